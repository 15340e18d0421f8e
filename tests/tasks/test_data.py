"""grain prompt streams: deterministic by seed, resumable from get_state, epochs and shards."""

import pytest

from trace_jax.tasks import eval_problems, make_task, prompt_stream


def _ids(batches):
    return [[p.id for p in b] for b in batches]


@pytest.mark.parametrize("name", ["reasoning", "coding", "gridworld"])
def test_resume_mid_stream_equals_uninterrupted(name):
    task = make_task(name)
    full = prompt_stream(task, "train", batch_size=3, seed=7)
    uninterrupted = _ids(next(full) for _ in range(8))

    first = prompt_stream(task, "train", batch_size=3, seed=7)
    head = _ids(next(first) for _ in range(5))
    state = first.get_state()
    resumed = prompt_stream(task, "train", batch_size=3, seed=7)
    resumed.set_state(state)
    assert head + _ids(next(resumed) for _ in range(3)) == uninterrupted


def test_seed_changes_order_and_batches_are_problems():
    task = make_task("reasoning")
    a = next(prompt_stream(task, batch_size=4, seed=0))
    b = next(prompt_stream(task, batch_size=4, seed=1))
    assert len(a) == 4 and all(p.id.startswith("reasoning/train/") for p in a)
    assert [p.id for p in a] != [p.id for p in b]


def test_finite_epochs_cover_the_split_and_reshuffle(tmp_path):
    task = make_task("reasoning", eval_size=10)
    stream = prompt_stream(task, "eval", batch_size=4, seed=3, num_epochs=2, drop_remainder=False)
    batches = _ids(stream)
    flat = [i for b in batches for i in b]
    assert [len(b) for b in batches] == [4, 4, 4, 4, 4]
    first, second = flat[:10], flat[10:]
    assert sorted(first) == sorted(second) == sorted(f"reasoning/eval/{i}" for i in range(10))
    assert first != second  # reshuffled each epoch


def test_unshuffled_eval_is_index_order_and_matches_eval_problems():
    task = make_task("coding", eval_size=6)
    batches = list(prompt_stream(task, "eval", batch_size=6, shuffle=False, num_epochs=1))
    assert batches == [eval_problems(task)]


def test_shards_partition_the_stream():
    task = make_task("reasoning")
    whole = prompt_stream(task, batch_size=8, seed=2)
    flat = [p.id for _ in range(2) for p in next(whole)]
    for k in range(2):
        shard = prompt_stream(task, batch_size=8, seed=2, shard_index=k, shard_count=2)
        assert [p.id for p in next(shard)] == flat[k::2]


def test_bad_arguments():
    task = make_task("reasoning")
    with pytest.raises(ValueError, match="batch_size"):
        prompt_stream(task, batch_size=0)
    with pytest.raises(ValueError, match="split"):
        prompt_stream(task, "test", batch_size=1)
