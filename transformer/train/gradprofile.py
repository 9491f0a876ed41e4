"""The gradient profile (`train.py CONFIG --grad-profile`): the norm of every layer's gradient, per
parameter, after one backward pass at initialisation, on the run's first training batch (the
gradient its first step would take, before clipping).

It is Xiong et al. 2020's measurement ("On Layer Normalization in the Transformer Architecture",
arXiv 2002.04745, Figure 3 and Theorem 1). At initialisation the gradient of the last layer's FFN
weights is O(d sqrt(ln d)) under Post-LN whatever the depth L, and O(d sqrt(ln d / L)) under Pre-LN;
so Post-LN's is the larger by ~sqrt(L), and under Post-LN the gradient grows toward the output where
Pre-LN's stays level across layers: why Post-LN needs a learning-rate warm-up and Pre-LN does not.

On a sweep file (`configs/ablations/xiong.yaml`: placements x depths x seeds) each member is profiled
into its own folder, and report/gradients.py sets them side by side.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from transformer import sharding
from transformer.config import Config
from transformer.data import prepare
from transformer.model import layer_slots
from transformer.train.coordcheck import write_check
from transformer.train.trainer import Trainer, per_layer_norm

PROFILE_FILE, FIGURE_FILE = "grad_profile.json", "grad_profile.png"
GROUPS = {"attention": "attn/", "FFN": "ffn/", "all": ""}  # a layer's parameters, by path prefix


@dataclasses.dataclass
class GradProfile:
    """Gradient norms at initialisation: per parameter of the main stack (its path inside a block,
    e.g. `ffn/w_in`), one per layer in layer order (None where a layer has no such parameter, as a
    dense layer among MoE layers); of each parameter outside the blocks; of an encoder-decoder's
    encoder stack, per parameter and layer; and the batch's loss."""

    norms: dict[str, list[float | None]]
    outside: dict[str, float]
    encoder: dict[str, list[float | None]]
    loss: float

    @property
    def n_layers(self) -> int:
        return len(next(iter(self.norms.values())))

    def group(self, name: str, stack: str = "main") -> list[float]:
        """Per layer, the norm of the gradient of the layer's parameters in `GROUPS[name]`."""
        norms = self.norms if stack == "main" else self.encoder
        rows = [v for k, v in norms.items() if k.startswith(GROUPS[name])]
        layers = len(next(iter(norms.values())))
        column = [[row[i] for row in rows] for i in range(layers)]
        return [float(np.sqrt(sum(0.0 if v is None else v * v for v in values))) for values in column]

    def table(self) -> list[str]:
        """A line per layer: its attention, FFN and whole gradient norms."""
        columns = {name: self.group(name) for name in GROUPS}
        lines = ["layer " + "".join(f"{name:>12}" for name in columns)]
        for i in range(self.n_layers):
            lines.append(f"{i + 1:>5} " + "".join(f"{columns[name][i]:>12.4g}" for name in columns))
        return lines

    def lines(self) -> list[str]:
        """One line per group: its first and last layers' gradient norms and their ratio."""
        out = []
        for stack in ("main", "encoder") if self.encoder else ("main",):
            for name in ("attention", "FFN"):
                norms = self.group(name, stack)
                out.append(
                    f"{'encoder ' if stack == 'encoder' else ''}{name} gradient norm at init: layer 1 {norms[0]:.4g}, "
                    f"layer {len(norms)} {norms[-1]:.4g} (last / first {norms[-1] / norms[0]:.3g})"
                )
        return out

    def to_json(self) -> str:
        groups = {name: self.group(name) for name in GROUPS}
        return json.dumps({**dataclasses.asdict(self), "groups": groups})

    @classmethod
    def from_json(cls, text: str) -> GradProfile:
        fields = json.loads(text)
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls)})


def _gradient_norms(trainer: Trainer, state, batch) -> tuple[dict, jax.Array]:
    """(every parameter's gradient norm, per layer along a stack's leading axis; the batch's loss)."""
    grads, nll_sum, count, _, _ = trainer.gradients(state, batch)

    def norm(path, g):
        if str(path[0].key).endswith("blocks"):
            return per_layer_norm(g)
        return jnp.sqrt(jnp.sum(jnp.square(g.astype(jnp.float32))))

    return jax.tree_util.tree_map_with_path(norm, grads), nll_sum / count


def _flatten(tree: dict) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(k.key) for k in path): np.asarray(v) for path, v in leaves}


def grad_profile(cfg: Config) -> GradProfile:
    """The profile of `cfg`'s model at its initial parameters (`model.init_from`'s, if it names a
    checkpoint) on its first training batch."""
    data = prepare(cfg.data, cfg.train.batch_size, cfg.train.seed, log=lambda _: None)
    cfg = cfg.with_vocab(data.vocab_size)
    trainer = Trainer(cfg, sharding.make_mesh(cfg))
    batch = trainer.put_batch(data.train_batch(0, jax.process_index(), jax.process_count()), cfg.train.batch_size)
    return profile_of(trainer, trainer.initial_state(), batch)


def profile_of(trainer: Trainer, state, batch: dict) -> GradProfile:
    """The profile of the gradient the step at `state` would take on `batch`."""
    cfg = trainer.cfg
    tree, loss = jax.device_get(jax.jit(lambda s, b: _gradient_norms(trainer, s, b))(state, batch))
    stacks = {stack: _flatten(tree[stack]) for stack in ("blocks", "moe_blocks") if stack in tree}
    names = list(dict.fromkeys(name for flat in stacks.values() for name in flat))
    norms = {
        name: [None if name not in stacks[s] else float(stacks[s][name][j]) for s, j in layer_slots(cfg.model)]
        for name in names
    }
    outside = {k: float(v) for k, v in _flatten({k: v for k, v in tree.items() if not k.endswith("blocks")}).items()}
    encoder: dict[str, list[float | None]] = {
        k: [float(x) for x in v] for k, v in _flatten(tree.get("encoder_blocks", {})).items()
    }
    return GradProfile(norms, outside, encoder, float(loss))


def _profile_figure(profile: GradProfile):
    """Gradient norm against layer index, a line per parameter and per group."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.subplots()
    layers = np.arange(1, profile.n_layers + 1)
    for name, values in profile.norms.items():
        ax.plot(layers, [np.nan if v is None else v for v in values], marker=".", lw=0.8, alpha=0.6, label=name)
    for name in ("attention", "FFN"):
        ax.plot(layers, profile.group(name), marker="o", lw=2, label=f"{name} (all)")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("gradient norm at init")
    ax.legend(fontsize=6, ncol=2)
    return fig


def write_profile(profile: GradProfile, out: Path) -> list[Path]:
    return write_check(out, (PROFILE_FILE, profile.to_json()), (FIGURE_FILE, _profile_figure(profile)))
