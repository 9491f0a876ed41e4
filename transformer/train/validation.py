"""Validation on the host: the fixed validation windows of each source run through the trainer's
jitted eval step in batches, summed on the host, and reported as the training log reports them.
The loop calls it at `train.eval_every`; `eval.py` calls it on a restored checkpoint."""

from __future__ import annotations

import math

import jax

from transformer.data import Data
from transformer.train.trainer import Trainer


def validation_metrics(trainer: Trainer, params, data: Data) -> dict[str, float]:
    """Loss, perplexity and bits/byte on the fixed validation windows. A mixture reports each
    source's (val/<name>/loss, val/<name>/bits_per_byte) and, as val_loss and val_bits_per_byte,
    their means weighted by the sources' weights (not by their validation tokens: the total
    means the same mixture the run trains on, however many windows each source validates on)."""
    if not data.parts:
        return _one_source(trainer, params, data)
    out: dict[str, float] = {}
    for part in data.parts:
        own = _one_source(trainer, params, part.data)
        out[f"val/{part.name}/loss"] = own["val_loss"]
        out[f"val/{part.name}/bits_per_byte"] = own["val_bits_per_byte"]
        out[f"val/{part.name}/accuracy"] = own["val_accuracy"]
    loss, bpb, accuracy = (
        sum(p.weight * out[f"val/{p.name}/{name}"] for p in data.parts)
        for name in ("loss", "bits_per_byte", "accuracy")
    )
    return {
        "val_loss": loss,
        "val_perplexity": math.exp(min(loss, 700.0)),
        "val_bits_per_byte": bpb,
        "val_accuracy": accuracy,
        **out,
    }


def _one_source(trainer: Trainer, params, data: Data) -> dict[str, float]:
    B = trainer.cfg.train.batch_size
    pidx, pcount = jax.process_index(), jax.process_count()
    per = B // pcount
    nll, count, correct = 0.0, 0.0, 0.0
    for batch in data.val_batches(B):
        local = {k: v[pidx * per : (pidx + 1) * per] for k, v in batch.items()}
        n, c, r = trainer.eval_step(params, trainer.put_batch(local, B))
        nll, count, correct = nll + float(n), count + float(c), correct + float(r)
    loss = nll / count
    out = {
        "val_loss": loss,
        "val_perplexity": math.exp(min(loss, 700.0)),
        "val_accuracy": correct / count,  # of the predicted tokens: every one, or the masked ones (mlm)
    }
    if trainer.cfg.data.objective == "causal":  # elsewhere not every byte of the text is predicted
        out["val_bits_per_byte"] = loss / math.log(2) / data.val_bytes_per_token
    return out
