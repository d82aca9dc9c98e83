"""The PTX text of O's in-place rescale (generator/asm/rescale.py) and of ex2_fence's barriers
(generator/asm/fence.py): operands wired as the kernel passes them, bad arguments rejected."""

from __future__ import annotations

import re

import pytest


def test_rescale_asm_text():
    from zyfa_tune.generator.asm.rescale import rescale_asm, rescale_constraints

    text = rescale_asm(8)
    assert "setp.ne.f32 p, $16, 0f3F800000;" in text and "setp.ne.or.f32 p, $18, 0f3F800000, p;" in text
    assert text.count("mul.f32") == 8 and "mul.f32 $7, $7, $23;" in text
    assert rescale_constraints(8).split(",") == ["=r"] * 8 + [str(i) for i in range(8)] + ["r"] * 8
    for bad in (0, 6, 8.0, True):
        with pytest.raises(ValueError, match="multiple of 4"):
            rescale_asm(bad)
    always = rescale_asm(8, skip=False)  # in place, no test or branch: a 256-key pv_defer block's rescale
    assert always.count("mul.f32") == 8 and "vote" not in always and "bra" not in always and "SKIP" not in always


def test_fence_asm_text():
    from zyfa_tune.generator.asm.fence import fence_barrier, p_fence_asm, p_fence_constraints, row_sum_fence_asm

    assert [fence_barrier(k) for k in range(3)] == [15, 14, 13]
    rows = row_sum_fence_asm(14)
    assert "bar.red.and.pred q, 14, 128, p;" in rows and "setp.geu.and.f32 p, $3, 0f00000000, p;" in rows
    with pytest.raises(ValueError):
        fence_barrier(3)

    text = p_fence_asm(8, 15)
    ors = re.findall(r"(?:lop3\.b32|or\.b32) acc, ([^;]*);", text)
    operands = {op.strip() for line in ors for op in line.split(",")} - {"acc", "0xFE"}
    assert operands == {f"${k}" for k in range(8, 16)}  # every input register is read
    assert "bar.red.and.pred q, 15, 128, p;" in text and "setp.ne.b32 p, acc, 0;" in text
    assert p_fence_constraints(4).split(",") == ["=r"] * 4 + ["0", "1", "2", "3"]
    for n, barrier in ((2, 15), (7, 15), (8, 12), (8.0, 15), (8, True)):
        with pytest.raises(ValueError):
            p_fence_asm(n, barrier)
