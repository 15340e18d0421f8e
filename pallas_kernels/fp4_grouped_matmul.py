"""The grouped (MoE) FP4 matmul op, ``ragged_dot(x, dequantize(W), group_sizes)``: its pure-JAX
definition and the choice of the kernel that computes it.

Rows of ``x`` are sorted by expert; expert ``e`` owns ``group_sizes[e]`` consecutive rows and
multiplies them by its own FP4 weight ``W[e]`` [K, N] (``layouts.prepack_grouped``). Kernels:
``fp4_matmul_mgpu.fp4_grouped_matmul_mgpu`` (Mosaic GPU, tensor cores; the faster one measured)
and ``fp4_grouped_matmul_triton`` (Triton; the one the Pallas interpreter runs off the GPU).
``fp4_grouped_matmul_reference`` is the definition both are tested against;
``fp4_grouped_linear`` is what the model's MoE layers call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import bf16_grouped_matmul
from pallas_kernels import fp4_grouped_matmul_triton as gt
from pallas_kernels import fp4_matmul_mgpu as fmm
from pallas_kernels.layouts import Fp4Weight
from trace_jax import fp4
from trace_jax.fp4 import QTensor

# Most routed rows (tokens x top-k) at which the kernel was measured against XLA's ragged_dot
# (H200, BENCHMARKS.md: 9.7-10.4x faster at 2048 rows); beyond it the crossover is not measured
# and the dispatcher uses XLA.
PALLAS_MAX_ROWS = 2048
# Above MGPU_MAX_SHORT_K_ROWS rows, contractions shorter than MGPU_MIN_K run the Triton kernel
# instead of the tensor-core one (fp4_grouped_linear).
MGPU_MIN_K = 1024
MGPU_MAX_SHORT_K_ROWS = 512


def fp4_grouped_linear(
    x: jax.Array, w: Fp4Weight, group_sizes: jax.Array, *, interpret: bool | None = None
) -> jax.Array:
    """``ragged_dot(x, dequantize(w), group_sizes)`` through a kernel where one applies, else
    dequantize + ``ragged_dot`` (the model's XLA path for rows it does not split into blocks:
    XLA's, or on one Hopper GPU JAX's BF16 grouped kernel, ``bf16_grouped_matmul``).

    A kernel runs when x is bf16 (they are W4A16), a tiling fits the weight
    (``fp4_grouped_matmul_triton.grouped_config``) and there are at most ``PALLAS_MAX_ROWS``
    rows: compiled on a GPU with the tensor-core layout (``prepack_grouped(mgpu=True)``),
    ``fp4_grouped_matmul_mgpu``, except for more than ``MGPU_MAX_SHORT_K_ROWS`` rows with
    K < ``MGPU_MIN_K`` (the Triton kernel measured faster there on the H200: 112 vs 122 us at
    2048 rows, K=768); else ``fp4_grouped_matmul_triton``.

    Args:
      x: [T, K] rows sorted by expert.
      w: ``prepack_grouped`` expert weights [E, K, N].
      group_sizes: [E] int32 rows per expert.
      interpret: run the kernel in the Pallas interpreter; default: unless on a GPU.
    Returns:
      [T, N] in x's dtype, accumulated in float32.
    """
    e, k, n = w.shape
    cfg = gt.grouped_config(x.shape[0], e, k, n, w.fmt)
    if x.dtype == jnp.bfloat16 and cfg is not None and x.shape[0] <= PALLAS_MAX_ROWS:
        if interpret is None:
            interpret = jax.default_backend() != "gpu"
        if (
            w.mgpu is not None
            and not interpret
            and (k >= MGPU_MIN_K or x.shape[0] <= MGPU_MAX_SHORT_K_ROWS)
        ):
            return fmm.fp4_grouped_matmul_mgpu(x, w.mgpu, group_sizes)
        return gt.fp4_grouped_matmul_triton(x, w, group_sizes, config=cfg, interpret=interpret)
    wx = fp4.dequantize(w.qtensor, x.dtype)
    if bf16_grouped_matmul.applies(x, wx):  # as the model's path: no [T, E * N] dense product
        return bf16_grouped_matmul.ragged_dot(x, wx, group_sizes)
    y = jax.lax.ragged_dot(x, wx, group_sizes, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def fp4_grouped_matmul_reference(
    x: jax.Array, w: QTensor | Fp4Weight, group_sizes: jax.Array
) -> jax.Array:
    """Pure-JAX definition: fp32 ``ragged_dot(x, dequantize(w), group_sizes)`` rounded to bf16."""
    qt = w.qtensor if isinstance(w, Fp4Weight) else w
    wf = fp4.dequantize(qt, jnp.float32)
    y = jax.lax.ragged_dot(
        x.astype(jnp.float32),
        wf,
        group_sizes.astype(jnp.int32),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return y.astype(jnp.bfloat16)
