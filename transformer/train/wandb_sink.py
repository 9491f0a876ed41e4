"""Weights & Biases as a second home for a run's scalars (`logging.wandb`, off by default): the same
tags TensorBoard gets, the resolved config, one W&B run per run directory (resumed with it), and one
group per sweep. Imported by the training loop; `wandb` itself only when a mode is on."""

from __future__ import annotations

import hashlib
from pathlib import Path

from transformer.config import Config
from transformer.rundir import ScalarSink

SWEEP_MANIFEST = "sweep.json"  # transformer/sweep/expansion.py's MANIFEST: a member's parent directory holds it


def scalar_sinks(cfg: Config, workdir: Path | None, lead: bool) -> list[ScalarSink]:
    """The extra sinks a run's scalars go to: a W&B run when `logging.wandb.mode` is not disabled."""
    if cfg.logging.wandb.mode == "disabled" or workdir is None or not lead:
        return []
    return [WandbSink(cfg, workdir)]


def sweep_group(workdir: Path) -> str | None:
    """A sweep member's group: its sweep's directory name."""
    return workdir.resolve().parent.name if (workdir.parent / SWEEP_MANIFEST).is_file() else None


class WandbSink:
    def __init__(self, cfg: Config, workdir: Path):
        import wandb

        w = cfg.logging.wandb
        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            group=w.group or sweep_group(workdir),
            name=workdir.resolve().name,
            # the same W&B run across resumes of one run directory
            id=hashlib.sha1(str(workdir.resolve()).encode()).hexdigest()[:16],
            resume="allow",
            dir=str(workdir),
            mode=w.mode,
            config=cfg.to_dict(),
            settings=wandb.Settings(console="off", silent=True),
        )

    def scalars(self, step: int, tags: list[tuple[str, float]]) -> None:
        self.run.log(dict(tags), step=step)

    def close(self) -> None:
        self.run.finish()
