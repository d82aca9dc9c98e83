"""Sequence-length mixes of packed (varlen) batches: what `zyfa-tune tune --lengths` tunes and
`zyfa-tune bench --lengths` benches.

A serving prefill batch packs prompts of many lengths; its kernel choice depends on the mix (how
many tokens, how long the longest sequence), not on one rectangular shape. `--lengths` takes a comma
list (`128,512,8192`), a file of lengths (one per line, `#` comments allowed, or a `.json` list), or
a named mix. Named mixes are fixed-seed draws, so a study or a bench run is reproducible anywhere:

  chat      64 sequences, log-uniform in [128, 8192]: a chat server's prefill batch (~128K tokens);
  long-doc  8 sequences, log-uniform in [8192, 32768]: long-document prefill.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

#: the most tokens a mix may pack (the database's largest total-tokens bucket)
MAX_TOTAL_TOKENS = 1 << 24
#: the most sequences a mix may hold
MAX_SEQUENCES = 65536
#: the draws' seed: one whose chat mix packs within 1% of 128K (131072) tokens
_SEED = 24288


@dataclass(frozen=True)
class LengthMix:
    """A named tuple of sequence lengths (each >= 1), packed in this order."""

    name: str
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        check_lengths(self.lengths, "lengths")
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def count(self) -> int:
        return len(self.lengths)

    def __str__(self) -> str:
        return f"{self.name}: {self.count} sequences, {self.total} tokens, {min(self.lengths)}..{self.max_len}"


def check_lengths(lengths: object, what: str) -> None:
    """ValueError naming `what` unless `lengths` is a non-empty sequence of positive ints within the
    limits (a bool or a float is not a length)."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, (list, tuple)) or not lengths:
        raise ValueError(f"{what}: expected a non-empty list of sequence lengths, got {lengths!r:.80}")
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"{what}: entry {i} ({n!r:.40}) is not an integer")
        if n <= 0:
            raise ValueError(f"{what}: entry {i} is {n}; sequence lengths must be >= 1")
    if len(lengths) > MAX_SEQUENCES:
        raise ValueError(f"{what}: {len(lengths)} sequences; at most {MAX_SEQUENCES}")
    if sum(lengths) > MAX_TOTAL_TOKENS:
        raise ValueError(f"{what}: {sum(lengths)} tokens in all; at most {MAX_TOTAL_TOKENS}")


def log_uniform(count: int, lo: int, hi: int, seed: int = _SEED) -> tuple[int, ...]:
    """`count` (>= 2) lengths spanning [lo, hi]: lo and hi themselves (the buckets a mix is stored
    under are those of its longest sequence) and count - 2 log-uniform draws between, in a shuffled
    order, all from Python's seeded Mersenne Twister (the same numbers on every platform)."""
    rng = random.Random(seed)
    drawn = [round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(count - 2)]
    out = [lo, hi, *(min(hi, max(lo, n)) for n in drawn)]
    rng.shuffle(out)
    return tuple(out)


#: the named mixes `--lengths` takes
MIXES: dict[str, LengthMix] = {
    "chat": LengthMix("chat", log_uniform(64, 128, 8192)),
    "long-doc": LengthMix("long-doc", log_uniform(8, 8192, 32768, seed=_SEED + 1)),
}


def parse_lengths(spec: str, what: str = "--lengths") -> LengthMix:
    """A named mix, a file of lengths, or a comma list (see the module doc); ValueError naming `what`."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{what}: expected a mix name ({', '.join(MIXES)}), a file or a comma list of lengths")
    spec = spec.strip()
    if spec in MIXES:
        return MIXES[spec]
    if ("," in spec or re.fullmatch(r"[\d\s.+-]+", spec)) and not os.path.isfile(spec):
        return _named(_ints(spec.split(","), what, "the list"), "lengths", what)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"{what}: {spec!r} is not a named mix ({', '.join(MIXES)}), an existing file, "
            f"or a comma list of positive integers"
        )
    return _named(_read_file(path, what), path.stem, what)


def _named(lengths: list[int], stem: str, what: str) -> LengthMix:
    """A mix named by its source and its content (the same lengths give the same study name)."""
    check_lengths(lengths, what)
    digest = hashlib.sha256(",".join(map(str, lengths)).encode()).hexdigest()[:8]
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", stem)[:32] or "lengths"
    return LengthMix(f"{stem}-{digest}", tuple(lengths))


def _read_file(path: Path, what: str) -> list[int]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc}") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what}: {path} is not valid JSON: {exc}") from None
        if not isinstance(data, list):
            raise ValueError(f"{what}: {path} must hold a JSON list of lengths, got {type(data).__name__}")
        check_lengths(data, f"{what} ({path})")
        return data
    lines = [line.split("#", 1)[0] for line in text.splitlines()]
    return _ints([line for line in lines if line.strip()], what, str(path))


def _ints(items: list[str], what: str, where: str) -> list[int]:
    out = []
    for i, item in enumerate(items):
        item = item.strip()
        if not re.fullmatch(r"[+-]?\d+", item):
            raise ValueError(f"{what}: entry {i} of {where} ({item!r:.40}) is not an integer")
        out.append(int(item))
    return out
