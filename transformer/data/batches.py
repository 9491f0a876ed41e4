"""Step-indexed batches. `Windows` (packed text) and `Pairs` (input/target rows) read the token
cache; `Sampler` gives the window ids of global batch `i` from a seeded permutation per epoch, and
`MixtureSampler` a mixture's by its stride `Schedule`: batch `i` is a pure function of (data config,
seed, `i`), so resuming needs no iterator state and every process computes its own rows."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np

from transformer.config import DataConfig
from transformer.data.objectives import (
    document_layout,
    make_objective,
    val_keys,
)
from transformer.data.tokenizer import ByteTokenizer


@dataclasses.dataclass(frozen=True)
class Windows:
    """A split's token stream cut into windows of seq_len+1 tokens with stride seq_len, so every
    token after the first is a target exactly once."""

    tokens: np.ndarray  # memory-mapped
    seq_len: int
    eos_id: int
    document_mask: bool

    @property
    def count(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def batch(self, window_ids: np.ndarray) -> dict[str, np.ndarray]:
        T = self.seq_len
        rows = np.stack([np.asarray(self.tokens[k * T : k * T + T + 1]) for k in window_ids]).astype(np.int32)
        batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
        if self.document_mask:
            batch.update(document_layout(batch["inputs"], self.eos_id))
        return batch


@dataclasses.dataclass(frozen=True)
class Pairs:
    """A split's input/target pairs: two ragged token streams (each document followed by EOS) and
    where each document starts, all memory-mapped. `count` pairs, sampled as windows are."""

    inputs: np.ndarray
    input_offsets: np.ndarray  # [count + 1]
    targets: np.ndarray
    target_offsets: np.ndarray

    @classmethod
    def open(cls, path: Path, split: str, dtype: np.dtype) -> Pairs:
        def stream(name: str, kind: np.dtype) -> np.ndarray:
            return np.memmap(path / name, dtype=kind, mode="r")

        return cls(
            stream(f"{split}.bin", dtype),
            stream(f"{split}.offsets", np.dtype(np.int64)),
            stream(f"{split}.target.bin", dtype),
            stream(f"{split}.target.offsets", np.dtype(np.int64)),
        )

    @property
    def count(self) -> int:
        return len(self.input_offsets) - 1

    def pairs(self, ids: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(inputs, targets) of pairs `ids`, without their EOS."""

        def docs(stream: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
            return [np.asarray(stream[offsets[k] : offsets[k + 1] - 1], np.int64) for k in ids]

        return docs(self.inputs, self.input_offsets), docs(self.targets, self.target_offsets)

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """Tokens of each input and each target (EOS not counted)."""
        return np.diff(self.input_offsets) - 1, np.diff(self.target_offsets) - 1


def example_batch(cfg: DataConfig) -> dict[str, np.ndarray]:
    """One row of the batch `cfg`'s objective makes, from a stand-in split of zeros: its keys, shapes
    and dtypes without reading the data (what an abstract batch for compiling needs)."""
    objective = make_objective(cfg, ByteTokenizer())
    zeros, one = np.zeros(2, np.uint16), np.arange(2, dtype=np.int64) * 2  # one document: a token and EOS
    length = objective.window_len
    split = (
        Pairs(zeros, one, zeros, one)
        if cfg.pairs
        else Windows(np.zeros(length + 1, np.uint16), length, ByteTokenizer.eos_id, objective.document_mask)
    )
    return objective.batch(split, np.zeros(1, np.int64), val_keys(np.zeros(1, np.int64)))


class Sampler:
    """Global batch i = windows [i*B, (i+1)*B) of the endless sequence of per-epoch permutations.
    A mixture's sources each have one (`stream` = the source's index, so their orders differ)."""

    def __init__(self, n_windows: int, batch_size: int, seed: int, stream: int | None = None):
        self.n, self.batch_size, self.seed = n_windows, batch_size, seed
        self.key = [seed] if stream is None else [seed, stream]
        # a batch straddles at most two epochs: keep their permutations, per sampler
        self.permutation = functools.lru_cache(maxsize=2)(self._permutation)

    def _permutation(self, epoch: int) -> np.ndarray:
        # [seed, epoch] as before streams existed: single-source runs keep their batches
        key = [self.key[0], epoch, *self.key[1:]]
        return np.random.Generator(np.random.PCG64(key)).permutation(self.n)

    def window_ids(self, step: int, rows: range | None = None) -> np.ndarray:
        rows = range(self.batch_size) if rows is None else rows
        return self.windows_at(step * self.batch_size + np.arange(rows.start, rows.stop))

    def windows_at(self, flat: np.ndarray) -> np.ndarray:
        """The windows at positions `flat` of the endless sequence of permutations."""
        epochs, offsets = np.divmod(flat, self.n)
        return np.asarray([self.permutation(int(e))[o] for e, o in zip(epochs, offsets)], np.int64)

    def epochs_consumed(self, steps: int) -> float:
        return steps * self.batch_size / self.n


# Rows of one period of a mixture's assignment: the weights are rounded to multiples of 1/this.
MIXTURE_PERIOD = 1 << 14


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which source each row of a mixture's global stream of rows (row k = step * B + r) comes from,
    and its index in that source's own stream. Each source gets quota_j = weight_j * P rows of every
    period of P rows (largest remainders), placed at its ideal times (n + 1/2) / quota_j merged in
    order (stride scheduling): every run of rows holds each source's share to within a row or two,
    and where row k goes is a table lookup, so batch i needs no state of the batches before it."""

    source: np.ndarray  # [P] the source of row k, for k % P
    rank: np.ndarray  # [P] its index among that source's rows of the period
    quota: np.ndarray  # [S] each source's rows per period

    @classmethod
    def of(cls, weights: list[float], period: int = MIXTURE_PERIOD) -> Schedule:
        w = np.asarray(weights, np.float64) / sum(weights)
        quota = np.floor(w * period).astype(np.int64)
        # the rows left by rounding down go to the largest remainders (ties to the first source)
        short = period - int(quota.sum())
        quota[np.argsort(-(w * period - quota), kind="stable")[:short]] += 1
        times = np.concatenate([(np.arange(q) + 0.5) / q for q in quota if q])
        source = np.concatenate([np.full(q, j) for j, q in enumerate(quota) if q])
        rank = np.concatenate([np.arange(q) for q in quota if q])
        order = np.lexsort((source, times))  # by time, ties by source: deterministic everywhere
        return cls(source[order], rank[order], quota)

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index in that source's stream) of each global row."""
        period, offset = np.divmod(rows, len(self.source))
        source = self.source[offset]
        return source, period * self.quota[source] + self.rank[offset]


class MixtureSampler:
    """Global batch i of a mixture: row r is global row k = i*B + r, whose source and index in that
    source's stream `Schedule` gives; each source's stream is its own endless sequence of per-epoch
    permutations (its Sampler). Window ids are indices into the sources' training windows laid end
    to end (source j's window w is offsets[j] + w)."""

    def __init__(self, samplers: list[Sampler], weights: list[float], batch_size: int):
        self.samplers, self.batch_size = samplers, batch_size
        self.schedule = Schedule.of(weights)
        self.offsets = np.cumsum([0] + [s.n for s in samplers[:-1]])

    def locate(self, step: int, rows: range | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(source, window of that source) of each row of global batch `step`."""
        rows = range(self.batch_size) if rows is None else rows
        source, index = self.schedule.locate(step * self.batch_size + np.arange(rows.start, rows.stop))
        windows = np.empty(len(source), np.int64)
        for j in np.unique(source):
            windows[source == j] = self.samplers[j].windows_at(index[source == j])
        return source, windows

    def window_ids(self, step: int, rows: range | None = None) -> np.ndarray:
        source, windows = self.locate(step, rows)
        return self.offsets[source] + windows
