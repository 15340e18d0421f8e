"""Deterministic, resumable prompt streams over a task's problems, built with grain.

    it = prompt_stream(task, "train", batch_size=8, seed=0)
    batch = next(it)                  # list[Problem] of length 8
    state = it.get_state()            # a small dict: store it in the checkpoint
    ...
    it = prompt_stream(task, "train", batch_size=8, seed=0)
    it.set_state(state)               # continues with exactly the batch that would come next

The order is a grain index shuffle of ``range(task.num_problems(split))`` keyed by ``seed``
(reshuffled each epoch), so it depends only on (task config, split, seed, batch size, shard).
GRPO's group repetition is left to the caller (repeat each problem ``group_size`` times).
"""

from __future__ import annotations

import grain

from trace_jax.tasks.base import Problem, Split, Task, check_split


def prompt_dataset(
    task: Task,
    split: Split = "train",
    *,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    drop_remainder: bool = True,
    shard_index: int = 0,
    shard_count: int = 1,
) -> grain.IterDataset:
    """A grain dataset of problem batches (each a ``list[Problem]``).

    Args:
      task: any task of ``trace_jax.tasks``.
      split: "train" or "eval".
      batch_size: problems per batch.
      seed: the shuffle seed (the problems themselves are fixed by the task's config).
      shuffle: False keeps index order 0, 1, 2, ... (e.g. for eval).
      num_epochs: passes over the split; None repeats forever.
      drop_remainder: drop a final short batch (only matters with finite ``num_epochs``).
      shard_index, shard_count: this data-parallel process's share (every ``shard_count``-th
        element of the shuffled stream, starting at ``shard_index``).
    """
    check_split(split)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index {shard_index} not in [0, shard_count={shard_count})")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1 or None, got {num_epochs}")
    ds = grain.MapDataset.range(task.num_problems(split))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)  # reshuffles each epoch from the seed
    if shard_count > 1:
        ds = ds[shard_index::shard_count]
    ds = ds.map(lambda index: task.problem(split, int(index)))
    # Problems are built in this process on demand: no reader threads, nothing read ahead.
    ids = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    return ids.batch(batch_size, drop_remainder=drop_remainder, batch_fn=list)


def prompt_stream(
    task: Task,
    split: Split = "train",
    *,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    drop_remainder: bool = True,
    shard_index: int = 0,
    shard_count: int = 1,
) -> grain.DatasetIterator:
    """An iterator over ``prompt_dataset`` batches with ``get_state()`` / ``set_state(state)``."""
    return iter(
        prompt_dataset(
            task,
            split,
            batch_size=batch_size,
            seed=seed,
            shuffle=shuffle,
            num_epochs=num_epochs,
            drop_remainder=drop_remainder,
            shard_index=shard_index,
            shard_count=shard_count,
        )
    )


def eval_problems(task: Task, limit: int | None = None) -> list[Problem]:
    """The eval split in index order (the first ``limit`` problems)."""
    n = task.num_problems("eval")
    return [task.problem("eval", i) for i in range(n if limit is None else min(n, limit))]
