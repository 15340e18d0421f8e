"""Multi-process JAX from the entry point's ``init_distributed``: two local CPU processes on a
localhost coordinator see one global mesh, each feeds its slice of the batch, and the RL loop
refuses settings that do not split over them (the loop itself: tests/rl/test_multiprocess.py)."""

import subprocess
import sys
from pathlib import Path

import portpicker
import pytest
from cpu_jobs import cpu_env

from experiments.runner import init_distributed
from trace_jax.config import ConfigError


def test_two_processes_reduce_one_global_batch():
    port = portpicker.pick_unused_port()
    script = Path(__file__).with_name("distributed_check.py")
    procs = []
    for index in range(2):
        env = cpu_env(
            JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(index),
        )
        cmd = [sys.executable, str(script)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, (out + err).decode()
    want = float(sum(range(24)))  # the global [8, 3] batch is 0..23
    for index, (out, _) in enumerate(outs):
        assert f"process {index} of 2: sum {want}" in out.decode(), out.decode()
        assert "refused: prompts_per_step: 3 does not split over the job's 2" in out.decode()
        assert "refused: mesh_data x mesh_fsdp x mesh_expert: 1 x 1 x 1" in out.decode()


@pytest.mark.parametrize(
    "environ",
    [
        {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
        {"JAX_COORDINATOR_ADDRESS": "localhost:1", "JAX_NUM_PROCESSES": "2"},
        {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
        {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
    ],
)
def test_an_incomplete_or_bad_environment_names_the_variable(environ):
    with pytest.raises(ConfigError, match="JAX_"):
        init_distributed(environ)


def test_no_environment_is_one_process():
    assert init_distributed({}) is False
