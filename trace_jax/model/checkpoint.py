"""orbax-checkpoint save and restore of model parameters (and, later, of whole train states)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from trace_jax.model.hf import CheckpointError, MissingCheckpointError


def save_params(path: str | Path, model: nnx.Module) -> None:
    """Write ``model``'s parameters to the folder ``path`` (must not exist)."""
    path = Path(path).absolute()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, nnx.state(model, nnx.Param))


def restore_params(path: str | Path, model: nnx.Module) -> nnx.Module:
    """Load parameters saved by ``save_params`` into ``model`` (same config), in place.

    The restored arrays keep the shardings (and dtypes) of ``model``'s current parameters.
    Raises ``MissingCheckpointError`` (a ``FileNotFoundError``) naming ``path`` when it holds no
    checkpoint, ``CheckpointError`` naming it when it cannot be read into ``model`` (damaged, or
    written for another model configuration).
    """
    path = Path(path).absolute()
    if not path.is_dir():
        raise MissingCheckpointError(f"no parameter checkpoint at {path}")
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        nnx.state(model, nnx.Param),
    )
    try:
        with ocp.StandardCheckpointer() as ckpt:
            state = ckpt.restore(path, target)
    except Exception as e:  # orbax and tensorstore raise many types; all mean "not readable"
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"{path}: not a parameter checkpoint of this model ({type(e).__name__}: {first})"
        ) from e
    nnx.update(model, state)
    return model


def params_digest(model_or_params) -> str:
    """SHA-256 (hex) of a model's parameters (or a parameter pytree): every leaf's path, dtype,
    shape and bytes in tree order, so equal digests mean bit-identical parameters (two runs that
    claim one starting policy can be checked)."""
    params = model_or_params
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        a = np.ascontiguousarray(jax.device_get(leaf))
        h.update(f"{jax.tree_util.keystr(path)}:{a.dtype}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()
