"""The child side of a `Worker`: the loop that serves tasks in the child process, and the guard that
ends the child with its parent.

A child must never outlive the tuner that started it: one left behind by a killed tuner (a hung
variant, say, that never reads its socket again) keeps its GPU busy and its CUDA context alive. So
the child asks the kernel for SIGKILL when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`, set
first thing), checks that the parent is still the one that started it (it may have died before the
request was made), and runs a watchdog thread that ends the process once its parent changes (the
kernel's request is tied to the parent *thread* that started the child, and covers nothing outside
Linux; a child so ended when that thread exits is replaced by the Worker's next task). The main loop
also exits when the parent's end of the socket closes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import faulthandler
import json
import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
import time
from typing import Any

from .runners import make_runner, parse_runner
from .task import Task, exception_text, tail

#: exit status of a child that ends itself after reporting a crash
CRASH_EXIT = 70
#: exit status of a child that ends itself because its parent is gone
ORPHAN_EXIT = 71
#: seconds between the watchdog's looks at the parent
WATCHDOG_PERIOD_S = 0.5
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """End this process when `parent_pid` (the process that started it) ends (see the module doc)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no libc to ask: the watchdog below still runs
            pass
    if os.getppid() != parent_pid:  # the parent died before the request: nobody is left to serve
        os._exit(ORPHAN_EXIT)

    def watch() -> None:
        while True:
            time.sleep(WATCHDOG_PERIOD_S)
            if os.getppid() != parent_pid:
                os._exit(ORPHAN_EXIT)

    threading.Thread(target=watch, name="zyfa-tune-parent-watchdog", daemon=True).start()


class _Reporter:
    def __init__(self, conn, seq: int) -> None:
        self.conn, self.seq = conn, seq
        self.sent = 0  # results sent so far (the index a crash is reported at)

    def setup_done(self) -> None:
        self.conn.send(("setup", self.seq))

    def result(self, index: int, fields: dict[str, Any]) -> None:
        self.conn.send(("result", self.seq, index, fields))
        self.sent = index + 1


def _serve(conn, runner, seq: int, task: Task) -> bool:
    """Run one task; returns True if the child must exit afterwards (the runner raised)."""
    from zyfa_tune.generator import ConfigError, KernelConfig

    reporter = _Reporter(conn, seq)
    try:
        config = KernelConfig.from_json(task.config_json)
    except ConfigError as exc:  # validated data only ever reaches the generator: nothing ran
        reporter.setup_done()
        for i in range(len(task.shapes)):
            reporter.result(i, dict(status="compile_error", message=tail(f"invalid config: {exc}")))
        conn.send(("done", seq))
        return False
    try:
        runner.run(config, task, reporter)
    except BaseException as exc:  # noqa: BLE001 - everything unexpected is a crash of this process
        conn.send(("crash", seq, reporter.sent, exception_text(exc)))
        return True
    conn.send(("done", seq))
    return False


def child_main(conn, log_fd: int | None, gpu: int | None, runner_text: str, parent_end=None) -> None:
    """The child process: serve tasks from `conn` until told to stop or the parent is gone."""
    if parent_end is not None:  # fork: drop the inherited parent end, so the parent's exit reads as EOF
        parent_end.close()
    if log_fd is not None and log_fd != 2:
        os.dup2(log_fd, 2)
        os.close(log_fd)
    faulthandler.enable()  # a segfault's Python stack goes to stderr (the log the parent reads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)  # before anything initialises CUDA
    try:
        runner = make_runner(parse_runner(runner_text))
    except BaseException as exc:  # noqa: BLE001
        try:
            conn.send(("fatal", exception_text(exc)))
        finally:
            os._exit(2)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            os._exit(0)
        if msg[0] == "stop":
            conn.close()
            return
        _, seq, task = msg
        try:
            conn.send(("start", seq))
            must_exit = _serve(conn, runner, seq, task)
        except (BrokenPipeError, ConnectionError, EOFError, OSError):  # the parent is gone
            os._exit(0)
        if must_exit:
            sys.stderr.flush()
            os._exit(CRASH_EXIT)


def child_entry(argv: list[str]) -> None:
    """Entry point of a "spawn" child: argv = [socket fd, log fd, gpu JSON, runner, parent pid]."""
    parent_pid = int(argv[4])
    die_with_parent(parent_pid)  # before the imports and set-up below, which take a while
    sock_fd, log_fd, gpu, runner_text = int(argv[0]), int(argv[1]), json.loads(argv[2]), argv[3]
    child_main(mpc.Connection(sock_fd), log_fd, gpu, runner_text)


def fork_main(conn, log_fd: int | None, gpu: int | None, runner_text: str, parent_pid: int, parent_end) -> None:
    """Entry point of a "fork" child (multiprocessing's target)."""
    die_with_parent(parent_pid)
    child_main(conn, log_fd, gpu, runner_text, parent_end)


SPAWN_CODE = (
    "import json, os, sys; "
    "p = os.environ.pop('ZYFA_TUNE_WORKER_SYS_PATH', None); sys.path[:] = json.loads(p) if p else sys.path; "
    "from zyfa_tune.tuning.worker_child import child_entry; child_entry(sys.argv[1:])"
)
