"""Shared by the kernel tests (on the path through pytest's `pythonpath`): inputs and the bf16-level
agreement check of the FP4 matmul kernels."""

import jax
import jax.numpy as jnp
import numpy as np


def random_x(m, k, seed):
    """[m, k] bf16 activations."""
    return jax.random.normal(jax.random.key(seed), (m, k), jnp.float32).astype(jnp.bfloat16)


def assert_close(y, ref):
    """bf16-level agreement: the two differ only in fp32 summation order before rounding."""
    y = np.asarray(y, np.float32)
    ref = np.asarray(ref, np.float32)
    assert y.shape == ref.shape
    assert np.all(np.isfinite(y)), "kernel output has NaN/Inf"
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < 4e-3, rel
    np.testing.assert_allclose(y, ref, rtol=2**-7, atol=1e-3 * np.abs(ref).max())
