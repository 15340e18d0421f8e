"""Checkpoints of a whole run (train state, data position, loop state) with orbax.

A checkpoint is a pytree of arrays (the train state and anything else the loop needs exactly:
past parameters for stale rollouts, PRNG key data) plus a JSON mapping (data iterator state,
counters). The newest ``max_to_keep`` are kept; saves are atomic, so a run killed at any point
restarts from its last complete checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from trace_jax.model import CheckpointError


class RunCheckpointer:
    """Args:
    directory: where checkpoints go (``<run_dir>/checkpoints``).
    max_to_keep: how many to keep.
    """

    def __init__(self, directory: str | Path, max_to_keep: int = 2):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, tree: Any, meta: dict[str, Any]) -> None:
        self._manager.save(
            step,
            args=ocp.args.Composite(tree=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)),
        )
        self._manager.wait_until_finished()

    def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
        """The checkpoint of ``step``; ``like`` is a pytree of the same structure whose arrays
        give shapes, dtypes and shardings. Raises ``CheckpointError`` naming the step's folder
        when it cannot be read."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            like,
        )
        try:
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    tree=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:  # orbax and tensorstore raise many types; all mean "unusable"
            first = (str(e).strip().splitlines() or [""])[0]
            first = first if len(first) <= 160 else first[:160] + "..."
            raise CheckpointError(
                f"{self.directory / str(step)}: the run checkpoint cannot be used "
                f"({type(e).__name__}: {first}); remove it to resume from an earlier one, or use "
                "a new --run-dir"
            ) from e
        return out["tree"], dict(out["meta"])

    def close(self) -> None:
        self._manager.close()


def read_policy_params(folder: str | Path) -> dict[tuple[str, ...], np.ndarray]:
    """The model parameters of one checkpoint, read alone into host memory: a run checkpoint
    (``<run>/checkpoints/<step>``: its train state's parameters, without the optimizer state,
    the stale versions and the metadata) or a ``save_params`` folder (``<run>/policy``).

    Returns:
      flat path of strings (``("layers", "0", "mlp", "gate_proj")``) -> numpy array, in the
      stored dtype. Raises ``CheckpointError`` naming the folder when it is not such a
      checkpoint.
    """
    folder = Path(folder).absolute()
    run_step = (folder / "tree").is_dir()
    tree_dir = folder / "tree" if run_step else folder
    # the handler alone: a run checkpoint's tree/ has no checkpointer metadata of its own
    handler = ocp.PyTreeCheckpointHandler()
    try:
        stored = handler.metadata(tree_dir).tree
        params = stored[0]["params"] if run_step else stored
        item = params
        if run_step:  # everything but the parameters is skipped
            item = jax.tree.map(lambda _: ocp.PLACEHOLDER, stored)
            item[0]["params"] = params
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
        restore = ocp.args.PyTreeRestore(item=item, restore_args=args)
        out = handler.restore(tree_dir, args=restore)
    except Exception as e:  # orbax and tensorstore raise many types; all mean "not readable"
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise CheckpointError(
            f"{folder}: not a readable parameter checkpoint ({type(e).__name__}: {first})"
        ) from None
    finally:
        handler.close()
    flat = {}
    restored = out[0]["params"] if run_step else out
    for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
        keys = tuple(str(k.key) for k in path)
        flat[keys[:-1] if keys[-1] == "value" else keys] = leaf
    return flat
