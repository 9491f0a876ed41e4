"""The Transformer of each family: embedding, a stack of blocks (scanned by default), output head;
an encoder-decoder adds the encoder stack whose output the decoder blocks cross-attend to."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.config import GLOBAL_WINDOW, ModelConfig
from transformer.model.attention import MASK_VALUE, Attention, KVCache, Window, cache_size
from transformer.model.cross_attention import CrossAttention, Memory
from transformer.model.layers import ACTIVATIONS, FFN, InitScales, Norm, const_param, dropout, normal_param, place
from transformer.model.mla import MultiHeadLatentAttention
from transformer.model.moe import STEP_METRICS, MoE
from transformer.model.parametrization import branch_multiplier, logit_multiplier
from transformer.model.positions import positions_for

# Statistics by name: scalars as one block sows them, or [L] when stacked over the layers.
Stats = dict[str, jax.Array]
# One block on the residual stream: (x, the block's state, dropout key, window) -> (x, stats).
BlockStep = Callable[[jax.Array, nnx.State, jax.Array | None, Window], tuple[jax.Array, Stats]]

_Xs = TypeVar("_Xs")  # what the layer scan slices per layer
_Ys = TypeVar("_Ys")  # what it stacks

# The residual stream between blocks, [B, T, D]: split by rows like the batch, whole along D even where
# fsdp splits the weights' D (see sharding.RULES).
RESIDUAL_AXES = ("batch", None, None)

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class Block(nnx.Module):
    """One attention sublayer, a cross-attention sublayer in an encoder-decoder's decoder, and one
    FFN sublayer (a mixture of experts with `moe`), each wrapped by the configured norm placement.
    `encoder_stack`: a block of an encoder-decoder's encoder stack (not the main `blocks`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False, encoder_stack: bool = False):
        self.cfg = cfg
        self.encoder_stack = encoder_stack
        # the one place the family decides how a block attends: encoders (an encoder-only model's
        # blocks, an encoder-decoder's encoder stack) bidirectionally; an encoder-decoder's decoder
        # blocks also to the encoder output
        causal = cfg.causal and not encoder_stack
        cross = cfg.arch == "encoder_decoder" and not encoder_stack
        # the one place model.attention is read
        attention = MultiHeadLatentAttention if cfg.attention == "mla" else Attention
        self.attn = attention(cfg, rngs=rngs, causal=causal, encoder_stack=encoder_stack)
        self.ffn = MoE(cfg, rngs=rngs) if moe else FFN(cfg, rngs=rngs, encoder_stack=encoder_stack)
        self.attn_norm = Norm(cfg)
        self.ffn_norm = Norm(cfg)
        sandwich = cfg.norm_position == "sandwich"
        self.attn_out_norm = Norm(cfg) if sandwich else None
        self.ffn_out_norm = Norm(cfg) if sandwich else None
        self.cross_attn = CrossAttention(cfg, rngs=rngs) if cross else None
        self.cross_attn_norm = Norm(cfg) if cross else None
        self.cross_attn_out_norm = Norm(cfg) if cross and sandwich else None

    # sublayer_input and add_sublayer are the one place where norm placement is decided.
    def sublayer_input(self, x_BxTxD: jax.Array, norm: Norm) -> jax.Array:
        """What a sublayer reads: the normalised stream (pre, sandwich) or the stream itself (post and
        DeepNorm normalise after the residual add instead)."""
        return norm(x_BxTxD) if self.cfg.norm_position in ("pre", "sandwich") else x_BxTxD

    def add_sublayer(
        self, x_BxTxD: jax.Array, y_BxTxD: jax.Array, norm: Norm, out_norm: Norm | None, key: jax.Array | None
    ) -> jax.Array:
        """The residual stream x after adding y, the sublayer's output on `sublayer_input(x)`."""
        rate = self.cfg.dropout
        match self.cfg.norm_position:
            case "pre":  # x + f(N(x))
                return x_BxTxD + dropout(self.branch(y_BxTxD), rate, key)
            case "post":  # N(x + f(x)), the original Transformer
                return norm(x_BxTxD + dropout(y_BxTxD, rate, key))
            case "sandwich":  # x + N2(f(N1(x))), a.k.a. peri-LN
                assert out_norm is not None, "sandwich blocks have output norms"
                return x_BxTxD + dropout(self.branch(out_norm(y_BxTxD)), rate, key)
            case "deepnorm":  # N(alpha*x + f(x)), DeepNet
                alpha = self.cfg.deepnorm(self.encoder_stack)[0]
                return norm(alpha * x_BxTxD + dropout(y_BxTxD, rate, key))
        raise AssertionError(self.cfg.norm_position)

    def branch(self, y_BxTxD: jax.Array) -> jax.Array:
        """A residual branch as it joins the stream: times depth scaling's m_L^-alpha, after any
        output norm (which would undo it); untouched without depth scaling (post and DeepNorm blocks
        refuse it: they renormalise the stream)."""
        multiplier = branch_multiplier(self.cfg)
        return y_BxTxD if multiplier == 1.0 else y_BxTxD * jnp.asarray(multiplier, y_BxTxD.dtype)

    def residual(
        self,
        x_BxTxD: jax.Array,
        sublayer: Callable[[jax.Array], jax.Array],
        norm: Norm,
        out_norm: Norm | None,
        key: jax.Array | None,
    ) -> jax.Array:
        """The residual stream after one sublayer under the configured norm placement."""
        return self.add_sublayer(x_BxTxD, sublayer(self.sublayer_input(x_BxTxD, norm)), norm, out_norm, key)

    def __call__(
        self,
        x_BxTxD: jax.Array,
        positions_BxT: jax.Array,
        segment_ids_BxT: jax.Array | None,
        window: Window,
        key: jax.Array | None = None,
        cache: KVCache | None = None,
        index: int | jax.Array = 0,
        collect: bool = False,
        memory: Memory | None = None,
        bias_table: jax.Array | None = None,
        attn_norm: bool = True,
    ) -> tuple[jax.Array, KVCache | None]:
        """(the block's output, its updated KV cache; None without a cache). With `collect`,
        statistics are sown as nnx.Intermediate (attention logits and entropy, the RMS of each
        sublayer's output and of the residual stream).
        `memory`: the encoder output a decoder block cross-attends to (decoding: the cache's
        `cross_k`/`cross_v` instead); `bias_table`: the stack's self-attention bias table (t5_relative);
        `attn_norm` false: the attention reads the stream itself (the first layer under
        model.first_attn_norm=false)."""
        attn_key, attn_drop_key, ffn_drop_key = (None, None, None) if key is None else jax.random.split(key, 3)
        h_BxTxD = self.sublayer_input(x_BxTxD, self.attn_norm) if attn_norm else x_BxTxD
        y_BxTxD, new_cache = self.attn(
            h_BxTxD, positions_BxT, segment_ids_BxT, window, attn_key, cache, index, collect, bias_table
        )
        x_BxTxD = self.add_sublayer(x_BxTxD, y_BxTxD, self.attn_norm, self.attn_out_norm, attn_drop_key)
        if self.cross_attn is not None:
            x_BxTxD = self.cross_residual(x_BxTxD, segment_ids_BxT, memory, cache, key, collect)
        f_BxTxD = self.ffn(self.sublayer_input(x_BxTxD, self.ffn_norm))
        x_BxTxD = self.add_sublayer(x_BxTxD, f_BxTxD, self.ffn_norm, self.ffn_out_norm, ffn_drop_key)
        if collect:  # what each sublayer writes into the residual stream, and the stream after the block
            for name, value in (("attn_out_rms", y_BxTxD), ("ffn_out_rms", f_BxTxD), ("residual_rms", x_BxTxD)):
                self.sow(nnx.Intermediate, name, jnp.sqrt(jnp.mean(jnp.square(value.astype(jnp.float32)))))
        return x_BxTxD, new_cache

    def cross_residual(
        self,
        x_BxTxD: jax.Array,
        segment_ids_BxT: jax.Array | None,
        memory: Memory | None,
        cache: KVCache | None,
        key: jax.Array | None,
        collect: bool,
    ) -> jax.Array:
        """The stream after the cross-attention sublayer, under the same norm placement, dropout and
        qk-norm as self-attention. Decoding reads the memory's keys and values from the cache, and
        each new token is a real target token: segment 1, as the batches mark them."""
        assert self.cross_attn is not None and self.cross_attn_norm is not None
        memory_segments_BxS: jax.Array | None
        if cache is not None:
            entries, memory_segments_BxS = {"k": cache["cross_k"], "v": cache["cross_v"]}, cache["cross_segments"]
            segment_ids_BxT = jnp.ones(x_BxTxD.shape[:2], jnp.int32)
        else:
            assert memory is not None, "a decoder block of an encoder-decoder reads the encoder output"
            entries, memory_segments_BxS = self.cross_attn.memory_entries(memory.x_BxSxD), memory.segment_ids_BxS
        attn_key, drop_key = (None, None) if key is None else jax.random.split(jax.random.fold_in(key, 1))
        cross_attn = self.cross_attn

        def sublayer(h_BxTxD: jax.Array) -> jax.Array:
            return cross_attn(h_BxTxD, entries, segment_ids_BxT, memory_segments_BxS, attn_key, collect)

        return self.residual(x_BxTxD, sublayer, self.cross_attn_norm, self.cross_attn_out_norm, drop_key)


def _stacked_blocks(
    cfg: ModelConfig, rngs: nnx.Rngs, count: int, moe: bool = False, encoder_stack: bool = False
) -> Block:
    """`count` blocks whose parameters are stacked on a leading `layers` axis, ready for `lax.scan`."""

    def block(k: jax.Array) -> Block:
        return Block(cfg, rngs=nnx.Rngs(k), moe=moe, encoder_stack=encoder_stack)

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: block(jax.random.key(0))))
    keys_L = jax.random.split(rngs.params(), count)
    state = jax.vmap(lambda k: nnx.state(block(k)))(keys_L)
    state = jax.tree.map(
        lambda v: v.replace(axes=("layers",) + v.axes),
        state,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )
    return nnx.merge(graphdef, state)


def _block_forward(
    block: Block,
    x_BxTxD: jax.Array,
    positions_BxT: jax.Array,
    segment_ids_BxT: jax.Array | None,
    window: Window,
    key: jax.Array | None,
    collect: bool,
    memory: Memory | None = None,
    bias_table: jax.Array | None = None,
    attn_norm: bool = True,
) -> tuple[jax.Array, Stats]:
    """One block without a cache, and what it sowed, by name: with `collect`, when its FFN is a
    mixture of experts (whose routing losses the trainer needs), or under QK-clip (its heads' largest
    logits); else {}."""

    def call(m: Block, collect: bool) -> jax.Array:
        args = (x_BxTxD, positions_BxT, segment_ids_BxT, window, key)
        return m(*args, collect=collect, memory=memory, bias_table=bias_table, attn_norm=attn_norm)[0]

    if not (collect or isinstance(block.ffn, MoE) or block.cfg.qk_clip is not None):
        return call(block, False), {}
    forward = nnx.capture(lambda m: call(m, collect), nnx.Intermediate)
    x_BxTxD, sown = forward(block)
    # each sown value is a one-element tuple
    return x_BxTxD, {str(path[-1]): value.get_value()[0] for path, value in nnx.to_flat_state(sown)}


def _remat(cfg: ModelConfig, step: BlockStep, static_argnums: tuple[int, ...]) -> BlockStep:
    """`step` rematerialised under the configured policy (as is for `none`)."""
    if cfg.remat == "none":
        return step
    return jax.checkpoint(step, policy=REMAT_POLICIES[cfg.remat], static_argnums=static_argnums)


def _over_layers(
    cfg: ModelConfig,
    step: BlockStep,
    x_BxTxD: jax.Array,
    state: nnx.State,
    keys_L: jax.Array | None,
    windows: tuple[int | None, ...],
) -> tuple[jax.Array, Stats]:
    """`step` through the L layers of the stacked `state` with their `windows`: unrolled, or scanned
    (with the window static when every layer has the same, else scanned as a value with the rest)."""
    if not cfg.scan_layers:
        return _unrolled(_remat(cfg, step, (3,)), x_BxTxD, state, keys_L, windows)
    if len(set(windows)) == 1:
        static_step = _remat(cfg, step, (3,))
        return _scan(cfg, lambda x, xs: static_step(x, *xs, windows[0]), x_BxTxD, (state, keys_L))
    traced_step = _remat(cfg, step, ())
    windows_L = jnp.asarray([GLOBAL_WINDOW if w is None else w for w in windows], jnp.int32)
    return _scan(cfg, lambda x, xs: traced_step(x, *xs), x_BxTxD, (state, keys_L, windows_L))


def _scan(
    cfg: ModelConfig, body: Callable[[jax.Array, _Xs], tuple[jax.Array, _Ys]], x_BxTxD: jax.Array, xs: _Xs
) -> tuple[jax.Array, _Ys]:
    """The layer scan, `model.scan_unroll` layers an iteration (null, when the config was not
    resolved for a platform: one)."""
    return jax.lax.scan(body, x_BxTxD, xs, unroll=cfg.scan_unroll or 1)


def layer_slots(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    """Where each layer's parameters are: (stack, index in it); the stacks are `blocks` (dense FFN)
    and `moe_blocks` (mixture of experts)."""
    seen = {"blocks": 0, "moe_blocks": 0}
    slots = []
    for moe in cfg.moe_layers:
        stack = "moe_blocks" if moe else "blocks"
        slots.append((stack, seen[stack]))
        seen[stack] += 1
    return tuple(slots)


def _merged_stats(per_layer: list[Stats]) -> Stats:
    """{name: [layers that have it]} from each layer's statistics, in layer order (a MoE layer's
    routing statistics are indexed over the MoE layers)."""
    names = dict.fromkeys(k for stats in per_layer for k in stats)
    return {k: jnp.concatenate([jnp.reshape(s[k], (-1,)) for s in per_layer if k in s]) for k in names}


def _over_groups(
    cfg: ModelConfig, steps: dict[str, BlockStep], states: dict[str, nnx.State], x_BxTxD: jax.Array, keys_L
) -> tuple[jax.Array, Stats]:
    """Dense and MoE layers interleaved (`moe_every` > 1): their two stacks hold different parameters,
    so the scan runs over the n_layers / moe_every groups of moe_every - 1 dense layers and one MoE
    layer, unrolled inside a group (windows traced). Unrolled throughout without `scan_layers`."""
    slots, windows = layer_slots(cfg), cfg.layer_windows
    if not cfg.scan_layers:
        per_layer = []
        for i, (stack, j) in enumerate(slots):
            state_l = jax.tree.map(lambda a, j=j: a[j], states[stack])
            step = _remat(cfg, steps[stack], (3,))
            x_BxTxD, stats = step(x_BxTxD, state_l, None if keys_L is None else keys_L[i], windows[i])
            per_layer.append(stats)
        return x_BxTxD, _merged_stats(per_layer)
    k, G = cfg.moe_every, cfg.n_layers // cfg.moe_every
    traced = {stack: _remat(cfg, step, ()) for stack, step in steps.items()}
    windows_GxK = jnp.asarray([GLOBAL_WINDOW if w is None else w for w in windows], jnp.int32).reshape(G, k)
    dense_GxJ = jax.tree.map(lambda a: a.reshape((G, k - 1) + a.shape[1:]), states["blocks"])
    keys_GxK = None if keys_L is None else keys_L.reshape((G, k) + keys_L.shape[1:])

    def group(x_BxTxD, xs):
        dense_J, moe_state, keys_K, windows_K = xs
        per_layer = []
        for j in range(k):
            key = None if keys_K is None else keys_K[j]
            if j < k - 1:
                state_j = jax.tree.map(lambda a, j=j: a[j], dense_J)
                x_BxTxD, stats = traced["blocks"](x_BxTxD, state_j, key, windows_K[j])
            else:
                x_BxTxD, stats = traced["moe_blocks"](x_BxTxD, moe_state, key, windows_K[j])
            per_layer.append(stats)
        return x_BxTxD, per_layer

    x_BxTxD, per_position = _scan(cfg, group, x_BxTxD, (dense_GxJ, states["moe_blocks"], keys_GxK, windows_GxK))
    # per_position[j][name] is [G]; layer g*k + j: stacking positions on a second axis restores layer order
    names = dict.fromkeys(n for stats in per_position for n in stats)
    return x_BxTxD, {n: jnp.stack([s[n] for s in per_position if n in s], axis=1).reshape(-1) for n in names}


def _first_apart(
    cfg: ModelConfig, first: BlockStep, step: BlockStep, state: nnx.State, x_BxTxD: jax.Array, keys_L
) -> tuple[jax.Array, Stats]:
    """The first layer by `first` (model.first_attn_norm=false), the others by `step`."""
    runs = [(first, state, slice(0, 1), slice(0, 1)), (step, state, slice(1, cfg.n_layers), slice(1, cfg.n_layers))]
    return _in_turn(cfg, runs, x_BxTxD, keys_L)


def _over_runs(
    cfg: ModelConfig, steps: dict[str, BlockStep], states: dict[str, nnx.State], x_BxTxD: jax.Array, keys_L
) -> tuple[jax.Array, Stats]:
    """Dense layers first, then MoE layers (`moe_first_dense`): each run of layers of one stack."""
    slots, runs, start = layer_slots(cfg), [], 0
    while start < len(slots):
        stack, first = slots[start]
        end = start + 1
        while end < len(slots) and slots[end][0] == stack:
            end += 1
        runs.append((steps[stack], states[stack], slice(first, first + end - start), slice(start, end)))
        start = end
    return _in_turn(cfg, runs, x_BxTxD, keys_L)


def _in_turn(
    cfg: ModelConfig, runs: list[tuple[BlockStep, nnx.State, slice, slice]], x_BxTxD: jax.Array, keys_L
) -> tuple[jax.Array, Stats]:
    """Runs of layers in turn, each (its step, its stack, its layers in the stack, in the model)
    scanned (or unrolled) as a stack of its own; each statistic over the layers that have it (a MoE
    one over the MoE layers)."""
    per_run = []
    for step, state, in_stack, in_model in runs:
        if in_model.start == in_model.stop:  # an empty run: a one-layer model's rest
            continue
        state_run = jax.tree.map(lambda a, rows=in_stack: a[rows], state)
        keys = None if keys_L is None else keys_L[in_model]
        x_BxTxD, stats = _over_layers(cfg, step, x_BxTxD, state_run, keys, cfg.layer_windows[in_model])
        per_run.append(stats)
    names = dict.fromkeys(k for stats in per_run for k in stats)
    return x_BxTxD, {k: jnp.concatenate([s[k] for s in per_run if k in s]) for k in names}


def _unrolled(
    step: BlockStep,
    x_BxTxD: jax.Array,
    state: nnx.State,
    keys_L: jax.Array | None,
    windows: tuple[int | None, ...],
) -> tuple[jax.Array, Stats]:
    """`step` layer after layer in Python, each layer's statistics stacked as a scan would."""
    per_layer = []
    for i, window in enumerate(windows):
        state_l = jax.tree.map(lambda a, i=i: a[i], state)
        x_BxTxD, stats = step(x_BxTxD, state_l, None if keys_L is None else keys_L[i], window)
        per_layer.append(stats)
    return x_BxTxD, jax.tree.map(lambda *v: jnp.stack(v), *per_layer)


def _default_positions(tokens_BxT: jax.Array) -> jax.Array:
    B, T = tokens_BxT.shape
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


class MLMHead(nnx.Module):
    """BERT's prediction head (`model.mlm_head`): the final hidden states through a dense layer with a
    bias, the FFN's activation and a norm, before the output projection."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D = cfg.d_model
        self.dense = normal_param(rngs, (D, D), ("embed", None), cfg.init_std, cfg)
        self.dense_bias = const_param(0.0, (D,), (None,), cfg) if cfg.mlm_head_bias else None
        self.norm = Norm(cfg)
        self.cfg = cfg

    def transform(self, x_BxTxD: jax.Array) -> jax.Array:
        h_BxTxD = jnp.einsum("BTD,DE->BTE", x_BxTxD, self.dense[...].astype(x_BxTxD.dtype))
        if self.dense_bias is not None:
            h_BxTxD = h_BxTxD + self.dense_bias[...].astype(x_BxTxD.dtype)
        return self.norm(ACTIVATIONS[self.cfg.ffn](h_BxTxD))


class Transformer(nnx.Module):
    """A language model of one of the three families (`model.arch`): token embedding (plus what the
    position scheme adds to it), the main stack `blocks` (a decoder's causal blocks, or an encoder's
    bidirectional ones), a final norm where the placement needs one, and the output head (the
    transposed embedding when tied). An encoder-decoder adds `encoder_blocks` (bidirectional, with
    its own final norm `encoder_norm`) sharing the token embedding, and its decoder blocks
    cross-attend to the encoder output."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.positions = positions_for(cfg)
        scales = InitScales.of(cfg)
        V, D = cfg.padded_vocab, cfg.d_model
        self.embed = normal_param(rngs, (V, D), ("vocab", "embed"), scales.embedding, cfg)
        table = self.positions.table_shape
        self.pos_embed = None if table is None else normal_param(rngs, table, (None, "embed"), scales.positions, cfg)
        n_moe = sum(cfg.moe_layers)
        self.blocks = _stacked_blocks(cfg, rngs, cfg.n_layers - n_moe) if n_moe < cfg.n_layers else None
        self.moe_blocks = _stacked_blocks(cfg, rngs, n_moe, moe=True) if n_moe else None
        self.final_norm = Norm(cfg) if cfg.final_norm else None
        self.head = None if cfg.tie_embeddings else normal_param(rngs, (D, V), ("embed", "vocab"), scales.head, cfg)
        # drawn last, so that a decoder-only model's parameters are what they always were
        encoder_decoder = cfg.arch == "encoder_decoder"
        self.encoder_blocks = (
            _stacked_blocks(cfg, rngs, cfg.n_encoder_layers, encoder_stack=True) if encoder_decoder else None
        )
        self.encoder_norm = Norm(cfg) if encoder_decoder and cfg.final_norm else None
        self.embed_norm = Norm(cfg) if cfg.embedding_norm else None
        self.encoder_embed_norm = Norm(cfg) if cfg.embedding_norm and encoder_decoder else None
        self.mlm_head = MLMHead(cfg, rngs=rngs) if cfg.mlm_head else None
        self.output_bias = const_param(0.0, (V,), ("vocab",), cfg) if cfg.output_bias else None
        # t5_relative: a logit-bias table per stack, shared by its layers (drawn after the rest)
        bias_table = self.positions.bias_table_shape
        self.rel_bias = None if bias_table is None else normal_param(rngs, bias_table, (None, None), cfg.init_std, cfg)
        self.encoder_rel_bias = (
            normal_param(rngs, bias_table, (None, None), cfg.init_std, cfg)
            if bias_table is not None and encoder_decoder
            else None
        )
        # model.encoder_positions: the encoder's own table (drawn after the rest)
        self.encoder_pos_embed = (
            normal_param(rngs, table, (None, "embed"), scales.positions, cfg)
            if cfg.encoder_positions and table is not None
            else None
        )
        # model.token_types: a row per type (drawn after the rest)
        types = cfg.token_types
        self.type_embed = normal_param(rngs, (types, D), (None, "embed"), scales.embedding, cfg) if types else None

    def embed_tokens(
        self,
        tokens_BxT: jax.Array,
        positions_BxT: jax.Array,
        encoder: bool = False,
        token_types_BxT: jax.Array | None = None,
    ) -> jax.Array:
        """Token embeddings [B, T, D] in the compute dtype, plus each token's type's (`model.token_types`;
        type 0 where none are given), plus what the position scheme adds (from the encoder's own table
        for an encoder-decoder's `encoder` under `model.encoder_positions`), then the stack's embedding
        norm (`model.embedding_norm`; the `encoder` has its own)."""
        x_BxTxD = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(self.cfg.compute_dtype)
        if self.cfg.embed_scale:  # sqrt(D) in the compute dtype, as Gemma's normalizer
            x_BxTxD = x_BxTxD * jnp.asarray(math.sqrt(self.cfg.d_model), x_BxTxD.dtype)
        if self.type_embed is not None:  # before the positions, as BERT adds them
            types_BxT = jnp.zeros_like(tokens_BxT) if token_types_BxT is None else token_types_BxT
            x_BxTxD = x_BxTxD + jnp.take(self.type_embed[...], types_BxT, axis=0).astype(x_BxTxD.dtype)
        table = self.encoder_pos_embed if encoder and self.encoder_pos_embed is not None else self.pos_embed
        table_PxD = None if table is None else table[...]
        x_BxTxD = self.positions.add_to_embeddings(x_BxTxD, positions_BxT, table_PxD)
        norm = self.encoder_embed_norm if encoder else self.embed_norm
        if norm is not None:
            x_BxTxD = norm(x_BxTxD)
        if self.cfg.mup_input_alpha != 1.0:  # µP's tuned alpha_input (model/parametrization.py)
            x_BxTxD = x_BxTxD * jnp.asarray(self.cfg.mup_input_alpha, x_BxTxD.dtype)
        return x_BxTxD

    def run_blocks(
        self,
        x_BxTxD: jax.Array,
        positions_BxT: jax.Array,
        segment_ids_BxT: jax.Array | None = None,
        key: jax.Array | None = None,
        collect: bool = False,
        memory: Memory | None = None,
    ) -> tuple[jax.Array, Stats]:
        """(the main stack on embeddings x, then the final norm where the placement has one; each
        layer's statistics {name: [L]} with `collect` (see Block), else {}). `memory`: the encoder
        output an encoder-decoder's decoder blocks cross-attend to."""
        steps, states = {}, {}
        for name in ("blocks", "moe_blocks"):
            if getattr(self, name) is not None:
                graphdef, states[name] = nnx.split(getattr(self, name))
                table = None if self.rel_bias is None else self.rel_bias[...]
                steps[name] = self._layer_step(graphdef, positions_BxT, segment_ids_BxT, collect, memory, table)
        keys_L = None if key is None else jax.random.split(key, self.cfg.n_layers)
        if not self.cfg.first_attn_norm:  # the first layer on its own, then the rest
            graphdef, _ = nnx.split(self.blocks)
            table = None if self.rel_bias is None else self.rel_bias[...]
            first = self._layer_step(graphdef, positions_BxT, segment_ids_BxT, collect, memory, table, attn_norm=False)
            x_BxTxD, stats_L = _first_apart(self.cfg, first, steps["blocks"], states["blocks"], x_BxTxD, keys_L)
        elif len(steps) == 1:  # one kind of layer: one stack, scanned as it is
            (name,) = steps
            x_BxTxD, stats_L = _over_layers(
                self.cfg, steps[name], x_BxTxD, states[name], keys_L, self.cfg.layer_windows
            )
        elif self.cfg.moe_first_dense:
            x_BxTxD, stats_L = _over_runs(self.cfg, steps, states, x_BxTxD, keys_L)
        else:
            x_BxTxD, stats_L = _over_groups(self.cfg, steps, states, x_BxTxD, keys_L)
        if self.final_norm is not None:
            x_BxTxD = self.final_norm(x_BxTxD)
        return x_BxTxD, stats_L

    def run_encoder(
        self,
        x_BxSxD: jax.Array,
        positions_BxS: jax.Array,
        segment_ids_BxS: jax.Array | None = None,
        key: jax.Array | None = None,
        collect: bool = False,
    ) -> tuple[jax.Array, Stats]:
        """`run_blocks` for an encoder-decoder's encoder stack and its final norm."""
        assert self.encoder_blocks is not None, "only an encoder-decoder has an encoder stack"
        graphdef, state = nnx.split(self.encoder_blocks)
        table = None if self.encoder_rel_bias is None else self.encoder_rel_bias[...]
        step = self._layer_step(graphdef, positions_BxS, segment_ids_BxS, collect, bias_table=table)
        keys_L = None if key is None else jax.random.split(key, self.cfg.n_encoder_layers)
        x_BxSxD, stats_L = _over_layers(self.cfg, step, x_BxSxD, state, keys_L, self.cfg.encoder_layer_windows)
        if self.encoder_norm is not None:
            x_BxSxD = self.encoder_norm(x_BxSxD)
        return x_BxSxD, stats_L

    @staticmethod
    def _layer_step(
        graphdef: nnx.GraphDef,
        positions_BxT: jax.Array,
        segment_ids_BxT: jax.Array | None,
        collect: bool,
        memory: Memory | None = None,
        bias_table: jax.Array | None = None,
        attn_norm: bool = True,
    ) -> BlockStep:
        # the memory and the stack's bias table are the same for every layer: closed over, like the positions
        def step(x: jax.Array, state_l: nnx.State, key_l: jax.Array | None, window: Window) -> tuple[jax.Array, Stats]:
            block = nnx.merge(graphdef, state_l)
            x = place(x, RESIDUAL_AXES)
            args = (block, x, positions_BxT, segment_ids_BxT, window, key_l, collect, memory, bias_table, attn_norm)
            x, stats = _block_forward(*args)
            return place(x, RESIDUAL_AXES), stats

        return step

    def encode(
        self,
        encoder_tokens_BxS: jax.Array,
        positions_BxS: jax.Array | None = None,
        segment_ids_BxS: jax.Array | None = None,
        key: jax.Array | None = None,
    ) -> jax.Array:
        """The encoder output [B, S, D] of an encoder-decoder (what its decoder cross-attends to):
        computed once per input for decoding (`init_cache`)."""
        return self._encoded(encoder_tokens_BxS, positions_BxS, segment_ids_BxS, key, collect=False)[0]

    def _encoded(
        self,
        tokens_BxS: jax.Array,
        positions_BxS: jax.Array | None,
        segment_ids_BxS: jax.Array | None,
        key: jax.Array | None,
        collect: bool,
    ) -> tuple[jax.Array, Stats]:
        """(the encoder output, the encoder stack's statistics): the shared embedding, then the stack."""
        if positions_BxS is None:
            positions_BxS = _default_positions(tokens_BxS)
        embed_key = block_key = None
        if key is not None:
            embed_key, block_key = jax.random.split(key)
        x_BxSxD = dropout(self.embed_tokens(tokens_BxS, positions_BxS, encoder=True), self.cfg.dropout, embed_key)
        return self.run_encoder(x_BxSxD, positions_BxS, segment_ids_BxS, block_key, collect)

    def _memory(
        self,
        encoder_tokens_BxS: jax.Array | None,
        positions_BxS: jax.Array | None,
        segment_ids_BxS: jax.Array | None,
        key: jax.Array | None,
        collect: bool = False,
    ) -> tuple[Memory | None, Stats]:
        """(what the decoder cross-attends to, the encoder's statistics): an encoder-decoder needs its
        input, the other families take none."""
        if (encoder_tokens_BxS is None) != (self.cfg.arch != "encoder_decoder"):
            raise ValueError(f"encoder_tokens_BxS is given exactly to an encoder_decoder, not to a {self.cfg.arch}")
        if encoder_tokens_BxS is None:
            return None, {}
        encoder_key = None if key is None else jax.random.fold_in(key, 1)
        x_BxSxD, stats = self._encoded(encoder_tokens_BxS, positions_BxS, segment_ids_BxS, encoder_key, collect)
        return Memory(x_BxSxD, segment_ids_BxS), stats

    def layer_block(self, i: int) -> Block:
        """Layer i's block of the main stack, taken out of its stack."""
        stack, j = layer_slots(self.cfg)[i]
        graphdef, state = nnx.split(getattr(self, stack))
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[j], state))

    def stability_stats(
        self,
        tokens_BxT: jax.Array,
        positions_BxT: jax.Array | None = None,
        segment_ids_BxT: jax.Array | None = None,
        *,
        encoder_tokens_BxS: jax.Array | None = None,
        encoder_positions_BxS: jax.Array | None = None,
        encoder_segment_ids_BxS: jax.Array | None = None,
    ) -> Stats:
        """One deterministic forward pass that reports, per layer ([L] each): attention logit max and
        mean, attention entropy, residual-stream RMS after the block; and the mean output log Z
        (what z-loss pushes toward 0). An encoder-decoder adds its encoder stack's as `encoder_*`
        ([L_enc]) and its decoder's cross-attention as `cross_attn_*` ([L])."""
        if positions_BxT is None:
            positions_BxT = _default_positions(tokens_BxT)
        memory, encoder_stats = self._memory(
            encoder_tokens_BxS, encoder_positions_BxS, encoder_segment_ids_BxS, None, collect=True
        )
        x_BxTxD = self.embed_tokens(tokens_BxT, positions_BxT)
        x_BxTxD, stats = self.run_blocks(x_BxTxD, positions_BxT, segment_ids_BxT, collect=True, memory=memory)
        stats.update({f"encoder_{name}": value for name, value in encoder_stats.items()})
        stats["log_z_mean"] = jnp.mean(jax.nn.logsumexp(self.logits(x_BxTxD), axis=-1))
        return stats

    def logits(self, x_BxTxD: jax.Array) -> jax.Array:
        """Float32 logits; the padding rows of the vocab are masked out so perplexity stays honest."""
        cfg = self.cfg
        if self.mlm_head is not None:
            x_BxTxD = self.mlm_head.transform(x_BxTxD)
        if cfg.scale_head_input:  # T5 v1.0's, in the compute dtype as transformers scales it
            x_BxTxD = x_BxTxD * jnp.asarray(cfg.d_model**-0.5, x_BxTxD.dtype)
        if self.head is None:
            logits_BxTxV = jnp.einsum(
                "BTD,VD->BTV", x_BxTxD, self.embed[...].astype(x_BxTxD.dtype), preferred_element_type=jnp.float32
            )
        else:
            logits_BxTxV = jnp.einsum(
                "BTD,DV->BTV", x_BxTxD, self.head[...].astype(x_BxTxD.dtype), preferred_element_type=jnp.float32
            )
        if cfg.parametrization == "mup":  # alpha_output times the readout's 1/m (model/parametrization.py)
            logits_BxTxV = logits_BxTxV * logit_multiplier(cfg)
        if self.output_bias is not None:
            logits_BxTxV = logits_BxTxV + self.output_bias[...].astype(jnp.float32)
        if cfg.logit_softcap is not None:
            logits_BxTxV = cfg.logit_softcap * jnp.tanh(logits_BxTxV / cfg.logit_softcap)
        if cfg.padded_vocab != cfg.vocab_size:
            logits_BxTxV = jnp.where(jnp.arange(cfg.padded_vocab) < cfg.vocab_size, logits_BxTxV, MASK_VALUE)
        return logits_BxTxV

    def init_cache(
        self,
        batch: int,
        max_len: int,
        memory_BxSxD: jax.Array | None = None,
        memory_segment_ids_BxS: jax.Array | None = None,
    ) -> list[KVCache]:
        """An empty KV cache for `max_len` tokens: per layer, K/V for the kv heads only (GQA and MQA
        caches shrink in proportion; MLA keeps its latent and rope key instead), a ring buffer of
        `window` entries for sliding-window layers. An encoder-decoder's layers also keep the keys
        and values of its encoder output `memory_BxSxD` (`encode`), made once here: `cross_k`,
        `cross_v` [B, S, K, H] and `cross_segments` [B, S] (0: padding, never attended; default 1)."""
        if not self.cfg.causal:
            raise ValueError("an encoder decodes nothing: its predictions at masked positions come from fill_mask")
        stack = self.blocks if self.blocks is not None else self.moe_blocks  # every layer has the same attention
        assert stack is not None
        caches = [stack.attn.empty_cache(batch, cache_size(w, max_len)) for w in self.cfg.layer_windows]
        if (memory_BxSxD is None) != (self.cfg.arch != "encoder_decoder"):
            raise ValueError(f"memory_BxSxD is given exactly to an encoder_decoder, not to a {self.cfg.arch}")
        if memory_BxSxD is None:
            return caches
        if memory_segment_ids_BxS is None:
            memory_segment_ids_BxS = jnp.ones(memory_BxSxD.shape[:2], jnp.int32)
        for i, cache in enumerate(caches):
            cross_attn = self.layer_block(i).cross_attn
            assert cross_attn is not None, "an encoder-decoder's decoder blocks cross-attend"
            entries = cross_attn.memory_entries(memory_BxSxD)
            cache.update(cross_k=entries["k"], cross_v=entries["v"], cross_segments=memory_segment_ids_BxS)
        return caches

    def decode(
        self, tokens_BxT: jax.Array, positions_BxT: jax.Array, cache: list[KVCache], index: int | jax.Array
    ) -> tuple[jax.Array, list[KVCache]]:
        """Logits for T new tokens at absolute index `index` (prefill: all prompt tokens at 0; then one
        per step), attending to the cache; returns the logits and the updated cache. Positions are per
        row (left padding has position -1)."""
        x_BxTxD = self.embed_tokens(tokens_BxT, jnp.maximum(positions_BxT, 0))
        table = None if self.rel_bias is None else self.rel_bias[...]
        new_cache = []
        for i, window in enumerate(self.cfg.layer_windows):  # unrolled: layers may hold caches of different sizes
            # captured, so that what a MoE layer sows is collected and dropped rather than kept on the block
            first_apart = i == 0 and not self.cfg.first_attn_norm
            forward = nnx.capture(
                lambda b, x=x_BxTxD, w=window, c=cache[i], norm=not first_apart: b(
                    x, positions_BxT, None, w, None, c, index, bias_table=table, attn_norm=norm
                ),
                nnx.Intermediate,
            )
            (x_BxTxD, layer_cache), _ = forward(self.layer_block(i))
            assert layer_cache is not None, "a block given a cache returns it updated"
            new_cache.append(layer_cache)
        if self.final_norm is not None:
            x_BxTxD = self.final_norm(x_BxTxD)
        return self.logits(x_BxTxD), new_cache

    def __call__(
        self,
        tokens_BxT: jax.Array,
        positions_BxT: jax.Array | None = None,
        segment_ids_BxT: jax.Array | None = None,
        key: jax.Array | None = None,
        **encoder_inputs: jax.Array | None,
    ) -> jax.Array:
        """Logits [B, T, V] for every position (teacher forcing); see `forward` for the arguments."""
        return self.logits(self.forward(tokens_BxT, positions_BxT, segment_ids_BxT, key, **encoder_inputs)[0])

    def forward(
        self,
        tokens_BxT: jax.Array,
        positions_BxT: jax.Array | None = None,
        segment_ids_BxT: jax.Array | None = None,
        key: jax.Array | None = None,
        *,
        encoder_tokens_BxS: jax.Array | None = None,
        encoder_positions_BxS: jax.Array | None = None,
        encoder_segment_ids_BxS: jax.Array | None = None,
        token_types_BxT: jax.Array | None = None,
    ) -> tuple[jax.Array, Stats]:
        """(the last hidden states [B, T, D], before the output projection, what the step reads
        besides them: the routing terms of the MoE layers, each of `moe.STEP_METRICS` reduced over
        them, under `model.router_bias_rate` each MoE layer's load of each expert `expert_load`
        [n_moe, E], and under `model.qk_clip` each layer's heads' largest logits, `head_logit_max`
        [L, N]; {} for a dense model without QK-clip). A chunked loss projects the hidden states a few
        positions at a time: `transformer/train/loss.py`.

        positions_BxT: defaults to 0..T-1 (pass per-document positions for packed documents);
        segment_ids_BxT: document ids, attention never crosses a change of id;
        key: dropout randomness; None runs deterministically (evaluation);
        encoder_*_BxS: an encoder-decoder's input (required there, refused elsewhere), its positions
        (default 0..S-1) and segment ids; decoder position t cross-attends to encoder position s iff
        their segment ids are equal when both are given, else to every encoder position;
        token_types_BxT: each token's type under model.token_types (BERT's segment ids; default 0).
        """
        if positions_BxT is None:
            positions_BxT = _default_positions(tokens_BxT)
        embed_key = block_key = None
        if key is not None:
            embed_key, block_key = jax.random.split(key)
        memory, _ = self._memory(encoder_tokens_BxS, encoder_positions_BxS, encoder_segment_ids_BxS, key)
        x_BxTxD = self.embed_tokens(tokens_BxT, positions_BxT, token_types_BxT=token_types_BxT)
        x_BxTxD = dropout(x_BxTxD, self.cfg.dropout, embed_key)
        x_BxTxD, stats = self.run_blocks(x_BxTxD, positions_BxT, segment_ids_BxT, block_key, memory=memory)
        terms = {k: over(stats[f"layer_{k}"]) for k, over in STEP_METRICS.items() if f"layer_{k}" in stats}
        if self.cfg.router_bias_rate:  # each MoE layer's load of each expert, [n_moe, E], for the balancing
            terms["expert_load"] = jnp.stack([stats[f"expert_load_{e}"] for e in range(self.cfg.n_experts)], -1)
        if "head_logit_max" in stats:  # layer-major whichever way the layers ran: [L * N] or [L, N]
            terms["head_logit_max"] = stats["head_logit_max"].reshape(self.cfg.n_layers, -1)
        return x_BxTxD, terms


def for_inference(model: Transformer) -> Transformer:
    """`model` as evaluation and generation compute it (`ModelConfig.at_inference`: a capacity-trained
    mixture of experts without drops), sharing its parameters; `model` itself where nothing differs."""
    cfg = model.cfg.at_inference
    if cfg is model.cfg:
        return model
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))
