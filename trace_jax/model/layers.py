"""Pure functions of the Qwen3-MoE transformer: norms, RoPE, attention, routing, expert dispatch.

The NNX modules in ``transformer.py`` hold parameters and call these; the rollout engine and the
Pallas kernels plug into the same functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import bf16_grouped_matmul
from pallas_kernels.fp4_grouped_matmul import fp4_grouped_linear
from pallas_kernels.layouts import Fp4Weight
from trace_jax import fp4

# Expert weights the rollout engine packs once (``RolloutConfig.backend``): a per-expert FP4
# ``QTensor`` (backend "xla") or the grouped Pallas kernel's prepacked ``Fp4Weight`` ("pallas").
# The model uses them as they are (no weight fake quant).
PackedExpertWeight = fp4.QTensor | Fp4Weight


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32. x: [..., H]; weight: [H]. Returns x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * y).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, half-split convention (Hugging Face ``rotate_half``).

    Args:
      x: [B, T, heads, D].
      positions: [B, T] int32.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query softmax attention (reference path), softmax in float32.

    Args:
      q: [B, T, Hq, D]; k, v: [B, S, Hkv, D] with Hq a multiple of Hkv.
      mask: [B, T, S] bool, True where query t may attend to key s.
    Returns:
      [B, T, Hq, D] in q's dtype.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def causal_mask(q_positions: jax.Array, kv_positions: jax.Array, kv_valid: jax.Array) -> jax.Array:
    """[B, T] query positions, [B, S] key positions and validity -> [B, T, S] bool."""
    return (kv_positions[:, None, :] <= q_positions[:, :, None]) & kv_valid[:, None, :]


def route(
    router_logits: jax.Array, top_k: int, norm_topk_prob: bool, replay: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Softmax router with top-k selection, or replay of recorded choices.

    Args:
      router_logits: [N, E] float32.
      top_k: experts per token.
      norm_topk_prob: renormalise the selected probabilities to sum to 1.
      replay: None or [N, k] int32 recorded expert ids (Rollout Routing Replay): the expert set is
        the recorded one and the combine weights are the current router's probabilities of those
        experts, so the router still receives gradient.
    Returns:
      (weights [N, k] float32, experts [N, k] int32)
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    if replay is None:
        experts = jax.lax.top_k(probs, top_k)[1]
    else:
        experts = replay.astype(jnp.int32)
    weights = take_last(probs, experts)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def take_last(values: jax.Array, indices: jax.Array) -> jax.Array:
    """``take_along_axis(values, indices, axis=-1)`` by a select, not a gather: its gradient is
    a select too (a gather's is a scatter-add: atomic adds on the GPU, serialised under XLA's
    deterministic ops). ``-inf`` values stay ``-inf`` where picked and are harmless elsewhere.

    Args:
      values: [..., n]; indices: [..., k] int, in [0, n).
    Returns:
      [..., k] in values' dtype.
    """
    chosen = indices[..., None] == jnp.arange(values.shape[-1], dtype=indices.dtype)
    return jnp.sum(jnp.where(chosen, values[..., None, :], 0), axis=-1)


ONE_HOT_VOCAB = 1024
"""Vocabularies up to this size take the embedding's gradient as a one-hot matmul (its [tokens,
vocab] float32 operand: 256 MiB for 65,536 tokens at 1,024)."""


@jax.custom_vjp
def embed(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """``table[tokens]``: the rows of the embedding table [V, H] for tokens [...] int, [..., H]
    in the table's dtype. The gradient is the one-hot matmul ``one_hot(tokens)^T @ g`` for
    vocabularies up to ``ONE_HOT_VOCAB`` (a gather's gradient is a scatter-add of repeated
    indices: atomic adds on the GPU, a loop over the tokens under XLA's deterministic ops), the
    scatter-add beyond (a byte-level vocabulary of 256: 2 x 256 x H flops a token; Qwen3's
    151,936 would be 600 times more)."""
    return table[tokens]


def _embed_fwd(table, tokens):
    return table[tokens], (table, tokens)  # the table: for its shape and dtype (no copy)


def _embed_bwd(res, g):
    table, tokens = res
    vocab, dtype = table.shape[0], table.dtype
    g = g.reshape(-1, g.shape[-1]).astype(jnp.float32)
    flat = tokens.reshape(-1)
    if vocab <= ONE_HOT_VOCAB:
        one_hot = jax.nn.one_hot(flat, vocab, dtype=jnp.float32)
        dt = jnp.einsum("nv,nh->vh", one_hot, g, precision=jax.lax.Precision.HIGHEST)
    else:
        dt = jnp.zeros((vocab, g.shape[-1]), jnp.float32).at[flat].add(g)
    return dt.astype(dtype), None


embed.defvjp(_embed_fwd, _embed_bwd)


def expert_matmul(
    x: jax.Array, w: jax.Array | PackedExpertWeight, group_sizes: jax.Array
) -> jax.Array:
    """Grouped matmul over rows sorted by expert (``ragged_dot`` semantics).

    The weight's type picks the backend:

    * [E, K, N] array: XLA ``ragged_dot`` (training, BF16 rollout).
    * FP4 ``QTensor`` of that logical shape (also the per-expert ``jax.vmap(quantize)`` form):
      dequantized to x's dtype, then XLA ``ragged_dot``.
    * ``Fp4Weight`` (``prepack_grouped``): the grouped FP4 Pallas kernel through its
      dispatcher (``fp4_grouped_linear``: bf16 x, in the Pallas interpreter off the GPU; where
      the kernel does not apply, the QTensor path above).

    Args:
      x: [M, K], rows grouped by expert in expert order.
      w: the expert weights, as above.
      group_sizes: [E] int32 rows per expert, summing to M.
    Returns:
      [M, N] in x's dtype, accumulated in float32.
    """
    if isinstance(w, Fp4Weight):
        return fp4_grouped_linear(x, w, group_sizes)
    if isinstance(w, fp4.QTensor):
        w = fp4.dequantize(w, x.dtype)
    return grouped_matmul(x, w.astype(x.dtype), group_sizes)


@jax.custom_vjp
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``ragged_dot(x [M, K], w [E, K, N], group_sizes [E])`` -> [M, N] in x's dtype, accumulated
    in float32, with gradients computed block by block (``_block_layout``).

    XLA's own ragged_dot gradients lower, on the GPU, to dense dots over zero-padded copies with
    E times the rows (the weight gradient always): a trainer step of the ``medium`` preset then
    asked for 82 GiB. Here the rows of each expert are padded to whole blocks, each block is
    multiplied with its expert's weights (one batched matmul) and the weight gradient is summed
    per expert: E x fewer FLOPs and memory of the order of the rows. The forward lowers alike
    (XLA's ragged_dot holds an [M, E * N] product): where that product would pass
    ``_DENSE_FORWARD_BYTES`` (a trainer's batch: the ``medium`` preset's scoring pass of 1,024
    sequences asked for 64 GiB), the forward runs block by block too; below it (decode steps,
    small batches) ragged_dot, which reads each expert's weights once.

    The output is rounded to x's dtype here, so the backward's cotangent arrives in it: with
    BF16 x and w, every backward product is of BF16 operands (exact in float32) accumulated in
    float32, as the forward's, at the tensor cores' BF16 rate.

    On a Hopper GPU with BF16 operands (``bf16_grouped_matmul.applies``), JAX's Mosaic GPU
    kernels compute the forward and both gradients instead: the same sums, without padded
    copies, and a deterministic weight gradient.
    """
    if bf16_grouped_matmul.applies(x, w):
        return bf16_grouped_matmul.ragged_dot(x, w, group_sizes)
    m, n = x.shape[0], w.shape[-1]
    if m * w.shape[0] * n * 4 > _DENSE_FORWARD_BYTES:
        return blocked_matmul(x, w, group_sizes).astype(x.dtype)
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)


# Above this size of ragged_dot's dense [M, E * N] float32 product, the forward goes by blocks.
_DENSE_FORWARD_BYTES = 1 << 30


def blocked_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``ragged_dot`` block by block: each expert's rows padded to whole blocks
    (``_block_layout``), each block multiplied with its expert's weights in one batched matmul.

    Args:
      x: [M, K], rows grouped by expert in expert order.
      w: [E, K, N].
      group_sizes: [E] int32 rows per expert, summing to M.
    Returns:
      [M, N] float32; memory of the order of M * (K + N) plus one [K, N] weight per block.
    """
    dest, block_expert, blocks, size = _block_layout(group_sizes, x.shape[0])
    xp = _to_blocks(x, dest, blocks, size)
    out = jnp.einsum("bmk,bkn->bmn", xp, w[block_expert], preferred_element_type=jnp.float32)
    return permute_rows(out.reshape(blocks * size, -1), dest)


def permute_rows(a: jax.Array, rows: jax.Array) -> jax.Array:
    """``a[rows]`` for rows that are all different (a permutation, or slots of a padded layout):
    declared unique, so its gradient is a plain scatter (no atomic adds: deterministic and no
    serialisation under XLA's deterministic mode).

    Args:
      a: [M, ...]; rows: [R] int32, distinct, in [0, M).
    """
    return a.at[rows].get(unique_indices=True, mode="promise_in_bounds")


def _to_blocks(a: jax.Array, dest: jax.Array, blocks: int, size: int) -> jax.Array:
    """Rows [M, C] to their slots ``dest`` of ``blocks`` blocks of ``size`` rows, zero-padded:
    [blocks, size, C]."""
    padded = jnp.zeros((blocks * size, a.shape[1]), a.dtype)
    return (
        padded.at[dest]
        .set(a, unique_indices=True, mode="promise_in_bounds")
        .reshape(blocks, size, -1)
    )


def _grouped_matmul_fwd(x, w, group_sizes):
    return grouped_matmul(x, w, group_sizes), (x, w, group_sizes)


def _grouped_matmul_bwd(res, g):
    x, w, group_sizes = res
    if bf16_grouped_matmul.applies(x, w):
        dx = bf16_grouped_matmul.ragged_dot_transposed(g, w, group_sizes)
        return dx, bf16_grouped_matmul.weight_gradient(x, g, group_sizes), None
    m, k = x.shape
    f32 = jnp.float32
    dest, block_expert, blocks, size = _block_layout(group_sizes, m)
    gp = _to_blocks(g, dest, blocks, size)  # g: [M, N] in x's dtype (the forward's output)
    xp = _to_blocks(x, dest, blocks, size)
    w_blocks = w[block_expert]  # [blocks, K, N]
    dx = jnp.einsum("bmn,bkn->bmk", gp, w_blocks, preferred_element_type=f32)
    per_block = jnp.einsum("bmk,bmn->bkn", xp, gp, preferred_element_type=f32)
    dw = jnp.zeros(w.shape, f32).at[block_expert].add(per_block, indices_are_sorted=True)
    return permute_rows(dx.reshape(-1, k), dest).astype(x.dtype), dw.astype(w.dtype), None


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def _block_layout(group_sizes: jax.Array, rows: int):
    """Rows sorted by expert, each expert's padded to whole blocks of ``size`` rows.

    Returns:
      (dest [rows] int32: each row's slot in the padded layout, block_expert [blocks] int32:
      the expert of each block (unused blocks: the last expert, with zero rows), blocks, size),
      the last two static: ``size`` a power of two near the mean rows per expert (8..128),
      ``blocks`` = rows // size + E, enough for any group sizes summing to ``rows``.
    """
    experts = group_sizes.shape[0]
    size = min(128, max(8, 1 << max(0, (rows // experts - 1).bit_length())))
    blocks = rows // size + experts
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    block_ends = jnp.cumsum((group_sizes + size - 1) // size)
    padded_starts = (block_ends - (group_sizes + size - 1) // size) * size
    index = jnp.arange(rows, dtype=jnp.int32)
    # compare_all: one fused comparison (the default's loop is a kernel launch per halving)
    group = jnp.searchsorted(ends, index, side="right", method="compare_all")
    group = jnp.minimum(group, experts - 1)
    dest = (padded_starts[group] + index - starts[group]).astype(jnp.int32)
    block = jnp.arange(blocks, dtype=jnp.int32)
    block_expert = jnp.searchsorted(block_ends, block, side="right", method="compare_all")
    block_expert = jnp.minimum(block_expert, experts - 1)
    return dest, block_expert.astype(jnp.int32), blocks, size


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Order of the (token, slot) pairs grouped by expert, and the group sizes.

    Args:
      experts: [N, k] int32.
    Returns:
      (order [N*k] int32 indices into the flattened pairs, group_sizes [E] int32)
    """
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    # a count by comparison (one fused reduction), not ``bincount``'s scatter-add, which XLA's
    # deterministic GPU ops rewrite (the rollout's decode step held no other such scatter)
    hits = flat[:, None] == jnp.arange(num_experts, dtype=flat.dtype)[None]
    group_sizes = jnp.sum(hits, axis=0, dtype=jnp.int32)
    return order, group_sizes
