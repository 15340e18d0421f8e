"""``bf16_grouped_matmul``: where JAX's Hopper kernels apply, and on the GPU, the trainer's
expert matmul and both its gradients through them against XLA's blocked form (the same float32
sums of BF16 products, in another order: equal to one BF16 rounding)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import bf16_grouped_matmul as bgm
from trace_jax.model import layers


def test_applies_only_to_bf16_on_a_hopper_gpu_at_whole_tiles():
    x = jnp.zeros((8, 256), jnp.bfloat16)
    w = jnp.zeros((4, 256, 128), jnp.bfloat16)
    hopper = jax.default_backend() == "gpu" and str(jax.devices()[0].compute_capability)[0] == "9"
    assert bgm.applies(x, w) == (hopper and jax.device_count() == 1)
    assert not bgm.applies(x.astype(jnp.float32), w.astype(jnp.float32))
    assert not bgm.applies(x[:, :192], w[:, :192])  # K not a multiple of 128


@pytest.mark.gpu
# a decode step's few rows; 8,192: the decode step of the medium recipe's 1,024 sequences;
# 65,536: one of its trainer minibatches (128 sequences of 64 slots, top-8); 524,288: its
# scoring pass over the whole batch of 1,024 sequences
@pytest.mark.parametrize("rows", [1, 8, 2000, 8192, 65536, 524288])
def test_kernels_equal_the_blocked_form_forward_and_backward(rows, monkeypatch):
    """A medium-like layer: 64 experts (the first and the last and maybe others without rows),
    K 1024, N 384."""
    rng = np.random.default_rng(rows)
    sizes = np.concatenate([[0], rng.multinomial(rows, rng.dirichlet(np.ones(62) * 0.5)), [0]])
    gs = jnp.asarray(sizes, jnp.int32)
    x, w, ct = (
        jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16)
        for s in ((rows, 1024), (64, 1024, 384), (rows, 384))
    )
    assert bgm.applies(x, w)

    def run():
        y, vjp = jax.vjp(lambda x, w: layers.grouped_matmul(x, w, gs), x, w)
        return (y, *vjp(ct))

    got = run()
    monkeypatch.setattr(bgm, "applies", lambda x, w: False)
    want = run()
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=2**-7, atol=1e-2)


def test_calls_of_one_shape_lower_the_kernel_once():
    """Lowered for CUDA (no GPU needed): four layers' calls of one shape hold the Mosaic GPU
    kernels' bodies once, as one layer does (JAX's kernels are plain functions: unjitted, each call
    site lowers its own copy, and an unrolled 48-layer decode step lowered it 48 times). The
    weight gradient's kernel reads the device's SM count as it lowers: not lowered here."""
    from pallas_kernels.cuda_lowering import export_for_cuda

    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((4,), jnp.int32)

    def text(layers):
        def model(x, w, gs):
            for _ in range(layers):
                x = bgm.ragged_dot(x, w, gs)
                x = bgm.ragged_dot_transposed(x, w, gs)
            return x

        return export_for_cuda(model, x, w, gs)

    one, four = text(1), text(4)
    assert one.count("mosaic_gpu") > 0
    assert four.count("mosaic_gpu") == one.count("mosaic_gpu")
    assert len(four) < 1.1 * len(one)
