"""FP4 weight matmul kernel for Hopper GPUs (Pallas, Triton lowering): ``y = x @ dequantize(W)``,
dequantized in the kernel; its reference is ``fp4_matmul.fp4_matmul_reference``.

``W`` is an NVFP4 or MXFP4 ``QTensor`` of logical shape [K, N] quantized along K (axis 0), so
its stored codes are [N, K/2] (element 2i of a row in the low nibble of byte i) and its block
scales [N, K/block]; the kernel takes its ``layouts.prepack_arrays`` (the codes as they are,
the scale bytes, the folded offset and the per-row output scale), streams those bytes once and
never writes a dequantized copy.

Kernel layout:

* Operands are swapped: the program computes ``y^T[n-tile] = W^T[n-tile, :] @ x^T``, so the
  weight tile (``block_n`` rows of N) is the matrix unit's 64-row side and the few tokens are its
  narrow side (padded to 16).
* The packed codes are never interleaved: the low nibbles of a [block_n, block_k/2] byte tile
  are the even K positions and the high nibbles the odd ones, so each loop step issues two dots,
  ``lo @ x[:, even].T + hi @ x[:, odd].T``, against stride-2 loads of x.
* Dequantization is exact in bf16 (``dequant``: the offset ``2**c`` folded into the block
  scale keeps every intermediate a normal bf16); the matching ``2**(126 - c)`` and the global
  scale multiply the fp32 accumulator at the end. ``dequant="asm"`` decodes 8 codes per 32-bit
  word in PTX, ``dequant="portable"`` the same arithmetic in plain ``jnp`` (interpret mode).
* ``split_k > 1`` splits the contraction over a second grid axis; partial fp32 sums are added
  in XLA.
* ``mma=False``: the GEMV form for one token (no matrix unit).

Entries: ``fp4_matmul_triton`` (W4A16; with a per-row scale, the W4A4 form whose activation
is given as its exact bf16 block values) and ``fp4_matmul_codes_triton`` (W4A4 with the
activation's NVFP4 codes decoded in the kernel). ``bf16_matmul`` is the same loop with bf16
weights, the like-for-like BF16 baseline. Which kernel a call runs is ``fp4_matmul``'s choice.
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

from pallas_kernels.dequant import DEQUANT_TILE, EXPANDED_SCALE, dequantize_tile
from pallas_kernels.layouts import NVFP4_SCALE_OFFSET, Fp4Weight, prepack
from trace_jax import fp4
from trace_jax.fp4 import FormatSpec, QTensor

Dequant = Literal["asm", "portable"]

_MIN_ROWS = 16  # the matrix unit's narrow side: fewer rows are zero-padded


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
        if cfg.dequant in EXPANDED_SCALE:
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
                xc, xs, jnp.int32(NVFP4_SCALE_OFFSET), fp4.NVFP4, cfg.dequant
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


def as_weight(w: QTensor | Fp4Weight) -> Fp4Weight:
    """A weight as the kernel takes it: a bare QTensor is arranged per call (no second copy of
    the codes is worth making then)."""
    return w if isinstance(w, Fp4Weight) else prepack(w, mgpu=False, gemv=False)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def fp4_matmul_triton(
    x: jax.Array,
    w: QTensor | Fp4Weight,
    *,
    config: Fp4MatmulConfig | None = None,
    row_scale: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x @ dequantize(w)`` with the weight dequantized in the kernel.

    Args:
      x: [M, K] bf16 activations.
      w: weight [K, N] as an NVFP4/MXFP4 ``QTensor`` quantized along K, or its ``prepack``.
      config: tiling; ``default_config(M, K, N)`` when None.
      row_scale: None (W4A16), or [M] float32 multiplying each row's fp32 sum before the one
        rounding to bf16 (W4A4 with x the activation's exact ``code * block_scale`` values:
        the K split is then at least 2, so that the partial sums stay fp32).
      interpret: run the Pallas interpreter (CPU tests).
    Returns:
      [M, N] bf16, accumulated in fp32.
    """
    w = as_weight(w)
    k, n = w.shape
    m = x.shape[0]
    if x.shape != (m, k):
        raise ValueError(f"fp4_matmul: x has shape {x.shape}, weight needs [M, {k}]")
    cfg = config or default_config(m, k, n)
    x = x.astype(jnp.bfloat16)
    if row_scale is None:
        x_args = [x[:, 0::2], x[:, 1::2]] if cfg.x_layout == "split" else [x]
        return _call(x_args, w, m, cfg, interpret, w4a4=False)
    # The per-token scale multiplies the fp32 sum of the K-split partials, before the one bf16
    # rounding (split_k >= 2 keeps the kernel's output in fp32).
    split = max(cfg.split_k, 2)
    if k % (cfg.block_k * split):
        raise ValueError(f"fp4_matmul_w4a4: K={k} does not split in two with {cfg}")
    cfg = dataclasses.replace(cfg, x_layout="split", split_k=split)
    x_args = [x[:, 0::2], x[:, 1::2]]
    return _call(x_args, w, m, cfg, interpret, w4a4=False, row_scale=row_scale)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def fp4_matmul_codes_triton(
    xq: QTensor,
    w: QTensor | Fp4Weight,
    *,
    config: Fp4MatmulConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """W4A4 with the activation's codes decoded by every program of the kernel:
    ``dequantize(xq) @ dequantize(w)``, x moving as 4.5 bits (each N block repeats the decode).

    Args:
      xq: NVFP4 activation [M, K] along K with one global scale per row.
      w: weight [K, N] ``QTensor`` (axis 0) or its ``prepack``.
    Returns:
      [M, N] bf16.
    """
    w = as_weight(w)
    k, n = w.shape
    m = xq.shape[0]
    if xq.fmt != fp4.NVFP4 or xq.axis != 1 or xq.shape[1] != k:
        raise ValueError(f"fp4_matmul_w4a4: activation must be NVFP4 [M, {k}] along axis 1")
    cfg = config or default_config(m, k, n)
    row_scale = jnp.broadcast_to(xq.global_scale, (m, 1))[:, 0].astype(jnp.float32)
    x_scales = jax.lax.bitcast_convert_type(xq.block_scales, jnp.uint8)
    x_out = row_scale * np.float32(2.0 ** (126 - NVFP4_SCALE_OFFSET))
    return _call([xq.codes, x_scales, x_out], w, m, cfg, interpret, w4a4=True)


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
