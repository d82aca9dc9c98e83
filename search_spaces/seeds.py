"""Named seed configs: known-good kernels a study measures before its sampler's own asks.

Each seed is a function (dtype, head_dim_qk, head_dim_v) -> KernelConfig whose fields are all read in
its body: the Gluon default of the head dims (`default_config(..., "gluon")`: 128-key blocks in a
3-stage K/V ring, or 64-key blocks in 2 stages for head_dim_v 256, two ping-ponging overlapped consumer
warpgroups, key-permuted V^T, balanced persistent tiles) with the fields that differ from it, head-dim
dependent ones computed there. Its docstring's first line says why it is a seed (timings on an H200
unless said otherwise). A seed raises ConfigError for head dims it is not built for.

`SEEDS` lists them in the order a study enqueues them, each with the head-dim pairs where it is a seed
(statically feasible; elsewhere the space skips it), and `loose` for the lean P seeds whose error
passes only a looser accuracy gate than the default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from zyfa_tune.generator import GLUON_HEAD_DIMS, ConfigError, KernelConfig
from zyfa_tune.generator.defaults import default_config

from .resources import gluon_infeasibility


def _gluon(dtype: str, head_dim_qk: int, head_dim_v: int, **fields) -> KernelConfig:
    """The Gluon default of these head dims with `fields` changed."""
    return default_config(dtype, head_dim_qk, head_dim_v, "gluon").replace(**fields)


def _first_fitting(seed: KernelConfig, shrinks: Iterable[dict]) -> KernelConfig:
    """`seed` with the first of `shrinks` (field changes, each tried on `seed`; `{}` for none) that the width
    allows (a valid config) and that fits (shared memory, registers: resources.gluon_infeasibility), so one
    seed derives its size from any head dims; where none fits, the last valid one (which the space skips)."""
    fallback = seed
    for changes in shrinks:
        try:
            fallback = seed.replace(**changes)
        except ConfigError:  # (such as o_through_p where head_dim_v is not a power of two)
            continue
        if gluon_infeasibility(fallback) is None:
            break
    return fallback


def gluon_default_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """The untuned Gluon schedule; its balanced tile order runs 1.04-1.05x round robin at 4K-16K (the same output)."""
    return _gluon(dtype, head_dim_qk, head_dim_v)


def gluon_wide_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """256-key blocks: 1.04-1.07x the best 128-key schedule at hd128.

    A 64 x 256 fp32 score tile leaves no registers for a P carried across steps: no intra-warpgroup
    overlap (the two consumer warpgroups overlap each other instead), no ping-pong, a Q ring of 2."""
    return _gluon(dtype, head_dim_qk, head_dim_v, block_n=256, num_stages=2, overlap=False, ping_pong=False, q_stages=2)


def gluon_lanes_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """The 256-key kernel with per-lane row sums (1.015x at hd128 8K / 16K) and its half-empty first block run
    as half a block (+3.2% / +1.6% at 4K / 8K, the same output)."""
    return _gluon(
        dtype,
        head_dim_qk,
        head_dim_v,
        block_n=256,
        num_stages=2,
        overlap=False,
        ping_pong=False,
        q_stages=2,
        lane_sums=True,
        half_block=True,
    )


def gluon_smem2_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """The overlapped 256-key kernel with P through two shared-memory tiles: 1.04-1.06x the plain 256-key kernel
    at hd128 8K / 16K, its halved first blocks +4.5% / +2.9% more at 4K / 8K.

    No register holds P while the next softmax runs (p_carry="smem2"), which is what lets a 256-key block
    overlap; the output tile lives in the first P tile."""
    return _gluon(
        dtype,
        head_dim_qk,
        head_dim_v,
        block_n=256,
        num_stages=2,
        ping_pong=False,
        q_stages=2,
        p_carry="smem2",
        lane_sums=True,
        half_block=True,
    )


def gluon_smem2_narrow_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """The two-P-tile overlap on 128-key blocks with ping-pong: it fits 192/128 (213 KB of shared memory, no
    spills at any producer split), where the 256-key one needs 255 KB."""
    return _gluon(
        dtype, head_dim_qk, head_dim_v, block_n=128, num_stages=3, p_carry="smem2", lane_sums=True, half_block=True
    )


def gluon_smem2_chunked_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """The 128-key two-P-tile kernel with its output stored in column chunks through the P tiles: at hd256 in a
    2-stage ring it fits (197 KB compiled), where an output tile of its own does not.

    o_through_p applies where the 64 x head_dim_v output tile does not fit one 128-key P tile and
    head_dim_v is a power of two (128, 256); elsewhere this is `gluon_smem2_narrow_config` where that fits.
    The K/V ring has 3 stages where they fit, else 2, else 64-key blocks without the halved first block
    (wide Q/K beside a V that is not a power of two: 176/176 and up)."""
    seed = _gluon(dtype, head_dim_qk, head_dim_v, block_n=128, p_carry="smem2", lane_sums=True, half_block=True)
    shrinks = [
        {"num_stages": stages, "block_n": block_n, "o_through_p": through_p, "half_block": block_n == 128}
        for block_n in (128, 64)  # (a halved first block needs blocks of 128 keys or more)
        for stages in (3, 2)
        for through_p in (True, False)
    ]
    return _first_fitting(seed, shrinks)


def gluon_packed_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """P carried packed as e4m3 between steps: 1.03-1.04x the float32 carry at hd128 and 1.02x at 192/128
    (B=2 S=8K), bitwise the same output."""
    return _gluon(dtype, head_dim_qk, head_dim_v, p_carry="e4m3")


def gluon_natural_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """V read as given, transposed by the producer warpgroup: one launch instead of a V^T copy plus the kernel,
    which wins where a call is launch-bound (short sequences) though it runs 0.80-0.90x its V^T twin at 8K-16K.
    """
    return _gluon(dtype, head_dim_qk, head_dim_v, v_layout="natural", v_permute=False, producer_regs=40)


def gluon_three_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """Three consumer warpgroups (FA3's 192-row tile): at hd64 0.94x / 0.97x FA3-fp8 at 8K / 16K where the Triton
    kernel runs 0.89x / 0.91x; at hd96, with O in a 64- and a 32-column part, 748 TFLOP/s at B=2 S=8K against
    the padded 256-key kernel's 697.

    Head dims 64 and 96 only: wider heads leave three consumers too few registers."""
    if (head_dim_qk, head_dim_v) == (96, 96):
        return _gluon(dtype, head_dim_qk, head_dim_v, block_m=192, o_split=True, p_carry="e4m3", late_rescale=True)
    if max(head_dim_qk, head_dim_v) > 64:
        raise ConfigError(
            f"three consumer warpgroups are seeded at head dims <= 64 and 96, not {head_dim_qk}/{head_dim_v}"
        )
    return _gluon(dtype, head_dim_qk, head_dim_v, block_m=192, ping_pong=False, rowsum="mma", skip_rescale=True)


def gluon_defer_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """Head dim 256, PV(j-1) issued with QK^T(j) and one wait per block (pv_defer), P carried packed: 1163
    TFLOP/s at B=2 S=8K against its float32 carry's 1138 and the Triton kernel's 851.

    Head dim 256 only."""
    if (head_dim_qk, head_dim_v) != (256, 256):
        raise ConfigError(f"the pv_defer seed is measured at head dim 256/256, not {head_dim_qk}/{head_dim_v}")
    return _gluon(
        dtype, head_dim_qk, head_dim_v, block_n=128, num_stages=2, overlap=False, pv_defer=True, p_carry="e4m3"
    )


# ---- lean P: ~1.35x the exact error (linear fold) or about FA3's; for a loose gate ------------------------


def gluon_lean_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """Lean P on the Gluon default (one FMA per score writes the e4m3 code of 2^x; row sum by an MMA against
    ones): 1.07-1.10x the best exact kernel at hd128 4K-16K, at ~1.35x the exact error."""
    return _gluon(dtype, head_dim_qk, head_dim_v, softmax="lean", rowsum="mma")


def gluon_lean_smem2_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """Lean P on the 256-key two-P-tile kernel, row sums from its decoded codes per lane, a saturating-FMA clamp:
    1.04-1.06x the best exact kernel at hd128 8K-32K and 1.08-1.15x FA3-fp8, at ~1.07x FA3's error.

    The code sums need no row-sum MMA (which cost the exact kernel of this structure 9-11%); the
    saturating clamp (an FFMA instead of an integer max) schedules into a shorter step (+0.8-4.4%)."""
    return _gluon(
        dtype,
        head_dim_qk,
        head_dim_v,
        block_n=256,
        num_stages=2,
        q_stages=2,
        p_carry="smem2",
        lane_sums=True,
        softmax="lean",
        rowsum="rounded",
        lean_clamp="sat",
        p_scale_log2=7,
        producer_regs=56,
        skip_rescale=True,
    )


def gluon_lean_f16_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """`gluon_lean_smem2_config` on f16 scores: 1.13-1.20x the float32-score kernel and 1.22-1.36x FA3-fp8 at hd128
    8K-32K, at the float32-score kernel's error.

    Probabilities at 2^8, not 2^7: lean's lowest codes then sit an octave further from the row maximum,
    which takes the error on inputs with outlier entries from 1.05x FA3's to 1.02x at the same speed."""
    return gluon_lean_smem2_config(dtype, head_dim_qk, head_dim_v).replace(qk_acc="f16", p_scale_log2=8)


def gluon_lean_f16_async_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """`gluon_lean_f16_config` with QK^T's wait behind PV(j-1)'s issue and a 24-register producer: 1.03-1.04x the
    synchronous kernel at hd128 8K-32K, the same error.

    The two go together: with the synchronous wait a 24-register producer runs 0.88x, with qk_async 56
    registers gain nothing."""
    return gluon_lean_f16_config(dtype, head_dim_qk, head_dim_v).replace(qk_async=True, producer_regs=24)


def gluon_lean_max_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """Lean P on f16 scores with the fold's line on each row's own maximum: 1.32-1.46x FA3-fp8 at hd128 8K-32K,
    1.34-1.39x at hd64, 1.17-1.27x at 192/128, 1.17-1.23x at hd256, each within 0.25% of FA3's error on
    Gaussian inputs.

    `gluon_lean_f16_async_config` with lean_ref="max", sized to fit shared memory: 256-key blocks up to
    hd128, 128-key blocks beyond, and where a Q ring of two does not fit one Q stage (hd160), with the output
    stored through the P tiles where that does not fit either (hd256); where O's width is not a power of two
    (no chunked store) and 128 keys do not fit (176/176 and up), 64-key blocks, sized the same way."""
    seed = _gluon(
        dtype,
        head_dim_qk,
        head_dim_v,
        num_stages=2,
        p_carry="smem2",
        lane_sums=True,
        softmax="lean",
        rowsum="rounded",
        lean_clamp="sat",
        skip_rescale=True,
        qk_acc="f16",
        qk_async=True,
        lean_ref="max",
    )
    first = 256 if head_dim_qk + head_dim_v <= 256 else 128
    shrinks = [
        {"block_n": block_n, **smaller}
        for block_n in (first, first // 2, first // 4)
        if block_n >= 64
        for smaller in ({"q_stages": 2}, {"q_stages": 1}, {"q_stages": 1, "o_through_p": True})
    ]
    return _first_fitting(seed, shrinks)


@dataclass(frozen=True)
class Seed:
    """A named seed, the head-dim pairs where it is one, and whether it needs a loose accuracy gate."""

    build: Callable[[str, int, int], KernelConfig]
    head_dims: tuple[tuple[int, int], ...]
    loose: bool = False

    @property
    def name(self) -> str:
        return self.build.__name__


_UP_TO_128 = ((64, 64), (96, 96), (128, 128))

#: The FP8 space's seeds, in the order a study enqueues them (after the Triton default).
SEEDS: tuple[Seed, ...] = (
    Seed(gluon_default_config, GLUON_HEAD_DIMS),
    Seed(gluon_wide_config, _UP_TO_128),
    Seed(gluon_defer_config, ((256, 256),)),
    Seed(gluon_natural_config, GLUON_HEAD_DIMS),
    Seed(gluon_three_config, ((64, 64), (96, 96))),
    Seed(gluon_packed_config, GLUON_HEAD_DIMS),
    Seed(gluon_lanes_config, _UP_TO_128),
    Seed(gluon_smem2_config, _UP_TO_128),
    Seed(gluon_smem2_narrow_config, _UP_TO_128 + ((192, 128),)),
    Seed(gluon_smem2_chunked_config, GLUON_HEAD_DIMS),
    Seed(gluon_lean_config, GLUON_HEAD_DIMS, loose=True),
    Seed(gluon_lean_smem2_config, _UP_TO_128, loose=True),
    Seed(gluon_lean_f16_config, _UP_TO_128, loose=True),
    Seed(gluon_lean_f16_async_config, _UP_TO_128, loose=True),
    Seed(gluon_lean_max_config, GLUON_HEAD_DIMS, loose=True),
)
