"""The fused W4A4 activation quantizer against the XLA definition (bit for bit), in the
interpreter on the CPU and compiled on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import cuda_lowering
from pallas_kernels import fp4_activation as fact
from trace_jax import fp4


def _rows(m: int, k: int, seed: int) -> np.ndarray:
    """Rows spanning 1e-36 .. 1e30 in magnitude (a global scale clamped to the smallest normal
    float32 at the bottom), a zero row, a zero block and a -0.0: bf16, drawn in numpy (no
    program compiled per shape)."""
    mags = np.logspace(-36, 30, m, dtype=np.float32)[:, None]
    x = np.random.default_rng(seed).standard_normal((m, k), np.float32) * mags
    x[0] = 0.0
    x[1, :16] = 0.0
    x[1, 17] = -0.0
    return x.astype(ml_dtypes.bfloat16)


def _ties(k: int) -> np.ndarray:
    """A row whose normalised values are every rounding midpoint of E2M1, exactly: the row max
    5.25 makes s_g = 2**-9, and each later block's max 3 makes s_b = 256, so x * (1 / s_g) / s_b
    is 2 x."""
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2, np.float32) / 2
    signs = np.where(np.arange(16) % 3 == 0, -1.0, 1.0).astype(np.float32)
    first = np.zeros(16, np.float32)
    first[0] = 5.25
    row = np.concatenate([first, np.tile(mids * signs, k // 16 - 1)])
    return row[None].astype(ml_dtypes.bfloat16)


# the XLA definition as one program per shape (eager, each of its ops compiled on its own)
_reference = jax.jit(fact.quantize_activation_blocks_reference)


def _assert_bits_equal(got, want):
    (v, s), (vr, sr) = got, want
    np.testing.assert_array_equal(np.asarray(v).view(np.uint16), np.asarray(vr).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(s).view(np.uint32), np.asarray(sr).view(np.uint32))


# whole power-of-two block counts (16), and 48 blocks padded to 64 (the zero blocks change
# nothing); (3, 2048), 128 blocks, ran the first path again
@pytest.mark.parametrize(("m", "k"), [(6, 256), (5, 768)])
def test_matches_xla_bit_for_bit(m, k):
    x = jnp.asarray(np.concatenate([_rows(m, k, seed=k), _ties(k)]))
    got = fact.quantize_activation_blocks(x, interpret=True)
    _assert_bits_equal(got, _reference(x))


def test_values_times_scale_dequantize():
    # values * s_g is the dequantization of the rollout-side quantizer
    x = jnp.asarray(_rows(4, 512, seed=1))
    v, s = fact.quantize_activation_blocks(x, interpret=True)
    deq = fp4.dequantize(fp4.quantize(x, "nvfp4", axis=-1, global_scale="row"))
    np.testing.assert_array_equal(np.asarray(v, np.float32) * np.asarray(s)[:, None], deq)


def test_non_finite_row_gets_nan_scale():
    x = _rows(3, 256, seed=2)
    x[1, 40], x[2, 3] = np.nan, -np.inf
    x = jnp.asarray(x)
    _, s = fact.quantize_activation_blocks(x, interpret=True)
    assert np.isnan(np.asarray(s)[1:]).all() and np.isfinite(np.asarray(s)[0])
    _, sr = _reference(x)
    np.testing.assert_array_equal(np.isnan(np.asarray(s)), np.isnan(np.asarray(sr)))


def test_bad_k_is_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        fact.quantize_activation_blocks(jnp.ones((2, 40), jnp.bfloat16), interpret=True)


def test_lowers_for_cuda_with_exact_division():
    # the GPU form divides with div.rn.f32 (Triton's float32 "/" is an approximate division)
    x = jnp.ones((4, 768), jnp.bfloat16)
    modules = cuda_lowering.triton_modules(fact.quantize_activation_blocks, x)
    assert len(modules) == 1
    assert modules[0].count("div.rn.f32") == 5


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "k"), [(16, 8192), (64, 4096), (5, 768)])
def test_gpu_matches_xla_bit_for_bit(m, k):
    x = jnp.asarray(np.concatenate([_rows(m, k, seed=k), _ties(k)]))
    got = fact.quantize_activation_blocks(x)
    _assert_bits_equal(got, _reference(x))
