"""What one batch of each training objective holds, made from the token cache's windows or pairs.

One class per `data.objective` (README: Objectives): each turns the rows the sampler picked into
the batch dict the trainer feeds the model, and owns the extra ids it needs after the tokenizer's
vocabulary (`Vocab`): the MLM mask token, T5's sentinels.

    causal   windows as they are (next token of text)
    mlm      BERT's masked LM: inputs corrupted, targets the original, weights on the chosen tokens
    span     T5's span corruption: encoder text with a sentinel per noise span, decoder the spans
    seq2seq  encoder-decoder on input/target pairs (teacher forcing)
    prefix   decoder-only on the same pairs: input, BOS, target, EOS in one row

Randomness is a pure function of a row's key: (seed, step, row of the global batch) in training,
so a resumed run corrupts batch i exactly as before, and the window's id in validation, so every
evaluation (of every run) sees the same corrupted validation set.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Protocol

import numpy as np

from transformer.config import DataConfig
from transformer.data.tokenizer import Tokenizer

MASK_TEXT = "<mask>"
TRAIN_KEY, VAL_KEY = 0x7472, 0x7661  # first word of a row's random key: training rows and validation windows apart


def sentinel_text(i: int) -> str:
    return f"<extra_id_{i}>"


def train_keys(seed: int, step: int, rows: np.ndarray) -> np.ndarray:
    """[n, 4] the random key of each row (its index in the global batch) of training batch `step`."""
    return np.stack([np.full(len(rows), TRAIN_KEY), np.full(len(rows), seed), np.full(len(rows), step), rows], 1)


def val_keys(window_ids: np.ndarray) -> np.ndarray:
    """[n, 2] the random key of each validation window: its id, whatever the run's seed or batch size."""
    return np.stack([np.full(len(window_ids), VAL_KEY), window_ids], 1)


def row_rng(key: np.ndarray) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([int(k) for k in key]))


@dataclasses.dataclass(frozen=True)
class Vocab:
    """The tokenizer's ids, then `n_mask` mask tokens (0 or 1; none where the tokenizer has its own,
    BERT's [MASK], which is then the mask) and `n_sentinels` T5 sentinels."""

    tokenizer: Tokenizer
    n_mask: int = 0
    n_sentinels: int = 0

    @property
    def base(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def size(self) -> int:
        """The model's vocabulary: Data.vocab_size."""
        return self.base + self.n_extra

    @property
    def n_added_masks(self) -> int:
        return self.n_mask if self.tokenizer.mask_id is None else 0

    @property
    def n_extra(self) -> int:
        return self.n_added_masks + self.n_sentinels

    @property
    def mask_id(self) -> int | None:
        if not self.n_mask:
            return None
        return self.base if self.tokenizer.mask_id is None else self.tokenizer.mask_id

    @property
    def sentinel_ids(self) -> tuple[int, ...]:
        first = self.base + self.n_added_masks
        return tuple(range(first, first + self.n_sentinels))

    @functools.cached_property
    def extra_texts(self) -> dict[int, str]:
        """Each extra id's text form: <mask>, <extra_id_0>, <extra_id_1>, ..."""
        texts = {} if self.mask_id is None else {self.mask_id: MASK_TEXT}
        return texts | {s: sentinel_text(i) for i, s in enumerate(self.sentinel_ids)}

    @functools.cached_property
    def ordinary_ids(self) -> np.ndarray:
        """The tokenizer's ids less BOS, EOS, PAD and its own mask: what MLM's random replacements draw from."""
        t = self.tokenizer
        own_mask = [] if t.mask_id is None else [t.mask_id]
        return np.setdiff1d(np.arange(self.base), [t.bos_id, t.eos_id, t.pad_id, *own_mask])

    def encode(self, text: str) -> list[int]:
        """Text in which <mask> (and <extra_id_i>) stand for their ids, e.g. a fill-mask prompt (and
        the tokenizer's own mask token, [MASK], for its)."""
        ids_of = {v: k for k, v in self.extra_texts.items()}
        own = getattr(self.tokenizer, "mask", None)
        if self.n_mask and own is not None and self.tokenizer.mask_id is not None:
            ids_of[own] = self.tokenizer.mask_id
        if not ids_of:
            return [int(i) for i in self.tokenizer.encode_batch([text])[0]]
        pieces = re.split("(" + "|".join(map(re.escape, ids_of)) + ")", text)
        ids: list[int] = []
        for i, piece in enumerate(pieces):  # odd pieces are the extra tokens' texts
            ids += [ids_of[piece]] if i % 2 else [int(t) for t in self.tokenizer.encode_batch([piece])[0]]
        return ids

    def decode(self, ids) -> str:
        """The text of `ids`, extra ids written in their text form (runs of ordinary ids decode together,
        so a multi-byte character split over tokens comes out whole)."""
        out: list[str] = []
        run: list[int] = []
        for i in map(int, ids):
            if i in self.extra_texts:
                out += [self.tokenizer.decode(run), self.extra_texts[i]]
                run = []
            else:
                run.append(i)
        return "".join(out) + self.tokenizer.decode(run)


def document_layout(inputs_BxT: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """Segment ids (a new document starts after each EOS) and positions restarting per document."""
    B, T = inputs_BxT.shape
    starts = np.zeros((B, T), bool)
    starts[:, 0] = True
    starts[:, 1:] = inputs_BxT[:, :-1] == eos_id
    segment_ids = np.cumsum(starts, axis=1, dtype=np.int32) - 1
    index = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    start_index = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return {"segment_ids": segment_ids, "positions": (index - start_index).astype(np.int32)}


class Objective(Protocol):
    @property
    def vocab(self) -> Vocab: ...

    @property
    def window_len(self) -> int: ...  # tokens per text window it reads; pair objectives read pairs

    @property
    def document_mask(self) -> bool: ...  # whether its windows carry document_layout themselves (causal)

    @property
    def lengths(self) -> tuple[int, int | None]: ...  # (T: tokens per row of `inputs`, S: per encoder row or None)

    def batch(self, split, ids: np.ndarray, keys: np.ndarray) -> dict[str, np.ndarray]:
        """The batch of rows `ids` of `split` (data.Windows or data.Pairs), row b drawing its
        randomness from keys[b] (`train_keys`, `val_keys`)."""
        ...

    def bytes_per_token(self, meta: dict) -> float: ...  # of a split, from its cache meta; NaN: no bits per byte


@dataclasses.dataclass(frozen=True)
class CausalLM:
    """Next-token prediction on the text windows, as before objectives existed (bit for bit)."""

    vocab: Vocab
    window_len: int
    document_mask: bool

    @property
    def lengths(self) -> tuple[int, int | None]:
        return self.window_len, None

    def batch(self, split, ids: np.ndarray, keys: np.ndarray) -> dict[str, np.ndarray]:
        return split.batch(ids)

    def bytes_per_token(self, meta: dict) -> float:
        return meta["bytes"] / max(1, meta["tokens"])


def _not_per_byte(meta: dict) -> float:
    """MLM and span losses cover some tokens of a row only (and span's include sentinels): bits per
    byte would compare with nothing, so it is NaN."""
    return math.nan


@dataclasses.dataclass(frozen=True)
class MaskedLM:
    """BERT's masked LM. Of each row's ordinary tokens (BOS, EOS and PAD are never chosen: EOS marks
    the document boundaries the layout is made of) round(mask_rate * n) are chosen (at least one); a
    chosen token becomes the mask id with probability mask_token_fraction, a random ordinary token with
    random_token_fraction, else stays. Targets are the original tokens, weighted 1 where chosen."""

    vocab: Vocab
    window_len: int
    mask_rate: float
    mask_token_fraction: float
    random_token_fraction: float
    document_mask = False  # the layout is always given (an encoder must not attend across documents)
    bytes_per_token = staticmethod(_not_per_byte)

    @property
    def lengths(self) -> tuple[int, int | None]:
        return self.window_len, None

    def batch(self, split, ids: np.ndarray, keys: np.ndarray) -> dict[str, np.ndarray]:
        tokens_BxT = split.batch(ids)["inputs"]
        inputs_BxT, weights_BxT = tokens_BxT.copy(), np.zeros(tokens_BxT.shape, np.float32)
        for b, key in enumerate(keys):
            chosen, replaced = self.corrupt_row(tokens_BxT[b], row_rng(key))
            inputs_BxT[b, chosen], weights_BxT[b, chosen] = replaced, 1.0
        t = self.vocab.tokenizer
        layout = document_layout(tokens_BxT, t.eos_id)
        return dict(inputs=inputs_BxT, targets=tokens_BxT, weights=weights_BxT, **layout)

    def corrupt_row(self, tokens_T: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(the chosen positions, sorted; the token each then holds)."""
        t = self.vocab.tokenizer
        eligible = np.flatnonzero(~np.isin(tokens_T, [t.bos_id, t.eos_id, t.pad_id]))
        n = min(len(eligible), max(1, round(self.mask_rate * len(eligible))))
        chosen = np.sort(rng.choice(eligible, n, replace=False))
        u = rng.random(n)
        random_ids = self.vocab.ordinary_ids[rng.integers(0, len(self.vocab.ordinary_ids), n)]
        replaced = np.where(u < self.mask_token_fraction, self.vocab.mask_id, tokens_T[chosen])
        is_random = (u >= self.mask_token_fraction) & (u < self.mask_token_fraction + self.random_token_fraction)
        return chosen, np.where(is_random, random_ids, replaced).astype(tokens_T.dtype)


def _positions(shape: tuple[int, int]) -> np.ndarray:
    return np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape).copy()


def span_counts(length: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a row of `length` tokens, T5's rule: round(length * density)
    noise tokens (at least 1, at most length - 1) in round(noise / mean) spans (at least 1, and no
    more than the non-noise tokens can separate)."""
    noise = min(max(round(length * noise_density), 1), length - 1)
    return noise, min(max(round(noise / mean_span_length), 1), length - noise)


def span_lengths(length: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
    """(S, T) of a row of `length` raw tokens: the encoder's non-noise tokens, a sentinel per span and
    EOS; the decoder's sentinel per span, the noise tokens and EOS."""
    noise, spans = span_counts(length, noise_density, mean_span_length)
    return length - noise + spans + 1, noise + spans + 1


def _segment_lengths(rng: np.random.Generator, n_items: int, n_segments: int) -> np.ndarray:
    """`n_segments` positive lengths summing to `n_items`, uniformly among such (T5's random_segmentation)."""
    cuts = np.sort(rng.choice(n_items - 1, n_segments - 1, replace=False)) + 1
    return np.diff(np.concatenate([[0], cuts, [n_items]]))


@dataclasses.dataclass(frozen=True)
class SpanCorruption:
    """T5's span corruption of windows of `window_len` raw tokens: noise spans and the text between
    them alternate, text first; the encoder reads the text with one sentinel per span and EOS, the
    decoder writes sentinel_i span_i ... EOS. Every row has the same counts, so no padding."""

    vocab: Vocab
    window_len: int  # raw tokens per row, the most whose encoder row fits data.seq_len (`raw_length`)
    noise_density: float
    mean_span_length: float
    document_mask = False
    bytes_per_token = staticmethod(_not_per_byte)

    @property
    def counts(self) -> tuple[int, int]:
        return span_counts(self.window_len, self.noise_density, self.mean_span_length)

    @property
    def encoder_len(self) -> int:
        """S: the text's non-noise tokens, a sentinel per span, EOS (at most data.seq_len)."""
        return span_lengths(self.window_len, self.noise_density, self.mean_span_length)[0]

    @property
    def decoder_len(self) -> int:
        """T: a sentinel per span, the noise tokens, EOS."""
        return span_lengths(self.window_len, self.noise_density, self.mean_span_length)[1]

    @property
    def lengths(self) -> tuple[int, int | None]:
        return self.decoder_len, self.encoder_len

    def batch(self, split, ids: np.ndarray, keys: np.ndarray) -> dict[str, np.ndarray]:
        tokens_BxL = split.batch(ids)["inputs"]
        rows = [self.corrupt_row(tokens_BxL[b], row_rng(key)) for b, key in enumerate(keys)]
        encoder_BxS, targets_BxT = (np.stack(r).astype(np.int32) for r in zip(*rows))
        inputs_BxT = np.concatenate(
            [np.full_like(targets_BxT[:, :1], self.vocab.tokenizer.bos_id), targets_BxT[:, :-1]], 1
        )
        return dict(
            encoder_inputs=encoder_BxS,
            inputs=inputs_BxT,
            targets=targets_BxT,
            weights=np.ones(targets_BxT.shape, np.float32),
            positions=_positions(targets_BxT.shape),
            segment_ids=np.ones(targets_BxT.shape, np.int32),
        )

    def noise_mask(self, rng: np.random.Generator) -> np.ndarray:
        """[L] bool: which tokens of a row are noise (the row starts with non-noise, ends with noise)."""
        noise, spans = self.counts
        noise_lengths = _segment_lengths(rng, noise, spans)
        text_lengths = _segment_lengths(rng, self.window_len - noise, spans)
        lengths = np.stack([text_lengths, noise_lengths], 1).reshape(-1)
        return np.repeat(np.arange(2 * spans) % 2 == 1, lengths)

    def corrupt_row(self, tokens_L: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(encoder row [S], decoder targets [T]) of one row of raw tokens."""
        is_noise = self.noise_mask(rng)
        sentinels = np.asarray(self.vocab.sentinel_ids, np.int64)
        eos = np.asarray([self.vocab.tokenizer.eos_id])
        return _replace_spans(tokens_L, is_noise, sentinels, eos), _replace_spans(tokens_L, ~is_noise, sentinels, eos)

    def restore(self, encoder_S: np.ndarray, targets_T: np.ndarray) -> np.ndarray:
        """The raw tokens back from an encoder row and its targets: each sentinel in the encoder row
        is replaced by what follows the same sentinel in the targets."""
        sentinels = set(self.vocab.sentinel_ids)
        spans: dict[int, list[int]] = {}
        for t in map(int, targets_T[:-1]):  # the targets start with a sentinel
            if t in sentinels:
                current = spans[t] = []
            else:
                current.append(t)
        out = [tok for t in map(int, encoder_S[:-1]) for tok in (spans[t] if t in sentinels else [t])]
        return np.asarray(out, np.int64)


def _replace_spans(tokens_L: np.ndarray, dropped: np.ndarray, sentinels: np.ndarray, eos: np.ndarray) -> np.ndarray:
    """`tokens_L` with each run of `dropped` tokens replaced by the next sentinel, then EOS."""
    starts = dropped & ~np.concatenate([[False], dropped[:-1]])
    out = np.where(starts, sentinels[np.cumsum(starts) - 1], tokens_L)
    return np.concatenate([out[~dropped | starts], eos])


def raw_length(seq_len: int, noise_density: float, mean_span_length: float) -> int:
    """The most raw tokens whose corrupted encoder row (text, sentinels, EOS) fits `seq_len` (T5's
    compute_input_and_target_lengths)."""
    length = seq_len - 1
    while span_lengths(length + 1, noise_density, mean_span_length)[0] <= seq_len:
        length += 1
    return length


def _padded(rows: list[np.ndarray], length: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """([B, length] the rows right-padded with `pad`, [B, length] 1 on real tokens, 0 on padding)."""
    out_BxL = np.full((len(rows), length), pad, np.int32)
    real_BxL = np.arange(length) < np.asarray([len(r) for r in rows])[:, None]
    out_BxL[real_BxL] = np.concatenate([np.asarray(r, np.int64) for r in rows]) if rows else []
    return out_BxL, real_BxL.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class PairObjective:
    """Input/target pairs: inputs cut to `input_len` tokens, targets to `target_len` - 1 (room for
    EOS). Pair rows carry no randomness: a pair's batch is a function of its tokens alone."""

    vocab: Vocab
    input_len: int  # data.seq_len
    target_len: int  # data.target_len (null: data.seq_len)
    window_len = 0  # reads pairs, not windows
    document_mask = False

    def bytes_per_token(self, meta: dict) -> float:
        """Per target token (EOS included): the loss covers the targets alone."""
        return meta["target_bytes"] / max(1, meta["target_tokens"])

    def overlong(self, input_lengths: np.ndarray, target_lengths: np.ndarray) -> tuple[int, int]:
        """How many of the inputs and of the targets of these lengths `cut` shortens."""
        return int(np.sum(input_lengths > self.input_len)), int(np.sum(target_lengths > self.target_len - 1))

    def cut(self, split, ids: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(inputs, targets + EOS) of the pairs `ids`, each cut to fit."""
        inputs, targets = split.pairs(ids)
        eos = [self.vocab.tokenizer.eos_id]
        return [i[: self.input_len] for i in inputs], [np.append(t[: self.target_len - 1], eos) for t in targets]


@dataclasses.dataclass(frozen=True)
class Seq2Seq(PairObjective):
    """Encoder-decoder with teacher forcing: the encoder reads the input (PAD after it, segment 0),
    the decoder reads BOS + target and predicts target + EOS; padding has segment 0 on both sides, so
    it only ever meets padding in cross-attention."""

    @property
    def lengths(self) -> tuple[int, int | None]:
        return self.target_len, self.input_len

    def batch(self, split, ids: np.ndarray, keys: np.ndarray) -> dict[str, np.ndarray]:
        t = self.vocab.tokenizer
        inputs, targets = self.cut(split, ids)
        encoder_BxS, encoder_segments_BxS = _padded(inputs, self.input_len, t.pad_id)
        targets_BxT, real_BxT = _padded(targets, self.target_len, t.pad_id)
        shifted_BxT, _ = _padded([np.append(t.bos_id, r[:-1]) for r in targets], self.target_len, t.pad_id)
        return dict(
            encoder_inputs=encoder_BxS,
            encoder_segment_ids=encoder_segments_BxS,
            encoder_positions=_positions(encoder_BxS.shape),
            inputs=shifted_BxT,
            targets=targets_BxT,
            weights=real_BxT.astype(np.float32),
            segment_ids=real_BxT,
            positions=_positions(targets_BxT.shape),
        )


@dataclasses.dataclass(frozen=True)
class PrefixLM(PairObjective):
    """Decoder-only on the same pairs: one LM row of input, BOS (the separator), target, EOS, padded
    to input_len + target_len; only the predictions of the target and its EOS are weighted."""

    @property
    def row_len(self) -> int:
        return self.input_len + self.target_len

    @property
    def lengths(self) -> tuple[int, int | None]:
        return self.row_len, None

    def batch(self, split, ids: np.ndarray, keys: np.ndarray) -> dict[str, np.ndarray]:
        t = self.vocab.tokenizer
        inputs, targets = self.cut(split, ids)
        rows = [np.concatenate([i, [t.bos_id], r]) for i, r in zip(inputs, targets)]
        inputs_BxR, real_BxR = _padded([r[:-1] for r in rows], self.row_len, t.pad_id)
        targets_BxR, _ = _padded([r[1:] for r in rows], self.row_len, t.pad_id)
        # the separator, at position len(input), predicts the target's first token
        separator_Bx1 = np.asarray([len(i) for i in inputs])[:, None]
        weights_BxR = (np.arange(self.row_len) >= separator_Bx1) & (real_BxR == 1)
        return dict(
            inputs=inputs_BxR,
            targets=targets_BxR,
            weights=weights_BxR.astype(np.float32),
            segment_ids=real_BxR,
            positions=_positions(inputs_BxR.shape),
        )


class ObjectiveError(ValueError):
    """A data config its objective cannot be made from (data.DataError carries it to the user)."""


def make_objective(cfg: DataConfig, tokenizer: Tokenizer) -> Objective:
    """The objective `cfg` trains (a DataConfig outside a run config, never resolved, trains causal)."""
    name = cfg.objective or "causal"
    if name == "causal":
        return CausalLM(Vocab(tokenizer), cfg.seq_len, cfg.document_mask)
    if name == "mlm":
        assert (
            cfg.mask_rate is not None and cfg.mask_token_fraction is not None and cfg.random_token_fraction is not None
        )
        return MaskedLM(
            Vocab(tokenizer, n_mask=1), cfg.seq_len, cfg.mask_rate, cfg.mask_token_fraction, cfg.random_token_fraction
        )
    target_len = cfg.target_len or cfg.seq_len
    if name in ("seq2seq", "prefix"):
        return (Seq2Seq if name == "seq2seq" else PrefixLM)(Vocab(tokenizer), cfg.seq_len, target_len)
    assert name == "span" and cfg.noise_density is not None and cfg.mean_span_length is not None
    length = raw_length(cfg.seq_len, cfg.noise_density, cfg.mean_span_length)
    if length < 2:
        raise ObjectiveError(f"data.seq_len: {cfg.seq_len} is too short for span corruption (at least 3)")
    _, spans = span_counts(length, cfg.noise_density, cfg.mean_span_length)
    return SpanCorruption(Vocab(tokenizer, n_sentinels=spans), length, cfg.noise_density, cfg.mean_span_length)


def _without_tokenizer(cfg: DataConfig) -> Objective:
    """`cfg`'s objective over a stand-in tokenizer: what it adds and how long its rows are do not
    depend on the tokenizer (for what is reckoned before the data is prepared, as preflight does)."""
    from transformer.data.tokenizer import ByteTokenizer

    return make_objective(cfg, ByteTokenizer())


def extra_ids(cfg: DataConfig) -> int:
    """How many ids `cfg`'s objective adds after any tokenizer's."""
    return _without_tokenizer(cfg).vocab.n_extra


def row_lengths(cfg: DataConfig) -> tuple[int, int | None]:
    """(tokens per row of `inputs`, per encoder row or None) of `cfg`'s batches."""
    return _without_tokenizer(cfg).lengths


def row_tokens(lengths: tuple[int, int | None]) -> int:
    """The tokens a row of these `lengths` holds: the trained stream's and an encoder's."""
    T, S = lengths
    return T + (S or 0)
