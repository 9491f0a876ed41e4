"""Where documents come from: `data.source` read as text (the standard library's sources, local
files, a Hugging Face dataset or a directory written by `save_to_disk`, the synthetic tasks), each
with a fingerprint of what it read, so that a changed source is a new token cache. A source that
cannot be read is one line (`DataError`), never datasets' traceback."""

from __future__ import annotations

import contextlib
import glob as globlib
import hashlib
import os
import socket
import sysconfig
import threading
import urllib.parse
import urllib.request
from pathlib import Path

from transformer.config import DataConfig, DataSource
from transformer.errors import first_line
from transformer.synthetic import RecallTask, Seq2seqTask

HUB_PROBE_SECONDS = 3.0  # how long the hub may take to accept a connection before it counts as unreachable
OFFLINE_HINT = (
    "to work offline, use data.source=files:PATH with local files or a directory written by datasets' save_to_disk"
)


class DataError(ValueError):
    """A user mistake about the data (exit 2): empty or missing source, bad field, too small a corpus."""


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


def stdlib_files() -> tuple[Path, list[Path]]:
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


def files_fingerprint(files: list[Path], root: Path | None = None) -> str:
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root) if root else p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def source_files(source: DataSource) -> list[Path]:
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

    root, files = stdlib_files()
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
    files = source_files(source)
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
        for f in files:
            if f.suffix.lower() == ".txt" and _only_nul(f):
                raise DataError(
                    f"data.source: {source.text} matches {f}, which holds no text (only NUL bytes and whitespace); "
                    "remove it or narrow the glob"
                )
    return builder


NO_TEXT = b"\0 \t\r\n\f\v"  # what a file of only NUL bytes (and whitespace) holds
CHUNK = 1 << 20


def _only_nul(path: Path) -> bool:
    """Whether a file holds NUL bytes and nothing else but whitespace: no text, however read. Reads
    only until the first other byte (the first chunk of a text file)."""
    seen_nul = False
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            if chunk.strip(NO_TEXT):
                return False
            seen_nul = seen_nul or b"\0" in chunk
    return seen_nul


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


def hub_unreachable() -> str | None:
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
def hub_offline():
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

    unreachable = hub_unreachable()
    try:
        if unreachable is None:
            return datasets.load_dataset(source.name, source.config)
        with hub_offline(), _quiet_datasets():  # a copy in the local cache serves; else one line below
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


def documents(cfg: DataConfig):
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


@contextlib.contextmanager
def naming(key: str):
    """Errors about another source's contents (data.val_source, data.mixture[i].source) name its
    key, not data.source."""
    try:
        yield
    except DataError as e:
        message = str(e)
        if message.startswith("data.source:"):
            raise DataError(f"{key}:" + message.removeprefix("data.source:")) from None
        raise


def pair_fields(cfg: DataConfig) -> tuple[str, str]:
    """The input and target fields of a pair source (builtin:seq2seq names its own)."""
    return cfg.input_field or "input", cfg.target_field or "target"
