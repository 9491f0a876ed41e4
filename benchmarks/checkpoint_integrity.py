"""Flipped bytes in a checkpoint: how many a restore would have taken silently, and how many the
per-array checksums catch.

    python benchmarks/checkpoint_integrity.py --workdir RUN [--trials 60] [--seed 0]

RUN is any finished run with checkpoints (e.g. `python train.py train.steps=20 checkpoint.every=10
--workdir RUN`). Each trial copies RUN, flips one random byte of a random array data file of its newest
checkpoint, and restores it twice: without the checksum check (what orbax alone notices) and with it.
A flip that leaves every restored array identical (padding, unused bytes) did no harm and counts apart.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformer import rundir, sharding
from transformer.io import checkpoint
from transformer.train.trainer import Trainer


def flip_one_byte(run: Path, step: int, rng: random.Random) -> None:
    files = [p for p in (run / rundir.CHECKPOINTS / str(step) / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    path = rng.choice(files)
    data = bytearray(path.read_bytes())
    data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(data))


def restore(run: Path, abstract: dict, step: int, cfg, good: list[np.ndarray]) -> str:
    """'same', 'changed' (restored without complaint, but different), 'error' (refused with a
    CheckpointError) or 'escaped: ...' (any other exception: a traceback a user would see)."""
    ckpt = checkpoint.Checkpointer(run, cfg.checkpoint, read_only=True)
    try:
        _, state, _ = ckpt.restore(abstract, step=step)
        ckpt.close()
    except checkpoint.CheckpointError:
        return "error"
    except Exception as e:
        return f"escaped: {type(e).__name__}"
    same = all(np.array_equal(a, np.asarray(b)) for a, b in zip(good, jax.tree.leaves(state)))
    return "same" if same else "changed"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--trials", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cfg = rundir.read_config(args.workdir)
    abstract = Trainer(cfg, sharding.make_mesh(cfg)).abstract_state()._asdict()
    step = max(int(d.name) for d in (args.workdir / rundir.CHECKPOINTS).iterdir() if d.name.isdigit())
    good = [np.asarray(x) for x in jax.tree.leaves(checkpoint_state(args.workdir, abstract, step, cfg))]
    verify, rng = checkpoint.verify_checksums, random.Random(args.seed)
    counts = {"harmless": 0, "refused_before": 0, "silent_before": 0, "detected_after": 0, "missed_after": 0}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.trials):
            run = Path(tmp) / "run"
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(args.workdir, run)
            flip_one_byte(run, step, rng)
            checkpoint.verify_checksums = lambda *a: None  # what orbax alone notices
            before = restore(run, abstract, step, cfg, good)
            checkpoint.verify_checksums = verify
            after = restore(run, abstract, step, cfg, good)
            if after.startswith("escaped"):
                counts[after] = counts.get(after, 0) + 1
            if before == "same":
                counts["harmless"] += 1
                continue
            counts["refused_before" if before == "error" else "silent_before"] += 1
            counts["detected_after" if after != "same" and after != "changed" else "missed_after"] += 1
    print(json.dumps({"trials": args.trials, **counts}))


def checkpoint_state(run: Path, abstract: dict, step: int, cfg):
    ckpt = checkpoint.Checkpointer(run, cfg.checkpoint, read_only=True)
    try:
        return ckpt.restore(abstract, step=step)[1]
    finally:
        ckpt.close()


if __name__ == "__main__":
    main()
