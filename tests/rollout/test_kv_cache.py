"""KV cache: per-sequence writes at each length, exact storage of each format."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from trace_jax import fp4
from trace_jax.rollout import kv_cache

B, S, H, D = 3, 8, 2, 32


def chunk(key, t):
    return jax.random.normal(jax.random.key(key), (B, t, H, D)) * 3


def stored_chunk(fmt, x):
    qt = None
    if fmt in ("nvfp4", "mxfp4"):
        qt = fp4.quantize(x, fmt, global_scale="row" if fmt == "nvfp4" else "tensor")
    return kv_cache.to_storage(fmt, x, qt)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_writes_land_at_each_sequence_length_and_read_back_exactly(fmt):
    cache = kv_cache.init_cache(fmt, 1, B, S, H, D)
    buf = cache.layers[0].k
    lengths = jnp.asarray([0, 2, 6], jnp.int32)
    x = chunk(0, 3)
    valid = jnp.asarray([[1, 1, 1], [1, 0, 0], [1, 1, 1]], bool)  # sequence 2 overflows at slot 8
    new = stored_chunk(fmt, x)
    out = np.asarray(kv_cache.read(kv_cache.write(buf, new, lengths, valid), jnp.float32))
    want = np.asarray(kv_cache.read(new, jnp.float32))
    expect = np.zeros((B, S, H, D), np.float32)
    expect[0, 0:3] = want[0]
    expect[1, 2:3] = want[1, :1]
    expect[2, 6:8] = want[2, :2]
    np.testing.assert_array_equal(out, expect)


def test_fp8_rows_are_e4m3_casts_of_the_row_scaled_values():
    x = np.asarray(chunk(1, 4), np.float32)
    t = kv_cache.quantize_fp8(jnp.asarray(x))
    scale = np.asarray(t.scale)
    np.testing.assert_allclose(scale, np.abs(x).max(-1, keepdims=True) / 448.0, rtol=2e-7)
    codes = (x / scale).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(t.values).view(np.uint8), codes.view(np.uint8))
    np.testing.assert_array_equal(
        np.asarray(kv_cache.dequantize_fp8(t, jnp.float32)), codes.astype(np.float32) * scale
    )


def test_fp4_cache_refuses_values_without_their_site_codes():
    with pytest.raises(ValueError, match="nvfp4 KV cache stores the KV sites' own codes"):
        kv_cache.to_storage("nvfp4", chunk(2, 1), None)
    with pytest.raises(ValueError, match="not one of bf16, fp8, nvfp4, mxfp4"):
        kv_cache.init_cache("int4", 1, B, S, H, D)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_empty_fp4_buffers_are_the_quantized_zeros(fmt):
    # made from one quantized row: the same bytes as quantizing a whole zero buffer
    buf = kv_cache.init_cache(fmt, 1, B, S, H, D).layers[0].v
    zeros = fp4.quantize(jnp.zeros((B, S, H, D)), fmt, global_scale=kv_cache.site_global_scale(fmt))
    assert buf.shape == zeros.shape and buf.axis == zeros.axis and buf.fmt == zeros.fmt
    np.testing.assert_array_equal(np.asarray(buf.codes), np.asarray(zeros.codes))
    np.testing.assert_array_equal(
        np.asarray(buf.block_scales).view(np.uint8), np.asarray(zeros.block_scales).view(np.uint8)
    )
    g = np.broadcast_to(np.asarray(zeros.global_scale), (B, S, H, 1))
    np.testing.assert_array_equal(np.asarray(buf.global_scale), g)


def test_row_writes_are_one_scatter_of_distinct_indices():
    """Invalid tokens and slots past the end are dropped, the rest land where they belong, and
    the scatter is declared to meet each index once (under XLA's deterministic GPU ops one that
    is not is rewritten, into a loop over its indices)."""
    buf = jnp.zeros((3, 5, 2), jnp.float32)
    chunk = jnp.arange(3 * 3 * 2, dtype=jnp.float32).reshape(3, 3, 2) + 1
    lengths = jnp.asarray([0, 3, 4], jnp.int32)
    valid = jnp.asarray([[1, 1, 0], [1, 1, 1], [1, 1, 1]], bool)
    got = np.asarray(kv_cache.scatter_rows(buf, chunk, lengths, valid))
    want = np.zeros((3, 5, 2), np.float32)
    for b in range(3):
        for t in range(3):
            slot = int(lengths[b]) + t
            if valid[b, t] and slot < 5:
                want[b, slot] = chunk[b, t]
    np.testing.assert_array_equal(got, want)
    hlo = jax.jit(kv_cache.scatter_rows).lower(buf, chunk, lengths, valid).as_text()
    assert "unique_indices = true" in hlo
