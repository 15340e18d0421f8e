"""Block-scaled quantization: stored fields, error bounds, edge cases, options and errors."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trace_jax import fp4
from trace_jax.fp4.formats import E2M1_VALUES, E4M3_MAX, E4M3_MIN_NORMAL
from trace_jax.fp4.quantize import (
    decode_blocks,
    e4m3_to_float32,
    exact_div,
    integer_div,
    nearest_even_quotient,
    normalise,
    nvfp4_block_scale,
)


def np_decode(qt: fp4.QTensor) -> np.ndarray:
    """Independent float64 decode of a QTensor's stored fields, in the stored layout."""
    packed = np.asarray(qt.codes)
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1)
    values = E2M1_VALUES[codes].astype(np.float64)
    scales = np.asarray(qt.block_scales)
    if qt.fmt.name == "nvfp4":
        scales = scales.astype(np.float64)
    else:
        scales = np.where(scales == 255, np.nan, 2.0 ** (np.maximum(scales, 1).astype(int) - 127))
    b = qt.fmt.block_size
    s = np.repeat(scales, b, axis=-1)
    return values * s * np.asarray(qt.global_scale, np.float64)


def step_bound(z: np.ndarray) -> np.ndarray:
    """Half the spacing of the E2M1 bracket around |z| (the RTN error bound in code units)."""
    a = np.abs(z)
    return np.where(a <= 2, 0.25, np.where(a <= 4, 0.5, 1.0))


def check_error_bound(x: np.ndarray, qt: fp4.QTensor):
    """|x - x^| <= s * halfstep(x / s) inside the range, <= |x| - 6 s beyond it, plus the one
    float32 rounding of the dequantized value (below float32's smallest normal that is the flush
    to zero of XLA:CPU and GPU, so it may lose up to that much)."""
    x_st = np.moveaxis(np.asarray(x, np.float64), qt.axis, -1)
    scales = np.asarray(qt.block_scales)
    if qt.fmt.name == "nvfp4":
        scales = scales.astype(np.float64)
    else:
        scales = 2.0 ** (np.maximum(scales, 1).astype(int) - 127)
    s = np.repeat(scales, qt.fmt.block_size, axis=-1) * np.asarray(qt.global_scale, np.float64)
    z = x_st / s
    deq = np.moveaxis(np.asarray(fp4.dequantize(qt)), qt.axis, -1)
    err = np.abs(deq.astype(np.float64) - x_st)
    bound = np.where(np.abs(z) <= 6, s * step_bound(z), np.abs(x_st) - 6 * s)
    rounding = np.maximum(np.spacing(np.abs(deq)), np.finfo(np.float32).tiny)
    slack = bound * 1e-6 + rounding.astype(np.float64)
    assert np.all(err <= bound + slack), float(np.max(err - bound - slack))


DISTRIBUTIONS = {
    "normal": lambda k, s: jax.random.normal(k, s),
    "uniform": lambda k, s: jax.random.uniform(k, s, minval=-3, maxval=3),
    "student_t": lambda k, s: jax.random.t(k, 2.0, s),
    "outliers": lambda k, s: jax.random.normal(k, s).at[..., 3].multiply(1000.0),
    "tiny": lambda k, s: jax.random.normal(k, s) * 1e-20,
    "huge": lambda k, s: jax.random.normal(k, s) * 1e20,
}


@pytest.mark.parametrize("dist", sorted(DISTRIBUTIONS))
@pytest.mark.parametrize(
    ("fmt", "global_scale"), [("nvfp4", "tensor"), ("nvfp4", "row"), ("mxfp4", "tensor")]
)
def test_dequantize_matches_the_stored_fields_and_the_error_bound(dist, fmt, global_scale):
    x = DISTRIBUTIONS[dist](jax.random.key(hash(dist) % 1000), (8, 128)).astype(jnp.float32)
    qt = fp4.quantize(x, fmt, global_scale=global_scale)
    assert qt.codes.shape == (8, 64) and qt.codes.dtype == jnp.uint8
    assert qt.block_scales.shape == (8, 128 // qt.fmt.block_size)
    deq = np.asarray(fp4.dequantize(qt))
    np.testing.assert_array_equal(deq, np_decode(qt).astype(np.float32))
    check_error_bound(np.asarray(x), qt)


def test_e4m3_block_scales_are_the_ml_dtypes_cast():
    x = jax.random.normal(jax.random.key(1), (32, 256)) * jnp.exp(
        jax.random.normal(jax.random.key(2), (32, 1)) * 4
    )
    qt = fp4.quantize(x, "nvfp4")
    amax_b = np.abs(np.asarray(x).reshape(32, 16, 16)).max(-1)
    s_g = np.float32(np.abs(np.asarray(x)).max() / np.float32(6 * 448))
    want = np.clip((amax_b / np.float32(6)) / s_g, E4M3_MIN_NORMAL, E4M3_MAX).astype(
        ml_dtypes.float8_e4m3fn
    )
    np.testing.assert_array_equal(np.asarray(qt.block_scales).view(np.uint8), want.view(np.uint8))
    assert float(qt.global_scale) == s_g


def test_mxfp4_scale_is_the_ocp_rule():
    x = jax.random.normal(jax.random.key(3), (16, 64)) * 10
    qt = fp4.quantize(x, "mxfp4")
    amax_b = np.abs(np.asarray(x, np.float64)).reshape(16, 2, 32).max(-1)
    np.testing.assert_array_equal(
        np.asarray(qt.block_scales).astype(int) - 127, np.floor(np.log2(amax_b)) - 2
    )


def test_ties_on_exact_midpoints_round_to_even():
    # Scales of exactly 1: NVFP4 with tensor amax 6*448 (s_g = 1) and a block max of 6 (s_b = 1);
    # MXFP4 with a block max of 6 (2**(floor(log2 6) - 2) = 1).
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    row = np.array([6.0, *mids, *(-m for m in mids), 0.0], np.float32)
    want = np.array([6, 0, 1, 1, 2, 2, 4, 4, 0, -1, -1, -2, -2, -4, -4, 0], np.float32)
    nv = np.stack([row, np.r_[np.float32(6 * 448), np.zeros(15, np.float32)]])
    got = np.asarray(fp4.dequantize(fp4.quantize(jnp.asarray(nv), "nvfp4")))[0]
    np.testing.assert_array_equal(got, want)
    mx = np.concatenate([row, row])[None]
    got = np.asarray(fp4.dequantize(fp4.quantize(jnp.asarray(mx), "mxfp4")))[0]
    np.testing.assert_array_equal(got, np.concatenate([want, want]))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_all_zero_blocks_and_tensors(fmt):
    top = {"nvfp4": 6 * 448.0, "mxfp4": 6 * 512.0}[fmt]  # exactly representable in each format
    x = jnp.zeros((4, 64)).at[0, 0].set(top)
    qt = fp4.quantize(x, fmt)
    deq = np.asarray(fp4.dequantize(qt))
    assert np.all(deq[1:] == 0) and np.all(deq[0, 1:] == 0) and deq[0, 0] == top
    assert np.all(np.asarray(qt.codes)[1:] == 0)
    zero = fp4.quantize(jnp.zeros((2, 64)), fmt, global_scale="tensor")
    assert np.all(np.asarray(fp4.dequantize(zero)) == 0)
    assert np.all(np.isfinite(np.asarray(zero.global_scale)))


def test_underflowing_block_scale_clamps_to_the_smallest_normal_e4m3():
    # Block 1's amax is 1e-7 of the tensor's: its ideal scale ~2.7e-5 is below E4M3's range.
    x = jnp.concatenate([jnp.full((1, 16), 1.0), jnp.linspace(-1e-7, 1e-7, 16)[None]], axis=1)
    qt = fp4.quantize(x, "nvfp4")
    scales = np.asarray(qt.block_scales).astype(np.float32)[0]
    assert scales[1] == E4M3_MIN_NORMAL
    check_error_bound(np.asarray(x), qt)


def test_the_block_holding_the_tensor_max_saturates_e4m3_exactly():
    x = jax.random.normal(jax.random.key(4), (4, 64)).at[2, 5].set(-50.0)
    qt = fp4.quantize(x, "nvfp4")
    assert float(qt.block_scales.astype(jnp.float32)[2, 0]) == E4M3_MAX
    got = float(fp4.dequantize(qt)[2, 5])
    assert abs(got + 50.0) <= np.spacing(np.float32(50.0))


def test_negative_zero_round_trips_with_its_sign():
    x = jnp.zeros((1, 32)).at[0, 1].set(-0.0).at[0, 2].set(1.0)
    for fmt in ("nvfp4", "mxfp4"):
        qt = fp4.quantize(x, fmt)
        codes = np.asarray(fp4.unpacked_codes(qt)).reshape(-1)
        assert codes[1] == 8 and codes[0] == 0
        assert np.signbit(np.asarray(fp4.dequantize(qt))[0, 1])


def test_zeros_stay_zeros_where_the_reciprocal_overflows():
    # A row of amax 1e-36 has s_g at its floor (the smallest normal float32) and a zero block
    # the smallest E4M3 scale: (1 / s_g) / s_b = 2**132 overflows, and 0 * inf must not make a
    # NaN whose code min/max decide (the Triton activation kernel and XLA disagreed there).
    x = np.full((1, 48), 1e-36, np.float32)
    x[0, :16], x[0, 3], x[0, 20] = 0.0, -0.0, -1e-36
    x = jnp.asarray(x)
    qt = fp4.quantize(x, "nvfp4", axis=-1, global_scale="row")
    assert float(qt.global_scale.reshape(-1)[0]) == np.finfo(np.float32).tiny
    s_g = qt.global_scale.reshape(1, 1)
    # jitted, as quantize runs it (one program, not one per eager step)
    z = jax.jit(normalise, static_argnums=3)(
        x.reshape(1, 3, 16), e4m3_to_float32(qt.block_scales), s_g, qt.fmt
    )
    z = np.asarray(z)
    assert not np.isnan(z).any()
    assert np.array_equal(np.signbit(z[0, 0]), np.arange(16) == 3)
    codes = np.asarray(fp4.unpacked_codes(qt)).reshape(-1)
    want = np.where(np.arange(48) < 16, 0, 7)  # 1e-36 / (s_g * s_b) saturates to 6
    want[3], want[20] = 8, 15
    np.testing.assert_array_equal(codes, want)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_propagate_to_their_scale_group(bad):
    x = np.array(jax.random.normal(jax.random.key(5), (4, 64)))
    x[1, 40] = bad
    # NVFP4, per-tensor: the whole tensor shares the NaN global scale.
    assert np.all(np.isnan(np.asarray(fp4.dequantize(fp4.quantize(x, "nvfp4")))))
    # NVFP4, per-row: only row 1.
    deq = np.asarray(fp4.dequantize(fp4.quantize(x, "nvfp4", global_scale="row")))
    assert np.all(np.isnan(deq[1])) and np.all(np.isfinite(np.delete(deq, 1, 0)))
    # MXFP4: only the block of 32 holding it.
    deq = np.asarray(fp4.dequantize(fp4.quantize(x, "mxfp4")))
    assert np.all(np.isnan(deq[1, 32:])) and np.isfinite(deq).sum() == deq.size - 32


def test_per_row_global_scale_makes_a_row_independent_of_its_batch():
    x = jax.random.normal(jax.random.key(6), (6, 3, 64)) * jnp.arange(1, 7)[:, None, None]
    qt = fp4.quantize(x, "nvfp4", global_scale="row")
    assert qt.global_scale.shape == (6, 3, 1)
    alone = fp4.quantize(x[4, 1][None], "nvfp4", global_scale="row")
    np.testing.assert_array_equal(np.asarray(qt.codes[4, 1]), np.asarray(alone.codes[0]))
    np.testing.assert_array_equal(
        np.asarray(qt.block_scales[4, 1]).view(np.uint8),
        np.asarray(alone.block_scales[0]).view(np.uint8),
    )


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantizing_along_axis_0_equals_quantizing_the_transpose(fmt):
    w = jax.random.normal(jax.random.key(7), (64, 48))
    a = fp4.quantize(w, fmt, axis=0)
    b = fp4.quantize(w.T, fmt, axis=-1)
    assert a.shape == (64, 48) and a.axis == 0 and a.codes.shape == (48, 32)
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
    np.testing.assert_array_equal(np.asarray(fp4.dequantize(a)), np.asarray(fp4.dequantize(b)).T)


def test_2d_blocks_share_one_scale_per_16x16_tile():
    w = jax.random.normal(jax.random.key(8), (32, 64)) * jnp.exp(
        jax.random.normal(jax.random.key(9), (32, 1))
    )
    qt = fp4.quantize(w, "nvfp4", block_2d=True)
    scales = np.asarray(qt.block_scales).astype(np.float32)
    tiles = scales.reshape(2, 16, 4)
    assert np.all(tiles == tiles[:, :1, :])
    tile_amax = np.abs(np.asarray(w)).reshape(2, 16, 4, 16).max(axis=(1, 3))
    s_g = float(qt.global_scale)
    want = np.clip(tile_amax / 6 / s_g, E4M3_MIN_NORMAL, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(tiles[:, 0, :], want.astype(np.float32))
    check_error_bound(np.asarray(w), qt)


def test_four_over_six_never_loses_to_either_candidate_and_helps_on_average():
    x = jax.random.normal(jax.random.key(10), (64, 256))
    err = {}
    for rule in ("max6", "four_over_six"):
        deq = fp4.dequantize(fp4.quantize(x, "nvfp4", scale_rule=rule))
        err[rule] = np.square(np.asarray(deq - x)).reshape(64, 16, 16).sum(-1)
    qt46 = fp4.quantize(x, "nvfp4", scale_rule="four_over_six")
    assert float(qt46.global_scale) == pytest.approx(float(jnp.abs(x).max()) / (6 * 256), rel=1e-6)
    # Per block, 4/6 keeps the better of "max to 6" and "max to 4" under its global scale,
    # so it is never worse than max-6 with the same global scale (recomputed here).
    for target in (6.0, 4.0):
        cand = _candidate_error(x, qt46.global_scale, target=target)
        cand_err = np.square(np.asarray(cand)).sum(-1)
        assert np.all(err["four_over_six"] <= cand_err)
    assert err["four_over_six"].sum() < err["max6"].sum()


@functools.partial(jax.jit, static_argnames="target")  # a constant, as quantize's own 4.0
def _candidate_error(x, s_g, target):
    """Error [64, 16, 16] of mapping each block max of ``x`` [64, 256] to ``target``
    under the global scale ``s_g`` (one program, not one per eager step)."""
    amax_b = jnp.abs(x).reshape(64, 16, 16).max(-1)
    blocks = x.reshape(64, 16, 16)
    s_b = nvfp4_block_scale(amax_b, s_g, target).astype(jnp.float32)
    z = jnp.clip(normalise(blocks, s_b, s_g, fp4.NVFP4), -6, 6)
    cand = decode_blocks(fp4.round_to_e2m1(z), s_b, s_g)  # the dequantization's arithmetic
    return cand - blocks


def test_stochastic_rounding_is_unbiased_through_quantize():
    x = jax.random.normal(jax.random.key(11), (2, 64))
    keys = jax.random.split(jax.random.key(12), 2000)
    deq = jax.vmap(
        lambda k: fp4.dequantize(fp4.quantize(x, "nvfp4", rounding="stochastic", key=k))
    )(keys)
    qt = fp4.quantize(x, "nvfp4")
    s = np.repeat(np.asarray(qt.block_scales).astype(np.float32), 16, -1) * float(qt.global_scale)
    # The scales do not depend on the rounding, so inside the range the error of the mean is a
    # few s / sqrt(n); beyond it (where the E4M3 scale rounded down) values saturate to 6 s.
    inside = np.abs(np.asarray(x)) <= 6 * s
    err = np.abs(np.asarray(deq.mean(0) - x))
    assert np.all(err[inside] <= (4 * 2 * s / np.sqrt(len(keys)))[inside] + 1e-7)
    saturated = np.abs(np.asarray(deq)[:, ~inside])
    np.testing.assert_allclose(
        saturated, np.broadcast_to((6 * s)[~inside], saturated.shape), rtol=1e-6
    )
    assert not np.all(np.asarray(deq[0]) == np.asarray(deq[1]))


def test_vmap_over_quantize_equals_a_loop():
    x = (
        jax.random.normal(jax.random.key(13), (3, 4, 32))
        * jnp.array([1.0, 100.0, 0.01])[:, None, None]
    )
    batched = jax.vmap(lambda t: fp4.dequantize(fp4.quantize(t, "nvfp4")))(x)
    for i in range(3):
        np.testing.assert_array_equal(
            np.asarray(batched[i]), np.asarray(fp4.dequantize(fp4.quantize(x[i], "nvfp4")))
        )


def test_qtensor_is_a_pytree_that_crosses_jit():
    qt = fp4.quantize(jax.random.normal(jax.random.key(14), (4, 32)), "mxfp4")
    leaves, treedef = jax.tree_util.tree_flatten(qt)
    assert len(leaves) == 3
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(fp4.dequantize)(again)), np.asarray(fp4.dequantize(qt))
    )
    assert qt.nbytes == 4 * 16 + 4 * 1 + 4


def test_bf16_inputs_and_outputs():
    x = jax.random.normal(jax.random.key(15), (4, 64)).astype(jnp.bfloat16)
    qt = fp4.quantize(x, "nvfp4")
    np.testing.assert_array_equal(
        np.asarray(fp4.dequantize(qt, jnp.bfloat16)).astype(np.float32),
        np.asarray(fp4.dequantize(qt)).astype(ml_dtypes.bfloat16).astype(np.float32),
    )
    check_error_bound(np.asarray(x.astype(jnp.float32)), qt)


@given(
    hnp.arrays(np.float32, (4, 32), elements=st.floats(-1e4, 1e4, width=32)),
    st.sampled_from(["nvfp4", "mxfp4"]),
)
# All at float32's smallest normal: the NVFP4 global scale clamps there, the block's exact value
# 6 * 2**-6 * 2**-126 is subnormal and dequantizes to 0.
@example(np.full((4, 32), np.finfo(np.float32).tiny), "nvfp4")
def test_error_bound_holds_for_arbitrary_inputs(x, fmt):
    check_error_bound(x, fp4.quantize(jnp.asarray(x), fmt))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(x=np.ones((3, 17)), fmt="nvfp4"), r"shape \(3, 17\).*17 elements.*block size 16"),
        (dict(x=np.ones((48, 3)), fmt="mxfp4", axis=0), r"shape \(48, 3\).*axis 0.*block size 32"),
        (dict(x=np.ones((2, 16)), fmt="fp5"), "unknown FP4 format"),
        (dict(x=np.ones((2, 32)), fmt="mxfp4", global_scale="row"), "NVFP4 only"),
        (dict(x=np.ones((2, 16)), fmt="nvfp4", rounding="stochastic"), "needs a PRNG key"),
        (dict(x=np.ones((8, 16)), fmt="nvfp4", block_2d=True), r"8 rows"),
        (dict(x=np.ones((2, 32)), fmt="mxfp4", scale_rule="four_over_six"), "NVFP4 only"),
        (dict(x=np.ones((2, 16), np.int32), fmt="nvfp4"), "floating-point"),
        (dict(x=np.ones((2, 16)), fmt="nvfp4", axis=2), "out of range"),
    ],
)
def test_bad_input_raises_a_clear_error(kwargs, match):
    x = jnp.asarray(kwargs.pop("x"))
    with pytest.raises((ValueError, TypeError), match=match):
        fp4.quantize(x, **kwargs)


def test_e4m3_scale_values_from_bits():
    # every float8_e4m3fn code (NaN, subnormals, signs) decodes as astype(float32) does
    f8 = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), jnp.float8_e4m3fn)
    got = np.asarray(jax.jit(e4m3_to_float32)(f8))
    want = np.asarray(f8.astype(jnp.float32))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def _flushed(x):
    """Subnormals to a zero of their sign (exact_div's rule on the way in and out)."""
    tiny = np.abs(x) < np.float32(2.0**-126)
    return np.where(tiny, np.copysign(np.float32(0), x), x).astype(np.float32)


def _random_divisions(n=1 << 16):
    rng = np.random.default_rng(11)
    scaled = rng.standard_normal((2, n)) * np.exp2(rng.integers(-40, 40, (2, n)))
    bits = rng.integers(0, 2**32, (2, n), dtype=np.uint64).astype(np.uint32).view(np.float32)
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -3.0, 6.0, 448.0, 2688.0, 2.0**-126,
         2.0**-126 * (1 - 2.0**-24), 1e-45, -3e-39, 3.4028235e38, 1.5, 2.0**-149 * 3],
        np.float32,
    )  # fmt: skip
    sa, sb = np.meshgrid(special, special)
    with np.errstate(over="ignore", invalid="ignore"):
        a = np.concatenate([scaled[0].astype(np.float32), bits[0], sa.ravel()])
        b = np.concatenate([scaled[1].astype(np.float32), bits[1], sb.ravel()])
    return a, b


def _assert_ieee_quotients(got, a, b):
    """``got`` is numpy's float32 ``a / b`` bit for bit (subnormals flushed), NaN where it is."""
    with np.errstate(all="ignore"):
        want = _flushed(_flushed(a) / _flushed(b))
    got = np.asarray(got)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("div", [exact_div, integer_div])
def test_exact_div_is_ieee_division_bit_for_bit(div, jit):
    # against numpy's IEEE float32 division (subnormals flushed in and out, as documented),
    # over scaled normals, arbitrary bit patterns (inf, NaN, subnormal) and special pairs; the
    # integer path (the GPU's) and what the CPU runs
    a, b = _random_divisions()
    fn = jax.jit(div) if jit else div
    _assert_ieee_quotients(fn(a, b), a, b)


@pytest.mark.parametrize("div", [exact_div, integer_div])
def test_exact_div_by_a_constant_is_not_a_reciprocal_multiply(div):
    # XLA rewrites x / c as x * (1 / c) (one more rounding); 1/6 is inexact
    x = jnp.asarray(np.random.default_rng(2).uniform(0, 448, 4096), jnp.float32)
    got = np.asarray(jax.jit(lambda x: div(x, 6.0))(x))
    np.testing.assert_array_equal(got, np.asarray(x) / np.float32(6))


def test_nearest_even_quotient_corrects_guesses_up_to_seven_away():
    # the correction that makes an approximate backend division exact (the GPU's is within
    # 2 ulp), checked against Python's exact integer rounding
    rng = np.random.default_rng(5)
    mb = rng.integers(2**23, 2**24, 4096, dtype=np.uint64)
    ma = rng.integers(2**23, 2**24, 4096, dtype=np.uint64)
    ma = np.where(ma < mb, ma * 2, ma)  # ma / mb in [1, 2)
    # exact ties: mb = 2**24 and an odd ma make ma * 2**23 / mb = (ma - 1) / 2 + 1/2, with an
    # even and an odd integer part in turn
    ma[:16], mb[:16] = 2**24 + 1 + 2 * np.arange(16), 2**24
    ma, mb = ma.astype(np.int64), mb.astype(np.int64)
    quo, rem = np.divmod(ma * 2**23, mb)
    up = (2 * rem > mb) | ((2 * rem == mb) & (quo % 2 == 1))
    want = (quo + up).astype(np.int64)
    quotient = jax.jit(nearest_even_quotient)  # one program for the 15 guesses, as quantize runs it
    for off in range(-7, 8):
        got = quotient(
            jnp.asarray(ma, jnp.uint32),
            jnp.asarray(mb, jnp.uint32),
            jnp.asarray(want + off, jnp.int32),
        )
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"guess off by {off}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("fmt", "mode"), [("nvfp4", "tensor"), ("nvfp4", "row"), ("mxfp4", "tensor")]
)
def test_gpu_quantize_matches_cpu(fmt, mode):
    # one jitted program on the GPU picks the same codes and scales as the CPU (XLA on the GPU
    # may drop a float32 -> float8 -> float32 rounding inside a fusion)
    x = jax.random.normal(jax.random.key(3), (64, 1024)) * 3
    fn = jax.jit(lambda x: fp4.quantize(x, fmt, axis=-1, global_scale=mode))
    gpu = fn(x)
    with jax.default_device(jax.devices("cpu")[0]):
        cpu = fn(jax.device_put(x, jax.devices("cpu")[0]))
    for a, b in ((gpu.codes, cpu.codes), (gpu.block_scales, cpu.block_scales)):
        np.testing.assert_array_equal(
            np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)),
            np.asarray(jax.lax.bitcast_convert_type(b, jnp.uint8)),
        )
    np.testing.assert_array_equal(np.asarray(gpu.global_scale), np.asarray(cpu.global_scale))


@pytest.mark.gpu
def test_gpu_exact_div_matches_the_cpu():
    # XLA's float32 division on the GPU is div.full.f32 (within 2 ulp); exact_div is IEEE's
    a, b = _random_divisions()
    gpu = jax.jit(exact_div)(jax.device_put(a, jax.devices("gpu")[0]), b)
    _assert_ieee_quotients(gpu, a, b)


@pytest.mark.gpu
def test_gpu_quantize_after_a_bf16_rounding_in_the_same_program_matches_cpu():
    # the site's input rounded to bf16 inside the same jitted program (as a layer's output
    # feeding its quantization site): the GPU must quantize the bf16 values, as a kernel reading
    # the materialised array does, not the float32 values before the rounding
    x = jax.random.normal(jax.random.key(5), (64, 1024)) * 3

    def fn(x):
        return fp4.quantize((x * 1.0001 + 0.3).astype(jnp.bfloat16), "nvfp4", axis=-1)

    gpu = jax.jit(fn)(x)
    materialised = jax.jit(lambda x: (x * 1.0001 + 0.3).astype(jnp.bfloat16))(x)
    want = jax.jit(lambda y: fp4.quantize(y, "nvfp4", axis=-1))(materialised)
    for a, b in ((gpu.codes, want.codes), (gpu.block_scales, want.block_scales)):
        np.testing.assert_array_equal(
            np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)),
            np.asarray(jax.lax.bitcast_convert_type(b, jnp.uint8)),
        )


def test_bf16_input_is_rounded_explicitly():
    # to_blocks rounds a bf16 input to bf16 again with an explicit reduce_precision (which
    # XLA's excess precision does not drop, unlike a convert pair; the GPU test above checks
    # the effect), a no-op on values that are bf16 already.
    from trace_jax.fp4.quantize import to_blocks

    x = jax.random.normal(jax.random.key(6), (4, 64)) * 3
    lowered = jax.jit(lambda x: to_blocks(x.astype(jnp.bfloat16), -1, 16)).lower(x)
    assert "reduce_precision" in lowered.as_text()
    np.testing.assert_array_equal(
        np.asarray(to_blocks(x.astype(jnp.bfloat16), -1, 16)).reshape(4, 64),
        np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("scale_rule", ["max6", "four_over_six"])
def test_gpu_fake_quant_matches_cpu(scale_rule):
    # the fused quantize-dequantize (the trainer's forward) gives the CPU's values on the GPU
    x = jax.random.normal(jax.random.key(4), (32, 2048)) * 2
    fn = jax.jit(lambda x: fp4.fake_quant(x, "nvfp4", axis=-1, scale_rule=scale_rule))
    gpu = np.asarray(fn(x))
    with jax.default_device(jax.devices("cpu")[0]):
        cpu = np.asarray(fn(jax.device_put(x, jax.devices("cpu")[0])))
    np.testing.assert_array_equal(gpu, cpu)
