"""The memory-traffic systems of `--quant-floor`: `quantize_fp8` alone with one recipe (on packed
sequences `quantize_fp8_varlen`, the packed quantiser), and the device-to-device copy of the same bytes
whose rate makes the floor (`bench.traffic`). They run in the timing rounds beside the attention
systems; their rows carry bytes, GB/s and time / floor instead of TFLOP/s and an error."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from zyfa_tune.bench.inputs import QUANT_MODES, Inputs
from zyfa_tune.bench.peers.base import Bound
from zyfa_tune.bench.shape import BenchShape
from zyfa_tune.bench.traffic import traffic_bytes
from zyfa_tune.generator.recipe import PLAIN, Recipe

#: recipes whose quantiser every `--quant-floor` run times: the plain one (FA3's users'), V written
#: keys-fastest, V rounded balanced, K smoothed and Q, K rotated
FLOOR_RECIPES = (
    PLAIN,
    Recipe(v_layout="k_major"),
    Recipe(v_rounding="balanced"),
    Recipe(smooth_k=True, hadamard=True),
)
_RECIPE_FIELDS = tuple(f.name for f in fields(Recipe))


def _normal(options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """`quantize_fp8` keywords with the plain recipe's defaults filled in: equal options, equal tuples."""
    return tuple(sorted({**PLAIN.quantize_kwargs(), **options}.items()))


def recipe_label(options: dict[str, Any]) -> str:
    """A row's recipe: `Recipe.summary` of the options, with balanced V's kappa where one is given."""
    text = Recipe(**{k: options[k] for k in _RECIPE_FIELDS if k in options}).summary()
    if options.get("v_weight") is not None:
        text += f" v_weight={options['v_weight']:g}"
    return text


@dataclass(frozen=True)
class Quantiser:
    """`quantize_fp8(q, k, v, **options)` on the bf16 inputs; with `from_attention`, the recipe
    `zyfa_tune.attention` picks for them (`explain_attention`), resolved where it binds."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    from_attention: bool = False
    dtype: ClassVar[str] = "fp8"
    kind: ClassVar[str] = "quantiser"
    quant_modes: ClassVar[tuple[str, ...]] = QUANT_MODES

    def supports(self, shape: BenchShape) -> bool:
        return not shape.lengths

    def prepare(self, x: Inputs) -> Bound:
        from zyfa_tune.quantize import quantize_fp8

        q, k, v = x.q16, x.k16, x.v16
        options = dict(self.options)
        if self.from_attention:
            from zyfa_tune.attention import explain_attention

            options = explain_attention(q, k, v, causal=True).recipe.quantize_kwargs()
        return Bound(
            lambda: quantize_fp8(q, k, v, **options),
            None,
            recipe=recipe_label(options),
            bytes_moved=traffic_bytes(x.shape, q.element_size()),
        )


@dataclass(frozen=True)
class PackedQuantiser:
    """`quantize_fp8_varlen` on packed sequences' bf16 inputs (its one recipe, plain): the same bytes
    as `quantize_fp8` on the same tokens, but a descale per (sequence, kv head)."""

    name: str = "quant:varlen"
    dtype: ClassVar[str] = "fp8"
    kind: ClassVar[str] = "quantiser"
    quant_modes: ClassVar[tuple[str, ...]] = QUANT_MODES

    def supports(self, shape: BenchShape) -> bool:
        return bool(shape.lengths)

    def prepare(self, x: Inputs) -> Bound:
        from zyfa_tune.quantize import quantize_fp8_varlen

        q, k, v = x.q16[0], x.k16[0], x.v16[0]
        cu, _ = x.packed_bounds()
        return Bound(
            lambda: quantize_fp8_varlen(q, k, v, cu, cu),
            None,
            recipe=PLAIN.summary(),
            bytes_moved=traffic_bytes(x.shape, q.element_size()),
        )


@dataclass(frozen=True)
class Copy:
    """`dst.copy_(src)` of uint8 buffers half the quantiser's traffic long: its reads plus writes are
    the bytes a quantiser moves, so its rate is the floor's (what the GPU's memory does now)."""

    name: str = "copy"
    dtype: ClassVar[str] = "fp8"
    kind: ClassVar[str] = "copy"
    quant_modes: ClassVar[tuple[str, ...]] = QUANT_MODES

    def supports(self, shape: BenchShape) -> bool:
        return True

    def prepare(self, x: Inputs) -> Bound:
        half = traffic_bytes(x.shape, x.q16.element_size()) // 2
        src = torch.ones(half, dtype=torch.uint8, device=x.q16.device)
        dst = torch.empty_like(src)
        return Bound(lambda: dst.copy_(src), None, bytes_moved=2 * half)


def floor_systems(extra: Iterable[dict[str, Any]] = (), attention: bool = False) -> list[Quantiser | Copy]:
    """The quantisers of FLOOR_RECIPES, then those of `extra` option sets (`--ours` quantisation
    options as `quantize_fp8` keywords) not among them, then `attention`'s where it is benched, and
    the copy last."""
    seen: dict[tuple, Quantiser] = {}
    for options in [r.quantize_kwargs() for r in FLOOR_RECIPES] + [dict(o) for o in extra]:
        key = _normal(options)
        if key not in seen:
            seen[key] = Quantiser("quant:" + recipe_label(options).replace(" ", "+"), key)
    systems: list[Quantiser | Copy] = list(seen.values())
    if attention:
        systems.append(Quantiser("quant:ours-attention", from_attention=True))
    return [*systems, Copy()]


def packed_floor_systems() -> list[PackedQuantiser | Copy]:
    """Packed sequences' floor rows: the packed quantiser, then the copy of its bytes."""
    return [PackedQuantiser(), Copy()]
