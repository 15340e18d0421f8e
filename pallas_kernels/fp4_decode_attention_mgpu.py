"""Decode attention over an NVFP4 or MXFP4 KV cache on Hopper tensor cores (Mosaic GPU).

One new query token per sequence against its cache slots, as ``fp4_decode_attention_triton``
(same arguments, same flash-decoding splits and ``kv_layout.combine_splits``; the op's
reference is ``fp4_decode_attention.decode_attention_reference``), with the slots on the matrix
unit's wide side so that nothing is padded and the decoded K tile never leaves the registers:

* scores, transposed: ``s^T [64 slots, G] = K [64, D] @ q^T [D, G]`` with ``wgmma``: the 64
  decoded K rows are its register operand, the ``G`` query heads of the KV head (padded to a
  multiple of 8) its shared-memory operand, loaded once per program;
* online softmax down the columns of ``s^T`` (one column per query head; the column max is a
  cross-warp reduction, the running sum is kept per element and reduced once at the end);
* output, transposed: ``o^T [D, G] += V^T [D, 64] @ p^T [64, G]``: V is decoded into shared
  memory (bf16, the operand's swizzled tile) and read transposed by ``wgmma``; p^T (times the
  slots' V global scales) is stored beside it as two bf16 parts, ``hi = bf16(p)`` and
  ``lo = bf16(p - hi)``, multiplied one after the other, so p carries ~16 significant bits
  instead of bf16's 8 (the multiply is 8 columns wide: the matrix unit's time stays small).

Each program is one warpgroup on one (KV head, split, sequence). Its K/V tiles (codes, block
scales and the per-token global scales of 64 slots; the scales of all KV heads of a slot, since
a TMA row must be 16 bytes: the neighbouring heads' programs read the same sectors) stream
through ``stages`` buffers with TMA, K and V on separate barriers, each buffer refilled as soon
as the step has decoded it.

The decode works on the cache's own bytes (the ``QTensor`` layout, nothing repacked). In the
``wgmma`` register layout thread ``t = 32 w + 4 a + b`` holds, of rows ``16 w + a`` and
``16 w + 8 + a``, the columns ``8 j + 2 b + {0, 1}``; the kernel chooses which D position each
column stands for (``column_order``): thread ``b``'s columns are the ``D / 4`` positions from
``D b / 4`` (one 16-byte load per row, whole scale blocks), column ``8 j + 2 b + v`` holding
position ``D b / 4 + 8 (j // 4) + j % 4 + 4 v``. So the two halves of a decoded bf16 pair are
nibbles ``i`` and ``i + 4`` of one 32-bit code word, 16 bits apart, and one masked multiply
moves both halves' sign and magnitude bits into place (``_WORD_ASM``). q's columns are put in
the same order in XLA (``q.k`` is a sum over D in any order), and the output's rows come back
in it and are put back in XLA. The V tile, which goes to shared memory, is decoded into Mosaic's
8-element-vector layout instead (thread ``b`` holding columns ``32 u + 8 b .. + 7`` of its
rows): each code word's four pairs become one 16-byte store; the output's rows follow that
tile's column order.

MXFP4 (D = 128): a row's four E8M0 exponents are one word; the largest goes to the top of
bf16's range (``_MX_SCALE_ASM``) and the row's power of two multiplies its score / probability,
as the global scale does for both formats.

The K/V append can be fused (``attend(..., append=...)``, used by
``fp4_decode_attention.decode_attention_append(..., tensor_cores=True)``): the cache operands
are mutable references, and the one program whose tile holds the new slot copies the new rows
into its shared-memory copy of the tile before decoding it, and into the cache.

``decode="asm"``: the decode is PTX inside ``plgpu.inline_mgpu`` (GPU only). ``"portable"``: the
same values in ``jnp``, both operands through shared memory (the interpreter's ``wgmma`` takes
no register operand), for interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_layout import check_shapes, combine_splits, default_splits
from trace_jax import fp4
from trace_jax.fp4.kv_format import Stored

_BK = 64  # slots per step: the wgmma M side of the scores
_COLS = 8  # query heads are padded to a multiple of 8 (the wgmma N side)
_OFFSET = 100  # as fp4_matmul: code * scale * 2**(100 - 126) is a normal bf16 for every code
_LOG2E = 1.4426950408889634
_NEG_INIT = -1e30  # running max before any valid slot (finite: exp2(-inf - -inf) would be NaN)
_SWIZZLE = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

Decode = Literal["asm", "portable"]


@dataclasses.dataclass(frozen=True)
class MgpuAttentionConfig:
    """Tiling of the tensor-core decode-attention kernel.

    Attributes:
      num_splits: programs per (sequence, KV head) along the sequence (flash-decoding splits).
      stages: K/V tile buffers in flight per program (64 slots each).
      p_parts: bf16 parts of the probabilities in the output's multiply: 2 (hi + lo, ~16
        significant bits) or 1 (rounded to bf16 once, as the Triton kernel).
      overlap_v: decode the V tile while the scores' multiply runs (between its issue and
        its wait) instead of after the softmax.
      auto_barriers: let Pallas put a warpgroup barrier before every TMA copy and around every
        shared-memory store (about 12 per step). False: only the kernel's own ``commit_smem``
        per step, which is all its memory order needs: each step's reads of a slot's buffers
        and its stores of the V tile and p all come before that barrier, the copies refilling
        the slot after it, and a store overwrites only what an already awaited multiply read.
      decode: "asm" (PTX, GPU only) or "portable" (jnp; used automatically in interpret mode).
    """

    num_splits: int = 8
    stages: int = 2
    p_parts: int = 2
    overlap_v: bool = False
    auto_barriers: bool = True
    decode: Decode = "asm"

    def __post_init__(self):
        if self.num_splits < 1 or self.stages < 1:
            raise ValueError(f"MgpuAttentionConfig: num_splits and stages must be >= 1: {self}")
        if self.p_parts not in (1, 2):
            raise ValueError(f"MgpuAttentionConfig.p_parts must be 1 or 2: {self}")
        if self.decode not in ("asm", "portable"):
            raise ValueError(f"MgpuAttentionConfig.decode: unknown {self.decode!r}")


def default_config(batch: int, max_len: int, kv_heads: int) -> MgpuAttentionConfig:
    """The Triton kernel's splits rule (``kv_layout.default_splits``) over 64-slot steps, 2
    buffers."""
    return MgpuAttentionConfig(num_splits=default_splits(batch, kv_heads, max(1, max_len // _BK)))


def supports(k: Stored, v: Stored, q_heads: int) -> bool:
    """Whether the kernel takes this cache: NVFP4 K and V with D a multiple of 64 (at most 256)
    or MXFP4 with D = 128 (a head's four scale bytes are one 32-bit word), a length that is a
    multiple of 64, at most 256 query heads per KV head, and 16-byte TMA rows for the scales of
    a slot (Hkv a multiple of 4)."""
    if not all(isinstance(t, fp4.QTensor) for t in (k, v)):
        return False
    fmt = k.fmt.name
    if fmt not in ("nvfp4", "mxfp4") or v.fmt.name != fmt:
        return False
    _, s, hkv, d = k.shape
    return (
        (d % 64 == 0 and d <= 256 if fmt == "nvfp4" else d == 128)
        and s % _BK == 0
        and hkv % 4 == 0
        and q_heads % hkv == 0
        and q_heads // hkv <= 256
    )


def column_order(d: int, layout: str = "wgmma") -> np.ndarray:
    """[D] int: the D position that each column of the kernel's [64, D] tiles holds (a
    permutation; see the module docstring). ``layout``: "wgmma" (the K tile, the register
    operand: thread b's column 8 j + 2 b + v holds position D b / 4 + 8 (j // 4) + j % 4 + 4 v)
    or "vector" (the V tile, stored to shared memory from 8-element vectors: thread b's column
    32 u + 8 b + 2 i + v holds position D b / 4 + 8 u + i + 4 v)."""
    col = np.arange(d)
    if layout == "wgmma":
        j, b, v = col // 8, (col % 8) // 2, col % 2
        return (d // 4) * b + 8 * (j // 4) + j % 4 + 4 * v
    u, b, i, v = col // 32, (col % 32) // 8, (col % 8) // 2, col % 2
    return (d // 4) * b + 8 * u + i + 4 * v


def _column_axes(d: int, layout: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``column_order`` as a transpose: the sizes of D's axes (b, u, v, i) = [4, D/32, 2, 4]
    (position (D/4) b + 8 u + 4 v + i) and the permutation of them that makes the columns
    ("wgmma": (u, i, b, v); "vector": (u, b, i, v))."""
    return (4, d // 32, 2, 4), ((1, 3, 0, 2) if layout == "wgmma" else (1, 0, 3, 2))


def to_columns(x: jax.Array, layout: str = "wgmma") -> jax.Array:
    """``x[..., column_order(D, layout)]`` for x [..., D], as a reshape and transpose (which XLA
    fuses into its neighbours, where an indexed gather stays an op of its own)."""
    *lead, d = x.shape
    sizes, perm = _column_axes(d, layout)
    k = len(lead)
    y = x.reshape(*lead, *sizes).transpose(*range(k), *(k + a for a in perm))
    return y.reshape(*lead, d)


def from_columns(x: jax.Array, layout: str = "wgmma") -> jax.Array:
    """The inverse of ``to_columns``: [..., D] in column order -> D order."""
    *lead, d = x.shape
    sizes, perm = _column_axes(d, layout)
    k = len(lead)
    y = x.reshape(*lead, *(sizes[a] for a in perm))
    return y.transpose(*range(k), *(k + a for a in np.argsort(perm))).reshape(*lead, d)


# ----------------------------------------------------------------------------- decode

# Code word x (8 nibbles, D positions 8u .. 8u + 7 from the low nibble) and the scale pair $5 ->
# the bf16 pairs of nibbles (i, i + 4), i = 0..3, worth code * scale * 2**(offset - 126). For
# nibble i of each 16-bit lane, x masked to that nibble times (2**(6 - 4i') + 2**(12 - 4i'))
# puts a copy of it at bits 6..9 and one at 12..15 of the lane (disjoint bits: no carry), i.e.
# the magnitude at 6..8 and the sign at 15; i' = i % 2 after shifting x right by 8 for i >= 2.
# The bf16 pair is then code * 2**-126 (the 0.5 code a subnormal; bf16 arithmetic keeps it)
# and ``mul.bf16x2`` by the scale pair finishes it, exactly.
_WORD_ASM = """
{
.reg .b32 t, y;
and.b32 t, $4, 0x000F000F;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $0, t, $5;
and.b32 t, $4, 0x00F000F0;
mul.lo.u32 t, t, 0x104;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $1, t, $5;
shr.b32 y, $4, 8;
and.b32 t, y, 0x000F000F;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $2, t, $5;
and.b32 t, y, 0x00F000F0;
mul.lo.u32 t, t, 0x104;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $3, t, $5;
}
"""
# E4M3 scale byte -> the bf16 pair (scale * 2**offset, same) = byte * mult + bias
_SCALE_MULT = 0x00100010
_SCALE_BIAS = ((_OFFSET + 120) << 7) * 0x10001

# MXFP4 (D = 128): a row's four E8M0 block exponents $2 (one word) and the bit offset $3 of the
# thread's block -> $0 the block's bf16 scale pair and $1 the float32 bits of the row's factor.
# As the Triton kernel, the row's largest exponent m goes to the top of bf16's range: the pair
# is 2**(x - m + 127) (x the block's byte), so the decoded value code * 2**-126 * pair is
# code * 2**(x - 127) * 2**(128 - m), and the factor 2**(m - 128) (at least 2**-126) restores
# it. Blocks more than 126 binades below the row's largest decode to 0 (their products would be
# bf16 subnormals). A NaN block (0xFF) makes the factor NaN and still decodes finite values, so
# a masked-out slot never yields a non-finite tile.
_MX_SCALE_ASM = """
{
.reg .b32 lo, hi, mm, m, x, e, f;
.reg .pred p;
and.b32 lo, $2, 0x00FF00FF;
shr.b32 hi, $2, 8;
and.b32 hi, hi, 0x00FF00FF;
max.u16x2 mm, lo, hi;
and.b32 lo, mm, 0xFFFF;
shr.b32 hi, mm, 16;
max.u32 m, lo, hi;
bfe.u32 x, $2, $3, 8;
sub.s32 e, x, m;
add.s32 e, e, 254;
setp.lt.s32 p, e, 128;
selp.b32 e, 0, e, p;
mul.lo.u32 $0, e, 0x00800080;
sub.s32 f, m, 1;
max.s32 f, f, 1;
shl.b32 f, f, 23;
setp.eq.u32 p, m, 255;
selp.b32 $1, 0x7FC00000, f, p;
}
"""


def inline_ptx() -> dict[str, tuple[str, int, int]]:
    """name -> (PTX text with $i operands, outputs, inputs) of the decode blocks the kernel
    inlines (for compiling them offline: ``experiments/bench/offline_sass.py``)."""
    return {
        "attention code word": (_WORD_ASM, 4, 2),
        "attention mxfp4 scales": (_MX_SCALE_ASM, 2, 2),
    }


def _first_row(t, c):
    """MLIR: the first of the two rows that warpgroup thread ``t = 32 w + 4 a + b`` holds in the
    ``wgmma`` layouts, ``16 w + a`` (its second is 8 below); ``c`` makes i32 constants."""
    from jax._src.lib.mlir.dialects import arith

    return arith.addi(
        arith.muli(arith.shrui(t, c(5)), c(16)), arith.shrui(arith.andi(t, c(31)), c(2))
    )


def _decode_asm(codes_ref, scales_ref, d: int, fmt: str, layout: str = "wgmma"):
    """[64, D/8] uint32 code words and one KV head's block scales in shared memory (NVFP4:
    [64, D/16] uint8 E4M3 bytes; MXFP4: [64, 1] uint32, the four E8M0 bytes) -> (the bf16
    [64, D] tile, columns in ``column_order(D, layout)``: in the ``wgmma`` register layout, or
    with ``layout="vector"`` in Mosaic's 8-element-vector layout (each code word's four pairs
    one 16-byte vector, stored to shared memory in one instruction); the rows' float32 factors
    [64] in the layout of s^T's rows, or None for NVFP4, whose factor is the constant
    ``2**(126 - offset)``)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, vector
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    words = d // 32  # code words of a thread's row
    blocks = d // 64  # NVFP4 scale blocks of a thread's row
    mx = fmt == "mxfp4"
    vectors = layout == "vector"
    tile_layout = mgpu.WGMMA_LAYOUT_UPCAST_4X if vectors else mgpu.WGMMA_LAYOUT
    tile_type = plgpu.ShapeDtypeStruct(
        (_BK, d),
        jnp.bfloat16,
        layout=plgpu.Layout.WGMMA_UPCAST_4X if vectors else plgpu.Layout.WGMMA,
    )
    row_type = plgpu.ShapeDtypeStruct((_BK,), jnp.float32, layout=plgpu.Layout.WGMMA.reduce(1))

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType()),
        return_type=(tile_type, row_type) if mx else tile_type,
    )
    def decode(_, c_ref, s_ref):
        i32 = ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        c = lambda v: arith.constant(i32, v)  # noqa: E731
        idx = lambda v: arith.index_cast(index, v)  # noqa: E731
        t = arith.remui(mgpu_utils.thread_idx(), c(128))
        lane_b = arith.andi(t, c(3))
        r0 = _first_row(t, c)
        pair = ir.VectorType.get((2,), ir.BF16Type.get())
        eight = ir.VectorType.get((8,), ir.BF16Type.get())
        struct = llvm.StructType.get_literal([i32] * 4)
        regs = np.empty(tile_layout.registers_shape((_BK, d)), dtype=object)
        row_layout = mgpu.WGMMA_ROW_LAYOUT
        factors = np.empty(row_layout.registers_shape((_BK,)), dtype=object)
        for rh in range(2):
            row = arith.addi(r0, c(8 * rh))
            first = idx(arith.muli(lane_b, c(words)))
            vec = vector.load(ir.VectorType.get((words,), i32), c_ref, [idx(row), first])
            if mx:  # the thread's 32 positions are block b
                word = memref.load(s_ref, [idx(row), arith.constant(index, 0)])
                pair_struct = llvm.StructType.get_literal([i32] * 2)
                out = llvm.inline_asm(
                    pair_struct, [word, arith.muli(lane_b, c(8))], _MX_SCALE_ASM, "=r,=r,r,r"
                )
                sc = [llvm.extractvalue(i32, out, [0])]
                bits = llvm.extractvalue(i32, out, [1])
                f32 = ir.F32Type.get()
                factors[0, 0, rh, 0, 0] = vector.broadcast(
                    ir.VectorType.get((1,), f32), arith.bitcast(f32, bits)
                )
            else:
                sc = []
                for q in range(blocks):
                    col = arith.addi(arith.muli(lane_b, c(blocks)), c(q))
                    byte = arith.extui(i32, memref.load(s_ref, [idx(row), idx(col)]))
                    sc.append(arith.addi(arith.muli(byte, c(_SCALE_MULT)), c(_SCALE_BIAS)))
            for u in range(words):
                x = vector.extract(vec, [], [u])
                out = llvm.inline_asm(
                    struct, [x, sc[0 if mx else u // 2]], _WORD_ASM, "=r,=r,=r,=r,r,r"
                )
                bits = [llvm.extractvalue(i32, out, [i]) for i in range(4)]
                if vectors:  # the word's four pairs: one vector of 8
                    four = vector.from_elements(ir.VectorType.get((4,), i32), bits)
                    regs[0, u, 0, 0, rh, 0, 0, 0, 0] = vector.bitcast(eight, four)
                    continue
                for i in range(4):
                    regs[0, 4 * u + i, 0, 0, rh, 0, 0, 0, 0] = mgpu_utils.bitcast(bits[i], pair)
        tile = mgpu.FragmentedArray(_registers=regs, _layout=tile_layout, _is_signed=None)
        if not mx:
            return tile
        return tile, mgpu.FragmentedArray(_registers=factors, _layout=row_layout, _is_signed=None)

    out = decode(codes_ref, scales_ref)
    return out if mx else (out, None)


def decode_tile_reference(
    words: jax.Array, scales: jax.Array, fmt: str = "nvfp4", layout: str = "wgmma"
):
    """What the decode makes, in ``jnp``: code words [R, D/8] uint32 and one KV head's block
    scales (NVFP4: E4M3 bytes [R, D/16] uint8; MXFP4: [R] or [R, 1] uint32 of four E8M0
    bytes, D = 128) -> (bf16 [R, D] in ``column_order(D, layout)``, float32 [R] row factors)
    whose product is the dequantized row before its global scale: exactly, except MXFP4 blocks
    more than 126 binades below the row's largest, which decode to 0 (``_MX_SCALE_ASM``)."""
    r, n = words.shape
    d = 8 * n
    nib = jnp.stack([(words >> (4 * i)) & 0xF for i in range(8)], axis=-1).reshape(r, d)
    mag = (nib & 7).astype(jnp.float32)
    e2m1 = 0.5 * mag + 0.5 * jnp.maximum(mag - 4, 0) + jnp.maximum(mag - 6, 0)
    val = jnp.where(nib >= 8, -e2m1, e2m1)
    pow2 = lambda e: lax.bitcast_convert_type(e.astype(jnp.uint32) << 23, jnp.float32)  # noqa: E731
    if fmt == "nvfp4":
        # E4M3 (bias 7, normal: quantized NVFP4 scales are) -> scale * 2**(offset - 126)
        sb = scales.astype(jnp.uint32)
        sf = lax.bitcast_convert_type(((sb & 0x7F) << 20) + ((_OFFSET - 6) << 23), jnp.float32)
        val = (val.reshape(r, d // 16, 16) * sf[:, :, None]).reshape(r, d)
        factor = jnp.full((r,), 2.0 ** (126 - _OFFSET), jnp.float32)
    else:
        w = scales.reshape(r).astype(jnp.uint32)
        x = jnp.stack([(w >> (8 * j)) & 0xFF for j in range(4)], axis=-1).astype(jnp.int32)
        m = jnp.max(x, axis=-1, keepdims=True)
        e = x - m + 254  # the pair's exponent field: value code * 2**(e - 253), normal for e >= 128
        sf = jnp.where(e >= 128, pow2(jnp.maximum(e - 126, 1)), 0.0)  # 2**(e - 253)
        val = (val.reshape(r, 4, 32) * sf[:, :, None]).reshape(r, d)
        factor = jnp.where(m[:, 0] == 255, jnp.nan, pow2(jnp.maximum(m[:, 0] - 1, 1)))
    # D position (D/4) b + 8 u + 4 v + i -> column 8 (4 u + i) + 2 b + v ("wgmma") or
    # 32 u + 8 b + 2 i + v ("vector"): ``column_order``
    val = val.reshape(r, 4, d // 32, 2, 4)
    val = val.transpose((0, 2, 4, 1, 3) if layout == "wgmma" else (0, 2, 1, 4, 3))
    return val.reshape(r, d).astype(jnp.bfloat16), factor


def _decode_portable(codes_ref, scales_ref, d: int, fmt: str, layout: str = "wgmma"):
    return decode_tile_reference(codes_ref[...], scales_ref[...], fmt, layout)


def _load_column(ref):
    """A [64, 1] float32 column (shared or global memory) -> [64] in the layout of s^T's rows
    (each thread loads its two rows)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref, vector
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct(
            (_BK,), jnp.float32, layout=plgpu.Layout.WGMMA.reduce(1)
        ),
    )
    def load(_, ref):
        i32 = ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        c = lambda v: arith.constant(i32, v)  # noqa: E731
        t = arith.remui(mgpu_utils.thread_idx(), c(128))
        r0 = _first_row(t, c)
        layout = mgpu.WGMMA_ROW_LAYOUT
        regs = np.empty(layout.registers_shape((_BK,)), dtype=object)
        vec = ir.VectorType.get((1,), ir.F32Type.get())
        zero = arith.constant(index, 0)
        for rh in range(2):
            row = arith.index_cast(index, arith.addi(r0, c(8 * rh)))
            regs[0, 0, rh, 0, 0] = vector.broadcast(vec, memref.load(ref, [row, zero]))
        return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    return load(ref)


def _copy_row(src, dsts, portable: bool):
    """Copy a short [n] row (n <= 128) from global memory into each of ``dsts`` (shared or
    global memory): one element per thread of the warpgroup."""
    if portable:
        for dst in dsts:
            dst[...] = src[...]
        return
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref, scf
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * (1 + len(dsts)))
    def copy(_, src_ref, *dst_refs):
        i32 = ir.IntegerType.get_signless(32)
        t = arith.remui(mgpu_utils.thread_idx(), arith.constant(i32, 128))
        n = ir.MemRefType(src_ref.type).shape[0]
        inside = arith.cmpi(arith.CmpIPredicate.ult, t, arith.constant(i32, n))
        branch = scf.IfOp(inside)
        with ir.InsertionPoint(branch.then_block):
            i = arith.index_cast(ir.IndexType.get(), t)
            value = memref.load(src_ref, [i])
            for dst_ref in dst_refs:
                memref.store(value, dst_ref, [i])
            scf.yield_([])

    copy(src, *dsts)


# ----------------------------------------------------------------------------- kernel


def _kernel(
    len_gmem,
    q_gmem,
    kc_gmem,
    ks_gmem,
    kg_gmem,
    vc_gmem,
    vs_gmem,
    vg_gmem,
    *refs,
    cfg,
    d,
    gp,
    splits,
    sm_scale,
    window,
    fmt,
    fused,
):
    """One (KV head, split, sequence) program. With ``fused``, ``refs`` starts with the new
    token's slot [B] int32 (-1: none) and its stored K and V rows (codes [B, Hkv, D/8], scales
    [B, Hkv * X], global scales [B, Hkv]), and the six cache operands are mutable: the program
    whose tile holds the new slot writes the rows into its shared-memory copy of the tile
    (before the decode reads it), its global scales into the step's registers, and all of them
    into the cache."""
    h = lax.axis_index("h")
    s_len, hkv = kc_gmem.shape[1], kc_gmem.shape[2]
    split = lax.axis_index("s")
    b = lax.axis_index("b")
    if fused:
        slot_gmem, *new_rows = refs[:7]
        refs = refs[7:]
        new_slot = slot_gmem[b]  # read once, before the loop
    o_gmem, m_gmem, l_gmem = refs
    hi = len_gmem[b]
    lo = jnp.maximum(hi - window, 0) if window is not None else jnp.int32(0)
    lo_aligned = (lo // _BK) * _BK
    n_blocks = jnp.maximum(pl.cdiv(hi - lo_aligned, _BK), 0)
    per_split = pl.cdiv(n_blocks, splits)
    first = split * per_split
    n_steps = jnp.clip(n_blocks - first, 0, per_split)
    portable = cfg.decode == "portable"
    decode = functools.partial(_decode_portable if portable else _decode_asm, d=d, fmt=fmt)
    logit_scale = np.float32(sm_scale * _LOG2E)  # softmax in base 2
    # block scales: a TMA row is 16 bytes, so a tile holds the scales of ``group`` KV heads
    width = ks_gmem.shape[-1] // hkv  # one head's scale elements per slot
    group = max(1, 16 // (width * ks_gmem.dtype.itemsize))
    box = group * width

    def head_scales(ref):
        """This KV head's block scales in a [64, group * X] tile."""
        return ref.at[:, pl.ds(lax.rem(h, group) * width, width)]

    def with_factor(row, factor):
        return row * (np.float32(2.0 ** (126 - _OFFSET)) if factor is None else factor)

    def tile_start(t):
        return lo_aligned + (first + t) * _BK

    def global_scales(t):
        """Step t's K and V global scales of this head, [64] float32 each in the layout of s^T's
        rows, loaded from global memory by each thread for its rows (a step ahead of their use:
        no shared memory, no copy to wait for); rows clamped into the cache past the last
        step."""
        start = jnp.clip(tile_start(t), 0, s_len - _BK)
        rows = [ref.at[b, pl.ds(start, _BK), pl.ds(h, 1)] for ref in (kg_gmem, vg_gmem)]
        if portable:
            return tuple(r[...][:, 0] for r in rows)
        return tuple(_load_column(r) for r in rows)

    def put_new_row(start, tiles, slot, rows, cache):
        """The new token's stored row, where this step's tile holds its slot: into the tile's
        two buffers (codes, this head's scales) and the cache (codes, scales, global scale)."""
        new = new_slot
        r = new - start

        @pl.when((new >= 0) & (r >= 0) & (r < _BK))
        def _():
            c_buf, s_buf = tiles
            c_row, s_row, g_row = rows
            c_gmem, s_gmem, g_gmem = cache
            at_head = pl.ds(h * width, width)
            in_tile = pl.ds(lax.rem(h, group) * width, width)
            for src, dsts in (
                (c_row.at[b, h], (c_buf.at[slot, r], c_gmem.at[b, new, h])),
                (s_row.at[b, at_head], (s_buf.at[slot, r, in_tile], s_gmem.at[b, new, at_head])),
                (g_row.at[b, pl.ds(h, 1)], (g_gmem.at[b, new, pl.ds(h, 1)],)),
            ):
                _copy_row(src, dsts, portable)
            plgpu.commit_smem()  # the decode's threads read what others wrote

    def body(q_smem, kc, ks, vc, vs, vdec, p_smem, kbar, vbar, qbar, kdec=None):
        plgpu.copy_gmem_to_smem(q_gmem.at[b, h], q_smem, qbar.at[0])

        def issue(t, slot):
            rows = pl.ds(tile_start(t), _BK)
            cols = pl.ds(lax.div(h, group) * box, box)
            for src, dst, bar in (
                (kc_gmem.at[b, rows, h], kc, kbar),
                (ks_gmem.at[b, rows, cols], ks, kbar),
                (vc_gmem.at[b, rows, h], vc, vbar),
                (vs_gmem.at[b, rows, cols], vs, vbar),
            ):
                plgpu.copy_gmem_to_smem(src, dst.at[slot], bar.at[slot])

        for s in range(cfg.stages):
            pl.when(s < n_steps)(functools.partial(issue, s, s))
        plgpu.barrier_wait(qbar.at[0])

        def step(t, carry):
            o, m, lsum, (k_glob, v_glob) = carry
            next_glob = global_scales(jnp.minimum(t + 1, n_steps - 1))
            slot = lax.rem(t, cfg.stages)
            start = tile_start(t)
            if fused:  # the new slot's global scales: read before they were written
                row_pos = start + plgpu.broadcasted_iota(
                    jnp.int32, (_BK,), 0, layout=plgpu.Layout.WGMMA.reduce(1)
                )
                k_glob = jnp.where(row_pos == new_slot, new_rows[2][b, h], k_glob)
                v_glob = jnp.where(row_pos == new_slot, new_rows[5][b, h], v_glob)
            plgpu.barrier_wait(kbar.at[slot])
            if fused:
                put_new_row(start, (kc, ks), slot, new_rows[:3], (kc_gmem, ks_gmem, kg_gmem))
            a, k_factor = decode(kc.at[slot], head_scales(ks.at[slot]))

            def decode_v():
                """The V tile into shared memory; returns its rows' factors."""
                plgpu.barrier_wait(vbar.at[slot])
                if fused:
                    put_new_row(start, (vc, vs), slot, new_rows[3:], (vc_gmem, vs_gmem, vg_gmem))
                v_tile, v_factor = decode(vc.at[slot], head_scales(vs.at[slot]), layout="vector")
                vdec[...] = v_tile
                return v_factor

            def scores(acc_ref):
                if kdec is None:
                    plgpu.wgmma(acc_ref, a, q_smem.T)
                else:
                    kdec[...] = a
                    plgpu.commit_smem()
                    plgpu.wgmma(acc_ref, kdec, q_smem.T)
                v_factor = decode_v() if cfg.overlap_v else None
                return acc_ref[...], v_factor

            st, v_factor = pl.run_scoped(scores, plgpu.ACC((_BK, gp), jnp.float32))
            pos = start + plgpu.broadcasted_iota(jnp.int32, st.shape, 0, layout=plgpu.Layout.WGMMA)
            s = st * lax.broadcast_in_dim(
                with_factor(k_glob, k_factor) * logit_scale, st.shape, [0]
            )
            valid = (pos >= lo) & (pos < hi)
            s = jnp.where(valid, s, -jnp.inf)

            m_new = jnp.maximum(m, s.max(axis=0))
            alpha = jnp.exp2(m - m_new)
            m = m_new
            o = o * lax.broadcast_in_dim(alpha, o.shape, [1])
            lsum = lsum * lax.broadcast_in_dim(alpha, lsum.shape, [1])
            p = jnp.exp2(s - lax.broadcast_in_dim(m, s.shape, [1]))
            lsum = lsum + p
            if not cfg.overlap_v:
                v_factor = decode_v()
            v_row = with_factor(v_glob, v_factor)
            pv = p * lax.broadcast_in_dim(v_row, s.shape, [0])
            pv = jnp.where(valid, pv, 0.0)
            p_hi = pv.astype(jnp.bfloat16)
            p_smem.at[0].T[...] = p_hi
            if cfg.p_parts == 2:
                p_smem.at[1].T[...] = (pv - p_hi.astype(jnp.float32)).astype(jnp.bfloat16)
            plgpu.commit_smem()  # every thread's reads of this slot's buffers are done too

            @pl.when(t + cfg.stages < n_steps)
            def _():
                issue(t + cfg.stages, slot)

            def pv_mma(acc_ref):
                for part in range(cfg.p_parts):
                    plgpu.wgmma(acc_ref, vdec.T, p_smem.at[part].T)

            if portable:  # (the interpreter takes no initialised accumulator)
                o = o + pl.run_scoped(
                    lambda acc: (pv_mma(acc), acc[...])[1], plgpu.ACC((d, gp), jnp.float32)
                )
            else:  # o += V^T p^T in the accumulator itself
                o = pl.run_state(pv_mma)(plgpu.ACC.init(o))
            return o, m, lsum, next_glob

        wgmma = plgpu.Layout.WGMMA
        init = (
            plgpu.layout_cast(jnp.zeros((d, gp), jnp.float32), wgmma),
            plgpu.layout_cast(jnp.full((gp,), _NEG_INIT, jnp.float32), wgmma.reduce(0)),
            plgpu.layout_cast(jnp.zeros((_BK, gp), jnp.float32), wgmma),
            global_scales(0),
        )
        o, m, lsum, _ = lax.fori_loop(0, n_steps, step, init)
        return o, m, lsum

    scale_dtype = ks_gmem.dtype
    scratch = [
        plgpu.SMEM((gp, d), jnp.bfloat16, transforms=_SWIZZLE),  # q
        plgpu.SMEM((cfg.stages, _BK, d // 8), jnp.uint32),  # K code words
        plgpu.SMEM((cfg.stages, _BK, box), scale_dtype),  # K block scales of `group` heads
        plgpu.SMEM((cfg.stages, _BK, d // 8), jnp.uint32),
        plgpu.SMEM((cfg.stages, _BK, box), scale_dtype),
        plgpu.SMEM((_BK, d), jnp.bfloat16, transforms=_SWIZZLE),  # decoded V
        plgpu.SMEM((cfg.p_parts, gp, _BK), jnp.bfloat16, transforms=_SWIZZLE),  # p^T's transpose
        plgpu.Barrier(num_arrivals=2, num_barriers=cfg.stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=cfg.stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=1),
    ]
    if portable:
        scratch.append(plgpu.SMEM((_BK, d), jnp.bfloat16, transforms=_SWIZZLE))
    o, m, lsum = pl.run_scoped(lambda *refs: body(*refs), *scratch)
    l = lsum.sum(axis=0)

    def store(o_smem, m_smem, l_smem):
        o_smem[...] = o
        m_smem[...] = m
        l_smem[...] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, h, split])
        plgpu.copy_smem_to_gmem(m_smem, m_gmem.at[b, h, split])
        plgpu.copy_smem_to_gmem(l_smem, l_gmem.at[b, h, split])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        store,
        plgpu.SMEM((d, gp), jnp.float32),
        plgpu.SMEM((gp,), jnp.float32),
        plgpu.SMEM((gp,), jnp.float32),
    )


def _operands(stored: fp4.QTensor) -> list[jax.Array]:
    """Code words [B, S, Hkv, D/8] uint32, block scales (NVFP4: [B, S, Hkv * D/16] uint8
    E4M3 bytes; MXFP4: [B, S, Hkv] uint32, each the four E8M0 bytes of a head) and global scales
    [B, S, Hkv] float32: views of the cache's arrays (no copy)."""
    b, s, hkv, d = stored.shape
    as_u8 = lambda a: a if a.dtype == jnp.uint8 else lax.bitcast_convert_type(a, jnp.uint8)  # noqa: E731
    words = lax.bitcast_convert_type(as_u8(stored.codes).reshape(b, s, hkv, d // 8, 4), jnp.uint32)
    scales = as_u8(stored.block_scales)
    if stored.fmt.name == "mxfp4":
        scales = lax.bitcast_convert_type(scales.reshape(b, s, hkv, 4), jnp.uint32)
    else:
        scales = scales.reshape(b, s, hkv * d // 16)
    return [words, scales, stored.global_scale.reshape(b, s, hkv).astype(jnp.float32)]


@functools.partial(jax.jit, static_argnames=("sm_scale", "window", "config", "interpret"))
def decode_attention_mgpu(
    q: jax.Array,
    k: fp4.QTensor,
    v: fp4.QTensor,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    config: MgpuAttentionConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``fp4_decode_attention.decode_attention`` on an NVFP4 or MXFP4 cache, on the tensor
    cores.

    Args:
      q: [B, Hq, D] bf16, the new tokens' queries (Hq a multiple of Hkv).
      k, v: the layer's NVFP4 or MXFP4 cache, logical [B, S, Hkv, D] (``supports`` says which
        shapes).
      lengths: [B] int32, valid slots per sequence; slots >= length are ignored.
      sm_scale: logit scale, 1/sqrt(D) when None.
      window: attend to the last ``window`` slots only; None: all.
      config: tiling; ``default_config(B, S, Hkv)`` when None.
      interpret: the Mosaic GPU interpreter (CPU tests; the portable decode).
    Returns:
      [B, Hq, D] bf16 (zeros for a sequence of length 0).
    """
    out, _ = attend(q, k, v, lengths, sm_scale, window, config, interpret)
    return out


def attend(q, k, v, lengths, sm_scale, window, config, interpret, append=None):
    """``decode_attention_mgpu``'s work (to be called under jit); with ``append`` = (slots [B]
    int32, -1 for none; the new token's stored K and V, ``QTensor`` [B, 1, Hkv, D] each) the
    kernel also writes the new rows into the cache operands in place (``lengths`` counting the
    new token). Returns (out [B, Hq, D] bf16, the written K and V cache operands (``_operands``
    order), or None without ``append``)."""
    _, (b, s, hkv, d) = check_shapes(q, k, v, window, "decode_attention_mgpu")
    if not supports(k, v, q.shape[1]):
        raise ValueError(
            f"decode_attention_mgpu: needs NVFP4 K and V with D a multiple of 64 (<= 256) or "
            f"MXFP4 with D = 128, S a multiple of 64 and Hkv a multiple of 4; got "
            f"{k.fmt.name}/{v.fmt.name} [B={b}, S={s}, Hkv={hkv}, D={d}]"
        )
    cfg = config or default_config(b, s, hkv)
    if interpret:
        cfg = dataclasses.replace(cfg, decode="portable")
    cfg = dataclasses.replace(cfg, stages=max(1, min(cfg.stages, s // _BK)))
    hq = q.shape[1]
    g = hq // hkv
    gp = -(-g // _COLS) * _COLS
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    qp = to_columns(q.astype(jnp.bfloat16).reshape(b, hkv, g, d))
    if gp != g:
        qp = jnp.pad(qp, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    splits = cfg.num_splits
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            cfg=cfg,
            d=d,
            gp=gp,
            splits=splits,
            sm_scale=sm_scale,
            window=window,
            fmt=k.fmt.name,
            fused=append is not None,
        ),
        out_type=(
            jax.ShapeDtypeStruct((b, hkv, splits, d, gp), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, splits, gp), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, splits, gp), jnp.float32),
        ),
        grid=(hkv, splits, b),
        grid_names=("h", "s", "b"),
        # exp2 as one ex2.approx.ftz.f32 (relative error ~2**-22; results below 2**-126 flush
        # to 0), as JAX's own attention kernels; nothing else in the kernel is approximated
        compiler_params=plgpu.CompilerParams(
            approx_math=True, unsafe_no_auto_barriers=not cfg.auto_barriers
        ),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    cache = _operands(k) + _operands(v)
    extra = []
    if append is not None:  # the cache operands become mutable: written in place
        slots, new_k, new_v = append
        cache = [jax.new_ref(a) for a in cache]
        rows = [a[:, 0] for a in _operands(new_k) + _operands(new_v)]
        extra = [slots.astype(jnp.int32), *rows]
    o_t, m, l = kernel(lengths.astype(jnp.int32), qp, *cache, *extra)
    # o^T rows come in the V tile's column order: back to D order, heads first
    o = from_columns(jnp.swapaxes(o_t[..., :g], -1, -2), "vector")
    (out,) = combine_splits([o], m[..., :g], l[..., :g])
    out = out.reshape(b, hq, d).astype(jnp.bfloat16)
    return out, ([jax.freeze(r) for r in cache] if append is not None else None)
