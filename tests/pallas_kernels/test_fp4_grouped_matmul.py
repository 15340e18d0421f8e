"""Grouped (MoE) FP4 matmul vs ``ragged_dot`` on dequantized weights: Pallas interpreter on the
CPU; the compiled kernel at the benchmark shapes on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import assert_close, random_x

from pallas_kernels import fp4_grouped_matmul as gm
from pallas_kernels import fp4_grouped_matmul_triton as gt
from pallas_kernels import layouts
from pallas_kernels.fp4_matmul_triton import Fp4MatmulConfig
from trace_jax import fp4

CFG = Fp4MatmulConfig(block_n=64, block_k=128, block_m=16)


# the reference as one program per shape (eager, each of its ops compiled on its own)
_reference = jax.jit(gm.fp4_grouped_matmul_reference)


def _case(sizes, k, n, fmt, seed, extra_rows=0):
    """Rows and expert weights drawn in numpy (no program compiled per shape)."""
    sizes = np.asarray(sizes, np.int32)
    t = int(sizes.sum()) + extra_rows
    rng = np.random.default_rng(seed)
    x = random_x(t, k, seed=seed)
    w = rng.standard_normal((len(sizes), k, n), np.float32) * 0.05
    return x, fp4.quantize(jnp.asarray(w), fmt, axis=1), jnp.asarray(sizes)


@pytest.mark.parametrize(
    ("fmt", "sizes"),
    # the format enters through the weight loads and their decode, not through the routing
    # (the row blocks, the padding of x): MXFP4 on the first routing
    [
        ("nvfp4", [5, 0, 19, 3]),  # an empty expert, and one spanning two row blocks
        ("mxfp4", [5, 0, 19, 3]),
        ("nvfp4", [0, 0, 37, 0, 1]),  # mostly empty; 37 rows = three row blocks, the last partial
        ("nvfp4", [2, 1]),  # fewer rows than one row block (x is padded)
    ],
)
def test_matches_ragged_dot(fmt, sizes):
    x, qt, gs = _case(sizes, 256, 128, fmt, seed=sum(sizes))
    y = gt.fp4_grouped_matmul_triton(x, qt, gs, config=CFG, interpret=True)
    assert_close(y, _reference(x, qt, gs))


def test_rows_past_the_groups_are_zero():
    x, qt, gs = _case([3, 4], 128, 64, "nvfp4", seed=3, extra_rows=5)
    y = np.asarray(gt.fp4_grouped_matmul_triton(x, qt, gs, config=CFG, interpret=True), np.float32)
    assert np.all(y[7:] == 0)
    assert_close(y[:7], _reference(x, qt, gs)[:7])


def test_each_expert_uses_its_own_weights():
    # identical rows routed to two experts must differ by exactly those experts' weights
    k, n = 128, 64
    x = jnp.asarray(np.tile(np.asarray(random_x(1, k, seed=0)), (2, 1)))
    w = np.random.default_rng(1).standard_normal((2, k, n), np.float32)
    qt = fp4.quantize(jnp.asarray(w), "nvfp4", axis=1)
    y = np.asarray(
        gt.fp4_grouped_matmul_triton(
            x, qt, jnp.array([1, 1], jnp.int32), config=CFG, interpret=True
        ),
        np.float32,
    )
    wd = np.asarray(fp4.dequantize(qt, jnp.float32))
    xf = np.asarray(x[0], np.float32)
    np.testing.assert_allclose(y[0], xf @ wd[0], rtol=2**-7, atol=1e-2)
    np.testing.assert_allclose(y[1], xf @ wd[1], rtol=2**-7, atol=1e-2)
    assert not np.allclose(y[0], y[1], rtol=0.1)


def test_rejects_wrong_weight_layout():
    qt = fp4.quantize(jnp.ones((2, 64, 32)), "nvfp4", axis=2)
    with pytest.raises(ValueError, match="axis 1"):
        layouts.prepack_grouped(qt)


@pytest.mark.gpu
@pytest.mark.parametrize(("k", "n"), [(2048, 1536), (768, 2048)])
@pytest.mark.parametrize("tokens", [16, 64, 256])
def test_gpu_benchmark_shapes(k, n, tokens):
    experts, top_k = 128, 8
    rng = np.random.default_rng(tokens)
    picks = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    gs = jnp.asarray(np.bincount(picks.ravel(), minlength=experts), jnp.int32)
    x = jax.random.normal(jax.random.key(tokens), (tokens * top_k, k)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(k), (experts, k, n), jnp.float32) * 0.02
    qt = layouts.prepack_grouped(fp4.quantize(w, "nvfp4", axis=1))
    assert_close(gt.fp4_grouped_matmul_triton(x, qt, gs), _reference(x, qt, gs))
