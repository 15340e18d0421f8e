"""Decode attention over the rollout KV cache, and the cache's one-token append: the ops' pure-JAX
definitions and the choice of the kernel that computes them.

One new query token per sequence attends to the cache slots ``[lo, length)`` of its sequence
(``lo = length - window`` with a sliding window, else 0). K and V are the cache's stored buffers
(``trace_jax.fp4.kv_format``: bf16 arrays, ``FP8Tensor`` or ``fp4.QTensor`` quantized along D
with one global scale per token and head), read in place. Kernels:
``fp4_decode_attention_triton`` (every format; the one the Pallas interpreter runs in CPU
tests), ``fp4_decode_attention_mgpu`` (NVFP4 / MXFP4 on the tensor cores, with
``tensor_cores=True``) and ``kv_append_triton`` (the append alone).
``decode_attention_reference`` (``kv_format.read`` + softmax) is the definition the attention
kernels are tested against; ``kv_format.write`` that of the append.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import fp4_decode_attention_mgpu as tc
from pallas_kernels import fp4_decode_attention_triton as ft
from pallas_kernels.kv_append_triton import append_rows, kernel_fits
from pallas_kernels.kv_layout import (
    as_bytes,
    cache_shape,
    from_operands,
    new_storage,
    operands,
    row_views,
)
from trace_jax import fp4
from trace_jax.fp4 import kv_format
from trace_jax.fp4.kv_format import Stored


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "window", "config", "tensor_cores", "interpret")
)
def decode_attention(
    q: jax.Array,
    k: Stored,
    v: Stored,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    config: ft.DecodeAttentionConfig | None = None,
    tensor_cores: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """Attention of one new query token per sequence over the KV cache.

    Args:
      q: [B, Hq, D] bf16, the new tokens' queries (Hq a multiple of Hkv).
      k, v: the cache's stored K and V of one layer, logical [B, S, Hkv, D]: bf16 arrays,
        ``kv_format.FP8Tensor`` or NVFP4/MXFP4 ``fp4.QTensor`` with per-row global scales (as
        ``kv_format.to_storage`` makes them). Both in the same format.
      lengths: [B] int32, valid slots per sequence (the new token's K/V already written, so
        ``lengths`` counts it); slots >= length are ignored whatever they hold.
      sm_scale: logit scale, 1/sqrt(D) when None.
      window: attend to the last ``window`` slots only (sliding window); None: all.
      config: tiling of the Triton kernel; ``fp4_decode_attention_triton.default_config(B, S,
        Hkv, fmt)`` when None.
      tensor_cores: an NVFP4 cache that ``fp4_decode_attention_mgpu.supports`` takes goes to
        that kernel (Mosaic GPU, its default tiling; ``config`` is not used); other caches here.
      interpret: run the Pallas interpreter (CPU tests).
    Returns:
      [B, Hq, D] bf16 (zeros for a sequence of length 0).
    """
    fmt, cfg = ft.resolve_config(q, k, v, window, config, interpret)
    if tensor_cores and tc.supports(k, v, q.shape[1]):
        return tc.decode_attention_mgpu(
            q, k, v, lengths, sm_scale=sm_scale, window=window, interpret=interpret
        )
    out, _ = ft.decode_attention_triton(
        q, operands(k), operands(v), lengths, fmt, cfg, sm_scale, window, interpret
    )
    return out


@functools.partial(
    jax.jit,
    donate_argnums=(1, 2),
    static_argnames=("sm_scale", "window", "config", "tensor_cores", "interpret"),
)
def decode_attention_append(
    q: jax.Array,
    k: Stored,
    v: Stored,
    new_k: jax.Array,
    new_v: jax.Array,
    lengths: jax.Array,
    *,
    qts: tuple[fp4.QTensor | None, fp4.QTensor | None] | None = None,
    valid: jax.Array | None = None,
    sm_scale: float | None = None,
    window: int | None = None,
    config: ft.DecodeAttentionConfig | None = None,
    tensor_cores: bool = False,
    interpret: bool = False,
) -> tuple[jax.Array, Stored, Stored]:
    """Write the new token's K and V into the cache and attend over it, in one kernel launch.

    Equal to ``kv_append_many([k, v], [new_k, new_v], lengths, qts=qts, valid=valid)`` followed
    by ``decode_attention(q, k, v, lengths + taken)``, where ``taken`` marks the sequences whose
    token was written (``valid`` and ``lengths < S``). The new token is attended from its
    stored row (decoded in the kernel as the cache's slots are), so no program reads a slot
    that another one writes. ``k`` and ``v`` are donated and updated in place. An FP8 cache,
    or one whose tiles the compiled kernel does not take, goes through the two calls above.

    Args:
      q: [B, Hq, D] bf16, the new tokens' queries.
      k, v: the layer's stored K and V, logical [B, S, Hkv, D] (as ``decode_attention``).
      new_k, new_v: [B, Hkv, D] or [B, 1, Hkv, D], the new token's K and V (the KV sites'
        outputs).
      lengths: [B] int32, the first free slot of each sequence (the new token's slot).
      qts: for FP4 caches, the ``QTensor`` each KV site quantized (as ``kv_append``).
      valid: [B] bool, which sequences take a token (all when None).
      sm_scale, window, config, interpret: as ``decode_attention``.
      tensor_cores: as ``decode_attention``; that kernel writes the new rows too (the program
        whose tile holds the new slot puts them into its copy of the tile and the cache).
    Returns:
      (out [B, Hq, D] bf16, updated k, updated v).
    """
    fmt, cfg = ft.resolve_config(q, k, v, window, config, interpret)
    b, s = cache_shape(k)[:2]
    qts = list(qts) if qts is not None else [None, None]
    ok = jnp.ones((b,), bool) if valid is None else valid.reshape(b)
    taken = ok & (lengths < s) & (lengths >= 0)
    if tensor_cores and tc.supports(k, v, q.shape[1]):  # the tensor-core kernel writes them
        news, _ = new_storage([k, v], [new_k, new_v], qts)
        slots = jnp.where(taken, lengths, -1).astype(jnp.int32)
        append = (slots, *news)
        out, written = tc.attend(
            q, k, v, lengths + taken, sm_scale, window, None, interpret, append
        )
        k, v = from_operands([k, v], written)
        return out, k, v
    if fmt == "fp8" or not (interpret or kernel_fits([k, v])):
        k, v = kv_append_many(
            [k, v], [new_k, new_v], lengths, qts=qts, valid=ok, interpret=interpret
        )
        out, _ = ft.decode_attention_triton(
            q, operands(k), operands(v), lengths + taken, fmt, cfg, sm_scale, window, interpret
        )
        return out, k, v
    news, qts = new_storage([k, v], [new_k, new_v], qts)
    rows = [[a[:, 0] for a in as_bytes(operands(n))] for n in news]
    for i, qt in enumerate(qts):  # a per-tensor global scale (MXFP4's unit scale): one value
        if isinstance(qt, fp4.QTensor) and qt.global_scale.size == 1:
            rows[i][-1] = qt.global_scale.reshape(1, 1)  # read by every program; no broadcast
    slots = jnp.where(taken, lengths, -1).astype(jnp.int32)
    append = (slots, rows[0] + rows[1])
    out, written = ft.decode_attention_triton(
        q,
        as_bytes(operands(k)),
        as_bytes(operands(v)),
        lengths,
        fmt,
        cfg,
        sm_scale,
        window,
        interpret,
        append=append,
    )
    k, v = from_operands([k, v], written)
    return out, k, v


@functools.partial(jax.jit, static_argnames=("sm_scale", "window"))
def decode_attention_reference(
    q: jax.Array,
    k: Stored,
    v: Stored,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
) -> jax.Array:
    """Pure-JAX definition: ``kv_format.read`` to float32, masked softmax, -> [B, Hq, D] bf16.

    Same arguments as ``decode_attention``.
    """
    kf = kv_format.read(k, jnp.float32)
    vf = kv_format.read(v, jnp.float32)
    b, s, hkv, d = kf.shape
    hq = q.shape[1]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    qg = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d)
    hp = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bhgd,bshd->bhgs", qg, kf, precision=hp) * sm_scale
    pos = jnp.arange(s)[None, :]
    valid = pos < lengths[:, None]
    if window is not None:
        valid &= pos >= lengths[:, None] - window
    logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    total = jnp.sum(p, axis=-1, keepdims=True)
    vf = jnp.where(valid[:, :, None, None], vf, 0.0)
    out = jnp.einsum("bhgs,bshd->bhgd", p, vf, precision=hp)
    out = jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)
    return out.reshape(b, hq, d).astype(jnp.bfloat16)


# ----------------------------------------------------------------------------- append


def kv_append(
    stored: Stored,
    value: jax.Array,
    lengths: jax.Array,
    *,
    qt: fp4.QTensor | None = None,
    valid: jax.Array | None = None,
    kernel: bool | None = None,
    interpret: bool = False,
) -> Stored:
    """Quantize one new token's K or V and write it at slot ``lengths[b]`` of each sequence.

    Equal to ``kv_format.write(stored, kv_format.to_storage(fmt, value, qt), lengths, valid)``
    for a one-token chunk. ``stored`` is donated: its buffers are updated in place (call it
    inside a jit that donates the cache, or directly: the jitted call donates its argument).

    Args:
      stored: the layer's K or V buffer, logical [B, S, Hkv, D].
      value: [B, Hkv, D] or [B, 1, Hkv, D], the new token's K or V (the KV site's output).
      lengths: [B] int32, the first free slot of each sequence.
      qt: for FP4 caches, the ``QTensor`` the KV site quantized (logical [B, 1, Hkv, D]); None:
        quantized here as the site's RTN mode does (``fp4.quantize`` along D, per-row global
        scale for NVFP4).
      valid: [B] bool, which sequences take a token (all when None); slots >= S are dropped.
      kernel: write with the one-launch Pallas kernel (``append_rows``) instead of XLA
        scatters; None: on a GPU when the shapes allow it (``kernel_fits``).
      interpret: run the kernel in the Pallas interpreter (CPU tests).
    Returns:
      the updated buffer (same type and shapes as ``stored``).
    """
    (out,) = kv_append_many(
        [stored], [value], lengths, qts=[qt], valid=valid, kernel=kernel, interpret=interpret
    )
    return out


def kv_append_many(
    stored: list[Stored],
    values: list[jax.Array],
    lengths: jax.Array,
    *,
    qts: list[fp4.QTensor | None] | None = None,
    valid: jax.Array | None = None,
    kernel: bool | None = None,
    interpret: bool = False,
) -> list[Stored]:
    """``kv_append`` of several buffers (K and V of a layer) in one kernel launch.

    Args and result as ``kv_append``, one list entry per buffer; ``stored`` is donated.
    """
    if kernel is None:
        kernel = interpret or (jax.default_backend() == "gpu" and kernel_fits(stored))
    qts = list(qts) if qts is not None else [None] * len(stored)
    return _kv_append(list(stored), list(values), lengths, qts, valid, kernel, interpret)


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("kernel", "interpret"))
def _kv_append(stored, values, lengths, qts, valid, kernel, interpret):
    b = lengths.shape[0]
    news, _ = new_storage(stored, values, qts)
    ok = jnp.ones((b,), bool) if valid is None else valid.reshape(b)
    if not kernel:
        return [
            kv_format.write(buf, new, lengths, ok[:, None])
            for buf, new in zip(stored, news, strict=True)
        ]
    s = kv_format.stored_shape(stored[0])[1]
    slots = jnp.where(ok & (lengths < s) & (lengths >= 0), lengths, -1).astype(jnp.int32)
    bufs = row_views(stored)
    rows = [a[:, 0] for a in row_views(news)]
    return from_operands(stored, append_rows(bufs, rows, slots, interpret=interpret))
