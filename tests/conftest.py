"""Suite-wide settings: GPU-marked tests skip (reported) without a GPU; modules with slow tests
are collected first; the hypothesis profile; a persistent compilation cache, so that programs
compiled again (a resumed run, a second engine of the same shapes) are loaded instead."""

import os
from pathlib import Path

import jax
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "trace",
    max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "40")),
    deadline=None,  # the first example of a test includes jit compilation
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=bool(os.environ.get("CI")),
)
settings.load_profile("trace")

jax.config.update(
    "jax_compilation_cache_dir", str(Path(__file__).parents[1] / ".pytest_cache" / "jax-cache")
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    # Modules with slow tests first: under `make test` (--dist worksteal) a worker that runs out
    # of tests takes the other's last queued ones, so the run should end on short tests.
    for item in items:
        if item.path.suffix == ".ipynb":  # a notebook runs whole, in its own kernel
            item.add_marker(pytest.mark.slow)
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order is otherwise kept
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible to JAX)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
