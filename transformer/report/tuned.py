"""Each variant at its own best learning rate: a sweep that crosses the compared key with a
learning-rate grid (an optimiser study, an architecture tuned per variant) compares every variant on
its tuned frontier rather than at one shared learning rate, which would favour whichever variant the
shared value happens to suit (Wen et al. 2025, arXiv 2509.02046).

For each setting of the other varied keys and each level of the compared key: the grid's learning
rate with the lowest mean final loss over seeds (capped at the initial loss, as the sensitivity
counts a diverged run); the final loss there with its 95% t-interval over seeds; its difference from
the first level's (the baseline, e.g. AdamW: the first in the sweep's order), paired by seed (a
seed is the same data order and init in every variant), with that interval; and the steps each seed
takes for its smoothed training loss to reach the same seed's baseline final value, and the speedup
that makes (the mean of the seeds' ratios).
"""

from __future__ import annotations

import math

import numpy as np

from transformer.report.stats import (
    LR_KEY,
    Report,
    Run,
    _hashable,
    format_value,
    independent_keys,
    mean_interval,
    short_key,
)

SMOOTHING = 0.05  # the training loss is averaged over a trailing window of this share of a run's steps
TUNED_NOTE = (
    "Each level at the grid learning rate with its lowest mean final loss over seeds. Final loss: the last "
    "validation loss, mean and 95% t-interval over seeds; Δ: its difference from the first level's at that "
    "level's own best learning rate, paired by seed; steps to reach: the first step at which a seed's training "
    f"loss, averaged over a trailing {SMOOTHING:.0%} of its steps, is at or below the first level's final value "
    "so averaged for the same seed; speedup: the mean over seeds of the first level's steps to that value over "
    "this level's."
)


def _smoothed(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """(steps, the training loss's trailing mean over SMOOTHING of the logged points)."""
    steps, loss = run.curve("loss")
    window = max(1, round(SMOOTHING * len(loss)))
    kernel = np.convolve(loss, np.ones(window), "full")[: len(loss)]
    counts = np.minimum(np.arange(1, len(loss) + 1), window)
    return steps, kernel / counts


def _cells(report: Report) -> dict[tuple, dict]:
    """{setting of the other varied keys: {level: {lr: [finished runs]}}}."""
    others = independent_keys(report, report.compare, (LR_KEY,))
    out: dict[tuple, dict] = {}
    for run in report.finished(report.runs):
        setting = tuple(_hashable(run.values.get(k)) for k in others)
        level = _hashable(run.values.get(report.compare))
        out.setdefault(setting, {}).setdefault(level, {}).setdefault(float(run.values[LR_KEY]), []).append(run)
    return out


def _best(report: Report, by_lr: dict[float, list[Run]]) -> tuple[float, list[Run]]:
    lr = min(by_lr, key=lambda x: float(np.mean([report.capped_final_loss(r) for r in by_lr[x]])))
    return lr, by_lr[lr]


def _interval(values: list[float], fmt: str) -> str:
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "–"
    if len(values) < 2:
        return f"{fmt.format(values[0])} (one seed)"
    mean, lo, hi = mean_interval(values)
    return f"{fmt.format(mean)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def _steps_to(run: Run, target: float) -> float:
    steps, loss = _smoothed(run)
    reached = np.flatnonzero(loss <= target)
    return float(steps[reached[0]]) if len(reached) else math.nan


def _levels(report: Report) -> list:
    """The compared key's levels in the sweep's order (the first is the baseline), finished or not."""
    return list(dict.fromkeys(_hashable(r.values.get(report.compare)) for r in report.runs))


def tuned_rows(report: Report) -> tuple[list[str], list[list[str]]]:
    """Header and rows (`TUNED_NOTE`); no rows unless the report varies the learning rate and
    another key it compares. Without a finished run of the first level in a setting, its other
    levels' differences and steps are "–"."""
    others = independent_keys(report, report.compare, (LR_KEY,))
    header = [short_key(k) for k in [*others, report.compare]] + ["best lr", "final loss (95% CI)"]
    header += ["Δ vs first (95% CI)", "steps to reach first's final loss", "speedup"]
    if LR_KEY not in report.keys or report.compare in ("", LR_KEY):
        return header, []
    order = _levels(report)
    rows = []
    for setting, levels in _cells(report).items():
        base = _best(report, levels[order[0]])[1] if order[0] in levels else []
        targets = {r.seed: float(_smoothed(r)[1][-1]) for r in base}
        targets = {seed: t for seed, t in targets.items() if math.isfinite(t)}
        base_by_seed = {r.seed: r for r in base}
        for level in (v for v in order if v in levels):
            rows.append(_row(report, [*setting, level], levels[level], base_by_seed, targets))
    return header, rows


def _row(report: Report, labels: list, by_lr: dict[float, list[Run]], base: dict[int, Run], targets: dict) -> list[str]:
    """One level's row against the first level's runs `base` and smoothed final losses `targets`,
    both by seed: every comparison is of the same seed (data order and init)."""
    lr, runs = _best(report, by_lr)
    diffs = [report.final_loss(r) - report.final_loss(base[r.seed]) for r in runs if r.seed in base]
    finite = [d for d in diffs if math.isfinite(d)]
    paired = [r for r in runs if r.seed in targets]
    steps = {r.seed: _steps_to(r, targets[r.seed]) for r in paired}
    reached = [v for v in steps.values() if math.isfinite(v)]
    if not paired:
        steps_cell, speed = "–", "–"
    else:
        steps_cell = f"{_interval(reached, '{:.0f}')} ({len(reached)}/{len(paired)} seeds)"
        ratios = [_steps_to(base[seed], targets[seed]) / v for seed, v in steps.items()]
        speed = f"{np.mean(ratios):.2f}x" if len(reached) == len(paired) else "not reached"
    edge = " (grid edge)" if lr in (min(by_lr), max(by_lr)) else ""
    row = [format_value(v) for v in labels] + [f"{lr:g}{edge}"]
    row += [_interval([report.final_loss(r) for r in runs], "{:.4f}")]
    row += [_interval(finite, "{:+.4f}") + (f" (n={len(finite)})" if len(finite) > 1 else "")]
    return row + [steps_cell, speed]
