"""A scaling ladder: the sweep's variants and seeds trained at a series of model sizes, each on a
token budget from a rule, so the report can fit loss against compute per variant and say whether a
difference grows, holds or vanishes with scale (`transformer/report/scaling.py`).

    sweep:
      grid: {model.ffn: [relu, swiglu]}
      seeds: [0, 1]
      ladder:
        params: [1.0e5, 3.0e5, 1.0e6]   # non-embedding parameter targets, or
        # shapes: [{d_model: 64, n_layers: 2}, {d_model: 128, n_layers: 4, n_heads: 8}]
        aspect: 32                     # params only: d_model / n_layers (default: the base's)
        head_dim: 16                   # params only: n_heads = d_model / head_dim (default: the base's)
        tokens_per_param: 20           # each rung's tokens = 20 x its non-embedding parameters, or
        # flops: [1.0e13, 1.0e14]      # isoFLOP: every size at every budget
        lr: [1.0e-3, 3.0e-3, 1.0e-2]   # each rung's sub-grid; or one list per rung; absent: optim.lr
        warmup: 0.1                    # optim.warmup_steps as a share of each rung's steps

Sizes are the base config's (a variant that changes the FFN keeps the shape and changes its own
count; the report reads each run's own compute). A parameter target picks, over depths 1 to 64, the
depth whose shape (d_model = aspect x depth rounded to the head size) comes closest to it in ratio.
Parameters are non-embedding (Kaplan et al. 2020): at these sizes the byte embedding table would
otherwise be much of the count and little of the compute. A rung's steps are its tokens over the
base's tokens per step, rounded up. Each rung becomes points of one sweep axis that sets the model's
sizes, train.steps and (with a sub-grid) optim.lr together, labelled `rung` (and `budget`, the
FLOPs, in an isoFLOP ladder).

Counting needs the model's closed forms, which import JAX (not its backend): a sweep with a ladder
pays that import when it expands.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any

from transformer.config import Config, ConfigError, ModelConfig
from transformer.config_loader import from_dict

# sizes the base could fix that the rung's width must derive (null: derived at every rung)
DERIVED = ("model.d_ff", "model.head_dim", "model.moe_d_ff")
LADDER_KEYS = ("params", "shapes", "aspect", "head_dim", "tokens_per_param", "flops", "lr", "warmup")
SIZE_KEYS = ("model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads")
MAX_DEPTH = 64


class LadderError(ConfigError):
    """A mistake in `sweep.ladder` (exit 2); the sweep re-raises it as its own."""


@dataclasses.dataclass(frozen=True)
class Rung:
    name: str  # N98k, or N98k-C1e+13 in an isoFLOP ladder
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # at the base's ratio of query to key/value heads
    params: int  # non-embedding parameters, the base's
    steps: int
    tokens: int  # steps x tokens per step
    flops: float  # model FLOPs of a run (the base's): steps x FLOPs per step
    budget: float | None  # the isoFLOP budget this rung was sized to
    lrs: tuple[float, ...]  # the learning-rate sub-grid; empty: the base's optim.lr

    def points(self, warmup: float | None) -> list[dict[str, Any]]:
        """This rung's points of the ladder axis, one per learning rate of its sub-grid."""
        point: dict[str, Any] = {"rung": self.name}
        if self.budget is not None:
            point["budget"] = self.budget
        point |= dict(zip(SIZE_KEYS, (self.d_model, self.n_layers, self.n_heads, self.n_kv_heads)))
        point["train.steps"] = self.steps
        if warmup is not None:
            point["optim.warmup_steps"] = round(warmup * self.steps)
        return [{**point, "optim.lr": lr} for lr in self.lrs] if self.lrs else [point]


@dataclasses.dataclass(frozen=True)
class Ladder:
    rungs: tuple[Rung, ...]
    warmup: float | None
    pinned: dict[str, Any]  # model keys every member takes: a µP base's resolved shape

    @property
    def keys(self) -> list[str]:
        """The keys and labels the ladder axis sets, in the order of its points."""
        return list(self.rungs[0].points(self.warmup)[0])

    def axis(self) -> list[dict[str, Any]]:
        return [p for rung in self.rungs for p in rung.points(self.warmup)]


def mup_base_shape(raw: dict) -> dict[str, Any]:
    """Under µP, the base's resolved base shape, so that each rung scales from the same base (left
    null, each rung would be its own base and µP would change nothing) and one learning rate can
    transfer up the ladder."""
    base = from_dict(raw).model
    if base.parametrization != "mup":
        return {}
    keys = ["mup_base_d_model", "mup_base_n_heads", "mup_base_head_dim", "mup_base_d_ff"]
    keys += ["mup_base_moe_d_ff"] if base.n_experts else []
    keys += ["mup_base_n_layers"] if base.depth_scaling != "none" else []
    return {k: getattr(base, k) for k in keys}


def _spec(spec: Any) -> dict:
    if not isinstance(spec, dict):
        raise LadderError("sweep.ladder", f"expected a mapping with {', '.join(LADDER_KEYS)}, got {spec!r}")
    for key in spec:
        if key not in LADDER_KEYS:
            match = difflib.get_close_matches(str(key), LADDER_KEYS, n=1)
            hint = f" (did you mean sweep.ladder.{match[0]}?)" if match else ""
            raise LadderError(f"sweep.ladder.{key}", f"unknown key{hint}")
    for one_of in (("params", "shapes"), ("tokens_per_param", "flops")):
        given = [k for k in one_of if k in spec]
        if len(given) != 1:
            raise LadderError("sweep.ladder", f"give exactly one of {' or '.join(one_of)} (got {len(given)})")
    return spec


def check_derived(values: dict[str, Any], where: str) -> None:
    """Refuse a size that would stay fixed while the ladder widens the model around it."""
    for key in DERIVED:
        short = key.partition(".")[2]
        if values.get(short, values.get(key)) is not None:
            raise LadderError(
                key, f"{where}, so it would stay fixed at every rung; leave it null and the ladder derives it"
            )


def _positive(where: str, value: Any, kind: type = float) -> Any:
    if isinstance(value, str):  # YAML 1.1 reads 1e5 (no dot, no sign) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise LadderError(where, f"expected a positive number, got {value!r}")
    if kind is int and value != int(value):
        raise LadderError(where, f"expected a whole number, got {value!r}")
    return kind(value)


def _list(where: str, value: Any) -> list:
    if not isinstance(value, list) or not value:
        raise LadderError(where, f"expected a non-empty list, got {value!r}")
    return value


def _config(raw: dict, sizes: dict[str, Any]) -> Config:
    """The base config at a rung's sizes."""
    model = {**(raw.get("model") or {}), **{k.partition(".")[2]: v for k, v in sizes.items()}}
    try:
        return from_dict({**raw, "model": model})
    except ConfigError as e:
        shape = ", ".join(f"{k.partition('.')[2]}={v}" for k, v in sizes.items())
        raise LadderError(e.key, f"{e.message} (at the ladder's shape {shape})") from None


def _shape(base: ModelConfig, d_model: int, n_layers: int, n_heads: int) -> dict[str, Any]:
    """A rung's sizes: key/value heads keep the base's grouping (MHA stays MHA, MQA stays MQA)."""
    if base.n_kv_heads == 1:  # MQA stays MQA
        return dict(zip(SIZE_KEYS, (d_model, n_layers, n_heads, 1)))
    group = base.n_heads // base.n_kv_heads
    if n_heads % group:
        raise LadderError(
            "sweep.ladder", f"{n_heads} heads cannot keep the base's {group} query heads per key/value head"
        )
    return dict(zip(SIZE_KEYS, (d_model, n_layers, n_heads, n_heads // group)))


def _shapes_given(base: ModelConfig, shapes: list) -> list[dict[str, Any]]:
    out = []
    for i, shape in enumerate(shapes):
        where = f"sweep.ladder.shapes[{i}]"
        if not isinstance(shape, dict) or not {"d_model", "n_layers"} <= set(shape) <= {
            "d_model",
            "n_layers",
            "n_heads",
        }:
            raise LadderError(where, f"expected a mapping of d_model, n_layers and optionally n_heads, got {shape!r}")
        d, L = (
            _positive(f"{where}.d_model", shape["d_model"], int),
            _positive(f"{where}.n_layers", shape["n_layers"], int),
        )
        heads = (
            _positive(f"{where}.n_heads", shape["n_heads"], int) if "n_heads" in shape else max(1, d // base.head_dim)
        )
        out.append(_shape(base, d, L, heads))
    return out


def _shape_for(raw: dict, base: ModelConfig, target: float, aspect: float, head_dim: int) -> dict[str, Any]:
    """The depth's shape whose non-embedding parameter count is nearest `target` in ratio."""
    from transformer.model import non_embedding_params

    best: tuple[float, dict[str, Any]] | None = None
    for depth in range(1, MAX_DEPTH + 1):
        d = max(head_dim, round(aspect * depth / head_dim) * head_dim)
        try:
            sizes = _shape(base, d, depth, d // head_dim)
        except LadderError:  # too few heads at this depth for the base's grouping
            continue
        miss = abs(math.log(non_embedding_params(_config(raw, sizes).model) / target))
        if best is None or miss < best[0]:
            best = (miss, sizes)
    if best is None:
        raise LadderError(
            "sweep.ladder", f"no depth from 1 to {MAX_DEPTH} keeps the base's query heads per key/value head"
        )
    return best[1]


def _shapes(raw: dict, spec: dict) -> list[dict[str, Any]]:
    base = from_dict(raw).model  # resolved once: each candidate shape reads its head grouping
    if "shapes" in spec:
        for key in ("aspect", "head_dim"):
            if key in spec:
                raise LadderError(f"sweep.ladder.{key}", "goes with sweep.ladder.params (shapes are given)")
        return _shapes_given(base, _list("sweep.ladder.shapes", spec["shapes"]))
    aspect = _positive("sweep.ladder.aspect", spec.get("aspect", base.d_model / base.n_layers))
    head_dim = _positive("sweep.ladder.head_dim", spec.get("head_dim", base.head_dim), int)
    targets = [
        _positive(f"sweep.ladder.params[{i}]", p) for i, p in enumerate(_list("sweep.ladder.params", spec["params"]))
    ]
    return [_shape_for(raw, base, t, aspect, head_dim) for t in targets]


def _lrs(spec: dict, n: int) -> list[tuple[float, ...]]:
    """Each size's learning-rate sub-grid: one list for all, or one list per size."""
    if "lr" not in spec:
        return [()] * n
    lrs = _list("sweep.ladder.lr", spec["lr"])
    grids = lrs if all(isinstance(x, list) for x in lrs) else [lrs] * n
    if len(grids) != n:
        raise LadderError("sweep.ladder.lr", f"one list per size: {n} sizes, {len(grids)} lists")
    return [
        tuple(_positive(f"sweep.ladder.lr[{i}]", lr) for lr in _list(f"sweep.ladder.lr[{i}]", grid))
        for i, grid in enumerate(grids)
    ]


def short_number(x: float) -> str:
    """98k, 1.2M, 3e+13: a size as a rung's name carries it."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            value = x / scale
            return f"{value:.0f}{unit}" if value >= 10 else f"{value:.1f}{unit}"
    return f"{x:.3g}"


def _distinct(shapes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen = [tuple(s.values()) for s in shapes]
    if len(set(seen)) != len(seen):
        twice = next(s for s in seen if seen.count(s) > 1)
        raise LadderError(
            "sweep.ladder",
            f"two rungs come out as one shape (d_model {twice[0]}, {twice[1]} layers); space the targets further apart",
        )
    return shapes


def build_ladder(raw: dict, spec: Any) -> Ladder:
    """The rungs of `spec` (the `sweep.ladder` block) on the base config `raw` (without its sweep)."""
    spec = _spec(spec)
    check_derived(raw.get("model") or {}, "the base config sets it")
    fixed = mup_base_shape(raw)
    raw = {**raw, "model": {**(raw.get("model") or {}), **fixed}}
    from transformer.model import non_embedding_params
    from transformer.train import work_per_step

    shapes = _distinct(_shapes(raw, spec))
    warmup = spec.get("warmup")
    if warmup is not None and (isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not 0 <= warmup < 1):
        raise LadderError("sweep.ladder.warmup", f"expected a share of the steps in [0, 1), got {warmup!r}")
    budgets: list[float | None] = (
        [_positive(f"sweep.ladder.flops[{i}]", c) for i, c in enumerate(_list("sweep.ladder.flops", spec["flops"]))]
        if "flops" in spec
        else [None]
    )
    per_param = None if "flops" in spec else _positive("sweep.ladder.tokens_per_param", spec["tokens_per_param"])
    rungs = []
    for sizes, lrs in zip(shapes, _lrs(spec, len(shapes))):
        cfg = _config(raw, sizes)
        params = non_embedding_params(cfg.model)
        tokens_per_step, flops_per_step = work_per_step(cfg)
        for budget in budgets:
            want = budget / flops_per_step if budget is not None else per_param * params / tokens_per_step  # type: ignore[operator]
            steps = max(1, math.ceil(want - 1e-9))  # a ratio a rounding above a whole number is that number
            name = f"N{short_number(params)}" + (f"-C{budget:.3g}" if budget is not None else "")
            if warmup is None and cfg.optim.warmup_steps >= steps:
                raise LadderError(
                    "sweep.ladder.warmup",
                    f"the base's optim.warmup_steps ({cfg.optim.warmup_steps}) is not below rung {name}'s {steps} "
                    "steps; give the warm-up as a share of each rung's steps (sweep.ladder.warmup: 0.1)",
                )
            d, L, N, K = (sizes[k] for k in SIZE_KEYS)
            rungs.append(
                Rung(name, d, L, N, K, params, steps, steps * tokens_per_step, steps * flops_per_step, budget, lrs)
            )
    if len({r.name for r in rungs}) != len(rungs):
        raise LadderError(
            "sweep.ladder",
            f"two rungs round to one name ({', '.join(r.name for r in rungs)}); space the targets further apart",
        )
    return Ladder(tuple(rungs), None if warmup is None else float(warmup), fixed)


def ladder_lines(ladder: Ladder, members: dict[str, int]) -> list[str]:
    """`--dry-run`'s table: each rung's shape, parameters, tokens, steps and FLOPs per run, its
    members (`members`: rung name -> count), and the ladder's total compute over all of them."""
    lines = ["ladder: rung, shape (d_model x n_layers, heads), non-embedding params, tokens, steps, FLOPs a run, runs"]
    total = 0.0
    for r in ladder.rungs:
        n = members.get(r.name, 0)
        total += n * r.flops
        lrs = f", lr {'/'.join(f'{x:g}' for x in r.lrs)}" if r.lrs else ""
        lines.append(
            f"  {r.name}: {r.d_model} x {r.n_layers}, {r.n_heads} heads; {r.params:,} params; {r.tokens:,} tokens"
            f" ({r.tokens / r.params:.1f} per param); {r.steps:,} steps; {r.flops:.3g} FLOPs; {n} runs{lrs}"
        )
    lines.append(f"ladder total: {total:.3g} model FLOPs over {sum(members.values())} runs (the base variant's count)")
    return lines
