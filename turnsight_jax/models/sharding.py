"""Named device meshes and the partitioning of Qwen3 weights and activations.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with weights and optimizer state
sharded), `tensor` (Megatron-style: attention heads and MLP columns split). The batch is split
over (data, fsdp). The same code runs on one CPU (a 1x1x1 mesh) and on a pod slice.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")

# Partition specs of each weight, by parameter name (see models/qwen3.py for the layouts).
PARAM_SPECS: dict[str, P] = {
    "embed": P("tensor", "fsdp"),
    "lm_head": P("fsdp", "tensor"),
    "final_norm": P(None),
    "attn_norm": P(None, None),
    "mlp_norm": P(None, None),
    "q_norm": P(None, None),
    "k_norm": P(None, None),
    "q": P(None, "fsdp", "tensor"),
    "k": P(None, "fsdp", "tensor"),
    "v": P(None, "fsdp", "tensor"),
    "o": P(None, "tensor", "fsdp"),
    "gate": P(None, "fsdp", "tensor"),
    "up": P(None, "fsdp", "tensor"),
    "down": P(None, "tensor", "fsdp"),
    # PPO's value head (methods.critic) and PiCA's PRM head (methods.prm): [D] and a scalar, replicated
    "value_w": P(None),
    "value_b": P(),
    "prm_w": P(None),
    "prm_b": P(),
}

# Activation specs used as sharding constraints inside the forward pass.
ACTIVATION_SPECS: dict[str, P] = {
    "activation": P(BATCH, None, None),  # [B, T, D]
    "heads": P(BATCH, None, "tensor", None),  # [B, T, H, Dh]
    "mlp": P(BATCH, None, "tensor"),  # [B, T, F]
    "tokens": P(BATCH, None),  # [B, T]
    "rows": P(BATCH),  # [B]
}


def mesh_shape(data: int, fsdp: int, tensor: int, n: int) -> list[int]:
    """The (data, fsdp, tensor) sizes of a mesh over n devices, the one axis given as -1 (if any)
    taking what is left. Raises ValueError when the sizes do not fit n."""
    shape = [data, fsdp, tensor]
    if shape.count(-1) > 1:
        raise ValueError(f"mesh {dict(zip(AXES, shape))}: at most one axis may be -1")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if known <= 0 or n % known:
            raise ValueError(f"mesh {dict(zip(AXES, shape))} does not divide the {n} available devices")
        shape[shape.index(-1)] = n // known
    if any(s <= 0 for s in shape) or math.prod(shape) != n:
        raise ValueError(
            f"mesh {dict(zip(AXES, shape))} has {math.prod(shape)} slots but {n} devices are available"
        )
    return shape


def make_mesh(
    data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (all devices by default). One axis may be -1
    (takes what is left). The product must equal the device count."""
    devices = list(devices if devices is not None else jax.devices())
    return Mesh(np.asarray(devices).reshape(mesh_shape(data, fsdp, tensor, len(devices))), AXES)


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """Drop mesh axes from dimensions they do not divide (e.g. 2 KV heads over 4 tensor shards),
    so that any model shape runs on any mesh; such a weight is replicated along that axis."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if axes is None:
            out.append(None)
            continue
        names = axes if isinstance(axes, tuple) else (axes,)
        size = math.prod(mesh.shape[a] for a in names)
        out.append(axes if dim % size == 0 else None)
    return P(*out)


def param_spec(name: str, shape: Sequence[int], mesh: Mesh) -> P:
    if name not in PARAM_SPECS:
        raise KeyError(f"no partition rule for parameter {name!r}")
    return fit_spec(PARAM_SPECS[name], shape, mesh)


def param_sharding(name: str, shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, param_spec(name, shape, mesh))


def state_shardings(state, mesh: Mesh):
    """NamedShardings for an nnx.State of a Qwen3 (leaf name = last path element)."""

    def leaf(path, x):
        return param_sharding(leaf_name(path), x.shape, mesh)

    return jax.tree_util.tree_map_with_path(leaf, state)


def opt_state_shardings(tree, mesh: Mesh):
    """NamedShardings of a tree whose leaves are named like parameters (an optimizer state, whose
    moments shard like their parameters; PPO's critic state, methods.critic.init_state): by the leaf's
    name (PARAM_SPECS); scalars (step counts, the value head's bias) replicated."""
    def leaf(path, x):
        if x.ndim == 0:
            return NamedSharding(mesh, P())
        return param_sharding(leaf_name(path), x.shape, mesh)

    return jax.tree_util.tree_map_with_path(leaf, tree)


def leaf_name(path) -> str:
    """Parameter name of a pytree path into an nnx.State: its last dictionary key."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    if not keys:
        raise ValueError(f"not a parameter path: {jax.tree_util.keystr(path)}")
    return str(keys[-1])


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Batch-major arrays ([B, ...]): rows split over (data, fsdp)."""
    return NamedSharding(mesh, P(BATCH, *([None] * (ndim - 1))))


def constrain(x: jax.Array, kind: str) -> jax.Array:
    """Sharding constraint for an activation when a mesh is set (`jax.set_mesh`); a no-op
    otherwise, so the model runs unchanged on one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(AXES) <= set(mesh.axis_names):
        return x
    spec = fit_spec(ACTIVATION_SPECS[kind], x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, spec)


def row_sharding(shape: Sequence[int], axis: int, mesh: Mesh) -> NamedSharding:
    """The sharding of a batch array of `shape`: its row axis split over (data, fsdp), where they divide."""
    spec = [None] * len(shape)
    spec[axis] = BATCH
    return NamedSharding(mesh, fit_spec(P(*spec), tuple(shape), mesh))


def shard_rows(tree, mesh: Mesh, row_axis_of=lambda path: 0):
    """device_put every array of `tree` with its row axis (default 0) split over (data, fsdp)."""

    def put(path, x):
        if x is None:
            return None
        return jax.device_put(x, row_sharding(x.shape, row_axis_of(path), mesh))

    return jax.tree_util.tree_map_with_path(put, tree)
