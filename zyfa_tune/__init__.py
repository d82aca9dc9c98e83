"""zyfa-tune: autotuned FP8/BF16 causal-prefill attention for NVIDIA Hopper.

    from zyfa_tune import flash_attn_func, quantize_fp8
"""

from zyfa_tune.api import explain, flash_attn_func
from zyfa_tune.generator import ConfigError, KernelConfig
from zyfa_tune.kernels.dispatch import set_databases, set_error_budget
from zyfa_tune.tuning.reference import attention_reference
from zyfa_tune.quantize import dequantize_fp8, hadamard_matrix, quantize_fp8

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "explain", "set_databases", "set_error_budget", "quantize_fp8", "dequantize_fp8",
           "hadamard_matrix", "attention_reference", "KernelConfig", "ConfigError", "__version__"]
