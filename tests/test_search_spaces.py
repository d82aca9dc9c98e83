"""Search spaces (zyfa_tune.search_spaces): declarations, Optuna suggestion, round trips, decodes,
static feasibility and its calibration against real sm_90a compiles (seeds: test_seeds.py).

CPU only. The calibration test compiles CALIBRATION's configs once each (module-scoped cache).
"""

from __future__ import annotations

import dataclasses
import itertools

import optuna
import pytest
from optuna.trial import TrialState

from zyfa_tune.generator import CHOICES, HOPPER, ConfigError, KernelConfig, emit
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.search_spaces import (
    FAMILIES,
    SMEM_LIMIT,
    Param,
    SearchSpace,
    get_space,
    register_estimate,
    smem_estimate,
)
from zyfa_tune.tuning.warm_start import study_seeds

optuna.logging.set_verbosity(optuna.logging.WARNING)

HEAD_PAIRS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
FIELDS = {f.name for f in dataclasses.fields(KernelConfig)}
D = default_config
#: every field each family searches (one Param line each)
FAMILY_FIELDS = {
    "fp8-causal": {
        "block_m",
        "block_n",
        "num_warps",
        "num_stages",
        "maxnreg",
        "softmax",
        "lean_fold",
        "lean_clamp",
        "lean_pack",
        "p_scale_log2",
        "scale_block",
        "rowsum",
        "q_order",
        "loads",
        "v_layout",
        "backend",
        "ping_pong",
        "overlap",
        "q_stages",
        "v_permute",
        "persistent",
        "producer_regs",
        "ex2_fence",
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
        "qk_async",
        "lean_ref",
        "lean_floor",
        "lean_mufu",
    },  # exp2_poly: slower
    "bf16-causal": {
        "block_m",
        "block_n",
        "num_warps",
        "num_stages",
        "maxnreg",
        "scale_block",
        "rowsum",
        "q_order",
        "loads",
        "v_layout",
    },
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
    s.enqueue_trial(
        {**base, "softmax": "lean", "rowsum": "fp32", "scale_per_tile": True, "block_n": 64, "lean_fold": "sub_fma"}
    )
    s.enqueue_trial({**base, "softmax": "exact", "rowsum": "fp32", "lean_pack": "bfi"})
    _, lean = ask_config(space, s, 128, 128)
    assert (lean.softmax, lean.rowsum, lean.scale_block, lean.block_n, lean.lean_fold) == (
        "lean",
        "rounded",
        64,
        64,
        "sub_fma",
    )
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
        space.suggest(study().ask(), 84, 84)


def test_config_from():
    space = get_space("fp8")
    c = space.config_from({"block_m": 128, "num_warps": 8, "softmax": "lean", "rowsum": "mma"}, 64, 64)
    assert c == D("fp8", 64, 64).replace(block_m=128, num_warps=8, softmax="lean", rowsum="mma")
    assert space.config_from({}, 96, 96) == D("fp8", 96, 96)
    for bad in (
        {"softmax": "lean", "rowsum": "fp32"},
        {"scale_block": 32},
        {"nonsense": 1},
        {"dtype": "bf16"},
        {"block_m": 96},
        {"num_warps": True},
    ):
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
    configs += [c for dqk, dv in HEAD_PAIRS for c in study_seeds(space, dqk, dv, loose=True)]
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
    for bad in (base.replace(block_m=256, num_warps=16), base.replace(p_scale_log2=3), base.replace(maxnreg=128)):
        with pytest.raises(ValueError, match="not one of the searched"):
            fp8.as_optuna_params(bad)
    with pytest.raises(ValueError, match="dtype"):
        fp8.as_optuna_params(bf16.base(128, 128))
    with pytest.raises(ValueError, match="not searched"):  # bf16 does not search the lean fields
        bf16.as_optuna_params(bf16.base(128, 128).replace(lean_pack="bfi"))
    with pytest.raises(ValueError, match="not one of the searched"):
        bf16.as_optuna_params(bf16.base(128, 128).replace(v_layout="transposed"))


# ---- decodes ----------------------------------------------------------------------------------


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
    Without these decodes about a third of the draws would be invalid points (lean P without overlap or
    v_permute, lean or natural-V 192-key blocks, shared-memory carries that cannot apply)."""
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


@pytest.mark.parametrize("dim", [40, 72, 200])
def test_widths_of_eights_draw_no_invalid_points(dim):
    """At a width of 8s but not 16s, Triton draws load by pointer and Gluon draws read V^T: TMA cannot address
    such FP8 rows. Without these decodes about half of a study's draws at hd72 were invalid points."""
    space = get_space("fp8")
    s = study(seed=1)
    invalid, made = [], []
    for _ in range(400):
        trial, config = ask_config(space, s, dim, dim)
        reason = trial.user_attrs.get("infeasible", "")
        if reason.startswith("invalid"):
            invalid.append(reason)
        if config is not None:
            made.append(config)
        s.tell(trial, 0.0)
    assert not invalid, invalid[:5]
    assert len(made) > 40
    assert all(c.loads == "pointer" if c.backend == "triton" else c.v_layout == "transposed" for c in made)


def test_p_carry_decode_judges_the_suggested_carry():
    """The fields so far hold the family default's p_carry; the decode must test the suggestion: a
    shared-memory carry on a 192-key block or without overlap becomes "f32", registers stay packed."""
    param = next(p for p in get_space("fp8").params if p.name == "p_carry")
    base = dict(
        vars(D("fp8", 128, 128, "gluon")), softmax="exact", rowsum="fp32", overlap=True, v_permute=True, p_carry="f32"
    )
    assert [param.to_field(v, base) for v in ("f32", "e4m3", "smem2")] == ["f32", "e4m3", "smem2"]
    assert param.to_field("smem2", dict(base, block_n=192)) == "f32"
    assert param.to_field("e4m3", dict(base, block_n=192)) == "e4m3"
    assert param.to_field("smem2", dict(base, overlap=False, pv_defer=True)) == "f32"
    assert param.to_field("e4m3", dict(base, overlap=False, pv_defer=True)) == "e4m3"


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


# ---- static feasibility -----------------------------------------------------------------------


def test_feasibility_rules():
    fp8, bf16 = get_space("fp8"), get_space("bf16")
    base = fp8.base(128, 128)
    assert fp8.feasible(base) is None and bf16.feasible(bf16.base(256, 256)) is None
    assert fp8.feasible(base.replace(num_warps=8)).startswith("wgmma")  # 64 rows, 2 warpgroups
    assert fp8.feasible(base.replace(block_m=128, num_warps=16)).startswith("wgmma")
    assert fp8.feasible(base.replace(block_m=128, num_warps=8)) is None
    assert fp8.feasible(base.replace(block_n=32, num_stages=2)) is None  # fp8 k=32 is fine
    assert fp8.feasible(bf16.base(128, 128)).startswith("fp8-causal")  # other family
    assert fp8.feasible(base.replace(block_m=128)).startswith("registers")  # 128x128 on 4 warps
    assert fp8.feasible(base.replace(maxnreg=128)).startswith("registers")
    assert fp8.feasible(base.replace(maxnreg=168)) is None
    r = bf16.feasible(bf16.base(256, 256).replace(block_n=128, num_stages=4))
    assert r.startswith("shared memory") and str(SMEM_LIMIT) in r
    # every default config is feasible (they compile without spills: test_compile_sm90)
    for dt, (dqk, dv) in itertools.product(("fp8", "bf16"), HEAD_PAIRS):
        assert get_space(dt).feasible(D(dt, dqk, dv)) is None


#: FP8 V^T loaded by pointer: the layout whose masked last key blocks Triton loads a byte at a time.
PTR_VT = dict(loads="pointer", v_layout="transposed")

#: Calibration (Triton 3.6, sm_90a, compile_for_target): config -> (estimated shared bytes, real
#: shared bytes, estimated registers, real registers, real spill bytes). The static check must accept
#: every config that fits 227 KiB without spills and reject every config over 227 KiB; the register
#: estimate is a lower bound that rejects only clear spills. (A wider sweep of 1940 configs, in
#: search_spaces/resources.py's docstrings, found no false rejection either.)
CALIBRATION = [
    # config                                                                            est_smem real_smem est_reg reg spill
    (D("fp8", 128, 128), 107520, 107520, 160, 191, 0),
    (
        D("fp8", 64, 64).replace(
            block_m=128, num_warps=8, num_stages=4, loads="pointer", v_layout="natural", rowsum="mma"
        ),
        51200,
        49152,
        128,
        212,
        0,
    ),
    (D("fp8", 96, 96).replace(loads="pointer", v_layout="natural"), 55296, 51200, 144, 247, 0),
    (D("fp8", 192, 128), 74752, 74752, 120, 150, 0),
    (D("fp8", 192, 128).replace(block_m=128, block_n=128, num_warps=8, num_stages=4), 189440, 189440, 160, 190, 0),
    (D("fp8", 256, 256), 115712, 115712, 184, 216, 0),
    (D("fp8", 256, 256).replace(block_m=128, block_n=128, num_warps=8, num_stages=4), 295936, 295936, 224, 236, 0),
    (D("fp8", 256, 256).replace(block_m=128, block_n=128, rowsum="mma"), 232448, 232448, 432, 255, 1440),
    (
        D("fp8", 128, 128).replace(softmax="lean", rowsum="rounded", maxnreg=168, num_stages=2),
        74752,
        74752,
        160,
        156,
        0,
    ),
    (D("fp8", 128, 128).replace(block_m=128), 115712, 115712, 304, 255, 192),
    # FP8 V^T by pointer (POINTER_VT_BYTES_PER_REGISTER): the tightest clean one and spills it rejects
    (
        D("fp8", 128, 128).replace(block_m=128, num_warps=8, maxnreg=200, rowsum="mma", **PTR_VT),
        116736,
        116736,
        192,
        200,
        0,
    ),
    (
        D("fp8", 128, 128).replace(block_m=128, num_warps=8, num_stages=2, maxnreg=168, **PTR_VT),
        81920,
        81920,
        192,
        168,
        360,
    ),
    (
        D("fp8", 80, 80).replace(block_m=128, num_warps=8, num_stages=2, maxnreg=200, rowsum="mma", **PTR_VT),
        59392,
        59392,
        156,
        200,
        0,
    ),
    (D("fp8", 80, 80).replace(block_n=128, num_stages=2, maxnreg=168, **PTR_VT), 51200, 51200, 176, 168, 104),
    (D("fp8", 96, 96).replace(block_n=128, num_stages=4, maxnreg=168, **PTR_VT), 104448, 104448, 192, 168, 184),
    (D("bf16", 64, 64).replace(num_warps=4, num_stages=3, rowsum="mma"), 119808, 119808, 240, 254, 0),
    (D("bf16", 128, 128), 164864, 164864, 160, 188, 0),
    (D("bf16", 192, 128).replace(block_n=128), 214016, 214016, 160, 193, 0),
    (D("bf16", 256, 256), 197632, 196640, 184, 217, 0),
    (D("bf16", 256, 256).replace(num_stages=3), 263168, 263168, 184, 218, 0),
    (D("bf16", 256, 256).replace(block_n=128, num_stages=4), 590848, 590848, 224, 255, 24),
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


@pytest.mark.parametrize(
    "row",
    CALIBRATION,
    ids=lambda row: (
        f"{row[0].dtype}-{row[0].head_dim_qk}/{row[0].head_dim_v}-{row[0].block_m}x{row[0].block_n}"
        f"-w{row[0].num_warps}-s{row[0].num_stages}-{row[0].loads}-{row[0].v_layout}-{row[0].rowsum}"
        f"-{row[0].softmax}-r{row[0].maxnreg}"
    ),
)
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


def test_calibration_covers_the_head_dims_tiles_and_limits():
    rows = [r[0] for r in CALIBRATION]
    pairs = {(c.head_dim_qk, c.head_dim_v) for c in rows}
    assert {(64, 64), (128, 128), (192, 128), (256, 256)} <= pairs
    assert {c.block_n for c in rows} == {64, 128} and {c.block_m for c in rows} == {64, 128}
    over = [r for r in CALIBRATION if r[2] > SMEM_LIMIT]
    assert len(over) >= 2 and any(c.dtype == "bf16" and c.block_n == 128 and c.num_stages == 4 for c, *_ in over)
    assert any(r[2] <= SMEM_LIMIT and r[5] == 0 and r[2] > 0.9 * SMEM_LIMIT for r in CALIBRATION)
    assert SMEM_LIMIT == HOPPER.shared_memory_bytes == 232448


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
        assert moved and any(
            space._from_options({**start, k: space.as_optuna_params(c)[k]}, 128, 128) == c for k in moved
        )
    if family == "fp8-causal":  # both backends and lean P are reachable in one move from the Triton default
        assert {c.backend for c in near} == {"triton", "gluon"} and any(c.softmax == "lean" for c in near)
