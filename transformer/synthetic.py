"""Synthetic corpora whose answers are known, for ablations that need a task with a ground truth.

`builtin:recall[:key=value,...]` is a recall task. A document lists `pairs` key/value pairs, then
filler, then asks for every key again:

    aQ mB xK ...  ..........  ?aQ?mB?xK ...
    pairs         filler      queries

Keys are distinct lowercase letters, values uppercase letters. In a query `?k v` the model must
predict `v` at the position of `k` (and, in the default fixed order, `k` itself at the `?`); both
last appeared in the pair list exactly `distance` tokens back (the byte tokenizer makes one
character one token). With `shuffle=1` the queries come in a random order, which makes it
associative recall proper (find the key, copy its value); every answer is then at least `distance`
back. Everything else is structure, so recall shows in the loss of the query tokens alone.

A causal model whose receptive field is shorter than `distance` — a sliding window of w tokens in
each of L layers reaches L·(w-1) back — cannot see the answers, and is left at the chance loss
log(26) on each of them; with full attention they are predictable exactly.
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np

KEYS = string.ascii_lowercase
VALUES = string.ascii_uppercase
PAIR = 3  # "kV " in the pair list
QUERY = 3  # "?kV" in the query list


@dataclasses.dataclass(frozen=True)
class RecallTask:
    pairs: int = 8
    distance: int = 48  # tokens between an answer and the position that must predict it (at least, if shuffled)
    shuffle: int = 0  # 1: queries in a random order (associative recall); 0: in the pairs' order
    train_docs: int = 20000
    val_docs: int = 1000
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.pairs <= len(KEYS):
            raise ValueError(f"pairs must be between 1 and {len(KEYS)}, got {self.pairs}")
        if self.shuffle not in (0, 1):
            raise ValueError(f"shuffle must be 0 or 1, got {self.shuffle}")
        if self.filler < 0:
            least = QUERY if self.shuffle else PAIR * self.pairs
            raise ValueError(f"distance must be >= {least} for {self.pairs} pairs, got {self.distance}")
        if self.train_docs < 1 or self.val_docs < 1:
            raise ValueError("train_docs and val_docs must be >= 1")

    @classmethod
    def parse(cls, options: str) -> RecallTask:
        """'pairs=8,distance=64' -> RecallTask(pairs=8, distance=64); ValueError names the problem."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for item in filter(None, options.split(",")):
            name, sep, value = item.partition("=")
            if not sep or name not in fields:
                raise ValueError(f"unknown option {item!r} (options: {', '.join(sorted(fields))})")
            try:
                kwargs[name] = int(value)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {value!r}") from None
        return cls(**kwargs)

    @property
    def filler(self) -> int:
        if self.shuffle:  # the nearest answer: the last pair's value, asked first, is filler + QUERY back
            return self.distance - QUERY
        return self.distance - PAIR * self.pairs  # query i starts exactly `distance` after pair i

    @property
    def doc_tokens(self) -> int:
        return PAIR * self.pairs + self.filler + QUERY * self.pairs

    def document(self, rng: np.random.Generator) -> str:
        keys = rng.choice(len(KEYS), self.pairs, replace=False)
        values = rng.integers(0, len(VALUES), self.pairs)
        order = rng.permutation(self.pairs) if self.shuffle else np.arange(self.pairs)
        pairs = "".join(f"{KEYS[k]}{VALUES[v]} " for k, v in zip(keys, values))
        queries = "".join(f"?{KEYS[keys[i]]}{VALUES[values[i]]}" for i in order)
        return pairs + "." * self.filler + queries

    def documents(self, split: str) -> list[str]:
        """The split's documents: a pure function of the task's fields (val never overlaps train's seed)."""
        n, stream = (self.train_docs, 0) if split == "train" else (self.val_docs, 1)
        rng = np.random.default_rng([self.seed, stream])
        return [self.document(rng) for _ in range(n)]

    def answers(self, doc: str) -> list[tuple[int, int]]:
        """(position predicting a value, position of that value in the pairs), one per query: the
        token after the first position must equal the token at the second."""
        start = PAIR * self.pairs + self.filler
        where = {doc[PAIR * i]: PAIR * i + 1 for i in range(self.pairs)}
        return [(start + QUERY * j + 1, where[doc[start + QUERY * j + 1]]) for j in range(self.pairs)]
