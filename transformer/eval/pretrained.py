"""The commands that take a Hugging Face model directory as a whole: `eval.py --hf PATH` (evaluate,
sample) and `eval.py --workdir RUN --export-hf OUT`. The format itself (config.json, tensors) is
`hf.py`'s; these sit above the trainer and the evaluation they run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from transformer.config import Config
from transformer.io import hf


def pretrained_config(path: Path, overrides: Sequence[str] = ()) -> Config:
    """What `eval.py --hf PATH` evaluates with: the default config with model.init_from=PATH, and the
    overrides (data.source=..., mesh.*)."""
    return hf.load_run_config(None, [f"model.init_from={path}", *overrides])


def _params_on_mesh(cfg: Config, path: Path, trainer) -> dict:
    return hf.load_params(path, cfg.model, trainer.abstract_state().params)


def evaluate_pretrained(
    path: Path, overrides: Sequence[str] = (), split: str = "val", batches: int | None = None
) -> dict:
    """`eval.py --hf PATH`: as `evaluate_run` of a run, at step 0, on the config's data."""
    from transformer import sharding
    from transformer.eval.evaluate import evaluate_params
    from transformer.train import Trainer

    cfg = pretrained_config(path, overrides)
    trainer = Trainer(cfg, sharding.make_mesh(cfg))
    return evaluate_params(cfg, trainer, _params_on_mesh(cfg, path, trainer), 0, None, split, batches)


def sample_pretrained(path: Path, prompts: list[str], sampling, overrides: Sequence[str] = ()) -> list[str]:
    """`eval.py --hf PATH --generate ...`: continuations of the prompts, with PATH's tokenizer."""
    from flax import nnx

    from transformer.accelerator import resolve
    from transformer.data import Vocab, cache_directory, make_tokenizer
    from transformer.eval.evaluate import checked_prompts, complete
    from transformer.model import Transformer

    cfg = resolve(pretrained_config(path, overrides))  # the dtype and attention this machine runs
    vocab = Vocab(make_tokenizer(cfg.data, None, cache_directory(cfg.data)))
    encoded = checked_prompts(cfg, vocab, prompts, sampling)
    params = hf.load_params(path, cfg.model, hf.abstract_params(cfg.model))
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))
    start = decoder_start(path, cfg.model.vocab_size) if cfg.model.arch == "encoder_decoder" else None
    return complete(cfg, nnx.merge(graphdef, params), vocab, encoded, sampling, start)


def decoder_start(path: Path, vocab_size: int) -> int | None:
    """The token an encoder-decoder checkpoint decodes from: config.json's decoder_start_token_id
    (BART's </s>), else T5's convention, its pad_token_id; None where it names neither (BOS then)."""
    config = hf.read_config_json(path)
    for key in ("decoder_start_token_id", "pad_token_id" if config.get("model_type") == "t5" else None):
        value = config.get(key) if key else None
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size:
            return value
    return None


def fill_mask_pretrained(path: Path, texts: list[str], top_k: int, overrides: Sequence[str] = ()) -> list[dict]:
    """`eval.py --hf PATH --fill-mask TEXT`: as `fill_masks` of a run, with PATH's tokenizer (its own
    mask token, where it has one, is what <mask> in the text stands for)."""
    from flax import nnx

    from transformer.accelerator import resolve
    from transformer.data import cache_directory, make_objective, make_tokenizer
    from transformer.eval.evaluate import checked_masked_texts, filled
    from transformer.model import Transformer, for_inference

    cfg = resolve(pretrained_config(path, overrides))
    vocab = make_objective(cfg.data, make_tokenizer(cfg.data, None, cache_directory(cfg.data))).vocab
    encoded = checked_masked_texts(cfg, vocab, texts)
    params = hf.load_params(path, cfg.model, hf.abstract_params(cfg.model))
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))
    return filled(for_inference(nnx.merge(graphdef, params)), vocab, texts, encoded, top_k)


def export_hf(workdir: Path, step: int | None, out: Path, note: Callable[[str], None]) -> str:
    """`eval.py --workdir RUN [--step N] --export-hf OUT`: the checkpoint as a Hugging Face model
    directory, with the run's tokenizer; returns a line saying what was written."""
    from flax import nnx

    from transformer.data import cache_directory, make_tokenizer
    from transformer.eval.evaluate import run_config
    from transformer.io import checkpoint

    cfg = run_config(workdir, [])
    family = hf.export_family(cfg.model)  # refuse before reading anything
    if out.exists() and any(out.iterdir()):
        raise hf.HFError("--export-hf", f"{out} exists and is not empty: give a new directory")
    tokenizer = make_tokenizer(cfg.data, workdir, cache_directory(cfg.data))
    _, model = checkpoint.load(workdir, step, note)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    hf.save(cfg.model, nnx.to_pure_dict(nnx.state(model, nnx.Param)), out, ids)
    written = [hf.CONFIG_JSON, hf.WEIGHTS]
    for name, text in tokenizer.files().items():
        (out / name).write_text(text)
        written.append(name)
    return f"wrote {out} ({family.name}): {', '.join(written)}"


def tasks_pretrained(
    path: Path, names: list[str], limit: int | None, include_path: list[Path], overrides: Sequence[str] = ()
) -> dict:
    """`eval.py --hf PATH --tasks ...`: as `evaluate_tasks` of a run, at step 0, with PATH's tokenizer
    (data.seq_len, an override, sets the context rows are cut to; it is the model's at most)."""
    from flax import nnx

    from transformer.accelerator import resolve
    from transformer.data import Vocab, cache_directory, make_tokenizer
    from transformer.eval import harness
    from transformer.eval.evaluate import task_suite
    from transformer.model import Transformer

    harness.require_lm_eval()
    cfg = resolve(pretrained_config(path, overrides))
    harness.check_model(cfg)
    vocab = Vocab(make_tokenizer(cfg.data, None, cache_directory(cfg.data)))
    params = hf.load_params(path, cfg.model, hf.abstract_params(cfg.model))
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))
    lm = harness.make_lm(cfg, nnx.merge(graphdef, params), vocab, cfg.train.batch_size)
    return {"step": 0, "tasks": harness.run_tasks(lm, task_suite(cfg, names, include_path), limit)}
