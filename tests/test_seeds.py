"""Seeds: the named seed configs (search_spaces/seeds.py), a space's seeds with the shipped database's
winners (tuning.warm_start) and the winners' one-field twins (fp8_causal.field_twins). CPU only."""

from __future__ import annotations

import warnings

import pytest
from test_search_spaces import HEAD_PAIRS, ask_config, study

from zyfa_tune.generator import GLUON_HEAD_DIMS, ConfigError, KernelConfig
from zyfa_tune.generator.defaults import default_config, fallback_config
from zyfa_tune.generator.rules import lane_sums_conflict
from zyfa_tune.search_spaces import FAMILIES, get_space
from zyfa_tune.search_spaces.fp8_causal import field_twins
from zyfa_tune.search_spaces.seeds import (
    SEEDS,
    gluon_default_config,
    gluon_defer_config,
    gluon_lanes_config,
    gluon_lean_config,
    gluon_lean_f16_async_config,
    gluon_lean_f16_config,
    gluon_lean_max_config,
    gluon_lean_smem2_config,
    gluon_natural_config,
    gluon_smem2_config,
    gluon_three_config,
    gluon_wide_config,
)
from zyfa_tune.tuning.warm_start import SEED_DATABASES, database_winners, stored_bests, study_seeds

D = default_config


# ---- the named seeds ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: s.name)
def test_each_named_seed_is_a_feasible_point_where_it_is_a_seed(seed):
    """Every seed builds a valid, statically feasible point of the FP8 space at each head-dim pair it lists,
    and at no other Gluon pair (it raises ConfigError there or does not fit), so its list is exact."""
    space = get_space("fp8")
    assert seed.build.__doc__ and seed.head_dims and set(seed.head_dims) <= set(GLUON_HEAD_DIMS)
    for dims in GLUON_HEAD_DIMS:
        try:
            cfg = seed.build("fp8", *dims)
        except ConfigError:
            assert dims not in seed.head_dims, (seed.name, dims)
            continue
        assert (cfg.dtype, cfg.backend, cfg.head_dim_qk, cfg.head_dim_v) == ("fp8", "gluon", *dims)
        if dims in seed.head_dims:
            assert space.feasible(cfg) is None, (seed.name, dims, space.feasible(cfg))
            assert space.as_optuna_params(cfg) and KernelConfig.from_json(cfg.to_json()) == cfg
            assert cfg in study_seeds(space, *dims, loose=seed.loose)
            assert (cfg.softmax == "lean") is seed.loose
        else:
            assert space.feasible(cfg) is not None, (seed.name, dims)


def test_named_seeds_are_distinct_where_they_are_seeds():
    """No two seeds name the same kernel at a head-dim pair where both are seeds (except the chunked
    seed, which is the narrow one where the output through the P tiles does not apply)."""
    for dims in GLUON_HEAD_DIMS:
        built = [(s.name, s.build("fp8", *dims)) for s in SEEDS if dims in s.head_dims]
        configs = [c for _, c in built]
        twins = {n for n, c in built if configs.count(c) > 1}
        assert twins <= {"gluon_smem2_narrow_config", "gluon_smem2_chunked_config"}, (dims, twins)


def test_fallback_is_the_two_tile_seed_at_hd128():
    assert fallback_config("fp8", 128, 128) == gluon_smem2_config("fp8", 128, 128)
    assert fallback_config("fp8", 64, 64) == D("fp8", 64, 64)
    assert fallback_config("bf16", 128, 128) == D("bf16", 128, 128)


# ---- a space's seeds --------------------------------------------------------------------------


def shipped_best(dtype: str, dqk: int, dv: int) -> list[KernelConfig]:
    from zyfa_tune.db import open_store

    with open_store(SEED_DATABASES[0], readonly=True, create=False) as store:
        return [
            KernelConfig.from_json(e.config_json)
            for e in store.best_entries(head_dims=(dqk, dv), dtype=dtype)
            if e.key.causal
        ]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_seeds(family):
    space = FAMILIES[family]
    for dqk, dv in HEAD_PAIRS:
        seeds = study_seeds(space, dqk, dv)
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
    seeds = study_seeds(space, 128, 128)
    assert set(best) <= set(seeds)
    # the Triton default, then the Gluon default, its 256-key kernel and its one-launch natural-V twin,
    # then the database's
    assert seeds[:4] == [
        D("fp8", 128, 128),
        D("fp8", 128, 128, "gluon"),
        gluon_wide_config("fp8", 128, 128),
        gluon_natural_config("fp8", 128, 128),
    ]
    assert seeds[3].v_layout == "natural" and not seeds[3].v_permute
    assert gluon_lanes_config("fp8", 128, 128) in seeds  # the 256-key kernel with per-lane row sums
    assert not any(c.block_m == 192 for c in seeds)  # three consumers: seeded at head dim 64 only
    hd256 = study_seeds(space, 256, 256)
    assert gluon_defer_config("fp8", 256, 256) in hd256 and hd256[2].pv_defer and not hd256[2].overlap
    hd64 = study_seeds(space, 64, 64)
    assert gluon_three_config("fp8", 64, 64) in hd64 and hd64[4].block_m == 192 and not hd64[4].ping_pong


def test_database_winners_are_followed_by_their_lane_sums_twins():
    """The FP8 space seeds each shipped Gluon winner's twin with row sums per lane (a field added after
    most were tuned; measured +1.3-2.3% at 192/128 and hd256), after every winner, where it applies."""
    space = get_space("fp8")
    checked = found = 0
    for dqk, dv in ((128, 128), (192, 128), (256, 256)):  # (192/128's winners: row-sum MMA)
        winners = [c for c in shipped_best("fp8", dqk, dv) if c.backend == "gluon" and c.rowsum == "fp32"]
        best = [c for c in winners if not c.lane_sums and not lane_sums_conflict(vars(c))]  # (ex2_fence: none)
        seeds = study_seeds(space, dqk, dv)
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
    assert not any(c.lane_sums and c.block_m == 192 for c in study_seeds(space, 64, 64))


def test_two_tile_winners_get_output_through_p_twins():
    """192/128's shipped two-P-tile winners (128-key blocks: the 64 x 128 bf16 output does not fit a
    64 x 128 e4m3 P tile) are followed by their o_through_p twins, one with a Q ring of 2 where they
    had 1 (the 32 KB the output tiles took); hd128's 256-key winners (output already in a P tile) get none."""
    space = get_space("fp8")
    winners = [c for c in shipped_best("fp8", 192, 128) if c.p_carry == "smem2"]
    seeds = study_seeds(space, 192, 128)
    assert winners and all(c.replace(o_through_p=True) in seeds for c in winners)
    assert any(c.replace(o_through_p=True, q_stages=2) in seeds for c in winners if c.q_stages == 1)
    hd128 = study_seeds(space, 128, 128)
    assert not any(c.o_through_p and c.block_n == 256 for c in hd128)


def test_field_twins_at_head_dim_96():
    """A Gluon winner's one-field twins (`field_twins`, seeded after the database winners): per-lane
    row sums where they apply, at head dim 96 O in 64 + 32 columns (o_split) for a winner with O
    padded to 128 (+2% on the padded 4K winner), a winner with its half-empty first blocks halved
    (half_block: plain schedule or P in shared memory), an overlapped one with P through two shared-memory
    tiles (p_carry="smem2", halved too); none for a Triton config, none with o_split beyond head dim 96,
    none that is already set."""

    def kernel_twins(config):  # the twins that are other kernels (not the launch twin, tested below)
        return [t for t in field_twins(config) if t.kernel_config() != config.kernel_config()]

    wide96 = gluon_wide_config("fp8", 96, 96)
    assert kernel_twins(wide96) == [
        wide96.replace(lane_sums=True),
        wide96.replace(o_split=True),
        wide96.replace(half_block=True),
    ]
    lanes96 = wide96.replace(lane_sums=True)
    assert kernel_twins(lanes96) == [lanes96.replace(o_split=True), lanes96.replace(half_block=True)]
    assert kernel_twins(lanes96.replace(o_split=True, half_block=True)) == []
    wide128 = gluon_wide_config("fp8", 128, 128)
    assert kernel_twins(wide128) == [wide128.replace(lane_sums=True), wide128.replace(half_block=True)]
    # no half-block twin for a pv_defer winner (hd256's, 192/128's) or one overlapped with P in registers
    assert not any(c.half_block for c in kernel_twins(gluon_defer_config("fp8", 256, 256)))
    # an overlapped winner gets its two-P-tile twin (not a pv_defer one, nor lean P)
    assert kernel_twins(D("fp8", 96, 96)) == []  # (the Triton default)
    seed96 = D("fp8", 96, 96, "gluon")
    assert kernel_twins(seed96) == [
        seed96.replace(lane_sums=True),
        seed96.replace(o_split=True),
        seed96.replace(p_carry="smem2", half_block=True),
    ]
    # with P in shared memory a first block halves in the overlapped pipeline too
    two = seed96.replace(lane_sums=True, o_split=True, p_carry="smem2")
    assert kernel_twins(two) == [two.replace(half_block=True)]
    assert kernel_twins(two.replace(half_block=True)) == []
    assert not any(c.p_carry == "smem2" for c in kernel_twins(gluon_defer_config("fp8", 256, 256)))
    assert kernel_twins(gluon_lean_config("fp8", 128, 128)) == []
    # the shipped hd96 winners (the 4K one is that twin) are seeds; none of hd128's carries o_split
    seeds = study_seeds(get_space("fp8"), 96, 96)
    assert all(c in seeds for c in shipped_best("fp8", 96, 96) if c.backend == "gluon")
    assert not any(c.o_split for c in study_seeds(get_space("fp8"), 128, 128))


def test_a_lean_two_tile_winner_has_its_f16_score_twin():
    """qk_acc="f16": a lean winner on the two-P-tile step with the saturating fold gets its twin on
    f16 scores; not an exact winner, nor lean P carried in registers; an f16 winner's twins keep it (and get no
    halved first block, which has no f16 build)."""

    coded = gluon_lean_smem2_config("fp8", 128, 128)
    assert coded.replace(qk_acc="f16") in field_twins(coded)
    assert all(t.qk_acc == "f16" and not t.half_block for t in field_twins(coded.replace(qk_acc="f16")))
    assert not any(t.qk_acc == "f16" for t in field_twins(gluon_lean_config("fp8", 128, 128)))
    assert not any(t.qk_acc == "f16" for t in field_twins(gluon_smem2_config("fp8", 128, 128)))
    get_space("fp8").as_optuna_params(coded.replace(qk_acc="f16"))  # a point of the space


def test_an_f16_score_winner_has_its_qk_async_twin_and_f32_scores_never_sample_it():
    """qk_async: an f16-score winner gets its twin with QK^T's wait behind PV(j-1)'s issue, which is
    a point of the space; a float32-score config never decodes to qk_async=True (no such kernel), whatever the
    sampler suggests."""

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
    """lean_ref="max" and lean_floor: a linear-fold f16 winner gets its twin with the line on the row's
    own maximum, a point of the space; configs they do not apply to (exact, float32 scores, the corrected fold)
    never decode to them, whatever the sampler suggests."""

    f16 = gluon_lean_f16_async_config("fp8", 128, 128)
    assert f16.lean_ref == "grid" and f16.replace(lean_ref="max") in field_twins(f16)
    at_max = f16.replace(lean_ref="max")  # and its twin with a quarter of the pairs from the MUFU
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

    space = get_space("fp8")
    for carry in ("e4m3", "smem2"):
        lean = gluon_lean_config("fp8", 128, 128).replace(p_carry=carry)
        twin = lean.replace(rowsum="rounded", lane_sums=True)
        assert twin in field_twins(lean) and space.feasible(twin) is None
        space.as_optuna_params(twin)  # a point of the space
    assert not any(t.rowsum == "rounded" for t in field_twins(gluon_lean_config("fp8", 128, 128)))


def test_a_balanced_winner_has_its_l2_group_twin():
    """A winner with the balanced tile table gets the same kernel launched with 32 MiB head groups
    (the launch-only field l2_group_mib; 2.5-4% at 192/128 with 16 heads), last; a
    round-robin winner or one already at another group size does not."""

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
    space = get_space("fp8")
    lean = gluon_lean_config("fp8", 128, 128)
    assert lean.softmax == "lean" and lean.rowsum == "mma" and space.feasible(lean) is None
    # and the lean two-tile kernel that decodes its codes for the row sum, per lane
    coded = gluon_lean_smem2_config("fp8", 128, 128)
    assert (coded.softmax, coded.rowsum, coded.lane_sums, coded.p_carry) == ("lean", "rounded", True, "smem2")
    assert space.feasible(coded) is None
    strict, loose = study_seeds(space, 128, 128), study_seeds(space, 128, 128, loose=True)
    assert not any(c.softmax == "lean" for c in strict)
    # and the same on f16 scores, probabilities at 2^8
    f16 = gluon_lean_f16_config("fp8", 128, 128)
    assert f16 == coded.replace(qk_acc="f16", p_scale_log2=8) and space.feasible(f16) is None
    # and that with QK^T's wait behind PV(j-1)'s issue at a 24-register producer
    f16_async = gluon_lean_f16_async_config("fp8", 128, 128)
    assert f16_async == f16.replace(qk_async=True, producer_regs=24) and space.feasible(f16_async) is None
    # and that with the fold's line on each row's own maximum
    at_max = gluon_lean_max_config("fp8", 128, 128)
    assert at_max == f16_async.replace(lean_ref="max") and space.feasible(at_max) is None
    assert loose[:-5] == strict and loose[-5:] == [lean, coded, f16, f16_async, at_max]
    assert study_seeds(get_space("bf16"), 128, 128, loose=True) == study_seeds(get_space("bf16"), 128, 128)


@pytest.mark.parametrize("dims,block_n,q_stages", [((64, 64), 256, 2), ((192, 128), 128, 2), ((256, 256), 128, 1)])
def test_lean_max_seed_fits_every_head_dim(dims, block_n, q_stages):
    """The 256-key lean seeds exceed shared memory at 192/128 and hd256 and are skipped there; the lean seed on
    the row maximum takes 128-key blocks (and at hd256 one Q stage with O through the P tiles), so a loose study
    of those head dims starts from the kernel measured at 1.17-1.27x FA3-fp8."""

    space = get_space("fp8")
    cfg = gluon_lean_max_config("fp8", *dims)
    assert (cfg.block_n, cfg.q_stages, cfg.o_through_p) == (block_n, q_stages, dims == (256, 256))
    assert space.feasible(cfg) is None and cfg in study_seeds(space, *dims, loose=True)
    assert cfg not in study_seeds(space, *dims)
    if dims != (64, 64):
        assert space.feasible(gluon_lean_f16_async_config("fp8", *dims)) is not None


def test_seeds_without_database(tmp_path):
    space = get_space("bf16")
    assert study_seeds(space, 128, 128, databases=[tmp_path / "missing.db"]) == [space.base(128, 128)]
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"not a database")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert study_seeds(space, 128, 128, databases=[empty]) == [space.base(128, 128)]


def test_winners_are_seeded_in_order_for_their_own_problem_only():
    """`seeds(winners=...)` takes the configs the caller read (most wins first), canonical, each once, after
    the extra seeds; winners of other head dims or another dtype, and points outside the space, are left out."""
    space = get_space("fp8")
    plain = space.seeds(128, 128)
    a = D("fp8", 128, 128, "gluon").replace(q_stages=2, producer_regs=40)
    b = D("fp8", 128, 128, "gluon").replace(num_stages=4)
    odd = D("fp8", 128, 128).replace(lean_pack="bfi")  # the Triton default with an irrelevant lean field
    other = [D("fp8", 64, 64, "gluon"), D("bf16", 128, 128), D("fp8", 128, 128).replace(maxnreg=128)]
    seeds = space.seeds(128, 128, winners=[b, a, b, odd, *other])
    assert seeds[: len(plain)] == plain
    added = seeds[len(plain) :]
    assert added[:2] == [b, a] and space.canonical(odd) not in added
    assert not any(c in added for c in other)
    assert [c for c in added[2:] if c not in field_twins(a) + field_twins(b)] == []


def test_database_winners_count_wins_and_stored_bests_are_canonical():
    space = get_space("fp8")
    stored = stored_bests(space, SEED_DATABASES[0], 192, 128)
    assert stored and all(space.canonical(c) == c and c.head_dim_qk == 192 for c, _ in stored)
    winners = database_winners(space, 192, 128)
    counts = [sum(c == w for c, _ in stored) for w in winners]
    assert sorted(set(winners), key=winners.index) == winners and counts == sorted(counts, reverse=True)
    assert set(winners) == {c for c, _ in stored}


def test_shipped_configs_and_seeds_pass_the_static_checks_that_reject_spills():
    """Every best entry of the shipped databases (both GPUs) and every named seed where it is one (head dim 80
    too) passes the register estimate, while the spilling shapes it was extended for are rejected: a
    256-key pv_defer block at 224 registers, two P tiles at 256 keys with a halved first block, ping-pong
    and per-row sums at 224, three consumers with two P tiles and Q/K in three parts (their spills:
    tests/test_gluon_compile.py CALIBRATION)."""
    from zyfa_tune.db import open_store
    from zyfa_tune.kernels.dispatch import TUNED_DIR

    space = get_space("fp8")
    shipped = []
    for path in sorted(TUNED_DIR.glob("*.db")):
        with open_store(path, readonly=True, create=False) as store:
            shipped += [KernelConfig.from_json(e.config_json) for e in store.best_entries()]
    assert {c.head_dim_qk for c in shipped} >= {64, 80, 96, 128, 192, 256}
    for c in shipped:
        assert get_space(c.dtype).feasible(c) is None, (c, get_space(c.dtype).feasible(c))
    for seed in SEEDS:  # a seed of head dim 96 is one at 80 too (the same padded tiles) where it builds
        for dims in (*seed.head_dims, *([(80, 80)] if (96, 96) in seed.head_dims else [])):
            try:
                cfg = seed.build("fp8", *dims)
            except ConfigError:
                assert dims == (80, 80), (seed.name, dims)
                continue
            assert space.feasible(cfg) is None, (seed.name, dims, space.feasible(cfg))
    wide = dict(block_n=256, num_stages=2, q_stages=2, producer_regs=56)
    spilling = [
        gluon_default_config("fp8", 80, 80).replace(**wide, overlap=False, ping_pong=False, pv_defer=True),
        gluon_default_config("fp8", 80, 80).replace(**wide, p_carry="smem2", half_block=True),
        gluon_default_config("fp8", 80, 80).replace(block_m=192, p_carry="smem2", lane_sums=True, half_block=True),
    ]
    for c in spilling:
        assert (space.feasible(c) or "").startswith("registers"), c
