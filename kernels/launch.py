"""Build cache and launcher: config -> emitted source -> Triton JIT function -> launch."""

from __future__ import annotations

import functools
import math

import torch
from triton import knobs
from triton.runtime import driver
from triton.tools.tensor_descriptor import TensorDescriptor

from zyfa_tune.generator import EmittedKernel, KernelConfig, emit, head_chunks
from zyfa_tune.generator.build import jit_function

LOG2E = 1.4426950408889634

_INT32_MAX = 2**31 - 1


@functools.lru_cache(maxsize=None)
def emitted(config: KernelConfig) -> EmittedKernel:
    """Emit once per config (configs are frozen and hashable)."""
    return emit(config)


@functools.lru_cache(maxsize=None)
def kernel(config: KernelConfig):
    """The Triton JIT function of `config` (emitted, written and imported once per process)."""
    return jit_function(emitted(config))


def launch(config: KernelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
           softmax_scale: float, causal: bool,
           q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
           v_descale: torch.Tensor | None = None) -> torch.Tensor:
    """Launch `config` on validated inputs (last dims contiguous) into `out` (bf16).

    Descales are all None or all contiguous float32 (batch, kv_heads) tensors.
    """
    grid, args, options = prepare(config, q, k, v, out, softmax_scale, causal, q_descale, k_descale, v_descale)
    _run(config, grid, args, options, q.device.index)
    return out


# ---- launch fast path ---------------------------------------------------------------------------
# Triton's `kernel[grid](...)` binds and specialises every argument and builds a cache key on each
# call (tens of microseconds). The compiled kernel depends only on the config and on the argument
# properties Triton specialises on, so after the first launch we key the CompiledKernel by those
# properties (conservatively: more than Triton distinguishes, never less) and launch it directly.

_compiled: dict[tuple, object] = {}
_I32 = (-(2**31), 2**31 - 1)


def compiled_kernels(config: KernelConfig) -> list:
    """The CompiledKernels launched so far for `config` (one per specialisation and device)."""
    return [ck for key, ck in _compiled.items() if key[0] == config]


def forget(config: KernelConfig) -> None:
    """Drop `config`'s compiled kernels from the fast path (a tuning worker serves many configs)."""
    for key in [k for k in _compiled if k[0] == config]:
        del _compiled[key]


def _arg_class(a) -> object:
    """The properties of one argument that Triton's specialisation can depend on."""
    if a is None or isinstance(a, bool):
        return a
    if isinstance(a, int):  # ==1 becomes a constant, %16 a divisibility hint, beyond int32 an i64
        return 1 if a == 1 else (16 if a % 16 == 0 else 0) if _I32[0] <= a <= _I32[1] else "i64"
    if isinstance(a, float):
        return "f"
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    # host TensorDescriptor
    return (a.base.dtype, a.base.data_ptr() % 16 == 0, tuple(a.block_shape),
            tuple(x % 16 == 0 for x in a.shape), tuple(x % 16 == 0 for x in a.strides), a.padding)


def _run(config: KernelConfig, grid: tuple, args: tuple, options: dict, device: int):
    """Launch through the fast path; returns the CompiledKernel that ran."""
    key = (config, device, options["CAUSAL"], tuple(_arg_class(a) for a in args))
    compiled = _compiled.get(key)
    if compiled is None:  # first launch of this specialisation: Triton's own path (compiles)
        compiled = kernel(config)[grid](*args, **options)
        _compiled[key] = compiled
        return compiled
    _launch_compiled(compiled, grid[0], device, (*args, options["CAUSAL"]))
    return compiled


def _launch_compiled(compiled, programs: int, device: int, full: tuple) -> None:
    """Enqueue `compiled` on the current stream of `device` (launch hooks honoured, as Triton does)."""
    stream = driver.active.get_current_stream(device)
    hook = knobs.runtime.launch_enter_hook
    meta = compiled.launch_metadata((programs,), stream, *full) if hook is not None else None
    compiled.run(programs, 1, 1, stream, compiled.function, compiled.packed_metadata, meta, hook,
                 knobs.runtime.launch_exit_hook, *full)


# ---- bound launches ------------------------------------------------------------------------------
# `flash_attn_func` calls with the same shapes, strides, dtypes and device differ only in their data
# pointers. A BoundLaunch holds everything else (grid, scalar arguments, the CompiledKernel chosen by
# the specialisation key) and rebuilds per call only what holds a pointer: the TMA descriptors.

class BoundLaunch:
    """`config` launched on one argument layout; call it with new tensors of that same layout.

    Valid only for tensors whose shapes, strides, dtypes and device equal those `bind` saw and whose
    data pointers are 16-byte aligned (the caller checks both: see `zyfa_tune.api`). The call path is
    written flat: every microsecond here is dispatch overhead (docs/PERF.md)."""

    __slots__ = ("compiled", "programs", "device", "transpose", "specs", "strides", "tail", "stream_of")

    def __init__(self, compiled, programs: int, device: int, transpose: bool, specs: tuple | None,
                 strides: tuple, tail: tuple):
        self.compiled, self.programs, self.device = compiled, programs, device
        self.transpose, self.specs, self.strides, self.tail = transpose, specs, strides, tail
        self.stream_of = driver.active.get_current_stream

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 q_descale: torch.Tensor | None, k_descale: torch.Tensor | None,
                 v_descale: torch.Tensor | None) -> torch.Tensor:
        if self.transpose:
            v = transpose_v(v)
        if self.specs is not None:
            qkv = (q, k, v)
            inputs = [_unchecked_descriptor(qkv[i], shape, strides, block) for i, shape, strides, block in self.specs]
        else:
            inputs = [q, k, v, *self.strides]
        c = self.compiled
        full = (*inputs, out, q_descale, k_descale, v_descale, *self.tail)
        stream = self.stream_of(self.device)
        hook = knobs.runtime.launch_enter_hook
        meta = c.launch_metadata((self.programs,), stream, *full) if hook is not None else None
        c.run(self.programs, 1, 1, stream, c.function, c.packed_metadata, meta, hook,
              knobs.runtime.launch_exit_hook, *full)
        return out


def bind(config: KernelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
         softmax_scale: float, causal: bool, q_descale: torch.Tensor | None = None,
         k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None) -> BoundLaunch | None:
    """Launch like `launch` and return a BoundLaunch for later calls with this layout, or None where
    this layout needs a hidden copy (unaligned or padded rows for TMA) and so no fast path."""
    grid, args, options = prepare(config, q, k, v, out, softmax_scale, causal, q_descale, k_descale, v_descale)
    device = q.device.index
    compiled = _run(config, grid, args, options, device)
    tensors = (q, k, v, q_descale, k_descale, v_descale)
    if any(t is not None and t.data_ptr() % 16 for t in tensors):
        return None
    n_inputs = 12
    specs = None
    if config.loads == "tma":
        if any(_tma_ready(t) is not t for t in (q, k) + (() if config.v_layout == "transposed" else (v,))):
            return None
        wqk, wv = _descriptor_widths(config)  # prepare's descriptors, in _descriptor_specs' order
        owners = (0,) * len(wqk) + (1,) * len(wqk) + (2,) * len(wv)
        specs = tuple((i, d.shape, d.strides, d.block_shape) for i, d in zip(owners, args))
        n_inputs = len(specs)
    return BoundLaunch(compiled, grid[0], device, config.v_layout == "transposed", specs,
                       tuple(args[3:12]) if specs is None else (), (*args[n_inputs + 4:], options["CAUSAL"]))


def prepare(config: KernelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            softmax_scale: float, causal: bool, q_descale: torch.Tensor | None = None,
            k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None):
    """Grid, positional arguments and launch options of one call (makes the V^T copy if needed)."""
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.shape[1] * t.stride(1) + t.shape[2] * t.stride(2) > _INT32_MAX:
            raise ValueError(f"{name}: one batch entry spans more than 2^31 elements; split the batch")
    n_m = math.ceil(sq / config.block_m)
    if n_m * b * h > _INT32_MAX:
        raise ValueError(f"q: {n_m * b * h} programs exceed the grid limit; split the batch")
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
        inputs = (q, k, v, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                  v.stride(0), vrow, vhead)
    args = (*inputs, out, q_descale, k_descale, v_descale,
            out.stride(0), out.stride(1), out.stride(2), ds0, ds1,
            h, h // hk, sq, sk, n_m, float(softmax_scale) * LOG2E)
    options = dict(CAUSAL=bool(causal), num_warps=config.num_warps, num_stages=config.num_stages,
                   maxnreg=config.maxnreg or None)
    return (n_m * b * h,), args, options


def transpose_v(v: torch.Tensor) -> torch.Tensor:
    """(B, Sk, Hkv, Dv) -> (B, Hkv, Dv, Sk) with keys contiguous and rows 16-byte aligned (TMA): a
    view when v is already stored that way (`quantize_fp8(..., v_layout="k_major")`), else a copy."""
    b, sk, hk, dv = v.shape
    vt = v.permute(0, 2, 3, 1)
    row = vt.stride(2)
    if vt.stride(3) == 1 and (row * v.element_size()) % 16 == 0 and row >= sk and vt.stride(1) == dv * row \
            and vt.stride(0) == hk * dv * row and v.data_ptr() % 16 == 0:
        return vt
    if sk % 16 == 0:  # one op: fewer host microseconds than empty + sliced copy
        return vt.contiguous()
    pad = -(-sk // 16) * 16
    vt = torch.empty(b, hk, dv, pad, dtype=v.dtype, device=v.device)
    vt[..., :sk].copy_(v.permute(0, 2, 3, 1))
    return vt[..., :sk]


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA reads (batch*seqlen, heads*dim) rows from a 16-byte aligned base: copy if not so."""
    if t.stride(2) != t.shape[3] or t.stride(0) != t.shape[1] * t.stride(1) or t.data_ptr() % 16:
        return t.contiguous() if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)
    return t


@functools.lru_cache(maxsize=None)
def _descriptor_widths(config: KernelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Distinct head-dim chunk widths of Q/K and of V, widest first (one descriptor each)."""
    def widths(dim: int) -> tuple[int, ...]:
        return tuple(sorted({w for _, w in head_chunks(dim)}, reverse=True))
    return widths(config.head_dim_qk), widths(config.head_dim_v)


def _descriptor_specs(config: KernelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list:
    """(tensor index in (q, k, v), 2-D shape, strides, block) of each host TMA descriptor: Q (B*Sq, H*Dqk),
    K (B*Sk, Hkv*Dqk), V (B*Sk, Hkv*Dv) or V^T (B*Hkv*Dv, Sk); one per tensor and head-dim chunk width.
    q, k (and natural v) must be TMA-ready; a transposed v is the copy `transpose_v` made."""
    wqk, wv = _descriptor_widths(config)
    bm, bn = config.block_m, config.block_n
    b, sq, h, dqk = q.shape
    sk, hk = k.shape[1], k.shape[2]
    specs = [(0, [b * sq, h * dqk], [q.stride(1), 1], [bm, w]) for w in wqk]
    specs += [(1, [b * sk, hk * dqk], [k.stride(1), 1], [bn, w]) for w in wqk]
    if config.v_layout == "transposed":  # v is the (B, Hkv, Dv, Sk) copy
        specs += [(2, [b * hk * v.shape[2], sk], [v.stride(2), 1], [w, bn]) for w in wv]
    else:
        specs += [(2, [b * sk, hk * v.shape[3]], [v.stride(1), 1], [bn, w]) for w in wv]
    return specs


def _descriptors(config: KernelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list:
    """Host TMA descriptors of one call (copies q, k, natural v first where TMA cannot read them)."""
    q, k = _tma_ready(q), _tma_ready(k)
    if config.v_layout != "transposed":
        v = _tma_ready(v)
    qkv = (q, k, v)
    return [TensorDescriptor(qkv[i], shape, strides, block) for i, shape, strides, block in
            _descriptor_specs(config, q, k, v)]


def _unchecked_descriptor(base: torch.Tensor, shape: list, strides: list, block: list):
    """A TensorDescriptor without its constructor's checks (about 1 us each): for a BoundLaunch,
    whose layout passed those checks at `bind` and whose pointers the caller checked for alignment."""
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(base=base, shape=shape, strides=strides, block_shape=block, padding="zero")
    return d
