"""FP4 weight matmul for Hopper GPUs: ``y = x @ dequantize(W)``, dequantized in the kernel.

``W`` is an NVFP4 or MXFP4 ``QTensor`` of logical shape [K, N] quantized along K (axis 0), so
its stored codes are [N, K/2] (element 2i of a row in the low nibble of byte i) and its block
scales [N, K/block]. The kernel streams those bytes once and never writes a dequantized copy.

Kernel layout (Pallas, Triton lowering):

* Operands are swapped: the program computes ``y^T[n-tile] = W^T[n-tile, :] @ x^T``, so the
  weight tile (``block_n`` rows of N) is the matrix unit's 64-row side and the few tokens are its
  narrow side (padded to 16).
* The packed codes are never interleaved: the low nibbles of a [block_n, block_k/2] byte tile
  are the even K positions and the high nibbles the odd ones, so each loop step issues two dots,
  ``lo @ x[:, even].T + hi @ x[:, odd].T``, against stride-2 loads of x.
* Dequantization is exact in bf16 (E2M1 x E4M3 needs 6 significant bits) and uses a power-of-two
  offset ``2**c`` folded into the block scale so that no intermediate is a bf16 subnormal; the
  matching ``2**(126 - c)`` and the global scale multiply the fp32 accumulator at the end.
  ``dequant="asm"`` decodes 8 codes per 32-bit word with PTX bit operations (``prmt``/``lop3``)
  and one ``mul.bf16x2`` per pair; ``dequant="portable"`` does the same arithmetic through
  float16 bit patterns in plain ``jnp`` (used in interpret mode and as a fallback).
* ``split_k > 1`` splits the contraction over a second grid axis; partial fp32 sums are added
  in XLA.

On a GPU, up to 256 rows with a ``prepack`` (NVFP4 or MXFP4) run ``fp4_matmul_mgpu``
instead (Mosaic GPU: decoded straight into the tensor cores' register operand, TMA stages; the
fastest FP4 path measured for 1-256 rows). A ``prepack`` without that layout runs one token through
``fp4_matmul_gemv`` (its own word layout, no matrix unit). ``fp4_matmul_reference`` is the
pure-JAX definition; ``fp4_linear`` is the dispatcher that falls back to dequantize-then-XLA-
matmul where the kernel would not be faster (large M).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

# fuser is imported for its side effect only: the Pallas interpreter imports it on first use,
# and it registers a jit-key config value, which turns every jit cache entry made before into a
# miss (the rollout engine's jitted steps would each compile twice on the CPU).
from jax.experimental.pallas import fuser as _fuser  # noqa: F401
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import fp4_activation as fact
from pallas_kernels import fp4_matmul_gemv as fmv
from pallas_kernels import fp4_matmul_mgpu as fmm
from trace_jax import fp4
from trace_jax.fp4 import FormatSpec, QTensor
from trace_jax.fp4.formats import E8M0_NAN
from trace_jax.fp4.quantize import block_scale_values, decode_blocks

Dequant = Literal["asm", "portable"]

# Offset folded into NVFP4 block scales: scale * 2**100 is a normal bf16 for every E4M3 scale in
# [2**-6, 448], and code * scale * 2**(100 - 126) stays a normal bf16 for every nonzero code.
_NVFP4_SCALE_OFFSET = 100
_MIN_ROWS = 16  # the matrix unit's narrow side: fewer rows are zero-padded
MGPU_MAX_ROWS = 256  # rows up to which a prepacked weight runs the tensor-core kernel


# ----------------------------------------------------------------------------- tuning


@dataclasses.dataclass(frozen=True)
class Fp4MatmulConfig:
    """Tiling of the FP4 matmul kernel.

    Attributes:
      block_n: weight rows (output features) per program; the matrix unit's wide side.
      block_k: contraction elements per loop step (block_k/2 code bytes per weight row).
      block_m: token rows per program (a power of two >= 16); M is padded up to it.
      split_k: programs that share one output tile along K (partial sums added in XLA).
      num_warps: warps per program.
      num_stages: software-pipelining depth of the K loop.
      dequant: "asm" (PTX bit tricks, GPU only) or "portable" (plain jnp).
      prefetch: load the next step's weight codes and scales into registers one step ahead (in
        the loop carry) instead of relying on the compiler's shared-memory pipeline; use with
        num_stages=1.
      mma: use the matrix unit. False: the GEMV form for a single token (``block_m`` 1): each
        step multiplies the decoded tile elementwise by x and accumulates in fp32 registers,
        reduced over K once at the end; no padding of the token side to 16 rows.
      x_layout: how the even/odd K split meets x. "split": x is split into even and odd columns
        in XLA before the kernel (contiguous, pipelined loads; two dots per step); "strided":
        stride-2 loads in the kernel.
    """

    block_n: int = 128
    block_k: int = 256
    block_m: int = 16
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    dequant: Dequant = "asm"
    x_layout: Literal["split", "strided"] = "split"
    prefetch: bool = False
    mma: bool = True

    def __post_init__(self):
        for name in ("block_n", "block_k", "block_m"):
            v = getattr(self, name)
            if name == "block_m" and not self.mma:
                if v != 1:
                    raise ValueError(f"Fp4MatmulConfig: mma=False needs block_m=1, got {v}")
                continue
            if v < 16 or v & (v - 1):
                raise ValueError(f"Fp4MatmulConfig.{name} must be a power of two >= 16, got {v}")
        if not self.mma and (self.x_layout != "split" or self.prefetch):
            raise ValueError("Fp4MatmulConfig: mma=False needs x_layout='split', no prefetch")
        if self.split_k < 1:
            raise ValueError(f"Fp4MatmulConfig.split_k must be >= 1, got {self.split_k}")
        if self.x_layout not in ("split", "strided"):
            raise ValueError(f"Fp4MatmulConfig.x_layout: unknown {self.x_layout!r}")
        if self.dequant not in DEQUANT_TILE:
            raise ValueError(
                f"Fp4MatmulConfig.dequant must be one of {sorted(DEQUANT_TILE)}: {self.dequant!r}"
            )


def default_config(m: int, k: int, n: int) -> Fp4MatmulConfig:
    """Tuned defaults per shape class (H200, see BENCHMARKS.md). ``m`` tokens, weight [k, n].

    One token (m = 1): the GEMV form (``gemv_config``), equal to or faster than the MMA kernel
    at every benchmark shape (1.2x for MXFP4); ``fp4_matmul`` sends one token with an NVFP4
    ``prepack`` to the one-token kernel instead (``fp4_matmul_gemv``, 1.3-1.5x the GEMV form on
    the H200). Decode (m <= 16): 64-row weight tiles,
    128-element K steps, and K split until there are ~900 programs (about 7 per
    multiprocessor): the kernel is bound by each program's serial load -> decode -> MMA chain,
    so more programs in flight is what raises bandwidth.
    Larger m: token tiles of up to 64 rows, 3 pipeline stages, K split in two.
    """
    block_n, block_k = 64, 128
    if m == 1 and n % block_n == 0 and k % block_k == 0:
        return gemv_config(k, n, block_n, block_k)
    block_m = max(_MIN_ROWS, min(64, _next_pow2(m)))
    if m <= 16:
        split_k, stages = 1, 4
        while n // block_n * split_k < 896 and k % (block_k * split_k * 2) == 0:
            split_k *= 2
    else:
        split_k, stages = (2 if k % (2 * block_k) == 0 else 1), 3
    return Fp4MatmulConfig(
        block_n=block_n if n % block_n == 0 else 16,
        block_k=block_k if k % block_k == 0 else 32,
        block_m=block_m,
        split_k=split_k,
        num_stages=stages,
    )


def gemv_config(
    k: int, n: int, block_n: int = 64, block_k: int = 128, programs: int = 1024, **kw
) -> Fp4MatmulConfig:
    """The GEMV form (``mma=False``, one token) with K split until there are ``programs``
    programs (the H200 search of BENCHMARKS.md: 64 x 128 tiles, ~1024 programs, 3 stages)."""
    split = 1
    while n // block_n * split < programs and k % (block_k * split * 2) == 0:
        split *= 2
    kw.setdefault("num_stages", 3)
    return Fp4MatmulConfig(
        block_n=block_n, block_k=block_k, block_m=1, mma=False, split_k=split, **kw
    )


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


# ----------------------------------------------------------------------------- prepacked weight


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp4Weight:
    """An FP4 weight [K, N] arranged once at load for the kernel (a pytree).

    Attributes:
      codes: [N, K/2] uint8, the ``QTensor``'s codes unchanged.
      scales: [N, K/block] uint8, the block scales' bytes (E4M3 bits or biased E8M0).
      scale_offset: int32 [], the power of two ``c`` folded into the block scales in-kernel.
      out_scale: [N] float32, ``global_scale * 2**(126 - c)``; NaN where a row holds a NaN scale.
      qtensor: the source ``QTensor`` (for the reference and the XLA fallback; shares buffers).
      gemv_words: uint32, the codes again in the one-token kernel's word layout
        (``fp4_matmul_gemv.pack_gemv_words``), or None; a second copy of the codes.
      gemv_scales: the block scales tiled as ``gemv_words`` (row-tiled layout only), or None.
      gemv_block_k: the ``block_k`` granule ``gemv_words`` was packed with (0: none).
      gemv_block_n: the row tile of a row-tiled layout, 0 for rows in order.
      mgpu: the codes and scales again in the tensor-core kernel's operand layout
        (``fp4_matmul_mgpu.prepack_mgpu``), or None; a second copy of the codes.
    """

    codes: jax.Array
    scales: jax.Array
    scale_offset: jax.Array
    out_scale: jax.Array
    qtensor: QTensor
    gemv_words: jax.Array | None = None
    gemv_scales: jax.Array | None = None
    gemv_block_k: int = dataclasses.field(default=0, metadata=dict(static=True))
    gemv_block_n: int = dataclasses.field(default=0, metadata=dict(static=True))
    mgpu: fmm.MgpuWeight | None = None

    @property
    def fmt(self) -> FormatSpec:
        return self.qtensor.fmt

    @property
    def shape(self) -> tuple[int, int]:
        return self.qtensor.shape


def prepack(w: QTensor, *, mgpu: bool = True, gemv: bool | None = None) -> Fp4Weight:
    """Arrange a weight ``QTensor`` [K, N] (quantized along K, axis 0) for ``fp4_matmul``.

    ``mgpu``: for K and N multiples of 64, also store the codes and scales in the
    tensor-core kernel's operand layout (``fp4_matmul_mgpu``; one more copy: 4.5 bits per
    weight); up to ``MGPU_MAX_ROWS`` rows then run that kernel on a GPU, the fastest FP4 path
    measured there for 1 to 256 rows (BENCHMARKS.md).
    ``gemv``: for NVFP4, also store the one-token kernel's layout (``gemv_words``/
    ``gemv_scales``, one more copy) where the shape allows; one-token calls without the
    tensor-core layout then use that kernel. None: only when no tensor-core layout was made.
    """
    if len(w.shape) != 2 or w.axis != 0:
        raise ValueError(
            f"fp4_matmul needs a 2-D weight [K, N] quantized along axis 0, got shape {w.shape} "
            f"axis {w.axis}"
        )
    packed = _prepack_arrays(w)
    k, n = w.shape
    if mgpu and fmm.default_on(w.fmt, k, n):
        packed = dataclasses.replace(packed, mgpu=fmm.prepack_mgpu(w, packed))
    if gemv is None:
        gemv = packed.mgpu is None
    if gemv and w.fmt.scale_format == "e4m3" and fmv.gemv_supported(k, n, w.fmt):
        cfg = fmv.default_gemv_config(k, n)
        packed = fmv.with_gemv_layout(packed, cfg.block_k, fmv.layout_block_n(cfg, n))
    return packed


def _prepack_arrays(w: QTensor) -> Fp4Weight:
    """Shared by the dense and grouped kernels: works on [..., N, K/2] stored layouts."""
    n_rows = w.codes.shape[:-1]
    if w.fmt.scale_format == "e4m3":
        scales = jax.lax.bitcast_convert_type(w.block_scales, jnp.uint8)
        offset = jnp.int32(_NVFP4_SCALE_OFFSET)
        row_nan = jnp.zeros(n_rows, bool)
        g = jnp.broadcast_to(jnp.reshape(w.global_scale, w.global_scale.shape[:-1] or ()), n_rows)
    else:
        scales = w.block_scales
        finite = jnp.where(scales == E8M0_NAN, 0, scales)
        # Keep the largest block exponent at the top of bf16's range: 126 binades below it stay
        # exact, and anything smaller is below 2**-126 of the largest value.
        offset = (254 - jnp.max(finite)).astype(jnp.int32)
        row_nan = jnp.any(scales == E8M0_NAN, axis=-1)
        g = jnp.ones(n_rows, jnp.float32)
    pow2 = jax.lax.bitcast_convert_type((126 - offset + 127) << 23, jnp.float32)
    out_scale = jnp.where(row_nan, jnp.nan, g.astype(jnp.float32) * pow2)
    return Fp4Weight(
        codes=w.codes, scales=scales, scale_offset=offset, out_scale=out_scale, qtensor=w
    )


# ----------------------------------------------------------------------------- dequantization


def _scale_f32_bits(s: jax.Array, offset: jax.Array, fmt: FormatSpec) -> jax.Array:
    """Block-scale bytes -> float32 bits of ``scale * 2**(offset - 112)`` (uint32)."""
    s = s.astype(jnp.uint32)
    off = offset.astype(jnp.uint32)
    if fmt.scale_format == "e4m3":
        # E4M3 (bias 7) -> float32 (bias 127), then 2**(offset - 112): exponent + 8 + offset.
        # Quantized NVFP4 scales are normal and positive (clipped to [2**-6, 448]).
        return ((s & 0x7F) << 20) + ((off + 8) << 23)
    return jnp.maximum(s.astype(jnp.int32) + offset - 112, 0).astype(jnp.uint32) << 23


def _scale_bf16_bits(s: jax.Array, offset: jax.Array, fmt: FormatSpec) -> jax.Array:
    """Block-scale bytes -> bfloat16 bits of ``scale * 2**offset`` (uint16)."""
    s = s.astype(jnp.uint16)
    off = offset.astype(jnp.uint16)
    if fmt.scale_format == "e4m3":
        return ((s & 0x7F) << 4) + ((off + 120) << 7)
    return (s + off) << 7


def _dequant_portable(c, s, offset, fmt):
    """Codes [R, kb] uint8 and scale bytes [R, kb/bpb] -> (even, odd) K elements, bf16 [R, kb].

    Each value is ``code * scale * 2**(offset - 126)``, exact. The code goes through a float16
    bit pattern (``code * 2**-14``; the 0.5 code is a float16 subnormal, which converts to a
    normal float32), so no backend's flush-to-zero can touch it.
    """
    rows, kb = c.shape
    groups = s.shape[1]
    mult = jax.lax.bitcast_convert_type(_scale_f32_bits(s, offset, fmt), jnp.float32)
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
    """As ``_dequant_portable``, with the decode and scaling in PTX (GPU only)."""
    rows, kb = c.shape
    groups = s.shape[1]
    scale = jax.lax.bitcast_convert_type(_scale_bf16_bits(s, offset, fmt), jnp.bfloat16)
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
    scale = jax.lax.bitcast_convert_type(_scale_bf16_bits(s, offset, fmt), jnp.bfloat16)
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
    "portable": _dequant_portable,
    "bf16_bits": _dequant_bf16_bits,
}
_EXPANDED_SCALE = {"bf16_bits"}  # modes that take one scale byte per code byte


def dequantize_tile(c, s, offset, fmt: FormatSpec, mode: str):
    return DEQUANT_TILE[mode](c, s, offset, fmt)


# ----------------------------------------------------------------------------- kernel


def _fp4_matmul_kernel(*refs, fmt, cfg, steps, w4a4, row_scaled):
    if w4a4:
        xc_ref, xs_ref, xg_ref, c_ref, s_ref, off_ref, g_ref, o_ref = refs
    elif row_scaled:
        xe_ref, xo_ref, xg_ref, c_ref, s_ref, off_ref, g_ref, o_ref = refs
    elif cfg.x_layout == "split":
        xe_ref, xo_ref, c_ref, s_ref, off_ref, g_ref, o_ref = refs
    else:
        x_ref, c_ref, s_ref, off_ref, g_ref, o_ref = refs
    split = pl.program_id(2)
    kb = cfg.block_k // 2  # code bytes per weight row and step
    sb = cfg.block_k // fmt.block_size  # scale bytes per weight row and step
    offset = off_ref[0]
    dims = (((1,), (1,)), ((), ()))  # contract the last axes: [bn, kb] x [bm, kb] -> [bn, bm]

    def load_w(step):
        c = c_ref[:, pl.ds(step * kb, kb)]
        if cfg.dequant in _EXPANDED_SCALE:
            # Gather each code byte's scale byte: a [bn, kb] load with 8- or 16-fold repeats.
            rows = jax.lax.broadcasted_iota(jnp.int32, (cfg.block_n, kb), 0)
            cols = jax.lax.broadcasted_iota(jnp.int32, (cfg.block_n, kb), 1)
            return c, s_ref[rows, step * sb + cols // (fmt.block_size // 2)]
        return c, s_ref[:, pl.ds(step * sb, sb)]

    def body(t, carry):
        acc, c, s = carry
        step = split * steps + t
        if cfg.prefetch:
            c_next, s_next = load_w(jnp.minimum(step + 1, (split + 1) * steps - 1))
        else:
            c, s = load_w(step)
            c_next, s_next = c, s
        w_even, w_odd = dequantize_tile(c, s, offset, fmt, cfg.dequant)
        if w4a4:
            xc = xc_ref[:, pl.ds(step * kb, kb)]
            xs = xs_ref[:, pl.ds(step * (cfg.block_k // 16), cfg.block_k // 16)]
            x_even, x_odd = dequantize_tile(
                xc, xs, jnp.int32(_NVFP4_SCALE_OFFSET), fp4.NVFP4, cfg.dequant
            )
        elif cfg.x_layout == "split":
            x_even = xe_ref[:, pl.ds(step * kb, kb)]
            x_odd = xo_ref[:, pl.ds(step * kb, kb)]
        else:
            x_even = x_ref[:, pl.ds(step * cfg.block_k, kb, stride=2)]
            x_odd = x_ref[:, pl.ds(step * cfg.block_k + 1, kb, stride=2)]
        if not cfg.mma:  # GEMV: [bn, kb] fp32 partial products, reduced after the loop
            f32 = jnp.float32
            acc += w_even.astype(f32) * x_even.astype(f32) + w_odd.astype(f32) * x_odd.astype(f32)
            return acc, c_next, s_next
        acc += jax.lax.dot_general(w_even, x_even, dims, preferred_element_type=jnp.float32)
        acc += jax.lax.dot_general(w_odd, x_odd, dims, preferred_element_type=jnp.float32)
        return acc, c_next, s_next

    acc_shape = (cfg.block_n, cfg.block_m) if cfg.mma else (cfg.block_n, kb)
    acc = jnp.zeros(acc_shape, jnp.float32)
    c0, s0 = load_w(split * steps)
    acc, _, _ = jax.lax.fori_loop(0, steps, body, (acc, c0, s0))
    if not cfg.mma:
        acc = jnp.sum(acc, axis=1, keepdims=True)
    acc = acc * g_ref[...][:, None]
    if w4a4 or row_scaled:
        acc = acc * xg_ref[...][None, :]
    o_ref[...] = acc.T.astype(o_ref.dtype)


def _check_config(cfg: Fp4MatmulConfig, k: int, n: int, fmt: FormatSpec):
    if n % cfg.block_n:
        raise ValueError(f"fp4_matmul: N={n} is not a multiple of block_n={cfg.block_n}")
    if k % (cfg.block_k * cfg.split_k):
        raise ValueError(
            f"fp4_matmul: K={k} is not a multiple of block_k*split_k={cfg.block_k * cfg.split_k}"
        )
    if cfg.block_k < 2 * fmt.block_size:
        raise ValueError(f"fp4_matmul: block_k={cfg.block_k} < 2 blocks of {fmt.name}")


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
    if a.shape[0] == rows:
        return a
    return jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def _call(
    x_args,
    w: Fp4Weight,
    m: int,
    cfg: Fp4MatmulConfig,
    interpret: bool,
    w4a4: bool,
    row_scaled: bool = False,
    row_scale: jax.Array | None = None,
):
    k, n = w.shape
    fmt = w.fmt
    _check_config(cfg, k, n, fmt)
    if interpret:
        cfg = dataclasses.replace(cfg, dequant="portable")
    m_pad = -(-m // cfg.block_m) * cfg.block_m
    x_args = [_pad_rows(a, m_pad) for a in x_args]
    steps = k // (cfg.block_k * cfg.split_k)
    grid = (n // cfg.block_n, m_pad // cfg.block_m, cfg.split_k)
    if w4a4:
        x_specs = [
            pl.BlockSpec((cfg.block_m, k // 2), lambda i, j, s: (j, 0)),
            pl.BlockSpec((cfg.block_m, k // 16), lambda i, j, s: (j, 0)),
            pl.BlockSpec((cfg.block_m,), lambda i, j, s: (j,)),
        ]
    elif cfg.x_layout == "split":
        x_specs = [pl.BlockSpec((cfg.block_m, k // 2), lambda i, j, s: (j, 0))] * 2
        if row_scaled:
            x_specs.append(pl.BlockSpec((cfg.block_m,), lambda i, j, s: (j,)))
    else:
        x_specs = [pl.BlockSpec((cfg.block_m, k), lambda i, j, s: (j, 0))]
    w_specs = [
        pl.BlockSpec((cfg.block_n, k // 2), lambda i, j, s: (i, 0)),
        pl.BlockSpec((cfg.block_n, k // fmt.block_size), lambda i, j, s: (i, 0)),
        pl.BlockSpec((1,), lambda i, j, s: (0,)),
        pl.BlockSpec((cfg.block_n,), lambda i, j, s: (i,)),
    ]
    if cfg.split_k == 1:
        out_shape = jax.ShapeDtypeStruct((m_pad, n), jnp.bfloat16)
        out_spec = pl.BlockSpec((cfg.block_m, cfg.block_n), lambda i, j, s: (j, i))
    else:
        out_shape = jax.ShapeDtypeStruct((cfg.split_k, m_pad, n), jnp.float32)
        out_spec = pl.BlockSpec((None, cfg.block_m, cfg.block_n), lambda i, j, s: (s, j, i))
    if row_scaled and cfg.x_layout != "split":
        raise ValueError("fp4_matmul: per-row activation scales need x_layout='split'")
    kernel = functools.partial(
        _fp4_matmul_kernel, fmt=fmt, cfg=cfg, steps=steps, w4a4=w4a4, row_scaled=row_scaled
    )
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=x_specs + w_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"fp4_matmul_{fmt.name}{'_w4a4' if w4a4 else ''}",
    )(*x_args, w.codes, w.scales, w.scale_offset.reshape(1), w.out_scale)
    if cfg.split_k > 1:
        out = out.sum(axis=0)
    out = out[:m]
    if row_scale is not None:  # fp32 partial sums (split_k >= 2): scaled before rounding
        out = out * row_scale[:, None]
    return out.astype(jnp.bfloat16)


def _mgpu_default(w: Fp4Weight, m: int) -> fmm.MgpuMatmulConfig | None:
    """The tensor-core kernel's default config where a compiled call takes it, else None."""
    if w.mgpu is None or m > MGPU_MAX_ROWS:
        return None
    return fmm.default_config(m, *w.shape)


def _as_weight(w: QTensor | Fp4Weight) -> Fp4Weight:
    # A bare QTensor is arranged per call: no second copy of the codes is worth making then.
    return w if isinstance(w, Fp4Weight) else prepack(w, mgpu=False, gemv=False)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def fp4_matmul(
    x: jax.Array,
    w: QTensor | Fp4Weight,
    *,
    config: Fp4MatmulConfig | fmv.Fp4GemvConfig | fmm.MgpuMatmulConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x @ dequantize(w)`` with the weight dequantized in the kernel (W4A16).

    Args:
      x: [M, K] bf16 activations.
      w: weight [K, N] as an NVFP4/MXFP4 ``QTensor`` quantized along K, or its ``prepack``.
      config: tiling; when None, a compiled call (not ``interpret``) with a ``prepack``
        holding the tensor-core layout (``mgpu``) and M <= ``MGPU_MAX_ROWS`` runs
        ``fp4_matmul_mgpu``; else one token with ``gemv_words`` uses the one-token kernel
        (``fp4_matmul_gemv``, ``default_gemv_config``), anything else the MMA kernel with
        ``default_config(M, K, N)``. An ``Fp4GemvConfig`` selects the one-token kernel, an
        ``MgpuMatmulConfig`` the tensor-core kernel.
      interpret: run the Pallas interpreter (CPU tests).
    Returns:
      [M, N] bf16, accumulated in fp32.
    """
    w = _as_weight(w)
    k, n = w.shape
    m = x.shape[0]
    if x.shape != (m, k):
        raise ValueError(f"fp4_matmul: x has shape {x.shape}, weight needs [M, {k}]")
    if config is None and not interpret:
        config = _mgpu_default(w, m)
    if isinstance(config, fmm.MgpuMatmulConfig):
        if w.mgpu is None:
            raise ValueError("fp4_matmul: an MgpuMatmulConfig needs prepack(w, mgpu=True)")
        return fmm.fp4_matmul_mgpu(x, w.mgpu, config, interpret=interpret)
    if config is None and m == 1 and w.gemv_words is not None:
        config = fmv.default_gemv_config(k, n, w.gemv_block_k, w.gemv_block_n)
    if isinstance(config, fmv.Fp4GemvConfig):
        return fmv.fp4_gemv(x.astype(jnp.bfloat16), w, config, interpret)
    cfg = config or default_config(m, k, n)
    x = x.astype(jnp.bfloat16)
    x_args = [x[:, 0::2], x[:, 1::2]] if cfg.x_layout == "split" else [x]
    return _call(x_args, w, m, cfg, interpret, w4a4=False)


def quantize_activation(x: jax.Array) -> QTensor:
    """The rollout-side activation quantizer: NVFP4 along K with one global scale per token."""
    return fp4.quantize(x, "nvfp4", axis=-1, global_scale="row")


@functools.partial(jax.jit, static_argnames=("config", "interpret", "activation_dequant"))
def fp4_matmul_w4a4(
    x: jax.Array | QTensor,
    w: QTensor | Fp4Weight,
    *,
    config: Fp4MatmulConfig | fmm.MgpuMatmulConfig | None = None,
    interpret: bool = False,
    activation_dequant: Literal["before", "kernel"] = "before",
) -> jax.Array:
    """``dequantize(quantize_activation(x)) @ dequantize(w)``, fp32 accumulation (W4A4).

    Args:
      x: [M, K] bf16 activations (quantized here with ``quantize_activation``), or that
        ``QTensor`` already.
      w: weight [K, N] ``QTensor`` (axis 0) or its ``prepack``.
      activation_dequant: "before" (default): the activation's exact bf16 values
        ``code * block_scale`` are formed once before the matmul (from x by one fused kernel,
        ``fp4_activation.quantize_activation_blocks``; from a ``QTensor`` in XLA) and the
        per-token scale multiplies the fp32 sums before the one bf16 rounding; "kernel": every
        program of the Triton kernel decodes the activation's codes itself (x moves as 4.5
        bits, but each N block repeats the decode). With "before", a compiled call with the
        tensor-core layout (``prepack``) and M <= ``MGPU_MAX_ROWS``, or an
        ``MgpuMatmulConfig``, multiplies those values in ``fp4_matmul_mgpu``.
    Returns:
      [M, N] bf16.
    """
    w = _as_weight(w)
    k, n = w.shape
    if activation_dequant not in ("before", "kernel"):
        raise ValueError(
            f"fp4_matmul_w4a4: activation_dequant must be 'before' or 'kernel', "
            f"got {activation_dequant!r}"
        )
    m = x.shape[0]
    if isinstance(x, QTensor) or activation_dequant == "kernel":
        xq = x if isinstance(x, QTensor) else quantize_activation(x)
        if xq.fmt != fp4.NVFP4 or xq.axis != 1 or xq.shape[1] != k:
            raise ValueError(f"fp4_matmul_w4a4: activation must be NVFP4 [M, {k}] along axis 1")
    elif x.shape != (m, k):
        raise ValueError(f"fp4_matmul_w4a4: x has shape {x.shape}, weight needs [M, {k}]")
    if config is None and activation_dequant == "before" and not interpret:
        config = _mgpu_default(w, m)
    mgpu = isinstance(config, fmm.MgpuMatmulConfig)
    if mgpu and (w.mgpu is None or activation_dequant != "before"):
        raise ValueError(
            "fp4_matmul_w4a4: an MgpuMatmulConfig needs prepack(w, mgpu=True) and "
            "activation_dequant='before'"
        )
    cfg = config or default_config(m, k, n)
    if activation_dequant == "kernel":
        row_scale = jnp.broadcast_to(xq.global_scale, (m, 1))[:, 0].astype(jnp.float32)
        x_scales = jax.lax.bitcast_convert_type(xq.block_scales, jnp.uint8)
        x_out = row_scale * np.float32(2.0 ** (126 - _NVFP4_SCALE_OFFSET))
        return _call([xq.codes, x_scales, x_out], w, m, cfg, interpret, w4a4=True)
    # code * block scale without the global scale: <= 6 significant bits, exact in bf16
    if isinstance(x, QTensor):
        x_blocks, row_scale = fact.activation_blocks(x)
    else:
        x_blocks, row_scale = fact.quantize_activation_blocks(x, interpret=interpret)
    if mgpu:
        return fmm.fp4_matmul_mgpu(x_blocks, w.mgpu, cfg, row_scale=row_scale, interpret=interpret)
    # The per-token scale multiplies the fp32 sum of the K-split partials, before the one bf16
    # rounding (split_k >= 2 keeps the kernel's output in fp32).
    split = max(cfg.split_k, 2)
    if k % (cfg.block_k * split):
        raise ValueError(f"fp4_matmul_w4a4: K={k} does not split in two with {cfg}")
    cfg = dataclasses.replace(cfg, x_layout="split", split_k=split)
    return _call(
        [x_blocks[:, 0::2], x_blocks[:, 1::2]],
        w,
        m,
        cfg,
        interpret,
        w4a4=False,
        row_scale=row_scale,
    )


# ----------------------------------------------------------------------------- reference


def fp4_matmul_reference(x: jax.Array, w: QTensor | Fp4Weight) -> jax.Array:
    """Pure-JAX definition: fp32 ``x @ dequantize(w)``, rounded to bf16. x: [M, K]; -> [M, N]."""
    qt = w.qtensor if isinstance(w, Fp4Weight) else w
    wf = fp4.dequantize(qt, jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), wf, precision=jax.lax.Precision.HIGHEST)
    return y.astype(jnp.bfloat16)


def fp4_matmul_w4a4_reference(x: jax.Array, w: QTensor | Fp4Weight) -> jax.Array:
    """Pure-JAX W4A4: the activation's exact dequantization times the weight's, fp32, -> bf16."""
    xq = quantize_activation(x)
    return fp4_matmul_reference(fp4.dequantize(xq, jnp.float32), w)


# ----------------------------------------------------------------------------- dispatch

Backend = Literal["auto", "pallas", "xla"]

# Largest M at which the FP4 kernels were measured to beat dequantize + XLA bf16 matmul (H200,
# BENCHMARKS.md, K=8192 N=28672: M=256 tensor-core kernel 223 us vs 773 us; M=1024 Triton
# kernel 2103 us vs 1232 us); above it the dispatcher uses XLA.
PALLAS_MAX_ROWS = 256


def fp4_linear(
    x: jax.Array, w: QTensor | Fp4Weight, *, backend: Backend = "auto", w4a4: bool = False
) -> jax.Array:
    """``x @ W`` for an FP4 weight, through the kernel or XLA, whichever is faster for M.

    Args:
      x: [..., K] bf16; leading axes are flattened into M.
      w: weight [K, N] ``QTensor`` (axis 0) or its ``prepack``.
      backend: "pallas" (the kernel), "xla" (dequantize + XLA matmul; runs anywhere) or "auto"
        (pallas on a GPU for M <= PALLAS_MAX_ROWS, else xla).
      w4a4: quantize the activation to NVFP4 first (the rollout-side activation site).
    Returns:
      [..., N] bf16.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if backend == "auto":
        on_gpu = jax.default_backend() == "gpu"
        backend = "pallas" if on_gpu and x2.shape[0] <= PALLAS_MAX_ROWS else "xla"
    if backend == "pallas":
        y = fp4_matmul_w4a4(x2, w) if w4a4 else fp4_matmul(x2, w)
    elif backend == "xla":
        y = _xla_linear(x2, w, w4a4)
    else:
        raise ValueError(f"fp4_linear: backend must be 'auto', 'pallas' or 'xla', got {backend!r}")
    return y.reshape(*lead, y.shape[-1])


@functools.partial(jax.jit, static_argnames=("w4a4",))
def _xla_linear(x, w, w4a4):
    qt = w.qtensor if isinstance(w, Fp4Weight) else w
    if w4a4:
        x = fp4.dequantize(quantize_activation(x), jnp.bfloat16)
    # The weight is dequantized in its stored layout [N, K] (fp4.dequantize's values, without
    # the transpose to [K, N]) and the matmul contracts the last axes of both.
    k, n = qt.shape
    values = decode_blocks(
        fp4.unpacked_codes(qt),
        block_scale_values(qt.block_scales, qt.fmt),
        qt.global_scale,
    )
    wt = values.astype(jnp.bfloat16).reshape(n, k)
    dims = (((1,), (1,)), ((), ()))
    y = jax.lax.dot_general(x.astype(jnp.bfloat16), wt, dims, preferred_element_type=jnp.float32)
    return y.astype(jnp.bfloat16)


# ----------------------------------------------------------------------------- bf16 baseline


def _bf16_matmul_kernel(x_ref, w_ref, o_ref, *, cfg, steps):
    split = pl.program_id(2)

    def body(t, acc):
        step = split * steps + t
        w = w_ref[:, pl.ds(step * cfg.block_k, cfg.block_k)]
        x = x_ref[:, pl.ds(step * cfg.block_k, cfg.block_k)]
        dims = (((1,), (1,)), ((), ()))
        return acc + jax.lax.dot_general(w, x, dims, preferred_element_type=jnp.float32)

    acc = jnp.zeros((cfg.block_n, cfg.block_m), jnp.float32)
    acc = jax.lax.fori_loop(0, steps, body, acc)
    o_ref[...] = acc.T.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def bf16_matmul(
    x: jax.Array, w_t: jax.Array, *, config: Fp4MatmulConfig, interpret: bool = False
) -> jax.Array:
    """The same kernel with bf16 weights (the like-for-like BF16 baseline).

    Args:
      x: [M, K] bf16.
      w_t: [N, K] bf16, the weight stored transposed as the FP4 codes are.
    Returns:
      [M, N] bf16.
    """
    cfg = config
    m, k = x.shape
    n = w_t.shape[0]
    m_pad = -(-m // cfg.block_m) * cfg.block_m
    x = _pad_rows(x.astype(jnp.bfloat16), m_pad)
    steps = k // (cfg.block_k * cfg.split_k)
    if cfg.split_k == 1:
        out_shape = jax.ShapeDtypeStruct((m_pad, n), jnp.bfloat16)
        out_spec = pl.BlockSpec((cfg.block_m, cfg.block_n), lambda i, j, s: (j, i))
    else:
        out_shape = jax.ShapeDtypeStruct((cfg.split_k, m_pad, n), jnp.float32)
        out_spec = pl.BlockSpec((None, cfg.block_m, cfg.block_n), lambda i, j, s: (s, j, i))
    out = pl.pallas_call(
        functools.partial(_bf16_matmul_kernel, cfg=cfg, steps=steps),
        grid=(n // cfg.block_n, m_pad // cfg.block_m, cfg.split_k),
        in_specs=[
            pl.BlockSpec((cfg.block_m, k), lambda i, j, s: (j, 0)),
            pl.BlockSpec((cfg.block_n, k), lambda i, j, s: (i, 0)),
        ],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="bf16_matmul",
    )(x, w_t)
    if cfg.split_k > 1:
        out = out.sum(axis=0)
    return out[:m].astype(jnp.bfloat16)
