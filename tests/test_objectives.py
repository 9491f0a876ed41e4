"""Training objectives (transformer/data/objectives.py): MLM masking, T5 span corruption, input/target pairs,
the extra ids after the tokenizer's vocabulary, and their batches through the data pipeline."""

import json
from pathlib import Path

import numpy as np
import pytest

from transformer import data as D
from transformer.config import DataConfig
from transformer.data import objectives as O
from transformer.data import splits as data_splits
from transformer.data.tokenizer import ByteTokenizer
from transformer.synthetic import Seq2seqTask

BOS, EOS, PAD = 256, 257, 258
MLM_KEYS = dict(mask_rate=0.15, mask_token_fraction=0.8, random_token_fraction=0.1)
SPAN_KEYS = dict(noise_density=0.15, mean_span_length=3.0)
RECALL = "builtin:recall:pairs=4,distance=16,train_docs=300,val_docs=40"


pytestmark = pytest.mark.usefixtures("private_hf_cache")


def prepare(tmp_path: Path, source: str = RECALL, batch_size: int = 4, seed: int = 0, **kw) -> D.Data:
    kw.setdefault("seq_len", 32)
    cfg = DataConfig(source=source, cache_dir=str(tmp_path / "cache"), **kw)
    return D.prepare(cfg, batch_size, seed, log=lambda _: None)


def span(seq_len: int, density: float, mean: float) -> O.SpanCorruption:
    cfg = DataConfig(seq_len=seq_len, objective="span", noise_density=density, mean_span_length=mean)
    objective = O.make_objective(cfg, ByteTokenizer())
    assert isinstance(objective, O.SpanCorruption)
    return objective


# --- extra ids -----------------------------------------------------------------------------------


def test_extra_ids_follow_the_tokenizer_and_render_as_text():
    vocab = O.Vocab(ByteTokenizer(), n_mask=1, n_sentinels=3)
    assert (vocab.mask_id, vocab.sentinel_ids, vocab.size) == (259, (260, 261, 262), 263)
    ids = vocab.encode("a<mask>é<extra_id_2>")
    assert ids == [97, 259, *"é".encode(), 262]
    assert vocab.decode(ids) == "a<mask>é<extra_id_2>"
    assert O.Vocab(ByteTokenizer()).encode("a<mask>") == list(b"a<mask>")  # no mask token: plain text


def test_data_vocab_size_counts_the_objectives_extra_ids(tmp_path):
    assert prepare(tmp_path).vocab_size == 259  # causal: the tokenizer's alone
    mlm = prepare(tmp_path, objective="mlm", **MLM_KEYS)
    assert mlm.vocab_size == 260 and mlm.vocab.mask_id == 259
    spans = prepare(tmp_path, objective="span", **SPAN_KEYS)
    assert spans.vocab_size == 259 + len(spans.vocab.sentinel_ids) == 259 + spans.objective.counts[1]


# --- span corruption -----------------------------------------------------------------------------


def test_t5_lengths():
    """T5's own figures: 568 raw tokens make 512 encoder tokens and 114 decoder tokens."""
    s = span(512, 0.15, 3.0)
    assert (s.window_len, s.encoder_len, s.decoder_len) == (568, 512, 114)


@pytest.mark.parametrize("density, mean", [(0.15, 3.0), (0.1, 1.0), (0.3, 2.5), (0.5, 5.0), (0.05, 8.0)])
@pytest.mark.parametrize("seq_len", [7, 32, 100])
def test_span_corruption_round_trips_and_has_fixed_lengths(density, mean, seq_len):
    s = span(seq_len, density, mean)
    noise, spans = s.counts
    longer = O.SpanCorruption(s.vocab, s.window_len + 1, density, mean)
    assert s.encoder_len <= seq_len < longer.encoder_len  # the longest raw window that fits
    sentinels = np.asarray(s.vocab.sentinel_ids)
    rng = np.random.default_rng(0)
    for row in range(50):
        tokens = rng.integers(0, 256, s.window_len)
        encoder, targets = s.corrupt_row(tokens, O.row_rng(np.asarray([7, row])))
        assert (len(encoder), len(targets)) == (s.encoder_len, s.decoder_len)
        assert encoder[-1] == targets[-1] == EOS
        np.testing.assert_array_equal(encoder[np.isin(encoder, sentinels)], sentinels)  # each once, in order
        np.testing.assert_array_equal(targets[np.isin(targets, sentinels)], sentinels)
        assert targets[0] == sentinels[0]
        np.testing.assert_array_equal(s.restore(encoder, targets), tokens)
        assert len(targets) - spans - 1 == noise == min(max(round(s.window_len * density), 1), s.window_len - 1)


def test_span_batches_through_the_pipeline(tmp_path):
    data = prepare(tmp_path, objective="span", **SPAN_KEYS)
    s = data.objective
    assert isinstance(s, O.SpanCorruption)
    batch = data.train_batch(5)
    raw = data.train.batch(data.sampler.window_ids(5))["inputs"]
    assert batch["encoder_inputs"].shape == (4, s.encoder_len) and batch["targets"].shape == (4, s.decoder_len)
    for b in range(4):
        np.testing.assert_array_equal(s.restore(batch["encoder_inputs"][b], batch["targets"][b]), raw[b])
    np.testing.assert_array_equal(batch["inputs"][:, 0], BOS)
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert (batch["weights"] == 1).all()
    assert all(v.dtype == (np.float32 if k == "weights" else np.int32) for k, v in batch.items())


def test_span_corruption_refuses_a_window_too_short(tmp_path):
    with pytest.raises(D.DataError) as e:
        prepare(tmp_path, seq_len=2, objective="span", **SPAN_KEYS)
    assert str(e.value) == "data.seq_len: 2 is too short for span corruption (at least 3)"


# --- masked LM -----------------------------------------------------------------------------------


def test_mlm_weights_exactly_the_chosen_tokens(tmp_path):
    data = prepare(tmp_path, objective="mlm", **MLM_KEYS)
    for step in (0, 3):
        batch = data.train_batch(step)
        original = data.train.batch(data.sampler.window_ids(step))["inputs"]
        np.testing.assert_array_equal(batch["targets"], original)
        chosen = batch["weights"] == 1
        assert set(np.unique(batch["weights"])) <= {0.0, 1.0}
        assert not (batch["inputs"] != original)[~chosen].any()  # unchosen tokens untouched
        assert not np.isin(original[chosen], [BOS, EOS, PAD]).any()
        eligible = (~np.isin(original, [BOS, EOS, PAD])).sum(1)
        np.testing.assert_array_equal(chosen.sum(1), np.maximum(1, np.round(0.15 * eligible)))
        layout = O.document_layout(original, EOS)
        for k in ("segment_ids", "positions"):
            np.testing.assert_array_equal(batch[k], layout[k])


def test_mlm_replacement_proportions():
    mlm = O.MaskedLM(O.Vocab(ByteTokenizer(), n_mask=1), 64, 0.15, 0.8, 0.1)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (3000, 64)).astype(np.int32)
    mask = random = kept = 0
    for b in range(len(tokens)):
        chosen, replaced = mlm.corrupt_row(tokens[b], O.row_rng(np.asarray([1, b])))
        mask += int((replaced == 259).sum())
        kept += int((replaced == tokens[b, chosen]).sum())
        random += int(((replaced != 259) & (replaced != tokens[b, chosen])).sum())
        assert ((replaced < 256) | (replaced == 259)).all()  # random replacements are ordinary tokens
    total = mask + random + kept
    assert total == 3000 * round(0.15 * 64)
    # a random replacement equals the original one time in 256: counted as kept
    expected = (0.8, 0.1 * 255 / 256, 0.1 + 0.1 / 256)
    for got, want in zip((mask / total, random / total, kept / total), expected):
        assert abs(got - want) < 0.015, (got, want)


def test_mlm_randomness_is_a_function_of_seed_step_and_row(tmp_path):
    data = prepare(tmp_path, objective="mlm", **MLM_KEYS)
    data_splits._load_splits.cache_clear()
    again = prepare(tmp_path, objective="mlm", **MLM_KEYS)
    for step in (0, 9):
        first, second = data.train_batch(step), again.train_batch(step)
        for k in first:
            np.testing.assert_array_equal(first[k], second[k], err_msg=k)
        halves = [data.train_batch(step, p, 2) for p in range(2)]  # each process its rows of the global batch
        for k in first:
            np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), first[k], err_msg=k)
    # the same window at another step or seed is masked differently
    mlm = data.objective
    assert isinstance(mlm, O.MaskedLM)
    window = data.train.batch(np.arange(1))
    picks = {
        tuple(mlm.batch(data.train, np.arange(1), O.train_keys(seed, step, np.arange(1)))["weights"][0].nonzero()[0])
        for seed, step in ((0, 0), (0, 1), (1, 0))
    }
    assert len(picks) == 3 and len(window["inputs"][0]) == 32


def test_validation_corruption_is_fixed_per_window(tmp_path):
    """Whatever the run's seed or evaluation batch size, every evaluation sees the same batches."""
    a = prepare(tmp_path, objective="mlm", seed=0, **MLM_KEYS)
    b = prepare(tmp_path, objective="mlm", seed=5, **MLM_KEYS)
    by_four, by_three = a.val_batches(4), b.val_batches(3)
    n = len(a.val_window_ids)
    for k in by_four[0]:
        rows_four = np.concatenate([x[k] for x in by_four])[:n]
        rows_three = np.concatenate([x[k] for x in by_three])[:n]
        np.testing.assert_array_equal(rows_four, rows_three, err_msg=k)
    padded = np.concatenate([x["weights"] for x in by_three])[n:]
    assert (padded == 0).all() and np.concatenate([x["weights"] for x in by_three])[:n].sum() > 0


# --- the seq2seq task and pair batches -----------------------------------------------------------


@pytest.mark.parametrize("task", ["reverse", "sort", "copy"])
def test_seq2seq_task_answers_and_splits(task):
    t = Seq2seqTask(task=task, train_docs=2000, val_docs=200, min_len=1, max_len=6, alphabet=4)
    inputs, targets = t.pairs("train")
    answer = {"reverse": lambda s: s[::-1], "sort": lambda s: "".join(sorted(s)), "copy": lambda s: s}[task]
    assert all(target == answer(text) for text, target in zip(inputs, targets))
    assert {len(s) for s in inputs} == set(range(1, 7)) and set("".join(inputs)) == set("abcd")
    val_inputs, _ = t.pairs("val")
    assert len(val_inputs) == 200 and not set(val_inputs) & set(inputs)
    assert t.pairs("val") == (val_inputs, [answer(s) for s in val_inputs])  # a pure function of the fields


def expected_pair(text: str, target: str, seq_len: int, target_len: int) -> tuple[list[int], list[int]]:
    """The contract's pair tokens, from the strings: input cut to seq_len, target to target_len - 1 + EOS."""
    return list(text.encode())[:seq_len], list(target.encode())[: target_len - 1] + [EOS]


def pair_strings(data: D.Data, ids: np.ndarray) -> list[tuple[str, str]]:
    inputs, targets = data.train.pairs(ids)
    return [(bytes(i.tolist()).decode(), bytes(t.tolist()).decode()) for i, t in zip(inputs, targets)]


SEQ2SEQ = "builtin:seq2seq:min_len=1,max_len=12,train_docs=400,val_docs=30"


def test_seq2seq_batches_follow_the_contract(tmp_path):
    data = prepare(tmp_path, SEQ2SEQ, seq_len=8, objective="seq2seq", target_len=6)
    batch, ids = data.train_batch(2), data.sampler.window_ids(2)
    assert batch["encoder_inputs"].shape == (4, 8) and batch["targets"].shape == (4, 6)
    for b, (text, target) in enumerate(pair_strings(data, ids)):
        assert target == text[::-1]
        source, wanted = expected_pair(text, target, 8, 6)
        n, m = len(source), len(wanted)
        np.testing.assert_array_equal(batch["encoder_inputs"][b], source + [PAD] * (8 - n))
        np.testing.assert_array_equal(batch["encoder_segment_ids"][b], [1] * n + [0] * (8 - n))
        np.testing.assert_array_equal(batch["targets"][b], wanted + [PAD] * (6 - m))
        np.testing.assert_array_equal(batch["inputs"][b], [BOS] + wanted[:-1] + [PAD] * (6 - m))
        np.testing.assert_array_equal(batch["weights"][b], [1.0] * m + [0.0] * (6 - m))
        np.testing.assert_array_equal(batch["segment_ids"][b], [1] * m + [0] * (6 - m))


def test_prefix_batches_follow_the_contract(tmp_path):
    data = prepare(tmp_path, SEQ2SEQ, seq_len=8, objective="prefix", target_len=6)
    batch, ids = data.train_batch(2), data.sampler.window_ids(2)
    assert batch["inputs"].shape == (4, 14)
    for b, (text, target) in enumerate(pair_strings(data, ids)):
        source, wanted = expected_pair(text, target, 8, 6)
        row = source + [BOS] + wanted
        pad = 15 - len(row)
        np.testing.assert_array_equal(batch["inputs"][b], row[:-1] + [PAD] * pad)
        np.testing.assert_array_equal(batch["targets"][b], row[1:] + [PAD] * pad)
        weighted = batch["targets"][b][batch["weights"][b] == 1]
        np.testing.assert_array_equal(weighted, wanted)  # the target and its EOS, nothing else
        assert batch["weights"][b][: len(source)].sum() == 0


def test_seq2seq_validation_pairs_are_fixed_and_weighted(tmp_path):
    data = prepare(tmp_path, SEQ2SEQ, seq_len=16, objective="seq2seq")
    batches = data.val_batches(8)
    assert sum(len(b["targets"]) for b in batches) == 32 and len(data.val_window_ids) == 30
    weights = np.concatenate([b["weights"] for b in batches])
    assert weights[30:].sum() == 0
    np.testing.assert_array_equal(weights[:30], np.concatenate([b["segment_ids"] for b in batches])[:30])
    assert data.val_bytes_per_token == pytest.approx(
        sum(len(t) for t in Seq2seqTask(min_len=1, max_len=12, train_docs=400, val_docs=30).pairs("val")[1])
        / sum(len(t) + 1 for t in Seq2seqTask(min_len=1, max_len=12, train_docs=400, val_docs=30).pairs("val")[1])
    )


def test_cut_pairs_are_counted_in_the_log(tmp_path):
    messages: list[str] = []
    cfg = DataConfig(source=SEQ2SEQ, cache_dir=str(tmp_path / "c"), seq_len=4, objective="seq2seq", target_len=3)
    D.prepare(cfg, 4, 0, log=messages.append)
    lengths = [len(s) for s in Seq2seqTask(min_len=1, max_len=12, train_docs=400, val_docs=30).pairs("train")[0]]
    line = next(m for m in messages if "training pairs" in m)
    assert (
        f"{sum(n > 4 for n in lengths):,} inputs are cut" in line and f"{sum(n > 2 for n in lengths):,} targets" in line
    )


# --- pairs from files ----------------------------------------------------------------------------


def write_pairs(path: Path, n: int) -> str:
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        text = "".join(rng.choice(list("xyzw"), int(rng.integers(1, 9))))
        rows.append({"id": i, "src": f"{i}:{text}", "tgt": text.upper()})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"files:{path}"


def test_pairs_from_a_jsonl_file(tmp_path):
    source = write_pairs(tmp_path / "pairs.jsonl", 300)
    with open(tmp_path / "pairs.jsonl", "a") as f:
        f.write(json.dumps({"id": 300, "src": "no target", "tgt": None}) + "\n")
    messages: list[str] = []
    cfg = DataConfig(
        source=source,
        cache_dir=str(tmp_path / "cache"),
        seq_len=16,
        objective="seq2seq",
        input_field="src",
        target_field="tgt",
        val_fraction=0.1,
    )
    data = D.prepare(cfg, 4, 0, log=messages.append)
    assert any("1 of 301 rows" in m and "('src', 'tgt')" in m for m in messages), messages
    train = pair_strings(data, np.arange(data.train.count))
    val_in, _ = data.val.pairs(np.arange(data.val.count))
    assert data.train.count + data.val.count == 300 and data.val.count > 0
    assert all(target == text.partition(":")[2].upper() for text, target in train)
    assert not {bytes(v.tolist()).decode() for v in val_in} & {text for text, _ in train}
    batch = data.train_batch(0)
    assert set(batch) >= {"encoder_inputs", "encoder_segment_ids", "inputs", "targets", "weights"}


def test_a_missing_pair_field_names_the_key_and_the_fields(tmp_path):
    source = write_pairs(tmp_path / "pairs.jsonl", 50)
    with pytest.raises(D.DataError) as e:
        prepare(tmp_path, source, objective="seq2seq", input_field="source", target_field="tgt")
    message = str(e.value)
    assert (
        message.startswith("data.input_field: 'source' is not a field of files:")
        and "(fields: id, src, tgt)" in message
    )
    assert "\n" not in message


@pytest.mark.parametrize(
    "kw",
    [
        dict(objective="causal", document_mask=True),
        dict(objective="mlm", **MLM_KEYS),
        dict(objective="span", **SPAN_KEYS),
        dict(source=SEQ2SEQ, objective="seq2seq", target_len=6),
        dict(source=SEQ2SEQ, objective="prefix"),
    ],
)
def test_example_batch_has_the_real_batchs_keys_shapes_and_dtypes(tmp_path, kw):
    """What preflight compiles for, reckoned without the data, and the vocabulary likewise."""
    data = prepare(tmp_path, **kw)
    cfg = DataConfig(**{"source": RECALL, "seq_len": 32, **kw})
    real, example = data.train_batch(0), D.example_batch(cfg)
    assert {k: (v.shape[1:], v.dtype) for k, v in example.items()} == {
        k: (v.shape[1:], v.dtype) for k, v in real.items()
    }
    assert len(next(iter(example.values()))) == 1
    assert data.vocab_size == 259 + O.extra_ids(cfg)
