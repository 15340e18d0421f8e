"""The KV cache's stored format: what a cache buffer holds per format, and how it is written and
read (bf16, fp8 = E4M3 + a per token-head scale, or FP4 in the ``QTensor`` layout).

A buffer is logical [B, S, Hkv, D]. FP4 buffers store exactly the ``QTensor`` that the model's KV
site produced (codes, block scales and a per-token-per-head global scale), so decoding over the
cache reproduces a full forward whose K/V pass the same fake quantization. This module sits with
the FP4 formats, below both the rollout's cache (``trace_jax.rollout.kv_cache``) and the
decode-attention kernels that read these buffers in place (``pallas_kernels``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from trace_jax.fp4.qtensor import QTensor
from trace_jax.fp4.quantize import dequantize, quantize

CacheFormat = Literal["bf16", "fp8", "nvfp4", "mxfp4"]
FORMATS: tuple[str, ...] = ("bf16", "fp8", "nvfp4", "mxfp4")
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


Stored = jax.Array | FP8Tensor | QTensor


def stored_shape(stored: Stored) -> tuple[int, ...]:
    """The logical shape [B, S, Hkv, D] of a stored buffer (or chunk)."""
    if isinstance(stored, FP8Tensor):
        return stored.values.shape
    return stored.shape


def site_global_scale(fmt: str) -> str:
    """The global-scale mode of the KV sites that feed an FP4 cache (``fp4.quantize``'s
    ``global_scale``): one per token and head for NVFP4, MXFP4's unit scale per tensor."""
    return "row" if fmt == "nvfp4" else "tensor"


def empty(fmt: CacheFormat, shape: tuple[int, ...], dtype=jnp.bfloat16) -> Stored:
    """An all-zero buffer of logical ``shape`` in format ``fmt`` (FP4: the codes and scales of
    zeros, so that slots never written decode to finite values)."""
    if fmt == "bf16":
        return jnp.zeros(shape, dtype)
    if fmt == "fp8":
        return FP8Tensor(
            jnp.zeros(shape, jnp.float8_e4m3fn), jnp.ones((*shape[:-1], 1), jnp.float32)
        )
    if fmt in ("nvfp4", "mxfp4"):
        # Rows quantize independently (per-row global scale, or MXFP4's unit one): one zero row
        # broadcast, with no float32 buffer of the cache's size (2.3 GB a layer at B=128, S=8.7k).
        zero_row = jnp.zeros((*(1,) * (len(shape) - 1), shape[-1]), jnp.float32)
        row = quantize(zero_row, fmt, global_scale=site_global_scale(fmt))
        lead = shape[:-1]
        return dataclasses.replace(
            row,
            codes=jnp.broadcast_to(row.codes, (*lead, row.codes.shape[-1])),
            block_scales=jnp.broadcast_to(row.block_scales, (*lead, row.block_scales.shape[-1])),
            global_scale=jnp.broadcast_to(row.global_scale, (*lead, 1)),
            shape=tuple(shape),
        )
    raise ValueError(f"kv cache format {fmt!r} is not one of bf16, fp8, nvfp4, mxfp4")


def to_storage(fmt: CacheFormat, value: jax.Array, qt: QTensor | None) -> Stored:
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


def _row_global_scale(qt: QTensor) -> QTensor:
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
    """buf [B, S, ...] <- chunk [B, T, ...] at slots lengths[b] + t where valid[b, t].

    The written (row, slot) pairs are distinct (out-of-range ones are dropped, never written),
    and the scatter says so: under XLA's deterministic GPU ops a scatter that may meet an index
    twice is rewritten (into a loop over its indices, one update at a time)."""
    b, t = valid.shape
    slots = lengths[:, None] + jnp.arange(t, dtype=lengths.dtype)[None]
    slots = jnp.where(valid, slots, buf.shape[1])  # out of range: dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    return buf.at[rows, slots].set(chunk.astype(buf.dtype), mode="drop", unique_indices=True)


def _fields(stored: Stored):
    # A QTensor's static shape differs between the buffer and the chunk: map over its arrays.
    if isinstance(stored, QTensor):
        return (stored.codes, stored.block_scales, stored.global_scale)
    return stored


def _with_fields(like: Stored, fields) -> Stored:
    if isinstance(like, QTensor):
        codes, scales, g = fields
        return dataclasses.replace(like, codes=codes, block_scales=scales, global_scale=g)
    return fields


def read(stored: Stored, dtype) -> jax.Array:
    """The whole buffer [B, S, Hkv, D] dequantized to ``dtype``."""
    if isinstance(stored, QTensor):
        return dequantize(stored, dtype)
    if isinstance(stored, FP8Tensor):
        return dequantize_fp8(stored, dtype)
    return stored.astype(dtype)
