"""Paged KV caches (`zyfa-tune bench --lengths MIX --paged PAGE_SIZE`): each of our systems on packed
sequences also runs as `<name>-paged`, `flash_attn_with_kvcache` over a cache holding the same keys and
values on shuffled pages (the queries are every token: a whole prefill from the cache), and as
`<name>-paged-contiguous`, the same call and config on a cache whose pages are in order. The pair's ratio
is what scattered pages cost the same kernel; the cache is built where a system is prepared, outside its
timing. With an FA3 varlen peer, FA3's KV-cache entry point runs on the same pages too (`<peer>-paged`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from zyfa_tune.bench.inputs import Inputs
from zyfa_tune.bench.peers.base import Bound, boxed
from zyfa_tune.bench.peers.ours import Ours
from zyfa_tune.bench.peers.varlen import FA3Varlen, one_entry
from zyfa_tune.bench.shape import BenchShape
from zyfa_tune.generator import KernelConfig
from zyfa_tune.tuning.fa3 import fa3_width


@dataclass(frozen=True)
class _PagedBase(Ours):
    page_size: int = 128

    quant_modes: ClassVar[tuple[str, ...]] = ("per-tensor",)
    packed: ClassVar[bool] = True
    suffix: ClassVar[str] = ""

    @property
    def name(self) -> str:
        return self.spec.label + self.suffix

    def supports(self, shape: BenchShape) -> bool:
        return bool(shape.lengths)

    def _config(self, x: Inputs) -> tuple[KernelConfig, str]:
        """The paged call's config and why: the forced one (V read as stored), or what
        `flash_attn_with_kvcache` picks for these pages (`kvcache.dispatched_paged_config`)."""
        from zyfa_tune import kvcache
        from zyfa_tune.kernels.gluon_paged import natural_config
        from zyfa_tune.varlen import natural_twin

        s, spec = x.shape, self.spec
        forced = spec.config_for(s.head_dim_qk, s.head_dim_v)
        if forced is not None and forced.backend == "gluon":  # (the paged twin's natural-V version)
            return natural_config(forced), "forced"
        if forced is not None:  # as flash_attn_with_kvcache would run it on these pages, for both rows
            return kvcache.paged_config(natural_twin(forced), self.page_size), "forced"
        mean = -(-s.tokens // s.batch)  # (the dispatcher keys a packed call on its mean query length)
        dims = (spec.dtype, s.head_dim_qk, s.head_dim_v, True, s.batch, s.heads, s.kv_heads, mean, self.page_size)
        return kvcache.dispatched_paged_config(*dims, False, x.q16.device.index or 0), "ours"

    def _bound(self, run, config: KernelConfig, source: str) -> Bound:
        call, output = boxed(run, one_entry)
        return Bound(call, output, config.to_json(), source)


@dataclass(frozen=True)
class PagedOurs(_PagedBase):
    """`flash_attn_with_kvcache` on the shuffled pages, with the config it picks (or the forced one)."""

    suffix: ClassVar[str] = "-paged"
    shuffled: ClassVar[bool] = True

    def prepare(self, x: Inputs) -> Bound:
        from zyfa_tune.kvcache import flash_attn_with_kvcache

        spec = self.spec
        (q, k, v), kw = x.args(spec.dtype, spec.quant)
        cu, most = x.packed_bounds()
        k_cache, v_cache, table, lens = cache_of(x, k, v, self.page_size, self.shuffled)
        config, source = self._config(x)
        forced = None if source == "ours" else config

        def run():
            return flash_attn_with_kvcache(
                q[0], k_cache, v_cache, cache_seqlens=lens, page_table=table, cu_seqlens_q=cu, max_seqlen_q=most,
                causal=True, config=forced, **kw,
            )  # fmt: skip

        return self._bound(run, config, source)


@dataclass(frozen=True)
class ContiguousTwin(PagedOurs):
    """The same call, same config, on a cache whose pages are in order: each sequence's keys one run of rows."""

    suffix: ClassVar[str] = "-paged-contiguous"
    shuffled: ClassVar[bool] = False


@dataclass(frozen=True)
class FA3Paged:
    """FA3's `flash_attn_with_kvcache` on the same shuffled pages as `<name>-paged` (built alike, outside its
    timing): the peer of our paged rows, where FA3 has the head dims' kernel."""

    name: str
    dtype: str
    page_size: int = 128
    kind: ClassVar[str] = "peer"
    quant_modes: ClassVar[tuple[str, ...]] = ("per-tensor",)
    packed: ClassVar[bool] = True

    def supports(self, shape: BenchShape) -> bool:
        return bool(shape.lengths) and fa3_width(shape.head_dim_qk) == shape.head_dim_qk == shape.head_dim_v

    def prepare(self, x: Inputs) -> Bound:
        from fa3_fwd_interface import flash_attn_with_kvcache as fa3_kvcache

        (q, k, v), kw = x.args(self.dtype)
        cu, most = x.packed_bounds()
        k_cache, v_cache, table, lens = cache_of(x, k, v, self.page_size, True)

        def run():
            return fa3_kvcache(
                q[0], k_cache, v_cache, cache_seqlens=lens, page_table=table, cu_seqlens_q=cu, max_seqlen_q=most,
                causal=True, **kw,
            )  # fmt: skip

        return Bound(*boxed(run, one_entry))


def cache_of(x: Inputs, k: torch.Tensor, v: torch.Tensor, page_size: int, shuffled: bool) -> tuple:
    """The paged cache of the packed K and V (batch entry 0) on pages of `page_size`: shuffled by a generator
    seeded with the token count (every system of a shape gets the same pages), or in order."""
    from zyfa_tune.kvcache import paged_from_packed

    s = x.shape
    shuffle = torch.Generator().manual_seed(s.tokens) if shuffled else None
    return paged_from_packed(k[0], v[0], list(s.lengths), page_size, shuffle)


def paged_systems(ours, page_size: int, peers=()) -> list:
    """Each of our systems on the paged cache and its contiguous twin; for each FA3 varlen peer among `peers`
    (peer objects), FA3's KV-cache entry point on the same pages (`<peer>-paged`)."""
    systems: list = [cls(spec, page_size) for spec in ours for cls in (PagedOurs, ContiguousTwin)]
    fa3 = [FA3Paged(f"{p.name}-paged", p.dtype, page_size) for p in peers if isinstance(p, FA3Varlen)]
    return systems + fa3
