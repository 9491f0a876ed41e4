"""The decoder-only Transformer: embedding, a stack of blocks (scanned by default), output head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.config import GLOBAL_WINDOW, ModelConfig
from transformer.model.attention import MASK_VALUE, Attention, cache_size, init_cache
from transformer.model.layers import FFN, Norm, dropout, normal_param, sinusoidal

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class Block(nnx.Module):
    """One attention sublayer and one FFN sublayer, each wrapped by the configured norm placement."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attn = Attention(cfg, rngs=rngs)
        self.ffn = FFN(cfg, rngs=rngs)
        self.attn_norm = Norm(cfg)
        self.ffn_norm = Norm(cfg)
        sandwich = cfg.norm_position == "sandwich"
        self.attn_out_norm = Norm(cfg) if sandwich else None
        self.ffn_out_norm = Norm(cfg) if sandwich else None

    def residual(self, x, sublayer, norm, out_norm, key):
        """The one place where norm placement is decided."""
        rate = self.cfg.dropout
        match self.cfg.norm_position:
            case "pre":  # x + f(N(x))
                return x + dropout(sublayer(norm(x)), rate, key)
            case "post":  # N(x + f(x)), the original Transformer
                return norm(x + dropout(sublayer(x), rate, key))
            case "sandwich":  # x + N2(f(N1(x))), a.k.a. peri-LN
                return x + dropout(out_norm(sublayer(norm(x))), rate, key)
            case "deepnorm":  # N(alpha*x + f(x)), DeepNet
                return norm(self.cfg.residual_alpha * x + dropout(sublayer(x), rate, key))
        raise AssertionError(self.cfg.norm_position)

    def __call__(self, x_BxTxD, positions_BxT, segment_ids_BxT, window, key=None, cache=None, index=0, collect=False):
        """The block's output; with a KV `cache` (decoding), (output, updated cache). With `collect`,
        statistics are sown as nnx.Intermediate (attention logits and entropy, residual RMS)."""
        keys = (None,) * 3 if key is None else tuple(jax.random.split(key, 3))
        new_cache = None

        def attend(h):
            nonlocal new_cache
            if cache is None:
                return self.attn(h, positions_BxT, segment_ids_BxT, window, keys[0], collect=collect)
            y, new_cache = self.attn(h, positions_BxT, segment_ids_BxT, window, keys[0], cache, index)
            return y

        x_BxTxD = self.residual(x_BxTxD, attend, self.attn_norm, self.attn_out_norm, keys[1])
        x_BxTxD = self.residual(x_BxTxD, self.ffn, self.ffn_norm, self.ffn_out_norm, keys[2])
        if collect:
            self.sow(nnx.Intermediate, "residual_rms", jnp.sqrt(jnp.mean(jnp.square(x_BxTxD.astype(jnp.float32)))))
        return x_BxTxD if cache is None else (x_BxTxD, new_cache)


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """L blocks whose parameters are stacked on a leading `layers` axis, ready for `lax.scan`."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))
    keys_L = jax.random.split(rngs.params(), cfg.n_layers)
    state = jax.vmap(lambda k: nnx.state(Block(cfg, rngs=nnx.Rngs(k))))(keys_L)
    state = jax.tree.map(
        lambda v: v.replace(axes=("layers",) + v.axes),
        state,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )
    return nnx.merge(graphdef, state)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        V, D = cfg.padded_vocab, cfg.d_model
        self.embed = normal_param(rngs, (V, D), ("vocab", "embed"), cfg.init_std, cfg)
        if cfg.position == "learned":
            self.pos_embed = normal_param(rngs, (cfg.max_seq_len, D), (None, "embed"), cfg.init_std, cfg)
        else:
            self.pos_embed = None
        self.blocks = _stacked_blocks(cfg, rngs)
        self.final_norm = Norm(cfg) if cfg.final_norm else None
        self.head = None if cfg.tie_embeddings else normal_param(rngs, (D, V), ("embed", "vocab"), cfg.init_std, cfg)

    def embed_tokens(self, tokens_BxT, positions_BxT) -> jax.Array:
        cfg = self.cfg
        x_BxTxD = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(cfg.dtype)
        if self.pos_embed is not None:
            x_BxTxD = x_BxTxD + jnp.take(self.pos_embed[...], positions_BxT, axis=0).astype(cfg.dtype)
        elif cfg.position == "sinusoidal":
            x_BxTxD = x_BxTxD + sinusoidal(positions_BxT, cfg.d_model).astype(cfg.dtype)
        return x_BxTxD

    def run_blocks(self, x_BxTxD, positions_BxT, segment_ids_BxT=None, key=None, collect=False):
        """The block stack on embeddings x, then the final norm where the placement has one.
        With `collect`, also each layer's statistics: {name: [L]} (see Block)."""
        cfg = self.cfg
        graphdef, state = nnx.split(self.blocks)
        keys_L = None if key is None else jax.random.split(key, cfg.n_layers)
        windows = cfg.layer_windows

        def block(x, state_l, key_l, window):
            module = nnx.merge(graphdef, state_l)
            if not collect:
                return module(x, positions_BxT, segment_ids_BxT, window, key_l), {}
            forward = nnx.capture(
                lambda m: m(x, positions_BxT, segment_ids_BxT, window, key_l, collect=True), nnx.Intermediate
            )
            x, sown = forward(module)
            # what the block sowed, by name; each value is a one-element tuple
            return x, {path[-1]: value.get_value()[0] for path, value in nnx.to_flat_state(sown)}

        def remat(f, static_argnums):
            if cfg.remat == "none":
                return f
            return jax.checkpoint(f, policy=REMAT_POLICIES[cfg.remat], static_argnums=static_argnums)

        if not cfg.scan_layers:
            step = remat(block, (3,))
            per_layer = []
            for i in range(cfg.n_layers):
                state_l = jax.tree.map(lambda a, i=i: a[i], state)
                x_BxTxD, stats = step(x_BxTxD, state_l, None if keys_L is None else keys_L[i], windows[i])
                per_layer.append(stats)
            stats_L = jax.tree.map(lambda *v: jnp.stack(v), *per_layer)
        elif len(set(windows)) == 1:  # one window for every layer: keep it static
            step = remat(block, (3,))
            body = lambda x, xs: step(x, *xs, windows[0])
            x_BxTxD, stats_L = jax.lax.scan(body, x_BxTxD, (state, keys_L))
        else:  # a per-layer pattern: the window becomes a scanned value
            step = remat(block, ())
            windows_L = jnp.asarray([GLOBAL_WINDOW if w is None else w for w in windows], jnp.int32)
            body = lambda x, xs: step(x, *xs)
            x_BxTxD, stats_L = jax.lax.scan(body, x_BxTxD, (state, keys_L, windows_L))
        if self.final_norm is not None:
            x_BxTxD = self.final_norm(x_BxTxD)
        return (x_BxTxD, stats_L) if collect else x_BxTxD

    def stability_stats(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None) -> dict[str, jax.Array]:
        """One deterministic forward pass that reports, per layer ([L] each): attention logit max and
        mean, attention entropy, residual-stream RMS after the block; and the mean output log Z
        (what z-loss pushes toward 0)."""
        B, T = tokens_BxT.shape
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        x_BxTxD = self.embed_tokens(tokens_BxT, positions_BxT)
        x_BxTxD, stats = self.run_blocks(x_BxTxD, positions_BxT, segment_ids_BxT, collect=True)
        stats["log_z_mean"] = jnp.mean(jax.nn.logsumexp(self.logits(x_BxTxD), axis=-1))
        return stats

    def logits(self, x_BxTxD) -> jax.Array:
        """Float32 logits; the padding rows of the vocab are masked out so perplexity stays honest."""
        cfg = self.cfg
        if self.head is None:
            logits_BxTxV = jnp.einsum(
                "BTD,VD->BTV", x_BxTxD, self.embed[...].astype(x_BxTxD.dtype), preferred_element_type=jnp.float32
            )
        else:
            logits_BxTxV = jnp.einsum(
                "BTD,DV->BTV", x_BxTxD, self.head[...].astype(x_BxTxD.dtype), preferred_element_type=jnp.float32
            )
        if cfg.logit_softcap is not None:
            logits_BxTxV = cfg.logit_softcap * jnp.tanh(logits_BxTxV / cfg.logit_softcap)
        if cfg.padded_vocab != cfg.vocab_size:
            logits_BxTxV = jnp.where(jnp.arange(cfg.padded_vocab) < cfg.vocab_size, logits_BxTxV, MASK_VALUE)
        return logits_BxTxV

    def init_cache(self, batch: int, max_len: int) -> list[dict]:
        """An empty KV cache for `max_len` tokens: per layer, K/V for the kv heads only (GQA and MQA
        caches shrink in proportion), a ring buffer of `window` entries for sliding-window layers."""
        return [init_cache(self.cfg, batch, cache_size(w, max_len)) for w in self.cfg.layer_windows]

    def decode(self, tokens_BxT, positions_BxT, cache: list[dict], index) -> tuple[jax.Array, list[dict]]:
        """Logits for T new tokens at absolute index `index` (prefill: all prompt tokens at 0; then one
        per step), attending to the cache; returns the logits and the updated cache. Positions are per
        row (left padding has position -1)."""
        cfg = self.cfg
        x_BxTxD = self.embed_tokens(tokens_BxT, jnp.maximum(positions_BxT, 0))
        graphdef, state = nnx.split(self.blocks)
        new_cache = []
        for i, window in enumerate(cfg.layer_windows):  # unrolled: layers may hold caches of different sizes
            block = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
            x_BxTxD, layer_cache = block(x_BxTxD, positions_BxT, None, window, None, cache[i], index)
            new_cache.append(layer_cache)
        if self.final_norm is not None:
            x_BxTxD = self.final_norm(x_BxTxD)
        return self.logits(x_BxTxD), new_cache

    def __call__(self, tokens_BxT, positions_BxT=None, segment_ids_BxT=None, key=None) -> jax.Array:
        """Logits [B, T, V] for every position (teacher forcing).

        positions_BxT: defaults to 0..T-1 (pass per-document positions for packed documents);
        segment_ids_BxT: document ids, attention never crosses a change of id;
        key: dropout randomness; None runs deterministically (evaluation).
        """
        B, T = tokens_BxT.shape
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        embed_key = block_key = None
        if key is not None:
            embed_key, block_key = jax.random.split(key)
        x_BxTxD = dropout(self.embed_tokens(tokens_BxT, positions_BxT), self.cfg.dropout, embed_key)
        x_BxTxD = self.run_blocks(x_BxTxD, positions_BxT, segment_ids_BxT, block_key)
        return self.logits(x_BxTxD)
