"""Block-scaled FP4 quantization: ``quantize(x, fmt) -> QTensor`` and ``dequantize``.

Encoding rules (bit-exact with the public references; ``tests/fp4`` checks them against torchao):

NVFP4, per group (the whole tensor, or one row for ``global_scale="row"``)::

    s_g  = amax(|x|) / (6 * 448)                  # FP32 global scale
    s_b  = E4M3(clip((amax_block / 6) / s_g, 2**-6, 448))
    q    = RTNE_E2M1(clip(x * ((1 / s_g) / s_b), -6, 6))
    x^   = (q * s_b) * s_g

The reciprocal-multiply order is the one NVIDIA's quantization kernels (and torchao's reference)
use; it decides the rare inputs that sit within an ulp of a rounding midpoint.
A group whose amax is 0 gets ``s_g = 1`` (all codes 0); ``s_g`` is kept >= the smallest normal
float32 so it never becomes a subnormal that backends flush to zero.

MXFP4 (OCP MX v1.0, section 6.3), per block of 32::

    e    = floor(log2(amax_block)) - 2            # from the float32 exponent bits
    s_b  = 2**clip(e, -127, 127)                  # stored as a biased E8M0 byte
    q    = RTNE_E2M1(clip(x / max(s_b, 2**-126), -6, 6))

E8M0 code 0 (2**-127, subnormal in float32) is decoded as 2**-126, the value the quantizer
divides by, so that encode and decode agree on every backend.

Non-finite inputs propagate, loudly: a NaN or +-Inf anywhere in an NVFP4 group makes its global
scale NaN, and an MXFP4 block containing one gets the E8M0 NaN scale (0xFF); every element that
depends on such a scale dequantizes to NaN. There is no silent finite result.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.fp4 import e2m1
from trace_jax.fp4.formats import (
    E2M1_EMAX,
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MAX_FOUR_OVER_SIX,
    E4M3_MIN_NORMAL,
    E8M0_BIAS,
    E8M0_NAN,
    F32_MIN_NORMAL,
    FormatSpec,
    get_format,
)
from trace_jax.fp4.qtensor import QTensor, stored_shape

GlobalScaleMode = Literal["tensor", "row"]
Rounding = Literal["nearest", "stochastic"]
ScaleRule = Literal["max6", "four_over_six"]


# ----------------------------------------------------------------------------- layout helpers


def to_blocks(x: jax.Array, axis: int, block_size: int) -> jax.Array:
    """Logical [..., K, ...] -> stored-layout blocks [*S[:-1], K // block, block] float32.

    A bf16 input is rounded to bf16 again, explicitly, after the widening: the quantizer must
    see the bf16 values a kernel reading the materialised array sees, and XLA (excess precision,
    on by default on the GPU) may drop a float32 -> bf16 -> float32 pair inside a fusion; a
    ``reduce_precision`` stays (a no-op on values that are bf16 already)."""
    xm = jnp.moveaxis(x, axis, -1)
    x32 = xm.astype(jnp.float32)
    if xm.dtype == jnp.bfloat16:
        x32 = jax.lax.reduce_precision(x32, exponent_bits=8, mantissa_bits=7)
    return x32.reshape(*x32.shape[:-1], x32.shape[-1] // block_size, block_size)


def from_blocks(blocks: jax.Array, axis: int) -> jax.Array:
    """Inverse of ``to_blocks`` (without the dtype change)."""
    xm = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1])
    return jnp.moveaxis(xm, -1, axis)


def _block_reduce(per_element: jax.Array, block_2d: bool, op) -> jax.Array:
    """Reduce [..., R, K/b, b] over each block (1-D) or each b x b tile (2-D) -> [..., R, K/b].

    2-D tiles cover ``b`` consecutive rows; their result is repeated on each of those rows.
    """
    if not block_2d:
        return op(per_element, axis=-1)
    *lead, rows, nb, b = per_element.shape
    tiles = per_element.reshape(*lead, rows // b, b, nb, b)
    reduced = op(tiles, axis=(-3, -1))  # [..., R/b, K/b]
    return jnp.repeat(reduced, b, axis=-2)


# ----------------------------------------------------------------------------- scales


def exact_div(a: jax.Array, b) -> jax.Array:
    """IEEE float32 ``a / b`` (round to nearest even), the same bits on every backend.

    On the CPU, XLA's division behind an optimization barrier (IEEE there, with subnormals
    flushed); elsewhere ``integer_div``, which computes the same bits without trusting the
    backend's division.
    """
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))

    def barrier_div(a, b):
        a, b = jax.lax.optimization_barrier((a, b))
        return a / b

    return jax.lax.platform_dependent(a, b, cpu=barrier_div, default=integer_div)


def integer_div(a: jax.Array, b) -> jax.Array:
    """IEEE float32 ``a / b`` (round to nearest even) that does not trust the backend's division.

    The formats' reference encoders divide in IEEE float32, and a scale one ulp off changes
    codes. XLA's own ``divide`` is not that everywhere: on the GPU it is ``div.full.f32``
    (within 2 ulp; about 29 % of random quotients differ from IEEE's in the last bit, measured
    with ``experiments/bench/gpu_numerics.py``), and the algebraic simplifier turns divisions by
    constants into multiplications by rounded reciprocals. Here the backend's quotient of the
    two significands is only a first guess ``q0``: the remainder ``A * 2**23 - q0 * B`` of the
    integer significands is exact in wrapping uint32 arithmetic (it is small), and
    ``nearest_even_quotient`` corrects the guess with it.

    Args:
      a, b: float32 arrays (or scalars) that broadcast together.
    Returns:
      float32 ``a / b`` of the broadcast shape: IEEE 754 bit for bit (NaN results canonical),
      with subnormals flushed to a zero of their sign on the way in and on the way out (as
      XLA:CPU's own arithmetic does; the FP4 scales never rely on them): a quotient below the
      smallest normal is 0 unless it rounds up to that normal.
    """
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    u32 = jnp.uint32
    ua = jax.lax.bitcast_convert_type(a, u32)
    ub = jax.lax.bitcast_convert_type(b, u32)
    sign = (ua ^ ub) & u32(0x80000000)
    ea = ((ua >> 23) & u32(0xFF)).astype(jnp.int32)
    eb = ((ub >> 23) & u32(0xFF)).astype(jnp.int32)
    ma = (ua & u32(0x7FFFFF)) | u32(0x800000)  # significands in [2**23, 2**24)
    mb = (ub & u32(0x7FFFFF)) | u32(0x800000)
    below = ma < mb
    ma = jnp.where(below, ma << 1, ma)  # ma / mb in [1, 2)
    e = ea - eb + 127 - below.astype(jnp.int32)  # the quotient's biased exponent
    # first guess of round(ma / mb * 2**23) from the backend's division (within a few ulp)
    guess = ma.astype(jnp.float32) / mb.astype(jnp.float32) * np.float32(2.0**23)
    q0 = jnp.clip(guess, 2.0**23 - 8, 2.0**24 + 8).astype(jnp.int32)  # (NaN: masked below)
    q = nearest_even_quotient(ma, mb, q0)
    # q in [2**23, 2**24]: its implicit bit adds 1 to the exponent field (a carry, another)
    bits = (jnp.clip(e, 1, 254) - 1).astype(u32) * u32(1 << 23) + q.astype(u32)
    mag = jnp.where(e >= 255, u32(0x7F800000), jnp.minimum(bits, u32(0x7F800000)))
    # below the normal range: flushed, unless it rounds up to the smallest normal
    mag = jnp.where(e < 1, jnp.where((e == 0) & (q == 1 << 24), u32(0x800000), u32(0)), mag)
    a_zero, b_zero, a_inf, b_inf = ea == 0, eb == 0, ea == 255, eb == 255  # (inf: or NaN)
    mag = jnp.where(a_zero | b_inf, u32(0), mag)
    mag = jnp.where(a_inf | b_zero, u32(0x7F800000), mag)
    nan_in = ((ua & u32(0x7FFFFFFF)) > u32(0x7F800000)) | ((ub & u32(0x7FFFFFFF)) > u32(0x7F800000))
    nan = nan_in | (a_zero & b_zero) | (a_inf & b_inf)
    return jax.lax.bitcast_convert_type(jnp.where(nan, u32(0x7FC00000), sign | mag), jnp.float32)


def nearest_even_quotient(ma: jax.Array, mb: jax.Array, q0: jax.Array) -> jax.Array:
    """round(ma * 2**23 / mb), ties to even, from a guess within 8 of it.

    Args:
      ma: uint32 in [2**23, 2**25), mb: uint32 in [2**23, 2**24), with ma / mb in [1, 2).
      q0: int32 guess, |q0 - ma * 2**23 / mb| < 8.
    Returns:
      int32 in [2**23, 2**24].
    """
    # the exact remainder ma * 2**23 - q0 * mb (|.| < 2**28: exact modulo 2**32), then the
    # nearest multiple of mb (from a float estimate, off by at most one) taken out of it
    rem = jax.lax.bitcast_convert_type((ma << 23) - q0.astype(jnp.uint32) * mb, jnp.int32)
    mbi = mb.astype(jnp.int32)
    k = jnp.round(rem.astype(jnp.float32) / mbi.astype(jnp.float32)).astype(jnp.int32)
    twice = 2 * (rem - k * mbi)  # within (-3 mb, 3 mb): at most one step from the nearest
    q = q0 + k + (twice > mbi).astype(jnp.int32) - (twice < -mbi).astype(jnp.int32)
    # exactly halfway (twice = +-mb: q is the lower / upper neighbour): the even one
    odd = q & 1
    return q + jnp.where(twice == mbi, odd, 0) - jnp.where(twice == -mbi, odd, 0)


def nvfp4_global_scale(amax: jax.Array, e4m3_max: float = E4M3_MAX) -> jax.Array:
    """FP32 global scale ``amax / (6 * e4m3_max)`` with the zero / non-finite rules above."""
    s_g = jnp.maximum(exact_div(amax, E2M1_MAX * e4m3_max), F32_MIN_NORMAL)
    s_g = jnp.where(amax == 0, 1.0, s_g)
    return jnp.where(jnp.isfinite(amax), s_g, jnp.nan).astype(jnp.float32)


def nvfp4_block_scale(amax_block: jax.Array, s_g: jax.Array, target: float = E2M1_MAX):
    """E4M3 block scale mapping the block max to ``target`` (6, or 4 for 4/6). -> float8_e4m3fn."""
    s = exact_div(exact_div(amax_block, target), _expand_rows(s_g, amax_block))
    return jnp.clip(s, E4M3_MIN_NORMAL, E4M3_MAX).astype(jnp.float8_e4m3fn)


def mxfp4_block_scale(amax_block: jax.Array) -> jax.Array:
    """Biased E8M0 exponent ``floor(log2 amax) - 2 + 127`` (uint8), 0xFF for non-finite blocks."""
    exp_bits = (jax.lax.bitcast_convert_type(amax_block, jnp.uint32) >> 23) & 0xFF
    unbiased = exp_bits.astype(jnp.int32) - E8M0_BIAS - E2M1_EMAX
    biased = jnp.clip(unbiased, -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    return jnp.where(jnp.isfinite(amax_block), biased, E8M0_NAN).astype(jnp.uint8)


def e8m0_to_float32(biased: jax.Array) -> jax.Array:
    """Biased E8M0 bytes -> float32 powers of two; 0 decodes as 2**-126, 0xFF as NaN."""
    bits = jnp.maximum(biased.astype(jnp.uint32), 1) << 23
    value = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(biased == E8M0_NAN, jnp.nan, value)


def e4m3_to_float32(scales: jax.Array) -> jax.Array:
    """float8_e4m3fn -> float32 values, from the bits.

    ``astype(float32)`` is not used: XLA on the GPU removes a float32 -> float8 -> float32
    conversion pair (excess precision allowed), so inside one program the encoder would divide
    by the unrounded scale and pick codes for a scale that is never stored. A bitcast is kept.
    """
    b = jax.lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.uint32)
    exp, man = (b >> 3) & 0xF, b & 0x7
    normal = jax.lax.bitcast_convert_type(((exp + 120) << 23) | (man << 20), jnp.float32)
    subnormal = man.astype(jnp.float32) * 2.0**-9  # m/8 * 2**-6
    value = jnp.where(exp == 0, subnormal, normal)
    value = jnp.where((b & 0x7F) == 0x7F, jnp.nan, value)
    return jnp.where(b >= 0x80, -value, value)


def block_scale_values(block_scales: jax.Array, fmt: FormatSpec) -> jax.Array:
    """Stored block scales -> float32 values, same shape."""
    if fmt.scale_format == "e4m3":
        return e4m3_to_float32(block_scales)
    return e8m0_to_float32(block_scales)


def normalise(blocks: jax.Array, scales: jax.Array, s_g: jax.Array, fmt: FormatSpec):
    """Divide by the combined scale, in the order the encoder uses.

    Args:
      blocks: [..., K/b, b] float32.
      scales: [..., K/b] float32 block-scale values.
      s_g: float32 global scale, () or [..., 1].
    Returns:
      [..., K/b, b] float32, not clipped. Zeros stay (signed) zeros: the reciprocal overflows
      to infinity where ``s_g`` is at its floor and a block's scale at E4M3's smallest
      (``1 / 2**-126 / 2**-6``), and ``0 * inf`` would be NaN, whose code each backend's
      min/max would decide differently.
    """
    if fmt.has_global_scale:
        reciprocal = exact_div(exact_div(1.0, _expand_rows(s_g, scales)), scales)
        return jnp.where(blocks == 0, blocks, blocks * reciprocal[..., None])
    return blocks / scales[..., None]


def decode_blocks(codes: jax.Array, scales: jax.Array, s_g: jax.Array) -> jax.Array:
    """Codes [..., K/b, b] uint8 (unpacked) with their scales -> values [..., K/b, b] float32.

    ``q * s_b`` is exact in float32 (E2M1 x E4M3 needs 6 significant bits); one rounding follows.
    """
    return (e2m1.decode_e2m1(codes) * scales[..., None]) * _expand(s_g)


def _expand_rows(s_g: jax.Array, per_block: jax.Array) -> jax.Array:
    """A global scale () or [..., 1] broadcast to per-block values [..., K/b]."""
    return jnp.broadcast_to(s_g, per_block.shape)


def _expand(s_g: jax.Array) -> jax.Array:
    # A per-row scale [..., 1] must broadcast against [..., K/b, b].
    return s_g[..., None] if jnp.ndim(s_g) else s_g


# ----------------------------------------------------------------------------- quantize


def check_quantizable(shape: tuple[int, ...], axis: int, fmt: FormatSpec) -> int:
    """Validate the shape for ``fmt`` along ``axis``; return the non-negative axis."""
    if len(shape) == 0:
        raise ValueError(f"{fmt.name}: cannot quantize a scalar (shape {shape})")
    if not -len(shape) <= axis < len(shape):
        raise ValueError(f"{fmt.name}: axis {axis} is out of range for shape {shape}")
    axis %= len(shape)
    if shape[axis] % fmt.block_size:
        raise ValueError(
            f"{fmt.name}: tensor of shape {shape} has {shape[axis]} elements along the quantized "
            f"axis {axis}, not a multiple of the block size {fmt.block_size}"
        )
    return axis


@functools.partial(
    jax.jit,
    static_argnames=("fmt", "axis", "global_scale", "rounding", "scale_rule", "block_2d"),
)
def quantize(
    x: jax.Array,
    fmt: str | FormatSpec = "nvfp4",
    *,
    axis: int = -1,
    global_scale: GlobalScaleMode = "tensor",
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    scale_rule: ScaleRule = "max6",
    block_2d: bool = False,
) -> QTensor:
    """Quantize ``x`` to NVFP4 or MXFP4 along ``axis`` (the contraction axis).

    Args:
      x: [...] float (bf16/f16/f32); ``x.shape[axis]`` a multiple of the block size.
      fmt: "nvfp4", "mxfp4" or a ``FormatSpec``.
      axis: the axis blocks run along.
      global_scale: "tensor" (the NVFP4 spec) or "row": one global scale per row of the stored
        layout, i.e. per token (per token and head for K/V), so a token's codes do not depend on
        the other tokens of its batch. NVFP4 only.
      rounding: "nearest" (ties to even) or "stochastic" (needs ``key``).
      key: PRNG key for stochastic rounding.
      scale_rule: "max6" (the spec) or "four_over_six": per block, also try mapping the block max
        to 4 and keep whichever has the lower squared error (NVFP4 only; the global scale then
        uses 256 in place of 448).
      block_2d: share one scale per ``b x b`` tile (16x16 for NVFP4) over the last two stored
        axes, as the NVFP4 training recipe does for weights; needs a per-tensor global scale.
    Returns:
      a ``QTensor``.
    """
    spec = get_format(fmt)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{spec.name}: quantize expects a floating-point array, got {x.dtype}")
    axis = check_quantizable(x.shape, axis, spec)
    _check_options(spec, x.shape, axis, global_scale, rounding, key, scale_rule, block_2d)
    blocks = to_blocks(x, axis, spec.block_size)
    if rounding == "nearest":
        key = None
    amax_block = _block_reduce(jnp.abs(blocks), block_2d, jnp.max)

    if spec.has_global_scale:
        e4m3_max = E4M3_MAX_FOUR_OVER_SIX if scale_rule == "four_over_six" else E4M3_MAX
        amax = jnp.max(jnp.abs(blocks), axis=(-2, -1), keepdims=False)
        if global_scale == "tensor":
            amax = jnp.max(amax)
        else:
            amax = amax[..., None]
        s_g = nvfp4_global_scale(amax, e4m3_max)
        stored, codes = _encode(blocks, nvfp4_block_scale(amax_block, s_g), s_g, spec, key)
        if scale_rule == "four_over_six":
            stored4, codes4 = _encode(
                blocks, nvfp4_block_scale(amax_block, s_g, target=4.0), s_g, spec, key
            )
            err6 = _block_sq_error(blocks, codes, stored, s_g, spec, block_2d)
            err4 = _block_sq_error(blocks, codes4, stored4, s_g, spec, block_2d)
            use4 = err4 < err6
            stored = jnp.where(use4, stored4, stored)
            codes = jnp.where(use4[..., None], codes4, codes)
    else:
        s_g = jnp.ones((), jnp.float32)
        stored, codes = _encode(blocks, mxfp4_block_scale(amax_block), s_g, spec, key)

    packed = e2m1.pack_nibbles(codes.reshape(*codes.shape[:-2], -1))
    return QTensor(
        codes=packed, block_scales=stored, global_scale=s_g, fmt=spec, shape=x.shape, axis=axis
    )


def _encode(blocks, stored_scales, s_g, spec, key):
    z = normalise(blocks, block_scale_values(stored_scales, spec), s_g, spec)
    z = jnp.clip(z, -E2M1_MAX, E2M1_MAX)
    return stored_scales, e2m1.round_to_e2m1(z, key)


def _block_sq_error(blocks, codes, stored, s_g, spec, block_2d):
    deq = decode_blocks(codes, block_scale_values(stored, spec), s_g)
    return _block_reduce(jnp.square(deq - blocks), block_2d, jnp.sum)


def _check_options(spec, shape, axis, global_scale, rounding, key, scale_rule, block_2d):
    name = spec.name
    if global_scale not in ("tensor", "row"):
        raise ValueError(f"{name}: global_scale must be 'tensor' or 'row', got {global_scale!r}")
    if global_scale == "row" and not spec.has_global_scale:
        raise ValueError(f"{name}: has no global scale; global_scale='row' applies to NVFP4 only")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"{name}: rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if rounding == "stochastic" and key is None:
        raise ValueError(f"{name}: rounding='stochastic' needs a PRNG key (key=...)")
    if scale_rule not in ("max6", "four_over_six"):
        raise ValueError(
            f"{name}: scale_rule must be 'max6' or 'four_over_six', got {scale_rule!r}"
        )
    if scale_rule == "four_over_six" and not spec.has_global_scale:
        raise ValueError(f"{name}: scale_rule='four_over_six' is defined for NVFP4 only")
    if block_2d:
        if len(shape) < 2:
            raise ValueError(f"{name}: block_2d needs at least 2 dimensions, got shape {shape}")
        if global_scale != "tensor":
            raise ValueError(f"{name}: block_2d needs global_scale='tensor'")
        stored = stored_shape(shape, axis)
        if stored[-2] % spec.block_size:
            raise ValueError(
                f"{name}: block_2d needs {spec.block_size}-row tiles, but tensor of shape {shape} "
                f"quantized along axis {axis} has {stored[-2]} rows (stored shape {stored})"
            )


# ----------------------------------------------------------------------------- dequantize


def unpacked_codes(qt: QTensor) -> jax.Array:
    """Codes of ``qt`` as [*S[:-1], K // b, b] uint8."""
    codes = e2m1.unpack_nibbles(qt.codes)
    b = qt.fmt.block_size
    return codes.reshape(*codes.shape[:-1], codes.shape[-1] // b, b)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize(qt: QTensor, dtype=jnp.float32) -> jax.Array:
    """``QTensor`` -> array of its logical shape in ``dtype`` (computed in float32).

    A QTensor made by ``jax.vmap(quantize)`` (its arrays carry leading batch axes beyond the
    stored layout, e.g. one global scale per expert) dequantizes to ``[*batch, *shape]``.
    """
    if qt.codes.ndim > len(qt.shape):
        return jax.vmap(functools.partial(dequantize, dtype=dtype))(qt)
    values = decode_blocks(
        unpacked_codes(qt), block_scale_values(qt.block_scales, qt.fmt), qt.global_scale
    )
    return from_blocks(values, qt.axis).astype(dtype)
