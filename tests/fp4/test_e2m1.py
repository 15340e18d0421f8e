"""E2M1 element rounding, decoding and packing against ml_dtypes and first principles."""

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trace_jax.fp4 import e2m1
from trace_jax.fp4.formats import E2M1_MAGNITUDES, E2M1_VALUES

round_jit = jax.jit(e2m1.round_to_e2m1)


def ml_dtypes_codes(z: np.ndarray) -> np.ndarray:
    """The 4-bit code ml_dtypes' float4_e2m1fn cast produces (RNE, saturating)."""
    return np.asarray(z, np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF


def test_codebook_matches_ml_dtypes():
    all_codes = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(e2m1.decode_e2m1(jnp.arange(16))), all_codes)
    np.testing.assert_array_equal(E2M1_VALUES, all_codes)


def test_rounding_matches_ml_dtypes_on_a_dense_grid_with_every_midpoint():
    # Every multiple of 1/64 in [-6.5, 6.5] (this includes every midpoint and every code) and
    # the float32 neighbours of each midpoint.
    grid = np.arange(-6.5 * 64, 6.5 * 64 + 1, dtype=np.float32) / 64
    mids = np.array([(a + b) / 2 for a, b in itertools.pairwise(E2M1_MAGNITUDES)], np.float32)
    near = np.concatenate([np.nextafter(mids, 0), mids, np.nextafter(mids, 7)])
    z = np.concatenate([grid, near, -near, [0.0, -0.0]]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(round_jit(jnp.asarray(z))), ml_dtypes_codes(z))


@given(hnp.arrays(np.float32, (256,), elements=st.floats(-8, 8, width=32)))
def test_rounding_matches_ml_dtypes_on_random_values(z):
    np.testing.assert_array_equal(np.asarray(round_jit(jnp.asarray(z))), ml_dtypes_codes(z))


def test_ties_go_to_the_even_code():
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    expected = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0], np.float32)
    got = np.asarray(e2m1.decode_e2m1(round_jit(jnp.asarray(mids))))
    np.testing.assert_array_equal(got, expected)
    assert np.all(np.asarray(e2m1.mantissa_bit(round_jit(jnp.asarray(mids)))) == 0)


def test_negative_zero_and_small_negatives_keep_the_sign_bit():
    codes = np.asarray(round_jit(jnp.asarray([-0.0, -0.2, 0.0, 0.2], jnp.float32)))
    np.testing.assert_array_equal(codes, [8, 8, 0, 0])
    assert np.signbit(np.asarray(e2m1.decode_e2m1(jnp.asarray([8])))[0])


def test_saturation():
    codes = np.asarray(round_jit(jnp.asarray([6.0, 7.0, 1e30, -1e30], jnp.float32)))
    np.testing.assert_array_equal(codes, [7, 7, 7, 15])


def test_mantissa_bit_alternates_along_the_signed_codebook():
    order = np.argsort(E2M1_VALUES[[0, *range(1, 8), *range(9, 16)]], kind="stable")
    codes = np.array([0, *range(1, 8), *range(9, 16)])[order]  # -6 .. -0.5, 0, 0.5 .. 6
    bits = np.asarray(e2m1.mantissa_bit(jnp.asarray(codes, jnp.uint8)))
    assert np.all(bits[1:] != bits[:-1])
    assert bits[7] == 0  # zero has mantissa bit 0


@given(hnp.arrays(np.uint8, (6, 32), elements=st.integers(0, 15)))
def test_nibble_packing_round_trips_and_puts_element_2i_low(codes):
    packed = np.asarray(e2m1.pack_nibbles(jnp.asarray(codes)))
    np.testing.assert_array_equal(packed & 0xF, codes[:, 0::2])
    np.testing.assert_array_equal(packed >> 4, codes[:, 1::2])
    np.testing.assert_array_equal(np.asarray(e2m1.unpack_nibbles(jnp.asarray(packed))), codes)


@given(hnp.arrays(np.uint8, (3, 64), elements=st.integers(0, 1)))
def test_bit_packing_round_trips_least_significant_first(bits):
    packed = np.asarray(e2m1.pack_bits(jnp.asarray(bits)))
    expected = np.packbits(bits.reshape(3, 8, 8), axis=-1, bitorder="little")[..., 0]
    np.testing.assert_array_equal(packed, expected)
    np.testing.assert_array_equal(np.asarray(e2m1.unpack_bits(jnp.asarray(packed))), bits)


def test_stochastic_rounding_is_unbiased_and_stays_in_the_bracket():
    z = jnp.asarray(np.linspace(-6, 6, 97, dtype=np.float32))
    keys = jax.random.split(jax.random.key(0), 4000)
    # one program (eagerly, every vmapped step compiles on its own)
    vals = np.asarray(jax.jit(jax.vmap(lambda k: e2m1.decode_e2m1(e2m1.round_to_e2m1(z, k))))(keys))
    a = np.abs(np.asarray(z))
    lo = np.array([max(v for v in E2M1_MAGNITUDES if v <= x) for x in a])
    hi = np.array([min(v for v in E2M1_MAGNITUDES if v >= x) for x in a])
    mag = np.abs(vals)
    assert np.all((mag == lo) | (mag == hi))
    # Unbiased: the mean lands within 5 standard errors of z.
    p = np.where(hi > lo, (a - lo) / np.where(hi > lo, hi - lo, 1), 0)
    stderr = (hi - lo) * np.sqrt(p * (1 - p) / len(keys)) + 1e-7
    assert np.all(np.abs(vals.mean(0) - np.asarray(z)) <= 5 * stderr)


def _signed_index(values: np.ndarray) -> np.ndarray:
    """Position on the signed codebook -6 .. 6 as an integer -7 .. 7 (+0 and -0 are 0)."""
    mag_idx = np.searchsorted(np.array(E2M1_MAGNITUDES), np.abs(values))
    return np.where(values < 0, -mag_idx, mag_idx)


@given(
    hnp.arrays(np.float32, (128,), elements=st.floats(-6, 6, width=32)),
    hnp.arrays(np.float32, (128,), elements=st.floats(-6, 6, width=32)),
)
def test_guided_round_picks_the_bracketing_code_with_the_rollout_mantissa(z_rollout, z_train):
    q_r = np.asarray(e2m1.decode_e2m1(round_jit(jnp.asarray(z_rollout))))
    m_r = np.asarray(e2m1.mantissa_bit(round_jit(jnp.asarray(z_rollout))))
    q = np.asarray(e2m1.decode_e2m1(jax.jit(e2m1.guided_round)(jnp.asarray(z_train), m_r)))
    z_train = np.where(np.abs(z_train) < np.finfo(np.float32).tiny, 0, z_train)  # flushed
    lo = np.array([max(v for v in E2M1_VALUES if v <= z) for z in z_train])
    hi = np.array([min(v for v in E2M1_VALUES if v >= z) for z in z_train])
    # The result is always one of the two neighbours of z ...
    assert np.all((q == lo) | (q == hi))
    # ... it is the rollout's value whenever that value is one of them ...
    bracketed = (q_r == lo) | (q_r == hi)
    np.testing.assert_array_equal(q[bracketed], q_r[bracketed])
    # ... and otherwise it carries the rollout's mantissa bit unless z is itself a code.
    idx = _signed_index(q)
    off_code = lo != hi
    assert np.all((np.abs(idx) % 2 == m_r)[off_code])
    # Against round-to-nearest it is never more than one code step farther from the rollout.
    rtn = np.asarray(e2m1.decode_e2m1(round_jit(jnp.asarray(z_train))))
    d_guided = np.abs(idx - _signed_index(q_r))
    d_rtn = np.abs(_signed_index(rtn) - _signed_index(q_r))
    assert np.all(d_guided <= d_rtn + 1)
    assert np.all(d_guided[bracketed] == 0)


def test_guided_round_can_be_one_step_farther_than_rtn_beyond_the_bracket():
    # Rollout code 0.5 (mantissa 1); the trainer's z = 1.1 lies between 1.0 and 1.5. RTN gives
    # 1.0 (one step from 0.5); the guided choice is 1.5 (mantissa 1), two steps away. One bit of
    # guidance cannot tell which neighbour is nearer to a rollout code outside the bracket.
    q = e2m1.decode_e2m1(e2m1.guided_round(jnp.asarray([1.1]), jnp.asarray([1], jnp.uint8)))
    assert float(q[0]) == 1.5
