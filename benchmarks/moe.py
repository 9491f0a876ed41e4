"""Step time of mixture-of-experts FFNs against a dense FFN at equal active parameters.

    python benchmarks/moe.py [--preset cpu-study] [--rounds 7] [--steps 5] [key.path=value ...]

Variants (all on the preset's model, SwiGLU d_ff = F): dense; top-1 of 4 experts of width F; top-2
of 4 experts of width F/2 (capacity factor 1.25); the same top-2 dropless (`ragged_dot`). Each gives a
token the same FFN parameters. The variants are timed interleaved (round r times every variant in
turn, `--steps` steps each, after one compiled warm-up step), so load from other processes on the
machine falls on all of them alike; the figure is the median over rounds of each variant's median
step time, divided by the dense one's, and beside it the quartiles of the rounds' own ratios (each
round's median over the same round's dense one; a round that caught a stall of the machine's sits
outside them). Random token batches: this measures the step only. Like
train.py, the script restarts itself once with malloc in huge pages (`TRANSFORMER_HUGE_PAGES=0`:
not), and malloc keeps each step's buffer where train.py would (`TRANSFORMER_KEEP_BUFFERS=0`: not).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformer.accelerator import describe_host_memory, restart_with_malloc_tunables

if __name__ == "__main__":  # as train.py runs: malloc's pages huge where it can (benchmarks/README.md)
    restart_with_malloc_tunables()

import jax
from throughput import Stepper, preset_path

from transformer.config_loader import load_config
from transformer.model.summary import active_params, count_params


def variants(d_ff: int) -> dict[str, list[str]]:
    moe = ["model.n_experts=4"]
    return {
        "dense": [],
        "top-1 of 4 (width F)": [*moe, "model.top_k=1", f"model.moe_d_ff={d_ff}"],
        "top-2 of 4 (width F/2)": [*moe, "model.top_k=2", f"model.moe_d_ff={d_ff // 2}"],
        "top-2 of 4, dropless": [*moe, "model.top_k=2", f"model.moe_d_ff={d_ff // 2}", "model.capacity_factor=null"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-study")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    base = load_config(preset_path(args.preset), args.overrides)
    timed = {
        name: Stepper(load_config(preset_path(args.preset), [*args.overrides, *extra]))
        for name, extra in variants(base.model.d_ff).items()
    }
    medians: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(args.rounds):
        for name, t in timed.items():
            medians[name].append(statistics.median(t.steps(args.steps)))
    m = base.model
    print(
        f"{args.preset}: d_model {m.d_model}, {m.n_layers} layers, d_ff {m.d_ff}, batch {base.train.batch_size} x {base.data.seq_len}"
    )
    print(
        f"{jax.device_count()} {jax.default_backend()} device(s); median of {args.rounds} interleaved rounds of {args.steps} steps"
    )
    print(describe_host_memory())
    for name, t in timed.items():
        print(f"  {name}: {t.buffers}")
    dense = statistics.median(medians["dense"])
    for name, t in timed.items():
        step = statistics.median(medians[name])
        ratios = [a / b for a, b in zip(medians[name], medians["dense"])]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0], None, ratios[0])
        total, active = count_params(t.cfg.model), active_params(t.cfg.model)
        print(
            f"  {name:<24} {1000 * step:8.1f} ms/step  x{step / dense:5.2f} (rounds' quartiles x{q1:.2f}-{q3:.2f})"
            f"  params {total:>9,} total {active:>9,} active"
        )


if __name__ == "__main__":
    main()
