"""One-token FP4 matmul (GEMV, W4A16) for Hopper GPUs: ``y = x @ dequantize(W)``, x [1, K].

With one token there is nothing for the matrix unit to do: every weight element is used once,
in one fused multiply-add. So the kernel is a stream of code words through the CUDA cores; on
the H200 it is bound by how many bytes each multiprocessor keeps in flight and by how many
instructions each weight element costs (BENCHMARKS.md has the Nsight Compute readings).

Weight layout (``layouts.pack_gemv_words``/``layouts.with_gemv_layout``, built once by
``layouts.prepack`` for NVFP4): 32-bit words, 8 codes a word. Inside each ``block_k`` step of a
row, word ``(g, b)`` holds elements ``8g .. 8g+7`` of block ``b`` (``g < block_size/8``), stored
group-major, so the words of one group form a [rows, block_k/block_size] tile whose column
``b`` is block ``b`` and the tile's block scales are a plain tile of the same shape (no
broadcast). Row-tiled (``block_n`` > 0), the words and scales of one (row tile, step) are one
contiguous chunk. Inside a word the codes' bits are placed so that masks and shifts give four
float16 pairs in 11 integer ops (``_decode_word``; no shift pattern tiles a word with the
sign/magnitude groups, so two pairs need a second shift): float16 bits
``sign << 15 | magnitude << 9`` are worth ``code * 2**-14`` (the 0.5 code is a float16
subnormal, which converts to a normal float32 exactly). Each float16 converts to float32 and
meets x in one fp32 FMA (in PTX: the compiler leaves a plain ``w * x + part`` as FMUL + FADD);
a block's 16 products are summed before its scale multiplies them once, so the scale costs one
FMA per block, not per element.

Loads: the loop has no dot, so Triton does not software-pipeline it (no shared-memory stages;
seen under ncu); ``prefetch`` steps of code words are loaded ahead into registers instead.

x is laid out once per call in XLA to match (fp32 [K/block_k * block_size, block_k/block_size]:
row ``(step, g, slot)`` holds the x values of that slot in every block of the step).

``split_k > 1`` splits K over a second grid axis; the fp32 partial rows are added in XLA.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dequant import scale_f32_bits
from pallas_kernels.layouts import GEMV_BLOCK_K, GEMV_ROW_TILED, Fp4Weight, gemv_default_block_n
from trace_jax.fp4 import FormatSpec

# float16 pair masks of the word layout (``layouts.GEMV_MAG_BIT`` / ``GEMV_SIGN_BIT``)
_PAIR = 0x8E008E00  # sign and magnitude bits of both float16 lanes
_PAIR_MAG = 0x0E000E00
_PAIR_SIGN = 0x80008000


@dataclasses.dataclass(frozen=True)
class Fp4GemvConfig:
    """Tiling of the one-token kernel.

    Attributes:
      block_n: weight rows (output features) per program.
      block_k: contraction elements per loop step; also the granule of the packed word layout
        (the weight must have been packed with the same value).
      split_k: programs that share one output row tile along K (partial sums added in XLA).
      num_warps: warps per program.
      num_stages: software-pipelining depth of the K loop.
      prefetch: loop steps whose code words and scales are loaded ahead into registers
        (0: none).
      decode: "asm" (the decode of the module docstring and the fp32 FMAs in PTX, GPU only; the
        compiler does not fuse the plain ``w * x + part`` into one FMA), "f16" (the same in plain
        ``jnp``; used in interpret mode), or "none", a timing diagnostic that reinterprets each
        loaded word as one float for all 8 slots (wrong values): the same loads and products
        without the decode and convert instructions.
    """

    block_n: int = 64
    block_k: int = GEMV_BLOCK_K
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    prefetch: int = 1
    decode: Literal["asm", "f16", "none"] = "asm"

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 8 or v & (v - 1):
                raise ValueError(f"Fp4GemvConfig.{name} must be a power of two >= 8, got {v}")
        if self.split_k < 1:
            raise ValueError(f"Fp4GemvConfig.split_k must be >= 1, got {self.split_k}")
        if self.prefetch < 0:
            raise ValueError(f"Fp4GemvConfig.prefetch must be >= 0, got {self.prefetch}")
        if self.decode not in ("asm", "f16", "none"):
            raise ValueError(f"Fp4GemvConfig.decode: unknown {self.decode!r}")


# Defaults from the H200 sweep (BENCHMARKS.md, ``experiments/bench/fp4_matmul.py --gemv``).
_MIN_PROGRAMS = 896  # K is split until there are at least this many programs


def default_gemv_config(
    k: int, n: int, block_k: int = GEMV_BLOCK_K, block_n: int = 0
) -> Fp4GemvConfig:
    """Tuned defaults (H200, BENCHMARKS.md). ``block_n``: the row tile of a row-tiled weight
    layout (0: free to choose)."""
    if not block_n:
        block_n = gemv_default_block_n(n)
    split = 1
    while n // block_n * split < _MIN_PROGRAMS and k % (block_k * split * 2) == 0:
        split *= 2
    return Fp4GemvConfig(block_n=block_n, block_k=block_k, split_k=split, num_stages=1)


def layout_block_n(cfg: Fp4GemvConfig, n: int) -> int:
    """The row tile ``prepack`` lays out for ``cfg`` (0: rows in order)."""
    return cfg.block_n if GEMV_ROW_TILED and n % cfg.block_n == 0 else 0


def arrange_x(x: jax.Array, fmt: FormatSpec, block_k: int) -> jax.Array:
    """x [K] -> fp32 [K/block_k * block_size, block_k/block_size]: row ``(step, g, r)`` holds
    element ``8g + r`` of every block of the step, matching ``pack_gemv_words``."""
    (k,) = x.shape
    bs = fmt.block_size
    nb = block_k // bs
    xr = x.astype(jnp.float32).reshape(k // block_k, nb, bs // 8, 8)
    return xr.transpose(0, 2, 3, 1).reshape(k // block_k * bs, nb)


def _decode_word(q: jax.Array) -> list[jax.Array]:
    """Packed words (uint32, any shape) -> the 8 slots' values as float32, each ``code * 2**-14``.

    Four float16 pairs: one mask, one shift + mask, and two whose magnitudes and signs come from
    different shifts (no shift pattern tiles a word with sign/magnitude groups, so two pairs
    need a second shift). Each float16 then converts to float32 (exactly, subnormals too).
    """
    u32 = jnp.uint32
    pairs = (
        q & u32(_PAIR),
        (q << 3) & u32(_PAIR),
        ((q << 6) & u32(_PAIR_MAG)) | ((q << 1) & u32(_PAIR_SIGN)),
        ((q << 9) & u32(_PAIR_MAG)) | ((q << 2) & u32(_PAIR_SIGN)),
    )
    out = []
    for p in pairs:
        for lane in (p, p >> 16):
            h = jax.lax.bitcast_convert_type(lane.astype(jnp.uint16), jnp.float16)
            out.append(h.astype(jnp.float32))
    return out


# The whole word in PTX: the four pairs of ``_decode_word``, each float16 converted to float32
# and accumulated with one fused multiply-add. Operands: $0 the result, $1 the word, $2..$9 the
# x values of slots 0..7, $10 the running sum.
_WORD_FMA_ASM = """
{
.reg .b32 p, t;
.reg .b16 lo, hi;
.reg .f32 a, b, s;
and.b32 p, $1, 0x8E008E00;
mov.b32 {lo, hi}, p;
cvt.f32.f16 a, lo;
cvt.f32.f16 b, hi;
fma.rn.f32 s, a, $2, $10;
fma.rn.f32 s, b, $3, s;
shl.b32 p, $1, 3;
and.b32 p, p, 0x8E008E00;
mov.b32 {lo, hi}, p;
cvt.f32.f16 a, lo;
cvt.f32.f16 b, hi;
fma.rn.f32 s, a, $4, s;
fma.rn.f32 s, b, $5, s;
shl.b32 p, $1, 6;
and.b32 p, p, 0x0E000E00;
shl.b32 t, $1, 1;
and.b32 t, t, 0x80008000;
or.b32 p, p, t;
mov.b32 {lo, hi}, p;
cvt.f32.f16 a, lo;
cvt.f32.f16 b, hi;
fma.rn.f32 s, a, $6, s;
fma.rn.f32 s, b, $7, s;
shl.b32 p, $1, 9;
and.b32 p, p, 0x0E000E00;
shl.b32 t, $1, 2;
and.b32 t, t, 0x80008000;
or.b32 p, p, t;
mov.b32 {lo, hi}, p;
cvt.f32.f16 a, lo;
cvt.f32.f16 b, hi;
fma.rn.f32 s, a, $8, s;
fma.rn.f32 $0, b, $9, s;
}
"""


def _word_fma(q: jax.Array, xs, part: jax.Array | None) -> jax.Array:
    """``part + sum_r slot_r(q) * xs[r]`` in PTX (GPU only): q [R, C] uint32, xs 8 x rows
    [1, C] fp32, part [R, C] fp32 or None."""
    if part is None:
        part = jnp.zeros(q.shape, jnp.float32)
    xs = [jnp.broadcast_to(xv, q.shape) for xv in xs]
    return plgpu.elementwise_inline_asm(
        _WORD_FMA_ASM,
        args=[q, *xs, part],
        constraints="=f,r" + ",f" * 9,
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(q.shape, jnp.float32)],
    )[0]


def _scale_f32(s: jax.Array, offset: jax.Array, fmt: FormatSpec) -> jax.Array:
    """Block-scale bytes -> float32 ``scale * 2**(offset - 112)``."""
    return jax.lax.bitcast_convert_type(scale_f32_bits(s, offset, fmt), jnp.float32)


def decode_reference(words: jax.Array, scales: jax.Array, fmt: FormatSpec, block_k: int):
    """Pure-JAX inverse of the layout, for tests: words [N, K/8] and scale bytes -> fp32 [N, K]
    worth ``code * scale`` (offset 112: no power of two folded in)."""
    n = words.shape[0]
    k = words.shape[1] * 8
    bs = fmt.block_size
    groups, nb = bs // 8, block_k // bs
    slots = jnp.stack(_decode_word(words.reshape(n, k // block_k, groups, nb)), axis=-1)
    vals = slots.transpose(0, 1, 3, 2, 4).reshape(n, k // bs, bs) * np.float32(2.0**14)
    mult = _scale_f32(scales, jnp.int32(112), fmt)
    return (vals * mult[:, :, None]).reshape(n, k)


# ----------------------------------------------------------------------------- kernel


def _gemv_kernel(x_ref, c_ref, s_ref, off_ref, g_ref, o_ref, *, fmt, cfg, steps, tiled):
    split = pl.program_id(1)
    groups = fmt.block_size // 8
    nb = cfg.block_k // fmt.block_size  # blocks per step = columns of every tile
    offset = off_ref[0]
    first, last = split * steps, split * steps + steps - 1

    def load(step):
        """One step's code words and scale bytes (the HBM stream)."""
        step = jnp.minimum(step, last)  # the prefetch past the end re-reads the last step
        if tiled:  # one contiguous [block_n, block_k/8] chunk of words per step
            rows = pl.ds(step * cfg.block_n, cfg.block_n)
            qs = tuple(c_ref[rows, pl.ds(g * nb, nb)] for g in range(groups))
            return qs, s_ref[rows, :]
        qs = tuple(c_ref[:, pl.ds((step * groups + g) * nb, nb)] for g in range(groups))
        return qs, s_ref[:, pl.ds(step * nb, nb)]

    def compute(acc, step, loaded):
        qs, sc = loaded
        part = None
        for g, q in enumerate(qs):
            if cfg.decode == "asm":
                xs = [x_ref[pl.ds((step * groups + g) * 8 + r, 1), :] for r in range(8)]
                part = _word_fma(q, xs, part)
                continue
            if cfg.decode == "none":
                slots = [jax.lax.bitcast_convert_type(q, jnp.float32)] * 8
            else:
                slots = _decode_word(q)
            for r, w in enumerate(slots):
                # x rows are L1/L2 hits shared by every program; loaded where used, not held
                # ahead, so that each thread's registers go to the code words in flight.
                prod = w * x_ref[pl.ds((step * groups + g) * 8 + r, 1), :]
                part = prod if part is None else part + prod
        return acc + part * _scale_f32(sc, offset, fmt)

    def body(t, carry):
        # ``prefetch`` steps of code words are loaded ahead into registers: Triton pipelines
        # loads that feed a dot through shared memory, and this loop has none.
        acc, ahead = carry[0], carry[1:]
        step = first + t
        if not ahead:
            return (compute(acc, step, load(step)),)
        return (compute(acc, step, ahead[0]), *ahead[1:], load(step + cfg.prefetch))

    acc = jnp.zeros((cfg.block_n, nb), jnp.float32)
    init = (acc, *(load(first + d) for d in range(cfg.prefetch)))
    acc = jax.lax.fori_loop(0, steps, body, init)[0]
    y = jnp.sum(acc, axis=1) * g_ref[...]
    o_ref[...] = y[None, :].astype(o_ref.dtype)


def fp4_gemv(
    x: jax.Array, w: Fp4Weight, config: Fp4GemvConfig, interpret: bool = False
) -> jax.Array:
    """``x @ dequantize(w)`` for one token. x: [1, K] bf16; w: ``layouts.Fp4Weight`` with
    packed words (``w.gemv_words``, packed with ``config.block_k``, and with ``config.block_n``
    where the layout is row-tiled). Returns [1, N] bf16."""
    cfg = config
    k, n = w.shape
    fmt = w.fmt
    tiled = w.gemv_block_n > 0
    if w.gemv_words is None or w.gemv_block_k != cfg.block_k:
        raise ValueError(
            f"fp4_gemv: weight packed with block_k={w.gemv_block_k}, config needs {cfg.block_k}"
        )
    if tiled and w.gemv_block_n != cfg.block_n:
        raise ValueError(
            f"fp4_gemv: weight packed with block_n={w.gemv_block_n}, config needs {cfg.block_n}"
        )
    if x.shape != (1, k):
        raise ValueError(f"fp4_gemv: x has shape {x.shape}, needs [1, {k}]")
    if n % cfg.block_n or k % (cfg.block_k * cfg.split_k):
        raise ValueError(f"fp4_gemv: K={k}, N={n} do not tile with {cfg}")
    if interpret and cfg.decode == "asm":
        cfg = dataclasses.replace(cfg, decode="f16")
    steps = k // (cfg.block_k * cfg.split_k)
    xa = arrange_x(x[0], fmt, cfg.block_k)
    if cfg.split_k == 1:
        out_shape = jax.ShapeDtypeStruct((1, n), jnp.bfloat16)
        out_spec = pl.BlockSpec((1, cfg.block_n), lambda i, s: (0, i))
    else:
        out_shape = jax.ShapeDtypeStruct((cfg.split_k, 1, n), jnp.float32)
        out_spec = pl.BlockSpec((None, 1, cfg.block_n), lambda i, s: (s, 0, i))
    if tiled:
        w_specs = [
            pl.BlockSpec((None, *w.gemv_words.shape[1:]), lambda i, s: (i, 0, 0)),
            pl.BlockSpec((None, *w.gemv_scales.shape[1:]), lambda i, s: (i, 0, 0)),
        ]
        w_args = [w.gemv_words, w.gemv_scales]
    else:
        w_specs = [
            pl.BlockSpec((cfg.block_n, k // 8), lambda i, s: (i, 0)),
            pl.BlockSpec((cfg.block_n, k // fmt.block_size), lambda i, s: (i, 0)),
        ]
        w_args = [w.gemv_words, w.scales]
    out = pl.pallas_call(
        functools.partial(_gemv_kernel, fmt=fmt, cfg=cfg, steps=steps, tiled=tiled),
        grid=(n // cfg.block_n, cfg.split_k),
        in_specs=[
            pl.BlockSpec(xa.shape, lambda i, s: (0, 0)),
            *w_specs,
            pl.BlockSpec((1,), lambda i, s: (0,)),
            pl.BlockSpec((cfg.block_n,), lambda i, s: (i,)),
        ],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"fp4_gemv_{fmt.name}",
    )(xa, *w_args, w.scale_offset.reshape(1), w.out_scale)
    if cfg.split_k > 1:
        out = out.sum(axis=0)
    return out.astype(jnp.bfloat16)
