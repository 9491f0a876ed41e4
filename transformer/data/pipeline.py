"""The data side as the trainer and evaluator see it: `prepare` opens (or builds) the token cache of
each source and returns a `Data` (tokenizer, windows, sampler, objective, validation windows); the
start-up line says what was read, how it was split and how often training repeats it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from transformer.config import DataConfig
from transformer.data.batches import MixtureSampler, Pairs, Sampler, Windows
from transformer.data.cache import build_cache, cache_directory, make_tokenizer
from transformer.data.objectives import (
    Objective,
    ObjectiveError,
    PairObjective,
    Vocab,
    make_objective,
    train_keys,
    val_keys,
)
from transformer.data.sources import DataError, naming, pair_fields
from transformer.data.splits import HASH, POSITION, SOURCE, VAL_SOURCE, split_rule
from transformer.data.tokenizer import Tokenizer

REPEAT_WARNING = 10.0  # a run that would see its training split more often than this says so


@dataclasses.dataclass(frozen=True)
class Part:
    """One source of a mixture: its name (in metric keys), its normalised weight and its data alone."""

    name: str
    weight: float
    data: Data


@dataclasses.dataclass
class Data:
    """Everything the trainer and evaluator need from the data side. For a mixture, `parts` holds
    each source's own Data and train, val and the val fields are those of the first source."""

    tokenizer: Tokenizer
    train: Windows | Pairs
    val: Windows | Pairs
    sampler: Sampler | MixtureSampler
    val_window_ids: np.ndarray  # the fixed validation windows (or pairs)
    # NaN where bits per byte means nothing (mlm, span); per target token for pairs
    val_bytes_per_token: float
    cache_path: Path
    objective: Objective  # what a batch holds (data.objective), with the extra ids it needs
    # how the source was divided (SOURCE, HASH, POSITION, VAL_SOURCE) and the sizes of the splits:
    # the `data` field of the run's start event
    summary: dict = dataclasses.field(default_factory=dict)
    parts: tuple[Part, ...] = ()

    @property
    def vocab(self) -> Vocab:
        """The ids the model sees: the tokenizer's, then the objective's mask token and sentinels."""
        return self.objective.vocab

    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    def train_batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step` (rows split evenly over processes, in order)."""
        B = self.sampler.batch_size
        if B % process_count:  # uneven shares would silently drop rows of the global batch
            raise DataError(f"train.batch_size: {B} rows cannot be split evenly over {process_count} processes")
        per = B // process_count
        rows = range(process_index * per, (process_index + 1) * per)
        if not isinstance(self.sampler, MixtureSampler):
            keys = train_keys(self.sampler.seed, step, np.arange(rows.start, rows.stop))
            return self.objective.batch(self.train, self.sampler.window_ids(step, rows), keys)
        source, windows = self.sampler.locate(step, rows)
        out: dict[str, np.ndarray] = {}
        for j in np.unique(source):
            for key, value in self.parts[j].data.train.batch(windows[source == j]).items():
                out.setdefault(key, np.empty((per, *value.shape[1:]), value.dtype))[source == j] = value
        return out

    def val_batches(self, batch_size: int) -> list[dict[str, np.ndarray]]:
        """The fixed validation windows in batches; a short last batch is padded and weighted 0. A
        mixture's are its sources' in turn (each validates separately: see train/validation.py)."""
        if self.parts:
            return [b for part in self.parts for b in part.data.val_batches(batch_size)]
        out = []
        for start in range(0, len(self.val_window_ids), batch_size):
            ids = self.val_window_ids[start : start + batch_size]
            real = len(ids)
            ids = np.concatenate([ids, np.repeat(ids[:1], batch_size - real)])
            batch = self.objective.batch(self.val, ids, val_keys(ids))
            real_B = (np.arange(batch_size) < real).astype(np.float32)
            batch["weights"] = batch.get("weights", np.ones(batch["targets"].shape, np.float32)) * real_B[:, None]
            out.append(batch)
        return out


def prepare(
    cfg: DataConfig,
    batch_size: int,
    seed: int,
    workdir: Path | None = None,
    log: Callable[[str], None] = print,
    steps: int | None = None,
) -> Data:
    """Load (or build) the token cache for `cfg` and set up deterministic train and val batches.
    Given a run's `steps`, logs its start-up line (see `startup_line`)."""
    cache_dir = cache_directory(cfg)
    tokenizer = make_tokenizer(cfg, workdir, cache_dir)
    if cfg.mixture:
        return _prepare_mixture(cfg, tokenizer, cache_dir, batch_size, seed, log, steps)
    data = _open_source(cfg, tokenizer, cache_dir, batch_size, seed, None, log)
    if steps is not None:  # a training run's start-up line (eval and tests leave it out)
        log(startup_line(cfg, data.summary, batch_size, steps))
    return data


def _open_source(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    cache_dir: Path,
    batch_size: int,
    seed: int,
    stream: int | None,
    log: Callable[[str], None],
) -> Data:
    """One source's Data over its token cache (built if missing); `stream` keeps the training
    orders of a mixture's sources apart (None: a single source's, as before mixtures)."""
    try:
        objective = make_objective(cfg, tokenizer)
    except ObjectiveError as e:
        raise DataError(str(e)) from None
    path = build_cache(cfg, tokenizer, cache_dir, log)
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("rows_without_text"):
        fields = f"the pair fields {pair_fields(cfg)}" if cfg.pairs else f"data.text_field {cfg.text_field!r}"
        log(
            f"data: {meta['rows_without_text']:,} of {meta['rows']:,} rows of {cfg.source} are without text in "
            f"{fields} (missing or null): left out"
        )
    train, val = _splits(cfg, objective, path, np.dtype(meta["dtype"]), batch_size, log)
    rule = meta.get("split") or split_rule(cfg)  # a cache made before the rule was recorded: ask the source
    summary = dict(split=rule, **{f"{s}_{n}": meta[s][n] for s in ("train", "val") for n in ("tokens", "documents")})
    # evenly spaced over the whole validation split, independent of the run's seed and batch size
    n_val = min(cfg.val_windows, val.count)
    val_ids = np.unique(np.linspace(0, val.count - 1, n_val).round().astype(np.int64))
    return Data(
        tokenizer=tokenizer,
        train=train,
        val=val,
        sampler=Sampler(train.count, batch_size, seed, stream),
        val_window_ids=val_ids,
        val_bytes_per_token=objective.bytes_per_token(meta["val"]),
        cache_path=path,
        objective=objective,
        summary=summary,
    )


def _splits(
    cfg: DataConfig, objective: Objective, path: Path, dtype: np.dtype, batch_size: int, log: Callable[[str], None]
) -> tuple[Windows, Windows] | tuple[Pairs, Pairs]:
    """The cache's training and validation splits: text cut into the objective's windows, or pairs."""
    if not cfg.pairs:
        eos = objective.vocab.tokenizer.eos_id
        windows = (
            Windows(
                np.memmap(path / f"{s}.bin", dtype=dtype, mode="r"), objective.window_len, eos, objective.document_mask
            )
            for s in ("train", "val")
        )
        train_windows, val_windows = windows
        _check_sizes(cfg, train_windows, val_windows, batch_size)
        return train_windows, val_windows
    assert isinstance(objective, PairObjective)  # pairs are trained by pair objectives (Config refuses others)
    train, val = Pairs.open(path, "train", dtype), Pairs.open(path, "val", dtype)
    if train.count < batch_size:
        raise DataError(
            f"data.source: the training split of {cfg.source} has {train.count:,} pairs, "
            f"fewer than one global batch of {batch_size}"
        )
    for name, split in (("training", train), ("validation", val)):
        inputs, targets = objective.overlong(*split.lengths())
        if inputs or targets:
            log(
                f"data: of {split.count:,} {name} pairs, {inputs:,} inputs are cut to data.seq_len and "
                f"{targets:,} targets to data.target_len - 1 tokens (room for EOS)"
            )
    return train, val


def _prepare_mixture(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    cache_dir: Path,
    batch_size: int,
    seed: int,
    log: Callable[[str], None],
    steps: int | None,
) -> Data:
    """A mixture's Data: each source opened alone (one window at least: the schedule decides how
    many rows it gives a batch), the rows of a batch assigned by MixtureSampler."""
    total = sum(e.weight for e in cfg.mixture)
    parts = []
    for i, name in enumerate(cfg.mixture_names):
        with naming(f"data.mixture[{i}].source"):
            part = _open_source(cfg.mixture_source(i), tokenizer, cache_dir, 1, seed, i, log)
        parts.append(Part(name, cfg.mixture[i].weight / total, part))
    first = parts[0].data
    samplers = [p.data.sampler for p in parts if isinstance(p.data.sampler, Sampler)]
    sampler = MixtureSampler(samplers, [p.weight for p in parts], batch_size)
    summary = mixture_summary(parts)
    if steps is not None:
        log(mixture_line(cfg, parts, batch_size, steps))
    return dataclasses.replace(first, sampler=sampler, summary=summary, parts=tuple(parts))


def mixture_summary(parts: list[Part]) -> dict:
    """The start event's `data` for a mixture: totals over the sources, and each source's own."""
    summary: dict = dict(split="mixture")
    for key in ("train_tokens", "train_documents", "val_tokens", "val_documents"):
        summary[key] = sum(p.data.summary[key] for p in parts)
    summary["sources"] = {p.name: dict(weight=p.weight, **p.data.summary) for p in parts}
    return summary


def mixture_line(cfg: DataConfig, parts: list[Part], batch_size: int, steps: int) -> str:
    """The start-up line of a mixture: per source its weight, tokens per split, split rule and the
    epochs a run of `steps` makes over its training split (said plainly above REPEAT_WARNING)."""
    line = f"data: a mixture of {len(parts)} sources; {steps:,} steps of {batch_size} x {cfg.seq_len} tokens"
    for entry, p in zip(cfg.mixture, parts):
        s = p.data.summary
        epochs = steps * batch_size * p.weight * cfg.seq_len / s["train_tokens"]
        line += (
            f"; {p.name} ({entry.source}, weight {p.weight:.3g}): train {s['train_tokens']:,} tokens, "
            f"val {s['val_tokens']:,} tokens ({s['split']} split), {epochs:.3g} epochs"
        )
        if epochs > REPEAT_WARNING:
            line += f": it repeats each of its training tokens ~{epochs:.0f} times, expect memorisation"
    return line


def _check_sizes(cfg: DataConfig, train: Windows, val: Windows, batch_size: int) -> None:
    need = batch_size * cfg.seq_len + 1
    if train.count < batch_size:
        raise DataError(
            f"data.source: the training split of {cfg.source} has {len(train.tokens):,} tokens; "
            f"one global batch of {batch_size} x {cfg.seq_len} needs {need:,}"
        )
    if val.count < 1:
        key, what = (
            ("val_source", cfg.val_source)
            if cfg.val_source
            else ("val_fraction", f"the validation split of {cfg.source}")
        )
        raise DataError(
            f"data.{key}: {what} has {len(val.tokens):,} tokens, fewer than one window of {cfg.seq_len + 1}"
        )


def startup_line(cfg: DataConfig, summary: dict, batch_size: int, steps: int) -> str:
    """Tokens and documents per split, the rule that made them, and how many times a run of `steps`
    goes over its training split (said plainly above REPEAT_WARNING)."""
    f, rule = cfg.val_fraction, summary["split"]
    how = {
        SOURCE: f"the source's own {cfg.val_split!r} split validates",
        HASH: f"split by content hash ({f:g} of the documents validate)",
        POSITION: f"split by position: the last {100 * f:g}% of each document's characters validates (a hash split of so few or so "
        "uneven documents would leave a side empty or far off val_fraction)",
        VAL_SOURCE: f"data.val_source {cfg.val_source} validates",
    }[rule]
    line = (
        f"data: {cfg.source}: train {summary['train_tokens']:,} tokens ({summary['train_documents']:,} documents), "
        f"val {summary['val_tokens']:,} tokens ({summary['val_documents']:,} documents); {how}"
    )
    if cfg.pairs:  # a row is a pair (its tokens counted above are the inputs')
        epochs = steps * batch_size / summary["train_documents"]
        line += f"; {steps:,} steps of {batch_size} pairs make {epochs:.3g} epochs of the training pairs"
    else:
        epochs = steps * batch_size * cfg.seq_len / summary["train_tokens"]
        line += (
            f"; {steps:,} steps of {batch_size} x {cfg.seq_len} tokens make {epochs:.3g} epochs of the training split"
        )
    if epochs > REPEAT_WARNING:
        line += f": it repeats each training token ~{epochs:.0f} times, expect memorisation (more data or fewer steps)"
    return line
