"""Sharding by annotation: parameters carry logical axis names, rules map them onto a mesh.

The same model code runs on one device, on fake CPU devices in tests, and on a GPU/TPU pod: only
the mesh and the rules change. Default rules split routed experts over the ``expert`` mesh axis
and the batch over ``data``; everything else is replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DEFAULT_RULES: dict[str, str | None] = {"batch": "data", "expert": "expert"}


def make_mesh(data: int = 1, expert: int = 1, devices=None) -> Mesh:
    """A ``(data, expert)`` mesh over the first ``data * expert`` devices."""
    devices = list(devices if devices is not None else jax.devices())
    if data * expert > len(devices):
        raise ValueError(
            f"mesh data={data} x expert={expert} needs {data * expert} devices, have {len(devices)}"
        )
    grid = np.array(devices[: data * expert]).reshape(data, expert)
    return Mesh(grid, ("data", "expert"))


def logical_to_spec(axes: tuple[str | None, ...] | None, rules=DEFAULT_RULES) -> PartitionSpec:
    if not axes:
        return PartitionSpec()
    return PartitionSpec(*(rules.get(a) if a is not None else None for a in axes))


def param_shardings(model: nnx.Module, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedSharding for every parameter of ``model`` (an ``nnx.State`` of the same structure)."""
    state = nnx.state(model, nnx.Param)

    def spec(v):
        axes = v.get_metadata().get("logical_axes")
        return v.replace(NamedSharding(mesh, logical_to_spec(axes, rules)))

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules=DEFAULT_RULES) -> nnx.Module:
    """Place ``model``'s parameters on ``mesh`` according to their logical axes (in place)."""
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(state, param_shardings(model, mesh, rules)))
    return model


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Inputs such as tokens [B, T]: batch over ``data``."""
    return NamedSharding(mesh, PartitionSpec("data", *([None] * (ndim - 1))))
