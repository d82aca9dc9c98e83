"""Isolated trial execution: one child process per worker (one per GPU), so that a kernel variant
that fails to compile, computes garbage, hangs or takes the CUDA context down never kills the study.

    with Worker(gpu=0, runner="gpu", timeout_s=120) as w:
        results = w.run(Task(config_json=cfg.to_json(), shapes=(Shape(1, 32, 32, 16384),)))

`Worker.run` sends the task to the child and returns one `TrialResult` per shape, in order. The
child streams one result per shape as it finishes; the parent turns whatever goes wrong into a
status and never raises for a failing variant:

  compile_error / wrong / ok   decided by the runner in the child (see zyfa_tune.tuning.runners);
  timeout   no answer within `timeout_s`: the child is killed (SIGTERM, then SIGKILL after a short
            grace) and replaced; shapes that had finished keep their results, the rest are timeout;
  crash     the child died (segfault, os._exit, killed), or the runner raised (a CUDA error such
            as an illegal memory access, or any unexpected exception: the child sends the traceback
            and exits by itself, so the next task gets a fresh process and CUDA context); the child
            is replaced. The message holds the exception or exit status and the tail of the child's
            stderr (faulthandler writes a segfault's Python stack there).

`timeout_s` covers the config's part of a task (compile, verify, time). The config-independent set-up
before it — starting the child, and in the GPU runner building the inputs and float64 references
of shapes not yet cached — has its own limit, `setup_timeout_s` (exceeding it is also "timeout").

Child processes: start_method "spawn" (default) starts a fresh interpreter (`sys.executable -c`)
with CUDA_VISIBLE_DEVICES=<gpu> in its environment from the first instruction, connected by a
socket carrying multiprocessing.connection messages. Unlike multiprocessing's own spawn it does not
re-run the caller's __main__ script in the child, so a tuner started from a script without an
`if __name__ == "__main__"` guard works. "fork" uses multiprocessing's fork context (fast; CPU
runners only: a forked child cannot use CUDA once the parent has). The child ignores SIGINT (the
parent decides), and dies with its parent, also in the middle of a hung task (worker_child.py).

Misuse raises: a closed worker, an argument that is not a Task, a bad runner string, a child that
cannot start at all (`WorkerError`, e.g. no GPU visible for runner "gpu").
"""

from __future__ import annotations

import fcntl
import json
import math
import multiprocessing
import multiprocessing.connection as mpc
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from zyfa_tune.db.records import TrialResult

from .runners import RunnerSpec, parse_runner
from .task import Shape, Task, tail
from .worker_child import SPAWN_CODE, fork_main

__all__ = ["Shape", "Task", "Worker", "WorkerError", "START_METHODS", "time_in_fresh_process"]

START_METHODS = ("spawn", "fork")
#: seconds between SIGTERM and SIGKILL when a child is stopped
KILL_GRACE_S = 2.0
#: characters of the child's stderr appended to crash / timeout messages
STDERR_TAIL = 1500


class WorkerError(RuntimeError):
    """The worker cannot serve tasks at all (closed, or its child cannot start)."""


# ---- parent side ---------------------------------------------------------------------------------


class _Child:
    """One child process, started by subprocess ("spawn") or multiprocessing ("fork")."""

    def __init__(self, start_method: str, gpu: int | None, runner: str) -> None:
        # stderr of the child: an unlinked temporary file shared by descriptor (nothing left behind)
        self.log_fd = self._open_log()
        self._popen: subprocess.Popen | None = None
        self._process = None
        try:
            if start_method == "spawn":
                self._spawn(gpu, runner)
            else:
                ctx = multiprocessing.get_context(start_method)
                self.conn, child_conn = ctx.Pipe(duplex=True)
                try:
                    self._process = ctx.Process(
                        target=fork_main,
                        args=(child_conn, self.log_fd, gpu, runner, os.getpid(), self.conn),
                        name=f"zyfa-tune-worker-gpu{gpu}",
                        daemon=True,
                    )
                    self._process.start()
                finally:
                    child_conn.close()
                self.pid = self._process.pid
        except BaseException:
            os.close(self.log_fd)
            raise

    def _spawn(self, gpu: int | None, runner: str) -> None:
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ, ZYFA_TUNE_WORKER_SYS_PATH=json.dumps(sys.path))
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        try:
            self._popen = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    SPAWN_CODE,
                    str(child_sock.fileno()),
                    str(self.log_fd),
                    json.dumps(gpu),
                    runner,
                    str(os.getpid()),
                ],
                pass_fds=(child_sock.fileno(), self.log_fd),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        self.conn = mpc.Connection(parent_sock.detach())
        self.pid = self._popen.pid

    @staticmethod
    def _open_log() -> int:
        fd, path = tempfile.mkstemp(prefix="zyfa-worker-", suffix=".log")
        os.unlink(path)
        # append mode: after the parent truncates it between tasks, the child writes from the start
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        return fd

    def exitcode(self) -> int | None:
        if self._popen is not None:
            return self._popen.poll()
        return self._process.exitcode

    def alive(self) -> bool:
        return self.exitcode() is None

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the process to end (and reap it); True if it has ended."""
        if self._popen is not None:
            try:
                self._popen.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        self._process.join(timeout)
        return self._process.exitcode is not None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGTERM, a short grace, then SIGKILL; reaps the process."""
        if not self.alive():
            self.wait(1.0)
            return
        self.signal(signal.SIGTERM)
        if not self.wait(KILL_GRACE_S):
            self.signal(signal.SIGKILL)
            self.wait(10.0)  # a process stuck in the driver may take a moment

    def stderr_tail(self, limit: int = STDERR_TAIL) -> str:
        try:
            size = os.fstat(self.log_fd).st_size
            data = os.pread(self.log_fd, limit, max(0, size - limit))
        except OSError:
            return ""
        text = data.decode("utf-8", "replace")
        # faulthandler's list of extension modules says nothing about the failure
        return "\n".join(line for line in text.splitlines() if not line.startswith("Extension modules:")).strip()

    def clear_log(self) -> None:
        try:
            os.ftruncate(self.log_fd, 0)
        except OSError:
            pass

    def close(self) -> None:
        for close in (self.conn.close, lambda: os.close(self.log_fd)):
            try:
                close()
            except OSError:
                pass


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Died(Exception):
    pass


class _TimedOut(Exception):
    pass


class _NotStarted(Exception):
    """The child died before it acknowledged the task (nothing of the task ran)."""


class Worker:
    """One isolated child process bound to one GPU (or none) that runs tasks with a runner.

    gpu:             the GPU index the child sees as its only device (CUDA_VISIBLE_DEVICES); None
                     leaves visibility as it is.
    runner:          "gpu", "simulate[:<db path>]", "fault:<mode>[@<field>=<value>]" (zyfa_tune.tuning.runners).
    timeout_s:       the limit for one task's config work (compile, check, time) over all its shapes.
    start_method:    "spawn" (fresh interpreter, default) or "fork" (CPU runners only).
    setup_timeout_s: the limit for starting a child and for a task's config-independent set-up.
    """

    def __init__(
        self,
        *,
        gpu: int | None = None,
        runner: str = "gpu",
        timeout_s: float = 120.0,
        start_method: str = "spawn",
        setup_timeout_s: float = 600.0,
    ) -> None:
        if gpu is not None and (type(gpu) is not int or gpu < 0):
            raise ValueError(f"gpu: expected None or a GPU index >= 0, got {gpu!r}")
        self.spec: RunnerSpec = parse_runner(runner)
        for name, value in (("timeout_s", timeout_s), ("setup_timeout_s", setup_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method: {start_method!r} is not one of {list(START_METHODS)}")
        self.gpu = gpu
        self.runner = runner
        self.timeout_s = float(timeout_s)
        self.setup_timeout_s = float(setup_timeout_s)
        self.start_method = start_method
        self.restarts = 0
        self._lock = threading.Lock()
        self._closed = False
        self._seq = 0
        self._child: _Child | None = None
        self._ready = False
        self._start()

    # ---- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pid={self.pid}"
        return f"Worker(gpu={self.gpu}, runner={self.runner!r}, {state}, restarts={self.restarts})"

    @property
    def pid(self) -> int | None:
        """The current child's pid (None once closed)."""
        return None if self._closed or self._child is None else self._child.pid

    def close(self) -> None:
        """Stop the child (politely, then by signal) and release everything. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            child, self._child = self._child, None
            if child is not None:
                self._stop(child)

    def __del__(self) -> None:
        try:
            if not self._closed and self._child is not None:
                self._child.kill()
                self._child.close()
        except Exception:
            pass

    def _start(self) -> None:
        self._child = _Child(self.start_method, self.gpu, self.runner)
        self._ready = False

    def _stop(self, child: _Child) -> None:
        if child.alive():
            try:
                child.conn.send(("stop",))
            except OSError:
                pass
            if not child.wait(10.0):
                child.kill()
        else:
            child.wait(1.0)
        child.close()

    def _replace(self) -> None:
        """Kill the current child (if it still runs) and start a fresh one."""
        old = self._child
        if old is not None:
            old.kill()
            old.close()
        self.restarts += 1
        self._start()

    # ---- receiving -----------------------------------------------------------------------------
    def _recv(self, deadline: float):
        """The next message from the child; _Died if it ended, _TimedOut past `deadline`."""
        child = self._child
        while True:
            if child.conn.poll(0):
                try:
                    return child.conn.recv()
                except (EOFError, OSError):
                    raise _Died() from None
            if not child.alive():
                # anything it sent before dying is read above first
                if child.conn.poll(0):
                    continue
                raise _Died()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _TimedOut()
            try:
                mpc.wait([child.conn], timeout=min(remaining, 0.5))
            except OSError:
                raise _Died() from None

    def _ensure_ready(self) -> None:
        """Replace a child that died between tasks, and wait for the child's ready message
        (two tries; a child that cannot start twice in a row is a WorkerError)."""
        if self._ready:
            if self._child.alive():
                return
            self._replace()  # died between tasks (killed from outside, say)
        for attempt in (1, 2):
            try:
                while True:
                    msg = self._recv(time.monotonic() + self.setup_timeout_s)
                    if msg[0] == "ready":
                        self._ready = True
                        return
                    if msg[0] == "fatal":
                        problem = msg[1]
                        break
            except _Died:
                self._child.wait(2.0)
                problem = f"the worker process died while starting ({describe_exit(self._child.exitcode())})"
            except _TimedOut:
                problem = f"the worker process did not start within {self.setup_timeout_s:g} s"
            err = self._child.stderr_tail()
            self._replace()
            if attempt == 2:
                raise WorkerError(
                    f"worker (gpu={self.gpu}, runner={self.runner!r}) cannot start: "
                    f"{problem}" + (f"\n--- worker stderr ---\n{err}" if err else "")
                )

    # ---- running -------------------------------------------------------------------------------
    def wait_ready(self) -> None:
        """Wait until the child has started its runner; `WorkerError` if it cannot (the tuner checks
        this before it creates anything, so a machine that cannot run the runner leaves no study)."""
        with self._lock:
            if self._closed:
                raise WorkerError("this Worker is closed")
            self._ensure_ready()

    def run(self, task: Task) -> list[TrialResult]:
        """Run `task` in the child; one TrialResult per shape, in order (see the module docstring)."""
        if not isinstance(task, Task):
            raise TypeError(f"task: expected a zyfa_tune.tuning.worker.Task, got {type(task).__name__}")
        with self._lock:
            if self._closed:
                raise WorkerError("this Worker is closed")
            try:
                try:
                    return self._attempt(task)
                except _NotStarted:  # the child died before it took the task: a fresh one, once more
                    self._replace()
                    return self._attempt(task, retried=True)
            except WorkerError:
                raise
            except BaseException:
                # interrupted (KeyboardInterrupt, say): the child's state is unknown, replace it
                self._replace()
                raise

    def _attempt(self, task: Task, retried: bool = False) -> list[TrialResult]:
        self._ensure_ready()
        child = self._child
        self._seq += 1
        seq = self._seq
        n = len(task.shapes)
        results: list[TrialResult | None] = [None] * n
        child.clear_log()
        try:
            child.conn.send(("task", seq, task))
        except OSError:
            pass  # it died just now: seen below
        deadline = time.monotonic() + self.setup_timeout_s
        started = in_setup = False
        failure: tuple[str, str] | None = None  # (status, message) for the shapes without a result
        stderr = True  # append the child's stderr tail to the failure message
        while True:
            try:
                msg = self._recv(deadline)
            except _TimedOut:
                where = (
                    "set-up (inputs, references)"
                    if in_setup or not started
                    else f"shape {_first_missing(results) + 1}/{n}"
                )
                limit = self.setup_timeout_s if in_setup or not started else self.timeout_s
                child.kill()
                failure = ("timeout", f"no answer within {limit:g} s during {where}; worker process {child.pid} killed")
                break
            except _Died:
                child.wait(2.0)
                if not started and not retried:
                    raise _NotStarted() from None
                failure = (
                    "crash",
                    f"worker process {child.pid} died ({describe_exit(child.exitcode())}) "
                    f"during shape {_first_missing(results) + 1}/{n}",
                )
                break
            kind, msg_seq = msg[0], msg[1]
            if msg_seq != seq:
                continue  # left over from an earlier, interrupted task
            if kind == "start":
                started = in_setup = True
            elif kind == "setup":
                in_setup = False
                deadline = time.monotonic() + self.timeout_s
            elif kind == "result":
                _, _, index, fields = msg
                if type(index) is int and 0 <= index < n:
                    results[index] = _trial_result(fields, task.shapes[index], task.recipe)
            elif kind == "done":
                break
            elif kind == "crash":
                _, _, index, text = msg
                child.wait(5.0)  # it exits by itself; replaced below either way
                failure = ("crash", f"worker raised during shape {index + 1}/{n}:\n{text}")
                stderr = False  # the traceback says it
                break
        if failure is not None:
            status, message = failure
            err = child.stderr_tail() if stderr else ""
            if err:
                message += f"\n--- worker stderr (tail) ---\n{err}"
            head, _, rest = message.partition("\n")
            message = head + ("\n" + tail(rest, 3500) if rest else "")
            self._replace()
            for i, shape in enumerate(task.shapes):
                if results[i] is None:
                    results[i] = TrialResult(
                        status=status,
                        message=message,
                        batch=shape.batch,
                        heads=shape.heads,
                        seqlen=shape.seqlen,
                        recipe=task.recipe,
                    )
        for i, shape in enumerate(task.shapes):  # "done" without every result: a runner bug
            if results[i] is None:
                results[i] = TrialResult(
                    status="crash",
                    message="worker finished without a result for this shape",
                    batch=shape.batch,
                    heads=shape.heads,
                    seqlen=shape.seqlen,
                    recipe=task.recipe,
                )
        return results  # type: ignore[return-value]


def _first_missing(results: list) -> int:
    return next((i for i, r in enumerate(results) if r is None), len(results) - 1)


def _trial_result(fields: dict[str, Any], shape: Shape, recipe: str | None) -> TrialResult:
    """A runner's fields as a TrialResult, with the shape and the task's recipe (what was measured)."""
    where = dict(batch=shape.batch, heads=shape.heads, seqlen=shape.seqlen, recipe=recipe)
    try:
        return TrialResult(**{**fields, **where})
    except (TypeError, ValueError) as exc:
        return TrialResult(
            status="crash", message=tail(f"the worker sent an invalid result ({exc}): {fields!r:.1000}"), **where
        )


def time_in_fresh_process(
    config_json: str,
    shape: Shape,
    *,
    causal: bool = True,
    api: str = "fp8",
    recipe: str | None = None,
    runner: str = "gpu",
    timeout_s: float = 600.0,
) -> TrialResult:
    """`config_json` checked and timed at `shape` by a new worker process, as a trial is (for the bf16 API
    with `recipe`'s quantiser): its own CUDA context and memory, nothing left over from what the calling
    process ran before (`zyfa-tune verify`'s last word on an entry that reads slow late in a long run)."""
    with Worker(runner=runner, timeout_s=timeout_s) as worker:
        return worker.run(Task(config_json, (shape,), causal=causal, api=api, recipe=recipe))[0]
