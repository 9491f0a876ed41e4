"""What a set of runs says about the variants, in final loss and in stability: the statistics of a
comparison report. Drawing them is `transformer/report/plots.py`; the tables, Markdown and HTML are
`transformer/report/render.py` (`render.write_report(DIR)`).

`build(DIR)` reads the runs under DIR — a sweep's members (named in its manifest) or any run
directories side by side. Every number comes from the runs' own files (`transformer/rundir.py`):

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

import dataclasses
import json
import math
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np

from transformer import rundir
from transformer.config import RUN_BOOKKEEPING, Config, ConfigError, flatten
from transformer.config_loader import load_config
from transformer.sweep import LR_KEY, MANIFEST, default_compare, member_config_path

SPIKES = ("spike", "nonfinite")
BUDGET_TAIL = 0.1  # the loss at a token budget averages the logged losses over its last 10%
# Keys that never make runs side by side different variants: the bookkeeping that may change on
# resume (how long, what is logged, where it runs) and the seed (runs that differ only in it are
# repeats of a variant). Execution keys (remat, scan) stay: their runs differ in speed and memory.
NOT_VARIANTS = ("train.seed", *RUN_BOOKKEEPING)


def format_value(value: Any) -> str:
    """A varied key's value as the table and the plots label it: 0.001 rather than 0.0010000, a
    list (an attention pattern) comma-joined."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def short_key(key: str) -> str:
    """The last part of a dotted key, as column headers and labels show it: optim.lr -> lr."""
    return key.rsplit(".", 1)[-1]


# --- reading runs --------------------------------------------------------------------------------


def _float(value: Any) -> float:
    try:
        return float(value)  # non-finite values are written as the strings "nan", "inf"
    except (TypeError, ValueError):
        return math.nan


@dataclasses.dataclass
class Run:
    """One run as the report sees it: its config, its metric series and its events."""

    name: str
    variant: str
    seed: int
    values: dict[str, Any]  # the varied keys (and zip labels) with this run's values
    config: Config
    series: dict[str, dict[int, Any]]  # key -> {step: value}, the last record per step
    events: list[dict]

    @classmethod
    def read(cls, workdir: Path, name: str, variant: str, values: dict[str, Any], config: Config | None = None) -> Run:
        """Read the run in `workdir`; `config` stands in for a member that has not written its own yet."""
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
        from transformer.data import row_lengths, row_tokens

        return self.config.train.batch_size * row_tokens(row_lengths(self.config.data))

    def count(self, *kinds: str) -> int:
        """How many events of these kinds the run recorded."""
        return sum(e["event"] in kinds for e in self.events)

    @property
    def status(self) -> str:
        return rundir.run_status(self.events, self.config.train.steps)


def load_runs(directory: Path) -> tuple[list[Run], list[str], str]:
    """The runs under `directory`, the keys that vary between them, and the key the verdict compares."""
    if (directory / MANIFEST).is_file():
        return _sweep_runs(directory)
    return _side_by_side_runs(directory)


def _sweep_runs(directory: Path) -> tuple[list[Run], list[str], str]:
    """A sweep's members, as its manifest names them; a member that has not started yet is read from
    its resolved config (and has no numbers), one whose config is gone is left out."""
    manifest = json.loads((directory / MANIFEST).read_text())
    runs = []
    for m in manifest["members"]:
        member_config = member_config_path(directory, m["name"])
        config = load_config(member_config) if member_config.is_file() else None
        if config is None and not rundir.has_config(directory / m["name"]):
            continue
        values = {**m["labels"], **m["values"]}
        runs.append(Run.read(directory / m["name"], m["name"], m["variant"], values, config))
    return runs, list(manifest["keys"]), manifest["compare"]


def _side_by_side_runs(directory: Path) -> tuple[list[Run], list[str], str]:
    """Any run directories side by side: the varied keys are those whose values differ."""
    dirs = sorted(p.parent for p in directory.glob(f"*/{rundir.CONFIG}"))
    configs = {d: flatten(rundir.read_config(d).to_dict()) for d in dirs}
    keys = sorted(
        {
            k
            for c in configs.values()
            for k in c
            if not k.startswith(NOT_VARIANTS) and len({repr(x.get(k)) for x in configs.values()}) > 1
        }
    )
    runs = []
    for d in dirs:
        values = {k: configs[d].get(k) for k in keys}
        variant = ",".join(f"{short_key(k)}={v}" for k, v in values.items()) or d.name
        runs.append(Run.read(d, d.name, variant, values))
    return runs, keys, default_compare(keys)


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
    min_attn_entropy: float  # the lowest per-layer attention entropy logged (nats): collapse shows here
    max_abs_log_z: float  # the largest |output log Z| logged (output-logit divergence drifts it)
    diverged: bool
    tokens_per_s: float
    tokens: int
    flops: float  # model FLOPs of the steps trained (`preflight.work_per_step`)
    status: str
    # a mixture run's best val/<name>/loss per source (empty for a single source)
    best_val_by_source: dict[str, float] = dataclasses.field(default_factory=dict)
    # the last logged score of each downstream task metric (train.eval_tasks), "<task>/<metric>"
    final_tasks: dict[str, float] = dataclasses.field(default_factory=dict)


def _min(values: np.ndarray) -> float:
    return float(np.nanmin(values)) if np.isfinite(values).any() else math.nan


def _max(values: np.ndarray) -> float:
    return float(np.nanmax(values)) if np.isfinite(values).any() else math.nan


def _layer_values(run: Run, key: str) -> np.ndarray:
    """Every per-layer value of `key` the run logged, as floats (a non-finite one, written as a
    string, is nan)."""
    lists = [v for v in (run.series.get(key) or {}).values() if isinstance(v, list)]
    return np.array([_float(x) for v in lists for x in v], dtype=np.float64)


def summarize(run: Run, budget: int | None) -> Summary:
    """The run's numbers (see the module's definitions), its loss taken at `budget` tokens."""
    from transformer.model import count_params
    from transformer.train import work_per_step

    steps, loss = run.curve("loss")
    _, val = run.curve("val_loss")
    _, tps = run.curve("tokens_per_s")
    logit_max = _layer_values(run, "attn_logit_max")
    entropy = _layer_values(run, "attn_entropy")
    final = float(loss[-1]) if len(loss) else math.nan
    return Summary(
        params=count_params(run.config.model),
        initial_loss=float(loss[0]) if len(loss) else math.nan,
        final_train_loss=final,
        final_val_loss=float(val[-1]) if len(val) else math.nan,
        best_val_loss=_min(val),
        best_val_bpb=_min(run.curve("val_bits_per_byte")[1]),
        loss_at_budget=_loss_at_budget(steps * run.tokens_per_step, loss, budget),
        spikes=run.count(*SPIKES),
        rollbacks=run.count("rollback"),
        max_grad_norm=_max(run.curve("grad_norm")[1]),
        max_attn_logit=_max(logit_max),
        min_attn_entropy=_min(entropy),
        max_abs_log_z=_max(np.abs(run.curve("log_z_mean")[1])),
        diverged=run.count("divergence", "stopped") > 0 or (len(loss) > 0 and not math.isfinite(final)),
        tokens_per_s=float(np.nanmedian(tps)) if np.isfinite(tps).any() else math.nan,
        tokens=int(steps[-1]) * run.tokens_per_step if len(steps) else 0,
        flops=int(steps[-1]) * work_per_step(run.config)[1] if len(steps) else 0.0,
        status=run.status,
        best_val_by_source={
            key.removeprefix("val/").removesuffix("/loss"): _min(run.curve(key)[1])
            for key in run.series
            if key.startswith("val/") and key.endswith("/loss")
        },
        final_tasks={key.removeprefix("eval/"): _last(run.curve(key)[1]) for key in task_keys(run.series)},
    )


def task_keys(series: dict) -> list[str]:
    """The downstream task metrics a run logged (eval/<task>/<metric>), their standard errors left out."""
    return [k for k in series if k.startswith("eval/") and not k.endswith("_stderr")]


def _last(values: np.ndarray) -> float:
    return float(values[-1]) if len(values) else math.nan


def _loss_at_budget(seen: np.ndarray, loss: np.ndarray, budget: int | None) -> float:
    """The mean logged loss over the last BUDGET_TAIL of `budget` tokens (`seen`: tokens at each log)."""
    if not budget or not len(seen):
        return math.nan
    tail = (seen > (1 - BUDGET_TAIL) * budget) & (seen <= budget)
    if not tail.any():  # logged too rarely for the tail: the last loss at or before the budget
        tail = seen == seen[seen <= budget].max() if (seen <= budget).any() else tail
    return float(np.mean(loss[tail])) if tail.any() else math.nan


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


def _hashable(value: Any) -> Hashable:
    return tuple(value) if isinstance(value, list) else value


@dataclasses.dataclass
class Report:
    """The runs of a comparison with their summaries, and what they say together."""

    runs: list[Run]
    summaries: dict[str, Summary]  # by run name
    keys: list[str]  # varied keys, labels included
    compare: str
    budget: int | None

    @property
    def variants(self) -> dict[str, list[Run]]:
        """The runs grouped by variant (runs of a variant differ only in the seed), in run order."""
        out: dict[str, list[Run]] = {}
        for run in self.runs:
            out.setdefault(run.variant, []).append(run)
        return out

    def finished(self, runs: list[Run]) -> list[Run]:
        """Those of `runs` whose numbers are final (finished, or stopped by the monitor)."""
        return [r for r in runs if self.summaries[r.name].status in rundir.FINAL]

    def aggregate(self, field: str) -> dict[str, tuple[float, float | None]]:
        """Mean and std of a Summary field over each variant's finished runs."""
        return {
            v: mean_std([float(getattr(self.summaries[r.name], field)) for r in self.finished(runs)])
            for v, runs in self.variants.items()
        }

    def sources(self) -> list[str]:
        """The mixture sources any run validated separately, in order of first appearance."""
        names = [n for s in self.summaries.values() for n in s.best_val_by_source]
        return list(dict.fromkeys(names))

    def aggregate_source(self, name: str) -> dict[str, tuple[float, float | None]]:
        """Mean and std of one source's best validation loss over each variant's finished runs (NaN
        for a run without that source)."""
        return {
            v: mean_std([self.summaries[r.name].best_val_by_source.get(name, math.nan) for r in self.finished(runs)])
            for v, runs in self.variants.items()
        }

    def task_metrics(self) -> list[str]:
        """The downstream task metrics any run logged ("<task>/<metric>"), in order of first appearance."""
        return list(dict.fromkeys(n for s in self.summaries.values() for n in s.final_tasks))

    def aggregate_task(self, name: str) -> dict[str, tuple[float, float | None]]:
        """Mean and std of one task metric's final score over each variant's finished runs."""
        return {
            v: mean_std([self.summaries[r.name].final_tasks.get(name, math.nan) for r in self.finished(runs)])
            for v, runs in self.variants.items()
        }

    def final_loss(self, run: Run) -> float:
        """The loss the LR sensitivity reads: the last validation loss, or the last training loss
        when the run has no finite validation loss but a finite training loss."""
        s = self.summaries[run.name]
        return (
            s.final_val_loss
            if math.isfinite(s.final_val_loss) or not math.isfinite(s.final_train_loss)
            else s.final_train_loss
        )

    def capped_final_loss(self, run: Run) -> float:
        """`final_loss` capped at the run's initial loss (a diverged run counts at its initial
        loss), as the LR sensitivity, its figure and the learning-rate transfer read it."""
        final, initial = self.final_loss(run), self.summaries[run.name].initial_loss
        return min(final, initial) if math.isfinite(final) else initial

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
                finished = self.finished(runs)
                if len(finished) < 2:
                    continue  # one learning rate says nothing about sensitivity
                losses = [self.final_loss(r) for r in finished]
                values[seed] = lr_sensitivity(losses, [self.summaries[r.name].initial_loss for r in finished])
            if values:
                out[setting] = values
        return out

    def verdict(self) -> str:
        """One line on which level of `compare` was more stable, only as strong as the data allow.

        With a learning-rate grid the measure is the LR sensitivity, compared cell by cell: the same
        setting of every other varied key and the same seed. Without one it is the number of spikes
        (and divergences). The best level is "more stable" outright only when it beats the runner-up
        in every cell, in at least three cells, by more than two standard errors of the paired
        difference.
        """
        key = self.compare
        if not key:
            return "Nothing varies between these runs, so there is no comparison to make."
        others = independent_keys(self, key, (LR_KEY,))
        if LR_KEY in self.keys and key != LR_KEY:
            measure, unit, cells = "LR sensitivity", "nats", _sensitivity_cells(self, key, others)
        else:
            measure, unit, cells = "spikes + divergences", "events", _event_cells(self, key, others)
        if len(cells) < 2:
            return f"Too few finished runs to compare {key} for stability."
        return _judge(key, measure, unit, cells)

    def best_loss_line(self) -> str:
        """One line naming the variant with the lowest best validation loss (mean over its seeds)."""
        losses = {v: m for v, (m, _) in self.aggregate("best_val_loss").items() if math.isfinite(m)}
        if not losses:
            return "No run has a validation loss yet."
        best = min(losses, key=losses.__getitem__)
        return f"Lowest best validation loss: {best} ({losses[best]:.4f} nats, mean over its seeds)."


def build(directory: Path, by: str | None = None) -> Report:
    """Read the runs under `directory` and summarize each at their common token budget; `by`: the
    varied key to compare instead of the sweep's own (a study of two interventions asks of each)."""
    runs, keys, compare = load_runs(directory)
    if by is not None:
        if by not in keys:
            raise ConfigError("--by", f"{by!r} is not a key these runs vary ({', '.join(keys) or 'none'})")
        compare = by
    budget = common_budget(runs)
    return Report(runs, {r.name: summarize(r, budget) for r in runs}, keys, compare, budget)


# --- the verdict ---------------------------------------------------------------------------------

Cells = dict[Hashable, dict[tuple, float]]  # level of the compared key -> {paired cell: instability}


def independent_keys(report: Report, key: str, without: tuple[str, ...] = ()) -> list[str]:
    """The varied keys that pair runs across the levels of `key` (besides the seed): not `key`, not
    those in `without` (the learning rate, where a measure spans it), and not keys tied to `key`
    (zipped with it, such as the n_kv_heads of an `attention: [mha, mqa]` label, or the qk_norm of an
    `intervention` label), which never match across its levels."""
    out = []
    for k in report.keys:
        if k == key or k in without:
            continue
        within: dict[Any, set] = {}
        for run in report.runs:
            within.setdefault(_hashable(run.values.get(key)), set()).add(_hashable(run.values.get(k)))
        if any(len(v) > 1 for v in within.values()):  # varies at a fixed level of `key`: independent
            out.append(k)
    return out


def _sensitivity_cells(report: Report, key: str, others: list[str]) -> Cells:
    """Each level's LR sensitivity per cell (the setting of `others`, and the seed)."""
    cells: Cells = {}
    setting_keys = [k for k in report.keys if k != LR_KEY]  # the order of a sensitivity's setting
    for setting, by_seed in report.sensitivities().items():
        values = dict(zip(setting_keys, setting))
        rest = tuple(values[k] for k in others)
        for seed, value in by_seed.items():
            cells.setdefault(values[key], {})[(*rest, seed)] = value
    return cells


def _event_cells(report: Report, key: str, others: list[str]) -> Cells:
    """Each level's spikes plus divergence per finished run, by cell (the setting of `others`, and the seed)."""
    cells: Cells = {}
    for run in report.finished(report.runs):
        s = report.summaries[run.name]
        level = _hashable(run.values.get(key))
        rest = (*(_hashable(run.values.get(k)) for k in others), run.seed)
        cells.setdefault(level, {})[rest] = s.spikes + int(s.diverged)
    return cells


def _judge(key: str, measure: str, unit: str, cells: Cells) -> str:
    """Rank the levels by their mean instability and weigh the best against the runner-up, cell by cell."""
    # rank over the cells every level has (a partly run sweep must not compare unequal sets)
    common = set.intersection(*(set(c) for c in cells.values())) or None
    means = {
        level: float(np.mean([v for cell, v in c.items() if common is None or cell in common]))
        for level, c in cells.items()
    }
    ranked = sorted(means, key=means.__getitem__)
    best, second = ranked[0], ranked[1]
    shared = sorted(set(cells[best]) & set(cells[second]))
    diffs = np.array([cells[second][c] - cells[best][c] for c in shared])
    order = " < ".join(f"{level} {means[level]:.3g}" for level in ranked)
    head = f"{key} by mean {measure} ({unit}): {order}"
    return _verdict_line(key, measure, head, (best, second), diffs)


def _verdict_line(key: str, measure: str, head: str, pair: tuple[Hashable, Hashable], diffs: np.ndarray) -> str:
    """The verdict for the best level against the runner-up, from their paired differences."""
    best, second = pair
    n = len(diffs)
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


# --- learning-rate transfer ------------------------------------------------------------------------

SIZE_KEYS = ("model.d_model", "model.n_layers")  # what a learning rate is transferred across
Transfer = dict[tuple, dict[int, tuple[float, bool]]]  # setting -> size -> (best lr, at the grid's edge)


def best_lr(points: dict[float, float]) -> tuple[float, bool]:
    """(the best learning rate, whether the grid's lowest loss is at its edge) from {lr: loss}: the
    vertex of the parabola in log lr through the lowest point and its two neighbours, kept between
    them; at an edge (or where the three points do not curve up), the lowest point's own lr."""
    lrs = sorted(points)
    losses = [points[lr] for lr in lrs]
    i = int(np.argmin(losses))
    if i in (0, len(lrs) - 1):
        return lrs[i], True
    x = np.log(lrs[i - 1 : i + 2])
    a, b, _ = np.polyfit(x, losses[i - 1 : i + 2], 2)
    return (float(np.exp(np.clip(-b / (2 * a), x[0], x[2]))) if a > 0 else lrs[i]), False


def _transfer_cells(report: Report, size: str) -> dict[tuple, dict[int, dict[int, dict[float, float]]]]:
    """{setting of the varied keys other than the learning rate and `size`: {seed: {size: {lr:
    loss}}}}, each run's final loss capped at its initial loss (as the LR sensitivity counts a
    diverged run); {} unless the report varies both keys."""
    if LR_KEY not in report.keys or size not in report.keys:
        return {}
    others = [k for k in report.keys if k not in (LR_KEY, size)]
    cells: dict[tuple, dict[int, dict[int, dict[float, float]]]] = {}
    for run in report.finished(report.runs):
        setting = tuple(_hashable(run.values.get(k)) for k in others)
        by_size = cells.setdefault(setting, {}).setdefault(run.seed, {})
        by_size.setdefault(int(run.values[size]), {})[float(run.values[LR_KEY])] = report.capped_final_loss(run)
    return cells


def transfer_points(report: Report, size: str) -> dict[tuple, dict[int, dict[float, float]]]:
    """{setting: {size: {lr: loss}}} (`_transfer_cells`), the loss averaged over the finished seeds."""
    out: dict[tuple, dict[int, dict[float, float]]] = {}
    for setting, seeds in _transfer_cells(report, size).items():
        pooled: dict[int, dict[float, list[float]]] = {}
        for by_size in seeds.values():
            for v, by_lr in by_size.items():
                for lr, loss in by_lr.items():
                    pooled.setdefault(v, {}).setdefault(lr, []).append(loss)
        out[setting] = {v: {lr: float(np.mean(ls)) for lr, ls in by_lr.items()} for v, by_lr in sorted(pooled.items())}
    return out


def transfer(report: Report, size: str) -> Transfer:
    """The best learning rate at each value of `size` that has three or more finished learning
    rates, for each setting of the other varied keys (`transfer_points`) that has two such sizes
    (so a partly run sweep reports the sizes it has)."""
    out: Transfer = {}
    for setting, sizes in transfer_points(report, size).items():
        best = {v: best_lr(by_lr) for v, by_lr in sizes.items() if len(by_lr) > 2}
        if len(best) > 1:
            out[setting] = best
    return out


def seed_shifts(report: Report, size: str, step: float) -> dict[tuple, list[float]]:
    """For each setting of `transfer`: every seed's own shift, in grid steps of `step` (log lr), of
    its best learning rate from the smallest to the largest size `transfer` compares (seeds
    without three finished learning rates at both are left out)."""
    cells, found = _transfer_cells(report, size), transfer(report, size)
    out: dict[tuple, list[float]] = {}
    for setting, sizes in found.items():
        lo, hi = min(sizes), max(sizes)
        shifts = []
        for by_size in cells[setting].values():
            if all(len(by_size.get(v, {})) > 2 for v in (lo, hi)):
                shifts.append(math.log(best_lr(by_size[hi])[0] / best_lr(by_size[lo])[0]) / step)
        out[setting] = shifts
    return out


# Two-sided 95% quantiles of Student's t by degrees of freedom (beyond the table: the normal's
# 1.96 with the first two Cornish-Fisher terms, within 0.001 of the exact value from 31 on).
T95: tuple[float, ...] = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179)
T95 += (2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052)
T95 += (2.048, 2.045, 2.042)


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with `df` >= 1 degrees of freedom."""
    if df <= len(T95):
        return T95[df - 1]
    z = 1.96
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t-interval of the mean of two or more values."""
    n, mean = len(values), float(np.mean(values))
    half = t95(n - 1) * float(np.std(values, ddof=1)) / math.sqrt(n)
    return mean, mean - half, mean + half


def _grid_step(report: Report) -> float:
    """The learning-rate grid's median step in log lr (nan with fewer than two learning rates)."""
    grid = np.log(sorted({float(r.values[LR_KEY]) for r in report.runs if LR_KEY in r.values}))
    return float(np.median(np.diff(grid))) if len(grid) > 1 else math.nan


def _moved(mean_curve_shift: float, shifts: list[float]) -> str:
    """Whether the optimum moved a grid step: by the seeds' shifts' 95% interval with two or more
    seeds, else by the mean curve's shift alone, said to be one seed's."""
    if len(shifts) < 2:
        where = "moved by" if abs(mean_curve_shift) >= 1 else "stayed within one grid step:"
        return f"the optimum {where} {mean_curve_shift:+.1f} grid steps (one seed, no interval)"
    mean, lo, hi = mean_interval(shifts)
    interval = f"{mean:+.1f} grid steps, 95% interval over {len(shifts)} seeds {lo:+.1f} to {hi:+.1f}"
    if lo >= 1 or hi <= -1:
        return f"the optimum moved by {interval}"
    if -1 < lo and hi < 1:
        return f"the optimum stayed within one grid step ({interval})"
    return f"whether the optimum moved a grid step is open ({interval})"


def transfer_lines(report: Report) -> list[str]:
    """One line per size key and setting: the best learning rate at each size (of the loss averaged
    over seeds), and whether the optimum moved between the smallest and the largest size by a grid
    step or more, judged by the interval of the seeds' own shifts."""
    lines = []
    step = _grid_step(report)
    for size in SIZE_KEYS:
        others = [k for k in report.keys if k not in (LR_KEY, size)]
        shifts = seed_shifts(report, size, step)
        for setting, sizes in transfer(report, size).items():
            label = ", ".join(f"{short_key(k)}={format_value(v)}" for k, v in zip(others, setting))
            best = ", ".join(f"{lr:.3g} at {format_value(v)}" for v, (lr, _) in sizes.items())
            first, last = sizes[min(sizes)][0], sizes[max(sizes)][0]
            moved = _moved(math.log(last / first) / step, shifts[setting])
            edges = [format_value(v) for v, (_, edge) in sizes.items() if edge]
            edge = f"; at the grid's edge at {', '.join(edges)}, so it may lie beyond" if edges else ""
            lines.append(f"{short_key(size)}{' (' + label + ')' if label else ''}: best lr {best}; {moved}{edge}.")
    return lines
