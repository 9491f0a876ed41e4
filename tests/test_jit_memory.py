"""The test suite's guard against running out of memory mappings (tests/conftest.py,
`_bounded_jit_memory`) rests on two facts about XLA:CPU that a jax upgrade could change: each
compiled program holds memory mappings of its own, and `jax.clear_caches` gives them back."""

import json
import subprocess
import sys

import pytest
from conftest import memory_maps

# In a fresh process: in a test worker, freed JIT memory is mapped again for new programs, and
# the count stands still.
PROGRAM = """
import gc, json, time
import jax, jax.numpy as jnp

def maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)

def chain(x, salt):
    for k in range(12):  # a dozen fusions, each a kernel of its own
        x = jnp.tanh(x @ x + k * salt) * (x.sum(0) + k)
    return x.sum()

x = jnp.ones((16, 16))
salt = time.time_ns() % 1_000_003  # programs no cache has seen
before = maps()
alive = [jax.jit(jax.grad(lambda x, i=i: chain(x, salt + i))) for i in range(4)]  # as a module's are
for f in alive:
    f(x).block_until_ready()
held = maps() - before
jax.clear_caches()
gc.collect()  # a traced function's closures and its executable can keep each other alive
print(json.dumps({"held": held, "left": maps() - before}))
"""


def test_compiled_programs_hold_memory_maps_until_jax_clears_its_caches():
    if not memory_maps():
        pytest.skip("no /proc/self/maps on this system")
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    counts = json.loads(out.stdout.splitlines()[-1])
    assert counts["held"] > 100, counts
    assert counts["left"] < counts["held"] / 10, counts
