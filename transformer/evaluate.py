"""What `eval.py` does: loss / perplexity / bits per byte of any kept checkpoint, and sampling."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from transformer import rundir, sharding
from transformer.checkpoint import Checkpointer
from transformer.config import Config, ConfigError
from transformer.config_loader import apply_overrides, from_dict
from transformer.data import Data, prepare
from transformer.generate import SamplingConfig, generate
from transformer.trainer import Trainer


def run_config(workdir: Path, overrides: list[str]) -> Config:
    """The run's resolved config, with overrides (another dataset, another mesh) applied."""
    if not rundir.has_config(workdir):
        raise ConfigError("--workdir", f"{workdir} holds no run (no {rundir.CONFIG})")
    return from_dict(apply_overrides(rundir.read_config(workdir).to_dict(), overrides))


def restore_params(cfg: Config, workdir: Path, step: int | None, trainer: Trainer) -> tuple[int, dict]:
    """(step, parameters) of a kept checkpoint, placed on the trainer's mesh."""
    ckpt = Checkpointer(workdir, cfg.checkpoint, read_only=True)
    try:
        step = ckpt.pick(step)
        return step, ckpt.restore_params(step, trainer.abstract_state().params)
    finally:
        ckpt.close()


def split_windows(data: Data, split: str):
    """The windows to evaluate: the fixed validation set, or as many evenly spaced training windows."""
    if split == "val":
        return data
    import numpy as np

    ids = np.unique(np.linspace(0, data.train.count - 1, len(data.val_window_ids)).round().astype(np.int64))
    return dataclasses.replace(data, val=data.train, val_window_ids=ids)


def evaluate(
    workdir: Path,
    step: int | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    split: str = "val",
    batches: int | None = None,
) -> dict:
    cfg = run_config(workdir, list(overrides))
    mesh = sharding.make_mesh(cfg)
    trainer = Trainer(cfg, mesh)
    step, params = restore_params(cfg, workdir, step, trainer)
    data = prepare(cfg.data, cfg.train.batch_size, cfg.train.seed, workdir, log=lambda _: None)
    if data.vocab_size != cfg.model.vocab_size:
        raise ConfigError(
            "data.tokenizer", f"gives {data.vocab_size} ids; the model was trained with {cfg.model.vocab_size}"
        )
    data = split_windows(data, split)
    if batches is not None:
        data = dataclasses.replace(data, val_window_ids=data.val_window_ids[: batches * cfg.train.batch_size])
    result = trainer.evaluate(params, data)
    tokens = len(data.val_window_ids) * cfg.data.seq_len
    return {
        "step": step,
        "split": split,
        "source": cfg.data.source,
        "loss": result["val_loss"],
        "perplexity": result["val_perplexity"],
        "bits_per_byte": result["val_bits_per_byte"],
        "tokens": tokens,
    }


def sample(workdir: Path, prompts: list[str], sampling: SamplingConfig, step: int | None = None) -> list[str]:
    from transformer.checkpoint import load
    from transformer.data import default_cache_dir, make_tokenizer

    cfg = run_config(workdir, [])
    ckpt = Checkpointer(workdir, cfg.checkpoint, read_only=True)
    try:
        step = ckpt.pick(step)  # before any work: a missing step is a one-line error
    finally:
        ckpt.close()
    cache_dir = Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else default_cache_dir()
    tokenizer = make_tokenizer(cfg.data, workdir, cache_dir)
    encoded = [list(ids) for ids in tokenizer.encode_batch(prompts)]
    for text, ids in zip(prompts, encoded):
        if not ids:
            raise ConfigError("--generate", "an empty prompt: give at least one character")
        assert cfg.model.max_seq_len is not None  # a run's Config fills it from data.seq_len
        if len(ids) > cfg.model.max_seq_len:
            raise ConfigError(
                "--generate",
                f"prompt {text[:30]!r}... is {len(ids)} tokens, longer than the context of {cfg.model.max_seq_len}",
            )
        longest = len(ids) + sampling.max_new_tokens
        if not cfg.model.fits_positions(longest):
            raise ConfigError(
                "--generate",
                f"prompt {text[:30]!r}... is {len(ids)} tokens; with --max-new-tokens {sampling.max_new_tokens} "
                f"that exceeds the model's context of {cfg.model.max_seq_len}",
            )
    _, model = load(workdir, step)
    out = generate(model, encoded, tokenizer.eos_id, tokenizer.pad_id, sampling)
    return [tokenizer.decode(ids) for ids in out]
