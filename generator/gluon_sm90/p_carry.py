"""O's rescale and P's way from one step's softmax to the PV wgmma of the next: carried in
registers (float32, or packed four e4m3 per word) or staged in one or two shared-memory P tiles.
Triton keeps fp8 tensors as separate bytes, so how P crosses the loop back-edge decides how many
byte-repacking instructions a step pays.
"""
# The config's constants (BLOCK_N, LEAN, ...) are defined only in the emitted module, by
# generator/gluon_sm90/emit.py:
# ruff: noqa: F821

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from .common import E4M3X4_ASM

# ---- emitted below this line ----


@gluon.jit
def _rescale(acc, l_i, alpha, row_o: gl.constexpr, accc, row_oc: gl.constexpr):
    """O *= alpha per row, and l too under ROWSUM_MMA (whose row sums arrive with PV, so l is
    rescaled when O is). O_SPLIT: O's second part (accc) too. Returns (acc, l_i, accc)."""
    acc = _times_rows(acc, alpha, row_o, RESCALE_ASM, RESCALE_CONSTRAINTS, RESCALE_PACK)
    if O_SPLIT:
        accc = _times_rows(accc, alpha, row_oc, RESCALE_C_ASM, RESCALE_C_CONSTRAINTS, RESCALE_C_PACK)
    if ROWSUM_MMA:
        l_i = l_i * alpha
    return acc, l_i, accc


@gluon.jit
def _times_rows(acc, alpha, row: gl.constexpr, ASM: gl.constexpr, CONSTRAINTS: gl.constexpr, PACK: gl.constexpr):
    """One O accumulator times its rows' alpha. RESCALE_IN_PLACE: inline PTX on its own registers
    (generator/asm/rescale.py), with skip_rescale jumped over by a warp whose rows all have alpha == 1
    (maxima kept)."""
    a = gl.convert_layout(alpha, row)[:, None]
    if RESCALE_IN_PLACE:
        return gl.inline_asm_elementwise(ASM, CONSTRAINTS, [acc, gl.broadcast(acc, a)[1]], dtype=gl.float32,
                                         is_pure=True, pack=PACK)
    else:
        return acc * a


@gluon.jit
def _carried(p, p_layout: gl.constexpr, LEAN: gl.constexpr = False):
    """One key part's float32 P as it goes to the PV wgmma (V_PERM): a thread's accumulator registers
    hold, per 32-key chunk, keys {16h + 8s + 2q + b}; the register A operand wants them as
    {16h + 4q + 2s + b}. Relabelling the keys (a bit permutation, no data movement) and storing V^T in
    the same key order makes the tensor already distributed like the A operand. Float32, rounded by
    _p_operand next to its wgmma, or (PACK_P, P_SMEM) rounded now and carried packed (LEAN: the folded
    scores turned into their codes, P_SMEM only)."""
    NB: gl.constexpr = p.shape[1] // 32
    p = p.reshape([64, NB, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5)).reshape([64, p.shape[1]])
    p = gl.convert_layout(p, p_layout)
    if PACK_P or P_SMEM:
        p = _p_pack(p, LEAN)
    return p


@gluon.jit
def _p_pack(p, LEAN: gl.constexpr = False):
    """float32 P (64 x keys, the A operand's layout: four consecutive keys per thread) -> int32
    (64 x keys / 4), four e4m3 per register: a quarter of the registers to carry across steps.
    LEAN: p holds lean P's folded scores, made codes by LEAN_ASM (the same four-in, one-out form)."""
    x0, x1 = gl.split(p.reshape([64, p.shape[1] // 4, 2, 2]))   # key 4a + 2b + c: c = 0 / 1
    x00, x01 = gl.split(x0)                                      # b = 0 / 1
    x10, x11 = gl.split(x1)
    if F16_S:  # y = 1024 + code in f16 (_f16_fold): the low bytes of two packed pairs, one PRMT
        return gl.inline_asm_elementwise(F16_PACK_ASM, "=r,h,h,h,h", [x00, x10, x01, x11], dtype=gl.int32,
                                         is_pure=True, pack=1)
    ASM: gl.constexpr = LEAN_ASM if LEAN else E4M3X4_ASM
    return gl.inline_asm_elementwise(ASM, "=r,r,r,r,r", [x00, x10, x01, x11], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _p_unpack(w, p_layout: gl.constexpr):
    """_p_pack's registers as the e4m3 A operand (each is its four keys' bytes: the joins only repeat
    it, so the layout conversion moves nothing). The operand is a copy (an identity LOP3): a plain
    mov lets ptxas coalesce it with the loop-carried register, so the next step's P would be written
    where the in-flight PV wgmma reads, and ptxas serialises every wgmma (C7513)."""
    x = gl.join(w, w)
    x = gl.join(x, x)
    x = gl.convert_layout(x.reshape([64, w.shape[1] * 4]), p_layout)
    return gl.inline_asm_elementwise("lop3.b32 $0, $1, $1, $1, 0xF0;", "=r,r,r,r,r", [x], dtype=gl.float8e4nv,
                                     is_pure=True, pack=4)


@gluon.jit
def _p_stage(w, p_smem):
    """P_SMEM: _p_pack's words into this warpgroup's P tile (as int32: the tile's bytes are the same
    under a 32-bit view of its swizzle, P_SWIZZLE bytes, and 8-bit tensors stored from registers are
    lowered to stmatrix.b16). Call only once the PV wgmma reading the tile is done; _p_publish before the
    next one reads it."""
    _p_words(p_smem, w.shape[1]).store(w)


@gluon.jit
def _p_words(p_smem, N: gl.constexpr):
    """The P tile as (64, N) int32 words (N = its keys / 4), the view _p_stage and _p_stage_lower store."""
    return p_smem._reinterpret(gl.int32, [64, N],
                               gl.NVMMASharedLayout(swizzle_byte_width=P_SWIZZLE, element_bitwidth=32, rank=2))


@gluon.jit
def _p_stage_lower(w, p_smem):
    """HALF_BLOCK on an overlapped kernel: a half block's _p_pack words into the lower half of the keys
    of the P tile, zeros into the upper half (the pipeline's PV wgmma reads the whole tile; the upper
    keys' V rows are loaded, finite, and times zero add nothing)."""
    words = _p_words(p_smem, 2 * w.shape[1])
    words.slice(0, w.shape[1], dim=1).store(w)
    words.slice(w.shape[1], w.shape[1], dim=1).store(gl.zeros_like(w))


@gluon.jit
def _pv_prologue(pP, pPb, acc, l_i, alpha, row_o: gl.constexpr, V_PERM: gl.constexpr, LEAN: gl.constexpr,
                 p_layout: gl.constexpr, p_smem, accc, row_oc: gl.constexpr):
    """What precedes PV(j-1) in an overlapped step and in the last block's PV: P(j-1) as the e4m3 A
    operand (both key parts under SPLIT), O (and l) rescaled by alpha(j-1), and under P_SMEM the P
    tile published. Returns (p8, p8b, acc, l_i, accc)."""
    p8 = _p_operand(pP, V_PERM, LEAN, p_layout, p_smem)
    p8b = _p_operand(pPb, V_PERM, LEAN, p_layout) if SPLIT else p8
    if not LATE_RESCALE:
        acc, l_i, accc = _rescale(acc, l_i, alpha, row_o, accc, row_oc)
    if P_SMEM:
        _p_publish()
    return p8, p8b, acc, l_i, accc


@gluon.jit
def _p_tile(p_smem, it, CID: gl.constexpr):
    """P_DOUBLE: the P tile of KV block `it`, this warpgroup's tile it % 2 of its two (the first also
    holds the warpgroup's output tile in the epilogue where it fits, O_IN_P)."""
    return p_smem.index((it % 2) * NUM_CONSUMERS + CID)


@gluon.jit
def _prev_p_ready(p_smem, kv_it, CID: gl.constexpr, acc, l_i, alpha, row_o: gl.constexpr, accc, row_oc: gl.constexpr):
    """P_DOUBLE, before PV(j-1): P(j-1)'s tile published and O (and l) rescaled by alpha(j-1) (unless
    LATE_RESCALE). Returns (the tile, acc, l_i, accc)."""
    _p_publish()
    if not LATE_RESCALE:
        acc, l_i, accc = _rescale(acc, l_i, alpha, row_o, accc, row_oc)
    return _p_tile(p_smem, kv_it - 1, CID), acc, l_i, accc


@gluon.jit
def _p_publish():
    """P_SMEM: make the warpgroup's stores to its P tile visible to the wgmma about to read it. The
    proxy fence waits for the stores, hundreds of cycles under the tensor cores' shared-memory traffic;
    written after O's rescale to overlap them, though ptxas puts it back at the top of the step."""
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _p_operand(pP, V_PERM: gl.constexpr, LEAN: gl.constexpr = False, p_layout: gl.constexpr = None, p_smem=None):
    """The e4m3 A operand of the PV wgmma. Triton keeps fp8 tensors as separate bytes, so an e4m3 P
    carried across a loop back-edge costs ~100 byte-repacking instructions per step; carried as
    float32 and rounded here (4 registers -> one register of 4 e4m3), they fold away. PACK_P: carried
    already rounded, as int32 words of four e4m3 (_p_pack), a quarter of the registers. LEAN: the
    folded scores become codes by integer clamp and byte packing (generator/asm/lean.py), or were made
    codes already where PACK_P packed them. P_SMEM: the warpgroup's P tile (pP is a stand-in)."""
    if P_SMEM:
        return p_smem
    elif PACK_P:  # (lean P's codes too: _carried made them)
        return _p_unpack(pP, p_layout)
    elif LEAN:
        return gl.inline_asm_elementwise(LEAN_ASM, "=r,r,r,r,r", [pP], dtype=gl.float8e4nv, is_pure=True, pack=4)
    elif V_PERM:
        return gl.inline_asm_elementwise(E4M3X4_ASM, "=r,r,r,r,r", [pP], dtype=gl.float8e4nv, is_pure=True, pack=4)
    else:
        return pP
