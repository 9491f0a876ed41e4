"""Each variant at its own best learning rate: a sweep that crosses the compared key with a
learning-rate grid (an optimiser study, an architecture tuned per variant) compares every variant on
its tuned frontier rather than at one shared learning rate, which would favour whichever variant the
shared value happens to suit (Wen et al. 2025, arXiv 2509.02046).

For each setting of the other varied keys and each level of the compared key: the grid's learning
rate with the lowest mean final loss over seeds (capped at the initial loss, as the sensitivity
counts a diverged run); the final loss there with its 95% t-interval over seeds; its difference from
the first level's (the baseline, e.g. AdamW), paired by seed (a seed is the same data order and
init in every variant), with that interval; and the steps each seed takes for its smoothed training
loss to reach the baseline's final one, and the speedup that makes.
"""

from __future__ import annotations

import math

import numpy as np

from transformer.report.stats import LR_KEY, Report, Run, _hashable, format_value, mean_interval, short_key

SMOOTHING = 0.05  # the training loss is averaged over a trailing window of this share of a run's steps
TUNED_NOTE = (
    "Each level at the grid learning rate with its lowest mean final loss over seeds. Final loss: the last "
    "validation loss, mean and 95% t-interval over seeds; Δ: its difference from the first level's at that "
    "level's own best learning rate, paired by seed; steps to reach: the first step at which a seed's training "
    f"loss, averaged over a trailing {SMOOTHING:.0%} of its steps, is at or below the first level's final value "
    "so averaged (mean over its seeds), and the speedup that is over the first level."
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
    others = [k for k in report.keys if k not in (LR_KEY, report.compare)]
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


def tuned_rows(report: Report) -> tuple[list[str], list[list[str]]]:
    """Header and rows (`TUNED_NOTE`); no rows unless the report varies the learning rate and
    another key it compares."""
    others = [k for k in report.keys if k not in (LR_KEY, report.compare)]
    header = [short_key(k) for k in [*others, report.compare]] + ["best lr", "final loss (95% CI)"]
    header += ["Δ vs first (95% CI)", "steps to reach first's final loss", "speedup"]
    if LR_KEY not in report.keys or report.compare in ("", LR_KEY):
        return header, []
    rows = []
    for setting, levels in _cells(report).items():
        _, base_runs = _best(report, next(iter(levels.values())))
        base_loss = {r.seed: report.final_loss(r) for r in base_runs}
        target = float(np.mean([_smoothed(r)[1][-1] for r in base_runs]))
        base_steps = float(np.nanmean([_steps_to(r, target) for r in base_runs]))
        for level, by_lr in levels.items():
            lr, runs = _best(report, by_lr)
            diffs = [report.final_loss(r) - base_loss[r.seed] for r in runs if r.seed in base_loss]
            steps = [_steps_to(r, target) for r in runs]
            reached = [s for s in steps if math.isfinite(s)]
            speed = f"{base_steps / np.mean(reached):.2f}x" if len(reached) == len(steps) else "not reached"
            edge = " (grid edge)" if lr in (min(by_lr), max(by_lr)) else ""
            row = [format_value(v) for v in (*setting, level)] + [f"{lr:g}{edge}"]
            row += [_interval([report.final_loss(r) for r in runs], "{:.4f}"), _interval(diffs, "{:+.4f}")]
            row += [f"{_interval(reached, '{:.0f}')} ({len(reached)}/{len(steps)} seeds)", speed]
            rows.append(row)
    return header, rows
