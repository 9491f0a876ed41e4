"""What one step computes: the train state, the loss, and the jitted init, train, eval and stats steps
(validation over many batches, on the host, is `validation.py`'s).

The host loop that drives them is `transformer/train/loop.py`; the `train.py` job around it `transformer/train/job.py`.

The step is one pure function `(state, batch) -> (state, metrics)` jitted with explicit shardings
and a donated state: the same code runs on one CPU, fake CPU devices, a GPU, a TPU slice or many
hosts; only the mesh differs. Parameters are a plain nested dict (`nnx.to_pure_dict`), merged into
the model inside the step, so optax, orbax and the sharding table all see ordinary pytrees.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from transformer import accelerator, sharding
from transformer.config import Config
from transformer.model import (
    STEP_METRICS,
    Transformer,
    balance_router_bias,
    clip_qk,
    layer_slots,
    optimizer_scaling,
    placing,
)
from transformer.train import loss
from transformer.train.optim import make_optimizer, schedule
from transformer.train.schedule_free import gradient_point


def model_inputs(batch: dict) -> tuple:
    """The positional arguments of `Transformer.forward` in a batch: the stream whose logits are
    trained (the decoder's in an encoder-decoder), its positions and document ids (None: 0..T-1, one document)."""
    return batch["inputs"], batch.get("positions"), batch.get("segment_ids")


# batch key -> keyword argument of Transformer.forward: what an encoder-decoder's encoder reads
ENCODER_INPUTS = {
    "encoder_inputs": "encoder_tokens_BxS",
    "encoder_positions": "encoder_positions_BxS",
    "encoder_segment_ids": "encoder_segment_ids_BxS",
}


def encoder_inputs(batch: dict) -> dict:
    """The encoder's keyword arguments of `Transformer.forward` in a batch ({} without an encoder)."""
    return {arg: batch[key] for key, arg in ENCODER_INPUTS.items() if key in batch}


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: the number of updates applied
    params: dict
    opt_state: optax.OptState


def per_layer_norm(tree) -> jax.Array:
    """[L]: the norm of each layer's slice of a tree whose leaves are stacked on a leading layer axis."""
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.reshape(x.shape[0], -1).astype(jnp.float32)), axis=1) for x in leaves))


def _micro_batches(batch: dict, accum: int) -> dict:
    """[accum, B / accum, ...]: row r goes to micro-batch r % accum, so every device keeps its own
    rows and nothing moves."""
    return jax.tree.map(lambda x: x.reshape((x.shape[0] // accum, accum) + x.shape[1:]).swapaxes(0, 1), batch)


def _should_apply(loss: jax.Array, grad_norm: jax.Array, controls: dict) -> jax.Array:
    """A non-finite step is never applied; in skip mode neither is one above the monitor's limits."""
    return (
        jnp.isfinite(loss)
        & jnp.isfinite(grad_norm)
        & (loss <= controls["loss_limit"])
        & (grad_norm <= controls["grad_limit"])
    )


def _keep_unless(apply: jax.Array, new, old):
    """`new` where `apply`, else `old`, exactly as it was (parameters and optimiser moments alike)."""
    return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)


def _per_layer_metrics(cfg: Config, grads: dict, updates: dict, params: dict) -> dict[str, jax.Array]:
    """[L] each: gradient norms of attention and feed-forward, and update / parameter norm ratios."""
    slots = layer_slots(cfg.model)  # dense and MoE layers live in two stacks: back to layer order

    def in_layer_order(norms: dict[str, jax.Array]) -> jax.Array:
        return jnp.stack([norms[stack][j] for stack, j in slots])

    stacks = {stack for stack, _ in slots}
    out = {
        "grad_norm_attn": in_layer_order({s: per_layer_norm(grads[s]["attn"]) for s in stacks}),
        "grad_norm_ffn": in_layer_order({s: per_layer_norm(grads[s]["ffn"]) for s in stacks}),
        "update_ratio": in_layer_order({s: per_layer_norm(updates[s]) / per_layer_norm(params[s]) for s in stacks}),
    }
    if "cross_attn" in grads.get("blocks", {}):  # an encoder-decoder's decoder layers, and its encoder's
        out["grad_norm_cross_attn"] = per_layer_norm(grads["blocks"]["cross_attn"])
        encoder = "encoder_blocks"
        out["encoder_grad_norm_attn"] = per_layer_norm(grads[encoder]["attn"])
        out["encoder_grad_norm_ffn"] = per_layer_norm(grads[encoder]["ffn"])
        out["encoder_update_ratio"] = per_layer_norm(updates[encoder]) / per_layer_norm(params[encoder])
    return out


def default_controls(
    lr_scale: float = 1.0, loss_limit: float = math.inf, grad_limit: float = math.inf, nan_grads: bool = False
) -> dict:
    return {
        "lr_scale": np.float32(lr_scale),
        "loss_limit": np.float32(loss_limit),
        "grad_limit": np.float32(grad_limit),
        "nan_grads": np.bool_(nan_grads),
    }


def _opt_shardings(tx: optax.GradientTransformation, abstract_params: dict, param_shardings: dict, replicated):
    """Shardings of the optimiser state: a moment shaped like its parameter is sharded like it;
    anything else is replicated. A moment's parameter is the one at the trailing dict keys of its
    path in the state (optax keeps every per-parameter tree as the parameters' own, masked or
    partitioned ones included). Adafactor keeps, in the parameter's place, factored row and column
    moments (one dimension fewer) and a placeholder of shape (1,); those are small, so replicated."""
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    paths = [tuple(k.key for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(abstract_params)]
    by_path = dict(zip(paths, zip(jax.tree.leaves(abstract_params), jax.tree.leaves(param_shardings))))

    def sharding_of(path, leaf):
        keys: list = []
        for k in reversed(path):
            if not isinstance(k, jax.tree_util.DictKey):
                break
            keys.insert(0, k.key)
        param, param_sharding = by_path.get(tuple(keys), (None, replicated))
        return param_sharding if param is not None and getattr(leaf, "shape", None) == param.shape else replicated

    return jax.tree_util.tree_map_with_path(sharding_of, abstract_opt)


class Trainer:
    """Builds the jitted steps for one config on one mesh."""

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh):
        cfg = accelerator.resolve(cfg)  # attention_impl: auto -> this backend's pick
        self.cfg = cfg
        self.mesh = mesh
        self.placer = sharding.activation_placer(mesh)
        self.graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))
        # validation computes the model inference does (ModelConfig.at_inference), with the same parameters
        self.inference_graphdef = self.graphdef
        if cfg.model.at_inference is not cfg.model:
            inference = nnx.eval_shape(lambda: Transformer(cfg.model.at_inference, rngs=nnx.Rngs(0)))
            self.inference_graphdef = nnx.split(inference)[0]
        param_shardings = nnx.to_pure_dict(sharding.state_shardings(abstract, mesh))
        pure = nnx.to_pure_dict(abstract)
        scaling = optimizer_scaling(cfg.model, pure, muon=cfg.optim.name == "muon")
        self.tx = make_optimizer(cfg.optim, cfg.train.steps, pure, scaling, cfg.model)
        self.lr = schedule(cfg.optim, cfg.train.steps)
        replicated = sharding.replicated(mesh)
        opt_shardings = _opt_shardings(self.tx, nnx.to_pure_dict(abstract), param_shardings, replicated)
        # a TrainState of shardings, not arrays
        self.state_shardings = TrainState(replicated, param_shardings, opt_shardings)  # type: ignore[arg-type]
        batch_spec = sharding.batch_sharding(mesh)
        self.compiler_options = accelerator.compiler_options(cfg, mesh.devices.flat[0].platform)
        jit = functools.partial(jax.jit, compiler_options=self.compiler_options or None)
        self.init = jax.jit(self._init, out_shardings=self.state_shardings)
        self.train_step = jit(
            self._train_step,
            in_shardings=(self.state_shardings, batch_spec, replicated),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=0,
        )
        self.eval_step = jit(self._eval_step, in_shardings=(param_shardings, batch_spec), out_shardings=replicated)
        self.judge_step = self.eval_step  # the training function's loss, which the monitor's limits are of
        if self.inference_graphdef is not self.graphdef:
            judge = functools.partial(self._eval_step, graphdef=self.graphdef)
            self.judge_step = jit(judge, in_shardings=(param_shardings, batch_spec), out_shardings=replicated)
        self.stats_step = jit(self._stats_step, in_shardings=(param_shardings, batch_spec), out_shardings=replicated)

    # --- pure functions ---------------------------------------------------------------------------
    def _init(self, seed: jax.Array) -> TrainState:
        model = Transformer(self.cfg.model, rngs=nnx.Rngs(params=seed))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params))

    def _loss(self, params, batch, key, graphdef=None):
        model = nnx.merge(self.graphdef if graphdef is None else graphdef, params)
        with placing(self.placer):
            x_BxTxD, routing = model.forward(*model_inputs(batch), key=key, **encoder_inputs(batch))
        head_max = routing.pop("head_logit_max", None)  # under model.qk_clip: [L, N]
        weights = batch.get("weights", jnp.ones(batch["targets"].shape, jnp.float32))
        objective, nll_sum, count, correct = loss.objective(
            x_BxTxD, model.logits, batch["targets"], weights, self.cfg.train.z_loss, self.cfg.loss_chunk
        )
        if routing:  # the MoE losses are means over tokens: as sums, like the objective
            m = self.cfg.model
            objective += count * (m.moe_aux_loss * routing["moe_aux_loss"] + m.moe_z_loss * routing["router_z_loss"])
        return objective, (nll_sum, count, routing, correct, head_max)

    def _train_step(self, state: TrainState, batch: dict, controls: dict) -> tuple[TrainState, dict]:
        """One update. `controls` (see `default_controls`) carry the host's decisions into the step:
        learning-rate scale, the skip limits of the monitor, injected NaN gradients."""
        grads, nll_sum, count, routing, head_max = self.gradients(state, batch)
        grads = jax.tree.map(lambda g: jnp.where(controls["nan_grads"], jnp.nan, g), grads)  # fault injection
        loss, grad_norm = nll_sum / count, optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        # lr_scale multiplies the whole update: AdamW's decoupled decay is scaled by lr too
        updates = jax.tree.map(lambda u: u * controls["lr_scale"], updates)
        params = optax.apply_updates(state.params, updates)
        if head_max is not None:  # QK-clip: after the update, from the logits of the step's forward pass
            params, clipped = clip_qk(self.cfg.model, params, head_max)
            routing = {**routing, "qk_max_logit": jnp.max(head_max), "qk_clipped_heads": clipped.astype(jnp.float32)}
        load_LxE = routing.pop("expert_load", None)  # under model.router_bias_rate
        if load_LxE is not None:  # aux-loss-free balancing, after the update like QK-clip
            params = balance_router_bias(self.cfg.model, params, load_LxE)
        apply = _should_apply(loss, grad_norm, controls)
        params, opt_state = _keep_unless(apply, (params, opt_state), (state.params, state.opt_state))
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "update_norm": optax.tree.norm(updates),
            "param_norm": optax.tree.norm(params),
            "lr": self.lr(state.step) * controls["lr_scale"],
            "applied": apply.astype(jnp.float32),
            **routing,
        }
        if self.cfg.monitor.stats_every:  # per layer, [L]: cheap reductions, and none when off
            metrics.update(_per_layer_metrics(self.cfg, grads, updates, state.params))
        return TrainState(state.step + 1, params, opt_state), metrics

    def gradients(self, state: TrainState, batch: dict) -> tuple[dict, Any, Any, dict, jax.Array | None]:
        """(gradients of the mean objective, nll sum, token count, the MoE routing metrics averaged
        over tokens, under QK-clip each layer's heads' largest logit [L, N] else None) of the batch,
        accumulated over `train.grad_accum` micro-batches."""
        cfg = self.cfg.model
        step_key = self._dropout_key(state.step)
        grad_fn = jax.grad(self._loss, has_aux=True)
        point = state.params
        if self.cfg.optim.name == "schedule_free_adamw":  # gradients at y, between z and the average x
            point = gradient_point(state.params, state.opt_state, self.cfg.optim.b1)

        def micro(carry, xs):
            grads, nll_sum, count, routing, head_max = carry
            micro_batch, index = xs
            key = None if step_key is None else jax.random.fold_in(step_key, index)
            g, (n, c, r, _, m) = grad_fn(point, micro_batch, key)
            routing = {k: routing[k] + c * r[k] for k in routing}
            head_max = None if head_max is None else jnp.maximum(head_max, m)
            return (jax.tree.map(jnp.add, grads, g), nll_sum + n, count + c, routing, head_max), None

        accum = self.cfg.train.grad_accum
        micro_batches = _micro_batches(batch, accum)
        zeros = jax.tree.map(jnp.zeros_like, state.params)
        routing = {k: jnp.float32(0.0) for k in STEP_METRICS} if cfg.n_experts else {}
        if cfg.router_bias_rate:  # each MoE layer's load of each expert, averaged over the step's tokens
            routing["expert_load"] = jnp.zeros((sum(cfg.moe_layers), cfg.n_experts), jnp.float32)
        head_max = None if cfg.qk_clip is None else jnp.full((cfg.n_layers, cfg.n_heads), -jnp.inf)
        (grads, nll_sum, count, routing, head_max), _ = jax.lax.scan(
            micro, (zeros, 0.0, 0.0, routing, head_max), (micro_batches, jnp.arange(accum))
        )
        # The objective is a sum over tokens: divide once, so accumulation equals one big batch.
        routing = {k: v / count for k, v in routing.items()}
        return jax.tree.map(lambda g: g / count, grads), nll_sum, count, routing, head_max

    def _dropout_key(self, step: jax.Array) -> jax.Array | None:
        """The step's dropout key, derived from (seed, step); None without dropout."""
        if not (self.cfg.model.dropout or self.cfg.model.attn_dropout):
            return None
        return jax.random.fold_in(jax.random.key(self.cfg.train.seed), step)

    def _stats_step(self, params, batch) -> dict:
        model = nnx.merge(self.graphdef, params)
        with placing(self.placer):
            return model.stability_stats(*model_inputs(batch), **encoder_inputs(batch))

    def _eval_step(self, params, batch, graphdef=None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(nll sum, target count, count of targets predicted right) of one batch, by the model
        inference computes unless another `graphdef` is given."""
        _, (nll_sum, count, _, correct, _) = self._loss(
            params, batch, None, self.inference_graphdef if graphdef is None else graphdef
        )
        return nll_sum, count, correct

    # --- host-side helpers ------------------------------------------------------------------------
    def initial_state(self) -> TrainState:
        """Step 0: parameters drawn from train.seed, or read from the model.init_from checkpoint."""
        if self.cfg.model.init_from is None:
            return self.init(jax.random.key(self.cfg.train.seed))
        from pathlib import Path

        from transformer.io import hf

        params = hf.load_params(
            Path(self.cfg.model.init_from).expanduser(), self.cfg.model, self.abstract_state().params
        )
        opt_state = jax.jit(self.tx.init, out_shardings=self.state_shardings.opt_state)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), self.state_shardings.step)
        return TrainState(step, params, opt_state)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the train state: the target a checkpoint restores into."""
        abstract = jax.eval_shape(self.init, jax.random.key(0))
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, self.state_shardings
        )

    def put_batch(self, local: dict[str, np.ndarray], global_rows: int) -> dict[str, jax.Array]:
        return sharding.global_batch(local, self.mesh, global_rows)
