"""The one interface every benched system implements, ours and the peers alike: a name and dtype for
its rows, whether it runs a shape, and `prepare`, which binds it to one input set (allocations,
graph builds and imports happen there, outside the timing) and returns the call that is timed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zyfa_tune.bench.inputs import Inputs
from zyfa_tune.bench.shape import BenchShape


@dataclass(frozen=True)
class Bound:
    """A system bound to one input set: `call()` runs it, `output()` is its last output in
    (batch, seqlen, heads, head_dim_v) layout (None: no attention output, no error to check);
    `config`/`source` say which of our kernels ran, `recipe` how its inputs were quantised."""

    call: Callable[[], None]
    output: Callable[[], torch.Tensor] | None
    config: str | None = None
    source: str | None = None
    entry: str | None = None  # the tuned entry's problem class where another shape's ran (nearest, other device)
    recipe: str | None = None  # Recipe.summary() of the quantisation inside the call
    bytes_moved: int | None = None  # a memory-traffic system (`bench.traffic`): the bytes a call must move


class Peer(Protocol):
    """A system the bench can time. A missing library is not checked up front: `prepare` raises its
    ImportError, which becomes that row's error (the others still run)."""

    @property
    def name(self) -> str:
        """The row's `system` (and, for registered peers, the `--peers` name)."""

    @property
    def kind(self) -> str:
        """ "ours" (dispatcher), "forced" (config given), "peer", or a memory-traffic row's "quantiser" /
        "copy" (`bench.traffic`)."""

    @property
    def dtype(self) -> str:
        """ "fp8" or "bf16": which tensors of `Inputs` it gets and which reference it is checked against."""

    @property
    def quant_modes(self) -> tuple[str, ...]:
        """The `--quant` modes (inputs.QUANT_MODES) it can run in; a plan naming it in another fails."""

    def supports(self, shape: BenchShape) -> bool:
        """False where it cannot run this shape at all (it is then left out, not reported as failed)."""

    def prepare(self, x: Inputs) -> Bound:
        """Bind to one input set; the returned `call` is what is timed."""


def boxed(fn: Callable[[], Any], pick: Callable[[Any], torch.Tensor] = lambda r: r):
    """(call, output): call() runs fn and keeps pick(result) for output()."""
    box: dict[str, torch.Tensor] = {}

    def call() -> None:
        box["o"] = pick(fn())

    return call, lambda: box["o"]
