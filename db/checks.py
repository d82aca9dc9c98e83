"""Field validators shared by the frozen records (keys, fingerprints, trial results).

Values may come from an untrusted database file, whose columns SQLite does not type-check, so every
check looks at the exact Python type (bool is rejected where an int is meant) and says which field
failed: the message becomes the `ImportReport` reason or the `ValueError` a caller sees.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

#: Terminal escape sequences (CSI, OSC, two-character ESC codes; 7-bit and C1 forms): removed whole,
#: so that neither the sequence nor its parameters reach a terminal.
_ESCAPES = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
    r"|(?:\x1b\]|\x9d)[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    r"|\x1b[@-Z\\-_]"
)


def strict_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    """An integer (never bool, float or text) within [lo, hi], returned as a plain int
    (numpy integers are accepted and converted)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name}: expected int, got {type(value).__name__} {short_repr(value)}")
    value = int(value)
    if lo is not None and value < lo:
        raise ValueError(f"{name}: {value} must be >= {lo}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: {value} must be <= {hi}")
    return value


def finite_float(name: str, value: Any, *, positive: bool = False) -> float:
    """A finite number >= 0 (> 0 when `positive`) as a plain float; ints and numpy scalars are
    accepted and converted, bools and text are not."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(f"{name}: expected a number, got {type(value).__name__} {short_repr(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}: {value} is not finite")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name}: {value} must be {'> 0' if positive else '>= 0'}")
    return value


def optional_float(name: str, value: Any, *, positive: bool = False) -> float | None:
    return None if value is None else finite_float(name, value, positive=positive)


def optional_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int | None:
    return None if value is None else strict_int(name, value, lo=lo, hi=hi)


def clean_text(value: str) -> str:
    """`value` without terminal escape sequences, every other non-printable character (C0 and C1
    controls, newlines included, and Unicode separators) replaced by a space: stored free text is
    printed by `show`, `best` and `import`, and must not move the cursor, recolour or clear a terminal."""
    value = _ESCAPES.sub("", value)
    if value.isprintable():
        return value
    return "".join(c if c.isprintable() else " " for c in value)


def text(
    name: str,
    value: Any,
    *,
    max_len: int = 256,
    allow_empty: bool = True,
    pattern: str | None = None,
    clean: bool = False,
) -> str:
    """A printable one-line string, at most `max_len` characters. Control characters are an error,
    or, with `clean` (free text: messages, provenance), removed by `clean_text`."""
    if type(value) is not str:
        raise ValueError(f"{name}: expected str, got {type(value).__name__} {short_repr(value)}")
    if clean:
        value = clean_text(value)
    if len(value) > max_len:
        raise ValueError(f"{name}: {len(value)} characters, more than {max_len}")
    if not value and not allow_empty:
        raise ValueError(f"{name}: must not be empty")
    if not value.isprintable():
        raise ValueError(f"{name}: contains control characters: {short_repr(value)}")
    if pattern is not None and value and not re.fullmatch(pattern, value):
        raise ValueError(f"{name}: {short_repr(value)} does not match {pattern}")
    return value


def optional_text(name: str, value: Any, *, max_len: int = 256) -> str | None:
    return None if value is None else text(name, value, max_len=max_len)


def short_repr(value: Any, limit: int = 60) -> str:
    """repr() of a value, cut to `limit` characters (it may be attacker-chosen and huge)."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."
