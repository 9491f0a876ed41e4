"""Corpora, tokenisation into a memory-mapped cache, packing, and step-indexed batches.

Batch i of a run is a pure function of (data config, seed, i): window ids come from a seeded
permutation per epoch, so resuming needs no iterator state and every process can compute its own
rows of any global batch without talking to the others.

Layout of a token cache (one directory per hash of source, tokenizer and split rules):
    train.bin, val.bin   the documents of each split, each followed by EOS, as uint16/uint32
    meta.json            counts and dtypes; written last, so its presence marks a complete cache
    tokenizer.json       for a BPE trained on the training split (reused by later runs)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob as globlib
import hashlib
import json
import os
import shutil
import socket
import sys
import sysconfig
import tempfile
import threading
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from transformer.config import DataConfig, DataSource
from transformer.data.objectives import (
    Objective,
    ObjectiveError,
    PairObjective,
    Vocab,
    make_objective,
    train_keys,
    val_keys,
)
from transformer.data.objectives import document_layout as document_layout
from transformer.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerError, load_pretrained, train_bpe
from transformer.errors import first_line
from transformer.rundir import atomic_write
from transformer.synthetic import RecallTask, Seq2seqTask

# 2: rows without text are left out (version 1 kept them as empty documents)
CACHE_VERSION = 2
# How a source's documents are divided between training and validation (the token cache records it):
SOURCE = "source"  # the source's own validation split (data.val_split)
HASH = "hash"  # by content hash, val_fraction of the documents
POSITION = "position"  # the last val_fraction of each document's characters
VAL_SOURCE = "val_source"  # data.val_source validates; the training source is all training
HASH_TOLERANCE = 4.0  # a hash split whose val share of the text is off by more than this factor is not used
REPEAT_WARNING = 10.0  # a run that would see its training split more often than this says so
TOKENIZER_FILE = "tokenizer.json"
BPE_TRAIN_BYTES = 64 << 20  # a BPE is trained on at most this much of the training split
# More rows than this without text (missing or null) is the wrong data.text_field, not a few gaps.
MAX_MISSING_TEXT = 0.5
HUB_PROBE_SECONDS = 3.0  # how long the hub may take to accept a connection before it counts as unreachable
OFFLINE_HINT = (
    "to work offline, use data.source=files:PATH with local files or a directory written by datasets' save_to_disk"
)


class DataError(ValueError):
    """A user mistake about the data (exit 2): empty or missing source, bad field, too small a corpus."""


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


@contextlib.contextmanager
def _quiet_datasets():
    """datasets' progress bars and log lines off while a source is read: its errors (logged before
    they are raised, with bars drawn half-way) would break the one-line rule, and reading local files
    is quick. Tokenising runs outside and keeps its progress bar; the caller's settings come back."""
    import datasets
    from datasets.utils import logging as datasets_logging

    bars, level = datasets.is_progress_bar_enabled(), datasets_logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    try:
        yield
    finally:
        datasets_logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def _reason(e: BaseException) -> str:
    """The first line of `e`, followed by that of its root cause when datasets wrapped one."""
    root = e
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__  # type: ignore[assignment]
    top, bottom = first_line(e), first_line(root)
    return top if root is e or bottom in top else f"{top}: {bottom}"


# --- sources -------------------------------------------------------------------------------------


def _stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))
    return root, files


def _glob_files(pattern: str) -> list[Path]:
    return sorted(Path(p) for p in globlib.glob(os.path.expanduser(pattern), recursive=True) if Path(p).is_file())


def _raise_denied(e: OSError) -> None:
    if isinstance(e, PermissionError):
        raise e  # other errors (a directory removed while walking) leave a gap, as glob does


def _walk_files(root: Path) -> list[Path]:
    """Every file under `root`. A directory that cannot be read is an error, not a silent gap."""
    files: list[Path] = []
    for dirpath, _, names in os.walk(root, onerror=_raise_denied, followlinks=True):
        files += [Path(dirpath) / name for name in names]
    return sorted(f for f in files if f.is_file())


def _denied_directory(pattern: str) -> str | None:
    """The first directory a glob would have read and may not (glob skips them silently), or None.
    Walks only as deep as the pattern reaches, from its literal prefix."""
    parts = Path(os.path.expanduser(pattern)).parts
    literal = next((i for i, part in enumerate(parts) if globlib.has_magic(part)), len(parts))
    root = Path(*parts[:literal]) if literal else Path(".")
    if literal == len(parts):  # no wildcard: only the path's own directory is read
        root = root.parent
    depth = None if "**" in parts else max(0, len(parts) - literal - 1)
    try:
        for dirpath, dirnames, _ in os.walk(root, onerror=_raise_denied):
            if depth is not None and len(Path(dirpath).relative_to(root).parts) >= depth:
                dirnames.clear()
    except PermissionError as e:
        return str(e.filename)
    return None


def _files_fingerprint(files: list[Path], root: Path | None = None) -> str:
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root) if root else p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _source_files(source: DataSource) -> list[Path]:
    """The files a files: source names: every file under a directory, or those its glob matches."""
    path = Path(os.path.expanduser(source.glob))
    try:
        files = _walk_files(path) if path.is_dir() else _glob_files(source.glob)
    except PermissionError as e:
        raise DataError(f"data.source: {source.text}: permission denied reading the directory {e.filename}") from None
    if not files:
        denied = _denied_directory(source.glob)
        if denied is not None:
            raise DataError(f"data.source: {source.text}: permission denied reading the directory {denied}")
        raise DataError(f"data.source: {source.text} matches no file")
    return files


def source_fingerprint(cfg: DataConfig) -> str:
    """Cheap identity of the source's contents: changes when the documents could have changed."""
    source = cfg.source_spec
    if source.recall is not None:
        return "recall-v1-" + "-".join(f"{k}{v}" for k, v in dataclasses.asdict(source.recall).items())
    if source.seq2seq is not None:
        return "seq2seq-v1-" + "-".join(f"{k}{v}" for k, v in dataclasses.asdict(source.seq2seq).items())
    if source.kind == "builtin":
        root, files = _stdlib_files()
        return f"stdlib-{sys.version_info.major}.{sys.version_info.minor}-{_files_fingerprint(files, root)}"
    if source.kind == "files":
        return f"files-{_files_fingerprint(_source_files(source))}"
    return "hf-" + "-".join(ds._fingerprint for ds in load_splits(cfg).values())


def _documents_from_recall(cfg: DataConfig, task: RecallTask) -> dict:
    import datasets

    # its own splits, whatever their names
    return {
        name: datasets.Dataset.from_dict({cfg.text_field: task.documents(split)})
        for name, split in ((cfg.train_split, "train"), (cfg.val_split, "val"))
    }


def _pairs_from_task(cfg: DataConfig, task: Seq2seqTask) -> dict:
    import datasets

    fields = pair_fields(cfg)
    return {
        name: datasets.Dataset.from_dict(dict(zip(fields, task.pairs(split))))
        for name, split in ((cfg.train_split, "train"), (cfg.val_split, "val"))
    }


def _documents_from_stdlib(cfg: DataConfig):
    import datasets

    root, files = _stdlib_files()
    texts = [p.read_text("utf-8", errors="replace") for p in files]
    paths = [str(p.relative_to(root)) for p in files]
    return datasets.DatasetDict({"train": datasets.Dataset.from_dict({cfg.text_field: texts, "path": paths})})


def _documents_from_files(cfg: DataConfig, source: DataSource):
    import datasets

    path = Path(os.path.expanduser(source.glob))
    if path.is_dir() and any((path / f).exists() for f in ("dataset_info.json", "dataset_dict.json")):
        try:
            with _quiet_datasets():
                return datasets.load_from_disk(str(path))
        except Exception as e:  # damaged, or a layout this datasets version cannot read back
            raise DataError(f"data.source: cannot read {source.text}: {_reason(e)}") from None
    files = _source_files(source)
    if all(f.stat().st_size == 0 for f in files):
        raise DataError(f"data.source: {source.text} is empty ({len(files)} file(s), 0 bytes)")
    builder = _builder(source, files)
    options = dict(sample_by="document", encoding_errors="replace") if builder == "text" else {}
    try:
        with _quiet_datasets():
            return datasets.load_dataset(builder, data_files={"train": [str(f) for f in files]}, **options)
    except Exception as e:
        raise DataError(f"data.source: cannot read {source.text}: {_reason(e)}") from None


# files read by a datasets builder of their own; any other extension (.py, .md, .c, ...) is text
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


# formats that hold text but are not text (documents, archives, arrays): refused by name, whatever
# their bytes, with a hint to convert them, rather than read as text or called "binary"
NOT_TEXT = {".docx", ".doc", ".pdf", ".odt", ".rtf", ".epub", ".xlsx", ".xls", ".pptx", ".zip", ".gz", ".bz2"}
NOT_TEXT |= {".xz", ".zst", ".tar", ".7z", ".arrow", ".feather", ".npy", ".npz", ".pkl", ".pt", ".safetensors"}


def _builder(source: DataSource, files: list[Path]) -> str:
    """The datasets builder that reads `files`: that of their kind, all of one kind; files of other
    extensions are plain text (one document per file, as .txt), and may go with .txt files."""
    refused = sorted({f.suffix for f in files if f.suffix.lower() in NOT_TEXT})
    if refused:
        raise DataError(
            f"data.source: {source.text} matches {', '.join(refused)} files, which this loader cannot read; "
            "convert them to text (.txt, .jsonl, ...) or narrow the glob"
        )
    kinds = {BUILDERS.get(f.suffix.lower(), "text") for f in files}
    if len(kinds) != 1:
        suffixes = sorted({f.suffix or "(none)" for f in files})
        raise DataError(
            f"data.source: {source.text} must match files of one kind (.jsonl/.json, .parquet, .csv, or text: "
            f".txt and any other extension), found {', '.join(suffixes)}"
        )
    (builder,) = kinds
    if builder == "text":
        _check_text_files(source, [f for f in files if f.suffix.lower() not in BUILDERS])
    return builder


def _check_text_files(source: DataSource, files: list[Path]) -> None:
    """Refuse a file that is not UTF-8 text (a compiled file, an image) among those read as text:
    decoded with replacement it would train on noise. A NUL byte counts as binary though valid UTF-8.
    .txt files keep their lenient reading (undecodable bytes become U+FFFD), so are not checked."""
    for f in files:
        data = f.read_bytes()
        try:
            data.decode("utf-8")
            binary = b"\0" in data
        except UnicodeDecodeError:
            binary = True
        if binary:
            raise DataError(
                f"data.source: {source.text} matches {f}, which is not UTF-8 text (a binary file?); "
                "narrow the glob to the text files (e.g. files:DIR/**/*.py)"
            )


def _hub_unreachable() -> str | None:
    """Why the hub cannot be reached, from one connection attempt of at most HUB_PROBE_SECONDS, or
    None. Without it, a machine with no network spends ~25 s in the hub client's retries, each one a
    line on stderr. Not probed in offline mode (the libraries then fail at once) or behind a proxy
    (a direct connection proves nothing there)."""
    from huggingface_hub import constants

    proxies = urllib.request.getproxies()
    if constants.HF_HUB_OFFLINE or "https" in proxies or "all" in proxies:
        return None
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=HUB_PROBE_SECONDS).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(f"{host}:{port}: {e.strerror or first_line(e)}")

    # a thread, because name resolution has no timeout of its own
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_SECONDS)
    return outcome[0] if outcome else f"{host}:{port}: no answer within {HUB_PROBE_SECONDS:g} s"


@contextlib.contextmanager
def _hub_offline():
    """The hub libraries in offline mode (what HF_HUB_OFFLINE=1 sets at import): the local cache only."""
    import datasets.config
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved


def _documents_from_hub(source: DataSource):
    import datasets

    unreachable = _hub_unreachable()
    try:
        if unreachable is None:
            return datasets.load_dataset(source.name, source.config)
        with _hub_offline(), _quiet_datasets():  # a copy in the local cache serves; else one line below
            return datasets.load_dataset(source.name, source.config)
    except Exception as e:
        if unreachable is not None:
            raise DataError(
                f"data.source: cannot reach the Hugging Face hub for {source.name} ({unreachable}) and it is not "
                f"in the local cache; {OFFLINE_HINT}"
            ) from None
        text = first_line(e)
        words = ("offline", "connection", "resolve", "internet", "network")
        offline = isinstance(e, ConnectionError) or any(w in text.lower() for w in words)  # "Couldn't reach"
        hint = f" (offline?); {OFFLINE_HINT}" if offline else ""
        raise DataError(f"data.source: cannot load {source.name} from the Hugging Face hub{hint}: {text}") from None


def _documents(cfg: DataConfig):
    """The source's documents as it stores them: a Dataset, a DatasetDict or a dict of splits."""
    source = cfg.source_spec
    if source.recall is not None:
        return _documents_from_recall(cfg, source.recall)
    if source.seq2seq is not None:
        return _pairs_from_task(cfg, source.seq2seq)
    if source.kind == "builtin":
        return _documents_from_stdlib(cfg)
    if source.kind == "files":
        return _documents_from_files(cfg, source)
    return _documents_from_hub(source)


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
        fingerprint += "+" + _val_fingerprint(cfg)
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
    loaded = _as_dict(_documents(cfg))
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


def pair_fields(cfg: DataConfig) -> tuple[str, str]:
    """The input and target fields of a pair source (builtin:seq2seq names its own)."""
    return cfg.input_field or "input", cfg.target_field or "target"


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
    loaded = _as_dict(_documents(cfg))
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


@contextlib.contextmanager
def _naming(key: str):
    """Errors about another source's contents (data.val_source, data.mixture[i].source) name its
    key, not data.source."""
    try:
        yield
    except DataError as e:
        message = str(e)
        if message.startswith("data.source:"):
            raise DataError(f"{key}:" + message.removeprefix("data.source:")) from None
        raise


def _naming_val_source():
    """Errors about the validation source's contents name data.val_source, not data.source."""
    return _naming("data.val_source")


def _val_config(cfg: DataConfig) -> DataConfig:
    assert cfg.val_source is not None
    return dataclasses.replace(cfg, source=cfg.val_source, val_source=None)


def _val_source_documents(cfg: DataConfig):
    """The documents of data.val_source: its validation split if it has one, else its training split."""
    vcfg = _val_config(cfg)
    with _naming_val_source():
        loaded = _as_dict(_documents(vcfg))
        name = next((n for n in (cfg.val_split, cfg.train_split) if n in loaded), None)
        if name is None:
            raise DataError(
                f"data.val_source: {cfg.val_source} has neither a {cfg.val_split!r} nor a {cfg.train_split!r} split "
                f"({', '.join(loaded)})"
            )
        _check_text_field(vcfg, loaded[name])
        val, _ = _text_rows(vcfg, loaded[name], name)
        return _separate(cfg, val)


def _val_fingerprint(cfg: DataConfig) -> str:
    vcfg = _val_config(cfg)
    with _naming_val_source():
        if vcfg.source_spec.kind == "hf":
            return "hf-" + "-".join(ds._fingerprint for ds in _as_dict(_documents(vcfg)).values())
        return source_fingerprint(vcfg)


# --- tokenizer -----------------------------------------------------------------------------------


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
        with _naming(f"data.mixture[{i}].source"):
            # the split rule is a function of the contents, which the fingerprint pins
            sources.append([source_fingerprint(scfg), _split_rules(scfg)])
    saved = cache_dir / f"bpe-{_digest({'bpe': cfg.vocab_size, 'mixture': sources})}.json"
    if saved.is_file():
        return HFTokenizer(saved.read_text())
    _check_writable(cache_dir)
    budget = BPE_TRAIN_BYTES // len(configs)
    texts = []
    for i, scfg in enumerate(configs):
        with _naming(f"data.mixture[{i}].source"):
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


# --- the token cache -----------------------------------------------------------------------------


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
        rules["val_source"] = _val_fingerprint(cfg)
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


# --- windows and batches -------------------------------------------------------------------------


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
        mixture's are its sources' in turn (each validates separately: see Trainer.evaluate)."""
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
        with _naming(f"data.mixture[{i}].source"):
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
