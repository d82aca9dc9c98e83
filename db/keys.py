"""Problem classes: the part of an attention call's shape a tuned config is chosen by.

Sequence length and batch*heads are bucketed to powers of two so that one tuning run covers every
shape of a class and the dispatcher's lookup is a dict hit; the bucket bounds are where tuning
stops paying (below 256 keys the launch dominates; above 1024 programs per head the GPU is full).

`api` says what was timed: "fp8" (`flash_attn_func` on FP8 codes: the kernel alone, inputs quantised
plainly) or "bf16" (`attention` on bf16 inputs: the quantiser with its recipe and the kernel, one
timing). The two rank kernels differently, so each has its own best entries; `dtype` stays the
kernel's ("fp8" for both).

`tokens_bucket` says whether the class is of packed sequences (`flash_attn_varlen_func`): 0 for a
rectangular (batch, seqlen) call; else the bucket of the packed batch's total tokens, with
`seqlen_bucket` its longest sequence's (max_seqlen_q) and `bh_bucket` sequences x heads: the padded
rectangle, and how much of it the tokens fill. All three are known on the host at call time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from zyfa_tune.generator import CHOICES, head_dim_error

from .checks import short_repr, strict_int

SEQLEN_BUCKET_MIN, SEQLEN_BUCKET_MAX = 256, 131072
BH_BUCKET_MIN, BH_BUCKET_MAX = 1, 1024
GQA_GROUP_MAX = 1024
#: packed total tokens: below 256 the launch dominates; 2**24 tokens is far beyond any prefill batch
TOKENS_BUCKET_MIN, TOKENS_BUCKET_MAX = 256, 1 << 24
#: the APIs a problem class is timed for (see the module doc)
APIS = ("fp8", "bf16")


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def seqlen_bucket(seqlen: int) -> int:
    """Next power of two >= seqlen, clamped to [256, 131072]."""
    seqlen = strict_int("seqlen", seqlen, lo=1)
    return min(max(_next_pow2(seqlen), SEQLEN_BUCKET_MIN), SEQLEN_BUCKET_MAX)


def bh_bucket(batch_heads: int) -> int:
    """Next power of two >= batch * heads, clamped to [1, 1024]."""
    batch_heads = strict_int("batch_heads", batch_heads, lo=1)
    return min(_next_pow2(batch_heads), BH_BUCKET_MAX)


def tokens_bucket(tokens: int) -> int:
    """Next power of two >= the packed total tokens, clamped to [256, 2**24]."""
    tokens = strict_int("tokens", tokens, lo=1)
    return min(max(_next_pow2(tokens), TOKENS_BUCKET_MIN), TOKENS_BUCKET_MAX)


def _check_bucket(name: str, value: Any, lo: int, hi: int) -> int:
    value = strict_int(name, value, lo=lo, hi=hi)
    if value & (value - 1):
        raise ValueError(f"{name}: {value} is not a power of two")
    return value


@dataclass(frozen=True)
class ProblemKey:
    """A problem class; every field is checked on construction (rows read back go through here)."""

    dtype: str
    head_dim_qk: int
    head_dim_v: int
    causal: bool
    gqa_group: int
    seqlen_bucket: int
    bh_bucket: int
    api: str = "fp8"
    tokens_bucket: int = 0  # 0: not packed; else the packed total tokens' bucket

    def __post_init__(self) -> None:
        if type(self.dtype) is not str or self.dtype not in CHOICES["dtype"]:
            raise ValueError(f"dtype: {short_repr(self.dtype)} is not one of {list(CHOICES['dtype'])}")
        for name in ("head_dim_qk", "head_dim_v"):
            value = self._set(name, strict_int(name, getattr(self, name)))
            if why := head_dim_error(name, value):
                raise ValueError(why)
        if type(self.causal) is not bool:
            raise ValueError(f"causal: expected bool, got {type(self.causal).__name__}")
        self._set("gqa_group", strict_int("gqa_group", self.gqa_group, lo=1, hi=GQA_GROUP_MAX))
        self._set(
            "seqlen_bucket", _check_bucket("seqlen_bucket", self.seqlen_bucket, SEQLEN_BUCKET_MIN, SEQLEN_BUCKET_MAX)
        )
        self._set("bh_bucket", _check_bucket("bh_bucket", self.bh_bucket, BH_BUCKET_MIN, BH_BUCKET_MAX))
        if type(self.api) is not str or self.api not in APIS:
            raise ValueError(f"api: {short_repr(self.api)} is not one of {list(APIS)}")
        if self.api == "bf16" and self.dtype != "fp8":
            raise ValueError(f"api: 'bf16' quantises to FP8 codes, so its kernels are fp8, not {self.dtype}")
        tokens = strict_int("tokens_bucket", self.tokens_bucket, lo=0, hi=TOKENS_BUCKET_MAX)
        if tokens:
            self._set("tokens_bucket", _check_bucket("tokens_bucket", tokens, TOKENS_BUCKET_MIN, TOKENS_BUCKET_MAX))
            if self.api != "fp8":
                raise ValueError(f"tokens_bucket: packed sequences are timed for api 'fp8' only, not {self.api!r}")
        else:
            self._set("tokens_bucket", 0)

    @property
    def packed(self) -> bool:
        """Whether this is a class of packed sequences (flash_attn_varlen_func)."""
        return self.tokens_bucket != 0

    def _set(self, name: str, value: int) -> int:
        """Store the validated plain int (a numpy integer would not bind to a database driver)."""
        object.__setattr__(self, name, value)
        return value

    @classmethod
    def from_shape(
        cls,
        *,
        dtype: str,
        head_dim_qk: int,
        head_dim_v: int,
        causal: bool,
        batch: int,
        heads: int,
        kv_heads: int,
        seqlen: int,
        api: str = "fp8",
        tokens: int | None = None,
    ) -> "ProblemKey":
        """The class of one call's shape; ValueError naming the field if the shape is invalid. Packed
        sequences: `batch` sequences, the longest `seqlen` tokens, `tokens` in all."""
        batch = strict_int("batch", batch, lo=1)
        heads = strict_int("heads", heads, lo=1)
        kv_heads = strict_int("kv_heads", kv_heads, lo=1)
        if heads % kv_heads:
            raise ValueError(f"kv_heads: {kv_heads} does not divide heads={heads}")
        return cls(
            dtype=dtype,
            head_dim_qk=head_dim_qk,
            head_dim_v=head_dim_v,
            causal=causal,
            gqa_group=heads // kv_heads,
            seqlen_bucket=seqlen_bucket(seqlen),
            bh_bucket=bh_bucket(batch * heads),
            api=api,
            tokens_bucket=0 if tokens is None else tokens_bucket(tokens),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        mask = "causal" if self.causal else "full"
        return (
            f"{self.dtype} {self.head_dim_qk}/{self.head_dim_v} {mask} gqa={self.gqa_group} "
            f"seqlen<={self.seqlen_bucket} B*H<={self.bh_bucket}"
            + (f" varlen tokens<={self.tokens_bucket}" if self.tokens_bucket else "")
            + ("" if self.api == "fp8" else f" api={self.api}")
        )
