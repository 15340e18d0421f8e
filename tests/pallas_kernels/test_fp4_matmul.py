"""FP4 dense matmul kernel vs its pure-JAX reference: Pallas interpreter on the CPU, and the
compiled kernel at the benchmark shapes on a GPU."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from kernel_checks import assert_close, random_x

from pallas_kernels import fp4_matmul as fm
from pallas_kernels import fp4_matmul_gemv as fmv
from pallas_kernels import fp4_matmul_triton as ft
from pallas_kernels import layouts
from trace_jax import fp4

FORMATS = ("nvfp4", "mxfp4")
# the references as one program per shape (eager, each of their ops compiled on its own)
_reference = jax.jit(fm.fp4_matmul_reference)
_w4a4_reference = jax.jit(fm.fp4_matmul_w4a4_reference)
_decode_words = jax.jit(fmv.decode_reference, static_argnums=(2, 3))


@functools.cache  # one quantization per shape and format: the interpret tests share weights
def _weights(k, n, fmt, seed=1, scale=0.05):
    w = np.random.default_rng(seed).standard_normal((k, n), np.float32) * scale
    return fp4.quantize(jnp.asarray(w), fmt, axis=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_identity_rows_recover_dequantize_exactly(fmt):
    # e_k @ W is row k of W: every code and scale of the tile passes through the in-kernel
    # decode, and the result must be fp4.dequantize's value, rounded once to bf16, bit for bit.
    k, n = 128, 64
    qt = _weights(k, n, fmt)
    eye = jnp.eye(k, dtype=jnp.bfloat16)
    cfg = ft.Fp4MatmulConfig(block_n=64, block_k=64, block_m=64)
    y = fm.fp4_matmul(eye, qt, config=cfg, interpret=True)
    expected = fp4.dequantize(qt, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(expected, np.float32))
    codes = np.asarray(fp4.unpacked_codes(qt)).ravel()
    assert set(np.unique(codes)) >= set(range(16)) - {8}  # every nonzero code was exercised


_TILINGS = [
    (1, 256, 64, ft.Fp4MatmulConfig(block_n=64, block_k=128)),
    (5, 512, 128, ft.Fp4MatmulConfig(block_n=64, block_k=128, split_k=2)),
    (16, 256, 128, ft.Fp4MatmulConfig(block_n=32, block_k=64, x_layout="strided")),
    (40, 128, 64, ft.Fp4MatmulConfig(block_n=64, block_k=64, prefetch=True, num_stages=1)),
    (1, 512, 64, ft.Fp4MatmulConfig(block_n=32, block_k=128, block_m=1, mma=False)),
    (3, 256, 64, ft.Fp4MatmulConfig(block_n=64, block_k=64, block_m=1, mma=False, split_k=2)),
]


@pytest.mark.parametrize(
    ("fmt", "m", "k", "n", "cfg"),
    # every tiling in NVFP4; MXFP4 where its weights are read differently: the format enters
    # through the weight loads and their decode (a step's scale bytes, a split's or a
    # prefetch's step), not through the x layout (strided) or the GEMV form's reduction
    [("nvfp4", *t) for t in _TILINGS] + [("mxfp4", *_TILINGS[i]) for i in (0, 1, 3, 5)],
)
def test_matches_reference(fmt, m, k, n, cfg):
    qt = _weights(k, n, fmt)
    x = random_x(m, k, seed=m * 7 + n)
    y = fm.fp4_matmul(x, qt, config=cfg, interpret=True)
    assert_close(y, _reference(x, qt))


@pytest.mark.parametrize(
    ("fmt", "mode"),
    # (MXFP4 "before": the W4A16 kernel with the per-token scale, whose weight loads and
    # decode are test_matches_reference's MXFP4 case on this tiling, and whose scale is the
    # NVFP4 case's; the activation is NVFP4 either way)
    [("nvfp4", "before"), ("nvfp4", "kernel"), ("mxfp4", "kernel")],
)
def test_w4a4_matches_reference(fmt, mode):
    m, k, n = 7, 256, 64
    qt = _weights(k, n, fmt)
    x = np.asarray(random_x(m, k, seed=4), np.float32) * 3  # rows of different magnitude get
    x[2] *= 50  # different global scales
    x = jnp.asarray(x.astype(ml_dtypes.bfloat16))
    cfg = ft.Fp4MatmulConfig(block_n=64, block_k=128)
    y = fm.fp4_matmul_w4a4(x, qt, config=cfg, interpret=True, activation_dequant=mode)
    ref = _w4a4_reference(x, qt)
    assert_close(y, ref)
    # and it is not the W4A16 result: the activation really was quantized
    w4a16 = np.asarray(_reference(x, qt), np.float32)
    assert np.linalg.norm(np.asarray(y, np.float32) - w4a16) / np.linalg.norm(w4a16) > 1e-2


def test_nan_block_scale_poisons_its_column_mxfp4():
    # an E8M0 NaN scale (0xFF) dequantizes its block to NaN: that output column must be NaN
    qt = _weights(128, 64, "mxfp4")
    qt = dataclasses.replace(qt, block_scales=qt.block_scales.at[9, 2].set(0xFF))
    ref = np.asarray(_reference(random_x(3, 128, 6), qt), np.float32)
    assert np.all(np.isnan(ref[:, 9]))
    cfg = ft.Fp4MatmulConfig(block_n=64, block_k=128)
    y = np.asarray(fm.fp4_matmul(random_x(3, 128, 6), qt, config=cfg, interpret=True), np.float32)
    assert np.all(np.isnan(y[:, 9]))
    assert np.all(np.isfinite(np.delete(y, 9, axis=1)))


def test_nan_global_scale_poisons_everything_nvfp4():
    qt = _weights(128, 64, "nvfp4")
    qt = dataclasses.replace(qt, global_scale=jnp.float32(jnp.nan))
    cfg = ft.Fp4MatmulConfig(block_n=64, block_k=128)
    y = fm.fp4_matmul(random_x(2, 128, 1), qt, config=cfg, interpret=True)
    assert np.all(np.isnan(np.asarray(y, np.float32)))


def test_prepack_rejects_wrong_axis_and_rank():
    w = jnp.ones((64, 32), jnp.float32)
    with pytest.raises(ValueError, match="axis 0"):
        layouts.prepack(fp4.quantize(w, "nvfp4", axis=1))
    with pytest.raises(ValueError, match="2-D"):
        layouts.prepack(fp4.quantize(jnp.ones((2, 64, 32)), "nvfp4", axis=1))


def test_config_validation():
    with pytest.raises(ValueError, match="power of two"):
        ft.Fp4MatmulConfig(block_n=48)
    with pytest.raises(ValueError, match="dequant"):
        ft.Fp4MatmulConfig(dequant="lut")
    qt = _weights(256, 64, "nvfp4")
    with pytest.raises(ValueError, match="multiple of block_k"):
        cfg = ft.Fp4MatmulConfig(block_n=64, block_k=512)
        fm.fp4_matmul(random_x(1, 256, 0), qt, config=cfg, interpret=True)


@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(1, 8192, 28672), (16, 4096, 14336), (64, 8192, 28672), (256, 768, 2048), (3, 2048, 1536)],
)
def test_default_config_tiles_the_shape(m, k, n):
    cfg = ft.default_config(m, k, n)
    assert n % cfg.block_n == 0
    assert k % (cfg.block_k * cfg.split_k) == 0
    assert cfg.block_m >= min(m, 64)


def test_dispatcher_xla_path_and_leading_axes():
    qt = _weights(256, 64, "nvfp4")
    x = random_x(6, 256, 3).reshape(2, 3, 256)
    y = fm.fp4_linear(x, qt, backend="auto")  # no GPU here: the XLA path
    assert y.shape == (2, 3, 64)
    assert_close(y.reshape(6, 64), _reference(x.reshape(6, 256), qt))
    with pytest.raises(ValueError, match="backend"):
        fm.fp4_linear(x, qt, backend="cuda")


# ----------------------------------------------------------------------------- one token


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_k", [128, 256])
def test_gemv_word_layout_decodes_to_dequantize(fmt, block_k):
    # every code and scale through the word layout and the kernel's bit decode, exactly
    k, n = 512, 24
    qt = _weights(k, n, fmt)
    spec = fp4.get_format(fmt)
    w = layouts.prepack(qt)
    words = layouts.pack_gemv_words(w.codes, spec, block_k)
    assert words.shape == (n, k // 8) and words.dtype == jnp.uint32
    got = np.asarray(_decode_words(words, w.scales, spec, block_k))
    g = np.asarray(qt.global_scale) if spec.scale_format == "e4m3" else 1.0
    expected = np.asarray(fp4.dequantize(qt, jnp.float32)).T
    np.testing.assert_array_equal(got * g, expected)
    stored = np.asarray(qt.codes)  # two codes a byte
    assert set(np.unique(np.stack([stored & 15, stored >> 4]))) >= set(range(16)) - {8}
    # the row-tiled layout is the same words, each (8-row tile, step) made contiguous
    tiled = layouts.with_gemv_layout(w, block_k, block_n=8)
    back = np.asarray(tiled.gemv_words).reshape(n // 8, k // block_k, 8, block_k // 8)
    back = back.transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(back.reshape(n, k // 8), np.asarray(words))
    nb = block_k // spec.block_size
    sback = np.asarray(tiled.gemv_scales).reshape(n // 8, k // block_k, 8, nb).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(sback.reshape(n, -1), np.asarray(w.scales))


_GEMV_CONFIGS = [
    (None, None),  # the dispatcher's choice for one token and a prepacked weight
    (fmv.Fp4GemvConfig(block_n=32, split_k=1, num_warps=2, prefetch=0), 32),
    (fmv.Fp4GemvConfig(block_n=16, block_k=128, split_k=2, prefetch=2), 16),
    (fmv.Fp4GemvConfig(block_n=16, block_k=128, split_k=2), 0),
]


@pytest.mark.parametrize(
    ("fmt", "cfg", "layout_n"),
    # every config in NVFP4; MXFP4 (its blocks per step and scale decode) except with no
    # prefetch (the loop without loads ahead reads the format as the others do; its row
    # tiles: the 16-row case)
    [("nvfp4", *c) for c in _GEMV_CONFIGS] + [("mxfp4", *_GEMV_CONFIGS[i]) for i in (0, 2, 3)],
)
def test_gemv_matches_reference(fmt, cfg, layout_n):
    k, n = 512, 64
    qt = _weights(k, n, fmt)
    w = layouts.prepack(qt, mgpu=False)
    assert (w.gemv_words is not None) == (fmt == "nvfp4")  # MXFP4 keeps the GEMV form
    if cfg is not None:
        w = layouts.with_gemv_layout(w, cfg.block_k, layout_n)
    x = random_x(1, k, seed=13)
    y = fm.fp4_matmul(x, w, config=cfg, interpret=True)
    assert_close(y, _reference(x, qt))


def test_gemv_nan_propagates():
    # a NaN block scale (MXFP4) poisons its column; a NaN activation poisons every column
    qt = _weights(512, 32, "mxfp4")
    qt = dataclasses.replace(qt, block_scales=qt.block_scales.at[5, 3].set(0xFF))
    w = layouts.with_gemv_layout(layouts.prepack(qt), block_n=32)  # prepack packs NVFP4 only
    x = random_x(1, 512, seed=15)
    y = np.asarray(fm.fp4_matmul(x, w, interpret=True), np.float32)
    assert np.isnan(y[0, 5]) and np.all(np.isfinite(np.delete(y, 5, axis=1)))
    y = np.asarray(fm.fp4_matmul(x.at[0, 77].set(jnp.nan), w, interpret=True), np.float32)
    assert np.all(np.isnan(y))


def test_gemv_layout_mismatch_and_config_rejected():
    w = layouts.prepack(_weights(512, 32, "nvfp4"))
    with pytest.raises(ValueError, match="packed with block_k"):
        fm.fp4_matmul(random_x(1, 512, 0), w, config=fmv.Fp4GemvConfig(block_k=128), interpret=True)
    with pytest.raises(ValueError, match="packed with block_n"):
        cfg = fmv.Fp4GemvConfig(block_n=w.gemv_block_n * 2)
        fm.fp4_matmul(random_x(1, 512, 0), w, config=cfg, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        fmv.Fp4GemvConfig(block_n=24)
    assert layouts.prepack(_weights(512, 32, "nvfp4"), gemv=False).gemv_words is None


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("k", "n"), [(8192, 28672), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_gpu_benchmark_shapes(fmt, k, n, m):
    qt = layouts.prepack(_weights(k, n, fmt, seed=k + m, scale=0.02))
    x = random_x(m, k, seed=m)
    assert_close(fm.fp4_matmul(x, qt), _reference(x, qt))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["before", "kernel"])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_gpu_w4a4(mode, m):
    k, n = 4096, 14336
    qt = layouts.prepack(_weights(k, n, "nvfp4", seed=m, scale=0.02))
    x = random_x(m, k, seed=m + 1)
    y = fm.fp4_matmul_w4a4(x, qt, activation_dequant=mode)
    assert_close(y, _w4a4_reference(x, qt))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_identity_rows_exact(fmt):
    # the PTX decode (bf16 subnormal for the 0.5 code) must agree bit for bit with dequantize
    k, n = 256, 128
    qt = _weights(k, n, fmt)
    y = fm.fp4_matmul(jnp.eye(k, dtype=jnp.bfloat16), qt)
    np.testing.assert_array_equal(
        np.asarray(y, np.float32), np.asarray(fp4.dequantize(qt, jnp.bfloat16), np.float32)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_one_token_unit_rows_exact(fmt):
    # x = e_k picks row k of W: the PTX word decode of every slot and group of a step (and of
    # the last step) must give fp4.dequantize's value, rounded once to bf16
    k, n = 1024, 64
    qt = _weights(k, n, fmt)
    w = layouts.with_gemv_layout(layouts.prepack(qt), block_n=32)  # prepack packs NVFP4 only
    expected = np.asarray(fp4.dequantize(qt, jnp.bfloat16), np.float32)
    for pos in [*range(32), *range(k - 32, k)]:
        x = jnp.zeros((1, k), jnp.bfloat16).at[0, pos].set(1)
        y = np.asarray(fm.fp4_matmul(x, w), np.float32)
        np.testing.assert_array_equal(y[0], expected[pos], err_msg=f"row {pos}")
