"""Triton backend: `KernelConfig` -> Python source of one specialised causal-prefill kernel.

Every choice the config makes is resolved here, at emission: the emitted kernel holds only the code
its config needs (no constexpr branches on config fields), so the source hash identifies the kernel.
The source is built from validated fields only (ints from fixed sets, enum names mapped through
dicts), never from free text.

Kernel contract (see kernels/launch.py):
  Q (B, Sq, H, Dqk), K (B, Sk, Hkv, Dqk), V (B, Sk, Hkv, Dv), O (B, Sq, H, Dv) bf16; last dim contiguous.
  QD/KD/VD: float32 descales indexed [b * stride_db + hkv * stride_dh] (strides 0 for "none").
  A 1-D grid of n_m_blocks * B * H programs. Causal masking is bottom-right aligned
  (query i sees keys j <= i + Sk - Sq), as in FlashAttention 2.1+.

The serving variant (`emit(config, serving=True)`) is the same kernel with four problem options
switched by constexprs, so that a call without them compiles to the plain kernel's code:
  VARLEN      packed sequences: Q/K/V/O are (1, total, heads, dim), CU_Q/CU_K the int32 cumulative
              lengths (batch + 1); the grid is n_m_blocks(max_seqlen_q) * batch * H, and programs
              past their sequence's end exit at once.
  PAGED       keys and values from a paged cache: K/V are (pages, SEQ_K = page size, Hkv, dim), and
              sequence b's keys are its first CACHE_SEQLENS[b] in the pages PAGE_TABLE[b * stride_pt + i]
              (int32). A page holds whole key tiles (SEQ_K % block_n == 0), so each tile looks up one
              page; V rows past a sequence's keys (stale cache slots) are zeroed in masked tiles. The
              queries are dense (B, Sq, H, dim), or packed with VARLEN (CU_K unused). Natural V only.
  WINDOW      query i sees keys j with i + off - WIN_L <= j <= i + off + WIN_R (off = Sk - Sq of its
              sequence; the launcher passes a bound no key reaches for an unbounded side, and a causal
              window as WIN_R = 0); key blocks wholly outside the window are skipped.
  RETURN_LSE  the natural-log sum of exp(scores) of each row into LSE (float32), -inf where a row
              sees no key: [b * stride_lb + h * stride_lh + row], or [h * stride_lh + CU_Q[b] + row].
"""

from __future__ import annotations

import math

from ..asm.lean import E4M3_ONE_CODE, LEAN_P_CONSTRAINTS, MAGIC, ONE_FMA_FOLDS, SAT_SCALE, fold_center, lean_p_asm
from ..config import GENERATOR_VERSION, KernelConfig
from ..emitted import KERNEL_NAME, EmittedKernel, emitted

#: Cap of the per-tile extra exponent (scale_block): keeps acc rescale factors within 2^16.
SCALE_EXP_CAP = 16

_TL_DTYPE = {"fp8": "tl.float8e4nv", "bf16": "tl.bfloat16"}
#: Rows with no visible key start from this finite maximum, so no inf - inf appears.
_M_INIT = "-1.0e30"
_LN2 = 0.6931471805599453


def head_chunks(dim: int, min_width: int = 16) -> list[tuple[int, int]]:
    """Split a head dim into power-of-two (offset, width) chunks, widest first: 96 -> 64+32. A rest
    narrower than `min_width` (tl.dot's and a TMA box's smallest: 16 columns, 32 for an FP8 reduction)
    is read as the last `min_width` columns of the head instead, overlapping the chunk before it
    (80 at 32 -> 64 + columns 48..80): every load stays inside the head (no padding, no next head's
    columns), and `chunk_skips` says which of its columns the previous chunk already covered."""
    chunks, offset = [], 0
    while offset < dim:
        width = 1 << int(math.log2(dim - offset))
        if width < min_width:
            chunks.append((dim - min_width, min_width))
            break
        chunks.append((offset, width))
        offset += width
    return chunks


def chunks_of(config: KernelConfig) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The (offset, width) chunks of Q/K and of V that the Triton kernel loads (one TMA descriptor per
    distinct width): FP8 wgmma reduces 32 columns per instruction, so an FP8 Q/K chunk is >= 32 wide."""
    return head_chunks(config.head_dim_qk, 32 if config.dtype == "fp8" else 16), head_chunks(config.head_dim_v)


def chunk_skips(chunks: list[tuple[int, int]]) -> list[int]:
    """Leading columns of each chunk that an earlier chunk already covers (0 but for an overlapping
    last chunk): a reduction over the head dim zeroes them in one operand so they count once."""
    ends = [0] + [off + w for off, w in chunks[:-1]]
    return [max(0, end - off) for end, (off, _) in zip(ends, chunks)]


def emit(config: KernelConfig, serving: bool = False) -> EmittedKernel:
    """Emit the Triton kernel source for `config` (deterministic; same config -> same bytes);
    `serving`: the variant taking varlen, window and LSE options (module docstring)."""
    if not isinstance(config, KernelConfig):
        raise TypeError(f"emit() takes a KernelConfig, got {type(config).__name__}")
    if config.backend != "triton":
        raise ValueError(f"emit_triton.emit: config has backend={config.backend!r}")
    return emitted(config, _Emitter(config, bool(serving)).source())


class _Emitter:
    def __init__(self, c: KernelConfig, serving: bool = False):
        self.c = c
        self.qk_chunks, self.v_chunks = chunks_of(c)
        self.pdt = _TL_DTYPE[c.dtype]
        self.lean = c.softmax == "lean"
        self.serving = serving
        # one sequence's lengths and first rows in the (B * S) TMA views: the serving variant reads
        # them per program (a packed sequence's), the plain kernel's are the batch entry's
        self.sq, self.sk = ("seq_q", "seq_k") if serving else ("SEQ_Q", "SEQ_K")
        self.q_row = "q_row" if serving else "b * SEQ_Q"
        # a key tile's first row in the (B * S) TMA views of K and V: the serving variant's comes from
        # the tile's page or its sequence's first row (`_tile_base`)
        self.k_tile = "kv_row" if serving else "b * SEQ_K + n0"

    # ---- pieces -------------------------------------------------------------------------
    def _header(self) -> list[str]:
        c = self.c
        out = [
            f'"""zyfa-tune generated kernel (generator {GENERATOR_VERSION}). Do not edit.',
            "",
            f"config: {c.to_json()}",
            '"""',
            "import triton",
            "import triton.language as tl",
            "",
            f"NUM_WARPS = {int(c.num_warps)}",
            f"NUM_STAGES = {int(c.num_stages)}",
            f"MAXNREG = {int(c.maxnreg) or None}",
            f"BLOCK_M = {int(c.block_m)}",
            f"KERNEL_NAME = {KERNEL_NAME!r}",
            "",
        ]
        if self.lean:
            asm = lean_p_asm(c.lean_fold, c.lean_clamp, c.lean_pack)
            out += [
                "",
                "@triton.jit",
                "def _lean_p(s, a, b):",
                "    # lean P: 4 fp32 scores -> 4 e4m3 codes in one register, no ex2, no cvt",
                "    return tl.inline_asm_elementwise(",
                f"        {asm!r},",
                f"        {LEAN_P_CONSTRAINTS!r},",
                "        [s, a, b], dtype=tl.float8e4nv, is_pure=True, pack=4)",
                "",
            ]
        return out

    def _signature(self) -> list[str]:
        c = self.c
        if c.loads == "tma":
            descs = [
                f"desc_{t}_{w}"
                for t, chunks in (("q", self.qk_chunks), ("k", self.qk_chunks), ("v", self.v_chunks))
                for w in sorted({w for _, w in chunks}, reverse=True)
            ]
            inputs = ["    " + ", ".join(descs) + ","]
        else:
            vrow = "stride_vd" if c.v_layout == "transposed" else "stride_vs"
            inputs = [
                "    Q, K, V,",
                "    stride_qb, stride_qs, stride_qh,",
                "    stride_kb, stride_ks, stride_kh,",
                f"    stride_vb, {vrow}, stride_vh,",
            ]
        return (
            ["", "@triton.jit", f"def {KERNEL_NAME}("]
            + inputs
            + [
                "    O, QD, KD, VD, CU_Q, CU_K, LSE, PAGE_TABLE, CACHE_SEQLENS,"
                if self.serving
                else "    O, QD, KD, VD,"
            ]
            + [
                "    stride_ob, stride_os, stride_oh,",
                "    stride_db, stride_dh,",
                "    H, GROUP, SEQ_Q, SEQ_K, N_M_BLOCKS, sm_scale_log2,",
            ]
            + (["    stride_lb, stride_lh, WIN_L, WIN_R, stride_pt,"] if self.serving else [])
            + ["    CAUSAL: tl.constexpr,"]
            + (
                ["    VARLEN: tl.constexpr, WINDOW: tl.constexpr, RETURN_LSE: tl.constexpr, PAGED: tl.constexpr,"]
                if self.serving
                else []
            )
            + ["):"]
        )

    def _prologue(self) -> list[str]:
        c = self.c
        bm, bn = c.block_m, c.block_n
        lines = ["    pid = tl.program_id(0)", "    n_bh = tl.num_programs(0) // N_M_BLOCKS"]
        if c.q_order == "heavy_first":
            lines += ["    start_m = N_M_BLOCKS - 1 - pid // n_bh", "    bh = pid % n_bh"]
        else:
            lines += ["    start_m = pid % N_M_BLOCKS", "    bh = pid // N_M_BLOCKS"]
        lines += ["    b = bh // H", "    h = bh % H", "    hk = h // GROUP"]
        if self.serving:
            lines += self._sequence()
        lines += [
            f"    offs_m = start_m * {bm} + tl.arange(0, {bm})",
            f"    offs_n = tl.arange(0, {bn})",
            f"    row_ok = offs_m < {self.sq}",
            "    d_off = b * stride_db + hk * stride_dh",
        ]
        if c.loads == "pointer" and not self.serving:
            lines += [
                "    q_base = Q + b.to(tl.int64) * stride_qb + h * stride_qh",
                "    k_base = K + b.to(tl.int64) * stride_kb + hk * stride_kh",
                "    v_base = V + b.to(tl.int64) * stride_vb + hk * stride_vh",
            ]
        if c.dtype == "fp8":  # QD is None (a compile-time constant) when no descales are given
            lines += [
                "    if QD is None:",
                "        qk_scale = sm_scale_log2",
                "        v_descale = 1.0",
                "    else:",
                "        qk_scale = sm_scale_log2 * tl.load(QD + d_off) * tl.load(KD + d_off)",
                "        v_descale = tl.load(VD + d_off)",
            ]
        else:
            lines += ["    qk_scale = sm_scale_log2"]
        for i, (off, w) in enumerate(self.qk_chunks):
            if c.loads == "tma":  # 2-D views: q (B*Sq, H*Dqk), rows past Sq are never stored
                lines.append(
                    f"    q{i} = desc_q_{w}.load([{self.q_row} + start_m * {bm}, h * {c.head_dim_qk} + {off}])"
                )
            else:
                lines.append(
                    f"    q{i} = tl.load(q_base + offs_m[:, None] * stride_qs + ({off} + tl.arange(0, {w}))[None, :],"
                    f" mask=row_ok[:, None], other=0.0)"
                )
        for i, skip in enumerate(chunk_skips(self.qk_chunks)):
            if skip:  # an overlapping last chunk: its first columns were multiplied already
                w = self.qk_chunks[i][1]
                lines.append(f"    q{i} = tl.where((tl.arange(0, {w}) >= {skip})[None, :], q{i}, tl.zeros_like(q{i}))")
        for i, (_, w) in enumerate(self.v_chunks):
            lines.append(f"    acc{i} = tl.zeros([{bm}, {w}], dtype=tl.float32)")
        lines += [
            f"    m_i = tl.full([{bm}], {_M_INIT}, dtype=tl.float32)",
            f"    ref_i = tl.full([{bm}], {_M_INIT}, dtype=tl.float32)",
            f"    l_i = tl.zeros([{bm}], dtype=tl.float32)",
        ]
        if c.rowsum == "mma":
            lines.append(f"    ones = tl.full([{bn}, 16], 1.0, dtype=tl.float32).to({self.pdt})")
        if self.serving:
            return lines + self._key_range()
        # Key range: [0, full_end) needs no mask; [full_end, hi) is the causal diagonal band
        # and the ragged end of the keys.
        lines += [
            "    off = SEQ_K - SEQ_Q",
            "    if CAUSAL:",
            f"        hi = tl.minimum(SEQ_K, tl.maximum(start_m * {bm} + {bm} + off, 0))",
            f"        full_end = tl.minimum(tl.maximum(start_m * {bm} + off + 1, 0) // {bn} * {bn},"
            f" SEQ_K // {bn} * {bn})",
            "    else:",
            "        hi = SEQ_K",
            f"        full_end = SEQ_K // {bn} * {bn}",
        ]
        return lines

    def _load_k(self, i: int, off: int, w: int, masked: bool) -> str:
        """A (block_n, w) tile of K. TMA zero-fills past the tensor's end; inside it, keys past
        SEQ_K (the next batch entry's) only meet probabilities that the score mask made zero."""
        c = self.c
        if c.loads == "tma":
            return f"desc_k_{w}.load([{self.k_tile}, hk * {c.head_dim_qk} + {off}])"
        mask = f", mask=(offs_k < {self.sk})[:, None], other=0.0" if masked else ""
        return f"tl.load(k_base + offs_k[:, None] * stride_ks + ({off} + tl.arange(0, {w}))[None, :]{mask})"

    def _load_v(self, off: int, w: int, masked: bool) -> str:
        """A (block_n, w) tile of V, read from V or from its (dim, keys) transposed copy."""
        c = self.c
        if c.v_layout == "transposed":
            if c.loads == "tma":  # V^T viewed (B*Hkv*Dv, Sk): keys past SEQ_K are zero-filled
                if self.serving:
                    return f"tl.trans(desc_v_{w}.load([vt_head * {c.head_dim_v} + {off}, vt_col + n0]))"
                return f"tl.trans(desc_v_{w}.load([(b * (H // GROUP) + hk) * {c.head_dim_v} + {off}, n0]))"
            mask = f", mask=(offs_k < {self.sk})[None, :], other=0.0" if masked else ""
            return (
                f"tl.trans(tl.load(v_base + ({off} + tl.arange(0, {w}))[:, None] * stride_vd + offs_k[None, :]{mask}))"
            )
        if c.loads == "tma":
            return f"desc_v_{w}.load([{self.k_tile}, hk * {c.head_dim_v} + {off}])"
        mask = f", mask=(offs_k < {self.sk})[:, None], other=0.0" if masked else ""
        return f"tl.load(v_base + offs_k[:, None] * stride_vs + ({off} + tl.arange(0, {w}))[None, :]{mask})"

    def _tile(self, masked: bool) -> list[str]:
        """Body of one key tile starting at `n0`; `masked` adds bounds and causal masks."""
        c = self.c
        ind = "        "
        L: list[str] = [f"{ind}offs_k = n0 + offs_n"]
        if self.serving:
            L += self._tile_base(ind)
        for i, (off, w) in enumerate(self.qk_chunks):
            L.append(f"{ind}k{i} = {self._load_k(i, off, w, masked)}")
        for i in range(len(self.qk_chunks)):
            acc = "" if i == 0 else ", qk"
            L.append(f"{ind}qk = tl.dot(q{i}, tl.trans(k{i}){acc})")
        if masked:
            L += [
                f"{ind}ok = (offs_k < {self.sk})[None, :]",
                f"{ind}if CAUSAL:",
                f"{ind}    ok = ok & (offs_k[None, :] <= offs_m[:, None] + off)",
            ]
            if self.serving:
                L += [
                    f"{ind}if WINDOW:",
                    f"{ind}    ok = ok & (offs_k[None, :] >= offs_m[:, None] + (off - WIN_L))",
                    f"{ind}    ok = ok & (offs_k[None, :] <= offs_m[:, None] + (off + WIN_R))",
                ]
            L.append(f"{ind}qk = tl.where(ok, qk, float('-inf'))")
        L += [f"{ind}m_tile = tl.max(qk, 1) * qk_scale", f"{ind}m_new = tl.maximum(m_i, m_tile)"]
        center = fold_center(c.lean_fold) if self.lean else 0.0
        if self.lean and c.lean_fold in ONE_FMA_FOLDS:
            # b = magic + 56 - (8*ref + center) must be exact in fp32: keep the reference on its grid
            # (n - center) / 8 (the 1/8 grid for "fma").
            L.append(
                f"{ind}m_new = tl.ceil(m_new * 8.0) * 0.125"
                if not center
                else f"{ind}m_new = tl.ceil(m_new * 8.0 + {center!r}) * 0.125 - {center / 8!r}"
            )
        ref = f"m_new - {c.p_scale_log2}.0"
        if c.scale_block:
            L.append(f"{ind}k_exp = tl.minimum(tl.floor(m_new - m_tile), {SCALE_EXP_CAP}.0)")
            ref += " - k_exp"
        L += [f"{ind}ref = {ref}", f"{ind}alpha = tl.math.exp2(ref_i - ref)"]
        if self.lean:
            if c.lean_fold in ONE_FMA_FOLDS and c.lean_clamp == "sat":  # asm.lean.SAT_SCALE
                L += [
                    f"{ind}a = qk_scale * {8.0 / SAT_SCALE!r}",
                    f"{ind}bias = ({float(E4M3_ONE_CODE)!r} - (8.0 * ref + {center!r})) * {1.0 / SAT_SCALE!r}",
                ]
            elif c.lean_fold in ONE_FMA_FOLDS:
                L += [
                    f"{ind}a = qk_scale * 8.0",
                    f"{ind}bias = {MAGIC + E4M3_ONE_CODE!r} - 8.0 * ref"
                    if not center
                    else f"{ind}bias = {MAGIC + E4M3_ONE_CODE!r} - (8.0 * ref + {center!r})",
                ]
            else:
                L += [f"{ind}a = qk_scale", f"{ind}bias = -ref"]
            L.append(f"{ind}p = _lean_p(qk, a, bias[:, None])")
        else:
            L.append(f"{ind}p32 = tl.math.exp2(qk * qk_scale - ref[:, None])")
            if c.rowsum == "fp32":
                L.append(f"{ind}l_ij = tl.sum(p32, 1)")
            L.append(f"{ind}p = p32.to({self.pdt})")
        if c.rowsum == "rounded":
            L.append(f"{ind}l_ij = tl.sum(p.to(tl.float32), 1)")
        if c.rowsum == "mma":
            # a fresh accumulator per tile: FP8 wgmma accumulates with reduced precision, so the
            # running sum stays in fp32 registers (all 16 columns hold the same row sum)
            L.append(f"{ind}l_ij = tl.max(tl.dot(p, ones), 1)")
        L.append(f"{ind}l_i = l_i * alpha + l_ij")
        for i, (off, w) in enumerate(self.v_chunks):
            L.append(f"{ind}v{i} = {self._load_v(off, w, masked)}")
            if masked and self.serving and c.loads == "tma":  # (pointer loads zero them in their mask)
                L += [
                    f"{ind}if PAGED:  # slots past the sequence's keys: stale data, perhaps NaN (0 * NaN = NaN)",
                    f"{ind}    v{i} = tl.where((offs_k < seq_k)[:, None], v{i}, tl.zeros_like(v{i}))",
                ]
            L.append(f"{ind}acc{i} = tl.dot(p, v{i}, acc{i} * alpha[:, None])")
        L += [f"{ind}m_i = m_new", f"{ind}ref_i = ref"]
        return L

    def _loops(self) -> list[str]:
        bn = self.c.block_n
        stages = int(self.c.num_stages)
        if self.serving:  # a window's leading edge: masked tiles [lo, full_lo)
            head = ["    if WINDOW:", f"        for n0 in tl.range(lo, full_lo, {bn}, num_stages={stages}):"]
            head += ["    " + line for line in self._tile(True)]
            start = "full_lo"
        else:
            head, start = [], "0"
        return (
            head
            + [f"    for n0 in tl.range({start}, full_end, {bn}, num_stages={stages}):"]
            + self._tile(False)
            + [f"    for n0 in tl.range(full_end, hi, {bn}, num_stages={stages}):"]
            + self._tile(True)
        )

    def _epilogue(self) -> list[str]:
        c = self.c
        lines = []
        scale = " * v_descale" if c.dtype == "fp8" else ""
        lines.append("    inv_l = tl.where(l_i > 0.0, 1.0 / l_i, 0.0)" + scale)
        if self.serving:
            lines += self._lse() + [
                "    if VARLEN:",
                "        o_base = O + q_row.to(tl.int64) * stride_os + h * stride_oh",
                "    else:",
                "        o_base = O + b.to(tl.int64) * stride_ob + h * stride_oh",
            ]
        else:
            lines.append("    o_base = O + b.to(tl.int64) * stride_ob + h * stride_oh")
        for i, (off, w) in enumerate(self.v_chunks):
            lines.append(
                f"    tl.store(o_base + offs_m[:, None] * stride_os + ({off} + tl.arange(0, {w}))[None, :],"
                f" (acc{i} * inv_l[:, None]).to(tl.bfloat16), mask=row_ok[:, None])"
            )
        return lines

    # ---- the serving variant's pieces (module docstring) ---------------------------------------
    def _sequence(self) -> list[str]:
        """This program's sequence: its lengths, its first rows in the TMA views (or its base
        pointers), and an early exit for query blocks past its end."""
        c = self.c
        pointer = c.loads == "pointer"
        lines = [
            "    if VARLEN:  # sequence b of the packed batch entry 0",
            "        q_row = tl.load(CU_Q + b)",
            "        seq_q = tl.load(CU_Q + b + 1) - q_row",
        ]
        lines += ["        q_base = Q + q_row.to(tl.int64) * stride_qs + h * stride_qh"] if pointer else []
        lines += ["    else:", "        q_row = b * SEQ_Q", "        seq_q = SEQ_Q"]
        lines += ["        q_base = Q + b.to(tl.int64) * stride_qb + h * stride_qh"] if pointer else []
        lines += [
            "    if PAGED:  # keys in pages: each key tile finds its own (`_tile_base`)",
            "        seq_k = tl.load(CACHE_SEQLENS + b)",
            "        pages = PAGE_TABLE + b.to(tl.int64) * stride_pt",
            "    elif VARLEN:",
            "        k_row = tl.load(CU_K + b)",
            "        seq_k = tl.load(CU_K + b + 1) - k_row",
        ]
        if pointer:
            # the V^T copy is (1, Hkv, Dv, keys) with keys contiguous: a sequence starts k_row columns in
            v_packed = "k_row" if c.v_layout == "transposed" else "k_row.to(tl.int64) * stride_vs"
            lines += [
                "        k_base = K + k_row.to(tl.int64) * stride_ks + hk * stride_kh",
                f"        v_base = V + {v_packed} + hk * stride_vh",
            ]
        elif c.v_layout == "transposed":  # V^T viewed (B*Hkv*Dv, keys): a head's rows, a sequence's columns
            lines += ["        vt_head = hk", "        vt_col = k_row"]
        lines += ["    else:", "        k_row = b * SEQ_K", "        seq_k = SEQ_K"]
        if pointer:
            lines += [
                "        k_base = K + b.to(tl.int64) * stride_kb + hk * stride_kh",
                "        v_base = V + b.to(tl.int64) * stride_vb + hk * stride_vh",
            ]
        elif c.v_layout == "transposed":
            lines += ["        vt_head = b * (H // GROUP) + hk", "        vt_col = 0"]
        return lines + [f"    if start_m * {c.block_m} >= seq_q:", "        return"]

    def _tile_base(self, ind: str) -> list[str]:
        """Where a key tile starting at n0 lies: in its page (PAGED; SEQ_K is the page size, and a
        page holds whole tiles), else at its sequence's row n0. TMA loads take a row of the (B * S)
        views; pointer loads add offs_k * stride to bases that stand n0 rows before the tile."""
        lines = [f"{ind}if PAGED:", f"{ind}    page = tl.load(pages + n0 // SEQ_K)"]
        if self.c.v_layout == "transposed":  # a cache has no V^T copy: its natural-V twin runs it
            lines.append(f'{ind}    tl.static_assert(False, "a paged KV cache is read with natural V")')
            if self.c.loads == "tma":
                lines += [f"{ind}else:", f"{ind}    kv_row = k_row + n0"]
            return lines
        if self.c.loads == "pointer":
            lines += [
                f"{ind}    in_page = (n0 % SEQ_K - n0).to(tl.int64)",
                f"{ind}    k_base = K + page.to(tl.int64) * stride_kb + in_page * stride_ks + hk * stride_kh",
                f"{ind}    v_base = V + page.to(tl.int64) * stride_vb + in_page * stride_vs + hk * stride_vh",
            ]
            return lines
        return lines + [f"{ind}    kv_row = page * SEQ_K + n0 % SEQ_K", f"{ind}else:", f"{ind}    kv_row = k_row + n0"]

    def _key_range(self) -> list[str]:
        """Key tiles of this query block: masked [lo, full_lo) (a window's leading edge), unmasked
        [full_lo, full_end), masked [full_end, hi) (the diagonal band, a window's trailing edge and
        the sequence's ragged end); tiles wholly outside the window are never visited."""
        bm, bn = self.c.block_m, self.c.block_n
        first, last = f"start_m * {bm}", f"start_m * {bm} + {bm - 1}"
        return [
            "    off = seq_k - seq_q",
            "    full_lo = 0",
            "    if WINDOW:",
            f"        lo = tl.maximum({first} + off - WIN_L, 0) // {bn} * {bn}",
            f"        hi = tl.minimum(seq_k, tl.maximum({last} + off + WIN_R + 1, 0))",
            f"        full_end = tl.minimum(tl.maximum({first} + off + WIN_R + 1, 0) // {bn} * {bn},"
            f" seq_k // {bn} * {bn})",
            "        full_end = tl.maximum(full_end, lo)",
            f"        full_lo = (tl.maximum({last} + off - WIN_L, 0) + {bn - 1}) // {bn} * {bn}",
            "        full_lo = tl.minimum(tl.maximum(full_lo, lo), full_end)",
            "    elif CAUSAL:",
            f"        hi = tl.minimum(seq_k, tl.maximum({first} + {bm} + off, 0))",
            f"        full_end = tl.minimum(tl.maximum({first} + off + 1, 0) // {bn} * {bn}, seq_k // {bn} * {bn})",
            "    else:",
            "        hi = seq_k",
            f"        full_end = seq_k // {bn} * {bn}",
        ]

    def _lse(self) -> list[str]:
        """Each row's natural-log sum of exp(scores): l_i sums 2^(s - ref_i) in log2 units."""
        return [
            "    if RETURN_LSE:",
            f"        lse = tl.where(l_i > 0.0, (ref_i + tl.log2(l_i)) * {_LN2!r}, float('-inf'))",
            "        if VARLEN:",
            "            lse_base = LSE + h.to(tl.int64) * stride_lh + q_row",
            "        else:",
            "            lse_base = LSE + b.to(tl.int64) * stride_lb + h * stride_lh",
            "        tl.store(lse_base + offs_m, lse, mask=row_ok)",
        ]

    def source(self) -> str:
        lines = self._header() + self._signature() + self._prologue() + self._loops() + self._epilogue()
        return "\n".join(lines) + "\n"
