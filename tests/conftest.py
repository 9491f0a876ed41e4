import gc
import itertools
import json
import os
import re
import tempfile
import threading
from pathlib import Path

from xla_cache import machine_key

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache for the whole suite, subprocesses included (they inherit the
# environment): the many runs that train the same tiny configs then compile each program once. One
# per kind of machine: a /tmp kept across machines held executables for another CPU. (A size limit
# would make jax lock it, but then every write scans the whole directory: the suite slowed ~4x.)
# Without one, jax writes an entry in place, unlocked: two processes finishing the same program at
# once can tear it.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"transformer-tests-xla-cache-{machine_key()}")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer import rundir
from transformer.config import ModelConfig
from transformer.model import Transformer
from transformer.model.attention import attention_mask

jax.config.update("jax_default_matmul_precision", "highest")

# The attention variants every model-level property is checked over.
ATTENTION_VARIANTS = {
    "mha": dict(n_kv_heads=4),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "window": dict(n_kv_heads=2, window=3),
    "pattern": dict(window=3, attention_pattern=("local", "global")),
}
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "none")
NORM_POSITIONS = ("pre", "post", "sandwich", "deepnorm")


def tiny(**overrides) -> ModelConfig:
    """A model small enough to compile in about a second on a 2-core CPU."""
    kw = dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=16, vocab_size=61, vocab_multiple=16, ffn_multiple=16)
    kw.update(overrides)
    return ModelConfig(**kw)


def all_pairs(*factors: tuple) -> list[tuple]:
    """Rows such that every value of every factor meets every value of every other factor in some
    row (a greedy covering array): 5 x 5 x 4 x 2 values in ~25 rows instead of 200. Interactions of
    three switches at once are left to the targeted tests."""
    index_pairs = list(itertools.combinations(range(len(factors)), 2))
    uncovered = {(x, y, a, b) for x, y in index_pairs for a in factors[x] for b in factors[y]}
    candidates = list(itertools.product(*factors))
    rows = []
    while uncovered:
        row = max(candidates, key=lambda r: sum((x, y, r[x], r[y]) in uncovered for x, y in index_pairs))
        rows.append(row)
        uncovered -= {(x, y, row[x], row[y]) for x, y in index_pairs}
    return rows


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    return Transformer(cfg, rngs=nnx.Rngs(seed))


def reference_mask(causal: bool, window: int | None, T: int) -> jax.Array:
    """[1, T, T] booleans of a static attention mask written independently of flash.Mask: the
    causal helper, or |t - s| < window."""
    if causal:
        return attention_mask(jnp.arange(T), jnp.arange(T), window)
    t, s = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    allowed = jnp.ones((T, T), bool) if window is None else jnp.abs(t - s) < window
    return allowed[None]


def compiled_dots(hlo: str) -> tuple[int, int]:
    """(dots inside YNNPACK fusions, dots elsewhere: XLA's own) of a compiled program's text."""
    bodies = dict(re.findall(r"^(%[\w.\-]+) .*?\{\n(.*?)\n\}", hlo, re.S | re.M))
    ynn = sum(
        bodies[name].count(" dot(") for name in re.findall(r"calls=(%[\w.\-]+), [^\n]*\"kind\":\"__ynn_fusion\"", hlo)
    )
    return ynn, hlo.count(" dot(") - ynn


def memory_maps() -> int:
    """How many memory mappings this process holds (0 where /proc is not there to say)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _max_map_count() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 0


# XLA:CPU maps three pages (code, constants, data) for each kernel it JIT-compiles, ~260 mappings
# for a small training step, and keeps them while jax's caches hold the executable. A test worker
# compiles thousands of programs: late in the suite it neared the kernel's vm.max_map_count (65,530
# by default; 64,561 measured), where the next mmap fails and XLA, failing mid-compile, aborts or
# segfaults in the unwinder: the worker crashes that refused CI runs. Past a third of the limit
# (leaving the rest for a single test), jax's caches are emptied; what a fixture still holds stays,
# and the next emptying waits until another sixth of the limit has been mapped.
_MAPS_LIMIT = _max_map_count()
_maps_ceiling = _MAPS_LIMIT // 3


@pytest.fixture(autouse=True)
def _bounded_jit_memory():
    global _maps_ceiling
    yield
    if _MAPS_LIMIT and memory_maps() > _maps_ceiling:
        jax.clear_caches()
        gc.collect()  # a traced function's closures and its executable can keep each other alive
        _maps_ceiling = max(_MAPS_LIMIT // 3, memory_maps() + _MAPS_LIMIT // 6)


@pytest.fixture(scope="session")
def private_hf_cache(tmp_path_factory):
    """Hugging Face datasets' cache in a temporary directory, its progress bars off (data tests)."""
    import datasets

    datasets.disable_progress_bars()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf-datasets"))
        yield


@pytest.fixture
def key():
    return jax.random.key(0)


ROOT = Path(__file__).resolve().parent.parent
WORDS = "the of and to in is was for on that with as by at from his her it an were are which this be or had not".split()


def within(seconds: float, call):
    """What `call` raised (or returned), failing the test when it runs longer than `seconds`
    (a call that waits or blocks for good)."""
    outcome = []

    def target():
        try:
            outcome.append(call())
        except Exception as e:
            outcome.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still waiting after {seconds} s"
    return outcome[0]


def write_corpus(path: Path, seed: int, n: int = 300) -> Path:
    """A small JSONL corpus of random-word documents that tokenises in a second."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"doc {i}: " + " ".join(rng.choice(WORDS, rng.integers(20, 80)))}) + "\n")
    return path


def logged(workdir: Path, key: str) -> dict[int, float]:
    """{step: value} of one metric in a run's metrics; the last record for a step wins (a rollback
    logs the abandoned steps first)."""
    return rundir.metric_series(workdir).get(key, {})


read_events = rundir.read_events


def final_params(workdir: Path, step: int | None = None) -> list:
    """The leaves of a run's parameters at its latest (or given) checkpoint."""
    from transformer.io.checkpoint import load

    _, model = load(workdir, step)
    return jax.tree.leaves(nnx.to_pure_dict(nnx.state(model)))


def assert_bitwise_equal(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def tiny_run_overrides(corpus: Path, cache: Path, *extra: str) -> list[str]:
    """Overrides for a 2-layer, 32-wide model on a small JSONL corpus, logging every step to files
    only: the run the trainer, checkpoint and monitor tests train (each adds its own `extra`). The
    default run's downstream task is off: these runs compare train.py's subprocess runs with runs of
    `job.run` (which scores tasks only when given an evaluator), and the task means nothing on
    this corpus (tests/test_harness.py runs it)."""
    return [
        "train.eval_tasks=[]",
        f"data.source=files:{corpus}",
        f"data.cache_dir={cache}",
        "data.seq_len=32",
        "data.val_windows=8",
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.ffn_multiple=16",
        "train.batch_size=8",
        "logging.every=1",
        "logging.progress=false",
        "logging.tensorboard=false",
        *extra,
    ]


# A finished tiny sweep (Pre-LN and Post-LN over two learning rates) shared by the sweep, report and
# notebook tests: it takes about a minute to run, so it runs once per session. Tests that use it
# are grouped onto one xdist worker (`@pytest.mark.xdist_group("sweep")`, `--dist loadgroup`).
TINY_SWEEP = {
    "base": str(ROOT / "configs" / "default.yaml"),
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2},
    "data": {"source": "builtin:recall:train_docs=400,val_docs=40", "seq_len": 64, "val_windows": 4},
    "train": {"steps": 12, "batch_size": 4, "eval_every": 6},
    "optim": {"warmup_steps": 2},
    "checkpoint": {"every": 6, "async": False},
    "monitor": {"stats_every": 6},
    "logging": {"every": 1, "progress": False, "tensorboard": False},
    "sweep": {"grid": {"model.norm_position": ["pre", "post"], "optim.lr": [1e-3, 1e-2]}},
}


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory) -> Path:
    import subprocess
    import sys

    import yaml

    workdir = tmp_path_factory.mktemp("tiny-sweep")
    (workdir / "sweep.yaml").write_text(yaml.safe_dump(TINY_SWEEP))
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            str(workdir / "sweep.yaml"),
            "--workdir",
            str(workdir),
            "--parallel",
            "2",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return workdir
