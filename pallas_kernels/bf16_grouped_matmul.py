"""The trainer's BF16 grouped (MoE) matmul on Hopper GPUs: JAX's own Mosaic GPU kernels for
the forward and the input gradient (``ragged_dot_mgpu``) and for the weight gradient
(``transposed_ragged_dot_mgpu``), and when they apply.

Rows of ``x`` are sorted by expert (``group_sizes``), as for ``jax.lax.ragged_dot``. Each output
tile is one program's float32 accumulator of BF16 products, rounded once to BF16: the sums of
XLA's path (``trace_jax.model.layers.grouped_matmul``) in another order, with no atomic adds
(the weight gradient is deterministic; XLA's is a scatter-add) and no padded copies of the
rows or of the weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# (block_m, block_n, block_k, max_concurrent_steps, grid_block_n), measured at the `medium`
# trainer's shapes (BENCHMARKS.md, "The trainer's expert matmuls")
TILE = {"block_m": 64, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1}


def applies(x: jax.Array, w: jax.Array) -> bool:
    """Whether the kernels take ``x`` [M, K] and ``w`` [E, K, N]: both BF16, on one Hopper GPU
    (a kernel call sees whole arrays: with several devices the operands may be split, and XLA's
    form is partitioned instead), K and N multiples of 128 (the tiles of the three products)."""
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16 or jax.default_backend() != "gpu":
        return False
    if jax.device_count() != 1:
        return False
    k, n = w.shape[1:]
    major = str(getattr(jax.devices()[0], "compute_capability", "0")).split(".")[0]
    return major == "9" and k % 128 == 0 and n % 128 == 0


# JAX's kernels are plain functions: each call site would lower its kernel again (an unrolled
# decode step of 48 MoE layers lowers it 48 times). Jitted, calls of one shape share one traced
# program, which JAX lowers once per module (XLA inlines the calls).
@functools.partial(jax.jit, static_argnames=("transpose_rhs",))
def _ragged_dot(x, w, group_sizes, transpose_rhs=False):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot(
        x, w, group_sizes=group_sizes, transpose_rhs=transpose_rhs, **TILE
    )


@jax.jit
def _transposed_ragged_dot(x, g, group_sizes):
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    return transposed_ragged_dot_mgpu.transposed_ragged_dot(x, g, group_sizes=group_sizes, **TILE)


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """[M, K] bf16 x [E, K, N] bf16 -> [M, N] bf16: rows of expert e times ``w[e]``."""
    return _ragged_dot(x, w, group_sizes)


def ragged_dot_transposed(g: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """[M, N] bf16 x [E, K, N] bf16 -> [M, K] bf16: rows of expert e times ``w[e].T`` (the
    input gradient)."""
    return _ragged_dot(g, w, group_sizes, transpose_rhs=True)


def weight_gradient(x: jax.Array, g: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """[M, K] bf16, [M, N] bf16 -> [E, K, N] bf16: ``x[rows of e].T @ g[rows of e]`` per expert
    (zero for an expert without rows)."""
    return _transposed_ragged_dot(x, g, group_sizes)
