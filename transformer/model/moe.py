"""The mixture-of-experts FFN: a router, E routed experts of width `moe_d_ff` (E x the FFN's weights,
on the `experts` logical axis), optional shared experts every token goes through, and the routing
losses.

Axis legend, beside layers.py's: E experts, K experts per token (top_k), X slots per expert in a row
(its capacity), M rows an expert computes (capacity slots of all rows, or assignments sorted by expert).

Routing (`MoE.route`): `softmax` takes the top-k of softmax(logits); `sigmoid` (DeepSeek-V3) the top-k
of sigmoid(logits). DeepSeek's refinements choose by other scores than they gate by: a per-expert
`router_bias` added for choosing only (V3), and group-limited routing, the experts in `router_groups`
groups of which a token may use its `router_topk_groups` best (V2: a group scored by its best
expert; V3: by its two best, biased). With top_k > 1 the k gates are renormalised to sum to 1
(`renormalize_gates`; false: the scores as they are, Qwen-MoE's `norm_topk_prob: false`); with top-1
the gate is the score itself (Switch), because a renormalised single gate is always 1 and the router
would learn only from the balancing loss. Then the gates times `routed_scale` (DeepSeek's
routed_scaling_factor). Under `router_bias_rate` the trainer moves the choice bias toward balance
after every update (`balance_router_bias`: aux-loss-free balancing). Shared experts add their output,
times sigmoid(x . w) per token under `shared_expert_gate` (Qwen2-MoE).

Dispatch, decided in `MoE.__call__`:
- capacity (`capacity_factor` set): each row (sequence) is a group; an expert takes at most
  X = ceil(factor * T * K / E) of the row's assignments, first choices before second choices, in
  token order (GShard/Switch). An assignment beyond X is dropped: it adds nothing, so a token whose
  every assignment is dropped passes through on the residual stream. Each slot gathers its token
  and each token its slots' outputs (`capacity_slots`): no one-hot dispatch or combine tensor
  (B x T x E x X) is made, whose einsums cost as much as the experts at small widths. The slots are
  laid out by row, then by expert (ROW_MAJOR, EXPERT_MAJOR): on a mesh with an expert axis that is
  an all-to-all each way, and a device computes its own experts on every device's tokens (GShard).
- dropless (`capacity_factor: null`): every assignment is computed. A device's rows' assignments
  (`row_groups`) are sorted by expert and multiplied with `jax.lax.ragged_dot`, which takes one
  group per expert (on a CPU, in blocks); each device gathers the experts' weights it lacks.
  Evaluation and generation always run dropless (`ModelConfig.at_inference`): a capacity is
  training's, as no cached decoding can see the tokens a drop depends on.

Losses (means over the batch's tokens): the Switch load-balancing loss E * sum_e f_e * P_e, where
f_e is the fraction of assignments routed to e and P_e the mean routing probability of e (1 at
uniform probabilities, E at collapse), and the router z-loss mean(logsumexp(logits)^2) (ST-MoE).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.config import ModelConfig
from transformer.model.layers import ACTIVATIONS, FFN, InitScales, const_param, normal_param, place, row_groups
from transformer.model.parametrization import output_multiplier

# The expert slots [B, E, X, D] as the batch's rows split them, and [E, B, X, D] as the experts do (the
# rows then split over the batch's other axes): placed so in turn, the move between them is an
# all-to-all over the expert axis where one splits the experts (sharding.RULES), and nothing elsewhere.
ROW_MAJOR = ("batch", None, None, None)
EXPERT_MAJOR = ("experts", "expert_rows", None, None)

# Step metrics, and how each reduces over the MoE layers the per-layer value `layer_<name>` every MoE
# layer sows on every forward pass (the busiest expert of any layer: a collapse anywhere shows). The
# per-layer values keep their own names, as the stability statistics log them beside the step's.
STEP_METRICS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "moe_aux_loss": jnp.mean,
    "router_z_loss": jnp.mean,
    "dropped_fraction": jnp.mean,
    "expert_load_max": jnp.max,
}


class Routing(NamedTuple):
    logits_BxTxE: jax.Array  # float32
    probs_BxTxE: jax.Array  # a distribution over experts per token (what P_e averages)
    expert_BxTxK: jax.Array  # int32, the chosen experts, best first
    gate_BxTxK: jax.Array  # float32, the weight of each chosen expert's output


def capacity(cfg: ModelConfig, T: int) -> int:
    """Slots per expert in a row of T tokens (never more than T: a token picks an expert once)."""
    assert cfg.capacity_factor is not None, "capacity applies to capacity-factor dispatch only"
    return min(T, math.ceil(cfg.capacity_factor * T * cfg.top_k / cfg.n_experts))


def capacity_slots(expert_BxTxK: jax.Array, E: int, X: int) -> jax.Array:
    """Each assignment's slot [B, T, K] in its row's E x X expert slots, flattened as e * X + x:
    assignment (t, k) takes slot x of its expert when x < X assignments are ahead of it (every first
    choice before any second); a dropped one gets E * X, a slot past them all."""
    B, T, K = expert_BxTxK.shape
    expert_BxKxT = expert_BxTxK.swapaxes(1, 2)
    onehot_BxKxTxE = jax.nn.one_hot(expert_BxKxT, E, dtype=jnp.int32)
    ahead = jnp.cumsum(onehot_BxKxTxE.reshape(B, K * T, E), axis=1).reshape(B, K, T, E) - onehot_BxKxTxE
    position_BxKxT = jnp.sum(ahead * onehot_BxKxTxE, axis=-1)
    slot_BxKxT = jnp.where(position_BxKxT < X, expert_BxKxT * X + position_BxKxT, E * X)
    return slot_BxKxT.swapaxes(1, 2)


def by_expert(expert_M: jax.Array, E: int) -> tuple[jax.Array, jax.Array]:
    """(the assignments' order sorted by expert, stable; each expert's count [E] int32)."""
    return jnp.argsort(expert_M, stable=True), jnp.bincount(expert_M, length=E).astype(jnp.int32)


# Up to this many experts `ahead_in_expert` counts (work M x E) rather than sorts (M log M): on a
# 2-core CPU (Intel Xeon, 2026-12-07) the counts took 0.14 / 2.3 / 6.3 ms at M = 4,096 / 65,536 /
# 65,536 assignments and E = 4 / 16 / 32 experts, a stable argsort 0.50 / 9.3 / 9.6; at E = 64, 22
# against 10.
COUNTED_EXPERTS = 32


def ahead_in_expert(expert_M: jax.Array, E: int) -> tuple[jax.Array, jax.Array]:
    """(how many assignments before each one chose its expert [M], each expert's count [E]): its
    rank in a stable sort by expert, by a cumulative count of one-hot choices up to COUNTED_EXPERTS
    experts, by a sort beyond."""
    if E <= COUNTED_EXPERTS:
        onehot_MxE = jax.nn.one_hot(expert_M, E, dtype=jnp.int32)
        ahead_M = jnp.sum((jnp.cumsum(onehot_MxE, axis=0) - onehot_MxE) * onehot_MxE, axis=-1)
        return ahead_M, jnp.sum(onehot_MxE, axis=0)
    order_M, sizes_E = by_expert(expert_M, E)
    ahead_sorted_M = jnp.arange(expert_M.shape[0]) - (jnp.cumsum(sizes_E) - sizes_E)[expert_M[order_M]]
    return jnp.zeros_like(ahead_sorted_M).at[order_M].set(ahead_sorted_M), sizes_E


def expert_blocks(
    x_SxD: jax.Array, expert_SxK: jax.Array, E: int, ffn: Callable, weights: tuple[jax.Array, ...]
) -> jax.Array:
    """`ffn(rows, expert weights)` of every row's K assignments [S, K, D], in blocks of b rows each
    of one expert: the assignments in expert order (stable), each expert's run padded to whole
    blocks with zeros, at most N = floor((M + E (b - 1)) / b) blocks (M = S * K; an expert's run
    leaves at most b - 1 rows of its last block empty), so under E * b rows more than ragged_dot's;
    each block one batched product with its expert's weights gathered (MegaBlocks' layout, Gale et
    al. 2022). b ~ M / 4E: a quarter of the work more at worst. Each assignment's block row follows
    from the count of assignments ahead of it in its expert (`ahead_in_expert`); the rows move by
    one gather each way, and so do their gradients (`to_blocks`, `from_blocks`: each the other's
    transpose, where XLA's would scatter-add into zeros)."""
    S, K = expert_SxK.shape
    M = S * K
    expert_M = expert_SxK.reshape(M)
    ahead_M, sizes_E = ahead_in_expert(expert_M, E)
    b = max(16, 1 << max(0, (M // (4 * E) - 1).bit_length()))
    N = (M + E * (b - 1)) // b
    blocks_E = (sizes_E + b - 1) // b
    end_E = jnp.cumsum(blocks_E)
    row_M = ((end_E - blocks_E)[expert_M] * b + ahead_M).astype(jnp.int32)  # each assignment's block row
    assignment_R = filled_by(row_M, N * b)
    expert_N = jnp.minimum(jnp.sum(end_E[None, :] <= jnp.arange(N)[:, None], axis=-1), E - 1)
    x_NxbxD = to_blocks(x_SxD, assignment_R, row_M).reshape(N, b, -1)
    y_NxbxC = ffn(x_NxbxD, tuple(w[expert_N] for w in weights))
    return from_blocks(y_NxbxC.reshape(N * b, -1), row_M, assignment_R).reshape(S, K, -1)


def filled_by(row_M: jax.Array, R: int) -> jax.Array:
    """Which assignment fills each of R rows [R], M where none does, from each assignment's row
    `row_M` (one past the rows, R: an assignment dropped, which fills none)."""
    M = row_M.shape[0]
    return jnp.full(R, M, jnp.int32).at[row_M].set(jnp.arange(M, dtype=jnp.int32), mode="drop")


@jax.custom_vjp
def to_blocks(x_SxD: jax.Array, assignment_R: jax.Array, row_M: jax.Array) -> jax.Array:
    """Block row r holds the token of assignment `assignment_R[r]` (zeros where that is M, padding)."""
    K = row_M.shape[0] // x_SxD.shape[0]
    return jnp.take(x_SxD, assignment_R // K, axis=0, mode="fill", fill_value=0)


def _to_blocks_fwd(x_SxD, assignment_R, row_M):
    return to_blocks(x_SxD, assignment_R, row_M), (assignment_R, row_M.reshape(x_SxD.shape[0], -1))


def _to_blocks_bwd(res, g_RxD):
    assignment_R, row_SxK = res
    g_MxD = from_blocks(g_RxD, row_SxK.reshape(-1), assignment_R)
    return g_MxD.reshape(*row_SxK.shape, -1).sum(axis=1), None, None


@jax.custom_vjp
def from_blocks(y_RxC: jax.Array, row_M: jax.Array, assignment_R: jax.Array) -> jax.Array:
    """Assignment m's output, block row `row_M[m]` [M, C] (zeros where that is past the rows: a
    capacity's dropped assignment)."""
    return jnp.take(y_RxC, row_M, axis=0, mode="fill", fill_value=0)


def _from_blocks_fwd(y_RxC, row_M, assignment_R):
    return from_blocks(y_RxC, row_M, assignment_R), assignment_R


def _from_blocks_bwd(assignment_R, g_MxC):
    return jnp.take(g_MxC, assignment_R, axis=0, mode="fill", fill_value=0), None, None


to_blocks.defvjp(_to_blocks_fwd, _to_blocks_bwd)
from_blocks.defvjp(_from_blocks_fwd, _from_blocks_bwd)


def routing_losses(r: Routing, E: int) -> dict[str, jax.Array]:
    """The Switch balancing loss and the router z-loss of one layer (means over tokens)."""
    f_E = jnp.mean(jax.nn.one_hot(r.expert_BxTxK, E, dtype=jnp.float32), axis=(0, 1, 2))
    p_E = jnp.mean(r.probs_BxTxE, axis=(0, 1))
    return {
        "moe_aux_loss": E * jnp.sum(f_E * p_E),
        "router_z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(r.logits_BxTxE, axis=-1))),
    }


def load_stats(r: Routing, E: int) -> dict[str, jax.Array]:
    """The fraction of tokens routed to each expert (summing to top_k) and the router's mean entropy."""
    load_E = jnp.mean(jnp.sum(jax.nn.one_hot(r.expert_BxTxK, E, dtype=jnp.float32), axis=2), axis=(0, 1))
    p = r.probs_BxTxE
    entropy = -jnp.mean(jnp.sum(p * jnp.log(jnp.maximum(p, 1e-30)), axis=-1))
    return {"router_entropy": entropy, **{f"expert_load_{e}": load_E[e] for e in range(E)}}


def balance_router_bias(cfg: ModelConfig, params: dict, load_LxE: jax.Array) -> dict:
    """`params` with each MoE layer's choice bias moved by router_bias_rate toward balance: up for
    an expert whose share of the step's tokens `load_LxE` is below the layer's mean (top_k / E),
    down above it (Wang et al. 2024's aux-loss-free balancing, DeepSeek-V3's rule)."""
    ffn = params["moe_blocks"]["ffn"]
    bias_LxE = ffn["router_bias"]
    step_LxE = cfg.router_bias_rate * jnp.sign(cfg.top_k / cfg.n_experts - load_LxE)
    ffn = {**ffn, "router_bias": bias_LxE + step_LxE.astype(bias_LxE.dtype)}
    return {**params, "moe_blocks": {**params["moe_blocks"], "ffn": ffn}}


class MoE(nnx.Module):
    """The FFN sublayer as a mixture of experts (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        E, D, F = cfg.n_experts, cfg.d_model, cfg.moe_d_ff
        scales = InitScales.of(cfg, experts=True)
        self.router = normal_param(rngs, (D, E), ("embed", None), cfg.init_std, cfg)
        if cfg.gated_ffn:  # gate and up projection fused: C = 2, as in FFN
            self.w_in = normal_param(rngs, (E, D, 2, F), ("experts", "embed", None, "mlp"), scales.ffn_in, cfg)
        else:
            self.w_in = normal_param(rngs, (E, D, F), ("experts", "embed", "mlp"), scales.ffn_in, cfg)
        self.w_out = normal_param(rngs, (E, F, D), ("experts", "mlp", "embed"), scales.ffn_out, cfg)
        shared = cfg.n_shared_experts * F
        # n shared experts are one FFN of n times the width: their hidden units simply add up
        self.shared = FFN(cfg, rngs=rngs, width=shared, experts=True) if shared else None
        self.shared_gate = normal_param(rngs, (D,), ("embed",), cfg.init_std, cfg) if cfg.shared_expert_gate else None
        self.router_bias = const_param(0.0, (E,), (None,), cfg) if cfg.router_bias else None

    def route(self, x_BxTxD: jax.Array) -> Routing:
        cfg = self.cfg
        logits_BxTxE = jnp.einsum("BTD,DE->BTE", x_BxTxD.astype(jnp.float32), self.router[...].astype(jnp.float32))
        if cfg.parametrization == "mup":  # µP's readout rule, as the head's (1.0 at the base shape)
            logits_BxTxE = logits_BxTxE * output_multiplier(cfg)
        if cfg.router == "softmax":
            scores_BxTxE = probs_BxTxE = jax.nn.softmax(logits_BxTxE, axis=-1)
        else:
            scores_BxTxE = jax.nn.sigmoid(logits_BxTxE)
            probs_BxTxE = scores_BxTxE / jnp.sum(scores_BxTxE, axis=-1, keepdims=True)
        if self.router_bias is None and cfg.router_groups == 1:
            gate_BxTxK, expert_BxTxK = jax.lax.top_k(scores_BxTxE, cfg.top_k)
        else:  # chosen by biased scores within the best groups, gated by the scores themselves
            choice_BxTxE = scores_BxTxE
            if self.router_bias is not None:
                choice_BxTxE = choice_BxTxE + self.router_bias[...].astype(jnp.float32)
            _, expert_BxTxK = jax.lax.top_k(self.within_best_groups(choice_BxTxE), cfg.top_k)
            gate_BxTxK = jnp.take_along_axis(scores_BxTxE, expert_BxTxK, axis=-1)
        if cfg.top_k > 1 and cfg.renormalize_gates:
            gate_BxTxK = gate_BxTxK / jnp.sum(gate_BxTxK, axis=-1, keepdims=True)
        if cfg.routed_scale != 1.0:
            gate_BxTxK = gate_BxTxK * cfg.routed_scale
        return Routing(logits_BxTxE, probs_BxTxE, expert_BxTxK.astype(jnp.int32), gate_BxTxK)

    def within_best_groups(self, choice_BxTxE: jax.Array) -> jax.Array:
        """The choice scores with every expert outside the token's router_topk_groups best groups at
        -inf (as they are with one group). A group's score: its best expert's, or its two best summed."""
        cfg = self.cfg
        G = cfg.router_groups
        if G == 1:
            return choice_BxTxE
        B, T, E = choice_BxTxE.shape
        choice_BxTxGxS = choice_BxTxE.reshape(B, T, G, E // G)
        if cfg.router_group_score == "max":
            group_BxTxG = jnp.max(choice_BxTxGxS, axis=-1)
        else:
            group_BxTxG = jnp.sum(jax.lax.top_k(choice_BxTxGxS, 2)[0], axis=-1)
        _, best_BxTxJ = jax.lax.top_k(group_BxTxG, cfg.router_topk_groups)
        kept_BxTxG = jnp.any(best_BxTxJ[..., None] == jnp.arange(G), axis=-2)
        return jnp.where(kept_BxTxG[..., None], choice_BxTxGxS, -jnp.inf).reshape(B, T, E)

    def experts(self, x_ExMxD: jax.Array) -> jax.Array:
        """Each expert's FFN on its own rows: [E, M, D] -> [E, M, D]."""
        return self.ffn_rows(x_ExMxD, *self.expert_weights(x_ExMxD.dtype))

    def expert_weights(self, dtype) -> tuple[jax.Array, jax.Array]:
        """(w_in [E, D, C] with a gated FFN's gate and up fused as C = 2F, gate first; w_out [E, F, D])."""
        E, D = self.cfg.n_experts, self.cfg.d_model
        return self.w_in[...].astype(dtype).reshape(E, D, -1), self.w_out[...].astype(dtype)

    def with_capacity(self, x_BxTxD: jax.Array, r: Routing) -> tuple[jax.Array, jax.Array]:
        """(output, kept mask [B, T, K]) with at most `capacity` assignments per expert and row: each
        slot gathers its token, and each assignment its slot's output (a dropped one, whose slot is
        past them all, zeros), by the gathers of the dropless blocks, in each row: so no one-hot
        dispatch or combine tensor is made, and no gradient is scattered into zeros."""
        B, T, D = x_BxTxD.shape
        E, X = self.cfg.n_experts, capacity(self.cfg, T)
        slot_BxTxK = capacity_slots(r.expert_BxTxK, E, X)
        K = slot_BxTxK.shape[-1]
        slot_BxM = slot_BxTxK.reshape(B, T * K)
        assignment_BxS = jax.vmap(lambda slot_M: filled_by(slot_M, E * X))(slot_BxM)
        x_BxSxD = jax.vmap(to_blocks)(x_BxTxD, assignment_BxS, slot_BxM)
        x_BxExXxD = place(x_BxSxD.reshape(B, E, X, D), ROW_MAJOR)
        x_ExBxXxD = place(x_BxExXxD.swapaxes(0, 1), EXPERT_MAJOR)
        y_ExBxXxD = place(self.experts(x_ExBxXxD.reshape(E, B * X, D)).reshape(E, B, X, D), EXPERT_MAJOR)
        y_BxSxD = place(y_ExBxXxD.swapaxes(0, 1), ROW_MAJOR).reshape(B, E * X, D)
        y_BxTxKxD = jax.vmap(from_blocks)(y_BxSxD, slot_BxM, assignment_BxS).reshape(B, T, K, D)
        out_BxTxD = jnp.einsum("BTKD,BTK->BTD", y_BxTxKxD, r.gate_BxTxK.astype(x_BxTxD.dtype))
        return out_BxTxD, slot_BxTxK < E * X

    def dropless(self, x_BxTxD: jax.Array, r: Routing) -> jax.Array:
        """Every assignment computed (`dropless_rows`), within each of the batch's row groups
        (`row_groups`: a device's rows are one), so no device sorts or computes another's rows; each
        gathers the experts' weights it lacks, as fsdp gathers a layer's."""
        B = x_BxTxD.shape[0]
        G = math.gcd(row_groups(), B)
        weights = self.expert_weights(x_BxTxD.dtype)
        if G == 1:
            return self.dropless_rows(x_BxTxD, r.expert_BxTxK, r.gate_BxTxK, weights)

        def split(a: jax.Array) -> jax.Array:
            return place(a.reshape(G, B // G, *a.shape[1:]), ("batch",) + (None,) * a.ndim)

        # ragged_dot maps over groups only with its weights mapped too: the weights gathered whole (not
        # left to XLA, which replicated and re-split them), then one copy per group, each its device's
        whole = tuple(place(w, (None,) * w.ndim) for w in weights)
        tiled = tuple(place(jnp.broadcast_to(w, (G, *w.shape)), ("batch",) + (None,) * w.ndim) for w in whole)
        y = jax.vmap(self.dropless_rows)(split(x_BxTxD), split(r.expert_BxTxK), split(r.gate_BxTxK), tiled)
        return y.reshape(x_BxTxD.shape)

    def dropless_rows(
        self, x_BxTxD: jax.Array, expert_BxTxK: jax.Array, gate_BxTxK: jax.Array, weights: tuple[jax.Array, ...]
    ) -> jax.Array:
        """Each token's K assignments through their experts' FFNs, weighed by their gates: on a CPU in
        blocks (`expert_blocks`; XLA:CPU computes a ragged_dot as E dense products over all the rows, E
        times the work), elsewhere sorted by expert, one `ragged_dot` group per expert."""
        B, T, D = x_BxTxD.shape
        E, K = self.cfg.n_experts, self.cfg.top_k
        x_SxD, expert_SxK = x_BxTxD.reshape(B * T, D), expert_BxTxK.reshape(B * T, K)
        if jax.default_backend() == "cpu":
            y_SxKxD = expert_blocks(x_SxD, expert_SxK, E, lambda x, w: self.ffn_rows(x, *w), weights)
        else:
            order_M, sizes_E = by_expert(expert_SxK.reshape(-1), E)
            w_in, w_out = weights
            y_MxD = self.ffn_rows(x_SxD[order_M // K], w_in, w_out, lambda x, w: jax.lax.ragged_dot(x, w, sizes_E))
            y_SxKxD = jnp.zeros_like(y_MxD).at[order_M].set(y_MxD).reshape(B * T, K, D)
        return jnp.einsum("BTKD,BTK->BTD", y_SxKxD.reshape(B, T, K, D), gate_BxTxK.astype(x_BxTxD.dtype))

    def ffn_rows(self, x: jax.Array, w_in: jax.Array, w_out: jax.Array, dot: Callable | None = None) -> jax.Array:
        """The experts' FFN on rows `x` with weights `w_in` (gated: [.., D, 2F], gate then up) and
        `w_out`, multiplied by `dot` (a batched matmul over leading axes by default)."""
        F, act = self.cfg.moe_d_ff, ACTIVATIONS[self.cfg.ffn]
        dot = dot or (lambda a, w: jnp.einsum("...bD,...DC->...bC", a, w))
        h = dot(x, w_in)
        h = act(h[..., :F]) * h[..., F:] if self.cfg.gated_ffn else act(h)
        return dot(h, w_out)

    def shared_output(self, x_BxTxD: jax.Array) -> jax.Array:
        """The shared experts' output, times its gate sigmoid(x . w) per token where there is one."""
        assert self.shared is not None
        y_BxTxD = self.shared(x_BxTxD)
        if self.shared_gate is None:
            return y_BxTxD
        logit_BxT = jnp.einsum("BTD,D->BT", x_BxTxD, self.shared_gate[...].astype(x_BxTxD.dtype))
        if self.cfg.parametrization == "mup":  # a readout of d_model to one number, as the router's
            logit_BxT = logit_BxT * output_multiplier(self.cfg)
        return jax.nn.sigmoid(logit_BxT)[..., None] * y_BxTxD

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        """The FFN output. Sows the routing losses and statistics (`layer_` + each of STEP_METRICS,
        each expert's load, the router's entropy): a few scalars, cheap beside the experts."""
        cfg = self.cfg
        r = self.route(x_BxTxD)
        if cfg.capacity_factor is None:
            y_BxTxD, dropped = self.dropless(x_BxTxD, r), jnp.float32(0.0)
        else:
            y_BxTxD, kept_BxTxK = self.with_capacity(x_BxTxD, r)
            dropped = 1.0 - jnp.mean(kept_BxTxK.astype(jnp.float32))
        if self.shared is not None:
            y_BxTxD = y_BxTxD + self.shared_output(x_BxTxD)
        load = load_stats(r, cfg.n_experts)
        load_max = jnp.max(jnp.stack([load[f"expert_load_{e}"] for e in range(cfg.n_experts)]))
        stats = {**routing_losses(r, cfg.n_experts), "dropped_fraction": dropped, "expert_load_max": load_max}
        stats = {f"layer_{k}": v for k, v in stats.items()} | load
        for name, value in stats.items():
            self.sow(nnx.Intermediate, name, value)
        return y_BxTxD
