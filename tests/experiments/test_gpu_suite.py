"""experiments/bench/gpu_suite.sh without a GPU: every step names scripts and configs that exist,
and every step's shell command runs (with ``echo`` for python) without a shell error, so that a
GPU call is not spent on a quoting mistake."""

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]
SUITE = ROOT / "experiments" / "bench" / "gpu_suite.sh"


def steps() -> list[str]:
    out = subprocess.run(["bash", str(SUITE), "--list"], capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if "|" in line]


def test_every_step_names_files_that_exist():
    lines = steps()
    assert len(lines) > 20
    names = [line.split("|", 1)[0] for line in lines]
    assert len(set(names)) == len(names), "two steps of one name"
    for line in lines:
        for path in re.findall(r"(?:experiments/bench|configs)/[\w./-]+\.(?:py|yaml)", line):
            assert (ROOT / path).exists(), f"{line.split('|', 1)[0]}: {path} does not exist"


def test_every_step_runs_its_shell_without_an_error(tmp_path):
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHON": "echo",
        "OUT": str(out),
        "PACK_CACHE": "0",
        "CACHE_IN": str(tmp_path / "no-cache"),
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
    }
    run = subprocess.run(
        ["bash", str(SUITE)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    names = [line.split("|", 1)[0] for line in steps()]
    for name in names:
        log = (out / f"{name}.log").read_text()
        for error in ("syntax error", "unexpected EOF", "bad substitution", "unbound variable"):
            assert error not in log, f"{name}: {error}\n{log[-1000:]}"


def test_a_callers_knobs_reach_the_steps_as_given(tmp_path):
    """``WS=320 ... rl-learn-medium-ws`` warm-starts for 320 steps (a helper of the suite named
    like a knob had once replaced the caller's value with its own text)."""
    env = {
        **os.environ,
        "PYTHON": "echo",
        "OUT": str(tmp_path / "out"),
        "PACK_CACHE": "0",
        "CACHE_IN": str(tmp_path / "no-cache"),
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
        "WS": "320",
        "RL_MIN": "8",
        "RL_ARGS": "lr=1e-5",
    }
    step = "rl-learn-medium-ws"
    subprocess.run(["bash", str(SUITE), step], cwd=tmp_path, env=env, timeout=60, check=True)
    log = (tmp_path / "out" / f"{step}.log").read_text().splitlines()
    command = next(line for line in log if line.startswith("-m experiments run"))
    assert command.split() == [
        "-m", "experiments", "run", "configs/reasoning/medium.yaml", "warm_start.steps=320",
        "time_limit_min=8", "checkpoint_every=0", "lr=1e-5", "--run-dir", "runs/learn-ws320",
    ]  # fmt: skip
    # RECIPE: another preset's recipe for the RL steps
    env["RECIPE"] = "configs/reasoning/small.yaml"
    subprocess.run(["bash", str(SUITE), step], cwd=tmp_path, env=env, timeout=60, check=True)
    log = (tmp_path / "out" / f"{step}.log").read_text().splitlines()
    command = next(line for line in log if line.startswith("-m experiments run"))
    assert command.split()[3] == "configs/reasoning/small.yaml"
