"""Operand layouts of the FP4 matmul kernels, and the prepacking that builds them once at load.

Below every kernel (it imports none): a weight is quantized once (``trace_jax.fp4.QTensor``) and
arranged here into what each kernel streams; the kernels and their dispatchers take the result.

* ``Fp4Weight`` (``prepack``, ``prepack_grouped``): the ``QTensor``'s codes unchanged, its block
  scales as bytes with a power-of-two offset ``c`` folded in (``prepack_arrays``: exact bf16
  products in the kernels' decode), the output scale ``global_scale * 2**(126 - c)`` per row, and
  optional second copies of the codes in the layouts below. Used by the Triton kernels
  (``fp4_matmul_triton``, ``fp4_grouped_matmul_triton``) as it is.
* The one-token kernel's word layout (``pack_gemv_words``, ``with_gemv_layout``;
  ``fp4_matmul_gemv``): 32-bit words of 8 codes whose bits sit where masks and shifts make
  float16 pairs; inside each ``block_k`` step of a row, word ``(g, b)`` holds elements
  ``8g .. 8g+7`` of block ``b``, stored group-major, row tiles optionally contiguous per step.
* The tensor-core kernels' operand layout (``MgpuWeight``, ``prepack_mgpu``;
  ``fp4_matmul_mgpu``): per 64 x 64 tile, each warpgroup thread's codes of the ``wgmma``
  register operand as 4 words whose bits become bf16 pairs in one to four integer operations
  (``MGPU_SLOTS``), and one word of 4 block scales per row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.fp4 import FormatSpec, QTensor
from trace_jax.fp4.formats import E8M0_NAN

# Offset folded into NVFP4 block scales: scale * 2**100 is a normal bf16 for every E4M3 scale in
# [2**-6, 448], and code * scale * 2**(100 - 126) stays a normal bf16 for every nonzero code.
NVFP4_SCALE_OFFSET = 100

# ----------------------------------------------------------------------------- one-token layout

GEMV_BLOCK_K = 256  # the K granule prepack lays the one-token words out with
GEMV_BLOCK_N = 32  # the row tile it lays them out with (halved until it divides N)
GEMV_ROW_TILED = True  # prepack lays each (row tile, step) of words out contiguously
# Bit positions, inside a word, of slot r's 3 magnitude bits (lowest bit) and of its sign bit.
# Slot r is float16 lane r % 2 of pair r // 2 (``fp4_matmul_gemv``'s decode).
GEMV_MAG_BIT = (9, 25, 6, 22, 3, 19, 0, 16)
GEMV_SIGN_BIT = (15, 31, 12, 28, 14, 30, 13, 29)

# ----------------------------------------------------------------------------- tensor-core layout

MGPU_TILE_N = 64  # weight rows per tile: the wgmma register operand's rows
MGPU_CHUNK = 64  # K elements per tile (4 NVFP4 blocks)
# Bit positions in a code word: slot (pair P, element v) -> (sign bit, lowest magnitude bit).
# Pair P of word j is the operand pair (cto, rh) = (P // 2, P % 2); v is its element.
MGPU_SLOTS = {
    (0, 0): (15, 6),
    (0, 1): (31, 22),
    (1, 0): (9, 0),
    (1, 1): (25, 16),
    (2, 0): (14, 3),
    (2, 1): (30, 19),
    (3, 0): (10, 11),
    (3, 1): (26, 27),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MgpuWeight:
    """NVFP4 weights [*E, K, N] in the operand layout of the kernels (a pytree); ``E``: the
    experts of a grouped weight, absent for a dense one.

    Attributes:
      words: [*E, N/64, K/64, 2, 256] uint32, each thread's 4 code words per 64 x 64 tile
        (thread t at flat word 4 t; two 1 KB rows, so each TMA row is long).
      scales: [*E, N/64, K/64, 64] uint32, one word of 4 E4M3 block scales per row and tile.
      out_scale: [*E, N] float32, what multiplies the fp32 sums: ``global_scale * 2**(126 - c)``
        for the offset ``c`` folded into the scales; NaN for a row with a NaN (E8M0) scale.
      scale_format: "e4m3" (NVFP4: scale bytes are E4M3 bits, ``c`` = 100) or "e8m0" (MXFP4:
        bytes are the biased exponent plus ``c = 254 - max exponent``, each 32-element block's
        byte repeated for its two 16-element halves).
    """

    words: jax.Array
    scales: jax.Array
    out_scale: jax.Array
    scale_format: str = dataclasses.field(default="e4m3", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        *e, nt, kt = self.words.shape[:-2]
        return (*e, kt * MGPU_CHUNK, nt * MGPU_TILE_N)


# ----------------------------------------------------------------------------- prepacked weight


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp4Weight:
    """An FP4 weight [K, N] (or expert weights [E, K, N]) arranged once at load for the kernels
    (a pytree).

    Attributes:
      codes: [*E, N, K/2] uint8, the ``QTensor``'s codes unchanged.
      scales: [*E, N, K/block] uint8, the block scales' bytes (E4M3 bits or biased E8M0).
      scale_offset: int32 [], the power of two ``c`` folded into the block scales in-kernel.
      out_scale: [*E, N] float32, ``global_scale * 2**(126 - c)``; NaN where a row holds a NaN
        scale.
      qtensor: the source ``QTensor`` (for the reference and the XLA fallback; shares buffers).
      gemv_words: uint32, the codes again in the one-token kernel's word layout
        (``pack_gemv_words``), or None; a second copy of the codes.
      gemv_scales: the block scales tiled as ``gemv_words`` (row-tiled layout only), or None.
      gemv_block_k: the ``block_k`` granule ``gemv_words`` was packed with (0: none).
      gemv_block_n: the row tile of a row-tiled layout, 0 for rows in order.
      mgpu: the codes and scales again in the tensor-core kernels' operand layout
        (``prepack_mgpu``), or None; a second copy of the codes.
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
    mgpu: MgpuWeight | None = None

    @property
    def fmt(self) -> FormatSpec:
        return self.qtensor.fmt

    @property
    def shape(self) -> tuple[int, ...]:
        return self.qtensor.shape


def prepack(w: QTensor, *, mgpu: bool = True, gemv: bool | None = None) -> Fp4Weight:
    """Arrange a weight ``QTensor`` [K, N] (quantized along K, axis 0) for ``fp4_matmul``.

    ``mgpu``: for K and N multiples of 64, also store the codes and scales in the
    tensor-core kernel's operand layout (``fp4_matmul_mgpu``; one more copy: 4.5 bits per
    weight); up to ``fp4_matmul.MGPU_MAX_ROWS`` rows then run that kernel on a GPU, the fastest
    FP4 path measured there for 1 to 256 rows (BENCHMARKS.md).
    ``gemv``: for NVFP4, also store the one-token kernel's layout (``gemv_words``/
    ``gemv_scales``, one more copy) where the shape allows; one-token calls without the
    tensor-core layout then use that kernel. None: only when no tensor-core layout was made.
    """
    if len(w.shape) != 2 or w.axis != 0:
        raise ValueError(
            f"fp4_matmul needs a 2-D weight [K, N] quantized along axis 0, got shape {w.shape} "
            f"axis {w.axis}"
        )
    packed = prepack_arrays(w)
    k, n = w.shape
    if mgpu and mgpu_layout_fits(w.fmt, k, n):
        packed = dataclasses.replace(packed, mgpu=prepack_mgpu(w, packed))
    if gemv is None:
        gemv = packed.mgpu is None
    if gemv and w.fmt.scale_format == "e4m3" and gemv_supported(k, n, w.fmt):
        block_n = gemv_default_block_n(n) if GEMV_ROW_TILED else 0
        packed = with_gemv_layout(packed, GEMV_BLOCK_K, block_n)
    return packed


def prepack_grouped(w: QTensor, *, mgpu: bool = True) -> Fp4Weight:
    """Arrange expert weights ``QTensor`` [E, K, N] (quantized along K, axis 1) for the grouped
    kernels.

    Also takes the per-expert form ``jax.vmap(quantize)`` makes of [E, K, N] weights (logical
    shape [K, N], axis 0, arrays with a leading expert axis, one global scale per expert): the
    stored bytes are the same; the global scales become per-row ones.

    ``mgpu``: for K and N multiples of 64, also store the tensor-core kernel's layout
    (``fp4_matmul_mgpu.fp4_grouped_matmul_mgpu``; one more copy of the codes), which
    ``fp4_grouped_matmul.fp4_grouped_linear`` then runs on a GPU: the faster grouped kernel
    measured on the H200 (BENCHMARKS.md).
    """
    w = stack_experts(w)
    if len(w.shape) != 3 or w.axis != 1:
        raise ValueError(
            f"fp4_grouped_matmul needs weights [E, K, N] quantized along axis 1, got shape "
            f"{w.shape} axis {w.axis}"
        )
    packed = prepack_arrays(w)
    _, k, n = w.shape
    if mgpu and mgpu_layout_fits(w.fmt, k, n):
        packed = dataclasses.replace(packed, mgpu=prepack_mgpu(w, packed))
    return packed


def stack_experts(w: QTensor) -> QTensor:
    """A per-expert ``jax.vmap(quantize)`` ``QTensor`` -> the same bytes as one [E, K, N]
    ``QTensor`` along axis 1 whose per-row global scales [E, N, 1] repeat each expert's scale.
    Anything else is returned unchanged."""
    if not (len(w.shape) == 2 and w.axis == 0 and w.codes.ndim == 3):
        return w
    e, (k, n) = w.codes.shape[0], w.shape
    g = jnp.asarray(w.global_scale, jnp.float32)
    g = jnp.broadcast_to(g.reshape(e, 1, 1) if g.ndim == 1 else g, (e, n, 1))
    return QTensor(
        codes=w.codes,
        block_scales=w.block_scales,
        global_scale=g,
        fmt=w.fmt,
        shape=(e, k, n),
        axis=1,
    )


def prepack_arrays(w: QTensor) -> Fp4Weight:
    """The ``Fp4Weight`` fields every FP4 kernel shares (no second copy of the codes): works on
    [..., N, K/2] stored layouts, dense or grouped."""
    scales, offset, out_scale = _kernel_scales(
        w.block_scales, w.global_scale, w.codes.shape[:-1], w.fmt.scale_format
    )
    return Fp4Weight(
        codes=w.codes, scales=scales, scale_offset=offset, out_scale=out_scale, qtensor=w
    )


@functools.partial(jax.jit, static_argnames=("n_rows", "scale_format"))
def _kernel_scales(block_scales, global_scale, n_rows, scale_format):
    """``prepack_arrays``' scale bytes, offset and output scales (one program per shape)."""
    if scale_format == "e4m3":
        scales = jax.lax.bitcast_convert_type(block_scales, jnp.uint8)
        offset = jnp.int32(NVFP4_SCALE_OFFSET)
        row_nan = jnp.zeros(n_rows, bool)
        g = jnp.broadcast_to(jnp.reshape(global_scale, global_scale.shape[:-1] or ()), n_rows)
    else:
        scales = block_scales
        finite = jnp.where(scales == E8M0_NAN, 0, scales)
        # Keep the largest block exponent at the top of bf16's range: 126 binades below it stay
        # exact, and anything smaller is below 2**-126 of the largest value.
        offset = (254 - jnp.max(finite)).astype(jnp.int32)
        row_nan = jnp.any(scales == E8M0_NAN, axis=-1)
        g = jnp.ones(n_rows, jnp.float32)
    pow2 = jax.lax.bitcast_convert_type((126 - offset + 127) << 23, jnp.float32)
    out_scale = jnp.where(row_nan, jnp.nan, jnp.asarray(g, jnp.float32) * pow2)
    return scales, offset, out_scale


# ----------------------------------------------------------------------------- one-token words


def gemv_supported(k: int, n: int, fmt: FormatSpec, block_k: int = GEMV_BLOCK_K) -> bool:
    """Whether a [K, N] weight can use the packed word layout with this ``block_k``."""
    nb = block_k // fmt.block_size
    return k % block_k == 0 and nb >= 4 and nb & (nb - 1) == 0 and n % 8 == 0


def gemv_default_block_n(n: int) -> int:
    """The one-token kernel's default row tile for N rows: ``GEMV_BLOCK_N`` halved until it
    divides N."""
    block_n = GEMV_BLOCK_N
    while n % block_n:
        block_n //= 2
    return block_n


@functools.partial(jax.jit, static_argnames=("fmt", "block_k", "block_n"))
def pack_gemv_words(
    codes: jax.Array, fmt: FormatSpec, block_k: int = GEMV_BLOCK_K, block_n: int = 0
) -> jax.Array:
    """Stored codes [N, K/2] uint8 (element 2i in the low nibble of byte i) -> words [N, K/8]
    uint32 in the one-token kernel's order (module docstring); with ``block_n`` > 0, row tiles
    made contiguous per step: [N/block_n, K/block_k * block_n, block_k/8]."""
    n, half_k = codes.shape
    k = 2 * half_k
    bs = fmt.block_size
    groups, nb = bs // 8, block_k // bs
    nib = jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(n, k).astype(jnp.uint32)
    # k = step * block_k + b * bs + g * 8 + r  ->  [n, step, g, b, r]
    nib = nib.reshape(n, k // block_k, nb, groups, 8).transpose(0, 1, 3, 2, 4)
    mag = jnp.asarray(np.array(GEMV_MAG_BIT, np.uint32))
    sign = jnp.asarray(np.array(GEMV_SIGN_BIT, np.uint32))
    parts = ((nib & 7) << mag) | ((nib >> 3) << sign)
    words = functools.reduce(jnp.bitwise_or, [parts[..., r] for r in range(8)])
    words = words.reshape(n, k // 8).astype(jnp.uint32)
    if not block_n:
        return words
    tiles = words.reshape(n // block_n, block_n, k // block_k, block_k // 8).transpose(0, 2, 1, 3)
    return tiles.reshape(n // block_n, k // block_k * block_n, block_k // 8)


@functools.partial(jax.jit, static_argnames=("fmt", "block_k", "block_n"))
def pack_gemv_scales(scales: jax.Array, fmt: FormatSpec, block_k: int, block_n: int) -> jax.Array:
    """Scale bytes [N, K/block] -> [N/block_n, K/block_k * block_n, block_k/block]: the scales
    of one (row tile, step) contiguous, as ``pack_gemv_words`` with ``block_n`` lays the words."""
    n, nblk = scales.shape
    nb = block_k // fmt.block_size
    tiles = scales.reshape(n // block_n, block_n, nblk // nb, nb).transpose(0, 2, 1, 3)
    return tiles.reshape(n // block_n, nblk // nb * block_n, nb)


def with_gemv_layout(w: Fp4Weight, block_k: int = GEMV_BLOCK_K, block_n: int = 0) -> Fp4Weight:
    """``w`` with its codes (and, for ``block_n`` > 0, its scales) copied into the one-token
    kernel's layout for this ``block_k`` (and row tile)."""
    k, n = w.shape
    if not gemv_supported(k, n, w.fmt, block_k) or (block_n and n % block_n):
        raise ValueError(f"one-token layout: [K={k}, N={n}] does not tile by {block_k}, {block_n}")
    words = pack_gemv_words(w.codes, w.fmt, block_k, block_n)
    scales = pack_gemv_scales(w.scales, w.fmt, block_k, block_n) if block_n else None
    return dataclasses.replace(
        w, gemv_words=words, gemv_scales=scales, gemv_block_k=block_k, gemv_block_n=block_n
    )


# ----------------------------------------------------------------------------- tensor-core tiles


def mgpu_layout_fits(fmt, k: int, n: int) -> bool:
    """Whether ``prepack``/``prepack_grouped`` build the tensor-core layout unless told
    otherwise: NVFP4 or MXFP4 (both measured on the H200) with K and N multiples of 64."""
    return fmt.name in ("nvfp4", "mxfp4") and k % MGPU_CHUNK == 0 and n % MGPU_TILE_N == 0


@functools.partial(jax.jit, static_argnames=("scale_format",))
def pack_mgpu(
    codes: jax.Array, scale_bytes: jax.Array, out_scale: jax.Array, scale_format: str
) -> MgpuWeight:
    """Stored codes [*E, N, K/2] uint8, one scale byte per 16-element block [*E, N, K/16]
    uint8 and ``out_scale`` [*E, N] -> the tensor-core kernels' layout."""
    *lead, n, kh = codes.shape
    k = 2 * kh
    if n % MGPU_TILE_N or k % MGPU_CHUNK:
        raise ValueError(f"prepack_mgpu: K={k} and N={n} must be multiples of 64")
    nt, kt = n // MGPU_TILE_N, k // MGPU_CHUNK
    c = codes.astype(jnp.uint32)
    q = jnp.stack([c & 0xF, c >> 4], axis=-1).reshape(-1, n, k)  # nibble of element (n, k)
    e = q.shape[0]
    # rows n = 64 tn + 16 w + 8 rh + a; cols k = 64 kc + 16 j + 8 cto + 2 b + v
    q = q.reshape(e, nt, 4, 2, 8, kt, 4, 2, 4, 2)
    # -> [e, tn, kc, w, a, b, j, cto, rh, v]: thread (w, a, b), word j, pair P = 2 cto + rh
    q = q.transpose(0, 1, 5, 2, 4, 8, 6, 7, 3, 9).reshape(e, nt, kt, 128, 4, 4, 2)
    words = jnp.zeros((e, nt, kt, 128, 4), jnp.uint32)
    for (p, v), (sign, mag) in MGPU_SLOTS.items():
        nib = q[..., p, v]
        words = words | ((nib >> 3) << sign) | ((nib & 7) << mag)
    sc = scale_bytes.astype(jnp.uint32)
    sc = sc.reshape(e, nt, MGPU_TILE_N, kt, 4).transpose(0, 1, 3, 2, 4)
    scales = sc[..., 0] | (sc[..., 1] << 8) | (sc[..., 2] << 16) | (sc[..., 3] << 24)
    return MgpuWeight(
        words=words.reshape(*lead, nt, kt, 2, 256),
        scales=scales.reshape(*lead, nt, kt, MGPU_TILE_N),
        out_scale=out_scale,
        scale_format=scale_format,
    )


def prepack_mgpu(w: QTensor, base: Fp4Weight | None = None) -> MgpuWeight:
    """Arrange an NVFP4 or MXFP4 ``QTensor`` for the tensor-core kernels: a dense weight of
    logical shape [K, N] quantized along K (axis 0), or expert weights [E, K, N] quantized along
    K (axis 1).

    ``base``: ``prepack_arrays(w)`` when the caller has it already (its scale bytes, offset and
    output scales, shared by every FP4 kernel)."""
    dense = len(w.shape) == 2 and w.axis == 0 and w.codes.ndim == 2
    grouped = len(w.shape) == 3 and w.axis == 1 and w.codes.ndim == 3
    if not (dense or grouped):
        raise ValueError(
            f"prepack_mgpu: a [K, N] weight quantized along axis 0 or [E, K, N] along axis 1, "
            f"got shape {w.shape} axis {w.axis}"
        )
    base = base if base is not None else prepack_arrays(w)
    sb = base.scales  # [*E, N, K/block] uint8
    if w.fmt.scale_format == "e8m0":
        sb = _e8m0_halves(sb, base.scale_offset)
    return pack_mgpu(w.codes, sb, base.out_scale, w.fmt.scale_format)


@jax.jit
def _e8m0_halves(sb: jax.Array, offset: jax.Array) -> jax.Array:
    """MXFP4 scale bytes [*E, N, K/32] -> [*E, N, K/16]: each block's biased exponent plus the
    offset (NaN bytes as 0), repeated for its two 16-element halves."""
    finite = jnp.where(sb == E8M0_NAN, 0, sb).astype(jnp.int32)
    return jnp.repeat((finite + offset).astype(jnp.uint8), 2, axis=-1)
