"""``layers.expert_matmul``: the weight's type picks the backend (array / QTensor -> XLA
``ragged_dot``; prepacked ``Fp4Weight`` -> the grouped FP4 Pallas kernel, interpreted on the
CPU, or XLA where the kernel does not apply)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp4_grouped_matmul as gm
from pallas_kernels import fp4_grouped_matmul_triton as gt
from pallas_kernels import layouts
from trace_jax import fp4
from trace_jax.model import layers

SIZES = jnp.asarray([3, 0, 9, 1], jnp.int32)  # an empty expert; 13 rows


def _per_expert(w, fmt):
    """As the rollout engine packs expert weights: vmapped over experts, along K."""
    return jax.vmap(lambda we: fp4.quantize(we, fmt, axis=0))(w)


def _case(k, n, fmt, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (int(SIZES.sum()), k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (len(SIZES), k, n), jnp.float32) * 0.05
    # different global scales per expert
    w = w * jnp.asarray([1.0, 3.0, 0.3, 7.0])[:, None, None]
    return x, _per_expert(w, fmt)


def test_per_expert_qtensor_prepacks_to_the_same_weights():
    _, qt = _case(64, 32, "nvfp4")
    pw = layouts.prepack_grouped(qt)
    assert pw.shape == (4, 64, 32) and pw.qtensor.axis == 1
    np.testing.assert_array_equal(
        np.asarray(fp4.dequantize(pw.qtensor)), np.asarray(fp4.dequantize(qt))
    )


@pytest.mark.parametrize("fmt, k, n", [("nvfp4", 64, 32), ("nvfp4", 32, 64), ("mxfp4", 64, 32)])
def test_prepacked_weight_runs_the_kernel_and_matches_the_qtensor_path(fmt, k, n):
    x, qt = _case(k, n, fmt)
    pw = layouts.prepack_grouped(qt)
    y = layers.expert_matmul(x, pw, SIZES)
    assert y.dtype == jnp.bfloat16
    # the kernel (interpreted here), with the dispatcher's tiling
    cfg = gt.grouped_config(x.shape[0], 4, k, n, pw.fmt)
    kernel = gt.fp4_grouped_matmul_triton(x, pw, SIZES, config=cfg, interpret=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(kernel))
    # vs float32 ragged_dot on the exact weights: one bf16 rounding of the output
    ref = gm.fp4_grouped_matmul_reference(x, qt if fmt == "mxfp4" else pw, SIZES)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32), rtol=2**-8)
    xla = np.asarray(layers.expert_matmul(x, qt, SIZES), np.float32)
    if fmt == "mxfp4":
        # bf16 holds MXFP4 weights exactly: both paths sum the same exact products in float32
        np.testing.assert_allclose(np.asarray(y, np.float32), xla, rtol=2**-8)
    else:
        # the XLA path rounds code * s_b * s_g to bf16 first (<= 2**-9 relative per weight)
        scale = np.abs(xla).max()
        np.testing.assert_allclose(np.asarray(y, np.float32), xla, rtol=2**-7, atol=2e-3 * scale)


def test_kernel_does_not_apply_falls_back_to_the_xla_path_bit_for_bit():
    # float32 activations (W4A16 takes bf16), and an MXFP4 K of one scale block (too short)
    for x, qt in [
        (_case(64, 32, "nvfp4")[0].astype(jnp.float32), _case(64, 32, "nvfp4")[1]),
        _case(32, 64, "mxfp4"),
    ]:
        pw = layouts.prepack_grouped(qt)
        np.testing.assert_array_equal(
            np.asarray(layers.expert_matmul(x, pw, SIZES)),
            np.asarray(layers.expert_matmul(x, qt, SIZES)),
        )
    assert gt.grouped_config(13, 4, 32, 64, fp4.MXFP4) is None


def test_array_weights_are_plain_ragged_dot():
    x, _ = _case(64, 32, "nvfp4")
    w = jax.random.normal(jax.random.key(5), (4, 64, 32), jnp.float32).astype(jnp.bfloat16)
    ref = jax.lax.ragged_dot(x, w, SIZES, preferred_element_type=jnp.float32).astype(x.dtype)
    np.testing.assert_array_equal(np.asarray(layers.expert_matmul(x, w, SIZES)), np.asarray(ref))


@pytest.mark.parametrize(
    "sizes",
    # "some" and "one" share their shapes (40 rows, 4 experts): one compiled program for both
    [[13, 0, 26, 1], [0, 0, 40, 0], [17, 5, 0, 33, 1, 0, 2, 70]],
    ids=["some", "one", "eight"],
)
def test_grouped_matmul_gradients_by_blocks_equal_ragged_dots(sizes, monkeypatch):
    """The block-by-block backward (no E-times dense expansion) gives ragged_dot's gradients."""
    gs = jnp.asarray(sizes, jnp.int32)
    m, k, n = int(gs.sum()), 48, 24
    rng = np.random.default_rng(len(sizes))  # numpy draws: no program compiled per shape
    x, w, cot = (
        jnp.asarray(rng.standard_normal(shape, np.float32))
        for shape in ((m, k), (len(sizes), k, n), (m, n))
    )
    got, want = _gradients(x, w, gs, cot)
    # the dense reference, expert by expert
    bounds = np.cumsum([0, *sizes])
    dw = np.stack(
        [np.asarray(x)[a:b].T @ np.asarray(cot)[a:b] for a, b in itertools.pairwise(bounds)]
    )
    np.testing.assert_allclose(np.asarray(got[1]), dw, rtol=1e-4, atol=1e-4)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(
        np.asarray(layers.grouped_matmul(x, w, gs)), np.asarray(jax.lax.ragged_dot(x, w, gs))
    )
    # The forward by blocks (taken above _DENSE_FORWARD_BYTES): the dense reference, expert by
    # expert, and no ragged_dot (its [M, E * N] product) left in the program.
    y = np.concatenate(
        [
            np.asarray(x)[a:b] @ np.asarray(w)[e]
            for e, (a, b) in enumerate(itertools.pairwise(bounds))
        ]
    )
    np.testing.assert_allclose(np.asarray(_blocked(x, w, gs)), y, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(layers, "_DENSE_FORWARD_BYTES", 0)
    assert "ragged_dot" not in str(jax.make_jaxpr(layers.grouped_matmul)(x, w, gs))


_blocked = jax.jit(layers.blocked_matmul)


@jax.jit
def _gradients(x, w, gs, cot):
    """grouped_matmul's and ragged_dot's (dx, dw) of sum(f(x, w) * cot), the group sizes an
    argument (one program per shape, not per sizes)."""

    def loss(fn, x, w):
        return jnp.sum(fn(x, w, gs) * cot)

    def grads(fn):
        return jax.grad(lambda x, w: loss(fn, x, w), argnums=(0, 1))(x, w)

    return grads(layers.grouped_matmul), grads(jax.lax.ragged_dot)


def test_grouped_matmul_bf16_gradients_accumulate_in_float32():
    """BF16 operands: output, input and weight gradients are the float32-accumulated products
    rounded once to BF16 (against float64 sums of the same BF16 values; a BF16 accumulation
    over K = 256 terms of unit size errs by ~0.05, the tolerance here is 1e-3 plus one ulp)."""
    sizes = [40, 0, 88]
    gs = jnp.asarray(sizes, jnp.int32)
    m, k, n = sum(sizes), 256, 32
    rng = np.random.default_rng(7)
    x, w, cot = (
        jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
        for shape in ((m, k), (len(sizes), k, n), (m, n))
    )
    y, vjp = jax.vjp(lambda x, w: layers.grouped_matmul(x, w, gs), x, w)
    dx, dw = vjp(cot)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    xs, ws, cs = (np.asarray(a, np.float64) for a in (x, w, cot))
    bounds = list(itertools.pairwise(np.cumsum([0, *sizes])))
    expert = np.repeat(np.arange(len(sizes)), sizes)
    want_y = np.einsum("mk,mkn->mn", xs, ws[expert])
    want_dx = np.einsum("mn,mkn->mk", cs, ws[expert])
    want_dw = np.stack([xs[a:b].T @ cs[a:b] for a, b in bounds])
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-7, atol=1e-3)
