"""Stopping for a signal: SIGTERM / SIGINT ask the training loop to stop after the current step,
checkpoint, and end with `Preempted` (the command line turns it into exit code 75: run it again)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import jax


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

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested is not None and signum == signal.SIGINT:
            os._exit(130)  # the second Ctrl-C: the user really wants out
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def should_stop(self, step: int) -> bool:
        if jax.process_count() > 1:
            # every host must stop at the same step: JAX's preemption sync point agrees on one
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested is not None
