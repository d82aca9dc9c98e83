"""Validated kernel configurations: the only values that ever reach emitted source.

A `KernelConfig` is frozen and checks every field in `__post_init__`: integers must be real ints
in their allowed set, enums must be one of a fixed tuple of identifiers. Because emitted source is
built only from validated fields (never from arbitrary strings), a config loaded from a database or
a file cannot inject code: anything unexpected raises `ConfigError` before emission.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .rules import P_TILES, gluon_conflict, gluon_qk_width, o_width, triton_conflict

GENERATOR_VERSION = "0.1.0"

#: Head dims a config may have (Q/K and, independently, V): multiples of 8 from 32 to 256. Each backend
#: narrows them (rules.triton_head_dim_conflict, rules.gluon_head_dim_conflict): 16-byte TMA rows, tl.dot's
#: 16-column minimum, FP8 wgmma's 32-column reduction (the Gluon QK^T zero-pads Q and K to it in the kernel).
#: Widths that are not powers of two are split into power-of-two parts; a narrower 8 would need padded operands.
HEAD_DIM_MIN, HEAD_DIM_MAX, HEAD_DIM_STEP = 32, 256, 8
HEAD_DIMS = tuple(range(HEAD_DIM_MIN, HEAD_DIM_MAX + 1, HEAD_DIM_STEP))


def head_dim_error(name: str, value: object) -> str | None:
    """Why `value` is not a head dim any config may have (named `name` in the message), or None."""
    if type(value) is not int or value not in HEAD_DIMS:
        return (
            f"{name}: {value!r} is not a head dim the generator emits: a multiple of {HEAD_DIM_STEP} from "
            f"{HEAD_DIM_MIN} to {HEAD_DIM_MAX}"
        )
    return None


#: The head dims FA3 instantiates (what models most often use; the shipped database's widths).
COMMON_HEAD_DIMS = (64, 96, 128, 192, 256)

#: Allowed values of every field. Search spaces draw from these; validation enforces them.
CHOICES: dict[str, tuple] = {
    "dtype": ("fp8", "bf16"),
    "head_dim_qk": HEAD_DIMS,
    "head_dim_v": HEAD_DIMS,
    "block_m": (64, 128, 192, 256),
    "block_n": (32, 64, 128, 192, 256),
    "num_warps": (4, 8, 16),
    "num_stages": (1, 2, 3, 4, 5),
    "maxnreg": (0, 128, 152, 168, 184, 200, 232),
    "softmax": ("exact", "lean"),
    "lean_fold": ("fma", "sub_fma", "corrected", "centered"),
    "lean_clamp": ("imax", "fmax", "sat"),
    "lean_pack": ("prmt", "bfi"),
    "p_scale_log2": tuple(range(0, 9)),
    "scale_block": (0, 32, 64, 128, 256),
    "rowsum": ("fp32", "rounded", "mma"),
    "q_order": ("forward", "heavy_first", "balanced"),
    "loads": ("pointer", "tma"),
    "v_layout": ("natural", "transposed"),
    "backend": ("triton", "gluon"),
    "ping_pong": (False, True),
    "overlap": (False, True),
    "q_stages": (1, 2),
    "v_permute": (False, True),
    "persistent": (False, True),
    "producer_regs": (24, 40, 56),
    "ex2_fence": (False, True),
    "exp2_poly": tuple(range(0, 9)),
    "exp2_poly_degree": (3, 2),
    "skip_rescale": (False, True),
    "turn_barrier": ("mbarrier", "named"),
    "pv_defer": (False, True),
    "p_carry": ("f32", "e4m3", "smem", "smem2"),
    "lane_sums": (False, True),
    "late_rescale": (False, True),
    "o_split": (False, True),
    "half_block": (False, True),
    "o_through_p": (False, True),
    "l2_group_mib": (16, 8, 32, 64),
    "qk_acc": ("f32", "f16"),
    "k_perm": (False, True),
    "qk_async": (False, True),
    "lean_mufu": (0, 1, 2, 3, 4),
    "lean_ref": ("grid", "max"),
    "lean_floor": (False, True),
}

#: Fields only the Gluon backend reads: a Triton config keeps them at their defaults.
GLUON_FIELDS = (
    "ping_pong",
    "overlap",
    "q_stages",
    "v_permute",
    "persistent",
    "producer_regs",
    "ex2_fence",
    "exp2_poly",
    "exp2_poly_degree",
    "skip_rescale",
    "turn_barrier",
    "pv_defer",
    "p_carry",
    "lane_sums",
    "late_rescale",
    "o_split",
    "half_block",
    "o_through_p",
    "l2_group_mib",
    "qk_acc",
    "k_perm",
    "qk_async",
    "lean_mufu",
    "lean_ref",
    "lean_floor",
)
#: Fields added after configs were stored in shipped databases: written to JSON only away from their
#: default, so every earlier config keeps its JSON (and so its database rows).
LATE_FIELDS = (
    "exp2_poly",
    "exp2_poly_degree",
    "skip_rescale",
    "v_layout",
    "turn_barrier",
    "pv_defer",
    "p_carry",
    "lane_sums",
    "late_rescale",
    "o_split",
    "half_block",
    "o_through_p",
    "l2_group_mib",
    "qk_acc",
    "k_perm",
    "qk_async",
    "lean_mufu",
    "lean_ref",
    "lean_floor",
)
#: Fields only the launch reads (the persistent grid's tile table), not the rectangular kernel's code:
#: configs that differ only in them differ in the source's header line alone (the config, so each is its
#: own database variant: variants are keyed by source hash), and Triton compiles the kernel function once.
#: (The varlen variant sizes its loop's head groups by l2_group_mib: a constant of its source.)
LAUNCH_FIELDS = ("l2_group_mib",)
#: Fields only the Triton backend reads: a Gluon config keeps them at their defaults (the Gluon
#: kernel is one 4-warp warpgroup per 64 query rows, TMA loads into a K/V ring, one scale).
TRITON_FIELDS = ("num_warps", "maxnreg", "scale_block", "loads")
#: The softmax fields, read by both backends. An exact Gluon config stores them only away from their
#: defaults (rowsum="mma"), so its JSON, and its database rows, are what they were before Gluon had
#: lean P; a lean one stores them all.
SOFTMAX_FIELDS = ("softmax", "lean_fold", "lean_clamp", "lean_pack", "rowsum")


class ConfigError(ValueError):
    """A kernel configuration value is outside what the generator accepts."""


@dataclass(frozen=True)
class KernelConfig:
    """One point of the generator's parameter space (both backends).

    dtype:        input dtype of Q, K, V and of the probabilities fed to P@V ("fp8" = e4m3fn).
    head_dim_qk:  head dim of Q and K; head_dim_v: head dim of V and the output.
    block_m/n:    query rows per program / keys per inner-loop tile.
    num_warps, num_stages: Triton launch options (warps per program, software-pipeline depth).
    maxnreg:      register cap per thread (0 = the compiler's choice); lower caps fit more programs
                  per SM (e.g. 168 lets three 4-warp programs share the 64K registers).
    softmax:      "exact" = exp2 on the MUFU unit then conversion; "lean" = lean P, an FMA that
                  writes the e4m3 code of 2^x directly (fp8 only), in inline PTX. Both backends
                  (Gluon: with overlap, v_permute and rowsum "mma" or "rounded").
    lean_fold/clamp/pack: which lean P instruction sequence is emitted (see generator/asm/lean.py).
    p_scale_log2: probabilities are scaled by 2^p_scale_log2 before rounding, to use more of the
                  e4m3 range; the factor cancels in the normalisation.
    scale_block:  keys sharing one extra power-of-2 exponent taken from their own maximum
                  (0 = none). The Triton backend supports one exponent per key tile (= block_n):
                  smaller blocks would need a PV product and an O rescale per block, and buy
                  nothing once p_scale_log2 >= 6 (float64 emulation, benchmarks/p_scale_error.py:
                  16-key blocks change the error by <= 0.3% on every input family; docs/results.md).
    rowsum:       "fp32" = sum of unrounded probabilities; "rounded" = sum of the probabilities as
                  rounded to the P@V dtype (numerator and denominator agree); "mma" = the same sum
                  from an extra MMA of P against a ones tile. Gluon: "fp32" or "mma" under exact
                  softmax ("mma" saves one FADD per score); "mma" or "rounded" under lean, where
                  "rounded" decodes the packed e4m3 codes (two codes per cvt to f16x2, 16 codes
                  summed in f16x2, then in float32): no MMA and no shared-memory re-read of P.
    q_order:      "forward" or "heavy_first" (causal: the longest query blocks are launched first).
                  Gluon persistent only, "balanced": each program takes the tiles of a schedule the
                  launcher computes once per shape (kernels/gluon_launch.tile_table: groups of heads
                  whose K/V fit in L2, heaviest query blocks first, each tile to the least loaded
                  program). Round robin leaves the most loaded program 3-9% above the mean.
    loads:        "pointer" (masked loads, cp.async pipelining) or "tma" (tensor descriptors built on
                  the host, TMA copies into shared memory).
    v_layout:     "natural" reads V as (keys, dim) tiles; "transposed" reads a (dim, keys) copy the
                  launcher makes (FP8 wgmma needs V K-major; the copy's time counts in every timing).
                  Gluon "natural": the producer warpgroup TMA-loads V's (keys, dim) tile and writes
                  its transpose into the V^T ring itself (as FA3 does): one launch, no copy.

    backend:      "triton" (generator/triton/emit.py: Triton schedules the kernel) or "gluon"
                  (generator/gluon_sm90/emit.py: a warp-specialised FP8 kernel whose schedule the config
                  decides; docs/design.md). Each backend has its own fields (TRITON_FIELDS,
                  GLUON_FIELDS); the other backend's stay at their defaults, so that one kernel has
                  one config and one JSON. Shared fields mean for Gluon: block_m = 64 query rows per
                  consumer warpgroup (64: one, 128: two, 192: three), block_n = keys per K/V block (192:
                  two parts of 128 + 64, since tensor shapes are powers of two), num_stages =
                  depth of the K/V shared-memory ring (>= 2), p_scale_log2 = log2 of the P scale,
                  q_order = tile order of the (persistent) grid.
    ping_pong:    Gluon: the consumer warpgroups take turns issuing their wgmmas (block_m=128, 192).
    overlap:      Gluon: inside a warpgroup, softmax of block j runs while PV of block j-1 is on the
                  tensor cores (FA3's intra-warpgroup overlap).
    q_stages:     Gluon: Q tiles in shared memory (2 lets the producer load the next tile's Q early).
    v_permute:    Gluon: V^T's keys are permuted within 32-key chunks so that the QK^T accumulator
                  registers are already the P operand of the PV wgmma (no shuffles).
    k_perm:       Gluon, with v_permute: the same relabelling of keys made on K instead of V^T: a 5-D TMA
                  box puts key 16h + 4q + 2s + b into K tile row 16h + 8s + 2q + b, so that V^T is read in
                  key order and a V quantised keys-fastest (quantize_fp8(..., v_layout="k_major")) is read
                  as it is, with no copy. Not searched: kernels.launch.for_v_layout picks the twin for
                  such a V (needs Sk % 16 == 0). Same arithmetic, other order of the row sums' adds.
    persistent:   Gluon: grid = min(SMs, tiles), each program loops over tiles; else one per tile.
    producer_regs: Gluon: registers per thread of the TMA producer (setmaxnreg; one warp, a warpgroup
                  with v_layout="natural"); the consumer warpgroups share the rest of the register
                  file (see gluon_registers).
    ex2_fence:    Gluon (overlap only): a barrier on the row sums (rowsum="mma": on the OR of all of a
                  thread's probabilities) right before the PV wait, so that ptxas cannot hoist the
                  wait above the step's exponentials (docs/design.md).
    exp2_poly:    Gluon, exact softmax: of every 8 scores, this many get 2^x from a polynomial on the
                  FMA pipe instead of MUFU.EX2 (generator/asm/exp2_poly.py): the two pipes share the work,
                  the result stays float32 (e4m3 rounding as exact as MUFU's for ~all scores).
    exp2_poly_degree: degree of that polynomial (3: rel. error 9e-5; 2: 2e-3, one FMA less).
    skip_rescale: Gluon: a warp none of whose rows' maxima moved skips the rescale of O (a vote and a
                  uniform branch, generator/asm/rescale.py); at 128-key blocks that is an FMUL per score.
    turn_barrier: Gluon (ping_pong only): the token the consumer warpgroups pass to take turns, an
                  "mbarrier" in shared memory or a hardware "named" barrier (bar.sync / bar.arrive,
                  as FA3's warp scheduler barrier).
    p_carry:      Gluon (overlap or pv_defer): how P crosses from the softmax of step j to the PV of
                  step j+1: "f32" (the float32 probabilities, rounded next to the wgmma) or "e4m3"
                  (rounded at once and packed four per register as the A operand holds them: a quarter
                  of the registers, no byte moves; generator/gluon_sm90/p_carry._p_pack) or "smem" (packed so,
                  then written to a shared-memory tile per consumer once PV(j-1) is done, and read by
                  the PV wgmma from there: no register holds P while the next softmax runs, which is
                  what lets a 256-key block overlap; FA3 keeps it in registers at 224 keys), or
                  "smem2" (two such tiles per consumer: P(j) is stored into the one PV(j-1) does not
                  read as soon as the softmax makes it, and published by the proxy fence and barrier
                  under QK^T(j+1), so the staging leaves the step's critical path; the output tile
                  lives in the first P tile where it fits).
    lane_sums:    Gluon, rowsum="fp32" (or lean's "rounded"): each thread keeps its own partial row
                  sums (its keys of a row) from step to step, and the four lanes that share a row add
                  theirs once, in the epilogue (as FA3 does): two shuffles and two FADDs less per row
                  and step, off the chain from the last exponential to the PV wgmma. Sums in another
                  order: not bitwise the per-step sum.
    late_rescale: Gluon, overlap=True: O (and a row-sum MMA's l) is rescaled by the step's new factor
                  right after the step's PV(j-1) wait instead of at the top of the next step, so nothing
                  but the waits stands between one step's last exponentials and the next step's wgmma
                  issue (where FA3 puts it). The same operations in the same order: bitwise the same output.
    o_split:      Gluon, head_dim_v=96 only: O, its V^T tile and its output tile in a 64- and a 32-column
                  part (two accumulators, two PV wgmmas, two output boxes) instead of one 128-column
                  accumulator whose last 32 columns are padding: 16 registers fewer per thread (room
                  for FA3's hd96 tile, three consumer warpgroups) and no padded PV product.
    pv_defer:     Gluon (overlap=False only): PV(j-1) is issued right after QK^T(j) and both are waited
                  for at once, so the tensor cores get the two products back to back and the warpgroup
                  waits once per key block instead of twice; the softmax still runs after both (no P
                  under an MMA), so it costs only the in-flight P registers, not overlap's carried P.
                  With two key parts (block_n 192, and 256 as 128 + 128) PV(j-1) goes first, then
                  QK^T(j)'s first part, a wait that lets that part run on, then the second part in the
                  registers the P in flight had: a 256-key block fits (O rescaled in place).
    half_block:   Gluon (pv_defer=False; block_n 128 or 256), causal kernel: a warpgroup's first block
                  (the diagonal one) whose upper half holds no key any of its rows sees is computed on
                  its lower half only. Plain schedule: a step of block_n / 2 keys (the lower halves of
                  the K and V^T tiles). Overlapped with P in shared memory (p_carry "smem"/"smem2"):
                  QK^T and softmax on the lower half, P's upper half stored as zeros, so the pipeline
                  (whose PV reads whole tiles) is unchanged. With 128-row tiles and 256-key blocks that
                  is every second tile's diagonal block: half a block of exponentials saved (+3% at 4K
                  on the plain schedule). The same output (bitwise on the plain schedule).
    o_through_p:  Gluon, p_carry="smem2", where the 64 x O_W bf16 output tile does not fit one P tile
                  (block_n < 2 O_W: hd256 and 192/128 at 128 keys): no output tile of its own; the epilogue
                  stores O in column chunks of block_n / 2 (what one P tile holds), alternating between the
                  warpgroup's two P tiles (free once the tile's last PV is done). At hd256 that is the 64 KB
                  that keeps the 128-key overlap with two P tiles out of shared memory (263 KB -> 199 KB).
    l2_group_mib: Gluon, q_order="balanced", launch only (LAUNCH_FIELDS): the balanced tile table lists the
                  tiles by groups of kv heads whose K and V fit in this many MiB together (kept in L2 while
                  their tiles run side by side); the varlen variant runs its heads in groups of the same size
                  at the longest sequence's keys (a constant of its source). 16: a quarter of the H200's L2; 32 (FA3's choice) measured 1.4-3.4%
                  faster at 192/128 with 16 heads, equal or up to 3% slower with 32 heads: tuned per shape.
    qk_acc:       Gluon lean P: the QK^T accumulator's type. "f16" halves the score registers and makes the row
                  maximum and lean P's fold f16x2 instructions (two scores each; the codes' pack one PRMT per
                  four): the step's softmax ~30% shorter. Each consumer scales its
                  Q rows in shared memory by a power of two so that no score or partial sum can leave f16's
                  range for any e4m3 K (generator/gluon_sm90/softmax._q_headroom), and the scale goes into the
                  softmax's; a score carries f16's 11-bit precision (0.03% of |x|, x in log2 units). With
                  lean_fold="corrected" the fold's second-order correction runs on f16 pairs too (five more
                  operations; ~97% of codes correctly rounded; not yet timed on the GPU).
    qk_async:     Gluon, qk_acc="f16": QK^T(j)'s wait moved behind PV(j-1)'s issue by a pass over Triton's PTX
                  (generator/ptx_pass.py; Triton splits an f16 accumulator before the wait, so the emitted
                  step waits for QK^T(j) before issuing PV(j-1), where ncu finds a quarter of the lean f16
                  step's samples). The same arithmetic; with a 24-register producer +3-4% on lean f16 at hd128;
                  searched.
    lean_mufu:    Gluon, qk_acc="f16" with lean_fold "corrected" or "fma": of every four f16 score pairs, how many
                  take 2^x from the MUFU (ex2.approx.f16x2, the e4m3 code read off the f16 bits) instead of
                  the fold. The folds' f16x2 operations are issue slots, the MUFU's are its own pipe: a share of
                  each runs the two side by side (generator/asm/lean.f16_mufu_asm). Beside the corrected fold
                  both round (nearly) as FA3 does: measured 0.97-0.99x the exact kernel at every share.
                  Beside the linear fold the MUFU's pairs are correctly rounded from the fold's own line
                  (sharing the row's shift) and take their share of the fold's excess error away: k = 1 0.99x
                  its error at 0.93x its speed on the H100.
    lean_ref:     Gluon lean P on f16 scores with the linear fold (qk_acc="f16", lean_fold="fma"): where each row's
                  fold line sits. "grid": the row's reference is its maximum rounded up to the fold's 1/8 grid
                  (what the float32 folds' magic constant needs), so the maximum's code falls anywhere in its
                  last code and the line's offset is random from row to row. "max": the reference is the row's
                  maximum itself and the line is lowered by LEAN_MAX_CENTER (generator/asm/lean.py), so that the
                  maximum keeps its exact code 2^P and every other score rounds about half a code down from
                  the line, against its overestimate of 2^x (float64 emulation: gaussian 1.035x -> 1.00x FA3's
                  error with balanced V; docs/results.md). The same instructions in the step.
    lean_floor:   Gluon lean P on f16 scores with the linear fold: scores 2^-6 to 2^-9 of 2^P (e4m3's subnormals)
                  get codes from a second, shallower line (the maximum of the two; generator/asm/lean.py,
                  LEAN_FLOOR_SLOPE) instead of 0, two more f16x2 operations a pair: the linear line stops at
                  x + P = -7 where correct rounding goes on to -10, which costs long rows with a few large
                  scores (entry_outliers, llm) 1-2% of error (docs/results.md).
    """

    dtype: str = "fp8"
    head_dim_qk: int = 128
    head_dim_v: int = 128
    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    maxnreg: int = 0
    softmax: str = "exact"
    lean_fold: str = "fma"
    lean_clamp: str = "imax"
    lean_pack: str = "prmt"
    p_scale_log2: int = 8
    scale_block: int = 0
    rowsum: str = "fp32"
    q_order: str = "heavy_first"
    loads: str = "tma"
    v_layout: str = "transposed"
    backend: str = "triton"
    ping_pong: bool = True
    overlap: bool = True
    q_stages: int = 1
    v_permute: bool = True
    persistent: bool = True
    producer_regs: int = 24
    ex2_fence: bool = False
    exp2_poly: int = 0
    exp2_poly_degree: int = 3
    skip_rescale: bool = False
    turn_barrier: str = "mbarrier"
    pv_defer: bool = False
    p_carry: str = "f32"
    lane_sums: bool = False
    late_rescale: bool = False
    o_split: bool = False
    half_block: bool = False
    o_through_p: bool = False
    l2_group_mib: int = 16
    qk_acc: str = "f32"
    k_perm: bool = False
    qk_async: bool = False
    lean_mufu: int = 0
    lean_ref: str = "grid"
    lean_floor: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            allowed = CHOICES[f.name]
            expected = type(allowed[0])
            # bool is an int subclass: reject it explicitly so True never passes as 1.
            if type(value) is not expected:
                raise ConfigError(f"{f.name}: expected {expected.__name__}, got {type(value).__name__} {value!r}")
            if allowed is HEAD_DIMS and (why := head_dim_error(f.name, value)):
                raise ConfigError(why)
            if value not in allowed:
                raise ConfigError(f"{f.name}: {value!r} is not one of {list(allowed)}")
        self._check_combination()

    def _check_combination(self) -> None:
        for name in TRITON_FIELDS if self.backend == "gluon" else GLUON_FIELDS:
            value, default = getattr(self, name), _DEFAULTS[name]
            if value != default:
                raise ConfigError(
                    f"{name}={value!r}: not a field of backend={self.backend!r}; it must keep "
                    f"its default {default!r} (one kernel, one config)"
                )
        why = gluon_conflict(vars(self), _DEFAULTS) if self.backend == "gluon" else triton_conflict(vars(self))
        if why:
            raise ConfigError(why)

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields of this config's backend (a Triton config serialises exactly as it did before
        the Gluon backend existed: same JSON, same database rows, same emitted source)."""
        if self.backend == "gluon":
            late = LATE_FIELDS + (SOFTMAX_FIELDS if self.softmax == "exact" else ())
            skip = TRITON_FIELDS + tuple(name for name in late if getattr(self, name) == _DEFAULTS[name])
        else:
            skip = GLUON_FIELDS + ("backend",)
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}

    def all_fields(self) -> dict[str, Any]:
        """Every field, both backends' (what a search space reads; `to_dict` is what is stored)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KernelConfig":
        """Build from untrusted data (a database row, a JSON file): unknown keys are errors."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise ConfigError(f"unknown config fields: {unknown}")
        return cls(**dict(data))

    @classmethod
    def from_json(cls, text: str) -> "KernelConfig":
        try:
            data = json.loads(text)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ConfigError(f"config is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> "KernelConfig":
        return dataclasses.replace(self, **changes)

    def kernel_config(self) -> "KernelConfig":
        """This config with its launch-only fields (LAUNCH_FIELDS) at their defaults: the config whose
        kernel code this config runs."""
        return dataclasses.replace(self, **{name: _DEFAULTS[name] for name in LAUNCH_FIELDS})

    def summary(self) -> str:
        """One line for tables (what `zyfa-tune best` and `zyfa-tune bench` print)."""
        if self.backend == "gluon":
            on = [
                name
                for name, flag in (
                    ("pingpong", self.ping_pong),
                    ("overlap", self.overlap),
                    ("vperm", self.v_permute),
                    ("persistent", self.persistent),
                    ("naturalV", self.v_layout == "natural"),
                    ("named", self.turn_barrier == "named"),
                    ("defer", self.pv_defer),
                    ("packedP", self.p_carry == "e4m3"),
                    ("smemP", self.p_carry == "smem"),
                    ("smemP2", self.p_carry == "smem2"),
                    ("laneSums", self.lane_sums),
                    ("oSplit", self.o_split),
                    ("halfBlock", self.half_block),
                    ("oThroughP", self.o_through_p),
                    ("balanced", self.q_order == "balanced"),
                )
                if flag
            ]
            softmax = self.softmax + (f" poly{self.exp2_poly}/8d{self.exp2_poly_degree}" if self.exp2_poly else "")
            softmax += " rowsum=mma" if self.rowsum == "mma" and self.softmax == "exact" else ""
            softmax += " codeSums" if self.rowsum == "rounded" and self.softmax == "lean" else ""
            softmax += " skip-rescale" if self.skip_rescale else ""
            softmax += " f16S" if self.qk_acc == "f16" else ""
            softmax += " qkAsync" if self.qk_async else ""
            softmax += f" mufu{self.lean_mufu}/4" if self.lean_mufu else ""
            softmax += " refMax" if self.lean_ref == "max" else ""
            softmax += " floor" if self.lean_floor else ""
            group = f" L2group{self.l2_group_mib}MiB" if self.l2_group_mib != _DEFAULTS["l2_group_mib"] else ""
            return (
                f"gluon {softmax} {self.block_m}x{self.block_n} s{self.num_stages} q{self.q_stages} "
                f"{'+'.join(on) or 'plain'}{group}"
            )
        return (
            f"{self.softmax} {self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages} "
            f"{self.loads}/{self.v_layout} rowsum={self.rowsum}"
        )


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(KernelConfig)}


def gluon_o_parts(config: KernelConfig) -> tuple[int, int]:
    """Columns of a Gluon consumer's O accumulators (and of the V^T and output tiles behind them):
    with o_split (64, 32); else (head_dim_v rounded up to a power of two, 0), as tensor shapes must be
    powers of two. Padded (96 -> 128), the PV wgmma reads 32 V^T rows past the head (the next head's,
    or TMA's zeros past the tensor) into O columns that are never stored (the output's TMA box is
    clipped at head_dim_v)."""
    if config.o_split:
        return 64, 32
    return o_width(int(config.head_dim_v)), 0


def gluon_qk_parts(config: KernelConfig) -> tuple[int, int]:
    """(columns, count) of a Gluon kernel's Q / K tile parts (one TMA box and one chained wgmma each): the
    QK^T's reduction width (rules.gluon_qk_width: head_dim_qk, or zero-padded up to a multiple of 32) in
    parts of its largest power-of-two divisor, as tensor shapes must be powers of two (96 and 80: three of
    32; 192 and 176: three of 64; 128 and 112: one)."""
    width = gluon_qk_width(int(config.head_dim_qk))
    part = width & -width
    return part, width // part


def gluon_qk_padded(config: KernelConfig) -> bool:
    """Whether a Gluon kernel's Q / K tiles are wider than head_dim_qk (zero-filled past it by TMA, through
    a (rows, heads, dims) view of Q and K instead of (rows, heads x dims))."""
    return gluon_qk_width(int(config.head_dim_qk)) != config.head_dim_qk


def p_tiles(c: KernelConfig) -> int:
    """Shared-memory P tiles per consumer warpgroup: 1 with p_carry="smem", 2 with "smem2", else 0."""
    return P_TILES.get(c.p_carry, 0)


def o_in_p_tile(c: KernelConfig) -> bool:
    """p_carry="smem2": each consumer's bf16 output tile lives in its first P tile (free once the
    tile's last PV is done) where it fits: 64 x block_n e4m3 bytes hold 64 x O_W bf16 when
    block_n >= 2 O_W (one O part); with o_through_p, in chunks through both P tiles (o_chunks)."""
    return p_tiles(c) == 2 and not c.o_split and (c.block_n >= 2 * gluon_o_parts(c)[0] or c.o_through_p)


def o_chunks(c: KernelConfig) -> tuple[int, int]:
    """(columns, count) of the output stores per consumer tile: O_W in one store, or with o_through_p
    chunks of block_n / 2 columns (one P tile of 64 x block_n e4m3 bytes holds 64 x block_n / 2 bf16)."""
    width = gluon_o_parts(c)[0]
    if c.o_through_p:
        return c.block_n // 2, width // (c.block_n // 2)
    return width, 1


def gluon_registers(config: KernelConfig) -> tuple[int, int]:
    """(consumer, producer) registers per thread that the Gluon kernel requests (setmaxnreg).

    Triton's warp-group allocator gives a CTA of W warps (the producer warp padded to a warpgroup)
    65536 / (32 W) registers per thread rounded down to 8 at entry, and the default partition (the
    first consumer warpgroup) what the requests leave; asking each other consumer for
    ((c + 1) * entry - producer) / c (c consumers) leaves the first at least as much: two consumers
    get 24 -> 240, 40 -> 232, 56 -> 224; three (entry 128) 24 -> 160, 40 -> 152, 56 -> 152.
    One consumer warpgroup runs at the 256-register maximum whatever is asked."""
    consumers = config.block_m // 64
    if consumers == 1:
        return 256, config.producer_regs
    warps = 4 * consumers + 4
    entry = 65536 // (32 * warps) // 8 * 8
    return ((consumers + 1) * entry - config.producer_regs) // consumers // 8 * 8, config.producer_regs
