"""Training: the train state, the jitted train and eval steps, and the loop.

The step is one pure function `(state, batch) -> (state, metrics)` jitted with explicit shardings
and a donated state: the same code runs on one CPU, fake CPU devices, a GPU, a TPU slice or many
hosts; only the mesh differs. Parameters are a plain nested dict (`nnx.to_pure_dict`), merged into
the model inside the step, so optax, orbax and the sharding table all see ordinary pytrees.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from transformer import rundir, sharding
from transformer.config import Config, ConfigError, config_changes
from transformer.data import Data
from transformer.metrics import Progress, device_peak_flops
from transformer.model import Transformer
from transformer.model.summary import count_params, flops_per_token
from transformer.optim import make_optimizer, schedule
from transformer.rundir import RunWriter


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: the number of updates applied
    params: dict
    opt_state: optax.OptState


def cross_entropy(logits_BxTxV, targets_BxT, weights_BxT, z_loss: float):
    """(objective sum, nll sum, weight sum): float32 cross-entropy summed over real target tokens,
    plus z_loss * log(Z)^2 (PaLM), which keeps the softmax normaliser near 1."""
    logits = logits_BxTxV.astype(jnp.float32)
    log_z_BxT = jax.nn.logsumexp(logits, axis=-1)
    target_logit_BxT = jnp.take_along_axis(logits, targets_BxT[..., None], axis=-1)[..., 0]
    nll_sum = jnp.sum((log_z_BxT - target_logit_BxT) * weights_BxT)
    z_sum = jnp.sum(jnp.square(log_z_BxT) * weights_BxT)
    return nll_sum + z_loss * z_sum, nll_sum, jnp.sum(weights_BxT)


def _per_layer_norm(tree) -> jax.Array:
    """[L]: the norm of each layer's slice of a tree whose leaves are stacked on a leading layer axis."""
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.reshape(x.shape[0], -1).astype(jnp.float32)), axis=1) for x in leaves))


def default_controls(
    lr_scale: float = 1.0, loss_limit: float = math.inf, grad_limit: float = math.inf, nan_grads: bool = False
) -> dict:
    return {
        "lr_scale": np.float32(lr_scale),
        "loss_limit": np.float32(loss_limit),
        "grad_limit": np.float32(grad_limit),
        "nan_grads": np.bool_(nan_grads),
    }


class Trainer:
    """Builds the jitted steps for one config on one mesh."""

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh):
        self.cfg = cfg
        self.mesh = mesh
        self.graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))
        param_shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))
        self.tx = make_optimizer(cfg.optim, cfg.train.steps, nnx.to_pure_dict(abstract))
        self.lr = schedule(cfg.optim, cfg.train.steps)
        abstract_opt = jax.eval_shape(self.tx.init, nnx.to_pure_dict(abstract))
        replicated = sharding.replicated(mesh)
        opt_shardings = optax.tree_map_params(
            self.tx, lambda _, s: s, abstract_opt, param_shardings, transform_non_params=lambda _: replicated
        )
        self.state_shardings = TrainState(replicated, param_shardings, opt_shardings)
        batch_spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
        self.init = jax.jit(self._init, out_shardings=self.state_shardings)
        self.train_step = jax.jit(
            self._train_step,
            in_shardings=(self.state_shardings, batch_spec, replicated),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=0,
        )
        self.eval_step = jax.jit(self._eval_step, in_shardings=(param_shardings, batch_spec), out_shardings=replicated)
        self.stats_step = jax.jit(
            self._stats_step, in_shardings=(param_shardings, batch_spec), out_shardings=replicated
        )

    # --- pure functions ---------------------------------------------------------------------------
    def _init(self, seed: jax.Array) -> TrainState:
        model = Transformer(self.cfg.model, rngs=nnx.Rngs(params=seed))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params))

    def _loss(self, params, batch, key):
        model = nnx.merge(self.graphdef, params)
        logits = model(batch["inputs"], batch.get("positions"), batch.get("segment_ids"), key=key)
        weights = batch.get("weights", jnp.ones(batch["targets"].shape, jnp.float32))
        objective, nll_sum, count = cross_entropy(logits, batch["targets"], weights, self.cfg.train.z_loss)
        return objective, (nll_sum, count)

    def _train_step(self, state: TrainState, batch: dict, controls: dict) -> tuple[TrainState, dict]:
        """One update. `controls` (see `default_controls`) carry the host's decisions into the step:
        learning-rate scale, the skip limits of the monitor, injected NaN gradients."""
        accum = self.cfg.train.grad_accum
        dropout = self.cfg.model.dropout or self.cfg.model.attn_dropout
        step_key = jax.random.fold_in(jax.random.key(self.cfg.train.seed), state.step) if dropout else None
        grad_fn = jax.grad(self._loss, has_aux=True)

        def micro(carry, xs):
            grads, nll_sum, count = carry
            micro_batch, index = xs
            key = None if step_key is None else jax.random.fold_in(step_key, index)
            g, (n, c) = grad_fn(state.params, micro_batch, key)
            return (jax.tree.map(jnp.add, grads, g), nll_sum + n, count + c), None

        # Row r goes to micro-batch r % accum: every device keeps its own rows, nothing moves.
        micro_batches = jax.tree.map(
            lambda x: x.reshape((x.shape[0] // accum, accum) + x.shape[1:]).swapaxes(0, 1), batch
        )
        zeros = jax.tree.map(jnp.zeros_like, state.params)
        (grads, nll_sum, count), _ = jax.lax.scan(micro, (zeros, 0.0, 0.0), (micro_batches, jnp.arange(accum)))
        # The objective is a sum over tokens: divide once, so accumulation equals one big batch.
        grads = jax.tree.map(lambda g: g / count, grads)
        grads = jax.tree.map(lambda g: jnp.where(controls["nan_grads"], jnp.nan, g), grads)  # fault injection
        loss, grad_norm = nll_sum / count, optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        # lr_scale multiplies the whole update: AdamW's decoupled decay is scaled by lr too
        updates = jax.tree.map(lambda u: u * controls["lr_scale"], updates)
        params = optax.apply_updates(state.params, updates)
        # A non-finite step is never applied; in skip mode neither is one above the monitor's limits.
        # Either way parameters and optimiser moments stay exactly as they were.
        apply = (
            jnp.isfinite(loss)
            & jnp.isfinite(grad_norm)
            & (loss <= controls["loss_limit"])
            & (grad_norm <= controls["grad_limit"])
        )
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)
        params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "update_norm": optax.tree.norm(updates),
            "param_norm": optax.tree.norm(params),
            "lr": self.lr(state.step) * controls["lr_scale"],
            "applied": apply.astype(jnp.float32),
        }
        if self.cfg.monitor.stats_every:  # per layer, [L]: cheap reductions, and none when off
            metrics["grad_norm_attn"] = _per_layer_norm(grads["blocks"]["attn"])
            metrics["grad_norm_ffn"] = _per_layer_norm(grads["blocks"]["ffn"])
            metrics["update_ratio"] = _per_layer_norm(updates["blocks"]) / _per_layer_norm(state.params["blocks"])
        return TrainState(state.step + 1, params, opt_state), metrics

    def _stats_step(self, params, batch) -> dict:
        model = nnx.merge(self.graphdef, params)
        return model.stability_stats(batch["inputs"], batch.get("positions"), batch.get("segment_ids"))

    def _eval_step(self, params, batch) -> tuple[jax.Array, jax.Array]:
        _, (nll_sum, count) = self._loss(params, batch, None)
        return nll_sum, count

    # --- host-side helpers ------------------------------------------------------------------------
    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the train state: the target a checkpoint restores into."""
        abstract = jax.eval_shape(self.init, jax.random.key(0))
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, self.state_shardings
        )

    def put_batch(self, local: dict[str, np.ndarray], global_rows: int) -> dict[str, jax.Array]:
        return sharding.global_batch(local, self.mesh, global_rows)

    def evaluate(self, params, data: Data) -> dict[str, float]:
        B = self.cfg.train.batch_size
        pidx, pcount = jax.process_index(), jax.process_count()
        per = B // pcount
        nll, count = 0.0, 0.0
        for batch in data.val_batches(B):
            local = {k: v[pidx * per : (pidx + 1) * per] for k, v in batch.items()}
            n, c = self.eval_step(params, self.put_batch(local, B))
            nll, count = nll + float(n), count + float(c)
        loss = nll / count
        return {
            "val_loss": loss,
            "val_perplexity": math.exp(min(loss, 700.0)),
            "val_bits_per_byte": loss / math.log(2) / data.val_bytes_per_token,
        }


def unigram_entropy(data: Data) -> float:
    """Cross-entropy (nats) of the best context-free model on the validation windows: the bar a
    model must clear to have learned anything beyond token frequencies."""
    targets = np.concatenate([b["targets"][b["weights"] > 0] for b in data.val_batches(64)])
    p = np.bincount(targets) / len(targets)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


@dataclasses.dataclass
class RunResult:
    train_loss: float
    val: dict[str, float]
    tokens_per_s: float
    mfu: float
    steps: int
    params: dict | None = None  # the trained parameters, for callers that inspect them


class Preempted(Exception):
    """Raised after a preemption; `step` is the newest checkpoint on disk (None: there is none)."""

    def __init__(self, step: int | None):
        super().__init__(f"preempted; newest checkpoint: {step}")
        self.step = step


class StopSignal:
    """SIGTERM / SIGINT ask the loop to stop after the current step (and checkpoint); a second
    SIGINT exits at once. Only installable from the main thread; elsewhere it stays inert."""

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        import signal

        if self.requested is not None and signum == signal.SIGINT:
            os._exit(130)  # the second Ctrl-C: the user really wants out
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def should_stop(self, step: int) -> bool:
        if jax.process_count() > 1:
            # every host must stop at the same step: JAX's preemption sync point agrees on one
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested is not None


def corrupt(batch: dict[str, np.ndarray], kind: str, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    """A deliberately bad batch (fault injection): uniform random tokens, or one token repeated."""
    rng = np.random.default_rng(seed)
    shape = batch["inputs"].shape
    if kind == "random":
        rows = rng.integers(0, vocab_size, (shape[0], shape[1] + 1)).astype(np.int32)
    else:
        rows = np.full((shape[0], shape[1] + 1), rng.integers(0, vocab_size), np.int32)
    return {**batch, "inputs": rows[:, :-1], "targets": rows[:, 1:]}


class _Loop:
    """The host side of training: which batch and controls each step gets, what the monitor saw,
    when to evaluate, checkpoint, roll back or stop. `train()` drives it."""

    def __init__(self, cfg, data, trainer, writer, checkpointer, recovery, monitor):
        self.cfg, self.data, self.trainer, self.writer = cfg, data, trainer, writer
        self.checkpointer, self.recovery, self.monitor = checkpointer, recovery, monitor

    def fault(self, name: str, step: int) -> bool:
        """Does fault `name` fire at this step? Each fires once per run, rollbacks and resumes included."""
        if getattr(self.cfg.faults, f"{name}_step") != step or name in self.recovery.fired:
            return False
        self.recovery.fired.add(name)
        self.writer.event("fault", step, fault=name)
        return True

    def batch(self, step: int) -> dict[str, np.ndarray]:
        pidx, pcount = jax.process_index(), jax.process_count()
        local = self.data.train_batch(self.recovery.batch_index(step), pidx, pcount)
        if self.fault("corrupt", step):
            local = corrupt(local, self.cfg.faults.corrupt_kind, self.cfg.model.vocab_size, seed=step)
        return local

    def controls(self, step: int) -> dict:
        lr_scale = self.recovery.lr_scale(step)
        if self.fault("lr", step):
            lr_scale *= self.cfg.faults.lr_multiplier
        loss_limit, grad_limit = self.monitor.limits(up_to=step - 1)
        return default_controls(lr_scale, loss_limit, grad_limit, nan_grads=self.fault("nan", step))

    def meta(self) -> dict:
        from transformer.checkpoint import meta_record

        return meta_record(
            self.cfg,
            monitor=self.monitor.state(),
            skipped_batches=self.recovery.skipped_batches(),
            rollbacks=self.recovery.rollbacks,
            faults_fired=sorted(self.recovery.fired),
        )


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
) -> RunResult:
    """Train `cfg` from `start` (or from scratch), writing metrics and events to `workdir` (process 0
    only) and checkpoints through `checkpointer`. `on_metrics(step, values)` sees every logged set of
    training metrics (tests, notebooks)."""
    from transformer.checkpoint import state_is_finite
    from transformer.monitor import Monitor, MonitorStop, Recovery

    mesh = mesh or sharding.make_mesh(cfg)
    lead = jax.process_index() == 0
    writer = RunWriter(workdir, lead, cfg.logging.tensorboard)
    trainer = Trainer(cfg, mesh)
    B, T = cfg.train.batch_size, cfg.data.seq_len
    tokens_per_step = B * T
    flops_per_step = flops_per_token(cfg.model, T) * tokens_per_step
    peak, peak_source = device_peak_flops()
    n_devices = mesh.devices.size
    if lead:
        log(
            f"{count_params(cfg.model):,} parameters on {n_devices} {jax.devices()[0].platform} device(s), "
            f"mesh {dict(mesh.shape)}; peak {peak / 1e12:.3g} TFLOP/s per device ({peak_source})"
        )
    state = start if start is not None else trainer.init(jax.random.key(cfg.train.seed))
    recovery = Recovery.replay(rundir.read_events(workdir), int(state.step)) if workdir is not None else Recovery()
    loop = _Loop(cfg, data, trainer, writer, checkpointer, recovery, Monitor(cfg.monitor, monitor_state))
    step = int(state.step)
    writer.event("start", step, devices=n_devices, mesh=dict(mesh.shape), peak_flops=peak)
    progress = Progress(cfg.train.steps, step, lead and cfg.logging.progress)
    pending: list = []  # (step, device metrics) read one step late, so the device never waits on the host
    last_time, last_step, tokens_per_s, mfu, train_loss, val = time.perf_counter(), step, 0.0, 0.0, math.nan, {}
    saved = -1
    rollback_to = None
    spike_batch = 0  # the data batch of the last spike that asked for a rollback

    def observe():
        """Read pending metrics: log them, and let the monitor judge them."""
        nonlocal last_time, last_step, tokens_per_s, mfu, train_loss, rollback_to
        for done, metrics in pending:
            values = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
            anomaly = loop.monitor.observe(done, values["loss"], values["grad_norm"], values.get("applied", 1.0) > 0)
            if anomaly is not None and rollback_to is None:
                rollback_to = handle(anomaly, values)
            if done % cfg.logging.every and done != cfg.train.steps:
                continue
            now = time.perf_counter()
            if done > last_step:
                seconds = (now - last_time) / (done - last_step)
                tokens_per_s = tokens_per_step / seconds
                tflops = flops_per_step / seconds / n_devices
                mfu = tflops / peak
                values.update(step_time=seconds, tokens_per_s=tokens_per_s, tflops_per_device=tflops / 1e12, mfu=mfu)
            last_time, last_step, train_loss = now, done, values["loss"]
            writer.scalars(done, values)
            if on_metrics is not None:
                on_metrics(done, values)
            progress.update(done, values["loss"], values["lr"], tokens_per_s)
        pending.clear()

    def handle(anomaly, values) -> int | None:
        """Record an anomaly and act on it; returns the step to roll back to, if any."""
        action = cfg.monitor.on_spike if anomaly.kind == "spike" else "log"
        if anomaly.kind == "level_shift":
            action = "new statistics window"
        elif anomaly.kind == "nonfinite":
            action = "not applied"
        elif cfg.monitor.on_spike == "skip" and not values.get("applied", 1.0):
            action = "skipped"
        batch_index = recovery.batch_index(anomaly.step - 1)
        target = None
        if cfg.monitor.on_spike == "rollback" and anomaly.kind in ("spike", "nonfinite"):
            nonlocal spike_batch
            spike_batch = batch_index
            target = rollback_target(anomaly.step)
            action = "rollback" if target is not None else "rollback impossible: no checkpoint before it"
        writer.event(
            anomaly.kind,
            anomaly.step,
            loss=anomaly.loss,
            grad_norm=anomaly.grad_norm,
            loss_z=anomaly.loss_z,
            grad_z=anomaly.grad_z,
            action=action,
            batch=batch_index,
            windows=data.sampler.window_ids(batch_index).tolist(),
        )
        writer.scalars(anomaly.step, {"anomaly": 1.0})
        if loop.monitor.nonfinite_run >= cfg.monitor.max_nonfinite:
            raise MonitorStop(
                f"{loop.monitor.nonfinite_run} non-finite steps in a row (monitor.max_nonfinite = "
                f"{cfg.monitor.max_nonfinite}), the last at step {anomaly.step}; no bad update was applied or saved"
            )
        if target is not None and recovery.rollbacks >= cfg.monitor.max_rollbacks:
            raise MonitorStop(
                f"{anomaly.kind} at step {anomaly.step} after {recovery.rollbacks} rollbacks "
                f"(monitor.max_rollbacks = {cfg.monitor.max_rollbacks}); the run stops here"
            )
        return target

    def rollback_target(spike_step: int) -> int | None:
        # the loss logged at step d was computed with the parameters after d - 1 updates
        if checkpointer is None:
            return None
        earlier = [s for s in checkpointer.steps() if s < spike_step - 1]
        return max(earlier) if earlier else None

    def checkpoint(done, metrics, val_loss=None, wait=False):
        nonlocal saved
        if checkpointer is None:
            return
        if done == saved:
            if wait:
                checkpointer.wait()
            return
        observe()  # the monitor state saved must include this step's metrics
        if rollback_to is not None:
            return  # this state is about to be abandoned
        if not state_is_finite(jax.device_get(metrics)):
            writer.event("not_saved", done, reason="non-finite loss or parameters")
            return
        checkpointer.save(done, state._asdict(), loop.meta(), val_loss, wait=wait)
        saved = done

    def preempt(done, metrics):
        """Stop for a signal: leave the newest good state on disk and say which step it is."""
        nonlocal state
        checkpoint(done, metrics, wait=True)
        if rollback_to is not None:  # a spike surfaced while stopping: recover first
            state, _ = rollback(rollback_to)
        if checkpointer is not None:
            checkpointer.wait()
        on_disk = max(checkpointer.steps(), default=None) if checkpointer is not None else None
        writer.event("preempted", done, signal=stop.requested, checkpoint=on_disk)
        raise Preempted(on_disk)

    def rollback(to: int) -> tuple[TrainState, int]:
        """Back to checkpoint `to`: later checkpoints are set aside, `skip_batches` batches skipped
        (more if that is what it takes to get past the batch of the spike)."""
        nonlocal rollback_to, saved, last_time, last_step
        checkpointer.wait()
        _, restored, meta = checkpointer.restore(trainer.abstract_state()._asdict(), step=to)
        checkpointer.set_aside([s for s in checkpointer.steps() if s > to], "rolledback")
        m = cfg.monitor
        skip = max(m.skip_batches, spike_batch - recovery.batch_index(to) + 1)
        writer.event(
            "rollback",
            to,
            to_step=to,
            skip_batches=skip,
            cooldown=m.cooldown,
            lr_factor=m.lr_factor,
            rollbacks=recovery.rollbacks + 1,
        )
        recovery.rollback(to, skip, m.cooldown, m.lr_factor)
        loop.monitor = Monitor(m, meta.get("monitor"))
        pending.clear()
        rollback_to, saved, last_step, last_time = None, to, to, time.perf_counter()
        if lead:
            log(f"rolled back to step {to}; skipping {m.skip_batches} batches")
        return TrainState(**restored), to

    try:
        while step < cfg.train.steps:
            batch = trainer.put_batch(loop.batch(step), B)
            state, metrics = trainer.train_step(state, batch, loop.controls(step))
            observe()
            done = step + 1
            pending.append((done, metrics))
            last = done == cfg.train.steps
            evaluated = None
            if rollback_to is None and (done % cfg.train.eval_every == 0 or last):
                observe()
                if rollback_to is None:
                    val = trainer.evaluate(state.params, data)
                    evaluated = val["val_loss"]
                    writer.scalars(done, val)
            if rollback_to is None and cfg.monitor.stats_every and done % cfg.monitor.stats_every == 0:
                per_layer = {k: v for k, v in jax.device_get(metrics).items() if np.ndim(v) == 1}
                stats = jax.device_get(trainer.stats_step(state.params, batch))
                writer.scalars(done, {k: np.asarray(v).tolist() for k, v in {**per_layer, **stats}.items()})
            if rollback_to is None and (done % cfg.checkpoint.every == 0 or last):
                checkpoint(done, metrics, evaluated)
            if rollback_to is not None:
                state, step = rollback(rollback_to)
                continue
            if evaluated is not None or done % cfg.checkpoint.every == 0:
                observe()
                last_time, last_step = time.perf_counter(), done  # evaluation and saving are not training time
            if stop is not None and not last and stop.should_stop(done):
                preempt(done, metrics)
            step = done
        observe()
        if checkpointer is not None:
            checkpointer.wait()
        writer.event("end", cfg.train.steps, train_loss=train_loss, **val)
    except MonitorStop as e:  # a result, not a crash: the sweep does not run it again, the report shows it
        writer.event("stopped", step, reason=str(e))
        raise
    finally:
        progress.close()
        writer.close()
    return RunResult(train_loss, val, tokens_per_s, mfu, cfg.train.steps, state.params)


def _restore(trainer: Trainer, checkpointer, writer_event) -> tuple[TrainState, dict]:
    """The latest valid checkpoint, resharded onto the trainer's mesh, and its JSON record."""
    _, restored, meta = checkpointer.restore(
        trainer.abstract_state()._asdict(), on_bad=lambda s, why: writer_event("checkpoint_corrupt", s, error=why)
    )
    return TrainState(**restored), meta


def run(cfg: Config, workdir: Path, log: Callable[[str], None] = print) -> RunResult:
    """The `train.py` job: resume checks, data, config.yaml, training, checkpoints, and a summary."""
    from transformer.checkpoint import Checkpointer, check_writable, partial_writes
    from transformer.data import prepare

    lead = jax.process_index() == 0
    sharding.mesh_shape(cfg, jax.device_count())  # refuse an impossible mesh before any work
    ckpt_dir = workdir / rundir.CHECKPOINTS
    resuming = rundir.has_checkpoints(workdir)
    safe_changes: list[str] = []
    if resuming:
        saved = rundir.read_config(workdir)
        unsafe, safe_changes = config_changes(saved, cfg.with_vocab(saved.model.vocab_size))
        if unsafe:
            raise ConfigError("", f"cannot resume {workdir}: the config changes what was trained: {'; '.join(unsafe)}")
    elif rundir.has_metrics(workdir):
        raise ConfigError("", f"{workdir} holds a run without checkpoints to resume from; use a new --workdir")
    check_writable(ckpt_dir)
    leftovers = partial_writes(ckpt_dir)

    data = prepare(cfg.data, cfg.train.batch_size, cfg.train.seed, workdir, log=log if lead else lambda _: None)
    cfg = cfg.with_vocab(data.vocab_size)
    mesh = sharding.make_mesh(cfg)
    checkpointer = Checkpointer(workdir, cfg.checkpoint)
    events = RunWriter(workdir, lead, tensorboard=False)
    start, monitor_state = None, None
    try:
        if leftovers:
            events.event("partial_checkpoint_removed", 0, names=leftovers)
        if resuming:
            start, meta = _restore(Trainer(cfg, mesh), checkpointer, events.event)
            monitor_state = meta.get("monitor")
            if int(start.step) >= cfg.train.steps:
                raise ConfigError(
                    "train.steps",
                    f"{workdir} is already trained to step {int(start.step)}; raise train.steps to continue it",
                )
            step = int(start.step)
            dropped = rundir.truncate_metrics(workdir, step) if lead else 0
            events.event("resume", step, dropped_metrics=dropped)
            if safe_changes:
                events.event("config_change", step, changes=safe_changes)
            if lead:
                log(f"resuming {workdir} from step {step}" + (f" ({'; '.join(safe_changes)})" if safe_changes else ""))
    finally:
        events.close()
    if lead:
        rundir.write_config(workdir, cfg)
    try:
        with StopSignal() as stop:
            result = train(
                cfg,
                data,
                workdir,
                mesh,
                log,
                checkpointer=checkpointer,
                start=start,
                stop=stop,
                monitor_state=monitor_state,
            )
    finally:
        checkpointer.close()
    if lead:
        baseline = unigram_entropy(data)
        log(
            f"done: {result.steps} steps; train loss {result.train_loss:.4f}; val loss {result.val['val_loss']:.4f} "
            f"(unigram baseline {baseline:.4f}), val bits/byte {result.val['val_bits_per_byte']:.4f}; "
            f"{result.tokens_per_s:,.0f} tokens/s, MFU {100 * result.mfu:.1f}%"
        )
    return result
