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

# Every option of a task is bounded, so that a typo cannot make validation or generation run for hours
MAX_DOCS = 1_000_000  # documents (pairs) per split
MAX_DISTANCE = 1_000_000  # recall: tokens between an answer and its query
MAX_LEN = 4096  # seq2seq: letters of an input
MAX_SEED = 2**32 - 1
MAX_TASK_TOKENS = 2**30  # characters of all of a task's documents, both splits


def parse_options(cls, options: str) -> dict:
    """'a=1,b=x' -> {'a': 1, 'b': 'x'} for the fields of dataclass `cls` (int fields as integers);
    ValueError names an unknown option, one given twice, or a value that is not an integer."""
    kinds = {f.name: f.type for f in dataclasses.fields(cls)}
    kwargs: dict = {}
    for item in filter(None, options.split(",")):
        name, sep, value = item.partition("=")
        if not sep or name not in kinds:
            raise ValueError(f"unknown option {item!r} (options: {', '.join(sorted(kinds))})")
        if name in kwargs:
            raise ValueError(f"option {name!r} is given twice (once is enough: which one did you mean?)")
        try:
            kwargs[name] = int(value) if kinds[name] == "int" else value
        except ValueError:
            shown = value if len(value) <= 40 else value[:40] + "..."
            raise ValueError(f"{name} must be an integer, got {shown!r}") from None
    return kwargs


def check_range(name: str, value: int, low: int, high: int) -> None:
    """ValueError naming option `name` unless low <= value <= high."""
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")


def _check_common(task) -> None:
    """The options every task has: its document counts and its seed; and the size of its documents,
    `task.longest` characters at most each, over both splits."""
    for name in ("train_docs", "val_docs"):
        check_range(name, getattr(task, name), 1, MAX_DOCS)
    check_range("seed", task.seed, 0, MAX_SEED)
    total = task.longest * (task.train_docs + task.val_docs)
    if total > MAX_TASK_TOKENS:
        raise ValueError(
            f"{task.longest_name} x (train_docs + val_docs) = {total:,} characters, more than {MAX_TASK_TOKENS:,}: "
            "lower them"
        )


@dataclasses.dataclass(frozen=True)
class RecallTask:
    pairs: int = 8
    distance: int = 48  # tokens between an answer and the position that must predict it (at least, if shuffled)
    shuffle: int = 0  # 1: queries in a random order (associative recall); 0: in the pairs' order
    train_docs: int = 20000
    val_docs: int = 1000
    seed: int = 0

    longest_name = "a document's tokens"  # in _check_common's message

    def __post_init__(self):
        check_range("pairs", self.pairs, 1, len(KEYS))
        if self.shuffle not in (0, 1):
            raise ValueError(f"shuffle must be 0 or 1, got {self.shuffle}")
        if self.filler < 0:
            least = QUERY if self.shuffle else PAIR * self.pairs
            raise ValueError(f"distance must be >= {least} for {self.pairs} pairs, got {self.distance}")
        check_range("distance", self.distance, 0, MAX_DISTANCE)
        _check_common(self)

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

    @property
    def longest(self) -> int:
        return self.doc_tokens

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

    longest_name = "max_len"  # in _check_common's message

    def __post_init__(self):
        if self.task not in SEQ2SEQ_TASKS:
            raise ValueError(f"task must be one of {', '.join(SEQ2SEQ_TASKS)}, got {self.task!r}")
        check_range("min_len", self.min_len, 1, MAX_LEN)
        check_range("max_len", self.max_len, 1, MAX_LEN)
        if not self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}")
        check_range("alphabet", self.alphabet, 2, len(KEYS))
        _check_common(self)
        need, distinct = 2 * (self.train_docs + self.val_docs), 0
        for n in range(self.min_len, self.max_len + 1):  # stops as soon as there are enough
            distinct += self.alphabet**n
            if distinct >= need:
                break
        if distinct < need:  # else validation inputs would be hard to find
            raise ValueError(
                f"{distinct} distinct inputs are too few for train_docs + val_docs: raise max_len or alphabet"
            )

    @property
    def longest(self) -> int:
        return self.max_len

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
