"""The Gluon backend in the config layer: KernelConfig's backend rules, old JSON and the shipped
database unchanged, defaults, command-line overrides, the search space and the store's backend
column (CPU)."""

from __future__ import annotations

import dataclasses
import json
import sqlite3

import optuna
import pytest
from optuna.trial import TrialState

from zyfa_tune.db import TrialResult, open_store
from zyfa_tune.generator import CHOICES, GLUON_HEAD_DIMS, ConfigError, KernelConfig, emit, gluon_registers
from zyfa_tune.generator.config import GLUON_FIELDS, LATE_FIELDS, TRITON_FIELDS
from zyfa_tune.generator.defaults import config_with, default_config, parse_changes, parse_value
from zyfa_tune.kernels.dispatch import TUNED_DIR
from zyfa_tune.search_spaces import get_space
from zyfa_tune.tuning.warm_start import SEED_DATABASES, study_seeds

optuna.logging.set_verbosity(optuna.logging.WARNING)

GLUON = default_config("fp8", 128, 128, "gluon")
#: what qk_acc="f16" is built on: lean P folded by one saturating FMA, P through two shared-memory tiles
F16_NEEDS = dict(softmax="lean", rowsum="rounded", p_carry="smem2", lean_clamp="sat")
DEFAULTS = {f.name: f.default for f in dataclasses.fields(KernelConfig)}


# ---- validation -------------------------------------------------------------------------------


def test_gluon_default_is_the_spike_schedule():
    assert (GLUON.backend, GLUON.block_m, GLUON.block_n, GLUON.num_stages, GLUON.q_order) == (
        "gluon",
        128,
        128,
        3,
        "balanced",
    )
    assert GLUON.ping_pong and GLUON.overlap and GLUON.v_permute and GLUON.persistent and GLUON.q_stages == 1
    assert gluon_registers(GLUON) == (240, 24)
    assert KernelConfig.from_json(GLUON.to_json()) == GLUON


@pytest.mark.parametrize("field", TRITON_FIELDS)
def test_gluon_config_keeps_triton_fields_at_defaults(field):
    other = next(v for v in CHOICES[field] if v != DEFAULTS[field])
    with pytest.raises(ConfigError, match=rf"^{field}={other!r}: not a field of backend='gluon'"):
        GLUON.replace(**{field: other})


@pytest.mark.parametrize("field", GLUON_FIELDS)
def test_triton_config_keeps_gluon_fields_at_defaults(field):
    other = next(v for v in CHOICES[field] if v != DEFAULTS[field])
    with pytest.raises(ConfigError, match=rf"^{field}={other!r}: not a field of backend='triton'"):
        KernelConfig(**{field: other})
    needs = (
        {"exp2_poly": 4}
        if field == "exp2_poly_degree"
        else {"overlap": False}
        if field == "pv_defer"
        else {"q_order": "heavy_first"}
        if field == "persistent"
        else {"head_dim_qk": 96, "head_dim_v": 96}
        if field == "o_split"
        else {"overlap": False}
        if field == "half_block"
        else {"p_carry": "smem2"}
        if field == "o_through_p"
        else F16_NEEDS
        if field == "qk_acc"
        else dict(F16_NEEDS, qk_acc="f16")
        if field == "qk_async"
        else dict(F16_NEEDS, qk_acc="f16", lean_fold="corrected")
        if field == "lean_mufu"
        else dict(F16_NEEDS, qk_acc="f16")
        if field in ("lean_ref", "lean_floor")
        else {}
    )
    assert getattr(GLUON.replace(**needs, **{field: other}), field) == other  # a Gluon config takes it


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(dtype="bf16", p_scale_log2=0), r"^dtype='bf16': backend='gluon' emits FP8"),
        (dict(head_dim_qk=72, head_dim_v=72), r"^head_dim_qk=72: backend='gluon' reads FP8 Q and K by TMA"),
        (dict(head_dim_qk=80, head_dim_v=64, k_perm=True), r"^head_dim_qk=80: k_perm=True .* multiple of 32"),
        (
            dict(head_dim_v=40, v_layout="natural", v_permute=False),
            r"^head_dim_v=40: v_layout='natural' reads FP8 V rows by TMA",
        ),
        (dict(block_m=256), r"^block_m=256: .*block_m must be 64, 128 or 192"),
        (
            dict(o_split=True),
            r"^o_split=True splits a 96-column O into 64 \+ 32 columns: it needs head_dim_v=96, not 128",
        ),
        (
            dict(head_dim_qk=96, head_dim_v=96, o_split=True, block_n=192),
            r"^o_split=True is built for blocks of one key",
        ),
        (
            dict(head_dim_qk=96, head_dim_v=96, o_split=True, v_layout="natural", v_permute=False),
            r"^o_split=True reads the V\^T copy in two row boxes",
        ),
        (dict(num_stages=1), r"^num_stages=1: the Gluon K/V ring needs at least 2 stages"),
        (dict(block_m=64), r"^ping_pong=True needs two or three consumer warpgroups"),
        (
            dict(rowsum="mma", ex2_fence=True, v_permute=False),
            r"^ex2_fence=True with rowsum='mma' fences on the float32 "
            r"probabilities carried to the next step, which needs "
            r"v_permute=True",
        ),
        (dict(exp2_poly=3, softmax="lean", rowsum="mma"), r"^exp2_poly=3: the polynomial replaces exact-softmax"),
        (dict(exp2_poly_degree=2), r"^exp2_poly_degree=2: no polynomial with exp2_poly=0"),
        (dict(rowsum="rounded"), r"^rowsum='rounded': the exact Gluon kernel sums"),
        (dict(block_m=64, ping_pong=False, producer_regs=40), r"^producer_regs=40: with one consumer warpgroup"),
        (dict(overlap=False, ex2_fence=True), r"^ex2_fence=True needs overlap=True"),
        (
            dict(v_layout="natural"),
            r"^v_layout='natural' with backend='gluon' writes V\^T in key order: with v_permute=True it "
            r"needs k_perm=True",
        ),
        (
            dict(overlap=False, p_carry="e4m3"),
            r"^p_carry='e4m3' is how P is carried from one step to the next: it needs "
            r"overlap=True or pv_defer=True",
        ),
        (
            dict(v_permute=False, p_carry="e4m3"),
            r"^p_carry='e4m3' packs P as the A operand's .* it needs v_permute=True",
        ),
        (dict(rowsum="mma", ex2_fence=True, p_carry="e4m3"), r"^p_carry='e4m3' with ex2_fence=True and rowsum='mma'"),
        (
            dict(overlap=False, pv_defer=True, p_carry="smem"),
            r"^p_carry='smem' hands P\(j\) to the PV wgmma issued with "
            r"QK\^T\(j\+1\) through shared memory: it needs overlap=True",
        ),
        (
            dict(v_permute=False, p_carry="smem"),
            r"^p_carry='smem' packs P as the A operand's .* it needs v_permute=True",
        ),
        (dict(block_n=192, p_carry="smem"), r"^p_carry='smem' holds one key part's P tile: it needs block_n a power "),
        (
            dict(rowsum="mma", lane_sums=True),
            r"^lane_sums=True keeps float32 row sums per lane, .* not softmax='exact' "
            r"with rowsum='mma'",
        ),
        (
            dict(softmax="lean", rowsum="mma", lane_sums=True),
            r"^lane_sums=True .* not softmax='lean' with rowsum='mma'",
        ),
        (dict(softmax="lean", rowsum="fp32"), r"^rowsum='fp32': Gluon lean P sums .* \('mma'\) or by decoding"),
        (
            dict(softmax="lean", rowsum="rounded"),
            r"^rowsum='rounded' with softmax='lean' decodes the packed e4m3 codes",
        ),
        (
            dict(softmax="lean", rowsum="rounded", p_carry="e4m3", ex2_fence=True),
            r"^ex2_fence=True fences .* rowsum='rounded' under lean P has neither",
        ),
        (dict(block_n=192, lane_sums=True), r"^lane_sums=True sums one key part's scores per lane"),
        (dict(block_n=256, overlap=False, pv_defer=True, lane_sums=True), r"^lane_sums=True sums one key part's"),
        (dict(ex2_fence=True, lane_sums=True), r"^lane_sums=True with ex2_fence=True"),
        (
            dict(half_block=True),
            r"^half_block=True halves a first block: .* the plain schedule \(overlap=False\) or P "
            r"in shared memory \(p_carry 'smem' or 'smem2'\)",
        ),
        (dict(p_carry="e4m3", half_block=True), r"^half_block=True halves a first block: it needs pv_defer=False"),
        (dict(overlap=False, pv_defer=True, half_block=True), r"^half_block=True halves a first block"),
        (dict(overlap=False, block_n=192, half_block=True), r"^half_block=True halves a first block"),
        (dict(overlap=False, block_n=64, half_block=True), r"^half_block=True halves a first block"),
        (dict(p_carry="smem", block_n=64, half_block=True), r"^half_block=True halves a first block"),
        (
            dict(lean_mufu=2),
            r"^lean_mufu=2: a share of the f16 fold's pairs from the MUFU; it needs "
            r"softmax='lean', qk_acc='f16' and lean_fold 'corrected' or 'fma', not softmax='exact'",
        ),
        (
            dict(F16_NEEDS, qk_acc="f16", lean_fold="centered", lean_mufu=1),
            r"^lean_mufu=1: .* not softmax='lean', qk_acc='f16', lean_fold='centered'",
        ),
        (
            dict(lean_ref="max"),
            r"^lean_ref='max': the linear f16 fold's line on the row's own maximum; it needs "
            r"softmax='lean', qk_acc='f16' and lean_fold='fma' .* not softmax='exact'",
        ),
        (
            dict(F16_NEEDS, qk_acc="f16", lean_fold="centered", lean_ref="max"),
            r"^lean_ref='max': .* lean_fold='centered'",
        ),
        (dict(F16_NEEDS, lean_ref="max"), r"^lean_ref='max': .* qk_acc='f32'"),
        (
            dict(lean_floor=True),
            r"^lean_floor=True: a second line beside the linear f16 fold; it needs softmax='lean', "
            r"qk_acc='f16' and lean_fold 'fma' or 'centered', not softmax='exact'",
        ),
        (
            dict(F16_NEEDS, qk_acc="f16", lean_fold="corrected", lean_floor=True),
            r"^lean_floor=True: .* lean_fold='corrected'",
        ),
        (
            dict(o_through_p=True),
            r"^o_through_p=True stores O through the warpgroup's two P tiles: it needs "
            r"p_carry='smem2'",
        ),
        (dict(p_carry="smem", o_through_p=True), r"^o_through_p=True stores O through .* p_carry='smem2'"),
        (
            dict(head_dim_qk=96, head_dim_v=96, p_carry="smem2", o_through_p=True),
            r"^o_through_p=True stores O in column chunks of its own width: head_dim_v=96 is padded to 128",
        ),
        (
            dict(head_dim_qk=96, head_dim_v=96, o_split=True, p_carry="smem2", o_through_p=True),
            r"^o_through_p=True stores O through .* one O part",
        ),
        (
            dict(block_n=256, num_stages=2, p_carry="smem2", o_through_p=True),
            r"^o_through_p=True: at block_n=256 the 64 x 128 output tile already lives in the first P tile",
        ),
        (
            dict(head_dim_qk=256, head_dim_v=256, block_n=64, p_carry="smem2", o_through_p=True),
            r"^o_through_p=True at block_n=64: 256 columns would take 8 chunks of 32; at most 4",
        ),
        (dict(qk_acc="f16"), r"^qk_acc='f16' is built for lean P .* it needs softmax='lean'"),
        (
            dict(F16_NEEDS, lean_clamp="imax", qk_acc="f16"),
            r"^qk_acc='f16' folds as .* not lean_fold='fma', "
            r"lean_clamp='imax'",
        ),
        (dict(F16_NEEDS, lean_fold="sub_fma", qk_acc="f16"), r"^qk_acc='f16' folds as .* lean_fold='sub_fma'"),
        (
            dict(F16_NEEDS, p_carry="smem", qk_acc="f16"),
            r"^qk_acc='f16' is built on the two-P-tile step: it needs "
            r"p_carry='smem2', not 'smem'",
        ),
        (dict(F16_NEEDS, half_block=True, qk_acc="f16"), r"^half_block=True with qk_acc='f16'"),
    ],
)
def test_bad_gluon_combinations_name_the_field(changes, match):
    with pytest.raises(ConfigError, match=match):
        GLUON.replace(**changes)


def test_f16_scores_are_stored_only_when_set():
    """qk_acc is a late field: every stored lean config keeps its JSON; "f16" round-trips."""
    lean = GLUON.replace(**F16_NEEDS)
    f16 = lean.replace(qk_acc="f16")
    assert "qk_acc" not in lean.to_dict() and f16.to_dict()["qk_acc"] == "f16"
    assert KernelConfig.from_json(f16.to_json()) == f16 and "f16S" in f16.summary()


def test_natural_v_is_shared_and_stored_only_when_set():
    """v_layout is read by both backends (Gluon "natural": the producer transposes V in the kernel);
    a Gluon config stores it only when "natural", so every stored Gluon config keeps its JSON."""
    plain = GLUON.replace(v_permute=False)
    natural = plain.replace(v_layout="natural")
    assert "v_layout" not in plain.to_dict() and natural.to_dict()["v_layout"] == "natural"
    assert KernelConfig.from_json(natural.to_json()) == natural
    assert KernelConfig.from_json(plain.to_json()) == plain


def test_packed_p_carry_is_stored_only_when_set():
    packed = GLUON.replace(p_carry="e4m3")
    assert "p_carry" not in GLUON.to_dict() and packed.to_dict()["p_carry"] == "e4m3"
    assert KernelConfig.from_json(packed.to_json()) == packed
    assert GLUON.replace(overlap=False, pv_defer=True, p_carry="e4m3").p_carry == "e4m3"
    assert GLUON.replace(rowsum="fp32", ex2_fence=True, p_carry="e4m3").ex2_fence  # a fence on the row sums


def test_smem_p_carry_is_stored_and_summarised():
    smem = GLUON.replace(p_carry="smem")
    assert smem.to_dict()["p_carry"] == "smem" and KernelConfig.from_json(smem.to_json()) == smem
    assert "smemP" in smem.summary() and "packedP" not in smem.summary()


def test_output_through_p_tiles_is_stored_only_when_set_and_chunks_by_tile():
    """o_through_p (a field added after the shipped rows): in the JSON only when set; the output goes in
    chunks of what one P tile holds (64 x block_n e4m3 bytes = 64 x block_n / 2 bf16), so hd256 at 128
    keys stores 4 chunks of 64 columns and 192/128 two of 64; without it one store of O_W columns."""
    from zyfa_tune.generator.config import o_chunks, o_in_p_tile

    hd256 = GLUON.replace(head_dim_qk=256, head_dim_v=256, num_stages=2, p_carry="smem2", o_through_p=True)
    assert hd256.to_dict()["o_through_p"] is True and "o_through_p" not in GLUON.to_dict()
    assert KernelConfig.from_json(hd256.to_json()) == hd256 and "oThroughP" in hd256.summary()
    assert o_chunks(hd256) == (64, 4) and o_in_p_tile(hd256)
    assert o_chunks(hd256.replace(o_through_p=False)) == (256, 1) and not o_in_p_tile(hd256.replace(o_through_p=False))
    mla = hd256.replace(head_dim_qk=192, head_dim_v=128)
    assert o_chunks(mla) == (64, 2) and o_chunks(GLUON.replace(block_n=64, p_carry="smem2", o_through_p=True)) == (
        32,
        4,
    )
    wide = GLUON.replace(block_n=256, num_stages=2, p_carry="smem2")
    assert o_in_p_tile(wide) and o_chunks(wide) == (128, 1)  # fits whole in one tile: no chunks


def test_lane_sums_are_stored_only_when_set():
    lanes = GLUON.replace(lane_sums=True)
    assert "lane_sums" not in GLUON.to_dict() and lanes.to_dict()["lane_sums"] is True
    assert KernelConfig.from_json(lanes.to_json()) == lanes and "laneSums" in lanes.summary()
    with pytest.raises(ConfigError, match="lane_sums"):
        KernelConfig(lane_sums=True)  # a Triton config keeps the Gluon fields at their defaults


def test_named_turn_barrier_is_stored_only_when_set():
    named = GLUON.replace(turn_barrier="named")
    assert "turn_barrier" not in GLUON.to_dict() and named.to_dict()["turn_barrier"] == "named"
    assert KernelConfig.from_json(named.to_json()) == named


def test_three_consumer_warpgroups():
    """block_m=192: three 64-row consumer warpgroups (FA3's head-dim-64 tile); Gluon only (Triton
    tiles are powers of two); the consumers share what the producer leaves (setmaxnreg)."""
    three = GLUON.replace(head_dim_qk=64, head_dim_v=64, block_m=192)
    assert gluon_registers(three) == (160, 24)
    assert gluon_registers(three.replace(producer_regs=40)) == (152, 40)
    assert gluon_registers(GLUON) == (240, 24)  # two consumers, unchanged
    with pytest.raises(ConfigError, match=r"^block_m=192: Triton tiles are powers of two"):
        KernelConfig(block_m=192)


def test_gluon_values_are_type_checked():
    for field, bad in (
        ("ping_pong", 1),
        ("overlap", "true"),
        ("q_stages", True),
        ("producer_regs", 32),
        ("backend", "ptx"),
        ("v_permute", None),
    ):
        with pytest.raises(ConfigError, match=rf"^{field}: "):
            GLUON.replace(**{field: bad})


def test_unsupported_head_dims_never_reach_a_launch():
    """Head dims the Gluon backend cannot emit (Q/K widths not of 16s): configs, defaults and overrides
    all refuse them."""
    assert GLUON_HEAD_DIMS == ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))
    assert default_config("fp8", 192, 128, "gluon").block_n == 128
    assert default_config("fp8", 64, 64, "gluon").head_dim_v == 64
    assert default_config("fp8", 256, 256, "gluon").block_n == 64  # the 64 x 256 accumulator's registers
    assert default_config("fp8", 96, 96, "gluon").block_n == 128
    for dqk, dv in ((72, 72), (40, 128)):
        with pytest.raises(ConfigError, match="multiple of 16"):
            default_config("fp8", dqk, dv, "gluon")
        with pytest.raises(ConfigError, match="multiple of 16"):
            config_with("fp8", dqk, dv, {"backend": "gluon"})
    with pytest.raises(ConfigError, match="FP8"):
        default_config("bf16", 128, 128, "gluon")


# ---- serialisation and the shipped database ---------------------------------------------------


def test_json_holds_the_backends_own_fields():
    triton = json.loads(default_config("fp8", 128, 128).to_json())
    assert "backend" not in triton and not set(GLUON_FIELDS) & set(triton)
    gluon = json.loads(GLUON.to_json())
    assert gluon["backend"] == "gluon" and not set(TRITON_FIELDS) & set(gluon)
    # fields added after Gluon rows were shipped are stored only away from their defaults
    assert set(GLUON_FIELDS) - set(LATE_FIELDS) <= set(gluon) and not set(LATE_FIELDS) & set(gluon)
    # a JSON without the backend key is a Triton config; an explicit "triton" is the same config
    assert KernelConfig.from_json(json.dumps({**triton, "backend": "triton"})) == default_config("fp8", 128, 128)


def shipped_rows():
    with sqlite3.connect(f"file:{TUNED_DIR / 'h200.db'}?mode=ro", uri=True) as con:
        return con.execute("SELECT backend, config_json, source_hash FROM variants").fetchall()


def test_every_shipped_row_parses_to_the_same_json_and_source_hash():
    """The Triton rows, written before the Gluon backend existed, load to the same configs, serialise
    to the same text and emit the same source (hash) as when they were recorded. The Gluon rows (the
    15-minute study's winners) serialise to the same text; their source hash is the one measured,
    from before the device code gained lean P (an exact config's kernel runs the same code)."""
    rows = shipped_rows()
    assert len(rows) >= 10
    assert {backend for backend, _, _ in rows} == {"triton", "gluon"}
    for backend, text, source_hash in rows:
        config = KernelConfig.from_json(text)
        assert backend == config.backend
        assert config.to_json() == text
        if backend == "triton":
            assert emit(config).source_hash == source_hash, text
        else:
            assert config.softmax == "exact" and emit(config).source


def test_store_records_the_configs_backend(tmp_path):
    from zyfa_tune.db import Fingerprint, ProblemKey

    fp = Fingerprint(
        gpu_name="H200",
        compute_capability="9.0",
        sm_count=132,
        memory_bytes=1,
        driver="d",
        cuda="c",
        torch="t",
        triton="3.6.0",
        generator_version="0.1.0",
    )
    key = ProblemKey.from_shape(
        dtype="fp8", head_dim_qk=128, head_dim_v=128, causal=True, batch=2, heads=32, kv_heads=32, seqlen=8192
    )
    with open_store(tmp_path / "t.db") as store:
        store.record_trial(fp, key, GLUON, TrialResult("ok", median_ms=1.0), source_hash=emit(GLUON).source_hash)
        store.record_trial(
            fp,
            key,
            default_config("fp8", 128, 128),
            TrialResult("ok", median_ms=2.0),
            source_hash=emit(default_config("fp8", 128, 128)).source_hash,
        )
        with pytest.raises(ValueError, match="^backend: 'triton' differs from the config's backend 'gluon'"):
            store.record_trial(
                fp, key, GLUON, TrialResult("ok", median_ms=1.0), backend="triton", source_hash=emit(GLUON).source_hash
            )
        best = store.best_for(key)
        assert [(b.backend, KernelConfig.from_json(b.config_json)) for b in best] == [("gluon", GLUON)]
        assert sorted(t["backend"] for t in store.trials()) == ["gluon", "triton"]


# ---- defaults and overrides -------------------------------------------------------------------


def test_overrides_pick_the_named_backends_default():
    assert config_with("fp8", 128, 128, {"backend": "gluon"}) == GLUON
    assert config_with("fp8", 128, 128, {"backend": "gluon", "ping_pong": False}) == GLUON.replace(ping_pong=False)
    assert config_with("fp8", 128, 128, {"block_m": 128, "num_warps": 8}) == default_config("fp8", 128, 128).replace(
        block_m=128, num_warps=8
    )
    with pytest.raises(ConfigError, match="^num_warps=8: not a field of backend='gluon'"):
        config_with("fp8", 128, 128, {"backend": "gluon", "num_warps": 8})
    texts = ("128", "-1", "true", "False", "gluon", " 7 ")
    assert [parse_value(t) for t in texts] == [128, -1, True, False, "gluon", 7]
    # --set items, --ours / --enqueue comma lists: one parser
    assert parse_changes(["backend=gluon", " ping_pong = false , block_n=256,", ""], "--set") == {
        "backend": "gluon",
        "ping_pong": False,
        "block_n": 256,
    }
    for bad in ("backend", "=gluon", "a=1,b"):
        with pytest.raises(ConfigError, match="^--set: expected key=value"):
            parse_changes([bad], "--set")


def test_bench_ours_backend_gluon_is_the_gluon_default():
    from zyfa_tune.bench.peers.ours import parse_ours

    (spec,) = parse_ours("gluon:backend=gluon", ["fp8"])
    assert spec.label == "gluon" and spec.config_for(128, 128) == GLUON
    (spec,) = parse_ours("g2:backend=gluon,overlap=false,p_scale_log2=0", ["fp8"])
    assert spec.config_for(128, 128) == GLUON.replace(overlap=False, p_scale_log2=0)


# ---- search space -----------------------------------------------------------------------------


def test_space_seeds_the_gluon_default_right_after_the_triton_default():
    space = get_space("fp8")
    seeds = space.seeds(128, 128)
    assert seeds[:2] == [default_config("fp8", 128, 128), GLUON]
    assert space.as_optuna_params(GLUON)["backend"] == "gluon"
    assert space.seeds(64, 64)[1] == default_config("fp8", 64, 64, "gluon")
    assert space.seeds(96, 96)[1] == default_config("fp8", 96, 96, "gluon")
    for dqk, dv in ((72, 72), (40, 64)):  # no Gluon seed where Gluon does not implement the dims
        assert all(c.backend == "triton" for c in space.seeds(dqk, dv))
    assert all(c.backend == "triton" for c in get_space("bf16").seeds(128, 128))


def test_space_samples_both_backends_as_valid_canonical_configs():
    space = get_space("fp8")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=4))
    got = {"triton": set(), "gluon": set()}
    for _ in range(300):
        trial = study.ask()
        config = space.suggest(trial, 128, 128)
        if config is None:
            study.tell(trial, state=TrialState.PRUNED)
            continue
        assert space.canonical(config) == config and space.feasible(config) is None
        assert KernelConfig.from_json(config.to_json()) == config
        if config.backend == "gluon":  # Triton fields at their defaults, whatever was suggested
            assert all(getattr(config, f) == DEFAULTS[f] for f in TRITON_FIELDS)
            assert config.block_m > 64 or (not config.ping_pong and config.producer_regs == 24)
        else:
            assert config.block_m in (64, 128)  # a suggested 192 runs as 128 under Triton
        got[config.backend].add(config)
        study.tell(trial, 1.0)
    assert len(got["triton"]) > 20 and len(got["gluon"]) > 20
    assert {c.block_m for c in got["gluon"]} == {64, 128, 192}


def test_space_maps_gluon_to_triton_where_gluon_lacks_the_head_dims():
    space = get_space("fp8")
    study = optuna.create_study()
    study.enqueue_trial({**space.as_optuna_params(space.base(72, 128)), "backend": "gluon"})
    config = space.suggest(study.ask(), 72, 128)
    assert config is not None and config.backend == "triton"


def test_gluon_feasibility_rules():
    space = get_space("fp8")
    assert space.feasible(GLUON) is None
    reason = space.feasible(GLUON.replace(block_n=256, num_stages=2))
    assert reason.startswith("registers: a consumer warpgroup needs about 248")  # head dim 128: no extra
    assert space.feasible(GLUON.replace(block_n=256, num_stages=2, overlap=False)) is None
    assert space.feasible(GLUON.replace(block_n=256, q_stages=2, num_stages=4)).startswith("shared memory")
    assert space.feasible(GLUON.replace(v_permute=False, producer_regs=56)).startswith("registers")


def test_seed_databases_may_hold_gluon_winners(tmp_path):
    """A database whose best fp8 128 entry is a Gluon kernel seeds that kernel (as a point of the space)."""
    from zyfa_tune.db import Fingerprint, ProblemKey

    fp = Fingerprint(
        gpu_name="H200",
        compute_capability="9.0",
        sm_count=132,
        memory_bytes=1,
        driver="d",
        cuda="c",
        torch="t",
        triton="3.6.0",
        generator_version="0.1.0",
    )
    key = ProblemKey.from_shape(
        dtype="fp8", head_dim_qk=128, head_dim_v=128, causal=True, batch=1, heads=32, kv_heads=32, seqlen=16384
    )
    winner = GLUON.replace(q_stages=2, producer_regs=40)
    with open_store(tmp_path / "s.db") as store:
        store.record_trial(fp, key, winner, TrialResult("ok", median_ms=1.0), source_hash=emit(winner).source_hash)
    seeds = study_seeds(get_space("fp8"), 128, 128, databases=[tmp_path / "s.db", *SEED_DATABASES])
    assert winner in seeds


# ---- the dispatcher chooses between backends by measured speed alone ----------------------------


@pytest.mark.parametrize("gluon_ms,winner", [(0.5, "gluon"), (2.0, "triton")])
def test_dispatcher_picks_the_faster_backend(tmp_path, gluon_ms, winner):
    from zyfa_tune.db import Fingerprint, ProblemKey
    from zyfa_tune.generator import GENERATOR_VERSION
    from zyfa_tune.kernels import dispatch

    fp = Fingerprint(
        gpu_name="NVIDIA H200",
        compute_capability="9.0",
        sm_count=132,
        memory_bytes=1,
        driver="d",
        cuda="c",
        torch="t",
        triton="3.6.0",
        generator_version=GENERATOR_VERSION,
    )
    key = ProblemKey.from_shape(
        dtype="fp8", head_dim_qk=128, head_dim_v=128, causal=True, batch=2, heads=32, kv_heads=32, seqlen=8192
    )
    triton = default_config("fp8", 128, 128)
    with open_store(tmp_path / "d.db") as store:
        for cfg, ms in ((triton, 1.0), (GLUON, gluon_ms)):
            store.record_trial(
                fp, key, cfg, TrialResult("ok", median_ms=ms, tflops=1.0 / ms), source_hash=emit(cfg).source_hash
            )
    choice = dispatch.Dispatcher([str(tmp_path / "d.db")]).choose(key, ("NVIDIA H200", "9.0", GENERATOR_VERSION))
    assert choice.source == "exact" and choice.config.backend == winner


def test_l2_group_is_stored_only_when_set_and_named_in_the_summary():
    """l2_group_mib (a launch field added after the shipped rows): in the JSON and the one-line summary
    only away from 16, so every earlier config keeps its JSON and database rows."""
    balanced = GLUON.replace(q_order="balanced")
    wide = balanced.replace(l2_group_mib=32)
    assert "l2_group_mib" not in balanced.to_dict() and wide.to_dict()["l2_group_mib"] == 32
    assert KernelConfig.from_json(wide.to_json()) == wide and wide.kernel_config() == balanced
    assert wide.summary() == balanced.summary() + " L2group32MiB" and "L2group" not in balanced.summary()
    with pytest.raises(ConfigError, match="l2_group_mib: 12 is not one of"):
        balanced.replace(l2_group_mib=12)
    with pytest.raises(ConfigError, match="l2_group_mib: expected int"):
        balanced.replace(l2_group_mib="32")


def test_lean_code_sums_are_a_gluon_row_sum():
    """Gluon lean P sums its rounded probabilities by the row-sum MMA or (rowsum="rounded") by decoding
    its packed codes, per row or per lane; the JSON round-trips (rowsum is stored whenever lean) and the
    summary names the code sums. Exact softmax keeps "fp32" / "mma" only."""
    lean = GLUON.replace(softmax="lean", rowsum="mma", p_carry="e4m3")
    for lanes in (False, True):
        coded = lean.replace(rowsum="rounded", lane_sums=lanes)
        assert KernelConfig.from_json(coded.to_json()) == coded and coded.to_dict()["rowsum"] == "rounded"
        assert "codeSums" in coded.summary() and ("laneSums" in coded.summary()) == lanes
        assert emit(coded).source_hash != emit(lean).source_hash
    assert "codeSums" not in lean.summary()
    with pytest.raises(ConfigError, match="the exact Gluon kernel sums"):
        GLUON.replace(rowsum="rounded")
