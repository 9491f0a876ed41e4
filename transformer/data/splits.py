"""How a source's documents are divided between training and validation: the source's own split
(`SOURCE`), a content hash (`HASH`), the tail of each document (`POSITION`) or `data.val_source`
(`VAL_SOURCE`); text rows and input/target pairs alike. The rule chosen is recorded in the token cache.

The fingerprints the cache is keyed by live here too (`source_fingerprint`, `val_fingerprint`): a
Hugging Face dataset's is that of its loaded splits."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import sys

import numpy as np

from transformer.config import DataConfig, DataSource
from transformer.data.sources import (
    DataError,
    documents,
    files_fingerprint,
    naming,
    pair_fields,
    source_files,
    stdlib_files,
)

# How a source's documents are divided between training and validation (the token cache records it):
SOURCE = "source"  # the source's own validation split (data.val_split)
HASH = "hash"  # by content hash, val_fraction of the documents
POSITION = "position"  # the last val_fraction of each document's characters
VAL_SOURCE = "val_source"  # data.val_source validates; the training source is all training
HASH_TOLERANCE = 4.0  # a hash split whose val share of the text is off by more than this factor is not used

# More rows than this without text (missing or null) is the wrong data.text_field, not a few gaps.
MAX_MISSING_TEXT = 0.5


def _hash_fraction(text: str) -> float:
    return int.from_bytes(hashlib.sha1(text.encode("utf-8", "surrogateescape")).digest()[:8], "big") / 2**64


def load_splits(cfg: DataConfig) -> dict:
    """{'train': Dataset, 'val': Dataset}, each with the text in column cfg.text_field; rows without
    text (missing or null) are left out (see `rows_without_text`)."""
    return _loaded(cfg)[0]


def rows_without_text(cfg: DataConfig) -> tuple[int, int]:
    """(rows left out for having no text, rows the source holds)."""
    return _loaded(cfg)[1]


def split_rule(cfg: DataConfig) -> str:
    """How the source's documents were divided between training and validation: SOURCE, HASH,
    POSITION or VAL_SOURCE (see `_divide`)."""
    return _loaded(cfg)[2]


def _loaded(cfg: DataConfig) -> tuple[dict, tuple[int, int], str]:
    # keyed by the files' fingerprints too: edited files are read again, not served from memory
    fingerprint = source_fingerprint(cfg) if cfg.source_spec.kind == "files" else ""
    if cfg.val_source is not None and DataSource.parse(cfg.val_source).kind == "files":
        fingerprint += "+" + val_fingerprint(cfg)
    return (_load_pair_splits if cfg.pairs else _load_splits)(cfg, fingerprint)


def _text_rows(cfg: DataConfig, split, name: str, key: str = "text_field", field: str | None = None):
    """`split` without its rows that have no text in `field` (data.<key>'s), and how many went. A
    value that is not text (a number) is refused rather than turned into text, and so is a field
    mostly missing: both say that data.<key> names the wrong column."""
    import pyarrow as pa

    field, total = field or getattr(cfg, key), len(split)
    column = split.with_format("arrow")[field]
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        missing, not_text = column.null_count, 0
        keep = np.flatnonzero(column.is_valid().to_numpy(zero_copy_only=False)) if missing else None
    else:  # numbers, nothing at all, or values of several kinds (datasets' Json feature): look at each
        values = split[field]
        missing = sum(v is None for v in values)
        not_text = sum(v is not None and not isinstance(v, str) for v in values)
        keep = np.asarray([i for i, v in enumerate(values) if isinstance(v, str)], np.int64)
    where = f"of the {name} split of {cfg.source}"
    if not_text:
        raise DataError(
            f"data.{key}: {field!r} holds values that are not text (numbers or other values) in {not_text} "
            f"of {total} rows {where}; make them strings in the source, or name the text column in data.{key}"
        )
    if missing > MAX_MISSING_TEXT * total:
        raise DataError(
            f"data.{key}: {field!r} is missing or null in {missing} of {total} rows {where}; is it the "
            f"column that holds the text? (columns: {', '.join(split.column_names)})"
        )
    return (split if keep is None or len(keep) == total else split.select(keep)), missing


def _as_dict(loaded):
    import datasets

    return datasets.DatasetDict({"train": loaded}) if isinstance(loaded, datasets.Dataset) else loaded


def _check_text_field(cfg: DataConfig, split) -> None:
    if cfg.text_field not in split.column_names:
        raise DataError(
            f"data.text_field: {cfg.text_field!r} is not a column of {cfg.source} "
            f"(columns: {', '.join(split.column_names)})"
        )


@functools.lru_cache(maxsize=4)
def _load_splits(cfg: DataConfig, fingerprint: str) -> tuple[dict, tuple[int, int], str]:
    loaded = _as_dict(documents(cfg))
    if cfg.train_split not in loaded:
        raise DataError(f"data.train_split: {cfg.train_split!r} is not a split of {cfg.source} ({', '.join(loaded)})")
    _check_text_field(cfg, loaded[cfg.train_split])
    rows = len(loaded[cfg.train_split])
    train, dropped = _text_rows(cfg, loaded[cfg.train_split], cfg.train_split)
    train = _separate(cfg, train)
    if cfg.val_source is not None:  # the training source is all training
        val = _val_source_documents(cfg)
        _check_splits(cfg, train, val, VAL_SOURCE)
        return {"train": train, "val": val}, (dropped, rows), VAL_SOURCE
    if cfg.val_split in loaded:
        val, dropped_val = _text_rows(cfg, loaded[cfg.val_split], cfg.val_split)
        rows, dropped = rows + len(loaded[cfg.val_split]), dropped + dropped_val
        val = _separate(cfg, val)
        _check_splits(cfg, train, val, SOURCE)
        return {"train": train, "val": val}, (dropped, rows), SOURCE
    train, val, rule = _divide(cfg, train)
    return {"train": train, "val": val}, (dropped, rows), rule


def _pair_rows(cfg: DataConfig, split, name: str):
    """`split` with the rows that hold both an input and a target, and how many went."""
    dropped = 0
    for key, field in zip(("input_field", "target_field"), pair_fields(cfg)):
        if field not in split.column_names:
            raise DataError(
                f"data.{key}: {field!r} is not a field of {cfg.source} (fields: {', '.join(split.column_names)})"
            )
        split, missing = _text_rows(cfg, split, name, key, field)
        dropped += missing
    return split, dropped


@functools.lru_cache(maxsize=4)
def _load_pair_splits(cfg: DataConfig, fingerprint: str) -> tuple[dict, tuple[int, int], str]:
    """As `_load_splits` for input/target pairs: the source's validation split, else a split by the
    input's content hash (a pair and any pair with the same input on one side only)."""
    for key in ("val_source", "document_separator"):
        if getattr(cfg, key) is not None:
            raise DataError(f"data.{key}: applies to text sources, and {cfg.source} gives input/target pairs")
    loaded = _as_dict(documents(cfg))
    if cfg.train_split not in loaded:
        raise DataError(f"data.train_split: {cfg.train_split!r} is not a split of {cfg.source} ({', '.join(loaded)})")
    rows = len(loaded[cfg.train_split])
    train, dropped = _pair_rows(cfg, loaded[cfg.train_split], cfg.train_split)
    if cfg.val_split in loaded:
        val, dropped_val = _pair_rows(cfg, loaded[cfg.val_split], cfg.val_split)
        _check_splits(cfg, train, val, SOURCE)
        return {"train": train, "val": val}, (dropped + dropped_val, rows + len(loaded[cfg.val_split])), SOURCE
    train, val, _ = _hash_split(dataclasses.replace(cfg, text_field=pair_fields(cfg)[0]), train)
    _check_splits(cfg, train, val, HASH)
    return {"train": train, "val": val}, (dropped, rows), HASH


def _separate(cfg: DataConfig, split):
    """Each document split on data.document_separator into documents; pieces that are empty or only
    whitespace are left out, the others kept verbatim. Only the text column is kept."""
    sep, field = cfg.document_separator, cfg.text_field
    if sep is None:
        return split

    def pieces(batch):
        return {field: [p for text in batch[field] for p in text.split(sep) if p.strip()]}

    return split.map(pieces, batched=True, remove_columns=split.column_names, keep_in_memory=True)


def _divide(cfg: DataConfig, docs):
    """(train, val, rule) for a source without a validation split of its own. By content hash
    (a document, and any copy of it, on one side only) when that gives each side a share of the
    characters within a factor HASH_TOLERANCE of the one asked for (val_fraction; 1 - val_fraction);
    else, as with one or a few large documents, by position: the last val_fraction of each
    document's characters is validation, the rest training. val_fraction 0 keeps the hash rule (and
    its error: nothing to validate on)."""
    train, val, share = _hash_split(cfg, docs)
    f = cfg.val_fraction
    balanced = len(train) and len(val) and f / HASH_TOLERANCE <= share <= f * HASH_TOLERANCE
    if f == 0 or (balanced and 1 - share >= (1 - f) / HASH_TOLERANCE):
        _check_splits(cfg, train, val, HASH)
        return train, val, HASH
    train, val = _position_split(cfg, docs)
    _check_splits(cfg, train, val, POSITION)
    return train, val, POSITION


def _hash_split(cfg: DataConfig, train):
    """(train, val, val's share of the characters) split by content hash."""
    fraction = cfg.val_fraction
    texts = [t if isinstance(t, str) else "" for t in train[cfg.text_field]]
    is_val = [_hash_fraction(t) < fraction for t in texts]
    val = train.select([i for i, v in enumerate(is_val) if v])
    total = sum(len(t) for t in texts)
    share = sum(len(t) for t, v in zip(texts, is_val) if v) / total if total else 0.0
    return train.select([i for i, v in enumerate(is_val) if not v]), val, share


def _position_split(cfg: DataConfig, docs):
    """(train, val): each document cut in two, its last val_fraction of characters (rounded) to
    validation. Empty pieces are left out. Only the text column is kept."""
    import datasets

    heads, tails = [], []
    for text in docs[cfg.text_field]:
        cut = len(text) - round(len(text) * cfg.val_fraction)
        heads.append(text[:cut])
        tails.append(text[cut:])
    field = cfg.text_field
    return tuple(datasets.Dataset.from_dict({field: [p for p in ps if p]}) for ps in (heads, tails))


def _check_splits(cfg: DataConfig, train, val, rule: str) -> None:
    """Both splits must hold documents; say whether val_fraction, val_source or the source is to blame."""
    total = len(train) + len(val)
    for name, split in (("train", train), ("val", val)):
        if len(split) == 0 and rule == HASH and total > 0:
            raise DataError(
                f"data.val_fraction: {cfg.val_fraction} leaves the {name} split of {cfg.source} with none of its "
                f"{total} documents (or give the source a {cfg.val_split!r} split)"
            )
        if len(split) == 0 and rule == POSITION and total > 0:
            raise DataError(
                f"data.val_fraction: {cfg.val_fraction} of each document of {cfg.source} leaves its {name} split "
                "empty (its documents are too short): raise data.val_fraction or give the source a validation split"
            )
        if len(split) == 0 and rule == VAL_SOURCE and name == "val":
            raise DataError(f"data.val_source: {cfg.val_source} has no documents")
        if len(split) == 0:
            raise DataError(f"data.source: the {name} split of {cfg.source} has no documents")


def _naming_val_source():
    """Errors about the validation source's contents name data.val_source, not data.source."""
    return naming("data.val_source")


def _val_config(cfg: DataConfig) -> DataConfig:
    assert cfg.val_source is not None
    return dataclasses.replace(cfg, source=cfg.val_source, val_source=None)


def _val_source_documents(cfg: DataConfig):
    """The documents of data.val_source: its validation split if it has one, else its training split."""
    vcfg = _val_config(cfg)
    with _naming_val_source():
        loaded = _as_dict(documents(vcfg))
        name = next((n for n in (cfg.val_split, cfg.train_split) if n in loaded), None)
        if name is None:
            raise DataError(
                f"data.val_source: {cfg.val_source} has neither a {cfg.val_split!r} nor a {cfg.train_split!r} split "
                f"({', '.join(loaded)})"
            )
        _check_text_field(vcfg, loaded[name])
        val, _ = _text_rows(vcfg, loaded[name], name)
        return _separate(cfg, val)


def val_fingerprint(cfg: DataConfig) -> str:
    vcfg = _val_config(cfg)
    with _naming_val_source():
        if vcfg.source_spec.kind == "hf":
            return "hf-" + "-".join(ds._fingerprint for ds in _as_dict(documents(vcfg)).values())
        return source_fingerprint(vcfg)


def source_fingerprint(cfg: DataConfig) -> str:
    """Cheap identity of the source's contents: changes when the documents could have changed."""
    source = cfg.source_spec
    if source.recall is not None:
        return "recall-v1-" + "-".join(f"{k}{v}" for k, v in dataclasses.asdict(source.recall).items())
    if source.seq2seq is not None:
        return "seq2seq-v1-" + "-".join(f"{k}{v}" for k, v in dataclasses.asdict(source.seq2seq).items())
    if source.kind == "builtin":
        root, files = stdlib_files()
        return f"stdlib-{sys.version_info.major}.{sys.version_info.minor}-{files_fingerprint(files, root)}"
    if source.kind == "files":
        return f"files-{files_fingerprint(source_files(source))}"
    return "hf-" + "-".join(ds._fingerprint for ds in load_splits(cfg).values())
