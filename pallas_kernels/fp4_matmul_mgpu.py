"""FP4 weight matmul on Hopper tensor cores (Mosaic GPU): ``y = x @ dequantize(W)``, dense
(``fp4_matmul_mgpu``) and grouped by expert (``fp4_grouped_matmul_mgpu``), NVFP4 and MXFP4.

The program computes ``y^T[n-tile] = W^T[n-tile, :] @ x^T`` with ``wgmma``: 64 weight rows are
the matrix unit's register operand, decoded from FP4 straight into the operand's register layout
(no shared-memory round trip of the decoded tile), and the few tokens (padded to a multiple of 8)
are its shared-memory operand, read transposed from the ``[M, K]`` activation tile.

Each program (one or more warpgroups, 64 rows of N each) owns a contiguous range of K. Its K
loop streams ``stages`` buffers of (code words, block scales, activation tile) with TMA copies,
each buffer signalled by its own barrier; a buffer is refilled as soon as the matrix unit has
consumed it. Several programs share a multiprocessor, so one program's wait overlaps another's
decode. The loop body runs two steps: a ``wgmma`` reads its register operand asynchronously
until retired, so consecutive steps must decode into different registers. Without a K split
the fp32 sums are multiplied by their row's output scale and rounded once to bf16 in the
kernel (with one, the fp32 partials are summed and scaled in XLA); the result is staged for its
TMA copy out in the shared memory the loop's buffers used (a second scope).

Layout (``layouts.prepack_mgpu``, once at load). The ``wgmma`` register operand for a [64, 64]
bf16 tile gives thread ``t = 32 w + 4 a + b`` of the warpgroup the pairs ``(row, cols)`` =
``(16 w + 8 rh + a, 16 j + 8 cto + 2 b + {0, 1})`` for ``j < 4`` (a 16-element block),
``cto, rh < 2``. The thread's 32 codes are stored as 4 contiguous 32-bit words, word ``j`` holding
block ``j``'s 4 pairs with the bits placed so that each pair becomes a bf16 pair worth
``code * 2**-126`` with one to four integer operations (``layouts.MGPU_SLOTS``). The block scales
of a 64 x 64 tile are 64 words, one per row, byte ``j`` = block ``j``'s scale (E4M3 bits; for MXFP4
the E8M0 exponent plus the tensor's offset, repeated for both halves of a 32-element block). The
decoded pair is multiplied by the scale times a power of two as a bf16 pair (exact; bf16
arithmetic keeps the subnormal 0.5 code), and the global scale times the inverse power of two
multiplies the fp32 result.

``decode="asm"`` runs the decode as PTX inside ``plgpu.inline_mgpu`` (GPU only);
``decode="portable"`` is the same arithmetic in ``jnp`` on the loaded words, for interpret mode;
``decode="none"`` (a benchmark diagnostic, wrong values) hands the loaded words to the MMA as
they are, which times the kernel without the decode arithmetic.
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
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.layouts import (
    MGPU_CHUNK,
    MGPU_SLOTS,
    MGPU_TILE_N,
    NVFP4_SCALE_OFFSET,
    MgpuWeight,
)

_ROW_ALIGN = 8  # rows per tile of the swizzled activation buffer

Decode = Literal["asm", "portable", "none"]
SplitIn = Literal["grid", "warpgroups"]
Prologue = Literal["xla", "kernel"]


@dataclasses.dataclass(frozen=True)
class MgpuMatmulConfig:
    """Tiling of the Mosaic GPU FP4 matmul kernels (dense and grouped).

    Attributes:
      block_k: K elements per pipeline stage (a multiple of 64).
      stages: buffers in flight per program.
      split_k: programs that share one 64-row output tile along K (fp32 partials summed in XLA).
      decode: "asm" (PTX, GPU only), "portable" (jnp, interpret mode) or "none" (diagnostic:
        the code words go to the MMA undecoded; wrong values, for timing only).
      block_m: grouped form only: rows per row block of an expert (a multiple of 8); each
        block streams its expert's weight tile once.
      warpgroups: warpgroups per program, each decoding its own 64 weight rows against one
        shared activation buffer (less shared memory and fewer activation reads per weight row).
      split_in: dense form, where the ``split_k`` parts of K run: "grid" (separate programs;
        fp32 partials summed in XLA) or "warpgroups" (one warpgroup per part in one program,
        each with its own buffers; the sums are added in shared memory and the output scaled
        and rounded in the kernel; needs ``warpgroups`` 1 and ``split_k`` 2).
      tiles: grouped form, output tiles (of ``warpgroups`` x 64 columns) one program computes
        one after another, their weights streamed through one pipeline (the next tile's first
        buffers load while this one's last steps and output run; one start-up per program).
      prologue: grouped form, the work around the kernel (``grouped_plan``,
        ``pad_rows_for_windows``): "kernel" (the default, 12-14 us the faster per call on an
        H100 at E=128: the plan in one Triton launch; x read as it is where its rows are whole
        8-row tiles and at least one window, TMA filling the window rows past its end; the
        unrouted rows zeroed by the kernel's last row block, which no routing uses) or "xla"
        (the row-block plan in XLA ops, x padded for every window, the rows past the routed
        ones zeroed after the kernel).
    """

    block_k: int = 256
    stages: int = 4
    split_k: int = 1
    decode: Decode = "asm"
    block_m: int = 8
    warpgroups: int = 1
    split_in: SplitIn = "grid"
    prologue: Prologue = "kernel"
    tiles: int = 1

    def __post_init__(self):
        if self.block_k < MGPU_CHUNK or self.block_k % MGPU_CHUNK:
            raise ValueError(f"MgpuMatmulConfig.block_k must be a multiple of 64: {self.block_k}")
        if self.stages < 1 or self.split_k < 1:
            raise ValueError(f"MgpuMatmulConfig: stages and split_k must be >= 1: {self}")
        if self.block_m < 8 or self.block_m % 8 or self.block_m > 256:
            raise ValueError(f"MgpuMatmulConfig.block_m must be a multiple of 8 <= 256: {self}")
        if self.warpgroups not in (1, 2, 3):
            raise ValueError(f"MgpuMatmulConfig.warpgroups must be 1, 2 or 3: {self}")
        if self.split_in not in ("grid", "warpgroups"):
            raise ValueError(f"MgpuMatmulConfig.split_in: unknown {self.split_in!r}")
        if self.split_in == "warpgroups" and (self.warpgroups != 1 or self.split_k != 2):
            raise ValueError(
                f"MgpuMatmulConfig: split_in='warpgroups' needs warpgroups 1 and split_k 2: {self}"
            )
        if self.decode not in ("asm", "portable", "none"):
            raise ValueError(f"MgpuMatmulConfig.decode: unknown {self.decode!r}")
        if self.prologue not in ("xla", "kernel"):
            raise ValueError(f"MgpuMatmulConfig.prologue: unknown {self.prologue!r}")
        if self.tiles < 1 or (self.tiles > 1 and (self.split_k != 1 or self.split_in != "grid")):
            raise ValueError(
                f"MgpuMatmulConfig.tiles must be >= 1, above 1 without a K split: {self}"
            )


def _divmod(a, b: int):
    """``divmod`` of a static or traced non-negative step index."""
    return divmod(a, b) if isinstance(a, int) else (lax.div(a, b), lax.rem(a, b))


def _threads(cfg: MgpuMatmulConfig) -> int:
    """Warpgroups per program: one per 64-row tile, or one per K part."""
    return cfg.split_k if cfg.split_in == "warpgroups" else cfg.warpgroups


_SMEM_LIMIT = 227 * 1024  # shared memory one program may use on Hopper (bytes)
_NUM_SMS = 132  # streaming multiprocessors of an H100 / H200 (SXM)


def _round_up(v, multiple: int):
    return -(-v // multiple) * multiple


def _smem_bytes(cfg: MgpuMatmulConfig, stages: int, mpad: int) -> int:
    """Shared memory of a program in bytes (barriers aside): the K loop's buffers
    (``_scratch(cfg, stages, mpad)``) or the output staging after it, whichever is larger."""

    def nbytes(b):
        return math.prod(b.shape) * jnp.dtype(b.dtype).itemsize if hasattr(b, "shape") else 0

    loop = sum(nbytes(b) for b in _scratch(cfg, stages, mpad).values())
    return max(loop, nbytes(_out_smem(cfg, mpad)))


def _check_smem(cfg: MgpuMatmulConfig, stages: int, mpad: int, who: str) -> None:
    used = _smem_bytes(cfg, stages, mpad)
    if used > _SMEM_LIMIT:
        raise ValueError(
            f"{who}: {cfg} with {mpad} activation rows needs {used // 1024} KB of shared memory "
            f"(at most {_SMEM_LIMIT // 1024} KB); use fewer stages or a smaller block_k"
        )


def default_config(m: int, k: int, n: int) -> MgpuMatmulConfig:
    """Tuned defaults per shape class (H200, BENCHMARKS.md), ``m`` rows, weight [k, n].

    2-16 rows, 2048 <= K <= 4096 (a multiple of 256): K split in two over the two warpgroups
    of one program, each with 4 buffers of 128-element steps, the halves added in shared
    memory and the output scaled in the kernel (no fp32 partials for XLA to sum): at K=4096
    M=16 17.7 against ~22 us on the H200, 16 % faster in two of three H100 runs.
    One row and K <= 4096 (few steps per program): 128-element steps, 4 buffers, K split in
    two over the grid, two warpgroups per program (18.9 vs 25.3 us at K=4096 N=14336).
    Longer or shorter K: 256-element steps, 3 buffers, K split over the grid where each part
    keeps at least 8 steps: at K=8192 N=28672 50.0-52.3 us on the H200 against 55.5-57.3 with
    the split on warpgroups (which is 5-8 % the faster on an H100; BENCHMARKS.md, "K split
    on warpgroups").
    17-64 rows: two warpgroups share each 128-element activation tile, 3 buffers (78.0 vs
    92.0 us at M=64 K=8192 N=28672). 65-128 rows: two warpgroups, 64-element steps, 4 buffers
    (109.4 vs 127.2 us at M=128); 129-256 rows: two warpgroups, 128-element steps, 3 buffers
    (185.2 vs 225.9 us at M=256); one warpgroup with 64-element steps and 4 buffers where N is
    not a multiple of 128. Where two warpgroups would leave fewer programs than SMs (N < 128 x
    132, e.g. N=14336), 17-128 rows take one warpgroup, 128-element steps, 3 buffers: twice
    the programs (H100, K=4096: 23.9 vs 31.3 us at M=64, 30.4 vs 39.2 at M=128). A shape these
    do not fit takes the most buffers of 256, else 128, elements that fit in shared memory.
    """
    block_k = 256 if k % 256 == 0 else MGPU_CHUNK
    if m > 16:
        mpad = _round_up(m, _ROW_ALIGN)
        two_wg = n % (2 * MGPU_TILE_N) == 0
        if two_wg and m <= 128 and n // (2 * MGPU_TILE_N) < _NUM_SMS:
            preferred = [(128, 3, 1)]
        elif two_wg:
            preferred = [(128, 3, 2)] if m <= 64 else [(64, 4, 2)] if m <= 128 else [(128, 3, 2)]
        else:
            preferred = [(64, 4, 1)] if m > 64 else []
        fallback = ((block_k, 4), (block_k, 3), (128, 4), (128, 3), (128, 2), (MGPU_CHUNK, 2))
        for bk, stages, wgs in (*preferred, *((bk, st, 1) for bk, st in fallback)):
            cfg = MgpuMatmulConfig(block_k=bk, stages=stages, warpgroups=wgs)
            if k % bk == 0 and _smem_bytes(cfg, stages, mpad) <= _SMEM_LIMIT:
                return cfg
        return MgpuMatmulConfig(block_k=MGPU_CHUNK, stages=2)
    if m == 1 and k <= 4096 and k % 256 == 0 and n % (2 * MGPU_TILE_N) == 0:
        return MgpuMatmulConfig(block_k=128, stages=4, split_k=2, warpgroups=2)
    if k % 256 == 0 and 2048 <= k <= 4096:
        return MgpuMatmulConfig(block_k=128, stages=4, split_k=2, split_in="warpgroups")
    split = 2 if k % (2 * block_k) == 0 and k // (2 * block_k) >= 8 else 1
    return MgpuMatmulConfig(block_k=block_k, stages=3, split_k=split)


# ----------------------------------------------------------------------------- decode

# scale byte -> the bf16 pair (scale * 2**c, scale * 2**c) = byte * mult + bias
_SCALE_MAD = {
    "e4m3": (
        0x00100010,
        ((NVFP4_SCALE_OFFSET + 120) << 7) * 0x10001,
    ),  # E4M3 bits -> exponent 7..14
    "e8m0": (0x00800080, 0),  # already the biased exponent
}


def _asm_word(j: int, scale_format: str) -> str:
    """PTX: code word $4 and the two rows' scale words $5, $6 -> 4 bf16 pairs $0..$3."""
    mult, bias = _SCALE_MAD[scale_format]
    return f"""
{{
.reg .b32 a, b, sa, sb;
bfe.u32 sa, $5, {8 * j}, 8;
mad.lo.u32 sa, sa, {mult}, {bias};
bfe.u32 sb, $6, {8 * j}, 8;
mad.lo.u32 sb, sb, {mult}, {bias};
and.b32 a, $4, 0x81C081C0;
mul.rn.bf16x2 $0, a, sa;
shl.b32 a, $4, 6;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 $1, a, sb;
shl.b32 a, $4, 1;
shl.b32 b, $4, 3;
and.b32 b, b, 0x01C001C0;
lop3.b32 a, a, b, 0x80008000, 0xEC;
mul.rn.bf16x2 $2, a, sa;
shr.b32 a, $4, 5;
shl.b32 b, $4, 5;
and.b32 a, a, 0x01C001C0;
lop3.b32 a, b, a, 0x80008000, 0xEC;
mul.rn.bf16x2 $3, a, sb;
}}
"""


def inline_ptx() -> dict[str, tuple[str, int, int]]:
    """name -> (PTX text with $i operands, outputs, inputs) of the decode blocks the kernels
    inline (for compiling them offline: ``experiments/bench/offline_sass.py``)."""
    return {f"matmul code word ({fmt})": (_asm_word(0, fmt), 4, 3) for fmt in ("e4m3", "e8m0")}


def _decode_asm(words_ref, scales_ref, scale_format, arithmetic=True):
    """[2, 256] uint32 code words and [64] uint32 scale words (shared memory) -> the bf16
    [64, 64] operand tile in the ``wgmma`` register layout (``arithmetic=False``: the loaded
    words themselves, for timing without the decode)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, vector
    from jax.experimental import mosaic as mgpu_pkg  # noqa: F401
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct(
            (MGPU_TILE_N, MGPU_CHUNK), jnp.bfloat16, layout=plgpu.Layout.WGMMA
        ),
    )
    def decode(_, w_ref, s_ref):
        i32 = ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        c = lambda v, ty=i32: arith.constant(ty, v)  # noqa: E731
        t = arith.remui(mgpu_utils.thread_idx(), c(128))
        row = arith.index_cast(index, arith.shrui(t, c(6)))
        col = arith.index_cast(index, arith.muli(arith.andi(t, c(63)), c(4)))
        words = vector.load(ir.VectorType.get((4,), i32), w_ref, [row, col])
        # row of rh = 0: 16 w + a = 16 (t // 32) + (t % 32) // 4
        r0 = arith.addi(
            arith.muli(arith.shrui(t, c(5)), c(16)), arith.shrui(arith.andi(t, c(31)), c(2))
        )
        s0 = memref.load(s_ref, [arith.index_cast(index, r0)])
        s1 = memref.load(s_ref, [arith.index_cast(index, arith.addi(r0, c(8)))])
        pair = ir.VectorType.get((2,), ir.BF16Type.get())
        struct = llvm.StructType.get_literal([i32] * 4)
        regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((MGPU_TILE_N, MGPU_CHUNK)), dtype=object)
        for j in range(4):
            word = vector.extract(words, [], [j])
            if not arithmetic:
                for p in range(4):
                    bits = word if p % 2 == 0 else arith.xori(word, s0 if p < 2 else s1)
                    regs[0, 2 * j + p // 2, 0, 0, p % 2, 0, 0, 0, 0] = mgpu_utils.bitcast(
                        bits, pair
                    )
                continue
            asm = _asm_word(j, scale_format)
            out = llvm.inline_asm(struct, [word, s0, s1], asm, "=r,=r,=r,=r,r,r,r")
            for p in range(4):
                cto, rh = p // 2, p % 2
                bits = llvm.extractvalue(i32, out, [p])
                regs[0, 2 * j + cto, 0, 0, rh, 0, 0, 0, 0] = mgpu_utils.bitcast(bits, pair)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return decode(words_ref, scales_ref)


def _decode_portable(words_ref, scales_ref, scale_format):
    """As ``_decode_asm`` in ``jnp`` (interpret mode): the same exact values."""
    w = words_ref[...].reshape(128, 4)
    s = scales_ref[...]  # [64]
    vals = []
    for p in range(4):
        for v in range(2):
            sign, mag = MGPU_SLOTS[(p, v)]
            m = ((w >> mag) & 7).astype(jnp.float32)
            e2m1 = 0.5 * m + 0.5 * jnp.maximum(m - 4, 0) + jnp.maximum(m - 6, 0)
            vals.append(jnp.where((w >> sign) & 1 == 1, -e2m1, e2m1))
    # [t=(w, a, b), j, cto, rh, v] -> [w, rh, a, j, cto, b, v] = [row, col]
    x = jnp.stack(vals, axis=-1).reshape(4, 8, 4, 4, 2, 2, 2)
    x = x.transpose(0, 5, 1, 3, 4, 2, 6).reshape(MGPU_TILE_N, MGPU_CHUNK)
    sb = jnp.stack([(s >> (8 * j)) & 0xFF for j in range(4)], axis=-1)  # [64, 4] scale bytes
    if scale_format == "e4m3":
        # E4M3 (bias 7) -> float32 worth scale * 2**(c - 126): exponent + 120 + c - 126
        sf = lax.bitcast_convert_type(
            ((sb & 0x7F) << 20) + ((NVFP4_SCALE_OFFSET - 6) << 23), jnp.float32
        )
        x = x.reshape(MGPU_TILE_N, 4, 16) * sf[:, :, None]
    else:
        # exponent byte e -> 2**(e - 127) times the code's 2**-126 (as the GPU's bf16 pair carries
        # it) in one float32 power of two, normal for e >= 127 (smaller bytes are more than 126
        # binades below the tensor's largest scale: 0 here)
        sf = lax.bitcast_convert_type(jnp.maximum(sb.astype(jnp.int32) - 126, 0) << 23, jnp.float32)
        x = x.reshape(MGPU_TILE_N, 4, 16) * sf[:, :, None]
    return x.reshape(MGPU_TILE_N, MGPU_CHUNK).astype(jnp.bfloat16)


# ----------------------------------------------------------------------------- kernel


def _stream(
    x_rows,
    w_tiles,
    s_tiles,
    out,
    *,
    cfg,
    steps,
    k0,
    mpad,
    scale_format,
    scale=None,
    token_scale=None,
    rows=None,
):
    """``cfg.warpgroups`` 64-row output tiles: ``out`` [W * 64, mpad] (gmem) =
    W^T[tiles, K range] @ x^T, warpgroup ``wg`` computing rows [64 wg, 64 wg + 64): float32
    sums, or with ``scale`` ([W * 64] float32 gmem, one factor per output row) the sums times
    their row's factor rounded once to ``out``'s dtype (bf16); ``token_scale`` ([mpad] float32
    gmem, W4A4's per-token global scales) multiplies that product by its token's factor before
    the rounding. With ``rows`` = (first, count,
    at), ``out`` is [T, W * 64] instead (gmem, token-major) and only the ``count`` tokens from
    window position ``first`` are written, transposed, to its rows ``at``, ``at + 1``, ...

    ``x_rows`` [mpad, K], ``w_tiles`` [W, K/64, 2, 256], ``s_tiles`` [W, K/64, 64]: gmem views of
    the operands; ``steps`` steps of ``cfg.block_k`` from 64-element chunk ``k0``. The
    warpgroups share each buffer's activation tile; warpgroup 0 refills a buffer once every
    warpgroup has marked it consumed. The buffers (``_scratch``) live for the K loop only: the
    fp32 result is staged for its copy to ``out`` in the same shared memory after it.

    With ``cfg.tiles`` T > 1 (``rows`` only): ``w_tiles``, ``s_tiles`` hold T W tiles and
    ``out``'s columns T W * 64; the program computes the T groups of W tiles one after another
    on one pipeline of T * ``steps`` steps (buffers refilled across the groups' boundaries),
    writing each group's rows from a staging buffer of its own while the next group's first
    buffers load.
    """
    ksplit = cfg.split_in == "warpgroups"  # the warpgroups split K for one 64-row tile
    nwg = _threads(cfg)
    wg = lax.axis_index("wg") if nwg > 1 else 0
    collective = ("wg",) if nwg > 1 else ()
    chunks = cfg.block_k // MGPU_CHUNK
    xi = wg if ksplit else 0  # the warpgroup's activation buffers
    tile = 0 if ksplit else wg  # its 64 output rows
    tiles = cfg.tiles
    total = tiles * steps  # the pipeline's steps, over the groups of tiles one after another
    if tiles > 1 and (rows is None or ksplit):
        raise ValueError(f"_stream: tiles > 1 needs token-major rows and no K split: {cfg}")
    decode = functools.partial(
        _decode_portable if cfg.decode == "portable" else _decode_asm, scale_format=scale_format
    )
    if cfg.decode == "none":
        decode = functools.partial(decode, arithmetic=False)

    def k_loop(x_smem, w_smem, s_smem, bar, consumed=None, a_smem=None, t_smem=None):
        def barrier(slot):
            return bar.at[wg * cfg.stages + slot] if ksplit else bar.at[slot]

        def issue(step, slot):
            group = slice(None)
            if tiles > 1:  # the group of tiles this step belongs to, and its step in K
                t, step = _divmod(step, steps)
                group = pl.ds(t * nwg, nwg)
            kc = k0 + ((wg * steps if ksplit else 0) + step) * chunks
            w_src = w_tiles.at[group, pl.ds(kc, chunks)]
            s_src = s_tiles.at[group, pl.ds(kc, chunks)]
            w_dst, s_dst = w_smem.at[slot], s_smem.at[slot]
            if ksplit:  # this warpgroup's part of K of the one weight tile
                w_dst, s_dst = w_smem.at[slot, pl.ds(wg, 1)], s_smem.at[slot, pl.ds(wg, 1)]
            plgpu.copy_gmem_to_smem(w_src, w_dst, barrier(slot))
            plgpu.copy_gmem_to_smem(s_src, s_dst, barrier(slot))
            plgpu.copy_gmem_to_smem(
                x_rows.at[:, pl.ds(kc * MGPU_CHUNK, cfg.block_k)],
                x_smem.at[slot, xi],
                barrier(slot),
            )

        @pl.when((wg == 0) | ksplit)
        def _():
            for s in range(min(cfg.stages, total)):
                issue(s, s)

        def one_step(acc_ref, step):
            slot = lax.rem(step, cfg.stages)
            plgpu.barrier_wait(barrier(slot))
            for c in range(chunks):
                a = decode(w_smem.at[slot, wg, c], s_smem.at[slot, wg, c])
                b = x_smem.at[slot, xi, :, pl.ds(c * MGPU_CHUNK, MGPU_CHUNK)].transpose((1, 0))
                if a_smem is None:
                    plgpu.wgmma(acc_ref, a, b)
                else:  # the interpreter's wgmma takes its operands from shared memory
                    a_smem.at[wg][...] = a
                    plgpu.commit_smem()
                    plgpu.wgmma(acc_ref, a_smem.at[wg], b)
                    plgpu.wgmma_wait(0)
            # The previous step's MMAs are done once at most this step's are pending: refill
            # its buffer with the step `stages` after it.
            plgpu.wgmma_wait(chunks)
            refill = step - 1 + cfg.stages
            prev = lax.rem(refill, cfg.stages)
            if isinstance(step, int) and not 0 < step < total - cfg.stages + 1:
                return  # a static step (odd last ones): nothing to refill, none traced
            if ksplit:  # each warpgroup refills its own buffers

                @pl.when((step > 0) & (refill < total))
                def _():
                    issue(refill, prev)

                return
            if nwg > 1:

                @pl.when((step > 0) & (refill < total))
                def _():
                    plgpu.barrier_arrive(consumed.at[prev])

            @pl.when((wg == 0) & (step > 0) & (refill < total))
            def _():
                if nwg > 1:
                    plgpu.barrier_wait(consumed.at[prev])
                issue(refill, prev)

        def run(acc_ref, base=0):
            # A wgmma reads its register operand until it is retired, and a PTX register written
            # in the loop body is the same register in every iteration: with one step per
            # iteration the next step's decode would overwrite operands that this step's MMAs
            # may still be reading. Two steps per iteration give the even and odd steps their
            # own registers, and each step's wait retires the step before it, the last to use
            # the registers it writes.
            def two_steps(i, _):
                one_step(acc_ref, base + 2 * i)
                one_step(acc_ref, base + 2 * i + 1)

            lax.fori_loop(0, steps // 2, two_steps, None)
            if steps % 2:
                one_step(acc_ref, base + steps - 1)
            return acc_ref[...]  # waits for every MMA

        acc_type = plgpu.ACC((MGPU_TILE_N, mpad), jnp.float32)
        if tiles == 1:
            return pl.run_scoped(run, acc_type)
        for t in range(tiles):  # each group's sums, then its rows, while the next group loads
            acc = pl.run_scoped(functools.partial(run, base=t * steps), acc_type)
            col = t * nwg + wg
            write_rows(finish(acc, col), t_smem, col, read_only=True)
        plgpu.wait_smem_to_gmem(0)
        return None

    def finish(acc, col):
        """The sums of output tile ``col`` of ``out`` scaled and rounded, where ``scale``."""
        if scale is None:
            return acc
        out_scale = plgpu.load(
            scale.at[pl.ds(col * MGPU_TILE_N, MGPU_TILE_N)],
            layout=plgpu.Layout.WGMMA.reduce(1),
            optimized=False,  # 64 floats straight from global memory, once per tile
        )
        acc = acc * lax.broadcast_in_dim(out_scale, acc.shape, [0])
        if token_scale is not None:
            col_scale = plgpu.load(
                token_scale, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False
            )
            acc = acc * lax.broadcast_in_dim(col_scale, acc.shape, [1])
        return acc.astype(out.dtype)

    def write_rows(acc, t_smem, col, read_only=False):
        """Token-major: the valid tokens' 64 outputs of tile ``col`` through ``t_smem``, one
        TMA copy of all of them where their count is static (the dense form), else one per
        token; waits until the copies have read it (``read_only``) or are done."""
        first, count, at = rows
        cols = pl.ds(col * MGPU_TILE_N, MGPU_TILE_N)

        @pl.when((wg == 0) | (not ksplit))  # the parts' total: warpgroup 0 writes it
        def _():
            t_smem.at[wg].T[...] = acc
            plgpu.commit_smem()
            if all(isinstance(v, int) for v in rows):
                plgpu.copy_smem_to_gmem(
                    t_smem.at[wg, pl.ds(first, count)], out.at[pl.ds(at, count), cols]
                )
            else:

                def one(j, _):
                    plgpu.copy_smem_to_gmem(
                        t_smem.at[wg, pl.ds(first + j, 1)], out.at[pl.ds(at + j, 1), cols]
                    )

                lax.fori_loop(0, count, one, None)
            plgpu.wait_smem_to_gmem(0, wait_read_only=read_only)

    acc = pl.run_scoped(k_loop, **_scratch(cfg, cfg.stages, mpad), collective_axes=collective)
    if tiles > 1:  # written in the loop's scope
        return
    if ksplit:  # the parts' sums added in shared memory, in part order

        def add_parts(parts_smem, done):
            parts_smem.at[wg][...] = acc
            plgpu.commit_smem()
            plgpu.barrier_arrive(done.at[0])  # every part is in shared memory
            plgpu.barrier_wait(done.at[0])
            summed = None
            for i in range(nwg):
                part = plgpu.load(parts_smem.at[i], layout=plgpu.Layout.WGMMA, optimized=False)
                summed = part if summed is None else summed + part
            plgpu.barrier_arrive(done.at[1])  # every warpgroup has read them (the memory is
            plgpu.barrier_wait(done.at[1])  # the output staging's next)
            return summed

        acc = pl.run_scoped(
            add_parts,
            _out_smem(cfg, mpad),
            plgpu.Barrier(num_arrivals=nwg, num_barriers=2),
            collective_axes=collective,
        )
    acc = finish(acc, tile)
    if rows is not None:  # token-major: each valid token's 64 outputs are one TMA row
        t_smem = plgpu.SMEM((nwg, mpad, MGPU_TILE_N), out.dtype)
        pl.run_scoped(
            lambda t_smem: write_rows(acc, t_smem, tile), t_smem, collective_axes=collective
        )
        return

    def store(o_smem):
        @pl.when((wg == 0) | (not ksplit))  # the parts' total: warpgroup 0 writes it
        def _():
            o_smem.at[wg][...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg], out.at[pl.ds(tile * MGPU_TILE_N, MGPU_TILE_N)])
            plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, _out_smem(cfg, mpad, out.dtype), collective_axes=collective)


def _dense_kernel(x_gmem, w_gmem, s_gmem, *refs, cfg, steps, mpad, fmt, tokens):
    # the output scale [N] float32 when the output is scaled bf16, then the per-token scales
    # [mpad] float32 where given
    *scale_gmem, o_gmem = refs
    tn = lax.axis_index("n")
    sk = lax.axis_index("k")  # 0 when the warpgroups split K
    rows = cfg.warpgroups * MGPU_TILE_N
    if tokens is None:
        out, token_rows = o_gmem.at[sk, pl.ds(tn * rows, rows)], None
    else:  # y [tokens, N]: the first `tokens` rows, token-major
        out, token_rows = o_gmem.at[:, pl.ds(tn * rows, rows)], (0, tokens, 0)
    _stream(
        x_gmem,
        w_gmem.at[pl.ds(tn * cfg.warpgroups, cfg.warpgroups)],
        s_gmem.at[pl.ds(tn * cfg.warpgroups, cfg.warpgroups)],
        out,
        cfg=cfg,
        steps=steps,
        k0=sk * steps * (cfg.block_k // MGPU_CHUNK),  # a warpgroup's part: steps later each
        mpad=mpad,
        scale_format=fmt,
        scale=scale_gmem[0].at[pl.ds(tn * rows, rows)] if scale_gmem else None,
        token_scale=scale_gmem[1] if len(scale_gmem) > 1 else None,
        rows=token_rows,
    )


def _grouped_kernel(
    expert_gmem,
    row_gmem,
    valid_gmem,
    x_gmem,
    w_gmem,
    s_gmem,
    scale_gmem,
    o_gmem,
    *,
    cfg,
    steps,
    fmt,
    num_blocks,
):
    b = lax.axis_index("b")
    tn = lax.axis_index("n")
    e = expert_gmem[b]
    first = row_gmem[b]
    offset = lax.rem(first, _ROW_ALIGN)
    row = pl.multiple_of(first - offset, _ROW_ALIGN)  # a tiled TMA window starts on a tile row
    per = cfg.warpgroups * cfg.tiles  # 64-column tiles per program
    cols = pl.ds(tn * per * MGPU_TILE_N, per * MGPU_TILE_N)

    @pl.when(valid_gmem[b] > 0)
    def _():
        _stream(
            x_gmem.at[pl.ds(row, cfg.block_m + _ROW_ALIGN)],
            w_gmem.at[e, pl.ds(tn * per, per)],
            s_gmem.at[e, pl.ds(tn * per, per)],
            o_gmem.at[:, cols],
            scale=scale_gmem.at[e, cols],
            rows=(offset, valid_gmem[b], first),
            cfg=cfg,
            steps=steps,
            k0=0,
            mpad=cfg.block_m + _ROW_ALIGN,
            scale_format=fmt,
        )

    if cfg.prologue == "kernel":  # the rows past the routed ones come out zero

        @pl.when(b == num_blocks - 1)  # never a routed block (``num_row_blocks``)
        def _():
            _zero_rows(o_gmem.at[:, cols], first, cfg.warpgroups)


def _zero_rows(out, first, nwg: int) -> None:
    """Zero the rows ``first, first + 1, ...`` to the end of ``out`` [T, tiles * nwg * 64]
    (gmem): warpgroup ``wg`` the 64 columns of tiles ``wg``, ``wg + nwg``, ..., one TMA row
    at a time from a zero row in shared memory."""
    wg = lax.axis_index("wg") if nwg > 1 else 0
    tiles = out.shape[1] // (nwg * MGPU_TILE_N)

    def body(z_smem):
        z_smem[...] = jnp.zeros(z_smem.shape, z_smem.dtype)
        plgpu.commit_smem()

        def one(r, _):
            for t in range(tiles):
                plgpu.copy_smem_to_gmem(
                    z_smem.at[wg, pl.ds(0, 1)],
                    out.at[pl.ds(r, 1), pl.ds((t * nwg + wg) * MGPU_TILE_N, MGPU_TILE_N)],
                )

        lax.fori_loop(first, out.shape[0], one, None)
        plgpu.wait_smem_to_gmem(0)

    collective = ("wg",) if nwg > 1 else ()
    pl.run_scoped(
        body, plgpu.SMEM((nwg, _ROW_ALIGN, MGPU_TILE_N), out.dtype), collective_axes=collective
    )


def _scratch(cfg: MgpuMatmulConfig, stages: int, mpad: int) -> dict:
    chunks = cfg.block_k // MGPU_CHUNK
    nwg = _threads(cfg)
    nx = nwg if cfg.split_in == "warpgroups" else 1  # activation buffers: per K part, or shared
    swizzle = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = dict(
        x_smem=plgpu.SMEM((stages, nx, mpad, cfg.block_k), jnp.bfloat16, transforms=swizzle),
        w_smem=plgpu.SMEM((stages, nwg, chunks, 2, 256), jnp.uint32),
        s_smem=plgpu.SMEM((stages, nwg, chunks, MGPU_TILE_N), jnp.uint32),
        bar=plgpu.Barrier(num_arrivals=3, num_barriers=stages * nx),
    )
    if nwg > 1 and nx == 1:
        scratch["consumed"] = plgpu.Barrier(num_arrivals=nwg, num_barriers=stages)
    if cfg.decode == "portable":
        scratch["a_smem"] = plgpu.SMEM(
            (nwg, MGPU_TILE_N, MGPU_CHUNK), jnp.bfloat16, transforms=swizzle
        )
    if cfg.tiles > 1:  # each group's rows staged beside the pipeline's buffers
        scratch["t_smem"] = plgpu.SMEM((nwg, mpad, MGPU_TILE_N), jnp.bfloat16)
    return scratch


def _out_smem(cfg: MgpuMatmulConfig, mpad: int, dtype=jnp.float32):
    """The results' staging buffer [W, 64, mpad], allocated after the K loop's buffers."""
    return plgpu.SMEM((_threads(cfg), MGPU_TILE_N, mpad), dtype)


def dense_partials(
    xp: jax.Array,
    w: MgpuWeight,
    cfg: MgpuMatmulConfig,
    *,
    scaled: bool = False,
    token_scale: jax.Array | None = None,
    tokens: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """The kernel alone: xp [mpad, K] bf16 (mpad a multiple of 8), W [K, N] prepacked ->
    [P, N, mpad] float32 partial sums of ``W^T xp^T`` before the output scale (P = ``split_k``
    programs, or 1 when the warpgroups split K), or with ``scaled`` (no split across programs)
    [1, N, mpad] bf16: the sums times ``w.out_scale`` (then times ``token_scale`` [mpad]
    float32, one factor per row of xp, where given), rounded once; with ``tokens`` too, y
    [tokens, N] bf16 of the first ``tokens`` rows, written token-major by the kernel (each
    token's 64 outputs of a tile one TMA row: no transpose or slice after it)."""
    (mpad, k), n = xp.shape, w.shape[1]
    parts = 1 if cfg.split_in == "warpgroups" else cfg.split_k  # along the grid
    if scaled and parts != 1:
        raise ValueError(f"dense_partials: a scaled bf16 output needs one part per tile: {cfg}")
    if token_scale is not None and not (scaled and token_scale.shape == (mpad,)):
        raise ValueError(
            f"dense_partials: token_scale {token_scale.shape} needs scaled and shape ({mpad},)"
        )
    if tokens is not None and not (scaled and 0 < tokens <= mpad):
        raise ValueError(f"dense_partials: tokens={tokens} needs scaled and 0 < tokens <= {mpad}")
    steps = k // (cfg.block_k * cfg.split_k)
    cfg = dataclasses.replace(cfg, stages=min(cfg.stages, steps))
    _check_smem(cfg, cfg.stages, mpad, "fp4_matmul_mgpu")
    nwg = _threads(cfg)
    threads = dict(num_threads=nwg, thread_name="wg") if nwg > 1 else {}
    out_shape = (parts, n, mpad) if tokens is None else (tokens, n)
    kernel = plgpu.kernel(
        functools.partial(
            _dense_kernel, cfg=cfg, steps=steps, mpad=mpad, fmt=w.scale_format, tokens=tokens
        ),
        out_type=jax.ShapeDtypeStruct(out_shape, jnp.bfloat16 if scaled else jnp.float32),
        grid=(n // (MGPU_TILE_N * cfg.warpgroups), parts),
        grid_names=("n", "k"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        **threads,
    )
    scales = ([w.out_scale] if scaled else []) + ([token_scale] if token_scale is not None else [])
    return kernel(xp, w.words, w.scales, *scales)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def fp4_matmul_mgpu(
    x: jax.Array,
    w: MgpuWeight,
    cfg: MgpuMatmulConfig | None = None,
    *,
    row_scale: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x @ dequantize(W)``: x [M, K] bf16, W prepacked FP4 [K, N] -> [M, N] bf16.

    ``row_scale`` [M] float32 (W4A4: the activation's per-token global scale) multiplies each
    row's fp32 sum (after the weight's output scale) before the one rounding to bf16: in the
    kernel where it rounds its own output (no K split across programs), else in XLA.

    fp32 accumulation; M is padded to a multiple of 8 (the matrix unit's narrow side).
    """
    if len(w.shape) != 2:
        raise ValueError(f"fp4_matmul_mgpu: a dense [K, N] weight, got {w.shape} (grouped?)")
    k, n = w.shape
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"fp4_matmul_mgpu: x must be [M, {k}], got {x.shape}")
    m = x.shape[0]
    if m > 256:
        raise ValueError(f"fp4_matmul_mgpu: at most 256 rows, got M={m}")
    if row_scale is not None and row_scale.shape != (m,):
        raise ValueError(f"fp4_matmul_mgpu: row_scale must be [{m}], got {row_scale.shape}")
    cfg = cfg or default_config(m, k, n)
    if interpret and cfg.decode == "asm":
        cfg = dataclasses.replace(cfg, decode="portable")
    if cfg.tiles != 1:
        raise ValueError(f"fp4_matmul_mgpu: MgpuMatmulConfig.tiles is for the grouped form: {cfg}")
    if k % (cfg.block_k * cfg.split_k):
        raise ValueError(f"fp4_matmul_mgpu: K={k} is not a multiple of {cfg.block_k * cfg.split_k}")
    mpad = _round_up(m, _ROW_ALIGN)
    xp = x.astype(jnp.bfloat16)
    if mpad != m:
        xp = jnp.pad(xp, ((0, mpad - m), (0, 0)))
    if n % (MGPU_TILE_N * cfg.warpgroups):
        raise ValueError(f"fp4_matmul_mgpu: N={n} is not a multiple of {64 * cfg.warpgroups}")
    if cfg.split_k == 1 or cfg.split_in == "warpgroups":  # scaled and rounded in the kernel
        ts = None
        if row_scale is not None:
            ts = jnp.pad(row_scale.astype(jnp.float32), (0, mpad - m), constant_values=1.0)
        return dense_partials(
            xp, w, cfg, scaled=True, token_scale=ts, tokens=m, interpret=interpret
        )
    part = dense_partials(xp, w, cfg, interpret=interpret)
    y = part.sum(axis=0)[:, :m] * w.out_scale[:, None]
    if row_scale is not None:
        y = y * row_scale.astype(jnp.float32)[None, :]
    return y.T.astype(jnp.bfloat16)


# ----------------------------------------------------------------------------- grouped (MoE)


def default_grouped_config(rows: int, experts: int, k: int) -> MgpuMatmulConfig:
    """Defaults for ``rows`` routed rows over ``experts`` experts (H200, BENCHMARKS.md): up to
    4 rows per expert on average, 8-row blocks (the narrowest MMA; an expert with more rows is
    read again, rarely); more, blocks wide enough that few experts need a second one: the mean
    plus three standard deviations of a uniform routing, at most 64. 256-element K steps, 3
    buffers; the routing plan in one kernel (``prologue="kernel"``)."""
    mean = rows / max(experts, 1)
    wide = _round_up(int(mean + 3 * mean**0.5 + 1), _ROW_ALIGN)
    block_m = _ROW_ALIGN if mean <= 4 else min(64, wide)
    return MgpuMatmulConfig(block_k=256 if k % 256 == 0 else MGPU_CHUNK, stages=3, block_m=block_m)


def num_row_blocks(rows: int, experts: int, block_m: int) -> int:
    """A static bound on the row blocks of any routing of ``rows`` rows over ``experts``."""
    return -(-rows // block_m) + experts


def _row_blocks(group_sizes: jax.Array, rows: int, block_m: int):
    """Split each expert's rows into blocks of ``block_m``: per block [B] its expert, first row
    and number of valid rows (``GroupedPlan``), B = ``num_row_blocks`` (the plan in XLA ops:
    the reference of ``_plan_kernel``)."""
    e = group_sizes.shape[0]
    nblocks = num_row_blocks(rows, e, block_m)
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    nb = -(-sizes // block_m)
    bend = jnp.cumsum(nb)
    b = jnp.arange(nblocks, dtype=jnp.int32)
    find = functools.partial(jnp.searchsorted, side="right", method="compare_all")
    be = jnp.minimum(find(bend, b), e - 1).astype(jnp.int32)
    j = b - (bend - nb)[be]
    used = b < bend[-1]
    valid = jnp.where(used, jnp.minimum(block_m, sizes[be] - j * block_m), 0)
    return be, jnp.where(used, starts[be] + j * block_m, jnp.sum(sizes)), valid


def grouped_partials(
    xp: jax.Array,
    w: MgpuWeight,
    be: jax.Array,
    brow: jax.Array,
    valid: jax.Array,
    cfg: MgpuMatmulConfig,
    *,
    rows: int,
    interpret: bool = False,
) -> jax.Array:
    """The grouped kernel alone: xp [T', K] bf16 (``pad_rows_for_windows`` of the T = ``rows``
    rows sorted by expert), per row block its expert ``be``, first row ``brow`` and valid row
    count ``valid`` [>= B] int32 (``grouped_plan``) -> y [T, N] bf16: each block's valid rows
    times its expert's weight, each column times its ``w.out_scale`` (one rounding of the
    float32 sum), written by the block straight into its rows; rows of no block are not
    written."""
    e, k, n = w.shape
    steps = k // cfg.block_k
    nb = num_row_blocks(rows, e, cfg.block_m)
    threads = dict(num_threads=cfg.warpgroups, thread_name="wg") if cfg.warpgroups > 1 else {}
    kernel = plgpu.kernel(
        functools.partial(_grouped_kernel, cfg=cfg, steps=steps, fmt=w.scale_format, num_blocks=nb),
        out_type=jax.ShapeDtypeStruct((rows, n), jnp.bfloat16),
        grid=(nb, n // (MGPU_TILE_N * cfg.warpgroups * cfg.tiles)),
        grid_names=("b", "n"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        **threads,
    )
    return kernel(be, brow, valid, xp, w.words, w.scales, w.out_scale)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def fp4_grouped_matmul_mgpu(
    x: jax.Array,
    w: MgpuWeight,
    group_sizes: jax.Array,
    cfg: MgpuMatmulConfig | None = None,
    *,
    interpret: bool = False,
) -> jax.Array:
    """``ragged_dot(x, dequantize(W), group_sizes)``: x [T, K] rows sorted by expert, W
    prepacked NVFP4 expert weights [E, K, N], group_sizes [E] -> [T, N] bf16 (rows past the
    sum of group_sizes come out zero).

    One program per (row block, 64 columns): each expert's rows are cut into blocks of
    ``cfg.block_m`` (``grouped_plan``, in XLA); a block streams its expert's weight tile through
    the dense kernel's pipeline, scales its sums by the expert's output scale, rounds them to
    bf16 and writes its valid rows straight into the output (one TMA row each, transposed in
    shared memory), so blocks that share a 64-row window of x never write the same row.
    Blocks past the routing's last one exit at once, and experts without rows read no weights.
    """
    if len(w.shape) != 3:
        raise ValueError(f"fp4_grouped_matmul_mgpu: expert weights [E, K, N], got {w.shape}")
    e, k, n = w.shape
    t = x.shape[0]
    if x.ndim != 2 or x.shape[1] != k or group_sizes.shape != (e,):
        raise ValueError(
            f"fp4_grouped_matmul_mgpu: x {x.shape}, group_sizes {group_sizes.shape} do not "
            f"match weights {w.shape}"
        )
    cfg = cfg or default_grouped_config(t, e, k)
    if interpret and cfg.decode == "asm":
        cfg = dataclasses.replace(cfg, decode="portable")
    if k % cfg.block_k:
        raise ValueError(f"fp4_grouped_matmul_mgpu: K={k} is not a multiple of {cfg.block_k}")
    bm = cfg.block_m
    steps = k // cfg.block_k
    if n % (MGPU_TILE_N * cfg.warpgroups * cfg.tiles):
        raise ValueError(
            f"fp4_grouped_matmul_mgpu: N={n} is not a multiple of "
            f"{64 * cfg.warpgroups * cfg.tiles} (64 x warpgroups x tiles)"
        )
    cfg = dataclasses.replace(cfg, stages=min(cfg.stages, steps), split_k=1)
    _check_smem(cfg, cfg.stages, bm + _ROW_ALIGN, "fp4_grouped_matmul_mgpu")
    lean = cfg.prologue == "kernel"
    plan = grouped_plan(group_sizes, t, bm, kernel=lean, interpret=interpret)
    xp = pad_rows_for_windows(x, bm, past_end=lean)
    y = grouped_partials(
        xp, w, plan.expert, plan.first_row, plan.valid, cfg, rows=t, interpret=interpret
    )
    if lean:  # the kernel zeroes the rows past the routed ones
        return y
    # rows past the routed ones belong to no block (in the model's use there are none)
    routed = jnp.arange(t) < jnp.sum(group_sizes)
    return jnp.where(routed[:, None], y, 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupedPlan:
    """Row blocks of a routing (``grouped_plan``), per block [B] int32: its expert, first row
    and number of valid rows; the blocks past the routing's last have 0 valid rows and as
    first row the number of routed rows (where the unrouted ones start)."""

    expert: jax.Array
    first_row: jax.Array
    valid: jax.Array


_PLAN_BLOCKS = 16  # row blocks per program of the plan kernel
PLAN_WARPS = 8  # warps per program of the plan kernel


def _plan_kernel(sizes_ref, expert_ref, first_ref, valid_ref, *, block_m: int, experts: int):
    """``_row_blocks`` for 16 row blocks per program: sizes [E'] int32 (zeros past the E
    experts, E' a power of two) -> per block its expert, first row and valid rows (int32).
    Each program scans the sizes (prefix sums), finds each of its blocks' expert by counting
    the experts whose blocks end at or before it, and reads that expert's fields by a one-hot
    sum ([16, E'] per program: the grid shares the compare XLA's form does in one pass)."""
    sizes = sizes_ref[...]
    nb = (sizes + (block_m - 1)) // block_m
    ends = jnp.cumsum(sizes)
    bend = jnp.cumsum(nb)
    shape = (expert_ref.shape[0], sizes.shape[0])
    block = pl.program_id(0) * shape[0] + lax.broadcasted_iota(jnp.int32, (shape[0],), 0)
    b = block[:, None]
    be = jnp.minimum(jnp.sum((bend[None, :] <= b).astype(jnp.int32), axis=1), experts - 1)
    onehot = lax.broadcasted_iota(jnp.int32, shape, 1) == be[:, None]

    def pick(v):
        return jnp.sum(jnp.where(onehot, v[None, :], 0), axis=1)

    j = block - pick(bend - nb)
    used = block < jnp.sum(nb)
    expert_ref[...] = be
    first_ref[...] = jnp.where(used, pick(ends - sizes) + j * block_m, jnp.sum(sizes))
    valid_ref[...] = jnp.where(used, jnp.minimum(block_m, pick(sizes) - j * block_m), 0)


def _pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def grouped_plan(
    group_sizes: jax.Array,
    rows: int,
    block_m: int,
    *,
    kernel: bool = False,
    interpret: bool = False,
) -> GroupedPlan:
    """Each expert's rows cut into blocks of ``block_m``; a block reads the window of
    ``block_m + 8`` rows from its first row rounded down to a multiple of 8 (TMA into the tiled
    buffer needs aligned starts) and writes its valid rows of the output.

    XLA's ops (``_row_blocks``: ``num_row_blocks`` entries), or with ``kernel`` one small
    Triton launch (``_plan_kernel``; ``interpret``: in the Pallas interpreter) whose fields
    have that number rounded up to a multiple of 16 entries, equal to XLA's on its blocks
    and with 0 valid rows past them."""
    if not kernel:
        return GroupedPlan(*_row_blocks(group_sizes, rows, block_m))
    e = group_sizes.shape[0]
    ep, bp = _pow2(e), _round_up(num_row_blocks(rows, e, block_m), _PLAN_BLOCKS)
    sizes = group_sizes.astype(jnp.int32)
    if ep != e:
        sizes = jnp.pad(sizes, (0, ep - e))
    field = jax.ShapeDtypeStruct((bp,), jnp.int32)
    blocks = pl.BlockSpec((_PLAN_BLOCKS,), lambda i: (i,))
    fields = pl.pallas_call(
        functools.partial(_plan_kernel, block_m=block_m, experts=e),
        out_shape=(field, field, field),
        grid=(bp // _PLAN_BLOCKS,),
        in_specs=[pl.BlockSpec((ep,), lambda i: (0,))],
        out_specs=(blocks, blocks, blocks),
        interpret=interpret,
        compiler_params=plgpu_triton.CompilerParams(num_warps=PLAN_WARPS, num_stages=1),
    )(sizes)
    return GroupedPlan(*fields)


def pad_rows_for_windows(x: jax.Array, block_m: int, *, past_end: bool = False) -> jax.Array:
    """x [T, K] -> bf16 [T', K]: every row block's window of ``block_m + 8`` rows read by one
    TMA copy from a multiple of 8. Zero rows after x (whole 8-row tiles, every window
    inside), or with ``past_end``, where T is a multiple of 8 and at least a window, x as it
    is: TMA fills the rows of a window past T with zeros (their outputs are not written)."""
    t = x.shape[0]
    x = x.astype(jnp.bfloat16)
    if past_end and t % _ROW_ALIGN == 0 and t >= block_m + _ROW_ALIGN:
        return x
    return jnp.pad(x, ((0, block_m + _ROW_ALIGN + -t % _ROW_ALIGN), (0, 0)))
