"""The dense FP4 matmul op, ``y = x @ dequantize(W)``: its pure-JAX definition and the choice of
the kernel that computes it.

``W`` is an NVFP4 or MXFP4 ``QTensor`` [K, N] quantized along K, or its ``layouts.prepack``.
Kernels (each in its own module): ``fp4_matmul_mgpu`` (Mosaic GPU: decoded straight into the
tensor cores' register operand, TMA stages; the fastest FP4 path measured for 1-256 rows, run
on a GPU with a ``prepack`` holding its layout), ``fp4_matmul_gemv`` (one token, its own word
layout, no matrix unit), ``fp4_matmul_triton`` (the Triton kernel, any shape it tiles; the one
the Pallas interpreter runs in CPU tests). ``fp4_matmul_reference`` is the definition every one
of them is tested against; ``fp4_linear`` adds the fallback to dequantize-then-XLA-matmul where
no kernel is faster (large M). W4A4 (``fp4_matmul_w4a4``) quantizes the activation first with
``fp4_activation.quantize_activation``.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels import fp4_activation as fact
from pallas_kernels import fp4_matmul_gemv as fmv
from pallas_kernels import fp4_matmul_mgpu as fmm
from pallas_kernels import fp4_matmul_triton as ft
from pallas_kernels.fp4_activation import quantize_activation
from pallas_kernels.layouts import Fp4Weight
from trace_jax import fp4
from trace_jax.fp4 import QTensor
from trace_jax.fp4.quantize import block_scale_values, decode_blocks

MGPU_MAX_ROWS = 256  # rows up to which a prepacked weight runs the tensor-core kernel


def _mgpu_default(w: QTensor | Fp4Weight, m: int) -> fmm.MgpuMatmulConfig | None:
    """The tensor-core kernel's default config where a compiled call takes it, else None."""
    if not isinstance(w, Fp4Weight) or w.mgpu is None or m > MGPU_MAX_ROWS:
        return None
    return fmm.default_config(m, *w.shape)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def fp4_matmul(
    x: jax.Array,
    w: QTensor | Fp4Weight,
    *,
    config: ft.Fp4MatmulConfig | fmv.Fp4GemvConfig | fmm.MgpuMatmulConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x @ dequantize(w)`` with the weight dequantized in the kernel (W4A16).

    Args:
      x: [M, K] bf16 activations.
      w: weight [K, N] as an NVFP4/MXFP4 ``QTensor`` quantized along K, or its ``prepack``.
      config: tiling; when None, a compiled call (not ``interpret``) with a ``prepack``
        holding the tensor-core layout (``mgpu``) and M <= ``MGPU_MAX_ROWS`` runs
        ``fp4_matmul_mgpu``; else one token with ``gemv_words`` uses the one-token kernel
        (``fp4_matmul_gemv``, ``default_gemv_config``), anything else the Triton kernel with
        ``fp4_matmul_triton.default_config(M, K, N)``. An ``Fp4GemvConfig`` selects the
        one-token kernel, an ``MgpuMatmulConfig`` the tensor-core kernel, an
        ``Fp4MatmulConfig`` the Triton kernel.
      interpret: run the Pallas interpreter (CPU tests).
    Returns:
      [M, N] bf16, accumulated in fp32.
    """
    w = ft.as_weight(w)
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
    return ft.fp4_matmul_triton(x, w, config=config, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "activation_dequant"))
def fp4_matmul_w4a4(
    x: jax.Array | QTensor,
    w: QTensor | Fp4Weight,
    *,
    config: ft.Fp4MatmulConfig | fmm.MgpuMatmulConfig | None = None,
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
    w = ft.as_weight(w)
    k, _ = w.shape
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
    if activation_dequant == "kernel":
        return ft.fp4_matmul_codes_triton(xq, w, config=config, interpret=interpret)
    # code * block scale without the global scale: <= 6 significant bits, exact in bf16
    if isinstance(x, QTensor):
        x_blocks, row_scale = fact.activation_blocks(x)
    else:
        x_blocks, row_scale = fact.quantize_activation_blocks(x, interpret=interpret)
    if mgpu:
        return fmm.fp4_matmul_mgpu(
            x_blocks, w.mgpu, config, row_scale=row_scale, interpret=interpret
        )
    return ft.fp4_matmul_triton(
        x_blocks, w, config=config, row_scale=row_scale, interpret=interpret
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
        y = xla_linear(x2, w, w4a4=w4a4)
    else:
        raise ValueError(f"fp4_linear: backend must be 'auto', 'pallas' or 'xla', got {backend!r}")
    return y.reshape(*lead, y.shape[-1])


@functools.partial(jax.jit, static_argnames=("w4a4",))
def xla_linear(x: jax.Array, w: QTensor | Fp4Weight, w4a4: bool = False) -> jax.Array:
    """The XLA path of ``fp4_linear``: the weight dequantized, then one bf16 matmul. x: [M, K]
    bf16; -> [M, N] bf16."""
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
