"""`Param`: one searched `KernelConfig` field, and the helpers a family module declares its fields with.

A family module (fp8_causal.py, bf16_causal.py) declares one `Param` per searched `KernelConfig`
field; everything else comes from the family's safe default (`generator.defaults.default_config`),
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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from zyfa_tune.generator import CHOICES, KernelConfig
from zyfa_tune.generator.rules import gluon_head_dim_conflict

FIELDS = tuple(f.name for f in fields(KernelConfig))
#: Fields that are the problem, not the kernel: never searched.
PROBLEM_FIELDS = ("dtype", "head_dim_qk", "head_dim_v")
#: The types Optuna accepts as categorical choices.
_PLAIN = (bool, int, float, str, type(None))

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
    return Param(
        "scale_block",
        (0,) + tuple(block_n_choices),
        label="scale_per_tile",
        options=(False, True),
        decode=lambda on, f: f["block_n"] if on else 0,
        encode=lambda value, config: value != 0,
    )


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


def gluon_only(
    name: str,
    choices: tuple,
    *,
    one_consumer: Any = None,
    needs: tuple[tuple[str, Any], ...] = (),
    unless: tuple[str, Any] | None = None,
    default: Any = None,
    forced: tuple[str, Any, Any] | None = None,
) -> Param:
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
    return f["dtype"] == "fp8" and gluon_head_dim_conflict({**f, "v_layout": "transposed"}) is None


def check_params(params: tuple[Param, ...]) -> None:
    """Every param is a searchable KernelConfig field with allowed, plain choices."""
    names, keys = set(), set()
    for p in params:
        if not isinstance(p, Param):
            raise TypeError(f"params must be Param, got {type(p).__name__}")
        if p.name not in FIELDS or p.name in PROBLEM_FIELDS:
            raise ValueError(f"{p.name!r} is not a searchable KernelConfig field")
        if p.name in names or p.key in keys:
            raise ValueError(f"{p.name!r} is declared twice")
        names.add(p.name)
        keys.add(p.key)
        if not p.choices or any(v not in CHOICES[p.name] or type(v) is not type(CHOICES[p.name][0]) for v in p.choices):
            raise ValueError(f"{p.name}: choices {list(p.choices)} are not all in {list(CHOICES[p.name])}")
        if len(set(p.suggest_choices)) != len(p.suggest_choices) or not all(
            type(v) in _PLAIN for v in p.suggest_choices
        ):
            raise ValueError(f"{p.key}: Optuna choices must be distinct plain values: {list(p.suggest_choices)}")
        if p.only_if is not None and p.only_if[0] not in FIELDS:
            raise ValueError(f"{p.name}: only_if names an unknown field {p.only_if[0]!r}")


#: Tile, warp, pipeline and register parameters shared by every family (one line each). Under
#: backend="gluon" block_m counts consumer warpgroups (64 rows each) and num_stages the K/V ring.
BLOCK_N = (64, 128, 256)  # 256: Gluon without overlap (its fastest exact hd128 kernels)
TILE_PARAMS = (
    Param("block_m", (64, 128)),
    Param("block_n", BLOCK_N),
    triton_only(Param("num_warps", (4, 8))),
    Param("num_stages", (2, 3, 4)),
    triton_only(Param("maxnreg", (0, 168, 200))),
)
