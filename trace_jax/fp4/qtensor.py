"""``QTensor``: the one quantized-tensor type of the project (a pytree)."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from trace_jax.fp4.formats import FormatSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
    """A block-scaled FP4 tensor.

    Storage layout: the quantized axis (``axis`` of the logical shape) is moved last, so that for
    a logical shape ``shape`` the *stored* shape is ``S = moveaxis(shape, axis, -1)`` with last
    dimension K. A weight ``W: [K, N]`` quantized along its contraction axis 0 is therefore stored
    as ``[N, K/2]`` codes and ``[N, K/block]`` scales, which is how NVFP4 serving checkpoints lay
    out ``[out, in]`` weights.

    Attributes:
      codes: ``[*S[:-1], K // 2]`` uint8; two E2M1 codes per byte, element 2i in the low nibble,
        sign in bit 3 of each nibble.
      block_scales: ``[*S[:-1], K // block]``; ``float8_e4m3fn`` for NVFP4, uint8 biased E8M0
        exponents for MXFP4. 2-D (16x16) blocks store their scale once per row of the tile.
      global_scale: float32, shape ``()`` (per tensor) or ``[*S[:-1], 1]`` (per row); 1.0 for MXFP4.
      fmt: the format spec (static).
      shape: the logical shape (static).
      axis: the quantized logical axis, non-negative (static).
    """

    codes: jax.Array
    block_scales: jax.Array
    global_scale: jax.Array
    fmt: FormatSpec = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The logical shape with ``axis`` moved last (the unpacked layout of ``codes``)."""
        return stored_shape(self.shape, self.axis)

    @property
    def per_row_global_scale(self) -> bool:
        return np.ndim(self.global_scale) > 0

    @property
    def nbytes(self) -> int:
        """Bytes of codes, block scales and global scale(s)."""
        return sum(_nbytes(a) for a in (self.codes, self.block_scales, self.global_scale))

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def stored_shape(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    dims = list(shape)
    k = dims.pop(axis)
    return (*dims, k)


def _nbytes(a) -> int:
    return int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize
