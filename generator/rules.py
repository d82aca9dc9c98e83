"""Cross-field rules of a KernelConfig: which combinations of fields make a valid kernel.

Each rule reads a mapping of fields (a config's `vars`, or the fields a search space has decoded so
far) and returns why the combination is invalid, or None: one rule for validation (`KernelConfig`
raises ConfigError with the reason) and for the search spaces (which decode a suggested value that
breaks a rule to one that does not).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: (head_dim_qk, head_dim_v) pairs FA3 also instantiates (and the shipped database is tuned for); the
#: Gluon backend emits any pair `gluon_head_dim_conflict` accepts.
GLUON_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))
#: the p_carry values that take P through shared memory -> P tiles per consumer warpgroup
P_TILES = {"smem": 1, "smem2": 2}


#: FP8 wgmma's reduction (k) per instruction: a Gluon QK^T reduces over a multiple of it
GLUON_QK_STEP = 32


def gluon_qk_width(head_dim_qk: int) -> int:
    """Columns a Gluon QK^T reduces over: head_dim_qk rounded up to a multiple of GLUON_QK_STEP. Past the
    head dim, the kernel's Q and K tiles hold TMA's zeros (a (rows, heads, dims) view clips the boxes at
    the head dim): they add nothing to the scores and cost no memory traffic."""
    return -(-head_dim_qk // GLUON_QK_STEP) * GLUON_QK_STEP


def o_width(head_dim_v: int) -> int:
    """Columns of an O accumulator of one part: head_dim_v rounded up to a power of two."""
    return 1 << (head_dim_v - 1).bit_length()


def triton_head_dim_conflict(f: Mapping[str, Any]) -> str | None:
    """Why the Triton backend cannot emit these head dims, or None. Any multiple of 8 from 32 to 256
    (KernelConfig's range) loads as power-of-two chunks of >= 16 columns (tl.dot's and a TMA box's
    smallest; >= 32 for an FP8 Q/K, whose wgmma reduces 32 at once), the last one overlapping the
    chunk before where the rest is narrower. TMA needs 16-byte row strides: with FP8 and loads="tma"
    a width must be a multiple of 16 (8 would leave an odd head count's rows misaligned)."""
    if f["dtype"] == "fp8" and f["loads"] == "tma":
        for name in ("head_dim_qk", "head_dim_v"):
            if f[name] % 16:
                return (
                    f"{name}={f[name]}: FP8 rows of a multiple of 8 but not of 16 columns are not 16-byte "
                    f"aligned for TMA with an odd head count: use loads='pointer' (or a multiple of 16)"
                )
    return None


def gluon_head_dim_conflict(f: Mapping[str, Any]) -> str | None:
    """Why the Gluon backend cannot emit these head dims, or None. FP8 wgmma reduces 32 columns at once:
    Q and K are loaded and multiplied in parts of the largest power of two dividing gluon_qk_width (the
    head dim rounded up to 32; 80 -> 96 in three 32-column parts, 112 -> 128 in one), the columns past
    head_dim_qk zero-filled by TMA through a (rows, heads, dims) view, whose head stride TMA needs
    16-byte aligned: head_dim_qk must be a multiple of 16 (40, 72, 200, ... are the Triton backend's).
    O is a power-of-two accumulator (V^T and output tiles of that width, the stores clipped at
    head_dim_v): any multiple of 8 for head_dim_v (16-byte bf16 output rows), a multiple of 16 with
    v_layout="natural" (16-byte FP8 V rows)."""
    if f["head_dim_qk"] % 16:
        return (
            f"head_dim_qk={f['head_dim_qk']}: backend='gluon' reads FP8 Q and K by TMA, zero-padded to a "
            f"multiple of 32 columns through a (rows, heads, dims) view whose 16-byte aligned head stride "
            f"needs a multiple of 16 (the Triton backend takes multiples of 8)"
        )
    if f["k_perm"] and gluon_qk_width(f["head_dim_qk"]) != f["head_dim_qk"]:
        return (
            f"head_dim_qk={f['head_dim_qk']}: k_perm=True reads K by a 5-D TMA box (TMA's most dimensions), "
            f"which leaves none for the heads of the zero-padded view: it needs a multiple of 32 (or "
            f"k_perm=False)"
        )
    if f["v_layout"] == "natural" and f["head_dim_v"] % 16:
        return (
            f"head_dim_v={f['head_dim_v']}: v_layout='natural' reads FP8 V rows by TMA, which needs 16-byte "
            f"rows: a multiple of 16 (or v_layout='transposed')"
        )
    return None


def triton_conflict(f: Mapping[str, Any]) -> str | None:
    """Why a Triton config with these fields is not a valid kernel (a cross-field rule it breaks), or None."""
    if why := triton_head_dim_conflict(f):
        return why
    if f["q_order"] == "balanced":
        return (
            "q_order='balanced' schedules the tiles of a persistent Gluon kernel; the Triton kernel "
            "runs one program per tile: use 'forward' or 'heavy_first'"
        )
    if f["softmax"] == "lean" and f["dtype"] != "fp8":
        return "softmax='lean' writes e4m3 codes and needs dtype='fp8'"
    if f["softmax"] == "lean" and f["rowsum"] == "fp32":
        return "softmax='lean' has no unrounded probabilities: rowsum must be 'rounded' or 'mma'"
    if f["dtype"] == "bf16" and f["p_scale_log2"] != 0:
        return "p_scale_log2 must be 0 for dtype='bf16' (bf16 has the range)"
    if f["block_m"] == 192:
        return (
            "block_m=192: Triton tiles are powers of two; 192 rows is the Gluon backend's "
            "three consumer warpgroups (backend='gluon')"
        )
    if f["block_n"] == 192:
        return (
            "block_n=192: Triton tiles are powers of two; 192 keys is the Gluon backend's "
            "128 + 64 key parts (backend='gluon')"
        )
    if f["scale_block"] not in (0, f["block_n"]):
        return (
            f"scale_block={f['scale_block']}: the Triton backend takes one exponent per key "
            f"tile, so scale_block must be 0 or block_n={f['block_n']} (smaller blocks buy nothing "
            f"at p_scale_log2 >= 6: docs/results.md)"
        )
    return None


def gluon_conflict(f: Mapping[str, Any], defaults: Mapping[str, Any]) -> str | None:
    """Why a Gluon config with these fields is not a valid kernel (the first cross-field rule it breaks), or None.
    `defaults`: KernelConfig's field defaults (fields some schedules must leave at them)."""
    if f["dtype"] != "fp8":
        return f"dtype={f['dtype']!r}: backend='gluon' emits FP8 (e4m3) kernels only"
    if why := gluon_head_dim_conflict(f):
        return why
    if f["block_m"] not in (64, 128, 192):
        return (
            f"block_m={f['block_m']}: backend='gluon' runs one consumer warpgroup per 64 "
            f"query rows, one to three of them: block_m must be 64, 128 or 192"
        )
    if f["num_stages"] < 2:
        return (
            f"num_stages={f['num_stages']}: the Gluon K/V ring needs at least 2 stages "
            f"(V is released one step after its PV product)"
        )
    if f["ping_pong"] and f["block_m"] == 64:
        return f"ping_pong=True needs two or three consumer warpgroups: block_m=128 or 192, not {f['block_m']}"
    if f["turn_barrier"] != "mbarrier" and not f["ping_pong"]:
        return f"turn_barrier={f['turn_barrier']!r}: the turn token exists with ping_pong=True only"
    if f["q_order"] == "balanced" and not f["persistent"]:
        return (
            "q_order='balanced' is a persistent program's list of tiles: it needs persistent=True "
            "(one program per tile is scheduled by the hardware)"
        )
    if f["l2_group_mib"] != defaults["l2_group_mib"] and f["q_order"] != "balanced":
        return (
            f"l2_group_mib={f['l2_group_mib']}: the L2 group sizes the tile table of "
            f"q_order='balanced' (not {f['q_order']!r}); keep the default "
            f"{defaults['l2_group_mib']}"
        )
    if f["pv_defer"] and (why := pv_defer_conflict(f)):
        return why
    if f["p_carry"] != "f32" and (why := packed_p_conflict(f)):
        return why
    if f["lane_sums"] and (why := lane_sums_conflict(f)):
        return why
    if f["o_split"] and (why := o_split_conflict(f)):
        return why
    if f["half_block"] and (why := half_block_conflict(f)):
        return why
    if f["o_through_p"] and (why := o_through_p_conflict(f)):
        return why
    if f["qk_acc"] != "f32" and (why := qk_acc_conflict(f)):
        return why
    if f["late_rescale"] and not f["overlap"]:
        return "late_rescale=True moves the overlapped step's O rescale after its PV wait: it needs overlap=True"
    if f["ex2_fence"] and not f["overlap"]:
        return "ex2_fence=True needs overlap=True: only the overlapped step has a PV wait under the softmax"
    if f["exp2_poly"] and f["softmax"] != "exact":
        return (
            f"exp2_poly={f['exp2_poly']}: the polynomial replaces exact-softmax exponentials; "
            f"softmax={f['softmax']!r} has none (use softmax='exact')"
        )
    if not f["exp2_poly"] and f["exp2_poly_degree"] != defaults["exp2_poly_degree"]:
        return (
            f"exp2_poly_degree={f['exp2_poly_degree']}: no polynomial with exp2_poly=0; keep the "
            f"default {defaults['exp2_poly_degree']!r}"
        )
    if f["softmax"] == "lean":
        if not (f["overlap"] and f["v_permute"]):
            return (
                "softmax='lean' with backend='gluon' needs overlap=True and v_permute=True "
                "(its codes are made in the overlapped step)"
            )
        if f["rowsum"] not in ("mma", "rounded"):
            return (
                f"rowsum={f['rowsum']!r}: Gluon lean P sums its rounded probabilities by an "
                f"MMA against ones ('mma') or by decoding its e4m3 codes ('rounded')"
            )
        if f["rowsum"] == "rounded" and f["p_carry"] == "f32":
            return (
                "rowsum='rounded' with softmax='lean' decodes the packed e4m3 codes of P: it needs "
                "p_carry 'e4m3', 'smem' or 'smem2' (with 'f32' the codes are made at the wgmma)"
            )
        if f["rowsum"] == "rounded" and f["ex2_fence"]:
            return (
                "ex2_fence=True fences on the float32 row sums or the row-sum MMA's operand; "
                "rowsum='rounded' under lean P has neither"
            )
    else:
        for name in ("lean_fold", "lean_clamp", "lean_pack"):
            if f[name] != defaults[name]:
                return f"{name}={f[name]!r}: the exact Gluon kernel has no lean P; keep the default {defaults[name]!r}"
        if f["rowsum"] not in ("fp32", "mma"):
            return (
                f"rowsum={f['rowsum']!r}: the exact Gluon kernel sums the float32 probabilities "
                f"('fp32') or their e4m3 roundings by an MMA against ones ('mma')"
            )
        if f["rowsum"] == "mma" and f["ex2_fence"] and not f["v_permute"]:
            return (
                "ex2_fence=True with rowsum='mma' fences on the float32 probabilities carried "
                "to the next step, which needs v_permute=True"
            )
    if f["block_n"] == 192 and (f["v_layout"] == "natural" or f["softmax"] == "lean"):
        return (
            "block_n=192 (128 + 64 key parts) is built for the exact softmax with the V^T copy: "
            "it needs softmax='exact' and v_layout='transposed'"
        )
    if f["qk_async"] and (why := qk_async_conflict(f)):
        return why
    if f["lean_mufu"] and (why := lean_mufu_conflict(f)):
        return why
    if f["lean_ref"] != "grid" and (why := lean_ref_conflict(f)):
        return why
    if f["lean_floor"] and (why := lean_floor_conflict(f)):
        return why
    if f["k_perm"] and not f["v_permute"]:
        return "k_perm=True makes v_permute's relabelling of keys on K instead of V^T: it needs v_permute=True"
    if f["v_layout"] == "natural" and f["v_permute"] and not f["k_perm"]:
        return (
            "v_layout='natural' with backend='gluon' writes V^T in key order: with v_permute=True it needs "
            "k_perm=True (the relabelling made on K)"
        )
    if f["block_m"] == 64 and f["producer_regs"] != defaults["producer_regs"]:
        return (
            f"producer_regs={f['producer_regs']}: with one consumer warpgroup (block_m=64) "
            f"every warp gets its maximum anyway; keep the default "
            f"{defaults['producer_regs']}"
        )

    return None


def packed_p_conflict(f: Mapping[str, Any]) -> str | None:
    """Why a Gluon config with these fields cannot carry P packed (p_carry "e4m3" or "smem"), or None.
    One rule for validation and for the search space, which decodes a suggested packed carry to "f32"
    where it does not apply."""
    carry = f["p_carry"]
    in_smem = carry in P_TILES
    if in_smem and not f["overlap"]:
        return (
            f"p_carry={carry!r} hands P(j) to the PV wgmma issued with QK^T(j+1) through shared memory: it "
            "needs overlap=True"
        )
    if not (f["overlap"] or f["pv_defer"]):
        return (
            f"p_carry={carry!r} is how P is carried from one step to the next: it needs overlap=True or "
            "pv_defer=True (the plain step uses P where it is made)"
        )
    if not f["v_permute"]:
        return (
            f"p_carry={carry!r} packs P as the A operand's registers (four keys per thread, the exact "
            "softmax's roundings or lean P's codes): it needs v_permute=True"
        )
    if f["ex2_fence"] and f["rowsum"] == "mma":
        return (
            f"p_carry={carry!r} with ex2_fence=True and rowsum='mma': that fence ORs the float32 probabilities, "
            "which are packed here; use rowsum='fp32' (its fence is on the row sums) or p_carry='f32'"
        )
    if in_smem and f["block_n"] == 192:
        return f"p_carry={carry!r} holds one key part's P tile: it needs block_n a power of two, not 192"
    return None


#: why f16 scores and a halved first block exclude each other (qk_acc_conflict, half_block_conflict)
_F16_HALF_BLOCK = "the half block's scores are not built in f16; use one or the other"


def qk_acc_conflict(f: Mapping[str, Any]) -> str | None:
    """Why a Gluon config with these fields cannot accumulate its scores in f16 (qk_acc="f16"), or None.
    Built for lean P's one-FMA folds (and "corrected", on the same b) with clamp "sat" and the overlapped step
    with two P tiles (whose QK^T is then synchronous); one rule for validation and for the search space."""
    if f["softmax"] != "lean":
        return (
            "qk_acc='f16' is built for lean P (the f16 fold writes e4m3 codes; the exact softmax's f16x2 "
            "exponentials measured 0.91-0.96x its float32 ones): it needs "
            "softmax='lean'"
        )
    if f["lean_fold"] not in ("fma", "centered", "corrected") or f["lean_clamp"] != "sat":
        return (
            f"qk_acc='f16' folds as lean_fold 'fma'/'centered' with lean_clamp='sat' do (one saturating FMA; "
            f"'corrected': five more f16x2 operations); not lean_fold={f['lean_fold']!r}, "
            f"lean_clamp={f['lean_clamp']!r}"
        )
    if f["p_carry"] != "smem2":
        return f"qk_acc='f16' is built on the two-P-tile step: it needs p_carry='smem2', not {f['p_carry']!r}"
    if f["half_block"]:
        return "qk_acc='f16' with half_block=True: " + _F16_HALF_BLOCK
    return None


def qk_async_conflict(f: Mapping[str, Any]) -> str | None:
    """Why a config with these fields cannot move QK^T's wait behind PV(j-1)'s issue (qk_async=True), or None.
    One rule for validation and for the search space (which decodes a suggested True to False)."""
    if f["qk_acc"] != "f16":
        return (
            "qk_async=True moves the f16-score kernels' QK^T wait behind PV(j-1)'s issue (the float32-score "
            "kernels issue them so already): it needs qk_acc='f16'"
        )
    return None


def lean_mufu_conflict(f: Mapping[str, Any]) -> str | None:
    """Why a config with these fields cannot take a share of lean P's 2^x from the MUFU (lean_mufu > 0), or None.
    One rule for validation and for the search space (which decodes a suggested share to 0)."""
    if f["qk_acc"] != "f16" or f["softmax"] != "lean" or f["lean_fold"] not in ("corrected", "fma"):
        return (
            f"lean_mufu={f['lean_mufu']}: a share of the f16 fold's pairs from the MUFU; it needs "
            f"softmax='lean', qk_acc='f16' and lean_fold 'corrected' or 'fma', not softmax={f['softmax']!r}, "
            f"qk_acc={f['qk_acc']!r}, lean_fold={f['lean_fold']!r}"
        )
    return None


def lean_ref_conflict(f: Mapping[str, Any]) -> str | None:
    """Why a config with these fields cannot put lean P's fold line on the row's own maximum (lean_ref="max"),
    or None. One rule for validation and for the search space (which decodes a suggested "max" to "grid")."""
    if f["qk_acc"] != "f16" or f["softmax"] != "lean" or f["lean_fold"] != "fma":
        return (
            f"lean_ref={f['lean_ref']!r}: the linear f16 fold's line on the row's own maximum; it needs "
            f"softmax='lean', qk_acc='f16' and lean_fold='fma' (the float32 folds' magic constant needs the "
            f"grid; 'centered' and 'corrected' place their lines themselves), not softmax={f['softmax']!r}, "
            f"qk_acc={f['qk_acc']!r}, lean_fold={f['lean_fold']!r}"
        )
    return None


def lean_floor_conflict(f: Mapping[str, Any]) -> str | None:
    """Why a config with these fields cannot give lean P's smallest scores subnormal codes (lean_floor=True), or
    None. One rule for validation and for the search space (which decodes a suggested True to False)."""
    if f["qk_acc"] != "f16" or f["softmax"] != "lean" or f["lean_fold"] not in ("fma", "centered"):
        return (
            f"lean_floor=True: a second line beside the linear f16 fold; it needs softmax='lean', qk_acc='f16' "
            f"and lean_fold 'fma' or 'centered', not softmax={f['softmax']!r}, qk_acc={f['qk_acc']!r}, "
            f"lean_fold={f['lean_fold']!r}"
        )
    return None


def pv_defer_conflict(f: Mapping[str, Any]) -> str | None:
    """Why a Gluon config with these fields cannot pair PV(j-1) with QK^T(j) (pv_defer=True), or None.
    One rule for validation and for the search space (which decodes a suggested True to False)."""
    if f["overlap"]:
        return (
            "pv_defer=True is the plain schedule's pairing of PV(j-1) with QK^T(j): overlap=True already "
            "issues them together; it needs overlap=False"
        )
    if f["block_n"] == 256 and f["v_layout"] == "natural":
        return (
            "block_n=256 with pv_defer=True (two 128-key parts) is built for the V^T copy: it needs "
            "v_layout='transposed'"
        )
    return None


def lane_sums_conflict(f: Mapping[str, Any]) -> str | None:
    """Why a Gluon config with these fields cannot keep per-lane row sums (lane_sums=True), or None.
    One rule for validation and for the search space (which decodes a suggested True to False)."""
    if (f["softmax"], f["rowsum"]) not in (("exact", "fp32"), ("lean", "rounded")):
        return (
            f"lane_sums=True keeps float32 row sums per lane, of the exact softmax's probabilities "
            f"(rowsum='fp32') or of lean P's decoded codes (rowsum='rounded'); not softmax={f['softmax']!r} "
            f"with rowsum={f['rowsum']!r}"
        )
    if f["block_n"] == 192 or (f["block_n"] == 256 and f["pv_defer"]):
        return (
            "lane_sums=True sums one key part's scores per lane: it needs a block of one part (not block_n=192, "
            "nor 256 with pv_defer)"
        )
    if f["ex2_fence"]:
        return "lane_sums=True with ex2_fence=True: that fence is on the per-row sums; use one or the other"
    return None


def half_block_conflict(f: Mapping[str, Any]) -> str | None:
    """Why a Gluon config with these fields cannot run a first block as half a block (half_block=True),
    or None."""
    if f["pv_defer"] or f["block_n"] not in (128, 256) or (f["overlap"] and f["p_carry"] not in P_TILES):
        return (
            "half_block=True halves a first block: it needs pv_defer=False, block_n 128 or 256 (one key part), "
            "and the plain schedule (overlap=False) or P in shared memory (p_carry 'smem' or 'smem2')"
        )
    if f.get("qk_acc", "f32") == "f16":  # (the search space decodes half_block before qk_acc: hence both rules)
        return "half_block=True with qk_acc='f16': " + _F16_HALF_BLOCK
    return None


def o_split_conflict(f: Mapping[str, Any]) -> str | None:
    """Why a Gluon config with these fields cannot hold O in a 64- and a 32-column part (o_split=True),
    or None. One rule for validation and for the search space (which decodes a suggested True to False)."""
    if f["head_dim_v"] != 96:
        return (
            f"o_split=True splits a 96-column O into 64 + 32 columns: it needs head_dim_v=96, not "
            f"{f['head_dim_v']} (other head dims are one power-of-two accumulator)"
        )
    if f["block_n"] == 192 or (f["block_n"] == 256 and f["pv_defer"]):
        return "o_split=True is built for blocks of one key part: not block_n=192, nor 256 with pv_defer"
    if f["v_layout"] == "natural":
        return "o_split=True reads the V^T copy in two row boxes: it needs v_layout='transposed'"
    return None


def o_through_p_conflict(f: Mapping[str, Any]) -> str | None:
    """Why a Gluon config with these fields cannot store its output through its two P tiles in chunks
    (o_through_p=True), or None. One rule for validation and for the search space."""
    if f["p_carry"] != "smem2" or f["o_split"]:
        return (
            "o_through_p=True stores O through the warpgroup's two P tiles: it needs p_carry='smem2' and "
            "one O part (o_split=False)"
        )
    width = o_width(int(f["head_dim_v"]))
    if width != f["head_dim_v"]:
        return (
            f"o_through_p=True stores O in column chunks of its own width: head_dim_v={f['head_dim_v']} is "
            f"padded to {width} columns (stored through a clipped 4-D box)"
        )
    if f["block_n"] >= 2 * width:
        return (
            f"o_through_p=True: at block_n={f['block_n']} the 64 x {width} output tile already lives in the "
            f"first P tile"
        )
    if width // (f["block_n"] // 2) > 4:
        return (
            f"o_through_p=True at block_n={f['block_n']}: {width} columns would take "
            f"{width // (f['block_n'] // 2)} chunks of {f['block_n'] // 2}; at most 4"
        )
    return None
