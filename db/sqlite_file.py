"""File-level checks and backups of SQLite databases, done without changing a byte of the file.

Opening a file through the engine would switch it to WAL mode (a header write), so whatever might
be refused (not SQLite, damaged, someone else's tables, a newer schema) is decided here first,
through a read-only connection.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from .errors import DatabaseCorruptError, DatabaseError
from .models import META_TABLE

SQLITE_MAGIC = b"SQLite format 3\x00"
_CORRUPT_CODES = {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB (primary result codes)
_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class FileState:
    """What is in a file: nothing yet (missing, 0 bytes or no tables) or our schema at `version`."""

    exists: bool
    version: int | None  # None: no zyfa-tune schema yet (the file may be created/filled)


def inspect_file(path: Path) -> FileState:
    """Classify `path`; DatabaseCorruptError (file untouched) if it is damaged or not ours."""
    if not path.exists():
        return FileState(exists=False, version=None)
    if not path.is_file():
        raise DatabaseError(f"{path}: not a regular file")
    size = path.stat().st_size
    if size == 0:
        return FileState(exists=True, version=None)
    _check_header(path, size)
    try:
        con = connect_readonly(path)
    except sqlite3.Error as exc:
        raise _classify(path, exc) from None
    try:
        rows = con.execute("PRAGMA quick_check").fetchall()
        if rows != [("ok",)]:
            problems = " ".join(" ".join(str(r[0]).split()) for r in rows[:3])
            raise DatabaseCorruptError(f"{path}: damaged SQLite file (quick_check: {problems})")
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return FileState(exists=True, version=None)
        if META_TABLE not in tables:
            listed = ", ".join(sorted(tables)[:5])
            raise DatabaseCorruptError(
                f"{path}: an SQLite database, but not a zyfa-tune one (no {META_TABLE} table; has {listed})"
            )
        found = con.execute(f"SELECT value FROM {META_TABLE} WHERE key = 'schema_version'").fetchall()
        return FileState(exists=True, version=parse_version(found, str(path)))
    except sqlite3.Error as exc:
        raise _classify(path, exc) from None
    finally:
        con.close()


def parse_version(rows: list, where: str) -> int:
    """The schema version from the meta table's rows (shared with the engine-side check)."""
    value = rows[0][0] if len(rows) == 1 else None
    if type(value) is str and value.isdigit() and 1 <= int(value) <= 10_000:
        return int(value)
    raise DatabaseCorruptError(f"{where}: the {META_TABLE} table has no valid schema_version")


def _check_header(path: Path, size: int) -> None:
    with open(path, "rb") as f:
        header = f.read(100)
    if len(header) < 100 or not header.startswith(SQLITE_MAGIC):
        raise DatabaseCorruptError(f"{path}: not an SQLite database (bad header)")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if page_size < 512 or page_size & (page_size - 1):
        raise DatabaseCorruptError(f"{path}: damaged SQLite header (page size {page_size})")
    if size % page_size:
        raise DatabaseCorruptError(
            f"{path}: truncated SQLite file ({size} bytes is not a whole number of {page_size}-byte pages)"
        )
    pages = int.from_bytes(header[28:32], "big")
    header_valid = header[24:28] == header[92:96]  # the in-header size is trusted only then
    if header_valid and pages and size < pages * page_size:
        raise DatabaseCorruptError(
            f"{path}: truncated SQLite file ({size} bytes, header says {pages} pages of {page_size})"
        )


def connect_readonly(path: Path) -> sqlite3.Connection:
    """A connection that cannot write to the file (SQLite URI mode=ro)."""
    return sqlite3.connect(f"file:{quote(str(path), safe='/')}?mode=ro", uri=True, timeout=_TIMEOUT_S)


def _classify(path: Path, exc: sqlite3.Error) -> DatabaseError:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None and (code & 0xFF) in _CORRUPT_CODES:
        return DatabaseCorruptError(f"{path}: damaged or not an SQLite database ({exc})")
    return DatabaseError(f"{path}: {exc}")


def backup(path: Path, version: int) -> Path:
    """A consistent copy `<file>.v<version>.bak` (never overwriting: .bak.1, .bak.2, ... if taken),
    made with SQLite's online backup API so that a WAL file's content is included."""
    dest = path.with_name(f"{path.name}.v{version}.bak")
    n = 0
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.v{version}.bak.{n}")
    src = connect_readonly(path)
    try:
        out = sqlite3.connect(str(dest))
        try:
            src.backup(out)
        finally:
            out.close()
    except sqlite3.Error as exc:
        dest.unlink(missing_ok=True)
        raise DatabaseError(f"{path}: could not write the backup {dest} before migrating: {exc}") from exc
    finally:
        src.close()
    return dest
