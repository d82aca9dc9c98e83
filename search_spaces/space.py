"""`SearchSpace`: the searched parameters of one kernel family (params.py for how a trial maps to a
config), its static pruning (resources.py) and its seeds (seeds.py; the tuning layer passes in the
winners it read from databases)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from zyfa_tune.generator import CHOICES, ConfigError, KernelConfig
from zyfa_tune.generator.config import GLUON_FIELDS, TRITON_FIELDS
from zyfa_tune.generator.defaults import default_config

from .params import FIELDS, PROBLEM_FIELDS, Param, check_params
from .resources import static_infeasibility

if TYPE_CHECKING:  # optuna is imported lazily: a config can be built without it
    import optuna

log = logging.getLogger("zyfa_tune.search_spaces")


class SearchSpace:
    """The searched parameters of one kernel family; see the module doc for how trials map."""

    def __init__(
        self,
        family: str,
        dtype: str,
        params: Sequence[Param],
        extra_seeds: Sequence[Callable[[str, int, int], KernelConfig]] = (),
        winner_twins: Callable[[KernelConfig], Sequence[KernelConfig]] = lambda config: (),
        loose_seeds: Sequence[Callable[[str, int, int], KernelConfig]] = (),
    ):
        if dtype not in CHOICES["dtype"]:
            raise ValueError(f"dtype: {dtype!r} is not one of {list(CHOICES['dtype'])}")
        self.family = family
        self.dtype = dtype
        self.params: tuple[Param, ...] = tuple(params)
        self.extra_seeds = tuple(extra_seeds)
        self.winner_twins = winner_twins
        self.loose_seeds = tuple(loose_seeds)
        check_params(self.params)

    def __repr__(self) -> str:
        return f"SearchSpace({self.family!r}, {[p.key for p in self.params]})"

    # ---- configs ---------------------------------------------------------------------------
    def base(self, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
        """The family's safe default for these head dims (ConfigError for unsupported ones)."""
        return default_config(self.dtype, head_dim_qk, head_dim_v)

    def config_from(self, values: Mapping[str, object], head_dim_qk: int, head_dim_v: int) -> KernelConfig:
        """base() with these fields replaced; ConfigError if a name or the result is invalid."""
        base = self.base(head_dim_qk, head_dim_v)
        unknown = sorted(str(k) for k in values if k not in FIELDS)
        if unknown:
            raise ConfigError(f"unknown config fields: {unknown}")
        fixed = sorted(k for k in values if k in PROBLEM_FIELDS and values[k] != getattr(base, k))
        if fixed:
            raise ConfigError(f"{fixed} are fixed by the search space {self.family} and the head dims")
        return base.replace(**dict(values))

    def canonical(self, config: KernelConfig) -> KernelConfig:
        """`config` with every irrelevant searched field (see Param.only_if) at the default's value:
        the config `suggest` produces for the same kernel."""
        base = self.base(config.head_dim_qk, config.head_dim_v).all_fields()
        current = config.all_fields()
        changes = {p.name: _kept(p.name, current, base) for p in self.params if not p.relevant(current)}
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
            raise ValueError(
                f"{self.family}: config is not a point of this space: {diff} are not searched "
                f"here and differ from the default"
            )
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
                values[p.name] = so_far[p.name] = _kept(p.name, so_far, base)
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

    def seeds(
        self, head_dim_qk: int, head_dim_v: int, *, winners: Iterable[KernelConfig] = (), loose: bool = False
    ) -> list[KernelConfig]:
        """Known-good configs to enqueue first: the default, the family's extra seeds (`extra_seeds`:
        the Gluon backend's default where it implements the head dims), then `winners` (configs a
        tuning database holds as best, in the caller's order: most problem classes won first), then
        each winner's `winner_twins` (the family's variants of a winner with a field it was tuned
        without: measured gains a short study would not sample).
        loose: also the family's `loose_seeds` (configs whose error passes only a looser accuracy gate
        than the default, such as lean P at ~1.35x the exact error), last, for a study whose gate or
        Pareto front has room for them.
        Winners of another dtype or other head dims are ignored; configs that are not points of this
        space or are statically infeasible are skipped; the list is deduplicated (after `canonical`)."""
        base = self.base(head_dim_qk, head_dim_v)
        out = [base]
        for config in self._made(self.extra_seeds, head_dim_qk, head_dim_v):
            if config not in out and self.feasible(config) is None:
                out.append(config)
        problem = (self.dtype, head_dim_qk, head_dim_v)
        won = [self.canonical(c) for c in winners if (c.dtype, c.head_dim_qk, c.head_dim_v) == problem]
        twins = [twin for config in won for twin in self.winner_twins(config)]
        extra = self._made(self.loose_seeds, head_dim_qk, head_dim_v) if loose else []
        for config in won + twins + extra:
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

    def _made(
        self, makers: Sequence[Callable[[str, int, int], KernelConfig]], head_dim_qk: int, head_dim_v: int
    ) -> list[KernelConfig]:
        """The configs these seed makers build for the head dims (a maker raising ConfigError does not
        implement them and is left out)."""
        out = []
        for make in makers:
            try:
                out.append(make(self.dtype, head_dim_qk, head_dim_v))
            except ConfigError:
                continue
        return out


def _kept(name: str, fields: Mapping[str, Any], base: Mapping[str, Any]) -> Any:
    """The value an irrelevant field keeps: the family default's (`base`), except a field of the other
    backend, which keeps KernelConfig's default as the config requires (the Triton default of a width
    of 8s loads by pointer, which a Gluon config of that width may not name)."""
    other = TRITON_FIELDS if fields["backend"] == "gluon" else GLUON_FIELDS
    return KernelConfig.__dataclass_fields__[name].default if name in other else base[name]
