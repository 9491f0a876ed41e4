"""The fused CPU attention kernel (model/flash_cpu.cc): values and gradients equal the einsum
reference over masks, windows, GQA ratios, value widths and lengths that cross its query and key
blocks; each row's result is independent of the batch it is computed in, bit for bit; the model
uses it where it applies and says so, and where it cannot be built it says why."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import reference_mask

from transformer import accelerator
from transformer.config import Config, DataConfig, ModelConfig
from transformer.model import flash_cpu
from transformer.model.attention import attend_einsum
from transformer.model.flash import Mask, attend_blocked

built, why_not = flash_cpu.kernel_status()
pytestmark = pytest.mark.skipif(
    not built and shutil.which("c++") is None and shutil.which("g++") is None,
    reason=f"no C++ compiler here: {why_not}",
)
# 150 positions: three query blocks of the kernel (64 rows, the last short), two key blocks (128)
T = 150


def test_the_kernel_builds_here():
    """A machine with a C++ compiler (CI's) builds and loads it: the model would silently fall back
    to XLA's blocks otherwise."""
    assert built, why_not


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 40, 200])
@pytest.mark.parametrize(("K", "G", "H", "Hv"), [(4, 1, 16, 16), (2, 2, 32, 32), (1, 4, 16, 16), (2, 1, 48, 32)])
def test_values_and_gradients_equal_einsum_reference(causal, window, K, G, H, Hv):
    """Hv != H is MLA's case: values narrower than queries and keys."""
    cfg = ModelConfig(d_model=K * G * H, n_heads=K * G, n_kv_heads=K)
    kq, kk, kv, kc = jax.random.split(jax.random.key(K + 10 * (window or 0) + causal + H), 4)
    q = jax.random.normal(kq, (2, T, K, G, H))
    k, v = jax.random.normal(kk, (2, T, K, H)), jax.random.normal(kv, (2, T, K, Hv))
    cotangent = jax.random.normal(kc, (2, T, K, G, Hv))
    mask = Mask(causal, window)

    def fused(q, k, v):
        return jnp.sum(flash_cpu.attention(q, k, v, cfg.scale, mask) * cotangent)

    def einsum(q, k, v):
        return jnp.sum(attend_einsum(q, k, v, reference_mask(*mask, T), None, cfg, None) * cotangent)

    got = jax.jit(jax.value_and_grad(fused, argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(einsum, argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("K", "G"), [(2, 2), (1, 4)])
def test_a_row_computes_the_same_in_any_batch(K, G):
    """Rows are the kernel's items (no sum runs across them, whatever the threads do): row 1 of a
    batch of four equals that row alone, output and gradients, bit for bit. With MQA (K=1) on two
    threads the row alone is one kv head, which the backward pass splits by query head, the batch
    of four not: the key and value gradients' sums over query heads are the same either way."""
    kq, kk, kv, kc = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(kq, (4, T, K, G, 16))
    k, v = jax.random.normal(kk, (4, T, K, 16)), jax.random.normal(kv, (4, T, K, 16))
    cotangent = jax.random.normal(kc, q.shape)
    mask = Mask(causal=True, window=None)

    @jax.jit
    def run(q, k, v, c):
        out, vjp = jax.vjp(lambda q, k, v: flash_cpu.attention(q, k, v, 0.25, mask), q, k, v)
        return (out, *vjp(c))

    whole = run(q, k, v, cotangent)
    alone = run(q[1:2], k[1:2], v[1:2], cotangent[1:2])
    for got, want in zip(alone, whole, strict=True):
        np.testing.assert_array_equal(got[0], want[1])


def test_the_model_attention_uses_it_where_it_applies():
    """`attend_blocked` (the model's blocked attention) calls the kernel for float32 heads of a
    multiple of its vectors, and XLA's blocks for bfloat16 and for heads it cannot take."""
    width = flash_cpu._library()[0]

    def call(H, dtype):
        q = jnp.zeros((2, 32, 2, 1, H), dtype)
        k = jnp.zeros((2, 32, 2, H), dtype)
        return jax.jit(lambda q, k: attend_blocked(q, k, k, 0.5, Mask(True, None))).lower(q, k).as_text()

    assert flash_cpu.FORWARD in call(width, jnp.float32)
    assert flash_cpu.FORWARD not in call(width, jnp.bfloat16)
    assert flash_cpu.FORWARD not in call(width + 4, jnp.float32)


@pytest.mark.parametrize(
    ("model", "words"),
    [
        (dict(d_model=64, n_heads=4), "fused kernel"),  # head_dim 16
        (dict(d_model=64, n_heads=4, dtype="bfloat16"), "computes float32, not bfloat16"),
        (dict(d_model=40, n_heads=4), "head width 10 is not a multiple"),
    ],
)
def test_the_start_up_line_names_what_computes_the_attention(model, words):
    cfg = Config(model=ModelConfig(attention_impl="auto", **model), data=DataConfig(seq_len=32))
    impl, why = accelerator.choose_attention(cfg, "cpu")
    assert impl == "blocked"
    assert words in why, why


def test_a_compiler_that_fails_is_named_and_nothing_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", shutil.which("false") or "false")
    monkeypatch.setenv("TRANSFORMER_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(flash_cpu.Unavailable, match="false"):
        flash_cpu._build()
    assert list(tmp_path.iterdir()) == []


def test_a_built_kernel_is_taken_from_the_cache(monkeypatch):
    """The library `kernel_status` built is found again by its name (source, jaxlib, compiler, CPU): a
    second process does not compile it again."""
    path = flash_cpu._build()
    monkeypatch.setattr(flash_cpu, "_compile", lambda *a: pytest.fail("compiled again"))
    assert flash_cpu._build() == path


MESH_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding
from transformer import sharding
from transformer.model import flash_cpu, placing
from transformer.model.flash import Mask, attend_blocked

q_axes, kv_axes = ("batch", None, "kv_heads", None, None), ("batch", None, "kv_heads", None)
kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
q, c = jax.random.normal(kq, (8, 150, 4, 2, 16)), jax.random.normal(kc, (8, 150, 4, 2, 16))
k, v = jax.random.normal(kk, (8, 150, 4, 16)), jax.random.normal(kv, (8, 150, 4, 16))
results = []
for shape in json.loads(sys.argv[1]):
    sizes = [shape.get(a, 1) for a in sharding.MESH_AXES]
    n = int(np.prod(sizes))
    mesh = jax.make_mesh(sizes, sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 4, devices=jax.devices()[:n])
    put = lambda x, axes: jax.device_put(x, NamedSharding(mesh, sharding.spec(axes, x.shape, mesh)))

    def attend(q, k, v):
        with placing(sharding.activation_placer(mesh)):
            return attend_blocked(q, k, v, 0.25, Mask(causal=True, window=None))

    @jax.jit
    def step(q, k, v, c):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(c))

    args = (put(q, q_axes), put(k, kv_axes), put(v, kv_axes), put(c, q_axes))
    hlo = step.lower(*args).compile().as_text()
    results.append({
        "fused": flash_cpu.FORWARD in hlo and flash_cpu.BACKWARD in hlo,
        "gathers": hlo.count("all-gather"),
        "arrays": [np.asarray(a).tolist() for a in step(*args)],
    })
print(json.dumps(results))
"""


@pytest.mark.slow
def test_every_mesh_computes_the_same_attention_bit_for_bit():
    """Sharded over rows (data, fsdp, expert) and kv heads (tensor), each device runs the kernel on
    its own block: the output and gradients are those of one device bit for bit, and nothing is
    gathered (XLA would otherwise compute the custom call whole on every device)."""
    import json
    import os
    import subprocess
    import sys

    meshes = [{}, {"data": 8}, {"data": 2, "tensor": 4}, {"data": 2, "fsdp": 2, "tensor": 2}, {"expert": 2, "fsdp": 4}]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT, json.dumps(meshes)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    reference = results[0]["arrays"]
    for mesh, r in zip(meshes, results, strict=True):
        assert r["fused"], mesh
        assert r["gathers"] == 0, mesh
        for got, want in zip(r["arrays"], reference, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(mesh))
