"""SOAP (train/soap.py): its steps against a float64 numpy implementation of the paper's algorithm
(two-sided and one-sided), each layer's and each fused projection's matrix preconditioned on its
own. Its refusals are tests/test_optimizers.py's, resume bit for bit tests/test_checkpoint.py's,
the agreement across meshes tests/test_trainer.py's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny

from transformer.config import OptimConfig, SoapConfig
from transformer.train.soap import scale_by_soap


def _numpy_soap(grads: list[np.ndarray], cfg: OptimConfig) -> list[np.ndarray]:
    """The steps of Algorithm 3 of Vyas et al. for one matrix, in float64, written from the paper:
    Adam on G rotated by the eigenbases of L and R, the bases made by eigh from the first gradient
    (which takes no step) and refreshed every f steps by a power step and QR, sorted by the old
    basis's eigenvalue estimates, with V permuted alike; a side longer than max_precond_dim stays."""
    b1, b2, eps, f = cfg.b1, cfg.b2, cfg.eps, cfg.soap.precondition_every
    m, n = grads[0].shape
    sides = [m <= cfg.soap.max_precond_dim, n <= cfg.soap.max_precond_dim]
    factors = [np.zeros((m, m)), np.zeros((n, n))]
    bases = [np.eye(m), np.eye(n)]
    mu, nu, steps = np.zeros((m, n)), np.zeros((m, n)), []

    def rot(x, back=False):
        left, right = (bases[0], bases[1].T) if back else (bases[0].T, bases[1])
        return (left if sides[0] else np.eye(m)) @ x @ (right if sides[1] else np.eye(n))

    for t, g in enumerate(g.astype(np.float64) for g in grads):
        if t > 0:
            mu = b1 * mu + (1 - b1) * g
            nu = b2 * nu + (1 - b2) * rot(g) ** 2
            mu_hat, nu_hat = mu / (1 - b1**t), nu / (1 - b2**t)
            steps.append(rot(rot(mu_hat) / (np.sqrt(nu_hat) + eps), back=True))
        else:
            steps.append(np.zeros((m, n)))
        factors = [b2 * factors[0] + (1 - b2) * g @ g.T, b2 * factors[1] + (1 - b2) * g.T @ g]
        for i in (0, 1):
            if not sides[i]:
                continue
            if t == 0:
                bases[i] = np.linalg.eigh(factors[i])[1][:, ::-1]
            elif t % f == 0:
                power = factors[i] @ bases[i]
                order = np.argsort(-np.einsum("ij,ij->j", bases[i], power), kind="stable")
                bases[i] = np.linalg.qr(power[:, order])[0]
                nu = nu[order] if i == 0 else nu[:, order]
    return steps


def _gradients(shape: tuple[int, ...], steps: int) -> list[np.ndarray]:
    """A fixed direction plus noise, so the factors have well-separated eigenvalues."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal(shape)
    return [(base + 0.5 * rng.standard_normal(shape)).astype(np.float32) for _ in range(steps)]


def _our_steps(name: str, grads: list[np.ndarray], cfg: OptimConfig, model=None) -> list[np.ndarray]:
    tx = scale_by_soap(cfg, model or tiny())
    state = tx.init({name: jnp.zeros(grads[0].shape)})
    update = jax.jit(tx.update)
    out = []
    for g in grads:
        step, state = update({name: jnp.asarray(g)}, state)
        out.append(np.asarray(step[name]))
    return out


@pytest.mark.parametrize(
    "shape,max_dim",
    [((5, 5), 10000), ((4, 7), 6), ((7, 4), 6)],
    ids=["two-sided", "left-only", "right-only"],
)
def test_soap_steps_equal_float64_numpy(shape, max_dim):
    """25 steps with a refresh every 3: the first takes none, the bases rotate, V follows them.
    (Square for two sides: a rank-deficient first factor leaves its null space's basis arbitrary.)"""
    cfg = OptimConfig(name="soap", b1=0.95, b2=0.95, soap=SoapConfig(precondition_every=3, max_precond_dim=max_dim))
    grads = _gradients(shape, 25)
    ours = _our_steps("w_out", [g[None] for g in grads], cfg)  # one layer of a stacked [L, F, D] parameter
    for t, (got, want) in enumerate(zip(ours, _numpy_soap(grads, cfg))):
        np.testing.assert_allclose(got[0], want, rtol=2e-3, atol=2e-4, err_msg=f"step {t}")
    assert not np.any(ours[0]) and np.all(np.isfinite(ours[-1]))


def test_each_layer_and_each_fused_projection_is_preconditioned_alone():
    """SOAP on a stacked, fused [L, D, K, G+2, H] projection equals SOAP on each layer's q (its G
    heads together), k and v matrices run apart."""
    model = tiny(n_heads=4, n_kv_heads=2)  # G = 2
    cfg = OptimConfig(name="soap", soap=SoapConfig(precondition_every=2))
    L, D, K, G, H = 2, model.d_model, 2, 2, model.head_dim
    grads = _gradients((L, D, K, G + 2, H), 6)
    fused = _our_steps("qkv", grads, cfg, model)
    for lo, hi in ((0, G), (G, G + 1), (G + 1, G + 2)):
        for layer in range(L):
            piece = [g[layer : layer + 1, :, :, lo:hi].reshape(1, D, K * (hi - lo), H) for g in grads]
            alone = _our_steps("wq", piece, cfg, model)  # "D,NH": one [D, K*(hi-lo)*H] matrix
            for got, want in zip(fused, alone):
                np.testing.assert_allclose(
                    got[layer, :, :, lo:hi].reshape(want[0].shape), want[0], rtol=1e-5, atol=1e-6
                )
