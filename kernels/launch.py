"""Build cache and launcher: config -> emitted source -> Triton / Gluon JIT function -> launch."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from zyfa_tune.generator import EmittedKernel, KernelConfig, chunks_of, emit, gluon_qk_padded
from zyfa_tune.generator.build import jit_function

from . import fastlaunch, gluon_launch
from .transpose import bind_transpose, k_major_view, transpose_v

__all__ = [
    "BoundLaunch",
    "Serving",
    "ServingLaunch",
    "bind",
    "compiled_kernels",
    "emitted",
    "for_v_layout",
    "forget",
    "kernel",
    "launch",
    "pages_by_tma",
    "prepare",
    "tma_readable",
    "transpose_v",
]

LOG2E = 1.4426950408889634

_INT32_MAX = 2**31 - 1


@functools.cache
def emitted(
    config: KernelConfig, serving: bool = False, lse: bool = False, window: bool = False, paged: bool = False
) -> EmittedKernel:
    """Emit once per config and variant (configs are frozen and hashable); `lse`, `window`, `paged`: a Gluon
    kernel's twin that writes the LSE, takes a window, reads paged K / V caches."""
    return emit(config, serving=serving, lse=lse, window=window, paged=paged)


@functools.cache
def kernel(config: KernelConfig, serving: bool = False, lse: bool = False, window: bool = False, paged: bool = False):
    """The JIT function of `config` (emitted, written and imported once per process)."""
    return jit_function(emitted(config, serving, lse, window, paged))


def twin_names(lse: bool, window: bool) -> tuple[str, ...]:
    """The names of a Gluon kernel's twin in its fast-path key ("lse", "window"; none for the kernel itself)."""
    return (("lse",) if lse else ()) + (("window",) if window else ())


def _twins_of(serving: Serving | None) -> tuple[bool, bool]:
    """(an LSE, a window): which of a Gluon kernel's twins `serving`'s options ask for."""
    return (False, False) if serving is None else (serving.lse is not None, serving.window is not None)


@dataclass(frozen=True, eq=False)
class Serving:
    """The problem options of one call, run by the serving variant of a Triton config
    (generator/triton/emit.py), or an LSE and a window by a Gluon config's twins. With `cu_seqlens_q`
    (varlen) q, k, v and out are the packed tensors viewed as one batch entry, (1, total, heads, dim),
    and descales are (batch, kv_heads) of the sequences. `window` is (left, right), both >= 0 (an
    unbounded side already resolved to a bound no key reaches; a causal window has right = 0). `lse`:
    float32 (batch, heads, seqlen_q), or (heads, total_q) for varlen, written where given. With
    `page_table` (int32 (batch, max_pages), last dim contiguous) k and v are paged caches (pages,
    page_size, kv_heads, dim) holding `cache_seqlens[b]` (int32 (batch,)) keys of sequence b;
    page_size a multiple of block_n."""

    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    window: tuple[int, int] | None = None
    lse: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    cache_seqlens: torch.Tensor | None = None

    @property
    def constexprs(self) -> dict[str, bool]:
        return dict(
            VARLEN=self.cu_seqlens_q is not None,
            WINDOW=self.window is not None,
            RETURN_LSE=self.lse is not None,
            PAGED=self.page_table is not None,
        )

    @property
    def pointers(self) -> tuple:
        """The tensors a launch passes after the descales, in the kernel's order."""
        return self.cu_seqlens_q, self.cu_seqlens_k, self.lse, self.page_table, self.cache_seqlens


#: the kernels' constexpr parameters, in signature order (the serving variant's four after CAUSAL)
_CONSTEXPRS = ("CAUSAL", "VARLEN", "WINDOW", "RETURN_LSE", "PAGED")
#: pointers a serving-variant launch adds after the descales: CU_Q, CU_K, LSE, PAGE_TABLE, CACHE_SEQLENS
_SERVING_POINTERS = 5


def launch(
    config: KernelConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    *,
    serving: Serving | None = None,
) -> torch.Tensor:
    """Launch `config` on validated inputs (last dims contiguous) into `out` (bf16).

    Descales are all None or all contiguous float32 (batch, kv_heads) tensors. `serving`: the
    call's varlen, window and LSE options (a Triton config's serving variant runs them; a Gluon
    config's twins a window and an LSE).
    """
    grid, args, options = prepare(
        config, q, k, v, out, softmax_scale, causal, q_descale, k_descale, v_descale, serving=serving
    )
    lse, window = _twins_of(serving)
    run_prepared(config, grid, args, options, q.device.index, lse=lse, window=window)
    return out


def for_v_layout(config: KernelConfig, v: torch.Tensor) -> KernelConfig:
    """The config to run for V as stored. A natural-V FP8 config given a K-major V (quantize_fp8(...,
    v_layout="k_major")) would first copy V back to (keys, dim) rows; its transposed twin, the same
    schedule reading the V^T tile from memory, reads those bytes as they are, with no copy (Gluon:
    bitwise equal to the natural kernel, tests/test_gpu_gluon.py; a natural Gluon config never
    permutes keys, so its twin needs no permuted copy). A Gluon config that relabels keys
    (v_permute) would copy a K-major V into its permuted V^T; its k_perm twin makes the relabelling on
    K's tile rows instead (a 5-D TMA box) and reads that V as it is, where Sk % 16 == 0 and Q / K are
    not zero-padded (rules.gluon_head_dim_conflict); elsewhere a k_perm config runs without it. Any
    other pair is returned unchanged."""
    if config.dtype != "fp8":
        return config
    if config.v_layout == "natural" and k_major_view(v) is not None:
        return config.replace(v_layout="transposed")
    if config.k_perm and v.shape[1] % 16:
        return config.replace(k_perm=False)
    if (
        config.backend == "gluon"
        and config.v_permute
        and not config.k_perm
        and not gluon_qk_padded(config)  # (k_perm's 5-D box leaves no dimension for the zero-padded heads)
        and v.shape[1] % 16 == 0
        and k_major_view(v) is not None
    ):
        return config.replace(k_perm=True)
    return config


# ---- launch fast path (kernels/fastlaunch.py) ---------------------------------------------------


def compiled_kernels(config: KernelConfig) -> list:
    """The CompiledKernels launched so far for `config` (one per specialisation and device)."""
    return fastlaunch.compiled_for(config)


def forget(config: KernelConfig) -> None:
    """Drop `config`'s compiled kernels from the fast path (a tuning worker serves many configs)."""
    fastlaunch.forget(config)


def run_prepared(
    config: KernelConfig,
    grid: tuple,
    args: tuple,
    options: dict,
    device: int,
    lse: bool = False,
    window: bool = False,
):
    """Launch `prepare`'s (grid, args, options) through the fast path; returns the CompiledKernel that ran.
    `lse`, `window`: the call passes an LSE, a window (a Gluon config then runs that twin of its kernel; a
    Triton one's serving variant takes them as options)."""
    causal = options["CAUSAL"]
    serving = "VARLEN" in options
    twin = twin_names(lse, window) if config.backend == "gluon" else ()
    return fastlaunch.run(
        (config, causal, "serving") if serving else (config, causal, "-".join(twin)) if twin else (config, causal),
        kernel(config, serving) if serving else kernel(config, False, lse, window) if twin else kernel(config),
        grid,
        args,
        {k: options[k] for k in _CONSTEXPRS if k in options},
        {k: v for k, v in options.items() if k not in _CONSTEXPRS},
        device,
    )


# ---- bound launches ------------------------------------------------------------------------------
# `flash_attn_func` calls with the same shapes, strides, dtypes and device differ only in their data
# pointers. A BoundLaunch holds everything else (grid, scalar arguments, the CompiledKernel chosen by
# the specialisation key) and rebuilds per call only what holds a pointer: the TMA descriptors.


class BoundLaunch:
    """`config` launched on one argument layout; call it with new tensors of that same layout.

    Valid only for tensors whose shapes, strides, dtypes and device equal those `bind` saw and whose
    data pointers are 16-byte aligned (the caller checks both: see `zyfa_tune.api`). The call path is
    written flat: every microsecond here is dispatch overhead (docs/results.md).

    transpose: the V^T copy for this layout (`kernels.transpose.bind_transpose`), or None (V read as
               given; a K-major V too: its descriptor needs only the base pointer, V's own).
    specs:     (index in (q, k, v, out), descriptor class, its fields but the base) per TMA descriptor,
               or None for pointer arguments (then `strides` follow q, k, v).
    out_arg:   whether `out` is passed as a pointer after the inputs (Triton) or only through its
               descriptor (Gluon)."""

    __slots__ = ("compiled", "programs", "device", "transpose", "specs", "out_arg", "strides", "tail", "raw", "tma")

    def __init__(
        self,
        compiled,
        programs: int,
        device: int,
        transpose,
        specs: tuple | None,
        out_arg: bool,
        strides: tuple,
        tail: tuple,
    ):
        self.compiled, self.programs, self.device = compiled, programs, device
        self.transpose, self.specs, self.out_arg, self.strides, self.tail = transpose, specs, out_arg, strides, tail
        # descriptors encoded once per pointer, handed to Triton's C launcher (kernels/fastlaunch.py)
        meta = getattr(getattr(compiled, "metadata", None), "tensordesc_meta", None)
        self.raw = fastlaunch.raw_launch(compiled) if specs and meta and len(meta) == len(specs) else None
        self.tma = (
            None
            if self.raw is None
            else tuple((i, fastlaunch.TmaArgs(cls, fields, m)) for (i, cls, fields), m in zip(specs, meta))
        )

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        q_descale: torch.Tensor | None,
        k_descale: torch.Tensor | None,
        v_descale: torch.Tensor | None,
        extra: tuple = (),
    ) -> torch.Tensor:
        """`extra`: a serving-variant launch's `Serving.pointers`, Nones where off."""
        if self.transpose is not None:
            v = self.transpose(v)
        if self.raw is not None and not fastlaunch.hooks_set():
            tensors = (q, k, v, out)
            inputs = []
            for i, encoded in self.tma:
                inputs += encoded(tensors[i])
            if self.out_arg:
                inputs.append(out)
            self.raw((self.programs, 1, 1), self.device, (*inputs, q_descale, k_descale, v_descale, *extra, *self.tail))
            return out
        if self.specs is not None:
            tensors = (q, k, v, out)
            inputs = [_unchecked_descriptor(tensors[i], cls, fields) for i, cls, fields in self.specs]
        else:
            inputs = [q, k, v, *self.strides]
        if self.out_arg:
            inputs.append(out)
        fastlaunch.launch_compiled(
            self.compiled,
            (self.programs,),
            self.device,
            (*inputs, q_descale, k_descale, v_descale, *extra, *self.tail),
        )
        return out


class ServingLaunch:
    """A serving-variant BoundLaunch for the API's per-layout fast path: allocates each call's LSE
    (returning (out, lse)) where the layout asks for one, and passes varlen calls' cumulative lengths
    and paged calls' page table and cache lengths. `lse_only`: a Gluon kernel's launch, whose one pointer
    after the descales is the LSE where it writes one (its window bounds are bound in the tail)."""

    __slots__ = ("bound", "lse_shape", "lse_only")

    def __init__(self, bound: BoundLaunch, lse_shape: tuple[int, ...] | None, lse_only: bool = False):
        self.bound, self.lse_shape, self.lse_only = bound, lse_shape, lse_only

    def __call__(
        self,
        q,
        k,
        v,
        out,
        q_descale,
        k_descale,
        v_descale,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        page_table=None,
        cache_seqlens=None,
    ):
        lse = None if self.lse_shape is None else torch.empty(self.lse_shape, dtype=torch.float32, device=out.device)
        if self.lse_only:
            extra = () if lse is None else (lse,)
        else:
            extra = (cu_seqlens_q, cu_seqlens_k, lse, page_table, cache_seqlens)
        self.bound(q, k, v, out, q_descale, k_descale, v_descale, extra)
        return out if lse is None else (out, lse)


def bind(
    config: KernelConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    *,
    serving: Serving | None = None,
) -> BoundLaunch | None:
    """Launch like `launch` and return a BoundLaunch for later calls with this layout, or None where
    this layout needs a hidden copy (unaligned or padded rows for TMA) and so no fast path. With
    `serving`, later calls pass its `pointers` as the BoundLaunch's `extra` (a Gluon config: the LSE alone,
    ServingLaunch's lse_only)."""
    grid, args, options = prepare(
        config, q, k, v, out, softmax_scale, causal, q_descale, k_descale, v_descale, serving=serving
    )
    device = q.device.index
    lse, window = _twins_of(serving)
    compiled = run_prepared(config, grid, args, options, device, lse=lse, window=window)
    constexprs = tuple(options[k] for k in _CONSTEXPRS if k in options)
    gluon = config.backend == "gluon"
    n_extra = int(lse) if gluon else 0 if serving is None else _SERVING_POINTERS
    tensors = (q, k, v, q_descale, k_descale, v_descale)
    if any(t is not None and t.data_ptr() % 16 for t in tensors):
        return None
    tma = gluon or config.loads == "tma"
    transposed = config.v_layout == "transposed"
    if tma and any(_tma_ready(t) is not t for t in (q, k) + (() if transposed else (v,))):
        return None
    if gluon and not out.is_contiguous():
        return None
    transpose = bind_transpose(v, gluon and gluon_launch.v_keys_permuted(config)) if transposed else None
    if transpose is k_major_view:  # a descriptor needs only the base pointer: V's own, no view per call
        transpose = None
    if not tma:  # pointers: q, k, v, 9 strides, out, descales, serving pointers, tail
        tail = (*args[16 + n_extra :], *constexprs)
        return BoundLaunch(compiled, grid[0], device, transpose, None, True, tuple(args[3:12]), tail)
    if gluon:  # descriptors of q, k (both key parts), v, out; descales; tail
        owners = gluon_launch.descriptor_owners(config)
    else:  # prepare's descriptors, in _descriptor_specs' order; out; descales; tail
        wqk, wv = _descriptor_widths(config)
        owners = (0,) * len(wqk) + (1,) * len(wqk) + (2,) * len(wv)
    specs = tuple((i, type(d), {f: x for f, x in vars(d).items() if f != "base"}) for i, d in zip(owners, args))
    skip = len(specs) + (3 + n_extra if gluon else 4 + n_extra)
    return BoundLaunch(compiled, grid[0], device, transpose, specs, not gluon, (), (*args[skip:], *constexprs))


def prepare(
    config: KernelConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    *,
    sms: int | None = None,
    serving: Serving | None = None,
):
    """Grid, positional arguments and launch options of one call (makes the V^T copy if needed).
    `sms` sizes a persistent grid (default: the device's SM count; the target's reference count, HOPPER.sm_count, for tensors not on a GPU).
    `serving`: the call's varlen, paged, window and LSE options (a Triton config's serving variant; a Gluon
    config's twins take an LSE and a window)."""
    gluon_lse = gluon_window = None
    if serving is not None and config.backend == "gluon":  # (its varlen variant has its own launcher)
        if serving.cu_seqlens_q is not None or serving.page_table is not None:
            raise ValueError(
                "config: backend='gluon' runs packed sequences through kernels.gluon_varlen and paged KV "
                "caches through kernels.gluon_paged; pass a Triton config for the serving variant"
            )
        gluon_lse, gluon_window, serving = serving.lse, serving.window, None
    if serving is not None:
        emitted(config, True)  # a backend with no serving variant says so here, naming the options
        if serving.page_table is not None:
            _check_paged(config, k, v, serving.page_table.shape[1])
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.shape[1] * t.stride(1) + t.shape[2] * t.stride(2) > _INT32_MAX:
            raise ValueError(f"{name}: one batch entry spans more than 2^31 elements; split the batch")
    varlen = serving is not None and serving.cu_seqlens_q is not None
    batch = serving.cu_seqlens_q.shape[0] - 1 if varlen else b  # packed: the sequences
    n_m = math.ceil((serving.max_seqlen_q if varlen else sq) / config.block_m)
    if n_m * batch * h > _INT32_MAX:
        raise ValueError(f"q: {n_m * batch * h} programs exceed the grid limit; split the batch")
    if config.backend == "gluon":
        if sms is None:
            sms = gluon_launch.sm_count(q.device.index) if q.device.type == "cuda" else gluon_launch.DEFAULT_SMS
        permuted = gluon_launch.v_keys_permuted(config)
        v = _tma_ready(v) if config.v_layout == "natural" else transpose_v(v, permuted)
        return gluon_launch.arguments(
            config,
            _tma_ready(q),
            _tma_ready(k),
            v,
            out,
            float(softmax_scale) * LOG2E,
            causal,
            q_descale,
            k_descale,
            v_descale,
            sms,
            gluon_lse,
            gluon_window,
        )
    # no descales: None specialises the kernel to skip them (no tensor to allocate, so a first
    # call inside CUDA graph capture is safe)
    ds0, ds1 = q_descale.stride() if q_descale is not None else (0, 0)
    if config.v_layout == "transposed":
        v = transpose_v(v)
    elif v.stride(-1) != 1:  # a keys-fastest V, for a kernel that reads (keys, dim) rows
        v = v.contiguous()
    if config.loads == "tma":
        inputs = _descriptors(config, q, k, v)
    else:
        vrow = v.stride(2) if config.v_layout == "transposed" else v.stride(1)
        vhead = v.stride(1) if config.v_layout == "transposed" else v.stride(2)
        inputs = (
            q,
            k,
            v,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            vrow,
            vhead,
        )
    extra = () if serving is None else serving.pointers
    args = (
        *inputs,
        out,
        q_descale,
        k_descale,
        v_descale,
        *extra,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        ds0,
        ds1,
        h,
        h // hk,
        sq,
        sk,
        n_m,
        float(softmax_scale) * LOG2E,
        *(() if serving is None else _serving_scalars(serving)),
    )
    options = dict(
        CAUSAL=bool(causal), num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=config.maxnreg or None
    )
    if serving is not None:
        options.update(serving.constexprs)
    return (n_m * batch * h,), args, options


def pages_by_tma(config: KernelConfig) -> bool:
    """Whether TMA may read a paged cache for `config`: only where Q/K and V are each one head-dim
    chunk. With two or more chunks a tile's page number (a load) feeds several TMA coordinates, and
    Triton 3.6's pipelined loop then gave wrong outputs and illegal addresses on an H100 (bf16 at
    head dims 80 and 96); pointer loads read those caches correctly."""
    qk, v = chunks_of(config)
    return len(qk) == 1 and len(v) == 1


def _check_paged(config: KernelConfig, k: torch.Tensor, v: torch.Tensor, max_pages: int) -> None:
    """What the paged kernel assumes of its config and cache: V read as stored (natural), TMA only
    where `pages_by_tma`, tiles within a page, and pointer loads' key offsets (key index x row
    stride) within int32."""
    if config.v_layout != "natural":
        raise ValueError("config: a paged KV cache is read with v_layout='natural' (no V^T copy of a cache)")
    if config.loads == "tma" and not pages_by_tma(config):
        raise ValueError(
            f"config: a paged KV cache at head dims {config.head_dim_qk}/{config.head_dim_v} is read with "
            "loads='pointer' (TMA reads pages only where Q/K and V are each one head-dim chunk)"
        )
    if k.shape[1] % config.block_n:
        raise ValueError(f"k_cache: page_size {k.shape[1]} is not a multiple of config's block_n {config.block_n}")
    if config.loads == "pointer" and max_pages * k.shape[1] * max(k.stride(1), v.stride(1)) > _INT32_MAX:
        raise ValueError("page_table: max_pages x page_size keys span more than 2^31 cache elements; split the batch")


def _serving_scalars(serving: Serving) -> tuple[int, ...]:
    """stride_lb, stride_lh, WIN_L, WIN_R, stride_pt of a serving-variant launch (0 for options
    that are off)."""
    lse = serving.lse
    if lse is None:
        strides = (0, 0)
    elif serving.cu_seqlens_q is not None:  # (heads, total_q)
        strides = (0, lse.stride(0))
    else:  # (batch, heads, seqlen_q)
        strides = (lse.stride(0), lse.stride(1))
    stride_pt = 0 if serving.page_table is None else serving.page_table.stride(0)
    return (*strides, *(serving.window or (0, 0)), stride_pt)


def tma_readable(t: torch.Tensor) -> bool:
    """Whether TMA reads `t` (4-D, last dim contiguous) as it is: (batch*seqlen, heads*dim) rows
    from a 16-byte aligned base."""
    return t.stride(2) == t.shape[3] and t.stride(0) == t.shape[1] * t.stride(1) and t.data_ptr() % 16 == 0


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy TMA can read (`tma_readable`)."""
    if not tma_readable(t):
        return t.contiguous() if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)
    return t


@functools.cache
def _descriptor_widths(config: KernelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Distinct head-dim chunk widths of Q/K and of V, widest first (one descriptor each)."""

    def widths(chunks: list[tuple[int, int]]) -> tuple[int, ...]:
        return tuple(sorted({w for _, w in chunks}, reverse=True))

    qk, v = chunks_of(config)
    return widths(qk), widths(v)


def _descriptor_specs(config: KernelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list:
    """(tensor index in (q, k, v), 2-D shape, strides, block) of each host TMA descriptor: Q (B*Sq, H*Dqk),
    K (B*Sk, Hkv*Dqk), V (B*Sk, Hkv*Dv) or V^T (B*Hkv*Dv, Sk); one per tensor and head-dim chunk width.
    K's and V's B is their own first dim: a paged cache's pages, not q's batch. q, k (and natural v)
    must be TMA-ready; a transposed v is the copy `transpose_v` made."""
    wqk, wv = _descriptor_widths(config)
    bm, bn = config.block_m, config.block_n
    b, sq, h, dqk = q.shape
    bk, sk, hk = k.shape[:3]
    specs = [(0, [b * sq, h * dqk], [q.stride(1), 1], [bm, w]) for w in wqk]
    specs += [(1, [bk * sk, hk * dqk], [k.stride(1), 1], [bn, w]) for w in wqk]
    if config.v_layout == "transposed":  # v is the (B, Hkv, Dv, Sk) copy
        specs += [(2, [bk * hk * v.shape[2], sk], [v.stride(2), 1], [w, bn]) for w in wv]
    else:
        specs += [(2, [bk * sk, hk * v.shape[3]], [v.stride(1), 1], [bn, w]) for w in wv]
    return specs


def _descriptors(config: KernelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list:
    """Host TMA descriptors of one call (copies q, k, natural v first where TMA cannot read them)."""
    q, k = _tma_ready(q), _tma_ready(k)
    if config.v_layout != "transposed":
        v = _tma_ready(v)
    qkv = (q, k, v)
    return [
        TensorDescriptor(qkv[i], shape, strides, block)
        for i, shape, strides, block in _descriptor_specs(config, q, k, v)
    ]


def _unchecked_descriptor(base: torch.Tensor, cls: type, fields: dict):
    """A TensorDescriptor (Triton's or Gluon's) without its constructor's checks (about 1 us each):
    for a BoundLaunch, whose layout passed those checks at `bind` and whose pointers the caller
    checked for alignment."""
    d = object.__new__(cls)
    d.__dict__.update(fields, base=base)
    return d
