"""A pass over Triton's PTX for configs with `qk_async` (f16 scores): QK^T's wait moved behind PV(j-1)'s issue.

Triton hands an f16 wgmma accumulator to `wgmma.wait_group` as 16-bit halves, split (`mov.b32 {h, l}, %r`) right
after the issue; ptxas then waits after every wgmma of the kernel. So the f16-score kernels issue QK^T's last
k-step synchronously (its own `wait_group 0`, then the split), and PV(j-1) goes to the tensor cores only once
QK^T(j) is done (docs/design.md). In the PTX of the two-P-tile step the split is followed by PV(j-1)'s issue and
a `wait_group 1` (QK^T's group done, PV's may run): this pass drops QK^T's `wait_group 0` and moves the split
after that `wait_group 1`, which is the float32-score kernels' order. It moves nothing that is read in between,
and changes a block only in that exact shape; a kernel it was asked to change and could not is an error.

The pass runs inside Triton's compile, on its "ptx" stage (`knobs.runtime.add_stages_inspection_hook`), for the
kernels whose name ends with QK_ASYNC_SUFFIX (the emitter names a `qk_async` kernel so, which also keys Triton's
cache apart from its synchronous twin). `install()` chains any hook already set.
"""

from __future__ import annotations

import re

#: the kernel-name suffix that asks for the pass (generator/gluon_sm90/emit.py names qk_async kernels with it)
QK_ASYNC_SUFFIX = "_qk_async"

_WAIT = re.compile(
    r"[ \t]*// begin inline asm\n[ \t]*// wait for regs:[^\n]*\n[ \t]*wgmma\.wait_group\.sync\.aligned "
    r"(\d+);\n[ \t]*// end inline asm\n"
)
_SPLIT = re.compile(r"[ \t]*mov\.b32[ \t]+\{(%rs\d+), (%rs\d+)\}, %r\d+;\n")
_MMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.(\w+)\.")
#: an f16 accumulator's split has one mov per 32-bit register: at least m64n16 (4 per thread)
_MIN_SPLITS = 4


class PtxPassError(RuntimeError):
    """The pass was asked for and found nothing it may change (a kernel shape it does not know)."""


def async_f16_qk(ptx: str) -> tuple[str, int]:
    """(PTX, blocks changed): each f16-accumulator wgmma group waited for at once (`wait_group 0`) and split,
    then followed, with no other wait and no read of the halves, by another issue and its `wait_group 1`,
    loses that wait and gets its split after the `wait_group 1`."""
    out, pos, changed = [], 0, 0
    for wait in _WAIT.finditer(ptx):
        if wait.start() < pos or wait.group(1) != "0":
            continue
        mmas = list(_MMA.finditer(ptx, pos, wait.start()))
        if not mmas or mmas[-1].group(1) != "f16" or "wgmma.commit_group" not in ptx[mmas[-1].end() : wait.start()]:
            continue
        splits, end = [], wait.end()
        while split := _SPLIT.match(ptx, end):
            splits.append(split)
            end = split.end()
        if len(splits) < _MIN_SPLITS:
            continue
        following = _WAIT.search(ptx, end)
        if following is None or following.group(1) != "1":
            continue
        between = ptx[end : following.start()]
        halves = [h for s in splits for h in s.groups()]
        if (
            "wgmma.wait_group" in between
            or "wgmma.mma_async" not in between
            or any(re.search(re.escape(h) + r"(?!\d)", between) for h in halves)
        ):
            continue
        out += [ptx[pos : wait.start()], between, following.group(0), "".join(s.group(0) for s in splits)]
        pos = following.end()
        changed += 1
    out.append(ptx[pos:])
    return "".join(out), changed


def _ptx_stage(make_ptx):
    def stage(src, metadata):
        ptx = make_ptx(src, metadata)
        name = metadata.get("name", "")
        if name.endswith(QK_ASYNC_SUFFIX):
            ptx, changed = async_f16_qk(ptx)
            if not changed:
                raise PtxPassError(
                    f"{name}: qk_async found no f16 QK^T wait followed by PV's issue to move "
                    "(a kernel shape generator/ptx_pass.py does not know)"
                )
        return ptx

    stage._zyfa_ptx_pass = True
    return stage


def install() -> None:
    """Hook the pass into Triton's ptx stage (idempotent; chains a hook already set). Triton builds without
    `knobs.runtime.add_stages_inspection_hook` compile qk_async kernels unchanged, and the emitter's name
    check (`ptx_pass_available`) refuses them first."""
    knobs = _runtime_knobs()
    if knobs is None:
        return
    prev = knobs.add_stages_inspection_hook
    if getattr(prev, "_zyfa_ptx_pass", False):
        return

    def hook(backend, stages, options, language, capability):
        if prev is not None:
            prev(backend, stages, options, language, capability)
        if "ptx" in stages and not getattr(stages["ptx"], "_zyfa_ptx_pass", False):
            stages["ptx"] = _ptx_stage(stages["ptx"])

    hook._zyfa_ptx_pass = True
    knobs.add_stages_inspection_hook = hook


def ptx_pass_available() -> bool:
    """Whether this Triton lets a pass see its PTX (`knobs.runtime.add_stages_inspection_hook`)."""
    knobs = _runtime_knobs()
    return knobs is not None and hasattr(knobs, "add_stages_inspection_hook")


def _runtime_knobs():
    try:
        from triton import knobs
    except ImportError:
        return None
    return getattr(knobs, "runtime", None)
