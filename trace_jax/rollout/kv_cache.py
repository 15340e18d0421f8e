"""Preallocated KV cache in bf16, fp8 (E4M3 + per token-head scale) or FP4 (``QTensor`` layout).

Each sequence of the batch has its own length: a chunk of new tokens is written at
``lengths[b] .. lengths[b] + T - 1`` for sequence ``b`` (prefill, one decode step, or appended
environment tokens alike), and attention reads every slot below the new length.

What a buffer stores per format, and its ``write`` / ``read``, is the cache's stored format
(``trace_jax.fp4.kv_format``, shared with the decode-attention kernels); its names are this
module's too, so that the rollout speaks of one cache API.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from trace_jax.fp4 import kv_format
from trace_jax.fp4.kv_format import (
    FP8_MAX,
    CacheFormat,
    FP8Tensor,
    Stored,
    dequantize_fp8,
    quantize_fp8,
    read,
    scatter_rows,
    site_global_scale,
    to_storage,
    write,
)

__all__ = [
    "FP8_MAX",
    "CacheFormat",
    "FP8Tensor",
    "KVCache",
    "LayerCache",
    "Stored",
    "dequantize_fp8",
    "init_cache",
    "quantize_fp8",
    "read",
    "scatter_rows",
    "site_global_scale",
    "to_storage",
    "write",
]


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
        return kv_format.stored_shape(self.layers[0].k)[1]

    @property
    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.layers))


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
    layers = tuple(
        LayerCache(kv_format.empty(fmt, shape, dtype), kv_format.empty(fmt, shape, dtype))
        for _ in range(num_layers)
    )
    return KVCache(layers=layers, lengths=jnp.zeros((batch,), jnp.int32), fmt=fmt)
