"""Rendering a comparison report: the table, the Markdown and the HTML.

`write_report(DIR)` reads the runs under DIR (`transformer.report.build`: a sweep's members or any
run directories side by side) and writes DIR/report.md, DIR/report.html (plots embedded) and the
plots as DIR/plots/*.png (`transformer.report.plots`). The numbers and their definitions are the report's;
this module only lays them out.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from transformer import rundir
from transformer.report.paired import PAIRED_NOTE, paired_json, paired_lines, paired_rows
from transformer.report.plots import plot_all
from transformer.report.scaling import SCALING_NOTE, LadderSummary, ladder_summary
from transformer.report.stats import (
    BUDGET_TAIL,
    LR_KEY,
    Report,
    build,
    format_value,
    mean_std,
    short_key,
    transfer_lines,
)
from transformer.report.tuned import TUNED_NOTE, tuned_rows

REPORT_MD = "report.md"
REPORT_HTML = "report.html"
REPORT_JSON = "report.json"
PLOTS_DIR = "plots"

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
    ("min attn entropy", "min_attn_entropy", "{:.3g}"),
    ("max |log Z|", "max_abs_log_z", "{:.3g}"),
    ("tokens/s", "tokens_per_s", "{:,.0f}"),
]
SENSITIVITY_TITLE = "Learning-rate sensitivity (Wortsman et al. 2023)"
TRANSFER_TITLE = "Learning-rate transfer"
TUNED_TITLE = "Each at its best learning rate"
PAIRED_TITLE = "Paired differences over seeds"
SCALING_TITLE = "Scaling: loss against compute"
TRANSFER_NOTE = (
    "The best learning rate at each model size: the vertex of a parabola in log lr through the lowest "
    "mean final loss (over seeds, capped at the initial loss) and its two grid neighbours. Whether it "
    "moved is judged by each seed's own optimum: the 95% t-interval of the seeds' shifts, in grid steps, "
    "from the smallest size to the largest. Under µP (Yang et al. 2021) it should not move with width, "
    "nor under depth-µP or CompleteP with depth; a move of less than one grid step is not resolved."
)
SENSITIVITY_NOTE = "mean over the LR grid of min(final loss, initial loss) − best final loss; lower is more stable."

Table = tuple[list[str], list[list[str]]]  # header, rows


def _cell(mean: float, std: float | None, fmt: str) -> str:
    if not math.isfinite(mean):
        return "–"
    return fmt.format(mean) + (f" ± {fmt.format(std)}" if std is not None and std > 0 else "")


def table(report: Report) -> Table:
    """Header and rows: one row per variant, seeds aggregated as mean ± std."""
    keys = report.keys
    sources = report.sources()  # a column per mixture source, only when some run has them
    header = [short_key(k) for k in keys] + ["seeds"] + [c[0] for c in COLUMNS]
    tasks = report.task_metrics()  # a column per downstream task metric (train.eval_tasks)
    header += [f"best val {name}" for name in sources] + [f"final {name}" for name in tasks] + ["diverged"]
    stats = {field: report.aggregate(field) for _, field, _ in COLUMNS}
    by_source = {name: report.aggregate_source(name) for name in sources}
    by_task = {name: report.aggregate_task(name) for name in tasks}
    stats["params"] = {v: (float(report.summaries[runs[0].name].params), None) for v, runs in report.variants.items()}
    rows = []
    for variant, runs in report.variants.items():
        first = runs[0].values
        done = report.finished(runs)
        row = [format_value(first.get(k)) for k in keys] + [f"{len(done)}/{len(runs)}"]
        row += [_cell(*stats[field][variant], fmt) for _, field, fmt in COLUMNS]
        row += [_cell(*by_source[name][variant], "{:.4f}") for name in sources]
        row += [_cell(*by_task[name][variant], "{:.3f}") for name in tasks]
        row.append(f"{sum(report.summaries[r.name].diverged for r in done)}/{len(done)}")
        rows.append(row)
    return header, rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown (GitHub) table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def sensitivity_rows(report: Report) -> Table:
    """Header and rows of the LR sensitivity: one row per setting of the other varied keys, most
    stable first, seeds aggregated as mean ± std. No rows without a learning-rate grid."""
    others = [k for k in report.keys if k != LR_KEY]
    header = [short_key(k) for k in others] + ["LR sensitivity (nats)", "seeds"]
    rows = []
    for setting, by_seed in sorted(report.sensitivities().items(), key=lambda kv: float(np.mean(list(kv[1].values())))):
        mean, std = mean_std(list(by_seed.values()))
        rows.append([format_value(s) for s in setting] + [_cell(mean, std, "{:.4f}"), str(len(by_seed))])
    return header, rows


@dataclasses.dataclass(frozen=True)
class _Section:
    """A titled part of the report below the main table: a note, then lines, then a table."""

    title: str
    note: str
    lines: list[str]
    table: Table | None = None


@dataclasses.dataclass(frozen=True)
class _Page:
    """What both the Markdown and the HTML report show."""

    title: str
    verdict: str
    best: str
    notes: list[str]
    main: Table
    sections: list[_Section]  # those with something to show
    plots: list[tuple[str, Path]]  # (title, PNG)


def _notes(report: Report) -> list[str]:
    budget = f"{report.budget:,} tokens" if report.budget else "–"
    return [
        f"Runs: {len(report.runs)} in {len(report.variants)} variants; varied: {', '.join(report.keys) or 'nothing'}.",
        f"Common token budget: {budget} (loss @ budget = mean logged train loss over its last {BUDGET_TAIL:.0%}).",
        "Mean ± sample std over seeds. Final train loss is one batch (the same batch in every run of a seed); "
        "loss @ budget is the steadier figure. Spikes = spike and non-finite events of the monitor; "
        "diverged = divergence reported (loss above its first value) or the monitor stopped the run; "
        "a run that stalls below its first loss is not counted, but the LR sensitivity charges it.",
    ]


def _markdown(page: _Page) -> str:
    md = [f"# Comparison: {page.title}", "", f"**Verdict.** {page.verdict}", "", page.best, "", *page.notes, ""]
    md += [markdown_table(*page.main), ""]
    for section in page.sections:
        md += [f"## {section.title}", "", section.note, "", *(f"- {line}" for line in section.lines)]
        md += ([""] if section.lines else []) + ([markdown_table(*section.table), ""] if section.table else [])
    md += ["## Plots", ""] + [f"![{title}]({PLOTS_DIR}/{path.name})" for title, path in page.plots] + [""]
    return "\n".join(md)


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _html_section(section: _Section) -> str:
    lines = "".join(f"<li>{html.escape(line)}</li>" for line in section.lines)
    return (
        f"<h2>{html.escape(section.title)}</h2><p>{html.escape(section.note)}</p>"
        + (f"<ul>{lines}</ul>" if lines else "")
        + (_html_table(*section.table) if section.table else "")
    )


def _html(page: _Page) -> str:
    """One self-contained HTML file: the plots are embedded as base64 PNGs."""
    images = "".join(
        f'<figure><img alt="{html.escape(t)}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        f"<figcaption>{html.escape(t)}</figcaption></figure>"
        for t, p in page.plots
    )
    style = (
        "body{font-family:sans-serif;max-width:1200px;margin:2em auto}table{border-collapse:collapse;font-size:90%}"
        "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}img{max-width:100%}"
    )
    title = html.escape(page.title)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{style}</style></head><body>"
        f"<h1>Comparison: {title}</h1><p><b>Verdict.</b> {html.escape(page.verdict)}</p><p>{html.escape(page.best)}</p>"
        + "".join(f"<p>{html.escape(n)}</p>" for n in page.notes)
        + _html_table(*page.main)
        + "".join(_html_section(section) for section in page.sections)
        + f"<h2>Plots</h2>{images}</body></html>"
    )


def _sections(report: Report, ladder: LadderSummary | None) -> list[_Section]:
    """The sections below the main table that the runs give something to show."""
    paired = paired_rows(report)
    sections = [
        _Section(PAIRED_TITLE, PAIRED_NOTE, paired_lines(report), paired if paired[1] else None),
        _Section(SENSITIVITY_TITLE, SENSITIVITY_NOTE, [], sensitivity_rows(report)),
        _Section(TUNED_TITLE, TUNED_NOTE, [], tuned_rows(report)),
        _Section(TRANSFER_TITLE, TRANSFER_NOTE, transfer_lines(report)),
    ]
    if ladder is not None:
        sections.append(
            _Section(SCALING_TITLE, SCALING_NOTE, ladder.lines, (ladder.header, ladder.rows) if ladder.rows else None)
        )
    return [s for s in sections if s.lines or (s.table is not None and s.table[1])]


def _json(report: Report, page: _Page, ladder: LadderSummary | None) -> dict:
    """The numbers of the report as notebooks and scripts read them (report.json)."""
    header, rows = page.main
    return {
        "verdict": page.verdict,
        "compare": report.compare,
        "keys": report.keys,
        "table": [dict(zip(header, row)) for row in rows],
        "paired": paired_json(report),
        "scaling": ladder.json if ladder is not None else None,
        "sections": {s.title: {"lines": s.lines, "table": s.table} for s in page.sections},
    }


def write_report(directory: Path, log: Callable[[str], None] = print, by: str | None = None) -> Path:
    """Write report.md, report.html, report.json and plots/*.png under `directory`; log the table,
    the verdict and the sections' lines. Returns the Markdown report's path. `by`: compare that
    varied key instead of the sweep's own, into report-by-<key>.* and plots-by-<key>/ beside them."""
    directory = Path(directory)
    report = build(directory, by)
    suffix = f"-by-{short_key(by)}" if by is not None else ""
    ladder = ladder_summary(report)
    plots = plot_all(report, directory / f"{PLOTS_DIR}{suffix}", ladder)
    sections = _sections(report, ladder)
    page = _Page(
        directory.name, report.verdict(), report.best_loss_line(), _notes(report), table(report), sections, plots
    )
    md, html_path, json_path = (
        directory / name.replace("report", f"report{suffix}") for name in (REPORT_MD, REPORT_HTML, REPORT_JSON)
    )
    rundir.atomic_write(md, _markdown(page))  # never through a link planted in a directory received from others
    rundir.atomic_write(html_path, _html(page))
    rundir.atomic_write(json_path, json.dumps(_json(report, page, ladder), indent=1) + "\n")
    log(markdown_table(*page.main))
    log(f"verdict: {page.verdict}")
    for section in sections:
        if section.title == TUNED_TITLE and section.table:
            log(f"{TUNED_TITLE}:\n{markdown_table(*section.table)}")
        for line in section.lines:
            log(f"{section.title}: {line}")
    return md
