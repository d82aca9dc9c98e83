"""Our systems: `flash_attn_func` through the dispatcher (what a user gets; its row says which tuned
entry ran) and forced configs (`--ours label:key=val,...`: the head dims' default config with those
fields changed, and/or `quantize_fp8` options), which run beside it on the same inputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zyfa_tune.bench.inputs import DTYPES, QUANT_MODES, QUANT_OPTIONS, Inputs
from zyfa_tune.bench.peers.base import Bound, boxed
from zyfa_tune.bench.shape import BenchShape
from zyfa_tune.generator import KernelConfig


@dataclass(frozen=True)
class OursSpec:
    """One of our systems: the dispatcher's choice (`overrides` None) or a forced config (the
    default config of the shape's head dims, of the backend the overrides name, with these fields
    changed: backend=gluon alone is the Gluon default)."""

    label: str
    dtype: str
    overrides: tuple[tuple[str, Any], ...] | None = None
    quant: tuple[tuple[str, Any], ...] = ()  # quantize_fp8 options (QUANT_OPTIONS), --quant native only

    def config_for(self, head_dim_qk: int, head_dim_v: int) -> KernelConfig | None:
        from zyfa_tune.generator.defaults import config_with

        if self.overrides is None:
            return None
        return config_with(self.dtype, head_dim_qk, head_dim_v, dict(self.overrides))


def _kappa(text: Any) -> float:
    """--ours v_weight=K as a float >= 0 (parse_changes leaves a number it cannot type as its text)."""
    try:
        kappa = float(text) if not isinstance(text, bool) else -1.0
    except ValueError:
        kappa = -1.0
    if not 0 <= kappa < float("inf"):
        raise ValueError(f"--ours: v_weight expects a number >= 0, got {text!r}")
    return kappa


def parse_ours(text: str, dtypes: Sequence[str]) -> list[OursSpec]:
    """'[label:]key=val,...' -> one forced config per benched dtype (only the named one if the text
    sets dtype=), labelled -<dtype> when there are several, so that the labels stay distinct."""
    label, sep, body = text.partition(":")
    if not sep or "=" in label:
        label, body = "", text
    from zyfa_tune.generator.defaults import parse_changes

    over = parse_changes([body], "--ours")
    named = over.pop("dtype", None)
    if named is not None and named not in DTYPES:
        raise ValueError(f"--ours: dtype={named!r} is not one of {list(DTYPES)}")
    quant = {k: over.pop(k) for k in QUANT_OPTIONS if k in over}
    for k, v in quant.items():
        if k == "v_weight":  # balanced V's kappa (quantize_fp8's v_weight), a number
            quant[k] = _kappa(v)
            if not quant.get("balanced_v"):
                raise ValueError("--ours: v_weight weighs balanced V's moves: add balanced_v=true")
        elif not isinstance(v, bool):
            raise ValueError(f"--ours: {k} expects true or false, got {v!r}")
    if quant and named != "fp8" and list(dtypes) != ["fp8"]:
        raise ValueError(f"--ours: {sorted(quant)} are FP8 quantisation options: add dtype=fp8")
    kinds = [named] if named else list(dtypes)
    base = label or "ours-" + (",".join(f"{k}={v}" for k, v in {**over, **quant}.items()) or "default")
    configs = tuple(over.items()) if over or not quant else None  # only quantisation: the dispatcher's kernel
    return [OursSpec(base if len(kinds) == 1 else f"{base}-{dt}", dt, configs, tuple(quant.items())) for dt in kinds]


def borrowed_from(choice) -> str | None:
    """Where the dispatcher's kernel was tuned when that was not this call's own problem class or GPU
    (a `kernels.dispatch.Choice` of source nearest / other-device), else None: a row that runs another
    shape's kernel says whose, so that a stale neighbour (an entry tuned before a faster kernel existed,
    borrowed by a longer sequence) shows in the table."""
    key, tuned = choice.key, choice.tuned_key
    if tuned is None or (tuned == key and choice.source == "exact"):
        return None
    where = f"tuned at seqlen<={tuned.seqlen_bucket} B*H<={tuned.bh_bucket}"
    if tuned.gqa_group != key.gqa_group:
        where += f" gqa={tuned.gqa_group}"
    return where + (f" on {choice.tuned_on}" if choice.source == "other-device" and choice.tuned_on else "")


@dataclass(frozen=True)
class Ours:
    """One `OursSpec` as a benched system: kind "ours" where the dispatcher picks, else "forced"."""

    spec: OursSpec

    @property
    def name(self) -> str:
        return self.spec.label

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def kind(self) -> str:
        return "ours" if self.spec.overrides is None else "forced"

    @property
    def quant_modes(self) -> tuple[str, ...]:
        return QUANT_MODES  # quantisation options need native or end-to-end: BenchPlan checks them

    def supports(self, shape: BenchShape) -> bool:
        return True

    def prepare(self, x: Inputs) -> Bound:
        from zyfa_tune.api import explain, flash_attn_func

        spec = self.spec
        config = spec.config_for(x.shape.head_dim_qk, x.shape.head_dim_v)
        call, output = boxed(
            x.call(spec.dtype, spec.quant, lambda *a, **kw: flash_attn_func(*a, causal=True, config=config, **kw))
        )
        if config is not None:
            return Bound(call, output, config.to_json(), "forced")
        args, kw = x.args(spec.dtype, spec.quant)
        choice = explain(*args, causal=True, **kw)
        return Bound(call, output, choice.config.to_json(), choice.source, borrowed_from(choice))
