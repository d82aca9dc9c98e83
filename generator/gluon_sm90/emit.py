"""Gluon backend: `KernelConfig` (backend="gluon") -> Python source of one warp-specialised FP8
causal-prefill kernel for sm_90a, written in Triton's Gluon dialect.

The emitted module is the device code (the modules device.py lists, copied verbatim), then the
config's schedule as module constants (validated ints and bools only, written as literals), then
the entry kernel, whose partition list and register split the emitter writes out for the config.
The source holds everything the kernel runs, so its hash identifies the kernel (database variant,
build cache), as for the Triton backend.

Kernel contract (see kernels/gluon_launch.py):
  (Dqk/D = head dims of Q, K / of V and O: Dqk a multiple of 16, D of 8, from 32 to 256
  (rules.gluon_head_dim_conflict); W = the width of one Q / K column part, qk_part_width: Dqk, 64 for
  192, 32 for 96, with Dqk not a multiple of 32 those of Dqk rounded up to one (80 -> 96: 32, 112 ->
  128: 128); Dp = D rounded up to a power of two, config.gluon_o_parts)
  desc_q: Q viewed (B*Sq, H*Dqk), block [BLOCK_M, W]; desc_k: K viewed (B*Sk, Hkv*Dqk), block
  [BLOCK_N, W]; where Dqk is not a multiple of 32 (config.gluon_qk_padded) Q viewed (B*Sq, H, Dqk),
  block [BLOCK_M, 1, W], and K (B*Sk, Hkv, Dqk), block [BLOCK_N, 1, W]: the columns of the last part
  past Dqk are TMA's zeros; desc_v: V^T viewed (B*Hkv*D, Skv), block [Dp, BLOCK_N], its keys permuted within
  32-key chunks when V_PERM (Skv = Sk padded to 32, padding zeros), else Skv = Sk; with
  v_layout="natural" V itself viewed (B*Sk, Hkv*D), block [BLOCK_N, Dp]; desc_o: O viewed
  (B, Sq, H*D) bf16, block [1, 64, D] (stores clipped per batch), or where Dp > D viewed
  (B, Sq, H, D), block [1, 64, 1, Dp] (clipped at D too); with o_split (D = 96) V^T blocks [64,
  BLOCK_N] and desc_vc [32, BLOCK_N] (rows 64.. of the head), O blocks [1, 64, 64] and desc_oc
  [1, 64, 32] (columns 64..) on the (B, Sq, H*D) view. QD/KD/VD: float32 descales
  indexed [b * stride_db + hkv * stride_dh], or None. Grid: min(#SMs, tiles) when PERSISTENT, else
  one program per tile; tiles = N_M_BLOCKS * B * H. Causal masking is bottom-right aligned.

The varlen variant (`emit(config, varlen=True)`, VARLEN) runs packed sequences: Q, K, V and O are the
packed tensors as one batch entry (B = 1; V^T: kernels/gluon_varlen's copy, each sequence from a 32-key
boundary), and after sm_scale_log2 come TILE_TABLE (int32: the ragged tile list, heaviest first,
kernels/gluon_varlen.ragged_tiles), CU_Q, CU_K (int32 cumulative lengths) and O_PTR (the output, for the
pointer stores of tiles on a sequence's end). N_M_BLOCKS is then the query blocks of the longest
sequence, N_TILES the table's entries (sequences x N_M_BLOCKS), SEQ_Q unused and SEQ_K the packed keys'
total (what sizes the loop's L2 head groups); descales are per (sequence, kv head). Only that variant has the four parameters: every other kernel compiles as before.
`emit(config, lse=True)` (either variant) also writes each row's float32 natural-log sum of exp(scores) into
LSE (after VD): (B, H, Sq) contiguous, varlen (H, total_q); LSE_STRIDE (after the tile parameters): Sq or total_q.
`emit(config, window=True)` (either variant, with or without lse) takes a sliding window: WIN_L, WIN_R (last
before CAUSAL, int32 >= 0: row r sees keys r + Sk - Sq - WIN_L .. r + Sk - Sq + WIN_R; 0 on the right when CAUSAL).
`emit(config, paged=True)` (varlen; natural V only) reads K and V from paged caches viewed as (pages * page size,
Hkv*D): PAGE_TABLE (int32, sequence b's row at b * PAGE_STRIDE), PAGE_SIZE (a multiple of BLOCK_N) last before
CAUSAL; key j of sequence b is cache row PAGE_TABLE[b, j // PAGE_SIZE] * PAGE_SIZE + j % PAGE_SIZE, CU_K its keys.
"""

from __future__ import annotations

from ..asm.exp2_poly import EXP2_CONSTRAINTS, exp2_asm
from ..asm.fence import ROW_SUM_FENCE_CONSTRAINTS, fence_barrier, p_fence_asm, p_fence_constraints, row_sum_fence_asm
from ..asm.lean import (
    CODE_SUM_CONSTRAINTS,
    E4M3_MAX,
    F16_MUFU_TOP,
    F16_SCORE_BOUND,
    LEAN_FLOOR_AT,
    LEAN_FLOOR_SLOPE,
    MAGIC,
    ONE_FMA_FOLDS,
    SAT_SCALE,
    code_sum_asm,
    f16_fold_asm,
    f16_mufu_asm,
    f16_mufu_constraints,
    f16_pack_asm,
    f16_reversed,
    fold_center,
    lean_tail_asm,
)
from ..asm.rescale import rescale_asm, rescale_constraints
from ..config import (
    GENERATOR_VERSION,
    KernelConfig,
    gluon_o_parts,
    gluon_qk_padded,
    gluon_qk_parts,
    gluon_registers,
    o_chunks,
    o_in_p_tile,
    p_tiles,
)
from ..emitted import EmittedKernel, emitted, kernel_name_of
from . import device
from .params import PAGED_PARAMS, UNSPECIALISED, WINDOW_PARAMS, kernel_params, paged_error

# (SCALAR_PARAMS, VARLEN_PARAMS and tile_params re-exported: the launchers and tests read them here)
from .params import SCALAR_PARAMS as SCALAR_PARAMS
from .params import VARLEN_PARAMS as VARLEN_PARAMS
from .params import tile_params as tile_params
from .trace import EVENTS, TraceBuffer, clock_asm

#: Warps of the entry kernel's default partition (consumer warpgroup 0).
NUM_WARPS = 4


def emit(
    config: KernelConfig,
    *,
    trace: TraceBuffer | None = None,
    varlen: bool = False,
    lse: bool = False,
    window: bool = False,
    paged: bool = False,
) -> EmittedKernel:
    """Emit the Gluon kernel source for `config` (deterministic; same config -> same bytes).
    trace: also stamp the SM clock at each consumer step's EVENTS into that buffer (CTA 0;
    generator/gluon_sm90/trace.py), a diagnostic twin of the kernel; None for the kernel itself.
    varlen: the packed-sequence variant (module docstring; `varlen_error` says which configs it takes).
    lse: also write the LSE (module docstring): a call option, not a config field, so a kernel's twin.
    window: take a sliding window's bounds (module docstring), the same way a twin: their values are runtime
    arguments, so one compile serves every window. paged: the varlen variant reading paged K / V caches."""
    if not isinstance(config, KernelConfig):
        raise TypeError(f"emit() takes a KernelConfig, got {type(config).__name__}")
    if config.backend != "gluon":
        raise ValueError(f"gluon_sm90.emit: config has backend={config.backend!r}")
    if trace is not None and not isinstance(trace, TraceBuffer):
        raise TypeError(f"emit(trace=...) takes a TraceBuffer, got {type(trace).__name__}")
    varlen = bool(varlen or paged)
    if (varlen and (why := varlen_error(config, paged))) or (paged and (why := paged_error(config))):
        raise ValueError(f"config: {why}")
    return emitted(
        config,
        _header(config)
        + device.source()
        + _constants(config, trace, varlen)
        + _entry(config, varlen, bool(lse), bool(window), bool(paged)),
        kernel_name_of(config),
    )


def varlen_error(config: KernelConfig, paged: bool = False) -> str | None:
    """Why the varlen variant (or its `paged` twin) cannot run `config`, or None. k_perm reads K in 16-row
    groups from a multiple of 16, which a packed sequence's first key is not (its twin without k_perm reads
    the same V^T) and a page's first key is (page sizes are multiples of 16)."""
    if config.k_perm and not paged:
        return "k_perm reads K in 16-key groups, which packed sequences do not start on; use k_perm=False"
    return None


def descriptor_blocks(config: KernelConfig) -> dict[str, tuple[str, list[int]]]:
    """Element type and TMA block of each descriptor argument, in kernel order (the launcher and the
    ahead-of-time compile build their descriptors from this one table)."""
    w, dv = qk_part_width(config), config.head_dim_v
    oa, oc = gluon_o_parts(config)
    bn, bn_b = key_parts(config)
    q_box = [q_box_rows(config), 1, w] if gluon_qk_padded(config) else [q_box_rows(config), w]
    blocks = {"desc_q": ("fp8", q_box), "desc_k": ("fp8", k_box(config, bn, w))}
    if bn_b:  # the second key part's K rows
        blocks["desc_kb"] = ("fp8", k_box(config, bn_b, w))
    blocks["desc_v"] = ("fp8", [bn, oa] if config.v_layout == "natural" else [oa, bn])
    if bn_b:  # the second key part's V^T columns
        blocks["desc_vb"] = ("fp8", [oa, bn_b])
    if oc:  # o_split: the second O part's V^T rows
        blocks["desc_vc"] = ("fp8", [oc, bn])
    # O's columns [0, oa), clipped per batch; a padded tile (oa > dv) also at dv, in a 4-D view; with
    # o_through_p in chunks of o_chunks' width
    blocks["desc_o"] = ("bf16", [1, 64, o_chunks(config)[0]] if oa <= dv else [1, 64, 1, oa])
    if oc:  # o_split: O's columns [oa, oa + oc)
        blocks["desc_oc"] = ("bf16", [1, 64, oc])
    return blocks


def k_box(config: KernelConfig, keys: int, width: int) -> list[int]:
    """The TMA block of `keys` K rows of `width` columns. k_perm: five dimensions (16-key groups, s, q,
    b, columns) over K's rows at strides (16, 2, 4, 1) rows (kernels/gluon_launch.k_view), so that tile
    row 16h + 8s + 2q + b holds key 16h + 4q + 2s + b: what v_permute relabels, made on K. Zero-padded
    Q / K (gluon_qk_padded): three, (rows, one head, columns), clipped at the head dim."""
    if config.k_perm:
        return [keys // 16, 2, 4, 2, width]
    return [keys, 1, width] if gluon_qk_padded(config) else [keys, width]


def key_parts(config: KernelConfig) -> tuple[int, int]:
    """Keys of a block's first and second part: tensor shapes must be powers of two, so a 192-key
    block is a 128-key and a 64-key part (two QK^T accumulators, two PV wgmmas); a 256-key block
    with pv_defer two 128-key parts (the second QK^T issued once PV(j-1) has freed its registers);
    else (block_n, 0)."""
    if config.block_n == 192:
        return 128, 64
    if config.block_n == 256 and config.pv_defer:
        return 128, 128
    return config.block_n, 0


def rescale_in_place(config: KernelConfig) -> bool:
    """O's rescale is inline PTX on its own registers (generator/asm/rescale.py): with skip_rescale,
    and for a 256-key pv_defer block, where a multiplied copy of O beside the scores spills."""
    return bool(config.skip_rescale) or (config.block_n == 256 and bool(config.pv_defer))


def q_box_rows(config: KernelConfig) -> int:
    """Rows of one Q TMA box: the tile's, or 64 (one per consumer) for 192 rows (boxes are powers of two)."""
    return 64 if config.block_m == 192 else config.block_m


def qk_part_width(config: KernelConfig) -> int:
    """Columns of one Q / K tile part (config.gluon_qk_parts): a 192- / 96-wide Q / K comes in three 64- /
    32-column parts, an 80-wide one zero-padded to three of 32."""
    return gluon_qk_parts(config)[0]


def descriptor_layout(dtype: str, block: list[int]):
    """The 128-byte-swizzled shared layout of a TMA block (what wgmma reads); one definition for
    the launcher's descriptors and the ahead-of-time compile's signature."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPE[dtype](gl))


def descriptor_type(dtype: str, block: list[int]) -> str:
    """The signature type Triton gives a host descriptor of this block (e.g. for triton.compile)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    stand_in = torch.empty(block, dtype=_TORCH_DTYPE[dtype](torch))
    strides = [int(s) for s in stand_in.stride()]
    return mangle_type(TensorDescriptor(stand_in, list(block), strides, list(block), descriptor_layout(dtype, block)))


_GL_DTYPE = {"fp8": lambda gl: gl.float8e4nv, "bf16": lambda gl: gl.bfloat16}
_TORCH_DTYPE = {"fp8": lambda torch: torch.float8_e4m3fn, "bf16": lambda torch: torch.bfloat16}


def _header(c: KernelConfig) -> str:
    return (
        f'"""zyfa-tune generated kernel (generator {GENERATOR_VERSION}, Gluon backend). Do not edit.\n\n'
        f"config: {c.to_json()}\n"
        '"""\n'
    )


def schedule_constants(c: KernelConfig, trace: TraceBuffer | None = None, varlen: bool = False) -> dict[str, object]:
    """The module constants the device code reads, each derived from the config (in emission order):
    validated ints, floats, bools and PTX built from validated fields, never text from a config."""
    consumer_regs, producer_regs = gluon_registers(c)
    consumers = int(c.block_m) // 64
    lean = c.softmax == "lean"
    values = [
        ("BLOCK_M", int(c.block_m)),
        ("BLOCK_N", int(c.block_n)),
        ("HEAD_D", int(c.head_dim_v)),
        ("HEAD_QK", int(c.head_dim_qk)),
        # O's accumulator columns (a power of two: padded, or with O_SPLIT the first of two parts, O_W + O_C;
        # without, O_C is the width of an unused stand-in) and the wgmmas of one PV issue
        ("O_W", gluon_o_parts(c)[0]),
        ("O_SPLIT", bool(c.o_split)),
        ("O_C", gluon_o_parts(c)[1] or 8),
        ("PV_GROUPS", (2 if key_parts(c)[1] else 1) * (2 if c.rowsum == "mma" else 1) + int(bool(c.o_split))),
        ("QK_PARTS", gluon_qk_parts(c)[1]),
        ("QK_W", qk_part_width(c)),
        ("Q_BOXES", int(c.block_m) // q_box_rows(c)),
        ("STAGES", int(c.num_stages)),
        ("Q_STAGES", int(c.q_stages)),
        ("NUM_CONSUMERS", consumers),
        ("OVERLAP", bool(c.overlap)),
        ("PINGPONG", bool(c.ping_pong)),
        ("HEAVY_FIRST", c.q_order == "heavy_first"),
        ("BALANCED", c.q_order == "balanced"),
        # packed sequences: the ragged tile loop, per-sequence rows, pointer stores on a sequence's end
        ("VARLEN", bool(varlen)),
        # the varlen loop's head groups: K and V of this many keys (l2_group_mib's bytes, e4m3) run side by
        # side. Only the varlen variant reads it: a rectangular kernel's groups are its launch-made table,
        # so its source stays its launch twins' (l2_group_mib is launch-only there)
        (
            "L2_GROUP_KEYS",
            (int((c if varlen else c.kernel_config()).l2_group_mib) << 20) // (c.head_dim_qk + c.head_dim_v),
        ),
        ("V_PERM", bool(c.v_permute)),
        ("K_PERM", bool(c.k_perm)),
        ("V_NATURAL", c.v_layout == "natural"),
        ("NAMED_TURNS", c.turn_barrier == "named"),
        ("PV_DEFER", bool(c.pv_defer)),
        ("BN_A", key_parts(c)[0]),
        ("BN_B", key_parts(c)[1]),
        ("SPLIT", bool(key_parts(c)[1])),
        ("P_OFFSET", float(int(c.p_scale_log2))),
        ("PACK_P", c.p_carry == "e4m3"),
        ("P_SMEM", p_tiles(c) > 0),
        ("K_AHEAD", p_tiles(c) > 0),
        # two P tiles per consumer (P(j) stored while PV(j-1) reads the other; published under QK^T(j+1))
        ("P_DOUBLE", p_tiles(c) == 2),
        ("O_IN_P", o_in_p_tile(c)),
        # the output's stores per tile: O_CHUNKS of O_CHUNK columns (o_through_p: through both P tiles)
        ("O_CHUNK", o_chunks(c)[0]),
        ("O_CHUNKS", o_chunks(c)[1]),
        # the P tile's swizzle (bytes): a row of BLOCK_N e4m3, up to the 128-byte maximum
        ("P_SWIZZLE", min(128, int(c.block_n))),
        ("LANE_SUMS", bool(c.lane_sums)),
        ("LATE_RESCALE", bool(c.late_rescale)),
        # a first block whose upper half no row sees runs as a step of BLOCK_N / 2 keys (plain schedule)
        ("HALF_BLOCK", bool(c.half_block)),
        ("CONSUMER_REGS", int(consumer_regs)),
        ("PRODUCER_REGS", int(producer_regs)),
        # qk_acc="f16": f16 scores, lean P folded two per instruction, Q's rows scaled by _q_headroom so that
        # E4M3_MAX * sum|q| * Q_HEADROOM <= 1 (generator/asm/lean.py)
        ("F16_S", c.qk_acc == "f16"),
        ("Q_HEADROOM", E4M3_MAX / F16_SCORE_BOUND),
        # qk_async: generator/ptx_pass.py drops the f16 QK^T's wait, so P(j-1)'s publication and O's rescale go
        # after QK^T(j)'s issue as in the float32-score step (without the pass they would wait for QK^T)
        ("QK_ASYNC", bool(c.qk_async)),
        ("F16_FOLD_ASM", f16_fold_asm(c.lean_fold, c.lean_floor) if c.qk_acc == "f16" else ""),
        # lean_floor: a second line for e4m3's subnormal codes (generator/asm/lean.py)
        ("LEAN_FLOOR", bool(c.lean_floor)),
        ("LEAN_FLOOR_SLOPE", LEAN_FLOOR_SLOPE),
        ("LEAN_FLOOR_AT", LEAN_FLOOR_AT),
        ("F16_PACK_ASM", f16_pack_asm() if c.qk_acc == "f16" else ""),
        # lean_mufu: that many of every four pairs of the f16 fold take 2^x from the MUFU instead
        ("LEAN_MUFU", int(c.lean_mufu)),
        ("F16_MUFU_ASM", f16_mufu_asm(int(c.lean_mufu), c.lean_fold, c.lean_floor) if c.lean_mufu else ""),
        ("F16_MUFU_CONSTRAINTS", f16_mufu_constraints(c.lean_fold, c.lean_floor)),
        ("F16_MUFU_TOP", F16_MUFU_TOP),
        # (f16 scores fold "corrected" on the one-FMA fold's row constant too: f16_fold_asm adds the correction,
        # on the reversed line u = 1 - t)
        ("F16_U", c.qk_acc == "f16" and f16_reversed(c.lean_fold)),
        ("LEAN", lean),
        ("ROWSUM_MMA", c.rowsum == "mma"),
        ("LEAN_FMA", lean and (c.lean_fold in ONE_FMA_FOLDS or c.qk_acc == "f16")),
        ("LEAN_CENTER", fold_center(c.lean_fold, c.lean_ref) if lean else 0.0),
        ("LEAN_MAGIC", MAGIC),
        # the row maximum on the one-FMA folds' 1/8 grid (b exact; measured better for the linear folds); the
        # corrected fold on f16 scores takes it as it is, so that the maximum's own code is exact
        ("LEAN_GRID", lean and c.lean_fold in ONE_FMA_FOLDS and c.lean_ref == "grid"),
        ("LEAN_SAT", lean and c.lean_clamp == "sat"),
        ("LEAN_SAT_SCALE", SAT_SCALE),
        # PTX from generator/asm/lean.py for validated enum values only (never text from a config)
        ("LEAN_ASM", lean_tail_asm(c.lean_fold, c.lean_clamp, c.lean_pack) if lean else ""),
        # lean P's row sum from its packed codes (rowsum="rounded"): generator/asm/lean.code_sum_asm
        ("CODE_SUMS", lean and c.rowsum == "rounded"),
        ("CODE_SUM_ASM", code_sum_asm() if lean and c.rowsum == "rounded" else ""),
        ("CODE_SUM_CONSTRAINTS", CODE_SUM_CONSTRAINTS),
        # 2^x of exp2_poly of every 8 scores on the FMA pipe (generator/asm/exp2_poly.py); ints only reach it
        ("EXP2_POLY", int(c.exp2_poly)),
        ("EXP2_ASM", exp2_asm(int(c.exp2_poly), int(c.exp2_poly_degree)) if c.exp2_poly else ""),
        ("EXP2_CONSTRAINTS", EXP2_CONSTRAINTS),
        # O's rescale skipped by warps whose maxima stayed (generator/asm/rescale.py): per thread, the
        # 64 x O_W accumulator is O_W / 2 registers
        # (in place, without the skip, also for a 256-key pv_defer block: rescale_in_place)
        *_rescale_constants(c),
        # ex2_fence (generator/asm/fence.py): one asm per consumer warpgroup (its own named barrier)
        *_fence_constants(c),
        # timeline stamps (generator/gluon_sm90/trace.py): a validated address and slot count only
        ("TRACE", trace is not None),
        ("TRACE_STEPS", trace.steps if trace else 0),
        ("TRACE_EVENTS", len(EVENTS)),
        ("TRACE_ASM", clock_asm(trace, consumers, after_value=False) if trace else ""),
        ("TRACE_AFTER_ASM", clock_asm(trace, consumers, after_value=True) if trace else ""),
        *((f"EV_{name.upper()}", i) for i, name in enumerate(EVENTS)),
    ]
    return dict(values)


def _constants(c: KernelConfig, trace: TraceBuffer | None = None, varlen: bool = False) -> str:
    lines = ["", "", "# ---- this kernel's schedule (its config, resolved)"]
    lines += [f"{name} = gl.constexpr({value!r})" for name, value in schedule_constants(c, trace, varlen).items()]
    lines += [
        "# host side: read by kernels/launch.py",
        f"NUM_WARPS = {NUM_WARPS}",
        f"PERSISTENT = {bool(c.persistent)!r}",
        f"KERNEL_NAME = {kernel_name_of(c)!r}",
        "",
    ]
    return "\n".join(lines) + "\n"


def _rescale_constants(c: KernelConfig) -> list[tuple[str, object]]:
    """O's in-place rescale asm (generator/asm/rescale.py) for each O part: per thread, a 64 x w
    accumulator is w / 2 registers; "" where O is rescaled by a multiply (or has no second part)."""
    out: list[tuple[str, object]] = [("RESCALE_IN_PLACE", rescale_in_place(c))]
    for name, w in zip(("", "_C"), gluon_o_parts(c)):
        n = int(w) // 2
        on = rescale_in_place(c) and n > 0
        out += [
            (f"RESCALE{name}_PACK", n or 1),
            (f"RESCALE{name}_ASM", rescale_asm(n, skip=c.skip_rescale) if on else ""),
            (f"RESCALE{name}_CONSTRAINTS", rescale_constraints(n) if on else ""),
        ]
    return out


def _fence_constants(c: KernelConfig) -> list[tuple[str, object]]:
    """ex2_fence's asm, indexed by consumer warpgroup: on the row sums (rowsum="fp32"), or on the
    probabilities of each key part, A and B (rowsum="mma"); "" where the kernel has no such fence."""
    none = ("",) * 3
    row_sums = c.ex2_fence and c.rowsum == "fp32"
    out: list[tuple[str, object]] = [
        ("ROW_SUM_FENCE_ASM", tuple(row_sum_fence_asm(fence_barrier(k)) for k in range(3)) if row_sums else none),
        ("ROW_SUM_FENCE_CONSTRAINTS", ROW_SUM_FENCE_CONSTRAINTS),
    ]
    for part, keys in zip("AB", key_parts(c)):
        n = int(keys) // 2  # float32 probabilities per thread: 64 rows x keys over 128 threads
        on = c.ex2_fence and c.rowsum == "mma" and n > 0
        out += [
            (f"P_FENCE_{part}_ASM", tuple(p_fence_asm(n, fence_barrier(k)) for k in range(3)) if on else none),
            (f"P_FENCE_{part}_CONSTRAINTS", p_fence_constraints(n) if on else ""),
        ]
    return out


def _consumer_args(cid: int, c: KernelConfig, lse: bool = False, window: bool = False) -> str:
    # ex2_fence goes in as a literal (a validated bool), not as a module constant, so that the
    # schedule constants of every other config stay exactly as they were
    ones = "ones_bufs" if c.rowsum == "mma" else "None"
    onesb = "onesb_bufs" if c.rowsum == "mma" and key_parts(c)[1] else ones
    tail = (", LSE, LSE_STRIDE" if lse else ", None, 0" if window else "") + (", WIN_L, WIN_R" if window else "")
    return (
        f"({cid}, desc_o, desc_oc, q_bufs, k_bufs, v_bufs, vc_bufs, o_bufs, oc_bufs, q_ready, q_empty,\n"
        "                    k_ready, k_empty, v_ready, v_empty, turn_bars, QD, KD, VD, stride_db, stride_dh,\n"
        "                    sm_scale_log2, H, GROUP, SEQ_Q, SEQ_K,\n"
        "                    N_M_BLOCKS, N_TILES, TILE_TABLE, BLOCK_M, BLOCK_N, HEAD_D, STAGES, Q_STAGES, NUM_CONSUMERS,\n"
        "                    CAUSAL, HEAVY_FIRST, OVERLAP, PINGPONG, V_PERM, P_OFFSET, "
        f"{bool(c.ex2_fence)!r}, LEAN, {ones}, QK_PARTS,\n"
        f"                    kb_bufs, vb_bufs, {onesb}, p_bufs, CU_Q, CU_K, O_PTR{tail})"
    )


_PRODUCER_ARGS = (
    "(desc_q, desc_k, desc_v, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty,\n"
    "                    v_ready, v_empty, H, GROUP, HKV, SEQ_Q, SEQ_K, N_M_BLOCKS, N_TILES, TILE_TABLE, BLOCK_M,\n"
    "                    BLOCK_N, HEAD_D, STAGES, Q_STAGES, CAUSAL, HEAVY_FIRST, HEAD_QK, QK_PARTS,\n"
    "                    v_raw, v_raw_ready, desc_kb, desc_vb, kb_bufs, vb_bufs, desc_vc, vc_bufs, CU_Q, CU_K)"
)


def _ones_lines(c: KernelConfig) -> list[str]:
    """The row-sum wgmma (rowsum="mma") reads an (8, BLOCK_N) tile of ones per consumer warpgroup
    (with 192-key blocks one of 8 x 128 and one of 8 x 64)."""
    if c.rowsum != "mma":
        return []
    lines = [
        "    ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, BN_A], dtype)",
        "    ones_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, 8, BN_A], ones_layout)",
    ]
    if key_parts(c)[1]:
        lines += [
            "    onesb_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, BN_B], dtype)",
            "    onesb_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, 8, BN_B], onesb_layout)",
        ]
    return lines


def _p_lines(c: KernelConfig) -> list[str]:
    """p_carry="smem" / "smem2": each consumer warpgroup's one or two (64, BLOCK_N) e4m3 P tiles, the PV
    wgmma's A operand."""
    if not p_tiles(c):
        return []
    tiles = "2 * NUM_CONSUMERS" if p_tiles(c) == 2 else "NUM_CONSUMERS"
    return [
        "    p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=P_SWIZZLE, element_bitwidth=8,",
        "                                                  rank=2)",
        f"    p_bufs = gl.allocate_shared_memory(dtype, [{tiles}, 64, BLOCK_N], p_layout)",
    ]


def _k_lines(c: KernelConfig) -> list[str]:
    """The K ring (with 192-key blocks a 128-row and a 64-row ring, one per key part). k_perm and zero-padded
    Q / K: the tiles keep the 2-D layout wgmma reads (the same swizzle as the 5-D / 3-D box that fills them:
    its rows are QK_W wide), not the descriptor's."""
    rings = [("k", "BN_A", "desc_k")] + ([("kb", "BN_B", "desc_kb")] if key_parts(c)[1] else [])
    lines = []
    for name, keys, desc in rings:
        own = c.k_perm or gluon_qk_padded(c)
        layout = f"gl.NVMMASharedLayout.get_default_for([{keys}, QK_W], dtype)" if own else f"{desc}.layout"
        lines.append(f"    {name}_bufs = gl.allocate_shared_memory(dtype, [STAGES * QK_PARTS, {keys}, QK_W], {layout})")
    return lines


def _q_layout(c: KernelConfig) -> str:
    """The Q ring's layout: the descriptor's, or for zero-padded Q / K the 2-D one wgmma reads (the 3-D box's
    swizzle)."""
    return (
        "gl.NVMMASharedLayout.get_default_for([BLOCK_M // Q_BOXES, QK_W], dtype)"
        if gluon_qk_padded(c)
        else "desc_q.layout"
    )


def _stand_ins(c: KernelConfig, varlen: bool = False) -> list[str]:
    """Names the partitions take that this kernel has no buffers or parameters for (never touched under
    its constants; aliases allocate nothing, so every other kernel keeps its shared-memory layout)."""
    out = [] if c.v_layout == "natural" else ["    v_raw = v_bufs", "    v_raw_ready = v_ready"]
    if not varlen:
        out += ["    CU_Q = N_TILES", "    CU_K = N_TILES", "    O_PTR = N_TILES"]
        if c.q_order != "balanced":
            out.append("    TILE_TABLE = N_TILES")
    if not p_tiles(c):
        out.append("    p_bufs = o_bufs")
    if not key_parts(c)[1]:
        out += ["    desc_kb = desc_k", "    desc_vb = desc_v", "    kb_bufs = k_bufs", "    vb_bufs = v_bufs"]
    if not c.o_split:
        out += ["    desc_vc = desc_v", "    vc_bufs = v_bufs", "    desc_oc = desc_o", "    oc_bufs = o_bufs"]
    return out


def _v_lines(c: KernelConfig) -> list[str]:
    """The V^T ring (with 192-key blocks one per key part); with v_layout="natural" also the two
    (BLOCK_N, D) slots V is loaded into and their barriers (the producer transposes it into the ring).
    What a kernel lacks, `_stand_ins` aliases."""
    if c.v_layout != "natural":
        lines = ["    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, O_W, BN_A], desc_v.layout)"]
        if key_parts(c)[1]:
            lines.append("    vb_bufs = gl.allocate_shared_memory(dtype, [STAGES, O_W, BN_B], desc_vb.layout)")
        if c.o_split:
            lines.append("    vc_bufs = gl.allocate_shared_memory(dtype, [STAGES, O_C, BN_A], desc_vc.layout)")
        return lines
    return [
        "    vt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([O_W, BLOCK_N], dtype)",
        "    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, O_W, BLOCK_N], vt_layout)",
        "    v_raw = gl.allocate_shared_memory(dtype, [2, BLOCK_N, O_W], desc_v.layout)",
        "    v_raw_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())",
        "    mbarrier.init(v_raw_ready.index(0), count=1)",
        "    mbarrier.init(v_raw_ready.index(1), count=1)",
    ]


def _entry(c: KernelConfig, varlen: bool = False, lse: bool = False, window: bool = False, paged: bool = False) -> str:
    consumers = c.block_m // 64
    partitions = [f"        (_consumer, {_consumer_args(i, c, lse, window)})," for i in range(consumers)]
    params = kernel_params(c, varlen, lse, window, paged)
    split = params.index("GROUP") + 1
    unspecialised = UNSPECIALISED + (("LSE_STRIDE",) if lse else ()) + (WINDOW_PARAMS if window else ())
    unspecialised += PAGED_PARAMS[1:] if paged else ()
    bounds = ", WIN_L, WIN_R" if window else ", None, None" if paged else ""
    producer = _PRODUCER_ARGS[:-1] + bounds + (", PAGE_TABLE, PAGE_STRIDE, PAGE_SIZE)" if paged else ")")
    partitions.append(f"        (_producer, {producer}),")
    # the default partition is consumer 0; workers: the other consumers (4 warps each), the producer
    # (1 warp; a warpgroup when it transposes V: the register split counts it as one either way)
    warps = "[" + "4, " * (consumers - 1) + ("4]" if c.v_layout == "natural" else "1]")
    regs = "[" + "CONSUMER_REGS, " * (consumers - 1) + "PRODUCER_REGS]"
    return "\n".join(
        [
            "",
            f"@gluon.jit(do_not_specialize={unspecialised!r})",
            f"def {kernel_name_of(c)}({', '.join(descriptor_blocks(c))},",
            f"                  {', '.join(params[:split])},",
            f"                  {', '.join(params[split:])}, CAUSAL: gl.constexpr):",
            "    dtype: gl.constexpr = gl.float8e4nv",
            "    q_bufs = gl.allocate_shared_memory(dtype, [Q_STAGES * QK_PARTS * Q_BOXES, BLOCK_M // Q_BOXES, QK_W],",
            f"                                       {_q_layout(c)})",
            *_k_lines(c),
            *_v_lines(c),
            "    o_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, O_CHUNK], gl.bfloat16)",
            *(
                ["    o_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_CONSUMERS, 64, O_W], o_layout)"]
                if not o_in_p_tile(c)
                else []
            ),
            *(
                [
                    "    oc_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, O_C], gl.bfloat16)",
                    "    oc_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_CONSUMERS, 64, O_C], oc_layout)",
                ]
                if c.o_split
                else []
            ),
            *_ones_lines(c),
            *_p_lines(c),
            *(
                [
                    f"    o_bufs = p_bufs._reinterpret(gl.bfloat16, [{'2 * ' if c.o_through_p else ''}NUM_CONSUMERS, 64, "
                    "O_CHUNK], o_layout)"
                ]
                if o_in_p_tile(c)
                else []
            ),
            "    q_ready = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())",
            "    q_empty = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())",
            "    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())",
            "    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())",
            "    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())",
            "    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())",
            "    turn_bars = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())",
            *_stand_ins(c, varlen),
            "    for i in gl.static_range(Q_STAGES):",
            "        mbarrier.init(q_ready.index(i), count=1)",
            "        mbarrier.init(q_empty.index(i), count=NUM_CONSUMERS)",
            "    for i in gl.static_range(STAGES):",
            "        mbarrier.init(k_ready.index(i), count=1)",
            "        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)",
            "        mbarrier.init(v_ready.index(i), count=1)",
            "        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)",
            "    for i in gl.static_range(NUM_CONSUMERS):",
            "        mbarrier.init(turn_bars.index(i), count=1)",
            "    gl.warp_specialize([",
            *partitions,
            f"    ], {warps}, {regs})",
            "",
        ]
    )
