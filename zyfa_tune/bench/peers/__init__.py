"""The systems `zyfa-tune bench` times beside ours, one module each, all registered here: a new peer
is a module with a class implementing `base.Peer` and one line in `PEERS`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from zyfa_tune.bench.peers.base import Peer
from zyfa_tune.bench.peers.cudnn import CudnnFP8
from zyfa_tune.bench.peers.fa3 import FA3
from zyfa_tune.bench.peers.ours import Ours, OursSpec
from zyfa_tune.bench.peers.sdpa import TorchSDPA
from zyfa_tune.bench.shape import BenchShape

#: `--peers` name -> peer, in the order rows and the default selection take
PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        FA3("fa3-fp8", "fp8"),
        CudnnFP8("cudnn-fp8"),
        FA3("fa3-bf16", "bf16"),
        TorchSDPA("sdpa-cudnn-bf16", "CUDNN_ATTENTION"),
        TorchSDPA("sdpa-flash-bf16", "FLASH_ATTENTION"),
    )
}


def parse_peers(text: str | None, dtypes: Sequence[str]) -> tuple[str, ...]:
    """Comma list of PEERS names, 'none', or None: every peer of the benched dtypes."""
    if text is None:
        return tuple(name for name, peer in PEERS.items() if peer.dtype in dtypes)
    if text.strip() == "none":
        return ()
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in names if p not in PEERS]
    if unknown:
        raise ValueError(f"--peers: unknown {unknown}; choose from {list(PEERS)} or 'none'")
    return names


def systems_for(shape: BenchShape, ours: Iterable[OursSpec], peers: Iterable[str]) -> list[Peer]:
    """Ours first, then the named peers that can run this shape."""
    systems: list[Peer] = [Ours(spec) for spec in ours]
    return systems + [PEERS[name] for name in peers if PEERS[name].supports(shape)]
