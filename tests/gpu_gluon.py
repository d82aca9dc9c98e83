"""What the Gluon GPU tests share: the seed, the error bounds against float64 and FA3-fp8's error on
the same inputs, the check every kernel passes, twins of a variant, error per input family, and a
dispatcher over a one-entry database."""

from __future__ import annotations

import torch

from zyfa_tune import flash_attn_func
from zyfa_tune.db import ProblemKey, TrialResult, current_fingerprint, open_store
from zyfa_tune.generator import emit
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels import dispatch
from zyfa_tune.quantize import quantize_fp8
from zyfa_tune.search_spaces.seeds import gluon_defer_config, gluon_smem2_config, gluon_wide_config
from zyfa_tune.tuning.inputs import make_qkv
from zyfa_tune.tuning.reference import attention_reference, rel_l2
from zyfa_tune.tuning.verify import make_inputs

GLUON = default_config("fp8", 128, 128, "gluon")


#: the seed schedule, the same without the key permutation (P carried as e4m3 through shuffles), and
#: the other branch of every schedule choice at once (one consumer, no overlap, no ping-pong, plain
#: V^T, one program per tile, forward order, 2-deep Q ring, 2-stage 64-key K/V ring)
CONFIGS = {
    "seed": GLUON,
    "noperm": GLUON.replace(v_permute=False),
    "plain": GLUON.replace(
        block_m=64,
        ping_pong=False,
        overlap=False,
        v_permute=False,
        persistent=False,
        q_order="forward",
        q_stages=2,
        num_stages=2,
        block_n=64,
    ),
    # the row sum of the e4m3-rounded probabilities by an MMA against ones (overlapped and plain step)
    "rowsum-mma": GLUON.replace(rowsum="mma"),
    "plain-mma": GLUON.replace(
        block_m=64,
        ping_pong=False,
        overlap=False,
        v_permute=False,
        persistent=False,
        q_order="forward",
        q_stages=2,
        num_stages=2,
        block_n=64,
        rowsum="mma",
    ),
    # warps whose row maxima stayed skip O's rescale (a vote and a uniform branch in inline PTX)
    "skip-rescale": GLUON.replace(skip_rescale=True),
    "plain-skip": GLUON.replace(
        block_m=64,
        ping_pong=False,
        overlap=False,
        v_permute=False,
        persistent=False,
        q_order="forward",
        q_stages=2,
        num_stages=2,
        block_n=64,
        skip_rescale=True,
    ),
    "mma-skip-lean": GLUON.replace(softmax="lean", rowsum="mma", skip_rescale=True),
    # 256-key blocks, no intra-warpgroup overlap (the FP8 space's third seed)
    "wide": gluon_wide_config("fp8", 128, 128),
    "wide-mma-skip": gluon_wide_config("fp8", 128, 128).replace(rowsum="mma", skip_rescale=True),
    # V read as given: the producer warpgroup writes each block's transpose into the V^T ring
    "natural": GLUON.replace(v_permute=False, v_layout="natural", producer_regs=40),
    "natural-plain": GLUON.replace(
        block_m=64,
        ping_pong=False,
        overlap=False,
        v_permute=False,
        persistent=False,
        q_order="forward",
        q_stages=2,
        num_stages=2,
        block_n=64,
        v_layout="natural",
    ),
    "natural-no-overlap": GLUON.replace(
        overlap=False,
        ping_pong=False,
        q_stages=2,
        num_stages=2,
        rowsum="mma",
        v_permute=False,
        v_layout="natural",
        producer_regs=40,
    ),
    # ex2_fence under the row-sum MMA: a barrier on the OR of all probabilities (every exponential
    # before the PV wait); lean P likewise on its FMA outputs
    "mma-fence": GLUON.replace(rowsum="mma", ex2_fence=True),
    "split-mma-fence": GLUON.replace(
        block_n=192, num_stages=3, ping_pong=False, skip_rescale=True, rowsum="mma", ex2_fence=True
    ),
    "lean-fence": GLUON.replace(softmax="lean", rowsum="mma", skip_rescale=True, ex2_fence=True),
    # ping-pong turns on hardware named barriers (FA3's warp scheduler barrier), not mbarriers
    "named-turns": GLUON.replace(turn_barrier="named"),
    # plain steps with PV(j-1) issued together with QK^T(j), one wait per step
    "defer-pp": GLUON.replace(overlap=False, pv_defer=True),
    "defer-split": GLUON.replace(
        block_n=192,
        num_stages=2,
        q_stages=2,
        ping_pong=False,
        overlap=False,
        pv_defer=True,
        rowsum="mma",
        skip_rescale=True,
    ),
    # 256-key blocks with pv_defer: two 128-key parts, the second QK^T issued after the PV wait
    "defer-256": GLUON.replace(
        block_n=256,
        num_stages=2,
        q_stages=2,
        ping_pong=False,
        overlap=False,
        pv_defer=True,
        rowsum="mma",
        skip_rescale=True,
    ),
    "defer-256-fp32": GLUON.replace(
        block_n=256, num_stages=2, q_stages=2, ping_pong=False, overlap=False, pv_defer=True
    ),  # O rescaled in place without the skip
    # 192-key blocks: a 128-key and a 64-key part (two QK^T accumulators, two PV wgmmas)
    "split": GLUON.replace(block_n=192, num_stages=2),
    "split-mma-skip": GLUON.replace(block_n=192, num_stages=2, rowsum="mma", skip_rescale=True),
    "split-plain": GLUON.replace(
        block_n=192,
        overlap=False,
        ping_pong=False,
        rowsum="mma",
        num_stages=2,
        q_stages=2,
        v_permute=False,
        q_order="forward",
    ),
}


#: P carried packed as e4m3 (four keys per register) from one step's softmax to the next step's PV
CONFIGS["carry-e4m3"] = GLUON.replace(p_carry="e4m3")


#: P through shared memory with half-empty first blocks halved: their causal mask has no key-end compare
#: (rows past the queries' end see keys past Sk; unequal lengths below), two 256-key P tiles or one 128-key one
CONFIGS["smem2-half"] = gluon_smem2_config("fp8", 128, 128)


CONFIGS["smem-half"] = GLUON.replace(p_carry="smem", half_block=True)


#: rel. L2 vs float64 and factor over FA3's error per config (lean P: its linear fold, see LEAN_BOUNDS)
BOUNDS = {"mma-skip-lean": (0.045, 1.6), "lean-fence": (0.045, 1.6)}


#: rel. L2 vs float64 that any FP8 exact-softmax kernel here stays under (tests/test_gpu_attention.py)
FP8_BOUND = 0.03


def fa3_error(args, kw, ref, causal):
    try:
        import fa3_fwd_interface as fa3
    except ImportError:
        return None
    r = fa3.flash_attn_func(*args, causal=causal, **kw)
    return rel_l2(r[0] if isinstance(r, tuple) else r, ref)


def check(cfg, b, sq, sk, h, hk, causal=True, seed=0, vs_fa3=True, bound=FP8_BOUND, fa3_factor=1.1):
    d = cfg.head_dim_v
    args, kw = make_inputs("fp8", cfg.head_dim_qk, d, batch=b, heads=h, kv_heads=hk, seqlen=sq, seqlen_k=sk, seed=seed)
    ref = attention_reference(*args, causal=causal, **kw)
    out = flash_attn_func(*args, causal=causal, config=cfg, **kw)
    assert out.dtype == torch.bfloat16 and out.shape == (b, sq, h, d)
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    err = rel_l2(out, ref)
    theirs = fa3_error(args, kw, ref, causal) if vs_fa3 else None
    print(
        f"\n{cfg.to_json()[:60]}.. B={b} Sq={sq} Sk={sk} H={h}/{hk} causal={causal}: rel L2 {err:.4e}"
        + (f" FA3 {theirs:.4e} ({err / theirs:.3f}x)" if theirs else ""),
        end="",
    )
    assert err < bound, f"rel L2 {err:.3e}"
    if theirs is not None:
        assert err <= fa3_factor * theirs, f"rel L2 {err:.4e} > {fa3_factor} x FA3's {theirs:.4e}"
    return out


#: lean P (Gluon): the linear folds' codes are the e4m3 rounding of a straight line between powers of
#: two (up to 6% high), ~1.35x the exact error; the corrected fold matches exact;
#: the centered fold (the same line lowered by 7/16 code) removes the mean bias, which cancels in the
#: normalisation anyway: measured 1.33-1.37x FA3 (fma: 1.36-1.40x)
LEAN = GLUON.replace(softmax="lean", rowsum="mma")


LEAN_BOUNDS = {"fma": (0.045, 1.6), "sub_fma": (0.045, 1.6), "corrected": (FP8_BOUND, 1.1), "centered": (0.045, 1.6)}


#: packed-P kernels of every head dim and carrying schedule (overlap with and without ping-pong, three
#: consumers, 192-key blocks, pv_defer at 128 and 256 keys)
PACKED = {
    "seed": GLUON,
    "192/128": default_config("fp8", 192, 128, "gluon"),
    "64-three": default_config("fp8", 64, 64, "gluon").replace(
        block_m=192, ping_pong=False, rowsum="mma", skip_rescale=True
    ),
    "192-keys": GLUON.replace(block_n=192, num_stages=3, ping_pong=False, skip_rescale=True),
    "256-defer": gluon_defer_config("fp8", 256, 256).replace(p_carry="f32"),
    "wide-defer": gluon_wide_config("fp8", 128, 128).replace(pv_defer=True),
}


#: (seqlen_q, seqlen_k, causal) a variant and its twin are compared on: tiny, ragged causal, non-causal
#: with more keys, 4K
TWIN_SHAPES = [(17, 17, True), (1000, 1000, True), (300, 1100, False), (4096, 4096, True)]


def variant_and_twin(variant, twin, sq, sk, causal):
    """`variant` checked against float64 (and FA3's error where the shape is long enough), and the
    output of `twin`, the same schedule without the variant's change, on the same inputs."""
    out = check(variant, 2, sq, sk, 4, 2, causal=causal, vs_fa3=min(sq, sk) >= 128)
    args, kw = make_inputs(
        "fp8", twin.head_dim_qk, twin.head_dim_v, batch=2, heads=4, kv_heads=2, seqlen=sq, seqlen_k=sk, seed=0
    )
    return out, flash_attn_func(*args, causal=causal, config=twin, **kw)


def family_errors(cfg, twin, family: str, seqlen: int, seed: int, smooth_k: bool = False) -> tuple[float, float]:
    """cfg and twin on `family` inputs quantised by quantize_fp8: their errors against the quantised inputs'
    float64 attention (kernel error only); cfg's output must be finite."""
    q, k, v = make_qkv(
        family, batch=1, seqlen=seqlen, heads=4, kv_heads=4, head_dim_qk=128, head_dim_v=128, seed=seed, device="cuda"
    )
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v, smooth_k=smooth_k)
    args, kw = (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd)
    ref = attention_reference(*args, causal=True, **kw)
    out = flash_attn_func(*args, causal=True, config=cfg, **kw)
    assert torch.isfinite(out).all()
    return rel_l2(out, ref), rel_l2(flash_attn_func(*args, causal=True, config=twin, **kw), ref)


def f16_family_errors(cfg, family: str, seqlen: int, seed: int, smooth_k: bool = False) -> tuple[float, float]:
    """family_errors of cfg on f16 scores against cfg itself (its float32-score twin)."""
    return family_errors(cfg.replace(qk_acc="f16"), cfg, family, seqlen, seed, smooth_k)


def dispatch_from(tmp_path, monkeypatch, entries, batch: int, seqlen: int) -> None:
    """Make the dispatcher read only a fresh database holding `entries` ((config, median ms), hd128 FP8
    causal, 8 heads) for that batch and sequence length."""
    key = ProblemKey.from_shape(
        dtype="fp8", head_dim_qk=128, head_dim_v=128, causal=True, batch=batch, heads=8, kv_heads=8, seqlen=seqlen
    )
    with open_store(tmp_path / "t.db") as store:
        for cfg, ms in entries:
            store.record_trial(
                current_fingerprint(),
                key,
                cfg,
                TrialResult(status="ok", median_ms=ms, tflops=1.0 / ms),
                source_hash=emit(cfg).source_hash,
                study="gpu-test",
            )
    monkeypatch.setattr(dispatch, "_dispatcher", dispatch.Dispatcher([str(tmp_path / "t.db")]))
