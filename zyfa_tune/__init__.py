"""zyfa-tune: autotuned FP8/BF16 causal-prefill attention for NVIDIA Hopper.

from zyfa_tune import attention              # bf16 / fp16 in: quantised and run on FP8 kernels
out = attention(q, k, v, causal=True)
from zyfa_tune import attention_varlen       # the same for packed sequences of different lengths

from zyfa_tune import flash_attn_func, quantize_fp8   # FP8 in, FlashAttention-3's interface
from zyfa_tune import flash_attn_varlen_func          # packed sequences of different lengths
from zyfa_tune import flash_attn_with_kvcache         # new queries over a paged KV cache
"""

from importlib.metadata import PackageNotFoundError, version

from zyfa_tune.api import explain, flash_attn_func
from zyfa_tune.attention import attention, attention_varlen, explain_attention
from zyfa_tune.generator import ConfigError, KernelConfig
from zyfa_tune.generator.recipe import Recipe
from zyfa_tune.kernels.dispatch import set_databases, set_error_budget
from zyfa_tune.kvcache import flash_attn_with_kvcache
from zyfa_tune.quantize import dequantize_fp8, hadamard_matrix, quantize_fp8, quantize_fp8_varlen
from zyfa_tune.tuning.reference import attention_reference, attention_reference_paged, attention_reference_varlen
from zyfa_tune.varlen import flash_attn_varlen_func

try:
    __version__ = version("zyfa-tune")
except PackageNotFoundError:  # run from a source tree that was not installed
    __version__ = "0+unknown"
__all__ = [
    "attention",
    "attention_varlen",
    "explain_attention",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "explain",
    "set_databases",
    "set_error_budget",
    "quantize_fp8",
    "quantize_fp8_varlen",
    "dequantize_fp8",
    "hadamard_matrix",
    "attention_reference",
    "attention_reference_varlen",
    "attention_reference_paged",
    "KernelConfig",
    "ConfigError",
    "Recipe",
    "__version__",
]
