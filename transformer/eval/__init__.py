"""Evaluation and generation, of a run's checkpoints or of a Hugging Face model directory. Each
module imports only those above it in this list:

- `generate.py`: KV-cache sampling (`generate`, `generate_seq2seq`) and an encoder's `fill_mask`;
- `evaluate.py`: what `eval.py --workdir` runs: the saved config, a restored checkpoint, its loss,
  perplexity and bits per byte on the trainer's validation windows, sampling and mask filling;
- `pretrained.py`: the same of `eval.py --hf PATH`, and a run's checkpoint written as a Hugging
  Face model (`--export-hf`).
"""

from transformer.eval import evaluate, pretrained
from transformer.eval.evaluate import note
from transformer.eval.generate import SamplingConfig
from transformer.eval.pretrained import export_hf

__all__ = ["SamplingConfig", "evaluate", "export_hf", "note", "pretrained"]
