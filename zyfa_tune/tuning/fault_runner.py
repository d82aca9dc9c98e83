"""The "fault" runner (tests): injected failures in the worker's child process.

"raise" (an exception in the runner -> crash with its traceback), "hang" (sleeps forever -> timeout),
"exit" (os._exit(17) -> crash), "segv" (SIGSEGV -> crash). With a condition `field=value` the fault
hits only configs whose KernelConfig field has that value (e.g. "hang@num_stages=4"), or, for a Shape
field ("exit@seqlen=16384"), only that shape of a task (the shapes before it are answered normally);
everything else is answered by the simulation runner over its database, so a test can run a small
study where only some configs fail.
"""

from __future__ import annotations

import os
import signal
import time

from zyfa_tune.generator import KernelConfig

from .simulation import SimulationRunner
from .task import Reporter, Task

FAULT_MODES = ("raise", "hang", "exit", "segv")
SHAPE_FIELDS = ("batch", "heads", "kv_heads", "seqlen")


class FaultRunner:
    def __init__(self, fault: str, field: str | None = None, value: str | None = None, db: str | None = None) -> None:
        if fault not in FAULT_MODES:
            raise ValueError(f"fault: {fault!r} is not one of {list(FAULT_MODES)}")
        self.fault, self.field, self.value, self.db = fault, field, value, db
        self._fallback: SimulationRunner | None = None

    def _simulation(self) -> SimulationRunner:
        if self._fallback is None:
            self._fallback = SimulationRunner(self.db)
        return self._fallback

    def run(self, config: KernelConfig, task: Task, reporter: Reporter) -> None:
        if self.field in SHAPE_FIELDS:  # per shape: shapes before the faulty one are answered normally
            reporter.setup_done()
            for i, shape in enumerate(task.shapes):
                if str(getattr(shape, self.field)) == self.value:
                    self._fault()
                reporter.result(i, self._simulation().answer(config, shape, task))
            return
        if self.field is not None and str(getattr(config, self.field)) != self.value:
            self._simulation().run(config, task, reporter)
            return
        reporter.setup_done()
        self._fault()

    def _fault(self) -> None:
        where = f" ({self.field}={self.value})" if self.field else ""
        if self.fault == "raise":
            raise ValueError(f"injected fault: raise{where}")
        if self.fault == "exit":
            os._exit(17)
        if self.fault == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        while True:  # "hang", and "segv" should the signal not end the process
            time.sleep(3600)
