"""NVFP4 tensor-core matmul (Mosaic GPU) vs the pure-JAX reference: the Mosaic GPU interpreter
on the CPU (pipeline, prepacked layout and decode arithmetic), and the compiled kernel with the
PTX decode on a GPU."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import assert_close, random_x

from pallas_kernels import cuda_lowering, layouts
from pallas_kernels import fp4_grouped_matmul as gm
from pallas_kernels import fp4_matmul as fm
from pallas_kernels import fp4_matmul_mgpu as fmm
from trace_jax import fp4


@functools.cache  # one quantization per shape: the interpret tests share their weights
def _weights(k, n, seed=1, scale=0.05, global_scale="tensor"):
    w = np.random.default_rng(seed).standard_normal((k, n), np.float32) * scale
    return fp4.quantize(jnp.asarray(w), "nvfp4", axis=0, global_scale=global_scale)


_SHORT = fmm.MgpuMatmulConfig(block_k=256, stages=4)  # one step at K = 256
_TWO_OF_3 = fmm.MgpuMatmulConfig(block_k=128, stages=3)  # two steps at K = 256, a spare buffer
_PACKED = {}
# the references as one program per shape (eager, each of their ops compiled on its own)
_reference = jax.jit(fm.fp4_matmul_reference)
_grouped_reference = jax.jit(gm.fp4_grouped_matmul_reference)
_xla_plan = jax.jit(fmm._row_blocks, static_argnums=(1, 2))
_kernel_plan = jax.jit(
    functools.partial(fmm.grouped_plan, kernel=True, interpret=True), static_argnums=(1, 2)
)


def _packed(qt):
    """layouts.prepack_mgpu(qt), once per weight object (the cached ones are shared)."""
    hit = _PACKED.get(id(qt))
    if hit is None or hit[0] is not qt:
        hit = _PACKED[id(qt)] = (qt, layouts.prepack_mgpu(qt))
    return hit[1]


def test_identity_rows_recover_dequantize_exactly():
    # e_k @ W is row k of W: every slot of every code word and every scale byte passes through
    # the decode, and the result must be fp4.dequantize's value, rounded once to bf16.
    k, n = 256, 128
    qt = _weights(k, n)
    # (the default config for 17-128 rows where N < 256 x 132: test_tall_default_configs_run)
    y = fmm.fp4_matmul_mgpu(jnp.eye(k, dtype=jnp.bfloat16), _packed(qt), _TWO_OF_3, interpret=True)
    expected = fp4.dequantize(qt, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(expected, np.float32))
    assert set(np.unique(np.asarray(fp4.unpacked_codes(qt)))) >= set(range(16)) - {8}
    # the same with K split over two warpgroups (each row's one nonzero term in one part)
    ksplit = fmm.MgpuMatmulConfig(block_k=64, stages=2, split_k=2, split_in="warpgroups")
    y = fmm.fp4_matmul_mgpu(jnp.eye(k, dtype=jnp.bfloat16), _packed(qt), ksplit, interpret=True)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(expected, np.float32))


@pytest.mark.parametrize(
    ("m", "k", "n", "cfg"),
    [
        (1, 256, 64, fmm.MgpuMatmulConfig(block_k=64, stages=3)),  # pipeline wraps around
        (5, 512, 128, fmm.MgpuMatmulConfig(block_k=128, stages=2, split_k=2)),
        (16, 256, 64, _SHORT),  # stages > steps
        (24, 384, 192, None),
        # two warpgroups share each activation buffer; the refill waits for both
        (24, 256, 256, fmm.MgpuMatmulConfig(block_k=64, stages=2, warpgroups=2)),
        # two warpgroups, 128-element steps, an odd step count (the default there until 17-128
        # rows took one warpgroup; the one-warpgroup default: the case above it)
        (24, 384, 256, fmm.MgpuMatmulConfig(block_k=128, stages=3, warpgroups=2)),
        # the warpgroups split K (own buffers; the parts added in shared memory)
        (
            1,
            512,
            128,
            fmm.MgpuMatmulConfig(block_k=128, stages=3, split_k=2, split_in="warpgroups"),
        ),
        (13, 768, 64, fmm.MgpuMatmulConfig(block_k=64, stages=4, split_k=2, split_in="warpgroups")),
    ],
)
def test_matches_reference(m, k, n, cfg):
    qt = _weights(k, n)
    x = random_x(m, k, seed=n)
    y = fmm.fp4_matmul_mgpu(x, _packed(qt), cfg, interpret=True)
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16
    assert_close(y, _reference(x, qt))


@pytest.mark.parametrize("grouped", [False, True])
def test_mxfp4_matches_reference(grouped):
    # E8M0 scales (32-element blocks) with the tensor's exponent offset folded into the bytes,
    # a NaN scale poisoning its output column
    k, n = 256, 128
    if grouped:
        w = np.random.default_rng(7).standard_normal((3, k, n), np.float32) * 0.05
        qt = fp4.quantize(jnp.asarray(w), "mxfp4", axis=1)
        x, gs = random_x(13, k, seed=8), jnp.asarray([6, 0, 7], jnp.int32)
        y = fmm.fp4_grouped_matmul_mgpu(x, _packed(qt), gs, interpret=True)
        assert_close(y, _grouped_reference(x, qt, gs))
        return
    w = np.random.default_rng(7).standard_normal((k, n), np.float32) * 0.05
    qt = fp4.quantize(jnp.asarray(w), "mxfp4", axis=0)
    # dense: every code and scale byte decoded exactly (identity rows; MXFP4 sums against the
    # reference: the grouped case), and the NaN column, through one kernel program
    eye = jnp.eye(k, dtype=jnp.bfloat16)
    y = fmm.fp4_matmul_mgpu(eye, _packed(qt), interpret=True)
    expected = np.asarray(fp4.dequantize(qt, jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(np.asarray(y, np.float32), expected)
    nan_qt = dataclasses.replace(qt, block_scales=qt.block_scales.at[5, 3].set(0xFF))
    y = fmm.fp4_matmul_mgpu(eye, layouts.prepack_mgpu(nan_qt), interpret=True)
    y = np.asarray(y, np.float32)
    assert np.all(np.isnan(y[:, 5])) and np.all(np.isfinite(np.delete(y, 5, axis=1)))


def test_w4a4_through_fp4_matmul_w4a4():
    # the activation quantized (per-token global scale) and its exact bf16 block values fed to
    # the tensor-core kernel; the per-token scale multiplies the fp32 sums
    k, n = 256, 128
    qt = _weights(k, n)
    x = random_x(6, k, seed=14) * jnp.asarray([[1.0], [30.0], [0.01], [1.0], [5.0], [0.2]])
    cfg = fmm.MgpuMatmulConfig(block_k=128, stages=2)
    y = fm.fp4_matmul_w4a4(x.astype(jnp.bfloat16), layouts.prepack(qt), config=cfg, interpret=True)
    assert_close(y, fm.fp4_matmul_w4a4_reference(x.astype(jnp.bfloat16), qt))
    with pytest.raises(ValueError, match="activation_dequant"):
        fm.fp4_matmul_w4a4(x, layouts.prepack(qt), config=cfg, activation_dequant="kernel")


@pytest.mark.parametrize(
    "cfg",
    [
        fmm.MgpuMatmulConfig(block_k=64, stages=2),
        # (two warpgroups: each scales its own tile's sums in `finish`, the one-warpgroup
        # case's code per tile; their sums: test_matches_reference's warpgroups=2 cases;
        # lowered for CUDA: test_lowers_for_cuda's W4A4 case)
        fmm.MgpuMatmulConfig(block_k=64, stages=2, split_k=2, split_in="warpgroups"),
    ],
)
def test_token_scale_in_the_kernel_equals_scaling_the_sums(cfg):
    # W4A4's per-token scale applied by the kernel before it rounds its output: bit for bit
    # the kernel's fp32 sums times the output scale, then the token scale, rounded once
    k, n, m = 256, 128, 5
    w = _packed(_weights(k, n))
    x = random_x(m, k, seed=22)
    r = jnp.asarray([1.0, 3.0e-3, 250.0, 0.5, 7.0], jnp.float32)
    y = fmm.fp4_matmul_mgpu(x, w, cfg, row_scale=r, interpret=True)
    cfg = dataclasses.replace(cfg, decode="portable")
    xp = jnp.pad(x.astype(jnp.bfloat16), ((0, 8 - m), (0, 0)))
    sums = fmm.dense_partials(xp, w, cfg, interpret=True)[0, :, :m]
    expected = (sums * w.out_scale[:, None] * r[None, :]).T.astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(expected, np.float32))
    with pytest.raises(ValueError, match="row_scale"):
        fmm.fp4_matmul_mgpu(x, w, cfg, row_scale=r[:3], interpret=True)


def test_per_row_global_scale():
    # the shapes and config of test_matches_reference's first case: the same kernel program
    # (the output scale is a per-row operand either way), other weights
    k, n = 256, 64
    qt = _weights(k, n, global_scale="row")
    assert qt.global_scale.shape == (n, 1)
    x = random_x(1, k, seed=4)
    y = fmm.fp4_matmul_mgpu(
        x, _packed(qt), fmm.MgpuMatmulConfig(block_k=64, stages=3), interpret=True
    )
    assert_close(y, _reference(x, qt))


def test_prepack_layout_is_the_operand_layout():
    # independent of the kernel: word j of thread t = 32 w + 4 a + b holds, in slot (P, v), the
    # code of element (16 w + 8 (P % 2) + a, 16 j + 8 (P // 2) + 2 b + v) of the 64 x 64 tile
    k, n = 128, 128
    qt = _weights(k, n)
    words = np.asarray(_packed(qt).words).reshape(2, 2, 128, 4)
    codes = np.asarray(fp4.unpacked_codes(qt)).reshape(n, k)
    rng = np.random.default_rng(0)
    for _ in range(200):
        tn, kc, t, j = rng.integers(2), rng.integers(2), rng.integers(128), rng.integers(4)
        p, v = rng.integers(4), rng.integers(2)
        w_, a, b = t // 32, (t % 32) // 4, t % 4
        row = 64 * tn + 16 * w_ + 8 * (p % 2) + a
        col = 64 * kc + 16 * j + 8 * (p // 2) + 2 * b + v
        sign, mag = layouts.MGPU_SLOTS[(int(p), int(v))]
        word = int(words[tn, kc, t, j])
        assert ((word >> sign) & 1) << 3 | ((word >> mag) & 7) == codes[row, col]


def test_bad_inputs():
    qt = _weights(128, 64)
    w = _packed(qt)
    with pytest.raises(ValueError, match="x must be"):
        fmm.fp4_matmul_mgpu(random_x(2, 64, 0), w, interpret=True)
    with pytest.raises(ValueError, match="multiples of 64"):
        _packed(_weights(128, 96))
    with pytest.raises(ValueError, match="block_k"):
        fmm.MgpuMatmulConfig(block_k=96)
    with pytest.raises(ValueError, match="not a multiple"):
        fmm.fp4_matmul_mgpu(
            random_x(2, 128, 0), w, fmm.MgpuMatmulConfig(block_k=256), interpret=True
        )


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_identity_rows_exact(fmt):
    # the PTX decode (bf16 subnormal for the 0.5 code) must agree bit for bit with dequantize
    k, n = 256, 128
    w = jax.random.normal(jax.random.key(9), (k, n), jnp.float32) * 0.05
    qt = fp4.quantize(w, fmt, axis=0)
    y = fmm.fp4_matmul_mgpu(jnp.eye(k, dtype=jnp.bfloat16), _packed(qt))
    np.testing.assert_array_equal(
        np.asarray(y, np.float32), np.asarray(fp4.dequantize(qt, jnp.bfloat16), np.float32)
    )


@pytest.mark.gpu
@pytest.mark.parametrize(("k", "n"), [(8192, 28672), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 16, 64, 128, 256])
def test_gpu_benchmark_shapes(k, n, m):
    qt = _weights(k, n, seed=k + m, scale=0.02)
    x = random_x(m, k, seed=m)
    assert_close(fmm.fp4_matmul_mgpu(x, _packed(qt)), _reference(x, qt))
    # the dispatcher's route for a prepacked weight (default config, the same kernel)
    assert_close(fm.fp4_matmul(x, layouts.prepack(qt)), _reference(x, qt))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [5, 13, 40, 200])
def test_gpu_token_major_rows_not_multiples_of_8(m):
    # the default tilings' output: one TMA copy of the first m of the padded rows per tile (K
    # split on the warpgroups for 5 and 13 rows, one and two warpgroups for 40 and 200)
    k, n = 2048, 512
    qt = _weights(k, n, seed=m, scale=0.02)
    x = random_x(m, k, seed=m + 2)
    assert_close(fmm.fp4_matmul_mgpu(x, _packed(qt)), _reference(x, qt))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "cfg"),
    [
        (128, fmm.MgpuMatmulConfig(block_k=64, stages=4)),
        (128, fmm.MgpuMatmulConfig(block_k=128, stages=2, warpgroups=2)),
        (64, fmm.MgpuMatmulConfig(block_k=64, stages=2, warpgroups=2)),
        (256, fmm.MgpuMatmulConfig(block_k=64, stages=2, warpgroups=2)),
        (256, fmm.MgpuMatmulConfig(block_k=64, stages=4, warpgroups=2)),
        # K split over the warpgroups of one program, output scaled in the kernel
        (1, fmm.MgpuMatmulConfig(block_k=256, stages=3, split_k=2, split_in="warpgroups")),
        (16, fmm.MgpuMatmulConfig(block_k=128, stages=4, split_k=2, split_in="warpgroups")),
    ],
)
def test_gpu_register_operand_not_overwritten(m, cfg):
    # tilings whose results had NaNs while the next step's decode could overwrite the register
    # operand of MMAs still in flight (one step per loop iteration); the last fits in shared
    # memory only with the output staged in the loop's buffers
    k, n = 8192, 28672
    qt = _weights(k, n, seed=m, scale=0.02)
    x = random_x(m, k, seed=m + 1)
    assert_close(fmm.fp4_matmul_mgpu(x, _packed(qt), cfg), _reference(x, qt))


def test_fp4_matmul_dispatch():
    # prepack builds the tensor-core layout for NVFP4 and MXFP4 (and then no one-token copy); an
    # MgpuMatmulConfig selects the kernel through fp4_matmul
    k, n = 256, 64
    qt = _weights(k, n)
    w = layouts.prepack(qt)
    assert w.mgpu is not None and w.gemv_words is None
    x = random_x(4, k, seed=11)
    cfg = fmm.MgpuMatmulConfig(block_k=128, stages=2)
    assert_close(fm.fp4_matmul(x, w, config=cfg, interpret=True), _reference(x, qt))
    assert layouts.prepack(fp4.quantize(jnp.ones((256, 64)), "mxfp4", axis=0)).mgpu is not None
    assert layouts.prepack(_weights(256, 32)).mgpu is None  # N not a multiple of 64
    with pytest.raises(ValueError, match="needs prepack"):
        fm.fp4_matmul(x, layouts.prepack(qt, mgpu=False), config=cfg, interpret=True)


# ----------------------------------------------------------------------------- grouped (MoE)


@functools.cache
def _experts(e, k, n, seed=1, scale=0.05):
    w = np.random.default_rng(seed).standard_normal((e, k, n), np.float32) * scale
    return fp4.quantize(jnp.asarray(w), "nvfp4", axis=1)


@pytest.mark.parametrize(
    ("sizes", "t", "k", "cfg"),
    [
        # empty experts, a group spanning several blocks, rows past the sum of the sizes
        ((5, 0, 19, 1, 0, 4), 31, 256, fmm.MgpuMatmulConfig(block_k=128, stages=2, block_m=8)),
        # leading empty experts, 64-element steps, 16-row blocks
        ((0, 0, 3, 0, 0, 0), 3, 256, fmm.MgpuMatmulConfig(block_k=64, stages=3, block_m=16)),
        ((2, 7, 0, 9, 1, 3), 22, 256, None),  # the default: one 256-element step
        # two warpgroups: 128 columns per program sharing each activation tile; an odd number
        # of K steps (their refills after both consumed a buffer: the wg2 tiles=2 case below)
        ((4, 9), 13, 192, fmm.MgpuMatmulConfig(block_k=64, stages=3, warpgroups=2)),
        # groups of tiles one after another on one pipeline: refills across the groups, an odd
        # step count per group, two warpgroups, the unrouted rows of every tile zeroed
        ((4, 9), 13, 192, fmm.MgpuMatmulConfig(block_k=64, stages=2, tiles=3)),
        # whole 8-row tiles: x not padded, the last windows reach past its rows; the rows past
        # the routed ones zeroed by the kernel's two warpgroups
        ((5, 2, 7), 16, 128, fmm.MgpuMatmulConfig(block_k=64, warpgroups=2, tiles=2)),
        # the plan in XLA ops, x padded for every window, unrouted rows zeroed after the kernel
        ((0, 7, 0, 9, 1, 3), 22, 128, fmm.MgpuMatmulConfig(block_k=64, tiles=2, prologue="xla")),
        # Run elsewhere (each a path of a case above): one warpgroup, whole tiles read past
        # x's end (the tiles=2 case: the same window copy in `issue`); the XLA plan with one
        # tile per program (the first case's pipeline; the last case's prologue); two
        # warpgroups refilling across 4 steps on 2 buffers (the wg2 tiles=2 case: 2 groups of
        # 2 steps); tiles=2 with 128-element steps (clamped to 2 buffers for 2 steps: the
        # last case's pipeline).
    ],
)
@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu, id="gpu")])
def test_grouped_matches_reference(sizes, t, k, cfg, interpret):
    # row counts that are not whole 8-row tiles, expert starts off the tiles
    e, n = len(sizes), max(128, 64 * cfg.warpgroups * cfg.tiles) if cfg else 128
    qt = _experts(e, k, n)
    x = random_x(t, k, seed=t + 1)
    gs = jnp.asarray(sizes, jnp.int32)
    y = fmm.fp4_grouped_matmul_mgpu(x, _packed(qt), gs, cfg, interpret=interpret)
    ref = _grouped_reference(x, qt, gs)
    total = sum(sizes)
    assert y.shape == (t, n) and np.all(np.asarray(y, np.float32)[total:] == 0)
    assert_close(y[:total], ref[:total])


def test_grouped_identity_rows_exact():
    # each expert's rows are unit vectors: the output rows are its weight's rows, decoded
    e, k, n = 3, 128, 64
    qt = _experts(e, k, n)
    picks = [0, 5, 127, 64, 3, 9, 100]  # expert 0: 3 rows, expert 1: none, expert 2: 4 rows
    gs = jnp.asarray([3, 0, 4], jnp.int32)
    x = jax.nn.one_hot(jnp.asarray(picks), k, dtype=jnp.bfloat16)
    y = fmm.fp4_grouped_matmul_mgpu(x, _packed(qt), gs, interpret=True)
    wd = np.asarray(fp4.dequantize(qt, jnp.bfloat16), np.float32)  # [E, K, N]
    expected = np.stack([wd[0, p] for p in picks[:3]] + [wd[2, p] for p in picks[3:]])
    np.testing.assert_array_equal(np.asarray(y, np.float32), expected)


def test_grouped_prepack_and_bad_inputs():
    qt = _experts(4, 128, 64)
    w = layouts.prepack_grouped(qt, mgpu=True)
    assert w.mgpu is not None and w.mgpu.shape == (4, 128, 64)
    assert layouts.prepack_grouped(qt, mgpu=False).mgpu is None
    with pytest.raises(ValueError, match="do not match"):
        fmm.fp4_grouped_matmul_mgpu(random_x(4, 128, 0), w.mgpu, jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match="expert weights"):
        fmm.fp4_grouped_matmul_mgpu(random_x(4, 128, 0), _packed(_weights(128, 64)), 0)
    with pytest.raises(ValueError, match="dense"):
        fmm.fp4_matmul_mgpu(random_x(4, 128, 0), w.mgpu)
    with pytest.raises(ValueError, match="block_m"):
        fmm.MgpuMatmulConfig(block_m=12)
    with pytest.raises(ValueError, match="split_in"):
        fmm.MgpuMatmulConfig(split_k=2, warpgroups=2, split_in="warpgroups")
    with pytest.raises(ValueError, match="tiles"):
        fmm.MgpuMatmulConfig(tiles=2, split_k=2)
    with pytest.raises(ValueError, match="grouped form"):
        fmm.fp4_matmul_mgpu(random_x(4, 128, 0), _packed(_weights(128, 128)),
                            fmm.MgpuMatmulConfig(block_k=64, tiles=2), interpret=True)  # fmt: skip
    with pytest.raises(ValueError, match="64 x warpgroups x tiles"):
        fmm.fp4_grouped_matmul_mgpu(
            random_x(4, 128, 0), w.mgpu, jnp.array([4, 0, 0, 0], jnp.int32),
            fmm.MgpuMatmulConfig(block_k=64, tiles=2), interpret=True,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("experts", "rows", "block_m"),
    # (128 experts on 8-row blocks: the power-of-two E of the 2048-row case, the blocks of
    # the 60-expert case)
    [(128, 2048, 64), (6, 31, 16), (60, 200, 8)],
)
def test_grouped_plan_kernel_equals_xla_plan(experts, rows, block_m):
    # random routings (empty experts, one expert with every row, fewer rows routed than
    # rows, E not a power of two): the kernel's fields on the B blocks equal XLA's, and the
    # blocks past B have no valid rows
    rng = np.random.default_rng(experts + rows)
    nblocks = fmm.num_row_blocks(rows, experts, block_m)
    routings = [
        np.bincount(rng.integers(0, experts, rows), minlength=experts),
        np.bincount(rng.integers(0, max(experts // 4, 1), rows // 2), minlength=experts),
        np.eye(experts, dtype=np.int64)[experts // 2] * rows,
        np.zeros(experts, np.int64),
    ]
    for sizes in routings:
        gs = jnp.asarray(sizes, jnp.int32)
        plan = _kernel_plan(gs, rows, block_m)
        want = _xla_plan(gs, rows, block_m)
        for got, ref in zip((plan.expert, plan.first_row, plan.valid), want, strict=True):
            assert got.shape[0] >= nblocks and got.dtype == jnp.int32
            np.testing.assert_array_equal(np.asarray(got)[:nblocks], np.asarray(ref))
        valid, first = np.asarray(plan.valid), np.asarray(plan.first_row)
        assert not np.any(valid[nblocks:]) and valid.sum() == sizes.sum()
        assert np.all(first[valid == 0] == sizes.sum())  # where the unrouted rows start


def test_pad_rows_for_windows():
    # padded: every block's window inside, zeros after x; reading past the end: x as it is
    # where its rows are whole 8-row tiles and at least one window
    x = random_x(24, 128, seed=3)
    assert fmm.pad_rows_for_windows(x, 8, past_end=True) is x
    assert fmm.pad_rows_for_windows(x, 16, past_end=True) is x  # a window of 24 rows
    for t, bm, past_end in ((24, 8, False), (16, 16, True), (21, 8, True)):
        xp = fmm.pad_rows_for_windows(random_x(t, 128, seed=3), bm, past_end=past_end)
        last_window = (t - 1) // 8 * 8  # the latest start of a block's window
        assert xp.shape[0] % 8 == 0 and xp.shape[0] >= last_window + bm + 8
        assert not np.any(np.asarray(xp[t:], np.float32))


def test_grouped_plan_lowers_for_cuda():
    modules = cuda_lowering.triton_modules(
        lambda g: fmm.grouped_plan(g, 128, 8, kernel=True), jnp.zeros((128,), jnp.int32)
    )
    assert len(modules) == 1 and "tt.func" in modules[0]


@pytest.mark.gpu
@pytest.mark.parametrize(("k", "n"), [(2048, 1536), (768, 2048)])
@pytest.mark.parametrize("tokens", [16, 64, 256])
def test_gpu_grouped_benchmark_shapes(k, n, tokens):
    e, top = 128, 8
    qt = _experts(e, k, n, seed=tokens, scale=0.02)
    rng = np.random.default_rng(tokens)
    picks = np.stack([rng.choice(e, top, replace=False) for _ in range(tokens)])
    gs = jnp.asarray(np.bincount(picks.ravel(), minlength=e), jnp.int32)
    x = random_x(tokens * top, k, seed=k)
    w = layouts.prepack_grouped(qt, mgpu=True)
    ref = _grouped_reference(x, qt, gs)
    assert_close(fmm.fp4_grouped_matmul_mgpu(x, w.mgpu, gs), ref)
    assert_close(gm.fp4_grouped_linear(x, w, gs), ref)  # the model's route on a GPU
    # the default: the plan in a Triton kernel, x read past its end, unrouted rows zeroed in
    # the kernel; and the plan in XLA ops
    lean = fmm.default_grouped_config(tokens * top, e, k)
    assert lean.prologue == "kernel"
    xla = dataclasses.replace(lean, prologue="xla")
    assert_close(fmm.fp4_grouped_matmul_mgpu(x, w.mgpu, gs, xla), ref)
    part = jnp.minimum(gs, 1)  # one row of each expert hit routed: the rest come out zero
    y = fmm.fp4_grouped_matmul_mgpu(x, w.mgpu, part, lean)
    routed = int(part.sum())
    assert not np.any(np.asarray(y[routed:], np.float32))
    assert_close(y[:routed], _grouped_reference(x, qt, part)[:routed])
    # two groups of tiles one after another per program
    assert_close(
        fmm.fp4_grouped_matmul_mgpu(x, w.mgpu, gs, dataclasses.replace(lean, tiles=2)), ref
    )


@pytest.mark.gpu
@pytest.mark.parametrize(("k", "n"), [(8192, 28672), (4096, 14336)])
def test_gpu_mxfp4_benchmark_shapes(k, n):
    w = jax.random.normal(jax.random.key(k), (k, n), jnp.float32) * 0.02
    qt = fp4.quantize(w, "mxfp4", axis=0)
    x = random_x(16, k, seed=3)
    assert_close(fmm.fp4_matmul_mgpu(x, _packed(qt)), _reference(x, qt))


@pytest.mark.parametrize(
    ("rows", "block_m"), [(1, 8), (128, 8), (512, 8), (2048, 32), (1 << 14, 64)]
)
def test_default_grouped_config_block_rows(rows, block_m):
    # 128 experts: narrow blocks up to 4 rows per expert, then mean + 3 sd in whole tiles
    assert fmm.default_grouped_config(rows, 128, 2048).block_m == block_m


def test_one_row_default_config_runs():
    # one row, short K: the two-warpgroup split default; equals the reference
    k, n = 512, 128
    cfg = fmm.default_config(1, k, n)
    assert cfg.warpgroups == 2 and cfg.split_k == 2
    qt = _weights(k, n)
    x = random_x(1, k, seed=22)
    y = fmm.fp4_matmul_mgpu(x, _packed(qt), cfg, interpret=True)
    assert_close(y, _reference(x, qt))
    assert fmm.default_config(1, 512, 64).warpgroups == 1  # N not whole 128-row tiles


def test_decode_default_splits_k_on_warpgroups():
    # 2-16 rows at 2048 <= K <= 4096: K split over the two warpgroups of one program, the
    # output scaled and rounded in the kernel (no fp32 partials summed in XLA)
    for m, k in ((16, 4096), (2, 4096), (16, 2048)):
        cfg = fmm.default_config(m, k, 28672)
        assert (cfg.split_in, cfg.split_k, cfg.block_k) == ("warpgroups", 2, 128), (m, k)
        assert fmm._smem_bytes(cfg, cfg.stages, 16) <= fmm._SMEM_LIMIT
    assert fmm.default_config(1, 4096, 14336).split_in == "grid"  # one row, short K
    assert fmm.default_config(16, 1024, 64).split_in == "grid"  # too few steps to split
    for m in (1, 16):  # long K: 256-element steps, split over the grid
        cfg = fmm.default_config(m, 8192, 28672)
        assert (cfg.split_in, cfg.split_k, cfg.block_k, cfg.stages) == ("grid", 2, 256, 3)
    # the kernel with K split on the warpgroups runs in test_matches_reference (128-element
    # steps, fewer steps than buffers; 64-element steps wrapping around the buffers)


@pytest.mark.parametrize(
    ("m", "n", "warpgroups", "ran"),
    # where `ran` names a config, the default must be it, and it runs elsewhere on these
    # shapes' K and N: one 256-element step (test_matches_reference's 16-row case); two
    # 128-element steps on 3 buffers (test_identity_rows_recover_dequantize_exactly's first
    # kernel); the same on two warpgroups (test_mxfp4_matches_reference[False]'s default for
    # its 256 identity rows)
    [
        (40, 128, 1, _TWO_OF_3),
        (40, 64, 1, _SHORT),
        (200, 64, 1, None),
        (200, 128, 2, fmm.default_config(256, 256, 128)),
    ],
)
def test_tall_default_configs_run(m, n, warpgroups, ran):
    # 17-256 rows: two warpgroups where N has whole 128-row tiles, except for up to 128 rows
    # where that leaves fewer programs than SMs; the default fits shared memory
    k = 256
    cfg = fmm.default_config(m, k, n)
    assert cfg.warpgroups == warpgroups
    assert fmm._smem_bytes(cfg, cfg.stages, fmm._round_up(m, 8)) <= fmm._SMEM_LIMIT
    if ran is not None:
        assert cfg == ran
        return
    qt = _weights(k, n)
    x = random_x(m, k, seed=24)
    assert_close(
        fmm.fp4_matmul_mgpu(x, _packed(qt), interpret=True),
        _reference(x, qt),
    )


@pytest.mark.parametrize("m", [17, 64, 65, 128, 129, 200, 256])
@pytest.mark.parametrize(("k", "n"), [(8192, 28672), (4096, 14336), (2048, 1536)])
def test_default_configs_fit_shared_memory(m, k, n):
    cfg = fmm.default_config(m, k, n)
    assert k % (cfg.block_k * cfg.split_k) == 0
    assert fmm._smem_bytes(cfg, cfg.stages, fmm._round_up(m, 8)) <= fmm._SMEM_LIMIT
    # N is whole 128-row tiles in every shape here; up to 128 rows, two warpgroups only where
    # they leave at least one program (128 columns) per SM
    assert cfg.warpgroups == (2 if m > 128 or n // 128 >= 132 else 1)
    if cfg.warpgroups == 1:
        assert (cfg.block_k, cfg.stages) == (128, 3)


def test_oversized_config_is_refused():
    # a config that does not fit in shared memory is refused with the size it would need
    with pytest.raises(ValueError, match="shared memory"):
        big = fmm.MgpuMatmulConfig(block_k=256, stages=4)
        fmm.fp4_matmul_mgpu(random_x(256, 1024, 0), _packed(_weights(1024, 64)), big)


@pytest.mark.parametrize(
    ("m", "cfg"),
    [
        (16, None),
        (13, None),  # the token-major copy of 13 of the 16 padded rows
        # (this config at 64 rows: the 200-row case's and the W4A4 case's, at 40 rows)
        (256, fmm.MgpuMatmulConfig(block_k=64, stages=4, warpgroups=2)),
        (200, fmm.MgpuMatmulConfig(block_k=128, stages=3, warpgroups=2)),
        (1, fmm.MgpuMatmulConfig(block_k=256, stages=3, split_k=2, decode="none")),
        (1, fmm.MgpuMatmulConfig(block_k=128, stages=3, split_k=2, split_in="warpgroups")),
        (16, fmm.MgpuMatmulConfig(block_k=64, stages=2, split_k=2, split_in="warpgroups")),
        ("w4a4", fmm.MgpuMatmulConfig(block_k=128, stages=3, warpgroups=2)),
        # the default: the plan in a Triton kernel, x read past its end
        ("grouped", None),
        ("grouped", fmm.MgpuMatmulConfig(block_k=128, stages=2, block_m=16, warpgroups=2)),
        # the plan in XLA ops
        ("grouped", fmm.MgpuMatmulConfig(block_k=128, stages=2, prologue="xla")),
        # two groups of tiles one after another per program, rows zeroed in the kernel
        ("grouped", fmm.MgpuMatmulConfig(block_k=128, stages=3, tiles=2)),
    ],
)
def test_lowers_for_cuda(m, cfg):
    # The GPU path (PTX decode, Mosaic GPU layout inference, the scoped buffers) lowered for
    # CUDA on this machine (cuda_lowering): what the interpreter does not run, short of the
    # final compile.
    k, n = 512, 256
    if m == "grouped":
        w = _packed(_experts(4, k, n))
        x, sizes = jnp.zeros((24, k), jnp.bfloat16), jnp.array([3, 0, 12, 9], jnp.int32)
        fn = lambda x, w, g: fmm.fp4_grouped_matmul_mgpu(x, w, g, cfg)  # noqa: E731
        args = (x, w, sizes)
    elif m == "w4a4":  # the per-token scale applied in the kernel
        w = _packed(_weights(k, n))
        fn = lambda x, w, r: fmm.fp4_matmul_mgpu(x, w, cfg, row_scale=r)  # noqa: E731
        args = (jnp.zeros((40, k), jnp.bfloat16), w, jnp.ones((40,), jnp.float32))
    else:
        w = _packed(_weights(k, n))
        fn = lambda x, w: fmm.fp4_matmul_mgpu(x, w, cfg)  # noqa: E731
        args = (jnp.zeros((m, k), jnp.bfloat16), w)
    assert "mosaic_gpu" in cuda_lowering.export_for_cuda(fn, *args)
