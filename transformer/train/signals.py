"""Stopping for a signal: SIGTERM / SIGINT ask the training loop to stop after the current step,
checkpoint, and end with `Preempted` (the command line turns it into exit code 75: run it again).
A sweep's member also stops so when its sweep dies (see `PARENT_PID_ENV`)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

# Set by a sweep to its pid in each member's environment: a member whose parent is no longer that
# process (the sweep was killed) stops as on SIGTERM. The sweep also asks the kernel for a SIGTERM
# on its death (Linux's PR_SET_PDEATHSIG); this watchdog covers the platforms without it.
PARENT_PID_ENV = "TRANSFORMER_SWEEP_PID"
WATCHDOG_SECONDS = 1.0


class Preempted(Exception):
    """Raised after a preemption; `step` is the newest checkpoint on disk (None: there is none)."""

    def __init__(self, step: int | None):
        super().__init__(f"preempted; newest checkpoint: {step}")
        self.step = step


class StopSignal:
    """SIGTERM / SIGINT ask the loop to stop after the current step (and checkpoint); a second
    SIGINT exits at once. Only installable from the main thread; elsewhere it stays inert."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[signal.Signals, Any] = {}  # the handlers to put back
        self._done = threading.Event()  # ends the watchdog

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        parent = os.environ.get(PARENT_PID_ENV, "")
        if parent.isdigit():
            threading.Thread(target=self._watch, args=(int(parent),), daemon=True, name="parent-watchdog").start()
        return self

    def _watch(self, parent: int) -> None:
        """Ask for a stop once the parent (a sweep) is gone: this process was re-parented."""
        while not self._done.wait(WATCHDOG_SECONDS):
            if os.getppid() != parent:
                if self.requested is None:
                    self.requested = "parent exited"
                return

    def _handle(self, signum, frame):
        if self.requested is not None and signum == signal.SIGINT:
            os._exit(130)  # the second Ctrl-C: the user really wants out
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        self._done.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def should_stop(self, step: int) -> bool:
        import jax  # here: a sweep imports this module for PARENT_PID_ENV, and needs no JAX

        if jax.process_count() > 1:
            # every host must stop at the same step: JAX's preemption sync point agrees on one
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested is not None
