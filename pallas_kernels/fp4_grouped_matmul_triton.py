"""Grouped (MoE) FP4 matmul kernel for Hopper GPUs (Pallas, Triton lowering):
``ragged_dot(x, dequantize(W), group_sizes)``; its reference is
``fp4_grouped_matmul.fp4_grouped_matmul_reference``.

Rows of ``x`` are sorted by expert; expert ``e`` owns ``group_sizes[e]`` consecutive rows and
multiplies them by its own FP4 weight ``W[e]`` [K, N]. The weights are one ``QTensor`` of shape
[E, K, N] quantized along K (axis 1), stored as codes [E, N, K/2] and scales [E, N, K/block].

One program per (expert, block of N): it walks its expert's rows in blocks of ``block_m`` and, for
each, streams the expert's weight tile along K exactly as the dense kernel does (``fp4_matmul``:
operands swapped, even/odd K halves, in-register dequantization; ``fp4_matmul_triton``). An
expert with no rows runs zero iterations and reads none of its weights, so the bytes moved are
those of the experts hit. Which grouped kernel a call runs is ``fp4_grouped_matmul``'s choice.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dequant import dequantize_tile
from pallas_kernels.fp4_matmul_triton import Fp4MatmulConfig
from pallas_kernels.layouts import Fp4Weight, prepack_grouped
from trace_jax import fp4
from trace_jax.fp4 import QTensor


def default_grouped_config(rows: int, experts: int, k: int, n: int) -> Fp4MatmulConfig:
    """Tuned defaults (H200): ``rows`` routed rows (tokens x top-k) over ``experts`` experts."""
    del rows, experts, k, n
    return Fp4MatmulConfig(block_n=64, block_k=128, block_m=16, split_k=1, num_stages=3)


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
def fp4_grouped_matmul_triton(
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
