"""Launching a Triton / Gluon JIT function without Triton's per-call binding.

Triton's `kernel[grid](...)` binds and specialises every argument and builds a cache key on each
call (tens of microseconds). The compiled kernel depends only on the function, its constexprs and
the argument properties Triton specialises on, so after the first launch we key the CompiledKernel
by those properties (conservatively: more than Triton distinguishes, never less) and launch it
directly. Used by the attention launcher (kernels/launch.py) and the V^T transpose.

TMA descriptors: Triton's launcher encodes every host TensorDescriptor argument into a CUtensorMap
(cuTensorMapEncodeTiled, through Python) on every launch. An encoding depends only on the base
pointer and the descriptor's fixed fields, so `TmaArgs` keeps the encoded arguments per pointer and
`RawLaunch` hands them to Triton's C launcher directly, below the wrapper that would encode again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from triton import knobs
from triton.backends.nvidia.driver import make_tensordesc_arg
from triton.runtime import driver

_compiled: dict[tuple, object] = {}
_I32 = (-(2**31), 2**31 - 1)


def arg_class(a) -> object:
    """The properties of one argument that Triton's specialisation can depend on."""
    if a is None or isinstance(a, bool):
        return a
    if isinstance(a, int):  # ==1 becomes a constant, %16 a divisibility hint, beyond int32 an i64
        return 1 if a == 1 else (16 if a % 16 == 0 else 0) if _I32[0] <= a <= _I32[1] else "i64"
    if isinstance(a, float):
        return "f"
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    # host TensorDescriptor (Triton's, or Gluon's with its shared layout)
    return (
        a.base.dtype,
        a.base.data_ptr() % 16 == 0,
        tuple(a.block_shape),
        tuple(x % 16 == 0 for x in a.shape),
        tuple(x % 16 == 0 for x in a.strides),
        a.padding,
        getattr(a, "layout", None),
    )


def run(head: tuple, fn, grid: tuple, args: tuple, constexprs: dict, options: dict, device: int):
    """Launch `fn` on `grid`; returns the CompiledKernel that ran. `head` names what else the
    compiled code depends on (the config, the function); `constexprs` are the function's trailing
    constexpr parameters in order, `options` the launch options (num_warps, ...). Both are part of
    the key: a kernel compiled for one constexpr value is never launched for another (the quantiser
    once reused a one-tensor pass for three tensors this way)."""
    key = (head, device, tuple(constexprs.items()), tuple(options.items()), tuple(arg_class(a) for a in args))
    compiled = _compiled.get(key)
    if compiled is None:  # first launch of this specialisation: Triton's own path (compiles)
        compiled = fn[grid](*args, **constexprs, **options)
        _compiled[key] = compiled
        return compiled
    launch_compiled(compiled, grid, device, (*args, *constexprs.values()))
    return compiled


@functools.lru_cache(maxsize=1)
def _stream_getter():
    """Triton's current-stream function, looked up once (`driver.active` is a lazy proxy whose
    attribute access costs on every call of the dispatch fast path)."""
    return driver.active.get_current_stream


def hooks_set() -> bool:
    """Whether a launch enter or exit hook is set (a profiler such as Proton)."""
    return hooked(knobs.runtime.launch_enter_hook) or hooked(knobs.runtime.launch_exit_hook)


def hooked(hook) -> bool:
    """Whether a launch hook does anything: Triton 3.6 keeps an empty HookChain when none is set."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch_compiled(compiled, grid: tuple, device: int, full: tuple) -> None:
    """Enqueue `compiled` on the current stream of `device` (launch hooks honoured, as Triton does)."""
    stream = _stream_getter()(device)
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    enter, exit_ = (enter if hooked(enter) else None), (exit_ if hooked(exit_) else None)
    meta = compiled.launch_metadata(grid, stream, *full) if enter is not None else None
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, meta, enter, exit_, *full)


def compiled_for(head_first: object) -> list:
    """The CompiledKernels launched so far whose head starts with `head_first` (one per
    specialisation and device)."""
    return [ck for key, ck in _compiled.items() if key[0][0] == head_first]


def forget(head_first: object) -> None:
    """Drop the CompiledKernels whose head starts with `head_first`."""
    for key in [k for k in _compiled if k[0][0] == head_first]:
        del _compiled[key]


# ---- launches with TMA descriptors encoded once per pointer ---------------------------------------

#: encoded descriptors kept per TmaArgs (pointers of one argument slot: the caching allocator hands a
#: steady-state loop the same few addresses); beyond it the cache starts over
TMA_CACHE_LIMIT = 64


class TmaArgs:
    """The launcher arguments of one TMA descriptor slot ([CUtensorMap, *shape, *strides], as
    Triton's `make_tensordesc_arg` expands a host descriptor), encoded once per base pointer.
    `fields` are the descriptor's fields but the base, `meta` its entry of the kernel's
    tensordesc_meta; only the base pointer varies between calls."""

    __slots__ = ("cls", "fields", "meta", "encoded")

    def __init__(self, cls: type, fields: dict, meta: dict):
        self.cls, self.fields, self.meta, self.encoded = cls, fields, meta, {}

    def __call__(self, base: torch.Tensor) -> tuple:
        ptr = base.data_ptr()
        got = self.encoded.get(ptr)
        if got is None:
            desc = object.__new__(self.cls)
            desc.__dict__.update(self.fields, base=base)
            got = tuple(make_tensordesc_arg(desc, self.meta))
            if len(self.encoded) >= TMA_CACHE_LIMIT:
                self.encoded.clear()
            self.encoded[ptr] = got
        return got


@dataclass(frozen=True)
class RawLaunch:
    """Triton's C launcher of one CompiledKernel (what `compiled.run` calls after expanding and
    encoding descriptor arguments), for argument lists whose descriptors are already expanded."""

    launch: Callable
    function: object
    packed_metadata: object
    cooperative: bool
    pdl: bool

    def __call__(self, grid: tuple[int, int, int], device: int, args: tuple) -> None:
        """Launch on `grid`; the caller checked that no launch hook is set (`hooks_set`)."""
        self.launch(
            grid[0],
            grid[1],
            grid[2],
            _stream_getter()(device),
            self.function,
            self.cooperative,
            self.pdl,
            None,
            None,
            self.packed_metadata,
            None,
            None,
            None,
            *args,
        )


class Bound:
    """One CompiledKernel on a fixed grid and device: launched through its RawLaunch when it has one
    and no launch hook is set, else through `launch_compiled` (hooks get Triton's metadata)."""

    __slots__ = ("compiled", "raw", "grid", "device")

    def __init__(self, compiled, grid: tuple, device: int):
        self.compiled, self.raw, self.device = compiled, raw_launch(compiled), device
        self.grid = (*grid, 1, 1)[:3]

    def __call__(self, args: tuple) -> None:
        if self.raw is not None and not hooks_set():
            self.raw(self.grid, self.device, args)
        else:
            launch_compiled(self.compiled, self.grid, self.device, args)


def raw_launch(compiled) -> RawLaunch | None:
    """The RawLaunch of `compiled`, or None where its launcher is not the one this module knows
    (Triton's CudaLauncher: its C launcher, wrapped by `wrap_handle_tensordesc` when the kernel
    takes descriptors) or the kernel needs scratch memory per launch. Callers check `hooks_set()`
    per call: hooks get launch metadata on Triton's own path."""
    run = getattr(compiled, "run", None)
    launcher = getattr(run, "launch", None)
    code = getattr(launcher, "__code__", None)
    if code is not None:  # the descriptor wrapper: its closure holds the C launcher
        if code.co_name != "inner" or not launcher.__closure__:
            return None
        launcher = dict(zip(code.co_freevars, (c.cell_contents for c in launcher.__closure__))).get("launcher")
    if (
        not callable(launcher)
        or getattr(launcher, "__code__", None) is not None
        or getattr(run, "global_scratch_size", 1)
        or getattr(run, "profile_scratch_size", 1)
    ):
        return None  # not a C function, or scratch memory to allocate per launch
    return RawLaunch(
        launcher, compiled.function, compiled.packed_metadata, bool(run.launch_cooperative_grid), bool(run.launch_pdl)
    )
