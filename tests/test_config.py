"""KernelConfig validation: the only gate between untrusted data (database rows, JSON files) and
emitted kernel source."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from zyfa_tune.generator import CHOICES, ConfigError, KernelConfig
from zyfa_tune.generator.config import GLUON_FIELDS, HEAD_DIMS, LATE_FIELDS, SOFTMAX_FIELDS, TRITON_FIELDS
from zyfa_tune.generator.rules import triton_conflict

FIELDS = [f.name for f in dataclasses.fields(KernelConfig)]
#: a valid Gluon config to hold Gluon field values under test (two consumer warpgroups)
GLUON = KernelConfig(backend="gluon", block_m=128)


def valid_with(field: str, value) -> KernelConfig:
    """A config holding `field=value`, with the other fields adjusted to satisfy the
    combination rules (so that only the value under test decides acceptance)."""
    changes = {field: value}
    if field == "exp2_poly_degree":
        changes["exp2_poly"] = 4
    if field == "turn_barrier":
        changes["ping_pong"] = True
    if field in ("pv_defer", "half_block") and value:
        changes["overlap"] = False
    if field == "persistent" and not value:
        changes["q_order"] = "heavy_first"
    if field == "o_split" and value:
        changes.update(head_dim_qk=96, head_dim_v=96)
    if field.startswith("head_dim") and value % 16:  # (FP8 rows of 8s are not 16-byte TMA rows)
        changes["loads"] = "pointer"
    if field == "o_through_p" and value:
        changes["p_carry"] = "smem2"
    if field == "l2_group_mib":
        changes["q_order"] = "balanced"
    if (
        (field == "qk_acc" and value == "f16")
        or (field == "qk_async" and value)
        or (field == "lean_ref" and value != "grid")
        or (field == "lean_floor" and value)
    ):
        changes.update(softmax="lean", rowsum="rounded", p_carry="smem2", lean_clamp="sat", qk_acc="f16")
    if field == "lean_mufu" and value:
        changes.update(
            softmax="lean", rowsum="rounded", p_carry="smem2", lean_clamp="sat", qk_acc="f16", lean_fold="corrected"
        )
    if field in GLUON_FIELDS or (field, value) in (
        ("backend", "gluon"),
        ("block_m", 192),
        ("block_n", 192),
        ("q_order", "balanced"),
    ):
        return GLUON.replace(**changes)
    if field == "softmax" and value == "lean":
        changes["rowsum"] = "rounded"
    if field == "dtype" and value == "bf16":
        changes["p_scale_log2"] = 0
    if field == "scale_block" and value != 0:
        changes["block_n"] = value
    return KernelConfig(**changes)


# ---- accepted values ------------------------------------------------------------------------


def test_defaults_are_valid():
    cfg = KernelConfig()
    assert cfg.dtype == "fp8" and cfg.softmax == "exact"
    for name in FIELDS:
        assert getattr(cfg, name) in CHOICES[name]


def test_choices_cover_exactly_the_fields():
    assert set(CHOICES) == set(FIELDS)
    assert CHOICES["head_dim_qk"] == CHOICES["head_dim_v"] == HEAD_DIMS


@pytest.mark.parametrize("field,value", [(f, v) for f in FIELDS for v in CHOICES[f]])
def test_every_choice_is_accepted(field, value):
    cfg = valid_with(field, value)
    assert getattr(cfg, field) == value
    assert type(getattr(cfg, field)) is type(value)


@pytest.mark.parametrize(
    "values,broken",
    [
        (dict(softmax="lean", rowsum="rounded"), dict(rowsum="fp32")),
        (
            dict(softmax="lean", rowsum="mma", lean_fold="sub_fma", lean_clamp="fmax", lean_pack="bfi"),
            dict(dtype="bf16", p_scale_log2=0),
        ),
        (dict(dtype="bf16", p_scale_log2=0, rowsum="mma"), dict(p_scale_log2=8)),
        (dict(block_n=64, scale_block=64), dict(block_n=128)),
        (dict(block_n=256, scale_block=256, block_m=64, num_warps=4), dict(scale_block=128)),
    ],
)
def test_valid_combinations_and_their_nearest_invalid_one(values, broken):
    """A combination the rules allow keeps its values and round-trips; one field more breaks a rule."""
    cfg = KernelConfig(**values)
    assert {k: getattr(cfg, k) for k in values} == values
    assert triton_conflict(vars(cfg)) is None and KernelConfig.from_json(cfg.to_json()) == cfg
    assert triton_conflict({**vars(cfg), **broken}) is not None
    with pytest.raises(ConfigError):
        cfg.replace(**broken)


# ---- rejected values ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_m", 32),
        ("block_m", 512),
        ("block_m", 0),
        ("block_m", -128),
        ("block_m", 129),
        ("block_n", 16),
        ("block_n", 512),
        ("num_warps", 2),
        ("num_warps", 32),
        ("num_stages", 0),
        ("num_stages", 6),
        ("p_scale_log2", -1),
        ("p_scale_log2", 9),
        ("p_scale_log2", 2**64),
        ("scale_block", 16),
        ("scale_block", 512),
    ],
)
def test_out_of_range_int_rejected(field, value):
    with pytest.raises(ConfigError, match=rf"^{field}: {value!r} is not one of"):
        KernelConfig(**{field: value})


@pytest.mark.parametrize("field", ["head_dim_qk", "head_dim_v"])
@pytest.mark.parametrize("value", [84, 0, 16, 512, -64])
def test_out_of_range_head_dim_rejected(field, value):
    with pytest.raises(ConfigError, match=rf"^{field}: {value!r} is not a head dim .* multiple of 8 from 32 to 256"):
        KernelConfig(**{field: value})


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_m", "128"),
        ("block_m", 128.0),
        ("block_m", True),
        ("block_m", None),
        ("block_m", np.int64(128)),
        ("block_m", [128]),
        ("num_warps", 8.0),
        ("head_dim_qk", "128"),
        # bool is an int subclass and True == 1 is inside range(0, 9): must still be refused
        ("p_scale_log2", True),
        ("p_scale_log2", False),
        ("scale_block", False),
        ("num_stages", True),
        ("softmax", None),
        ("softmax", 1),
        ("softmax", b"exact"),
        ("dtype", ["fp8"]),
    ],
)
def test_wrong_type_rejected(field, value):
    with pytest.raises(ConfigError, match=rf"^{field}: expected (int|str), got"):
        KernelConfig(**{field: value})


def test_str_subclass_rejected():
    class Sneaky(str):
        def __repr__(self):  # would change what an f-string with !r writes
            return "__import__('os')"

    with pytest.raises(ConfigError, match="^softmax: expected str, got Sneaky"):
        KernelConfig(softmax=Sneaky("exact"))


@pytest.mark.parametrize(
    "field,value",
    [
        ("dtype", "fp16"),
        ("dtype", "FP8"),
        ("dtype", "e4m3"),
        ("dtype", ""),
        ("softmax", "EXACT"),
        ("softmax", "exact "),
        ("softmax", "fast"),
        ("lean_fold", "fma2"),
        ("lean_clamp", "max"),
        ("lean_pack", "shf"),
        ("rowsum", "fp16"),
        ("q_order", "backward"),
    ],
)
def test_unknown_enum_rejected(field, value):
    with pytest.raises(ConfigError, match=rf"^{field}: .* is not one of"):
        KernelConfig(**{field: value})


@pytest.mark.parametrize(
    "field,value",
    [
        ("softmax", "exact\nimport os"),
        ("dtype", "fp8'); import os; #"),
        ("lean_pack", "prmt;\n}"),
        ("lean_fold", 'fma", "=r"); __import__("os").system("id"); ("'),
        ("lean_clamp", "imax;\nst.global.u32 [0], 0;"),
        ("rowsum", "fp32\n    import os"),
        ("q_order", "forward # "),
        ("dtype", "bf16\x00"),
    ],
)
def test_injection_strings_rejected(field, value):
    with pytest.raises(ConfigError, match=rf"^{field}: .* is not one of"):
        KernelConfig(**{field: value})
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        KernelConfig.from_json(json.dumps({field: value}))


# ---- combination rules ----------------------------------------------------------------------


def test_lean_needs_fp8():
    with pytest.raises(ConfigError, match=r"softmax='lean'.*dtype='fp8'"):
        KernelConfig(dtype="bf16", p_scale_log2=0, softmax="lean", rowsum="rounded")


def test_lean_with_fp32_rowsum_rejected():
    with pytest.raises(ConfigError, match=r"softmax='lean'.*rowsum"):
        KernelConfig(softmax="lean", rowsum="fp32")


@pytest.mark.parametrize("p", range(1, 9))
def test_bf16_needs_p_scale_zero(p):
    with pytest.raises(ConfigError, match=r"^p_scale_log2 must be 0 for dtype='bf16'"):
        KernelConfig(dtype="bf16", p_scale_log2=p)


@pytest.mark.parametrize("block_n,scale_block", [(128, 64), (64, 128), (32, 256), (256, 32)])
def test_scale_block_must_be_zero_or_block_n(block_n, scale_block):
    with pytest.raises(ConfigError, match=rf"^scale_block={scale_block}: .*block_n={block_n}"):
        KernelConfig(block_n=block_n, scale_block=scale_block)


def test_replace_revalidates():
    cfg = KernelConfig()
    assert cfg.replace(block_m=64).block_m == 64
    with pytest.raises(ConfigError, match="^block_m:"):
        cfg.replace(block_m=7)
    with pytest.raises(ConfigError, match="softmax='lean'"):
        cfg.replace(softmax="lean")  # rowsum stays fp32
    with pytest.raises(ConfigError, match="^scale_block="):
        cfg.replace(block_n=64, scale_block=128)


# ---- from_dict / from_json ------------------------------------------------------------------


def test_from_dict_unknown_keys():
    with pytest.raises(ConfigError, match=r"unknown config fields: \['evil'\]"):
        KernelConfig.from_dict({"block_m": 128, "evil": 1})
    with pytest.raises(ConfigError, match=r"unknown config fields: \['1', '__class__'\]"):
        KernelConfig.from_dict({1: 2, "__class__": "x"})


@pytest.mark.parametrize("data", [[("block_m", 128)], "block_m=128", None, 128, ("fp8",)])
def test_from_dict_non_mapping(data):
    with pytest.raises(ConfigError, match="config must be a mapping"):
        KernelConfig.from_dict(data)


def test_from_dict_validates_values():
    with pytest.raises(ConfigError, match="^block_m: expected int"):
        KernelConfig.from_dict({"block_m": "128"})
    assert KernelConfig.from_dict({}) == KernelConfig()
    assert KernelConfig.from_dict({"block_m": 64}).block_m == 64


@pytest.mark.parametrize("text", ["", "{", "not json", "{'block_m': 128}", '{"block_m": 128,}', None])
def test_from_json_invalid(text):
    with pytest.raises(ConfigError, match="config is not valid JSON"):
        KernelConfig.from_json(text)


@pytest.mark.parametrize("text", ["[" * 100_000, '{"a":' * 100_000], ids=["array", "object"])
def test_from_json_deeply_nested(text):
    with pytest.raises(ConfigError, match="config is not valid JSON"):
        KernelConfig.from_json(text)


@pytest.mark.parametrize(
    "text,match",
    [
        ("[1, 2]", "config must be a mapping"),
        ('"fp8"', "config must be a mapping"),
        ("null", "config must be a mapping"),
        ('{"block_m": 128.0}', "^block_m: expected int, got float"),
        ('{"block_m": true}', "^block_m: expected int, got bool"),
        ('{"p_scale_log2": 1e0}', "^p_scale_log2: expected int, got float"),
        ('{"softmax": ["exact"]}', "^softmax: expected str, got list"),
        ('{"dtype": "fp8", "dtype2": "x"}', "unknown config fields"),
    ],
)
def test_from_json_bad_content(text, match):
    with pytest.raises(ConfigError, match=match):
        KernelConfig.from_json(text)


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError):
        KernelConfig(block_m=1)


# ---- serialisation, immutability ------------------------------------------------------------

ROUND_TRIP = [
    KernelConfig(),
    KernelConfig(
        dtype="bf16",
        p_scale_log2=0,
        head_dim_qk=192,
        head_dim_v=128,
        block_n=64,
        num_stages=2,
        rowsum="mma",
        q_order="forward",
    ),
    KernelConfig(
        softmax="lean",
        rowsum="rounded",
        lean_fold="sub_fma",
        lean_clamp="fmax",
        lean_pack="bfi",
        p_scale_log2=5,
        block_n=64,
        scale_block=64,
    ),
    GLUON.replace(
        ping_pong=False,
        overlap=False,
        q_stages=2,
        v_permute=False,
        persistent=False,
        producer_regs=40,
        q_order="heavy_first",
    ),
    GLUON.replace(rowsum="mma"),
    GLUON.replace(exp2_poly=3, exp2_poly_degree=2),
]


@pytest.mark.parametrize("cfg", ROUND_TRIP, ids=range(len(ROUND_TRIP)))
def test_round_trip(cfg):
    text = cfg.to_json()
    back = KernelConfig.from_json(text)
    assert back == cfg and hash(back) == hash(cfg)
    assert back.to_json() == text
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert json.loads(text) == cfg.to_dict()
    # canonical form: sorted keys, no whitespace (so it can serve as a database key)
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    # a config serialises its backend's fields: a Triton config exactly the fields it had before
    # the Gluon backend existed (so its JSON, database rows and emitted source are unchanged)
    # (a Gluon config stores the softmax fields under softmax="exact", and the fields added since
    # Gluon rows were shipped, only away from their defaults: older rows keep their JSON)
    if cfg.backend == "gluon":
        late = LATE_FIELDS + (SOFTMAX_FIELDS if cfg.softmax == "exact" else ())
        other = TRITON_FIELDS + tuple(f for f in late if getattr(cfg, f) == getattr(KernelConfig(), f))
    else:
        other = GLUON_FIELDS + ("backend",)
    assert list(json.loads(text)) == sorted(set(FIELDS) - set(other))


def test_gluon_json_of_shipped_rows_is_unchanged():
    """The exact Gluon JSON the shipped database holds (before rowsum="mma" and exp2_poly existed)."""
    shipped = (
        '{"backend":"gluon","block_m":128,"block_n":128,"dtype":"fp8","ex2_fence":false,"head_dim_qk":128,'
        '"head_dim_v":128,"num_stages":3,"overlap":true,"p_scale_log2":8,"persistent":false,"ping_pong":false,'
        '"producer_regs":24,"q_order":"forward","q_stages":1,"v_permute":true}'
    )
    cfg = KernelConfig.from_json(shipped)
    assert cfg.to_json() == shipped
    assert '"rowsum":"mma"' in cfg.replace(rowsum="mma").to_json()
    assert '"exp2_poly":3' in cfg.replace(exp2_poly=3).to_json()


def test_frozen():
    cfg = KernelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_m = 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.softmax = "exact\nimport os"
    with pytest.raises(dataclasses.FrozenInstanceError):
        del cfg.dtype
    assert cfg.block_m == 64 and cfg.softmax == "exact"


def test_equal_configs_hash_equal():
    a, b = KernelConfig(block_m=128), KernelConfig(block_m=128)
    assert a == b and hash(a) == hash(b)
    assert len({a, b, KernelConfig()}) == 2
