"""The tokenizer a run uses (byte, pretrained, or a BPE trained on the training split and kept in
the cache) and the memory-mapped token cache.

Layout of a token cache (one directory per hash of source, tokenizer and split rules):
    train.bin, val.bin   the documents of each split, each followed by EOS, as uint16/uint32
    meta.json            counts and dtypes; written last, so its presence marks a complete cache
    tokenizer.json       for a BPE trained on the training split (reused by later runs)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from transformer.config import DataConfig
from transformer.data.sources import DataError, naming, pair_fields
from transformer.data.splits import (
    HASH,
    POSITION,
    load_splits,
    rows_without_text,
    source_fingerprint,
    split_rule,
    val_fingerprint,
)
from transformer.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerError, load_pretrained, train_bpe
from transformer.errors import first_line
from transformer.rundir import atomic_write

# 2: rows without text are left out (version 1 kept them as empty documents)
CACHE_VERSION = 2

TOKENIZER_FILE = "tokenizer.json"
BPE_TRAIN_BYTES = 64 << 20  # a BPE is trained on at most this much of the training split


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "transformer-ablations" / "tokens"


def cache_directory(cfg: DataConfig) -> Path:
    """data.cache_dir (or the default), created if missing: a file there, or a directory that cannot
    be created, is one line naming data.cache_dir before any work."""
    path = Path(os.path.expanduser(cfg.cache_dir)) if cfg.cache_dir else default_cache_dir()
    if path.exists() and not path.is_dir():
        raise DataError(f"data.cache_dir: {path} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"data.cache_dir: cannot create {path}: {e.strerror or first_line(e)}") from None
    return path


def _check_writable(cache_dir: Path) -> None:
    """Called before anything is written into the cache (so before tokenising, which takes a while).
    A probe file rather than os.access, which answers yes to root whatever the mount allows; a
    read-only cache holding everything a run needs is never probed."""
    try:
        fd, name = tempfile.mkstemp(prefix=".probe-", dir=cache_dir)
    except OSError as e:
        raise DataError(
            f"data.cache_dir: {cache_dir} is not writable ({e.strerror or first_line(e)}); "
            "give data.cache_dir a directory this user may write"
        ) from None
    os.close(fd)
    os.unlink(name)


def make_tokenizer(cfg: DataConfig, workdir: Path | None, cache_dir: Path) -> Tokenizer:
    """The run's tokenizer. A run directory's own tokenizer.json wins (resume, eval); a BPE is trained
    once per (source, vocab size, split rules) and kept in the cache for later runs."""
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if workdir is not None and (workdir / TOKENIZER_FILE).is_file():
        try:
            tok = load_pretrained(str(workdir / TOKENIZER_FILE))
        except TokenizerError as e:  # a damaged run directory: say which file, exit 2
            raise DataError(str(e)) from None
    elif cfg.tokenizer.startswith("pretrained:"):
        try:
            tok = load_pretrained(cfg.tokenizer.partition(":")[2])
        except TokenizerError as e:
            raise DataError(str(e)) from None
    elif cfg.mixture:
        tok = _mixture_bpe(cfg, cache_dir)
    else:
        source = source_fingerprint(cfg)
        key = _cached_key(
            cfg,
            lambda rules: _digest({"bpe": cfg.vocab_size, "source": source, "split": rules}),
            lambda key: (cache_dir / f"bpe-{key}.json").is_file(),
        )
        saved = cache_dir / f"bpe-{key}.json"
        if saved.is_file():
            tok = HFTokenizer(saved.read_text())
        else:
            _check_writable(cache_dir)
            train = load_splits(cfg)["train"]
            # a pair source's BPE learns from its inputs and its targets
            texts = (t for field in (pair_fields(cfg) if cfg.pairs else (cfg.text_field,)) for t in train[field])
            try:
                tok = train_bpe(_prefix(texts, BPE_TRAIN_BYTES), cfg.vocab_size)
            except TokenizerError as e:
                raise DataError(str(e)) from None
            atomic_write(saved, tok.json_text)
    if workdir is not None and not (workdir / TOKENIZER_FILE).is_file() and isinstance(tok, HFTokenizer):
        workdir.mkdir(parents=True, exist_ok=True)
        for name, text in tok.files().items():  # the config too: a pretrained one's special tokens
            atomic_write(workdir / name, text)
    return tok


def _mixture_bpe(cfg: DataConfig, cache_dir: Path) -> HFTokenizer:
    """One BPE for all the sources of a mixture, trained on their training splits together, plain
    (not weighted): each source gives up to an equal share of BPE_TRAIN_BYTES, so a source with a
    small weight still has its words in the vocabulary. Kept in the cache like a single source's."""
    configs = [cfg.mixture_source(i) for i in range(len(cfg.mixture))]
    sources = []
    for i, scfg in enumerate(configs):
        with naming(f"data.mixture[{i}].source"):
            # the split rule is a function of the contents, which the fingerprint pins
            sources.append([source_fingerprint(scfg), _split_rules(scfg)])
    saved = cache_dir / f"bpe-{_digest({'bpe': cfg.vocab_size, 'mixture': sources})}.json"
    if saved.is_file():
        return HFTokenizer(saved.read_text())
    _check_writable(cache_dir)
    budget = BPE_TRAIN_BYTES // len(configs)
    texts = []
    for i, scfg in enumerate(configs):
        with naming(f"data.mixture[{i}].source"):
            texts.append(_prefix(load_splits(scfg)["train"][scfg.text_field], budget))
    try:
        tok = train_bpe((t for part in texts for t in part), cfg.vocab_size)
    except TokenizerError as e:
        raise DataError(str(e)) from None
    atomic_write(saved, tok.json_text)
    return tok


def _prefix(texts, budget: int):
    for text in texts:
        if budget <= 0:
            return
        if isinstance(text, str):
            budget -= len(text)
            yield text


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


def _split_rules(cfg: DataConfig, rule: str = HASH) -> dict:
    rules: dict = dict(
        text_field=cfg.text_field, train=cfg.train_split, val=cfg.val_split, val_fraction=cfg.val_fraction
    )
    # only what differs from the defaults is added, so the caches made before these options keep their keys
    if cfg.document_separator is not None:
        rules["separator"] = cfg.document_separator
    if cfg.val_source is not None:
        rules["val_source"] = val_fingerprint(cfg)
    if rule == POSITION:
        rules["rule"] = POSITION
    if cfg.pairs:
        rules["pairs"] = list(pair_fields(cfg))
    return rules


def _cached_key(cfg: DataConfig, make: Callable[[dict], str], complete: Callable[[str], bool]) -> str:
    """The key `make(split rules)` of this config's cached product (token cache, BPE). The split
    rule is a function of the source's contents, which the source fingerprint in every key pins, so
    a complete product under either rule's key is this config's, found without reading the source."""
    if cfg.val_source is None:
        for rule in (HASH, POSITION):
            if complete(key := make(_split_rules(cfg, rule))):
                return key
    return make(_split_rules(cfg, split_rule(cfg)))


def cache_key(cfg: DataConfig, tokenizer: Tokenizer, rule: str | None = None) -> str:
    """The token cache's key; `rule` (see `split_rule`) is found by reading the source if not given."""
    rules = _split_rules(cfg, split_rule(cfg) if rule is None else rule)
    return _token_key(source_fingerprint(cfg), tokenizer, rules)


def _token_key(source: str, tokenizer: Tokenizer, rules: dict) -> str:
    return _digest(dict(version=CACHE_VERSION, source=source, tokenizer=tokenizer.fingerprint, split=rules))


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _is_complete(path: Path) -> bool:
    try:
        meta = json.loads((path / "meta.json").read_text())
        itemsize = np.dtype(meta["dtype"]).itemsize
        sizes = {f"{s}.bin": meta[s]["tokens"] * itemsize for s in ("train", "val")} | meta.get("files", {})
        return all((path / name).stat().st_size == size for name, size in sizes.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _clean_partials(cache_dir: Path, key: str) -> None:
    """Remove the leftovers of interrupted builds of this key whose process is gone."""
    for partial in cache_dir.glob(f"{key}.partial-*"):
        pid = int(partial.name.rsplit("-", 2)[-2]) if partial.name.count("-") >= 2 else 0
        try:
            os.kill(pid, 0)
            alive = pid != 0
        except (OSError, ValueError):
            alive = False
        if not alive:
            shutil.rmtree(partial, ignore_errors=True)


def build_cache(cfg: DataConfig, tokenizer: Tokenizer, cache_dir: Path, log: Callable[[str], None] = print) -> Path:
    """Tokenise both splits into `cache_dir/<key>/` unless a complete cache is there already."""
    source = source_fingerprint(cfg)
    key = _cached_key(
        cfg, lambda rules: _token_key(source, tokenizer, rules), lambda key: _is_complete(cache_dir / key)
    )
    final = cache_dir / key
    if _is_complete(final):
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    _check_writable(cache_dir)
    _clean_partials(cache_dir, key)
    if final.exists():  # incomplete or damaged: never trust it
        shutil.rmtree(final, ignore_errors=True)
    partial = cache_dir / f"{key}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    log(f"tokenising {cfg.source} with the {cfg.tokenizer} tokenizer into {final}")
    dtype = token_dtype(tokenizer.vocab_size)
    meta = dict(
        version=CACHE_VERSION,
        source=cfg.source,
        tokenizer=tokenizer.fingerprint,
        dtype=dtype.name,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
    )
    try:
        for name, split in load_splits(cfg).items():
            if cfg.pairs:
                meta[name] = _tokenise_pairs(cfg, split, tokenizer, dtype, partial / name)
            else:
                meta[name] = _tokenise_split(split, cfg.text_field, tokenizer, dtype, partial / f"{name}.bin")
        meta["files"] = {f.name: f.stat().st_size for f in partial.iterdir()}
        meta["rows_without_text"], meta["rows"] = rows_without_text(cfg)
        meta["split"] = split_rule(cfg)
        (partial / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(partial, final)
        except OSError:  # another process finished the same cache first
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return final


def _tokenise_pairs(cfg: DataConfig, split, tokenizer: Tokenizer, dtype: np.dtype, stem: Path) -> dict:
    """A split's inputs and targets as two ragged streams, each document followed by EOS, with the
    offsets of the documents (<stem>.bin, <stem>.offsets, <stem>.target.bin, <stem>.target.offsets)."""
    field, target = pair_fields(cfg)
    meta = _tokenise_split(split, field, tokenizer, dtype, stem.with_suffix(".bin"), stem.with_suffix(".offsets"))
    out = _tokenise_split(
        split, target, tokenizer, dtype, stem.with_suffix(".target.bin"), stem.with_suffix(".target.offsets")
    )
    return meta | {"target_tokens": out["tokens"], "target_bytes": out["bytes"]}


def _tokenise_split(
    split, text_field: str, tokenizer: Tokenizer, dtype: np.dtype, path: Path, offsets: Path | None = None
) -> dict:
    """Write the split's documents, each followed by EOS, to `path` (and where each starts, int64,
    to `offsets` when given): its counts of documents, tokens and bytes."""
    eos = tokenizer.eos_id

    def encode(batch):
        texts = batch[text_field]
        ids = tokenizer.encode_batch([t if isinstance(t, str) else "" for t in texts])
        return {
            "ids": [np.append(i.astype(dtype), np.asarray(eos, dtype)) for i in ids],
            "n_bytes": [len(t.encode("utf-8", "surrogateescape")) if isinstance(t, str) else 0 for t in texts],
        }

    # One process: forking a process that already runs JAX's threads can deadlock. The cores are
    # used all the same: the BPE encodes each batch on all of them (Rust threads), and the byte
    # tokenizer is a memory copy.
    encoded = split.map(
        encode,
        batched=True,
        batch_size=1024,
        remove_columns=split.column_names,
        desc=f"tokenising {path.stem}",
        new_fingerprint=None,
        keep_in_memory=True,
    )
    n_tokens, lengths = 0, [np.zeros(1, np.int64)]
    with open(path, "wb") as out:
        for chunk in encoded.data.column("ids").chunks:
            values = chunk.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
            out.write(values.tobytes())
            n_tokens += len(values)
            lengths.append(np.diff(chunk.offsets.to_numpy()))
    if offsets is not None:
        offsets.write_bytes(np.cumsum(np.concatenate(lengths), dtype=np.int64).tobytes())
    n_bytes = int(np.sum(encoded.data.column("n_bytes").to_numpy()))
    return dict(documents=len(split), tokens=n_tokens, bytes=n_bytes)
