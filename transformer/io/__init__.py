"""Reading and writing parameters in the two formats a run meets; neither imports the other:

- `checkpoint.py`: the run's own orbax checkpoints (`Checkpointer`: save, checksums, fall-back
  restore, set-aside) and `load(DIR)` of a run's config and model for notebooks;
- `hf.py`: the Hugging Face format, one table entry per `model_type` (config.json keys, tensor
  layout), read tensor by tensor into sharded parameters (`load_params`) and written back (`save`).

Both sit below the trainer, which restores and initialises from them; the commands that use a whole
Hugging Face checkpoint (`eval.py --hf`, `--export-hf`) are `transformer/eval/pretrained.py`'s.
The face exports the checkpoint names the trainer uses, and each module by name, whose functions read
best qualified (`checkpoint.load`, `hf.load_params`).
"""

from transformer.io import checkpoint, hf
from transformer.io.checkpoint import (
    Checkpointer,
    CheckpointError,
    SaveFailed,
    check_writable,
    meta_record,
    partial_writes,
    state_is_finite,
)
from transformer.io.hf import HFError, load_run_config, with_pretrained

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "HFError",
    "SaveFailed",
    "check_writable",
    "checkpoint",
    "hf",
    "load_run_config",
    "meta_record",
    "partial_writes",
    "state_is_finite",
    "with_pretrained",
]
