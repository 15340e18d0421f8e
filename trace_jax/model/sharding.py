"""Sharding by annotation: parameters carry logical axis names, rules map them onto a mesh.

The same model code runs on one device, on fake CPU devices in tests, and on a GPU/TPU pod: only
the mesh and the rules change. The mesh has three axes, ``(data, fsdp, expert)``:

- ``expert``: routed experts are split over it (their ``expert`` logical axis);
- ``fsdp``: every parameter (and so its gradient and optimizer moments) is split, as FSDP does,
  over its largest dimension that ``fsdp`` divides and that no other mesh axis splits yet; the
  forward gathers each weight where it is used;
- ``data`` and ``fsdp`` together split the batch (an FSDP rank is a data-parallel rank that
  holds a slice of the weights instead of a copy).

Everything else is replicated. ``param_spec`` works from shapes and axis sizes alone, so the
same rules place real arrays (``shard_model``) and size abstract ones (``shard_report``).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert")
BATCH_AXES = ("data", "fsdp")
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {"batch": BATCH_AXES, "expert": "expert"}


def make_mesh(data: int = 1, expert: int = 1, fsdp: int = 1, devices=None) -> Mesh:
    """A ``(data, fsdp, expert)`` mesh over the first ``data * fsdp * expert`` devices."""
    devices = list(devices if devices is not None else jax.devices())
    size = data * fsdp * expert
    if size > len(devices):
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x expert={expert} needs {size} devices, "
            f"have {len(devices)}"
        )
    grid = np.array(devices[:size]).reshape(data, fsdp, expert)
    return Mesh(grid, MESH_AXES)


def logical_to_spec(axes: tuple[str | None, ...] | None, rules=DEFAULT_RULES) -> PartitionSpec:
    if not axes:
        return PartitionSpec()
    return PartitionSpec(*(rules.get(a) if a is not None else None for a in axes))


def _mesh_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _devices(entry, axis_sizes: Mapping[str, int]) -> int:
    return int(np.prod([axis_sizes.get(a, 1) for a in _mesh_axes(entry)]))


def param_spec(
    shape: tuple[int, ...],
    axes: tuple[str | None, ...] | None,
    axis_sizes: Mapping[str, int],
    rules=DEFAULT_RULES,
) -> PartitionSpec:
    """Where a parameter of ``shape`` with logical ``axes`` lives on a mesh of ``axis_sizes``
    (mesh axis -> devices): the rules' axes (a dimension they do not divide stays whole), then
    ``fsdp`` on the largest dimension it divides among those still whole (ties: the first). A
    parameter no dimension of which ``fsdp`` divides stays replicated over ``fsdp``."""
    spec = list(logical_to_spec(axes, rules)) if axes else []
    spec += [None] * (len(shape) - len(spec))
    spec = [s if shape[i] % _devices(s, axis_sizes) == 0 else None for i, s in enumerate(spec)]
    fsdp = axis_sizes.get("fsdp", 1)
    used = {a for s in spec for a in _mesh_axes(s)}
    whole = [i for i, s in enumerate(spec) if s is None and shape[i] % fsdp == 0]
    if fsdp > 1 and whole and "fsdp" not in used:
        spec[max(whole, key=lambda i: (shape[i], -i))] = "fsdp"
    return PartitionSpec(*spec)


def shard_bytes(shape: tuple[int, ...], dtype, spec: PartitionSpec, axis_sizes) -> int:
    """Bytes of the largest shard of an array of ``shape`` placed by ``spec``."""
    spec = list(spec) + [None] * (len(shape) - len(spec))
    local = [-(-n // _devices(s, axis_sizes)) for n, s in zip(shape, spec, strict=True)]
    return int(np.prod(local, dtype=np.int64)) * np.dtype(dtype).itemsize


def per_device_bytes(tree, axis_sizes: Mapping[str, int], rules=DEFAULT_RULES) -> int:
    """Bytes one device holds of ``tree`` (arrays or ``jax.ShapeDtypeStruct``, e.g. from
    ``nnx.eval_shape``) placed by ``param_spec``: an ``nnx.Variable``'s arrays by its logical
    axes (where their rank is the Variable's, e.g. a packed ``QTensor``'s codes and scales), other
    arrays by ``fsdp`` alone. No device or allocation is needed."""
    total = 0
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        axes = None
        if isinstance(leaf, nnx.Variable):
            axes = leaf.get_metadata().get("logical_axes")
            leaf = leaf.get_value()
        for a in jax.tree.leaves(leaf):
            own = axes if axes is not None and len(axes) == len(a.shape) else None
            total += shard_bytes(
                a.shape, a.dtype, param_spec(a.shape, own, axis_sizes, rules), axis_sizes
            )
    return total


def param_shardings(model: nnx.Module, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedSharding for every parameter of ``model`` (an ``nnx.State`` of the same structure)."""
    state = nnx.state(model, nnx.Param)

    def spec(v):
        spec = param_spec(
            v.get_value().shape, v.get_metadata().get("logical_axes"), mesh.shape, rules
        )
        return v.replace(NamedSharding(mesh, spec))

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules=DEFAULT_RULES) -> nnx.Module:
    """Place ``model``'s parameters on ``mesh`` according to their logical axes (in place)."""
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(state, param_shardings(model, mesh, rules)))
    return model


def commit(tree):
    """``tree``'s arrays committed to the device they are on, where there is one device.

    A jitted program is compiled per pattern of committed and uncommitted arguments, and its
    outputs are committed when any input is: state that starts uncommitted (a fresh ``init``)
    and comes back committed (after its first update, or from a step that read a restored
    checkpoint) compiles every step's programs again. State committed from the start keeps one
    pattern. With several devices the tree is returned as it is: uncommitted arrays follow a
    mesh's placement, one committed to a device would not."""
    if jax.device_count() > 1:
        return tree

    def put(a):  # tracers (a state built inside a traced function) have no placement yet
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
            return jax.device_put(a, a.sharding)
        return a

    return jax.tree.map(put, tree)


def place_batch(tree, batch: int):
    """``tree`` (a rollout's state: arrays [B, ...] and a few others) placed on the current
    mesh (``jax.set_mesh``): arrays whose leading dimension is the batch ``batch`` split over
    ``data`` x ``fsdp`` (the KV cache, tokens, records; on ``expert`` every device holds every
    row, as the trainer's batch), the rest replicated. Without a mesh of
    several devices: ``commit``. Decoding keeps each sequence's cache on the devices of its
    rows, where propagation from FSDP-split weights would split it along the head dimension."""
    mesh = jax.sharding.get_abstract_mesh()  # also inside jit, where get_mesh is refused
    if mesh.empty or mesh.size == 1:
        return commit(tree)
    split = batch % (mesh.shape["data"] * mesh.shape["fsdp"]) == 0

    def put(a):
        spec = batch_spec(a.ndim) if split and a.ndim and a.shape[0] == batch else PartitionSpec()
        if isinstance(a, jax.core.Tracer):  # a state built inside a traced function
            return jax.lax.with_sharding_constraint(a, spec)
        return jax.device_put(a, NamedSharding(jax.sharding.get_mesh(), spec))

    return jax.tree.map(put, tree)


def batch_spec(ndim: int = 2, batch_axis: int = 0) -> PartitionSpec:
    """An array of ``ndim`` dimensions split over ``data`` x ``fsdp`` along ``batch_axis``."""
    spec = [None] * ndim
    spec[batch_axis] = BATCH_AXES
    return PartitionSpec(*spec)


def batch_sharding(mesh: Mesh, ndim: int = 2, batch_axis: int = 0) -> NamedSharding:
    """Inputs such as tokens [B, T]: the batch axis over ``data`` x ``fsdp``."""
    return NamedSharding(mesh, batch_spec(ndim, batch_axis))
