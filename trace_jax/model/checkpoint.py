"""orbax-checkpoint save and restore of model parameters (and, later, of whole train states)."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx


def save_params(path: str | Path, model: nnx.Module) -> None:
    """Write ``model``'s parameters to the folder ``path`` (must not exist)."""
    path = Path(path).absolute()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, nnx.state(model, nnx.Param))


def restore_params(path: str | Path, model: nnx.Module) -> nnx.Module:
    """Load parameters saved by ``save_params`` into ``model`` (same config), in place.

    The restored arrays keep the shardings (and dtypes) of ``model``'s current parameters.
    Raises ``FileNotFoundError`` naming ``path`` when it holds no checkpoint.
    """
    path = Path(path).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"no parameter checkpoint at {path}")
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        nnx.state(model, nnx.Param),
    )
    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(path, target)
    nnx.update(model, state)
    return model
