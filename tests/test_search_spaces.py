"""Search spaces (zyfa_tune.search_spaces): declarations, Optuna suggestion, round trips, seeds,
static feasibility and its calibration against real sm_90a compiles.

CPU only. The calibration test compiles CALIBRATION's configs once each (module-scoped cache).
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import optuna
import pytest
from optuna.trial import TrialState

from zyfa_tune.generator import CHOICES, ConfigError, KernelConfig, emit
from zyfa_tune.generator.config import lane_sums_conflict
from zyfa_tune.generator.defaults import (default_config, gluon_defer_config, gluon_natural_config, gluon_three_config,
                                       gluon_lanes_config, gluon_smem2_config, gluon_wide_config)
from zyfa_tune.search_spaces import (FAMILIES, SEED_DATABASES, SMEM_LIMIT, Param, SearchSpace, get_space,
                                     register_estimate, smem_estimate)
from zyfa_tune.search_spaces import base as ss_base

optuna.logging.set_verbosity(optuna.logging.WARNING)

HEAD_PAIRS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
FIELDS = {f.name for f in dataclasses.fields(KernelConfig)}
D = default_config
#: every field the issue lists for each family (one Param line each)
FAMILY_FIELDS = {
    "fp8-causal": {"block_m", "block_n", "num_warps", "num_stages", "maxnreg", "softmax", "lean_fold",
                   "lean_clamp", "lean_pack", "p_scale_log2", "scale_block", "rowsum", "q_order", "loads",
                   "v_layout", "backend", "ping_pong", "overlap", "q_stages", "v_permute", "persistent",
                   "producer_regs", "ex2_fence", "skip_rescale", "turn_barrier", "pv_defer", "p_carry",
                   "lane_sums", "late_rescale", "o_split", "half_block", "o_through_p", "l2_group_mib",
                   "qk_acc", "qk_async", "lean_ref", "lean_floor", "lean_mufu"},  # exp2_poly: slower
    "bf16-causal": {"block_m", "block_n", "num_warps", "num_stages", "maxnreg", "scale_block", "rowsum",
                    "q_order", "loads", "v_layout"},
}


def study(seed: int = 0) -> optuna.Study:
    return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))


def ask_config(space: SearchSpace, s: optuna.Study, dqk: int, dv: int):
    trial = s.ask()
    return trial, space.suggest(trial, dqk, dv)


# ---- declarations -----------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_params_are_fields_with_allowed_choices(family):
    space = FAMILIES[family]
    assert space.family == family and space.dtype == family.split("-")[0]
    names = [p.name for p in space.params]
    assert len(names) == len(set(names))
    assert set(names) == FAMILY_FIELDS[family]
    for p in space.params:
        assert isinstance(p, Param)
        assert p.name in FIELDS
        assert p.choices and all(v in CHOICES[p.name] for v in p.choices), p
        assert all(type(v) in (bool, int, float, str) for v in p.suggest_choices), p
    keys = [p.key for p in space.params]
    assert len(keys) == len(set(keys))


def test_family_specifics():
    fp8, bf16 = FAMILIES["fp8-causal"], FAMILIES["bf16-causal"]
    by = {f: {p.name: p for p in FAMILIES[f].params} for f in FAMILIES}
    assert by["fp8-causal"]["v_layout"].choices == ("transposed", "natural")
    assert by["bf16-causal"]["v_layout"].choices == ("natural",)
    assert by["fp8-causal"]["p_scale_log2"].choices == (6, 7, 8)
    for name in ("softmax", "lean_fold", "lean_clamp", "lean_pack", "p_scale_log2"):
        assert name not in by["bf16-causal"]
    # scale_block is searched as a boolean; rowsum offers all three everywhere
    for f in FAMILIES:
        sb = by[f]["scale_block"]
        assert sb.key == "scale_per_tile" and sb.suggest_choices == (False, True)
        assert by[f]["rowsum"].suggest_choices == ("fp32", "rounded", "mma")
    assert fp8.base(128, 128) == D("fp8", 128, 128) and bf16.base(192, 128) == D("bf16", 192, 128)


def test_space_rejects_bad_declarations():
    with pytest.raises(ValueError, match="not a searchable"):
        SearchSpace("x", "fp8", [Param("nonsense", (1,))])
    with pytest.raises(ValueError, match="not a searchable"):
        SearchSpace("x", "fp8", [Param("dtype", ("fp8",))])
    with pytest.raises(ValueError, match="not all in"):
        SearchSpace("x", "fp8", [Param("block_m", (64, 96))])
    with pytest.raises(ValueError, match="declared twice"):
        SearchSpace("x", "fp8", [Param("block_m", (64,)), Param("block_m", (128,))])


def test_get_space():
    assert get_space("fp8") is FAMILIES["fp8-causal"]
    assert get_space("bf16") is FAMILIES["bf16-causal"]
    assert set(FAMILIES) == {"fp8-causal", "bf16-causal"}
    for bad in ("fp16", "FP8", "", None, 8):
        with pytest.raises(ValueError, match="dtype"):
            get_space(bad)


# ---- suggestion -------------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_random_sampler_gives_valid_configs_or_reasons(family):
    space = FAMILIES[family]
    s = study(seed=1)
    got, infeasible, reasons = set(), 0, set()
    for i in range(300):
        dqk, dv = HEAD_PAIRS[i % len(HEAD_PAIRS)]
        trial, config = ask_config(space, s, dqk, dv)
        # the space is static: every param is suggested on every trial
        assert set(trial.params) == {p.key for p in space.params}
        if config is None:
            reason = trial.user_attrs.get("infeasible")
            assert isinstance(reason, str) and reason
            reasons.add(reason.split(":")[0])
            infeasible += 1
            s.tell(trial, state=TrialState.PRUNED)
            continue
        assert isinstance(config, KernelConfig)
        assert KernelConfig.from_json(config.to_json()) == config  # passes validation again
        assert (config.dtype, config.head_dim_qk, config.head_dim_v) == (space.dtype, dqk, dv)
        assert space.feasible(config) is None
        assert space.canonical(config) == config
        assert "infeasible" not in trial.user_attrs
        if config.softmax == "exact":
            assert (config.lean_fold, config.lean_clamp, config.lean_pack) == ("fma", "imax", "prmt")
        assert config.scale_block in (0, config.block_n)
        got.add(config)
        s.tell(trial, 1.0)
    assert 30 < infeasible < 270 and len(got) > 30
    assert reasons >= {"wgmma", "shared memory", "registers"}


def test_suggest_maps_to_valid_combinations():
    space = get_space("fp8")
    s = study()
    base = space.as_optuna_params(space.base(128, 128))
    s.enqueue_trial({**base, "softmax": "lean", "rowsum": "fp32", "scale_per_tile": True, "block_n": 64,
                     "lean_fold": "sub_fma"})
    s.enqueue_trial({**base, "softmax": "exact", "rowsum": "fp32", "lean_pack": "bfi"})
    _, lean = ask_config(space, s, 128, 128)
    assert (lean.softmax, lean.rowsum, lean.scale_block, lean.block_n, lean.lean_fold) == (
        "lean", "rounded", 64, 64, "sub_fma")
    _, exact = ask_config(space, s, 128, 128)
    assert (exact.rowsum, exact.lean_pack) == ("fp32", "prmt")  # irrelevant lean field: canonical value


def test_suggest_marks_infeasible_trials():
    space = get_space("bf16")
    s = study()
    params = space.as_optuna_params(space.base(256, 256))
    s.enqueue_trial({**params, "block_n": 128, "num_stages": 4})
    trial, config = ask_config(space, s, 256, 256)
    assert config is None
    assert trial.user_attrs["infeasible"].startswith("shared memory")
    with pytest.raises(ConfigError):  # unsupported head dims are the caller's error
        space.suggest(study().ask(), 80, 80)


def test_config_from():
    space = get_space("fp8")
    c = space.config_from({"block_m": 128, "num_warps": 8, "softmax": "lean", "rowsum": "mma"}, 64, 64)
    assert c == D("fp8", 64, 64).replace(block_m=128, num_warps=8, softmax="lean", rowsum="mma")
    assert space.config_from({}, 96, 96) == D("fp8", 96, 96)
    for bad in ({"softmax": "lean", "rowsum": "fp32"}, {"scale_block": 32}, {"nonsense": 1},
                {"dtype": "bf16"}, {"block_m": 96}, {"num_warps": True}):
        with pytest.raises(ConfigError):
            space.config_from(bad, 128, 128)
    with pytest.raises(ConfigError):
        get_space("bf16").config_from({"p_scale_log2": 8}, 128, 128)


# ---- round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_as_optuna_params_round_trip(family):
    space = FAMILIES[family]
    sampled = study(seed=7)
    configs = []
    for i in range(120):
        dqk, dv = HEAD_PAIRS[i % len(HEAD_PAIRS)]
        trial, config = ask_config(space, sampled, dqk, dv)
        sampled.tell(trial, state=TrialState.PRUNED)
        if config is not None:
            configs.append(config)
    configs += [c for dqk, dv in HEAD_PAIRS for c in space.seeds(dqk, dv)]
    assert len(configs) > 20
    replay = study(seed=3)
    for config in configs:
        params = space.as_optuna_params(config)
        assert all(type(v) in (bool, int, float, str) for v in params.values())
        replay.enqueue_trial(params)
        trial, again = ask_config(space, replay, config.head_dim_qk, config.head_dim_v)
        assert again == config
        assert trial.params == params
        replay.tell(trial, 1.0)


def test_as_optuna_params_non_points():
    fp8, bf16 = get_space("fp8"), get_space("bf16")
    base = fp8.base(128, 128)
    # an irrelevant lean field reproduces as the canonical config (the same kernel)
    odd = base.replace(lean_fold="sub_fma")
    s = study()
    s.enqueue_trial(fp8.as_optuna_params(odd))
    _, again = ask_config(fp8, s, 128, 128)
    assert again == fp8.canonical(odd) == base
    for bad in (base.replace(block_m=256, num_warps=16), base.replace(p_scale_log2=3),
                base.replace(maxnreg=128)):
        with pytest.raises(ValueError, match="not one of the searched"):
            fp8.as_optuna_params(bad)
    with pytest.raises(ValueError, match="dtype"):
        fp8.as_optuna_params(bf16.base(128, 128))
    with pytest.raises(ValueError, match="not searched"):  # bf16 does not search the lean fields
        bf16.as_optuna_params(bf16.base(128, 128).replace(lean_pack="bfi"))
    with pytest.raises(ValueError, match="not one of the searched"):
        bf16.as_optuna_params(bf16.base(128, 128).replace(v_layout="transposed"))


# ---- seeds ------------------------------------------------------------------------------------

def shipped_best(dtype: str, dqk: int, dv: int) -> list[KernelConfig]:
    from zyfa_tune.db import open_store

    with open_store(SEED_DATABASES[0], readonly=True, create=False) as store:
        return [KernelConfig.from_json(e.config_json)
                for e in store.best_entries(head_dims=(dqk, dv), dtype=dtype) if e.key.causal]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_seeds(family):
    space = FAMILIES[family]
    for dqk, dv in HEAD_PAIRS:
        seeds = space.seeds(dqk, dv)
        assert seeds[0] == space.base(dqk, dv) == D(space.dtype, dqk, dv)
        assert len(seeds) == len(set(seeds))
        for c in seeds:
            assert KernelConfig.from_json(c.to_json()) == c
            assert (c.dtype, c.head_dim_qk, c.head_dim_v) == (space.dtype, dqk, dv)
            assert space.feasible(c) is None, (c, space.feasible(c))
        assert set(shipped_best(space.dtype, dqk, dv)) <= set(seeds)


def test_seeds_fp8_128_include_shipped_best():
    space = get_space("fp8")
    best = shipped_best("fp8", 128, 128)
    # seven entries (S = 128 .. 32K), all Gluon: one-launch natural V for the two shortest, then V^T kernels
    assert len(best) == 7 and all(c.backend == "gluon" for c in best)
    assert [c.v_layout for c in best] == ["natural"] * 2 + ["transposed"] * 5
    seeds = space.seeds(128, 128)
    assert set(best) <= set(seeds)
    # the Triton default, then the Gluon default, its 256-key kernel and its one-launch natural-V twin,
    # then the database's
    assert seeds[:4] == [D("fp8", 128, 128), D("fp8", 128, 128, "gluon"), gluon_wide_config("fp8", 128, 128),
                         gluon_natural_config("fp8", 128, 128)]
    assert seeds[3].v_layout == "natural" and not seeds[3].v_permute
    assert gluon_lanes_config("fp8", 128, 128) in seeds  # the 256-key kernel with per-lane row sums
    assert not any(c.block_m == 192 for c in seeds)  # three consumers: seeded at head dim 64 only
    hd256 = space.seeds(256, 256)
    assert gluon_defer_config("fp8", 256, 256) in hd256 and hd256[2].pv_defer and not hd256[2].overlap
    hd64 = space.seeds(64, 64)
    assert gluon_three_config("fp8", 64, 64) in hd64 and hd64[4].block_m == 192 and not hd64[4].ping_pong


def test_database_winners_are_followed_by_their_lane_sums_twins():
    """The FP8 space seeds each shipped Gluon winner's twin with row sums per lane (a field added after
    most were tuned; measured +1.3-2.3% at 192/128 and hd256), after every winner, where it applies.
    (Sessions 11-12 shipped twins at most shapes; hd128's short-sequence winners are still without.)"""
    space = get_space("fp8")
    checked = found = 0
    for dqk, dv in ((128, 128), (192, 128), (256, 256)):  # (192/128's winners since session 21: row-sum MMA)
        winners = [c for c in shipped_best("fp8", dqk, dv) if c.backend == "gluon" and c.rowsum == "fp32"]
        best = [c for c in winners if not c.lane_sums and not lane_sums_conflict(vars(c))]  # (ex2_fence: none)
        seeds = space.seeds(dqk, dv)
        assert all(c in seeds for c in winners)
        found += len(winners)
        last_winner = max(seeds.index(c) for c in shipped_best("fp8", dqk, dv) if c in seeds)
        assert all(c.replace(lane_sums=True) in seeds for c in best)
        # (a twin that is itself a winner keeps its winner's place: hd256's 16K winner is the 8K one without)
        twins = [c.replace(lane_sums=True) for c in best if c.replace(lane_sums=True) not in winners]
        assert all(seeds.index(t) > last_winner for t in twins)
        checked += len(twins)
    assert found and checked
    # no twin where lane sums do not apply (the row-sum MMA of hd64's shipped three-consumer kernel)
    three = [c for c in shipped_best("fp8", 64, 64) if c.block_m == 192]
    assert three and all(c.rowsum == "mma" for c in three)
    assert not any(c.lane_sums and c.block_m == 192 for c in space.seeds(64, 64))


def test_two_tile_winners_get_output_through_p_twins():
    """192/128's shipped two-P-tile winners (128-key blocks: the 64 x 128 bf16 output does not fit a
    64 x 128 e4m3 P tile) are followed by their o_through_p twins, one with a Q ring of 2 where they
    had 1 (the 32 KB the output tiles took); hd128's 256-key winners (output already in a P tile) get none."""
    space = get_space("fp8")
    winners = [c for c in shipped_best("fp8", 192, 128) if c.p_carry == "smem2"]
    seeds = space.seeds(192, 128)
    assert winners and all(c.replace(o_through_p=True) in seeds for c in winners)
    assert any(c.replace(o_through_p=True, q_stages=2) in seeds for c in winners if c.q_stages == 1)
    hd128 = space.seeds(128, 128)
    assert not any(c.o_through_p and c.block_n == 256 for c in hd128)


def test_field_twins_at_head_dim_96():
    """A Gluon winner's one-field twins (`field_twins`, seeded after the database winners): per-lane
    row sums where they apply, at head dim 96 O in 64 + 32 columns (o_split) for a winner with O
    padded to 128 (the session-14 study picked that twin of the padded 4K winner, +2%), and a
    winner with its half-empty first blocks halved (half_block: plain schedule or P in shared memory), an
    overlapped one with P through two shared-memory tiles (p_carry="smem2", halved too); none for a Triton config, none with o_split
    beyond head dim 96, none that is already set."""
    from zyfa_tune.generator.defaults import gluon_lean_config
    from zyfa_tune.search_spaces import fp8_causal

    def field_twins(config):  # the twins that are other kernels (not the launch twin, tested below)
        return [t for t in fp8_causal.field_twins(config) if t.kernel_config() != config.kernel_config()]

    wide96 = gluon_wide_config("fp8", 96, 96)
    assert field_twins(wide96) == [wide96.replace(lane_sums=True), wide96.replace(o_split=True),
                                   wide96.replace(half_block=True)]
    lanes96 = wide96.replace(lane_sums=True)
    assert field_twins(lanes96) == [lanes96.replace(o_split=True), lanes96.replace(half_block=True)]
    assert field_twins(lanes96.replace(o_split=True, half_block=True)) == []
    wide128 = gluon_wide_config("fp8", 128, 128)
    assert field_twins(wide128) == [wide128.replace(lane_sums=True), wide128.replace(half_block=True)]
    # no half-block twin for a pv_defer winner (hd256's, 192/128's) or one overlapped with P in registers
    assert not any(c.half_block for c in field_twins(gluon_defer_config("fp8", 256, 256)))
    # an overlapped winner gets its two-P-tile twin (not a pv_defer one, nor lean P)
    assert field_twins(D("fp8", 96, 96)) == []  # (the Triton default)
    seed96 = D("fp8", 96, 96, "gluon")
    assert field_twins(seed96) == [seed96.replace(lane_sums=True), seed96.replace(o_split=True),
                                   seed96.replace(p_carry="smem2", half_block=True)]
    # with P in shared memory a first block halves in the overlapped pipeline too
    two = seed96.replace(lane_sums=True, o_split=True, p_carry="smem2")
    assert field_twins(two) == [two.replace(half_block=True)]
    assert field_twins(two.replace(half_block=True)) == []
    assert not any(c.p_carry == "smem2" for c in field_twins(gluon_defer_config("fp8", 256, 256)))
    assert field_twins(gluon_lean_config("fp8", 128, 128)) == []
    # the shipped hd96 winners (the 4K one is that twin) are seeds; none of hd128's carries o_split
    seeds = get_space("fp8").seeds(96, 96)
    assert all(c in seeds for c in shipped_best("fp8", 96, 96) if c.backend == "gluon")
    assert not any(c.o_split for c in get_space("fp8").seeds(128, 128))


def test_a_lean_two_tile_winner_has_its_f16_score_twin():
    """qk_acc="f16" (session 28): a lean winner on the two-P-tile step with the saturating fold gets its twin on
    f16 scores; not an exact winner, nor lean P carried in registers; an f16 winner's twins keep it (and get no
    halved first block, which has no f16 build)."""
    from zyfa_tune.generator.defaults import gluon_lean_config, gluon_lean_smem2_config
    from zyfa_tune.search_spaces.fp8_causal import field_twins

    coded = gluon_lean_smem2_config("fp8", 128, 128)
    assert coded.replace(qk_acc="f16") in field_twins(coded)
    assert all(t.qk_acc == "f16" and not t.half_block for t in field_twins(coded.replace(qk_acc="f16")))
    assert not any(t.qk_acc == "f16" for t in field_twins(gluon_lean_config("fp8", 128, 128)))
    assert not any(t.qk_acc == "f16" for t in field_twins(gluon_smem2_config("fp8", 128, 128)))
    get_space("fp8").as_optuna_params(coded.replace(qk_acc="f16"))  # a point of the space


def test_an_f16_score_winner_has_its_qk_async_twin_and_f32_scores_never_sample_it():
    """qk_async (session 35): an f16-score winner gets its twin with QK^T's wait behind PV(j-1)'s issue, which is
    a point of the space; a float32-score config never decodes to qk_async=True (no such kernel), whatever the
    sampler suggests."""
    from zyfa_tune.generator.defaults import gluon_lean_f16_config
    from zyfa_tune.search_spaces.fp8_causal import field_twins

    f16 = gluon_lean_f16_config("fp8", 128, 128)
    assert f16.qk_acc == "f16" and not f16.qk_async
    assert f16.replace(qk_async=True) in field_twins(f16)
    assert not any(t.qk_async for t in field_twins(f16.replace(qk_acc="f32")))
    assert not any(t == f16.replace(qk_async=False) for t in field_twins(f16.replace(qk_async=True)))
    space = get_space("fp8")
    options = space.as_optuna_params(f16.replace(qk_async=True))
    assert options["qk_async"] is True
    assert space._from_options(options, 128, 128) == f16.replace(qk_async=True)
    assert space._from_options({**options, "qk_acc": "f32"}, 128, 128).qk_async is False
    s, asked = study(3), 0
    for _ in range(200):
        _, cfg = ask_config(space, s, 128, 128)
        if cfg is not None:
            asked += 1
            assert not cfg.qk_async or cfg.qk_acc == "f16"
    assert asked > 20


def test_a_linear_f16_winner_has_its_max_reference_twin_and_others_never_sample_it():
    """lean_ref="max" and lean_floor (session 45): a linear-fold f16 winner gets its twin with the line on the row's
    own maximum, a point of the space; configs they do not apply to (exact, float32 scores, the corrected fold)
    never decode to them, whatever the sampler suggests."""
    from zyfa_tune.generator.defaults import gluon_lean_f16_async_config
    from zyfa_tune.search_spaces.fp8_causal import field_twins

    f16 = gluon_lean_f16_async_config("fp8", 128, 128)
    assert f16.lean_ref == "grid" and f16.replace(lean_ref="max") in field_twins(f16)
    at_max = f16.replace(lean_ref="max")   # and its twin with a quarter of the pairs from the MUFU (session 47)
    assert at_max.replace(lean_mufu=1) in field_twins(at_max) and not any(t.lean_mufu for t in field_twins(f16))
    assert not any(t.lean_ref == "max" for t in field_twins(f16.replace(lean_fold="corrected")))
    assert not any(t.lean_ref == "max" for t in field_twins(gluon_smem2_config("fp8", 128, 128)))
    space = get_space("fp8")
    both = f16.replace(lean_ref="max", lean_floor=True)
    options = space.as_optuna_params(both)
    assert options["lean_ref"] == "max" and options["lean_floor"] is True
    assert space._from_options(options, 128, 128) == both
    assert space._from_options({**options, "lean_fold": "corrected"}, 128, 128).lean_ref == "grid"
    assert space._from_options({**options, "lean_mufu": 2}, 128, 128) == both.replace(lean_mufu=2)
    assert space._from_options({**options, "lean_mufu": 2, "lean_fold": "corrected"}, 128, 128).lean_mufu == 0
    s, asked = study(5), 0
    for _ in range(200):
        _, cfg = ask_config(space, s, 128, 128)
        if cfg is not None:
            asked += 1
            assert cfg.lean_ref == "grid" or (cfg.qk_acc == "f16" and cfg.lean_fold == "fma")
            assert not cfg.lean_floor or cfg.qk_acc == "f16"
            assert not cfg.lean_mufu or (cfg.qk_acc == "f16" and cfg.lean_fold == "fma")
    assert asked > 20


def test_a_lean_winner_with_the_row_sum_mma_has_its_code_sum_twin():
    """Lean P with its codes carried packed and summed by the row-sum MMA: its twin sums the decoded codes
    (rowsum="rounded"), per lane where that applies; not with P carried as float32 (no packed codes)."""
    from zyfa_tune.generator.defaults import gluon_lean_config
    from zyfa_tune.search_spaces.fp8_causal import field_twins

    space = get_space("fp8")
    for carry in ("e4m3", "smem2"):
        lean = gluon_lean_config("fp8", 128, 128).replace(p_carry=carry)
        twin = lean.replace(rowsum="rounded", lane_sums=True)
        assert twin in field_twins(lean) and space.feasible(twin) is None
        space.as_optuna_params(twin)  # a point of the space
    assert not any(t.rowsum == "rounded" for t in field_twins(gluon_lean_config("fp8", 128, 128)))


def test_gluon_lean_rowsum_decodes_to_mma_or_the_code_sums():
    """Under Gluon lean P a suggested "mma" stays; "fp32" (no unrounded probabilities) and "rounded"
    become "rounded", the sum of the decoded codes; under exact softmax "rounded" is still "mma"."""
    param = next(p for p in get_space("fp8").params if p.name == "rowsum")
    lean = {"backend": "gluon", "softmax": "lean"}
    assert [param.to_field(v, lean) for v in ("fp32", "rounded", "mma")] == ["rounded", "rounded", "mma"]
    exact = {"backend": "gluon", "softmax": "exact"}
    assert [param.to_field(v, exact) for v in ("fp32", "rounded", "mma")] == ["fp32", "mma", "mma"]


def test_lean_code_sums_get_a_packed_carry_and_no_fence():
    """The code sums decode packed codes and have no fence: under lean with rowsum="rounded" a suggested
    float32 carry becomes "e4m3" and ex2_fence stays False, so no such suggestion is an invalid point."""
    params = {p.name: p for p in get_space("fp8").params}
    base = dict(vars(D("fp8", 128, 128, "gluon")), softmax="lean", overlap=True, v_permute=True)
    coded, mma = dict(base, rowsum="rounded"), dict(base, rowsum="mma")
    assert [params["p_carry"].to_field(v, coded) for v in ("f32", "e4m3", "smem2")] == ["e4m3", "e4m3", "smem2"]
    assert [params["p_carry"].to_field(v, mma) for v in ("f32", "e4m3", "smem2")] == ["f32", "e4m3", "smem2"]
    assert params["ex2_fence"].to_field(True, coded) is False and params["ex2_fence"].to_field(True, mma) is False
    assert params["ex2_fence"].to_field(True, dict(base, softmax="exact", rowsum="fp32")) is True


def test_decodes_leave_few_invalid_points():
    """Random suggestions at hd128 (the sampler's start): Gluon lean P is decoded to overlap on key-permuted
    V^T, a Gluon 192-key block to the exact softmax on V^T, a packed carry that cannot apply (judged with
    the suggested carry, not the default's) to "f32", pv_defer on a 256-key block of natural V to False.
    Before: 507 of 2000 draws were lean points without overlap / v_permute, 121 lean or natural-V 192-key
    blocks, 68 shared-memory carries that could not be, about 13 pv_defer 256-key blocks of natural V."""
    space = get_space("fp8")
    s = study(seed=0)
    invalid, lean_ok = [], 0
    for _ in range(2000):
        trial, config = ask_config(space, s, 128, 128)
        reason = trial.user_attrs.get("infeasible", "")
        if reason.startswith("invalid"):
            invalid.append(reason)
        lean_ok += config is not None and config.softmax == "lean"
        s.tell(trial, 0.0)
    assert not invalid, invalid[:5]
    assert lean_ok > 400


def test_p_carry_decode_judges_the_suggested_carry():
    """The fields so far hold the family default's p_carry; the decode must test the suggestion: a
    shared-memory carry on a 192-key block or without overlap becomes "f32", registers stay packed."""
    param = next(p for p in get_space("fp8").params if p.name == "p_carry")
    base = dict(vars(D("fp8", 128, 128, "gluon")), softmax="exact", rowsum="fp32", overlap=True, v_permute=True,
                p_carry="f32")
    assert [param.to_field(v, base) for v in ("f32", "e4m3", "smem2")] == ["f32", "e4m3", "smem2"]
    assert param.to_field("smem2", dict(base, block_n=192)) == "f32"
    assert param.to_field("e4m3", dict(base, block_n=192)) == "e4m3"
    assert param.to_field("smem2", dict(base, overlap=False, pv_defer=True)) == "f32"
    assert param.to_field("e4m3", dict(base, overlap=False, pv_defer=True)) == "e4m3"


def test_a_balanced_winner_has_its_l2_group_twin():
    """A winner with the balanced tile table gets the same kernel launched with 32 MiB head groups
    (the launch-only field l2_group_mib; 2.5-4% at 192/128 with 16 heads, session 22), last; a
    round-robin winner or one already at another group size does not."""
    from zyfa_tune.search_spaces.fp8_causal import field_twins

    winners = [c.kernel_config() for c in shipped_best("fp8", 192, 128)]
    for config in winners + [D("fp8", 128, 128, "gluon").replace(q_order="balanced")]:
        assert config.q_order == "balanced" and config.l2_group_mib == 16
        twins = field_twins(config)
        assert twins[-1] == config.replace(l2_group_mib=32) and twins[-1].kernel_config() == config
        assert sum(t.kernel_config() == config for t in twins) == 1
        for other in (8, 32):
            assert not any(t.kernel_config() == config for t in field_twins(config.replace(l2_group_mib=other)))
    heavy = D("fp8", 128, 128, "gluon").replace(q_order="heavy_first")
    assert all(t.l2_group_mib == 16 for t in field_twins(heavy))


def test_loose_seeds_only_when_asked():
    """The lean Gluon default (lean P: ~1.35x the exact error) is a seed only of a study whose gate or
    Pareto front admits it (`seeds(..., loose=True)`), last; a default-gate study never sees it."""
    from zyfa_tune.generator.defaults import (gluon_lean_config, gluon_lean_f16_async_config, gluon_lean_f16_config,
                                           gluon_lean_max_config, gluon_lean_smem2_config)

    space = get_space("fp8")
    lean = gluon_lean_config("fp8", 128, 128)
    assert lean.softmax == "lean" and lean.rowsum == "mma" and space.feasible(lean) is None
    # and the lean two-tile kernel that decodes its codes for the row sum, per lane (session 23)
    coded = gluon_lean_smem2_config("fp8", 128, 128)
    assert (coded.softmax, coded.rowsum, coded.lane_sums, coded.p_carry) == ("lean", "rounded", True, "smem2")
    assert space.feasible(coded) is None
    strict, loose = space.seeds(128, 128), space.seeds(128, 128, loose=True)
    assert not any(c.softmax == "lean" for c in strict)
    # and the same on f16 scores (session 28), probabilities at 2^8 (session 31)
    f16 = gluon_lean_f16_config("fp8", 128, 128)
    assert f16 == coded.replace(qk_acc="f16", p_scale_log2=8) and space.feasible(f16) is None
    # and that with QK^T's wait behind PV(j-1)'s issue at a 24-register producer (session 35)
    f16_async = gluon_lean_f16_async_config("fp8", 128, 128)
    assert f16_async == f16.replace(qk_async=True, producer_regs=24) and space.feasible(f16_async) is None
    # and that with the fold's line on each row's own maximum (sessions 45, 49)
    at_max = gluon_lean_max_config("fp8", 128, 128)
    assert at_max == f16_async.replace(lean_ref="max") and space.feasible(at_max) is None
    assert loose[:-5] == strict and loose[-5:] == [lean, coded, f16, f16_async, at_max]
    assert get_space("bf16").seeds(128, 128, loose=True) == get_space("bf16").seeds(128, 128)


@pytest.mark.parametrize("dims,block_n,q_stages", [((64, 64), 256, 2), ((192, 128), 128, 2), ((256, 256), 128, 1)])
def test_lean_max_seed_fits_every_head_dim(dims, block_n, q_stages):
    """The 256-key lean seeds exceed shared memory at 192/128 and hd256 and are skipped there; the lean seed on
    the row maximum takes 128-key blocks (and at hd256 one Q stage with O through the P tiles), so a loose study
    of those head dims starts from the kernel measured at 1.17-1.27x FA3-fp8 (docs/PERF.md session 50)."""
    from zyfa_tune.generator.defaults import gluon_lean_f16_async_config, gluon_lean_max_config

    space = get_space("fp8")
    cfg = gluon_lean_max_config("fp8", *dims)
    assert (cfg.block_n, cfg.q_stages, cfg.o_through_p) == (block_n, q_stages, dims == (256, 256))
    assert space.feasible(cfg) is None and cfg in space.seeds(*dims, loose=True)
    assert cfg not in space.seeds(*dims)
    if dims != (64, 64):
        assert space.feasible(gluon_lean_f16_async_config("fp8", *dims)) is not None


def test_turn_barrier_only_with_ping_pong():
    space = get_space("fp8")
    opts = space.as_optuna_params(D("fp8", 128, 128, "gluon"))
    named = space._from_options({**opts, "turn_barrier": "named"}, 128, 128)
    assert named.turn_barrier == "named" and named.ping_pong
    no_pp = space._from_options({**opts, "turn_barrier": "named", "ping_pong": False}, 128, 128)
    assert no_pp.turn_barrier == "mbarrier"  # irrelevant without turns: the default, one config


def test_balanced_order_only_for_persistent_gluon():
    """q_order="balanced" is a persistent Gluon kernel's tile table: a Triton trial that draws it keeps
    the family's order, and a Gluon trial that draws it stays persistent."""
    space = get_space("fp8")
    gluon = space.as_optuna_params(D("fp8", 128, 128, "gluon"))
    assert gluon["q_order"] == "balanced"
    kept = space._from_options({**gluon, "persistent": False}, 128, 128)
    assert (kept.q_order, kept.persistent) == ("balanced", True)
    rr = space._from_options({**gluon, "q_order": "heavy_first", "persistent": False}, 128, 128)
    assert (rr.q_order, rr.persistent) == ("heavy_first", False)
    triton = space.as_optuna_params(D("fp8", 128, 128))
    assert space._from_options({**triton, "q_order": "balanced"}, 128, 128).q_order == D("fp8", 128, 128).q_order


def test_seeds_without_database(tmp_path):
    space = get_space("bf16")
    assert space.seeds(128, 128, databases=[tmp_path / "missing.db"]) == [space.base(128, 128)]
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"not a database")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert space.seeds(128, 128, databases=[empty]) == [space.base(128, 128)]


# ---- static feasibility -----------------------------------------------------------------------

def test_feasibility_rules():
    fp8, bf16 = get_space("fp8"), get_space("bf16")
    base = fp8.base(128, 128)
    assert fp8.feasible(base) is None and bf16.feasible(bf16.base(256, 256)) is None
    assert fp8.feasible(base.replace(num_warps=8)).startswith("wgmma")           # 64 rows, 2 warpgroups
    assert fp8.feasible(base.replace(block_m=128, num_warps=16)).startswith("wgmma")
    assert fp8.feasible(base.replace(block_m=128, num_warps=8)) is None
    assert fp8.feasible(base.replace(block_n=32, num_stages=2)) is None            # fp8 k=32 is fine
    assert fp8.feasible(bf16.base(128, 128)).startswith("fp8-causal")            # other family
    assert fp8.feasible(base.replace(block_m=128)).startswith("registers")       # 128x128 on 4 warps
    assert fp8.feasible(base.replace(maxnreg=128)).startswith("registers")
    assert fp8.feasible(base.replace(maxnreg=168)) is None
    r = bf16.feasible(bf16.base(256, 256).replace(block_n=128, num_stages=4))
    assert r.startswith("shared memory") and str(SMEM_LIMIT) in r
    # every default config is feasible (they compile without spills: test_compile_sm90)
    for dt, (dqk, dv) in itertools.product(("fp8", "bf16"), HEAD_PAIRS):
        assert get_space(dt).feasible(D(dt, dqk, dv)) is None


#: Calibration (Triton 3.6, sm_90a, compile_for_target): config -> (estimated shared bytes, real
#: shared bytes, estimated registers, real registers, real spill bytes). The static check must accept
#: every config that fits 227 KiB without spills and reject every config over 227 KiB; the register
#: estimate is a lower bound that rejects only clear spills. (A wider sweep of 1940 configs, in
#: search_spaces/base.py's docstrings, found no false rejection either.)
CALIBRATION = [
    # config                                                                            est_smem real_smem est_reg reg spill
    (D("fp8", 128, 128),                                                                 107520, 107520, 160, 191, 0),
    (D("fp8", 64, 64).replace(block_m=128, num_warps=8, num_stages=4, loads="pointer",
                              v_layout="natural", rowsum="mma"),                          51200,  49152, 128, 212, 0),
    (D("fp8", 96, 96).replace(loads="pointer", v_layout="natural"),                       55296,  51200, 144, 247, 0),
    (D("fp8", 192, 128),                                                                  74752,  74752, 120, 150, 0),
    (D("fp8", 192, 128).replace(block_m=128, block_n=128, num_warps=8, num_stages=4),    189440, 189440, 160, 190, 0),
    (D("fp8", 256, 256),                                                                 115712, 115712, 184, 216, 0),
    (D("fp8", 256, 256).replace(block_m=128, block_n=128, num_warps=8, num_stages=4),    295936, 295936, 224, 236, 0),
    (D("fp8", 256, 256).replace(block_m=128, block_n=128, rowsum="mma"),                 232448, 232448, 432, 255, 1440),
    (D("fp8", 128, 128).replace(softmax="lean", rowsum="rounded", maxnreg=168,
                                num_stages=2),                                            74752,  74752, 160, 156, 0),
    (D("fp8", 128, 128).replace(block_m=128),                                            115712, 115712, 304, 255, 192),
    (D("bf16", 64, 64).replace(num_warps=4, num_stages=3, rowsum="mma"),                 119808, 119808, 240, 254, 0),
    (D("bf16", 128, 128),                                                                164864, 164864, 160, 188, 0),
    (D("bf16", 192, 128).replace(block_n=128),                                           214016, 214016, 160, 193, 0),
    (D("bf16", 256, 256),                                                                197632, 196640, 184, 217, 0),
    (D("bf16", 256, 256).replace(num_stages=3),                                          263168, 263168, 184, 218, 0),
    (D("bf16", 256, 256).replace(block_n=128, num_stages=4),                             590848, 590848, 224, 255, 24),
]


@pytest.fixture(scope="module")
def compiled():
    from zyfa_tune.generator.build import compile_for_target

    cache = {}

    def get(config: KernelConfig):
        if config not in cache:
            cache[config] = compile_for_target(emit(config))
        return cache[config]

    return get


@pytest.mark.parametrize("row", CALIBRATION, ids=lambda row: (
    f"{row[0].dtype}-{row[0].head_dim_qk}/{row[0].head_dim_v}-{row[0].block_m}x{row[0].block_n}"
    f"-w{row[0].num_warps}-s{row[0].num_stages}-{row[0].loads}-{row[0].v_layout}-{row[0].rowsum}"
    f"-{row[0].softmax}-r{row[0].maxnreg}"))
def test_feasibility_calibration(row, compiled):
    import triton

    config, est_smem, real_smem, est_regs, real_regs, spill = row
    space = get_space(config.dtype)
    assert (smem_estimate(config), register_estimate(config)) == (est_smem, est_regs)
    art = compiled(config)
    if triton.__version__.startswith("3.6."):  # the pinned Triton: the table is what it compiles
        assert (art.shared_bytes, art.registers, art.spill_bytes) == (real_smem, real_regs, spill)
    reason = space.feasible(config)
    usable = art.shared_bytes <= SMEM_LIMIT and art.spill_bytes == 0
    if usable:
        assert reason is None, f"rejected a config that compiles within 227 KiB without spills: {reason}"
    if art.shared_bytes > SMEM_LIMIT:
        assert reason is not None and reason.startswith("shared memory")
    if reason is not None and reason.startswith("registers"):
        assert art.spill_bytes > 0
    # the estimate tracks the real size: at most 1 KiB optimistic, at most 6.5 KiB pessimistic
    assert -1024 <= smem_estimate(config) - art.shared_bytes <= 6656
    if usable:  # the register estimate stays (about) below what compiles, with headroom to the limit
        assert register_estimate(config) <= art.registers + 8
        assert register_estimate(config) <= (config.maxnreg or 255) - 8


def test_calibration_covers_the_brief():
    rows = [r[0] for r in CALIBRATION]
    pairs = {(c.head_dim_qk, c.head_dim_v) for c in rows}
    assert {(64, 64), (128, 128), (192, 128), (256, 256)} <= pairs
    assert {c.block_n for c in rows} == {64, 128} and {c.block_m for c in rows} == {64, 128}
    over = [r for r in CALIBRATION if r[2] > SMEM_LIMIT]
    assert len(over) >= 2 and any(c.dtype == "bf16" and c.block_n == 128 and c.num_stages == 4
                                  for c, *_ in over)
    assert any(r[2] <= SMEM_LIMIT and r[5] == 0 and r[2] > 0.9 * SMEM_LIMIT for r in CALIBRATION)
    assert ss_base.SMEM_LIMIT == 232448


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_neighbours_are_one_option_away_and_feasible(family):
    space = FAMILIES[family]
    base = space.base(128, 128)
    near = space.neighbours(base)
    assert near and base not in near and len(set(near)) == len(near)
    start = space.as_optuna_params(base)
    for c in near:
        assert space.feasible(c) is None
        moved = {k for k, v in space.as_optuna_params(c).items() if v != start[k]}
        # one option changed; options it made irrelevant (or relevant) may follow it
        assert moved and any(space._from_options({**start, k: space.as_optuna_params(c)[k]}, 128, 128) == c
                             for k in moved)
    if family == "fp8-causal":  # both backends and lean P are reachable in one move from the Triton default
        assert {c.backend for c in near} == {"triton", "gluon"} and any(c.softmax == "lean" for c in near)
