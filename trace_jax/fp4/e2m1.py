"""E2M1 element rounding, decoding and bit packing (pure ``jnp``, jit- and vmap-able).

All functions act elementwise on already-scaled values ``z`` (``x / scale``), so the block-scaled
quantizers, the rollout-guided rounding and the kernels' references share one definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax.fp4.formats import (
    E2M1_MAGNITUDES,
    E2M1_MAX,
    E2M1_SIGN_BIT,
    E2M1_VALUES,
    F32_MIN_NORMAL,
)

# Round-to-nearest-even thresholds on |z|: the magnitude code is the number of thresholds passed.
# At a midpoint the even code (mantissa bit 0) wins, hence ">" where the lower neighbour is even
# and ">=" where the upper one is.
_RNE_STRICT = (0.25, 1.25, 2.5, 5.0)  # lower neighbour even: a tie stays down
_RNE_INCLUSIVE = (0.75, 1.75, 3.5)  # upper neighbour even: a tie goes up


def round_magnitude_nearest(a: jax.Array) -> jax.Array:
    """Round magnitudes to E2M1, nearest with ties to even.

    Args:
      a: [...] float32, 0 <= a <= 6 (callers clip; NaN gives code 0).
    Returns:
      [...] uint8 magnitude codes 0..7.
    """
    code = jnp.zeros(a.shape, jnp.uint8)
    for t in _RNE_STRICT:
        code += (a > t).astype(jnp.uint8)
    for t in _RNE_INCLUSIVE:
        code += (a >= t).astype(jnp.uint8)
    return code


def floor_magnitude(a: jax.Array) -> jax.Array:
    """Largest magnitude code whose value is <= a. a: [...] float32 in [0, 6] -> uint8."""
    code = jnp.zeros(a.shape, jnp.uint8)
    for v in E2M1_MAGNITUDES[1:]:
        code += (a >= v).astype(jnp.uint8)
    return code


def magnitude_value(code: jax.Array) -> jax.Array:
    """Value of magnitude codes 0..7 as float32."""
    return jnp.asarray(E2M1_VALUES[:8])[code.astype(jnp.int32)]


def round_magnitude_stochastic(a: jax.Array, key: jax.Array) -> jax.Array:
    """Stochastic rounding to E2M1: up with probability (a - lo) / (hi - lo), unbiased in value.

    Args:
      a: [...] float32 magnitudes in [0, 6].
      key: PRNG key.
    Returns:
      [...] uint8 magnitude codes.
    """
    lo = floor_magnitude(a)
    hi = jnp.minimum(lo + 1, 7).astype(jnp.uint8)
    lo_v, hi_v = magnitude_value(lo), magnitude_value(hi)
    p_up = jnp.where(hi_v > lo_v, (a - lo_v) / jnp.where(hi_v > lo_v, hi_v - lo_v, 1.0), 0.0)
    u = jax.random.uniform(key, a.shape, jnp.float32)
    return jnp.where(u < p_up, hi, lo)


def guided_round(z: jax.Array, mantissa_bit: jax.Array) -> jax.Array:
    """Rollout-guided rounding (TRACE section 3, steps 2-3).

    Between the two codes adjacent to ``z`` (``q-`` <= z <= ``q+``), pick the one whose mantissa
    bit equals the rollout's; if ``z`` is itself a code, keep it. Along the signed codebook the
    mantissa bit alternates, so the two neighbours always differ in it.

    Args:
      z: [...] float32, already normalised by the rollout's scales and clipped to [-6, 6].
      mantissa_bit: [...] uint8 (0 or 1), the rollout code's mantissa bit.
    Returns:
      [...] uint8 4-bit codes (sign in bit 3).

    Subnormal float32 ``z`` count as zero (an exact code) on every backend: XLA flushes them on
    CPU and GPU, and the explicit flush keeps the result independent of that.
    """
    a = jnp.abs(z)
    a = jnp.where(a < F32_MIN_NORMAL, 0.0, a)
    lo = floor_magnitude(a)
    on_code = magnitude_value(lo) == a
    hi = jnp.minimum(lo + 1, 7).astype(jnp.uint8)
    pick_lo = on_code | ((lo & 1) == mantissa_bit.astype(jnp.uint8))
    return with_sign(jnp.where(pick_lo, lo, hi), z)


def with_sign(magnitude_code: jax.Array, z: jax.Array) -> jax.Array:
    """Attach the sign of ``z`` (including the sign of -0.0) as bit 3 of the code."""
    negative = jnp.signbit(z).astype(jnp.uint8)
    return magnitude_code | (negative << 3)


def round_to_e2m1(z: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """Round scaled values to 4-bit E2M1 codes, saturating to +-6.

    Args:
      z: [...] float32.
      key: None for round-to-nearest-even, a PRNG key for stochastic rounding.
    Returns:
      [...] uint8 codes 0..15; -0.0 and negatives that round to zero keep the sign bit (code 8).
    """
    a = jnp.minimum(jnp.abs(z), E2M1_MAX)
    mag = round_magnitude_nearest(a) if key is None else round_magnitude_stochastic(a, key)
    return with_sign(mag, z)


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """4-bit codes [...] uint8 -> values [...] float32 (exact; ``E2M1_VALUES[codes]``).

    Built from bits rather than a table lookup, so that it fuses into elementwise kernels: a
    code ``s ee m`` with ``ee > 0`` is the float32 ``(-1)**s * 2**(ee - 1) * (1 + m / 2)``
    (exponent field ``ee + 126``, top mantissa bit ``m``); ``ee = 0`` is 0 or 0.5.
    """
    c = codes.astype(jnp.uint32)
    e, m = (c >> 1) & 3, c & 1
    magnitude = jnp.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return jax.lax.bitcast_convert_type(((c & 8) << 28) | magnitude, jnp.float32)


def mantissa_bit(codes: jax.Array) -> jax.Array:
    """The E2M1 mantissa bit (low bit of the magnitude) of 4-bit codes, uint8 0/1."""
    return codes & 1


def is_negative_code(codes: jax.Array) -> jax.Array:
    return (codes & E2M1_SIGN_BIT) != 0


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """Pack 4-bit codes two per byte: element 2i in the low nibble, 2i+1 in the high nibble.

    Args:
      codes: [..., K] uint8, K even.
    Returns:
      [..., K // 2] uint8.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last axis, got shape {codes.shape}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Inverse of ``pack_nibbles``: [..., K // 2] uint8 -> [..., K] uint8."""
    pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_bits(bits: jax.Array) -> jax.Array:
    """Pack 0/1 values eight per byte, element 8i+j in bit j (least significant first).

    Args:
      bits: [..., K] uint8 in {0, 1}, K a multiple of 8.
    Returns:
      [..., K // 8] uint8.
    """
    if bits.shape[-1] % 8:
        raise ValueError(f"pack_bits needs a last axis that is a multiple of 8, got {bits.shape}")
    groups = bits.reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8).astype(jnp.uint8)
    weights = (jnp.uint8(1) << jnp.arange(8, dtype=jnp.uint8)).astype(jnp.uint8)
    return jnp.sum(groups * weights, axis=-1, dtype=jnp.uint8)


def unpack_bits(packed: jax.Array) -> jax.Array:
    """Inverse of ``pack_bits``: [..., K // 8] uint8 -> [..., K] uint8 in {0, 1}."""
    bits = (packed[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
    return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8)
