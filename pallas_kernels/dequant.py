"""FP4 tile decode inside the Triton kernels: packed codes and block-scale bytes to exact bf16.

Below the kernels (``fp4_matmul_triton``, ``fp4_grouped_matmul_triton``,
``fp4_decode_attention_triton``, ``fp4_matmul_gemv``), which share it. Dequantization is exact
in bf16 (E2M1 x E4M3 needs 6 significant bits) and uses a power-of-two offset ``2**c`` folded
into the block scale so that no intermediate is a bf16 subnormal (``layouts.prepack_arrays``
picks ``c``; the kernels multiply their fp32 sums by the matching ``2**(126 - c)``).

Modes (``DEQUANT_TILE``): "asm" decodes 8 codes per 32-bit word with PTX bit operations
(``prmt``/``lop3``) and one ``mul.bf16x2`` per pair (GPU only); "portable" does the same
arithmetic through float16 bit patterns in plain ``jnp`` (interpret mode, and a fallback);
"bf16_bits" decodes elementwise against one scale byte per code byte (GPU only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from trace_jax.fp4 import FormatSpec


def scale_f32_bits(s: jax.Array, offset: jax.Array, fmt: FormatSpec) -> jax.Array:
    """Block-scale bytes -> float32 bits of ``scale * 2**(offset - 112)`` (uint32)."""
    s = s.astype(jnp.uint32)
    off = offset.astype(jnp.uint32)
    if fmt.scale_format == "e4m3":
        # E4M3 (bias 7) -> float32 (bias 127), then 2**(offset - 112): exponent + 8 + offset.
        # Quantized NVFP4 scales are normal and positive (clipped to [2**-6, 448]).
        return ((s & 0x7F) << 20) + ((off + 8) << 23)
    return jnp.maximum(s.astype(jnp.int32) + offset - 112, 0).astype(jnp.uint32) << 23


def scale_bf16_bits(s: jax.Array, offset: jax.Array, fmt: FormatSpec) -> jax.Array:
    """Block-scale bytes -> bfloat16 bits of ``scale * 2**offset`` (uint16)."""
    s = s.astype(jnp.uint16)
    off = offset.astype(jnp.uint16)
    if fmt.scale_format == "e4m3":
        return ((s & 0x7F) << 4) + ((off + 120) << 7)
    return (s + off) << 7


def dequant_portable(c, s, offset, fmt):
    """Codes [R, kb] uint8 and scale bytes [R, kb/bpb] -> (even, odd) K elements, bf16 [R, kb].

    Each value is ``code * scale * 2**(offset - 126)``, exact. The code goes through a float16
    bit pattern (``code * 2**-14``; the 0.5 code is a float16 subnormal, which converts to a
    normal float32), so no backend's flush-to-zero can touch it.
    """
    rows, kb = c.shape
    groups = s.shape[1]
    mult = jax.lax.bitcast_convert_type(scale_f32_bits(s, offset, fmt), jnp.float32)
    c16 = c.astype(jnp.uint16)
    out = []
    for bits in (
        ((c16 & 0x08) << 12) | ((c16 & 0x07) << 9),
        ((c16 & 0x80) << 8) | ((c16 & 0x70) << 5),
    ):
        v = jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)
        v = v.reshape(rows, groups, kb // groups) * mult[:, :, None]
        out.append(v.astype(jnp.bfloat16).reshape(rows, kb))
    return tuple(out)


# One 32-bit word = 4 code bytes b0..b3 = 8 codes. After ``prmt`` to b0|b2<<8|b1<<16|b3<<24, the
# top nibble of each 16-bit lane holds (b2.hi, b3.hi); shifting the word left by 4, 8, 12 brings
# (b2.lo, b3.lo), (b0.hi, b1.hi), (b0.lo, b1.lo) there. ``(x & 0x80008000) | ((x & 0x70007000)
# >> 6)`` moves sign and 3 magnitude bits into a bf16 pair worth code * 2**-126 (the 0.5 code is a
# bf16 subnormal; bf16 arithmetic keeps subnormals), and ``mul.bf16x2`` applies the scale pair.
# Operands: $0, $1 the two output pairs, $2 the code word, $3, $4 the scale pairs.
_DEQUANT_ASM = """
{{
.reg .b32 q, x, t;
prmt.b32 q, $2, $2, 0x3120;
shl.b32 x, q, {shift01};
and.b32 t, x, 0x70007000;
shr.b32 t, t, 6;
and.b32 x, x, 0x80008000;
or.b32 x, x, t;
mul.rn.bf16x2 $0, x, $3;
{shift23}
and.b32 t, x, 0x70007000;
shr.b32 t, t, 6;
and.b32 x, x, 0x80008000;
or.b32 x, x, t;
mul.rn.bf16x2 $1, x, $4;
}}
"""
_DEQUANT_ASM_LO = _DEQUANT_ASM.format(shift01=12, shift23="shl.b32 x, q, 4;")
_DEQUANT_ASM_HI = _DEQUANT_ASM.format(shift01=8, shift23="mov.b32 x, q;")


def _dequant_asm(c, s, offset, fmt):
    """As ``dequant_portable``, with the decode and scaling in PTX (GPU only)."""
    rows, kb = c.shape
    groups = s.shape[1]
    scale = jax.lax.bitcast_convert_type(scale_bf16_bits(s, offset, fmt), jnp.bfloat16)
    scale = jnp.broadcast_to(scale[:, :, None], (rows, groups, kb // groups)).reshape(rows, kb)
    out = jax.ShapeDtypeStruct((rows, kb), jnp.bfloat16)
    # One program per result: multi-result inline asm does not lower in this Pallas version.
    return tuple(
        plgpu.elementwise_inline_asm(
            asm, args=[c, scale], constraints="=r,=r,r,r,r", pack=4, result_shape_dtypes=[out]
        )[0]
        for asm in (_DEQUANT_ASM_LO, _DEQUANT_ASM_HI)
    )


def _dequant_bf16_bits(c, s, offset, fmt):
    """Elementwise decode against an expanded scale ``s`` [R, kb] (one scale byte per code byte).

    bf16 bits ``sign << 15 | magnitude << 6`` are worth ``code * 2**-126`` (the 0.5 code is a bf16
    subnormal, kept by GPU bf16 arithmetic, flushed by XLA on the CPU): GPU only.
    """
    scale = jax.lax.bitcast_convert_type(scale_bf16_bits(s, offset, fmt), jnp.bfloat16)
    c16 = c.astype(jnp.uint16)
    out = []
    for bits in (
        ((c16 << 12) & 0x8000) | ((c16 << 6) & 0x01C0),
        ((c16 << 8) & 0x8000) | ((c16 << 2) & 0x01C0),
    ):
        out.append(jax.lax.bitcast_convert_type(bits, jnp.bfloat16) * scale)
    return tuple(out)


# mode -> fn(codes [R, kb] uint8, scale bytes [R, kb*2/block], offset, fmt) -> (even-K, odd-K)
# bf16 [R, kb] tiles.
DEQUANT_TILE = {
    "asm": _dequant_asm,
    "portable": dequant_portable,
    "bf16_bits": _dequant_bf16_bits,
}
EXPANDED_SCALE = {"bf16_bits"}  # modes that take one scale byte per code byte


def dequantize_tile(c, s, offset, fmt: FormatSpec, mode: str):
    return DEQUANT_TILE[mode](c, s, offset, fmt)
