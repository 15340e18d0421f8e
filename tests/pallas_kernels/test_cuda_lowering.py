"""Every Pallas Triton kernel lowered for CUDA on the CPU (``cuda_lowering``): the GPU-only
paths the interpreter never runs (the PTX dequantization, Triton's block-shape rules) must
lower; the Mosaic GPU forms are checked in ``test_fp4_matmul_mgpu.py``."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import cuda_lowering, layouts
from pallas_kernels import fp4_decode_attention as fa
from pallas_kernels import fp4_decode_attention_triton as ft
from pallas_kernels import fp4_grouped_matmul_triton as gt
from pallas_kernels import fp4_matmul as fm
from pallas_kernels import fp4_matmul_triton as fmt
from trace_jax import fp4
from trace_jax.rollout import kv_cache

B, S, HKV, HQ, D = 2, 256, 4, 32, 128


def _normal(shape, seed, dtype=np.float32, scale=1.0):
    """Values only fill the operands (the tests lower, never run): drawn in numpy."""
    x = np.random.default_rng(seed).standard_normal(shape, np.float32) * np.float32(scale)
    return jnp.asarray(x.astype(dtype))


def _cache(fmt, seed):
    x = _normal((B, S, HKV, D), seed)
    qt = None
    if fmt in ("nvfp4", "mxfp4"):
        qt = fp4.quantize(x, fmt, axis=-1, global_scale=kv_cache.site_global_scale(fmt))
    return kv_cache.to_storage(fmt, x, qt)


def _one_kernel(fn, *args) -> str:
    modules = cuda_lowering.triton_modules(fn, *args)
    assert len(modules) == 1, f"expected one Triton kernel, got {len(modules)}"
    assert "tt.func" in modules[0]
    return modules[0]


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("heads", [1, 2])
def test_decode_attention_lowers(fmt, heads):
    q = _normal((B, HQ, D), 0, ml_dtypes.bfloat16)
    k, v = _cache(fmt, 1), _cache(fmt, 2)
    lengths = jnp.array([1, S], jnp.int32)
    cfg = ft.DecodeAttentionConfig(block_k=16, num_splits=2, heads_per_program=heads)
    ir = _one_kernel(
        lambda q, k, v, n: fa.decode_attention(q, k, v, n, config=cfg), q, k, v, lengths
    )
    if fmt in ("nvfp4", "mxfp4"):
        assert "inline_asm" in ir  # the PTX decode, not the interpreter's portable one


def test_fused_append_lowers():
    q = _normal((B, HQ, D), 0, ml_dtypes.bfloat16)
    new = _normal((B, HKV, D), 3, ml_dtypes.bfloat16)
    k, v = _cache("nvfp4", 1), _cache("nvfp4", 2)
    lengths = jnp.array([0, S - 1], jnp.int32)
    modules = cuda_lowering.triton_modules(
        lambda q, k, v, n: fa.decode_attention_append(q, k, v, new, new, n)[0], q, k, v, lengths
    )
    assert any("inline_asm" in m for m in modules)


def _dense(k=512, n=256):
    return fp4.quantize(_normal((k, n), 5, scale=0.05), "nvfp4", axis=0)


@pytest.mark.parametrize("m", [1, 16, 64, 256])
def test_fp4_matmul_triton_lowers(m):
    qt = _dense()
    w = layouts.prepack(qt, mgpu=False, gemv=m == 1)  # m = 1: the one-token kernel
    x = jnp.zeros((m, 512), jnp.bfloat16)
    cfg = None if m == 1 else fmt.default_config(m, 512, 256)
    ir = _one_kernel(lambda x, w: fm.fp4_matmul(x, w, config=cfg), x, w)
    assert "inline_asm" in ir


def test_w4a4_kernel_decode_and_grouped_lower():
    x = jnp.zeros((16, 512), jnp.bfloat16)
    w = layouts.prepack(_dense(), mgpu=False)
    _one_kernel(lambda x, w: fm.fp4_matmul_w4a4(x, w, activation_dequant="kernel"), x, w)
    experts = fp4.quantize(_normal((4, 512, 256), 6), "nvfp4", axis=1)
    wg = layouts.prepack_grouped(experts, mgpu=False)
    sizes = jnp.array([3, 0, 12, 9], jnp.int32)
    _one_kernel(
        lambda x, w, g: gt.fp4_grouped_matmul_triton(x, w, g), jnp.zeros((24, 512)), wg, sizes
    )
