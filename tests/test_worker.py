"""Isolated trial workers (zyfa_tune.tuning.worker) and their runners (zyfa_tune.tuning.runners), on the CPU:
injected faults (exception, hang, exit, segfault) give the right status and the worker goes on with
a fresh child; the simulation runner answers stored GPU measurements and deterministic synthetic ones
with real sm_90a compiles (spills and shared memory overflow are compile errors); invalid config
text never runs; close() leaves no process; a child killed from outside is replaced. The last test
runs the real GPU runner (marked gpu)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from zyfa_tune.db import open_store
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.kernels import dispatch
from zyfa_tune.tuning import compile_check, gpu_runner, runners, simulation
from zyfa_tune.tuning.worker import Shape, Task, Worker, WorkerError

SHIPPED = str(Path(dispatch.TUNED_DIR) / "h200.db")
SIMULATE = f"simulate:{SHIPPED}"
BIG = Shape(batch=1, heads=32, kv_heads=32, seqlen=16384)
SMALL = Shape(batch=4, heads=32, kv_heads=32, seqlen=4096)
FP8 = default_config("fp8", 128, 128)
#: compiles for sm_90a with 255 registers and 192 bytes of spills
SPILLS = FP8.replace(block_m=128, num_warps=4, block_n=128)
#: no spills, but 336896 bytes of shared memory (sm_90: 232448)
TOO_MUCH_SMEM = FP8.replace(block_n=256, num_stages=5)


def stored_trial(dtype="fp8", dims=(128, 128), seqlen=16384) -> dict:
    """The stored trial of the best entry of (dtype, dims) at `seqlen` in the shipped database."""
    with open_store(SHIPPED, readonly=True, create=False) as store:
        best = [e for e in store.best_entries(dtype=dtype, head_dims=dims) if e.seqlen == seqlen]
        (entry,) = best
        rows = [t for t in store.trials() if t["config_json"] == entry.config_json and t["seqlen"] == seqlen]
    return rows[0]


def gone(pid: int) -> bool:
    """No such process, or only its zombie (an orphan's new parent may not reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@pytest.fixture(scope="module")
def simulated():
    with Worker(runner=SIMULATE, timeout_s=120) as w:
        yield w


# ---- arguments ---------------------------------------------------------------------------------


def test_task_and_runner_validation():
    with pytest.raises(ValueError, match="kv_heads"):
        Shape(batch=1, heads=32, kv_heads=5, seqlen=128)
    with pytest.raises(ValueError, match="seqlen"):
        Shape(batch=1, heads=1, kv_heads=1, seqlen=0)
    with pytest.raises(ValueError, match="batch"):
        Shape(batch=True, heads=1, kv_heads=1, seqlen=8)
    with pytest.raises(ValueError, match="shapes"):
        Task(FP8.to_json(), ())
    with pytest.raises(ValueError, match="gate"):
        Task(FP8.to_json(), (BIG,), gate=float("nan"))
    assert Task(FP8.to_json(), [BIG]).shapes == (BIG,)  # a list becomes a tuple
    for bad in (
        "cpu",
        "replay:",
        "replay:/no/such.db",
        "fault:boom",
        "fault:hang@num_stages=7",
        "fault:hang@colour=red",
        "fault:hang@seqlen=x",
    ):
        with pytest.raises(ValueError, match="runner"):
            runners.parse_runner(bad)
    assert (
        runners.parse_runner("simulate")
        == runners.parse_runner(f"replay:{SHIPPED}")
        == runners.RunnerSpec("simulate", db=SHIPPED)
    )  # "replay" is the simulation's older name
    spec = runners.parse_runner("fault:hang@num_stages=4")
    assert (spec.fault, spec.field, spec.value, spec.db) == ("hang", "num_stages", "4", SHIPPED)
    with pytest.raises(ValueError, match="timeout_s"):
        Worker(runner=SIMULATE, timeout_s=0)
    with pytest.raises(ValueError, match="start_method"):
        Worker(runner=SIMULATE, start_method="forkserver")


# ---- faults ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode,status,words",
    [
        ("raise", "crash", "ValueError: injected fault"),
        ("hang", "timeout", "no answer within 5 s"),
        ("exit", "crash", "exit code 17"),
        ("segv", "crash", "SIGSEGV"),
    ],
)
def test_fault_gives_its_status_and_the_worker_goes_on(mode, status, words):
    # the fault hits the second shape only: the first keeps its (stored) result
    cfg = stored_trial(seqlen=4096)["config_json"]
    with Worker(runner=f"fault:{mode}@seqlen=16384", timeout_s=5) as w:
        first = w.pid
        results = w.run(Task(cfg, (SMALL, BIG)))
        assert [r.status for r in results] == ["ok", status]
        assert results[0].message.startswith("simulate: stored trial")
        assert words in results[1].message
        assert (results[1].batch, results[1].heads, results[1].seqlen) == (1, 32, 16384)
        assert w.restarts == 1 and w.pid != first and gone(first)
        again = w.run(Task(cfg, (SMALL,)))  # a fresh child serves the next task
        assert [r.status for r in again] == ["ok"] and again[0].median_ms == results[0].median_ms
        assert w.restarts == 1


def test_config_level_fault_spares_other_configs():
    with Worker(runner="fault:raise@num_stages=4", timeout_s=60) as w:
        (r,) = w.run(Task(FP8.replace(num_stages=4).to_json(), (SMALL,)))
        assert r.status == "crash" and "injected fault: raise (num_stages=4)" in r.message
        assert "Traceback" in r.message
        spared = stored_trial(seqlen=4096)["config_json"]
        assert '"num_stages":4' not in spared
        (r,) = w.run(Task(spared, (SMALL,)))
        assert r.status == "ok" and w.restarts == 1


# ---- simulation runner -------------------------------------------------------------------------


def test_simulation_returns_the_stored_trial(simulated):
    row = stored_trial("fp8", (128, 128), 16384)
    (r,) = simulated.run(Task(row["config_json"], (BIG,)))
    assert r.status == "ok" and r.message.startswith(f"simulate: stored trial #{row['id']}")
    assert (r.median_ms, r.tflops, r.error_rel_l2) == (row["median_ms"], row["tflops"], row["error_rel_l2"])
    assert (r.batch, r.heads, r.seqlen) == (1, 32, 16384)
    # same problem class (seqlen bucket 16384, B*H bucket 32), other shape: times scaled by FLOPs
    (s,) = simulated.run(Task(row["config_json"], (Shape(batch=1, heads=32, kv_heads=32, seqlen=12288),)))
    assert s.status == "ok" and "scaled" in s.message and s.tflops == r.tflops
    assert s.median_ms == pytest.approx(r.median_ms * (12288 / 16384) ** 2)


def test_simulation_synthetic_is_deterministic_and_real_compiles(simulated):
    cfg = FP8.replace(num_stages=2, q_order="forward")
    task = Task(cfg.to_json(), (SMALL, BIG), seed=3)
    first = simulated.run(task)
    assert [r.status for r in first] == ["ok", "ok"]
    assert all(r.message.startswith("simulate: synthetic") and "191 registers" in r.message for r in first)
    assert first[1].tflops > first[0].tflops  # longer sequences run faster in the model too
    with Worker(runner=SIMULATE, timeout_s=120) as other:  # another process, same numbers
        assert other.run(task) == first
    # lean P: more error than the exact default allows (as measured on the H200)
    lean = FP8.replace(softmax="lean", rowsum="rounded")
    (w,) = simulated.run(Task(lean.to_json(), (SMALL,)))
    assert w.status == "wrong" and w.error_rel_l2 > 0.025 and "error" in w.message
    (ok,) = simulated.run(Task(lean.to_json(), (SMALL,), gate=2.0))
    assert ok.status == "ok"


def test_simulation_spills_and_shared_memory_are_compile_errors(simulated):
    results = simulated.run(Task(SPILLS.to_json(), (SMALL, BIG)))
    assert [r.status for r in results] == ["compile_error"] * 2
    assert "spills 192 bytes" in results[0].message
    (r,) = simulated.run(Task(TOO_MUCH_SMEM.to_json(), (SMALL,)))
    assert r.status == "compile_error" and "shared memory, Required: 336896" in r.message
    assert simulated.restarts == 0


def test_compile_exceptions_are_compile_errors(monkeypatch):
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import PTXASError

    from zyfa_tune.generator import build

    def fail(exc):
        def compile_for_target(kernel, causal=True):
            raise exc

        return compile_for_target

    monkeypatch.setattr(build, "compile_for_target", fail(PTXASError("ptxas fatal: too many resources")))
    check = compile_check._compile_check(FP8, True)
    assert check.error is not None and "ptxas fatal" in check.error
    monkeypatch.setattr(build, "compile_for_target", fail(CompilationError("src", None, "bad dot")))
    assert "bad dot" in compile_check._compile_check(FP8, True).error
    monkeypatch.setattr(build, "compile_for_target", fail(FileNotFoundError("cuobjdump")))
    with pytest.raises(FileNotFoundError):  # a broken installation is not the variant's fault
        compile_check._compile_check(FP8, True)


def test_compile_checks_are_kept_per_source_and_toolchain(tmp_path, monkeypatch):
    """A verdict is stored under cache_dir()/checks keyed by source hash, causal and Triton's version:
    read back without compiling; a damaged or ill-typed file is redone, never trusted; a config with
    other source or the other causal specialisation is compiled afresh."""
    from zyfa_tune.generator import emit

    monkeypatch.setenv("ZYFA_TUNE_CACHE", str(tmp_path))
    calls = []
    verdicts = {
        True: compile_check.CompileCheck(None, 168, 0, 1024),
        False: compile_check.CompileCheck("spills 8 bytes", 255, 8, 9),
    }
    monkeypatch.setattr(
        compile_check, "_compile_check", lambda c, causal: calls.append((c, causal)) or verdicts[causal]
    )
    assert compile_check.compile_check(FP8, True) == verdicts[True] and len(calls) == 1
    assert compile_check.compile_check(FP8, True) == verdicts[True] and len(calls) == 1  # read back
    assert compile_check.compile_check(FP8, False) == verdicts[False] and len(calls) == 2
    other = FP8.replace(num_stages=FP8.num_stages + 1)
    assert emit(other).source_hash != emit(FP8).source_hash
    compile_check.compile_check(other, True)
    assert len(calls) == 3
    (path,) = [p for p in (tmp_path / "checks").iterdir() if p.name.startswith(emit(FP8).source_hash + "-causal-")]
    for damaged in (
        "{not json",
        '{"error": 5, "registers": 1, "spill_bytes": 0, "shared_bytes": 0}',
        '{"error": null, "registers": "1; import os", "spill_bytes": 0, "shared_bytes": 0}',
        "[]",
    ):
        path.write_text(damaged)
        assert compile_check.compile_check(FP8, True) == verdicts[True]
        assert compile_check.CompileCheck(**json.loads(path.read_text())) == verdicts[True]  # rewritten
    assert len(calls) == 7


def test_gpu_error_classification():
    import triton
    from triton.runtime.errors import OutOfResources

    assert gpu_runner.is_cuda_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert gpu_runner.is_cuda_error(RuntimeError("Triton Error [CUDA]: misaligned address"))
    assert not gpu_runner.is_compile_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert gpu_runner.is_compile_error(OutOfResources(300000, 232448, "shared memory"))
    # an MLIR pass failure is a plain RuntimeError raised inside triton/compiler
    where = str(Path(triton.__file__).parent / "compiler" / "compiler.py")
    try:
        exec(compile("raise RuntimeError('PassManager::run failed')", where, "exec"))
    except RuntimeError as exc:
        assert gpu_runner.is_compile_error(exc)
    try:
        raise KeyError("somewhere else")
    except KeyError as exc:
        assert not gpu_runner.is_compile_error(exc)


def test_nvml_follows_the_visible_gpu(monkeypatch):
    """Inside a child CUDA device 0 is the worker's GPU; NVML must be read for that GPU."""
    from types import SimpleNamespace as NS

    import torch

    from zyfa_tune.tuning import timing

    class FakeNvml:
        def nvmlDeviceGetHandleByIndex(self, index):
            return f"index {index}"

        def nvmlDeviceGetHandleByPciBusId(self, bus):
            if not isinstance(bus, bytes):  # like nvidia-ml-py: c_char_p needs bytes
                raise TypeError("bytes or integer address expected instead of str instance")
            return f"pci {bus.decode()}"

    nv = FakeNvml()
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: NS(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    )
    assert timing._nvml_device(nv, 0) == "pci 00000000:3B:00.0"

    def no_pci(d):
        raise AttributeError("pci_bus_id")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_pci)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert timing._nvml_device(nv, 0) == "index 5"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert timing._nvml_device(nv, 1) == "index 1"


def test_synthetic_model_is_near_the_measured_defaults():
    # the model puts the fp8 hd128 default at B=1 S=16K near its H200 measurements (about 700 TFLOP/s)
    tf = simulation.synthetic_tflops(FP8, BIG, True)
    assert 600 < tf < 800
    assert simulation.synthetic_measurement(FP8, BIG, True, 1.25)["status"] == "ok"
    assert simulation.synthetic_measurement(FP8.replace(p_scale_log2=0), BIG, True, 1.25)["status"] == "wrong"
    assert simulation.unit_hash("a", 1) == simulation.unit_hash("a", 1) != simulation.unit_hash("a", 2)


# ---- configs that must never run ---------------------------------------------------------------


def test_invalid_config_text_is_a_compile_error_and_nothing_runs(simulated, tmp_path):
    marker = tmp_path / "pwned"
    payload = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    injected = dict(FP8.to_dict(), softmax=f'exact"); {payload} #')
    texts = [
        payload,
        json.dumps(injected),
        json.dumps(dict(FP8.to_dict(), evil=payload)),
        json.dumps(dict(FP8.to_dict(), block_m=True)),
        "[]",
        "",
    ]
    for text in texts:
        results = simulated.run(Task(text, (SMALL, BIG)))
        assert [r.status for r in results] == ["compile_error"] * 2, text
        assert results[0].message.startswith("invalid config:")
    assert not marker.exists()
    assert simulated.restarts == 0


# ---- process lifecycle -------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")
def test_close_is_idempotent_and_leaves_no_process():
    w = Worker(runner=SIMULATE, timeout_s=60)
    pid = w.pid
    assert isinstance(pid, int) and not gone(pid)
    w.close()
    w.close()
    assert w.pid is None and gone(pid)
    with pytest.raises(WorkerError, match="closed"):
        w.run(Task(FP8.to_json(), (SMALL,)))
    with Worker(runner=SIMULATE, start_method="fork") as f:  # context manager, fork start
        pid = f.pid
    assert gone(pid)


def test_child_killed_between_tasks_is_replaced():
    cfg = stored_trial(seqlen=4096)["config_json"]
    with Worker(runner=SIMULATE, timeout_s=60) as w:
        (before,) = w.run(Task(cfg, (SMALL,)))
        pid = w.pid
        os.kill(pid, signal.SIGKILL)
        (after,) = w.run(Task(cfg, (SMALL,)))
        assert after == before and after.status == "ok"
        assert w.restarts == 1 and w.pid != pid and gone(pid)


_HANGING_PARENT = """
import sys
from zyfa_tune.generator.defaults import default_config
from zyfa_tune.tuning.worker import Shape, Task, Worker

w = Worker(runner="fault:hang", timeout_s=600, start_method=sys.argv[1])
w.wait_ready()
print(w.pid, flush=True)
w.run(Task(default_config("fp8", 128, 128).to_json(), (Shape(1, 32, 32, 4096),)))
"""


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_a_child_dies_with_its_killed_parent_even_in_a_hung_task(tmp_path, start_method):
    """A tuner killed while its worker's child hangs in a variant: the child must not keep the GPU."""
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(_HANGING_PARENT)
    parent = subprocess.Popen([sys.executable, str(script), start_method], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)  # the task is sent and the child sleeps in it
        assert not gone(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5.0
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not gone(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"worker child {child} outlived its killed parent")


def test_runner_that_cannot_start_is_a_worker_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with Worker(runner="gpu", timeout_s=60) as w:
        with pytest.raises(WorkerError, match="no CUDA device"):
            w.run(Task(FP8.to_json(), (SMALL,)))
        assert w.restarts == 2  # tried twice, then gave up


# ---- the real thing ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_runner_statuses():
    shapes = (Shape(batch=1, heads=16, kv_heads=16, seqlen=4096), Shape(batch=2, heads=16, kv_heads=4, seqlen=2048))
    with Worker(gpu=0, runner="gpu", timeout_s=300) as w:
        t0 = time.perf_counter()
        ok = w.run(Task(FP8.to_json(), shapes, seed=1))
        first = time.perf_counter() - t0
        assert [r.status for r in ok] == ["ok", "ok"], [r.message for r in ok]
        for r, s in zip(ok, shapes):
            assert (r.batch, r.heads, r.seqlen) == (s.batch, s.heads, s.seqlen)
            assert r.p20_ms <= r.median_ms <= r.p80_ms and r.tflops > 50
            assert 0 < r.error_rel_l2 < 0.05 and r.error_max > 0
        print(
            f"\n  default fp8: {[round(r.tflops) for r in ok]} TFLOP/s, clock {ok[0].sm_clock_mhz} MHz, "
            f"{ok[0].power_w} W, {ok[0].tflop_per_j} TFLOP/J, first task {first:.1f} s"
        )
        spill = w.run(Task(SPILLS.to_json(), shapes, seed=1))
        assert [r.status for r in spill] == ["compile_error"] * 2 and "spills" in spill[0].message
        smem = w.run(Task(TOO_MUCH_SMEM.to_json(), shapes, seed=1))
        assert [r.status for r in smem] == ["compile_error"] * 2 and "shared memory" in smem[0].message
        bad = w.run(Task(FP8.replace(p_scale_log2=0, softmax="lean", rowsum="rounded").to_json(), shapes, seed=1))
        assert all(r.status in ("ok", "wrong") for r in bad)
        print(f"  lean P, p_scale 0: {[(r.status, r.error_rel_l2) for r in bad]}")
        t0 = time.perf_counter()
        again = w.run(Task(FP8.to_json(), shapes, seed=1))  # probes cached in the child
        assert [r.status for r in again] == ["ok", "ok"] and time.perf_counter() - t0 < first
        assert again[0].error_rel_l2 == ok[0].error_rel_l2
        assert w.restarts == 0
