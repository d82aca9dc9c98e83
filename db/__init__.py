"""Tuning database: trials and the best config per (GPU fingerprint, problem class).

SQLite file by default (`default_db_path()`), any SQLAlchemy URL otherwise. Everything read from a
database is data: configs come back as text for the caller to validate with
`KernelConfig.from_json`, and `Store.import_from` validates every row before writing it.
"""

from .errors import DatabaseCorruptError, DatabaseError
from .fingerprint import Fingerprint, current_fingerprint
from .keys import ProblemKey, bh_bucket, seqlen_bucket
from .models import SCHEMA_VERSION
from .records import TRIAL_STATUSES, BestEntry, ImportReport, TrialResult
from .session import default_db_path
from .store import Store, open_store

__all__ = ["Store", "open_store", "default_db_path", "DatabaseError", "DatabaseCorruptError",
           "Fingerprint", "current_fingerprint", "ProblemKey", "seqlen_bucket", "bh_bucket",
           "TrialResult", "BestEntry", "ImportReport", "SCHEMA_VERSION", "TRIAL_STATUSES"]
