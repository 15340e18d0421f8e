"""Grouped (MoE) FP4 matmul for Hopper GPUs: ``ragged_dot(x, dequantize(W), group_sizes)``.

Rows of ``x`` are sorted by expert; expert ``e`` owns ``group_sizes[e]`` consecutive rows and
multiplies them by its own FP4 weight ``W[e]`` [K, N]. The weights are one ``QTensor`` of shape
[E, K, N] quantized along K (axis 1), stored as codes [E, N, K/2] and scales [E, N, K/block].

One program per (expert, block of N): it walks its expert's rows in blocks of ``block_m`` and, for
each, streams the expert's weight tile along K exactly as the dense kernel does (``fp4_matmul``:
operands swapped, even/odd K halves, in-register dequantization). An expert with no rows runs
zero iterations and reads none of its weights, so the bytes moved are those of the experts hit.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import fp4_matmul_mgpu as fmm
from pallas_kernels.fp4_matmul import (
    Fp4MatmulConfig,
    Fp4Weight,
    _prepack_arrays,
    dequantize_tile,
)
from trace_jax import fp4
from trace_jax.fp4 import QTensor


def default_grouped_config(rows: int, experts: int, k: int, n: int) -> Fp4MatmulConfig:
    """Tuned defaults (H200): ``rows`` routed rows (tokens x top-k) over ``experts`` experts."""
    del rows, experts, k, n
    return Fp4MatmulConfig(block_n=64, block_k=128, block_m=16, split_k=1, num_stages=3)


def prepack_grouped(w: QTensor, *, mgpu: bool = True) -> Fp4Weight:
    """Arrange expert weights ``QTensor`` [E, K, N] (quantized along K, axis 1) for the kernel.

    Also takes the per-expert form ``jax.vmap(quantize)`` makes of [E, K, N] weights (logical
    shape [K, N], axis 0, arrays with a leading expert axis, one global scale per expert): the
    stored bytes are the same; the global scales become per-row ones.

    ``mgpu``: for K and N multiples of 64, also store the tensor-core kernel's layout
    (``fp4_matmul_mgpu.fp4_grouped_matmul_mgpu``; one more copy of the codes), which
    ``fp4_grouped_linear`` then runs on a GPU: the faster grouped kernel measured on the H200
    (BENCHMARKS.md).
    """
    w = stack_experts(w)
    if len(w.shape) != 3 or w.axis != 1:
        raise ValueError(
            f"fp4_grouped_matmul needs weights [E, K, N] quantized along axis 1, got shape "
            f"{w.shape} axis {w.axis}"
        )
    packed = _prepack_arrays(w)
    _, k, n = w.shape
    if mgpu and fmm.default_on(w.fmt, k, n):
        packed = dataclasses.replace(packed, mgpu=fmm.prepack_mgpu(w, packed))
    return packed


def stack_experts(w: QTensor) -> QTensor:
    """A per-expert ``jax.vmap(quantize)`` ``QTensor`` -> the same bytes as one [E, K, N]
    ``QTensor`` along axis 1 whose per-row global scales [E, N, 1] repeat each expert's scale.
    Anything else is returned unchanged."""
    if not (len(w.shape) == 2 and w.axis == 0 and w.codes.ndim == 3):
        return w
    e, (k, n) = w.codes.shape[0], w.shape
    g = jnp.asarray(w.global_scale, jnp.float32)
    g = jnp.broadcast_to(g.reshape(e, 1, 1) if g.ndim == 1 else g, (e, n, 1))
    return QTensor(
        codes=w.codes,
        block_scales=w.block_scales,
        global_scale=g,
        fmt=w.fmt,
        shape=(e, k, n),
        axis=1,
    )


def _grouped_kernel(
    start_ref,
    size_ref,
    xe_ref,
    xo_ref,
    c_ref,
    s_ref,
    off_ref,
    g_ref,
    _zeros_ref,
    o_ref,
    *,
    fmt,
    cfg,
    rows,
):
    kb = cfg.block_k // 2
    sb = cfg.block_k // fmt.block_size
    steps = c_ref.shape[-1] // kb
    start = start_ref[0]
    size = size_ref[0]
    offset = off_ref[0]
    scale = g_ref[...]
    dims = (((1,), (1,)), ((), ()))

    def row_block(r, carry):
        first = start + r * cfg.block_m
        # Keep the window inside x (rows >= block_m is guaranteed by padding) and mask the rows
        # that belong to other experts.
        window = jnp.minimum(first, rows - cfg.block_m)
        row_ids = window + jax.lax.broadcasted_iota(jnp.int32, (cfg.block_m, 1), 0)
        mine = (row_ids >= first) & (row_ids < start + size)

        def k_step(t, acc):
            c = c_ref[:, pl.ds(t * kb, kb)]
            s = s_ref[:, pl.ds(t * sb, sb)]
            w_even, w_odd = dequantize_tile(c, s, offset, fmt, cfg.dequant)
            x_even = plgpu.load(xe_ref.at[pl.ds(window, cfg.block_m), pl.ds(t * kb, kb)])
            x_odd = plgpu.load(xo_ref.at[pl.ds(window, cfg.block_m), pl.ds(t * kb, kb)])
            acc += jax.lax.dot_general(w_even, x_even, dims, preferred_element_type=jnp.float32)
            acc += jax.lax.dot_general(w_odd, x_odd, dims, preferred_element_type=jnp.float32)
            return acc

        acc = jnp.zeros((cfg.block_n, cfg.block_m), jnp.float32)
        acc = jax.lax.fori_loop(0, steps, k_step, acc)
        y = (acc * scale[:, None]).T.astype(o_ref.dtype)
        plgpu.store(o_ref.at[pl.ds(window, cfg.block_m), :], y, mask=mine)
        return carry

    jax.lax.fori_loop(0, pl.cdiv(size, cfg.block_m), row_block, 0)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def fp4_grouped_matmul(
    x: jax.Array,
    w: QTensor | Fp4Weight,
    group_sizes: jax.Array,
    *,
    config: Fp4MatmulConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``ragged_dot`` with FP4 expert weights dequantized in the kernel.

    Args:
      x: [T, K] bf16 rows sorted by expert.
      w: expert weights [E, K, N] as a ``QTensor`` quantized along axis 1, or its
        ``prepack_grouped``.
      group_sizes: [E] int32 rows per expert (sum <= T; rows past the sum come out zero).
      config: tiling (``split_k`` must be 1); ``default_grouped_config`` when None.
      interpret: run the Pallas interpreter (CPU tests).
    Returns:
      [T, N] bf16.
    """
    w = w if isinstance(w, Fp4Weight) else prepack_grouped(w)
    e, k, n = w.shape
    t = x.shape[0]
    fmt = w.fmt
    if x.shape != (t, k) or group_sizes.shape != (e,):
        raise ValueError(
            f"fp4_grouped_matmul: x {x.shape}, group_sizes {group_sizes.shape} do not match "
            f"weights {w.shape}"
        )
    cfg = config or default_grouped_config(t, e, k, n)
    if interpret:
        cfg = dataclasses.replace(cfg, dequant="portable")
    if cfg.split_k != 1 or n % cfg.block_n or k % cfg.block_k:
        raise ValueError(f"fp4_grouped_matmul: config {cfg} does not tile K={k} N={n}")
    rows = max(t, cfg.block_m)
    x = x.astype(jnp.bfloat16)
    if rows != t:
        x = jnp.pad(x, ((0, rows - t), (0, 0)))
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    out = jnp.zeros((rows, n), jnp.bfloat16)
    kernel = functools.partial(_grouped_kernel, fmt=fmt, cfg=cfg, rows=rows)
    out = pl.pallas_call(
        kernel,
        grid=(e, n // cfg.block_n),
        in_specs=[
            pl.BlockSpec((1,), lambda g, i: (g,)),
            pl.BlockSpec((1,), lambda g, i: (g,)),
            pl.BlockSpec((rows, k // 2), lambda g, i: (0, 0)),
            pl.BlockSpec((rows, k // 2), lambda g, i: (0, 0)),
            pl.BlockSpec((None, cfg.block_n, k // 2), lambda g, i: (g, i, 0)),
            pl.BlockSpec((None, cfg.block_n, k // fmt.block_size), lambda g, i: (g, i, 0)),
            pl.BlockSpec((1,), lambda g, i: (0,)),
            pl.BlockSpec((None, cfg.block_n), lambda g, i: (g, i)),
            pl.BlockSpec((rows, cfg.block_n), lambda g, i: (0, i)),
        ],
        out_specs=pl.BlockSpec((rows, cfg.block_n), lambda g, i: (0, i)),
        out_shape=jax.ShapeDtypeStruct((rows, n), jnp.bfloat16),
        input_output_aliases={8: 0},
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"fp4_grouped_matmul_{fmt.name}",
    )(
        starts,
        sizes,
        x[:, 0::2],
        x[:, 1::2],
        w.codes,
        w.scales,
        w.scale_offset.reshape(1),
        w.out_scale,
        out,
    )
    return out[:t]


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


# ----------------------------------------------------------------------------- dispatch

# Most routed rows (tokens x top-k) at which the kernel was measured against XLA's ragged_dot
# (H200, BENCHMARKS.md: 9.7-10.4x faster at 2048 rows); beyond it the crossover is not measured
# and the dispatcher uses XLA.
PALLAS_MAX_ROWS = 2048
# Above MGPU_MAX_SHORT_K_ROWS rows, contractions shorter than MGPU_MIN_K run this module's
# kernel instead of the tensor-core one (fp4_grouped_linear).
MGPU_MIN_K = 1024
MGPU_MAX_SHORT_K_ROWS = 512


def grouped_config(rows: int, experts: int, k: int, n: int, fmt: fp4.FormatSpec):
    """``default_grouped_config`` with block_n / block_k narrowed to divide N / K (small models);
    None where no tiling fits (block_n >= 16, block_k >= two scale blocks)."""
    cfg = default_grouped_config(rows, experts, k, n)
    block_n, block_k = _pow2_divisor(n, cfg.block_n), _pow2_divisor(k, cfg.block_k)
    if block_n < 16 or block_k < max(16, 2 * fmt.block_size):
        return None
    return dataclasses.replace(cfg, block_n=block_n, block_k=block_k)


def _pow2_divisor(v: int, most: int) -> int:
    """The largest power of two <= ``most`` dividing ``v``."""
    return min(most, v & -v)


def fp4_grouped_linear(
    x: jax.Array, w: Fp4Weight, group_sizes: jax.Array, *, interpret: bool | None = None
) -> jax.Array:
    """``ragged_dot(x, dequantize(w), group_sizes)`` through the kernel where it applies, else
    dequantize + XLA ``ragged_dot`` (the model's XLA path, bit for bit).

    The kernel runs when x is bf16 (it is W4A16), a tiling fits the weight (``grouped_config``)
    and there are at most ``PALLAS_MAX_ROWS`` rows: compiled on a GPU with the tensor-core
    layout (``prepack_grouped(mgpu=True)``), ``fp4_grouped_matmul_mgpu``, except for more
    than ``MGPU_MAX_SHORT_K_ROWS`` rows with K < ``MGPU_MIN_K`` (this module's kernel
    measured faster there on the H200: 112 vs 122 us at 2048 rows, K=768); else this module's
    kernel.

    Args:
      x: [T, K] rows sorted by expert.
      w: ``prepack_grouped`` expert weights [E, K, N].
      group_sizes: [E] int32 rows per expert.
      interpret: run the kernel in the Pallas interpreter; default: unless on a GPU.
    Returns:
      [T, N] in x's dtype, accumulated in float32.
    """
    e, k, n = w.shape
    cfg = grouped_config(x.shape[0], e, k, n, w.fmt)
    if x.dtype == jnp.bfloat16 and cfg is not None and x.shape[0] <= PALLAS_MAX_ROWS:
        if interpret is None:
            interpret = jax.default_backend() != "gpu"
        if (
            w.mgpu is not None
            and not interpret
            and (k >= MGPU_MIN_K or x.shape[0] <= MGPU_MAX_SHORT_K_ROWS)
        ):
            return fmm.fp4_grouped_matmul_mgpu(x, w.mgpu, group_sizes)
        return fp4_grouped_matmul(x, w, group_sizes, config=cfg, interpret=interpret)
    wx = fp4.dequantize(w.qtensor, x.dtype)
    y = jax.lax.ragged_dot(x, wx, group_sizes, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
