"""The report's figures, drawn from a `report.Report`. Each function returns a matplotlib Figure
(the object API, no pyplot state), so the renderer (`transformer/report/render.py`) saves them as PNGs and
a notebook displays them. This module reads the statistics only; it never imports the renderer."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from transformer import rundir
from transformer.report.scaling import LadderSummary
from transformer.report.stats import (
    LR_KEY,
    SIZE_KEYS,
    Report,
    Run,
    format_value,
    short_key,
    task_keys,
    transfer,
    transfer_points,
)

FACET_ABOVE = 8  # more variants than this: one panel per level of the compared key


def _colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _panels(report: Report) -> list[tuple[str, list[str]]]:
    """(title, variants) per panel: one panel, or one per level of the compared key."""
    variants = list(report.variants)
    levels: dict[str, list[str]] = {}
    for v, runs in report.variants.items():
        levels.setdefault(format_value(runs[0].values.get(report.compare)), []).append(v)
    if len(variants) <= FACET_ABOVE or len(levels) < 2:
        return [("", variants)]
    return [(f"{report.compare} = {level}", vs) for level, vs in levels.items()]


def _grid(n: int, width: float = 5.5, height: float = 3.8) -> tuple[Figure, list]:
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(width * cols + 2.5, height * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _smooth(y: np.ndarray, alpha: float = 0.1) -> np.ndarray:
    """Exponential moving average, so that variants' curves can be told apart through the noise."""
    out, level = np.empty_like(y), None
    for i, v in enumerate(y):
        level = v if level is None or not np.isfinite(level) else (1 - alpha) * level + alpha * v
        out[i] = level
    return out


def curves(report: Report, key: str, ylabel: str, log_y: bool = False, smooth: bool = True) -> Figure:
    """`key` against tokens trained, one colour per variant, one line per seed."""
    panels = _panels(report)
    fig, axes = _grid(len(panels))
    for ax, (title, variants) in zip(axes, panels):
        for color, variant in zip(_colors(len(variants)), variants):
            for i, run in enumerate(report.variants[variant]):
                steps, y = run.curve(key)
                if not len(steps):
                    continue
                ax.plot(
                    steps * run.tokens_per_step,
                    _smooth(y) if smooth else y,
                    color=color,
                    lw=1.0,
                    alpha=0.85,
                    label=variant if i == 0 else None,
                )
        if report.budget:
            ax.axvline(report.budget, color="0.6", lw=0.8, ls=":")
        ax.set(title=title, xlabel="tokens", ylabel=ylabel)
        if log_y:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper right")
    return fig


# Per-layer statistics only some runs have: the encoder stack and cross-attention of encoder-decoders,
# and the routing of mixtures of experts (indexed over their MoE layers).
OPTIONAL_PER_LAYER = [
    ("encoder_residual_rms", "encoder residual RMS"),
    ("encoder_attn_entropy", "encoder attention entropy (nats)"),
    ("cross_attn_entropy", "cross-attention entropy (nats)"),
    ("layer_expert_load_max", "busiest expert's share of tokens"),
    ("router_entropy", "router entropy (nats)"),
]
MOE_PER_LAYER = ("layer_expert_load_max", "router_entropy")  # their x axis counts MoE layers only


def per_layer(report: Report) -> Figure | None:
    """Residual RMS and attention entropy per layer at the last statistics step (and, for mixtures
    of experts, the busiest expert's load and the router's entropy per MoE layer): one line per
    variant (mean over seeds), or, with many variants, per level of the compared key and depth
    (mean over everything else)."""
    keys = [("residual_rms", "residual RMS"), ("attn_entropy", "attention entropy (nats)")]
    keys += [(k, label) for k, label in OPTIONAL_PER_LAYER if any(r.last_list(k) for r in report.runs)]
    if not any(r.last_list(k) for r in report.runs for k, _ in keys):
        return None
    groups: dict[str, list] = {}
    many = len(report.variants) > FACET_ABOVE
    for variant, runs in report.variants.items():
        for run in runs:
            label = f"{short_key(report.compare)}={format_value(run.values.get(report.compare))}" if many else variant
            groups.setdefault(f"{label}, {run.config.model.n_layers} layers" if many else label, []).append(run)
    fig, axes = _grid(len(keys), width=5.0)
    for ax, (key, label) in zip(axes, keys):
        for color, (name, runs) in zip(_colors(len(groups)), groups.items()):
            lists = [x for x in (r.last_list(key) for r in runs) if x and np.isfinite(x).any()]
            if not lists or len({len(x) for x in lists}) != 1:
                continue
            mean = np.nanmean(np.array(lists), axis=0)
            ax.plot(np.arange(len(mean)), mean, marker="o", ms=3, color=color, label=name)
        xlabel = "MoE layer" if key in MOE_PER_LAYER else "layer"
        ax.set(xlabel=xlabel, ylabel=label, title=f"{label} at the end")
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    return fig


def _by_lr(report: Report, value: Callable[[Run], Any]) -> tuple[list[str], dict[str, dict[float, list]]]:
    """The other varied keys, and each finished run's `value` (None: left out) by the setting of
    those keys (a line's label) and by learning rate."""
    others = [k for k in report.keys if k != LR_KEY]
    lines: dict[str, dict[float, list]] = {}
    for run in report.finished(report.runs):
        point = value(run)
        if point is not None:
            label = ",".join(format_value(run.values.get(k)) for k in others) or "all"
            lines.setdefault(label, {}).setdefault(float(run.values[LR_KEY]), []).append(point)
    return others, lines


def loss_vs_lr(report: Report) -> Figure | None:
    """Final loss (capped at the initial loss, as in the LR sensitivity) against the learning rate,
    one line per setting of the other varied keys; crosses mark diverged runs."""
    if LR_KEY not in report.keys:
        return None
    others, lines = _by_lr(report, lambda run: (report.capped_final_loss(run), report.summaries[run.name].diverged))
    if not lines:
        return None
    fig, (ax,) = _grid(1, width=7.0, height=4.5)
    for color, (label, points) in zip(_colors(len(lines)), lines.items()):
        lrs = sorted(points)
        mean = [np.mean([p[0] for p in points[lr]]) for lr in lrs]
        err = [np.std([p[0] for p in points[lr]], ddof=1) if len(points[lr]) > 1 else 0 for lr in lrs]
        ax.errorbar(lrs, mean, yerr=err, color=color, marker="o", ms=3, capsize=2, label=label)
        bad = [(lr, m) for lr, m in zip(lrs, mean) if any(d for _, d in points[lr])]
        if bad:
            ax.scatter(*zip(*bad), marker="x", s=60, color=color, zorder=3)
    ax.set_xscale("log")
    ax.set(
        xlabel="learning rate",
        ylabel="final loss (capped at initial)",
        title="loss against learning rate (x: diverged)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, title=", ".join(short_key(k) for k in others) or None, title_fontsize=7)
    return fig


def stat_vs_lr(report: Report, field: str, ylabel: str, log_y: bool = False) -> Figure | None:
    """A run's stability statistic (a `Summary` field) against the learning rate, one line per
    setting of the other varied keys, mean and std over seeds: Wortsman et al.'s attention-logit
    growth and entropy collapse, and output-logit divergence, against the learning rate."""
    if LR_KEY not in report.keys:
        return None

    def finite(run: Run) -> float | None:
        value = float(getattr(report.summaries[run.name], field))
        return value if math.isfinite(value) else None

    others, lines = _by_lr(report, finite)
    if not lines:
        return None
    fig, (ax,) = _grid(1, width=7.0, height=4.5)
    for color, (label, points) in zip(_colors(len(lines)), lines.items()):
        lrs = sorted(points)
        err = [np.std(points[lr], ddof=1) if len(points[lr]) > 1 else 0 for lr in lrs]
        ax.errorbar(
            lrs, [np.mean(points[lr]) for lr in lrs], yerr=err, color=color, marker="o", ms=3, capsize=2, label=label
        )
    ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
    ax.set(xlabel="learning rate", ylabel=ylabel, title=f"{ylabel} against learning rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, title=", ".join(short_key(k) for k in others) or None, title_fontsize=7)
    return fig


def lr_transfer(report: Report) -> Figure | None:
    """Final loss against the learning rate, a curve per model size (µP's Figure 1), a panel per
    size key and setting of the other keys; a dotted line marks each size's best learning rate."""
    found = {size: (transfer(report, size), transfer_points(report, size)) for size in SIZE_KEYS}
    panels = [(size, setting) for size, (best_by_setting, _) in found.items() for setting in best_by_setting]
    if not panels:
        return None
    fig, axes = _grid(len(panels))
    for ax, (size, setting) in zip(axes, panels):
        others = [k for k in report.keys if k not in (LR_KEY, size)]
        best_by_setting, points = found[size]
        curves_by_size = points[setting]
        for color, (value, (best, _)) in zip(_colors(len(curves_by_size)), best_by_setting[setting].items()):
            lrs = sorted(curves_by_size[value])
            ax.plot(
                lrs,
                [curves_by_size[value][lr] for lr in lrs],
                marker="o",
                ms=3,
                color=color,
                label=f"{short_key(size)}={value}",
            )
            ax.axvline(best, color=color, ls=":", lw=1)
        ax.set_xscale("log")
        ax.set(xlabel="learning rate", ylabel="final loss (capped at initial)")
        title = ", ".join(f"{short_key(k)}={format_value(v)}" for k, v in zip(others, setting))
        ax.set_title(title or short_key(size), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def loss_vs_compute(report: Report, ladder: LadderSummary | None) -> Figure | None:
    """A ladder's final loss against training compute on log axes, a panel per setting: each
    variant's points (a dot per seed, at its best learning rate per rung), its fit L(C) = E + A·C^-α
    and the fit's 95% bootstrap band, out to the extrapolated target (report/scaling.py)."""
    if ladder is None or not ladder.found:
        return None
    fig, axes = _grid(len(ladder.found))
    for ax, (setting, found) in zip(axes, ladder.found.items()):
        by_level = ladder.curves[setting]
        for color, (level, fit) in zip(_colors(len(found.fits)), found.fits.items()):
            compute, loss = by_level[level].arrays(found.rungs)
            ax.scatter(
                compute, loss, s=12, color=color, label=f"{format_value(level)}: α={fit.alpha:.3f}, E={fit.E:.2f}"
            )
            if level in found.band:
                grid, low, high = found.band[level]
                ax.plot(grid, fit.loss(grid), color=color, lw=1.2)
                ax.fill_between(grid, low, high, color=color, alpha=0.15, lw=0)
        for c, extrapolated in found.targets:
            if extrapolated:
                ax.axvline(c, color="0.5", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set(xlabel="training compute (model FLOPs)", ylabel="final loss (nats)")
        ax.set_title(", ".join(format_value(v) for v in setting) or short_key(report.compare), fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return fig


def task_figures(report: Report) -> list[tuple[str, str, Figure]]:
    """Each downstream task metric (train.eval_tasks) against tokens, a figure each."""
    keys = dict.fromkeys(k for r in report.runs for k in task_keys(r.series))
    return [
        (f"{key.removeprefix('eval/')} against tokens", key.replace("/", "_"), curves(report, key, key, smooth=False))
        for key in keys
    ]


def figures(report: Report, ladder: LadderSummary | None = None) -> list[tuple[str, str, Figure]]:
    """(title, file stem, figure) for every plot the data supports (`ladder`: a ladder's scaling)."""
    out = [
        ("training loss (EMA) against tokens", "loss", curves(report, "loss", "train loss (nats)")),
        (
            "gradient norm against tokens",
            "grad_norm",
            curves(report, "grad_norm", "gradient norm", log_y=True, smooth=False),
        ),
    ]
    val = (
        curves(report, "val_loss", "validation loss (nats)", smooth=False)
        if any(r.curve("val_loss")[0].size for r in report.runs)
        else None
    )
    for title, stem, fig in (
        ("validation loss against tokens", "val_loss", val),
        *task_figures(report),
        ("per-layer statistics at the end", "layers", per_layer(report)),
        ("loss against learning rate", "lr", loss_vs_lr(report)),
        ("learning-rate transfer across model size", "lr_transfer", lr_transfer(report)),
        (
            "max attention logit against learning rate",
            "attn_logit_lr",
            stat_vs_lr(report, "max_attn_logit", "max attention logit", log_y=True),
        ),
        (
            "min attention entropy against learning rate",
            "attn_entropy_lr",
            stat_vs_lr(report, "min_attn_entropy", "min attention entropy (nats)"),
        ),
        (
            "output |log Z| against learning rate",
            "log_z_lr",
            stat_vs_lr(report, "max_abs_log_z", "max |output log Z|", log_y=True),
        ),
        (
            "output log Z against tokens",
            "log_z",
            curves(report, "log_z_mean", "output log Z (mean)", smooth=False)
            if any(r.curve("log_z_mean")[0].size for r in report.runs)
            else None,
        ),
        ("final loss against training compute (ladder)", "scaling", loss_vs_compute(report, ladder)),
    ):
        if fig is not None:
            out.append((title, stem, fig))
    return out


def plot_all(report: Report, directory: Path, ladder: LadderSummary | None = None) -> list[tuple[str, Path]]:
    """Save every figure as `directory`/STEM.png; (title, path) of each."""
    directory.mkdir(parents=True, exist_ok=True)
    saved = []
    for title, stem, fig in figures(report, ladder):
        path = directory / f"{stem}.png"
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
        rundir.atomic_write(path, png.getvalue())  # a planted link is replaced, not written through
        saved.append((title, path))
    return saved
