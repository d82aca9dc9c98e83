"""Static feasibility: why a config cannot compile to a usable sm_90a kernel, from its shape alone.

`feasible()` prunes before compiling, after FlashAttention-4's SM90 config search: wgmma shape
rules, a shared-memory estimate and a register estimate, both calibrated against
`generator.build.compile_for_target` (Triton 3.6, sm_90a; tables in tests/test_search_spaces.py).
The resource estimates are deliberately optimistic: they never rejected a config that compiles
within 227 KiB of shared memory without spills; a compile-time check catches the few that pass
here and still fail. The wgmma rule "64 query rows per warpgroup" does prune configs that compile
(block_m=64 on 8 warps), because they measured 1.6-3x slower (see `static_infeasibility`).
Limits come from the backend's target (`generator.HOPPER`).
"""

from __future__ import annotations

from zyfa_tune.generator import (
    HOPPER,
    KernelConfig,
    chunks_of,
    gluon_o_parts,
    gluon_qk_parts,
    gluon_registers,
    o_in_p_tile,
    p_tiles,
)

#: The target's largest dynamic shared memory per block (227 KiB), under the name the calibration tests use.
SMEM_LIMIT = HOPPER.shared_memory_bytes


def _elem_bytes(dtype: str) -> int:
    return 1 if dtype == "fp8" else 2


#: Shared memory beyond the tiles with TMA loads: mbarriers and the 1024-byte alignment of the
#: swizzled TMA buffers (measured +32..+1024 B beyond the tiles).
TMA_SMEM_MARGIN = 1024


def loaded_widths(c: KernelConfig) -> tuple[int, int]:
    """Columns of Q/K and of V the Triton kernel loads and multiplies: its chunks' widths, which exceed
    the head dim where a last chunk overlaps the one before (generator.head_chunks)."""
    qk, v = chunks_of(c)
    return sum(w for _, w in qk), sum(w for _, w in v)


def smem_estimate(c: KernelConfig) -> int:
    """Shared memory (bytes) the compiled kernel needs, calibrated against compile_for_target.

    Q tile (block_m x head_dim_qk) + num_stages buffers of the K tile (block_n x head_dim_qk) and of
    the V tile (block_n x head_dim_v) + the rowsum="mma" ones tile (block_n x 16) + TMA barriers.
    FP8 with V (keys, dim) through pointer loads holds one V buffer: wgmma needs V K-major, so
    Triton loads V into registers and stores it transposed, unpipelined. Layout-conversion scratch
    reuses the loop's buffers afterwards. Over 1940 compiled configs (both dtypes, head dims 64..256,
    every tile/warp/stage/load/layout/rowsum choice) the real size lies between this estimate
    - 6.5 KiB (FP8 with V (keys, dim), where Triton buffers V differently) and + 1 KiB (BF16 with
    pointer loads, rowsum="mma" and block_m=64): it never rejected a config that fits, and caught
    all 222 that did not.
    """
    e = _elem_bytes(c.dtype)
    dqk, dv = loaded_widths(c)
    q = c.block_m * dqk * e
    k = c.block_n * dqk * e * c.num_stages
    v_tile = c.block_n * dv * e
    v_buffers = 1 if (c.dtype == "fp8" and c.loads == "pointer" and c.v_layout == "natural") else c.num_stages
    ones = c.block_n * 16 * e if c.rowsum == "mma" else 0
    margin = TMA_SMEM_MARGIN if c.loads == "tma" else 0
    return q + k + v_tile * v_buffers + ones + margin


#: Fixed part of `register_estimate`: row statistics, addresses, loop state (calibrated: see below).
REGISTER_OVERHEAD = 16


def register_estimate(c: KernelConfig) -> int:
    """Registers per thread the key loop needs at least, calibrated against compile_for_target.

    fp32 accumulators (block_m x head_dim_v) + fp32 scores (block_m x block_n), spread over
    32*num_warps threads, + P at a quarter of the scores (four e4m3 per register; Triton converts
    bf16 P as it feeds the P@V wgmma, so its extra registers overlap the scores' the same way)
    + REGISTER_OVERHEAD. It is close to a lower bound, not a prediction: real counts run 0..100
    above it with loads, layouts and rowsum (lean P under maxnreg=168 once came 4 below). Over the
    same 1940 configs (maxnreg 0, 168 and 200) every config whose estimate exceeds its limit spilled
    (305 of the 586 that spill); every config that did not spill stays 8 or more under its limit.
    Not modelled: FP8 with V in several chunks (head dims 80, 96) gives each chunk's PV wgmma its own
    register copy of P, and ptxas then serialises the wgmmas (C7512) of 256-key tiles at an estimate of
    216-224 of 255 and of 128 x 64 on 4 warps at 176-192 of maxnreg=200, while 64 x 128 compiles clean at
    136 of 168: no one term separates them, so they are left to the compile check.
    FP8 V^T loaded by pointer adds a register per two of its bytes per thread (POINTER_VT_BYTES_PER_REGISTER).
    """
    threads = 32 * c.num_warps
    acc = c.block_m * loaded_widths(c)[1] // threads
    scores = c.block_m * c.block_n // threads
    return acc + scores + scores // 4 + pointer_vt_bytes(c) // POINTER_VT_BYTES_PER_REGISTER + REGISTER_OVERHEAD


#: Bytes of FP8 V^T per thread (see `pointer_vt_bytes`) that take at least one register. Over 88
#: distinct FP8 pointer-load kernels from configs the static check accepted (head dims 64..256, both V
#: layouts, random tiles, warps, stages, softmax and rowsum), the smallest register cap that compiled
#: without spills (compile_for_target, caps in steps of 8) ran 24..119 above the rest of the estimate
#: with V^T and 8..72 with V as given. Half the V^T bytes never exceeded that excess (tightest: head
#: dim 128, 128 x 128 on 8 warps, rowsum="mma", 32 of 32; at maxnreg=200 it compiles clean at an
#: estimate of 192). On the 94 sampled configs (their own maxnreg 0/168/200) it rejects 14 of the 43
#: that spilled (all with V^T: 12 more with V^T and 17 with V as given still pass) and none of the 51
#: that did not.
POINTER_VT_BYTES_PER_REGISTER = 2


def pointer_vt_bytes(c: KernelConfig) -> int:
    """Bytes of V^T each thread loads per key block where FP8 V^T comes by pointer (loads="pointer",
    v_layout="transposed"), else 0. In the masked last blocks the key mask runs along V^T's contiguous
    axis, so Triton loads that tile one byte at a time (LDG.E.U8, a register each: 64 per thread at
    head dim 128, 128 x 128 on 8 warps) where K and V as given load 16-byte vectors."""
    if c.dtype != "fp8" or c.loads != "pointer" or c.v_layout != "transposed":
        return 0
    return c.block_n * loaded_widths(c)[1] // (32 * c.num_warps)


def register_limit(c: KernelConfig) -> int:
    return c.maxnreg or HOPPER.max_registers


def gluon_smem_estimate(c: KernelConfig) -> int:
    """Shared memory (bytes) of a Gluon kernel: the Q ring (q_stages x block_m x 128), the K and V^T
    rings (2 x num_stages x block_n x 128), one 64 x 128 bf16 output tile per consumer warpgroup,
    lean P's (8, block_n) e4m3 ones tile per consumer warpgroup, barriers and swizzle alignment
    (TMA_SMEM_MARGIN), with v_layout="natural" the two (block_n, head_dim_v) slots V is loaded into,
    and with p_carry="smem" / "smem2" one / two (64, block_n) e4m3 P tiles per consumer warpgroup (with
    "smem2" the output tile in the first where it fits). Q and K tiles count the columns the QK^T reduces
    over (a head dim not of 32s zero-padded to one: 80 -> 96).
    Exact to within the margin (compiled: 147920 B for the default against 148480 estimated; 150000 B
    for its lean P variant)."""
    qk_part, qk_parts = gluon_qk_parts(c)
    q = c.q_stages * c.block_m * qk_part * qk_parts
    dp = sum(gluon_o_parts(c))  # V^T and O tiles: padded to a power of two (96 -> 128), or 64 + 32
    kv = c.num_stages * c.block_n * (qk_part * qk_parts + dp)
    raw_v = 2 * c.block_n * dp if c.v_layout == "natural" else 0  # the tiles the producer transposes
    out = (c.block_m // 64) * 64 * dp * 2
    ones = (c.block_m // 64) * 8 * c.block_n if c.rowsum == "mma" else 0
    p = p_tiles(c) * (c.block_m // 64) * 64 * c.block_n  # P's way to the PV wgmma
    if o_in_p_tile(c):  # the output tiles live in the first P tiles
        out = 0
    return q + kv + raw_v + out + ones + p + TMA_SMEM_MARGIN


#: setmaxnreg of a producer warpgroup that transposes V (v_layout="natural"): at 24 it spilled 8 bytes
#: (compile_for_target, hd128 128 x 128 overlap; one consumer with 256-key blocks), at 40 none; one
#: consumer (producer_regs fixed at 24) with blocks of up to 128 keys did not spill at head dims up to
#: 128 (at 256: 16 bytes) unless it also reads a tile table (q_order="balanced": 8 bytes)
NATURAL_V_PRODUCER_REGS = 40
#: Fixed part of a Gluon consumer's registers: row statistics, loop state, addresses, barriers.
GLUON_REGISTER_OVERHEAD = 24
#: Extra registers each of three consumer warpgroups (block_m=192, 160 registers each) needs at head
#: dim 128 and up: with 128-key blocks (estimated 152) they spilled 48-80 bytes with or without
#: overlap, v_permute, rowsum="mma" or skip_rescale; 64-key blocks (estimated 120-128) did not, nor did
#: head dim 64 with 128-key blocks (estimated 148). With P through two shared tiles (no P
#: in registers) and the row sums in fp32 they fit (hd128, 128-key blocks: 152, no spill with or without
#: the output through the P tiles, late_rescale, skip_rescale, lane sums, half_block, ping-pong, 3 or 4
#: stages) at 160, but not at 152 (producer_regs=56: 512 bytes, wgmmas serialised):
#: GLUON_THREE_CONSUMER_TWO_TILE_REGISTERS; with the row-sum MMA they still spill (48 bytes). That relief
#: needs Q and K in one part: with QK^T chained over three 32-column parts (head dims 80 and 96, zero-padded
#: to 96) every such kernel spilled 8-24 bytes at 160 (lane sums, half_block, late_rescale, skip_rescale,
#: ping-pong, 2 or 3 stages, a Q ring of 1 or 2: 28 compiles), where head dims 112 and 128 (one 128-column
#: part) compiled clean in the same shapes. (At hd128 a Q ring of 2 with 2 stages, without late_rescale,
#: spilled 8-16 bytes too: left to the tuner's compile check.)
GLUON_THREE_CONSUMER_REGISTERS = 24
GLUON_THREE_CONSUMER_TWO_TILE_REGISTERS = 8
#: Extra registers of an overlapped 192-key block (two key parts, two accumulators): at 240 per
#: consumer none spilled, at 224 (producer_regs=56) 40 bytes did with the estimate at 208.
#: Three consumers need them without overlap too: at hd64 their plain 192-key step spilled 64-80 bytes
#: at 160 (estimated 152) and 160-224 with the wgmmas serialised at 152 (compile sweep)
GLUON_SPLIT_REGISTERS = 24
#: Extra registers at head dims 192/128 (Q and K in three 64-column parts; 176 zero-padded alike) with overlap and the row-sum
#: MMA: one consumer with 256-key blocks spilled 64 bytes at an estimated 248 of 256 (hd128: none;
#: rowsum="fp32": none)
GLUON_MLA_MMA_REGISTERS = 16
#: Extra registers a Gluon consumer needs at head dims 64 and 256 with the packed P carried (measured)
GLUON_OTHER_DIM_REGISTERS = 12
#: Extra registers of the plain step (no overlap, no pv_defer) at head dim 256 on 128-key blocks (a
#: 64 x 256 accumulator beside 64 x 128 scores, estimated 216): it spilled 8-32 bytes at 224 and 232
#: per consumer (producer_regs 56 / 40, with or without ping-pong, half_block, skip_rescale, lane sums)
#: and none at 240; with the row-sum MMA 24 bytes at 240 too (a random sweep of the hd256
#: space: 3 of 80 feasible points spilled, this one and two at the estimate's edge)
GLUON_WIDE_PLAIN_REGISTERS = 24
GLUON_WIDE_PLAIN_MMA_REGISTERS = 8
#: Extra registers of a 256-key pv_defer block (two 128-key parts, the second QK^T issued after the PV
#: wait, so the scores never share the registers with the P in flight). Such a block always rescales O
#: in place (inline PTX, generator/gluon_sm90/emit.rescale_in_place): with the fp32 row sums it compiled
#: without spills at 240 and 232 per consumer and spilled 16-144 bytes at 224 (producer_regs=56; head dims
#: 80 and 128, with or without ping-pong or skip_rescale: 24 compiles); the row-sum MMA needs
#: GLUON_SPLIT_DEFER_MMA_REGISTERS more (clean at 240, 8-16 bytes at 232). Rescaled by a multiply (a second
#: copy of O) it had spilled 64-152 bytes (causal; non-causal kernels may spill and are left to the tuner's
#: compile check)
GLUON_SPLIT_DEFER_REGISTERS = 16
GLUON_SPLIT_DEFER_MMA_REGISTERS = 8
#: Extra registers of one consumer warpgroup (block_m=64, the 256-register maximum) that reads the
#: balanced tile table: its 256-key overlapped kernels (estimated 248) spilled 8 bytes with the table and
#: none in round robin; no two- or three-consumer calibration row changed (48 compiles)
GLUON_ONE_CONSUMER_TABLE_REGISTERS = 16
#: Extra registers of pv_defer with the row-sum MMA: at head dim 256 with 128-key blocks (estimated
#: 232) rowsum="fp32" did not spill at 240 registers and "mma" spilled 32-40 bytes; at 224 both spilled
#: 120-160 (64 compiles over head dims 64 / 256)
GLUON_DEFER_MMA_REGISTERS = 16
#: Extra registers of two P tiles (p_carry="smem2") with the row-sum MMA where accumulator and scores take
#: 192 registers (hd128 at 256 keys, hd256 at 128): at hd128 (estimated 216 without it) the exact softmax
#: spilled 48-64 bytes and lean P 32; at hd256 with the output through the P tiles (228)
#: 32-40 bytes; rowsum="fp32": none
GLUON_TWO_TILE_MMA_REGISTERS = 32
#: Extra registers of two P tiles beside 192 registers of accumulator and scores (hd128 at 256 keys) where
#: three things each add live state at the softmax: the halved first block (a second, half-width copy of
#: the step), ping-pong (the turn barrier's state across the step) and the per-row fp32 sums (a quad
#: shuffle reduction every step, which lane_sums defers to the end). Together they spilled 8-16 bytes at
#: 224 per consumer (producer_regs=56; head dims 80 and 128, with or without skip_rescale, ex2_fence,
#: q_order, p_scale_log2 or the named turn barrier); with any one of them off, or at 232, none did
#: (48 compiles)
GLUON_TWO_TILE_HALF_PING_PONG_REGISTERS = 16


#: Extra registers of three consumer warpgroups (160 registers each) carrying P as float32 with O in two
#: parts (o_split, head dim 96): 3 of 4 such kernels spilled 24-32 bytes (estimated 152 without this
#: term; ping-pong with the row-sum MMA and skip_rescale did not and is rejected with them), while every
#: packed-P (p_carry="e4m3") one compiled clean (50 compiles over head dim 96)
GLUON_SPLIT_O_F32_THREE_REGISTERS = 16
#: Extra registers of those three consumers (o_split) without the key permutation (v_permute=False:
#: P reaches the PV wgmma through a layout conversion): all 4 compiled spilled 8-40 bytes at an
#: estimated 136, overlap or not; with the permutation none did
GLUON_SPLIT_O_NO_PERM_THREE_REGISTERS = 32


#: Extra registers of a consumer that reads V as given (v_layout="natural") beside Q/K in more than three
#: parts (160 and 224 in 32-column parts: five and seven chained wgmmas): at 160/128 and 224/128 the
#: natural-V seed spilled 8 bytes at an estimated 232 of 232 (16 with producer_regs 56), where 96/96,
#: 192/128 (three parts), 160/64, 160/160 and 224/224 (the same estimate) did not
GLUON_MANY_PARTS_NATURAL_REGISTERS = 8


def gluon_register_estimate(c: KernelConfig) -> int:
    """Registers per thread a Gluon consumer warpgroup needs at least: its 64 x head_dim fp32
    accumulator, the 64 x block_n fp32 scores and, with overlap, the previous block's P carried into
    the next step: packed four e4m3 to a register with v_permute (block_n / 8), else as separate
    bytes plus the shuffles' temporaries (block_n / 2 + 16); p_carry="smem" counts the same packed
    words (live until they are stored: 256 keys, estimated 248, spilled 16 bytes; 128 keys did not);
    + GLUON_REGISTER_OVERHEAD. pv_defer holds the same P in flight under QK^T(j) (at 256 keys,
    estimated 248 of 240, it spilled 96-184 bytes and ptxas serialised every wgmma; 128 and 192 keys did not spill).
    Calibrated on compile_for_target over block_n 64/128/256 x overlap x v_permute x producer_regs
    24/56 x one or two consumers (36 configs; tests/test_gluon_compile.py keeps the decisive ones):
    it rejected every config that spilled and none that did not. Head dims 64 and 256 with the
    packed P carried (overlap, v_permute) need GLUON_OTHER_DIM_REGISTERS more: without them a 256 x
    128-key and a 64 x 256-key (producer_regs=56) config passed and spilled 48 and 8 bytes, while the
    same term on head dim 128 would reject a 256-key one-consumer config that fits (7 more compiles,
    tests/test_gluon_compile.py CALIBRATION). Head dim 96 counts its accumulator as 128 columns
    (padded) or 64 + 32 (o_split, without the other-dims term: three consumers and 256-key overlapped
    blocks compile clean at 152 and 232; GLUON_SPLIT_O_F32_THREE_REGISTERS). Two P tiles with the row-sum MMA
    beside 192 registers of accumulator and scores: GLUON_TWO_TILE_MMA_REGISTERS; with a halved first block,
    ping-pong and per-row sums: GLUON_TWO_TILE_HALF_PING_PONG_REGISTERS."""
    dp = sum(gluon_o_parts(c))  # the accumulators' columns (96 -> 128, or 64 + 32)
    acc = 64 * dp // 128
    scores = 64 * c.block_n // 128
    # (two P tiles: P(j) is stored as the softmax makes it, before the PV(j-1) wait, and carried in no register)
    carried = 0 if not (c.overlap or c.pv_defer) or p_tiles(c) == 2 else scores // 4 if c.v_permute else scores + 16
    other_dim = GLUON_OTHER_DIM_REGISTERS if c.overlap and c.v_permute and dp != 128 and not c.o_split else 0
    three_split_o = c.o_split and c.block_m == 192  # (o_split's own terms for three consumers)
    split_o = (GLUON_SPLIT_O_F32_THREE_REGISTERS if three_split_o and c.overlap and c.p_carry == "f32" else 0) + (
        GLUON_SPLIT_O_NO_PERM_THREE_REGISTERS if three_split_o and not c.v_permute else 0
    )
    defer_mma = GLUON_DEFER_MMA_REGISTERS if c.pv_defer and c.rowsum == "mma" else 0
    two_tile_mma = GLUON_TWO_TILE_MMA_REGISTERS if p_tiles(c) == 2 and acc + scores >= 192 and c.rowsum == "mma" else 0
    row_sums = c.rowsum == "fp32" and not c.lane_sums  # reduced across the quad every step
    two_tile_half = p_tiles(c) == 2 and acc + scores >= 192 and c.half_block and c.ping_pong and row_sums
    qk_part, qk_parts = gluon_qk_parts(c)
    three = (
        0
        if c.block_m != 192 or dp < 128
        else (
            GLUON_THREE_CONSUMER_TWO_TILE_REGISTERS
            if p_tiles(c) == 2 and c.rowsum == "fp32" and qk_parts == 1
            else GLUON_THREE_CONSUMER_REGISTERS
        )
    )
    split = GLUON_SPLIT_REGISTERS if c.block_n == 192 and (c.overlap or c.block_m == 192) else 0
    mla = GLUON_MLA_MMA_REGISTERS if (qk_part, qk_parts) == (64, 3) and c.overlap and c.rowsum == "mma" else 0
    table = GLUON_ONE_CONSUMER_TABLE_REGISTERS if c.block_m == 64 and c.q_order == "balanced" else 0
    many_parts = qk_parts > 3 and c.v_layout == "natural"
    table += GLUON_MANY_PARTS_NATURAL_REGISTERS if many_parts and dp == 128 else 0
    wide_plain = (
        GLUON_WIDE_PLAIN_REGISTERS + (GLUON_WIDE_PLAIN_MMA_REGISTERS if c.rowsum == "mma" else 0)
        if dp == 256 and c.block_n >= 128 and not (c.overlap or c.pv_defer)
        else 0
    )
    if c.pv_defer and c.block_n == 256:  # peak at the softmax: no P in flight beside the scores, O in place
        split_mma = GLUON_SPLIT_DEFER_MMA_REGISTERS if c.rowsum == "mma" else 0  # (in place of defer_mma)
        return acc + scores + split_mma + table + GLUON_SPLIT_DEFER_REGISTERS + GLUON_REGISTER_OVERHEAD
    return (
        acc
        + scores
        + carried
        + other_dim
        + three
        + split
        + mla
        + defer_mma
        + two_tile_mma
        + (GLUON_TWO_TILE_HALF_PING_PONG_REGISTERS if two_tile_half else 0)
        + table
        + split_o
        + wide_plain
        + GLUON_REGISTER_OVERHEAD
    )


def gluon_infeasibility(c: KernelConfig) -> str | None:
    """Why a Gluon config cannot compile to a usable kernel (TMA boxes, shared memory, registers per
    role: the consumers' setmaxnreg share), or None."""
    if c.block_n & (c.block_n - 1) and c.block_n != 192:
        return (
            f"TMA: block_n={c.block_n} must be a power of two (the V^T box is [128, block_n]) or 192 "
            f"(128 + 64 key parts)"
        )
    smem = gluon_smem_estimate(c)
    if smem > HOPPER.shared_memory_bytes:
        return (
            f"shared memory: about {smem} B (Q ring {c.q_stages}, K/V ring {c.num_stages} x {c.block_n} keys, "
            f"output tiles) > {HOPPER.shared_memory_bytes} B (227 KiB)"
        )
    consumer, producer = gluon_registers(c)
    if (
        c.v_layout == "natural"
        and producer < NATURAL_V_PRODUCER_REGS
        and (c.block_m > 64 or c.block_n > 128 or c.head_dim_v > 128 or c.q_order == "balanced")
    ):
        return (
            f"registers: the producer warpgroup transposes V (v_layout='natural') and spills at "
            f"producer_regs={producer} (block_m={c.block_m}, block_n={c.block_n}, head_dim_v="
            f"{c.head_dim_v}, q_order={c.q_order!r}); it needs {NATURAL_V_PRODUCER_REGS}"
        )
    need = gluon_register_estimate(c)
    if need > consumer:
        return (
            f"registers: a consumer warpgroup needs about {need} per thread (accumulator, scores"
            f"{', carried P' if c.overlap or c.pv_defer else ''}) > its {consumer} (producer_regs={c.producer_regs}): "
            f"it would spill"
        )
    return None


def static_infeasibility(c: KernelConfig) -> str | None:
    """Why `c` cannot compile to a usable sm_90a kernel, from its shape alone; None if it may."""
    if c.backend == "gluon":
        return gluon_infeasibility(c)
    wg_rows = 64 * (c.num_warps // 4)
    if c.num_warps % 4 or c.block_m % wg_rows:
        # Triton compiles it by splitting the key / head-dim columns across warpgroups (row
        # statistics then go through shared memory each tile). Measured on the H200 (B=2, H=32,
        # S=4096, causal) it ran 1.6-3.0x slower than the same config with 64 rows x 4 warps or
        # 128 rows x 8 warps, both dtypes, head dims 64, 128 and 256: pruned, as FA3/FA4 do.
        return (
            f"wgmma: block_m={c.block_m} with num_warps={c.num_warps} gives a warpgroup fewer than 64 "
            f"query rows (block_m must be a multiple of {wg_rows}, one 64-row slice per warpgroup)"
        )
    min_n = 32 if c.dtype == "fp8" else 16
    if c.block_n % 16 or c.block_n < min_n:
        return (
            f"wgmma: block_n={c.block_n} must be a multiple of 16 and >= {min_n} for {c.dtype} (the k dimension of P@V)"
        )
    smem = smem_estimate(c)
    if smem > HOPPER.shared_memory_bytes:
        return (
            f"shared memory: about {smem} B (Q, {c.num_stages} stages of K and V"
            f"{', ones tile' if c.rowsum == 'mma' else ''}) > {HOPPER.shared_memory_bytes} B (227 KiB)"
        )
    regs, limit = register_estimate(c), register_limit(c)
    if regs > limit:
        return (
            f"registers: about {regs} per thread (accumulators, scores, P) > "
            f"{'maxnreg=' + str(c.maxnreg) if c.maxnreg else str(HOPPER.max_registers)}: it would spill"
        )
    return None
