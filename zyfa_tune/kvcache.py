"""`flash_attn_with_kvcache`: FlashAttention-3's forward over a paged KV cache, for prefill chunks.

A serving engine keeps each sequence's keys and values in fixed-size pages of one cache tensor;
a chunked prefill or a prefix-cache hit runs its new queries against the cached prefix plus the
new tokens, whose K/V the engine has already written into the cache. The call runs on the paged
twin of the dispatcher's Gluon choice where it can (kernels/gluon_paged.py), else on the serving
variant of a Triton config with PAGED on (generator/triton/emit.py): each key tile reads its page
through the page table. The argument checks and the per-layout fast path are
flash_attn_func's and flash_attn_varlen_func's (zyfa_tune/api.py, zyfa_tune/varlen.py); only what
a cache adds is checked here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zyfa_tune import api as _api
from zyfa_tune import varlen as _varlen
from zyfa_tune.api import (
    ArgumentProblems,
    check_config,
    check_options,
    check_tensor,
    empty_result,
    planned,
    readable,
    remember,
    run_plan,
    serving_config,
    values_read,
    values_to_read,
    window_bounds,
)
from zyfa_tune.generator import ConfigError, KernelConfig
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels import dispatch, gluon_paged
from zyfa_tune.kernels.launch import Serving, ServingLaunch, bind, pages_by_tma, tma_readable

_CACHE = ("num_pages", "page_size", "kv_heads", "head_dim")
#: key blocks a page may hold whole, widest first (the Triton backend's block_n but 192)
_BLOCKS = (256, 128, 64, 32)
#: a page size is a multiple of this: a page holds whole key blocks of the narrowest
PAGE_MULTIPLE = _BLOCKS[-1]


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    return_lse: bool = False,
    config: KernelConfig | None = None,
    validate: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of new queries over a paged KV cache, like FlashAttention-3's
    `flash_attn_with_kvcache` with a page_table (its names; arguments after v by keyword).

    q: (batch, seqlen_q, heads, head_dim_qk), or packed (total_q, heads, head_dim_qk) with int32
    cu_seqlens_q (batch + 1,) and max_seqlen_q, as flash_attn_varlen_func's. k_cache / v_cache:
    (num_pages, page_size, kv_heads, head_dim), last dim contiguous; page_size a multiple of 32 (a
    page holds whole key blocks: a config's block_n is lowered to divide it, a forced config's must).
    All torch.float8_e4m3fn or all torch.bfloat16 on one CUDA device. page_table: int32 (batch,
    max_pages), sequence b's keys being the first cache_seqlens[b] (int32 (batch,)) of its pages
    page_table[b, 0], page_table[b, 1], ... (pages may be shared and in any order). The new
    tokens' K/V must already be in the cache: the queries are the last seqlen_q positions of their
    sequence's keys (causal masks and windows bottom-right aligned), so cache_seqlens[b] >= seqlen_q.
    k / v (FlashAttention-3 appends them to the cache) are not supported: write them first.
    Descales (fp8 only): (batch, kv_heads). Returns (batch, seqlen_q, heads, head_dim_v) bf16, or
    (total_q, heads, head_dim_v) packed; with return_lse=True also the float32 natural-log sum of
    exp(scores), (batch, heads, seqlen_q) or (heads, total_q).

    Checks as flash_attn_func's: every argument on a layout's first call, all problems in one
    error naming each argument. The values of CUDA page tables, cache lengths (and cumulative
    lengths) are read then (one synchronisation each, not inside CUDA graph capture) and on every
    call with validate=True; host ones always: page indices of the pages in use within
    [0, num_pages), cache_seqlens within [seqlen_q, max_pages * page_size]. Later calls with the
    layout launch without checks or synchronisation (CUDA-graph capturable); a bad page index then
    reads out of bounds. Where the dispatcher picks a Gluon kernel (FP8, head dims TMA reads pages at, a
    page holding its key blocks whole, pages TMA reads in place) it runs that kernel's paged twin
    (kernels/gluon_paged.py), else the Triton serving variant; a forced Gluon config runs its natural-V
    version on the paged twin too (refused where the twin cannot run it).
    """
    tensors = (q, k_cache, v_cache, page_table, cache_seqlens)
    given = (q_descale, k_descale, v_descale)
    options = (max_seqlen_q, softmax_scale, causal, window_size, return_lse, config)
    key, plan = planned("kvcache", (*tensors, k, v, cu_seqlens_q, *given), options, validate)
    if plan is not None:
        return run_plan(plan, q, k_cache, v_cache, *given, cu_seqlens_q, None, page_table, cache_seqlens)
    read = values_to_read(key, validate)
    p = _prepare(tensors, (k, v), cu_seqlens_q, max_seqlen_q, given, softmax_scale, causal, window_size, return_lse,
                 config, read)  # fmt: skip
    values_read(key, read)
    return _run(key, p, given, config, causal, (*tensors, cu_seqlens_q))


@dataclass(frozen=True)
class _Paged:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    max_seqlen_q: int  # the longest query sequence (seqlen_q where q is not packed)
    dtype: str
    softmax_scale: float
    descales: tuple
    window: tuple[int, int]
    return_lse: bool


def paged_config(config: KernelConfig, page_size: int, pointer: bool = False) -> KernelConfig:
    """The config that runs a paged cache for `config`: its natural-V twin (a cache has no V^T
    copy), with pointer loads where `pointer` (pages TMA cannot read in place) or where TMA may not
    read pages for its head dims (`pages_by_tma`), on the widest key block, at most its own, that a
    page holds whole."""
    config = _varlen.natural_twin(config)
    if (pointer or not pages_by_tma(config)) and config.loads != "pointer":
        try:
            config = config.replace(loads="pointer")
        except ConfigError:  # (a combination pointer loads do not take: the default's)
            config = default_config(config.dtype, config.head_dim_qk, config.head_dim_v).replace(
                loads="pointer", v_layout="natural"
            )
        config = serving_config(config)
    block = next(b for b in _BLOCKS if b <= config.block_n and page_size % b == 0)
    if block == config.block_n:
        return config
    try:
        return config.replace(block_n=block)
    except ConfigError:  # (a combination the narrower block does not take: the default's)
        return default_config(config.dtype, config.head_dim_qk, config.head_dim_v).replace(
            v_layout="natural", block_n=block
        )


def dispatched_paged_config(
    dtype: str,
    dqk: int,
    dv: int,
    causal: bool,
    batch: int,
    h: int,
    hk: int,
    seqlen_q: int,
    page_size: int,
    apart: bool,
    device_index: int,
) -> KernelConfig:
    """The config a paged call runs where none is forced: the dispatcher's pick for its query length
    (packed: the mean); a Gluon pick on the paged twin where it runs it (`gluon_paged_config`; not where
    pages lie `apart`, which TMA cannot read in place), else as `paged_config` makes it run a cache of
    `page_size` pages."""
    picked = dispatch.dispatcher().config_for(dtype, dqk, dv, causal, batch, h, hk, seqlen_q, device_index)
    gluon = None if apart else gluon_paged_config(picked, page_size)
    return gluon or paged_config(serving_config(picked), page_size, pointer=apart)


def paged_from_packed(
    k: torch.Tensor, v: torch.Tensor, lengths: list[int], page_size: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed (total, kv_heads, dim) K and V of sequences of `lengths` as a paged cache:
    (k_cache, v_cache, page_table, cache_seqlens) for `flash_attn_with_kvcache`, each sequence on its
    own pages, the pages in a random order drawn from `generator` (a CPU generator; in order without
    one), slots past a sequence's keys zero (and one zero page where every sequence is empty). For
    benchmarks and tests: a serving engine writes its cache itself."""
    if page_size <= 0 or page_size % PAGE_MULTIPLE:
        raise ValueError(f"page_size: expected a positive multiple of {PAGE_MULTIPLE}, got {page_size}")
    if not lengths or min(lengths) < 0:
        raise ValueError(f"lengths: expected one or more lengths >= 0, got {lengths}")
    if k.shape[0] != sum(lengths) or v.shape[0] != k.shape[0]:
        raise ValueError(f"lengths: sum to {sum(lengths)}, k and v hold {k.shape[0]} and {v.shape[0]} rows")
    device = k.device
    counts = torch.tensor([-(-n // page_size) for n in lengths], dtype=torch.int64)
    pages = int(counts.sum())
    order = torch.randperm(pages, generator=generator) if generator is not None else torch.arange(pages)
    table = torch.zeros(len(lengths), max(1, int(counts.max())), dtype=torch.int64)
    first = torch.cumsum(counts, 0) - counts
    for b, c in enumerate(counts.tolist()):
        table[b, :c] = order[int(first[b]) : int(first[b]) + c]
    lens = torch.tensor(lengths, dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lens)
    row = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[seq]
    slot = (table[seq, row // page_size] * page_size + row % page_size).to(device)
    caches = []
    for t in (k, v):  # (bytes: index_put has no float8 kernel)
        cache = torch.zeros(max(1, pages) * page_size, *t.shape[1:], dtype=t.dtype, device=device)
        cache.view(torch.uint8)[slot] = t.view(torch.uint8)
        caches.append(cache.view(-1, page_size, *t.shape[1:]))
    as_int32 = dict(dtype=torch.int32, device=device)
    return caches[0], caches[1], table.to(**as_int32), lens.to(**as_int32)


def _run(key, p: _Paged, given: tuple, config, causal: bool, as_passed: tuple):
    """Choose the kernel and launch; leave a plan for the layout where nothing was copied."""
    packed = p.cu_seqlens_q is not None
    h, dqk = p.q.shape[-2:]
    hk, dv = p.k_cache.shape[2], p.v_cache.shape[3]
    batch, max_pages = p.page_table.shape
    device = p.q.device
    out = torch.empty(*p.q.shape[:-1], dv, dtype=torch.bfloat16, device=device)
    lse_shape = (h, p.q.shape[0]) if packed else (p.q.shape[0], h, p.q.shape[1])
    lse = torch.empty(lse_shape, dtype=torch.float32, device=device) if p.return_lse else None
    if out.numel() == 0:
        return empty_result(out, lse, False)
    q4, out4 = (t.unsqueeze(0) for t in (p.q, out)) if packed else (p.q, out)
    mean = -(-p.q.shape[0] // batch) if packed else p.q.shape[1]  # the dispatcher keys on the query length
    page_size = p.k_cache.shape[1]
    forced_gluon = config is not None and config.backend == "gluon"
    chosen = config and (gluon_paged.natural_config(config) if forced_gluon else _varlen.natural_twin(config))
    window = window_bounds(p.window, causal, max_pages * page_size, p.max_seqlen_q)
    if chosen is None:
        # pages apart in memory (say K and V interleaved per page): pointer loads read them in place
        apart = not (tma_readable(p.k_cache) and tma_readable(p.v_cache))
        chosen = dispatched_paged_config(p.dtype, dqk, dv, causal, batch, h, hk, mean, page_size, apart, device.index)
    if chosen.backend == "gluon":
        pages = (p.cu_seqlens_q, p.page_table, p.cache_seqlens)
        args = (p.softmax_scale, causal, p.descales, pages, p.max_seqlen_q, lse, window)
        with torch.cuda.device(device):
            bound = gluon_paged.bind(chosen, p.q, p.k_cache, p.v_cache, out, *args)
        return _remember(key, bound, out, lse, device, given, p, as_passed)
    serving = Serving(p.cu_seqlens_q, None, p.max_seqlen_q, window, lse, p.page_table, p.cache_seqlens)
    causal_mask = causal and window is None
    with torch.cuda.device(device):
        bound = bind(chosen, q4, p.k_cache, p.v_cache, out4, p.softmax_scale, causal_mask, *p.descales, serving=serving)
    bound = bound and ServingLaunch(bound, None if lse is None else lse_shape)
    return _remember(key, bound, out, lse, device, given, p, as_passed)


def _remember(key, bound, out, lse, device, given: tuple, p: _Paged, as_passed: tuple):
    """Leave `bound` as the layout's plan where nothing was copied; the call's result."""
    used = (p.q, p.k_cache, p.v_cache, p.page_table, p.cache_seqlens, p.cu_seqlens_q)
    if all(a is b for a, b in zip(used, as_passed)) and all(d is None or d is c for d, c in zip(given, p.descales)):
        remember(key, bound, tuple(out.shape), device, given, p.descales)
    return out if lse is None else (out, lse)


def gluon_paged_config(picked: KernelConfig, page_size: int) -> KernelConfig | None:
    """The config of the Gluon paged twin where the dispatcher picked the Gluon `picked`: its natural-V
    version (kernels/gluon_paged.natural_config), or None where the twin cannot run it (a Triton pick, head
    dims read in several chunks, key blocks a page does not hold whole: the Triton serving variant then)."""
    if picked.backend != "gluon" or picked.dtype != "fp8":  # (the Gluon kernels run FP8)
        return None
    config = gluon_paged.natural_config(picked)
    return None if gluon_paged.paged_error(config, page_size) else config


def _prepare(tensors, new_kv, cu_q, max_q, given, softmax_scale, causal, window_size, return_lse, config, read):
    """Validate the arguments; every problem is reported at once, each naming its argument, the
    device last (as flash_attn_func's)."""
    q, k_cache, v_cache, page_table, cache_seqlens = tensors
    problems = ArgumentProblems()
    packed = cu_q is not None
    q_ok = check_tensor("q", q, problems, dims=_varlen._PACKED if packed else _api._DENSE_DIMS)
    caches_ok = [check_tensor(n, t, problems, dims=_CACHE) for n, t in (("k_cache", k_cache), ("v_cache", v_cache))]
    related = q_ok and all(caches_ok) and _check_caches(q, k_cache, v_cache, problems)
    for name, t in zip("kv", new_kv):
        if t is not None:
            problems.add(
                ValueError,
                f"{name}: appending new keys and values is not supported; write them into the cache "
                "and count them in cache_seqlens",
            )
    cu_ok = packed and _varlen._check_cu("cu_seqlens_q", cu_q, q if q_ok else None, problems)
    batch = cu_q.shape[0] - 1 if cu_ok else (q.shape[0] if q_ok and not packed else None)
    max_ok = not packed or _varlen._check_max(
        ("max_seqlen_q",), (max_q,), (q.shape[0] if q_ok else None,), batch if cu_ok else None, problems
    )
    if not packed and max_q is not None:
        problems.add(ValueError, f"max_seqlen_q: given ({max_q!r}) without cu_seqlens_q; it sizes packed queries only")
    lens_ok = _check_index("page_table", page_table, 2, batch, q if q_ok else None, problems)
    lens_ok = _check_index("cache_seqlens", cache_seqlens, 1, batch, q if q_ok else None, problems) and lens_ok
    window = check_options(softmax_scale, causal, window_size, return_lse, problems)
    dtype = _api._DTYPES[q.dtype] if q_ok else None
    batch_from = " (batch: len(cu_seqlens_q) - 1)" if packed else ""
    ok = [q_ok, *caches_ok, lens_ok, not packed or cu_ok]
    descales = _api._prepare_descales(q, k_cache, given, ok, read, problems, batch, batch_from)
    check_config(config, dtype, q, v_cache, related, problems)
    if related and isinstance(config, KernelConfig):
        _check_forced(config, k_cache, v_cache, problems)
    if related and lens_ok and max_ok and (cu_ok or not packed) and not problems.found:
        _check_values(q, k_cache, page_table, cache_seqlens, cu_q, max_q, read, problems)
    if q_ok:  # the other tensors' devices are checked against q's above
        try:
            _api._on_cuda("q", q)
        except ValueError as exc:
            problems.add(ValueError, str(exc))
    problems.raise_any()
    q = q if q.stride(-1) == 1 else q.contiguous()
    page_table = page_table if page_table.stride(1) == 1 else page_table.contiguous()
    cache_seqlens, cu_q = (
        None if c is None else c if c.is_contiguous() else c.contiguous() for c in (cache_seqlens, cu_q)
    )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    longest = int(max_q) if packed else q.shape[1]
    return _Paged(
        q, k_cache, v_cache, page_table, cache_seqlens, cu_q, longest, dtype, scale, descales, window, return_lse
    )


def _check_forced(config: KernelConfig, k_cache, v_cache, problems: ArgumentProblems) -> None:
    """A forced config against the cache: its key block (a Gluon config's natural-V version's) divides the
    page size; a Gluon one runs on the paged twin, which reads pages by TMA at head dims of one chunk."""
    gluon = config.backend == "gluon"
    runs = gluon_paged.natural_config(config) if gluon else config
    page_size = k_cache.shape[1]
    if page_size % runs.block_n:
        problems.add(ValueError, f"config: block_n={runs.block_n} does not divide k_cache's page_size {page_size}")
    elif gluon and (why := gluon_paged.paged_error(runs, page_size)):
        problems.add(ValueError, f"config: {why}")
    elif gluon and not (tma_readable(k_cache) and tma_readable(v_cache)):
        problems.add(
            ValueError,
            "config: backend='gluon' reads pages by TMA, which needs k_cache and v_cache pages evenly spaced rows "
            "from a 16-byte aligned base; pass a Triton config (pointer loads), or none",
        )


def _check_caches(q, k_cache, v_cache, problems: ArgumentProblems) -> bool:
    """The caches against q and each other: dtype, device, pages, head dims, GQA, and a page layout
    the kernels read (last dim contiguous, page_size a multiple of the smallest key block)."""
    before = len(problems.found)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            problems.add(TypeError, f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        if t.device != q.device:
            problems.add(ValueError, f"{name}: on {t.device}, but q is on {q.device}")
        if t.stride(-1) != 1:
            problems.add(ValueError, f"{name}: the last dim must be contiguous (stride 1), got strides {t.stride()}")
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        problems.add(
            ValueError,
            f"v_cache: shape {tuple(v_cache.shape)} must match k_cache's (num_pages, page_size, kv_heads) = "
            f"{tuple(k_cache.shape[:3])}",
        )
    num_pages, page_size, hk, dqk = k_cache.shape
    if num_pages == 0:
        problems.add(ValueError, "k_cache: holds no pages")
    if page_size % PAGE_MULTIPLE or page_size == 0:
        problems.add(
            ValueError,
            f"k_cache: page_size {page_size} must be a multiple of {PAGE_MULTIPLE} (a page holds whole key blocks)",
        )
    if dqk != q.shape[-1]:
        problems.add(ValueError, f"k_cache: head_dim {dqk} differs from q's {q.shape[-1]}")
    if hk == 0 or q.shape[-2] % hk:
        problems.add(ValueError, f"k_cache: kv_heads={hk} must divide q's heads={q.shape[-2]}")
    return len(problems.found) == before


def _check_index(name: str, t, dims: int, batch: int | None, q, problems: ArgumentProblems) -> bool:
    """page_table (batch, max_pages) or cache_seqlens (batch,) on its own: an int32 tensor on q's device."""
    shape = "(batch, max_pages)" if dims == 2 else "(batch,)"
    if not isinstance(t, torch.Tensor):
        problems.add(TypeError, f"{name}: expected an int32 torch.Tensor of shape {shape}, got {type(t).__name__}")
    elif t.dtype != torch.int32:
        problems.add(TypeError, f"{name}: expected dtype torch.int32, got {t.dtype}")
    elif t.dim() != dims or (batch is not None and t.shape[0] != batch):
        got = "" if batch is None else f" with batch = {batch}"
        problems.add(ValueError, f"{name}: expected shape {shape}{got}, got {tuple(t.shape)}")
    elif q is not None and t.device != q.device:
        problems.add(ValueError, f"{name}: on {t.device}, but q is on {q.device}")
    else:
        return True
    return False


def _check_values(q, k_cache, page_table, cache_seqlens, cu_q, max_q, read_cuda: bool, problems) -> None:
    """The index values, where `readable` allows: cumulative lengths as flash_attn_varlen_func's;
    each sequence's cache length within [its query count, max_pages * page_size]; the pages in
    use (the first ceil(cache_seqlens[b] / page_size) of row b) within [0, num_pages)."""
    if not all(readable(t, read_cuda) for t in (page_table, cache_seqlens)):
        return
    if cu_q is not None:
        c = cu_q.cpu()
        problems_before = len(problems.found)
        _varlen.check_cu_values([("q", c, q.shape[0], max_q)], problems)
        if len(problems.found) > problems_before:
            return
        seqlen_q = (c[1:] - c[:-1]).to(torch.int64)
    else:
        seqlen_q = torch.full((q.shape[0],), q.shape[1], dtype=torch.int64)
    lens = cache_seqlens.cpu().to(torch.int64)
    num_pages, page_size = k_cache.shape[:2]
    capacity = page_table.shape[1] * page_size
    for bad, what in ((lens < seqlen_q, "fewer than its"), (lens > capacity, "more than")):
        if bad.any():
            b = int(bad.nonzero()[0])
            bound = (
                f"{int(seqlen_q[b])} queries (their keys are in the cache)"
                if what == "fewer than its"
                else (f"page_table's max_pages x page_size = {page_table.shape[1]} x {page_size}")
            )
            problems.add(ValueError, f"cache_seqlens: sequence {b} holds {int(lens[b])} keys, {what} {bound}")
            return
    table = page_table.cpu().to(torch.int64)
    in_use = torch.arange(table.shape[1])[None, :] < (-(-lens // page_size))[:, None]
    bad = in_use & ((table < 0) | (table >= num_pages))
    if bad.any():
        b, i = bad.nonzero()[0].tolist()
        problems.add(
            ValueError,
            f"page_table: entry ({b}, {i}) = {int(table[b, i])} is out of range for k_cache's {num_pages} pages "
            f"({int(bad.sum())} entries in use are)",
        )


__all__ = [
    "PAGE_MULTIPLE",
    "dispatched_paged_config",
    "flash_attn_with_kvcache",
    "gluon_paged_config",
    "paged_config",
    "paged_from_packed",
]
