"""Is a difference between variants more than seed noise? Every sweep's final losses compared level
by level against the compared key's first level (the baseline), paired: each run of a level is
matched with the baseline's run of the same seed and the same value of every other varied key (a
learning rate, a rung of a ladder), so the seed's data order and init cancel out of the difference.

The difference is taken where the comparison is fair, and only there: at the end of training
(runs of a pair train the same steps unless a varied key changes their length), and at an equal
token budget, the mean training loss over the last tenth of the fewer tokens of the pair's two runs
(shown only where some pair trained on different numbers of tokens). Never mid-training at unequal
tokens (Wen et al. 2025, arXiv 2509.02046, show such comparisons mislead).

For n pairs: the mean difference, its 95% t-interval, and the two-sided p-value of the paired
t-test (Student's t with n - 1 degrees of freedom; modded-nanogpt accepts a record at p < 0.01).
The verdict is worded by that evidence: "no detectable difference" when the interval covers zero,
with the number of seeds the observed spread would need to resolve a difference of the observed
size; a direction only when the interval excludes zero.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from transformer.report.stats import (
    BUDGET_TAIL,
    Report,
    Run,
    _hashable,
    _loss_at_budget,
    format_value,
    independent_keys,
    short_key,
    t95,
)

PAIRED_NOTE = (
    "Each level against the first, paired by seed and by every other varied key: Δ = level − first, in nats of "
    "the final loss (the last validation loss, else the last training loss); mean, 95% t-interval and the paired "
    "t-test's two-sided p over the pairs whose runs both finished with a finite loss. At equal tokens: the mean "
    f"training loss over the last {BUDGET_TAIL:.0%} of the fewer tokens of each pair's two runs. 'Seeds to resolve': "
    "the seeds at which a 95% interval of the observed spread would just exclude zero at the observed mean (about "
    "even odds of resolving a true difference of that size, not 80% power). Pairs in different settings count as "
    "independent replicates."
)


# --- Student's t ------------------------------------------------------------------------------------


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side; use the symmetry otherwise
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def t_pvalue(t: float, df: int) -> float:
    """Two-sided p-value of Student's t statistic `t` with `df` degrees of freedom."""
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0
    return incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


# --- one paired comparison ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Paired:
    """The paired differences of one level against the baseline, and what they say."""

    n: int
    mean: float
    low: float  # the 95% t-interval (nan with fewer than two pairs)
    high: float
    p: float
    seeds_needed: int | None  # to resolve the observed mean with the observed spread (None: resolved, or no spread)

    @classmethod
    def of(cls, diffs: list[float], pairs_per_seed: float = 1.0) -> Paired:
        """From the differences; `pairs_per_seed`: how many pairs each seed contributes (the other
        varied keys' settings), to turn the pairs needed into seeds."""
        d = np.array([x for x in diffs if math.isfinite(x)], dtype=np.float64)
        n = len(d)
        if n < 2:
            mean = float(d[0]) if n else math.nan
            return cls(n, mean, math.nan, math.nan, math.nan, None)
        mean, sd = float(d.mean()), float(d.std(ddof=1))
        if sd <= 1e-12 * max(1.0, abs(mean)):  # identical differences: no spread to test against
            p = 1.0 if mean == 0.0 else 0.0
            return cls(n, mean, mean, mean, p, None)
        half = t95(n - 1) * sd / math.sqrt(n)
        p = t_pvalue(mean / (sd / math.sqrt(n)), n - 1)
        needed = None
        if abs(mean) <= half and mean != 0.0:
            pairs = next((k for k in range(2, 100_000) if t95(k - 1) * sd / math.sqrt(k) < abs(mean)), None)
            needed = None if pairs is None else max(1, math.ceil(pairs / pairs_per_seed))
        return cls(n, mean, mean - half, mean + half, p, needed)

    @property
    def resolved(self) -> bool:
        return self.n >= 2 and (self.low > 0 or self.high < 0)

    def cell(self) -> str:
        if self.n == 0:
            return "–"
        if self.n == 1:
            return f"{self.mean:+.4f} (one pair)"
        return f"{self.mean:+.4f} [{self.low:+.4f}, {self.high:+.4f}]"

    def verdict(self, level: str, base: str) -> str:
        """One line on `level` against `base`, worded by the evidence."""
        if self.n < 2:
            return f"{level} vs {base}: {self.n} finished pair(s), no interval; repeat over seeds."
        spread = (
            f"Δ {self.mean:+.4f} nats, 95% CI [{self.low:+.4f}, {self.high:+.4f}], p = {self.p:.2g}, {self.n} pairs"
        )
        if self.resolved:
            word = "lower" if self.mean < 0 else "higher"
            return f"{level} ended {word} than {base} ({spread})."
        more = (
            f"; repeat with about {self.seeds_needed} seeds to resolve a difference this size"
            if self.seeds_needed
            else ""
        )
        return f"{level} vs {base}: no detectable difference ({spread}){more}."


# --- a report's comparisons ----------------------------------------------------------------------------


def _cells(report: Report) -> dict[object, dict[tuple, Run]]:
    """{level of the compared key: {(every other varied key's value..., seed): finished run}}."""
    others = independent_keys(report, report.compare)
    out: dict[object, dict[tuple, Run]] = {}
    for run in report.finished(report.runs):
        cell = (*(_hashable(run.values.get(k)) for k in others), run.seed)
        out.setdefault(_hashable(run.values.get(report.compare)), {})[cell] = run
    return out


def _equal_tokens(report: Report, a: Run, b: Run) -> float:
    """b's loss minus a's at the fewer tokens of the two (the mean over that budget's last tenth)."""
    budget = min(report.summaries[a.name].tokens, report.summaries[b.name].tokens)
    losses = []
    for run in (a, b):
        steps, loss = run.curve("loss")
        losses.append(_loss_at_budget(steps * run.tokens_per_step, loss, budget))
    return losses[1] - losses[0]


@dataclasses.dataclass(frozen=True)
class Comparison:
    level: str
    base: str
    final: Paired
    equal_tokens: Paired | None  # None where every pair trained on the same tokens
    within: str = ""  # "" for all pairs; "rung=N83k" for a ladder's pairs at one rung

    @property
    def label(self) -> str:
        return f"{self.level} (at {self.within})" if self.within else self.level


def comparisons(report: Report) -> list[Comparison]:
    """Each level of the compared key (in sweep order) against the first, by paired differences."""
    if not report.compare:
        return []
    cells = _cells(report)
    order = list(dict.fromkeys(_hashable(r.values.get(report.compare)) for r in report.runs))
    if not order or order[0] not in cells:
        return []
    base = cells[order[0]]
    # a ladder's pairs also rung by rung: whether a difference holds is a question of scale
    others = independent_keys(report, report.compare)
    at = others.index("rung") if "rung" in others else None
    rungs = list(dict.fromkeys(c[at] for c in base)) if at is not None else []
    out = []
    for level in order[1:]:
        pairs = {c: (base[c], run) for c, run in cells.get(level, {}).items() if c in base}
        for rung in [None, *rungs]:
            chosen = [p for c, p in pairs.items() if rung is None or c[at] == rung]  # type: ignore[index]
            within = "" if rung is None else f"rung={rung}"
            out.append(_comparison(report, format_value(level), format_value(order[0]), chosen, within))
    return out


def _comparison(report: Report, level: str, base: str, pairs: list[tuple[Run, Run]], within: str) -> Comparison:
    """The paired differences of (baseline run, level run) `pairs`."""
    final = [report.final_loss(b) - report.final_loss(a) for a, b in pairs]
    uneven = any(report.summaries[a.name].tokens != report.summaries[b.name].tokens for a, b in pairs)
    per_seed = max(1.0, len(pairs) / max(1, len({a.seed for a, _ in pairs})))
    equal = Paired.of([_equal_tokens(report, a, b) for a, b in pairs], per_seed) if uneven else None
    return Comparison(level, base, Paired.of(final, per_seed), equal, within)


def paired_rows(report: Report) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the paired comparisons (`PAIRED_NOTE`)."""
    found = comparisons(report)
    uneven = any(c.equal_tokens is not None for c in found)
    header = [short_key(report.compare) or "level", "vs", "pairs", "Δ final loss (95% CI)", "p", "seeds to resolve"]
    header += ["Δ at equal tokens (95% CI)", "p (equal tokens)"] if uneven else []
    rows = []
    for c in found:
        f = c.final
        row = [c.label, c.base, str(f.n), f.cell(), f"{f.p:.2g}" if math.isfinite(f.p) else "–"]
        row.append(str(f.seeds_needed) if f.seeds_needed else "–")
        if uneven:
            e = c.equal_tokens or f
            row += [e.cell(), f"{e.p:.2g}" if math.isfinite(e.p) else "–"]
        rows.append(row)
    return header, rows


def paired_lines(report: Report) -> list[str]:
    return [c.final.verdict(c.label, c.base) for c in comparisons(report)]


def paired_json(report: Report) -> list[dict]:
    """The comparisons as the report's JSON carries them."""
    return [
        {
            "level": c.level,
            "baseline": c.base,
            "within": c.within,
            "final": dataclasses.asdict(c.final),
            "equal_tokens": None if c.equal_tokens is None else dataclasses.asdict(c.equal_tokens),
            "verdict": c.final.verdict(c.label, c.base),
        }
        for c in comparisons(report)
    ]
