"""Exceptions of the tuning database. Both name the file or (password-masked) URL involved, so a
user with several databases (user cache, shipped, imported) knows which one is at fault."""

from __future__ import annotations


class DatabaseError(RuntimeError):
    """The database cannot be opened or used as asked (wrong version, missing, locked too long...)."""


class DatabaseCorruptError(DatabaseError):
    """The file is damaged or is not a zyfa-tune database; it was left exactly as it was."""
