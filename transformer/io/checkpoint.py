"""Checkpoints (orbax): save, resume from the latest valid one, refuse unsafe config changes, load.

A checkpoint holds the train state (step, parameters, optimiser state) and a JSON record of
everything else a run needs to continue exactly: the resolved config, and the host-side state that
later features keep (monitor window, skipped batches). Dropout keys derive from (seed, step) and
batches from (data config, seed, step), so no RNG or iterator state is needed beyond the step.

orbax writes each checkpoint into a temporary directory and renames it when complete, so a crash
mid-save never leaves something that looks finished; leftovers are cleaned at start-up. What the
storage layer does not check (orbax's zarr3 chunks carry no checksum of their data, only of their
index), `tree_checksums` does: each saved array's checksum goes into the JSON record, and a restore
that reads back other bytes is a damaged checkpoint, set aside like one orbax cannot read.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import jax
import jax.numpy as jnp

from transformer import rundir
from transformer.config import CheckpointConfig, Config, ConfigError
from transformer.errors import first_line

CHECKSUMS = "checksums"  # the key of the JSON record that holds each saved array's checksum


class CheckpointError(RuntimeError):
    """A checkpoint problem that stops the run (exit 1): nothing valid to resume from, a failed save."""


class SaveFailed(CheckpointError):
    """Writing the checkpoint of `step` failed; `newest` is the newest complete checkpoint on disk."""

    def __init__(self, step: int | None, reason: str, newest: int | None):
        what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
        where = f"the newest good checkpoint is step {newest}" if newest is not None else "no checkpoint was kept"
        super().__init__(f"saving {what} failed: {reason}; {where}")
        self.step, self.reason, self.newest = step, reason, newest


def check_writable(directory: Path) -> None:
    """Fail early, with the reason, if checkpoints cannot be written here."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{uuid.uuid4().hex}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise ConfigError("checkpoint", f"cannot write checkpoints to {directory}: {e.strerror or e}") from None


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


class Checkpointer:
    """One run's checkpoint directory: retention, async saves, and fall-back restore."""

    def __init__(self, workdir: Path, cfg: CheckpointConfig, read_only: bool = False):
        ocp = _ocp()
        from orbax.checkpoint import checkpoint_managers as policies

        _quiet_orbax()
        self.directory = Path(workdir) / rundir.CHECKPOINTS
        self.in_flight: int | None = None  # the step an async save may still be writing
        self.failed: SaveFailed | None = None  # a save that failed: reported once, never waited on again
        if not read_only:
            repair_metrics_records(Path(workdir), self.directory)
        keep = [policies.LatestN(cfg.keep)]
        if cfg.keep_best:
            keep.append(
                policies.BestN(
                    get_metric_fn=lambda m: -m["val_loss"], n=cfg.keep_best, keep_checkpoints_without_metrics=False
                )
            )
        options = ocp.CheckpointManagerOptions(
            # best_fn only makes orbax write each step's metrics to disk, so that BestN still knows
            # them after a resume or a reload; retention itself is the preservation policy's
            best_fn=lambda m: m["val_loss"],
            best_mode="min",
            enable_async_checkpointing=cfg.async_ and not read_only,
            # directories are made by the calling thread: one that cannot be made fails the save of
            # its own step at once, instead of leaving orbax's writer threads waiting 300 s for a
            # "directory created" signal that never comes
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
            preservation_policy=policies.AnyPreservationPolicy(keep),
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
            # a reader needs neither the save times nor the kept-best metrics: not reading them
            # spares eval.py a damaged metrics record (a writer repairs them first)
            lightweight_initialize=read_only,
        )
        self.manager = ocp.CheckpointManager(self.directory.resolve(), options=options, item_names=("state", "meta"))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def pick(self, step: int | None) -> int:
        """`step` if it was kept, else the latest; a clear CheckpointError when there is none."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"{self.directory} holds no checkpoints")
        if step is not None and step not in steps:
            raise CheckpointError(
                f"step {step} was not kept in {self.directory.parent} (kept: {', '.join(map(str, steps))})"
            )
        return steps[-1] if step is None else step

    def save(self, step: int, state: dict, meta: dict, val_loss: float | None = None, wait: bool = False) -> None:
        """Save `state` (async unless `wait`), with `meta` and the checksum of every array. SaveFailed
        names the step whose write failed: this one, or the async save still in flight before it."""
        ocp = _ocp()
        self.wait()
        metrics = {"val_loss": float(val_loss)} if val_loss is not None and math.isfinite(val_loss) else None
        # computed on the device from the arrays being saved, before orbax copies them to the host
        record = {**meta, CHECKSUMS: tree_checksums(state)}
        self.in_flight = step
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(record)),
                metrics=metrics,
                force=True,
            )
        except Exception as e:  # disk full, permissions changed under us, ...
            self._fail(step, e)
        if wait:
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight; SaveFailed, naming its step, if it failed."""
        if self.failed is not None:
            raise self.failed
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            self._fail(self.in_flight, e)
        self.in_flight = None

    def _fail(self, step: int | None, e: Exception) -> NoReturn:
        newest = max((s for s in self.steps() if s != step), default=None)
        _quiet_abandoned_io()
        self.failed = SaveFailed(step, first_line(e, with_type=True), newest)
        raise self.failed from None

    def restore(
        self,
        abstract_state: dict,
        step: int | None = None,
        on_bad: Callable[[int, str], None] | None = None,
        log: Callable[[str], None] | None = None,
    ):
        """(step, state, meta) of `step`, or of the latest checkpoint that restores intact (readable,
        complete, checksums matching), trying older ones when the newest is damaged; each damaged one
        goes to `on_bad` and, on process 0, a line to `log`. Raises CheckpointError when none is usable."""
        candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
        problems, bad = [], []
        for s in candidates:
            try:
                restored = self._restore_verified(s, abstract_state)
            except Exception as e:
                _quiet_abandoned_io()
                why = first_line(e, with_type=True)
                problems.append(f"step {s}: {why}")
                bad.append(s)
                if on_bad is not None:
                    on_bad(s, why)
                if log is not None and jax.process_index() == 0:
                    log(f"the checkpoint of step {s} {_unusable(why)}; trying the one before it")
                continue
            self.set_aside([b for b in bad if b > s], "corrupt")
            return s, restored["state"], restored["meta"]
        where = "; ".join(problems) if problems else "no checkpoints"
        raise CheckpointError(f"no usable checkpoint in {self.directory} ({where}); nothing was deleted")

    def _restore_verified(self, step: int, abstract_state: dict) -> dict:
        ocp = _ocp()
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()),
        )
        _check_complete(restored["state"], abstract_state)
        verify_checksums(restored["state"], restored["meta"].pop(CHECKSUMS, None))
        return restored

    def restore_params(
        self, step: int | None, target: dict, log: Callable[[str], None] | None = None
    ) -> tuple[int, dict]:
        """(step, parameters) of `step`, or of the latest checkpoint whose parameters restore intact
        (older ones tried, with a line to `log`, when the newest is damaged); no optimiser state, placed
        as `target`'s shardings say. A damaged `step` named by the caller is a CheckpointError."""
        candidates = [self.pick(step)] if step is not None else sorted(self.steps(), reverse=True)
        self.pick(None)  # a clear error when there are none
        problems = []
        for s in candidates:
            try:
                return s, self._restore_params_verified(s, target)
            except Exception as e:
                _quiet_abandoned_io()
                why = first_line(e, with_type=True)
                if step is not None:
                    raise CheckpointError(f"the checkpoint of step {s} in {self.directory} is damaged: {why}") from None
                problems.append(f"step {s}: {why}")
                if log is not None:
                    log(f"the checkpoint of step {s} is damaged ({why}); trying the one before it")
        raise CheckpointError(f"no usable checkpoint in {self.directory} ({'; '.join(problems)})")

    def _restore_params_verified(self, step: int, target: dict) -> dict:
        ocp = _ocp()
        item = {"params": target}
        restore = ocp.args.PyTreeRestore(
            item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
        )
        restored = self.manager.restore(step, args=ocp.args.Composite(state=restore, meta=ocp.args.JsonRestore()))
        params = restored["state"]["params"]
        verify_checksums({"params": params}, restored["meta"].get(CHECKSUMS))
        return params

    def set_aside(self, steps: list[int], reason: str) -> None:
        """Rename checkpoints the run will write again (damaged ones newer than the one resumed from,
        or those of a trajectory abandoned by a rollback) to STEP.REASON: kept for inspection, never
        deleted, invisible to the manager."""
        for step in steps if jax.process_index() == 0 else []:
            src = self.directory / str(step)
            if src.is_dir():
                dst, n = self.directory / f"{step}.{reason}", 1
                while dst.exists():
                    n += 1
                    dst = self.directory / f"{step}.{reason}{n}"
                src.rename(dst)
        if steps:
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("checkpoint set aside")
            self.manager.reload()

    def close(self) -> None:
        """Finish the save in flight and close. After a failed save, nothing is waited on: orbax's
        writer threads of the failed step may be stuck, and the failure was reported already."""
        if self.failed is not None:
            return
        try:
            self.manager.close()
        except Exception as e:
            self._fail(self.in_flight, e)


def _unusable(why: str) -> str:
    """What is wrong with a checkpoint that did not restore: intact files whose state tree is not
    the one this config trains (another version of the code, or another model or optimiser) are not
    damaged, and saying so would send the user looking for a disk fault."""
    if "tree structures do not match" in why:
        return f"holds another state tree than this config's model and optimiser (written by another version or config?) ({why})"
    return f"is damaged ({why})"


class _OrbaxErrors(logging.Filter):
    """orbax logs each failure of its writer threads with a traceback (hundreds of lines, through
    absl) before the same error reaches `Checkpointer.wait`, which reports it in one line (and the
    run journals it): those records are dropped, and so are the warnings that every read-only open
    gives (eval.py's), and those of each save without a validation loss (orbax is given `best_fn` only
    to keep the metrics it has). orbax's other warnings pass."""

    EXPECTED = ("CheckpointManagerOptions.read_only=True", "Given directory is read only", "Requested `tracked_metric`")

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" not in record.pathname:
            return True
        return record.levelno < logging.ERROR and not str(record.msg).startswith(self.EXPECTED)


class _AbandonedIO(logging.Filter):
    """A failed save or restore leaves asyncio tasks and futures of its other writes or reads whose
    errors nobody retrieves: asyncio logs each (a traceback of the same error) when it is collected,
    after the line that reported the failure. Dropped once a save or a restore has failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        headline = str(record.msg).split("\n", 1)[0]  # "Task/Future/_GatheringFuture exception was ..."
        return not headline.endswith("exception was never retrieved")


def _closed_loop_callbacks(unraisable) -> None:
    """tensorstore hands each write's completion to the save's event loop from its own threads; when a
    write fails, orbax closes that loop while the other writes still finish, and every late hand-off
    is an unraisable 'Event loop is closed' (a 5-line traceback each, dozens on a full disk), printed
    before the save's own error. Those are dropped; any other unraisable goes where it went."""
    exc = unraisable.exc_value
    if unraisable.object is None and isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return
    _closed_loop_callbacks.previous(unraisable)  # type: ignore[attr-defined]


def _quiet_orbax() -> None:
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxErrors) for f in absl.filters):
        absl.addFilter(_OrbaxErrors())
    if sys.unraisablehook is not _closed_loop_callbacks:
        _closed_loop_callbacks.previous = sys.unraisablehook  # type: ignore[attr-defined]
        sys.unraisablehook = _closed_loop_callbacks


def _quiet_abandoned_io() -> None:
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedIO) for f in asyncio_log.filters):
        asyncio_log.addFilter(_AbandonedIO())


# --- checksums ------------------------------------------------------------------------------------
# One 32-bit checksum per array, of its bytes and their positions: the wrapping sum over elements of
# fmix32(word + fmix32(flat index)). fmix32 (murmur3's finaliser) is a bijection, so a change to any
# one element always changes the sum, and damage to several is missed with odds of 2**-32. A sum does
# not depend on the order it is taken in, so the checksum is the same for any sharding: it is
# computed by a jitted reduction over the global array, where each device hashes the shards it holds
# and XLA adds the partial sums across devices and processes. With several processes, each one thus
# hashes the shards it saved (or restored, in whatever sharding it restored them), and every process
# compares the same total with the record: all of them accept or reject a checkpoint together.


def _fmix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words (8-byte elements give two words each)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size in (4, 8):
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(jnp.uint32)


def _leaf_checksum(x: jax.Array) -> jax.Array:
    words = _words(jnp.asarray(x))
    index, stride = jnp.zeros(words.shape, jnp.uint32), 1
    for d in reversed(range(words.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, d) * jnp.uint32(stride % 2**32)
        stride *= words.shape[d]
    return jnp.sum(_fmix32(words + _fmix32(index * jnp.uint32(0x9E3779B9) + jnp.uint32(1))), dtype=jnp.uint32)


_checksums = jax.jit(lambda leaves: [_leaf_checksum(x) for x in leaves])


def tree_checksums(tree) -> dict[str, int]:
    """{path: checksum} of every array in `tree`; the same on every process, for any sharding."""
    flat = jax.tree_util.tree_leaves_with_path(tree)
    sums = jax.device_get(_checksums([x for _, x in flat]))
    return {jax.tree_util.keystr(path): int(v) for (path, _), v in zip(flat, sums)}


def verify_checksums(tree, saved: dict | None) -> None:
    """A ValueError naming the first array whose checksum differs from the one saved (checkpoints
    written before checksums were recorded have none, and pass)."""
    if not saved:
        return
    for path, value in tree_checksums(tree).items():
        if path in saved and saved[path] != value:
            raise ValueError(f"checksum mismatch in {path}: its data changed after it was saved")


# --- the kept-best metrics records ---------------------------------------------------------------
METRICS_ITEM = "metrics"  # orbax's item (a directory) and file name of a step's kept-best metrics


def _record_is_valid(path: Path) -> bool:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    value = record.get("val_loss") if isinstance(record, dict) else None
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def repair_metrics_records(workdir: Path, directory: Path) -> None:
    """orbax reads every checkpoint's kept-best record (STEP/metrics/metrics) when it opens the
    directory, and stops with a traceback at one it cannot parse. Process 0 rewrites a damaged record
    from the validation loss that the run logged at that step, or, if none was, moves it aside as
    `metrics.corrupt` (the checkpoint then counts as one without metrics: kept while among the
    latest); each repair is journaled as `checkpoint_metrics_repaired`."""
    if jax.process_index() == 0 and directory.is_dir():
        for step_dir in sorted(p for p in directory.iterdir() if p.name.isdigit()):
            item = step_dir / METRICS_ITEM
            record = item / METRICS_ITEM
            if not item.exists() or (item.is_dir() and (not record.exists() or _record_is_valid(record))):
                continue
            _repair_record(workdir, int(step_dir.name), item, record)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("checkpoint metrics repaired")


def _repair_record(workdir: Path, step: int, item: Path, record: Path) -> None:
    logged = rundir.metric_series(workdir).get("val_loss", {}).get(step)
    if item.is_dir() and isinstance(logged, (int, float)) and math.isfinite(logged):
        rundir.atomic_write(record, json.dumps({"val_loss": float(logged)}))
        action = "rewritten from the logged validation loss"
    else:
        damaged = record if item.is_dir() else item
        damaged.rename(damaged.with_name(f"{METRICS_ITEM}.corrupt"))
        action = f"set aside as {damaged.with_name(METRICS_ITEM + '.corrupt').relative_to(workdir)}"
    events = rundir.RunWriter(workdir, True, tensorboard=False)
    try:
        events.event("checkpoint_metrics_repaired", step, action=action)
    finally:
        events.close()


def _check_complete(state, abstract_state) -> None:
    got = jax.tree.structure(state)
    want = jax.tree.structure(abstract_state)
    if got != want:  # type: ignore[operator]  # jaxlib's stub declares PyTreeDef.__eq__ only
        raise ValueError("the checkpoint's tree does not match the model")
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(abstract_state)):
        if a.shape != b.shape:
            raise ValueError(f"shape {a.shape} where the model has {b.shape}")


def state_is_finite(metrics: dict) -> bool:
    """The step's loss and parameter norm are finite: its parameters may be saved."""
    return all(math.isfinite(float(metrics[k])) for k in ("loss", "param_norm") if k in metrics)


def load(workdir: str | Path, step: int | None = None, log: Callable[[str], None] | None = None):
    """(config, model) of a run's latest (or given) checkpoint, on the current devices. Without a
    `step`, a damaged newest checkpoint is passed over for the one before (a line to `log` says so).

    For notebooks and eval: `cfg, model = load("runs/x")`; `model(tokens)` gives logits, of the model
    inference computes (`ModelConfig.at_inference`: a capacity-trained mixture of experts without drops).
    """
    from flax import nnx

    from transformer.accelerator import resolve
    from transformer.model import Transformer

    workdir = Path(workdir)
    if not rundir.has_config(workdir):
        raise CheckpointError(f"{workdir} holds no run (no {rundir.CONFIG})")
    cfg = rundir.read_config(workdir)
    model_cfg = resolve(cfg).model.at_inference  # attention_impl: auto -> this backend's pick
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract)
    params_shape = nnx.to_pure_dict(abstract_params)
    ckpt = Checkpointer(workdir, cfg.checkpoint, read_only=True)
    try:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), params_shape)
        _, params = ckpt.restore_params(step, target, log)
    finally:
        ckpt.close()
    return cfg, nnx.merge(graphdef, params)


def meta_record(cfg: Config, **host_state) -> dict:
    """The JSON part of a checkpoint."""
    return {"config": cfg.to_dict(), **host_state}


def partial_writes(directory: Path) -> list[str]:
    """Unfinished writes left by a crash; the Checkpointer removes them when it opens the directory."""
    if not directory.is_dir():
        return []
    return [p.name for p in directory.iterdir() if ".orbax-checkpoint-tmp" in p.name]
