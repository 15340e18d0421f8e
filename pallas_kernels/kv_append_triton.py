"""The KV append kernel (Pallas, Triton lowering): one new row per sequence written into each of
several cache buffers in place, all buffers in one launch. Its reference is
``trace_jax.fp4.kv_format.write`` of a one-token chunk; ``fp4_decode_attention.kv_append`` is
the op that chooses between the two.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_layout import row_views
from trace_jax.fp4.kv_format import Stored


def kernel_fits(stored: list[Stored]) -> bool:
    """Whether the compiled kernel takes these buffers: every per-token tile [Hkv, X]
    (X = D, D/2, D/block or 1) has power-of-two sides (a Triton block-shape rule)."""
    pow2 = lambda v: v & (v - 1) == 0  # noqa: E731
    return all(pow2(a.shape[2]) and pow2(a.shape[3]) for a in row_views(stored))


def _append_kernel(slot_ref, *refs, n):
    rows, outs = refs[:n], refs[2 * n :]
    slot = slot_ref[0]

    @pl.when(slot >= 0)
    def _write():
        for row, out in zip(rows, outs, strict=True):
            out[slot] = row[...]


def append_rows(
    bufs: list[jax.Array], rows: list[jax.Array], slots: jax.Array, *, interpret: bool = False
) -> list[jax.Array]:
    """Write one row per sequence into each buffer in place, all buffers in one launch.

    Args:
      bufs: [B, S, H, X] arrays (donate them: outputs alias inputs, only the rows are written).
      rows: [B, H, X] arrays, one per buffer, of the buffer's dtype.
      slots: [B] int32, the slot each sequence's row goes to; negative: not written.
    Returns:
      the updated buffers.
    """
    n = len(bufs)
    b, s = bufs[0].shape[:2]
    for buf, row in zip(bufs, rows, strict=True):
        if buf.ndim != 4 or buf.shape[:2] != (b, s) or row.shape != (b, *buf.shape[2:]):
            raise ValueError(f"append_rows: row {row.shape} does not fit buffer {buf.shape}")
    return pl.pallas_call(
        functools.partial(_append_kernel, n=n),
        grid=(b,),
        in_specs=[pl.BlockSpec((1,), lambda i: (i,))]
        + [pl.BlockSpec((None, *r.shape[1:]), lambda i: (i, 0, 0)) for r in rows]
        + [pl.BlockSpec((None, *a.shape[1:]), lambda i: (i, 0, 0, 0)) for a in bufs],
        out_specs=[pl.BlockSpec((None, *a.shape[1:]), lambda i: (i, 0, 0, 0)) for a in bufs],
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in bufs],
        input_output_aliases={1 + n + i: i for i in range(n)},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="kv_append",
    )(slots, *rows, *bufs)
