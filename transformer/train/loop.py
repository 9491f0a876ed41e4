"""The host loop of training: which batch and controls each step gets, what the monitor saw, when
to log, evaluate, checkpoint, roll back or stop.

The device never waits on the host: each step's metrics are read one step late (`pending`), and the
monitor judges them then. Everything the loop remembers between steps is an attribute of `TrainLoop`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from transformer import rundir, sharding
from transformer.accelerator import choose_attention, choose_dtype, describe_host_memory, keep_step_buffers
from transformer.config import Config
from transformer.data import Data, Vocab
from transformer.errors import EXIT_FAILED, first_line
from transformer.io import Checkpointer, CheckpointError, SaveFailed, meta_record, state_is_finite
from transformer.model import count_params
from transformer.rundir import RunWriter
from transformer.train import preflight
from transformer.train.feed import Feed
from transformer.train.metrics import Progress, Throughput, device_peak_flops
from transformer.train.monitor import COLLAPSE_LOAD, Anomaly, Faults, Monitor, MonitorStop, Recovery
from transformer.train.profile import ProfileWindow
from transformer.train.signals import Preempted, StopSignal
from transformer.train.trainer import Trainer, TrainState, default_controls
from transformer.train.validation import validation_metrics
from transformer.train.wandb_sink import scalar_sinks


def _process() -> tuple[int, int]:
    return jax.process_index(), jax.process_count()


@dataclasses.dataclass
class RunResult:
    train_loss: float
    val: dict[str, float]
    tokens_per_s: float
    mfu: float
    steps: int
    params: dict | None = None  # the trained parameters, for callers that inspect them


# what scores train.eval_tasks: given (cfg, trainer, vocab) once, a function of the parameters giving
# {"eval/<task>/<metric>": value} (transformer.eval.evaluate.loop_tasks; the evaluation package sits
# above this one, so the caller hands it in)
Downstream = Callable[[Config, Trainer, Vocab], Callable[[Any], dict[str, float]]]


def train(
    cfg: Config,
    data: Data,
    workdir: Path | None,
    mesh: jax.sharding.Mesh | None = None,
    log: Callable[[str], None] = print,
    on_metrics: Callable[[int, dict], None] | None = None,
    checkpointer=None,
    start: TrainState | None = None,
    stop: StopSignal | None = None,
    monitor_state: dict | None = None,
    downstream: Downstream | None = None,
) -> RunResult:
    """Train `cfg` from `start` (or from scratch), writing metrics and events to `workdir` (process 0
    only) and checkpoints through `checkpointer`. `on_metrics(step, values)` sees every logged set of
    training metrics (tests, notebooks); `downstream` scores `train.eval_tasks` at each evaluation."""
    loop = TrainLoop(cfg, data, workdir, mesh, log, on_metrics, checkpointer, start, stop, monitor_state, downstream)
    return loop.run()


class TrainLoop:
    """One run of the step loop (see `train` for the arguments). `run()` drives it."""

    def __init__(
        self,
        cfg: Config,
        data: Data,
        workdir: Path | None,
        mesh: jax.sharding.Mesh | None = None,
        log: Callable[[str], None] = print,
        on_metrics: Callable[[int, dict], None] | None = None,
        checkpointer: Checkpointer | None = None,
        start: TrainState | None = None,
        stop: StopSignal | None = None,
        monitor_state: dict | None = None,
        downstream: Downstream | None = None,
    ):
        self.cfg, self.data, self.log, self.on_metrics = cfg, data, log, on_metrics
        self.checkpointer, self.stop = checkpointer, stop
        self.mesh = mesh or sharding.make_mesh(cfg)
        self.lead = jax.process_index() == 0
        self.writer = RunWriter(workdir, self.lead, cfg.logging.tensorboard, scalar_sinks(cfg, workdir, self.lead))
        trace_dir = workdir / rundir.TENSORBOARD if workdir is not None and self.lead else None
        self.profile = ProfileWindow(cfg.logging.profile_steps, trace_dir, log)
        self.trainer = Trainer(cfg, self.mesh)
        # its tasks loaded now: one that cannot be is refused before any step
        self.downstream = downstream(cfg, self.trainer, data.objective.vocab) if downstream is not None else None
        # compiled here, ahead of the first step, to log (and check) what a device will hold
        self.train_step, self.plan = preflight.start_step(self.trainer, data.train_batch(0, *_process()))
        self.host_buffers = None  # on a CPU, whether malloc keeps the step's buffer (decided by its size)
        if jax.default_backend() == "cpu":
            self.host_buffers = keep_step_buffers(self.plan.temporaries, jax.local_device_count())
        put = lambda local: self.trainer.put_batch(local, cfg.train.batch_size)
        self.feed = Feed(lambda index: data.train_batch(index, *_process()), put, cfg.data.prefetch)
        self.peak = self._announce()
        self.state = start if start is not None else self.trainer.initial_state()
        self.step = int(self.state.step)  # the next step to train
        self.recovery = Recovery.replay(rundir.read_events(workdir), self.step) if workdir is not None else Recovery()
        self.faults = Faults(cfg.faults, self.recovery, self.writer.event)
        self.monitor = Monitor(cfg.monitor, monitor_state)
        self.progress = Progress(cfg.train.steps, self.step, self.lead and cfg.logging.progress)
        tokens_per_step, flops_per_step = preflight.work_per_step(cfg)
        self.meter = Throughput(tokens_per_step, flops_per_step, self.mesh.devices.size, self.peak, self.step)
        self.pending: list = []  # (step, device metrics) read one step late, so the device never waits
        self.train_loss = math.nan
        self.val: dict[str, float] = {}  # the latest evaluation
        self.saved = -1  # the step of the newest checkpoint this run wrote or rolled back to
        self.rollback_to: int | None = None  # a spike asked to roll back to this checkpoint
        self.spike_batch = 0  # the data batch of the last spike that asked for a rollback
        self.judged: dict = {}  # how the rollback target was chosen, for the rollback event
        self.restored: tuple | None = None  # (step, state, meta) of a checkpoint judged sound, kept for the rollback

    def _announce(self) -> float:
        """Log the model, devices, mesh and peak FLOP/s (process 0); returns the peak of one device."""
        peak, source = device_peak_flops()
        platform, attention = jax.default_backend(), ""
        if self.cfg.model.dtype == "auto":
            attention = f"compute {choose_dtype(self.cfg, platform)} (auto); "
        if self.cfg.model.attention_impl == "auto":
            impl, why = choose_attention(self.cfg, platform)
            attention += f"attention {impl} (auto: {why}); "
        if self.trainer.compiler_options:
            attention += "dots and reductions by XLA's own kernels, not YNNPACK's (CPU, experts); "
        if self.host_buffers is not None:
            attention += f"{describe_host_memory()}, {self.host_buffers}; "
        if self.lead:
            self.log(
                f"{count_params(self.cfg.model):,} parameters on {self.mesh.devices.size} "
                f"{jax.devices()[0].platform} device(s), mesh {dict(self.mesh.shape)}; "
                f"peak {peak / 1e12:.3g} TFLOP/s per device ({source}); {attention}{self.plan.memory()}"
            )
        return peak

    # --- the step loop ----------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Train to `train.steps`; MonitorStop, Preempted and SaveFailed end it early."""
        cfg, mesh = self.cfg, self.mesh
        self.writer.event(
            "start",
            self.step,
            devices=mesh.devices.size,
            mesh=dict(mesh.shape),
            peak_flops=self.peak,
            data=self.data.summary,
            memory=self.plan.figures(),
        )
        self.meter.restart(self.step)
        try:
            while self.step < cfg.train.steps:
                self.train_one()
            self.finish()
        except MonitorStop as e:  # a result, not a crash: the sweep does not run it again, the report shows it
            self.writer.event("stopped", self.step, reason=str(e))
            raise
        except SaveFailed as e:  # the step whose write failed, and the checkpoint a rerun would resume from
            step = e.step if e.step is not None else self.step
            self.writer.event("save_failed", step, error=e.reason, newest_checkpoint=e.newest)
            raise
        except jax.errors.JaxRuntimeError as e:
            if not preflight.is_out_of_memory(e):
                raise
            raise preflight.OutOfMemory(self.plan.too_large(first_line(e)), EXIT_FAILED) from None
        finally:
            self.feed.close()
            self.profile.close()
            self.progress.close()
            self.writer.close()
        return RunResult(self.train_loss, self.val, *self.meter.overall(), cfg.train.steps, self.state.params)

    def train_one(self) -> None:
        """Train step `self.step`, then evaluate, record statistics, checkpoint, roll back or stop as due."""
        step, every = self.step, self.cfg.checkpoint.every
        batch = self.batch(step)
        self.profile.before(step)
        self.state, metrics = self.train_step(self.state, batch, self.controls(step))
        self.feed.ahead(self.recovery.batch_index(s) for s in range(step + 1, self.cfg.train.steps))
        self.profile.after(step + 1, self.state)
        self.observe()
        done = step + 1
        self.pending.append((done, metrics))
        last = done == self.cfg.train.steps
        evaluated = self.validate(done, last)
        self.layer_stats(done, metrics, batch)
        if self.rollback_to is None and (done % every == 0 or last):
            self.checkpoint(done, metrics, evaluated)
        if self.rollback_to is not None:
            self.rollback(self.rollback_to)
            return
        if evaluated is not None or done % every == 0:
            self.observe()
            self.meter.restart(done)  # evaluation and saving are not training time
        if self.stop is not None and not last and self.stop.should_stop(done):
            self.preempt(done, metrics)
        self.step = done

    def batch(self, step: int) -> dict[str, jax.Array]:
        """The step's batch on the devices: this process's rows of its data batch (past skipped
        batches), made ahead by the feed unless a fault corrupts it."""
        local, placed = self.feed.get(self.recovery.batch_index(step))
        corrupted = self.faults.batch(local, step, self.cfg.model.vocab_size)
        return placed if corrupted is local else self.trainer.put_batch(corrupted, self.cfg.train.batch_size)

    def controls(self, step: int) -> dict:
        """The host's decisions for the step: learning-rate scale, skip limits, injected NaN gradients."""
        lr_scale = self.recovery.lr_scale(step) * self.faults.lr_multiplier(step)
        loss_limit, grad_limit = self.monitor.limits(up_to=step - 1)
        return default_controls(lr_scale, loss_limit, grad_limit, nan_grads=self.faults.nan_grads(step))

    def validate(self, done: int, last: bool) -> float | None:
        """Evaluate when due and no rollback is pending; the validation loss, or None."""
        if self.rollback_to is not None or not (done % self.cfg.train.eval_every == 0 or last):
            return None
        self.observe()
        if self.rollback_to is not None:
            return None
        self.val = validation_metrics(self.trainer, self.state.params, self.data)
        if self.downstream is not None:
            self.val.update(self.downstream(self.state.params))
        self.writer.scalars(done, self.val)
        return self.val["val_loss"]

    def layer_stats(self, done: int, metrics: dict, batch: dict) -> None:
        """Every `monitor.stats_every` steps: the step's per-layer metrics and the model's stability statistics."""
        every = self.cfg.monitor.stats_every
        if self.rollback_to is not None or not every or done % every:
            return
        per_layer = {k: v for k, v in jax.device_get(metrics).items() if np.ndim(v) == 1}
        stats = jax.device_get(self.trainer.stats_step(self.state.params, batch))
        self.writer.scalars(done, {k: np.asarray(v).tolist() for k, v in {**per_layer, **stats}.items()})

    def finish(self) -> None:
        self.observe()
        if self.checkpointer is not None:
            self.checkpointer.wait()
        self.writer.event("end", self.cfg.train.steps, train_loss=self.train_loss, **self.val)

    # --- metrics and the monitor ------------------------------------------------------------------
    def observe(self) -> None:
        """Read pending metrics: log them, and let the monitor judge them."""
        for done, metrics in self.pending:
            values = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
            anomaly = self.monitor.observe(done, values["loss"], values["grad_norm"], values.get("applied", 1.0) > 0)
            if anomaly is not None and self.rollback_to is None:
                self.rollback_to = self.on_anomaly(anomaly, values)
            self.watch_router(done, values)
            if done % self.cfg.logging.every == 0 or done == self.cfg.train.steps:
                self.log_metrics(done, values)
        self.pending.clear()

    def watch_router(self, done: int, values: dict[str, float]) -> None:
        """Journal a router collapse (mixture of experts; see monitor.COLLAPSE_LOAD)."""
        m = self.cfg.model
        if "expert_load_max" in values and self.monitor.router_collapse(
            values["expert_load_max"], m.n_experts, m.top_k
        ):
            self.writer.event("router_collapse", done, expert_load_max=values["expert_load_max"], limit=COLLAPSE_LOAD)

    def log_metrics(self, done: int, values: dict[str, float]) -> None:
        """Write one step's metrics, with the throughput since the last logged step."""
        values.update(self.meter.measure(done))
        self.train_loss = values["loss"]
        self.writer.scalars(done, values)
        if self.on_metrics is not None:
            self.on_metrics(done, values)
        self.progress.update(done, values["loss"], values["lr"], self.meter.tokens_per_s)

    def on_anomaly(self, anomaly: Anomaly, values: dict[str, float]) -> int | None:
        """Record an anomaly and act on it; returns the step to roll back to, if any."""
        action = self.action(anomaly, values)
        batch_index = self.recovery.batch_index(anomaly.step - 1)
        target = None
        if self.cfg.monitor.on_spike == "rollback" and anomaly.kind in ("spike", "nonfinite"):
            self.spike_batch = batch_index
            target = self.rollback_target(anomaly.step)
            action = "rollback" if target is not None else "rollback impossible: no checkpoint before it"
        self.writer.event(
            anomaly.kind,
            anomaly.step,
            loss=anomaly.loss,
            grad_norm=anomaly.grad_norm,
            loss_z=anomaly.loss_z,
            grad_z=anomaly.grad_z,
            action=action,
            batch=batch_index,
            windows=self.data.sampler.window_ids(batch_index).tolist(),
        )
        self.writer.scalars(anomaly.step, {"anomaly": 1.0})
        self.give_up_if_exhausted(anomaly, target)
        return target

    def action(self, anomaly: Anomaly, values: dict[str, float]) -> str:
        """What the step did about an anomaly, for its event (a rollback is decided in on_anomaly)."""
        on_spike = self.cfg.monitor.on_spike
        if anomaly.kind == "level_shift":
            return "new statistics window"
        if anomaly.kind == "nonfinite":
            return "not applied"
        if on_spike == "skip" and not values.get("applied", 1.0):
            return "skipped"
        return on_spike if anomaly.kind == "spike" else "log"

    def give_up_if_exhausted(self, anomaly: Anomaly, target: int | None) -> None:
        """MonitorStop after `monitor.max_nonfinite` non-finite steps in a row, or when a rollback is
        due and `monitor.max_rollbacks` are spent."""
        m = self.cfg.monitor
        run = self.monitor.nonfinite_run
        if run >= m.max_nonfinite:
            # What is known: the jitted step applied none of these steps, and no non-finite state was
            # saved. Not known: whether an update applied before them (an lr spike, say: its own step
            # looked normal) left finite but broken parameters, possibly in the newest checkpoints.
            first = anomaly.step - run + 1
            raise MonitorStop(
                f"{run} non-finite steps in a row (monitor.max_nonfinite = {m.max_nonfinite}), steps "
                f"{first} to {anomaly.step}: none of them was applied and no non-finite state was saved, "
                f"but an update applied before step {first} may have caused them (and may be in the "
                f"newest checkpoints)"
            )
        if target is not None and self.recovery.rollbacks >= m.max_rollbacks:
            raise MonitorStop(
                f"{anomaly.kind} at step {anomaly.step} after {self.recovery.rollbacks} rollbacks "
                f"(monitor.max_rollbacks = {m.max_rollbacks}); the run stops here"
            )

    # --- checkpoints, rollbacks, preemption -------------------------------------------------------
    def meta(self) -> dict:
        """The JSON record saved with a checkpoint: config and the host-side state of recovery."""
        return meta_record(
            self.cfg,
            monitor=self.monitor.state(),
            skipped_batches=self.recovery.skipped_batches(),
            rollbacks=self.recovery.rollbacks,
            faults_fired=sorted(self.recovery.fired),
        )

    def checkpoint(self, done: int, metrics: dict, val_loss: float | None = None, wait: bool = False) -> None:
        """Save the state after step `done`, unless it is saved already, about to be abandoned, or not finite."""
        if self.checkpointer is None:
            return
        if done == self.saved:
            if wait:
                self.checkpointer.wait()
            return
        self.observe()  # the monitor state saved must include this step's metrics
        if self.rollback_to is not None:
            return  # this state is about to be abandoned
        if not state_is_finite(jax.device_get(metrics)):
            self.writer.event("not_saved", done, reason="non-finite loss or parameters")
            return
        self.checkpointer.save(done, self.state._asdict(), self.meta(), val_loss, wait=wait)
        self.saved = done

    def rollback_target(self, spike_step: int) -> int | None:
        """The newest checkpoint from before the cause of the spike, if any.

        The loss logged at step d was computed with the parameters after d - 1 updates, on data
        batch d - 1: a spike there comes from that batch (checkpoint d - 1 is sound) or from update
        d - 1 (an lr spike: checkpoint d - 1 holds it), and step d alone cannot tell which. So a kept
        checkpoint d - 1 is judged (`checkpoint_sound`); sound, it is the target, else the one before.
        One a rollback already returned to is not judged again: a spike right after it convicts it."""
        self.judged, self.restored = {"checkpoint_sound": None}, None
        if self.checkpointer is None:
            return None
        last, steps = spike_step - 1, self.checkpointer.steps()
        if last in steps and last not in self.recovery.targets:
            if self.checkpoint_is_sound(last):
                return last
        earlier = [s for s in steps if s < last]
        return max(earlier) if earlier else None

    def checkpoint_is_sound(self, step: int) -> bool:
        """Do the parameters of checkpoint `step` keep the loss of the last normal step's batch (data
        batch step - 1, the one its last update trained on) within the monitor's limit (mean +
        threshold * std of the window)? One judge_step (the training function, as the limit's losses
        are), on the clean batch; a sound state is kept for the rollback. Everything it reads is a
        function of the trajectory, so a resumed run judges alike (and a journaled rollback is
        replayed without judging again)."""
        assert self.checkpointer is not None  # rollback_target asks only with checkpoints
        limit = self.monitor.loss_limit(up_to=step)
        self.judged = {"checkpoint_sound": False, "loss_limit": limit}
        if limit is None:  # not warm: nothing to judge by, so the old rule (the one before)
            return False
        self.checkpointer.wait()
        try:
            restored = self.checkpointer.restore(self.trainer.abstract_state()._asdict(), step=step)[1:]
        except CheckpointError:  # damaged: the rollback sets it aside with the rest
            return False
        index = self.recovery.batch_index(step - 1)
        local = self.data.train_batch(index, jax.process_index(), jax.process_count())
        batch = self.trainer.put_batch(local, self.cfg.train.batch_size)
        nll, count, _ = self.trainer.judge_step(restored[0]["params"], batch)
        loss = float(nll) / float(count)
        sound = math.isfinite(loss) and loss <= limit
        self.judged.update(checkpoint_sound=sound, judged_loss=loss, judged_batch=index)
        self.restored = (step, *restored) if sound else None
        return sound

    def rollback(self, to: int) -> None:
        """Back to checkpoint `to`: later checkpoints are set aside, `skip_batches` batches skipped
        (more if that is what it takes to get past the batch of the spike)."""
        m, checkpointer = self.cfg.monitor, self.checkpointer
        assert checkpointer is not None  # rollback_target found no checkpoint to return to without one
        checkpointer.wait()
        if self.restored is not None and self.restored[0] == to:
            _, restored, meta = self.restored  # judged sound by checkpoint_is_sound: not read twice
        else:
            _, restored, meta = checkpointer.restore(self.trainer.abstract_state()._asdict(), step=to)
        checkpointer.set_aside([s for s in checkpointer.steps() if s > to], "rolledback")
        skip = max(m.skip_batches, self.spike_batch - self.recovery.batch_index(to) + 1)
        self.writer.event(
            "rollback",
            to,
            to_step=to,
            skip_batches=skip,
            cooldown=m.cooldown,
            lr_factor=m.lr_factor,
            rollbacks=self.recovery.rollbacks + 1,
            metrics_size=self.writer.metrics_size(),  # what a resume keeps of the abandoned trajectory
            **self.judged,
        )
        self.recovery.rollback(to, skip, m.cooldown, m.lr_factor)
        self.monitor = Monitor(m, meta.get("monitor"))
        self.pending.clear()
        self.rollback_to, self.saved, self.restored, self.judged = None, to, None, {}
        self.meter.restart(to)
        if self.lead:
            self.log(f"rolled back to step {to}; skipping {skip} batches")
        self.state, self.step = TrainState(**restored), to

    def preempt(self, done: int, metrics: dict) -> None:
        """Stop for a signal: leave the newest good state on disk, say which step it is, raise Preempted."""
        self.checkpoint(done, metrics, wait=True)
        if self.rollback_to is not None:  # a spike surfaced while stopping: recover first
            self.rollback(self.rollback_to)
        if self.checkpointer is not None:
            self.checkpointer.wait()
        assert self.stop is not None  # only a StopSignal asks for this
        on_disk = max(self.checkpointer.steps(), default=None) if self.checkpointer is not None else None
        self.writer.event("preempted", done, signal=self.stop.requested, checkpoint=on_disk)
        raise Preempted(on_disk)
