"""Safe default configs: what runs when no tuned entry matches (and the tuner's baseline).

Chosen from sweeps on the H200 (docs/PERF.md, 2026-11-30): TMA loads everywhere; for FP8 a
(dim, keys) copy of V so that the P@V wgmma reads V K-major, and 64-row programs of one warpgroup
(two or three programs share an SM, which overlaps one's softmax with another's MMAs).

The Gluon backend's default is the schedule the Gluon spike measured best (docs/BACKENDS.md):
two ping-ponging consumer warpgroups with intra-warpgroup overlap, 128-key blocks in a 3-stage
K/V ring, key-permuted V^T, persistent tiles on the launcher's balanced schedule (session 7: +4-5%
over round robin at 4K-16K, bitwise the same output), producer warp at 24 registers.
"""

from __future__ import annotations

from typing import Iterable

from .config import ConfigError, KernelConfig, o_through_p_conflict


def default_config(dtype: str, head_dim_qk: int, head_dim_v: int, backend: str = "triton") -> KernelConfig:
    """A config that compiles without spills and fits shared memory for this head-dim pair.
    KernelConfig's own defaults are the FP8 head-dim-128 default. backend="gluon" raises
    ConfigError for what the Gluon backend does not implement (bf16, head-dim pairs outside
    GLUON_HEAD_DIMS)."""
    if backend == "gluon":  # head_dim_v 256: a 64 x 256 fp32 accumulator leaves registers for 64-key blocks
        wide = head_dim_v > 128
        return KernelConfig(backend="gluon", dtype=dtype, head_dim_qk=head_dim_qk, head_dim_v=head_dim_v,
                            block_m=128, block_n=64 if wide else 128, num_stages=2 if wide else 3,
                            q_order="balanced", p_scale_log2=8)
    big = max(head_dim_qk, head_dim_v) > 128
    dims = dict(head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, block_n=64 if big else 128)
    if dtype == "fp8":  # query blocks in launch order: every fp8 study so far preferred it (1.02-1.23x)
        return KernelConfig(dtype="fp8", q_order="forward", **dims)
    return KernelConfig(dtype="bf16", block_m=128, num_warps=8, num_stages=2, p_scale_log2=0,
                        v_layout="natural", **dims)


def gluon_wide_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """The Gluon kernel with 256-key blocks: a 64 x 256 fp32 score tile leaves no registers for a P
    carried across steps, so no intra-warpgroup overlap (two consumer warpgroups overlap each other
    instead), no ping-pong, a 2-stage K/V ring, Q ring of 2. At head dim 128 the fastest exact kernel
    measured (docs/PERF.md, session 4: 1.04-1.07x the study's best 128-key schedule); a seed of the
    FP8 space. ConfigError where Gluon lacks the head dims."""
    return default_config(dtype, head_dim_qk, head_dim_v, "gluon").replace(
        block_n=256, num_stages=2, overlap=False, ping_pong=False, q_stages=2)


def gluon_lanes_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """The 256-key kernel keeping its row sums per lane (lane_sums: the quad of lanes sharing a row add
    theirs once per tile, not every step): 1.015-1.016x the 256-key kernel at hd128 8K / 16K (B=2 / 1,
    H=32; docs/PERF.md, session 10); and running a first block whose upper half no row sees as half a
    block (half_block: +3.2% / +1.6% at 4K / 8K, bitwise the same output; session 15). A seed of the FP8
    space (the untuned FP8 kernel at head dim 128 in sessions 10-16)."""
    return gluon_wide_config(dtype, head_dim_qk, head_dim_v).replace(lane_sums=True, half_block=True)


def gluon_smem2_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """The 256-key kernel with intra-warpgroup overlap (PV(j-1) under softmax(j)), which fits the
    registers because P goes through two shared-memory tiles per consumer (p_carry="smem2": P(j) stored
    as the softmax makes it, published under QK^T(j+1); the output tile lives in the first P tile):
    at hd128 1.04-1.06x the 256-key plain kernel at 8K / 16K (docs/PERF.md, session 16); with a first
    block whose upper half no row sees computed on its lower half (half_block) +4.5% / +2.9% more at
    4K / 8K (session 17). A seed of the FP8 space."""
    return gluon_wide_config(dtype, head_dim_qk, head_dim_v).replace(overlap=True, p_carry="smem2", lane_sums=True,
                                                                     half_block=True)


def gluon_smem2_narrow_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """gluon_smem2_config at 128-key blocks in a 3-stage K/V ring with ping-pong: where two P tiles
    beside 256-key K/V stages exceed shared memory (192/128: 255 KB), the 128-key ones fit (213 KB)
    and compile without spills at every producer split (CPU, session 18). A seed of the FP8 space, so
    that head dims whose 256-key overlap cannot fit still measure the overlap with P in shared memory."""
    return gluon_smem2_config(dtype, head_dim_qk, head_dim_v).replace(block_n=128, num_stages=3, q_stages=1,
                                                                      ping_pong=True)


def gluon_smem2_chunked_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """gluon_smem2_narrow_config with the output stored in column chunks through the two P tiles
    (o_through_p) where the output tile does not fit one: at hd256, in a 2-stage ring (a third 128-key
    stage is 64 KB more), what brings the 128-key overlap with P in shared memory within the 227 KB
    (197 KB compiled, from 263 estimated; session 19); at 192/128 the narrow seed's 3 stages with 32 KB
    freed. Where o_through_p does not apply, the narrow seed itself (so no extra seed). A seed of the
    FP8 space."""
    narrow = gluon_smem2_narrow_config(dtype, head_dim_qk, head_dim_v)
    if o_through_p_conflict(vars(narrow)):
        return narrow
    return narrow.replace(num_stages=2 if head_dim_qk + head_dim_v > 320 else narrow.num_stages, o_through_p=True)


def gluon_lean_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """The Gluon default schedule with lean P (softmax="lean": one FMA per score writes the e4m3 code of
    2^x, no exponential; its rounded row sum from an MMA against ones): 1.07-1.10x the best exact
    kernel at hd128 4K-16K and 1.02-1.04x FA3, at ~1.35x the exact error (docs/PERF.md, session 15). A
    seed of studies whose accuracy gate or Pareto front admits that error (`SearchSpace.loose_seeds`)."""
    return default_config(dtype, head_dim_qk, head_dim_v, "gluon").replace(softmax="lean", rowsum="mma")


def gluon_lean_smem2_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """Lean P on the 256-key kernel with P through two shared-memory tiles, its rounded row sum from its
    own codes, decoded per lane (rowsum="rounded", lane_sums: no row-sum MMA, which cost the exact
    kernel of that structure 9-11%), with ping-pong and the rescale skip, its codes clamped by a saturating
    FMA (lean_clamp="sat": an FFMA instead of an integer max per score, which ptxas schedules into a shorter
    step, +0.8-4.4% at 8K-32K, docs/PERF.md session 26): the fastest hd128 kernel measured, 1.04-1.06x
    the best exact one at 8K-32K and 1.08-1.15x FA3-fp8, at ~1.07x FA3's error (native quantisation). A
    seed of studies whose gate admits that error, like `gluon_lean_config`."""
    return gluon_smem2_config(dtype, head_dim_qk, head_dim_v).replace(
        softmax="lean", rowsum="rounded", half_block=False, ping_pong=True, producer_regs=56, skip_rescale=True,
        p_scale_log2=7, lean_clamp="sat")


def gluon_lean_f16_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """`gluon_lean_smem2_config` on f16 scores (qk_acc="f16": the row maximum, the fold and the pack on
    pairs of scores, Q's rows scaled into f16's range in the kernel): 1.13-1.20x the float32-score kernel
    and 1.22-1.36x FA3-fp8 at hd128 8K-32K, at the float32-score kernel's error on Gaussian inputs (1.07x
    FA3's; docs/PERF.md, sessions 28, 31).
    Probabilities at 2^8, not 2^7: lean's lowest codes then sit an octave further from the row maximum, which
    takes its error on entry outliers from 1.05x FA3's to 1.02x at the same speed (session 31; safe since the
    row maximum's code is bounded, session 30). A seed of studies whose gate admits lean P's error."""
    return gluon_lean_smem2_config(dtype, head_dim_qk, head_dim_v).replace(qk_acc="f16", p_scale_log2=8)


def gluon_lean_f16_async_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """`gluon_lean_f16_config` with QK^T's wait behind PV(j-1)'s issue (qk_async, generator/ptx_pass.py) and a
    24-register producer: 1.03-1.04x the synchronous seed at hd128 8K-32K (1.31x / 1.35x / 1.44x FA3-fp8, its
    error unchanged; docs/PERF.md, session 35). The two go together: with the synchronous wait a 24-register
    producer runs 0.88x, with qk_async 56 registers gain nothing. A seed of studies whose gate admits lean P."""
    return gluon_lean_f16_config(dtype, head_dim_qk, head_dim_v).replace(qk_async=True, producer_regs=24)


def gluon_lean_max_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """`gluon_lean_f16_async_config` with the fold's line on each row's own maximum (lean_ref="max"), sized to
    fit shared memory: 256-key blocks up to hd128, 128-key blocks at 192/128, and at hd256 one Q stage with the
    output stored through the P tiles (o_through_p). H200, one process with FA3-fp8, V K-major and balanced
    (its k_perm twin runs, kernels.launch.for_v_layout; docs/PERF.md session 50): 1.32-1.46x FA3-fp8 at hd128
    8K-32K, 1.34-1.39x at hd64, 1.17-1.27x at 192/128, 1.17-1.23x at hd256, each within 0.25% of FA3's error on
    Gaussian inputs (with lean_mufu=1: 1.10-1.31x at 0.99x its error). A seed of studies whose gate admits
    lean P (`SearchSpace.loose_seeds`)."""
    cfg = gluon_lean_f16_async_config(dtype, head_dim_qk, head_dim_v).replace(lean_ref="max")
    if head_dim_qk + head_dim_v > 256:
        cfg = cfg.replace(block_n=128)
    if head_dim_qk + head_dim_v > 384:
        cfg = cfg.replace(q_stages=1, o_through_p=True)
    return cfg


def gluon_packed_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """The Gluon default schedule carrying P packed as e4m3 from one step to the next
    (p_carry="e4m3", a quarter of the float32 carry's registers): at 128-key blocks with overlap and
    ping-pong 1.03-1.04x its float32 twin at head dim 128 and 1.02x at 192/128 (B=2 S=8K; docs/PERF.md,
    session 8), bitwise the same output; a seed, so that every study measures it beside the default."""
    return default_config(dtype, head_dim_qk, head_dim_v, "gluon").replace(p_carry="e4m3")


def gluon_natural_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """The Gluon default schedule reading V as given (the producer warpgroup transposes each V tile
    into the V^T ring): one launch per call instead of a V^T copy plus the kernel. 10-20% slower
    than its V^T twin at 8K-16K (docs/PERF.md, session 5), but where a call is launch-bound (short
    sequences) the second launch costs more than that; a seed so that every study measures it and
    the database picks it per shape."""
    return default_config(dtype, head_dim_qk, head_dim_v, "gluon").replace(
        v_layout="natural", v_permute=False, producer_regs=40)


def gluon_three_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """Three consumer warpgroups (192 query rows per tile, FA3's head-dim-64 tile), no ping-pong,
    row sum by MMA, rescale skipped where no row maximum moved: at FP8 head dim 64 0.94x / 0.97x
    FA3-fp8 at 8K / 16K where the shipped Triton kernel is 0.89x / 0.91x (docs/PERF.md, session 6).
    At head dim 96 (FA3's hd96 tile is 192 x 128 too) with O in a 64- and a 32-column part (o_split),
    ping-pong, P carried packed and O rescaled after the PV wait: 748.4 TFLOP/s at B=2 S=8K against
    the padded 256-key kernel's 697.0 and FA3-fp8's 813.4 (docs/PERF.md, session 13).
    Only for head dims <= 64 and 96: wider heads leave three consumers too few registers."""
    if (head_dim_qk, head_dim_v) == (96, 96):
        return default_config(dtype, head_dim_qk, head_dim_v, "gluon").replace(
            block_m=192, o_split=True, p_carry="e4m3", late_rescale=True)
    if max(head_dim_qk, head_dim_v) > 64:
        raise ConfigError(f"three consumer warpgroups are seeded at head dims <= 64 and 96, not "
                          f"{head_dim_qk}/{head_dim_v}")
    return default_config(dtype, head_dim_qk, head_dim_v, "gluon").replace(
        block_m=192, ping_pong=False, rowsum="mma", skip_rescale=True)


def gluon_defer_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """Head dim 256: two ping-ponging consumer warpgroups over 128-key blocks without overlap, each
    step issuing PV(j-1) with QK^T(j) and waiting once (pv_defer): 988.8 TFLOP/s at B=2 S=8K against
    the Triton kernel's 851.4 and FA3-fp8's 1182.5 (session 6, round robin); on the balanced tile
    schedule 1119.9 against FA3's 1224.7 (docs/PERF.md, session 7); with P carried packed
    (p_carry="e4m3") 1163.0 against its float32 twin's 1137.7 and FA3's 1235.5 (session 8). Only for
    head dim 256."""
    if (head_dim_qk, head_dim_v) != (256, 256):
        raise ConfigError(f"the pv_defer seed is measured at head dim 256/256, not {head_dim_qk}/{head_dim_v}")
    return default_config(dtype, head_dim_qk, head_dim_v, "gluon").replace(block_n=128, overlap=False, pv_defer=True,
                                                                           p_carry="e4m3")


def fallback_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """What `flash_attn_func` runs where no tuned entry applies (the untuned kernel): at FP8 head dim
    128 the overlapped Gluon 256-key kernel with P through two shared-memory tiles
    (gluon_smem2_config: 0.99x / 1.01x / 1.00x FA3-fp8 at 4K / 8K / 16K; 1.04x / 1.07x at 4K / 8K
    the plain 256-key kernel gluon_lanes_config, the fallback of sessions 10-16; docs/PERF.md,
    session 17), else `default_config`. Head dims other than 128 keep the Triton default until a
    Gluon config is measured faster there untuned."""
    if dtype == "fp8" and (head_dim_qk, head_dim_v) == (128, 128):
        return gluon_smem2_config(dtype, head_dim_qk, head_dim_v)
    return default_config(dtype, head_dim_qk, head_dim_v)


def config_with(dtype: str, head_dim_qk: int, head_dim_v: int, changes: dict) -> KernelConfig:
    """The default config of these head dims (of the backend `changes` names, if any) with `changes`
    applied; ConfigError names a bad field. What `--set` / `--ours key=val,...` mean."""
    base = default_config(dtype, head_dim_qk, head_dim_v, changes.get("backend", "triton"))
    return KernelConfig.from_dict({**base.to_dict(), **changes})


def parse_value(text: str) -> int | bool | str:
    """A command-line field value: an integer, true / false, or the text itself."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_changes(items: Iterable[str], what: str) -> dict[str, int | bool | str]:
    """Command-line `key=value` items (one per item, or comma-separated within one) -> config field
    changes for `config_with`; `what` (the option) names a malformed item."""
    out: dict[str, int | bool | str] = {}
    for item in (part.strip() for text in items for part in text.split(",")):
        if not item:
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{what}: expected key=value, got {item!r}")
        out[key.strip()] = parse_value(val)
    return out
