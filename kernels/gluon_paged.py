"""Paged KV caches on the Gluon backend: the launch of the varlen kernel's paged twin
(generator/gluon_sm90/emit.py, `emit(config, paged=True)`) and its per-layout fast path.

The twin is the varlen kernel with its producer reading each K and V block through the page table, so a
call is the varlen launch (kernels/gluon_varlen.py) over the caches viewed as (pages * page_size, kv_heads,
dim) rows, with the page table, its row stride and the page size appended. The per-sequence key counts
are the cache lengths: their cumulative offsets (`key_offsets`, built on the device on every call, no
synchronisation) feed the tile table and the kernel's key counts; no K / V row is read at them.
"""

from __future__ import annotations

import torch

from zyfa_tune.generator import ConfigError, KernelConfig
from zyfa_tune.generator.gluon_sm90.emit import varlen_error
from zyfa_tune.generator.gluon_sm90.params import paged_error as _twin_error
from zyfa_tune.search_spaces.resources import static_infeasibility
from zyfa_tune.search_spaces.seeds import gluon_natural_config

from . import fastlaunch, gluon_launch, gluon_varlen
from .launch import kernel, pages_by_tma, tma_readable, twin_names

_INT32_MAX = 2**31 - 1
#: producer registers of a natural-V k_perm kernel of 128 keys or more: its transposes beside the 5-D K box
#: coordinates spill 8 bytes with 40 (the exact schedules; lean P's compiles clean with either)
PERM_PRODUCER_REGS = 56


def natural_config(config: KernelConfig) -> KernelConfig:
    """The natural-V version of a Gluon `config` (a cache has no V^T copy): V read as stored and transposed
    by the producer warpgroup, with the producer registers of `gluon_natural_config` at least. A v_permute
    config keeps its P carry (lean P's too) by making the relabelling on K (k_perm: pages start on 16-key
    groups), at its own block or, where the raw V slots leave no shared memory for it, at 128 keys; else V^T
    in key order (no v_permute), or the natural seed of its head dims."""
    if config.v_layout == "natural":
        return config
    seed = gluon_natural_config(config.dtype, config.head_dim_qk, config.head_dim_v)
    regs = max(config.producer_regs, seed.producer_regs)
    tries = [dict(k_perm=True), dict(k_perm=True, block_n=128)] if config.v_permute else []
    for change in (*tries, dict(v_permute=False, k_perm=False)):
        try:
            natural = config.replace(v_layout="natural", producer_regs=regs, **change)
            if natural.k_perm and natural.block_n >= 128:
                natural = natural.replace(producer_regs=max(regs, PERM_PRODUCER_REGS))
        except ConfigError:
            continue
        if static_infeasibility(natural) is None:
            return natural
    return seed


def paged_error(config: KernelConfig, page_size: int) -> str | None:
    """Why the paged twin cannot run `config` on pages of `page_size` keys, or None: a natural-V Gluon config
    that runs packed sequences, whose Q/K and V are each one TMA-legal head-dim chunk (as
    `launch.pages_by_tma` restricts the Triton variant), on key blocks a page holds whole."""
    if config.backend != "gluon":
        return f"backend={config.backend!r}: the paged twin is a Gluon kernel"
    if why := _twin_error(config) or varlen_error(config, paged=True):
        return why
    if not pages_by_tma(config):
        return f"head dims {config.head_dim_qk}/{config.head_dim_v} are read in several chunks; pages are read by TMA"
    if page_size % config.block_n:
        return f"block_n={config.block_n} does not divide the page_size {page_size}"
    return None


def key_offsets(cache_seqlens: torch.Tensor) -> torch.Tensor:
    """int32 (batch + 1,) cumulative cache lengths on their device (two launches, no synchronisation)."""
    out = torch.zeros(cache_seqlens.shape[0] + 1, dtype=torch.int32, device=cache_seqlens.device)
    torch.cumsum(cache_seqlens, 0, dtype=torch.int32, out=out[1:])
    return out


def query_offsets(batch: int, seqlen_q: int, device: torch.device) -> torch.Tensor:
    """int32 (batch + 1,) cumulative query counts of `batch` sequences of `seqlen_q` rows (dense q)."""
    return torch.arange(0, (batch + 1) * seqlen_q, max(1, seqlen_q), dtype=torch.int32, device=device)[: batch + 1]


def arguments(
    config: KernelConfig,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    descales: tuple,
    pages: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    max_seqlen_q: int,
    sms: int,
    lse: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, options) of one paged call. q, out: packed (total_q, heads, dim), as
    gluon_varlen.arguments'; k_cache, v_cache: (num_pages, page_size, kv_heads, dim), TMA-readable;
    pages: (int32 cumulative query counts, int32 (batch, max_pages) page table with contiguous rows and a
    16-byte aligned base, int32 (batch,) cache lengths)."""
    cu_q, page_table, cache_seqlens = pages
    num_pages, page_size, hk, _ = k_cache.shape
    if why := paged_error(config, page_size):
        raise ValueError(f"config: {why}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not tma_readable(t):
            raise ValueError(f"{name}: pages must be contiguous rows from a 16-byte aligned base for TMA")
    ok = page_table.dtype == torch.int32 and page_table.dim() == 2 and page_table.stride(1) == 1
    if not ok or page_table.data_ptr() % 16:
        raise ValueError("page_table: expected int32 (batch, max_pages), rows contiguous, 16-byte aligned")
    if num_pages * page_size >= _INT32_MAX:  # (TMA row coordinates are int32)
        raise ValueError(f"k_cache: {num_pages} pages of {page_size} keys exceed 2^31 rows")
    rows = [t.flatten(0, 1) for t in (k_cache, v_cache)]  # (a view: tma_readable pages are evenly spaced rows)
    capacity = page_table.shape[1] * page_size
    cu = (cu_q, key_offsets(cache_seqlens))
    grid, args, options = gluon_varlen.arguments(
        config, q, *rows, out, softmax_scale, causal, descales, cu, (max_seqlen_q, capacity), sms, lse, window
    )
    return grid, (*args, page_table, page_table.stride(0), page_size), options


def run(config: KernelConfig, grid: tuple, args: tuple, options: dict, device: int, lse: bool, window: bool):
    """Launch `arguments`' call through the fast path; returns the CompiledKernel that ran."""
    causal = options["CAUSAL"]
    return fastlaunch.run(
        (config, causal, "-".join(("paged", *twin_names(lse, window)))),
        kernel(config, True, lse, window, True),
        grid,
        args,
        {"CAUSAL": causal},
        {"num_warps": options["num_warps"]},
        device,
    )


class PagedLaunch:
    """A paged Gluon kernel bound to one argument layout, for the API's fast path: each call views q, out
    and the caches as the bound launch reads them, builds the key offsets from the cache lengths and runs
    the varlen fast path (gluon_varlen.PackedLaunch) with the page table. `dense`: (batch, seqlen_q) where
    q is (batch, seqlen_q, heads, dim), whose query offsets are bound (and whose LSE is returned as
    (batch, heads, seqlen_q)); None for packed q."""

    __slots__ = ("packed", "dense", "cu_q")

    def __init__(self, packed: gluon_varlen.PackedLaunch, dense: tuple[int, int] | None, cu_q: torch.Tensor):
        self.packed, self.dense, self.cu_q = packed, dense, cu_q

    def __call__(self, q, k_cache, v_cache, out, qd, kd, vd, cu_seqlens_q=None, _cu_k=None, page_table=None,
                 cache_seqlens=None):  # fmt: skip
        rows = [t.flatten(0, 1) for t in (k_cache, v_cache)]
        qp, outp = (t.view(-1, *t.shape[-2:]) for t in (q, out))
        cu_q = self.cu_q if self.dense else cu_seqlens_q
        result = self.packed(qp, *rows, outp, qd, kd, vd, cu_q, key_offsets(cache_seqlens), page_table)
        if isinstance(result, tuple) and self.dense:
            return out, dense_lse(result[1], *self.dense).contiguous()
        return out if not isinstance(result, tuple) else (out, result[1])


def dense_lse(lse: torch.Tensor, batch: int, seqlen_q: int) -> torch.Tensor:
    """The kernel's (heads, batch * seqlen_q) LSE viewed as the API's (batch, heads, seqlen_q)."""
    return lse.view(lse.shape[0], batch, seqlen_q).transpose(0, 1)


def bind(config, q, k_cache, v_cache, out, softmax_scale, causal, descales, pages, max_seqlen_q, lse, window):
    """Launch one paged call and return a PagedLaunch for later calls of its layout, or None where a copy was
    made (no fast path). q, out: dense (batch, seqlen_q, heads, dim) or packed (total_q, heads, dim); pages:
    (cumulative query counts or None for dense q, page table, cache lengths); lse: the API's LSE to fill, or
    None; window: (left, right) bounds for the window twin, or None."""
    device = q.device.index
    sms = gluon_launch.sm_count(device) if q.device.type == "cuda" else gluon_launch.DEFAULT_SMS
    dense = None if pages[0] is not None else tuple(q.shape[:2])
    cu_q = pages[0] if dense is None else query_offsets(*dense, q.device)
    qp = q.reshape(-1, *q.shape[-2:])
    qp = qp if tma_readable(qp.unsqueeze(0)) else qp.contiguous()
    outp = out.view(-1, *out.shape[-2:])
    lse_p = lse if lse is None or dense is None else torch.empty(lse.shape[1], qp.shape[0], dtype=lse.dtype,
                                                                  device=lse.device)  # fmt: skip
    table = pages[1] if pages[1].data_ptr() % 16 == 0 else pages[1].clone()
    args = (softmax_scale, causal, descales, (cu_q, table, pages[2]), max_seqlen_q, sms, lse_p, window)
    grid, launch_args, options = arguments(config, qp, k_cache, v_cache, outp, *args)
    compiled = run(config, grid, launch_args, options, device, lse is not None, window is not None)
    if lse is not None and dense is not None:
        lse.copy_(dense_lse(lse_p, *dense))
    copied = qp.data_ptr() != q.data_ptr() or table is not pages[1]
    if copied or any(d is not None and d.data_ptr() % 16 for d in descales):
        return None
    lse_shape = None if lse is None else tuple(lse_p.shape)
    tail = gluon_launch.window_args(window, causal)
    packed = gluon_varlen.PackedLaunch(
        config, compiled, grid, device, launch_args[:-3], options, lse_shape, tail, launch_args[-2:]
    )
    return PagedLaunch(packed, dense, cu_q)
