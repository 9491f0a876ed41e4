"""What downstream evaluation costs: one in-loop `train.eval_tasks` evaluation of a run's model,
against the training steps it sits between.

    python benchmarks/downstream.py --workdir RUN [--tasks stdlib_next_line] [--limit 200] [--rounds 5]

Loads RUN's latest checkpoint and its tasks once (as the loop does), then times `--rounds`
evaluations after a first one that compiles: the median wall time, the tokens computed per second
(padding included; the real tokens' share is printed) and their forward FLOPs as a fraction of the
machine's measured matmul peak.
The scores must be the same every round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flax import nnx

from transformer import sharding
from transformer.data import cache_directory, make_objective, make_tokenizer
from transformer.eval import harness
from transformer.eval.evaluate import restore_params, run_config, task_suite
from transformer.model.summary import flops_per_token
from transformer.train import Trainer
from transformer.train.metrics import device_peak_flops


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", required=True)
    p.add_argument("--tasks", default="stdlib_next_line")
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    workdir = Path(args.workdir)
    cfg = run_config(workdir, [])
    trainer = Trainer(cfg, sharding.make_mesh(cfg))
    step, params = restore_params(cfg, workdir, None, trainer)
    vocab = make_objective(cfg.data, make_tokenizer(cfg.data, workdir, cache_directory(cfg.data))).vocab
    loaded = task_suite(cfg, args.tasks.split(","), [], progress=False)
    times, results, lm = [], [], None
    for _ in range(args.rounds + 1):
        lm = harness.make_lm(cfg, nnx.merge(trainer.graphdef, params), vocab, cfg.train.batch_size)
        start = time.perf_counter()
        results.append(harness.run_tasks(lm, loaded, args.limit, progress=False))
        times.append(time.perf_counter() - start)
    assert all(r == results[0] for r in results), "an evaluation gave other scores than the first"
    seconds, peak = statistics.median(times[1:]), device_peak_flops()[0]
    assert lm is not None
    mean_len = lm.scorer.computed / (lm.scorer.batches * lm.scorer.batch)  # padded rows' mean length
    flops = lm.scorer.computed * flops_per_token(cfg.model, round(mean_len)) / 3  # forward only
    for task, metrics in results[0].items():
        print(f"step {step} {task}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    print(
        f"one evaluation of {args.limit} items: {seconds:.2f} s median of {args.rounds} (the first, compiling: "
        f"{times[0]:.2f} s); {lm.scorer.computed / seconds:,.0f} tokens/s computed, "
        f"{lm.scorer.scored / lm.scorer.computed:.0%} of them real; {flops / seconds / peak:.1%} of the measured "
        f"matmul peak ({peak / 1e12:.3f} TFLOP/s)"
    )


if __name__ == "__main__":
    main()
