"""Downstream tasks through EleutherAI's lm-evaluation-harness: this framework's model as an lm-eval
`LM`, and `run_tasks`, which evaluates any harness task (its registry and YAML task format, local
`--include-path` tasks, the built-in `stdlib_next_line`) on a model.

Conventions, so that a score means what the model learned: a row is read as training read its rows.
A causal decoder's starts with EOS (the boundary each training document follows), is cut from the
left to the model's context and laid out as training lays out its windows (segments and positions
per document under `data.document_mask`); a decoder trained on pairs (`prefix`) reads the context,
its separator (BOS), then the continuation; an encoder-decoder encodes the context and decodes the
continuation from BOS. Rows are scored in batches padded to a few static shapes (a power of two of
tokens up to the context, `batch` rows), so a task compiles a handful of times, not once per request.
Generation is the framework's KV-cache `generate`, greedy unless a task asks to sample.

lm-eval is the `evals` extra; a missing task dataset is a TaskError naming the task, never a hang.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer.config import Config
from transformer.data import Vocab, document_layout, hub_offline, hub_unreachable
from transformer.errors import first_line
from transformer.eval.generate import SamplingConfig, generate, generate_seq2seq, right_pad
from transformer.model import for_inference

EVALS_EXTRA = 'pip install -e ".[evals]"'


class TaskError(ValueError):
    """A task that cannot be evaluated here: unknown, its data missing, a model it does not fit."""


def require_lm_eval() -> None:
    """TaskError, saying how to install it, where lm-eval is missing."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise TaskError(f"downstream tasks need lm-eval: {EVALS_EXTRA}") from None


def check_model(cfg: Config) -> None:
    """The families lm-eval's requests fit: decoders (trained causally, or on pairs with a separator)
    and encoder-decoders (the context encoded, the continuation decoded). An encoder has no
    left-to-right likelihood to give (pseudo-log-likelihoods are not built)."""
    if cfg.model.arch == "encoder":
        raise TaskError(
            "lm-eval tasks score decoders and encoder-decoders; an encoder (model.arch=encoder) has no "
            "next-token likelihood (its masked predictions: eval.py --fill-mask)"
        )


def buckets(context: int) -> list[int]:
    """The row lengths rows are padded to: powers of two below the context, and the context."""
    out = [2**k for k in range(3, max(3, math.ceil(math.log2(context))))]
    return [n for n in out if n < context] + [context]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _token_scores(graphdef, params, inputs_BxT, targets_BxT, positions_BxT, segments_BxT):
    """Each target's log-probability and whether it is the greedy choice, [B, T] each."""
    model = nnx.merge(graphdef, params)
    logits_BxTxV = model(inputs_BxT, positions_BxT, segments_BxT)
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    logp_BxT = jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    return logp_BxT, jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _pair_scores(graphdef, params, encoder_BxS, encoder_segments_BxS, inputs_BxT, targets_BxT, segments_BxT):
    """An encoder-decoder's `_token_scores`: the decoder's targets given the encoded inputs."""
    model = nnx.merge(graphdef, params)
    logits_BxTxV = model(
        inputs_BxT, None, segments_BxT, encoder_tokens_BxS=encoder_BxS, encoder_segment_ids_BxS=encoder_segments_BxS
    )
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    logp_BxT = jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    return logp_BxT, jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT


class Scorer:
    """Log-likelihoods of token rows under a model, batched into static shapes."""

    def __init__(self, cfg: Config, model, vocab: Vocab, batch: int):
        assert cfg.model.max_seq_len is not None  # a run's Config fills it from data.seq_len
        self.context, self.batch, self.vocab = cfg.model.max_seq_len, batch, vocab
        # an encoder-decoder's input and output lengths (data.seq_len, data.target_len)
        self.input_len, self.target_len = cfg.data.seq_len, cfg.data.target_len or cfg.data.seq_len
        self.document_mask = cfg.data.document_mask and cfg.data.objective in (None, "causal")
        self.graphdef, self.params = nnx.split(model)
        self.lengths = buckets(self.context)
        self.computed = self.scored = self.batches = 0  # tokens through the model (padding included), real ones

    def score(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """For each (tokens, n): the summed log-probability of the last n tokens given the ones
        before (cut from the left to the context), and whether each of them is the greedy choice."""
        # a continuation longer than the context is scored on its last tokens, as they fit
        cut = [(tokens[-(self.context + 1) :], min(n, len(tokens) - 1, self.context)) for tokens, n in rows]
        out: list[tuple[float, bool]] = [(0.0, True)] * len(cut)
        order = sorted(range(len(cut)), key=lambda i: -len(cut[i][0]))  # similar lengths together
        for start in range(0, len(order), self.batch):
            chunk = order[start : start + self.batch]
            for i, result in zip(chunk, self._score_batch([cut[i] for i in chunk])):
                out[i] = result
        return out

    def _score_batch(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        T = next(n for n in self.lengths if n >= max(len(tokens) - 1 for tokens, _ in rows))
        tokens_BxT1, _ = _pad_rows([tokens for tokens, _ in rows], self.batch, T + 1, self.vocab.tokenizer.pad_id)
        inputs, targets = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
        self.computed, self.batches = self.computed + self.batch * T, self.batches + 1
        self.scored += sum(len(tokens) - 1 for tokens, _ in rows)
        # padding follows the real tokens: a causal model's scores of those never see it
        layout = document_layout(inputs, self.vocab.tokenizer.eos_id) if self.document_mask else {}
        logp, greedy = _token_scores(
            self.graphdef, self.params, inputs, targets, layout.get("positions"), layout.get("segment_ids")
        )
        logp, greedy = np.asarray(logp), np.asarray(greedy)
        out = []
        for b, (tokens, n) in enumerate(rows):
            span = slice(len(tokens) - 1 - n, len(tokens) - 1)
            out.append((float(logp[b, span].sum()), bool(greedy[b, span].all())))
        return out


def _pad_rows(rows: list[list[int]], batch: int, length: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """generate.right_pad's (tokens [batch, length], segment ids), the batch filled with empty rows."""
    return right_pad([*rows, *[[]] * (batch - len(rows))], pad, length)


def score_pairs(scorer: Scorer, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """An encoder-decoder's log-likelihood of each (input, continuation): the input (its last
    data.seq_len tokens) encoded, the continuation (its first data.target_len) decoded from BOS, as
    training reads a pair; batched into power-of-two shapes like `Scorer.score`."""
    t = scorer.vocab.tokenizer
    cut = [(x[-scorer.input_len :], y[: scorer.target_len]) for x, y in pairs]
    out: list[tuple[float, bool]] = [(0.0, True)] * len(cut)
    order = sorted(range(len(cut)), key=lambda i: (-len(cut[i][0]), -len(cut[i][1])))
    for start in range(0, len(order), scorer.batch):
        chunk = order[start : start + scorer.batch]
        S = next(n for n in buckets(scorer.input_len) if n >= max(len(cut[i][0]) for i in chunk))
        T = next(n for n in buckets(scorer.target_len) if n >= max(len(cut[i][1]) for i in chunk))
        encoder, encoder_segments = _pad_rows([cut[i][0] for i in chunk], scorer.batch, S, t.pad_id)
        inputs, segments = _pad_rows([[t.bos_id, *cut[i][1][:-1]] for i in chunk], scorer.batch, T, t.pad_id)
        targets, _ = _pad_rows([cut[i][1] for i in chunk], scorer.batch, T, t.pad_id)
        logp, greedy = _pair_scores(
            scorer.graphdef, scorer.params, encoder, encoder_segments, inputs, targets, segments
        )
        logp, greedy = np.asarray(logp), np.asarray(greedy)
        for b, i in enumerate(chunk):
            n = len(cut[i][1])
            out[i] = (float(logp[b, :n].sum()), bool(greedy[b, :n].all()))
    return out


@functools.cache
def _lm_class():
    """The lm-eval adapter class (defined on first use: lm-eval is an optional extra)."""
    from lm_eval.api.model import TemplateLM

    class FrameworkLM(TemplateLM):
        """This framework's model as an lm-eval LM (see the module's docstring for the conventions)."""

        def __init__(self, cfg: Config, model, vocab: Vocab, batch: int = 16):
            super().__init__()
            self.cfg, self.model, self.vocab = cfg, model, vocab
            self.scorer = Scorer(cfg, model, vocab, batch)
            self.progress = True  # lm-eval's bars (run_tasks turns them off inside training)
            # a decoder trained on pairs reads its input, the separator it was trained with, then the target
            self.separator = [vocab.tokenizer.bos_id] if cfg.data.objective == "prefix" else []
            self.encoder_decoder = cfg.model.arch == "encoder_decoder"
            # pairs: context and continuation encoded apart, as their two sides were in training
            self.backend = "seq2seq" if self.separator or self.encoder_decoder else "causal"

        @property
        def eot_token_id(self) -> int:
            return self.vocab.tokenizer.eos_id

        @property
        def max_length(self) -> int:
            return self.scorer.context

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            return [int(i) for i in self.vocab.encode(string)]

        def tok_decode(self, tokens: list[int], **kwargs) -> str:
            return self.vocab.decode(tokens)

        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
            return loglikelihood_tokens(self, [(context, continuation) for _, context, continuation in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            return rolling_loglikelihood(self, [request.args[0] for request in requests])

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            return generate_until(self, [request.args for request in requests])

    return FrameworkLM


def make_lm(cfg: Config, model, vocab: Vocab, batch: int = 16):
    """The lm-eval LM of `model` (an nnx Transformer) with the run's vocabulary."""
    require_lm_eval()
    check_model(cfg)
    return _lm_class()(cfg, for_inference(model), vocab, batch)


def _lead(lm, context: list[int]) -> list[int]:
    """A causal decoder's context after the EOS its training documents follow (an empty context is
    [EOS] already); a pair's input as it is (its row starts with it in training)."""
    eos = lm.eot_token_id
    return context if lm.separator or lm.encoder_decoder or context[:1] == [eos] else [eos, *context]


def loglikelihood_tokens(lm, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """lm-eval's _loglikelihood_tokens: (log-probability, greedy) of each continuation after its
    context, read as the model was trained to read it (see the module's docstring)."""
    if lm.encoder_decoder:
        return score_pairs(lm.scorer, pairs)
    rows = [([*_lead(lm, context), *lm.separator, *continuation], len(continuation)) for context, continuation in pairs]
    return lm.scorer.score(rows)


def rolling_loglikelihood(lm, texts: list[str]) -> list[float]:
    """lm-eval's loglikelihood_rolling: each text's log-probability after EOS, every token predicted
    once over lm-eval's disjoint windows of the context, each with as much context as fits. A
    decoder's only (`check_task_kinds` refuses the others' perplexity tasks before they run)."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    assert not lm.encoder_decoder
    rows, owner = [], []
    for i, text in enumerate(texts):
        windows = get_rolling_token_windows(lm.tok_encode(text), lm.eot_token_id, lm.max_length, 1)
        for context, predicted in map(make_disjoint_window, windows):
            rows.append(([*context, *predicted], len(predicted)))
            owner.append(i)
    totals = [0.0] * len(texts)
    for i, (logp, _) in zip(owner, lm.scorer.score(rows)):
        totals[i] += logp
    return totals


def generate_until(lm, requests: list[tuple[str, dict]]) -> list[str]:
    """lm-eval's generate_until: the framework's generation from EOS + each context (cut from the
    left so that max_gen_toks fit), greedy unless do_sample, cut at the first stop sequence. Requests
    with the same settings go `batch` rows at a time, their prompts left-padded to a bucket length,
    so that a task compiles a few times, not once per prompt length."""
    groups: dict[SamplingConfig, list[int]] = {}
    settings = [_generation_settings(lm, kwargs) for _, kwargs in requests]
    for i, (sampling, _) in enumerate(settings):
        groups.setdefault(sampling, []).append(i)
    out = [""] * len(requests)
    for sampling, members in groups.items():
        # a decoder's prompt and its new tokens share the context; an encoder-decoder's input is its own
        room = lm.scorer.input_len if lm.encoder_decoder else lm.max_length - sampling.max_new_tokens
        prompts = {i: [*_lead(lm, lm.tok_encode(requests[i][0])), *lm.separator][-room:] for i in members}
        for start in range(0, len(members), lm.scorer.batch):
            chunk = members[start : start + lm.scorer.batch]
            length = min(next(n for n in buckets(room) if n >= max(len(prompts[i]) for i in chunk)), room)
            rows = [prompts[i] for i in chunk] + [[lm.eot_token_id]] * (lm.scorer.batch - len(chunk))
            for i, new in zip(chunk, _generate_rows(lm, rows, sampling, length)):
                out[i] = _cut(lm.tok_decode(new), settings[i][1])
    return out


def _generate_rows(lm, rows: list[list[int]], sampling: SamplingConfig, length: int) -> list[list[int]]:
    t = lm.vocab.tokenizer
    if lm.encoder_decoder:
        return generate_seq2seq(lm.model, rows, t.bos_id, t.eos_id, t.pad_id, sampling, length)
    return generate(lm.model, rows, t.eos_id, t.pad_id, sampling, length)


def _generation_settings(lm, gen_kwargs: dict) -> tuple[SamplingConfig, tuple[str, ...]]:
    """(sampling, stop sequences) of a request's generation arguments."""
    until = gen_kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    new = max(1, min(int(gen_kwargs.get("max_gen_toks", 256)), lm.max_length - 1))
    sample = bool(gen_kwargs.get("do_sample", False))
    temperature = float(gen_kwargs.get("temperature", 0.0)) if sample else 0.0
    return SamplingConfig(max_new_tokens=new, temperature=temperature, seed=int(gen_kwargs.get("seed", 0))), tuple(
        until
    )


def _cut(text: str, until: tuple[str, ...]) -> str:
    cuts = [text.index(stop) for stop in until if stop and stop in text]
    return text[: min(cuts)] if cuts else text


# --- tasks ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_harness(progress: bool) -> Iterator[None]:
    """lm-eval's informational logging (a line per task setting) off for the evaluation; without
    `progress` (inside a training run), its and datasets' progress bars too."""
    from unittest import mock

    import datasets
    import lm_eval.api.task
    from tqdm import tqdm

    loggers = [logging.getLogger(name) for name in ("lm-eval", "lm_eval")]
    saved = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    bars = datasets.utils.logging.is_progress_bar_enabled()
    quiet_bars = (
        contextlib.nullcontext()
        if progress
        else mock.patch.object(lm_eval.api.task, "tqdm", functools.partial(tqdm, disable=True))
    )
    if not progress:
        datasets.disable_progress_bars()
    try:
        with quiet_bars:
            yield
    finally:
        for log, level in zip(loggers, saved):
            log.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def load_tasks(
    names: list[str], include_path: list[Path], builtin: dict[str, Callable[[], dict]], progress: bool = True
) -> Any:
    """lm-eval's loaded tasks: built-in ones by their configs, the rest from the harness's registry
    and `include_path`. An unknown task, or one whose data is not here and cannot be fetched, is a
    TaskError naming it."""
    from lm_eval.tasks import TaskManager

    require_lm_eval()
    others = [n for n in names if n not in builtin]
    manager = TaskManager(include_path=[str(p) for p in include_path] or None, include_defaults=bool(others))
    unknown = [n for n in others if n not in manager.all_tasks]
    if unknown:
        raise TaskError(f"unknown task {', '.join(unknown)} (not in lm-eval's registry or --include-path)")
    loaded = {}
    unreachable = None if not others else hub_unreachable()  # one probe; shipped tasks are local
    for name in names:
        spec = builtin[name]() if name in builtin else name
        try:
            with _quiet_harness(progress), hub_offline() if unreachable else contextlib.nullcontext():
                loaded[name] = manager.load([spec])
        except Exception as e:
            config = spec if isinstance(spec, dict) else (getattr(manager.task_index.get(name), "cfg", None) or {})
            hub = f"; the hub cannot be reached ({unreachable})" if unreachable else ""
            raise TaskError(
                f"task {name}: its dataset {_dataset(config)} could not be loaded ({first_line(e, with_type=True)}){hub}"
            ) from None
    return loaded


def check_task_kinds(cfg: Config, loaded: dict) -> None:
    """TaskError for a task whose requests the model cannot answer: an encoder-decoder has no
    likelihood of a text on its own (perplexity tasks, loglikelihood_rolling)."""
    if cfg.model.arch != "encoder_decoder":
        return
    for name, task_dict in loaded.items():
        for task in task_dict["tasks"].values():
            if task.OUTPUT_TYPE == "loglikelihood_rolling":
                raise TaskError(
                    f"task {name} asks the likelihood of a whole text (loglikelihood_rolling), which an "
                    "encoder-decoder does not give; its multiple-choice and generation tasks run"
                )


def _dataset(config: dict) -> str:
    """A task's dataset as its config names it: a hub name, or a loader and its local files."""
    path = config.get("dataset_path", "?")
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    return f"{path} ({files})" if files else str(path)


def run_tasks(lm, loaded: dict, limit: int | None, progress: bool = True) -> dict[str, dict[str, float]]:
    """Each task's metrics ({"acc": 0.61, "acc_stderr": 0.02, ...}; a filter other than lm-eval's
    default `none` is kept in the name, `acc/strict-match`) for tasks from `load_tasks`, zero-shot
    unless a task fixes its shots; at most `limit` items of each."""
    from lm_eval.evaluator import evaluate

    out: dict[str, dict[str, float]] = {}
    lm.progress = progress
    with _quiet_harness(progress):
        for task_dict in loaded.values():
            for task in task_dict["tasks"].values():
                if task.get_config("num_fewshot") is None:
                    task.set_config(key="num_fewshot", value=0)
                task.set_fewshot_seed(seed=1234)
            results = evaluate(lm=lm, task_dict=task_dict, limit=limit, bootstrap_iters=1000, log_samples=False)
            for task_name, metrics in results["results"].items():
                out[task_name] = _metrics(metrics)
    return out


def _metrics(raw: dict) -> dict[str, float]:
    out = {}
    for key, value in raw.items():
        metric, _, kind = key.partition(",")
        if not kind or not isinstance(value, (int, float)):
            continue  # alias, name, sample_len; "N/A" errors
        out[metric if kind == "none" else f"{metric}/{kind}"] = float(value)
    return out
