"""Evaluation and generation, of a run's checkpoints or of a Hugging Face model directory. Each
module imports only those above it in this list:

- `generate.py`: KV-cache sampling (`generate`, `generate_seq2seq`) and an encoder's `fill_mask`;
- `harness.py`: downstream tasks through lm-evaluation-harness: the model as an lm-eval `LM`
  (log-likelihoods in static-shape batches, generation with the KV cache) and `run_tasks`;
- `tasks.py`: the tasks shipped with the framework (`stdlib_next_line`), as offline lm-eval configs;
- `evaluate.py`: what `eval.py --workdir` runs: the saved config, a restored checkpoint, its loss,
  perplexity and bits per byte on the trainer's validation windows, sampling and mask filling, and
  lm-eval tasks (`--tasks`, and `train.eval_tasks` in the loop);
- `pretrained.py`: the same of `eval.py --hf PATH`, and a run's checkpoint written as a Hugging
  Face model (`--export-hf`).
"""

from transformer.eval import evaluate, harness, pretrained
from transformer.eval.evaluate import note
from transformer.eval.generate import SamplingConfig
from transformer.eval.pretrained import export_hf

__all__ = ["SamplingConfig", "evaluate", "export_hf", "harness", "note", "pretrained"]
