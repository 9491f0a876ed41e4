"""The coordinate check (`train.py CONFIG --coord-check`): does each activation keep its size as
the model widens, or deepens? The config's model is trained a few steps at a series of widths
(`model.d_model`; heads, head dim and FFN width follow as the config derives them) or, with
`--coord-depths`, of depths (`model.n_layers`), and the RMS of six quantities is recorded before the
first step and after each: the embedding output, the attention logits, the attention and FFN outputs
and the residual stream (each the mean over layers of the per-layer RMS; a sublayer's output before
any depth multiplier), and the output logits. A width check runs under the parametrization the
config asks for and the standard one beside it; a depth check under the config's depth scaling and
none beside it (its µP width rules kept: depth scaling sits on them).

Under µP (model/parametrization.py) every quantity stays flat in width, with one expected
exception: at initialisation µP's 1/d attention scale makes attention logits shrink as width grows
(they reach their size once queries and keys align in training). Under the standard
parametrization the output logits and the hidden activations grow once training moves them. In
depth, Adam moves each block's output by about the learning rate whatever the depth, so without
depth scaling the residual stream and the logits move more the more blocks there are; depth-µP
and CompleteP scale each branch and its learning rate so that the sum stays put. The verdict of
each quantity is the slope of log RMS against log size after the last step (1 means proportional
to it). All sizes of a µP check share the config's base shape; every check trains at the config's
learning rate, constant and without warm-up (a warm-up would hide the first steps' updates), on
the run's own first batches.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer import sharding
from transformer.config import MUP_BASE, Config, ModelConfig
from transformer.config_loader import from_dict
from transformer.data import Data, prepare
from transformer.train.trainer import Trainer, default_controls, encoder_inputs, model_inputs

COORD_WIDTHS = (64, 128, 256, 512, 1024)
COORD_STEPS = 3
AXES = ("d_model", "n_layers")  # what a check varies: the width, or with --coord-depths the depth
# quantity -> (its label, the per-layer statistic it averages; None: computed at the model's ends)
QUANTITIES: dict[str, tuple[str, str | None]] = {
    "embedding": ("embedding output", None),
    "attn_logits": ("attention logits", "attn_logit_rms"),
    "attn_out": ("attention output", "attn_out_rms"),
    "ffn_out": ("FFN output", "ffn_out_rms"),
    "residual": ("residual stream", "residual_rms"),
    "logits": ("output logits", None),
}
FLAT = 0.25  # |slope| below which a quantity is called flat (1: proportional to width, 0.5: its square root)
RESULT_FILE, FIGURE_FILE = "coord_check.json", "coord_check.png"


def coord_check_config(raw: dict[str, Any], size: int, kind: str, base: ModelConfig, axis: str = "d_model") -> Config:
    """The raw config at `size` of `axis` under `kind`, the learning rate constant from the first
    step. Along d_model `kind` is a parametrization (µP against `base`'s shape, the same for every
    width); along n_layers a depth scaling (against `base`'s base depth; `none`: µP without it)."""
    model = {k: v for k, v in (raw.get("model") or {}).items() if k not in MUP_BASE}
    model[axis] = size
    if axis == "d_model":
        model["parametrization"] = kind
        if kind == "mup":
            model.update({k: getattr(base, k) for k in MUP_BASE})
        else:  # depth scaling sits on µP's rules
            model.pop("depth_scaling", None)
    else:
        model["depth_scaling"] = kind
        if base.parametrization == "mup":
            model.update({k: getattr(base, k) for k in MUP_BASE if k != "mup_base_n_layers"})
        if kind != "none":
            model["mup_base_n_layers"] = base.mup_base_n_layers
    optim = {**(raw.get("optim") or {}), "warmup_steps": 0, "schedule": "constant"}
    return from_dict({**raw, "model": model, "optim": optim})


def _ends(trainer: Trainer) -> Callable[[dict, dict], dict[str, jax.Array]]:
    """The jitted RMS of the embedding output and of the output logits (the real vocabulary's)."""
    V = trainer.cfg.model.vocab_size

    def ends(params: dict, batch: dict) -> dict[str, jax.Array]:
        model = nnx.merge(trainer.graphdef, params)
        tokens, positions, segments = model_inputs(batch)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        embedded = model.embed_tokens(tokens, positions).astype(jnp.float32)
        x_BxTxD, _ = model.forward(tokens, positions, segments, **encoder_inputs(batch))
        logits = model.logits(x_BxTxD)[..., :V]
        return {"embedding": jnp.sqrt(jnp.mean(jnp.square(embedded))), "logits": jnp.sqrt(jnp.mean(jnp.square(logits)))}

    return jax.jit(ends)


def _batch(trainer: Trainer, data: Data, step: int) -> dict:
    B = trainer.cfg.train.batch_size
    return trainer.put_batch(data.train_batch(step, jax.process_index(), jax.process_count()), B)


def coordinates(cfg: Config, data: Data, steps: int) -> dict[str, list[float]]:
    """Each quantity's RMS on the first batch, before the first step and after each of `steps`."""
    trainer = Trainer(cfg, sharding.make_mesh(cfg))
    state, probe, ends = trainer.init(jax.random.key(cfg.train.seed)), _batch(trainer, data, 0), _ends(trainer)
    out: dict[str, list[float]] = {name: [] for name in QUANTITIES}
    for t in range(steps + 1):
        if t:
            state, _ = trainer.train_step(state, _batch(trainer, data, t - 1), default_controls())
        stats = jax.device_get(trainer.stats_step(state.params, probe))
        at_ends = jax.device_get(ends(state.params, probe))
        for name, (_, key) in QUANTITIES.items():
            out[name].append(float(at_ends[name] if key is None else np.mean(stats[key])))
    return out


def _slope(sizes: list[int], values: list[float]) -> float:
    """The least-squares slope of log value against log size."""
    return float(np.polyfit(np.log(sizes), np.log(np.maximum(values, 1e-30)), 1)[0])


@dataclasses.dataclass
class CoordCheck:
    """What a check measured: per kind (parametrization, or depth scaling), per quantity, RMS
    [step][size], the sizes being d_model's or n_layers' (`axis`)."""

    sizes: list[int]
    steps: int
    rms: dict[str, dict[str, list[list[float]]]]
    axis: str = "d_model"

    def slopes(self) -> dict[str, dict[str, float]]:
        return {p: {q: _slope(self.sizes, by_step[-1]) for q, by_step in qs.items()} for p, qs in self.rms.items()}

    def lines(self) -> list[str]:
        against = "width" if self.axis == "d_model" else "depth"
        lines = []
        for kind, slopes in self.slopes().items():
            for q, s in slopes.items():
                trend = "flat" if abs(s) < FLAT else ("grows" if s > 0 else "shrinks")
                lines.append(
                    f"{kind}: {QUANTITIES[q][0]}: {trend} (slope {s:+.2f} of log RMS against log {against}, step {self.steps})"
                )
        return lines

    def to_json(self) -> str:
        slopes = self.slopes()
        return json.dumps(
            {"axis": self.axis, "sizes": self.sizes, "steps": self.steps, "rms": self.rms, "slopes": slopes}
        )


def distinct_models(members: list[tuple[str, dict, Config]], axis: str = "d_model") -> list[tuple[str, dict, Config]]:
    """Of a sweep's (name, raw config, config) members, the first of each model the check would
    train: members differing only in `axis` (which the check varies itself), µP's base shape, or
    outside the model section (learning rate, seed) check the same thing once."""
    seen: set[str] = set()
    kept = []
    for name, raw, cfg in members:
        model = {k: v for k, v in (raw.get("model") or {}).items() if k != axis and k not in MUP_BASE}
        key = json.dumps(model, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            kept.append((name, raw, cfg))
    return kept


def run_coord_check(
    raw: dict[str, Any], cfg: Config, sizes: list[int], steps: int, log=print, axis: str = "d_model"
) -> CoordCheck:
    """The check of `cfg` (resolved from `raw`) along `axis`: across width its parametrization and,
    beside it, the standard one; across depth its depth scaling and, beside it, none."""
    assert axis in AXES, axis
    own = cfg.model.parametrization if axis == "d_model" else cfg.model.depth_scaling
    plain = "standard" if axis == "d_model" else "none"
    kinds = [own] + ([plain] if own != plain else [])
    # every size's config, validated before anything is read or trained
    members = {kind: [coord_check_config(raw, n, kind, cfg.model, axis) for n in sizes] for kind in kinds}
    data = prepare(cfg.data, cfg.train.batch_size, cfg.train.seed, log=lambda _: None)
    rms: dict[str, dict[str, list[list[float]]]] = {}
    for kind, configs in members.items():
        by_size = []
        for n, member in zip(sizes, configs):
            by_size.append(coordinates(member.with_vocab(data.vocab_size), data, steps))
            log(f"coord-check: {kind} {axis}={n} done")
        rms[kind] = {q: [[w[q][t] for w in by_size] for t in range(steps + 1)] for q in QUANTITIES}
    return CoordCheck(list(sizes), steps, rms, axis)


def _figure(check: CoordCheck):
    """RMS against size, a line per step, a panel per quantity, a row per kind."""
    from matplotlib.figure import Figure

    rows = list(check.rms)
    fig = Figure(figsize=(3.2 * len(QUANTITIES), 2.8 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), len(QUANTITIES), squeeze=False)
    for r, kind in enumerate(rows):
        for c, (name, (label, _)) in enumerate(QUANTITIES.items()):
            ax = axes[r][c]
            for t, values in enumerate(check.rms[kind][name]):
                ax.plot(check.sizes, values, marker="o", label=f"step {t}", color=f"C{t}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{kind}: {label}", fontsize=9)
            ax.set_xlabel(check.axis)
    axes[0][0].set_ylabel("RMS")
    axes[0][-1].legend(fontsize=7)
    return fig


def write_check(out: Path, result: tuple[str, str], figure: tuple[str, Any]) -> list[Path]:
    """A check's (file name, JSON text) and (file name, matplotlib figure) written into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / result[0]).write_text(result[1])
    figure[1].savefig(out / figure[0], dpi=100)
    return [out / result[0], out / figure[0]]


def write_coord_check(check: CoordCheck, out: Path) -> list[Path]:
    return write_check(out, (RESULT_FILE, check.to_json()), (FIGURE_FILE, _figure(check)))
