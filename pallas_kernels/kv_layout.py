"""The KV cache as the decode-attention kernels take it, and the flash-decoding pieces both
attention kernels share.

Below the kernels (``fp4_decode_attention_triton``, ``fp4_decode_attention_mgpu``,
``kv_append_triton``). A cache buffer is the stored format of ``trace_jax.fp4.kv_format``
(logical [B, S, Hkv, D]: a bf16 array, an ``FP8Tensor``, or an NVFP4/MXFP4 ``QTensor`` along D
with one global scale per token and head); the kernels read its arrays in place as operands
(``operands``), 1-byte floats viewed as bytes where a kernel writes them (``as_bytes``), and
rebuild the buffer from what they wrote (``from_operands``).

Flash decoding: each (sequence, KV head) is split along the sequence (``default_splits``); each
split writes an unnormalised fp32 partial output with its running max and sum (base 2), which
``combine_splits`` merges.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax import fp4
from trace_jax.fp4 import kv_format
from trace_jax.fp4.kv_format import CacheFormat, FP8Tensor, Stored


def cache_format(stored: Stored) -> CacheFormat:
    """The format name of a stored K or V buffer."""
    if isinstance(stored, fp4.QTensor):
        return stored.fmt.name
    if isinstance(stored, FP8Tensor):
        return "fp8"
    if stored.dtype == jnp.bfloat16:
        return "bf16"
    raise TypeError(f"decode_attention: unsupported cache array of dtype {stored.dtype}")


def cache_shape(stored: Stored) -> tuple[int, int, int, int]:
    """The logical [B, S, Hkv, D] of a buffer the kernels take (FP4: along D, per-row global
    scales)."""
    if isinstance(stored, fp4.QTensor):
        if stored.axis != 3 or not stored.per_row_global_scale:
            raise ValueError(
                "decode_attention: an FP4 cache is a QTensor [B, S, Hkv, D] quantized along D "
                "with one global scale per token and head (kv_format.to_storage)"
            )
        return stored.shape
    return kv_format.stored_shape(stored)


def check_shapes(q, k, v, window, who: str = "decode_attention"):
    """Validate q [B, Hq, D], the K and V buffers and the window (shared by both kernels);
    returns (cache format, (B, S, Hkv, D))."""
    fmt = cache_format(k)
    if cache_format(v) != fmt:
        raise ValueError(f"{who}: K is {fmt} but V is {cache_format(v)}")
    b, s, hkv, d = cache_shape(k)
    if cache_shape(v) != (b, s, hkv, d):
        raise ValueError(f"{who}: K {(b, s, hkv, d)} and V {cache_shape(v)} differ")
    bq, hq, dq = q.shape
    if bq != b or dq != d or hq % hkv:
        raise ValueError(f"{who}: q {q.shape} does not fit a [B={b}, Hkv={hkv}] cache")
    if window is not None and window < 1:
        raise ValueError(f"{who}: window must be >= 1, got {window}")
    return fmt, (b, s, hkv, d)


def operands(stored: Stored) -> list[jax.Array]:
    """The arrays the Triton kernels read, [B, S, Hkv, ...] each (trailing size-1 scale axes
    dropped)."""
    if isinstance(stored, fp4.QTensor):
        return [stored.codes, stored.block_scales, stored.global_scale[..., 0]]
    if isinstance(stored, FP8Tensor):
        return [stored.values, stored.scale[..., 0]]
    return [stored]


def as_bytes(arrays: list[jax.Array]) -> list[jax.Array]:
    """1-byte floats viewed as uint8 (the kernels write bytes; they read either)."""
    return [
        jax.lax.bitcast_convert_type(a, jnp.uint8)
        if a.dtype.itemsize == 1 and a.dtype != jnp.uint8
        else a
        for a in arrays
    ]


def row_views(stored: list[Stored]) -> list[jax.Array]:
    """Each buffer's arrays as [B, S, Hkv, X] with 1-byte floats viewed as uint8."""
    return as_bytes(jax.tree.leaves(stored))


def from_operands(stored, arrays: list[jax.Array]):
    """Rebuild stored buffers (one, or a list) from their kernel operands in leaf order,
    byte-viewed and with trailing size-1 axes dropped or not (inverse of ``operands`` and
    ``row_views``)."""
    old = jax.tree.leaves(stored)
    leaves = [
        (jax.lax.bitcast_convert_type(a, o.dtype) if a.dtype != o.dtype else a).reshape(o.shape)
        for a, o in zip(arrays, old, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(stored), leaves)


def new_storage(stored, values, qts):
    """The new token's K/V in each buffer's stored form, logical [B, 1, Hkv, D]; FP4 values
    without a site ``QTensor`` are quantized as the KV site's RTN mode does (along D).

    Returns (stored forms, the ``QTensor`` each FP4 one was made from (None otherwise)).
    """
    news, used = [], []
    for buf, value, qt in zip(stored, values, qts, strict=True):
        if value.ndim == 3:
            value = value[:, None]
        fmt = cache_format(buf)
        if fmt in ("nvfp4", "mxfp4") and qt is None:
            qt = fp4.quantize(value, fmt, axis=-1, global_scale=kv_format.site_global_scale(fmt))
        news.append(kv_format.to_storage(fmt, value, qt))
        used.append(qt)
    return news, used


# ----------------------------------------------------------------------------- flash decoding


def default_splits(batch: int, kv_heads: int, steps: int) -> int:
    """Splits per (sequence, KV head) for about 1024 programs, without a split shorter than 4
    of the ``steps`` loop steps (4 to 8 splits were within noise of each other at B=32)."""
    splits = 1
    while batch * kv_heads * splits < 1024 and steps // (splits * 2) >= 4:
        splits *= 2
    return splits


def combine_splits(o_parts, m, l):
    """Merge the splits: o_parts [B, Hkv, splits, G, d] f32, m and l [B, Hkv, splits, G] (base 2).

    Returns [B, Hkv, G, d] f32 per part; a query with no valid slot gets zeros.
    """
    m_max = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp2(m - m_max)
    total = jnp.sum(w * l, axis=2)
    inv = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    return [jnp.sum(w[..., None] * o, axis=2) * inv[..., None] for o in o_parts]
