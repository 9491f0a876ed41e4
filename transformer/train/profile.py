"""`logging.profile: START:STOP` (or `train.py --profile START:STOP`): a `jax.profiler` trace of
those training steps, written under the run's TensorBoard directory, where TensorBoard's Profile tab
finds it (`tensorboard --logdir runs`); the `.trace.json.gz` beside it opens in Perfetto
(ui.perfetto.dev). Steps are counted as the loop counts them (the first trained step is 0), and a
trace spans whole steps: the device finishes STOP-1 before the trace is closed."""

from __future__ import annotations

from pathlib import Path

import jax


class ProfileWindow:
    """Starts and stops the trace around the steps of the window; inert without one."""

    def __init__(self, steps: tuple[int, int] | None, directory: Path | None, log=print):
        self.steps = steps if directory is not None else None
        self.directory = directory
        self.log = log
        self.active = False

    def before(self, step: int) -> None:
        """Called before step `step` is dispatched."""
        if self.steps is None or self.active or not (self.steps[0] <= step < self.steps[1]):
            return
        assert self.directory is not None
        jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
        self.active = True

    def after(self, done: int, state) -> None:
        """Called after step `done - 1` is dispatched, with the state it returns."""
        if self.active and self.steps is not None and done >= self.steps[1]:
            jax.block_until_ready(state)  # the trace holds the device work of its last step
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            self.log(f"profile of steps {self.steps[0]}..{self.steps[1] - 1} written to {self.directory}")  # type: ignore[index]
