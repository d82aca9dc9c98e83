"""Per-(batch, kv head) FP8 quantisation of attention inputs: two Triton passes (plain inputs: both in one
persistent launch, `ONE_PASS`), optionally after K's token mean is removed and after a Hadamard rotation
of the head dim, and for V optionally with rounding errors that cancel along the keys (`balanced_codes`).

Why a kernel: in torch ops each tensor went through float32 copies of itself (x.float(), |x|,
x / descale, the clamp) and, rotated, a float32 matmul: on the H200 at hd128 and 16K tokens x 32
heads, 2.7 ms for Q, K and V, more than the 2.1 ms attention it feeds (docs/results.md).
Here pass 1 reads a block of rows and folds its amax into its (batch, kv head)'s by an atomic max
(of non-negative floats: the result does not depend on the order); pass 2 makes the descale from it,
reads the rows again and writes their e4m3 codes. Only the codes (and the descales) are written.
Q, K and V that take the same passes share one launch of each (`quantize_tensors`: segments of one grid).
Plain inputs (no rotation, centring or balancing, not packed) take both passes in one launch instead
(kernels/quantize_onepass.py): each row block's second read follows its first closely enough to come
from L2, where a second launch would read every row from HBM again.

The numbers are the torch path's (`quantize_heads_reference`: the CPU path and the tests'
reference): descale = max(amax, 1e-12) * float32(1 / 448), codes = e4m3 round-to-nearest-even of
clamp(x * scale, -448, 448) with scale = float32(1 / descale) (IEEE division, once a program: a division
per element cost V's balanced pass about 8 instructions a code), so without the rotation the two are
bitwise equal. The rotation is a tensor-core product with the +-1 Sylvester matrix (block-diagonal where the
head dim is not a power of two, as `hadamard_matrix`), then one float32 multiply by 1/sqrt(block).
Rows are split into bf16 parts that sum to them exactly (one for bf16, two for fp16, three for
float32 and centred rows), so every product is exact and only the order of the float32 sums differs
from torch's matmul: a code can differ where x * scale lies within a float32 rounding of a
rounding boundary. A balanced V (`balanced_codes`) also needs to know which keys of a block may move
(from each key's largest |value|): pass 1 has the rows and writes that as a 16-bit mask a block (FREE,
(B, H, S / 16) int32), so pass 2 reads one int a block where it reduced over the head dim across threads.

The rotation lives in kernels/hadamard.py, balanced V's rounding and its weight in kernels/balanced_v.py, the
passes in kernels/quantize_passes.py and kernels/quantize_onepass.py; this module holds their launch plans,
and re-exports those modules' public names.
"""

from __future__ import annotations

import torch
import triton

from . import quantize_onepass
from .balanced_v import (
    BALANCE_COST_CAP,
    BALANCE_FIXED,
    BALANCE_KEYS,
    BALANCE_ROW_BITS,
    BALANCE_SKIP,
    BALANCE_STEPS,
    BALANCE_WEIGHT_MAX,
    WEIGHT_SAMPLES,
    balance_weights,
    balanced_codes,
)
from .fastlaunch import Bound, run
from .hadamard import _pm1_matrix, hadamard_matrix, rotation_block
from .quantize_onepass import _onepass_kernel, onepass_lag, onepass_programs, onepass_tiles
from .quantize_passes import AMAX_FLOOR, E4M3_MAX, INV_E4M3_MAX, _amax_kernel, _codes_kernel
from .transpose import padded_keys, transpose_v

__all__ = [
    "AMAX_FLOOR",
    "BALANCE_COST_CAP",
    "BALANCE_FIXED",
    "BALANCE_KEYS",
    "BALANCE_ROW_BITS",
    "BALANCE_SKIP",
    "BALANCE_STEPS",
    "BALANCE_WEIGHT_MAX",
    "E4M3_MAX",
    "INV_E4M3_MAX",
    "KERNEL_DTYPES",
    "WEIGHT_SAMPLES",
    "balance_weights",
    "balanced_codes",
    "hadamard_matrix",
    "quantize_heads",
    "quantize_heads_reference",
    "quantize_packed",
    "quantize_packed_reference",
    "quantize_tensors",
    "rotation_block",
]

#: rows x padded head dim per program (4096 values: 32 a thread at four warps), at most 32 rows (at
#: hd64, 64-row blocks made ptxas spill the centred amax pass at 64 registers)
TILE = 4096
NUM_WARPS = 4
#: rotating: rows x padded head dim per program at eight warps (128 x 128, 64 x 256): each program reads
#: the whole +-1 matrix, so more rows a program means less of that traffic per row (the wgmma tile)
ROT_TILE, ROT_ROWS, ROT_WARPS = 16384, 128, 8
#: output columns per rotation product: the +-1 matrix's (padded dim x 64) slice is at most 64 KB
ROT_N = 64
#: balanced V: blocks of BALANCE_KEYS keys per program of both passes, a loop over them (a program's setup, its
#: segment's and head's picks, the descale's load and division and kappa's load, once for them all). Part of a
#: plan's key: a plan made for one value is not used for another.
BALANCE_BLOCKS = 4
#: balanced V: channels per thread of the codes pass (each thread all 16 keys of them; the program has head dim /
#: 32 / this warps, at least one): 2 makes each key's load 4 bytes a thread and gives a thread two channels' independent work
#: for about the registers of one a thread at twice the warps. Part of a plan's key, as BALANCE_BLOCKS.
BALANCE_CHANNELS = 1
#: dtypes the kernel reads as they are (others are made float32 first, as the torch path does), and the
#: bf16 parts a row of each splits into exactly for the rotation (8 significant bits a part)
_TERMS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
KERNEL_DTYPES = tuple(_TERMS)


def quantize_heads_reference(
    x: torch.Tensor,
    kv_heads: int,
    rotate: bool = False,
    mean: torch.Tensor | None = None,
    balance: bool = False,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, H, D) floating -> (e4m3 codes (B, S, H, D), float32 descales (B, kv_heads)), one scale
    per kv head shared by its GQA group, in torch ops. `mean` (B, kv_heads, D) float32 is subtracted
    first (K smoothing), then the rows are rotated by `hadamard_matrix(D)` if `rotate`; `balance`
    rounds as `balanced_codes` (V) with kappa `weight` (B, kv_heads), else to nearest."""
    b, s, h, d = x.shape
    xf = x.float()
    if mean is not None:
        xf = xf - mean.view(b, 1, kv_heads, d).repeat_interleave(h // kv_heads, dim=2)
    if rotate:
        xf = xf @ hadamard_matrix(d, device=x.device)
    xf = xf.reshape(b, s, kv_heads, h // kv_heads, d)
    descale = xf.abs().amax(dim=(1, 3, 4)).clamp_min(AMAX_FLOOR) * INV_E4M3_MAX  # (b, kv_heads)
    scale = 1.0 / descale
    codes = (xf * scale.view(b, 1, kv_heads, 1, 1)).clamp(-E4M3_MAX, E4M3_MAX).view(b, s, h, d)
    if balance:  # kappa per (batch, kv head), each of its heads'
        weight = None if weight is None else weight.repeat_interleave(h // kv_heads, dim=1)
        codes = balanced_codes(codes, xf.view(b, s, h, d), weight)
    else:
        codes = codes.to(torch.float8_e4m3fn)
    return codes, descale.contiguous()


def quantize_heads(
    x: torch.Tensor,
    kv_heads: int,
    rotate: bool = False,
    mean: torch.Tensor | None = None,
    balance: bool = False,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_heads_reference`'s result; on a GPU by the Triton passes (`quantize_tensors`)."""
    codes, descales = quantize_tensors(((x, rotate, mean),), kv_heads, balance_last=balance, balance_weight=weight)
    return codes[0], descales[0]


def quantize_tensors(
    items,
    kv_heads: int,
    k_major_last: bool = False,
    balance_last: bool = False,
    balance_weight: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(codes, descales) of each (x, rotate, mean) in `items` (at most three tensors of one batch size
    and kv head count), as `quantize_heads`. `k_major_last`: the last tensor's codes are written
    keys-fastest, a (B, S, H, D) view of a (B, H, D, Sp) buffer (Sp: S padded to 16 bytes, what
    transpose_v would make): the codes pass stores them there itself (transposed through shared
    memory), so the FP8 kernels' V^T costs no pass of its own. `balance_last`: the last tensor (V,
    neither rotated nor centred) is rounded as `balanced_codes`, alone in its launch (`BALANCE_BLOCKS`), with
    kappa `balance_weight` ((B, kv_heads) float32, finite, >= 0; default 0).

    On a GPU, tensors that take the same compiled passes (head dim, dtype, options, last stride) are
    one launch per pass: each program finds its tensor from its index (quantize_fp8's plain Q, K and
    V: one launch in all with `ONE_PASS`, else two; with balanced V one for Q and K and one for V). The
    amaxes of all tensors (and, one pass, its counters) are one zeroed buffer and their descales views of
    one more, each starting 16-byte aligned (`scale_row`). What depends only on the layouts is kept in a
    plan per layout: a call costs four allocations and the launches (host time: docs/results.md)."""
    if balance_last and (items[-1][1] or items[-1][2] is not None):
        raise ValueError("balance_last: the balanced tensor (V) cannot be rotated or centred")
    last = len(items) - 1
    b = items[0][0].shape[0]
    if balance_weight is not None and (balance_weight.shape != (b, kv_heads) or balance_weight.dtype != torch.float32):
        raise ValueError(
            f"balance_weight: expected float32 ({b}, {kv_heads}), got {balance_weight.dtype} "
            f"{tuple(balance_weight.shape)}"
        )
    if items[0][0].device.type != "cuda":
        out = [
            quantize_heads_reference(x, kv_heads, rotate, mean, balance_last and i == last, balance_weight)
            for i, (x, rotate, mean) in enumerate(items)
        ]
        codes = [c for c, _ in out]
        if k_major_last:
            codes[-1] = transpose_v(codes[-1]).permute(0, 3, 1, 2)
        return codes, [d for _, d in out]
    return _launch_tensors(items, kv_heads, k_major_last, balance_last, balance_weight)


def _launch_tensors(
    items,
    kv_heads: int,
    k_major_last: bool = False,
    balance_last: bool = False,
    balance_weight: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`quantize_tensors` by the Triton passes on the items' device, whichever it is (on CPU tensors:
    under Triton's interpreter), arguments checked by the caller."""
    if len(items) > MAX_SEGMENTS:
        raise ValueError(f"items: at most {MAX_SEGMENTS} tensors a call, got {len(items)}")
    last = len(items) - 1
    b = items[0][0].shape[0]
    xs = [x if x.dtype in KERNEL_DTYPES else x.float() for x, _, _ in items]
    means = [None if m is None else m.contiguous() for _, _, m in items]
    key = (
        ONE_PASS,
        kv_heads,
        xs[0].device.index,
        bool(k_major_last),
        (BALANCE_BLOCKS, BALANCE_CHANNELS) if balance_last else 0,
        quantize_onepass.PROGRAMS_PER_SM if ONE_PASS else 0,  # (read per call: a benchmark sets it)
        *(
            (
                x.shape,
                x.stride(),
                x.dtype,
                bool(r),
                m is not None,
                x.data_ptr() % 16 == 0,
                m is None or m.data_ptr() % 16 == 0,
            )
            for x, (_, r, _), m in zip(xs, items, means)
        ),
    )
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= PLAN_LIMIT:
            _plans.clear()
        plan = _plans[key] = _Plan(
            xs,
            [bool(r) for _, r, _ in items],
            [m is not None for m in means],
            kv_heads,
            last if k_major_last else -1,
            last if balance_last else -1,
            onepass=ONE_PASS,
        )
    row = scale_row(b, kv_heads)
    amax = torch.zeros(plan.buffer, dtype=torch.float32, device=xs[0].device)
    descales = torch.empty(len(xs), row, dtype=torch.float32, device=xs[0].device)
    codes = [_codes_buffer(x, k_major_last and i == len(xs) - 1) for i, x in enumerate(xs)]
    free = weight = amax  # (placeholders where nothing is balanced)
    if balance_last:  # which keys of each block may move, pass 1 to pass 2 (every entry written by pass 1)
        free = torch.empty(
            b * xs[-1].shape[2] * (padded_keys(xs[-1].shape[1], False) // BALANCE_KEYS),
            dtype=torch.int32,
            device=xs[0].device,
        )
        weight = (
            torch.zeros(b, kv_heads, dtype=torch.float32, device=xs[0].device)
            if balance_weight is None
            else balance_weight.contiguous()
        )
    plan(xs, means, amax, descales, codes, free, weight)
    return codes, [d[: b * kv_heads].view(b, kv_heads) for d in descales.unbind(0)]


def quantize_packed_reference(
    x: torch.Tensor, cu_seqlens: torch.Tensor, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (total, H, D) floating rows of the sequences `cu_seqlens` ((batch + 1,) cumulative
    lengths) -> (e4m3 codes (total, H, D), float32 descales (batch, kv_heads)): each sequence
    `quantize_heads_reference`'s plain codes as a batch of one, an empty one the floor's descale
    (amax 0), rows outside the sequences 0. Reads the lengths on the host (the CPU path and the
    tests' reference)."""
    cu = cu_seqlens.tolist()
    codes = torch.zeros(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    descales = torch.zeros(len(cu) - 1, kv_heads, device=x.device).clamp_min(AMAX_FLOOR) * INV_E4M3_MAX
    for i, (a, e) in enumerate(zip(cu, cu[1:])):
        if e > a:
            c, d = quantize_heads_reference(x[None, a:e], kv_heads)
            codes[a:e], descales[i] = c[0], d[0]
    return codes, descales


def quantize_packed(items, kv_heads: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(codes, descales) of each (x, cu_seqlens) in `items` (at most three): packed (total, H, D)
    floating rows, cu_seqlens their sequences' int32 (batch + 1,) cumulative lengths on x's device,
    every item of one batch; as `quantize_packed_reference`, bitwise (rows outside the sequences are
    left unwritten). On a GPU the passes of `quantize_tensors` with each program's rows within one
    sequence (`_packed_block`): one launch per pass for all items of one head dim and dtype, sized from
    the shapes alone, so no length is read on the host (CUDA-graph capturable); descales (batch,
    kv_heads), each 16-byte aligned."""
    if not 1 <= len(items) <= MAX_SEGMENTS:
        raise ValueError(f"items: 1 to {MAX_SEGMENTS} tensors a call, got {len(items)}")
    batch = items[0][1].shape[0] - 1
    for x, cu in items:
        if cu.shape[0] - 1 != batch:
            raise ValueError(f"cu_seqlens: {cu.shape[0]} entries, another item's {batch + 1} (one batch)")
        if batch == 0 and x.shape[0]:
            raise ValueError(f"cu_seqlens: no sequence holds x's {x.shape[0]} rows")
    if items[0][0].device.type != "cuda":
        out = [quantize_packed_reference(x, cu, kv_heads) for x, cu in items]
        return [c for c, _ in out], [d for _, d in out]
    xs = [(x if x.dtype in KERNEL_DTYPES else x.float()).unsqueeze(0) for x, _ in items]
    cus = [cu if cu.is_contiguous() else cu.contiguous() for _, cu in items]
    layouts = ((x.shape, x.stride(), x.dtype, x.data_ptr() % 16 == 0, c.data_ptr() % 16 == 0) for x, c in zip(xs, cus))
    key = ("packed", kv_heads, batch, xs[0].device.index, *layouts)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= PLAN_LIMIT:
            _plans.clear()
        plan = _plans[key] = _Plan(xs, [False] * len(xs), [False] * len(xs), kv_heads, packed=batch)
    row = scale_row(batch, kv_heads)
    amax = torch.zeros(plan.buffer, dtype=torch.float32, device=xs[0].device)
    descales = torch.empty(len(xs), row, dtype=torch.float32, device=xs[0].device)
    codes = [torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device) for x in xs]
    plan(xs, [None] * len(xs), amax, descales, codes, amax, amax, cus)
    return [c[0] for c in codes], [d[: batch * kv_heads].view(batch, kv_heads) for d in descales.unbind(0)]


def scale_row(batch: int, kv_heads: int) -> int:
    """Floats per tensor in the amax and descale buffers: batch x kv_heads rounded up to 16 bytes, so
    that each returned descale starts 16-byte aligned, as the FP8 kernels' bound fast path requires
    of every pointer (an unaligned descale would send each of its calls through the checked path)."""
    return -(-batch * kv_heads // 4) * 4


def _codes_buffer(x: torch.Tensor, k_major: bool) -> torch.Tensor:
    """The e4m3 codes of x (B, S, H, D): contiguous, or k_major the keys-fastest (B, S, H, D) view of a
    (B, H, D, Sp) buffer, whose base the codes pass writes (LAST_K_MAJOR)."""
    if not k_major:
        return torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    b, s, h, d = x.shape
    return torch.empty(b, h, d, padded_keys(s, False), dtype=torch.float8_e4m3fn, device=x.device)[..., :s].permute(
        0, 3, 1, 2
    )


#: tensors one launch can take (Q, K and V)
MAX_SEGMENTS = 3
#: plain calls (no rotation, centring, balancing or packing) in one persistent launch that reads each row
#: from HBM once (kernels/quantize_onepass.py), else the two passes; read at each call (part of the plan key),
#: so both can be timed in one process
ONE_PASS = True
#: plans kept (one per layout of the call's tensors and option set: a prefill with varying lengths
#: makes one per length); beyond it the cache starts over
PLAN_LIMIT = 256
_plans: dict[tuple, "_Plan"] = {}


class _Plan:
    """The launches of one call layout: its tensors grouped by the compiled passes they take (a
    centred tensor alone: the mean is one argument). `onepass`: its groups of plain or balanced rows take the
    one-pass kernel.
    `buffer`: the floats of the zeroed amax buffer, the amaxes (`scale_row` a tensor) and, one pass,
    as many int32 arrival counts and a ticket a group."""

    __slots__ = ("groups", "buffer")

    def __init__(
        self,
        xs: list,
        rotates: list,
        centres: list,
        kv_heads: int,
        k_major: int = -1,
        balanced: int = -1,
        packed: int | None = None,
        onepass: bool = False,
    ):
        by_kind: dict[tuple, list[int]] = {}
        for i, (x, r, c) in enumerate(zip(xs, rotates, centres)):
            bal = i == balanced  # alone, as a centred tensor (its mean is one argument): its tiles are its own
            by_kind.setdefault((x.shape[3], x.dtype, x.stride(3), r, c, bal, i if c or bal else -1), []).append(i)
        amaxes = len(xs) * scale_row(xs[0].shape[0] if packed is None else packed, kv_heads)
        onepass = onepass and packed is None
        # (items keep their order in a group, so the K-major tensor, the last item, is its group's last; a
        # group of plain or balanced rows takes the one-pass kernel beside a rotated or centred one)
        self.groups = [
            _Group(
                xs,
                members,
                kv_heads,
                r,
                c,
                members[-1] == k_major,
                bal,
                packed,
                (amaxes, 2 * amaxes + i) if onepass and not (r or c) else None,
            )
            for i, ((_, _, _, r, c, bal, _), members) in enumerate(by_kind.items())
        ]
        self.buffer = 2 * amaxes + MAX_SEGMENTS + 1 if onepass else amaxes

    def __call__(
        self,
        xs: list,
        means: list,
        amax: torch.Tensor,
        descales: torch.Tensor,
        codes: list,
        free: torch.Tensor,
        weight: torch.Tensor,
        cus: list | None = None,
    ) -> None:
        for group in self.groups:
            group(xs, means, amax, descales, codes, free, weight, cus)


class _Group:
    """The passes over up to three tensors (segments) of one head dim, dtype and option set: the
    grid and every argument that is not a tensor. The passes are compiled (through `run`) at the
    first call and launched directly (`Bound`) after it. `packed`: the tensors are (1, total, H, D)
    rows of that many sequences, whose cumulative lengths each call passes (`cus`); a head's
    programs are total // rows + sequences slots (`_packed_block`), scales per (sequence, kv head).
    `counters`: (ARRIVED_AT, TICKET_AT) in the amax buffer's int32 view: both passes in one persistent
    launch (`_onepass_kernel`, plain or balanced tensors), LAG the most blocks of a unit."""

    __slots__ = ("members", "grid", "tail", "consts", "options", "head", "kernels", "bound")

    def __init__(
        self,
        xs: list,
        members: list[int],
        kv_heads: int,
        rotate: bool,
        centre: bool,
        last_k_major: bool = False,
        balanced: bool = False,
        packed: int | None = None,
        counters: tuple[int, int] | None = None,
    ):
        x0 = xs[members[0]]
        b, d = x0.shape[0], x0.shape[3]
        block_s, dp, bn, warps = _tiles(d, rotate, balanced) if counters is None or balanced else onepass_tiles(d)
        scales = b if packed is None else packed  # (batch or sequence, kv head) scales per tensor
        starts, fields = [0], []  # per segment: S, H, GROUP, stride_b, stride_s, stride_h
        for i in members:
            x = xs[i]
            blocks = triton.cdiv(x.shape[1], block_s) * b if packed is None else x.shape[1] // block_s + packed
            starts.append(starts[-1] + blocks * x.shape[2])
            fields.append((x.shape[1], x.shape[2], x.shape[2] // kv_heads, *x.stride()[:3]))
        pad = MAX_SEGMENTS - len(members)  # unused segments repeat the first
        self.members = tuple(members + members[:1] * pad)
        fields += fields[:1] * pad
        self.grid = (starts[-1],)
        self.tail = (
            starts[1],
            starts[min(2, len(members))],  # P1, P2: where segments 1, 2 start
            *(i * scale_row(scales, kv_heads) for i in self.members),  # F0, F1, F2: their first scales
            *(f[k] for k in range(6) for f in fields),
            x0.stride(3),
            d,
            rotation_block(d) ** -0.5,
            padded_keys(xs[members[-1]].shape[1], False),  # SKP: the K-major buffer's key stride
            scales if packed is not None else 0,  # NSEQ and STEPS, the binary search's
            packed.bit_length() if packed is not None else 0,
        )
        # (name, kernel, whether it takes the outputs: the codes pass and the one-pass kernel do)
        self.kernels = (("quantize_amax", _amax_kernel, False), ("quantize_codes", _codes_kernel, True))
        if counters is not None:  # CHUNKS, LAG (over a unit's blocks: a head's times its group), the counters
            self.grid = (onepass_programs(x0.device, starts[-1]),)
            lag = onepass_lag(max(triton.cdiv(s, block_s) * group for s, _, group, *_ in fields), self.grid[0])
            self.tail += (starts[-1], lag, *counters)
            self.kernels = (("quantize_onepass", _onepass_kernel, True),)
        self.consts = dict(
            NSEG=len(members),
            DP=dp,
            BN=bn,
            BLOCK_S=block_s,
            CENTER=centre,
            ROTATE=rotate,
            TERMS=3 if centre else _TERMS[x0.dtype],
            LAST_K_MAJOR=bool(last_k_major),
            BALANCED=bool(balanced),
            PACKED=packed is not None,
        )
        self.options = dict(num_warps=warps, num_stages=1)
        self.head = (d, str(x0.dtype), centre, rotate, bool(last_k_major), bool(balanced), packed is not None)
        self.bound = None

    def __call__(
        self,
        xs: list,
        means: list,
        amax: torch.Tensor,
        descales: torch.Tensor,
        codes: list,
        free: torch.Tensor,
        weight: torch.Tensor,
        cus: list | None = None,
    ) -> None:
        if not self.grid[0]:  # (no rows: nothing to write)
            return
        x0 = xs[self.members[0]]
        r = _pm1_matrix(x0.shape[3], x0.device) if self.consts["ROTATE"] else x0
        m = means[self.members[0]] if self.consts["CENTER"] else x0
        cu = (x0,) * 3 if cus is None else (cus[i] for i in self.members)  # (placeholders: not packed)
        ins = (*(xs[i] for i in self.members), r, m, amax, free, *cu)
        outs = (descales, *(codes[i] for i in self.members))
        args = [(*ins, weight, *outs, *self.tail) if writes else (*ins, *self.tail) for *_, writes in self.kernels]
        if self.bound is None:  # first call: compile through Triton's path, then launch directly
            dev = x0.device.index
            compiled = [
                run((name, *self.head), fn, self.grid, a, self.consts, self.options, dev)
                for (name, fn, _), a in zip(self.kernels, args)
            ]
            if None not in compiled:  # (Triton's interpreter returns none: each of its calls runs through `run`)
                self.bound = [Bound(c, self.grid, dev) for c in compiled]
        else:
            for launch, a in zip(self.bound, args):
                launch((*a, *self.consts.values()))


def _tiles(d: int, rotate: bool, balanced: bool = False) -> tuple[int, int, int, int]:
    """(rows per program, head dim padded to a power of two, columns per rotation step, warps).
    Balanced: BALANCE_BLOCKS blocks of keys a program, each thread all its keys of BALANCE_CHANNELS channels."""
    dp = triton.next_power_of_2(d)
    if rotate:
        return max(16, min(ROT_ROWS, ROT_TILE // dp)), dp, min(dp, ROT_N), ROT_WARPS
    if balanced:
        return BALANCE_KEYS * BALANCE_BLOCKS, dp, dp, max(1, dp // (32 * BALANCE_CHANNELS))
    return max(16, min(32, TILE // dp)), dp, dp, NUM_WARPS
