"""The Gluon kernel's parameters after its descriptors, in the order the launchers pass them, for each
variant (varlen, LSE, window: generator/gluon_sm90/emit.py's module docstring says what each holds).
"""

from __future__ import annotations

from ..config import KernelConfig

#: Kernel parameters after the descriptors (the launcher passes them in this order).
SCALAR_PARAMS = (
    "QD",
    "KD",
    "VD",
    "stride_db",
    "stride_dh",
    "H",
    "GROUP",
    "HKV",
    "SEQ_Q",
    "SEQ_K",
    "N_M_BLOCKS",
    "N_TILES",
    "sm_scale_log2",
)


#: Parameters after sm_scale_log2 of the varlen variant (emit.py's module docstring).
VARLEN_PARAMS = ("TILE_TABLE", "CU_Q", "CU_K", "O_PTR")


def tile_params(c: KernelConfig, varlen: bool = False) -> tuple[str, ...]:
    """The parameters after sm_scale_log2: the varlen variant's VARLEN_PARAMS; a q_order="balanced"
    kernel's tile table (int32, kernels/gluon_launch.tile_table); other kernels loop round robin and
    have none."""
    if varlen:
        return VARLEN_PARAMS
    return ("TILE_TABLE",) if c.q_order == "balanced" else ()


def kernel_params(
    c: KernelConfig, varlen: bool = False, lse: bool = False, window: bool = False, paged: bool = False
) -> tuple[str, ...]:
    """The parameters after the descriptors but CAUSAL (the LSE kernel's LSE beside the descales, as Triton's)."""
    first = SCALAR_PARAMS[:3] + (("LSE",) if lse else ()) + SCALAR_PARAMS[3:]
    twins = (("LSE_STRIDE",) if lse else ()) + (WINDOW_PARAMS if window else ()) + (PAGED_PARAMS if paged else ())
    return first + tile_params(c, varlen or paged) + twins


#: The window kernel's last parameters before CAUSAL (emit.py's module docstring).
WINDOW_PARAMS = ("WIN_L", "WIN_R")


#: The paged twin's last parameters before CAUSAL (emit.py's module docstring): the int32 page table, its row
#: stride and the page size in keys.
PAGED_PARAMS = ("PAGE_TABLE", "PAGE_STRIDE", "PAGE_SIZE")


def paged_error(c: KernelConfig) -> str | None:
    """Why the paged twin cannot run `c`, or None: it reads V from the cache as stored, (keys, dim) rows,
    so only a natural-V config (its producer transposes each V tile) reads it."""
    if c.v_layout != "natural":
        return f"the paged twin reads V as stored: it takes v_layout='natural', got v_layout={c.v_layout!r}"
    return None


#: Integer parameters Triton must not specialise (on == 1 or % 16): the schedule gains nothing from
#: it, and one compile then serves every shape (a trial, a test run, a new sequence length). The
#: ahead-of-time compile types them as plain i32, so it builds exactly the code a launch runs.
UNSPECIALISED = SCALAR_PARAMS[3:12]
