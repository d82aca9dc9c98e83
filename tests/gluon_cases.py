"""Gluon configs the CPU tests share: the search space's Gluon seed and its one-field neighbours
(every value of every field the space searches under backend="gluon"), and a random sample."""

from __future__ import annotations

import optuna

from zyfa_tune.generator import ConfigError, KernelConfig
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.search_spaces import get_space

SPACE = get_space("fp8")
GLUON = default_config("fp8", 128, 128, "gluon")


def neighbours(seed: KernelConfig = GLUON) -> list[KernelConfig]:
    """seed, then seed with one searched Gluon-relevant field changed (block_m=64 with the
    one-consumer values of the two-consumer fields), each a feasible point of the space."""
    out = [seed]
    for p in SPACE.params:
        if p.name == "backend" or (p.only_if is not None and p.only_if != ("backend", "gluon")):
            continue
        for value in p.choices:
            changes = {p.name: value}
            if p.name == "block_m" and value == 64:
                changes.update(ping_pong=False, producer_regs=24)
            try:
                config = seed.replace(**changes)
            except ConfigError:  # a two-consumer field's value under one consumer
                continue
            if config not in out and SPACE.feasible(config) is None:
                SPACE.as_optuna_params(config)  # a point of the space
                out.append(config)
    return out


def sampled(n: int, seed: int = 11) -> list[KernelConfig]:
    """n distinct Gluon configs the space's random sampler suggests at head dim 128."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    out: list[KernelConfig] = []
    while len(out) < n:
        trial = study.ask()
        config = SPACE.suggest(trial, 128, 128)
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        if config is not None and config.backend == "gluon" and config not in out:
            out.append(config)
    return out
