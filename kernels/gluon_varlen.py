"""Packed sequences on the Gluon backend: the ragged tile list, the per-sequence V^T copy, the launch
arguments of the varlen variant (generator/gluon_sm90/emit.py) and its per-layout launch.

The tile list is built on the device on every call, from the cumulative lengths as they are then: the
kernel's work depends on the lengths' values, which a caller may change between calls of one layout (a
serving loop reuses its buffers), and reading them to the host would synchronise. So the call stays
asynchronous and CUDA-graph capturable (a replay rebuilds the list from the lengths it finds). One Triton
program builds the whole table (`_ragged_tiles_kernel`: one launch, where the torch construction
`ragged_tiles_reference` takes about a dozen). The list holds one entry per (sequence, query block) that
has rows, heaviest first: the persistent programs take tiles round robin from its head, so the longest
tiles of every sequence run first and the short ones fill in at the end (longest-processing-time order,
as the rectangular heavy_first order, across sequences of any lengths).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from zyfa_tune.generator import KernelConfig
from zyfa_tune.generator.gluon_sm90.emit import NUM_WARPS, SCALAR_PARAMS

from . import fastlaunch, gluon_launch
from .launch import LOG2E, kernel, tma_readable, twin_names

#: V^T's sequences start on multiples of this many keys: 16-byte TMA boxes, and whole 32-key chunks for
#: v_permute's key order (the kernel's key blocks are multiples of 32 from a sequence's first key)
VT_ALIGN = 32
_ALIGN = tl.constexpr(VT_ALIGN)
#: the kernel's scalar parameters between the descales and TILE_TABLE (gluon_sm90.emit.SCALAR_PARAMS[3:])
_SCALARS = SCALAR_PARAMS[3:]
_INT32_MAX = 2**31 - 1
#: keys and head dims per program of the V^T copy (as kernels/transpose.py)
_BLOCK_K = 128
_BLOCK_D = 64
#: the most (sequence, query block) entries `_ragged_tiles_kernel` sorts in one program's registers
#: (16 warps x 32 lanes x 16 int64 keys, no spills: tests/test_gluon_varlen.py); a larger table (say 64
#: sequences of 32K queries in 128-row blocks) takes the torch construction, a dozen launches beside a
#: prefill of that size. A single program keeps the table one launch, with no grid-wide step
MAX_SORTED_TILES = 8192
#: the narrowest sort (one lane per thread of 4 warps)
_MIN_WIDTH = 128


def ragged_tiles(
    cu_q: torch.Tensor, cu_k: torch.Tensor, max_seqlen_q: int, block_m: int, block_n: int, causal: bool
) -> torch.Tensor:
    """The kernel's TILE_TABLE (`ragged_tiles_reference`'s, bitwise), int32 on cu_q's device. On a GPU
    with at most MAX_SORTED_TILES entries: one launch of `_ragged_tiles_kernel`; else (CPU tensors, more
    tiles) the torch construction. No synchronisation either way."""
    batch = cu_q.shape[0] - 1
    tiles = batch * query_blocks(max_seqlen_q, block_m)
    if cu_q.device.type != "cuda" or tiles > MAX_SORTED_TILES:
        return ragged_tiles_reference(cu_q, cu_k, max_seqlen_q, block_m, block_n, causal)
    table, args, constexprs, options = tile_table_launch(cu_q, cu_k, max_seqlen_q, block_m, block_n, causal)
    fastlaunch.run(("ragged_tiles",), _ragged_tiles_kernel, (1,), args, constexprs, options, cu_q.device.index)
    return table


def ragged_tiles_reference(
    cu_q: torch.Tensor, cu_k: torch.Tensor, max_seqlen_q: int, block_m: int, block_n: int, causal: bool
) -> torch.Tensor:
    """The kernel's TILE_TABLE, int32 on cu_q's device: [n, T entries, batch + 1 V^T starts]. T = batch x
    n_m (n_m: query blocks of max_seqlen_q); entry sequence * n_m + block, the n that hold rows first,
    by descending cost (key blocks visited + one, as gluon_launch.block_count counts them; causal bottom-
    right aligned per sequence), ties in (sequence, block) order; then the first V^T column of each
    sequence (`vt_starts`). Torch ops on the device only (the tests' reference, and the path on CPU
    tensors and past MAX_SORTED_TILES)."""
    batch = cu_q.shape[0] - 1
    n_m = query_blocks(max_seqlen_q, block_m)
    lq = (cu_q[1:] - cu_q[:-1])[:, None]
    lk = (cu_k[1:] - cu_k[:-1])[:, None]
    m0 = torch.arange(0, n_m * block_m, block_m, dtype=torch.int32, device=cu_q.device)[None, :]
    hi = (m0 + block_m + lk - lq).clamp_min(0).minimum(lk) if causal else lk.expand(batch, n_m)
    cost = torch.where(m0 < lq, (hi + block_n - 1) // block_n + 1, -1)
    order = torch.argsort(cost.flatten(), descending=True, stable=True).to(torch.int32)
    count = (m0 < lq).sum(dtype=torch.int32).view(1)
    return torch.cat([count, order, vt_starts(cu_k)])


def tile_table_launch(
    cu_q: torch.Tensor, cu_k: torch.Tensor, max_seqlen_q: int, block_m: int, block_n: int, causal: bool
) -> tuple[torch.Tensor, tuple, dict, dict]:
    """(table to fill, arguments, constexprs, options) of `_ragged_tiles_kernel` on one program: the
    sort's width is the tile count rounded up to a power of two (one compilation per width), its warps
    grow with it so that each thread sorts at most 16 keys in registers."""
    batch = cu_q.shape[0] - 1
    n_m = query_blocks(max_seqlen_q, block_m)
    table = torch.empty(1 + batch * n_m + batch + 1, dtype=torch.int32, device=cu_q.device)
    width = max(_MIN_WIDTH, triton.next_power_of_2(batch * n_m))
    args = (table, cu_q, cu_k, batch, n_m, block_m, block_n)
    options = dict(num_warps=min(16, max(4, width // 512)))
    return table, args, dict(CAUSAL=bool(causal), WIDTH=width), options


@triton.jit
def _ragged_tiles_kernel(
    TABLE, CU_Q, CU_K, BATCH, N_M, BLOCK_M, BLOCK_N, CAUSAL: tl.constexpr, WIDTH: tl.constexpr
):  # fmt: skip
    """`ragged_tiles_reference` in one program (BATCH * N_M <= WIDTH). The stable descending argsort is
    an ascending bitonic sort (tl.sort) of int64 keys -cost * 2^32 + entry: distinct keys, so any sort
    gives the one order of (cost descending, entry ascending), and an entry is its key's low word. The
    lanes past the tiles cost -1 with entries past every real one, so they sort last; V^T starts are an
    inclusive cumsum of the padded key lengths (BATCH <= BATCH * N_M <= WIDTH)."""
    i = tl.arange(0, WIDTH)
    tiles = BATCH * N_M
    real = i < tiles
    s = i // N_M
    m0 = (i % N_M) * BLOCK_M
    lq = tl.load(CU_Q + s + 1, mask=real, other=0) - tl.load(CU_Q + s, mask=real, other=0)
    lk = tl.load(CU_K + s + 1, mask=real, other=0) - tl.load(CU_K + s, mask=real, other=0)
    if CAUSAL:
        hi = tl.minimum(tl.maximum(m0 + BLOCK_M + lk - lq, 0), lk)
    else:
        hi = lk
    rows = real & (m0 < lq)
    cost = tl.where(rows, (hi + BLOCK_N - 1) // BLOCK_N + 1, -1)
    keys = tl.sort((-cost).to(tl.int64) * 4294967296 + i.to(tl.int64))
    tl.store(TABLE, tl.sum(rows.to(tl.int32)))
    tl.store(TABLE + 1 + i, keys.to(tl.int32), mask=real)  # (truncation keeps the low word)
    seq = i < BATCH
    klen = tl.load(CU_K + i + 1, mask=seq, other=0) - tl.load(CU_K + i, mask=seq, other=0)
    ends = tl.cumsum((klen + _ALIGN - 1) // _ALIGN * _ALIGN, 0)
    tl.store(TABLE + 1 + tiles, 0)
    tl.store(TABLE + 2 + tiles + i, ends.to(tl.int32), mask=seq)


def vt_starts(cu_k: torch.Tensor) -> torch.Tensor:
    """int32 (batch + 1,): the first V^T column of each sequence in the packed copy, each sequence's keys
    padded to VT_ALIGN; the last entry is where the padded sequences end."""
    padded = (cu_k[1:] - cu_k[:-1] + VT_ALIGN - 1) // VT_ALIGN * VT_ALIGN
    return torch.cat([torch.zeros(1, dtype=torch.int32, device=cu_k.device), padded.cumsum(0, dtype=torch.int32)])


def query_blocks(max_seqlen_q: int, block_m: int) -> int:
    """Query blocks of the longest sequence (at least one, so that the table's shape never vanishes)."""
    return max(1, math.ceil(max_seqlen_q / block_m))


def vt_columns(total_k: int, batch: int) -> int:
    """Columns of the packed V^T copy: room for every sequence padded to VT_ALIGN, whatever the lengths
    (a bound from shapes alone), rounded to VT_ALIGN."""
    return -(-(total_k + (VT_ALIGN - 1) * batch) // VT_ALIGN) * VT_ALIGN


@triton.jit
def _packed_vt_kernel(
    V, VT, CU_K, STARTS, stride_vs, stride_vh, stride_vd, BATCH, SEARCH, COLS,
    DIM: tl.constexpr, PERMUTE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Columns [pid_k BLOCK_K, +BLOCK_K) of V^T for kv head pid_h: each column's sequence by binary search
    over STARTS (SEARCH steps), its key (PERMUTE: kernels/transpose.py's order within 32-key chunks,
    which start on multiples of 32 here too), zeros past the sequence's keys and past the last sequence."""
    pid_k = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_d = tl.program_id(2)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    lo = tl.zeros([BLOCK_K], dtype=tl.int32)
    hi = tl.zeros([BLOCK_K], dtype=tl.int32) + BATCH
    for _ in range(SEARCH):  # the last sequence s <= BATCH with STARTS[s] <= col
        mid = (lo + hi + 1) // 2
        go = tl.load(STARTS + mid) <= cols
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    if PERMUTE:  # slot 16h + 4q + 2s + b of a 32-key chunk holds key 16h + 8s + 2q + b
        r = cols % 32
        key_cols = cols - r + (r & 16) + ((r >> 1) & 1) * 8 + ((r >> 2) & 3) * 2 + (r & 1)
    else:
        key_cols = cols
    in_seq = key_cols - tl.load(STARTS + lo)
    seq = tl.minimum(lo, BATCH - 1)
    first = tl.load(CU_K + seq)
    keep = (lo < BATCH) & (in_seq < tl.load(CU_K + seq + 1) - first)
    dims = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = (first + in_seq).to(tl.int64) * stride_vs + pid_h * stride_vh
    tile = tl.load(V + rows[:, None] + dims[None, :] * stride_vd, mask=keep[:, None] & (dims < DIM)[None, :], other=0.0)
    dst = VT + (pid_h * DIM).to(tl.int64) * COLS
    tl.store(
        dst + dims[:, None] * COLS + cols[None, :], tl.trans(tile), mask=(dims < DIM)[:, None] & (cols < COLS)[None, :]
    )


def packed_vt(v: torch.Tensor, cu_k: torch.Tensor, starts: torch.Tensor, permute: bool) -> torch.Tensor:
    """(total_k, Hkv, D) packed V (any strides) -> (1, Hkv, D, vt_columns) V^T, sequence s's keys from
    column starts[s] (`vt_starts`), zeros between and after them; keys permuted within 32-key chunks with
    `permute`. One launch, no synchronisation."""
    total_k, hk, d = v.shape
    batch = cu_k.shape[0] - 1
    cols = vt_columns(total_k, batch)
    out = torch.empty(1, hk, d, cols, dtype=v.dtype, device=v.device)
    grid = (triton.cdiv(cols, _BLOCK_K), hk, triton.cdiv(d, _BLOCK_D))
    args = (v, out, cu_k, starts, v.stride(0), v.stride(1), v.stride(2), batch, max(1, batch.bit_length()), cols)
    constexprs = dict(DIM=d, PERMUTE=bool(permute), BLOCK_K=_BLOCK_K, BLOCK_D=_BLOCK_D)
    fastlaunch.run(("packed_vt", d, bool(permute)), _packed_vt_kernel, grid, args, constexprs, {}, v.device.index)
    return out


def packed_vt_reference(v: torch.Tensor, cu_k: torch.Tensor, permute: bool) -> torch.Tensor:
    """`packed_vt` with torch ops on host lengths (the tests' reference; any device)."""
    from .transpose import key_permutation

    total_k, hk, d = v.shape
    bounds = [int(x) for x in cu_k.cpu()]
    starts = [int(x) for x in vt_starts(cu_k.cpu())]
    bits = v.view(torch.uint8)
    out = torch.zeros(1, hk, d, vt_columns(total_k, len(bounds) - 1), dtype=torch.uint8, device=v.device)
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        out[0, :, :, starts[s] : starts[s] + b - a] = bits[a:b].permute(1, 2, 0)
    if permute:
        out = out[..., key_permutation(out.shape[-1], v.device)]
    return out.view(v.dtype)


def arguments(
    config: KernelConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    descales: tuple,
    cu: tuple[torch.Tensor, torch.Tensor],
    max_seqlen: tuple[int, int],
    sms: int,
    lse: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, options) of one varlen call. q, k, v: packed (total, heads, dim),
    rows TMA-ready (v as stored, dims contiguous; a transposed config reads `packed_vt`'s copy); out:
    contiguous (total_q, heads, dim_v) bf16; descales (batch, kv_heads) or Nones; cu: int32 cumulative
    lengths of q and k; max_seqlen: at least the longest q and k sequence; lse: float32 (heads, total_q),
    contiguous, for the kernel emitted with lse=True; window: (left, right), each sequence's rows and keys
    bottom-right aligned (gluon_launch.window_args), for the kernel emitted with window=True."""
    if config.backend != "gluon":
        raise ValueError(f"config: backend={config.backend!r}; this is the Gluon varlen launcher")
    total_q, h, _ = q.shape
    hk = k.shape[1]
    batch = cu[0].shape[0] - 1
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if sum((n - 1) * st for n, st in zip(t.shape, t.stride())) >= _INT32_MAX:  # (int32 offsets and coordinates)
            raise ValueError(f"{name}: the packed rows span more than 2^31 elements; split the batch")
    n_m = query_blocks(max_seqlen[0], config.block_m)
    table = ragged_tiles(*cu, max_seqlen[0], config.block_m, config.block_n, causal)
    if config.v_layout == "natural":
        v4 = v.unsqueeze(0)
    else:
        v4 = packed_vt(v, cu[1], table[1 + batch * n_m :], gluon_launch.v_keys_permuted(config))
    descs = gluon_launch.descriptors(config, q.unsqueeze(0), k.unsqueeze(0), v4, out.unsqueeze(0))
    ds0, ds1 = descales[0].stride() if descales[0] is not None else (0, 0)
    # SEQ_K: the packed keys' total, which sizes the kernel's L2 head groups (emit.py's VARLEN)
    scalars = (ds0, ds1, h, h // hk, hk, max_seqlen[0], k.shape[0], n_m, batch * n_m, float(softmax_scale) * LOG2E)
    lse_args = gluon_launch.lse_pointer(lse, (h, total_q))
    tail = gluon_launch.lse_stride(lse) + gluon_launch.window_args(window, causal)
    args = (*descs, *descales, *lse_args, *scalars, table, *cu, out, *tail)
    tiles = h * min(batch * n_m, -(-total_q // config.block_m) + batch)
    programs = max(1, gluon_launch.grid_size(config.persistent, tiles, sms))
    return (programs,), args, dict(CAUSAL=bool(causal), num_warps=NUM_WARPS)


def run(
    config: KernelConfig, grid: tuple, args: tuple, options: dict, device: int, lse: bool = False, window: bool = False
):
    """Launch `arguments`' call through the fast path; returns the CompiledKernel that ran. `lse`, `window`: the
    arguments hold an LSE, window bounds (that twin runs)."""
    causal = options["CAUSAL"]
    return fastlaunch.run(
        (config, causal, "-".join(("varlen", *twin_names(lse, window)))),
        kernel(config, True, lse, window),
        grid,
        args,
        {"CAUSAL": causal},
        {"num_warps": options["num_warps"]},
        device,
    )


class PackedLaunch:
    """A varlen Gluon kernel bound to one argument layout, for the API's per-layout fast path (as
    launch.ServingLaunch). Each call builds the tile table (and the V^T copy) from its own cumulative
    lengths, encodes descriptors once per pointer and launches: no synchronisation. `lse_shape`: the LSE
    kernel's, (heads, total_q); each call then allocates its LSE and returns (out, lse). `window`: the window
    kernel's bounds, (WIN_L, WIN_R), passed as bound (the API binds per window); () for other kernels."""

    __slots__ = (
        "config",
        "compiled",
        "programs",
        "device",
        "causal",
        "max_q",
        "scalars",
        "specs",
        "raw",
        "tma",
        "lse_shape",
        "window",
        "pages",
    )

    def __init__(
        self,
        config: KernelConfig,
        compiled,
        grid: tuple,
        device: int,
        args: tuple,
        options: dict,
        lse_shape: tuple[int, int] | None = None,
        window: tuple = (),
        pages: tuple = (),
    ):
        n_desc = len(gluon_launch.descriptor_owners(config))
        self.config, self.compiled, self.programs, self.device = config, compiled, grid[0], device
        self.causal, self.lse_shape, self.window, self.pages = options["CAUSAL"], lse_shape, tuple(window), tuple(pages)
        first = n_desc + 3 + (lse_shape is not None)  # (the LSE pointer sits between descales and scalars)
        self.scalars = tuple(args[first : first + len(_SCALARS)])
        self.max_q = self.scalars[5]
        owners = gluon_launch.descriptor_owners(config)
        self.specs = tuple(
            (i, type(d), {f: x for f, x in vars(d).items() if f != "base"}) for i, d in zip(owners, args)
        )
        meta = getattr(getattr(compiled, "metadata", None), "tensordesc_meta", None)
        self.raw = fastlaunch.raw_launch(compiled) if meta and len(meta) == len(self.specs) else None
        self.tma = (
            None
            if self.raw is None
            else tuple((i, fastlaunch.TmaArgs(cls, f, m)) for (i, cls, f), m in zip(self.specs, meta))
        )

    def __call__(self, q, k, v, out, q_descale, k_descale, v_descale, cu_seqlens_q=None, cu_seqlens_k=None, *paged):
        """`paged`: the paged twin's page table (kernels/gluon_paged.py; its stride and page size are bound)."""
        c = self.config
        table = ragged_tiles(cu_seqlens_q, cu_seqlens_k, self.max_q, c.block_m, c.block_n, self.causal)
        if c.v_layout != "natural":
            v = packed_vt(v, cu_seqlens_k, table[1 + self.scalars[8] :], gluon_launch.v_keys_permuted(c))
        tensors = (q, k, v, out)
        pages = (paged[0], *self.pages) if self.pages else ()
        lse = () if self.lse_shape is None else (torch.empty(self.lse_shape, dtype=torch.float32, device=out.device),)
        stride = () if self.lse_shape is None else (self.lse_shape[1],)
        tail = (*self.scalars, table, cu_seqlens_q, cu_seqlens_k, out, *stride, *self.window, *pages, self.causal)
        result = out if self.lse_shape is None else (out, lse[0])
        if self.raw is not None and not fastlaunch.hooks_set():
            inputs = []
            for i, encoded in self.tma:
                inputs += encoded(tensors[i])
            self.raw((self.programs, 1, 1), self.device, (*inputs, q_descale, k_descale, v_descale, *lse, *tail))
            return result
        descs = []
        for i, cls, fields in self.specs:
            d = object.__new__(cls)
            d.__dict__.update(fields, base=tensors[i])
            descs.append(d)
        fastlaunch.launch_compiled(
            self.compiled, (self.programs,), self.device, (*descs, q_descale, k_descale, v_descale, *lse, *tail)
        )
        return result


def bind(
    config: KernelConfig, q, k, v, out, softmax_scale, causal, descales, cu, max_seqlen, lse=None, window=None
) -> PackedLaunch | None:
    """Launch one varlen call (`arguments`; copies q, k, natural v where TMA cannot read them) and return
    a PackedLaunch for later calls of this layout, or None where a copy was made (no fast path). `lse`:
    float32 (heads, total_q) to write the LSE into (the LSE kernel; its PackedLaunch returns (out, lse));
    `window`: (left, right) bounds for the window kernel (`arguments`)."""
    device = q.device.index
    sms = gluon_launch.sm_count(device) if q.device.type == "cuda" else gluon_launch.DEFAULT_SMS
    ready = [t if tma_readable(t.unsqueeze(0)) else t.contiguous() for t in (q, k, v)]
    if config.v_layout != "natural":  # (packed_vt reads any strides)
        ready[2] = v
    grid, args, options = arguments(
        config, *ready, out, softmax_scale, causal, descales, cu, max_seqlen, sms, lse, window
    )
    compiled = run(config, grid, args, options, device, lse is not None, window is not None)
    if any(a is not b for a, b in zip(ready, (q, k, v))) or any(d is not None and d.data_ptr() % 16 for d in descales):
        return None
    lse_shape = None if lse is None else tuple(lse.shape)
    return PackedLaunch(
        config, compiled, grid, device, args, options, lse_shape, gluon_launch.window_args(window, causal)
    )
