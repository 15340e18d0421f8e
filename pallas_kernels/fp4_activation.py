"""The rollout-side activation quantizer of W4A4, fused into one kernel: NVFP4 along K with one
global scale per token (``quantize_activation``), returned as the exact bf16 block
values ``code * block_scale`` and the per-token global scale.

``x^ = (code * s_b) * s_g``: the matmul multiplies the first factor (6 significant bits, exact
in bf16) and applies ``s_g`` to its fp32 sums. In XLA the same computation is several kernels
(each IEEE division of the format's rules is ``fp4.quantize``'s ``exact_div``, which XLA can
neither rewrite nor, on the GPU, approximate); here one program per token does all of it on the
token's row:

    s_g  = amax(|x|) / 2688, at least the smallest normal float32; 1 for a zero row, NaN for a
           row with a NaN or infinity
    s_b  = E4M3(clip((amax_block / 6) / s_g, 2**-6, 448))
    q    = RTNE_E2M1(clip(x * ((1 / s_g) / s_b), -6, 6))     (the sign of -0.0 kept)
    out  = q * s_b (bf16), s_g (float32)

The divisions are ``div.rn.f32`` (PTX, exact IEEE) on the GPU (Triton's ``/`` on float32 is an
approximate division) and ``fp4.quantize``'s own ``exact_div`` in interpret mode.
``quantize_activation_blocks_reference`` is the XLA definition the kernel matches bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from trace_jax import fp4
from trace_jax.fp4 import QTensor
from trace_jax.fp4.formats import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    F32_MIN_NORMAL,
)
from trace_jax.fp4.quantize import block_scale_values, exact_div

_BLOCK = 16  # NVFP4 block
# Round-to-nearest-even steps of the E2M1 magnitude (value added once |z| passes a threshold;
# ">" where a tie stays on the even code below, ">=" where it goes up to the even code above).
_RNE_STEPS = (
    (0.25, False, 0.5),
    (0.75, True, 0.5),
    (1.25, False, 0.5),
    (1.75, True, 0.5),
    (2.5, False, 1.0),
    (3.5, True, 1.0),
    (5.0, False, 2.0),
)


def _div_rn(a: jax.Array, b: jax.Array) -> jax.Array:
    """float32 ``a / b`` rounded to nearest even (PTX ``div.rn.f32``), elementwise."""
    a, b = jnp.broadcast_arrays(a, b)
    return plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )[0]


def _kernel(x_ref, o_ref, s_ref, *, div):
    """One token: x [nb, 16] bf16 -> block values [nb, 16] bf16 and its global scale [1]."""
    x = x_ref[...].astype(jnp.float32)
    a = jnp.abs(x)
    amax_b = jnp.max(a, axis=1)  # [nb]
    amax = jnp.max(amax_b, axis=0, keepdims=True)  # [1]
    finite = jnp.min(jnp.where(a < jnp.inf, 1.0, 0.0), axis=(0, 1), keepdims=True)[0]  # NaN: 0
    s_g = jnp.maximum(div(amax, jnp.full_like(amax, E2M1_MAX * E4M3_MAX)), F32_MIN_NORMAL)
    s_g = jnp.where(amax == 0, 1.0, s_g)
    s_g = jnp.where(finite > 0, s_g, jnp.nan)  # [1]
    s_b = div(div(amax_b, jnp.full_like(amax_b, E2M1_MAX)), jnp.broadcast_to(s_g, amax_b.shape))
    s_b = jnp.clip(s_b, E4M3_MIN_NORMAL, E4M3_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    recip = div(div(jnp.ones_like(s_b), jnp.broadcast_to(s_g, s_b.shape)), s_b)  # [nb]
    # zeros stay signed zeros where recip overflows (fp4.quantize's ``normalise``)
    z = jnp.clip(jnp.where(x == 0, x, x * recip[:, None]), -E2M1_MAX, E2M1_MAX)
    az = jnp.abs(z)
    v = jnp.zeros_like(az)
    for t, inclusive, step in _RNE_STEPS:
        v = v + jnp.where((az >= t) if inclusive else (az > t), step, 0.0)
    sign = jax.lax.bitcast_convert_type(z, jnp.uint32) & jnp.uint32(0x80000000)
    v = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(v, jnp.uint32) | sign, jnp.float32
    )
    o_ref[...] = (v * s_b[:, None]).astype(jnp.bfloat16)
    s_ref[...] = s_g


@functools.partial(jax.jit, static_argnames=("interpret",))
def quantize_activation_blocks(
    x: jax.Array, *, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Quantize each token (row) of ``x`` to NVFP4 with its own global scale, in one kernel.

    Args:
      x: [M, K] bf16 (K a multiple of 16).
      interpret: run the Pallas interpreter (CPU tests).
    Returns:
      (values [M, K] bf16, the exact ``code * block_scale``; s_g [M] float32), so that
      ``values * s_g[:, None]`` is ``fp4.dequantize(quantize_activation(x))``.
    """
    m, k = x.shape
    if k % _BLOCK:
        raise ValueError(f"quantize_activation_blocks: K={k} is not a multiple of 16")
    nb = k // _BLOCK
    nbp = pl.next_power_of_2(nb)  # Triton blocks are powers of two: zero blocks change nothing
    xb = x.astype(jnp.bfloat16).reshape(m, nb, _BLOCK)
    if nbp != nb:
        xb = jnp.pad(xb, ((0, 0), (0, nbp - nb), (0, 0)))
    values, s_g = pl.pallas_call(
        functools.partial(_kernel, div=exact_div if interpret else _div_rn),
        grid=(m,),
        in_specs=[pl.BlockSpec((None, nbp, _BLOCK), lambda i: (i, 0, 0))],
        out_specs=[
            pl.BlockSpec((None, nbp, _BLOCK), lambda i: (i, 0, 0)),
            pl.BlockSpec((None, 1), lambda i: (i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((m, nbp, _BLOCK), jnp.bfloat16),
            jax.ShapeDtypeStruct((m, 1), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=8 if nbp >= 256 else 4, num_stages=1),
        interpret=interpret,
        name="fp4_activation_quantize",
    )(xb)
    return values[:, :nb].reshape(m, k), s_g[:, 0]


def activation_blocks(xq: QTensor) -> tuple[jax.Array, jax.Array]:
    """An NVFP4 activation ``QTensor`` [M, K] (along K, per-row global scale) -> (the exact
    ``code * block_scale`` as bf16 [M, K], s_g [M] float32), in XLA."""
    m, k = xq.shape
    codes = fp4.unpacked_codes(xq)  # [M, K/16, 16]
    scales = block_scale_values(xq.block_scales, xq.fmt)[..., None]  # from the bits: exact
    values = (fp4.decode_e2m1(codes) * scales).astype(jnp.bfloat16).reshape(m, k)
    return values, jnp.broadcast_to(xq.global_scale, (m, 1))[:, 0].astype(jnp.float32)


def quantize_activation(x: jax.Array) -> QTensor:
    """The rollout-side activation quantizer: NVFP4 along K with one global scale per token."""
    return fp4.quantize(x, "nvfp4", axis=-1, global_scale="row")


def quantize_activation_blocks_reference(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """XLA definition of ``quantize_activation_blocks``: ``quantize_activation(x)`` through
    ``activation_blocks``."""
    return activation_blocks(quantize_activation(x))
