"""Tokenizers: byte, trained byte-level BPE, pretrained tokenizer.json; ids, specials, fingerprints, errors."""

import json
import pickle

import numpy as np
import pytest

from transformer.data.tokenizer import SPECIALS, ByteTokenizer, HFTokenizer, TokenizerError, load_pretrained, train_bpe

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def forward(self, x):\n    return self.norm(x + self.attn(x))\n",
    "Ünïcödé: naïve café, 東京, emoji 🙂 and tabs\tand newlines\n",
] * 10


def test_byte_tokenizer_ids_are_utf8_bytes_and_specials_follow():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    (ids,) = tok.encode_batch(["héllo"])
    np.testing.assert_array_equal(ids, list("héllo".encode()))
    assert tok.decode([*ids, tok.eos_id, tok.pad_id]) == "héllo"


def test_byte_tokenizer_survives_undecodable_bytes():
    raw = b"ok \xff\xfe \x80 end"
    text = raw.decode("utf-8", errors="surrogateescape")  # lone surrogates stand for the bad bytes
    (ids,) = ByteTokenizer().encode_batch([text])
    assert bytes(ids.astype(np.uint8)) == raw
    assert ByteTokenizer().decode(ids) == raw.decode("utf-8", errors="replace")


def test_bpe_training_is_deterministic_and_round_trips():
    a = train_bpe(iter(TEXTS), 300)
    b = train_bpe(iter(TEXTS), 300)
    assert a.json_text == b.json_text and a.fingerprint == b.fingerprint
    assert 259 < a.vocab_size <= 300
    assert [a.tok.token_to_id(s) for s in SPECIALS] == [a.bos_id, a.eos_id, a.pad_id]
    ids = a.encode_batch(TEXTS[:3])
    assert sum(map(len, ids)) < sum(len(t.encode()) for t in TEXTS[:3])
    assert [a.decode(i) for i in ids] == TEXTS[:3]
    # byte-level: text never seen in training still round-trips
    (unseen,) = a.encode_batch(["Ωmega ∑ 𝔘 \x00 zzz"])
    assert a.decode(unseen) == "Ωmega ∑ 𝔘 \x00 zzz"


def test_bpe_saved_and_reloaded_gives_identical_ids(tmp_path):
    tok = train_bpe(iter(TEXTS), 300)
    tok.save(tmp_path / "tokenizer.json")
    for path in (tmp_path / "tokenizer.json", tmp_path):
        again = load_pretrained(str(path))
        assert again.fingerprint == tok.fingerprint
        assert (again.bos_id, again.eos_id, again.pad_id, again.vocab_size) == (
            tok.bos_id,
            tok.eos_id,
            tok.pad_id,
            tok.vocab_size,
        )
        for x, y in zip(again.encode_batch(TEXTS), tok.encode_batch(TEXTS)):
            np.testing.assert_array_equal(x, y)


def test_bpe_needs_room_for_bytes_and_specials():
    with pytest.raises(TokenizerError, match=r"data\.vocab_size"):
        train_bpe(iter(TEXTS), 258)


def test_a_pretrained_tokenizer_without_our_specials_gets_them_added(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    base = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    base.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    base.add_special_tokens(["<eos>"])
    tok = HFTokenizer(base.to_str())
    assert tok.eos_id == 3  # an existing <eos> is kept
    assert {tok.bos_id, tok.pad_id} == {4, 5} and tok.vocab_size == 6
    np.testing.assert_array_equal(tok.encode_batch(["hello world nope"])[0], [1, 2, 0])
    assert HFTokenizer(base.to_str()).fingerprint == tok.fingerprint  # the same file, the same ids
    assert tok.decode([1, 2, tok.eos_id]) == "hello world"


def test_text_that_spells_a_special_token_is_encoded_as_text():
    tok = train_bpe(iter(TEXTS), 300)
    text = "a <eos> b <pad><bos> c"
    for t in (tok, pickle.loads(pickle.dumps(tok))):  # also in the worker processes of datasets.map
        (ids,) = t.encode_batch([text])
        assert not {t.bos_id, t.eos_id, t.pad_id} & set(ids.tolist())
        assert t.decode(ids) == text
        assert t.decode([*ids, t.eos_id]) == text  # real specials are still dropped when decoding


def test_fingerprints_differ_between_tokenizers():
    a, b = train_bpe(iter(TEXTS), 300), train_bpe(iter(TEXTS), 290)
    assert len({a.fingerprint, b.fingerprint, ByteTokenizer.fingerprint}) == 3


@pytest.mark.parametrize(
    "content", ["", "{not json", json.dumps({"version": "1.0", "model": {"type": "Nope"}}), "[1, 2]"]
)
def test_a_broken_tokenizer_file_is_a_clear_one_line_error(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    path.write_text(content)
    with pytest.raises(TokenizerError) as info:
        load_pretrained(str(path))
    message = str(info.value)
    assert message.startswith("data.tokenizer: cannot load") and str(path) in message and "\n" not in message


def test_a_missing_tokenizer_file(tmp_path):
    for missing in (tmp_path / "nope.json", tmp_path):  # a directory without tokenizer.json, too
        with pytest.raises(TokenizerError, match=r"data\.tokenizer: no tokenizer\.json"):
            load_pretrained(str(missing))


def test_text_a_bpe_cannot_take_is_a_tokenizer_error_naming_it():
    """A lone surrogate (undecodable bytes kept by surrogateescape, e.g. from argv) makes the library
    raise a bare TypeError; it becomes a one-line TokenizerError naming the text."""
    tok = train_bpe(iter(TEXTS), 300)
    bad = b"caf\xff".decode("utf-8", errors="surrogateescape")
    with pytest.raises(TokenizerError) as info:
        tok.encode_batch(["fine", bad])
    message = str(info.value)
    assert "\n" not in message and repr(bad) in message and "UTF-8" in message
