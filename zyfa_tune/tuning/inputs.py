"""Activation-like Q/K/V input families for the accuracy gate and the benchmarks.

Gaussian inputs are the easy case for FP8 attention: every channel has the same scale, every row of
scores has the same temperature, nothing is positional. Real Q/K/V are not like that, and the lean
P / scaling / Hadamard variants differ exactly where they are not. Each family below
models one documented property of real activations, in float32, deterministically for a seed.

Families (`FAMILIES`; scores are q.k / sqrt(head_dim_qk), the default softmax scale):

gaussian  q, k, v i.i.d. N(0, 1): score std 1. Drawn as q, k, v in that order from
          `torch.Generator(device).manual_seed(seed)`.
outliers  `Outliers`: per kv head, `channels` fixed channels of Q and K (the same channels in both,
          and in all q heads of a GQA group) carry a large, nearly token-independent value, so the
          channel's RMS is `ratio` (20-100, log-uniform per channel) times the others'. The Q
          channel keeps its ordinary noise; the K channel's noise is shrunk so the outliers add a
          key-varying score part of std `score_std` only (their large product is a per-row constant,
          which softmax removes). V has no outliers. Stress: one huge amax per (batch, kv head) sets
          the FP8 scale; scores are per-row constants of hundreds to thousands plus O(1)
          differences; the K outliers' key-varying part is far below one e4m3 step of the
          channel, so FP8 erases it (subtracting K's token mean first keeps it; a Hadamard
          rotation makes it worse: docs/design.md).
sink      `Sink`: key 0 is an attention sink. Per kv head a unit direction u; every query's u
          component is set to a (1 + spread z), key 0's to c, other keys have none, with
          a c / sqrt(d) = `score` (default 10 against std-1 scores: key 0 has the largest
          probability in ~99% of rows, on average ~80% of the mass of rows of 512-1K keys and ~50%
          of rows of 8K-16K keys). v_0 is scaled by `value_scale` (sinks hold small values:
          attending to them is a "no-op"). With outliers, u avoids their channels.
rope      `Rope`: pre-RoPE q and k share a mean direction per kv head (score `locality` at distance
          0), then both are rotated by rotary embeddings (rotate-half pairs (i, i + d/2), frequency
          base**(-2i/d), default base 500000 as in Llama 3; query i sits at position
          i + seqlen_k - seqlen_q + offset, key j at j + offset). Nearby keys score higher (RoPE's
          long-term decay). On plain Gaussian inputs RoPE would change nothing statistically, hence
          the shared direction.
peaky     scores scaled to std 8 (low temperature): above sqrt(2 ln n) a few keys take nearly all
          of a row's mass for any n up to ~1e13 keys. Tiny probabilities everywhere else.
flat      scores scaled to std 0.2: near-uniform rows, every probability ~1/n (deep in the FP8
          subnormal range without power-of-2 scaling).
llm       outliers + RoPE + sink as they occur together in LLMs: the outlier channels sit in the
          lowest-frequency RoPE pairs (barely rotated, so still fixed channels), the sink is added
          after the rotation.
entry_outliers  `EntryOutliers`: the FlashAttention-3 paper's FP8 test inputs, N(0, 1) + N(0, 100) x
          Bernoulli(0.001) in every entry of Q, K and V: outliers in random entries, not channels,
          the case a Hadamard rotation is for (it spreads each over the head dim).

What is known about real activations, in brief: LLMs have a few fixed feature dimensions with
magnitudes far above the rest (Dettmers et al. 2022, LLM.int8(); Sun et al. 2024, "Massive
Activations in Large Language Models": nearly constant across tokens, acting as biases); in the
KV cache keys show fixed outlier channels and values do not (KIVI, Liu et al. 2024; KVQuant, Hooper
et al. 2024), and the massive values of Q and K share dimensions, the low-frequency RoPE ones (Jin
et al. 2025, "Massive Values in Self-Attention Modules..."; Barbero et al. 2025, "Round and Round We
Go!"). Many heads put most of their mass on the first token whatever it is (Xiao et al. 2024,
"Efficient Streaming Language Models with Attention Sinks"), a learned no-op tied to those outliers
(Bondarenko et al. 2023, "Quantizable Transformers"). RoPE: Su et al. 2021 (RoFormer). For contrast,
the FlashAttention-3 paper's FP8 error test puts outliers in random entries,
N(0,1) + N(0,100) * Bernoulli(0.001), not in channels.

Randomness: the structure (outlier channels, magnitudes, signs, sink and mean directions) comes from
CPU generators seeded from (seed, component, kv head), so for a seed and head dim it is the same on
every device and for any batch, sequence length and head count; token noise comes from the device's
generator seeded with `seed`, as in the gaussian family (so CPU and CUDA noise differ). Quantisation is not done here: `kernels.verify.make_inputs` quantises like every
other FP8 caller (`zyfa_tune.quantize.quantize_fp8`, per (batch, kv head)).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Outliers:
    channels: int = 4  # outlier channels per kv head
    ratio: tuple[float, float] = (20.0, 100.0)  # channel RMS / ordinary channel RMS, log-uniform
    score_std: float = 0.5  # key-varying score std the outlier channels add


@dataclass(frozen=True)
class Sink:
    score: float = 10.0  # mean score of key 0 (other scores have std 1)
    spread: float = 0.25  # relative std of that score over queries
    value_scale: float = 0.1  # v_0 is multiplied by this


@dataclass(frozen=True)
class Rope:
    base: float = 500000.0  # rotary frequency base (Llama 3: 500000; Llama 2: 10000)
    locality: float = 2.0  # score of the shared pre-RoPE component at distance 0
    offset: int = 0  # position of key 0


@dataclass(frozen=True)
class EntryOutliers:
    rate: float = 1e-3  # share of entries of q, k and v with an outlier
    std: float = 10.0  # the outlier's std (N(0, 100) in the FA3 paper), added to the N(0, 1) entry


@dataclass(frozen=True)
class Family:
    """A named combination of components; applied in a fixed order: RoPE mean, outliers, RoPE
    rotation, sink, temperature (so outliers are pre-RoPE and the sink is post-RoPE)."""

    name: str
    summary: str
    outliers: Outliers | None = None
    sink: Sink | None = None
    rope: Rope | None = None
    score_std: float | None = None  # rescale Q so that scores have this std (peaky / flat)
    entry_outliers: EntryOutliers | None = None  # added to the token noise first


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("gaussian", "i.i.d. N(0, 1) q, k, v (score std 1)"),
        Family("outliers", "a few fixed channels of Q and K 20-100x larger", outliers=Outliers()),
        Family("sink", "key 0 is an attention sink with a small value", sink=Sink()),
        Family("rope", "RoPE-rotated Q and K with a shared direction (recency)", rope=Rope()),
        Family("peaky", "low temperature: score std 8, a few keys dominate", score_std=8.0),
        Family("flat", "high temperature: score std 0.2, near-uniform rows", score_std=0.2),
        Family(
            "llm",
            "outliers in low-frequency RoPE channels + RoPE + sink",
            outliers=Outliers(),
            sink=Sink(),
            rope=Rope(),
        ),
        Family(
            "entry_outliers",
            "FA3's test: N(0,1) + N(0,100) x Bernoulli(0.001) entries of Q, K, V",
            entry_outliers=EntryOutliers(),
        ),
    )
}
FAMILY_NAMES: tuple[str, ...] = tuple(FAMILIES)


def check_family(name: object, what: str = "family") -> str:
    """`name` if it names a family; else ValueError naming `what` and the valid names."""
    if not isinstance(name, str) or name not in FAMILIES:
        raise ValueError(f"{what}: {name!r} is not one of {list(FAMILY_NAMES)}")
    return name


def check_input_family(name: object, captured: str | None, what: str = "family") -> str:
    """check_family, and that no family other than the default is asked for together with
    captured activations (a file replaces the generated inputs; a family would be ignored)."""
    check_family(name, what)
    if captured is not None and name != "gaussian":
        raise ValueError(
            f"{what}: {name!r} generates inputs, but captured inputs ({captured}) are used instead; "
            f"give one or the other"
        )
    return name


def make_qkv(
    family: str | Family = "gaussian",
    *,
    batch: int,
    seqlen: int,
    heads: int,
    kv_heads: int,
    head_dim_qk: int,
    head_dim_v: int,
    seed: int,
    seqlen_k: int | None = None,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 q (batch, seqlen, heads, dqk), k (batch, seqlen_k, kv_heads, dqk), v (..., dv) of
    `family` (a name in FAMILIES or a custom Family) on `device`, the same for the same arguments."""
    fam = FAMILIES[check_family(family)] if not isinstance(family, Family) else family
    sk = seqlen if seqlen_k is None else seqlen_k
    for name, value in (
        ("batch", batch),
        ("seqlen", seqlen),
        ("seqlen_k", sk),
        ("heads", heads),
        ("kv_heads", kv_heads),
        ("head_dim_qk", head_dim_qk),
        ("head_dim_v", head_dim_v),
    ):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if heads % kv_heads:
        raise ValueError(f"kv_heads: {kv_heads} does not divide heads={heads}")
    if type(seed) is not int or not 0 <= seed < 2**63:
        raise ValueError(f"seed: expected an int in [0, 2**63), got {seed!r}")
    _check_components(fam, head_dim_qk)
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, seqlen, heads, head_dim_qk, device=device, generator=g)
    k = torch.randn(batch, sk, kv_heads, head_dim_qk, device=device, generator=g)
    v = torch.randn(batch, sk, kv_heads, head_dim_v, device=device, generator=g)
    if fam.entry_outliers is not None:
        q, k, v = (_add_entry_outliers(t, fam.entry_outliers, g) for t in (q, k, v))
    group = heads // kv_heads
    if fam.rope is not None:
        mean = _rope_mean(fam.rope, seed, kv_heads, head_dim_qk).to(q.device)
        q += mean.repeat_interleave(group, 0)
        k += mean
    outlier_mask = torch.zeros(kv_heads, head_dim_qk, dtype=torch.bool)
    if fam.outliers is not None:
        outlier_mask = _add_outliers(q, k, fam.outliers, seed, group, low_frequency=fam.rope is not None)
    if fam.rope is not None:
        first_q = sk - seqlen + fam.rope.offset  # bottom-right aligned, as the causal mask
        q = apply_rope(q, torch.arange(first_q, first_q + seqlen), fam.rope.base)
        k = apply_rope(k, torch.arange(fam.rope.offset, fam.rope.offset + sk), fam.rope.base)
    if fam.sink is not None:
        _add_sink(q, k, v, fam.sink, seed, group, g, avoid=outlier_mask)
    if fam.score_std is not None:
        q *= fam.score_std
    return q, k, v


def _check_components(fam: Family, dim: int) -> None:
    o = fam.outliers
    if o is not None:
        room = dim // 2 if fam.rope is not None else dim  # with RoPE: one channel per rotary pair
        room -= fam.sink is not None  # the sink direction needs a channel without outliers
        if type(o.channels) is not int or not 1 <= o.channels <= room:
            raise ValueError(f"outliers.channels: {o.channels!r} must be in [1, {room}] at head dim {dim}")
        lo, hi = o.ratio
        if not 1.0 <= lo <= hi:
            raise ValueError(f"outliers.ratio: expected 1 <= low <= high, got {o.ratio!r}")
        if not o.score_std > 0:
            raise ValueError(f"outliers.score_std: expected > 0, got {o.score_std!r}")
    if fam.rope is not None:
        if dim % 2:
            raise ValueError(f"head_dim_qk: RoPE pairs channels, {dim} is odd")
        if not fam.rope.base > 1:
            raise ValueError(f"rope.base: expected > 1, got {fam.rope.base!r}")
    if fam.sink is not None and not fam.sink.score > 0:
        raise ValueError(f"sink.score: expected > 0, got {fam.sink.score!r}")
    if fam.score_std is not None and not fam.score_std > 0:
        raise ValueError(f"score_std: expected > 0, got {fam.score_std!r}")
    e = fam.entry_outliers
    if e is not None and not (0 < e.rate <= 1 and e.std > 0):
        raise ValueError(f"entry_outliers: expected 0 < rate <= 1 and std > 0, got {e!r}")


def _add_entry_outliers(x: torch.Tensor, e: EntryOutliers, g: torch.Generator) -> torch.Tensor:
    """x + N(0, std^2) in a random `rate` share of its entries (token noise: the device generator)."""
    spikes = torch.randn(x.shape, device=x.device, generator=g) * e.std
    return x + spikes * (torch.rand(x.shape, device=x.device, generator=g) < e.rate)


def _structure(seed: int, component: str, head: int) -> torch.Generator:
    """A CPU generator for one kv head's fixed structure of one component: the same on every
    device and for any shape, independent of the token noise and of the other components."""
    digest = hashlib.sha256(f"{component}:{seed}:{head}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _unit_rows(seed: int, component: str, kv_heads: int, dim: int, avoid: torch.Tensor | None = None) -> torch.Tensor:
    """(kv_heads, dim) fixed random unit vectors, one per kv head, zero where `avoid` is set."""
    x = torch.stack([torch.randn(dim, generator=_structure(seed, component, h)) for h in range(kv_heads)])
    if avoid is not None:
        x[avoid] = 0.0
    return x / x.norm(dim=1, keepdim=True)


def _outlier_layout(o: Outliers, seed: int, head: int, dim: int, low_frequency: bool):
    """One kv head's outlier channels (n,), magnitudes (2, n) and signs (2, n) for (Q, K)."""
    g = _structure(seed, "outliers", head)
    n = o.channels
    if low_frequency:  # the n lowest-frequency rotary pairs, one channel of each (either half)
        channels = torch.arange(dim // 2 - n, dim // 2) + (dim // 2) * torch.randint(0, 2, (n,), generator=g)
    else:
        channels = torch.randperm(dim, generator=g)[:n]
    lo, hi = math.log(o.ratio[0]), math.log(o.ratio[1])
    mags = torch.exp(lo + (hi - lo) * torch.rand(2, n, generator=g))
    signs = torch.randint(0, 2, (2, n), generator=g) * 2.0 - 1.0
    return channels, mags, signs


def _add_outliers(
    q: torch.Tensor, k: torch.Tensor, o: Outliers, seed: int, group: int, *, low_frequency: bool
) -> torch.Tensor:
    """In place: per kv head, `o.channels` channels get a bias s * m (Q keeps its noise; K's noise
    shrinks so that the key-varying score part the outliers add has std o.score_std). Returns the
    (kv_heads, dim) mask of the channels the biases reach (with RoPE, both channels of each pair)."""
    kv_heads, dim = k.shape[2], k.shape[3]
    layouts = [_outlier_layout(o, seed, h, dim, low_frequency) for h in range(kv_heads)]
    channels = torch.stack([c for c, _, _ in layouts])
    mag_q, mag_k = torch.stack([m for _, m, _ in layouts], 1)
    sign_q, sign_k = torch.stack([s for _, _, s in layouts], 1)
    # each channel adds score variance (m_q * noise_k)^2 / dim; together o.score_std^2
    noise_k = o.score_std * math.sqrt(dim / o.channels) / mag_q
    bias_q = torch.zeros(kv_heads, dim).scatter_(1, channels, sign_q * mag_q)
    bias_k = torch.zeros(kv_heads, dim).scatter_(1, channels, sign_k * mag_k)
    scale_k = torch.ones(kv_heads, dim).scatter_(1, channels, noise_k)
    q += bias_q.repeat_interleave(group, 0).to(q.device)
    k.mul_(scale_k.to(k.device)).add_(bias_k.to(k.device))
    mask = bias_q != 0
    return (mask | mask.roll(dim // 2, 1)) if low_frequency else mask


def _rope_mean(r: Rope, seed: int, kv_heads: int, dim: int) -> torch.Tensor:
    """(kv_heads, dim) shared pre-RoPE component with |mean|^2 / sqrt(dim) = r.locality."""
    return _unit_rows(seed, "rope", kv_heads, dim) * math.sqrt(r.locality * math.sqrt(dim))


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate-half RoPE of x (batch, seqlen, heads, dim): token t turned by positions[t] times
    base**(-2i/dim) in pair (i, i + dim/2). Negated positions undo it."""
    dim, half = x.shape[3], x.shape[3] // 2
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # float64: exact at long contexts
    cos = angles.cos().to(torch.float32).to(x.device)[None, :, None, :]
    sin = angles.sin().to(torch.float32).to(x.device)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _add_sink(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s: Sink,
    seed: int,
    group: int,
    g: torch.Generator,
    avoid: torch.Tensor,
) -> None:
    """In place: queries' u component -> a (1 + spread z), key 0's -> c, other keys' -> 0. u avoids
    the outlier channels: projecting their large biases out would leak them into every channel."""
    kv_heads, dim = k.shape[2], k.shape[3]
    u = _unit_rows(seed, "sink", kv_heads, dim, avoid).to(q.device)
    uq = u.repeat_interleave(group, 0)
    a = c = math.sqrt(s.score * math.sqrt(dim))  # a * c / sqrt(dim) = s.score
    z = torch.randn(q.shape[:3], device=q.device, generator=g)
    q += (a * (1.0 + s.spread * z) - torch.einsum("bshd,hd->bsh", q, uq))[..., None] * uq
    target = torch.zeros(k.shape[1], device=k.device)
    target[0] = c
    k += (target[None, :, None] - torch.einsum("bshd,hd->bsh", k, u))[..., None] * u
    v[:, 0] *= s.value_scale
