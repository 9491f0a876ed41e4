"""What a config costs before it runs: the train step compiled ahead of time, for the local devices or
a TPU topology, and what one device holds while it runs (from XLA's own buffer assignment).

`train.py CONFIG --preflight [--topology v5e-16]` prints `Plan.report()`; a real run logs
`Plan.line()` at start-up and runs the very executable measured. An out-of-memory, whether the plan
or XLA says so, becomes an `OutOfMemory`: one line with the figures and the knobs that reduce them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np

from transformer import limits, sharding
from transformer.accelerator import resolve
from transformer.config import Config, ConfigError
from transformer.data import row_lengths, row_tokens
from transformer.errors import EXIT_USAGE, first_line
from transformer.model import count_params, flops_per_token
from transformer.train.trainer import Trainer, TrainState, default_controls

MEMORY_KNOBS = (
    "model.remat=full (or dots), a smaller train.batch_size or data.seq_len, a larger train.grad_accum, "
    "mesh.fsdp > 1 (parameters and optimiser state sharded)"
)


class OutOfMemory(Exception):
    """The train step cannot fit a device: at compile time or in the plan (a config that does not
    fit: EXIT_USAGE), or while running (EXIT_FAILED). The message is one line."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# --- where it compiles for ---------------------------------------------------------------------

# HBM per chip (data sheets) and the chip grids libtpu names. Names count chips (v5e, v6e) or
# TensorCores, two per chip (v4, v5p), as Cloud TPU names do: v5e-16 is 16 chips, v5p-128 is 64.
TPU_HBM = {"v4": 32 * 2**30, "v5e": 16 * 2**30, "v5p": 95 * 2**30, "v6e": 32 * 2**30}
CORES_PER_CHIP = {"v4": 2, "v5e": 1, "v5p": 2, "v6e": 1}
ACCELERATOR_TYPES = {"v4": "v4", "v5e": "v5litepod", "v5p": "v5p", "v6e": "v6e"}  # Cloud TPU's names
GRIDS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
GRIDS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8", 512: "8x8x8"}


@dataclasses.dataclass(frozen=True)
class Target:
    """The devices a step is compiled for and how much one of them holds."""

    devices: list
    capacity: int  # bytes one device can hold
    where: str  # what `capacity` is, for messages
    name: str  # 'the local devices' or the topology

    @property
    def platform(self) -> str:
        return self.devices[0].platform


def local_target() -> Target:
    capacity, where = limits.device_memory()
    return Target(jax.devices(), capacity, where, f"{jax.device_count()} local {jax.devices()[0].platform} device(s)")


def tpu_topology(name: str) -> tuple[str, str, int]:
    """(generation, libtpu's topology name, chips) of `v5e-16`, `v5p-128`, `v4-8` or `v5e:4x4`."""
    match = re.fullmatch(r"(v4|v5e|v5p|v6e)(?:-(\d+)|:(\d+(?:x\d+){1,2}))", name)
    if match is None:
        raise ConfigError("--topology", f"{name!r} is not a TPU topology such as v5e-16, v5p-128, v4-8 or v5e:4x4")
    generation, count, grid = match.groups()
    if grid is not None:
        return generation, f"{generation}:{grid}", math.prod(int(d) for d in grid.split("x"))
    chips = int(count) // CORES_PER_CHIP[generation]
    grids = GRIDS_2D if generation in ("v5e", "v6e") else GRIDS_3D
    if chips not in grids:
        sizes = ", ".join(f"{generation}-{c * CORES_PER_CHIP[generation]}" for c in grids)
        raise ConfigError("--topology", f"no {name} slice; one of {sizes}")
    return generation, f"{generation}:{grids[chips]}", chips


def libtpu_path() -> str | None:
    """The libtpu library the compile-only backend needs: $TPU_LIBRARY_PATH, or the libtpu package."""
    if os.environ.get("TPU_LIBRARY_PATH"):
        return os.environ["TPU_LIBRARY_PATH"]
    try:
        import libtpu  # optional: pip install libtpu
    except ImportError:
        return None
    return str(Path(libtpu.__file__).parent / "libtpu.so")


def topology_target(name: str) -> Target:
    """Compile-only devices of a TPU slice, from this (CPU-only) machine, as MaxText's train_compile."""
    generation, topology, chips = tpu_topology(name)
    path = libtpu_path()
    if path is None:
        raise ConfigError("--topology", "needs libtpu's compile-only backend: pip install libtpu (or TPU_LIBRARY_PATH)")
    os.environ["TPU_LIBRARY_PATH"] = path
    # no TPU here: keep libtpu from looking for one (metadata server, worker hostnames)
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # nor from claiming the chips: a second preflight at the same time would find them taken
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault(
        "TPU_ACCELERATOR_TYPE", f"{ACCELERATOR_TYPES[generation]}-{chips * CORES_PER_CHIP[generation]}"
    )
    from jax.experimental import topologies

    try:
        devices: list = topologies.get_topology_desc(topology, "tpu").devices
    except Exception as e:  # libtpu's refusal, whatever its type, is the answer
        raise ConfigError("--topology", f"libtpu cannot describe {topology}: {first_line(e)}") from None
    hbm = TPU_HBM[generation] * chips // len(devices)
    return Target(devices, hbm, f"HBM per {devices[0].device_kind} device (data sheet)", f"{name} ({topology})")


# --- compiling and measuring -------------------------------------------------------------------


def vocab_size(cfg: Config) -> int:
    """The run's vocabulary without preparing its data: the byte tokenizer's, a BPE's target size,
    a pretrained tokenizer's own; plus the ids the objective adds (a mask token, sentinels)."""
    from transformer.data import TokenizerError, extra_ids, load_pretrained, make_objective

    if cfg.data.tokenizer.startswith("pretrained:"):  # its own mask token, if it has one, is the objective's
        try:
            return make_objective(cfg.data, load_pretrained(cfg.data.tokenizer.partition(":")[2])).vocab.size
        except TokenizerError as e:
            raise ConfigError("", str(e)) from None
    return _tokenizer_vocab(cfg) + extra_ids(cfg.data)


def _tokenizer_vocab(cfg: Config) -> int:
    """The byte tokenizer's ids, or the BPE's target size (a pretrained tokenizer is read whole)."""
    from transformer.data import ByteTokenizer

    return ByteTokenizer.vocab_size if cfg.data.tokenizer == "byte" else cfg.data.vocab_size


def abstract_batch(cfg: Config, mesh: jax.sharding.Mesh, local: dict[str, np.ndarray] | None = None) -> dict:
    """The global batch's shapes, dtypes and sharding: like this process's rows `local` (what the
    data gives), else as the data config makes them."""
    batch_sharding = sharding.batch_sharding(mesh)
    if local is None:
        from transformer.data import example_batch

        local = example_batch(cfg.data)
    B = cfg.train.batch_size
    return {k: jax.ShapeDtypeStruct((B, *v.shape[1:]), v.dtype, sharding=batch_sharding) for k, v in local.items()}


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e)


def compile_step(trainer: Trainer, batch: dict) -> tuple[jax.stages.Compiled, float]:
    """(the train step compiled for `batch`'s shapes, seconds it took); no array is allocated."""
    start = time.perf_counter()
    state = trainer.abstract_state()
    try:
        compiled = trainer.train_step.lower(state, batch, default_controls()).compile()
    except jax.errors.JaxRuntimeError as e:
        if is_out_of_memory(e):
            b = limits.human_bytes
            raise OutOfMemory(
                f"out of memory compiling the train step ({first_line(e)}); per device: parameters "
                f"{b(per_device_bytes(state.params))}, optimiser state {b(per_device_bytes(state.opt_state))}, "
                f"batch {b(per_device_bytes(batch))}; to reduce memory: {MEMORY_KNOBS}",
                EXIT_USAGE,
            ) from None
        raise
    return compiled, time.perf_counter() - start


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded arrays or ShapeDtypeStructs (its shards)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one device holds and does in one train step (bytes, FLOPs), from the compiled step."""

    parameters: int
    optimizer: int  # optimiser state (and the step counter)
    batch: int
    arguments: int  # everything the step takes: parameters, optimiser state, batch, controls
    outputs: int
    aliased: int  # outputs written over donated arguments (the new state over the old)
    temporaries: int  # activations, gradients and everything else live inside the step
    peak: int  # the backend's own peak, where it reports one (else 0)
    flops: float  # XLA's count for one device's program
    scanned: bool  # XLA counts the body of a layer scan that loops (model.scan_layers, scan_unroll) once, not once per iteration
    model_flops: float  # the model's count (transformer.model.summary) per device
    compile_s: float
    capacity: int
    where: str

    @property
    def total(self) -> int:
        return max(self.peak, self.arguments + self.outputs - self.aliased + self.temporaries)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def figures(self) -> dict[str, float]:
        """Bytes per device by part, and FLOPs: the run's `start` event."""
        parts = ("parameters", "optimizer", "batch", "temporaries", "total", "capacity", "flops", "compile_s")
        return {k: getattr(self, k) for k in parts}

    def memory(self) -> str:
        b = limits.human_bytes
        return (
            f"memory per device: parameters {b(self.parameters)}, optimiser state {b(self.optimizer)}, "
            f"batch {b(self.batch)}, activations and temporaries {b(self.temporaries)}; "
            f"total {b(self.total)} of {b(self.capacity)} ({self.where}, {100 * self.total / self.capacity:.1f}%)"
        )

    def compute(self) -> str:
        return (
            f"compute per device and step: {self.flops / 1e12:.3g} TFLOP by XLA's count"
            f"{' (which counts the layer scan once)' if self.scanned else ''}, "
            f"{self.model_flops / 1e12:.3g} TFLOP by the model's; compiled in {self.compile_s:.1f} s"
        )

    def too_large(self, why: str = "") -> str:
        """The one line of a step that does not fit (or ran out of memory: `why`)."""
        cause = f" ({why})" if why else ""
        return f"out of memory{cause}: {self.memory()}; to reduce memory: {MEMORY_KNOBS}"


def measure(
    cfg: Config, trainer: Trainer, compiled: jax.stages.Compiled, batch: dict, seconds: float, target: Target
) -> Plan:
    """The Plan of a compiled train step."""
    memory = compiled.memory_analysis()
    assert memory is not None, "CPU, GPU and TPU compilers all report their buffer assignment"
    state: TrainState = trainer.abstract_state()
    _, flops = work_per_step(cfg)
    return Plan(
        parameters=per_device_bytes(state.params),
        optimizer=per_device_bytes((state.step, state.opt_state)),
        batch=per_device_bytes(batch),
        arguments=memory.argument_size_in_bytes,
        outputs=memory.output_size_in_bytes,
        aliased=memory.alias_size_in_bytes,
        temporaries=memory.temp_size_in_bytes,
        peak=getattr(memory, "peak_memory_in_bytes", 0),
        flops=step_flops(compiled),
        scanned=loops(trainer.cfg),
        model_flops=flops / len(target.devices),
        compile_s=seconds,
        capacity=target.capacity,
        where=target.where,
    )


def step_flops(compiled: jax.stages.Compiled) -> float:
    """XLA's count of one device's FLOPs in a compiled program (NaN where the backend gives none)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # older jax: one dict per program
    return float((cost or {}).get("flops", math.nan))


COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")


def collectives(compiled: jax.stages.Compiled) -> dict[str, int]:
    """How many of each collective one device's compiled program holds (async ones by their start)."""
    text = compiled.as_text() or ""
    return {op: len(re.findall(rf"\b{op}(?:-start)?\(", text)) for op in COLLECTIVES}


def loops(cfg: Config) -> bool:
    """Whether the compiled step keeps the layer scan as a loop (`cfg` resolved for the platform):
    scanned, with fewer layers an iteration than the stack has."""
    m = cfg.model
    return m.scan_layers and (m.scan_unroll or 1) < m.deepest_stack


def work_per_step(cfg: Config) -> tuple[int, float]:
    """(tokens, model FLOPs) of one training step: the tokens of every row (the trained stream's and
    an encoder's), and `flops_per_token` of the trained stream's tokens (an encoder-decoder's figure
    is per target token and includes its encoder's work)."""
    T, S = row_lengths(cfg.data)
    B = cfg.train.batch_size
    per_token = flops_per_token(cfg.model, T) if S is None else flops_per_token(cfg.model, S, T)
    return B * row_tokens((T, S)), per_token * B * T


def rows_text(cfg: Config) -> str:
    """A row's length, '256', or an encoder-decoder's '(input 128 + target 40)'."""
    T, S = row_lengths(cfg.data)
    return str(T) if S is None else f"(input {S} + target {T})"


def start_step(trainer: Trainer, local: dict[str, np.ndarray]) -> tuple[Callable, Plan]:
    """A real run's train step, compiled for batches like `local` (this process's rows), and its
    plan on the local devices; OutOfMemory (EXIT_USAGE) if it cannot fit one. The step is the
    executable measured, unless it returns a state of other types than it takes (optax keeps
    float32 moments of bfloat16 parameters after the first update): then the jitted step, which
    compiles once more for them."""
    batch = abstract_batch(trainer.cfg, trainer.mesh, local)
    compiled, seconds = compile_step(trainer, batch)
    p = measure(trainer.cfg, trainer, compiled, batch, seconds, local_target())
    if not p.fits:
        raise OutOfMemory(p.too_large("the compiled step needs more than a device holds"), EXIT_USAGE)
    same = jax.tree.map(
        lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype), trainer.abstract_state(), compiled.out_info[0]
    )
    return (compiled if all(jax.tree.leaves(same)) else trainer.train_step), p


@contextlib.contextmanager
def _no_compilation_cache() -> Iterator[None]:
    """Compile without the persistent compilation cache: a compile-only client cannot load an
    executable from it (jax warns and compiles again), and nothing compiled for an absent slice is
    worth keeping. jax decides once per process whether the cache is used, hence the resets."""
    from jax.experimental.compilation_cache import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache  # type: ignore[attr-defined]  # a flag jax defines at runtime
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


def plan(cfg: Config, target: Target) -> Plan:
    """Compile `cfg`'s train step (its vocabulary resolved: `vocab_size`) for `target` from abstract
    shapes (nothing is allocated) and measure it."""
    cfg = resolve(cfg, target.platform)
    local = target.platform == jax.default_backend()
    if local:  # what this backend cannot run at all (cudnn on CPU, ...)
        limits.check_attention_support(cfg.model)
    mesh = sharding.make_mesh(cfg, target.devices)
    trainer = Trainer(cfg, mesh)
    batch = abstract_batch(cfg, mesh)
    if local:
        compiled, seconds = compile_step(trainer, batch)
    else:
        with _no_compilation_cache():
            compiled, seconds = compile_step(trainer, batch)
    return measure(cfg, trainer, compiled, batch, seconds, target)


def report(cfg: Config, target: Target, plan: Plan) -> str:
    """The lines `--preflight` prints."""
    return "\n".join(
        [
            f"preflight: {count_params(cfg.model):,} parameters, batch {cfg.train.batch_size} x "
            f"{rows_text(cfg)} tokens, on {target.name}",
            plan.memory(),
            plan.compute(),
        ]
    )


def run_preflight(cfg: Config, topology: str | None, log=print) -> int:
    """`train.py --preflight`: report the plan; EXIT_USAGE (one line raised) when it cannot fit."""
    target = local_target() if topology is None else topology_target(topology)
    cfg = cfg.with_vocab(vocab_size(cfg))
    p = plan(cfg, target)
    log(report(cfg, target, p))
    if not p.fits:
        raise OutOfMemory(p.too_large("the compiled step needs more than a device holds"), EXIT_USAGE)
    return 0
