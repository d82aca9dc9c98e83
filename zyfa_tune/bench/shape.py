"""What the bench measures on: a tuner shape with its head dims, and the `--shape` / `--seqlens`
parsers that make them."""

from __future__ import annotations

from dataclasses import dataclass

from zyfa_tune.generator import head_dim_error
from zyfa_tune.tuning.worker import Shape

#: tokens per shape when no batch is given: batch = max(1, TOKENS // seqlen), as `zyfa-tune tune`
TOKENS = 16384
DEFAULT_HEADS = 32


@dataclass(frozen=True)
class BenchShape(Shape):
    """A tuner shape (batch, heads, kv_heads, seqlen, or packed sequences' lengths; validated there)
    with its head dims."""

    head_dim_qk: int
    head_dim_v: int

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("head_dim_qk", "head_dim_v"):
            if why := head_dim_error(name, getattr(self, name)):
                raise ValueError(why)

    @property
    def label(self) -> str:
        heads = f"H={self.heads}" + (f"/{self.kv_heads}" if self.kv_heads != self.heads else "")
        if self.lengths:
            return (
                f"{self.head_dim_qk}/{self.head_dim_v} varlen N={self.batch} T={self.tokens} max={self.seqlen} {heads}"
            )
        return f"{self.head_dim_qk}/{self.head_dim_v} B={self.batch} S={self.seqlen} {heads}"

    @property
    def flops(self) -> float:
        """Causal FLOPs of one call (packed sequences: each at its own length)."""
        from zyfa_tune.tuning.task import task_flops

        return task_flops(self.head_dim_qk, self.head_dim_v, self, True)


def packed_shape(lengths: str, head_dim: int, head_dim_v: int | None, heads: int, kv_heads: int | None) -> BenchShape:
    """Packed sequences of a `--lengths` mix (tuning.lengths.parse_lengths) at these head dims."""
    from zyfa_tune.tuning.lengths import parse_lengths

    mix = parse_lengths(lengths)
    return BenchShape.packed(
        mix.lengths, heads, kv_heads or heads, head_dim_qk=head_dim, head_dim_v=head_dim_v or head_dim
    )


def _ints(text: str, what: str, sep: str = ",") -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(sep) if x.strip())
    except ValueError:
        raise ValueError(f"{what}: expected integers separated by {sep!r}, got {text!r}") from None


def parse_shape(text: str) -> BenchShape:
    """'dqk,dv,batch,seqlen,heads[,kv_heads]': one explicit shape of `--shape`."""
    v = _ints(text, "--shape")
    if len(v) not in (5, 6):
        raise ValueError(f"--shape: expected dqk,dv,batch,seqlen,heads[,kv_heads], got {text!r}")
    return BenchShape(
        head_dim_qk=v[0], head_dim_v=v[1], batch=v[2], seqlen=v[3], heads=v[4], kv_heads=v[5] if len(v) == 6 else v[4]
    )


def shapes_from(
    head_dim: int, head_dim_v: int | None, seqlens: str, batch_heads: str | None = None, kv_heads: int | None = None
) -> tuple[BenchShape, ...]:
    """Shapes from `--seqlens 4096,8192` and `--batch-heads 4x32,2x32` (one BxH per seqlen, or one
    for all; default: B = 16384 tokens / S, H = 32)."""
    lens = _ints(seqlens, "--seqlens")
    if not lens:
        raise ValueError("--seqlens: give at least one sequence length")
    if batch_heads:
        pairs = [_ints(item, "--batch-heads", "x") for item in batch_heads.split(",") if item.strip()]
        if any(len(p) != 2 for p in pairs) or len(pairs) not in (1, len(lens)):
            raise ValueError(
                f"--batch-heads: expected BxH, one for all or one per seqlen ({len(lens)}), got {batch_heads!r}"
            )
        pairs = pairs * len(lens) if len(pairs) == 1 else pairs
    else:
        pairs = [(max(1, TOKENS // s), DEFAULT_HEADS) for s in lens]
    dv = head_dim_v or head_dim
    return tuple(
        BenchShape(head_dim_qk=head_dim, head_dim_v=dv, batch=b, seqlen=s, heads=h, kv_heads=kv_heads or h)
        for s, (b, h) in zip(lens, pairs)
    )
