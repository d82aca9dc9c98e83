"""Damaged or foreign files are refused with DatabaseCorruptError naming the file, and left
byte-for-byte as they were; empty and missing files are created fresh."""

from __future__ import annotations

import os
import sqlite3

import pytest
from test_db_support import record, sha256

from zyfa_tune.db import DatabaseCorruptError, DatabaseError, open_store

PAGE = 4096


@pytest.fixture
def good(tmp_path):
    """A valid, closed tuning database with a few pages of data."""
    path = tmp_path / "good.db"
    with open_store(path) as s:
        for i in range(40):
            record(s, 1.0 + i, message="m" * 300)
    assert path.stat().st_size % PAGE == 0 and path.stat().st_size >= 10 * PAGE
    return path


def refused(path, *, match: str | None = None) -> DatabaseCorruptError:
    before = sha256(path)
    for readonly in (False, True):
        with pytest.raises(DatabaseCorruptError, match=match) as err:
            open_store(path, readonly=readonly)
        assert str(path) in str(err.value)
        assert sha256(path) == before
    return err.value


def write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_random_bytes(tmp_path):
    refused(write(tmp_path / "random.db", os.urandom(3 * PAGE)), match="bad header")


def test_text_file(tmp_path):
    refused(write(tmp_path / "notes.db", b"this is not a database\n" * 100), match="bad header")


def test_short_file(tmp_path):
    refused(write(tmp_path / "short.db", b"SQLite format 3\x00" + b"\x10\x00"))


def test_damaged_header(good):
    data = bytearray(good.read_bytes())
    data[0:6] = b"SQLigt"
    refused(write(good, bytes(data)), match="bad header")


@pytest.mark.parametrize("cut", ["half", "mid-page"])
def test_truncated(good, cut):
    data = good.read_bytes()
    keep = len(data) // PAGE // 2 * PAGE if cut == "half" else 5000  # whole pages / mid-page
    refused(write(good, data[:keep]), match="truncated")


@pytest.mark.parametrize("page", [1, 3, 6, 10])
def test_damaged_page_fails_quick_check(good, page):
    data = bytearray(good.read_bytes())
    data[page * PAGE : (page + 1) * PAGE] = bytes(range(256)) * (PAGE // 256)
    err = refused(write(good, bytes(data)))
    assert "quick_check" in str(err) or "malformed" in str(err)


def test_someone_elses_sqlite_database(tmp_path):
    path = tmp_path / "other.db"
    con = sqlite3.connect(path)
    with con:
        con.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
        con.execute("INSERT INTO customers (name) VALUES ('a')")
    con.close()
    refused(path, match="not a zyfa-tune")


@pytest.mark.parametrize("value", [None, "two", "-1"])
def test_meta_table_without_a_valid_version(good, value):
    con = sqlite3.connect(good)
    with con:
        if value is None:
            con.execute("DELETE FROM zyfa_meta")
        else:
            con.execute("UPDATE zyfa_meta SET value = ?", (value,))
        con.execute("PRAGMA journal_mode = DELETE")
    con.close()
    refused(good, match="schema_version")


def test_empty_file_and_empty_sqlite_database_are_created_fresh(tmp_path):
    empty = write(tmp_path / "empty.db", b"")
    with open_store(empty) as s:
        record(s, 1.0)
    blank = tmp_path / "blank.db"
    sqlite3.connect(blank).execute("PRAGMA user_version = 7").connection.close()  # SQLite, no tables
    with open_store(blank) as s:
        assert s.count_trials() == 0
        record(s, 1.0)
    with open_store(empty, readonly=True) as s:
        assert s.count_trials() == 1


def test_empty_file_is_not_created_when_asked_not_to(tmp_path):
    empty = write(tmp_path / "empty.db", b"")
    for kw in ({"create": False}, {"readonly": True}):
        with pytest.raises(DatabaseError, match="empty.db"):
            open_store(empty, **kw)
    assert empty.read_bytes() == b""


def test_import_from_a_damaged_file_is_refused(tmp_path):
    bad = write(tmp_path / "bad.db", os.urandom(2 * PAGE))
    before = sha256(bad)
    with open_store(tmp_path / "mine.db") as s:
        with pytest.raises(DatabaseCorruptError, match="bad.db"):
            s.import_from(bad)
        assert s.count_trials() == 0
    assert sha256(bad) == before
