"""Checkpoints (orbax): save, resume from the latest valid one, refuse unsafe config changes, load.

A checkpoint holds the train state (step, parameters, optimiser state) and a JSON record of
everything else a run needs to continue exactly: the resolved config, and the host-side state that
later features keep (monitor window, skipped batches). Dropout keys derive from (seed, step) and
batches from (data config, seed, step), so no RNG or iterator state is needed beyond the step.

orbax writes each checkpoint into a temporary directory and renames it when complete, so a crash
mid-save never leaves something that looks finished; leftovers are cleaned at start-up.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from pathlib import Path

import jax

from transformer import rundir
from transformer.config import CheckpointConfig, Config, ConfigError
from transformer.errors import first_line


class CheckpointError(RuntimeError):
    """A checkpoint problem that stops the run (exit 1): nothing valid to resume from, a failed save."""


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

        self.directory = Path(workdir) / rundir.CHECKPOINTS
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
            preservation_policy=policies.AnyPreservationPolicy(keep),
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
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
        ocp = _ocp()
        metrics = {"val_loss": float(val_loss)} if val_loss is not None and math.isfinite(val_loss) else None
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                metrics=metrics,
                force=True,
            )
            if wait:
                self.manager.wait_until_finished()
        except Exception as e:  # disk full, permissions changed under us, ...
            raise CheckpointError(
                f"saving the checkpoint of step {step} failed: {first_line(e, with_type=True)}"
            ) from None

    def wait(self) -> None:
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise CheckpointError(f"finishing a checkpoint write failed: {first_line(e, with_type=True)}") from None

    def restore(self, abstract_state: dict, step: int | None = None, on_bad: Callable[[int, str], None] | None = None):
        """(step, state, meta) of `step`, or of the latest checkpoint that restores cleanly, trying
        older ones when the newest is damaged. Raises CheckpointError when none is usable."""
        ocp = _ocp()
        candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
        problems, bad = [], []
        for s in candidates:
            try:
                restored = self.manager.restore(
                    s,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                    ),
                )
                _check_complete(restored["state"], abstract_state)
            except Exception as e:
                problems.append(f"step {s}: {first_line(e, with_type=True)}")
                bad.append(s)
                if on_bad is not None:
                    on_bad(s, first_line(e, with_type=True))
                continue
            self.set_aside([b for b in bad if b > s], "corrupt")
            return s, restored["state"], restored["meta"]
        where = "; ".join(problems) if problems else "no checkpoints"
        raise CheckpointError(f"no usable checkpoint in {self.directory} ({where}); nothing was deleted")

    def restore_params(self, step: int, target: dict) -> dict:
        """Only the parameters of a checkpoint (no optimiser state), placed as `target`'s shardings say."""
        ocp = _ocp()
        item = {"params": target}
        restore = ocp.args.PyTreeRestore(
            item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
        )
        return self.manager.restore(step, args=ocp.args.Composite(state=restore))["state"]["params"]

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
        self.manager.close()


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


def load(workdir: str | Path, step: int | None = None):
    """(config, model) of a run's latest (or given) checkpoint, on the current devices.

    For notebooks and eval: `cfg, model = load("runs/x")`; `model(tokens)` gives logits.
    """
    from flax import nnx

    from transformer.model import Transformer

    workdir = Path(workdir)
    if not rundir.has_config(workdir):
        raise CheckpointError(f"{workdir} holds no run (no {rundir.CONFIG})")
    cfg = rundir.read_config(workdir)
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract)
    params_shape = nnx.to_pure_dict(abstract_params)
    ckpt = Checkpointer(workdir, cfg.checkpoint, read_only=True)
    try:
        step = ckpt.pick(step)
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), params_shape)
        params = ckpt.restore_params(step, target)
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
