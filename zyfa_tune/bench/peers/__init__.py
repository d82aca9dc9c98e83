"""The systems `zyfa-tune bench` times beside the dispatcher's kernels, one module each, all registered
here: a new system is a module with a class implementing `base.Peer` and one line in `PEERS`. Those of
kind "ours" (`zyfa_tune.attention`) are ours, added to a run by default where its mode runs them; the
rest are the peers. `--quant-floor` adds the memory-traffic systems of `quantiser`. Systems with
`packed` set (`varlen`) run packed-sequence shapes (`bench --lengths`), the others rectangular ones."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from zyfa_tune.bench.inputs import quant_kwargs
from zyfa_tune.bench.peers.attention import Attention
from zyfa_tune.bench.peers.base import Peer
from zyfa_tune.bench.peers.cudnn import CudnnFP8
from zyfa_tune.bench.peers.fa3 import FA3
from zyfa_tune.bench.peers.ours import Ours, OursSpec
from zyfa_tune.bench.peers.paged import paged_systems
from zyfa_tune.bench.peers.quantiser import floor_systems, packed_floor_systems
from zyfa_tune.bench.peers.sdpa import TorchSDPA
from zyfa_tune.bench.peers.varlen import FA3Varlen, VarlenOurs
from zyfa_tune.bench.shape import BenchShape

#: `--peers` name -> system, in the order rows and the default selection take
PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        Attention("ours-attention"),
        FA3("fa3-fp8", "fp8"),
        CudnnFP8("cudnn-fp8"),
        FA3("fa3-bf16", "bf16"),
        TorchSDPA("sdpa-cudnn-bf16", "CUDNN_ATTENTION"),
        TorchSDPA("sdpa-flash-bf16", "FLASH_ATTENTION"),
        FA3Varlen("fa3-varlen-fp8", "fp8"),
        FA3Varlen("fa3-varlen-bf16", "bf16"),
    )
}


def parse_peers(
    text: str | None, dtypes: Sequence[str], quant: str = "per-tensor", packed: bool = False
) -> tuple[str, ...]:
    """Comma list of PEERS names, 'none', or None: every peer (kind "peer") of the benched dtypes that
    runs in `quant` mode, on packed sequences where `packed` (`bench --lengths`) or else rectangular
    shapes."""
    if text is None:
        return tuple(
            name
            for name, peer in PEERS.items()
            if peer.kind == "peer"
            and peer.dtype in dtypes
            and quant in peer.quant_modes
            and getattr(peer, "packed", False) == packed
        )
    if text.strip() == "none":
        return ()
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in names if p not in PEERS]
    if unknown:
        raise ValueError(f"--peers: unknown {unknown}; choose from {list(PEERS)} or 'none'")
    return names


def our_systems(dtypes: Sequence[str], quant: str) -> tuple[str, ...]:
    """The registered systems of ours (kind "ours") of the benched dtypes that run in `quant` mode:
    part of a run by default, as the dispatcher's own pick is."""
    return tuple(
        name
        for name, peer in PEERS.items()
        if peer.kind == "ours" and peer.dtype in dtypes and quant in peer.quant_modes
    )


def systems_for(
    shape: BenchShape, ours: Iterable[OursSpec], peers: Iterable[str], quant_floor: bool = False, paged: int = 0
) -> list[Peer]:
    """Ours first (on packed sequences through flash_attn_varlen_func), then the named peers that can
    run this shape (packed systems only packed shapes and the others only rectangular ones); with
    `quant_floor`, the quantisers
    of the floor recipes, of the `--ours` quantisation options and of `attention()` where it is
    benched, and the copy (`peers.quantiser.floor_systems`); on packed sequences the packed
    quantiser and the copy (`peers.quantiser.packed_floor_systems`). `paged` (a page size, packed
    sequences only): each of ours also on a paged cache and its contiguous twin, and each FA3 varlen peer's
    KV-cache entry point on the same pages (`peers.paged`)."""
    ours, peers = list(ours), list(peers)
    packed = bool(shape.lengths)
    systems: list[Peer] = [VarlenOurs(spec) if packed else Ours(spec) for spec in ours]
    if packed and paged:
        systems += [s for s in paged_systems(ours, paged, [PEERS[n] for n in peers]) if s.supports(shape)]
    systems += [
        PEERS[name] for name in peers if PEERS[name].supports(shape) and getattr(PEERS[name], "packed", False) == packed
    ]
    if quant_floor and packed:
        systems += packed_floor_systems()
    elif quant_floor:
        extra = [quant_kwargs(spec.quant) for spec in ours if spec.dtype == "fp8" and spec.quant]
        systems += floor_systems(extra, attention=any(isinstance(PEERS[name], Attention) for name in peers))
    return systems
