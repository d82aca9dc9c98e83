"""Launch arguments of a Gluon kernel (generator/gluon_sm90/emit.py's contract): host TMA descriptors
of Q, K, V^T and O, the scalars, the grid.

Works on any tensors with the right shapes and strides (CPU and meta tensors too: the descriptors
only record pointers), so argument building is testable without a GPU.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math

import torch
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from zyfa_tune.generator import HOPPER, KernelConfig, gluon_qk_padded
from zyfa_tune.generator.gluon_sm90.emit import NUM_WARPS, descriptor_blocks, descriptor_layout

_INT32_MAX = 2**31 - 1

#: SMs of the H200 / H100 SXM: the persistent grid of an argument set not on a GPU (ahead of time).
DEFAULT_SMS = HOPPER.sm_count


@functools.lru_cache(maxsize=64)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def grid_size(persistent: bool, tiles: int, sms: int) -> int:
    """A persistent kernel loops over tiles: one program per SM, or per tile when there are fewer."""
    return min(sms, tiles) if persistent else tiles


#: per-tile cost beyond its key blocks (Q load, first QK^T, epilogue), in key blocks
TILE_OVERHEAD_BLOCKS = 1.0


def block_count(mb: int, block_m: int, block_n: int, sq: int, sk: int, causal: bool) -> int:
    """Key blocks query block mb visits (the device code's _block_range; causal bottom-right aligned)."""
    if not causal:
        return -(-sk // block_n)
    hi = min(sk, max(mb * block_m + block_m + sk - sq, 0))
    return -(-hi // block_n)


def group_bounds(n_kv: int, kv_per_group: int, even: bool) -> tuple[int, ...]:
    """Where the groups of kv heads start and end: chunks of kv_per_group (the last holds the rest), or
    (even) as many groups with sizes differing by at most one, the larger ones first."""
    if not even:
        return (*range(0, n_kv, kv_per_group), n_kv)
    n_groups = -(-n_kv // kv_per_group)
    size, larger = divmod(n_kv, n_groups)
    return tuple(i * size + min(i, larger) for i in range(n_groups + 1))


def _greedy(
    bounds: tuple[int, ...], n_h: int, group: int, n_m: int, cost: list[float], programs: int
) -> tuple[list[list[int]], float]:
    """Each group's tiles, longest query blocks first, each to the program with the least work so far:
    (the programs' lists, the largest load)."""
    heap = [(0.0, p) for p in range(programs)]
    lists: list[list[int]] = [[] for _ in range(programs)]
    for first, last in zip(bounds, bounds[1:]):
        heads = [
            kv // (n_h // group) * n_h + (kv % (n_h // group)) * group + g
            for kv in range(first, last)
            for g in range(group)
        ]
        for mb in range(n_m - 1, -1, -1):
            for bh in heads:
                load, p = heapq.heappop(heap)
                lists[p].append(bh * n_m + mb)
                heapq.heappush(heap, (load + cost[mb], p))
    return lists, max(load for load, _ in heap)


@functools.lru_cache(maxsize=16)
def schedule(
    n_b: int,
    n_h: int,
    group: int,
    n_m: int,
    sq: int,
    sk: int,
    block_m: int,
    block_n: int,
    causal: bool,
    kv_bytes_per_key: int,
    programs: int,
    l2_group_bytes: int,
) -> tuple[tuple[int, ...], ...]:
    """The tiles (forward numbers bh * n_m + mb) of each program of a q_order="balanced" kernel.

    Tiles are listed by groups of (batch, kv head) whose K and V fit in l2_group_bytes together (the
    config's l2_group_mib: their tiles run side by side and share K/V in L2), each
    group's longest query blocks first, and each goes to the program with the least work so far
    (cost: its key blocks + TILE_OVERHEAD_BLOCKS): what a dynamic scheduler would hand out, fixed
    ahead of time, so that no atomic counter has to be reset between launches. Round robin (the
    other orders) leaves the busiest program 3-9% above the mean on causal shapes. Costs about 0.5 us
    per tile on the host, once per shape (4096 tiles: 2 ms, twice that where even groups are tried too;
    with a new shape's plan, kernels/launch.py).

    The groups are full chunks with the rest last, unless groups of even sizes give a smaller largest
    load: a last group of one head puts its longest tiles at the end, where the programs can no longer
    even out (192/128 at 16 heads, 16K, 16 MiB: 4.6% over the mean in this model, 0.3% with even
    groups; measured 3.4% slower than 32 MiB's table, docs/results.md)."""
    per_kv_head = max(1, sk * kv_bytes_per_key)
    kv_per_group = max(1, l2_group_bytes // per_kv_head)
    cost = [block_count(mb, block_m, block_n, sq, sk, causal) + TILE_OVERHEAD_BLOCKS for mb in range(n_m)]
    n_kv = n_b * (n_h // group)
    chunks, even = (group_bounds(n_kv, kv_per_group, even=e) for e in (False, True))
    lists, worst = _greedy(chunks, n_h, group, n_m, cost, programs)
    if even != chunks:
        even_lists, even_worst = _greedy(even, n_h, group, n_m, cost, programs)
        if even_worst < worst:
            lists = even_lists
    return tuple(tuple(x) for x in lists)


@functools.lru_cache(maxsize=256)
def tile_table(key: tuple, device: torch.device) -> torch.Tensor:
    """`schedule(*key)` as the kernel reads it: int32 [offsets of the P programs' lists (P + 1), their
    tiles], on `device`; made once per shape and device and kept (a launch only passes its pointer,
    so CUDA graphs replay it). Its first use cannot be inside CUDA graph capture (a host copy)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "q_order='balanced': the tile schedule of a new shape is copied to the GPU on its "
            "first call; make one call of this shape before CUDA graph capture"
        )
    lists = schedule(*key)
    offsets = [0, *itertools.accumulate(map(len, lists))]
    return torch.tensor(offsets + [t for x in lists for t in x], dtype=torch.int32, device=device)


def descriptors(config: KernelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> list:
    """desc_q, desc_k, desc_v, desc_o. q, k: (B, S, H, D) with (batch*seqlen, heads*dim) rows
    (TMA-ready); v: with v_layout="natural" V itself, TMA-ready like k, else the (B, Hkv, D, Skv) V^T
    of `kernels.transpose.transpose_v` (permuted and padded to 32 keys when config.v_permute and not
    config.k_perm, whose K view (k_view) relabels the keys instead); out:
    contiguous (B, Sq, H, D) bf16; D = the config's head dim. A head dim of q and k that the kernel
    zero-pads (gluon_qk_padded) is read through (batch*seqlen, heads, dim) views instead, so that its
    boxes stop at the head's end."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if not out.is_contiguous():
        raise ValueError("out: the Gluon kernel stores through a TMA descriptor: out must be contiguous")
    if config.v_layout == "natural":
        dv = v.shape[3]
        v_view = (v, [b * sk, hk * dv], [v.stride(1), 1])
    else:
        dv, skv = v.shape[2], v.shape[3]
        if v_keys_permuted(config) and skv % 32:
            raise ValueError(
                f"v: V^T has {skv} keys; v_permute needs the 32-padded copy of transpose_v(v, permute=True)"
            )
        if v.stride(3) != 1 or v.stride(1) != dv * v.stride(2) or v.stride(0) != hk * v.stride(1):
            raise ValueError(
                f"v: V^T strides {v.stride()} are not those of a (B, Hkv, D, keys) buffer with keys contiguous"
            )
        v_view = (v, [b * hk * dv, skv], [v.stride(2), 1])
    blocks = descriptor_blocks(config)
    if len(blocks["desc_o"][1]) == 4:  # a padded O tile (wider than dv): (B, Sq, H, dv), its box clipped at dv
        o_view = (out, [b, sq, h, dv], [sq * h * dv, h * dv, dv, 1])
    else:
        o_view = (out, [b, sq, h * dv], [sq * h * dv, h * dv, 1])
    if gluon_qk_padded(config):
        q_view = (q, [b * sq, h, d], [q.stride(1), q.stride(2), 1])
        k_rows = (k, [b * sk, hk, d], [k.stride(1), k.stride(2), 1])
    else:
        q_view, k_rows = (q, [b * sq, h * d], [q.stride(1), 1]), (k, [b * sk, hk * d], [k.stride(1), 1])
    views = {
        "desc_q": q_view,
        "desc_k": k_view(k) if config.k_perm else k_rows,
        "desc_v": v_view,
        "desc_o": o_view,
    }
    return [
        TensorDescriptor(*views[DESCRIPTOR_TENSOR[name][1]], block, descriptor_layout(dtype, block))
        for name, (dtype, block) in blocks.items()
    ]


def v_keys_permuted(config: KernelConfig) -> bool:
    """Whether the kernel reads V^T with its keys permuted within 32-key chunks (transpose_v(v, True)):
    a v_permute kernel that does not relabel keys on K instead (k_perm)."""
    return bool(config.v_permute) and not config.k_perm


def k_view(k: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """K's rows as the 5-D view of k_perm's box (emit_gluon.k_box): (16-key group, s, q, b, column) at
    row strides (16, 2, 4, 1), so that a box read in that order puts key 16h + 4q + 2s + b into tile row
    16h + 8s + 2q + b. Needs Sk % 16 == 0 (a group never spans two batch entries, and the view ends
    where K does: a box past it is zero-filled like any other)."""
    b, sk, hk, d = k.shape
    if sk % 16:
        raise ValueError(
            f"k: {sk} keys; k_perm reads K in 16-key groups and needs a multiple of 16 "
            f"(kernels.launch.for_v_layout keeps k_perm off for such a K)"
        )
    rs = k.stride(1)
    return k, [b * sk // 16, 2, 4, 2, hk * d], [16 * rs, 2 * rs, 4 * rs, rs, 1]


#: descriptor -> (index of its tensor in (q, k, v, out), the view it is built on): a 192-key
#: block's second key part (desc_kb, desc_vb) and o_split's second O part (desc_vc, desc_oc) are
#: other boxes on K's / V^T's / O's view
DESCRIPTOR_TENSOR = {
    "desc_q": (0, "desc_q"),
    "desc_k": (1, "desc_k"),
    "desc_kb": (1, "desc_k"),
    "desc_v": (2, "desc_v"),
    "desc_vb": (2, "desc_v"),
    "desc_vc": (2, "desc_v"),
    "desc_o": (3, "desc_o"),
    "desc_oc": (3, "desc_o"),
}


def lse_pointer(lse: torch.Tensor | None, shape: tuple[int, ...]) -> tuple:
    """The LSE kernel's LSE argument (after the descales; none for a kernel without it): `lse` checked to be
    the contiguous float32 `shape` the kernel writes ((B, H, Sq), or varlen's (H, total_q))."""
    if lse is None:
        return ()
    if lse.dtype != torch.float32 or tuple(lse.shape) != tuple(shape) or not lse.is_contiguous():
        raise ValueError(
            f"lse: expected a contiguous float32 {tuple(shape)} tensor, got {lse.dtype} {tuple(lse.shape)}"
        )
    if lse.numel() > _INT32_MAX:  # (the kernel's LSE offsets are int32)
        raise ValueError(f"lse: {lse.numel()} rows exceed 2^31 - 1; split the batch")
    return (lse,)


def lse_stride(lse: torch.Tensor | None) -> tuple:
    """The LSE kernel's last argument, LSE_STRIDE: the head stride of the contiguous LSE (rows per head)."""
    return () if lse is None else (lse.shape[-1],)


#: The largest window bound the window kernel takes: row + Sk - Sq +- bound stays within int32.
MAX_WINDOW = 2**30


def window_args(window: tuple[int, int] | None, causal: bool) -> tuple:
    """The window kernel's last arguments, WIN_L and WIN_R (none for a kernel without them): `window` checked to
    be (left, right) ints in [0, MAX_WINDOW] (an unbounded side resolved to a bound no key reaches, as
    api.window_bounds does), with right = 0 when `causal` (the kernel then masks the diagonal as the window's
    right edge)."""
    if window is None:
        return ()
    ok = isinstance(window, tuple) and len(window) == 2
    if not ok or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_WINDOW for x in window):
        raise ValueError(f"window: expected (left, right) ints in [0, {MAX_WINDOW}], got {window!r}")
    if causal and window[1] != 0:
        raise ValueError(f"window: a causal window's right bound is 0, got {window!r}")
    return window


def descriptor_owners(config: KernelConfig) -> tuple[int, ...]:
    """Index in (q, k, v, out) of the tensor under each descriptor argument, in kernel order."""
    return tuple(DESCRIPTOR_TENSOR[name][0] for name in descriptor_blocks(config))


def arguments(
    config: KernelConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    sm_scale_log2: float,
    causal: bool,
    q_descale: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
    sms: int,
    lse: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, options) of one call (v as `descriptors` takes it); `sms` sizes
    the persistent grid. `lse`: float32 (B, H, Sq), contiguous, for the kernel emitted with lse=True;
    `window`: (left, right) bounds (`window_args`) for the kernel emitted with window=True."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dv = v.shape[3] if config.v_layout == "natural" else v.shape[2]
    if (d, k.shape[3], dv) != (config.head_dim_qk, config.head_dim_qk, config.head_dim_v):
        raise ValueError(
            f"q/k/v: head dims {d}/{k.shape[3]}/{dv}; this Gluon kernel is built for "
            f"{config.head_dim_qk}/{config.head_dim_qk}/{config.head_dim_v}"
        )
    n_m = math.ceil(sq / config.block_m)
    tiles = n_m * b * h
    ds0, ds1 = q_descale.stride() if q_descale is not None else (0, 0)
    args = (
        *descriptors(config, q, k, v, out),
        q_descale,
        k_descale,
        v_descale,
        *lse_pointer(lse, (b, h, sq)),
        ds0,
        ds1,
        h,
        h // hk,
        hk,
        sq,
        sk,
        n_m,
        tiles,
        float(sm_scale_log2),
    )
    programs = grid_size(config.persistent, tiles, sms)
    if config.q_order == "balanced":
        key = (
            b,
            h,
            h // hk,
            n_m,
            sq,
            sk,
            config.block_m,
            config.block_n,
            bool(causal),
            config.head_dim_qk + config.head_dim_v,
            programs,
            config.l2_group_mib << 20,
        )
        args += (tile_table(key, q.device),)
    args += lse_stride(lse) + window_args(window, causal)
    options = dict(CAUSAL=bool(causal), num_warps=NUM_WARPS)
    return (programs,), args, options
