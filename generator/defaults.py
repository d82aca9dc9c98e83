"""Safe default configs: what runs when no tuned entry matches (and the tuner's baseline), and the
command-line way to change one (`config_with`, `parse_changes`). The search spaces' seeds are in
search_spaces/seeds.py.

The Triton defaults come from sweeps on an H200: TMA loads everywhere; for FP8 a (dim, keys) copy of V
so that the P@V wgmma reads V K-major, and 64-row programs of one warpgroup (two or three programs
share an SM, which overlaps one's softmax with another's MMAs).

The Gluon default is the best schedule of a sweep of its untuned ones: two ping-ponging consumer
warpgroups with intra-warpgroup overlap, 128-key blocks in a 3-stage K/V ring, key-permuted V^T,
persistent tiles on the launcher's balanced schedule (1.04-1.05x round robin at 4K-16K, bitwise the
same output), producer warp at 24 registers.
"""

from __future__ import annotations

from collections.abc import Iterable

from .config import ConfigError, KernelConfig


def default_config(dtype: str, head_dim_qk: int, head_dim_v: int, backend: str = "triton") -> KernelConfig:
    """A config that compiles without spills and fits shared memory for this head-dim pair.
    KernelConfig's own defaults are the FP8 head-dim-128 default. backend="gluon" raises
    ConfigError for what the Gluon backend does not implement (bf16, rules.gluon_head_dim_conflict).
    An FP8 width that is a multiple of 8 but not of 16 loads by pointer (TMA needs 16-byte rows)."""
    if backend == "gluon":  # head_dim_v 256: a 64 x 256 fp32 accumulator leaves registers for 64-key blocks
        wide = head_dim_v > 128
        return KernelConfig(
            backend="gluon",
            dtype=dtype,
            head_dim_qk=head_dim_qk,
            head_dim_v=head_dim_v,
            block_m=128,
            block_n=64 if wide else 128,
            num_stages=2 if wide else 3,
            q_order="balanced",
            p_scale_log2=8,
        )
    big = max(head_dim_qk, head_dim_v) > 128
    dims = dict(head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, block_n=64 if big else 128)
    if dtype == "fp8":  # query blocks in launch order: the fp8 studies preferred it (1.02-1.23x)
        if head_dim_qk % 16 or head_dim_v % 16:  # (pointer loads hold more registers: 200 spilled at 64 keys)
            dims.update(loads="pointer", block_n=32 if big else 128)
        return KernelConfig(dtype="fp8", q_order="forward", **dims)
    return KernelConfig(
        dtype="bf16", block_m=128, num_warps=8, num_stages=2, p_scale_log2=0, v_layout="natural", **dims
    )


def fallback_config(dtype: str, head_dim_qk: int, head_dim_v: int) -> KernelConfig:
    """What `flash_attn_func` runs where no tuned entry applies (the untuned kernel): at FP8 head dim
    128 the overlapped Gluon kernel on 256-key blocks with P through two shared-memory tiles, per-lane
    row sums and halved first blocks (the FP8 space's seed `gluon_smem2_config`: 0.99x / 1.01x / 1.00x
    FA3-fp8 at 4K / 8K / 16K on an H200, 1.04x / 1.07x the plain 256-key kernel at 4K / 8K), else
    `default_config`. Other head dims keep the Triton default until a Gluon config is measured faster
    there untuned."""
    if dtype == "fp8" and (head_dim_qk, head_dim_v) == (128, 128):
        return default_config(dtype, head_dim_qk, head_dim_v, "gluon").replace(
            block_n=256, num_stages=2, ping_pong=False, q_stages=2, p_carry="smem2", lane_sums=True, half_block=True
        )
    return default_config(dtype, head_dim_qk, head_dim_v)


def config_with(dtype: str, head_dim_qk: int, head_dim_v: int, changes: dict) -> KernelConfig:
    """The default config of these head dims (of the backend `changes` names, if any) with `changes`
    applied; ConfigError names a bad field. What `--set` / `--ours key=val,...` mean."""
    base = default_config(dtype, head_dim_qk, head_dim_v, changes.get("backend", "triton"))
    return KernelConfig.from_dict({**base.to_dict(), **changes})


def parse_value(text: str) -> int | bool | str:
    """A command-line field value: an integer, true / false, or the text itself."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_changes(items: Iterable[str], what: str) -> dict[str, int | bool | str]:
    """Command-line `key=value` items (one per item, or comma-separated within one) -> config field
    changes for `config_with`; `what` (the option) names a malformed item."""
    out: dict[str, int | bool | str] = {}
    for item in (part.strip() for text in items for part in text.split(",")):
        if not item:
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{what}: expected key=value, got {item!r}")
        out[key.strip()] = parse_value(val)
    return out
