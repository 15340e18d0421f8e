"""Losses, advantages and importance corrections against values computed by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.config import ConfigError
from trace_jax.rl.losses import (
    LossConfig,
    aggregate,
    group_advantages,
    importance_weights,
    kl_k3,
    policy_loss,
)


def test_group_advantages_by_hand():
    r = jnp.asarray([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    # group 0: mean 0.5, std 0.5 -> +-1; group 1: constant -> 0
    np.testing.assert_allclose(
        group_advantages(r, "grpo", eps=0.0)[0], [1.0, -1.0, -1.0, 1.0], rtol=1e-6
    )
    np.testing.assert_array_equal(group_advantages(r, "grpo")[1], 0.0)
    np.testing.assert_allclose(group_advantages(r, "dr_grpo")[0], [0.5, -0.5, -0.5, 0.5])
    with pytest.raises(ValueError, match="advantage"):
        group_advantages(r, "ppo")


MASK = jnp.asarray([[True, True, False], [True, False, False]])


def test_aggregations_by_hand():
    x = jnp.asarray([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]])
    assert float(aggregate(x, MASK, "token")) == pytest.approx((1 + 3 + 5) / 3)
    assert float(aggregate(x, MASK, "sequence")) == pytest.approx((2 + 5) / 2)
    assert float(aggregate(x, MASK, "constant")) == pytest.approx(9 / 6)


def test_importance_corrections_by_hand():
    old = jnp.log(jnp.asarray([[0.5, 0.9, 0.3], [0.8, 0.1, 0.1]]))
    rollout = jnp.log(jnp.asarray([[0.05, 0.9, 0.3], [0.4, 0.1, 0.1]]))
    # token ratios: [[10, 1, -], [2, -, -]]
    w, kept = importance_weights(old, rollout, MASK, LossConfig(is_correction="tis", is_cap=5.0))
    np.testing.assert_allclose(np.asarray(w)[np.asarray(MASK)], [5.0, 1.0, 2.0], rtol=1e-5)
    w, kept = importance_weights(old, rollout, MASK, LossConfig(is_correction="mis", is_cap=5.0))
    np.testing.assert_allclose(np.asarray(w)[np.asarray(MASK)], [0.0, 1.0, 2.0], rtol=1e-5)
    assert np.asarray(kept).tolist() == [[False, True, False], [True, False, False]]
    # sequence level: product of the sequence's ratios: 10 and 2
    cfg = LossConfig(is_correction="tis", is_level="sequence", is_cap=5.0)
    w, _ = importance_weights(old, rollout, MASK, cfg)
    np.testing.assert_allclose(np.asarray(w)[np.asarray(MASK)], [5.0, 5.0, 2.0], rtol=1e-5)
    cfg = LossConfig(is_correction="mis", is_level="sequence", is_cap=5.0)
    w, _ = importance_weights(old, rollout, MASK, cfg)
    np.testing.assert_allclose(np.asarray(w)[np.asarray(MASK)], [0.0, 0.0, 2.0], rtol=1e-5)
    w, _ = importance_weights(old, rollout, MASK, LossConfig(is_correction="none"))
    np.testing.assert_array_equal(w, 1.0)


def test_clipped_surrogate_value_and_gradient_by_hand():
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, is_correction="none", aggregation="token")
    old = jnp.zeros((2, 3))
    rollout = jnp.zeros((2, 3))
    adv = jnp.asarray([1.0, -1.0])
    # ratios exp(logp): seq 0 -> 1.5 (clipped above at 1.28 for A > 0), 1.0; seq 1 -> 0.5
    logp = jnp.log(jnp.asarray([[1.5, 1.0, 1.0], [0.5, 1.0, 1.0]]))
    loss, m = policy_loss(logp, old, rollout, adv, MASK, cfg)
    # -A*clip: -1.28, -1.0; seq 1 (A=-1): max(0.5, 0.8) = 0.8
    assert float(loss) == pytest.approx((-1.28 - 1.0 + 0.8) / 3, rel=1e-6)
    assert float(m["loss/clip_frac"]) == pytest.approx(2 / 3)
    g = jax.grad(lambda lp: policy_loss(lp, old, rollout, adv, MASK, cfg)[0])(logp)
    # clipped tokens carry no gradient; the unclipped one: d(-A * exp(lp))/dlp / 3 = -1/3
    np.testing.assert_allclose(np.asarray(g), [[0, -1 / 3, 0], [0, 0, 0]], atol=1e-7)


def test_on_policy_gradient_is_advantage_weighted_score_times_is_weight():
    cfg = LossConfig(is_correction="tis", is_cap=5.0, aggregation="sequence")
    logp = jnp.log(jnp.asarray([[0.5, 0.25, 0.9], [0.2, 0.9, 0.9]]))
    rollout = logp - jnp.log(2.0)  # the rollout gave every token half the probability: w = 2
    adv = jnp.asarray([2.0, -1.0])
    g = jax.grad(lambda lp: policy_loss(lp, lp, rollout, adv, MASK, cfg)[0])(logp)
    # ratio 1 at old = logp: dL/dlogp = -w * A / (tokens of the sequence) / (sequences)
    np.testing.assert_allclose(
        np.asarray(g), [[-2 * 2 / 2 / 2, -2 * 2 / 2 / 2, 0], [2 * 1 / 1 / 2, 0, 0]], rtol=1e-6
    )


def test_kl_k3_and_its_use():
    logp = jnp.log(jnp.asarray([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    ref = jnp.log(jnp.asarray([[0.25, 0.5, 0.5], [1.0, 0.5, 0.5]]))
    np.testing.assert_allclose(kl_k3(logp, ref)[:, 0], [0.5 - np.log(0.5) - 1, 2 - np.log(2) - 1])
    cfg = LossConfig(kl_coef=0.1, is_correction="none")
    zeros = jnp.zeros(2)
    loss, m = policy_loss(logp, logp, logp, zeros, MASK, cfg, ref_logp=ref)
    expected = (0.5 - np.log(0.5) - 1 + 0 + 2 - np.log(2) - 1) / 3
    assert float(m["loss/kl_ref"]) == pytest.approx(expected, rel=1e-6)
    assert float(loss) == pytest.approx(0.1 * expected, rel=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, logp, logp, zeros, MASK, cfg)


def test_bad_loss_config_names_the_key():
    with pytest.raises(ConfigError, match="is_cap"):
        LossConfig(is_cap=0)
