"""A JAX/Flax research framework for training Transformers (decoder-only, encoder-only and
encoder-decoder) and comparing ablations: the same model trained several times with one thing
changed, then compared for final loss and for stability.

One package per stage, each with a face; imports point down this list and never in a loop:

- the floor: `config`, `config_loader`, `errors`, `synthetic`, `rundir`, `accelerator`, `sharding`,
  `limits`, `lazy`;
- `model`: the function a Transformer computes (every variant, every family);
- `data`: from a `data.*` config to step-indexed batches; `io`: orbax checkpoints and the Hugging
  Face format;
- `train`: the step, the loop and the `train.py` job; `eval`: evaluation and generation of runs and
  Hugging Face models;
- `sweep`: many members run from one sweep file; `report`: their statistics, figures and report;
- `cli`: `train.py` and `eval.py`.

The README's module map says what each module owns and why it lives where it does.
"""
