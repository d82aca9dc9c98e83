"""SQLAlchemy tables of the tuning database (schema version 5).

environments, problems and variants are deduplicated by unique constraints, so concurrent writers
converge on one row each; trials are append-only; best holds one row per (environment, problem):
the fastest "ok" trial. Older versions lack columns (see migrations.py): version 1 trials'
energy_j and tflop_per_j, version 2 environments' runner, version 3 problems' api and trials' recipe
and error_ref (an absent api is "fp8", an absent recipe the plain one), version 4 problems'
tokens_bucket (absent: 0, a rectangular problem, not packed sequences). Text columns are data only: nothing
here is ever evaluated.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from .records import TRIAL_STATUSES

SCHEMA_VERSION = 5
META_TABLE = "zyfa_meta"
#: float columns are IEEE doubles on every backend, so timings round-trip exactly.
_Double = Float(precision=53)
_STATUS_CHECK = "status IN (" + ", ".join(f"'{s}'" for s in TRIAL_STATUSES) + ")"


class Base(DeclarativeBase):
    pass


class MetaModel(Base):
    """Key/value facts about the database itself; `schema_version` is the one that matters."""

    __tablename__ = META_TABLE
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))


class EnvironmentModel(Base):
    __tablename__ = "environments"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(16), unique=True)
    gpu_name: Mapped[str] = mapped_column(String(128), index=True)
    compute_capability: Mapped[str] = mapped_column(String(8))
    sm_count: Mapped[int] = mapped_column(Integer)
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    driver: Mapped[str] = mapped_column(String(64))
    cuda: Mapped[str] = mapped_column(String(64))
    torch: Mapped[str] = mapped_column(String(64))
    triton: Mapped[str] = mapped_column(String(64))
    generator_version: Mapped[str] = mapped_column(String(64))
    runner: Mapped[str] = mapped_column(String(32), server_default="gpu")  # new in version 3


class ProblemModel(Base):
    __tablename__ = "problems"
    __table_args__ = (
        UniqueConstraint(
            "dtype",
            "head_dim_qk",
            "head_dim_v",
            "causal",
            "gqa_group",
            "seqlen_bucket",
            "bh_bucket",
            "api",
            "tokens_bucket",
            name="uq_problems_key",
        ),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    dtype: Mapped[str] = mapped_column(String(8))
    head_dim_qk: Mapped[int] = mapped_column(Integer)
    head_dim_v: Mapped[int] = mapped_column(Integer)
    causal: Mapped[bool] = mapped_column(Boolean)
    gqa_group: Mapped[int] = mapped_column(Integer)
    seqlen_bucket: Mapped[int] = mapped_column(Integer)
    bh_bucket: Mapped[int] = mapped_column(Integer)
    api: Mapped[str] = mapped_column(String(8), server_default="fp8")  # new in version 4
    tokens_bucket: Mapped[int] = mapped_column(Integer, server_default="0")  # new in version 5


class VariantModel(Base):
    """A generated kernel: the same source (hash) is one variant, whichever config produced it."""

    __tablename__ = "variants"
    __table_args__ = (UniqueConstraint("backend", "source_hash", name="uq_variants_source"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    backend: Mapped[str] = mapped_column(String(32))
    config_json: Mapped[str] = mapped_column(Text)
    source_hash: Mapped[str] = mapped_column(String(64))
    generator_version: Mapped[str] = mapped_column(String(64))


class TrialModel(Base):
    __tablename__ = "trials"
    __table_args__ = (
        CheckConstraint(_STATUS_CHECK, name="ck_trials_status"),
        Index("ix_trials_env_problem_variant", "environment_id", "problem_id", "variant_id"),
        Index("ix_trials_problem_status", "problem_id", "status"),
        Index("ix_trials_status", "status"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    environment_id: Mapped[int] = mapped_column(ForeignKey("environments.id"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("problems.id"))
    variant_id: Mapped[int] = mapped_column(ForeignKey("variants.id"))
    status: Mapped[str] = mapped_column(String(16))
    median_ms: Mapped[float | None] = mapped_column(_Double)
    p20_ms: Mapped[float | None] = mapped_column(_Double)
    p80_ms: Mapped[float | None] = mapped_column(_Double)
    tflops: Mapped[float | None] = mapped_column(_Double)
    error_rel_l2: Mapped[float | None] = mapped_column(_Double)
    error_max: Mapped[float | None] = mapped_column(_Double)
    sm_clock_mhz: Mapped[float | None] = mapped_column(_Double)
    power_w: Mapped[float | None] = mapped_column(_Double)
    energy_j: Mapped[float | None] = mapped_column(_Double)  # new in version 2
    tflop_per_j: Mapped[float | None] = mapped_column(_Double)  # new in version 2
    recipe: Mapped[str | None] = mapped_column(Text)  # new in version 4 (NULL: plain)
    error_ref: Mapped[float | None] = mapped_column(_Double)  # new in version 4
    message: Mapped[str] = mapped_column(Text, default="")
    batch: Mapped[int | None] = mapped_column(Integer)
    heads: Mapped[int | None] = mapped_column(Integer)
    seqlen: Mapped[int | None] = mapped_column(Integer)
    study: Mapped[str | None] = mapped_column(String(256))
    provenance: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime)  # naive UTC


class BestModel(Base):
    __tablename__ = "best"
    environment_id: Mapped[int] = mapped_column(ForeignKey("environments.id"), primary_key=True)
    problem_id: Mapped[int] = mapped_column(ForeignKey("problems.id"), primary_key=True, index=True)
    variant_id: Mapped[int] = mapped_column(ForeignKey("variants.id"))
    trial_id: Mapped[int] = mapped_column(ForeignKey("trials.id"))
    median_ms: Mapped[float] = mapped_column(_Double)
    tflops: Mapped[float | None] = mapped_column(_Double)
    error_rel_l2: Mapped[float | None] = mapped_column(_Double)
    provenance: Mapped[str] = mapped_column(Text, default="")
    updated_at: Mapped[datetime] = mapped_column(DateTime)  # naive UTC
