"""Suite-wide settings: GPU-marked tests skip (reported) without a GPU; the hypothesis profile."""

import os

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


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible to JAX)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
