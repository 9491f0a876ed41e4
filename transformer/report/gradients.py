"""A sweep's gradient profiles at initialisation (`train.py SWEEP --grad-profile`, train/gradprofile.py)
side by side over norm placements and depths: Xiong et al. 2020's comparison (arXiv 2002.04745). Their
Theorem 1 has the last layer's FFN gradient at initialisation O(d sqrt(ln d)) under Post-LN whatever
the depth L and O(d sqrt(ln d / L)) under Pre-LN, so the ratio grows as sqrt(L). The summary gives, per
placement and depth, that ratio over Pre-LN's at the same depth and seed, and its slope in log-log
against depth fitted for each seed, as a mean with a 95% t-interval; the figure, each placement's FFN
gradient against layer index at the deepest depth and the ratios against depth beside sqrt(L).
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from transformer.config import Config
from transformer.report.stats import mean_interval

if TYPE_CHECKING:  # read through its methods only: the report imports nothing of the trainer
    from transformer.train import GradProfile

SUMMARY_FILE, SUMMARY_FIGURE = "grad_profile_summary.json", "grad_profile_summary.png"
PREDICTED_SLOPE = 0.5  # Xiong et al.: the Post-LN / Pre-LN ratio of the last layer's FFN gradient ~ sqrt(L)


@dataclasses.dataclass
class GradientSummary:
    """A sweep's profiles side by side: per placement, per depth, the last layer's FFN gradient norm
    of each seed, and its ratio over Pre-LN's at the same depth and seed."""

    last_ffn: dict[str, dict[int, list[float]]]
    ratios: dict[str, dict[int, list[float]]]

    def slope(self, placement: str) -> tuple[float, float, float] | None:
        """The slope of log ratio against log depth, fitted for each seed on its own: (their mean,
        its 95% t-interval; nan with one seed), None under two depths."""
        by_depth = self.ratios[placement]
        depths = sorted(by_depth)
        seeds = min(len(v) for v in by_depth.values()) if depths else 0
        if len(depths) < 2 or not seeds:
            return None
        x = np.log(depths)
        per_seed = [float(np.polyfit(x, np.log([by_depth[d][s] for d in depths]), 1)[0]) for s in range(seeds)]
        return mean_interval(per_seed) if seeds > 1 else (per_seed[0], float("nan"), float("nan"))

    def lines(self) -> list[str]:
        out = []
        for placement, by_depth in self.ratios.items():
            depths = sorted(by_depth)
            means = [float(np.mean(by_depth[d])) for d in depths]
            text = ", ".join(f"L={d} {m:.3g}" for d, m in zip(depths, means))
            line = f"{placement} / pre, last layer's FFN gradient norm at init: {text}"
            fit = self.slope(placement)
            if fit is not None:
                seeds = min(len(v) for v in by_depth.values())
                interval = (
                    f" (95% interval {fit[1]:+.2f} to {fit[2]:+.2f}, {seeds} seeds)" if seeds > 1 else " (1 seed)"
                )
                line += f"; grows as L^{fit[0]:.2f}{interval}"
                if placement == "post":
                    line += f"; Xiong et al. predict L^{PREDICTED_SLOPE}"
            out.append(line)
        return out

    def to_json(self) -> str:
        slopes = {p: self.slope(p) for p in self.ratios}
        return json.dumps({"last_ffn": self.last_ffn, "ratios": self.ratios, "slopes": slopes})


def summarize_gradients(profiles: list[tuple[Config, GradProfile]]) -> GradientSummary | None:
    """The summary of a sweep's profiles over placements and depths, or None where it has no Pre-LN
    member to compare with (members at the same placement, depth and seed: the first counts)."""
    last: dict[str, dict[int, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for cfg, profile in profiles:
        cell = last[cfg.model.norm_position][cfg.model.n_layers]
        cell.setdefault(cfg.train.seed, profile.group("FFN")[-1])
    if "pre" not in last:
        return None
    ratios: dict[str, dict[int, list[float]]] = {}
    for placement, by_depth in last.items():
        if placement == "pre":
            continue
        shared = {
            depth: [seeds[s] / last["pre"][depth][s] for s in sorted(seeds) if s in last["pre"].get(depth, {})]
            for depth, seeds in sorted(by_depth.items())
        }
        ratios[placement] = {depth: r for depth, r in shared.items() if r}
    last_ffn = {
        p: {d: [v for _, v in sorted(seeds.items())] for d, seeds in sorted(b.items())} for p, b in last.items()
    }
    return GradientSummary(last_ffn, ratios)


def _figure(summary: GradientSummary, profiles: list[tuple[Config, GradProfile]]):
    """Left: the deepest depth's FFN gradient norm against layer index, a line per placement (first
    seed). Right: each placement's last-layer ratio over Pre-LN against depth, sqrt(L) dashed."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    deepest = max(cfg.model.n_layers for cfg, _ in profiles)
    placements = list(dict.fromkeys(cfg.model.norm_position for cfg, _ in profiles))
    color: dict[str, str] = {p: f"C{i}" for i, p in enumerate(placements)}  # one colour per placement in both panels
    shown: set[str] = set()
    for cfg, profile in profiles:
        if cfg.model.n_layers == deepest and cfg.model.norm_position not in shown:
            shown.add(cfg.model.norm_position)
            norms = profile.group("FFN")
            label = cfg.model.norm_position
            left.plot(range(1, len(norms) + 1), norms, marker=".", color=color[label], label=label)
    left.set(yscale="log", xlabel="layer", ylabel="FFN gradient norm at init", title=f"{deepest} layers")
    left.legend(fontsize=7)
    for placement, by_depth in summary.ratios.items():
        depths = sorted(by_depth)
        means = [float(np.mean(by_depth[d])) for d in depths]
        right.plot(depths, means, marker="o", color=color[placement], label=f"{placement} / pre")
        if placement == "post" and depths:
            reference = means[0] * np.sqrt(np.asarray(depths) / depths[0])
            right.plot(depths, reference, ls="--", color=color[placement], label="sqrt(L) (Xiong et al.)")
    right.set(xscale="log", yscale="log", xlabel="layers", ylabel="last layer's FFN gradient / Pre-LN's")
    depths = sorted({cfg.model.n_layers for cfg, _ in profiles})
    right.set_xticks(depths, [str(d) for d in depths], minor=False)
    right.minorticks_off()
    right.legend(fontsize=7)
    return fig


def write_gradient_summary(
    summary: GradientSummary, profiles: list[tuple[Config, GradProfile]], out: Path
) -> list[Path]:
    """The summary's JSON and figure in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / SUMMARY_FILE).write_text(summary.to_json())
    _figure(summary, profiles).savefig(out / SUMMARY_FIGURE, dpi=100)
    return [out / SUMMARY_FILE, out / SUMMARY_FIGURE]
