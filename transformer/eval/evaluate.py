"""What `eval.py` does: loss / perplexity / bits per byte of any kept checkpoint, and sampling."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from transformer import limits, rundir, sharding
from transformer.accelerator import resolve
from transformer.config import SAFE_ON_RESUME, Config, ConfigError, config_changes
from transformer.config_loader import apply_overrides, from_dict
from transformer.data import Data, TokenizerError, Vocab, make_objective, prepare, row_tokens
from transformer.eval.generate import SamplingConfig, fill_mask, generate, generate_seq2seq
from transformer.io import Checkpointer
from transformer.train import Trainer, validation_metrics


def run_config(workdir: Path, overrides: list[str]) -> Config:
    """The run's resolved config, with overrides (another dataset, another mesh) applied."""
    if not rundir.has_config(workdir):
        raise ConfigError("--workdir", f"{workdir} holds no run (no {rundir.CONFIG})")
    saved = rundir.read_config(workdir)
    cfg = from_dict(apply_overrides(saved.to_dict(), overrides))
    check_parameter_shapes(saved, cfg)
    # a run trained elsewhere (float16 or cuDNN attention on a GPU) may not run here: say which
    # override would (model.dtype and model.attention_impl keep the parameters' shapes)
    limits.check_attention_support(resolve(cfg).model)
    return cfg


def check_parameter_shapes(saved: Config, cfg: Config) -> None:
    """Refuse overrides that change the shapes of the trained parameters (model.d_model, ...), naming
    the keys, before the checkpoint is read (orbax's own complaint is a 100-line traceback). data.*
    and mesh.* overrides, and the model keys a resume may change, are what eval.py is for; any other
    model key passes when the parameters keep their shapes (model.attention_impl, model.dtype)."""
    from flax import nnx

    from transformer.model import abstract_model

    unsafe, _ = config_changes(saved, cfg)
    keys = [line.partition(":")[0] for line in unsafe if line.startswith("model.")]
    keys = [key for key in keys if not key.startswith(SAFE_ON_RESUME)]
    if not keys:
        return

    def shapes(c: Config) -> dict:
        params = nnx.state(abstract_model(c.model), nnx.Param)
        return {path: leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(params)}

    if shapes(saved) != shapes(cfg):
        changes = "; ".join(line for line in unsafe if line.partition(":")[0] in keys)
        raise ConfigError(
            ", ".join(keys),
            f"would change the shapes of the run's trained parameters ({changes}); eval.py may override "
            "data.*, mesh.* and model keys that keep the parameters' shapes",
        )


def note(message: str) -> None:
    """A line for the user on stderr (stdout may carry --json): e.g. a damaged checkpoint passed over."""
    import sys

    print(f"eval.py: {message}", file=sys.stderr)


def restore_params(cfg: Config, workdir: Path, step: int | None, trainer: Trainer) -> tuple[int, dict]:
    """(step, parameters) of a kept checkpoint, placed on the trainer's mesh. Without `step`, the
    latest whose parameters are intact: a damaged newer one is passed over, with a `note`; a damaged
    `step` asked for is a CheckpointError."""
    ckpt = Checkpointer(workdir, cfg.checkpoint, read_only=True)
    try:
        return ckpt.restore_params(step, trainer.abstract_state().params, note)
    finally:
        ckpt.close()


def split_windows(data: Data, split: str, limit: int | None = None) -> Data:
    """The windows to evaluate: the fixed validation set, or as many evenly spaced training windows
    (bits per byte then by the training split's bytes per token); the first `limit` of them when
    given. A mixture's are each source's own, chosen so (its parts are what validation_metrics reads)."""
    if data.parts:
        parts = tuple(dataclasses.replace(p, data=split_windows(p.data, split, limit)) for p in data.parts)
        first = parts[0].data
        # the top-level fields are the first source's, as `prepare` leaves them
        return dataclasses.replace(
            data,
            val=first.val,
            val_window_ids=first.val_window_ids,
            val_bytes_per_token=first.val_bytes_per_token,
            parts=parts,
        )
    if split == "train":
        import json

        import numpy as np

        ids = np.unique(np.linspace(0, data.train.count - 1, len(data.val_window_ids)).round().astype(np.int64))
        meta = json.loads((data.cache_path / "meta.json").read_text())["train"]
        data = dataclasses.replace(
            data, val=data.train, val_window_ids=ids, val_bytes_per_token=data.objective.bytes_per_token(meta)
        )
    return data if limit is None else dataclasses.replace(data, val_window_ids=data.val_window_ids[:limit])


def evaluate_run(
    workdir: Path,
    step: int | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    split: str = "val",
    batches: int | None = None,
) -> dict:
    """Loss, perplexity and bits per byte of a kept checkpoint on `split`'s windows (the first
    `batches` batches of them). A mixture's loss and bits per byte are its sources' weighted as
    training weights them, and `sources` gives each source's own; `tokens` counts all sources'."""
    cfg = run_config(workdir, list(overrides))
    trainer = Trainer(cfg, sharding.make_mesh(cfg))
    step, params = restore_params(cfg, workdir, step, trainer)
    return evaluate_params(cfg, trainer, params, step, workdir, split, batches)


def evaluate_params(
    cfg: Config, trainer: Trainer, params: dict, step: int, workdir: Path | None, split: str, batches: int | None
) -> dict:
    """`evaluate` of given parameters (`workdir`: the run's, for its tokenizer; None for none)."""
    data = prepare(cfg.data, cfg.train.batch_size, cfg.train.seed, workdir, log=lambda _: None)
    if cfg.with_vocab(data.vocab_size).model.vocab_size != cfg.model.vocab_size:
        raise ConfigError(
            "data.tokenizer", f"gives {data.vocab_size} ids; the model was trained with {cfg.model.vocab_size}"
        )
    data = split_windows(data, split, None if batches is None else batches * cfg.train.batch_size)
    result = validation_metrics(trainer, params, data)
    out = {
        "step": step,
        "split": split,
        "source": cfg.data.source if not data.parts else f"a mixture of {len(data.parts)} sources",
        "loss": result["val_loss"],
        "perplexity": result["val_perplexity"],
        "accuracy": result["val_accuracy"],
        "bits_per_byte": result.get("val_bits_per_byte"),
        # the rows' tokens (a row of each stream: the decoder's, and an encoder's)
        "tokens": sum(len(d.val_window_ids) * row_tokens(d.objective.lengths) for d in _sources(data)),
    }
    if data.parts:
        out["sources"] = per_source(cfg, data, result)
    return out


def _sources(data: Data) -> list[Data]:
    """Each source's Data: a mixture's parts, or the one source."""
    return [p.data for p in data.parts] or [data]


def per_source(cfg: Config, data: Data, result: dict[str, float]) -> dict[str, dict]:
    """A mixture's sources by name: spec, normalised weight, loss, bits per byte and tokens evaluated."""
    return {
        p.name: {
            "source": entry.source,
            "weight": p.weight,
            "loss": result[f"val/{p.name}/loss"],
            "bits_per_byte": result[f"val/{p.name}/bits_per_byte"],
            "tokens": len(p.data.val_window_ids) * cfg.data.seq_len,
        }
        for entry, p in zip(cfg.data.mixture, data.parts)
    }


def encode_prompts(vocab: Vocab, prompts: list[str], flag: str = "--generate") -> list[list[int]]:
    """Each prompt's ids (<mask> and <extra_id_i> as the objective's own ids); a prompt the run's
    tokenizer cannot take (a BPE refuses the lone surrogates that stand for undecodable bytes in
    argv) is a ConfigError naming it."""
    out = []
    for text in prompts:
        try:
            out.append(vocab.encode(text))
        except TokenizerError as e:
            raise ConfigError(flag, f"prompt {text[:30]!r}: {e}") from None
    return out


def _run_vocab(workdir: Path, step: int | None) -> tuple[Config, Vocab]:
    """The run's config and vocabulary (its tokenizer and objective's extra ids), once the asked
    checkpoint is known to exist (a missing step is a one-line error before any work)."""
    from transformer.data import cache_directory, make_tokenizer

    cfg = run_config(workdir, [])
    ckpt = Checkpointer(workdir, cfg.checkpoint, read_only=True)
    try:
        ckpt.pick(step)
    finally:
        ckpt.close()
    tokenizer = make_tokenizer(cfg.data, workdir, cache_directory(cfg.data))
    return cfg, make_objective(cfg.data, tokenizer).vocab


def sample_run(workdir: Path, prompts: list[str], sampling: SamplingConfig, step: int | None = None) -> list[str]:
    from transformer.io import checkpoint

    cfg, vocab = _run_vocab(workdir, step)
    encoded = checked_prompts(cfg, vocab, prompts, sampling)
    _, model = checkpoint.load(workdir, step, note)
    return complete(cfg, model, vocab, encoded, sampling)


def checked_prompts(cfg: Config, vocab: Vocab, prompts: list[str], sampling: SamplingConfig) -> list[list[int]]:
    """Each prompt's ids; an empty prompt, or one too long for the model's context, is a ConfigError.
    An encoder-decoder's prompt is its encoder's input, and its output starts afresh."""
    _check(
        cfg.model.arch != "encoder", "an encoder-only model does not generate: ask it --fill-mask 'text with <mask>'"
    )
    encoded = encode_prompts(vocab, prompts)
    for text, ids in zip(prompts, encoded):
        _check(bool(ids), "an empty prompt: give at least one character")
        assert cfg.model.max_seq_len is not None  # a run's Config fills it from data.seq_len
        _check(
            len(ids) <= cfg.model.max_seq_len,
            f"prompt {text[:30]!r}... is {len(ids)} tokens, longer than the context of {cfg.model.max_seq_len}",
        )
        # the decoder's row: BOS then the output (encoder-decoder), or the prompt, the separator of
        # a prefix run, then the continuation
        before = 1 if cfg.model.arch == "encoder_decoder" else len(ids) + (cfg.data.objective == "prefix")
        _check(
            cfg.model.fits_positions(before + sampling.max_new_tokens),
            f"prompt {text[:30]!r}... is {len(ids)} tokens; with --max-new-tokens {sampling.max_new_tokens} "
            f"that exceeds the model's context of {cfg.model.max_seq_len}",
        )
    return encoded


def _check(ok: bool, message: str, flag: str = "--generate") -> None:
    if not ok:
        raise ConfigError(flag, message)


def complete(
    cfg: Config,
    model,
    vocab: Vocab,
    encoded: list[list[int]],
    sampling: SamplingConfig,
    decoder_start: int | None = None,
) -> list[str]:
    """The sampled continuation of each prompt, as text: an encoder-decoder's output for the prompt
    as its input, decoded from `decoder_start` (None: BOS, as this framework trains them); a
    decoder trained on pairs (prefix) continues after the separator it was trained with, so the
    prompt is an input and the continuation its target."""
    t = vocab.tokenizer
    if cfg.model.arch == "encoder_decoder":
        start = t.bos_id if decoder_start is None else decoder_start
        out = generate_seq2seq(model, encoded, start, t.eos_id, t.pad_id, sampling)
    else:
        separator = [t.bos_id] if cfg.data.objective == "prefix" else []
        out = generate(model, [ids + separator for ids in encoded], t.eos_id, t.pad_id, sampling)
    return [vocab.decode(ids) for ids in out]


def fill_masks(workdir: Path, texts: list[str], top_k: int, step: int | None = None) -> list[dict]:
    """`eval.py --fill-mask TEXT`: an encoder's `top_k` predictions at each <mask> of each text,
    and the text with every mask replaced by its best prediction."""
    from transformer.io import checkpoint

    cfg, vocab = _run_vocab(workdir, step)
    encoded = checked_masked_texts(cfg, vocab, texts)
    _, model = checkpoint.load(workdir, step, note)
    return filled(model, vocab, texts, encoded, top_k)


def checked_masked_texts(cfg: Config, vocab: Vocab, texts: list[str]) -> list[list[int]]:
    """The texts' ids for --fill-mask, once each is known to hold a <mask> and fit the context."""
    _check(cfg.model.arch == "encoder", f"fills masks with an encoder (model.arch={cfg.model.arch})", "--fill-mask")
    encoded = encode_prompts(vocab, texts, "--fill-mask")
    for text, ids in zip(texts, encoded):
        _check(vocab.mask_id in ids, f"{text[:30]!r} has no <mask> to fill", "--fill-mask")
        _check(
            len(ids) <= (cfg.model.max_seq_len or 0),
            f"{text[:30]!r}... is {len(ids)} tokens, longer than the context of {cfg.model.max_seq_len}",
            "--fill-mask",
        )
    return encoded


def filled(model, vocab: Vocab, texts: list[str], encoded: list[list[int]], top_k: int) -> list[dict]:
    """Each text with every mask replaced by its best prediction, and the `top_k` of each mask."""
    assert vocab.mask_id is not None  # an encoder's objective (mlm) has one
    best = fill_mask(model, encoded, vocab.mask_id, vocab.tokenizer.pad_id, top_k)
    out = []
    for text, ids, per_mask in zip(texts, encoded, best):
        best_first = iter([top[0] for top in per_mask])  # the masks in order, each filled by its best
        ids = [next(best_first) if i == vocab.mask_id else i for i in ids]
        out.append(
            {
                "text": text,
                "filled": vocab.decode(ids),
                "top": [[vocab.decode([c]) for c in top] for top in per_mask],
            }
        )
    return out


def task_suite(cfg: Config, names: list[str], include_path: list[Path], progress: bool = True) -> dict:
    """lm-eval's tasks by name, loaded once (a TaskError naming a task that cannot be); the shipped
    tasks' items live under data.cache_dir/tasks."""
    from transformer.data import cache_directory
    from transformer.eval import harness
    from transformer.eval.tasks import builtin_tasks

    loaded = harness.load_tasks(names, include_path, builtin_tasks(cache_directory(cfg.data) / "tasks"), progress)
    harness.check_task_kinds(cfg, loaded)
    return loaded


def loop_tasks(cfg: Config, trainer: Trainer, vocab: Vocab):
    """`train.eval_tasks` for the training loop: a function of the parameters giving
    {"eval/<task>/<metric>": value}, its tasks loaded (and checked) now, before training."""
    from flax import nnx

    from transformer.eval import harness

    harness.check_model(cfg)
    loaded = task_suite(cfg, list(cfg.train.eval_tasks), [], progress=False)

    def scores(params) -> dict[str, float]:
        lm = harness.make_lm(cfg, nnx.merge(trainer.graphdef, params), vocab, cfg.train.batch_size)
        results = harness.run_tasks(lm, loaded, cfg.train.eval_tasks_limit, progress=False)
        return {f"eval/{task}/{metric}": v for task, metrics in results.items() for metric, v in metrics.items()}

    return scores


def evaluate_tasks(
    workdir: Path, names: list[str], limit: int | None, include_path: list[Path], step: int | None = None
) -> dict:
    """`eval.py --workdir DIR --tasks ...`: {"step", "tasks": {task: {metric: value}}} of a kept checkpoint."""
    from flax import nnx

    from transformer.eval import harness

    harness.require_lm_eval()
    cfg, vocab = _run_vocab(workdir, step)
    harness.check_model(cfg)
    trainer = Trainer(cfg, sharding.make_mesh(cfg))
    loaded = task_suite(cfg, names, include_path)
    step, params = restore_params(cfg, workdir, step, trainer)
    lm = harness.make_lm(cfg, nnx.merge(trainer.graphdef, params), vocab, cfg.train.batch_size)
    return {"step": step, "tasks": harness.run_tasks(lm, loaded, limit)}
