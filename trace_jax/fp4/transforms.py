"""Quantization transforms for training: straight-through fake quant and TRACE's guided rounding.

``straight_through`` is the one custom_vjp of the package: the forward returns a quantized value
computed without gradient, the backward passes the cotangent to ``x`` unchanged (optionally
masked). ``fake_quant`` and ``guided_fake_quant`` only differ in how they compute that value.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.fp4 import e2m1
from trace_jax.fp4.formats import E2M1_MAX, E8M0_NAN, FormatSpec
from trace_jax.fp4.qtensor import QTensor, stored_shape
from trace_jax.fp4.quantize import (
    GlobalScaleMode,
    Rounding,
    ScaleRule,
    block_scale_values,
    dequantize,
    from_blocks,
    normalise,
    quantize,
    to_blocks,
    unpacked_codes,
)

# ----------------------------------------------------------------------------- the STE


@jax.custom_vjp
def straight_through(x: jax.Array, forward_value: jax.Array, grad_mask: jax.Array | None):
    """Return ``forward_value``; d/dx is the identity, times ``grad_mask`` where given.

    Args:
      x: [...] the input the gradient flows to.
      forward_value: [...] same shape and dtype as ``x``; receives no gradient.
      grad_mask: None or [...] bool, False where the gradient is zeroed.
    """
    return forward_value


def _st_fwd(x, forward_value, grad_mask):
    return forward_value, grad_mask


def _st_bwd(grad_mask, g):
    gx = g if grad_mask is None else jnp.where(grad_mask, g, jnp.zeros_like(g))
    mask_ct = None if grad_mask is None else np.zeros(grad_mask.shape, jax.dtypes.float0)
    return gx, jnp.zeros_like(g), mask_ct


straight_through.defvjp(_st_fwd, _st_bwd)


def _in_range(z: jax.Array, axis: int) -> jax.Array:
    """|z| <= 6 for normalised blocks z -> bool mask in the logical layout."""
    return from_blocks(jnp.abs(z) <= E2M1_MAX, axis)


# ----------------------------------------------------------------------------- fake quant


@functools.partial(
    jax.jit,
    static_argnames=(
        "fmt",
        "axis",
        "global_scale",
        "rounding",
        "scale_rule",
        "block_2d",
        "mask_outside",
    ),
)
def fake_quant(
    x: jax.Array,
    fmt: str | FormatSpec = "nvfp4",
    *,
    axis: int = -1,
    global_scale: GlobalScaleMode = "tensor",
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    scale_rule: ScaleRule = "max6",
    block_2d: bool = False,
    mask_outside: bool = False,
) -> jax.Array:
    """Quantize-dequantize forward, straight-through backward (vanilla QAT).

    Args:
      x: [...] float; see ``quantize`` for the other quantization arguments.
      mask_outside: zero the gradient where ``|x / scale| > 6`` (outside the representable range
        of the block; with scales computed from ``x`` itself this only happens where the E4M3
        scale rounded down).
    Returns:
      [...] same dtype as ``x``: ``dequantize(quantize(x))``.
    """
    xs = jax.lax.stop_gradient(x)
    qt = quantize(
        xs,
        fmt,
        axis=axis,
        global_scale=global_scale,
        rounding=rounding,
        key=key,
        scale_rule=scale_rule,
        block_2d=block_2d,
    )
    mask = None
    if mask_outside:
        mask = _in_range(
            _normalised_by(xs, qt.block_scales, qt.global_scale, qt.fmt, qt.axis), qt.axis
        )
    return straight_through(x, dequantize(qt, x.dtype), mask)


def _normalised_by(x, block_scales, s_g, fmt, axis):
    blocks = to_blocks(x, axis, fmt.block_size)
    return normalise(blocks, block_scale_values(block_scales, fmt), s_g, fmt)


# ----------------------------------------------------------------------------- guidance


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Guidance:
    """What the rollout keeps of one quantization site (TRACE sections 3-4).

    Attributes:
      mantissa_bits: [*S[:-1], K // 8] uint8, the mantissa bit of every rollout code packed eight
        per byte (element 8i+j in bit j), in the stored layout of the ``QTensor``.
      block_scales: the rollout's block scales, as in ``QTensor``.
      global_scale: the rollout's global scale(s), as in ``QTensor``.
      fmt, shape, axis: as in ``QTensor`` (static).
    """

    mantissa_bits: jax.Array
    block_scales: jax.Array
    global_scale: jax.Array
    fmt: FormatSpec = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        """Bytes of the record: mantissa bits, block scales and global scale(s)."""
        arrays = (self.mantissa_bits, self.block_scales, self.global_scale)
        return sum(int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize for a in arrays)

    @property
    def bits_per_element(self) -> float:
        return 8.0 * self.nbytes / max(1, int(np.prod(self.shape)))


@jax.jit  # one program for eager callers (the guidance cache), not one per unpack/pack step
def rollout_guidance(qt: QTensor) -> Guidance:
    """The compact guidance record of a rollout-side ``QTensor``: 1 mantissa bit + scales."""
    codes = e2m1.unpack_nibbles(qt.codes)
    return Guidance(
        mantissa_bits=e2m1.pack_bits(e2m1.mantissa_bit(codes)),
        block_scales=qt.block_scales,
        global_scale=qt.global_scale,
        fmt=qt.fmt,
        shape=qt.shape,
        axis=qt.axis,
    )


def with_row_global_scale(record: QTensor | Guidance) -> QTensor | Guidance:
    """``record`` with an NVFP4 per-tensor global scale repeated on every row ([*S[:-1], 1]), so
    that rows recorded in different chunks (a prefill, then one decode step after another) each
    keep the scale they were quantized with. Records with per-row scales, and MXFP4's unit
    placeholder, are returned as they are."""
    if not record.fmt.has_global_scale or jnp.ndim(record.global_scale) > 0:
        return record
    rows = record.block_scales.shape[:-1]
    return dataclasses.replace(
        record, global_scale=jnp.broadcast_to(record.global_scale, (*rows, 1))
    )


def take_rows(record: QTensor | Guidance, rows: jax.Array) -> QTensor | Guidance:
    """The rows ``rows`` ([R] int) of a record's leading (batch) axis, which must not be the
    quantized one; a per-tensor global scale is kept as it is."""
    if record.axis == 0:
        raise ValueError(f"take_rows: axis 0 of shape {record.shape} is the quantized axis")
    shape = (len(rows), *record.shape[1:])
    return _map_arrays(record, lambda a: a if jnp.ndim(a) == 0 else a[rows], shape)


def take_slots(record: QTensor | Guidance, width: int) -> QTensor | Guidance:
    """The first ``width`` slots (axis 1, after the batch axis) of a record [B, S, ..., K]
    quantized along a later axis; a per-tensor global scale is kept as it is."""
    if record.axis <= 1:
        raise ValueError(f"take_slots: axis {record.axis} of shape {record.shape} is quantized")
    shape = (record.shape[0], min(width, record.shape[1]), *record.shape[2:])
    return _map_arrays(record, lambda a: a if jnp.ndim(a) < 2 else a[:, :width], shape)


def _map_arrays(record: QTensor | Guidance, fn, shape: tuple[int, ...]):
    """``record`` with ``fn`` applied to each of its arrays and the logical ``shape``."""
    fields = [f.name for f in dataclasses.fields(record) if not f.metadata.get("static")]
    return dataclasses.replace(record, **{f: fn(getattr(record, f)) for f in fields}, shape=shape)


def _check_guidance(x: jax.Array, guidance: Guidance) -> None:
    if tuple(x.shape) != tuple(guidance.shape):
        raise ValueError(
            f"guidance was recorded for a tensor of shape {guidance.shape}, got {tuple(x.shape)}"
        )


@jax.jit
def guided_quantize(x: jax.Array, guidance: Guidance) -> QTensor:
    """Training-side quantization of ``x`` guided by the rollout's record (TRACE section 3).

    1. ``z = clip(x / s_rollout, -6, 6)`` with the rollout's block and global scales;
    2-3. between the two codes adjacent to ``z`` pick the one whose mantissa bit is the rollout's
       (``z`` exactly on a code keeps it).

    Non-finite inputs stay visible as ``quantize`` makes them: a NaN or +-Inf in an NVFP4 group
    (the row for a per-row global scale, else the tensor) makes that group's global scale NaN, one
    in an MXFP4 block makes its scale the E8M0 NaN; every element depending on such a scale
    dequantizes to NaN (the codes alone could not say so: clipping would turn Inf into +-6).

    Args:
      x: [...] float, the training side's input at the site; ``x.shape == guidance.shape``.
      guidance: the rollout's ``Guidance`` for the same sample and site.
    Returns:
      a ``QTensor`` carrying the rollout's scales and the guided codes.
    """
    _check_guidance(x, guidance)
    fmt = guidance.fmt
    z = _normalised_by(x, guidance.block_scales, guidance.global_scale, fmt, guidance.axis)
    z = jnp.clip(z, -E2M1_MAX, E2M1_MAX)
    bits = e2m1.unpack_bits(guidance.mantissa_bits).reshape(z.shape)
    codes = e2m1.guided_round(z, bits)
    bad_block = ~jnp.all(jnp.isfinite(to_blocks(x, guidance.axis, fmt.block_size)), axis=-1)
    block_scales, s_g = guidance.block_scales, guidance.global_scale
    if fmt.has_global_scale:
        per_row = jnp.ndim(s_g) > 0
        bad = jnp.any(bad_block, axis=-1, keepdims=True) if per_row else jnp.any(bad_block)
        s_g = jnp.where(bad, jnp.float32(jnp.nan), s_g)
    else:
        block_scales = jnp.where(bad_block, jnp.uint8(E8M0_NAN), block_scales)
    return QTensor(
        codes=e2m1.pack_nibbles(codes.reshape(*codes.shape[:-2], -1)),
        block_scales=block_scales,
        global_scale=s_g,
        fmt=fmt,
        shape=guidance.shape,
        axis=guidance.axis,
    )


@functools.partial(jax.jit, static_argnames=("mask_outside",))
def guided_fake_quant(x: jax.Array, guidance: Guidance, *, mask_outside: bool = False):
    """Rollout-guided fake quant: forward ``s_rollout * q*``, straight-through backward.

    Args:
      x: [...] float; ``x.shape == guidance.shape``.
      guidance: the rollout's record for this sample and site.
      mask_outside: zero the gradient where ``|x / s_rollout| > 6``.
    Returns:
      [...] same dtype as ``x``.
    """
    xs = jax.lax.stop_gradient(x)
    qt = guided_quantize(xs, guidance)
    mask = None
    if mask_outside:
        z = _normalised_by(xs, guidance.block_scales, guidance.global_scale, qt.fmt, qt.axis)
        mask = _in_range(z, qt.axis)
    return straight_through(x, dequantize(qt, x.dtype), mask)


@jax.jit  # one program for eager callers, not one per unpack/decode step
def code_values(qt: QTensor) -> jax.Array:
    """The E2M1 values (before scaling) of ``qt`` in its logical layout, float32."""
    return from_blocks(e2m1.decode_e2m1(unpacked_codes(qt)), qt.axis)


def guidance_nbytes(
    shape: tuple[int, ...],
    fmt: FormatSpec,
    axis: int = -1,
    global_scale: GlobalScaleMode = "tensor",
) -> int:
    """Bytes of the ``Guidance`` record for a tensor of ``shape`` (no arrays needed)."""
    stored = stored_shape(tuple(shape), axis % len(shape))
    rows = int(np.prod(stored[:-1]))
    k = stored[-1]
    n = rows * k // 8 + rows * (k // fmt.block_size)
    if fmt.has_global_scale:
        n += 4 * (rows if global_scale == "row" else 1)
    return n
