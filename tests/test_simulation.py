"""The simulation runner's synthetic model covers every point of both search spaces: every value of
every searched parameter, and every seed a study starts from, gets a finite number (never a crash of
the worker), and its factor tables cover every value the generator accepts."""

from __future__ import annotations

import math

import pytest

from zyfa_tune.generator import CHOICES, HEAD_DIMS, ConfigError
from zyfa_tune.search_spaces import get_space
from zyfa_tune.tuning import simulation
from zyfa_tune.tuning.task import Shape
from zyfa_tune.tuning.warm_start import study_seeds

SHAPE = Shape(batch=1, heads=32, kv_heads=32, seqlen=8192)
PAIRS = [(d, d) for d in HEAD_DIMS] + [(192, 128)]


def _modelled(config) -> None:
    for causal in (True, False):
        tf = simulation.synthetic_tflops(config, SHAPE, causal)
        assert math.isfinite(tf) and tf > 0, config
        fields = simulation.synthetic_measurement(config, SHAPE, causal, 1.25)
        assert fields["status"] in ("ok", "wrong"), config


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_every_seed_of_every_space_is_modelled(dtype):
    space = get_space(dtype)
    for dqk, dv in PAIRS:
        try:
            seeds = space.seeds(dqk, dv, loose=True)
        except ConfigError:
            continue
        for config in seeds:
            _modelled(config)


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_every_choice_of_every_param_is_modelled(dtype):
    """From each seed at head dim 128 (both backends, the shipped database's winners too), every
    searched option of every param."""
    space = get_space(dtype)
    walked = set()
    for seed in study_seeds(space, 128, 128):
        options = space.as_optuna_params(seed)
        for p in space.params:
            for option in p.suggest_choices:
                try:
                    config = space._from_options({**options, p.key: option}, 128, 128)
                except ConfigError:
                    continue
                if config not in walked:
                    walked.add(config)
                    _modelled(config)
    assert len(walked) > 20


def test_the_tables_cover_every_value_the_generator_accepts():
    tables = {
        "block_n": (simulation._BLOCK_N_SMALL, simulation._BLOCK_N_LARGE),
        "num_stages": (simulation._STAGES,),
        "rowsum": (simulation._ROWSUM,),
        "block_m": tuple(simulation._BLOCK_M.values()),
        **{name: (table,) for name, table in simulation._GLUON_FACTORS.items()},
    }
    for name, of_field in tables.items():
        for table in of_field:
            assert set(CHOICES[name]) <= set(table), (name, table)
