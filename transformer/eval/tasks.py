"""Downstream tasks shipped with the framework, as lm-eval task configs that run offline.

`stdlib_next_line`: which of four lines really comes next in a held-out file of the Python standard
library? The context is up to six lines (at most `CONTEXT_CHARS` characters) of a validation
document of `builtin:stdlib` (the default run's validation split, so the default run never trained
on them); the choices are the true next line and three lines drawn from other validation files, in
a random order. Chance is 1/4. Everything is a function of the seed and the machine's standard
library: the items are written as JSON lines (and the task as an lm-eval YAML beside them, for
`lm_eval --include_path`) under the data cache.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml

from transformer.config import DataConfig
from transformer.rundir import atomic_write

STDLIB_NEXT_LINE = "stdlib_next_line"
N_ITEMS, N_CHOICES, CONTEXT_LINES, CONTEXT_CHARS = 500, 4, 6, 200
LINE_CHARS = (12, 80)  # a candidate line's stripped length: no blank lines or lone brackets


def _candidate(line: str) -> bool:
    text = line.strip()
    return LINE_CHARS[0] <= len(text) <= LINE_CHARS[1] and any(c.isalnum() for c in text)


def next_line_items(documents: list[str], seed: int, n: int = N_ITEMS) -> list[dict]:
    """`n` items {context, choices, label} from `documents` (see the module's docstring)."""
    rng = np.random.default_rng(seed)
    lines = [doc.split("\n") for doc in documents]
    pool = [(d, i) for d, doc_lines in enumerate(lines) for i, line in enumerate(doc_lines) if i and _candidate(line)]
    if len({d for d, _ in pool}) < 2:
        raise ValueError("the next-line task needs candidate lines in at least two documents")
    items = []
    for k in rng.permutation(len(pool)):
        d, i = pool[k]
        context = _context(lines[d][max(0, i - CONTEXT_LINES) : i])
        true = lines[d][i]
        if not context.strip():
            continue
        choices = {true}
        while len(choices) < N_CHOICES:
            other_d, other_i = pool[rng.integers(len(pool))]
            if other_d != d:
                choices.add(lines[other_d][other_i])
        ordered = sorted(choices - {true})
        label = int(rng.integers(N_CHOICES))
        ordered.insert(label, true)
        items.append({"context": context, "choices": ordered, "label": label})
        if len(items) == n:
            break
    return items


def _context(lines: list[str]) -> str:
    """The lines, each ended by its newline, the oldest dropped until CONTEXT_CHARS hold them."""
    while len(lines) > 1 and sum(len(line) + 1 for line in lines) > CONTEXT_CHARS:
        lines = lines[1:]
    return "".join(line + "\n" for line in lines)[-CONTEXT_CHARS:]


def stdlib_next_line(directory: Path, seed: int = 0) -> dict:
    """The task's lm-eval config, its items written under `directory` (once per content)."""
    from transformer.data import load_splits

    val = load_splits(DataConfig(source="builtin:stdlib"))["val"]
    items = next_line_items([str(t) for t in val["text"]], seed)
    text = "".join(json.dumps(item) + "\n" for item in items)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{STDLIB_NEXT_LINE}-seed{seed}-{digest}.jsonl"
    config = {
        "task": STDLIB_NEXT_LINE,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"validation": str(path)}},
        "output_type": "multiple_choice",
        "validation_split": "validation",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": "",  # a choice is the whole next line; the context ends with its newline
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0, "seed": seed, "items": len(items)},
    }
    if not path.exists():
        atomic_write(path, text)
        atomic_write(directory / f"{STDLIB_NEXT_LINE}.yaml", yaml.safe_dump(config, sort_keys=False))
    return config


def builtin_tasks(directory: Path) -> dict[str, Callable[[], dict]]:
    """The shipped tasks by name, each built when first asked for."""
    return {STDLIB_NEXT_LINE: lambda: stdlib_next_line(directory)}
