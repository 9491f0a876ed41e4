"""Comparison reports: what a set of runs says about the variants, in final loss and in stability.

`write_report(DIR)` reads the runs under DIR — a sweep's members (named in DIR/sweep.json) or any
run directories side by side — and writes DIR/report.md, DIR/report.html (plots embedded) and the
plots as DIR/plots/*.png. Every number comes from the runs' own files:

- the metrics, last record per step and key (after a rollback the abandoned steps come first);
- the events: spikes, rollbacks, divergence, a monitor stop;
- the resolved config: parameters and tokens per step.

Definitions (the report states them too):
- final train loss: the last logged training loss; best val loss / bits per byte: the minimum over
  evaluations;
- loss at the common token budget: the mean logged training loss over the last 10% of the smallest
  number of tokens any run of the report trained on, so runs of different lengths or batch sizes
  are compared at equal data;
- LR sensitivity (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
  instabilities"): over the learning-rate grid, mean(min(final loss, initial loss)) − min(final
  loss). A diverged run counts at its initial loss. Lower is more stable.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from transformer import rundir
from transformer.config import Config, flatten, load_config

LR_KEY = "optim.lr"
SPIKES = ("spike", "nonfinite")
BUDGET_TAIL = 0.1  # the loss at a token budget averages the logged losses over its last 10%


# --- reading runs --------------------------------------------------------------------------------


def _float(value) -> float:
    try:
        return float(value)  # non-finite values are written as the strings "nan", "inf"
    except (TypeError, ValueError):
        return math.nan


@dataclasses.dataclass
class Run:
    name: str
    variant: str
    seed: int
    values: dict[str, Any]  # the varied keys (and zip labels) with this run's values
    config: Config
    series: dict[str, dict[int, Any]]  # key -> {step: value}, the last record per step
    events: list[dict]

    @classmethod
    def read(cls, workdir: Path, name: str, variant: str, values: dict, config: Config | None = None) -> Run:
        if rundir.has_config(workdir):
            config = rundir.read_config(workdir)
        assert config is not None, f"{workdir}: no config"
        series = rundir.metric_series(workdir)
        return cls(name, variant, config.train.seed, values, config, series, rundir.read_events(workdir))

    def curve(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of one scalar metric, in step order."""
        points = sorted((s, _float(v)) for s, v in self.series.get(key, {}).items() if not isinstance(v, list))
        return np.array([s for s, _ in points], dtype=np.int64), np.array([v for _, v in points], dtype=np.float64)

    def last_list(self, key: str) -> list[float] | None:
        """The last logged per-layer list of `key` (e.g. residual_rms), or None."""
        lists = {s: v for s, v in self.series.get(key, {}).items() if isinstance(v, list)}
        return [_float(x) for x in lists[max(lists)]] if lists else None

    @property
    def tokens_per_step(self) -> int:
        return self.config.train.batch_size * self.config.data.seq_len

    def count(self, *kinds: str) -> int:
        return sum(e["event"] in kinds for e in self.events)

    @property
    def status(self) -> str:
        return rundir.run_status(self.events, self.config.train.steps)


def load_runs(directory: Path) -> tuple[list[Run], list[str], str]:
    """The runs under `directory`, the keys that vary between them, and the key the verdict compares."""
    manifest_path = directory / "sweep.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        runs = []
        for m in manifest["members"]:
            member_config = directory / "members" / f"{m['name']}.yaml"
            config = load_config(member_config) if member_config.is_file() else None
            if config is None and not rundir.has_config(directory / m["name"]):
                continue
            values = {**m["labels"], **m["values"]}
            runs.append(Run.read(directory / m["name"], m["name"], m["variant"], values, config))
        return runs, list(manifest["keys"]), manifest["compare"]
    # Any run directories side by side: the varied keys are those whose values differ.
    dirs = sorted(p.parent for p in directory.glob(f"*/{rundir.CONFIG}"))
    configs = {d: flatten(rundir.read_config(d).to_dict()) for d in dirs}
    ignore = ("train.seed", "train.steps", "train.eval_every", "logging.", "checkpoint.", "mesh.", "data.cache_dir")
    keys = sorted(
        {
            k
            for c in configs.values()
            for k in c
            if not k.startswith(ignore) and len({repr(x.get(k)) for x in configs.values()}) > 1
        }
    )
    runs = []
    for d in dirs:
        values = {k: configs[d].get(k) for k in keys}
        variant = ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in values.items()) or d.name
        runs.append(Run.read(d, d.name, variant, values))
    compare = next((k for k in keys if k != LR_KEY), keys[0] if keys else "")
    return runs, keys, compare


# --- per-run and per-variant numbers -------------------------------------------------------------


@dataclasses.dataclass
class Summary:
    """One run's row of the report."""

    params: int
    initial_loss: float
    final_train_loss: float
    final_val_loss: float
    best_val_loss: float
    best_val_bpb: float
    loss_at_budget: float
    spikes: int
    rollbacks: int
    max_grad_norm: float
    max_attn_logit: float
    diverged: bool
    tokens_per_s: float
    tokens: int
    status: str


def summarize(run: Run, budget: int | None) -> Summary:
    from transformer.model.summary import count_params

    steps, loss = run.curve("loss")
    _, val = run.curve("val_loss")
    _, bpb = run.curve("val_bits_per_byte")
    _, grad = run.curve("grad_norm")
    _, tps = run.curve("tokens_per_s")
    logit_max = [max(v) for v in (run.series.get("attn_logit_max") or {}).values() if isinstance(v, list) and v]
    tokens = int(steps[-1]) * run.tokens_per_step if len(steps) else 0
    at_budget = math.nan
    if budget and len(steps):
        seen = steps * run.tokens_per_step
        tail = (seen > (1 - BUDGET_TAIL) * budget) & (seen <= budget)
        if not tail.any():  # logged too rarely for the tail: the last loss at or before the budget
            tail = seen == seen[seen <= budget].max() if (seen <= budget).any() else tail
        at_budget = float(np.mean(loss[tail])) if tail.any() else math.nan
    final = float(loss[-1]) if len(loss) else math.nan
    diverged = run.count("divergence", "stopped") > 0 or (len(loss) > 0 and not math.isfinite(final))
    return Summary(
        params=count_params(run.config.model),
        initial_loss=float(loss[0]) if len(loss) else math.nan,
        final_train_loss=final,
        final_val_loss=float(val[-1]) if len(val) else math.nan,
        best_val_loss=float(np.nanmin(val)) if np.isfinite(val).any() else math.nan,
        best_val_bpb=float(np.nanmin(bpb)) if np.isfinite(bpb).any() else math.nan,
        loss_at_budget=at_budget,
        spikes=run.count(*SPIKES),
        rollbacks=run.count("rollback"),
        max_grad_norm=float(np.nanmax(grad)) if np.isfinite(grad).any() else math.nan,
        max_attn_logit=float(max(logit_max)) if logit_max else math.nan,
        diverged=diverged,
        tokens_per_s=float(np.nanmedian(tps)) if np.isfinite(tps).any() else math.nan,
        tokens=tokens,
        status=run.status,
    )


def common_budget(runs: list[Run]) -> int | None:
    """The fewest tokens any run trained on (runs that logged nothing do not count)."""
    seen = [int(steps[-1]) * run.tokens_per_step for run in runs if len(steps := run.curve("loss")[0])]
    return min(seen) if seen else None


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for a single value) of the finite values."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, None
    return float(np.mean(finite)), float(np.std(finite, ddof=1)) if len(finite) > 1 else None


def lr_sensitivity(losses: list[float], initial: list[float]) -> float:
    """Wortsman et al. (2023): mean over the LR grid of min(loss(lr), initial loss) minus the best
    loss over the grid. `losses[i]` is the final loss at the i-th learning rate (nan or inf when
    the run diverged), `initial[i]` that run's initial loss."""
    capped = [min(loss, l0) if math.isfinite(loss) else l0 for loss, l0 in zip(losses, initial)]
    return float(np.mean(capped) - np.min(capped))


# --- the report ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    runs: list[Run]
    summaries: dict[str, Summary]  # by run name
    keys: list[str]  # varied keys, labels included
    compare: str
    budget: int | None

    @property
    def variants(self) -> dict[str, list[Run]]:
        out: dict[str, list[Run]] = {}
        for run in self.runs:
            out.setdefault(run.variant, []).append(run)
        return out

    def aggregate(self, field: str) -> dict[str, tuple[float, float | None]]:
        """Mean and std of a Summary field over each variant's finished runs."""
        return {
            v: mean_std(
                [
                    float(getattr(self.summaries[r.name], field))
                    for r in runs
                    if self.summaries[r.name].status in rundir.FINAL
                ]
            )
            for v, runs in self.variants.items()
        }

    def _final_loss(self, run: Run) -> float:
        s = self.summaries[run.name]
        return (
            s.final_val_loss
            if math.isfinite(s.final_val_loss) or not math.isfinite(s.final_train_loss)
            else s.final_train_loss
        )

    def sensitivities(self) -> dict[tuple, dict[int, float]]:
        """LR sensitivity for each setting of the other varied keys: {setting: {seed: value}}."""
        if LR_KEY not in self.keys:
            return {}
        others = [k for k in self.keys if k != LR_KEY]
        cells: dict[tuple, dict[int, list[Run]]] = {}
        for run in self.runs:
            setting = tuple(_hashable(run.values.get(k)) for k in others)
            cells.setdefault(setting, {}).setdefault(run.seed, []).append(run)
        out = {}
        for setting, by_seed in cells.items():
            values = {}
            for seed, runs in by_seed.items():
                finished = [r for r in runs if self.summaries[r.name].status in rundir.FINAL]
                if len(finished) < 2:
                    continue  # one learning rate says nothing about sensitivity
                losses = [self._final_loss(r) for r in finished]
                initial = [self.summaries[r.name].initial_loss for r in finished]
                values[seed] = lr_sensitivity(losses, initial)
            if values:
                out[setting] = values
        return out

    def verdict(self) -> str:
        return _verdict(self)

    def best_loss_line(self) -> str:
        losses = {v: m for v, (m, _) in self.aggregate("best_val_loss").items() if math.isfinite(m)}
        if not losses:
            return "No run has a validation loss yet."
        best = min(losses, key=losses.get)
        return f"Lowest best validation loss: {best} ({losses[best]:.4f} nats, mean over its seeds)."


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def build(directory: Path) -> Report:
    runs, keys, compare = load_runs(directory)
    budget = common_budget(runs)
    return Report(runs, {r.name: summarize(r, budget) for r in runs}, keys, compare, budget)


def _independent_keys(report: Report, key: str) -> list[str]:
    """The varied keys that define paired cells for comparing levels of `key`: not the learning
    rate (the sensitivity spans it), and not keys tied to `key` (zipped with it, such as the
    n_kv_heads of an `attention: [mha, mqa]` label), which never match across its levels."""
    out = []
    for k in report.keys:
        if k in (key, LR_KEY):
            continue
        within: dict[Any, set] = {}
        for run in report.runs:
            within.setdefault(_hashable(run.values.get(key)), set()).add(_hashable(run.values.get(k)))
        if any(len(v) > 1 for v in within.values()):  # varies at a fixed level of `key`: independent
            out.append(k)
    return out


def _verdict(report: Report) -> str:
    """One line on which level of `compare` was more stable, only as strong as the data allow.

    With a learning-rate grid the measure is the LR sensitivity, compared cell by cell: the same
    setting of every other varied key and the same seed. Without one it is the number of spikes
    (and divergences). The best level is "more stable" outright only when it beats the runner-up in
    every cell, in at least three cells, by more than two standard errors of the paired difference.
    """
    key = report.compare
    if not key:
        return "Nothing varies between these runs, so there is no comparison to make."
    others = _independent_keys(report, key)
    cells: dict[Any, dict[tuple, float]] = {}  # level -> {cell: instability}
    if LR_KEY in report.keys and key != LR_KEY:
        measure, unit = "LR sensitivity", "nats"
        setting_keys = [k for k in report.keys if k != LR_KEY]  # the order of a sensitivity's setting
        for setting, by_seed in report.sensitivities().items():
            values = dict(zip(setting_keys, setting))
            rest = tuple(values[k] for k in others)
            for seed, value in by_seed.items():
                cells.setdefault(values[key], {})[rest + (seed,)] = value
    else:
        measure, unit = "spikes + divergences", "events"
        for run in report.runs:
            s = report.summaries[run.name]
            if s.status not in rundir.FINAL:
                continue
            level = _hashable(run.values.get(key))
            rest = tuple(_hashable(run.values.get(k)) for k in others) + (run.seed,)
            cells.setdefault(level, {})[rest] = s.spikes + int(s.diverged)
    if len(cells) < 2:
        return f"Too few finished runs to compare {key} for stability."
    # rank over the cells every level has (a partly run sweep must not compare unequal sets)
    common = set.intersection(*(set(c) for c in cells.values())) or None
    means = {
        level: float(np.mean([v for cell, v in c.items() if common is None or cell in common]))
        for level, c in cells.items()
    }
    ranked = sorted(means, key=means.get)
    best, second = ranked[0], ranked[1]
    shared = sorted(set(cells[best]) & set(cells[second]))
    diffs = np.array([cells[second][c] - cells[best][c] for c in shared])
    n = len(diffs)
    order = " < ".join(f"{level} {means[level]:.3g}" for level in ranked)
    head = f"{key} by mean {measure} ({unit}): {order}"
    if n == 0 or not np.any(diffs > 0):
        return f"No {key} was more stable than another by {measure} ({head}; {n} paired settings)."
    wins = int(np.sum(diffs > 0))
    if n == 1:
        return f"Weak evidence: {best} was more stable than {second} in the one setting and seed run ({head}); repeat over seeds before relying on it."
    se = float(np.std(diffs, ddof=1) / math.sqrt(n))
    spread = f"paired difference {diffs.mean():.3g} ± {se:.2g} (s.e.) over {n} settings"
    if wins == n and n >= 3 and diffs.mean() > 2 * se:
        return f"{best} was more stable than {second}: lower {measure} in all {n} paired settings ({head}; {spread})."
    if wins > n / 2:
        return f"Tentatively, {best} was more stable than {second}: lower {measure} in {wins} of {n} paired settings ({head}; {spread}); not conclusive."
    return f"No clear stability difference between {best} and {second}: lower {measure} in only {wins} of {n} paired settings ({head}; {spread})."


# --- rendering -----------------------------------------------------------------------------------

COLUMNS = [  # (header, Summary field, format)
    ("params", "params", "{:,.0f}"),
    ("final train loss", "final_train_loss", "{:.4f}"),
    ("best val loss", "best_val_loss", "{:.4f}"),
    ("best val bpb", "best_val_bpb", "{:.4f}"),
    ("loss @ budget", "loss_at_budget", "{:.4f}"),
    ("spikes", "spikes", "{:.1f}"),
    ("rollbacks", "rollbacks", "{:.1f}"),
    ("max grad norm", "max_grad_norm", "{:.3g}"),
    ("max attn logit", "max_attn_logit", "{:.3g}"),
    ("tokens/s", "tokens_per_s", "{:,.0f}"),
]


def _cell(mean: float, std: float | None, fmt: str) -> str:
    if not math.isfinite(mean):
        return "–"
    return fmt.format(mean) + (f" ± {fmt.format(std)}" if std is not None and std > 0 else "")


def table(report: Report) -> tuple[list[str], list[list[str]]]:
    """Header and rows: one row per variant, seeds aggregated as mean ± std."""
    keys = report.keys
    header = [k.rsplit(".", 1)[-1] for k in keys] + ["seeds"] + [c[0] for c in COLUMNS] + ["diverged"]
    stats = {field: report.aggregate(field) for _, field, _ in COLUMNS}
    stats["params"] = {v: (float(report.summaries[runs[0].name].params), None) for v, runs in report.variants.items()}
    rows = []
    for variant, runs in report.variants.items():
        first = runs[0].values
        done = [r for r in runs if report.summaries[r.name].status in rundir.FINAL]
        row = [_text(first.get(k)) for k in keys] + [f"{len(done)}/{len(runs)}"]
        row += [_cell(*stats[field][variant], fmt) for _, field, fmt in COLUMNS]
        row.append(f"{sum(report.summaries[r.name].diverged for r in done)}/{len(done)}")
        rows.append(row)
    return header, rows


def _text(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def sensitivity_rows(report: Report) -> tuple[list[str], list[list[str]]]:
    others = [k for k in report.keys if k != LR_KEY]
    header = [k.rsplit(".", 1)[-1] for k in others] + ["LR sensitivity (nats)", "seeds"]
    rows = []
    for setting, by_seed in sorted(report.sensitivities().items(), key=lambda kv: float(np.mean(list(kv[1].values())))):
        mean, std = mean_std(list(by_seed.values()))
        rows.append([_text(s) for s in setting] + [_cell(mean, std, "{:.4f}"), str(len(by_seed))])
    return header, rows


def write_report(directory: Path, log: Callable[[str], None] = print) -> Path:
    """Write report.md, report.html and plots/*.png under `directory`; print the table."""
    from transformer.plots import plot_all

    directory = Path(directory)
    report = build(directory)
    header, rows = table(report)
    plots = plot_all(report, directory / "plots")
    sens_header, sens_rows = sensitivity_rows(report)
    budget = f"{report.budget:,} tokens" if report.budget else "–"
    notes = [
        f"Runs: {len(report.runs)} in {len(report.variants)} variants; varied: {', '.join(report.keys) or 'nothing'}.",
        f"Common token budget: {budget} (loss @ budget = mean logged train loss over its last {BUDGET_TAIL:.0%}).",
        "Mean ± sample std over seeds. Final train loss is one batch (the same batch in every run of a seed); "
        "loss @ budget is the steadier figure. Spikes = spike and non-finite events of the monitor; "
        "diverged = divergence reported (loss above its first value) or the monitor stopped the run; "
        "a run that stalls below its first loss is not counted, but the LR sensitivity charges it.",
    ]
    verdict, best = report.verdict(), report.best_loss_line()
    md = [
        f"# Comparison: {directory.name}",
        "",
        f"**Verdict.** {verdict}",
        "",
        best,
        "",
        *notes,
        "",
        markdown_table(header, rows),
        "",
    ]
    if sens_rows:
        md += [
            "## Learning-rate sensitivity (Wortsman et al. 2023)",
            "",
            "mean over the LR grid of min(final loss, initial loss) − best final loss; lower is more stable.",
            "",
            markdown_table(sens_header, sens_rows),
            "",
        ]
    md += ["## Plots", ""] + [f"![{title}](plots/{path.name})" for title, path in plots] + [""]
    (directory / "report.md").write_text("\n".join(md))
    (directory / "report.html").write_text(
        _html(directory.name, verdict, best, notes, (header, rows), (sens_header, sens_rows), plots)
    )
    log(markdown_table(header, rows))
    log(f"verdict: {verdict}")
    return directory / "report.md"


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _html(title, verdict, best, notes, main, sens, plots) -> str:
    images = "".join(
        f'<figure><img alt="{html.escape(t)}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        f"<figcaption>{html.escape(t)}</figcaption></figure>"
        for t, p in plots
    )
    sens_html = (
        "<h2>Learning-rate sensitivity (Wortsman et al. 2023)</h2>"
        "<p>mean over the LR grid of min(final loss, initial loss) − best final loss; lower is more stable.</p>"
        + _html_table(*sens)
        if sens[1]
        else ""
    )
    style = (
        "body{font-family:sans-serif;max-width:1200px;margin:2em auto}table{border-collapse:collapse;font-size:90%}"
        "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}img{max-width:100%}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{style}</style></head><body>"
        f"<h1>Comparison: {html.escape(title)}</h1><p><b>Verdict.</b> {html.escape(verdict)}</p><p>{html.escape(best)}</p>"
        + "".join(f"<p>{html.escape(n)}</p>" for n in notes)
        + _html_table(*main)
        + sens_html
        + f"<h2>Plots</h2>{images}</body></html>"
    )
