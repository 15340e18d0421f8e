"""Sampling: the truncated distributions, the recorded log-probs and the config checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.config import ConfigError
from trace_jax.rollout import SamplingConfig, sample

LOGITS = jnp.log(jnp.asarray([[0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]]))


def draws(cfg: SamplingConfig, n: int = 20000):
    keys = jax.random.split(jax.random.key(0), n)
    tokens, logp = jax.vmap(lambda k: sample(LOGITS, k, cfg))(keys)
    return np.asarray(tokens[:, 0]), np.asarray(logp[:, 0])


@pytest.mark.parametrize(
    "cfg, support",
    [
        (SamplingConfig(), 8),
        (SamplingConfig(top_k=3), 3),
        (SamplingConfig(top_p=0.7), 3),  # 0.4 + 0.25 < 0.7 <= 0.4 + 0.25 + 0.15
        (SamplingConfig(top_p=0.65), 2),  # 0.4 + 0.25 reaches 0.65
        (SamplingConfig(temperature=2.0, top_k=4, top_p=0.99), 4),
    ],
)
def test_samples_follow_the_truncated_tempered_distribution(cfg, support):
    probs = np.array(jax.nn.softmax(LOGITS[0] / cfg.temperature))
    probs[support:] = 0
    probs /= probs.sum()
    tokens, logp = draws(cfg)
    assert tokens.max() < support
    freq = np.bincount(tokens, minlength=8) / len(tokens)
    np.testing.assert_allclose(freq, probs, atol=0.015)
    # The recorded log-prob is that of the distribution the token was drawn from.
    np.testing.assert_allclose(logp, np.log(probs[tokens]), rtol=1e-5)


def test_greedy_takes_the_argmax_with_its_untempered_log_prob():
    logits = jax.random.normal(jax.random.key(1), (5, 32))
    tokens, logp = sample(logits, jax.random.key(2), SamplingConfig(temperature=0.0))
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(logits), -1))
    ref = jax.nn.log_softmax(logits)[jnp.arange(5), tokens]
    np.testing.assert_allclose(np.asarray(logp), np.asarray(ref), rtol=1e-6)


@pytest.mark.parametrize(
    "kw, key",
    [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0}, "top_p")],
)
def test_bad_sampling_settings_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        SamplingConfig(**kw)


def test_a_greedy_flag_per_row_takes_the_argmax_rows_and_leaves_the_others_sampled():
    logits = jax.random.normal(jax.random.key(0), (6, 40)) * 3
    cfg, key = SamplingConfig(temperature=0.7, top_p=0.9), jax.random.key(1)
    rows = jnp.asarray([True, False, True, False, False, True])
    tokens, logprobs = sample(logits, key, cfg, rows)
    want_g = sample(logits, key, SamplingConfig(temperature=0.0))
    want_s = sample(logits, key, cfg)
    for got, g, s in zip((tokens, logprobs), want_g, want_s, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.where(rows, g, s))
    assert not np.array_equal(np.asarray(want_g[0])[~rows], np.asarray(want_s[0])[~rows])
