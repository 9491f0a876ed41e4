"""The `train.py` job around the training loop: may this run directory be used (fresh, or a safe
resume)? Then data, the config file, the start-up events (partial checkpoints removed, resume, config
changes), training, checkpoints, and a one-line summary."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np

from transformer import limits, rundir, sharding
from transformer.accelerator import settle_dtype
from transformer.config import Config, ConfigError, config_changes
from transformer.data import Data, prepare
from transformer.io import Checkpointer, CheckpointError, check_writable, partial_writes
from transformer.rundir import RunWriter
from transformer.train.loop import Downstream, RunResult, train
from transformer.train.signals import StopSignal
from transformer.train.trainer import Trainer, TrainState
from transformer.train.wandb_sink import check_credentials


def run(
    cfg: Config, workdir: Path, log: Callable[[str], None] = print, downstream: Downstream | None = None
) -> RunResult:
    """The `train.py` job: resume checks, data, the resolved config, training, checkpoints, and a summary.
    The run directory is locked for the job's life (rundir.Busy when another process writes it).
    `downstream` scores train.eval_tasks (train.py hands in transformer.eval.evaluate.loop_tasks)."""
    limits.check_platform(cfg)  # refuse an impossible mesh, dtype, attention or size before any work
    check_credentials(cfg)
    check_downstream(cfg, downstream, log)
    resume_changes(cfg, workdir)  # refuse an unsafe change before touching the directory (the lock file)
    with writer_lock(workdir):  # ... and check again under the lock, in _run
        return _run(cfg, workdir, log, downstream)


def check_downstream(cfg: Config, downstream: Downstream | None, log: Callable[[str], None]) -> None:
    """Whether train.eval_tasks are scored in the loop: on one process, with an evaluator (train.py
    hands one in); otherwise a line says they are not, and how to score them."""
    if not cfg.train.eval_tasks or jax.process_index() != 0:
        return
    if jax.process_count() > 1:
        log(
            f"train.eval_tasks ({', '.join(cfg.train.eval_tasks)}) not evaluated: scored on one process only; "
            "eval.py --workdir DIR --tasks scores this run's checkpoints"
        )
    elif downstream is None:
        log(
            f"train.eval_tasks ({', '.join(cfg.train.eval_tasks)}) not evaluated: no evaluator given "
            "(train.py gives transformer.eval.evaluate.loop_tasks as run(..., downstream=))"
        )


@contextlib.contextmanager
def writer_lock(workdir: Path) -> Iterator[None]:
    """One writer per run directory: process 0 (the one that writes) locks it; the other processes
    of the same run learn from process 0 whether it could, so that all of them stop together."""
    lock = rundir.RunLock(workdir)
    busy = None
    if jax.process_index() == 0:
        try:
            lock.acquire()
        except rundir.Busy as e:
            busy = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        if not int(multihost_utils.broadcast_one_to_all(np.int32(busy is None))) and busy is None:
            busy = rundir.Busy(f"{workdir} is in use by another run (process 0 could not lock it)")
    if busy is not None:
        raise busy
    try:
        yield
    finally:
        lock.release()


def _run(cfg: Config, workdir: Path, log: Callable[[str], None], downstream: Downstream | None) -> RunResult:
    lead = jax.process_index() == 0
    changes = resume_changes(cfg, workdir)
    done = finished(cfg, workdir, log)
    if done is not None:
        return done
    ckpt_dir = workdir / rundir.CHECKPOINTS
    check_writable(ckpt_dir)
    leftovers = partial_writes(ckpt_dir)

    lead_log = log if lead else lambda _: None
    data = prepare(cfg.data, cfg.train.batch_size, cfg.train.seed, workdir, log=lead_log, steps=cfg.train.steps)
    cfg = cfg.with_vocab(data.vocab_size)
    mesh = sharding.make_mesh(cfg)
    checkpointer = Checkpointer(workdir, cfg.checkpoint)
    try:
        start, monitor_state = begin(cfg, mesh, workdir, checkpointer, leftovers, changes, log)
        if lead:  # with the dtype auto chose here: a resume elsewhere must compute in the same one
            rundir.write_config(workdir, settle_dtype(cfg))
        if start is not None and int(start.step) >= cfg.train.steps:
            return conclude(cfg, workdir, start, log)
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
                downstream=downstream if cfg.train.eval_tasks and jax.process_count() == 1 else None,
            )
    finally:
        checkpointer.close()
    if lead:
        log(summary(result, data))
    return result


def conclude(cfg: Config, workdir: Path, start: TrainState, log: Callable[[str], None]) -> RunResult:
    """End a run killed after its final checkpoint but before its `end` event: everything it logged
    up to that checkpoint is on disk (metrics are written before a save starts), so the end event is
    journaled from them, as the run would have, and nothing is trained again."""
    steps = cfg.train.steps
    train_loss, val = _last_numbers(workdir, steps)
    writer = RunWriter(workdir, jax.process_index() == 0, tensorboard=False)
    writer.event("end", steps, train_loss=train_loss, **val)
    writer.close()
    if jax.process_index() == 0:
        log(f"{workdir} was trained to step {steps} (its final checkpoint); journaled its end")
    return RunResult(train_loss, val, 0.0, 0.0, steps, start.params)


def finished(cfg: Config, workdir: Path, log: Callable[[str], None]) -> RunResult | None:
    """The same command run again on a run that ended at its train.steps: nothing to do, and said
    so (exit 0, so that "rerun until it succeeds" ends); None for any other run. Its numbers are
    its last logged ones; nothing is written."""
    steps = cfg.train.steps
    ends = [e for e in rundir.read_events(workdir) if e["event"] == "end"]
    if not rundir.has_checkpoints(workdir) or not ends or ends[-1].get("step") != steps:
        return None
    if rundir.status(workdir, steps) != "finished":
        return None
    train_loss, val = _last_numbers(workdir, steps)
    if jax.process_index() == 0:
        log(f"{workdir} is already trained to step {steps}; nothing to do (raise train.steps to continue it)")
    return RunResult(train_loss, val, 0.0, 0.0, steps)


def _last_numbers(workdir: Path, steps: int) -> tuple[float, dict]:
    """The training loss and the validation numbers the run logged at `steps`."""
    last = [r for r in rundir.read_metrics(workdir) if r["step"] == steps]
    train_loss = next((float(r["loss"]) for r in reversed(last) if "loss" in r), float("nan"))
    val = next(({k: v for k, v in r.items() if k.startswith("val_")} for r in reversed(last) if "val_loss" in r), {})
    return train_loss, val


def resume_changes(cfg: Config, workdir: Path) -> list[str] | None:
    """None for a fresh run (or one started over: see `restart`); for a resumed one, the safe config
    changes since it was saved. A ConfigError if the changes alter what was trained, or if a run that
    never checkpointed was of another config (it may be someone else's: not ours to start over)."""
    if not rundir.has_checkpoints(workdir):
        if rundir.has_config(workdir):
            saved = rundir.read_config(workdir)
            unsafe, _ = _changes(saved, cfg)
            if unsafe:
                raise ConfigError(
                    "",
                    f"{workdir} holds a run of another config (no checkpoint yet): {'; '.join(unsafe)}; use a new --workdir",
                )
        return None
    saved = rundir.read_config(workdir)
    unsafe, safe = _changes(saved, cfg)
    if unsafe:
        raise ConfigError("", f"cannot resume {workdir}: the config changes what was trained: {'; '.join(unsafe)}")
    return safe


def _changes(saved: Config, cfg: Config) -> tuple[list[str], list[str]]:
    """`config_changes` between the saved and the new config, with `model.dtype: auto` settled for this
    machine on both sides: a run saved in float32 resumes under `auto` on a CPU, and is refused under
    it on a GPU, where it would compute in bfloat16."""
    return config_changes(settle_dtype(saved), settle_dtype(cfg.with_vocab(saved.model.vocab_size)))


def begin(
    cfg: Config,
    mesh: jax.sharding.Mesh,
    workdir: Path,
    checkpointer: Checkpointer,
    leftovers: list[str],
    changes: list[str] | None,
    log: Callable[[str], None],
) -> tuple[TrainState | None, dict | None]:
    """Journal what start-up found, and restore the state to resume from (`changes` is None: a
    fresh run). Returns (start state, monitor state), both None for a fresh run."""
    lead = jax.process_index() == 0
    earlier = changes is None and lead and (rundir.has_metrics(workdir) or bool(rundir.read_events(workdir)))
    events = RunWriter(workdir, lead, tensorboard=False)
    try:
        if leftovers:
            events.event("partial_checkpoint_removed", 0, names=leftovers)
        if earlier:
            restart(workdir, events, log)
        if changes is None:
            return None, None
        return resume(cfg, mesh, workdir, checkpointer, events, changes, log)
    finally:
        events.close()


def restart(workdir: Path, events: RunWriter, log: Callable[[str], None]) -> None:
    """Start over a run that ended (killed, preempted, crashed) before its first checkpoint: its
    metrics belong to a trajectory that is trained again from step 0, so they go, all of them (the
    rerun's file then reads as an uninterrupted run's); the events stay, with a `restart` to say why."""
    dropped = rundir.truncate_metrics(workdir, 0)
    events.event("restart", 0, reason="no checkpoint to resume from: starting over", dropped_metrics=dropped)
    log(f"starting {workdir} over: its previous attempt ended before its first checkpoint")


def resume(
    cfg: Config,
    mesh: jax.sharding.Mesh,
    workdir: Path,
    checkpointer: Checkpointer,
    events: RunWriter,
    changes: list[str],
    log: Callable[[str], None],
) -> tuple[TrainState, dict | None]:
    """The latest valid checkpoint, resharded onto `mesh`, and its monitor state; metrics logged
    after it are dropped (the resumed run logs them again)."""
    start, meta = restore(Trainer(cfg, mesh), checkpointer, events.event, log)
    step = int(start.step)
    foreign = _foreign(meta, cfg)
    if foreign:
        raise CheckpointError(
            f"checkpoint {step} in {workdir} was written by a run of another config ({'; '.join(foreign)}): "
            "not this run's (copied in?); remove it, or resume it in its own run directory"
        )
    # at train.steps but not ended: killed after its final checkpoint (see `conclude`)
    if step > cfg.train.steps or (step == cfg.train.steps and rundir.status(workdir, step) in rundir.FINAL):
        raise ConfigError(
            "train.steps", f"{workdir} is already trained to step {step}; raise train.steps to continue it"
        )
    lead = jax.process_index() == 0
    rollbacks = rundir.read_events(workdir, "rollback") if lead else []
    history = rollbacks[-1].get("metrics_size", 0) if rollbacks else 0  # journals from before it: 0
    history = history if isinstance(history, int) else 0
    dropped = rundir.truncate_metrics(workdir, step, history) if lead else 0
    events.event("resume", step, dropped_metrics=dropped)
    if changes:
        events.event("config_change", step, changes=changes)
    if lead:
        log(f"resuming {workdir} from step {step}" + (f" ({'; '.join(changes)})" if changes else ""))
    return start, meta.get("monitor")


def _foreign(meta: dict, cfg: Config) -> list[str]:
    """What the checkpoint's own record says was trained, where it differs from this run's config in
    a way no resume may change (a checkpoint copied in from another run, its checksums intact)."""
    from transformer.config_loader import from_dict

    recorded = meta.get("config")
    if not isinstance(recorded, dict):  # older checkpoints' records: nothing to compare
        return []
    try:
        saved = from_dict(recorded)
    except ConfigError as e:
        return [f"its recorded config does not load ({e})"]
    return _changes(saved, cfg)[0]


def restore(
    trainer: Trainer, checkpointer: Checkpointer, event: Callable[..., None], log: Callable[[str], None] | None = None
) -> tuple[TrainState, dict]:
    """The latest valid checkpoint, resharded onto the trainer's mesh, and its JSON record; each
    damaged newer one is journaled and named in a line to `log` (process 0)."""
    _, restored, meta = checkpointer.restore(
        trainer.abstract_state()._asdict(), on_bad=lambda s, why: event("checkpoint_corrupt", s, error=why), log=log
    )
    return TrainState(**restored), meta


def summary(result: RunResult, data: Data) -> str:
    """The last line of a run: losses against the unigram baseline, bits per byte, throughput."""
    val = result.val
    bpb = f"val bits/byte {val['val_bits_per_byte']:.4f}" if "val_bits_per_byte" in val else ""
    return (
        f"done: {result.steps} steps; train loss {result.train_loss:.4f}; val loss {val['val_loss']:.4f} "
        f"(unigram baseline {unigram_entropy(data):.4f}), val accuracy {val['val_accuracy']:.3f}{', ' + bpb if bpb else ''}; "
        f"{result.tokens_per_s:,.0f} tokens/s, MFU {100 * result.mfu:.1f}%"
    )


def unigram_entropy(data: Data) -> float:
    """Cross-entropy (nats) of the best context-free model on the validation windows: the bar a
    model must clear to have learned anything beyond token frequencies."""
    targets = np.concatenate([b["targets"][b["weights"] > 0] for b in data.val_batches(64)])
    p = np.bincount(targets) / len(targets)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())
