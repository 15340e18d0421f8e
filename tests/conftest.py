"""Suite-wide settings: GPU-marked tests skip (reported) without a GPU; modules with slow tests
are collected first; the hypothesis profile; a persistent compilation cache, so that programs
compiled again (a resumed run, a second engine of the same shapes) are loaded instead."""

import gc
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


# Every program XLA:CPU compiles keeps its machine code in memory mappings until the program is
# dropped; a test worker that has compiled a few hundred of them reaches the kernel's limit on
# mappings per process (vm.max_map_count, 65530 by default; 6 RL trainer tests alone leave 12k)
# and the next compilation crashes the worker. Past 60 % of the limit the compiled programs are
# dropped (later tests compile again or load them from the persistent cache).
def _mapping_limit() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):  # not Linux: no such limit to watch
        return 0


MAX_MAPPINGS = int(0.6 * _mapping_limit())


@pytest.fixture(autouse=True)
def _bounded_memory_mappings():
    yield
    if MAX_MAPPINGS and Path("/proc/self/maps").read_bytes().count(b"\n") > MAX_MAPPINGS:
        jax.clear_caches()
        gc.collect()


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


@pytest.fixture(scope="session")
def ref_python() -> str:
    """The reference environment's interpreter (torch, torchao, transformers, compressed-tensors):
    ``TRACE_REF_PYTHON``, else ``.venv-ref/bin/python``. Missing, its tests skip (fail under CI)."""
    path = os.environ.get("TRACE_REF_PYTHON") or str(
        Path(__file__).parents[1] / ".venv-ref/bin/python"
    )
    if not Path(path).exists():
        message = f"reference interpreter {path} not found; run `make ref-env` to build it"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path
