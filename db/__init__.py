"""Tuning database: trials and the best config per (GPU fingerprint, problem class).

SQLite file by default (`default_db_path()`), any SQLAlchemy URL otherwise. Everything read from a
database is data, checked by one set of rules (validity.py) wherever rows enter (`record_trial`,
`Store.import_from`) or are read (`best_entries`, which the dispatcher, `show` and `best` use).
"""

from .errors import DatabaseCorruptError, DatabaseError
from .fingerprint import Fingerprint, current_fingerprint
from .keys import APIS, ProblemKey, bh_bucket, seqlen_bucket, tokens_bucket
from .models import SCHEMA_VERSION
from .records import TRIAL_STATUSES, BestEntry, ImportReport, TrialResult
from .session import default_db_path
from .store import Store, open_store

__all__ = [
    "Store",
    "open_store",
    "default_db_path",
    "DatabaseError",
    "DatabaseCorruptError",
    "Fingerprint",
    "current_fingerprint",
    "ProblemKey",
    "APIS",
    "seqlen_bucket",
    "bh_bucket",
    "tokens_bucket",
    "TrialResult",
    "BestEntry",
    "ImportReport",
    "SCHEMA_VERSION",
    "TRIAL_STATUSES",
]
