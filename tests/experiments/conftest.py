"""Shared by the run, sweep and report tests: a tiny RL config file with the shapes of
tests/rl/test_loop.py's small() config (its compiled programs are reused), and the check that a
user error printed one line."""

from pathlib import Path

import pytest
import yaml

SMALL = {
    "experiment": "fp4_trace",
    "model": "tiny",
    "model_overrides": {"num_layers": 1, "dtype": "bfloat16"},
    "steps": 2,
    "prompts_per_step": 2,
    "group_size": 2,
    "max_new_tokens": 6,
    "warm_start": {"steps": 1, "batch": 4},
    "eval_every": 2,
    "eval_problems": 4,
    "checkpoint_every": 1,
    "guidance_host_bytes": 0,
    "staleness": 1,
    "diagnostic": True,
    "plot": False,
    "tensorboard": False,
}


@pytest.fixture
def small_yaml(tmp_path):
    """``small_yaml(**changes)``: the path of the tiny config file with ``changes``."""

    def write(**changes) -> str:
        path = Path(tmp_path) / "small.yaml"
        path.write_text(yaml.safe_dump({**SMALL, **changes}))
        return str(path)

    return write


@pytest.fixture
def one_line():
    """``one_line(err)``: the single line a user error printed (asserts one line, no traceback)."""

    def check(err: str) -> str:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in err, err
        return lines[0]

    return check
