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


def parse_options(cls, options: str) -> dict:
    """'a=1,b=x' -> {'a': 1, 'b': 'x'} for the fields of dataclass `cls` (int fields as integers);
    ValueError names an unknown option or a value that is not an integer."""
    kinds = {f.name: f.type for f in dataclasses.fields(cls)}
    kwargs: dict = {}
    for item in filter(None, options.split(",")):
        name, sep, value = item.partition("=")
        if not sep or name not in kinds:
            raise ValueError(f"unknown option {item!r} (options: {', '.join(sorted(kinds))})")
        try:
            kwargs[name] = int(value) if kinds[name] == "int" else value
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
    return kwargs


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
        return cls(**parse_options(cls, options))

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


# builtin:seq2seq: what the target is, given the input
SEQ2SEQ_TASKS = {"reverse": lambda s: s[::-1], "sort": lambda s: "".join(sorted(s)), "copy": lambda s: s}


@dataclasses.dataclass(frozen=True)
class Seq2seqTask:
    """`builtin:seq2seq[:task=reverse|sort|copy,...]`: input/target pairs whose answer is known. An
    input is min_len..max_len letters drawn from the first `alphabet` lowercase letters (lengths vary,
    so batches carry padding); the target is the input reversed, sorted or copied. Validation inputs
    never occur among the training inputs, so a model must compute the answer, not recall it."""

    task: str = "reverse"
    min_len: int = 2
    max_len: int = 10
    alphabet: int = 8
    train_docs: int = 20000
    val_docs: int = 500
    seed: int = 0

    def __post_init__(self):
        if self.task not in SEQ2SEQ_TASKS:
            raise ValueError(f"task must be one of {', '.join(SEQ2SEQ_TASKS)}, got {self.task!r}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}")
        if not 2 <= self.alphabet <= len(KEYS):
            raise ValueError(f"alphabet must be between 2 and {len(KEYS)}, got {self.alphabet}")
        if self.train_docs < 1 or self.val_docs < 1:
            raise ValueError("train_docs and val_docs must be >= 1")
        distinct = sum(self.alphabet**n for n in range(self.min_len, self.max_len + 1))
        if distinct < 2 * (self.train_docs + self.val_docs):  # else validation inputs would be hard to find
            raise ValueError(
                f"{distinct} distinct inputs are too few for train_docs + val_docs: raise max_len or alphabet"
            )

    @classmethod
    def parse(cls, options: str) -> Seq2seqTask:
        return cls(**parse_options(cls, options))

    def answer(self, text: str) -> str:
        return SEQ2SEQ_TASKS[self.task](text)

    def draw(self, rng: np.random.Generator) -> str:
        n = int(rng.integers(self.min_len, self.max_len + 1))
        return "".join(KEYS[i] for i in rng.integers(0, self.alphabet, n))

    def inputs(self, split: str) -> list[str]:
        """The split's inputs, a pure function of the task's fields: validation draws from its own
        stream and passes over any input the training split holds."""
        train_rng = np.random.default_rng([self.seed, 0])
        train = [self.draw(train_rng) for _ in range(self.train_docs)]
        if split == "train":
            return train
        seen, val, rng = set(train), list[str](), np.random.default_rng([self.seed, 1])
        while len(val) < self.val_docs:
            text = self.draw(rng)
            if text not in seen:
                val.append(text)
        return val

    def pairs(self, split: str) -> tuple[list[str], list[str]]:
        inputs = self.inputs(split)
        return inputs, [self.answer(t) for t in inputs]
