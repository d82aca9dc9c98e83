"""generator/ptx_pass.py (CPU): the qk_async pass over Triton's PTX moves an f16-accumulator QK^T's wait behind the
next issue's `wait_group 1`, and changes nothing in any other shape; its hook asks for it by kernel name only,
and a kernel that asked and got nothing is an error. The compiled kernels' SASS: tests/test_gluon_compile.py."""

from __future__ import annotations

import pytest

from zyfa_tune.generator import ConfigError, emit, ptx_pass
from zyfa_tune.generator.emitted import KERNEL_NAME, kernel_name_of
from zyfa_tune.generator.ptx_pass import QK_ASYNC_SUFFIX, PtxPassError, async_f16_qk
from zyfa_tune.search_spaces.seeds import gluon_lean_f16_config, gluon_smem2_config


def _wait(n: int, regs: str = "%r1,%r2,%r3,%r4") -> str:
    return (
        f"\t// begin inline asm\n\t// wait for regs: {regs}\n\twgmma.wait_group.sync.aligned {n};\n"
        "\t// end inline asm\n"
    )


def _mma(acc: str, d: str = "{%r1,%r2,%r3,%r4}") -> str:
    return f"\twgmma.mma_async.sync.aligned.m64n16k32.{acc}.e4m3.e4m3 {d}, %rd1, %rd2, 0, 1, 1;\n"


SPLITS = "".join(f"\tmov.b32 \t{{%rs{2 * k}, %rs{2 * k + 1}}}, %r{k + 1};\n" for k in range(4))
BETWEEN = "\tmbarrier.try_wait.parity.shared.b64 complete, [%r9], %r8;\n\twgmma.fence.sync.aligned;\n"


def step(qk_acc: str = "f16", between: str = BETWEEN, next_wait: int = 1) -> str:
    """A two-P-tile step's shape: QK^T issued and waited for at once, its accumulator split, PV(j-1) issued,
    the wait for all but PV's group, then the softmax reading the halves."""
    return (
        "\twgmma.fence.sync.aligned;\n"
        + _mma(qk_acc)
        + _mma(qk_acc)
        + "\twgmma.commit_group.sync.aligned;\n"
        + _wait(0)
        + SPLITS
        + between
        + _mma("f32", "{%r20,%r21,%r22,%r23}")
        + "\twgmma.commit_group.sync.aligned;\n"
        + _wait(next_wait, "%r20")
        + "\tmax.f16x2 %r30, %rs0, %rs2;\n"
    )


def test_the_wait_moves_behind_the_next_issue():
    ptx = ".visible .entry zyfa_attn_fwd_qk_async()\n{\n" + step() + step() + "}\n"
    out, changed = async_f16_qk(ptx)
    assert changed == 2 and out.count("wait_group.sync.aligned 0") == 0 and out.count("wait_group.sync.aligned 1") == 2
    for block in out.split("\twgmma.fence.sync.aligned;\n" + _mma("f16"))[1:]:
        assert block.index("wait_group.sync.aligned 1") < block.index("mov.b32") < block.index("max.f16x2")
        assert block.index(BETWEEN.splitlines()[0]) < block.index("wait_group.sync.aligned 1")
    assert sorted(out.splitlines()) == sorted(ptx.replace(_wait(0), "").splitlines())  # moved, nothing else


@pytest.mark.parametrize(
    "why, ptx",
    [
        ("float32 accumulator", step(qk_acc="f32")),
        ("a half read before the wait", step(between=BETWEEN + "\tmov.b32 %r40, {%rs2, %rs3};\n")),
        ("a half read (the last)", step(between="\tadd.f16 %rs9, %rs7, %rs7;\n" + BETWEEN)),
        ("another wait in between", step(between=_wait(0, "%r50") + BETWEEN)),
        ("the next wait is for everything", step(next_wait=0)),
        ("no issue in between", step().replace(_mma("f32", "{%r20,%r21,%r22,%r23}"), "")),
    ],
)
def test_other_shapes_are_left_alone(why, ptx):
    assert async_f16_qk(ptx) == (ptx, 0), why


def test_the_stage_runs_the_pass_for_its_kernels_only():
    ptx = step()
    stage = ptx_pass._ptx_stage(lambda src, metadata: ptx)
    assert stage(None, {"name": "zyfa_attn_fwd"}) == ptx
    assert stage(None, {"name": "someone_elses_kernel"}) == ptx
    assert stage(None, {"name": "zyfa_attn_fwd" + QK_ASYNC_SUFFIX}) == async_f16_qk(ptx)[0] != ptx
    nothing = ptx_pass._ptx_stage(lambda src, metadata: step(qk_acc="f32"))
    with pytest.raises(PtxPassError, match="found no f16 QK"):
        nothing(None, {"name": "zyfa_attn_fwd" + QK_ASYNC_SUFFIX})


def test_install_chains_a_hook_once(monkeypatch):
    from triton import knobs

    seen = []
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", lambda *args: seen.append(args[1]))
    ptx_pass.install()
    ptx_pass.install()  # idempotent: the second call sees its own hook
    stages = {"ptx": lambda src, metadata: step()}
    knobs.runtime.add_stages_inspection_hook("backend", stages, None, None, 90)
    assert seen == [stages] and getattr(stages["ptx"], "_zyfa_ptx_pass", False)
    knobs.runtime.add_stages_inspection_hook("backend", stages, None, None, 90)  # a stage already wrapped
    assert stages["ptx"](None, {"name": "zyfa_attn_fwd" + QK_ASYNC_SUFFIX}).count("wait_group.sync.aligned 0") == 0
    assert ptx_pass.ptx_pass_available()


def test_qk_async_config_names_its_kernel():
    lean = gluon_lean_f16_config("fp8", 128, 128)
    assert kernel_name_of(lean) == KERNEL_NAME and emit(lean).kernel_name == KERNEL_NAME
    fast = lean.replace(qk_async=True)
    kernel = emit(fast)
    assert kernel.kernel_name == KERNEL_NAME + QK_ASYNC_SUFFIX and f"def {kernel.kernel_name}(" in kernel.source
    assert kernel.source_hash != emit(lean).source_hash and "qkAsync" in fast.summary()
    assert fast.to_dict()["qk_async"] is True and "qk_async" not in lean.to_dict()
    with pytest.raises(ConfigError, match="needs qk_acc='f16'"):
        gluon_smem2_config("fp8", 128, 128).replace(qk_async=True)
