"""Devices: the mesh, and the one table that maps logical axis names to mesh axes.

Model code only names axes (`embed`, `heads`, ...). This module alone decides where they live:
the batch is split over `data`, `fsdp` and `expert`, `fsdp` also shards parameters and optimiser state
along `embed`, `tensor` shards heads and the FFN width (Megatron-style), and `expert` shards the
experts of a mixture-of-experts FFN: expert parallelism (GShard). Outside the MoE layers the expert
axis is one more data-parallel axis; in them, the tokens routed to the experts are re-split from the
batch's rows to the experts (`expert_rows`), which XLA compiles to an all-to-all over the expert axis
each way, so a device computes its own experts on every device's tokens.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from transformer.config import Config, ConfigError, check_expert_split, check_tensor_split
from transformer.model import Placer

MESH_AXES = ("data", "fsdp", "tensor", "expert")
# the mesh axes the batch's rows are split over: all but tensor, whose devices share their rows
BATCH_AXES = ("data", "fsdp", "expert")

# logical axis -> mesh axis (or axes); anything not listed is replicated.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    # the rows of the tokens dispatched to the experts: the batch's split less the expert axis, which
    # splits the experts there (model/moe.py places them so: the all-to-all)
    "expert_rows": ("data", "fsdp"),
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "latent": None,  # MLA's latents: each tensor shard projects its own heads up from the whole latent
    "layers": None,
    "experts": "expert",
}


def mesh_shape(cfg: Config, n_devices: int) -> dict[str, int]:
    """Axis sizes with -1 filled in; refuses (ConfigError) what cannot fit the devices or the model."""
    sizes = {axis: getattr(cfg.mesh, axis) for axis in MESH_AXES}
    fixed = math.prod(s for s in sizes.values() if s != -1)
    for axis, size in sizes.items():
        if size == -1:
            if n_devices % fixed:
                raise ConfigError(f"mesh.{axis}", f"cannot fill: {n_devices} devices are not divisible by {fixed}")
            sizes[axis] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        shape = " x ".join(f"{a}={s}" for a, s in sizes.items())
        raise ConfigError("mesh", f"{shape} = {math.prod(sizes.values())} devices, but {n_devices} are available")
    check_tensor_split(cfg.model, sizes["tensor"])
    if sizes["expert"] > 1:
        check_expert_split(cfg.model, sizes["expert"])
    batch_shards = math.prod(sizes[a] for a in BATCH_AXES)
    if cfg.train.batch_size % (batch_shards * cfg.train.grad_accum):
        raise ConfigError(
            "train.batch_size",
            f"{cfg.train.batch_size} is not divisible by data x fsdp x expert x grad_accum = "
            f"{sizes['data']} x {sizes['fsdp']} x {sizes['expert']} x {cfg.train.grad_accum}",
        )
    return sizes


def make_mesh(cfg: Config, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    sizes = mesh_shape(cfg, len(devices))
    return jax.make_mesh(
        tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for a value with these logical axes; a dimension its mesh axes cannot divide
    evenly stays replicated (only fsdp can hit this: tensor divisibility is checked up front)."""
    out: list[str | tuple[str, ...] | None] = []
    used: set[str] = set()
    for name, dim in zip(axes, shape):
        target = RULES.get(name) if name else None
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1 and a not in used)
        if not mesh_axes or dim % math.prod(mesh.shape[a] for a in mesh_axes):
            out.append(None)
            continue
        used.update(mesh_axes)
        out.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*out)


def activation_placer(mesh: Mesh) -> Placer | None:
    """What pins the activations the model names (`model.layers.place`) on `mesh`: None on one
    device. Without it XLA's propagation may follow the fsdp-split weights instead of the batch:
    it gathered the whole batch onto every device and split the residual stream along D, all-reducing
    each projection's output (tensor parallelism over fsdp), so activations did not shrink with the
    mesh and no weight was gathered."""
    if mesh.size == 1:
        return None

    def each_device(f, args, axes, out_axes):
        out = jax.eval_shape(f, *args)
        return jax.shard_map(
            f,
            mesh=mesh,
            in_specs=tuple(spec(a, x.shape, mesh) for a, x in zip(axes, args, strict=True)),
            out_specs=spec(out_axes, out.shape, mesh),
            check_vma=False,  # f's result on a block is replicated over the mesh axes its axes do not name
        )(*args)

    return Placer(
        pin=lambda x, axes: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(axes, x.shape, mesh))),
        row_groups=math.prod(mesh.shape[a] for a in BATCH_AXES),
        each_device=each_device,
    )


def state_shardings(state: nnx.State, mesh: Mesh):
    """NamedShardings for an nnx.State of parameters (from each Param's `axes` metadata)."""

    def one(v):
        value = v.get_value()
        return v.replace(NamedSharding(mesh, spec(v.get_metadata()["axes"], value.shape, mesh)))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Where a batch's arrays live: rows split over BATCH_AXES."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def global_batch(local: dict[str, np.ndarray], mesh: Mesh, global_rows: int) -> dict[str, jax.Array]:
    """Global arrays from this process's rows (processes hold consecutive row blocks, in order)."""
    sharding = batch_sharding(mesh)
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (global_rows,) + v.shape[1:]) for k, v in local.items()
    }
