"""Comparison reports: what a set of runs says about the variants. Each module imports only those
above it in this list:

- `stats.py`: the runs read back from their directories and their statistics (final and
  budget-matched losses, stability events, LR sensitivity, the verdict); numpy only;
- `tuned.py`: each level of the compared key at its own best learning rate (final loss, its
  difference from the first level's paired by seed, steps to reach the first level's final loss);
- `paired.py`: every sweep's levels against the first, paired by seed and every other varied key:
  the mean difference, its 95% t-interval, the paired t-test's p and the seeds needed to resolve it;
- `scaling.py`: a ladder's loss against compute per variant, the fit L(C) = E + A·C^-α and each
  variant's compute-equivalent gain over the baseline, with bootstrap intervals;
- `gradients.py`: a sweep's gradient profiles at initialisation side by side over norm placements
  and depths (Xiong et al.'s ratio of Post-LN's last-layer gradient over Pre-LN's, against depth);
- `plots.py`: their figures (matplotlib's object API, no pyplot state);
- `render.py`: the tables and the Markdown/HTML report (`write_report(DIR)`), with the figures.

The face resolves its names lazily (`transformer/lazy.py`), so that `from transformer.report import
build` imports no matplotlib.
"""

from typing import TYPE_CHECKING

from transformer.lazy import exports

if TYPE_CHECKING:  # the names as mypy sees them; at run time __getattr__ imports each on first use
    from transformer.report.gradients import summarize_gradients, write_gradient_summary  # noqa: F401
    from transformer.report.render import write_report  # noqa: F401
    from transformer.report.stats import Report, Run, build, load_runs, lr_sensitivity, mean_std  # noqa: F401

__all__, __getattr__ = exports(
    __name__,
    {
        "stats": ("Report", "Run", "build", "load_runs", "lr_sensitivity", "mean_std"),
        "gradients": ("summarize_gradients", "write_gradient_summary"),
        "render": ("write_report",),
    },
)
