"""In each process of a local multi-process job joined through the entry point's
``init_distributed`` (``tests/rl/sharded_step_check.py``, run by ``test_multiprocess.py``, starts
them with the environment the entry point reads): give this process's slice of a global batch,
reduce over the global (data=2) mesh, and have the RL loop refuse what does not split over the
processes."""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.config import ConfigError
from trace_jax.model.sharding import batch_sharding, make_mesh
from trace_jax.rl.loop import RLConfig, RLRun


def check_global_batch():
    mesh = make_mesh(data=jax.process_count())  # one CPU device per process
    rows = 4  # the global batch [8, 3]: rows 4p..4p+3 are process p's
    index = jax.process_index()
    local = np.arange(index * rows * 3, (index + 1) * rows * 3, dtype=np.float32).reshape(rows, 3)
    batch = jax.make_array_from_process_local_data(batch_sharding(mesh), local)
    assert batch.shape == (rows * jax.process_count(), 3), batch.shape
    total = jax.jit(jnp.sum)(batch)  # replicated on every process: each reads its own copy
    print(f"process {index} of {jax.process_count()}: sum {float(total.addressable_data(0))}")
    # the RL loop across processes refuses, in one line naming the key, what cannot split
    for cfg in (RLConfig(prompts_per_step=3), RLConfig(model_overrides={"num_layers": 1})):
        try:
            RLRun(cfg, tempfile.mkdtemp())
        except ConfigError as e:
            print("RL loop refused:", e)
