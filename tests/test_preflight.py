"""`--preflight`: the compiled step's memory and FLOPs, refusals in one line, out-of-memory handling."""

import json
import os
import subprocess
import sys

import jax
import pytest
from conftest import ROOT, tiny_run_overrides, write_corpus

from transformer import cli, limits, sharding
from transformer.config_loader import load_config
from transformer.errors import EXIT_FAILED, EXIT_USAGE
from transformer.model.summary import count_params
from transformer.train import preflight
from transformer.train.loop import TrainLoop
from transformer.train.trainer import Trainer, default_controls

TINY = [
    "model.d_model=32",
    "model.n_heads=2",
    "model.n_kv_heads=2",
    "model.ffn_multiple=16",
    "data.seq_len=32",
    "train.batch_size=4",
]


def _plan(*overrides: str) -> preflight.Plan:
    cfg = load_config(None, [*TINY, *overrides])
    return preflight.plan(cfg.with_vocab(preflight.vocab_size(cfg)), preflight.local_target())


def test_figures_are_the_compiled_steps():
    """Against an independent compile of the same step: XLA's figures; the state's by counting."""
    p = _plan("model.n_layers=2")
    cfg = load_config(None, [*TINY, "model.n_layers=2"]).with_vocab(259)
    trainer = Trainer(cfg, sharding.make_mesh(cfg, jax.devices()[:1]))
    batch = preflight.abstract_batch(cfg, trainer.mesh)
    memory = trainer.train_step.lower(trainer.abstract_state(), batch, default_controls()).compile().memory_analysis()
    assert p.temporaries == memory.temp_size_in_bytes
    assert p.arguments == memory.argument_size_in_bytes
    assert p.total == max(memory.peak_memory_in_bytes, p.arguments + p.outputs - p.aliased + p.temporaries)
    assert p.parameters == 4 * count_params(cfg.model)  # float32, one device
    assert 2 * p.parameters <= p.optimizer <= 2 * p.parameters + 64  # AdamW's two moments and counters
    assert p.batch == 2 * 4 * 32 * 4  # inputs and targets, int32
    assert p.parameters + p.optimizer + p.batch <= p.arguments


def test_activations_grow_with_batch_and_shrink_with_remat():
    base = _plan("model.n_layers=4", "train.batch_size=4")
    double = _plan("model.n_layers=4", "train.batch_size=8")
    remat = _plan("model.n_layers=4", "train.batch_size=4", "model.remat=full")
    assert 1.6 * base.temporaries < double.temporaries < 2.4 * base.temporaries
    assert double.parameters == base.parameters
    assert remat.temporaries < 0.7 * base.temporaries
    assert base.flops > 0 and base.model_flops > 0


def _one_line(capsys, code: int, *words: str) -> None:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0]
    assert code == EXIT_USAGE


def test_preflight_prints_the_plan(capsys):
    assert cli.train_main(["--preflight", *TINY, "model.n_layers=1"]) == 0
    out = capsys.readouterr().out
    assert "memory per device: parameters" in out and "TFLOP" in out and "compiled in" in out


def test_impossible_config_exits_2_in_one_line(capsys):
    # a mesh this machine cannot form: found only when the step is planned
    _one_line(capsys, cli.train_main(["--preflight", *TINY, "mesh.tensor=2", "mesh.data=4"]), "mesh")
    _one_line(capsys, cli.train_main(["--preflight", *TINY, "--topology", "v5e-12"]), "--topology", "v5e-16")


def test_a_step_larger_than_the_device_exits_2_with_figures_and_knobs(capsys, monkeypatch):
    monkeypatch.setattr(limits, "device_memory", lambda: (100_000, "a 100 kB test device"))
    code = cli.train_main(["--preflight", *TINY, "model.n_layers=1"])
    _one_line(capsys, code, "out of memory", "activations and temporaries", "100 kB", "model.remat", "grad_accum")


def test_out_of_memory_while_running_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    """XLA's RESOURCE_EXHAUSTED from a step becomes the plan's figures and the knobs."""

    def exhausted(self):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.")

    monkeypatch.setattr(TrainLoop, "train_one", exhausted)
    corpus = write_corpus(tmp_path / "docs.jsonl", seed=0, n=40)
    overrides = tiny_run_overrides(corpus, tmp_path / "cache", "model.n_layers=1", "train.steps=2")
    code = cli.train_main([*overrides, "--workdir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == EXIT_FAILED
    errors = [line for line in err.splitlines() if line.startswith("train.py")]  # past tokenising's progress
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "allocate 1.00GiB" in errors[0] and "memory per device: parameters" in errors[0]
    assert "mesh.fsdp" in errors[0]


# .ci/run installs libtpu beside the environment (in it, every JAX program would look for a TPU)
LIBTPU = preflight.libtpu_path() or next((str(p) for p in [ROOT / ".ci/libtpu/libtpu/libtpu.so"] if p.exists()), None)


@pytest.fixture
def with_libtpu():
    """Runs Python code with libtpu's compile-only backend in a process of its own and returns the
    JSON its last line prints. Never in a test worker: libtpu, once loaded, stays for every later
    test there (its own signal handlers, threads and SIGPROF timers with it); its environment
    variables would also make every JAX subprocess a later test starts look for a TPU."""
    if LIBTPU is None:
        pytest.skip("libtpu (the TPU compile-only backend) not installed: .ci/run puts it in .ci/libtpu")

    def run(code: str) -> dict:
        env = {**os.environ, "TPU_LIBRARY_PATH": LIBTPU, "JAX_PLATFORMS": "cpu"}
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-4000:]
        # the last JSON line: libtpu may write to stdout as well (at exit too)
        return json.loads(next(line for line in reversed(result.stdout.splitlines()) if line.startswith("{")))

    return run


@pytest.mark.slow
def test_compiles_for_a_tpu_topology(with_libtpu):
    args = ["--preflight", *TINY, "model.n_layers=1", "--topology", "v5e-4", "mesh.fsdp=2"]
    # twice: had the first been written to the suite's persistent compilation cache, the second
    # would find it there, fail to load it on the compile-only client and warn
    seen = with_libtpu(f"""
import contextlib, io, json, warnings
from transformer import cli
out = io.StringIO()
with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out):
    warnings.simplefilter("always")
    codes = [cli.train_main({args!r}), cli.train_main({args!r})]
print(json.dumps(dict(codes=codes, out=out.getvalue(), warnings=[str(w.message) for w in caught])))
""")
    assert seen["codes"] == [0, 0]
    assert "v5e:2x2" in seen["out"] and "HBM per TPU v5 lite device" in seen["out"]
    assert not [w for w in seen["warnings"] if "compilation cache" in w]


@pytest.mark.slow
def test_fsdp_shards_the_state_on_a_tpu_topology(with_libtpu):
    """Each of the slice's 4 devices holds a quarter of the parameters and optimiser state."""
    seen = with_libtpu(f"""
import json
from transformer.config_loader import load_config
from transformer.model.summary import count_params
from transformer.train import preflight
target = preflight.topology_target("v5e-4")
cfgs = [load_config(None, [*{TINY!r}, "model.n_layers=2", f"mesh.fsdp={{n}}"]).with_vocab(259) for n in (1, 4)]
plans = [preflight.plan(cfg, target) for cfg in cfgs]
print(json.dumps(dict(count=count_params(cfgs[0].model), parameters=[p.parameters for p in plans],
                      optimizer=[p.optimizer for p in plans])))
""")
    (whole, sharded), (whole_opt, sharded_opt) = seen["parameters"], seen["optimizer"]
    assert whole == 4 * seen["count"]  # float32
    assert sharded == whole // 4
    assert sharded_opt <= whole_opt // 4 + 64  # the step counter is not sharded


def test_topology_without_libtpu_says_what_is_missing(capsys, monkeypatch):
    monkeypatch.setattr(preflight, "libtpu_path", lambda: None)
    _one_line(capsys, cli.train_main(["--preflight", *TINY, "--topology", "v5e-4"]), "pip install libtpu")


def test_a_sweep_preflights_every_member(tmp_path, capsys, monkeypatch):
    import yaml

    sweep = {
        "base": str(ROOT / "configs" / "default.yaml"),
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2},
        "data": {"seq_len": 32},
        "train": {"batch_size": 4},
        "sweep": {"grid": {"train.batch_size": [4, 8]}},
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    monkeypatch.chdir(tmp_path)
    assert cli.train_main([str(tmp_path / "sweep.yaml"), "--preflight"]) == 0
    out = capsys.readouterr().out
    temporaries = [line for line in out.splitlines() if "memory per device" in line]
    assert len(temporaries) == 2 and temporaries[0] != temporaries[1]
    assert not list(tmp_path.glob("runs"))  # nothing was run


@pytest.mark.slow
def test_train_py_preflight_refuses_an_impossible_mesh_in_one_line():
    args = [sys.executable, "train.py", "--preflight", *TINY, "mesh.tensor=2", "mesh.data=4"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == EXIT_USAGE
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "mesh" in result.stderr and "devices" in result.stderr
