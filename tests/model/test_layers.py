"""``layers.embed``: the table's rows as a gather, and a gradient that sums each token's
cotangents into its row (a one-hot matmul for small vocabularies, without a scatter; the
scatter-add beyond). ``layers.sort_by_expert``: the order and the group sizes, without a
scatter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.model import layers


@pytest.mark.parametrize("one_hot_vocab", [1024, 8])
def test_embedding_gradient_sums_each_tokens_cotangents_into_its_row(one_hot_vocab, monkeypatch):
    monkeypatch.setattr(layers, "ONE_HOT_VOCAB", one_hot_vocab)
    rng = np.random.default_rng(0)
    vocab, h = 256, 16
    table = jnp.asarray(rng.standard_normal((vocab, h)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 12, (3, 40)))  # every token repeated
    g = rng.standard_normal((3, 40, h)).astype(np.float32)
    np.testing.assert_array_equal(layers.embed(table, tokens), table[tokens])
    _, vjp = jax.vjp(lambda t: layers.embed(t, tokens), table)
    (got,) = vjp(jnp.asarray(g))
    want = np.zeros((vocab, h), np.float64)
    np.add.at(want, np.asarray(tokens).reshape(-1), g.reshape(-1, h).astype(np.float64))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-5)
    grad = jax.jit(jax.grad(lambda t: jnp.sum(layers.embed(t, tokens) * g)))
    hlo = grad.lower(table).as_text()
    assert ("scatter" in hlo) == (vocab > one_hot_vocab)


def test_sort_by_expert_groups_pairs_and_counts_them_without_a_scatter():
    rng = np.random.default_rng(1)
    experts = rng.integers(0, 64, (300, 8)).astype(np.int32)
    experts[:, 0] = 5  # one expert far above the rest; some get none
    order, sizes = jax.jit(layers.sort_by_expert, static_argnums=1)(jnp.asarray(experts), 64)
    flat = experts.reshape(-1)
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(flat, minlength=64))
    np.testing.assert_array_equal(np.asarray(order), np.argsort(flat, kind="stable"))
    hlo = jax.jit(layers.sort_by_expert, static_argnums=1).lower(jnp.asarray(experts), 64)
    assert "scatter" not in hlo.as_text()
