"""Tokenizers: `byte` (256 byte values + BOS/EOS/PAD), a byte-level `bpe` trained on the training
split, or `pretrained:PATH` (a tokenizer.json, or a directory holding one).

Every tokenizer exposes the same small surface: `vocab_size`, `bos_id`, `eos_id`, `pad_id`,
`encode_batch`, `decode`, and a `fingerprint` that changes whenever the ids it produces could.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

SPECIALS = ("<bos>", "<eos>", "<pad>")
TOKENIZER_CONFIG = "tokenizer_config.json"  # beside a tokenizer.json: its special tokens (Hugging Face)


class TokenizerError(ValueError):
    """A tokenizer that cannot be built or loaded (a user mistake: exit 2)."""


class ByteTokenizer:
    """UTF-8 bytes are the ids 0..255; BOS, EOS and PAD follow."""

    vocab_size = 259
    bos_id, eos_id, pad_id = 256, 257, 258
    mask_id = None  # an objective that masks adds its own id
    fingerprint = "byte-v1"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # surrogateescape: text read with errors='surrogateescape' gets its original bytes back
        return [np.frombuffer(t.encode("utf-8", "surrogateescape"), np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def files(self) -> dict[str, str]:
        """The same ids as a Hugging Face tokenizer (a byte-level BPE without merges), for export."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = {char: byte for byte, char in enumerate(_byte_chars())}
        tok = Tokenizer(models.BPE(vocab, []))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(list(SPECIALS))  # 256, 257, 258
        return HFTokenizer(tok.to_str()).files()


def _byte_chars() -> list[str]:
    """The printable character byte-level BPE stands each byte for (GPT-2's bytes_to_unicode)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(shifted)) for b in range(256)]


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer; BOS/EOS/PAD are the tokens `specials` names: those a
    model directory's tokenizer_config.json gives, else <bos>/<eos>/<pad> (added at the end of the
    vocabulary when it has none). `mask`: its mask token (BERT's [MASK]), which a masking objective
    then uses instead of adding one, where the vocabulary has it."""

    def __init__(self, json_text: str, specials: tuple[str, str, str] = SPECIALS, mask: str | None = None):
        from tokenizers import Tokenizer

        self.json_text = json_text
        self.specials = specials
        self.mask = mask
        self.tok = Tokenizer.from_str(json_text)
        self.mask_id: int | None = None if mask is None else self.tok.token_to_id(mask)
        ids = [self.tok.token_to_id(s) for s in specials]
        if None in ids:
            self.tok.add_special_tokens([s for s, i in zip(specials, ids) if i is None])
            ids = [self.tok.token_to_id(s) for s in specials]
        bos, eos, pad = ids
        assert bos is not None and eos is not None and pad is not None  # added just above where missing
        self.bos_id, self.eos_id, self.pad_id = bos, eos, pad
        # document text is only text: a literal "<eos>" in it must not become a document boundary
        self.tok.encode_special_tokens = True
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        # hf2: ids of text that spells a special token changed (it used to give the special id)
        named = json_text if specials == SPECIALS else json.dumps([json_text, specials])
        self.fingerprint = "hf2-" + hashlib.sha256(named.encode()).hexdigest()[:16]

    def __getstate__(self):  # worker processes rebuild it whole (encode_special_tokens is not pickled)
        return {"json_text": self.json_text, "specials": self.specials, "mask": self.mask}

    def __setstate__(self, state):
        self.__init__(state["json_text"], tuple(state.get("specials", SPECIALS)), state.get("mask"))

    def files(self) -> dict[str, str]:
        """The files that hold it in a Hugging Face model directory: tokenizer.json, and the
        tokenizer_config.json naming its special tokens."""
        bos, eos, pad = self.specials
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": pad}
        if self.mask is not None and self.mask_id is not None:
            config["mask_token"] = self.mask
        # the config first: a run directory holding tokenizer.json is taken to hold both
        return {TOKENIZER_CONFIG: json.dumps(config, indent=2) + "\n", "tokenizer.json": self.json_text}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        try:
            encodings = self.tok.encode_batch(texts, add_special_tokens=False)
        except TypeError:  # the library takes valid Unicode only; its TypeError does not say which text
            bad = next((t for t in texts if not _is_utf8(t)), None)
            if bad is None:
                raise
            raise TokenizerError(
                f"text {bad[:30]!r} holds characters that are not valid UTF-8 (undecodable bytes?); "
                "the tokenizer cannot take them"
            ) from None
        return [np.asarray(e.ids, np.int64) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, path: Path) -> None:
        path.write_text(self.json_text)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates, e.g. from bytes decoded with errors='surrogateescape'
        return False
    return True


# What a run's data pipeline, trainer and evaluator hold: either kind, used through the surface above.
Tokenizer = ByteTokenizer | HFTokenizer


def train_bpe(texts: Iterator[str], vocab_size: int) -> HFTokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation) trained on `texts`; deterministic for a given input."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIALS):
        raise TokenizerError(
            f"data.vocab_size: a byte-level BPE needs at least {256 + len(SPECIALS)} ids, got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok.to_str())


def _named_specials(config: Path) -> tuple[tuple[str, str, str], str | None]:
    """(BOS, EOS and PAD, the mask token) as a tokenizer_config.json names them, or ours: an encoder's
    tokenizer (BERT's) names no BOS or EOS, and its [CLS] and [SEP] take their places around a text;
    PAD and BOS default to EOS."""
    if not config.is_file():
        return SPECIALS, None
    named = json.loads(config.read_text())

    def token(key: str) -> str | None:
        value = named.get(key)
        return value.get("content") if isinstance(value, dict) else value

    eos, mask = token("eos_token") or token("sep_token"), token("mask_token")
    if eos is None:
        return SPECIALS, mask
    return (token("bos_token") or token("cls_token") or eos, eos, token("pad_token") or eos), mask


def load_pretrained(path: str) -> HFTokenizer:
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise TokenizerError(f"data.tokenizer: no tokenizer.json at {p}")
    try:
        text = p.read_text()
        json.loads(text)
        return HFTokenizer(text, *_named_specials(p.parent / TOKENIZER_CONFIG))
    except Exception as e:  # a broken file: say which, not where inside the library it broke
        raise TokenizerError(f"data.tokenizer: cannot load {p}: {str(e).splitlines()[0]}") from None
