"""FP8 (e4m3) causal forward: one line per searched `KernelConfig` field, both backends.

Fields not listed (dtype, head dims) come from `generator.defaults.default_config("fp8", ...)`.
Adding a parameter to the generator means adding its line here (and in bf16_causal.py for a Triton
field). `backend` comes first: the fields after it that only one backend reads are marked
(`triton_only`, `gluon_only`) and take their defaults under the other (see params.py).
The seeds are named in seeds.py; `field_twins` makes a database winner's seeds.
"""

from zyfa_tune.generator import KernelConfig
from zyfa_tune.generator.rules import (
    gluon_head_dim_conflict,
    half_block_conflict,
    lane_sums_conflict,
    lean_floor_conflict,
    lean_mufu_conflict,
    lean_ref_conflict,
    o_split_conflict,
    o_through_p_conflict,
    packed_p_conflict,
    pv_defer_conflict,
    qk_acc_conflict,
    qk_async_conflict,
    triton_head_dim_conflict,
)

from .params import (
    BLOCK_N,
    TILE_PARAMS,
    Param,
    backend_param,
    gluon_only,
    gluon_tile,
    lean_only,
    rowsum_param,
    scale_per_tile,
    triton_only,
)
from .seeds import SEEDS
from .space import SearchSpace


def decode_p_carry(v: str, f: dict) -> str:
    """p_carry: "f32" where a packed carry does not apply; where lean P sums its codes (rowsum="rounded")
    a suggested "f32" becomes "e4m3": the sums decode the packed codes, so they need a packed carry."""
    if v != "f32" and packed_p_conflict({**f, "p_carry": v}):  # f holds the default's carry, not v
        return "f32"
    return "e4m3" if v == "f32" and f["softmax"] == "lean" and f["rowsum"] == "rounded" else v


def _exact_only_block(f: dict) -> bool:
    """A Gluon 192-key block (a 128- and a 64-key part) exists for the exact softmax on V^T only."""
    return f["backend"] == "gluon" and f["block_n"] == 192


def _loadable(loads: str, f: dict) -> str:
    """Triton loads: by pointer where TMA cannot address the rows (FP8 widths of 8s but not 16s)."""
    return "pointer" if triton_head_dim_conflict({**f, "loads": loads}) else loads


def _v_layout(v_layout: str, f: dict) -> str:
    """V^T ("transposed") where a Gluon config must read it: lean P and 192-key blocks do, and natural V rows
    of 8s but not 16s columns are not TMA-addressable."""
    if f["backend"] == "gluon" and (
        f["softmax"] == "lean" or _exact_only_block(f) or gluon_head_dim_conflict({**f, "v_layout": v_layout})
    ):
        return "transposed"
    return v_layout


def decode_lean_mufu(value: int, fields) -> int:
    """A share of the linear f16 fold's pairs from the MUFU where it applies, else 0. Beside the corrected fold it
    is not searched: 0.97-0.99x the exact kernel at every share."""
    return value if value and fields["lean_fold"] == "fma" and not lean_mufu_conflict(fields) else 0


PARAMS = (
    backend_param(),
    gluon_tile("block_m", (64, 128, 192)),  # Gluon 192: three consumer warpgroups (FA3's hd64 tile)
    gluon_tile("block_n", BLOCK_N + (192,)),  # Gluon 192: a 128- and a 64-key part, with overlap
    *(p for p in TILE_PARAMS if p.name not in ("block_m", "block_n")),
    Param(
        "softmax",
        ("exact", "lean"),  # both backends (Gluon lean: overlap + v_permute)
        decode=lambda v, f: "exact" if _exact_only_block(f) else v,
    ),
    lean_only("lean_fold", ("fma", "sub_fma", "corrected", "centered")),  # only under softmax="lean"
    lean_only("lean_clamp", ("imax", "fmax", "sat")),  # only under softmax="lean"
    lean_only("lean_pack", ("prmt", "bfi")),  # only under softmax="lean"
    Param("p_scale_log2", (6, 7, 8)),
    triton_only(scale_per_tile(BLOCK_N)),  # Optuna "scale_per_tile": scale_block 0 / block_n
    rowsum_param(("fp32", "rounded", "mma")),  # "fp32" under lean -> "rounded"; Gluon exact: "fp32" / "mma"
    Param(
        "q_order",
        ("forward", "heavy_first", "balanced"),  # "balanced": Gluon (persistent) only
        decode=lambda v, f: f["q_order"] if v == "balanced" and f["backend"] != "gluon" else v,
    ),
    # widths of 8s but not 16s (40, 72, 200): FP8 rows a TMA cannot address, so pointer loads / V^T
    triton_only(Param("loads", ("tma", "pointer"), decode=_loadable)),
    Param("v_layout", ("transposed", "natural"), decode=_v_layout),  # Gluon lean P, 192-key blocks: V^T
    gluon_only("ping_pong", (True, False), one_consumer=False),  # consumer warpgroups alternate wgmma issue
    gluon_only("overlap", (True, False), forced=("softmax", "lean", True)),  # softmax(j) while PV(j-1) runs
    Param(
        "pv_defer",
        (False, True),
        only_if=("backend", "gluon"),  # plain: PV(j-1) paired with QK^T(j)
        decode=lambda v, f: v and not pv_defer_conflict(f),
    ),
    gluon_only("q_stages", (1, 2)),  # Q ring: 2 prefetches the next tile's Q
    gluon_only(
        "v_permute",
        (True, False),
        unless=("v_layout", "natural"),
        default=False,  # key-permuted V^T
        forced=("softmax", "lean", True),
    ),
    gluon_only("persistent", (True, False), unless=("q_order", "balanced")),  # grid = min(SMs, tiles)
    gluon_only("l2_group_mib", (16, 32, 8, 64), needs=(("q_order", "balanced"),)),  # L2 groups: tile table, varlen loop
    gluon_only("producer_regs", (24, 40, 56), one_consumer=24),  # setmaxnreg split: consumers get the rest
    gluon_only("ex2_fence", (False, True), needs=(("overlap", True), ("rowsum", "fp32"))),  # exps before PV wait
    gluon_only("skip_rescale", (False, True)),  # a warp whose row maxima stayed skips O's rescale
    gluon_only("turn_barrier", ("mbarrier", "named"), needs=(("ping_pong", True),)),  # ping-pong token
    gluon_only("late_rescale", (False, True), needs=(("overlap", True),)),  # O rescaled after the PV wait
    Param(
        "p_carry",
        ("f32", "e4m3", "smem2"),
        only_if=("backend", "gluon"),  # P packed, or via two smem tiles
        decode=decode_p_carry,
    ),
    Param(
        "lane_sums",
        (False, True),
        only_if=("backend", "gluon"),  # row sums per lane, reduced in the epilogue
        decode=lambda v, f: v and not lane_sums_conflict(f),
    ),
    Param(
        "o_split",
        (False, True),
        only_if=("backend", "gluon"),  # hd96: O in 64 + 32 columns, not padded to 128
        decode=lambda v, f: v and not o_split_conflict(f),
    ),
    Param(
        "half_block",
        (False, True),
        only_if=("backend", "gluon"),  # a half-empty first block halved
        decode=lambda v, f: v and not half_block_conflict(f),
    ),
    Param(
        "o_through_p",
        (False, True),
        only_if=("backend", "gluon"),  # output in chunks through the P tiles
        decode=lambda v, f: v and not o_through_p_conflict(f),
    ),
    Param(
        "qk_acc",
        ("f32", "f16"),
        only_if=("backend", "gluon"),  # lean P on f16 scores (two per instruction)
        decode=lambda v, f: "f32" if qk_acc_conflict(f) else v,
    ),
    Param(
        "qk_async",
        (False, True),
        only_if=("backend", "gluon"),  # f16 QK^T's wait behind PV(j-1)'s issue
        decode=lambda v, f: v and not qk_async_conflict(f),
    ),
    Param(
        "lean_ref",
        ("grid", "max"),
        only_if=("backend", "gluon"),  # the f16 fold's line on the row's maximum
        decode=lambda v, f: "grid" if v != "grid" and lean_ref_conflict(f) else v,
    ),
    Param(
        "lean_floor",
        (False, True),
        only_if=("backend", "gluon"),  # e4m3's subnormal codes by a second line
        decode=lambda v, f: v and not lean_floor_conflict(f),
    ),
    Param(
        "lean_mufu",
        (0, 1, 2),
        only_if=("backend", "gluon"),  # of four linear-fold pairs, so many by the MUFU
        decode=decode_lean_mufu,
    ),
)


def field_twins(config: KernelConfig) -> list[KernelConfig]:
    """A database winner's one-field twins, where the field applies: measured gains over such winners that a
    short study would rarely sample as neighbours of the best kernel it already has.

    - row sums per lane (lane_sums): +1.3-2.3% on the shipped 192/128 and hd256 schedules;
    - at head dim 96 O in a 64- and a 32-column part (o_split): +2.0% on the padded 256-key 4K winner;
    - a half-empty first block run as half a block (half_block): +1.6-3.2% on the 256-key kernels at 4K / 8K,
      +1-4.5% on the overlapped ones with P in shared memory;
    - an overlapped exact winner with P through two shared-memory tiles (p_carry="smem2"), its first blocks
      halved too: 1.04-1.06x the plain kernel at hd128 8K / 16K;
    - a two-tile winner whose output tile does not fit a P tile with its output through the P tiles
      (o_through_p), alone and with the freed shared memory spent on a Q ring of 2;
    - a balanced winner with its tile table's heads grouped for 32 MiB of L2 (the same compiled kernel):
      2.5-4% at 192/128 with 16 heads;
    - a lean winner with the row-sum MMA summing its decoded codes instead (per lane where that applies):
      5-9% faster at hd128;
    - a winner whose scores can accumulate in f16 (qk_acc="f16"): lean P 1.13-1.20x its float32 scores at
      hd128 8K-32K;
    - an f16-score winner with its QK^T wait behind PV(j-1)'s issue (qk_async): +9% on the lean f16 kernel
      without ping-pong, +0.5% with it;
    - a linear-fold f16 winner with its line on the row's own maximum (lean_ref="max"): 0.97x its error at
      the same speed; and such a winner with a quarter of its pairs from the MUFU (lean_mufu=1): 0.99x its
      error at 0.93x its speed."""
    if config.backend != "gluon":
        return []
    twins = []
    if not config.lane_sums and not lane_sums_conflict(vars(config)):
        twins.append(config.replace(lane_sums=True))
    if not config.o_split and not o_split_conflict(vars(config)):
        twins.append(config.replace(o_split=True))
    if not config.half_block and not half_block_conflict(vars(config)):
        twins.append(config.replace(half_block=True))
    two_tiles = {**vars(config), "p_carry": "smem2"}
    # (not lean P's: through the tiles 0.92x its float32 carry at hd128 16K)
    if (
        config.overlap
        and config.p_carry in ("f32", "e4m3")
        and config.softmax == "exact"
        and not packed_p_conflict(two_tiles)
    ):
        twin = config.replace(p_carry="smem2")  # with its half-empty first blocks halved where that applies
        twins.append(twin.replace(half_block=True) if not half_block_conflict(vars(twin)) else twin)
    if config.p_carry == "smem2" and not config.o_through_p and not o_through_p_conflict(vars(config)):
        chunked = config.replace(o_through_p=True)  # the output tile's shared memory freed: a Q ring of 2
        twins += [chunked, chunked.replace(q_stages=2)] if config.q_stages == 1 else [chunked]
    if config.softmax == "lean" and config.rowsum == "mma" and config.p_carry != "f32":
        twin = config.replace(rowsum="rounded")  # its codes decoded: no row-sum MMA
        twins.append(twin if lane_sums_conflict({**vars(twin), "lane_sums": True}) else twin.replace(lane_sums=True))
    if config.q_order == "balanced" and config.l2_group_mib == 16:
        twins.append(config.replace(l2_group_mib=32))
    if config.qk_acc == "f32" and not qk_acc_conflict(vars(config)):
        twins.append(config.replace(qk_acc="f16"))  # scores in f16
    if not config.qk_async and not qk_async_conflict(vars(config)):
        twins.append(config.replace(qk_async=True))  # PV(j-1) issued behind QK^T(j)
    if config.lean_ref == "grid" and not lean_ref_conflict({**vars(config), "lean_ref": "max"}):
        twins.append(config.replace(lean_ref="max"))  # the line on the row's maximum
    if config.lean_ref == "max" and config.lean_mufu == 0 and decode_lean_mufu(1, vars(config)):
        twins.append(config.replace(lean_mufu=1))  # a quarter of its pairs correctly rounded
    return twins


#: Enqueued right after the Triton default (where statically feasible): seeds.SEEDS, the lean P ones only for a
#: study whose gate admits lean P's error (tune.LOOSE_GATE, or --multi-objective).
SPACE = SearchSpace(
    "fp8-causal",
    "fp8",
    PARAMS,
    extra_seeds=tuple(s.build for s in SEEDS if not s.loose),
    winner_twins=field_twins,
    loose_seeds=tuple(s.build for s in SEEDS if s.loose),
)
