"""Data pipeline: sources, splits, the token cache, packing, document layout and step-indexed batches.

Every test works in its own cache directory (DataConfig(cache_dir=...)) and the Hugging Face datasets cache
is redirected to a temporary directory, so nothing here touches the user's caches.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from transformer import data as D
from transformer.config import DataConfig
from transformer.data import batches as data_batches
from transformer.data import cache as data_cache
from transformer.data import objectives as data_objectives
from transformer.data import pipeline as data_pipeline
from transformer.data import sources as data_sources
from transformer.data import splits as data_splits

EOS = 257  # the byte tokenizer's end of document
REPO = Path(__file__).resolve().parents[1]


# --- helpers -------------------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("private_hf_cache")


def restart():
    """Forget everything held in memory, as a new process would."""
    data_splits._load_splits.cache_clear()


def config(source: str, cache: Path, **kw) -> DataConfig:
    kw.setdefault("seq_len", 16)
    return DataConfig(source=source, cache_dir=str(cache), **kw)


def quiet(messages: list | None = None):
    return (lambda m: None) if messages is None else messages.append


def make_docs(n: int, seed: int = 0, lo: int = 20, hi: int = 120) -> list[str]:
    rng = np.random.default_rng(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
    docs = []
    for i in range(n):
        body = " ".join(rng.choice(words, size=int(rng.integers(lo, hi)) // 5))
        docs.append(f"doc {i}: {body}.")
    return docs


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def save_dict(path: Path, **splits: list[str]) -> Path:
    import datasets

    def dataset(docs):  # an empty split the way one usually arises (filtered), which datasets can read back
        return datasets.Dataset.from_dict({"text": docs or [""]}).filter(lambda row: bool(docs))

    datasets.DatasetDict({k: dataset(v) for k, v in splits.items()}).save_to_disk(path)
    return path


def stream_of(docs: list[str]) -> np.ndarray:
    """The byte tokenizer's stream for documents in this order: each one followed by EOS."""
    out = []
    for d in docs:
        out.extend(d.encode("utf-8"))
        out.append(EOS)
    return np.asarray(out, np.int64)


def texts(split) -> list[str]:
    return list(split["text"])


def one_line_error(fn, *args, **kw) -> str:
    with pytest.raises(D.DataError) as info:
        fn(*args, **kw)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A .jsonl corpus without a validation split of its own (so it is split by document hash)."""
    root = tmp_path_factory.mktemp("corpus")
    docs = make_docs(120)
    write_jsonl(root / "src" / "docs.jsonl", docs)
    return dict(source=f"files:{root / 'src'}", docs=docs, root=root)


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    """A saved DatasetDict (train and validation splits) whose train split is 65 documents of 15 bytes."""
    root = tmp_path_factory.mktemp("exact")
    train = [f"train doc {i:04d}." for i in range(65)]  # 15 bytes + EOS = 16 tokens each
    val = [f"validation {i:03d}" for i in range(9)]
    assert all(len(d) == 15 for d in train)
    save_dict(root / "dd", train=train, validation=val)
    return dict(source=f"files:{root / 'dd'}", train=train, val=val, root=root)


# 65 documents of 16 tokens = 1040 tokens; windows of seq_len+1 = 17 with stride 16: (1040 - 1) // 16 = 64
N_WINDOWS = 64


# --- determinism and process splits --------------------------------------------------------------


@pytest.mark.parametrize("document_mask", [False, True])
def test_batch_i_is_a_pure_function_of_config_seed_and_step(corpus, tmp_path, document_mask):
    cfg = config(corpus["source"], tmp_path / "cache", val_fraction=0.2, document_mask=document_mask)
    first = D.prepare(cfg, batch_size=8, seed=3, log=quiet())
    steps = [0, 1, 2, 7, 50, 1000]  # well past the first epoch too
    expected = {i: first.train_batch(i) for i in steps}
    del first
    restart()
    second = D.prepare(cfg, batch_size=8, seed=3, log=quiet())
    for i in reversed(steps):  # order of asking does not matter
        got = second.train_batch(i)
        assert got.keys() == expected[i].keys()
        assert ("segment_ids" in got) == document_mask
        for k in got:
            np.testing.assert_array_equal(got[k], expected[i][k], err_msg=f"step {i}, {k}")
    other_seed = D.prepare(cfg, batch_size=8, seed=4, log=quiet())
    assert not np.array_equal(other_seed.train_batch(0)["inputs"], expected[0]["inputs"])


@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_union_over_processes_is_exactly_the_global_batch(corpus, tmp_path, process_count):
    cfg = config(corpus["source"], tmp_path / "cache", val_fraction=0.2, document_mask=True)
    data = D.prepare(cfg, batch_size=8, seed=0, log=quiet())
    for step in (0, 5, 123):
        whole = data.train_batch(step)
        parts = [data.train_batch(step, p, process_count) for p in range(process_count)]
        assert all(len(part["inputs"]) == 8 // process_count for part in parts)
        for k in whole:
            np.testing.assert_array_equal(np.concatenate([part[k] for part in parts]), whole[k], err_msg=k)


def test_a_global_batch_that_does_not_split_evenly_is_refused(corpus, tmp_path):
    data = D.prepare(config(corpus["source"], tmp_path / "cache", val_fraction=0.2), 6, 0, log=quiet())
    message = one_line_error(data.train_batch, 0, 0, 4)
    assert message.startswith("train.batch_size:") and "4 processes" in message
    assert len(data.train_batch(0, 1, 3)["inputs"]) == 2


# --- epochs --------------------------------------------------------------------------------------


def test_each_epoch_visits_every_window_once_in_a_fresh_order(exact, tmp_path):
    cfg = config(exact["source"], tmp_path / "cache")
    B = 8
    data = D.prepare(cfg, batch_size=B, seed=0, log=quiet())
    assert data.sampler.n == data.train.count == N_WINDOWS
    steps_per_epoch = N_WINDOWS // B

    def epoch(sampler, e):
        return np.concatenate([sampler.window_ids(s) for s in range(e * steps_per_epoch, (e + 1) * steps_per_epoch)])

    e0, e1 = epoch(data.sampler, 0), epoch(data.sampler, 1)
    for ids in (e0, e1):
        np.testing.assert_array_equal(np.sort(ids), np.arange(N_WINDOWS))
    assert not np.array_equal(e0, e1), "the next epoch must be a different permutation"
    assert not np.array_equal(e0, np.arange(N_WINDOWS)), "windows must be shuffled"
    other = D.prepare(cfg, batch_size=B, seed=1, log=quiet())
    assert not np.array_equal(epoch(other.sampler, 0), e0), "different seeds must give different orders"


def test_epochs_follow_one_another_without_gap_or_repeat_when_batches_straddle_them():
    n, B = 10, 4  # batches straddle the epoch boundaries
    sampler = data_batches.Sampler(n, B, seed=7)
    flat = np.concatenate([sampler.window_ids(s) for s in range(15)])  # 60 ids = 6 epochs
    for e in range(6):
        chunk = flat[e * n : (e + 1) * n]
        np.testing.assert_array_equal(np.sort(chunk), np.arange(n), err_msg=f"epoch {e}")
        np.testing.assert_array_equal(chunk, sampler.permutation(e))
    # rows of a step, asked for piecewise, are the same as the whole step
    for s in range(15):
        whole = sampler.window_ids(s)
        np.testing.assert_array_equal(
            np.concatenate([sampler.window_ids(s, range(0, 1)), sampler.window_ids(s, range(1, B))]), whole
        )
    assert sampler.epochs_consumed(5) == pytest.approx(2.0)


# --- packing -------------------------------------------------------------------------------------


def test_stream_is_the_split_documents_in_order_each_followed_by_eos(exact, tmp_path):
    data = D.prepare(config(exact["source"], tmp_path / "cache"), batch_size=4, seed=0, log=quiet())
    np.testing.assert_array_equal(np.asarray(data.train.tokens, np.int64), stream_of(exact["train"]))
    np.testing.assert_array_equal(np.asarray(data.val.tokens, np.int64), stream_of(exact["val"]))
    assert data.tokenizer.eos_id == EOS and data.vocab_size == 259


def test_hash_split_stream_follows_the_split_order(corpus, tmp_path):
    cfg = config(corpus["source"], tmp_path / "cache", val_fraction=0.25)
    data = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    splits = data_splits.load_splits(cfg)
    train, val = texts(splits["train"]), texts(splits["val"])
    np.testing.assert_array_equal(np.asarray(data.train.tokens, np.int64), stream_of(train))
    np.testing.assert_array_equal(np.asarray(data.val.tokens, np.int64), stream_of(val))
    # each side keeps the source's order
    position = {d: i for i, d in enumerate(corpus["docs"])}
    for side in (train, val):
        assert [position[d] for d in side] == sorted(position[d] for d in side)


@pytest.mark.parametrize("document_mask", [False, True])
def test_targets_are_inputs_shifted_by_one_in_the_token_stream(corpus, tmp_path, document_mask):
    cfg = config(corpus["source"], tmp_path / "cache", val_fraction=0.2, document_mask=document_mask)
    data = D.prepare(cfg, batch_size=8, seed=0, log=quiet())
    T = cfg.seq_len
    stream = np.asarray(data.train.tokens, np.int64)
    for step in (0, 3, 40):
        batch = data.train_batch(step)
        assert batch["inputs"].shape == batch["targets"].shape == (8, T)
        assert batch["inputs"].dtype == np.int32
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
        for row, w in enumerate(data.sampler.window_ids(step)):
            np.testing.assert_array_equal(batch["inputs"][row], stream[w * T : w * T + T])
            np.testing.assert_array_equal(batch["targets"][row], stream[w * T + 1 : w * T + T + 1])
    # windows tile the stream: every token after the first is a target of exactly one window
    targets = np.concatenate([data.train.batch(np.array([w]))["targets"][0] for w in range(data.train.count)])
    np.testing.assert_array_equal(targets, stream[1 : 1 + data.train.count * T])
    assert data.train.count == (len(stream) - 1) // T


def test_document_layout_hand_made():
    e = 9
    inputs = np.array(
        [
            [1, 2, e, 3, 4, e, e, 5],
            [e, 1, 1, 1, 1, 1, 1, 1],
            [1, 1, 1, 1, 1, 1, 1, e],
        ]
    )
    layout = data_objectives.document_layout(inputs, e)
    np.testing.assert_array_equal(
        layout["segment_ids"], [[0, 0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        layout["positions"], [[0, 1, 2, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7]]
    )
    assert layout["segment_ids"].dtype == layout["positions"].dtype == np.int32


def test_document_layout_on_real_batches(corpus, tmp_path):
    cfg = config(corpus["source"], tmp_path / "cache", val_fraction=0.2, document_mask=True, seq_len=64)
    data = D.prepare(cfg, batch_size=8, seed=0, log=quiet())
    saw_boundary = False
    for batch in [data.train_batch(s) for s in range(4)] + data.val_batches(4):
        inputs, seg, pos = batch["inputs"], batch["segment_ids"], batch["positions"]
        after_eos = inputs[:, :-1] == EOS
        saw_boundary |= bool(after_eos.any())
        assert (seg[:, 0] == 0).all() and (pos[:, 0] == 0).all()
        np.testing.assert_array_equal(np.diff(seg, axis=1), after_eos.astype(np.int32))
        np.testing.assert_array_equal(pos[:, 1:] == 0, after_eos)  # restart right after each EOS, only there
        np.testing.assert_array_equal(np.where(after_eos, 0, pos[:, :-1] + 1), pos[:, 1:])
    assert saw_boundary, "the corpus' documents are shorter than a window, so boundaries must occur"


# --- validation windows --------------------------------------------------------------------------


def test_validation_windows_are_fixed_by_the_data_config(corpus, tmp_path):
    cfg = config(corpus["source"], tmp_path / "cache", val_fraction=0.2, val_windows=10)
    a = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    restart()
    b = D.prepare(cfg, batch_size=8, seed=99, log=quiet())
    np.testing.assert_array_equal(a.val_window_ids, b.val_window_ids)
    assert len(a.val_window_ids) == min(10, a.val.count) and len(np.unique(a.val_window_ids)) == len(a.val_window_ids)
    assert a.val_window_ids.min() >= 0 and a.val_window_ids.max() < a.val.count
    # batched with padding: the real rows are exactly the fixed windows, padding weighs nothing
    batches = a.val_batches(3)
    real = np.concatenate([bt["inputs"][bt["weights"][:, 0] > 0] for bt in batches])
    np.testing.assert_array_equal(real, a.val.batch(a.val_window_ids)["inputs"])
    assert sum(bt["weights"].sum() for bt in batches) == len(a.val_window_ids) * cfg.seq_len
    assert a.val_bytes_per_token == pytest.approx(1.0, abs=0.05)  # bytes: 1 per token, plus the EOSs


# --- splits and sources --------------------------------------------------------------------------


def test_hash_split_is_disjoint_by_content_and_deterministic(tmp_path):
    docs = make_docs(200, seed=1)
    docs = docs + docs[:50]  # exact copies must land on the same side as their originals
    write_jsonl(tmp_path / "src" / "a.jsonl", docs)
    cfg = config(f"files:{tmp_path / 'src'}", tmp_path / "cache", val_fraction=0.2)
    splits = data_splits.load_splits(cfg)
    train, val = texts(splits["train"]), texts(splits["val"])
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(docs)
    assert 0.05 < len(val) / len(docs) < 0.4
    restart()
    again = data_splits.load_splits(cfg)
    assert texts(again["train"]) == train and texts(again["val"]) == val
    # a larger fraction moves documents only from train to val
    more = data_splits.load_splits(config(cfg.source, tmp_path / "cache", val_fraction=0.5))
    assert set(val) <= set(texts(more["val"]))


def test_the_sources_own_validation_split_is_used(exact, tmp_path):
    for fraction in (0.01, 0.5):  # ignored when the source has its own split
        splits = data_splits.load_splits(config(exact["source"], tmp_path / "cache", val_fraction=fraction))
        assert texts(splits["train"]) == exact["train"]
        assert texts(splits["val"]) == exact["val"]


def test_a_custom_validation_split_name(tmp_path):
    docs = make_docs(30)
    save_dict(tmp_path / "dd", train=docs[:20], test=docs[20:])
    splits = data_splits.load_splits(config(f"files:{tmp_path / 'dd'}", tmp_path / "cache", val_split="test"))
    assert texts(splits["val"]) == docs[20:] and texts(splits["train"]) == docs[:20]


def _write_source(root: Path, kind: str, docs: list[str]) -> None:
    import datasets

    root.mkdir(parents=True)
    if kind == "jsonl":
        write_jsonl(root / "a.jsonl", docs[:10])
        write_jsonl(root / "sub" / "b.jsonl", docs[10:])
    elif kind == "csv":
        datasets.Dataset.from_dict({"text": docs, "n": list(range(len(docs)))}).to_csv(root / "a.csv", index=False)
    elif kind == "parquet":
        datasets.Dataset.from_dict({"text": docs}).to_parquet(root / "a.parquet")
    elif kind == "txt":  # one document per file
        for i, d in enumerate(docs):
            (root / f"{i:03d}.txt").write_text(d + "\nsecond line\n")


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "txt"])
def test_packaged_file_builders(tmp_path, kind):
    docs = [d.replace(",", " ") for d in make_docs(40)]
    _write_source(tmp_path / "src", kind, docs)
    expected = [d + "\nsecond line\n" for d in docs] if kind == "txt" else docs
    cfg = config(f"files:{tmp_path / 'src'}", tmp_path / "cache", val_fraction=0.2)
    splits = data_splits.load_splits(cfg)
    assert sorted(texts(splits["train"]) + texts(splits["val"])) == sorted(expected)
    data = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    np.testing.assert_array_equal(np.asarray(data.train.tokens, np.int64), stream_of(texts(splits["train"])))


def test_a_glob_source(tmp_path):
    docs = make_docs(40)
    write_jsonl(tmp_path / "a.jsonl", docs[:20])
    write_jsonl(tmp_path / "b.jsonl", docs[20:])
    (tmp_path / "notes.md").write_text("not part of the corpus")
    splits = data_splits.load_splits(config(f"files:{tmp_path}/*.jsonl", tmp_path / "cache", val_fraction=0.2))
    assert sorted(texts(splits["train"]) + texts(splits["val"])) == sorted(docs)


def _code_files(root: Path, n: int = 30) -> list[str]:
    """n small Python files under root/pkg (one nested), each a document with blank lines in it."""
    docs = [f"def f{i}(x):\n    return x + {i}\n\n\n# file {i}\n" + "y = 1\n" * (i % 5) for i in range(n)]
    for i, doc in enumerate(docs):
        path = root / "pkg" / ("sub" if i % 3 == 0 else "") / f"m{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(doc)
    return docs


def test_a_glob_of_code_files_trains_and_validates_as_documents(tmp_path):
    """Files of any other extension (.py, .md, ...) are text, one document per file, as .txt is."""
    docs = _code_files(tmp_path)
    (tmp_path / "pkg" / "README.md").write_text("# not matched by the glob\n")
    cfg = config(f"files:{tmp_path}/pkg/**/*.py", tmp_path / "cache", val_fraction=0.2)
    splits = data_splits.load_splits(cfg)
    assert sorted(texts(splits["train"]) + texts(splits["val"])) == sorted(docs)
    assert len(splits["train"]) and len(splits["val"]) and data_splits.split_rule(cfg) == data_splits.HASH
    data = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    np.testing.assert_array_equal(np.asarray(data.train.tokens, np.int64), stream_of(texts(splits["train"])))
    np.testing.assert_array_equal(np.asarray(data.val.tokens, np.int64), stream_of(texts(splits["val"])))
    # the separator applies as to .txt files; a directory mixes .py and .md files, both text
    (tmp_path / "pkg" / "notes.md").write_text("first note\n\n\nsecond note\n")
    sep = config(f"files:{tmp_path}/pkg", tmp_path / "cache", val_fraction=0.2, document_separator="\n\n\n")
    pieces = texts(data_splits.load_splits(sep)["train"]) + texts(data_splits.load_splits(sep)["val"])
    assert "first note" in pieces and "second note\n" in pieces and "# file 4\n" + "y = 1\n" * 4 in pieces


def test_a_binary_file_among_text_files_is_one_line_naming_it(tmp_path):
    _code_files(tmp_path)
    (tmp_path / "pkg" / "sub" / "m3.cpython-312.pyc").write_bytes(b"\xa7\r\r\n\0\0" + bytes(range(256)))
    message = one_line_error(data_splits.load_splits, config(f"files:{tmp_path}/pkg", tmp_path / "cache"))
    assert message.startswith("data.source:") and "m3.cpython-312.pyc" in message and "not UTF-8 text" in message
    (tmp_path / "pkg" / "sub" / "m3.cpython-312.pyc").write_bytes(b"valid UTF-8 but \0 NUL bytes")
    assert "m3.cpython-312.pyc" in one_line_error(
        data_splits.load_splits, config(f"files:{tmp_path}/pkg", tmp_path / "cache")
    )
    # a glob that leaves it out reads the rest; .jsonl among text files is still refused as a mix of kinds
    assert len(data_splits.load_splits(config(f"files:{tmp_path}/pkg/**/*.py", tmp_path / "cache"))["train"])
    write_jsonl(tmp_path / "pkg" / "rows.jsonl", ["a row"])
    message = one_line_error(data_splits.load_splits, config(f"files:{tmp_path}/pkg/**/*.*[ly]", tmp_path / "cache"))
    assert "one kind" in message and ".jsonl" in message and ".py" in message
    # a document format is refused by its extension, whatever its bytes, with a hint to convert it
    (tmp_path / "pkg" / "rows.jsonl").unlink()
    (tmp_path / "pkg" / "paper.pdf").write_text("%PDF-1.4 looks like text")
    message = one_line_error(data_splits.load_splits, config(f"files:{tmp_path}/pkg/*", tmp_path / "cache"))
    assert message.startswith("data.source:") and ".pdf files" in message and "convert them" in message


@pytest.mark.parametrize("size", [4, 100_000])
def test_a_txt_file_of_nul_bytes_is_said_to_hold_no_text(tmp_path, size):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_bytes(b"\0" * size)
    message = one_line_error(D.prepare, config(f"files:{tmp_path / 'src'}", tmp_path / "cache"), 4, 0, log=quiet())
    assert message.startswith("data.source:") and "a.txt" in message and "no text" in message, message
    (tmp_path / "src" / "b.txt").write_text("some text " * 100)  # one such file among others: still named
    message = one_line_error(D.prepare, config(f"files:{tmp_path / 'src'}", tmp_path / "cache"), 4, 0, log=quiet())
    assert "a.txt" in message and "no text" in message, message


def test_non_utf8_bytes_do_not_crash_the_byte_tokenizer(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"{i}.txt").write_bytes(b"caf\xe9 \xff\xfe latin-1 and junk \x80\x81 " * 8 + f"file {i}\n".encode())
    cfg = config(f"files:{src}", tmp_path / "cache", val_fraction=0.3)
    data = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    tokens = np.asarray(data.train.tokens)
    assert tokens.max() <= EOS and (tokens == EOS).sum() == len(data_splits.load_splits(cfg)["train"])
    text = data.tokenizer.decode(tokens)
    assert "\ufffd" in text and "latin-1 and junk" in text  # undecodable bytes became U+FFFD
    assert data.train_batch(0)["inputs"].shape == (4, 16)


def test_missing_texts_are_empty_documents(tmp_path):
    """A CSV cell left empty, a JSON line without the field: null text, an empty document, no crash."""
    docs = make_docs(30)
    src = tmp_path / "csv"
    src.mkdir()
    rows = [f"{'' if i % 7 == 0 else d.replace(',', ' ')},{i}\n" for i, d in enumerate(docs)]
    (src / "a.csv").write_text("text,n\n" + "".join(rows))
    data = D.prepare(config(f"files:{src}", tmp_path / "cache", val_fraction=0.2), batch_size=4, seed=0, log=quiet())
    assert data.train.count >= 4
    src = tmp_path / "json"
    src.mkdir()
    lines = [json.dumps({"text": d} if i % 7 else {"other": i}) + "\n" for i, d in enumerate(docs)]
    (src / "a.jsonl").write_text("".join(lines))
    cfg = config(f"files:{src}", tmp_path / "cache", val_fraction=0.2, tokenizer="bpe", vocab_size=300)
    data = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    assert data.train.count >= 4


def test_edited_files_are_read_again_in_the_same_process(tmp_path):
    src = tmp_path / "src"
    docs = make_docs(40)
    write_jsonl(src / "a.jsonl", docs)
    cfg = config(f"files:{src}", tmp_path / "cache", val_fraction=0.2)
    before = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    write_jsonl(src / "a.jsonl", [d.upper() + "!" for d in docs])  # other size, so another fingerprint
    after = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    assert after.cache_path != before.cache_path
    text = bytes(np.asarray(after.train.tokens)[np.asarray(after.train.tokens) < 256].astype(np.uint8)).decode()
    assert "DOC 0" in text or "DOC 1" in text
    assert "alpha" not in text


# --- the token cache -----------------------------------------------------------------------------


def _no_tokenising(*args, **kw):
    raise AssertionError("tokenised again although a complete cache exists")


def test_a_second_run_reuses_the_cache_and_tokenises_nothing(corpus, tmp_path, monkeypatch):
    cfg = config(corpus["source"], tmp_path / "cache", val_fraction=0.2)
    messages = []
    first = D.prepare(cfg, batch_size=4, seed=0, log=quiet(messages))
    assert any("tokenising" in m for m in messages)
    meta = json.loads((first.cache_path / "meta.json").read_text())
    assert meta["train"]["documents"] + meta["val"]["documents"] == len(corpus["docs"])
    assert meta["train"]["tokens"] == len(first.train.tokens) and meta["dtype"] == "uint16"
    restart()
    monkeypatch.setattr(data_cache, "_tokenise_split", _no_tokenising)
    messages.clear()
    second = D.prepare(cfg, batch_size=4, seed=0, log=quiet(messages))
    assert not messages
    assert second.cache_path == first.cache_path
    np.testing.assert_array_equal(second.train_batch(3)["inputs"], first.train_batch(3)["inputs"])
    # the key depends on the source, the tokenizer and the split rules, not on the run's shape
    third = D.prepare(config(corpus["source"], tmp_path / "cache", val_fraction=0.2, seq_len=32), 4, 1, log=quiet())
    assert third.cache_path == first.cache_path
    assert data_cache.cache_key(cfg, D.ByteTokenizer()) != data_cache.cache_key(
        config(corpus["source"], tmp_path / "cache", val_fraction=0.3), D.ByteTokenizer()
    )


def _delete_meta(path: Path):
    (path / "meta.json").unlink()


def _truncate_train(path: Path):
    size = (path / "train.bin").stat().st_size
    os.truncate(path / "train.bin", size - 6)


def _garble_meta(path: Path):
    (path / "meta.json").write_text('{"dtype": "uint16", "train": ')


def _delete_val(path: Path):
    (path / "val.bin").unlink()


@pytest.mark.parametrize("damage", [_delete_meta, _truncate_train, _garble_meta, _delete_val])
def test_a_damaged_cache_is_detected_and_rebuilt(corpus, tmp_path, damage):
    cfg = config(corpus["source"], tmp_path / "cache", val_fraction=0.2)
    first = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    expected = np.array(first.train.tokens)
    path = first.cache_path
    del first
    damage(path)
    assert not data_cache._is_complete(path)
    restart()
    messages = []
    again = D.prepare(cfg, batch_size=4, seed=0, log=quiet(messages))
    assert any("tokenising" in m for m in messages)
    assert again.cache_path == path and data_cache._is_complete(path)
    np.testing.assert_array_equal(np.asarray(again.train.tokens), expected)


def test_a_pair_cache_is_reused_and_its_damage_detected(tmp_path, monkeypatch):
    """Pairs keep their own cache (inputs, targets, offsets): a second run reads it back; a target
    offsets file lost or cut is caught and the cache rebuilt."""
    source = "builtin:seq2seq:train_docs=200,val_docs=20"
    cfg = config(source, tmp_path / "cache", objective="seq2seq")
    first = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    expected = first.train_batch(2)
    path = first.cache_path
    restart()
    with monkeypatch.context() as m:
        m.setattr(data_cache, "_tokenise_split", _no_tokenising)
        again = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    for k in expected:
        np.testing.assert_array_equal(again.train_batch(2)[k], expected[k], err_msg=k)
    os.truncate(path / "val.target.offsets", 8)
    assert not data_cache._is_complete(path)
    restart()
    messages = []
    rebuilt = D.prepare(cfg, batch_size=4, seed=0, log=quiet(messages))
    assert any("tokenising" in m for m in messages) and data_cache._is_complete(path)
    np.testing.assert_array_equal(rebuilt.train_batch(2)["targets"], expected["targets"])
    # the text cache of the same documents would be another: the pair fields are in the key
    assert "pairs" in data_cache._split_rules(cfg) and "pairs" not in data_cache._split_rules(
        config("builtin:recall", tmp_path)
    )


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_an_interrupted_build_leaves_nothing_that_looks_complete(corpus, tmp_path, monkeypatch):
    cfg = config(corpus["source"], tmp_path / "cache", val_fraction=0.2)
    real = data_cache._tokenise_split

    def interrupted(split, text_field, tokenizer, dtype, path):
        if path.stem == "val":  # after the train split was written
            raise KeyboardInterrupt
        return real(split, text_field, tokenizer, dtype, path)

    monkeypatch.setattr(data_cache, "_tokenise_split", interrupted)
    with pytest.raises(KeyboardInterrupt):
        D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    key = data_cache.cache_key(cfg, D.ByteTokenizer())
    cache = tmp_path / "cache"
    assert not (cache / key).exists()
    assert not list(cache.glob(f"{key}*"))
    monkeypatch.setattr(data_cache, "_tokenise_split", real)
    data = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    assert data_cache._is_complete(data.cache_path)


def test_stale_partial_builds_are_cleaned_and_live_ones_kept(corpus, tmp_path):
    cfg = config(corpus["source"], tmp_path / "cache", val_fraction=0.2)
    key = data_cache.cache_key(cfg, D.ByteTokenizer())
    cache = tmp_path / "cache"
    stale = cache / f"{key}.partial-{_dead_pid()}-deadbeef"
    live = cache / f"{key}.partial-{os.getpid()}-0123abcd"  # a build still running in a live process
    other = cache / f"{'0' * 20}.partial-{_dead_pid()}-deadbeef"  # another key's: not ours to judge now
    for d in (stale, live, other):
        d.mkdir(parents=True)
        (d / "train.bin").write_bytes(b"\0" * 100)
        (d / "meta.json").write_text("{}")
    data = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    assert data.cache_path == cache / key and data_cache._is_complete(data.cache_path)
    assert not stale.exists()
    assert live.exists() and other.exists()


def test_token_dtype():
    assert data_cache.token_dtype(259) == np.uint16
    assert data_cache.token_dtype(4096) == np.uint16
    assert data_cache.token_dtype(2**16) == np.uint16  # ids 0..65535 fit
    assert data_cache.token_dtype(2**16 + 1) == np.uint32
    assert data_cache.token_dtype(200_000) == np.uint32


def _wordlevel_tokenizer(path: Path, n_words: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n_words)} | {"[UNK]": n_words}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.write_text(tok.to_str())
    return path


def test_a_vocab_beyond_uint16_is_stored_as_uint32_without_loss(tmp_path):
    n = 70_000
    tok = _wordlevel_tokenizer(tmp_path / "big.json", n)
    rng = np.random.default_rng(0)
    docs = [" ".join(f"w{int(i)}" for i in rng.integers(0, n, size=30)) for _ in range(30)]
    write_jsonl(tmp_path / "src" / "a.jsonl", docs)
    cfg = config(f"files:{tmp_path / 'src'}", tmp_path / "cache", tokenizer=f"pretrained:{tok}", val_fraction=0.2)
    data = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    assert data.vocab_size > 2**16 and data.train.tokens.dtype == np.uint32
    assert data.tokenizer.eos_id > 2**16
    eos = data.tokenizer.eos_id
    expected = [
        i for d in texts(data_splits.load_splits(cfg)["train"]) for i in [*(int(w[1:]) for w in d.split()), eos]
    ]
    np.testing.assert_array_equal(np.asarray(data.train.tokens, np.int64), expected)
    byte = D.prepare(config(cfg.source, tmp_path / "cache", val_fraction=0.2), batch_size=4, seed=0, log=quiet())
    assert byte.train.tokens.dtype == np.uint16


# --- BPE -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    rng = np.random.default_rng(5)
    words = ["transformer", "attention", "layer", "norm", "residual", "gradient", "token", "batch", "über", "naïve"]
    docs = [" ".join(rng.choice(words, size=int(rng.integers(10, 40)))) + f" #{i}" for i in range(80)]
    write_jsonl(root / "src" / "a.jsonl", docs)
    return dict(source=f"files:{root / 'src'}", docs=docs)


def test_bpe_trained_saved_and_reloaded_gives_identical_ids(bpe_corpus, tmp_path):
    workdir = tmp_path / "run"
    cfg = config(bpe_corpus["source"], tmp_path / "cache1", tokenizer="bpe", vocab_size=320, val_fraction=0.2)
    first = D.prepare(cfg, batch_size=4, seed=0, workdir=workdir, log=quiet())
    saved = workdir / "tokenizer.json"
    assert saved.is_file()
    assert 259 < first.vocab_size <= 320
    stream = np.asarray(first.train.tokens)
    n_bytes = sum(len(t.encode()) + 1 for t in texts(data_splits.load_splits(cfg)["train"]))
    assert len(stream) < 0.7 * n_bytes, "a trained BPE merges frequent byte pairs"
    assert stream.max() < first.vocab_size
    eos_positions = np.flatnonzero(stream == first.tokenizer.eos_id)
    assert len(eos_positions) == len(data_splits.load_splits(cfg)["train"]) and eos_positions[-1] == len(stream) - 1
    # decoding each document gives its text back
    docs = np.split(stream, eos_positions[:-1] + 1)
    assert [first.tokenizer.decode(d) for d in docs[:5]] == texts(data_splits.load_splits(cfg)["train"])[:5]

    # a restart with the same run directory, in a fresh cache: the saved tokenizer, the same ids
    restart()
    cfg2 = config(bpe_corpus["source"], tmp_path / "cache2", tokenizer="bpe", vocab_size=320, val_fraction=0.2)
    again = D.prepare(cfg2, batch_size=4, seed=0, workdir=workdir, log=quiet())
    assert again.tokenizer.fingerprint == first.tokenizer.fingerprint
    np.testing.assert_array_equal(np.asarray(again.train.tokens), stream)
    np.testing.assert_array_equal(np.asarray(again.val.tokens), np.asarray(first.val.tokens))
    assert not list((tmp_path / "cache2").glob("bpe-*.json")), "the run's own tokenizer wins; nothing is trained"

    # pretrained:PATH (a file or the directory holding it) loads the same tokenizer
    for spec in (saved, workdir):
        cfg3 = config(bpe_corpus["source"], tmp_path / "cache3", tokenizer=f"pretrained:{spec}", val_fraction=0.2)
        other = D.prepare(cfg3, batch_size=4, seed=0, log=quiet())
        np.testing.assert_array_equal(np.asarray(other.train.tokens), stream)
        assert other.tokenizer.eos_id == first.tokenizer.eos_id


def test_a_literal_eos_in_a_document_is_not_a_document_boundary(tmp_path):
    """Enough documents that datasets.map tokenises in several processes (where there are cores)."""
    docs = [f"doc {i}: the <eos> token and <pad> are just text here" + " filler" * (i % 5) for i in range(600)]
    write_jsonl(tmp_path / "src" / "a.jsonl", docs)
    cfg = config(f"files:{tmp_path / 'src'}", tmp_path / "cache", tokenizer="bpe", vocab_size=300, val_fraction=0.1)
    data = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    stream = np.asarray(data.train.tokens)
    train = texts(data_splits.load_splits(cfg)["train"])
    assert len(train) >= 512
    assert (stream == data.tokenizer.eos_id).sum() == len(train) and stream[-1] == data.tokenizer.eos_id
    assert not (stream == data.tokenizer.pad_id).any()
    pieces = np.split(stream, np.flatnonzero(stream == data.tokenizer.eos_id)[:-1] + 1)
    assert [data.tokenizer.decode(piece) for piece in pieces] == train


def test_bpe_is_kept_in_the_cache_for_later_runs(bpe_corpus, tmp_path, monkeypatch):
    cfg = config(bpe_corpus["source"], tmp_path / "cache", tokenizer="bpe", vocab_size=300, val_fraction=0.2)
    first = D.prepare(cfg, batch_size=4, seed=0, workdir=tmp_path / "run1", log=quiet())
    assert len(list((tmp_path / "cache").glob("bpe-*.json"))) == 1
    restart()

    def no_training(*a, **k):
        raise AssertionError("trained again")

    monkeypatch.setattr(data_cache, "train_bpe", no_training)
    monkeypatch.setattr(data_cache, "_tokenise_split", _no_tokenising)
    second = D.prepare(cfg, batch_size=4, seed=0, workdir=tmp_path / "run2", log=quiet())
    assert (tmp_path / "run2" / "tokenizer.json").read_text() == (tmp_path / "run1" / "tokenizer.json").read_text()
    assert second.cache_path == first.cache_path


def test_broken_tokenizer_files_are_clear_data_errors(bpe_corpus, tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": {"type": "BPE", "vocab": ')
    cfg = config(bpe_corpus["source"], tmp_path / "cache", tokenizer=f"pretrained:{broken}")
    message = one_line_error(D.prepare, cfg, 4, 0, log=quiet())
    assert message.startswith("data.tokenizer:") and str(broken) in message

    valid_json = tmp_path / "valid.json"
    valid_json.write_text('{"not": "a tokenizer"}')
    message = one_line_error(D.prepare, config(cfg.source, cfg.cache_dir, tokenizer=f"pretrained:{valid_json}"), 4, 0)
    assert message.startswith("data.tokenizer:") and str(valid_json) in message

    missing = tmp_path / "nowhere"
    message = one_line_error(D.prepare, config(cfg.source, cfg.cache_dir, tokenizer=f"pretrained:{missing}"), 4, 0)
    assert message.startswith("data.tokenizer:") and "nowhere" in message

    # a damaged tokenizer.json in the run directory
    run = tmp_path / "run"
    run.mkdir()
    (run / "tokenizer.json").write_text("{not json")
    bpe = config(cfg.source, cfg.cache_dir, tokenizer="bpe", vocab_size=300)
    message = one_line_error(D.prepare, bpe, 4, 0, workdir=run, log=quiet())
    assert message.startswith("data.tokenizer:") and "tokenizer.json" in message

    too_small = config(cfg.source, cfg.cache_dir, tokenizer="bpe", vocab_size=100, val_fraction=0.2)
    message = one_line_error(D.prepare, too_small, 4, 0, log=quiet())
    assert message.startswith("data.vocab_size:")


# --- errors: one line, naming the key ------------------------------------------------------------


def test_empty_source(tmp_path):
    for name in ("a.jsonl", "a.txt"):
        src = tmp_path / name.replace(".", "_")
        src.mkdir()
        (src / name).write_text("")
        message = one_line_error(D.prepare, config(f"files:{src}", tmp_path / "cache"), 4, 0, log=quiet())
        assert message.startswith("data.source:") and "empty" in message


def test_empty_split(tmp_path):
    save_dict(tmp_path / "dd", train=make_docs(20), validation=[])
    message = one_line_error(data_splits.load_splits, config(f"files:{tmp_path / 'dd'}", tmp_path / "cache"))
    assert message.startswith("data.source:") and "val" in message and "no documents" in message

    save_dict(tmp_path / "dd2", train=[], validation=make_docs(5))
    message = one_line_error(data_splits.load_splits, config(f"files:{tmp_path / 'dd2'}", tmp_path / "cache"))
    assert message.startswith("data.source:") and "train" in message


def test_a_hash_split_that_leaves_validation_empty_names_val_fraction(tmp_path):
    write_jsonl(tmp_path / "src" / "a.jsonl", make_docs(20))
    message = one_line_error(
        data_splits.load_splits, config(f"files:{tmp_path / 'src'}", tmp_path / "cache", val_fraction=0.0)
    )
    assert message.startswith("data.val_fraction:") and "20 documents" in message


def test_a_missing_train_split(tmp_path):
    save_dict(tmp_path / "dd", training=make_docs(20), validation=make_docs(5))
    message = one_line_error(data_splits.load_splits, config(f"files:{tmp_path / 'dd'}", tmp_path / "cache"))
    assert message.startswith("data.train_split:") and "training" in message


def test_a_corpus_smaller_than_one_global_batch(tmp_path):
    docs = make_docs(30)
    save_dict(tmp_path / "dd", train=docs[:3], validation=docs[3:])
    cfg = config(f"files:{tmp_path / 'dd'}", tmp_path / "cache", seq_len=64)
    have = len(stream_of(docs[:3]))
    need = 16 * 64 + 1
    assert have < need
    message = one_line_error(D.prepare, cfg, 16, 0, log=quiet())
    assert message.startswith("data.source:")
    assert f"{have:,} tokens" in message and f"{need:,}" in message and "16 x 64" in message


def test_a_validation_split_shorter_than_one_window(tmp_path):
    docs = make_docs(30)
    save_dict(tmp_path / "dd", train=docs, validation=["tiny"])
    message = one_line_error(D.prepare, config(f"files:{tmp_path / 'dd'}", tmp_path / "cache"), 4, 0, log=quiet())
    assert message.startswith("data.val_fraction:") and "5 tokens" in message


def test_a_missing_text_field_lists_the_columns(corpus, tmp_path):
    cfg = config(corpus["source"], tmp_path / "cache", text_field="content")
    message = one_line_error(D.prepare, cfg, 4, 0, log=quiet())
    assert message.startswith("data.text_field:") and "'content'" in message
    assert message.endswith("(columns: text, id)")


@pytest.mark.parametrize(
    "source",
    [
        "files:{tmp}/does/not/exist",
        "files:{tmp}/*.parquet",
        "files:{tmp}/**/*.jsonl",
    ],
)
def test_a_path_or_glob_matching_nothing(tmp_path, source):
    (tmp_path / "present.txt").write_text("something")
    source = source.format(tmp=tmp_path)
    message = one_line_error(D.prepare, config(source, tmp_path / "cache"), 4, 0, log=quiet())
    assert message.startswith("data.source:") and source in message and "no file" in message


def test_unreadable_or_mixed_files(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.parquet").write_bytes(b"this is not a parquet file" * 10)
    message = one_line_error(D.prepare, config(f"files:{bad}", tmp_path / "cache"), 4, 0, log=quiet())
    assert message.startswith("data.source:") and "cannot read" in message

    mixed = tmp_path / "mixed"
    write_jsonl(mixed / "a.jsonl", make_docs(5))
    (mixed / "b.txt").write_text("text")
    message = one_line_error(D.prepare, config(f"files:{mixed}", tmp_path / "cache"), 4, 0, log=quiet())
    assert message.startswith("data.source:") and ".jsonl" in message and ".txt" in message

    damaged = save_dict(tmp_path / "damaged", train=make_docs(10), validation=make_docs(3))
    for arrow in (damaged / "train").glob("*.arrow"):
        arrow.unlink()
    message = one_line_error(D.prepare, config(f"files:{damaged}", tmp_path / "cache"), 4, 0, log=quiet())
    assert message.startswith("data.source:") and "cannot read" in message

    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "a.docx").write_text("text")
    message = one_line_error(D.prepare, config(f"files:{odd}", tmp_path / "cache"), 4, 0, log=quiet())
    assert message.startswith("data.source:") and ".docx" in message


@pytest.mark.slow
def test_a_hub_dataset_while_offline(tmp_path):
    script = textwrap.dedent(
        """
        from transformer import data as D
        from transformer.config import DataConfig
        from transformer.data import splits as data_splits
        try:
            data_splits.load_splits(DataConfig(source="hf:someone/nonexistent-dataset", cache_dir="unused"))
        except D.DataError as e:
            print("DATAERROR", e)
        """
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("DATAERROR")]
    assert lines, out.stdout + out.stderr
    message = lines[0].removeprefix("DATAERROR ")
    assert message.startswith("data.source:") and "offline" in message and "files:" in message


def test_an_unreachable_hub_suggests_files_too(monkeypatch):
    """Without the offline variables, datasets reports a missing network as ConnectionError("Couldn't reach ...")."""
    import datasets

    def unreachable(*a, **k):
        raise ConnectionError("Couldn't reach 'someone/thing' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    message = one_line_error(data_splits.load_splits, DataConfig(source="hf:someone/thing"))
    assert message.startswith("data.source:") and "offline" in message and "files:" in message


def _no_network(monkeypatch) -> list[bool]:
    """A machine without network: every connection fails. Returns, per load_dataset call, whether the hub
    libraries were in offline mode (the local cache only) at the time."""
    import datasets
    from huggingface_hub import constants

    def refused(*a, **k):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(data_sources.socket, "create_connection", refused)
    monkeypatch.setattr(data_sources.urllib.request, "getproxies", lambda: {})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    offline_at_call: list[bool] = []

    def load(*a, **k):
        offline_at_call.append(constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE)
        if not offline_at_call[-1]:  # what the hub client would retry for ~25 s
            raise ConnectionError("Couldn't reach 'someone/thing' on the Hub (LocalEntryNotFoundError)")
        raise FileNotFoundError("Couldn't find cache for someone/thing")

    monkeypatch.setattr(datasets, "load_dataset", load)
    return offline_at_call


def test_no_network_asks_only_the_local_cache_and_says_how_to_work_offline(monkeypatch):
    from huggingface_hub import constants

    offline_at_call = _no_network(monkeypatch)
    message = one_line_error(data_splits.load_splits, DataConfig(source="hf:someone/thing"))
    assert offline_at_call == [True]  # never online: no retries against a network that is not there
    assert not constants.HF_HUB_OFFLINE  # offline mode was for that one call
    assert message.startswith("data.source:") and "cannot reach the Hugging Face hub" in message
    assert "Network is unreachable" in message and "files:" in message and "save_to_disk" in message


def test_no_network_with_a_cached_copy_of_the_dataset(monkeypatch):
    import datasets

    _no_network(monkeypatch)
    cached = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": make_docs(20)}),
            "validation": datasets.Dataset.from_dict({"text": make_docs(3)}),
        }
    )
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: cached)
    assert len(data_splits.load_splits(DataConfig(source="hf:someone/cached"))["train"]) == 20


# --- the built-in corpus -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory):
    cfg = DataConfig(source="builtin:stdlib", seq_len=64, cache_dir=str(tmp_path_factory.mktemp("stdlib-cache")))
    return cfg, D.prepare(cfg, batch_size=4, seed=0, log=quiet())


def test_builtin_stdlib(stdlib_data):
    cfg, data = stdlib_data
    assert data.vocab_size == 259 and data.train.tokens.dtype == np.uint16
    assert data.sampler.n > 100_000 and data.val.count > 100
    batch = data.train_batch(0)
    assert batch["inputs"].shape == (4, 64)
    assert batch["inputs"].min() >= 0 and batch["inputs"].max() < 259
    text = "".join(data.tokenizer.decode(row) for s in range(8) for row in data.train_batch(s)["inputs"])
    assert sum(text.count(w) for w in ("def ", "self", "import ", "return", "    ")) > 10, text[:500]
    head = data.tokenizer.decode(np.asarray(data.train.tokens[:20000]))
    assert "import " in head or "def " in head
    # reused, not tokenised again
    restart()
    messages = []
    again = D.prepare(cfg, batch_size=4, seed=0, log=quiet(messages))
    assert not messages and again.cache_path == data.cache_path


# --- builtin:recall ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options", ["", "pairs=4,distance=20", "shuffle=1,pairs=6,distance=30", "pairs=26,distance=78"]
)
def test_recall_answers_are_in_the_input_at_the_stated_distance(options):
    from transformer.data.tokenizer import ByteTokenizer
    from transformer.synthetic import KEYS, VALUES, RecallTask

    task = RecallTask.parse(options)
    docs = task.documents("val")
    assert len(docs) == task.val_docs and docs == task.documents("val")  # deterministic
    assert not set(docs) & set(task.documents("train")[:200])
    tok = ByteTokenizer()
    for doc in docs[:50]:
        ids = tok.encode_batch([doc])[0]
        assert len(ids) == len(doc) == task.doc_tokens  # one token per character: positions are token positions
        pairs = [doc[3 * i : 3 * i + 2] for i in range(task.pairs)]
        assert len({p[0] for p in pairs}) == task.pairs and all(p[0] in KEYS and p[1] in VALUES for p in pairs)
        distances = []
        for predicting, answer in task.answers(doc):
            assert doc[predicting] == doc[answer - 1]  # the query names the key of that pair
            assert doc[predicting + 1] == doc[answer]  # and its answer is that pair's value
            assert ids[predicting + 1] == ids[answer]
            distances.append(predicting - answer)
        if task.shuffle:
            assert min(distances) >= task.distance
        else:
            assert distances == [task.distance] * task.pairs
        # nothing between the answer and the query repeats it as a pair: the answer is only reachable there
        start = 3 * task.pairs + task.filler
        assert set(doc[3 * task.pairs : start]) <= {"."}


def test_recall_through_the_data_pipeline(tmp_path):
    cfg = config("builtin:recall:pairs=4,distance=16,train_docs=300,val_docs=20", tmp_path / "cache", seq_len=32)
    data = D.prepare(cfg, 4, 0, log=lambda _: None)
    from transformer.synthetic import RecallTask

    task = RecallTask(pairs=4, distance=16, train_docs=300, val_docs=20)
    expected = "".join(d + "\x00" for d in task.documents("val"))  # each document followed by EOS
    stream = np.asarray(data.val.tokens)
    assert len(stream) == len(expected)
    text = bytes(int(t) for t in stream if t < 256).decode()
    assert text == "".join(task.documents("val"))


@pytest.mark.parametrize(
    "source, words",
    [
        ("builtin:recal", "unknown builtin corpus"),
        ("builtin:recall:pair=3", "unknown option 'pair=3'"),
        ("builtin:recall:pairs=x", "pairs must be an integer"),
        ("builtin:recall:pairs=8,distance=10", "distance must be >= 24"),
        ("builtin:recall:pairs=27", "pairs must be between 1 and 26"),
        ("builtin:stdlib:x", "takes no options"),
        ("builtin:seq2seq:max_len=x", "max_len must be an integer"),
        ("builtin:seq2seq:task=rot13", "task must be one of reverse, sort, copy"),
        ("builtin:seq2seq:min_len=5,max_len=3", "min_len <= max_len"),
        ("builtin:seq2seq:alphabet=2,max_len=3", "too few"),
        ("builtin:seq2seq:length=3", "unknown option 'length=3'"),
        # every option bounded (a million-letter max_len hung validation), each duplicate refused
        ("builtin:seq2seq:max_len=1000000", "max_len must be between 1 and 4096, got 1000000"),
        ("builtin:seq2seq:min_len=0", "min_len must be between 1 and 4096"),
        ("builtin:seq2seq:train_docs=100000000", "train_docs must be between 1 and 1000000"),
        ("builtin:seq2seq:val_docs=0", "val_docs must be between 1 and 1000000"),
        ("builtin:seq2seq:seed=-1", "seed must be between 0 and"),
        ("builtin:seq2seq:max_len=4096,train_docs=1000000", "max_len x (train_docs + val_docs) = 4,098,048,000"),
        ("builtin:seq2seq:task=sort,task=copy", "option 'task' is given twice"),
        ("builtin:recall:distance=1000000000", "distance must be between"),
        ("builtin:recall:train_docs=2000000", "train_docs must be between 1 and 1000000"),
        ("builtin:recall:seed=-3", "seed must be between 0 and"),
        ("builtin:recall:distance=100000,train_docs=1000000", "a document's tokens x (train_docs + val_docs)"),
        ("builtin:recall:pairs=2,pairs=3", "option 'pairs' is given twice"),
    ],
)
def test_bad_builtin_sources_are_config_errors(source, words):
    from transformer.config import ConfigError

    with pytest.raises(ConfigError) as e:
        DataConfig(source=source)
    assert e.value.key == "source" and words in str(e.value), str(e.value)


# --- reliability (issue 18): cache directory, permissions, rows without text, quiet errors --------


def test_a_cache_dir_that_is_a_file_or_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "src" / "a.jsonl", make_docs(40))
    source = f"files:{tmp_path / 'src'}"
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for cache in (blocker, blocker / "below"):
        message = one_line_error(D.prepare, config(source, cache, val_fraction=0.2), 4, 0, log=quiet())
        assert message.startswith("data.cache_dir:") and str(cache) in message

    def read_only(*a, **k):  # what a read-only directory does to a non-root user (root may write anyway)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(data_cache.tempfile, "mkstemp", read_only)
    message = one_line_error(D.prepare, config(source, tmp_path / "ro", val_fraction=0.2), 4, 0, log=quiet())
    assert message.startswith("data.cache_dir:") and "ro" in message and "not writable" in message


def test_a_read_only_cache_dir_holding_a_complete_cache_is_used(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "src" / "a.jsonl", make_docs(40))
    cfg = config(f"files:{tmp_path / 'src'}", tmp_path / "cache", val_fraction=0.2)
    D.prepare(cfg, 4, 0, log=quiet())

    def read_only(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(data_cache.tempfile, "mkstemp", read_only)
    assert D.prepare(cfg, 4, 0, log=quiet()).train.count >= 4  # a shared, pre-built cache needs no writes


def _deny(monkeypatch, blocked: Path):
    """Reads of `blocked` fail as they do for a non-root user after chmod 000 (root is never denied)."""
    real = os.scandir

    def scandir(path="."):
        if Path(os.fsdecode(path)).resolve() == blocked.resolve():
            raise PermissionError(13, "Permission denied", os.fsdecode(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)


@pytest.mark.parametrize("pattern", ["{d}", "{d}/*.jsonl", "{d}/**/*.jsonl", "{top}/**/*.jsonl"])
def test_an_unreadable_directory_is_permission_denied_not_no_file(tmp_path, monkeypatch, pattern):
    blocked = tmp_path / "top" / "locked"
    write_jsonl(blocked / "a.jsonl", make_docs(20))
    _deny(monkeypatch, blocked)
    source = "files:" + pattern.format(d=blocked, top=tmp_path / "top")
    message = one_line_error(D.prepare, config(source, tmp_path / "cache"), 4, 0, log=quiet())
    assert message.startswith("data.source:") and "permission denied" in message and str(blocked) in message


def test_an_unreadable_subdirectory_of_a_directory_source_is_not_skipped(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "src" / "a.jsonl", make_docs(20))
    write_jsonl(tmp_path / "src" / "more" / "b.jsonl", make_docs(20, seed=1))
    _deny(monkeypatch, tmp_path / "src" / "more")
    message = one_line_error(data_splits.load_splits, config(f"files:{tmp_path / 'src'}", tmp_path / "cache"))
    assert "permission denied" in message and str(tmp_path / "src" / "more") in message


def _rows(path: Path, rows: list[dict]) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"files:{path}"


def test_rows_without_text_are_dropped_and_reported(tmp_path):
    docs = make_docs(40)
    rows = [{"id": i} if i % 10 == 0 else {"text": None} if i % 10 == 5 else {"text": d} for i, d in enumerate(docs)]
    cfg = config(_rows(tmp_path / "src", rows), tmp_path / "cache", val_fraction=0.2)
    splits = data_splits.load_splits(cfg)
    kept = [d for i, d in enumerate(docs) if i % 5]
    assert sorted(texts(splits["train"]) + texts(splits["val"])) == sorted(kept)  # no empty documents
    for _ in range(2):  # reported when the cache is built and when it is reused
        messages: list[str] = []
        D.prepare(cfg, 4, 0, log=quiet(messages))
        (line,) = [m for m in messages if "without text" in m]
        assert "8 of 40 rows" in line and "'text'" in line and "data.text_field" in line


def test_mostly_missing_text_is_refused_naming_the_field(tmp_path):
    rows = [{"text": d} if i % 4 == 0 else {"body": d} for i, d in enumerate(make_docs(40))]
    message = one_line_error(data_splits.load_splits, config(_rows(tmp_path / "src", rows), tmp_path / "cache"))
    assert message.startswith("data.text_field:") and "'text'" in message and "30 of 40 rows" in message


@pytest.mark.parametrize("values", [[5, 6.5, 7], [5, "a text", None]], ids=["numbers", "mixed"])
def test_numbers_in_the_text_field_are_refused(tmp_path, values):
    rows = [{"text": values[i % len(values)]} for i in range(30)]
    message = one_line_error(data_splits.load_splits, config(_rows(tmp_path / "src", rows), tmp_path / "cache"))
    assert message.startswith("data.text_field:") and "'text'" in message and "not text" in message
    assert f"{30 if values[1] == 6.5 else 10} of 30 rows" in message


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_files_error_is_one_stderr_line(tmp_path, kind):
    """datasets' progress bars and schema warnings must not add lines to train.py's one-line error."""
    bad = tmp_path / "bad"
    bad.mkdir()
    if kind == "parquet":
        (bad / "a.parquet").write_bytes(b"this is not a parquet file" * 10)
    else:  # read for a while, then a broken line: the progress bar has been drawn by then
        (bad / "a.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + "{broken\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_DATASETS_CACHE=str(tmp_path / "hf"))
    out = subprocess.run(
        [sys.executable, "train.py", f"data.source=files:{bad}", f"data.cache_dir={tmp_path / 'cache'}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.source:" in lines[0] and "cannot read" in lines[0], out.stderr


# --- one large document: the split by position -----------------------------------------------------


def novel(n_bytes: int, seed: int = 0) -> str:
    """ASCII prose of about `n_bytes` (one character per byte token): sentences in lines, and
    paragraphs separated by blank lines."""
    rng = np.random.default_rng(seed)
    words = "the of and to in is was for on that with as by at from his her it an were are which".split()
    paragraphs, size = [], 0
    while size < n_bytes:
        lines = [" ".join(rng.choice(words, int(rng.integers(5, 15)))) + "." for _ in range(int(rng.integers(1, 6)))]
        paragraphs.append("\n".join(lines))
        size += len(paragraphs[-1]) + 2
    return "\n\n".join(paragraphs) + "\n"


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    """One ~1 MB .txt file: one document, which no hash split can divide."""
    path = tmp_path_factory.mktemp("novel") / "input.txt"
    path.write_text(novel(1 << 20))
    return path


def test_one_large_file_is_split_by_position_and_windows_never_overlap(big_file, tmp_path):
    text = big_file.read_text()
    cfg = config(f"files:{big_file}", tmp_path / "cache")  # the default val_fraction, 0.01
    data = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    assert data_splits.split_rule(cfg) == data_splits.POSITION and data.summary["split"] == data_splits.POSITION
    cut = len(text) - round(len(text) * cfg.val_fraction)
    np.testing.assert_array_equal(data.train.tokens, stream_of([text[:cut]]))
    np.testing.assert_array_equal(data.val.tokens, stream_of([text[cut:]]))
    assert data.summary["val_tokens"] / (data.summary["train_tokens"] + data.summary["val_tokens"]) == pytest.approx(
        0.01, abs=1e-4
    )
    # by position in the document: every training window reads [0, cut), every validation window [cut, end)
    T = cfg.seq_len
    train_ends = [k * T + T for k in range(data.train.count)]  # the last document position a window reads
    val_starts = [cut + k * T for k in data.val_window_ids]
    assert max(train_ends) <= cut and min(val_starts) >= cut  # position `cut` in the train stream is its EOS
    for k in (0, data.train.count - 1):
        window = data.train.batch(np.array([k]))["inputs"][0]
        assert bytes(window.astype(np.uint8)) == text[k * T : k * T + T].encode()
    for k in data.val_window_ids[[0, -1]]:
        window = data.val.batch(np.array([k]))["inputs"][0]
        assert bytes(window.astype(np.uint8)) == text[cut + k * T : cut + k * T + T].encode()


def test_a_multi_document_corpus_keeps_its_hash_split_and_cache_key(corpus, tmp_path):
    """The hash split of 120 documents at the default val_fraction puts 2.6x the asked share of the
    text into validation: within HASH_TOLERANCE, so kept, under the key it had before split rules."""
    cfg = config(corpus["source"], tmp_path / "cache")
    data = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    assert data_splits.split_rule(cfg) == data_splits.HASH and data.summary["split"] == data_splits.HASH
    rules = dict(text_field="text", train="train", val="validation", val_fraction=0.01)
    old_key = data_cache._digest(
        dict(
            version=2, source=data_splits.source_fingerprint(cfg), tokenizer=D.ByteTokenizer().fingerprint, split=rules
        )
    )
    assert data.cache_path.name == old_key == data_cache.cache_key(cfg, D.ByteTokenizer())
    val = [d for d in corpus["docs"] if data_splits._hash_fraction(d) < 0.01]
    np.testing.assert_array_equal(data.val.tokens, stream_of(val))


def test_uneven_documents_fall_back_to_position(tmp_path):
    """Three documents, one of them 97% of the text: no hash split gives val 1% of it."""
    docs = [novel(50_000, seed=1), "a short note on the side.", "another short note."]
    write_jsonl(tmp_path / "src" / "a.jsonl", docs)
    cfg = config(f"files:{tmp_path / 'src'}", tmp_path / "cache")
    splits = data_splits.load_splits(cfg)
    assert data_splits.split_rule(cfg) == data_splits.POSITION
    cuts = [len(d) - round(len(d) * 0.01) for d in docs]
    assert texts(splits["train"]) == [d[:c] for d, c in zip(docs, cuts)]
    assert texts(splits["val"]) == [d[c:] for d, c in zip(docs, cuts) if d[c:]]


def test_the_position_cache_is_found_without_reading_the_source(big_file, tmp_path, monkeypatch):
    cfg = config(f"files:{big_file}", tmp_path / "cache")
    first = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    assert json.loads((first.cache_path / "meta.json").read_text())["split"] == data_splits.POSITION
    assert (
        first.cache_path.name
        == data_cache.cache_key(cfg, D.ByteTokenizer(), data_splits.POSITION)
        != data_cache.cache_key(cfg, D.ByteTokenizer(), data_splits.HASH)
    )
    restart()
    monkeypatch.setattr(
        data_splits, "documents", lambda cfg: pytest.fail("read the source although its cache is complete")
    )
    messages = []
    second = D.prepare(cfg, batch_size=4, seed=0, log=quiet(messages))
    assert second.cache_path == first.cache_path and second.summary == first.summary and not messages


def test_the_startup_line_gives_sizes_rule_and_epochs(big_file, corpus, tmp_path):
    messages = []
    cfg = config(f"files:{big_file}", tmp_path / "cache", seq_len=64)
    data = D.prepare(cfg, batch_size=8, seed=0, log=quiet(messages), steps=100)
    (line,) = [m for m in messages if m.startswith("data: ")]
    s = data.summary
    assert f"train {s['train_tokens']:,} tokens (1 documents)" in line and f"val {s['val_tokens']:,} tokens" in line
    assert "split by position" in line and "repeats" not in line
    assert f"{100 * 8 * 64 / s['train_tokens']:.3g} epochs" in line
    messages.clear()
    small = config(corpus["source"], tmp_path / "cache", val_fraction=0.2)
    data = D.prepare(small, batch_size=8, seed=0, log=quiet(messages), steps=1000)
    (line,) = [m for m in messages if m.startswith("data: ")]
    epochs = 1000 * 8 * 16 / data.summary["train_tokens"]
    assert epochs > data_pipeline.REPEAT_WARNING and "split by content hash" in line and f"~{epochs:.0f} times" in line


def _tiny_cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_DATASETS_CACHE=str(tmp_path / "hf"))
    args = [
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=32",
        "data.val_windows=4",
        "model.d_model=32",
        "model.n_layers=1",
        "model.n_heads=2",
        "model.n_kv_heads=2",
        "train.batch_size=4",
        "train.steps=3",
        "train.eval_every=3",
        "checkpoint.every=3",
        "logging.every=1",
        "logging.progress=false",
        "logging.tensorboard=false",
        *overrides,
    ]
    cmd = [sys.executable, "train.py", *args, "--workdir", str(tmp_path / "run")]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_one_big_text_file_trains_and_validates_from_the_cli(big_file, tmp_path):
    from transformer import rundir

    out = _tiny_cli(tmp_path, f"data.source=files:{big_file}")
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [m for m in out.stdout.splitlines() if m.startswith("data: ")]
    assert "split by position" in line and "3 steps of 4 x 32 tokens" in line
    (start,) = [e for e in rundir.read_events(tmp_path / "run") if e["event"] == "start"]
    assert start["data"]["split"] == data_splits.POSITION and start["data"]["val_tokens"] > 0
    assert any("val_loss" in r and np.isfinite(r["val_loss"]) for r in rundir.read_metrics(tmp_path / "run"))


# --- data.document_separator -----------------------------------------------------------------------


def test_a_separator_turns_a_file_into_documents(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("first line\nsame paragraph\n\nsecond\n\n\n\nthird\n\n  \n\nfourth\n")
    splits = data_splits.load_splits(
        config(f"files:{tmp_path / 'src'}", tmp_path / "cache", document_separator="\n\n", val_fraction=0.5)
    )
    # empty and whitespace-only pieces are left out, the others kept verbatim
    expected = ["first line\nsame paragraph", "second", "third", "fourth\n"]
    assert sorted(texts(splits["train"]) + texts(splits["val"])) == sorted(expected)
    whole = data_splits.load_splits(config(f"files:{tmp_path / 'src'}", tmp_path / "cache2", val_fraction=0.2))
    assert len(whole["train"]) == len(whole["val"]) == 1  # without it, one document (split by position)


def test_separated_documents_get_eos_and_document_masks(big_file, tmp_path):
    paragraphs = [p for p in big_file.read_text().split("\n\n") if p.strip()]
    cfg = config(f"files:{big_file}", tmp_path / "cache", document_separator="\n\n", document_mask=True, seq_len=64)
    data = D.prepare(cfg, batch_size=8, seed=0, log=quiet())
    assert data.summary["split"] == data_splits.HASH  # thousands of documents now: the hash split works
    val = [p for p in paragraphs if data_splits._hash_fraction(p) < cfg.val_fraction]
    np.testing.assert_array_equal(data.train.tokens, stream_of([p for p in paragraphs if p not in set(val)]))
    np.testing.assert_array_equal(data.val.tokens, stream_of(val))
    assert data.summary["train_documents"] + data.summary["val_documents"] == len(paragraphs)
    for batch in [data.train_batch(s) for s in range(4)] + data.val_batches(8):
        inputs, seg, pos = batch["inputs"], batch["segment_ids"], batch["positions"]
        after_eos = inputs[:, :-1] == EOS
        assert after_eos.any()  # paragraphs are shorter than a window
        # a new segment (attention never reaches back across it) exactly after each EOS
        np.testing.assert_array_equal(np.diff(seg, axis=1), after_eos.astype(np.int32))
        np.testing.assert_array_equal(np.where(after_eos, 0, pos[:, :-1] + 1), pos[:, 1:])
        for row, ids in zip(inputs, seg):  # each segment is one paragraph, or a piece of one, plus its EOS
            for s in np.unique(ids):
                piece = bytes(row[(ids == s) & (row != EOS)].astype(np.uint8)).decode()
                assert "\n\n" not in piece


def test_the_separator_is_part_of_the_cache_key(corpus, tmp_path):
    keys = {
        data_cache.cache_key(
            config(corpus["source"], tmp_path / "c", document_separator=s, val_fraction=0.2), D.ByteTokenizer()
        )
        for s in (None, "\n\n", ": ")
    }
    assert len(keys) == 3


# --- data.val_source -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    root = tmp_path_factory.mktemp("other")
    docs = make_docs(40, seed=7)
    write_jsonl(root / "other.jsonl", docs)
    return dict(source=f"files:{root / 'other.jsonl'}", docs=docs)


def test_val_source_validates_as_the_sources_own_validation_split_would(corpus, other, tmp_path):
    cfg = config(corpus["source"], tmp_path / "cache", val_source=other["source"], val_windows=16)
    data = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    assert data_splits.split_rule(cfg) == data_splits.VAL_SOURCE and data.summary["split"] == data_splits.VAL_SOURCE
    np.testing.assert_array_equal(data.train.tokens, stream_of(corpus["docs"]))  # all of it trains
    np.testing.assert_array_equal(data.val.tokens, stream_of(other["docs"]))
    # the same as a source whose own validation split is the other corpus: the same val batches, so
    # the same val loss for the same parameters
    save_dict(tmp_path / "dd", train=corpus["docs"], validation=other["docs"])
    own = D.prepare(config(f"files:{tmp_path / 'dd'}", tmp_path / "cache", val_windows=16), 4, 0, log=quiet())
    assert own.summary["split"] == data_splits.SOURCE
    for a, b in zip(data.val_batches(4), own.val_batches(4), strict=True):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_val_source_uses_the_runs_tokenizer_trained_on_the_training_source(bpe_corpus, other, tmp_path):
    cfg = config(bpe_corpus["source"], tmp_path / "cache", tokenizer="bpe", vocab_size=320, val_source=other["source"])
    data = D.prepare(cfg, batch_size=4, seed=0, log=quiet())
    tok, eos = data.tokenizer, data.tokenizer.eos_id
    expected = np.concatenate([np.append(ids, eos) for ids in tok.encode_batch(other["docs"])])
    np.testing.assert_array_equal(data.val.tokens, expected)
    # trained on the training source only: another val source gives the same tokenizer
    again = config(
        bpe_corpus["source"],
        tmp_path / "cache2",
        tokenizer="bpe",
        vocab_size=320,
        val_source=f"files:{tmp_path}/none.jsonl",
    )
    write_jsonl(tmp_path / "none.jsonl", make_docs(30, seed=3))
    assert D.prepare(again, 4, 0, log=quiet()).tokenizer.fingerprint == tok.fingerprint


def test_val_source_takes_its_validation_split_when_it_has_one(corpus, exact, tmp_path):
    data = D.prepare(config(corpus["source"], tmp_path / "cache", val_source=exact["source"]), 4, 0, log=quiet())
    np.testing.assert_array_equal(data.val.tokens, stream_of(exact["val"]))


def test_a_bad_val_source_is_one_line_naming_it(corpus, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    write_jsonl(tmp_path / "short.jsonl", ["tiny"])
    cases = {
        f"files:{tmp_path}/missing/*.txt": "matches no file",
        f"files:{tmp_path / 'empty'}": "is empty",
        f"files:{tmp_path / 'short.jsonl'}": "fewer than one window",
    }
    for source, words in cases.items():
        restart()
        message = one_line_error(
            D.prepare, config(corpus["source"], tmp_path / "cache", val_source=source), 4, 0, log=quiet()
        )
        assert message.startswith(f"data.val_source: {source}") and words in message, message


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, key",
    [
        ("data.val_source=files:/no/such/dir/*.txt", "data.val_source:"),
        ('data.document_separator=""', "data.document_separator:"),
    ],
)
def test_bad_new_data_keys_exit_2_in_one_line(override, key, tmp_path):
    out = _tiny_cli(tmp_path, override)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], out.stderr


# --- mixtures --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weights", [(0.7, 0.3), (0.5, 0.3, 0.2), (0.01, 0.99), (1, 1, 1), (0.123, 0.0, 0.877), (5, 3, 1, 1)]
)
def test_mixture_proportions_over_any_1000_steps_are_within_1_percent(weights):
    """The assignment rule alone (pure numpy): any 1,000 consecutive steps of 16 rows, wherever they
    start (periods of the schedule included), hold each source's weight to within 1%; and every
    prefix of rows is within three rows of its share of the rounded weights (quota / period, within
    1 / period of the weights)."""
    schedule = data_batches.Schedule.of(list(weights))
    w = np.asarray(weights) / sum(weights)
    B, steps = 16, 1000
    for start in (0, 1, 777, 1023, 50_000, 10**7 + 3):
        source, _ = schedule.locate(np.arange(start * B, (start + steps) * B))
        share = np.bincount(source, minlength=len(w)) / (steps * B)
        assert np.abs(share - w).max() < 0.01, (start, share, w)
    rounded = schedule.quota / data_batches.MIXTURE_PERIOD
    assert np.abs(rounded - w).max() <= 1 / data_batches.MIXTURE_PERIOD
    source, _ = schedule.locate(np.arange(5 * data_batches.MIXTURE_PERIOD))
    counts = np.cumsum(np.eye(len(w))[source], axis=0)
    ideal = np.arange(1, len(source) + 1)[:, None] * rounded
    assert np.abs(counts - ideal).max() < 3


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.3, 0.2)])
def test_each_source_reads_its_own_stream_without_gap_or_repeat(weights):
    """Row k's index in its source's stream is the number of rows given to that source before k."""
    source, index = data_batches.Schedule.of(list(weights)).locate(np.arange(3 * data_batches.MIXTURE_PERIOD + 100))
    for j in range(len(weights)):
        np.testing.assert_array_equal(index[source == j], np.arange((source == j).sum()))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three small .jsonl sources of different sizes (the last small enough to repeat)."""
    root = tmp_path_factory.mktemp("mixture")
    for name, n, seed in (("code", 200, 1), ("prose", 150, 2), ("tiny", 30, 3)):
        write_jsonl(root / f"{name}.jsonl", make_docs(n, seed))
    return root


def mixture(root: Path, cache: Path, weights=(("code", 0.5), ("prose", 0.3), ("tiny", 0.2)), **kw) -> DataConfig:
    from transformer.config import MixtureEntry

    entries = tuple(MixtureEntry(f"files:{root / name}.jsonl", w, name) for name, w in weights)
    kw.setdefault("seq_len", 16)
    return DataConfig(mixture=entries, cache_dir=str(cache), **kw)


def test_mixture_batch_i_is_the_same_after_a_rebuild_and_across_process_splits(sources, tmp_path):
    cfg = mixture(sources, tmp_path)
    first = D.prepare(cfg, 8, seed=3, log=quiet())
    before = {i: first.train_batch(i) for i in (0, 1, 57, 400)}
    restart()  # a resumed run: a new process builds its Data again
    again = D.prepare(cfg, 8, seed=3, log=quiet())
    for i, batch in before.items():
        halves = [again.train_batch(i, p, 2) for p in range(2)]
        for key, value in batch.items():
            np.testing.assert_array_equal(again.train_batch(i)[key], value)
            np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), value)
    other = D.prepare(cfg, 8, seed=4, log=quiet())
    assert not np.array_equal(other.train_batch(0)["inputs"], before[0]["inputs"])


def test_mixture_rows_are_their_sources_windows(sources, tmp_path):
    cfg = mixture(sources, tmp_path, document_mask=True)
    data = D.prepare(cfg, 8, seed=0, log=quiet())
    assert [p.name for p in data.parts] == ["code", "prose", "tiny"]
    assert [p.weight for p in data.parts] == pytest.approx([0.5, 0.3, 0.2])
    source, windows = data.sampler.locate(5)
    batch = data.train_batch(5)
    for r, (j, w) in enumerate(zip(source, windows)):
        own = data.parts[j].data.train.batch(np.asarray([w]))
        for key in ("inputs", "targets", "segment_ids", "positions"):
            np.testing.assert_array_equal(batch[key][r], own[key][0])
    # the anomaly event's window ids: the sources' windows laid end to end
    offsets = np.cumsum([0] + [p.data.train.count for p in data.parts[:-1]])
    np.testing.assert_array_equal(data.sampler.window_ids(5), offsets[source] + windows)


def test_mixture_sources_share_caches_with_single_source_runs(sources, tmp_path):
    """A source of a mixture is tokenised once, into the cache a run of that source alone uses."""
    data = D.prepare(mixture(sources, tmp_path), 8, seed=0, log=quiet())
    alone = D.prepare(config(f"files:{sources / 'prose'}.jsonl", tmp_path), 8, seed=0, log=quiet())
    assert data.parts[1].data.cache_path == alone.cache_path


def test_mixture_startup_line_gives_each_source_and_warns_of_repeats(sources, tmp_path):
    messages: list[str] = []
    data = D.prepare(mixture(sources, tmp_path), 8, seed=0, log=quiet(messages), steps=2000)
    (line,) = [m for m in messages if m.startswith("data: a mixture")]
    for part in data.parts:
        s = part.data.summary
        assert f"{part.name} (" in line and f"train {s['train_tokens']:,} tokens" in line
    # tiny: 2000 steps x 8 rows x 0.2 x 16 tokens over ~3k tokens is ~17 epochs; code ~1.4
    assert line.count("expect memorisation") == 1 and "tiny" in line.split("expect memorisation")[0].rsplit(";", 1)[-1]
    assert set(data.summary["sources"]) == {"code", "prose", "tiny"}
    assert data.summary["train_tokens"] == sum(p.data.summary["train_tokens"] for p in data.parts)


def test_a_mixture_entry_with_a_bad_source_names_its_key(sources, tmp_path):
    weights = (("code", 0.5), ("missing", 0.5))
    message = one_line_error(D.prepare, mixture(sources, tmp_path, weights), 8, 0, log=quiet())
    assert message.startswith("data.mixture[1].source:") and "matches no file" in message


def test_a_mixture_bpe_is_trained_on_all_sources(tmp_path):
    root = tmp_path / "src"
    write_jsonl(root / "a.jsonl", ["zebra quokka " * 40] * 20)
    write_jsonl(root / "b.jsonl", ["lorem ipsum " * 40] * 20)
    cfg = mixture(root, tmp_path / "cache", (("a", 0.9), ("b", 0.1)), tokenizer="bpe", vocab_size=300)
    data = D.prepare(cfg, 4, seed=0, log=quiet())
    assert [len(ids) for ids in data.tokenizer.encode_batch([" quokka", " ipsum"])] == [1, 1]
    assert {p.data.tokenizer.fingerprint for p in data.parts} == {data.tokenizer.fingerprint}


def test_per_source_val_losses_equal_evaluating_each_source_alone(sources, tmp_path):
    import jax

    from transformer import sharding
    from transformer.config_loader import load_config
    from transformer.train.trainer import Trainer
    from transformer.train.validation import validation_metrics

    mixed = mixture(sources, tmp_path, val_windows=6)
    data = D.prepare(mixed, 4, seed=0, log=quiet())
    tiny = ["model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.ffn_multiple=16", "data.seq_len=16"]
    cfg = load_config(None, [*tiny, "train.batch_size=4"]).with_vocab(data.vocab_size)
    trainer = Trainer(cfg, sharding.make_mesh(cfg, jax.devices()[:1]))
    params = trainer.init(jax.random.key(0)).params
    result = validation_metrics(trainer, params, data)
    for i, part in enumerate(data.parts):
        alone = D.prepare(mixed.mixture_source(i), 4, seed=0, log=quiet())
        own = validation_metrics(trainer, params, alone)
        assert result[f"val/{part.name}/loss"] == pytest.approx(own["val_loss"], rel=1e-6)
        assert result[f"val/{part.name}/bits_per_byte"] == pytest.approx(own["val_bits_per_byte"], rel=1e-6)
    total = sum(p.weight * result[f"val/{p.name}/loss"] for p in data.parts)
    assert result["val_loss"] == pytest.approx(total)


@pytest.mark.slow
def test_a_mixture_run_writes_per_source_validation_metrics(sources, tmp_path):
    from transformer import rundir

    entries = f"[{{source: 'files:{sources}/code.jsonl', weight: 0.7, name: code}}, {{source: 'files:{sources}/prose.jsonl', weight: 0.3, name: prose}}]"
    tiny = ["model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.ffn_multiple=16", "data.seq_len=16"]
    result = subprocess.run(
        [sys.executable, "train.py", f"data.mixture={entries}", f"data.cache_dir={tmp_path / 'cache'}", *tiny]
        + ["data.val_windows=4", "train.batch_size=4", "train.steps=3", "train.eval_every=3", "optim.warmup_steps=1"]
        + ["logging.progress=false", "--workdir", str(tmp_path / "run")],
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "data: a mixture of 2 sources" in result.stdout
    (last,) = [r for r in rundir.read_metrics(tmp_path / "run") if "val_loss" in r]
    for name in ("code", "prose"):
        assert np.isfinite(last[f"val/{name}/loss"]) and np.isfinite(last[f"val/{name}/bits_per_byte"])
    assert last["val_loss"] == pytest.approx(0.7 * last["val/code/loss"] + 0.3 * last["val/prose/loss"])


def _mixture_run(directory: Path, name: str, lr: float, records: list[dict]) -> None:
    """A finished run directory as the trainer writes it, with the given metric records."""
    from transformer.config_loader import from_dict

    run = directory / name
    run.mkdir(parents=True)
    model = {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2}
    cfg = from_dict({"model": model, "optim": {"lr": lr}, "train": {"steps": len(records)}})
    (run / "config.yaml").write_text(cfg.to_yaml())
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **r}) + "\n" for s, r in enumerate(records, 1)))
    (run / "events.jsonl").write_text(
        json.dumps({"event": "start", "step": 0}) + "\n" + json.dumps({"event": "end", "step": len(records)}) + "\n"
    )


def test_the_report_has_a_column_per_mixture_source(tmp_path):
    from transformer.report import build
    from transformer.report.render import table

    def val(code: float, prose: float) -> dict:
        return {"loss": 3.0, "val_loss": 0.5 * (code + prose), "val/code/loss": code, "val/prose/loss": prose}

    _mixture_run(tmp_path, "a", 0.001, [val(2.0, 3.0), val(1.5, 2.5)])
    _mixture_run(tmp_path, "b", 0.002, [val(1.7, 2.9), val(1.9, 2.1)])
    report = build(tmp_path)
    assert report.summaries["a"].best_val_by_source == {"code": 1.5, "prose": 2.5}
    header, rows = table(report)
    assert header[-3:] == ["best val code", "best val prose", "diverged"]
    first, second = sorted(rows)
    assert first[header.index("best val code")] == "1.5000" and first[header.index("best val prose")] == "2.5000"
    assert second[header.index("best val code")] == "1.7000" and second[header.index("best val prose")] == "2.1000"


def test_the_report_has_no_source_columns_without_a_mixture(tmp_path):
    from transformer.report import build
    from transformer.report.render import COLUMNS, table

    for lr in (0.001, 0.002):
        _mixture_run(tmp_path, f"r{lr}", lr, [{"loss": 3.0, "val_loss": 2.0}])
    header, _ = table(build(tmp_path))
    assert not any(h.startswith("best val ") and h not in {c[0] for c in COLUMNS} for h in header)
