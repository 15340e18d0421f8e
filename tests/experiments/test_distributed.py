"""Multi-process JAX from the entry point's ``init_distributed``: the environment it reads, and
one process without it (two local CPU processes on a localhost coordinator that see one global
mesh, feed each its slice of the batch and have the RL loop refuse settings that do not split
over them: ``distributed_check.py``, run in the job of tests/rl/test_multiprocess.py)."""

import pytest

from experiments.runner import init_distributed
from trace_jax.config import ConfigError


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
