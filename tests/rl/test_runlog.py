"""The run's own curves: which points each metric's line has."""

from trace_jax.rl import runlog

RECORDS = [
    {"step": 0, "sft/loss": 2.0},
    {"step": 1, "reward": 0.1, "eval/reward_start": 0.25},  # the evaluation before RL
    {"step": 2, "reward": 0.2},
    {"step": 3, "reward": 0.3, "eval/reward": 0.5},
]


def test_the_eval_curve_starts_with_the_evaluation_before_rl():
    assert runlog.curve_points(RECORDS, "eval/reward") == [(1, 0.25), (3, 0.5)]
    assert runlog.curve_points(RECORDS, "reward") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert runlog.curve_points(RECORDS, "sft/loss") == [(0, 2.0)]
