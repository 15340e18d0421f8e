"""experiments/bench/row_writes.py: the rollout's row writes against a NumPy reference."""

import functools

import numpy as np

from experiments.bench import row_writes


def test_both_forms_write_as_the_reference_and_a_faulty_one_is_caught():
    writes = row_writes.rollout_writes(8, 24, 8, 3, (2, 4), np.float32, seed=1)
    assert writes[0][4].sum() < writes[0][4].size  # ragged prompts: some positions invalid
    assert sum(not w[4].all() for w in writes[1:]) > 0  # finished rows in some decode step
    for form in (row_writes.old_scatter_rows, row_writes.scatter_rows):
        assert [n for _, n, _ in row_writes.check(form, writes)] == [0] * len(writes)
    clamped = functools.partial(row_writes.old_scatter_rows, mode="clip")
    faulty = row_writes.check(clamped, writes)
    padded = int((~writes[0][4]).any(axis=1).sum())  # rows whose prompt is padded
    assert faulty[0][1] > 0 and faulty[0][2] == padded  # their padding lands in the last slot


def test_the_script_passes_on_this_device(capsys):
    assert row_writes.main(["--batch", "16", "--slots", "24", "--prompt", "8", "--steps", "2"]) == 0
    assert capsys.readouterr().out.count("differing elements         0") == 8


def test_engine_rollouts_compared_bit_for_bit(capsys):
    same = {"tokens": np.arange(6).reshape(2, 3), "x.codes": np.ones((2, 3, 4), np.uint8)}
    other = {**same, "x.codes": same["x.codes"].copy()}
    other["x.codes"][1, 2, 3] = 7
    assert row_writes.compare_rollouts({"old": same, "scatter_rows": same}) == 0
    assert row_writes.compare_rollouts({"old": other, "scatter_rows": same}) == 1
    out = capsys.readouterr().out
    assert "x.codes: 1 of 24 elements differ" in out and "1 of 2 buffers differ" in out
