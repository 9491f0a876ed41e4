"""Downstream tasks (lm-evaluation-harness): the adapter's numbers against the model's own, the
shipped stdlib_next_line task, eval.py --tasks with local and missing tasks, and train.eval_tasks in
the loop (logged, resumed bit for bit)."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_run_overrides, write_corpus
from lm_eval.api.instance import Instance

from transformer import rundir
from transformer.cli import eval_main, train_main
from transformer.config_loader import load_config
from transformer.data import ByteTokenizer, Vocab
from transformer.eval import SamplingConfig, harness
from transformer.eval.evaluate import loop_tasks
from transformer.eval.generate import generate
from transformer.eval.tasks import N_CHOICES, next_line_items
from transformer.model import Transformer
from transformer.train.job import run

VOCAB = Vocab(ByteTokenizer())
EOS = VOCAB.tokenizer.eos_id


def model_and_config(*overrides: str):
    """A random byte-level decoder with a 64-token context (scores need no training)."""
    from flax import nnx

    cfg = load_config(
        None,
        [
            "model.d_model=32",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.ffn_multiple=16",
            "data.seq_len=64",
            "train.eval_tasks=[]",
            *overrides,
        ],
    ).with_vocab(VOCAB.size)
    return cfg, Transformer(cfg.model, rngs=nnx.Rngs(3))


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def direct_logprob(model, tokens: list[int], n: int) -> float:
    """log p(last n tokens | the ones before), from one forward pass of the model."""
    logits = model(jnp.asarray([tokens[:-1]]))
    logp = jax.nn.log_softmax(logits[0], axis=-1)
    return float(sum(logp[t - 1, tokens[t]] for t in range(len(tokens) - n, len(tokens))))


PAIRS = [
    ("def f(x):\n", "    return x"),
    ("import os\n", "import sys"),
    ("", "class A:"),  # an empty context: the continuation given EOS alone
    ("a" * 70, " tail"),  # longer than the context: cut from the left
    ("x = 1\n", "y"),
    ("for i in range(3):\n    ", "print(i)"),  # trailing whitespace moves into the continuation
    ("q", "r" * 5),
]


@pytest.mark.parametrize("document_mask", [False, True])
def test_loglikelihood_is_the_models_sum_of_token_log_probs(document_mask):
    """Seven requests of lengths that fall in several padded shapes, three to a batch: each equals
    the model's own log-probability of its continuation after EOS + context (cut to the context),
    and is_greedy says whether every continuation token is the model's argmax."""
    cfg, model = model_and_config(f"data.document_mask={str(document_mask).lower()}")
    lm = harness.make_lm(cfg, model, VOCAB, batch=3)
    got = lm.loglikelihood([request("loglikelihood", c, x) for c, x in PAIRS])
    for (context, continuation), (logp, greedy) in zip(PAIRS, got):
        spaces = len(context) - len(context.rstrip())  # lm-eval moves trailing whitespace, newlines too
        context, continuation = context[: len(context) - spaces], context[len(context) - spaces :] + continuation
        tokens = [EOS, *VOCAB.encode(context), *VOCAB.encode(continuation)][-65:]
        n = len(VOCAB.encode(continuation))
        if document_mask:  # the EOS-led row is laid out as training lays out its windows
            from transformer.data import document_layout

            inputs = np.asarray([tokens[:-1]])
            layout = document_layout(inputs, EOS)
            logits = model(jnp.asarray(inputs), jnp.asarray(layout["positions"]), jnp.asarray(layout["segment_ids"]))
            logp_T = jax.nn.log_softmax(logits[0], axis=-1)
            want = float(sum(logp_T[t - 1, tokens[t]] for t in range(len(tokens) - n, len(tokens))))
        else:
            want = direct_logprob(model, tokens, n)
        np.testing.assert_allclose(logp, want, rtol=1e-5, atol=1e-5)
        argmax = np.asarray(jnp.argmax(model(jnp.asarray([tokens[:-1]])), -1))[0]
        if not document_mask:
            assert greedy == all(argmax[t - 1] == tokens[t] for t in range(len(tokens) - n, len(tokens)))


def test_a_continuation_the_model_would_write_is_greedy():
    """Scored at the token level (a random model's bytes need not decode to text and back)."""
    cfg, model = model_and_config()
    scorer = harness.Scorer(cfg, model, VOCAB, batch=4)
    prompt = [EOS, *VOCAB.encode("def f(x):")]
    new = generate(model, [prompt], EOS, VOCAB.tokenizer.pad_id, SamplingConfig(6, 0.0))[0]
    assert len(new) == 6
    [(_, greedy), (_, changed)] = scorer.score([([*prompt, *new], 6), ([*prompt, *new[:-1], (new[-1] + 1) % 256], 6)])
    assert greedy and not changed


def test_rolling_loglikelihood_scores_every_token_once():
    """A text shorter than the context: all its tokens after EOS in one row; a longer one: the sum
    over lm-eval's disjoint windows, each token predicted once with as much context as fits."""
    cfg, model = model_and_config()
    lm = harness.make_lm(cfg, model, VOCAB, batch=2)
    short, long = "print('hello')\n", "".join(f"line {i}\n" for i in range(30))
    got = lm.loglikelihood_rolling([request("loglikelihood_rolling", short), request("loglikelihood_rolling", long)])
    tokens = VOCAB.encode(short)
    np.testing.assert_allclose(got[0], direct_logprob(model, [EOS, *tokens], len(tokens)), rtol=1e-5)
    tokens = [EOS, *VOCAB.encode(long)]
    want, done = 0.0, 1  # tokens[done:] are still to predict; each window is the 65 tokens ending at its last
    while done < len(tokens):
        end = min(done + 64, len(tokens))
        window = tokens[max(0, end - 65) : end]
        want += direct_logprob(model, window, end - done)
        done = end
    np.testing.assert_allclose(got[1], want, rtol=1e-5)


def test_generate_until_is_greedy_generation_cut_at_the_first_stop():
    """Three requests of different lengths, two to a batch, padded to a shared shape: each equals the
    framework's greedy generation of its prompt alone, and a stop sequence cuts it."""
    cfg, model = model_and_config()
    lm = harness.make_lm(cfg, model, VOCAB, batch=2)
    contexts = ["x = 1\n", "def main(argv):\n    parser = argparse.ArgumentParser()\n", "import"]
    alone = [
        VOCAB.decode(
            generate(model, [[EOS, *VOCAB.encode(c)]], EOS, VOCAB.tokenizer.pad_id, SamplingConfig(20, 0.0))[0]
        )
        for c in contexts
    ]
    whole = lm.generate_until([request("generate_until", c, {"until": [], "max_gen_toks": 20}) for c in contexts])
    assert whole == alone
    stop = alone[0][5:7]  # a stop sequence the greedy text does contain
    kwargs = {"until": ["\x00never", stop], "max_gen_toks": 20}
    [cut] = lm.generate_until([request("generate_until", contexts[0], kwargs)])
    assert cut == alone[0][: alone[0].index(stop)]


def test_an_encoder_is_refused_in_one_line():
    cfg = load_config(None, ["model.arch=encoder", "train.eval_tasks=[]"])
    with pytest.raises(harness.TaskError, match=r"an encoder .* has no next-token likelihood"):
        harness.check_model(cfg)


def seq2seq_model():
    from flax import nnx

    overrides = ["model.arch=encoder_decoder", "data.source=builtin:seq2seq", "data.seq_len=32", "data.target_len=16"]
    cfg, _ = model_and_config(*overrides)
    return cfg, Transformer(cfg.model, rngs=nnx.Rngs(4))


def test_an_encoder_decoder_scores_the_continuation_decoded_from_its_encoded_context():
    """The context is the encoder's input (its last data.seq_len tokens), the continuation decoded
    from BOS (its first data.target_len), as training reads a pair: each request equals the model's
    own log-probabilities, padded into shared shapes or not."""
    cfg, model = seq2seq_model()
    lm = harness.make_lm(cfg, model, VOCAB, batch=3)
    pairs = [("3 + 4 =", " 7"), ("sort: c a b", " a b c"), ("x" * 40, " y"), ("q", "z" * 20), ("", "hello")]
    got = lm.loglikelihood([request("loglikelihood", c, x) for c, x in pairs])
    bos = VOCAB.tokenizer.bos_id
    for (context, continuation), (logp, _) in zip(pairs, got):
        source = (VOCAB.encode(context) or [EOS])[-32:]  # an empty context is lm-eval's prefix token
        target = VOCAB.encode(continuation)[:16]
        logits = model(jnp.asarray([[bos, *target[:-1]]]), encoder_tokens_BxS=jnp.asarray([source]))
        logp_T = jax.nn.log_softmax(logits[0], axis=-1)
        np.testing.assert_allclose(logp, float(sum(logp_T[t, x] for t, x in enumerate(target))), rtol=1e-5, atol=1e-5)


def test_an_encoder_decoder_generates_from_its_encoded_context_and_takes_no_perplexity_task(tmp_path):
    from transformer.eval.generate import generate_seq2seq

    cfg, model = seq2seq_model()
    lm = harness.make_lm(cfg, model, VOCAB, batch=2)
    contexts = ["3 + 4 =", "sort: c a b a", "x"]
    t = VOCAB.tokenizer
    alone = [
        VOCAB.decode(generate_seq2seq(model, [VOCAB.encode(c)], t.bos_id, EOS, t.pad_id, SamplingConfig(8, 0.0))[0])
        for c in contexts
    ]
    assert lm.generate_until([request("generate_until", c, {"max_gen_toks": 8}) for c in contexts]) == alone
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "texts.jsonl"
    data.write_text('{"text": "a b c"}\n')
    (tasks / "text_ppl.yaml").write_text(
        f"task: text_ppl\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "output_type: loglikelihood_rolling\ntest_split: test\ndoc_to_text: ''\ndoc_to_target: text\n"
        "metric_list:\n  - metric: word_perplexity\n"
    )
    from transformer.eval.evaluate import task_suite

    with pytest.raises(harness.TaskError, match="task text_ppl asks the likelihood of a whole text"):
        task_suite(cfg, ["text_ppl"], [tasks], progress=False)


# --- the shipped task -------------------------------------------------------------------------------

DOCS = ["\n".join(f"    value_{d}_{i} = compute_{d}({i})" for i in range(40)) for d in range(5)]


def test_next_line_items_are_deterministic_and_the_true_line_follows_its_context():
    items = next_line_items(DOCS, seed=0, n=30)
    assert items == next_line_items(DOCS, seed=0, n=30) and items != next_line_items(DOCS, seed=1, n=30)
    labels = set()
    for item in items:
        choices, true = item["choices"], item["choices"][item["label"]]
        assert len(set(choices)) == N_CHOICES and item["context"].endswith("\n")
        doc = next(d for d in DOCS if item["context"] + true in d)  # the true line comes next in its file
        assert all(c not in doc for c in choices if c != true)  # the others come from other files
        labels.add(item["label"])
    assert labels == set(range(N_CHOICES))


# --- eval.py --tasks and the loop ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny byte-level run on a JSONL corpus, with stdlib_next_line evaluated in the loop at
    steps 4 and 8 (20 items), and the same run stopped at 4 and resumed to 8."""
    root = tmp_path_factory.mktemp("harness")
    corpus = write_corpus(root / "docs.jsonl", seed=5)
    cache = root / "cache"
    base = tiny_run_overrides(corpus, cache, "data.tokenizer=byte", "train.eval_every=4", "checkpoint.every=4")
    tasks = ["train.eval_tasks=[stdlib_next_line]", "train.eval_tasks_limit=20"]
    straight, resumed = root / "straight", root / "resumed"
    run(load_config(None, [*base, "train.steps=8"]), root / "without", log=lambda _: None)
    run(load_config(None, [*base, *tasks, "train.steps=8"]), straight, log=lambda _: None, downstream=loop_tasks)
    run(load_config(None, [*base, *tasks, "train.steps=4"]), resumed, log=lambda _: None, downstream=loop_tasks)
    run(load_config(None, [*base, *tasks, "train.steps=8"]), resumed, log=lambda _: None, downstream=loop_tasks)
    return straight, resumed, root


def eval_rows(workdir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k.startswith(("eval/", "val_", "step"))} for r in rows if "val_loss" in r]


def test_eval_tasks_are_logged_at_each_evaluation_and_resume_bit_for_bit(trained):
    straight, resumed, root = trained
    rows = eval_rows(straight)
    assert [r["step"] for r in rows] == [4, 8]
    for r in rows:
        assert 0 <= r["eval/stdlib_next_line/acc"] <= 1 and "eval/stdlib_next_line/acc_norm" in r
    assert eval_rows(resumed) == rows
    # scoring reads the parameters and changes nothing: the run without tasks trains the same losses
    losses = [[r["loss"] for r in rundir.read_metrics(w) if "loss" in r] for w in (straight, root / "without")]
    assert losses[0] == losses[1] and len(losses[0]) == 8


def test_eval_py_tasks_matches_the_loop(trained, capsys):
    straight, _, _ = trained
    assert eval_main(["--workdir", str(straight), "--tasks", "stdlib_next_line", "--limit", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    logged = eval_rows(straight)[-1]
    assert out["step"] == 8
    assert out["tasks"]["stdlib_next_line"]["acc"] == logged["eval/stdlib_next_line/acc"]


def write_task(directory: Path, name: str, data_files: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    validation: {data_files}\n"
        "output_type: multiple_choice\nvalidation_split: validation\ndoc_to_text: q\ndoc_to_choice: choices\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )
    return directory


def test_a_local_yaml_task_runs_offline(trained, tmp_path, capsys):
    """A task of the harness's YAML format from --include-path, on local JSON lines: its accuracy is
    the fraction of items where the model's best-scored choice is the labelled one, computed here."""
    straight, _, _ = trained
    items = [{"q": f"x{i} = ", "choices": [f"{i}", "abc", f"{i}{i}"], "label": i % 3} for i in range(9)]
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items))
    tasks = write_task(tmp_path / "tasks", "local_choice", str(data))
    argv = ["--workdir", str(straight), "--tasks", "local_choice", "--include-path", str(tasks), "--json"]
    assert eval_main(argv) == 0
    acc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tasks"]["local_choice"]["acc"]
    from transformer.io import checkpoint

    cfg, model = checkpoint.load(straight)
    lm = harness.make_lm(cfg, model, VOCAB, batch=4)
    scores = lm.loglikelihood([request("loglikelihood", it["q"], " " + c) for it in items for c in it["choices"]])
    best = [int(np.argmax([s for s, _ in scores[3 * i : 3 * i + 3]])) for i in range(len(items))]
    assert acc == pytest.approx(np.mean([b == it["label"] for b, it in zip(best, items)]))


def one_line_error(capsys, argv: list[str], main=eval_main) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_missing_and_unknown_tasks_are_one_line(trained, tmp_path, capsys):
    straight, _, _ = trained
    tasks = write_task(tmp_path / "tasks", "gone_task", str(tmp_path / "no-such-file.jsonl"))
    line = one_line_error(capsys, ["--workdir", str(straight), "--tasks", "gone_task", "--include-path", str(tasks)])
    assert "task gone_task: its dataset json" in line and "no-such-file.jsonl" in line and "could not be loaded" in line
    hub = tmp_path / "hub_tasks"
    hub.mkdir()
    (hub / "hub_task.yaml").write_text(
        "task: hub_task\ndataset_path: no-such-org-4f1c/no-such-dataset\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: q\ndoc_to_choice: choices\ndoc_to_target: label\n"
    )
    line = one_line_error(capsys, ["--workdir", str(straight), "--tasks", "hub_task", "--include-path", str(hub)])
    assert "task hub_task: its dataset no-such-org-4f1c/no-such-dataset could not be loaded" in line
    line = one_line_error(capsys, ["--workdir", str(straight), "--tasks", "no_such_task_anywhere"])
    assert "unknown task no_such_task_anywhere" in line
    line = one_line_error(capsys, ["--workdir", str(straight), "--limit", "3"])
    assert "--limit and --include-path go with --tasks" in line


def test_without_lm_eval_the_tasks_are_refused_naming_the_extra(trained, capsys, monkeypatch):
    straight, _, root = trained
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    line = one_line_error(capsys, ["--workdir", str(straight), "--tasks", "stdlib_next_line"])
    assert harness.EVALS_EXTRA in line
    argv = [*tiny_run_overrides(root / "docs.jsonl", root / "cache"), "train.eval_tasks=[stdlib_next_line]"]
    line = one_line_error(capsys, [*argv, "--workdir", str(root / "refused"), "--dry-run"], train_main)
    assert "train.eval_tasks" in line and harness.EVALS_EXTRA in line


CHANCE_SIGMAS = 3.0  # how far from chance (1/4) a score over the task's 500 items must be to count


@pytest.mark.slow
def test_stdlib_next_line_is_at_chance_untrained_and_above_it_trained(tmp_path):
    """A 2-layer, 64-wide model trained 400 steps on the task's own held-out files (it has seen the
    true lines: the point is the task and the scoring, not generalisation, which benchmarks/README.md
    measures on the default run) scores above chance by more than three standard errors of chance;
    the same model untrained scores within them."""
    from flax import nnx

    from transformer.config import DataConfig
    from transformer.data import load_splits
    from transformer.eval.evaluate import task_suite

    corpus = tmp_path / "held_out.jsonl"
    val = load_splits(DataConfig(source="builtin:stdlib"))["val"]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in val["text"]))
    overrides = [
        f"data.source=files:{corpus}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=128",
        "model.d_model=64",
        "model.n_layers=2",
        "model.n_heads=4",
        "train.batch_size=16",
        "train.steps=400",
        "train.eval_every=400",
        "optim.warmup_steps=20",
        "checkpoint.every=400",
        "train.eval_tasks=[stdlib_next_line]",
        "train.eval_tasks_limit=null",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]
    cfg = load_config(None, overrides)
    run(cfg, tmp_path / "run", log=lambda _: None, downstream=loop_tasks)
    trained = eval_rows(tmp_path / "run")[-1]["eval/stdlib_next_line/acc_norm"]
    cfg = cfg.with_vocab(VOCAB.size)
    untrained = harness.make_lm(cfg, Transformer(cfg.model, rngs=nnx.Rngs(0)), VOCAB, 16)
    loaded = task_suite(cfg, ["stdlib_next_line"], [], progress=False)
    score = harness.run_tasks(untrained, loaded, None, progress=False)["stdlib_next_line"]["acc_norm"]
    margin = CHANCE_SIGMAS * (0.25 * 0.75 / 500) ** 0.5
    assert abs(score - 0.25) < margin, score
    assert trained > 0.25 + margin, trained


def test_a_hugging_face_model_takes_tasks_with_its_own_tokenizer(tmp_path, capsys):
    """eval.py --hf PATH --tasks: the fixture's GPT-2 with its own BPE on a local task, end to end
    (the scoring itself is tested against the model above)."""
    from conftest import ROOT

    fixture = ROOT / "tests" / "fixtures" / "hf" / "gpt2"
    items = [{"q": f"The number {i} is", "choices": [" odd", " even"], "label": i % 2} for i in range(6)]
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items))
    tasks = write_task(tmp_path / "tasks", "parity_words", str(data))
    argv = ["--hf", str(fixture), "data.seq_len=32", "--tasks", "parity_words", "--include-path", str(tasks), "--json"]
    assert eval_main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step"] == 0 and 0 <= out["tasks"]["parity_words"]["acc"] <= 1


def test_a_decoder_trained_on_pairs_reads_context_separator_continuation():
    """A prefix-LM's row in training is input, BOS (the separator), target: so is a request's."""
    cfg, model = model_and_config("data.source=builtin:seq2seq", "data.seq_len=24", "data.target_len=8")
    assert cfg.data.objective == "prefix"
    lm = harness.make_lm(cfg, model, VOCAB, batch=2)
    [(logp, _)] = lm.loglikelihood([request("loglikelihood", "3 + 4 =", "7")])
    tokens = [*VOCAB.encode("3 + 4 ="), VOCAB.tokenizer.bos_id, *VOCAB.encode("7")]
    np.testing.assert_allclose(logp, direct_logprob(model, tokens, 1), rtol=1e-5)
    prompt = [*VOCAB.encode("3 + 4 ="), VOCAB.tokenizer.bos_id]
    new = generate(model, [prompt], EOS, VOCAB.tokenizer.pad_id, SamplingConfig(5, 0.0))[0]
    assert lm.generate_until([request("generate_until", "3 + 4 =", {"max_gen_toks": 5})]) == [VOCAB.decode(new)]
