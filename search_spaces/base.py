"""Shared machinery of the per-family search spaces: `Param`, `SearchSpace`, static feasibility.

A family module (fp8_causal.py, bf16_causal.py) declares one `Param` per searched `KernelConfig`
field; everything else comes from the family's safe default (`kernels.defaults.default_config`),
so adding a parameter to the generator means adding one line to a family module.

How a trial becomes a config (`SearchSpace.suggest`):

* every param is suggested on every trial, with `trial.suggest_categorical` under the field's own
  name (or the param's `label`) and plain Python choices. The space is therefore static, which is
  what TPE handles best: `TPESampler(multivariate=True)` can model interacting fields (tiles x
  warps x stages x maxnreg) jointly without `group=True`'s split into sub-spaces, every trial is
  an observation of every param, `enqueue_trial` always fixes the whole space, and a study can
  switch samplers. The price: under softmax="exact" the lean fields' suggested values carry no
  signal (three two-way choices of noise for the independent model).
* a param can be irrelevant under another field's value (the lean P instruction sequence when
  softmax="exact"): it is still suggested, but the config takes the family default's value for it
  (`only_if`), so equal kernels are equal configs (one source hash, one compile, one database row).
* a few fields are suggested through a stand-in that can only produce valid combinations:
  scale_block is the boolean "scale_per_tile" (-> 0 or block_n, the only values the Triton backend
  takes), and under softmax="lean" a suggested rowsum "fp32" becomes "rounded" (lean P has no
  unrounded probabilities). Such a mapping may read fields declared before it in the family module.
* backends: "backend" is a param like any other (declared first). Each backend's own fields are
  relevant only under it (`triton_only`, `gluon_only`); irrelevance is transitive in declaration
  order (under backend="gluon" softmax is irrelevant, hence "exact", hence the lean fields too).
  Where the Gluon backend does not implement the head dims, a suggested "gluon" becomes "triton",
  and Gluon fields that need two consumer warpgroups take their one-consumer value under
  block_m=64 (ping_pong False, producer_regs 24). Shared fields (block_m, block_n, num_stages,
  p_scale_log2, q_order) are searched for both: the dispatcher then picks between backends by
  measured speed alone.

`feasible()` prunes before compiling, after FlashAttention-4's SM90 config search: wgmma shape
rules, a shared-memory estimate and a register estimate, both calibrated against
`generator.build.compile_for_target` (Triton 3.6, sm_90a; tables in tests/test_search_spaces.py).
The resource estimates are deliberately optimistic: they never rejected a config that compiles
within 227 KiB of shared memory without spills; a compile-time check catches the few that pass
here and still fail. The wgmma rule "64 query rows per warpgroup" does prune configs that compile
(block_m=64 on 8 warps), because they measured 1.6-3x slower (see `static_infeasibility`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import zyfa_tune.kernels as _kernels
from zyfa_tune.generator import (CHOICES, GLUON_HEAD_DIMS, ConfigError, KernelConfig, gluon_o_parts, gluon_registers,
                                 o_in_p_tile, p_tiles)
from zyfa_tune.generator.defaults import default_config

if TYPE_CHECKING:  # optuna is imported lazily: a config can be built without it
    import optuna

log = logging.getLogger("zyfa_tune.search_spaces")

_FIELDS = tuple(f.name for f in fields(KernelConfig))
#: Fields that are the problem, not the kernel: never searched.
_PROBLEM_FIELDS = ("dtype", "head_dim_qk", "head_dim_v")
#: The types Optuna accepts as categorical choices.
_PLAIN = (bool, int, float, str, type(None))

#: sm_90 maximum dynamic shared memory per block (227 KiB).
SMEM_LIMIT = 232448
#: Registers per thread the hardware allows.
MAX_REGISTERS = 255
#: Databases whose best entries seed every study (known-good configs measured on an H200).
SEED_DATABASES: tuple[Path, ...] = (Path(_kernels.__file__).resolve().parent / "tuned" / "h200.db",)

Decode = Callable[[Any, Mapping[str, Any]], Any]
Encode = Callable[[Any, KernelConfig], Any]


@dataclass(frozen=True)
class Param:
    """One searched `KernelConfig` field.

    name:    the field.
    choices: the values the field can take in this family (a subset of generator CHOICES[name]).
    label / options: the Optuna parameter name and its choices when they are not the field's own
             (e.g. scale_block is searched as the boolean "scale_per_tile"); default: name/choices.
    decode:  (suggested option, fields so far) -> field value; `fields so far` is the family
             default updated with the params declared before this one. Default: the option itself.
    encode:  (field value, config) -> option, the inverse used by `SearchSpace.as_optuna_params`.
    only_if: (field, value): the param matters only when that field has that value; otherwise the
             config keeps the family default's value (it is still suggested: see the module doc).
    """

    name: str
    choices: tuple
    label: str = ""
    options: tuple = ()
    decode: Decode | None = dataclasses.field(default=None, compare=False, repr=False)
    encode: Encode | None = dataclasses.field(default=None, compare=False, repr=False)
    only_if: tuple[str, Any] | None = None

    @property
    def key(self) -> str:
        """The Optuna parameter name."""
        return self.label or self.name

    @property
    def suggest_choices(self) -> tuple:
        """The Optuna categorical choices."""
        return self.options or self.choices

    def to_field(self, option: Any, so_far: Mapping[str, Any]) -> Any:
        return self.decode(option, so_far) if self.decode is not None else option

    def to_option(self, value: Any, config: KernelConfig) -> Any:
        return self.encode(value, config) if self.encode is not None else value

    def relevant(self, so_far: Mapping[str, Any]) -> bool:
        return self.only_if is None or so_far[self.only_if[0]] == self.only_if[1]

    def only_under(self, field: str, value: Any) -> "Param":
        """This param, relevant only when `field` has `value` (its one only_if)."""
        if self.only_if is not None:
            raise ValueError(f"{self.name}: already only_if {self.only_if}")
        return dataclasses.replace(self, only_if=(field, value))


# ---- declaration helpers used by the family modules (one line per field) ---------------------

def lean_only(name: str, choices: tuple) -> Param:
    """A lean P instruction-sequence field: matters only under softmax="lean"."""
    return Param(name, choices, only_if=("softmax", "lean"))


def scale_per_tile(block_n_choices: tuple) -> Param:
    """scale_block searched as the boolean "scale_per_tile": False -> 0, True -> block_n (the
    Triton backend takes one extra exponent per key tile), so no suggestion is ever invalid."""
    return Param("scale_block", (0,) + tuple(block_n_choices), label="scale_per_tile", options=(False, True),
                 decode=lambda on, f: f["block_n"] if on else 0,
                 encode=lambda value, config: value != 0)


def rowsum_param(choices: tuple = ("fp32", "rounded", "mma")) -> Param:
    """rowsum; under softmax="lean" (no unrounded probabilities) a suggested "fp32" becomes "rounded".
    The Gluon backend sums by "fp32" or "mma" under exact softmax (a suggested "rounded", the sum
    "mma" computes, becomes "mma"), and by "mma" or "rounded" (its codes decoded) under lean."""
    def decode(v, f):
        if f["backend"] == "gluon":
            if f["softmax"] == "lean":
                return "mma" if v == "mma" else "rounded"
            return "mma" if v != "fp32" else "fp32"
        return "rounded" if v == "fp32" and f["softmax"] == "lean" else v
    return Param("rowsum", choices, decode=decode)


def gluon_tile(name: str, choices: tuple) -> Param:
    """block_m / block_n with 192, a Gluon-only size (three consumer warpgroups; a 128-key and a 64-key
    part): Triton tiles are powers of two, so a suggested 192 runs as 128 under Triton (a 192-key
    block with lean P or natural V is an invalid point, pruned)."""
    return Param(name, choices, decode=lambda v, f: 128 if v == 192 and f["backend"] == "triton" else v)


def triton_only(param: Param) -> Param:
    """A field only the Triton backend reads (KernelConfig's TRITON_FIELDS)."""
    return param.only_under("backend", "triton")


def gluon_only(name: str, choices: tuple, *, one_consumer: Any = None,
               needs: tuple[tuple[str, Any], ...] = (), unless: tuple[str, Any] | None = None,
               default: Any = None, forced: tuple[str, Any, Any] | None = None) -> Param:
    """A Gluon schedule field (KernelConfig's GLUON_FIELDS). `one_consumer`: the field's only value
    with one consumer warpgroup (block_m=64) for a field that exists with two (ping_pong: False).
    `needs` ((field, value), ...) / `unless` (field, value): the field keeps the family default (or
    `default`) unless each of those fields / when that field (declared before it) has that value
    (ex2_fence: only with overlap=True and rowsum="fp32"; v_permute: False with v_layout="natural").
    `forced` (field, value, this field's value): the one value this field can take when that field
    has that value (Gluon lean P runs only overlapped, on key-permuted V^T)."""
    def decode(v, f):
        if one_consumer is not None and f["block_m"] <= 64:
            return one_consumer
        if forced is not None and f[forced[0]] == forced[1]:
            return forced[2]
        ok = all(f[field] == value for field, value in needs) and (unless is None or f[unless[0]] != unless[1])
        return v if ok else f[name] if default is None else default
    return Param(name, choices, decode=decode, only_if=("backend", "gluon"))


def backend_param(choices: tuple = ("triton", "gluon")) -> Param:
    """backend; a suggested "gluon" becomes "triton" for a dtype / head dims Gluon does not implement."""
    return Param("backend", choices, decode=lambda v, f: v if v == "triton" or _gluon_implements(f) else "triton")


def _gluon_implements(f: Mapping[str, Any]) -> bool:
    return f["dtype"] == "fp8" and (f["head_dim_qk"], f["head_dim_v"]) in GLUON_HEAD_DIMS


# ---- static feasibility ------------------------------------------------------------------------

def _elem_bytes(dtype: str) -> int:
    return 1 if dtype == "fp8" else 2


#: Shared memory beyond the tiles with TMA loads: mbarriers and the 1024-byte alignment of the
#: swizzled TMA buffers (measured +32..+1024 B beyond the tiles).
TMA_SMEM_MARGIN = 1024


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
    q = c.block_m * c.head_dim_qk * e
    k = c.block_n * c.head_dim_qk * e * c.num_stages
    v_tile = c.block_n * c.head_dim_v * e
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
    """
    threads = 32 * c.num_warps
    acc = c.block_m * c.head_dim_v // threads
    scores = c.block_m * c.block_n // threads
    return acc + scores + scores // 4 + REGISTER_OVERHEAD


def register_limit(c: KernelConfig) -> int:
    return c.maxnreg or MAX_REGISTERS


def gluon_smem_estimate(c: KernelConfig) -> int:
    """Shared memory (bytes) of a Gluon kernel: the Q ring (q_stages x block_m x 128), the K and V^T
    rings (2 x num_stages x block_n x 128), one 64 x 128 bf16 output tile per consumer warpgroup,
    lean P's (8, block_n) e4m3 ones tile per consumer warpgroup, barriers and swizzle alignment
    (TMA_SMEM_MARGIN), with v_layout="natural" the two (block_n, head_dim_v) slots V is loaded into,
    and with p_carry="smem" / "smem2" one / two (64, block_n) e4m3 P tiles per consumer warpgroup (with
    "smem2" the output tile in the first where it fits).
    Exact to within the margin (compiled: 147920 B for the default against 148480 estimated; 150000 B
    for its lean P variant)."""
    q = c.q_stages * c.block_m * c.head_dim_qk
    dp = sum(gluon_o_parts(c))  # V^T and O tiles: padded to a power of two (96 -> 128), or 64 + 32
    kv = c.num_stages * c.block_n * (c.head_dim_qk + dp)
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
#: 128 (at 256: 16 bytes) unless it also reads a tile table (q_order="balanced": 8 bytes, session 7)
NATURAL_V_PRODUCER_REGS = 40
#: Fixed part of a Gluon consumer's registers: row statistics, loop state, addresses, barriers.
GLUON_REGISTER_OVERHEAD = 24
#: Extra registers each of three consumer warpgroups (block_m=192, 160 registers each) needs at head
#: dim 128 and up: with 128-key blocks (estimated 152) they spilled 48-80 bytes with or without
#: overlap, v_permute, rowsum="mma" or skip_rescale; 64-key blocks (estimated 120-128) did not, nor did
#: head dim 64 with 128-key blocks (estimated 148; session 5). With P through two shared tiles (no P
#: in registers) and the row sums in fp32 they fit (hd128, 128-key blocks: 152, no spill with or without
#: the output through the P tiles, late_rescale, skip_rescale, 4 stages, a Q ring of 2) at 160, but not at
#: 152 (producer_regs=56: 512 bytes, wgmmas serialised): GLUON_THREE_CONSUMER_TWO_TILE_REGISTERS; with
#: the row-sum MMA they still spill (48 bytes; session 20)
GLUON_THREE_CONSUMER_REGISTERS = 24
GLUON_THREE_CONSUMER_TWO_TILE_REGISTERS = 8
#: Extra registers of an overlapped 192-key block (two key parts, two accumulators): at 240 per
#: consumer none spilled, at 224 (producer_regs=56) 40 bytes did with the estimate at 208 (session 5).
#: Three consumers need them without overlap too: at hd64 their plain 192-key step spilled 64-80 bytes
#: at 160 (estimated 152) and 160-224 with the wgmmas serialised at 152 (session 20, compile sweep)
GLUON_SPLIT_REGISTERS = 24
#: Extra registers at head dims 192/128 (Q and K in three column parts) with overlap and the row-sum
#: MMA: one consumer with 256-key blocks spilled 64 bytes at an estimated 248 of 256 (hd128: none;
#: rowsum="fp32": none; session 5)
GLUON_MLA_MMA_REGISTERS = 16
#: Extra registers a Gluon consumer needs at head dims 64 and 256 with the packed P carried (measured)
GLUON_OTHER_DIM_REGISTERS = 12
#: Extra registers of the plain step (no overlap, no pv_defer) at head dim 256 on 128-key blocks (a
#: 64 x 256 accumulator beside 64 x 128 scores, estimated 216): it spilled 8-32 bytes at 224 and 232
#: per consumer (producer_regs 56 / 40, with or without ping-pong, half_block, skip_rescale, lane sums)
#: and none at 240; with the row-sum MMA 24 bytes at 240 too (session 20, a random sweep of the hd256
#: space: 3 of 80 feasible points spilled, this one and two at the estimate's edge)
GLUON_WIDE_PLAIN_REGISTERS = 24
GLUON_WIDE_PLAIN_MMA_REGISTERS = 8
#: Extra registers of a 256-key pv_defer block (two 128-key parts, the second QK^T issued after the PV
#: wait, so the scores never share the registers with the P in flight). Such a block always rescales O
#: in place (inline PTX, emit_gluon.rescale_in_place): so it compiled without spills at 240 per
#: consumer (rowsum fp32 / mma, with or without ping-pong, v_permute or skip_rescale) and spilled 16
#: bytes at 232; rescaled by a multiply (a second copy of O) it had spilled 64-152 bytes (session 7,
#: causal; non-causal kernels may spill and are left to the tuner's compile check)
GLUON_SPLIT_DEFER_REGISTERS = 8
#: Extra registers of one consumer warpgroup (block_m=64, the 256-register maximum) that reads the
#: balanced tile table: its 256-key overlapped kernels (estimated 248) spilled 8 bytes with the table and
#: none in round robin; no two- or three-consumer calibration row changed (session 7, 48 compiles)
GLUON_ONE_CONSUMER_TABLE_REGISTERS = 16
#: Extra registers of pv_defer with the row-sum MMA: at head dim 256 with 128-key blocks (estimated
#: 232) rowsum="fp32" did not spill at 240 registers and "mma" spilled 32-40 bytes; at 224 both spilled
#: 120-160 (session 6, 64 compiles over head dims 64 / 256)
GLUON_DEFER_MMA_REGISTERS = 16
#: Extra registers of two P tiles (p_carry="smem2") with the row-sum MMA where accumulator and scores take
#: 192 registers (hd128 at 256 keys, hd256 at 128): at hd128 (estimated 216 without it) the exact softmax
#: spilled 48-64 bytes and lean P 32 (session 17); at hd256 with the output through the P tiles (228)
#: 32-40 bytes (session 19); rowsum="fp32": none
GLUON_TWO_TILE_MMA_REGISTERS = 32


#: Extra registers of three consumer warpgroups (160 registers each) carrying P as float32 with O in two
#: parts (o_split, head dim 96): 3 of 4 such kernels spilled 24-32 bytes (estimated 152 without this
#: term; ping-pong with the row-sum MMA and skip_rescale did not and is rejected with them), while every
#: packed-P (p_carry="e4m3") one compiled clean (session 13, 50 compiles over head dim 96)
GLUON_SPLIT_O_F32_THREE_REGISTERS = 16
#: Extra registers of those three consumers (o_split) without the key permutation (v_permute=False:
#: P reaches the PV wgmma through a layout conversion): all 4 compiled spilled 8-40 bytes at an
#: estimated 136, overlap or not; with the permutation none did (session 13)
GLUON_SPLIT_O_NO_PERM_THREE_REGISTERS = 32


def gluon_register_estimate(c: KernelConfig) -> int:
    """Registers per thread a Gluon consumer warpgroup needs at least: its 64 x head_dim fp32
    accumulator, the 64 x block_n fp32 scores and, with overlap, the previous block's P carried into
    the next step: packed four e4m3 to a register with v_permute (block_n / 8), else as separate
    bytes plus the shuffles' temporaries (block_n / 2 + 16); p_carry="smem" counts the same packed
    words (live until they are stored: 256 keys, estimated 248, spilled 16 bytes; 128 keys did not,
    session 10); + GLUON_REGISTER_OVERHEAD. pv_defer
    holds the same P in flight under QK^T(j) (session 6: at 256 keys, estimated 248 of 240, it
    spilled 96-184 bytes and ptxas serialised every wgmma; 128 and 192 keys did not spill).
    Calibrated on compile_for_target over block_n 64/128/256 x overlap x v_permute x producer_regs
    24/56 x one or two consumers (36 configs; tests/test_gluon_compile.py keeps the decisive ones):
    it rejected every config that spilled and none that did not. Head dims 64 and 256 with the
    packed P carried (overlap, v_permute) need GLUON_OTHER_DIM_REGISTERS more: without them a 256 x
    128-key and a 64 x 256-key (producer_regs=56) config passed and spilled 48 and 8 bytes, while the
    same term on head dim 128 would reject a 256-key one-consumer config that fits (7 more compiles,
    tests/test_gluon_compile.py CALIBRATION). Head dim 96 counts its accumulator as 128 columns
    (padded) or 64 + 32 (o_split, without the other-dims term: three consumers and 256-key overlapped
    blocks compile clean at 152 and 232; GLUON_SPLIT_O_F32_THREE_REGISTERS). Two P tiles with the row-sum MMA
    beside 192 registers of accumulator and scores: GLUON_TWO_TILE_MMA_REGISTERS."""
    dp = sum(gluon_o_parts(c))  # the accumulators' columns (96 -> 128, or 64 + 32)
    acc = 64 * dp // 128
    scores = 64 * c.block_n // 128
    # (two P tiles: P(j) is stored as the softmax makes it, before the PV(j-1) wait, and carried in no register)
    carried = (0 if not (c.overlap or c.pv_defer) or p_tiles(c) == 2
               else scores // 4 if c.v_permute else scores + 16)
    other_dim = GLUON_OTHER_DIM_REGISTERS if c.overlap and c.v_permute and dp != 128 and not c.o_split else 0
    three_split_o = c.o_split and c.block_m == 192  # (o_split's own terms for three consumers)
    split_o = ((GLUON_SPLIT_O_F32_THREE_REGISTERS if three_split_o and c.overlap and c.p_carry == "f32" else 0)
               + (GLUON_SPLIT_O_NO_PERM_THREE_REGISTERS if three_split_o and not c.v_permute else 0))
    defer_mma = GLUON_DEFER_MMA_REGISTERS if c.pv_defer and c.rowsum == "mma" else 0
    two_tile_mma = GLUON_TWO_TILE_MMA_REGISTERS if p_tiles(c) == 2 and acc + scores >= 192 and c.rowsum == "mma" else 0
    three = 0 if c.block_m != 192 or dp < 128 else (
        GLUON_THREE_CONSUMER_TWO_TILE_REGISTERS if p_tiles(c) == 2 and c.rowsum == "fp32"
        else GLUON_THREE_CONSUMER_REGISTERS)
    split = GLUON_SPLIT_REGISTERS if c.block_n == 192 and (c.overlap or c.block_m == 192) else 0
    mla = GLUON_MLA_MMA_REGISTERS if c.head_dim_qk == 192 and c.overlap and c.rowsum == "mma" else 0
    table = GLUON_ONE_CONSUMER_TABLE_REGISTERS if c.block_m == 64 and c.q_order == "balanced" else 0
    wide_plain = (GLUON_WIDE_PLAIN_REGISTERS + (GLUON_WIDE_PLAIN_MMA_REGISTERS if c.rowsum == "mma" else 0)
                  if dp == 256 and c.block_n >= 128 and not (c.overlap or c.pv_defer) else 0)
    if c.pv_defer and c.block_n == 256:  # peak at the softmax: no P in flight beside the scores, O in place
        return acc + scores + defer_mma + table + GLUON_SPLIT_DEFER_REGISTERS + GLUON_REGISTER_OVERHEAD
    return (acc + scores + carried + other_dim + three + split + mla + defer_mma + two_tile_mma + table + split_o
            + wide_plain + GLUON_REGISTER_OVERHEAD)


def gluon_infeasibility(c: KernelConfig) -> str | None:
    """Why a Gluon config cannot compile to a usable kernel (TMA boxes, shared memory, registers per
    role: the consumers' setmaxnreg share), or None."""
    if c.block_n & (c.block_n - 1) and c.block_n != 192:
        return (f"TMA: block_n={c.block_n} must be a power of two (the V^T box is [128, block_n]) or 192 "
                f"(128 + 64 key parts)")
    smem = gluon_smem_estimate(c)
    if smem > SMEM_LIMIT:
        return (f"shared memory: about {smem} B (Q ring {c.q_stages}, K/V ring {c.num_stages} x {c.block_n} keys, "
                f"output tiles) > {SMEM_LIMIT} B (227 KiB)")
    consumer, producer = gluon_registers(c)
    if c.v_layout == "natural" and producer < NATURAL_V_PRODUCER_REGS and (
            c.block_m > 64 or c.block_n > 128 or c.head_dim_v > 128 or c.q_order == "balanced"):
        return (f"registers: the producer warpgroup transposes V (v_layout='natural') and spills at "
                f"producer_regs={producer} (block_m={c.block_m}, block_n={c.block_n}, head_dim_v="
                f"{c.head_dim_v}, q_order={c.q_order!r}); it needs {NATURAL_V_PRODUCER_REGS}")
    need = gluon_register_estimate(c)
    if need > consumer:
        return (f"registers: a consumer warpgroup needs about {need} per thread (accumulator, scores"
                f"{', carried P' if c.overlap or c.pv_defer else ''}) > its {consumer} (producer_regs={c.producer_regs}): "
                f"it would spill")
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
        return (f"wgmma: block_m={c.block_m} with num_warps={c.num_warps} gives a warpgroup fewer than 64 "
                f"query rows (block_m must be a multiple of {wg_rows}, one 64-row slice per warpgroup)")
    min_n = 32 if c.dtype == "fp8" else 16
    if c.block_n % 16 or c.block_n < min_n:
        return (f"wgmma: block_n={c.block_n} must be a multiple of 16 and >= {min_n} for {c.dtype} "
                f"(the k dimension of P@V)")
    smem = smem_estimate(c)
    if smem > SMEM_LIMIT:
        return (f"shared memory: about {smem} B (Q, {c.num_stages} stages of K and V"
                f"{', ones tile' if c.rowsum == 'mma' else ''}) > {SMEM_LIMIT} B (227 KiB)")
    regs, limit = register_estimate(c), register_limit(c)
    if regs > limit:
        return (f"registers: about {regs} per thread (accumulators, scores, P) > "
                f"{'maxnreg=' + str(c.maxnreg) if c.maxnreg else str(MAX_REGISTERS)}: it would spill")
    return None


# ---- the search space --------------------------------------------------------------------------

class SearchSpace:
    """The searched parameters of one kernel family; see the module doc for how trials map."""

    def __init__(self, family: str, dtype: str, params: Sequence[Param],
                 extra_seeds: Sequence[Callable[[str, int, int], KernelConfig]] = (),
                 winner_twins: Callable[[KernelConfig], Sequence[KernelConfig]] = lambda config: (),
                 loose_seeds: Sequence[Callable[[str, int, int], KernelConfig]] = ()):
        if dtype not in CHOICES["dtype"]:
            raise ValueError(f"dtype: {dtype!r} is not one of {list(CHOICES['dtype'])}")
        self.family = family
        self.dtype = dtype
        self.params: tuple[Param, ...] = tuple(params)
        self.extra_seeds = tuple(extra_seeds)
        self.winner_twins = winner_twins
        self.loose_seeds = tuple(loose_seeds)
        _check_params(self.params)

    def __repr__(self) -> str:
        return f"SearchSpace({self.family!r}, {[p.key for p in self.params]})"

    # ---- configs ---------------------------------------------------------------------------
    def base(self, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
        """The family's safe default for these head dims (ConfigError for unsupported ones)."""
        return default_config(self.dtype, head_dim_qk, head_dim_v)

    def config_from(self, values: Mapping[str, object], head_dim_qk: int, head_dim_v: int) -> KernelConfig:
        """base() with these fields replaced; ConfigError if a name or the result is invalid."""
        base = self.base(head_dim_qk, head_dim_v)
        unknown = sorted(str(k) for k in values if k not in _FIELDS)
        if unknown:
            raise ConfigError(f"unknown config fields: {unknown}")
        fixed = sorted(k for k in values if k in _PROBLEM_FIELDS and values[k] != getattr(base, k))
        if fixed:
            raise ConfigError(f"{fixed} are fixed by the search space {self.family} and the head dims")
        return base.replace(**dict(values))

    def canonical(self, config: KernelConfig) -> KernelConfig:
        """`config` with every irrelevant searched field (see Param.only_if) at the default's value:
        the config `suggest` produces for the same kernel."""
        base = self.base(config.head_dim_qk, config.head_dim_v)
        current = config.all_fields()
        changes = {p.name: getattr(base, p.name) for p in self.params if not p.relevant(current)}
        return config.replace(**changes) if changes else config

    # ---- Optuna ----------------------------------------------------------------------------
    def suggest(self, trial: "optuna.Trial", head_dim_qk: int, head_dim_v: int) -> KernelConfig | None:
        """Suggest every param on `trial` and build the config; None (with the trial's user attr
        "infeasible" set to the reason) when the point is invalid or statically infeasible.
        Unsupported head dims are the caller's error: ConfigError."""
        self.base(head_dim_qk, head_dim_v)
        options = {p.key: trial.suggest_categorical(p.key, list(p.suggest_choices)) for p in self.params}
        try:
            config = self._from_options(options, head_dim_qk, head_dim_v)
        except ConfigError as exc:
            trial.set_user_attr("infeasible", f"invalid: {exc}")
            return None
        reason = self.feasible(config)
        if reason is not None:
            trial.set_user_attr("infeasible", reason)
            return None
        return config

    def as_optuna_params(self, config: KernelConfig) -> dict:
        """The `suggest` parameters that reproduce `config` (for study.enqueue_trial). Irrelevant
        fields (Param.only_if) are reproduced at the default's value; ValueError if `config` is not a
        point of this space (another dtype, a value outside a param's choices, an unsearched field
        away from the default)."""
        if not isinstance(config, KernelConfig):
            raise TypeError(f"as_optuna_params() takes a KernelConfig, got {type(config).__name__}")
        if config.dtype != self.dtype:
            raise ValueError(f"{self.family}: config has dtype {config.dtype!r}, this space is {self.dtype!r}")
        target = self.canonical(config)
        out = {}
        for p in self.params:
            value = getattr(config, p.name)
            if value not in p.choices:
                raise ValueError(f"{self.family}: {p.name}={value!r} is not one of the searched {list(p.choices)}")
            out[p.key] = p.to_option(value, config)
        try:
            again = self._from_options(out, config.head_dim_qk, config.head_dim_v)
        except ConfigError as exc:
            raise ValueError(f"{self.family}: config is not a point of this space: {exc}") from exc
        if again != target:
            diff = sorted(k for k, v in target.all_fields().items() if getattr(again, k) != v)
            raise ValueError(f"{self.family}: config is not a point of this space: {diff} are not searched "
                             f"here and differ from the default")
        return out

    def _from_options(self, options: Mapping[str, Any], head_dim_qk: int, head_dim_v: int) -> KernelConfig:
        so_far = self.base(head_dim_qk, head_dim_v).all_fields()
        base = dict(so_far)
        values = {}
        for p in self.params:
            option = options[p.key]
            if option not in p.suggest_choices:
                raise ConfigError(f"{p.key}: {option!r} is not one of {list(p.suggest_choices)}")
            values[p.name] = so_far[p.name] = p.to_field(option, so_far)
        for p in self.params:  # irrelevant fields take the default's value (seen by the params after it)
            if not p.relevant(so_far):
                values[p.name] = so_far[p.name] = base[p.name]
        return self.config_from(values, head_dim_qk, head_dim_v)

    # ---- pruning and seeds -----------------------------------------------------------------
    def neighbours(self, config: KernelConfig) -> list[KernelConfig]:
        """The feasible points of the space one suggested option away from `config` (deduplicated,
        `config` excluded), in parameter order: the tuner's local moves when its sampler keeps
        proposing configs it has measured."""
        options = self.as_optuna_params(config)
        out: list[KernelConfig] = []
        for p in self.params:
            for option in p.suggest_choices:
                if option == options[p.key]:
                    continue
                try:
                    near = self._from_options({**options, p.key: option}, config.head_dim_qk, config.head_dim_v)
                except ConfigError:
                    continue
                if near != config and near not in out and self.feasible(near) is None:
                    out.append(near)
        return out

    def feasible(self, config: KernelConfig) -> str | None:
        """A human reason why `config` is statically infeasible (before any compile), or None."""
        if config.dtype != self.dtype:
            return f"{self.family} searches dtype {self.dtype!r}, not {config.dtype!r}"
        return static_infeasibility(config)

    def seeds(self, head_dim_qk: int, head_dim_v: int, *,
              databases: Iterable[str | os.PathLike] | None = None, loose: bool = False) -> list[KernelConfig]:
        """Known-good configs to enqueue first: the default, the family's extra seeds (`extra_seeds`:
        the Gluon backend's default where it implements the head dims), then the best configs of
        these head dims in `databases` (default: SEED_DATABASES, the shipped H200 database), most
        problem classes won first, then each winner's `winner_twins` (the family's variants of a
        winner with a field it was tuned before: measured gains a short study would not sample).
        loose: also the family's `loose_seeds` (configs whose error passes only a looser accuracy gate
        than the default, such as lean P at ~1.35x the exact error), last, for a study whose gate or
        Pareto front has room for them.
        Rows that fail validation, are not causal, are not points of this space or are statically
        infeasible are skipped; the list is deduplicated (after `canonical`)."""
        base = self.base(head_dim_qk, head_dim_v)
        wins: Counter[KernelConfig] = Counter()
        for path in (SEED_DATABASES if databases is None else databases):
            for config, _ in self.stored_bests(path, head_dim_qk, head_dim_v):
                wins[config] += 1
        out = [base]
        for config in self._made(self.extra_seeds, head_dim_qk, head_dim_v):
            if config not in out and self.feasible(config) is None:
                out.append(config)
        winners = [config for config, _ in sorted(wins.items(), key=lambda kv: -kv[1])]  # stable on ties
        twins = [twin for config in winners for twin in self.winner_twins(config)]
        extra = self._made(self.loose_seeds, head_dim_qk, head_dim_v) if loose else []
        for config in winners + twins + extra:
            if config in out:
                continue
            try:
                self.as_optuna_params(config)
            except ValueError as exc:
                log.debug("seed skipped: %s", exc)
                continue
            reason = self.feasible(config)
            if reason is not None:
                log.debug("seed skipped: %s", reason)
                continue
            out.append(config)
        return out

    def _made(self, makers: Sequence[Callable[[str, int, int], KernelConfig]], head_dim_qk: int,
              head_dim_v: int) -> list[KernelConfig]:
        """The configs these seed makers build for the head dims (a maker raising ConfigError does not
        implement them and is left out)."""
        out = []
        for make in makers:
            try:
                out.append(make(self.dtype, head_dim_qk, head_dim_v))
            except ConfigError:
                continue
        return out

    def stored_bests(self, database: str | os.PathLike, head_dim_qk: int, head_dim_v: int, *, causal: bool = True,
                     required: bool = False) -> list[tuple[KernelConfig, float | None]]:
        """(config, TFLOP/s) of each best entry a tuning database (path or URL) holds for this family's
        dtype, these head dims and `causal`, in the database's order, each config validated
        (`KernelConfig.from_json`: an invalid one is skipped with a warning) and canonical. The seeds'
        winners and the tuner's warm start both come from here. A database that is missing or does not
        open is skipped with a log line, or with `required` raises the DatabaseError."""
        from zyfa_tune.db import DatabaseError, open_store

        if not required and not Path(database).exists():
            log.info("seed database %s does not exist", database)
            return []
        try:
            with open_store(database, readonly=True, create=False) as store:
                entries = store.best_entries(head_dims=(head_dim_qk, head_dim_v), dtype=self.dtype)
        except DatabaseError as exc:
            if required:
                raise
            log.warning("seed database skipped: %s", exc)
            return []
        out = []
        for entry in entries:
            if entry.key.causal != causal:
                continue
            try:
                config = self.canonical(KernelConfig.from_json(entry.config_json))
            except ConfigError as exc:
                log.warning("%s: skipping an invalid best config: %s", database, exc)
                continue
            if entry.backend != config.backend:
                log.warning("%s: skipping a best config stored under backend %r", database, entry.backend)
                continue
            if (config.dtype, config.head_dim_qk, config.head_dim_v) != (self.dtype, head_dim_qk, head_dim_v):
                continue
            out.append((config, entry.tflops))
        return out


def _check_params(params: tuple[Param, ...]) -> None:
    """Every param is a searchable KernelConfig field with allowed, plain choices."""
    names, keys = set(), set()
    for p in params:
        if not isinstance(p, Param):
            raise TypeError(f"params must be Param, got {type(p).__name__}")
        if p.name not in _FIELDS or p.name in _PROBLEM_FIELDS:
            raise ValueError(f"{p.name!r} is not a searchable KernelConfig field")
        if p.name in names or p.key in keys:
            raise ValueError(f"{p.name!r} is declared twice")
        names.add(p.name)
        keys.add(p.key)
        if not p.choices or any(v not in CHOICES[p.name] or type(v) is not type(CHOICES[p.name][0])
                                for v in p.choices):
            raise ValueError(f"{p.name}: choices {list(p.choices)} are not all in {list(CHOICES[p.name])}")
        if len(set(p.suggest_choices)) != len(p.suggest_choices) or not all(
                type(v) in _PLAIN for v in p.suggest_choices):
            raise ValueError(f"{p.key}: Optuna choices must be distinct plain values: {list(p.suggest_choices)}")
        if p.only_if is not None and p.only_if[0] not in _FIELDS:
            raise ValueError(f"{p.name}: only_if names an unknown field {p.only_if[0]!r}")


#: Tile, warp, pipeline and register parameters shared by every family (one line each). Under
#: backend="gluon" block_m counts consumer warpgroups (64 rows each) and num_stages the K/V ring.
BLOCK_N = (64, 128, 256)   # 256: Gluon without overlap (session 4: its best exact hd128 kernels)
TILE_PARAMS = (
    Param("block_m", (64, 128)),
    Param("block_n", BLOCK_N),
    triton_only(Param("num_warps", (4, 8))),
    Param("num_stages", (2, 3, 4)),
    triton_only(Param("maxnreg", (0, 168, 200))),
)
