"""What a worker is asked to measure (a config's JSON on a tuple of shapes, with the inputs, gate, API
and quantisation recipe)
and how a runner answers it (the `Reporter` protocol, messages cut to a bounded tail)."""

from __future__ import annotations

import math
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Protocol

from zyfa_tune.db.checks import strict_int
from zyfa_tune.db.keys import APIS, ProblemKey
from zyfa_tune.db.validity import check_recipe

from .inputs import check_input_family
from .lengths import check_lengths

#: characters of an error / traceback kept in TrialResult.message
MESSAGE_CHARS = 2000


@dataclass(frozen=True)
class Shape:
    """A rectangular (batch, seqlen) problem, or with `lengths` packed sequences of those lengths
    (`flash_attn_varlen_func`): batch is then their number and seqlen the longest (`Shape.packed`)."""

    batch: int
    heads: int
    kv_heads: int
    seqlen: int
    lengths: tuple[int, ...] = field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "kv_heads", "seqlen"):
            object.__setattr__(self, name, strict_int(name, getattr(self, name), lo=1))
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: {self.kv_heads} does not divide heads={self.heads}")
        if self.lengths != ():
            check_lengths(self.lengths, "lengths")
            object.__setattr__(self, "lengths", tuple(self.lengths))
            if (self.batch, self.seqlen) != (len(self.lengths), max(self.lengths)):
                raise ValueError("lengths: batch must be their number and seqlen the longest (use Shape.packed)")

    @classmethod
    def packed(cls, lengths: tuple[int, ...], heads: int, kv_heads: int, **more: Any) -> "Shape":
        """Packed sequences of `lengths` (each >= 1); `more`: a subclass's fields."""
        check_lengths(lengths, "lengths")
        return cls(len(lengths), heads, kv_heads, max(lengths), lengths=tuple(lengths), **more)

    @property
    def tokens(self) -> int:
        """Query tokens of one call: every sequence's, or batch x seqlen."""
        return sum(self.lengths) if self.lengths else self.batch * self.seqlen

    def __str__(self) -> str:
        kv = f"/{self.kv_heads}" if self.kv_heads != self.heads else ""
        if self.lengths:
            return f"varlen N={self.batch} T={self.tokens} max={self.seqlen} H={self.heads}{kv}"
        return f"B={self.batch} H={self.heads}{kv} S={self.seqlen}"


def shape_key(
    shape: Shape, dtype: str, head_dim_qk: int, head_dim_v: int, causal: bool, api: str = "fp8"
) -> ProblemKey:
    """The problem class a shape's results are stored under (packed sequences: by their tokens too)."""
    return ProblemKey.from_shape(
        dtype=dtype,
        head_dim_qk=head_dim_qk,
        head_dim_v=head_dim_v,
        causal=causal,
        batch=shape.batch,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        seqlen=shape.seqlen,
        api=api,
        tokens=shape.tokens if shape.lengths else None,
    )


@dataclass(frozen=True)
class Task:
    config_json: str  # KernelConfig.to_json(); the child re-validates it with from_json
    shapes: tuple[Shape, ...]
    causal: bool = True
    seed: int = 0  # input seed (fresh inputs per study/shape)
    gate: float = 1.25  # error gate vs the exact default (kernels.verify.DEFAULT_ERROR_GATE)
    reps: int = 20
    inputs: str | None = None  # captured activations (.pt / .safetensors) instead of random inputs
    input_family: str = "gaussian"  # random inputs' family (zyfa_tune.tuning.inputs)
    api: str = "fp8"  # "fp8": the kernel alone on plainly quantised codes; "bf16": the whole
    # call from bf16 inputs, quantiser (with `recipe`) and kernel, one timing
    recipe: str | None = None  # generator.recipe.Recipe JSON (bf16 API only; None: the plain recipe)

    def __post_init__(self) -> None:
        if self.inputs is not None and (type(self.inputs) is not str or not os.path.isfile(self.inputs)):
            raise ValueError(f"inputs: {self.inputs!r} is not a file")
        check_input_family(self.input_family, self.inputs, what="input_family")
        if type(self.config_json) is not str:
            raise ValueError(f"config_json: expected str, got {type(self.config_json).__name__}")
        shapes = tuple(self.shapes) if isinstance(self.shapes, (list, tuple)) else None
        if not shapes or not all(isinstance(s, Shape) for s in shapes):
            raise ValueError(f"shapes: expected a non-empty tuple of Shape, got {self.shapes!r:.200}")
        object.__setattr__(self, "shapes", shapes)
        if type(self.causal) is not bool:
            raise ValueError(f"causal: expected bool, got {type(self.causal).__name__}")
        if type(self.seed) is not int or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed: expected an int in [0, 2**63), got {self.seed!r}")
        if (
            isinstance(self.gate, bool)
            or not isinstance(self.gate, (int, float))
            or not math.isfinite(self.gate)
            or self.gate <= 0
        ):
            raise ValueError(f"gate: expected a positive finite number, got {self.gate!r}")
        object.__setattr__(self, "gate", float(self.gate))
        strict_int("reps", self.reps, lo=1)
        if type(self.api) is not str or self.api not in APIS:
            raise ValueError(f"api: {self.api!r} is not one of {list(APIS)}")
        object.__setattr__(self, "recipe", check_recipe(self.recipe))  # canonical text; ValueError if bad
        if self.recipe is not None and self.api != "bf16":
            raise ValueError("recipe: only bf16-API tasks quantise with a recipe")


class Reporter(Protocol):
    """What a runner reports to: the end of the config-independent set-up, then one result per shape."""

    def setup_done(self) -> None: ...
    def result(self, index: int, fields: dict[str, Any]) -> None: ...


def tail(text: str, limit: int = MESSAGE_CHARS) -> str:
    """The last `limit` characters of `text`, cut at a line start where possible."""
    text = text.strip()
    if len(text) <= limit:
        return text
    cut = text[-limit:]
    nl = cut.find("\n")
    return "..." + (cut[nl:] if 0 <= nl < limit // 2 else cut)


def exception_text(exc: BaseException, *, with_traceback: bool = True) -> str:
    """An exception as a message: its traceback's tail, or its type and text."""
    if with_traceback:
        return tail("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    return tail(f"{type(exc).__name__}: {exc}")


def task_flops(head_dim_qk: int, head_dim_v: int, shape: Shape, causal: bool) -> float:
    """FLOPs of one attention call at `shape` (TFLOP/s = this / time): packed sequences', each
    counted at its own length."""
    from .timing import attention_flops

    if shape.lengths:
        return sum(attention_flops(1, shape.heads, n, n, head_dim_qk, head_dim_v, causal) for n in shape.lengths)
    return attention_flops(shape.batch, shape.heads, shape.seqlen, shape.seqlen, head_dim_qk, head_dim_v, causal)
