"""Preallocated KV cache in bf16, fp8 (E4M3 + per token-head scale) or FP4 (``QTensor`` layout).

Each sequence of the batch has its own length: a chunk of new tokens is written at
``lengths[b] .. lengths[b] + T - 1`` for sequence ``b`` (prefill, one decode step, or appended
environment tokens alike), and attention reads every slot below the new length.

FP4 caches store exactly the ``QTensor`` that the model's KV site produced (codes, block scales and
a per-token-per-head global scale), so decoding over the cache reproduces a full forward whose
K/V pass the same fake quantization.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from trace_jax import fp4

CacheFormat = Literal["bf16", "fp8", "nvfp4", "mxfp4"]
FP8_MAX = 448.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Tensor:
    """E4M3 values with one float32 scale per row (token and head). values: [..., D]."""

    values: jax.Array
    scale: jax.Array


def quantize_fp8(x: jax.Array) -> FP8Tensor:
    """x: [..., D] -> E4M3 with ``scale = amax(|row|) / 448`` (1 for all-zero rows)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return FP8Tensor((x32 / scale).astype(jnp.float8_e4m3fn), scale)


def dequantize_fp8(t: FP8Tensor, dtype) -> jax.Array:
    return (t.values.astype(jnp.float32) * t.scale).astype(dtype)


Stored = jax.Array | FP8Tensor | fp4.QTensor


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    """K and V of one layer: [B, S, Hkv, D] in the cache's storage format."""

    k: Stored
    v: Stored


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Attributes:
    layers: one ``LayerCache`` per decoder layer.
    lengths: [B] int32, filled slots per sequence.
    fmt: the storage format (static).
    """

    layers: tuple[LayerCache, ...]
    lengths: jax.Array
    fmt: CacheFormat = dataclasses.field(metadata=dict(static=True))

    @property
    def max_len(self) -> int:
        k = self.layers[0].k
        return _leading(k)[1]

    @property
    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.layers))


def _leading(stored: Stored) -> tuple[int, ...]:
    if isinstance(stored, fp4.QTensor):
        return stored.shape
    if isinstance(stored, FP8Tensor):
        return stored.values.shape
    return stored.shape


def init_cache(
    fmt: CacheFormat,
    num_layers: int,
    batch: int,
    max_len: int,
    kv_heads: int,
    head_dim: int,
    dtype=jnp.bfloat16,
) -> KVCache:
    """An empty cache (all lengths 0) holding ``max_len`` slots per sequence."""
    shape = (batch, max_len, kv_heads, head_dim)

    def empty():
        if fmt == "bf16":
            return jnp.zeros(shape, dtype)
        if fmt == "fp8":
            return FP8Tensor(
                jnp.zeros(shape, jnp.float8_e4m3fn), jnp.ones((*shape[:-1], 1), jnp.float32)
            )
        if fmt in ("nvfp4", "mxfp4"):
            return _row_global_scale(
                fp4.quantize(
                    jnp.zeros(shape, jnp.float32), fmt, global_scale=_site_global_scale(fmt)
                )
            )
        raise ValueError(f"kv cache format {fmt!r} is not one of bf16, fp8, nvfp4, mxfp4")

    layers = tuple(LayerCache(empty(), empty()) for _ in range(num_layers))
    return KVCache(layers=layers, lengths=jnp.zeros((batch,), jnp.int32), fmt=fmt)


def to_storage(fmt: CacheFormat, value: jax.Array, qt: fp4.QTensor | None) -> Stored:
    """What the cache stores for new K or V.

    Args:
      value: [B, T, Hkv, D] the KV site's output (what attention uses).
      qt: the ``QTensor`` the site quantized, or None if the site is off.
    """
    if fmt == "bf16":
        return value.astype(jnp.bfloat16)
    if fmt == "fp8":
        return quantize_fp8(value)
    if qt is None or qt.fmt.name != fmt or (fmt == "nvfp4" and not qt.per_row_global_scale):
        raise ValueError(
            f"a {fmt} KV cache stores the KV sites' own codes: the quantization policy must "
            f"quantize K/V in {fmt} with a per-row global scale (policy.kv 'rtn' or 'record')"
        )
    return _row_global_scale(qt)


def _site_global_scale(fmt: str) -> str:
    return "row" if fmt == "nvfp4" else "tensor"


def _row_global_scale(qt: fp4.QTensor) -> fp4.QTensor:
    """MXFP4's unit global scale, stored per row so that every field is written slot by slot."""
    if qt.per_row_global_scale:
        return qt
    rows = qt.codes.shape[:-1]
    return dataclasses.replace(qt, global_scale=jnp.broadcast_to(qt.global_scale, (*rows, 1)))


def write(stored: Stored, new: Stored, lengths: jax.Array, valid: jax.Array) -> Stored:
    """Write the valid tokens of a chunk at each sequence's next slots.

    Args:
      stored: [B, S, ...] leaves.
      new: [B, T, ...] leaves of the chunk.
      lengths: [B] int32, the first free slot of each sequence.
      valid: [B, T] bool; invalid tokens, and tokens past slot S - 1, are not written.
    """
    fields = jax.tree.map(
        lambda buf, chunk: scatter_rows(buf, chunk, lengths, valid), _fields(stored), _fields(new)
    )
    return _with_fields(stored, fields)


def scatter_rows(buf: jax.Array, chunk: jax.Array, lengths: jax.Array, valid: jax.Array):
    """buf [B, S, ...] <- chunk [B, T, ...] at slots lengths[b] + t where valid[b, t]."""
    b, t = valid.shape
    slots = lengths[:, None] + jnp.arange(t, dtype=lengths.dtype)[None]
    slots = jnp.where(valid, slots, buf.shape[1])  # out of range: dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    return buf.at[rows, slots].set(chunk.astype(buf.dtype), mode="drop")


def _fields(stored: Stored):
    # A QTensor's static shape differs between the buffer and the chunk: map over its arrays.
    if isinstance(stored, fp4.QTensor):
        return (stored.codes, stored.block_scales, stored.global_scale)
    return stored


def _with_fields(like: Stored, fields) -> Stored:
    if isinstance(like, fp4.QTensor):
        codes, scales, g = fields
        return dataclasses.replace(like, codes=codes, block_scales=scales, global_scale=g)
    return fields


def read(stored: Stored, dtype) -> jax.Array:
    """The whole buffer [B, S, Hkv, D] dequantized to ``dtype``."""
    if isinstance(stored, fp4.QTensor):
        return fp4.dequantize(stored, dtype)
    if isinstance(stored, FP8Tensor):
        return dequantize_fp8(stored, dtype)
    return stored.astype(dtype)
