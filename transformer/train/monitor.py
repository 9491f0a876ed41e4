"""Loss-spike detection and the host-side state of recovery.

The monitor sees each step's loss and gradient norm one step late (no host synchronisation is added
to the step), keeps rolling statistics over `monitor.window` normal steps, and classifies anomalies:

- `nonfinite`: a NaN/inf loss or gradient norm (always an anomaly; the jitted step never applies it);
- `spike`: loss above mean + threshold * std, or log gradient norm above its mean + threshold * std,
  once the window is warm;
- `divergence`: loss above its first value for `monitor.divergence_steps` steps in a row;
- `router_collapse` (mixture of experts): one expert of some layer takes at least `COLLAPSE_LOAD` of
  the tokens (journaled when it happens, again only after the router has recovered).

Recovery (`monitor.on_spike`): `log` records; `skip` hands limits to the jitted step, which then drops
updates above them (moments untouched); `rollback` restores the last checkpoint before the spike's
cause (`TrainLoop.rollback_target`), skips `monitor.skip_batches` data batches and optionally cools
the learning rate down.

Fault injection (`faults.*`: a learning-rate spike, a corrupt batch, NaN gradients) lives here too,
beside the recovery it exercises: each fault fires once per run (`Faults`).

What recovery did must survive rollbacks, kills and resumes, so it is journaled in the run's events
(`rollback`, `fault`) and replayed from there; the statistics window travels in checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable

import numpy as np

from transformer.config import FaultsConfig, MonitorConfig

# A router that sends this fraction of a batch's tokens (or more) to one expert has collapsed: that
# expert does the layer's work and the others idle. Only meaningful when top_k < n_experts.
COLLAPSE_LOAD = 0.9
WARM_FRACTION = 4  # the window is warm once it holds window / WARM_FRACTION normal steps (at least 8)


def _window_mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std of the window, in plain float sums: cheap enough for every step, and
    the same bits as the runs (and checkpointed windows) made before, so decisions replay exactly."""
    n = len(values)
    mean = sum(values) / n
    return mean, math.sqrt(max(0.0, sum((v - mean) ** 2 for v in values) / n))


def _log(grad_norm: float) -> float:
    """The scale gradient norms are judged on. They are heavy-tailed (late in training a window's
    ordinary batches reach mean + 6 std of the raw norm with the loss below its mean, and a rollback
    on them is a false alarm); a real spike multiplies the norm, which stands out in log space."""
    return math.log(max(grad_norm, 1e-30))


class MonitorStop(RuntimeError):
    """The run cannot go on: too many non-finite steps in a row, or rollbacks exhausted (exit 1)."""


@dataclasses.dataclass
class Anomaly:
    kind: str  # spike | nonfinite | divergence
    step: int
    loss: float
    grad_norm: float
    loss_z: float
    grad_z: float


class Monitor:
    def __init__(self, cfg: MonitorConfig, state: dict | None = None):
        self.cfg = cfg
        state = state or {}
        # (step, loss, grad norm) of the last `window` normal steps
        # room for the entries a host read ahead of the step that asks for limits (see limits())
        self.window = deque((tuple(e) for e in state.get("window", [])), maxlen=cfg.window + 2)
        self.first_loss = state.get("first_loss")
        self.above_first = state.get("above_first", 0)
        self.nonfinite_run = state.get("nonfinite_run", 0)
        self.spike_run = state.get("spike_run", 0)
        self.diverged = state.get("diverged", False)
        self.router_collapsed = state.get("router_collapsed", False)

    def state(self) -> dict:
        """JSON-able; saved in checkpoints so a resumed run makes the same decisions."""
        return {
            "window": [list(e) for e in self.window],
            "first_loss": self.first_loss,
            "above_first": self.above_first,
            "nonfinite_run": self.nonfinite_run,
            "spike_run": self.spike_run,
            "diverged": self.diverged,
            "router_collapsed": self.router_collapsed,
        }

    def _stats(self, up_to: int | None = None):
        entries = [e for e in self.window if up_to is None or e[0] <= up_to][-self.cfg.window :]
        if len(entries) < self.warm_count:
            return None  # not warm yet
        return _window_mean_std([e[1] for e in entries]), _window_mean_std([_log(e[2]) for e in entries])

    @property
    def warm_count(self) -> int:
        return max(8, self.cfg.window // WARM_FRACTION)

    def limits(self, up_to: int) -> tuple[float, float]:
        """(loss, grad norm) above which the jitted step drops an update; inf unless skipping.

        Only steps <= up_to count, so the limits do not depend on when the host happened to read
        the metrics (which changes with evaluation and checkpoint frequency)."""
        stats = self._stats(up_to) if self.cfg.on_spike == "skip" else None
        if stats is None:
            return math.inf, math.inf
        (lm, ls), (gm, gs) = stats
        k = self.cfg.threshold
        return lm + k * ls, math.exp(gm + k * gs)

    def loss_limit(self, up_to: int) -> float | None:
        """mean + threshold * std of the losses of the window's steps <= up_to (whatever `on_spike`
        is); None while the window is not warm. A rollback judges a checkpoint's parameters by it."""
        stats = self._stats(up_to)
        if stats is None:
            return None
        (mean, std), _ = stats
        return mean + self.cfg.threshold * std

    def observe(self, step: int, loss: float, grad_norm: float, applied: bool = True) -> Anomaly | None:
        """Classify one step; normal steps enter the window, anomalies do not (a spike must not
        widen the band that detects the next one). A step the jitted step did not apply counts as a
        spike whatever its z-score. After `warm_count` spikes in a row the level itself has moved:
        the window starts afresh (`level_shift`), so `skip` cannot freeze training and `log` does not
        report every later step."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.nonfinite_run += 1
            return Anomaly("nonfinite", step, loss, grad_norm, math.nan, math.nan)
        self.nonfinite_run = 0
        if self.first_loss is None:
            self.first_loss = loss
        self.above_first = self.above_first + 1 if loss > self.first_loss else 0
        loss_z = grad_z = 0.0
        stats = self._stats()
        if stats is not None:
            (lm, ls), (gm, gs) = stats
            loss_z = (loss - lm) / ls if ls > 0 else 0.0
            grad_z = (_log(grad_norm) - gm) / gs if gs > 0 else 0.0
        if self.above_first >= self.cfg.divergence_steps and not self.diverged:  # reported once
            self.diverged = True
            return Anomaly("divergence", step, loss, grad_norm, loss_z, grad_z)
        if not applied or (stats is not None and max(loss_z, grad_z) > self.cfg.threshold):
            self.spike_run += 1
            if self.spike_run >= self.warm_count:
                self.window.clear()
                self.spike_run = 0
                return Anomaly("level_shift", step, loss, grad_norm, loss_z, grad_z)
            return Anomaly("spike", step, loss, grad_norm, loss_z, grad_z)
        self.spike_run = 0
        self.window.append((step, loss, grad_norm))
        return None

    def router_collapse(self, load_max: float, n_experts: int, top_k: int) -> bool:
        """Whether the router has just collapsed: the busiest expert (`expert_load_max`, the fraction
        of tokens routed to it) reaches COLLAPSE_LOAD where top_k < n_experts leaves it a choice."""
        collapsed = top_k < n_experts and load_max >= COLLAPSE_LOAD
        news = collapsed and not self.router_collapsed
        self.router_collapsed = collapsed
        return news


@dataclasses.dataclass
class Recovery:
    """What rollbacks and faults did, replayed from the event journal.

    skips: (from_step, count): from `from_step` on, data batch indices are shifted by `count`.
    cooldowns: (from_step, until_step, factor): the learning rate is scaled by `factor` in between.
    targets: the steps rollbacks returned to (a spike right after returning to one convicts it).
    """

    rollbacks: int = 0
    skips: list = dataclasses.field(default_factory=list)
    cooldowns: list = dataclasses.field(default_factory=list)
    fired: set = dataclasses.field(default_factory=set)
    targets: list = dataclasses.field(default_factory=list)

    def rollback(self, to_step: int, skip_batches: int, cooldown: int, lr_factor: float) -> None:
        # anything recorded after the restored step belonged to the abandoned trajectory
        self.skips = [s for s in self.skips if s[0] <= to_step]
        self.cooldowns = [c for c in self.cooldowns if c[0] <= to_step]
        # a later target's checkpoint is set aside, and the step may be saved afresh on this trajectory
        self.targets = [t for t in self.targets if t < to_step] + [to_step]
        if skip_batches:
            self.skips.append((to_step, skip_batches))
        if cooldown and lr_factor != 1.0:
            self.cooldowns.append((to_step, to_step + cooldown, lr_factor))
        self.rollbacks += 1

    def batch_index(self, step: int) -> int:
        return step + sum(count for start, count in self.skips if step >= start)

    def skipped_batches(self) -> list[int]:
        """Data batch indices never trained on (stored in checkpoints for inspection)."""
        skipped: list[int] = []
        shift = 0
        for start, count in sorted(self.skips):
            skipped += range(start + shift, start + shift + count)
            shift += count
        return skipped

    def lr_scale(self, step: int) -> float:
        scale = 1.0
        for start, until, factor in self.cooldowns:
            if start <= step < until:
                scale *= factor
        return scale

    @classmethod
    def replay(cls, events: list[dict], resume_step: int = 0) -> Recovery:
        """The recovery state of a run resumed at `resume_step`. A fault counts as fired if it fired
        before that step, or if a rollback recovered from it; one that fired after the checkpoint
        and before any rollback (a kill in between) fires again, as it did in the first attempt."""
        recovery = cls()
        unresolved: dict[str, int] = {}
        for event in events:
            if event.get("event") == "rollback":
                recovery.rollback(event["to_step"], event["skip_batches"], event["cooldown"], event["lr_factor"])
                recovery.fired |= set(unresolved)
                unresolved.clear()
            elif event.get("event") == "fault":
                if event["step"] < resume_step:
                    recovery.fired.add(event["fault"])
                else:
                    unresolved[event["fault"]] = event["step"]
        return recovery


def corrupt(batch: dict[str, np.ndarray], kind: str, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    """A deliberately bad batch (fault injection): uniform random tokens, or one token repeated."""
    rng = np.random.default_rng(seed)
    shape = batch["inputs"].shape
    if kind == "random":
        rows = rng.integers(0, vocab_size, (shape[0], shape[1] + 1)).astype(np.int32)
    else:
        rows = np.full((shape[0], shape[1] + 1), rng.integers(0, vocab_size), np.int32)
    return {**batch, "inputs": rows[:, :-1], "targets": rows[:, 1:]}


class Faults:
    """The faults of `cfg` (tests, demonstrations of recovery). Each fires once per run at its step,
    rollbacks and resumes included: what fired is the `fired` set of the run's `Recovery`, replayed
    from the journal, where firing writes a `fault` event through `event(kind, step, **fields)`."""

    def __init__(self, cfg: FaultsConfig, recovery: Recovery, event: Callable[..., None]):
        self.cfg, self.recovery, self.event = cfg, recovery, event

    def fires(self, name: str, step: int) -> bool:
        """Does fault `name` (lr | corrupt | nan) fire at this step? True at most once per run."""
        if getattr(self.cfg, f"{name}_step") != step or name in self.recovery.fired:
            return False
        self.recovery.fired.add(name)
        self.event("fault", step, fault=name)
        return True

    def batch(self, batch: dict[str, np.ndarray], step: int, vocab_size: int) -> dict[str, np.ndarray]:
        """`batch`, or a corrupt one where the `corrupt` fault fires."""
        if self.fires("corrupt", step):
            return corrupt(batch, self.cfg.corrupt_kind, vocab_size, seed=step)
        return batch

    def lr_multiplier(self, step: int) -> float:
        """`faults.lr_multiplier` where the `lr` fault fires, else 1."""
        return self.cfg.lr_multiplier if self.fires("lr", step) else 1.0

    def nan_grads(self, step: int) -> bool:
        """Does the `nan` fault replace this step's gradients by NaN?"""
        return self.fires("nan", step)
