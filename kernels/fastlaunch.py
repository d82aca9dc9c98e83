"""Launching a Triton / Gluon JIT function without Triton's per-call binding.

Triton's `kernel[grid](...)` binds and specialises every argument and builds a cache key on each
call (tens of microseconds). The compiled kernel depends only on the function, its constexprs and
the argument properties Triton specialises on, so after the first launch we key the CompiledKernel
by those properties (conservatively: more than Triton distinguishes, never less) and launch it
directly. Used by the attention launcher (kernels/launch.py) and the V^T transpose.
"""

from __future__ import annotations

import functools

import torch
from triton import knobs
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
    return (a.base.dtype, a.base.data_ptr() % 16 == 0, tuple(a.block_shape),
            tuple(x % 16 == 0 for x in a.shape), tuple(x % 16 == 0 for x in a.strides), a.padding,
            getattr(a, "layout", None))


def run(head: tuple, fn, grid: tuple, args: tuple, constexprs: dict, options: dict, device: int):
    """Launch `fn` on `grid`; returns the CompiledKernel that ran. `head` names what else the
    compiled code depends on (the config, the constexprs); `constexprs` are the function's trailing
    constexpr parameters in order, `options` the launch options (num_warps, ...)."""
    key = (head, device, tuple(arg_class(a) for a in args))
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


def launch_compiled(compiled, grid: tuple, device: int, full: tuple) -> None:
    """Enqueue `compiled` on the current stream of `device` (launch hooks honoured, as Triton does)."""
    stream = _stream_getter()(device)
    hook = knobs.runtime.launch_enter_hook
    meta = compiled.launch_metadata(grid, stream, *full) if hook is not None else None
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, meta, hook,
                 knobs.runtime.launch_exit_hook, *full)


def compiled_for(head_first: object) -> list:
    """The CompiledKernels launched so far whose head starts with `head_first` (one per
    specialisation and device)."""
    return [ck for key, ck in _compiled.items() if key[0][0] == head_first]


def forget(head_first: object) -> None:
    """Drop the CompiledKernels whose head starts with `head_first`."""
    for key in [k for k in _compiled if k[0][0] == head_first]:
        del _compiled[key]
