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

In a multi-process job the mesh spans every process's devices; host data (prompts, rewards, done
flags) is each process's own rows of a batch: ``place_rows`` makes them one global array,
``process_rows`` reads a process's rows of one back, and ``batch_part`` says which rows those are.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
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


def batch_part(mesh: Mesh | None = None) -> tuple[int, int]:
    """(k, n): this process's devices hold part k of a batch split into n equal, contiguous
    parts over ``data`` x ``fsdp`` of ``mesh`` (default: the current one); (0, 1) in one process.
    Processes whose devices differ only along ``expert`` hold the same part.

    Raises ``ValueError`` when the process's devices hold no such part (rows of several parts
    that are not one contiguous range)."""
    mesh = jax.sharding.get_mesh() if mesh is None else mesh
    if jax.process_count() == 1 or mesh.empty:
        return 0, 1
    grid = mesh.devices.reshape(-1, mesh.shape["expert"])  # batch chunk -> its devices
    me = jax.process_index()
    mine = [i for i, devices in enumerate(grid) if any(d.process_index == me for d in devices)]
    size = len(mine)
    if len(grid) % size or mine != list(range(mine[0], mine[0] + size)) or mine[0] % size:
        raise ValueError(
            f"the mesh {dict(mesh.shape)} gives process {me} the batch chunks {mine} of "
            f"{len(grid)}, not one contiguous part"
        )
    return mine[0] // size, len(grid) // size


def place_rows(rows, batch_axis: int = 0) -> jax.Array:
    """This process's rows of a batch (a host array, its rows along ``batch_axis``) as the global
    batch on the current mesh (``jax.set_mesh``), split over ``data`` x ``fsdp`` (replicated,
    in one process, where they do not divide it): every process gives its ``batch_part``. One
    process without a mesh of several devices: ``jnp.asarray``.

    Host data must enter a multi-process job this way: ``jnp.asarray`` under the global mesh
    takes each process's value for the replicated value of all."""
    rows = np.asarray(rows)
    mesh = jax.sharding.get_mesh()
    if mesh.empty or mesh.size == 1:
        return jnp.asarray(rows)
    _, parts = batch_part(mesh)
    shape = list(rows.shape)
    shape[batch_axis] *= parts
    split = shape[batch_axis] % (mesh.shape["data"] * mesh.shape["fsdp"]) == 0
    if not split and parts > 1:
        raise ValueError(
            f"a batch of {shape[batch_axis]} rows does not split over data x fsdp of the mesh "
            f"{dict(mesh.shape)}"
        )
    spec = batch_spec(rows.ndim, batch_axis) if split else PartitionSpec()
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), rows, tuple(shape))


def process_rows(a) -> np.ndarray:
    """This process's rows (``batch_part`` of the array's mesh) of a batch array [B, ...] as a
    host array: the whole array in one process. Reads only this process's devices: ``a`` is
    split over the batch, or replicated (other axes whole)."""
    mesh = getattr(getattr(a, "sharding", None), "mesh", None)
    if not isinstance(mesh, Mesh) or a.is_fully_addressable or a.ndim == 0:
        return np.asarray(a)
    part, parts = batch_part(mesh)
    size = a.shape[0] // parts
    lo, hi = part * size, (part + 1) * size
    out = np.empty((size, *a.shape[1:]), a.dtype)
    done = np.zeros(size, bool)
    for shard in a.addressable_shards:
        if np.shape(shard.data)[1:] != a.shape[1:]:
            raise ValueError(f"process_rows: {a.sharding} splits an axis other than the batch")
        first, last, _ = shard.index[0].indices(a.shape[0])
        start, stop = max(first, lo), min(last, hi)
        if start < stop and not done[start - lo : stop - lo].all():
            out[start - lo : stop - lo] = np.asarray(shard.data)[start - first : stop - first]
            done[start - lo : stop - lo] = True
    if not done.all():
        raise ValueError(f"process_rows: rows of part {part} of {parts} are not on this process")
    return out


def host_value(a) -> np.ndarray:
    """The whole value of an array on the host: gathered from every process where this one
    holds a part of it (every process calls it then)."""
    if getattr(a, "is_fully_addressable", True):
        return np.asarray(a)
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def processes_max(value: int) -> int:
    """The largest of ``value`` over the processes of the job (a collective: every process
    calls it)."""
    if jax.process_count() == 1:
        return value
    return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int64))))
