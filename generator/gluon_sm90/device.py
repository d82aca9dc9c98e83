"""Device code of the Gluon backend, in one module per concern (`MODULES`, beside this one). Each
module's text below its marker line is copied verbatim into every emitted Gluon kernel, in the
order of `MODULES`, after which generator/gluon_sm90/emit.py appends the config's constants and the
entry kernel. They are real modules so that they are linted and read like code (the names each
takes from the others are imported above its marker); they are never launched from there. The
schedule and why each piece is shaped as it is: docs/design.md.

Roles (warp specialisation): the entry kernel's default partition is consumer warpgroup 0; the
worker partitions are consumer warpgroups 1 and 2 (two or three consumers) and the TMA producer (one
warp; a warpgroup when it also transposes V, V_NATURAL). A consumer warpgroup owns 64 query rows of
the CTA's tile and issues m64 x BLOCK_N x 32 FP8 wgmmas (QGMMA); a 192-key block (SPLIT) is a
128-key and a 64-key part, each its own wgmmas (a 256-key pv_defer block: two 128-key parts).

Module constants (written by the emitter for each config) choose among the variants; every branch
on them is resolved at compile time, so a kernel contains only its own schedule.
"""

from __future__ import annotations

import functools
from pathlib import Path

#: The line each module's emitted text follows.
MARKER = "# ---- emitted below this line ----"

#: The modules in the order their texts are emitted (common first: it holds the kernel's imports).
MODULES = ("common", "schedule", "producer", "softmax", "p_carry", "turns", "mma", "steps", "smem", "consumer")


def module_body(name: str) -> str:
    """The emitted text of device module `name`: what follows its marker line, without the blank
    lines around it."""
    if name not in MODULES:
        raise ValueError(f"module_body: name {name!r} is not one of {MODULES}")
    text = (Path(__file__).parent / f"{name}.py").read_text()
    _, marker, body = text.partition(MARKER)
    if not marker:
        raise RuntimeError(f"{name}.py lacks the line {MARKER!r}")
    return body.strip("\n") + "\n"


@functools.lru_cache(maxsize=1)
def source() -> str:
    """The device code of every emitted Gluon kernel: the modules' bodies in order, two blank lines
    between them (as between top-level definitions)."""
    return "\n\n".join(module_body(name) for name in MODULES)
