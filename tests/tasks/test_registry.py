"""The common interface: every registered task satisfies it; the registry names bad keys."""

import numpy as np
import pytest

from trace_jax.config import ConfigError
from trace_jax.tasks import (
    BOS,
    EOS,
    TOKENIZER,
    Env,
    Problem,
    Task,
    demonstration_tokens,
    make_task,
    task_names,
)

PROCEDURAL = ["reasoning", "countdown", "coding", "gridworld"]


def test_registry_names():
    assert {"reasoning", "coding", "gridworld", "long_horizon", "jsonl"} <= set(task_names())
    with pytest.raises(ConfigError, match="unknown task 'chess'"):
        make_task("chess")


@pytest.mark.parametrize("name", PROCEDURAL)
def test_tasks_satisfy_the_interface(name):
    task = make_task(name)
    assert isinstance(task, Task)
    p = task.problem("train", 0)
    assert isinstance(p, Problem) and hash(p) == hash(task.problem("train", 0))
    env = task.env(p)
    assert (env is not None) == task.multi_turn
    if task.multi_turn:
        assert isinstance(env, Env)
    # Every prompt and demonstration is in the tokenizer's alphabet and fits a byte vocab.
    ids, mask = demonstration_tokens(task, p)
    assert ids.dtype == np.int32 and ids.shape == mask.shape
    assert ids[0] == BOS and ids.max() < TOKENIZER.vocab_size
    assert not mask[: len(TOKENIZER.prompt_ids(p.prompt))].any()
    if not task.multi_turn:
        assert ids[-1] == EOS and mask[-1]
        completion = TOKENIZER.completion_text(ids[mask].tolist())
        assert completion == task.demonstration(p)
        assert task.reward(p, completion) == 1.0


@pytest.mark.parametrize("name", PROCEDURAL)
def test_rewards_are_in_unit_interval_on_junk(name):
    task = make_task(name)
    p = task.problem("eval", 1)
    for junk in ["", "Answer:", "\ufffd" * 10, "dup dup", "n\ns\ne\nw", "x" * 2000]:
        assert 0.0 <= task.reward(p, junk) <= 1.0
