"""Shared by the kernel tests (on the path through pytest's `pythonpath`): inputs and the bf16-level
agreement checks of the FP4 matmul and decode-attention kernels."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from trace_jax import fp4
from trace_jax.rollout import kv_cache


def random_x(m, k, seed):
    """[m, k] bf16 activations (drawn and rounded to bf16 in numpy, as XLA rounds: no program
    compiled per shape)."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((m, k), np.float32).astype(ml_dtypes.bfloat16))


def assert_close(y, ref):
    """bf16-level agreement: the two differ only in fp32 summation order before rounding."""
    y = np.asarray(y, np.float32)
    ref = np.asarray(ref, np.float32)
    assert y.shape == ref.shape
    assert np.all(np.isfinite(y)), "kernel output has NaN/Inf"
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < 4e-3, rel
    np.testing.assert_allclose(y, ref, rtol=2**-7, atol=1e-3 * np.abs(ref).max())


def stored_cache(fmt, x):
    """Decode attention: x [B, S, Hkv, D] -> the cache's stored value (the KV site's RTN)."""
    qt = None
    if fmt in ("nvfp4", "mxfp4"):
        qt = fp4.quantize(x, fmt, axis=-1, global_scale=kv_cache.site_global_scale(fmt))
    return kv_cache.to_storage(fmt, x, qt)


def attn_inputs(fmt, b, s, hkv, hq, d, seed):
    """q [B, Hq, D] bf16 and a K and V cache [B, S, Hkv, D] in format ``fmt``."""
    q, k, v = _attn_draws(b, s, hkv, hq, d, seed)
    return q, stored_cache(fmt, k), stored_cache(fmt, v)


@functools.partial(jax.jit, static_argnames=("b", "s", "hkv", "hq", "d"))
def _attn_draws(b, s, hkv, hq, d, seed):
    """``attn_inputs``' q and float32 K, V: one program per shape, the seed an operand."""
    kk, kv, kq = jax.random.split(jax.random.key(seed), 3)
    # Per-token magnitudes spread over 2**-3..2**3 so the per-row scales differ row to row.
    mag = 2.0 ** jax.random.uniform(jax.random.key(seed + 1), (b, s, hkv, 1), minval=-3, maxval=3)
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.float32) * mag
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.float32) * mag[:, ::-1]
    q = jax.random.normal(kq, (b, hq, d), jnp.float32).astype(jnp.bfloat16)
    return q, k, v


@jax.jit
def poison(stored, lengths, lo=None):
    """Decode attention: every slot outside [lo, length) overwritten with NaN bytes."""

    def bad(a, slot_ok):
        nan = (
            jnp.asarray(0xFF, jnp.uint8) if a.dtype == jnp.uint8 else jnp.asarray(jnp.nan, a.dtype)
        )
        return jnp.where(slot_ok.reshape(slot_ok.shape + (1,) * (a.ndim - 2)), a, nan)

    def per_leaf(a):
        pos = jnp.arange(a.shape[1])[None, :]
        ok = pos < lengths[:, None]
        if lo is not None:
            ok &= pos >= lo[:, None]
        return bad(a, ok)

    return jax.tree.map(per_leaf, stored)


def assert_attn_close(y, ref):
    """bf16-level agreement: probabilities and output are rounded to bf16 once each."""
    y = np.asarray(y, np.float32)
    ref = np.asarray(ref, np.float32)
    assert y.shape == ref.shape
    assert np.all(np.isfinite(y)), "kernel output has NaN/Inf"
    assert np.all(np.isfinite(ref))
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < 4e-3, rel
    np.testing.assert_allclose(y, ref, rtol=2**-6, atol=2**-7 * np.abs(ref).max())
