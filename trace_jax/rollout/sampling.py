"""Token sampling with temperature, top-k and top-p, returning the log-prob of the sampled token
under the exact (tempered, truncated) distribution it was drawn from.

That distribution is the *behaviour policy* of RL: the trainer scores a sampled token under the
same transform of its own logits (``scored_logits``), so that importance weights and mismatch
metrics compare like with like (temperature and truncation are not a trainer-rollout mismatch).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from trace_jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Attributes:
    temperature: 0 means greedy (argmax); its log-prob is then that of the untempered softmax.
    top_k: keep the k most likely tokens (0: all).
    top_p: keep the smallest set of most likely tokens whose probability reaches p (1: all).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ConfigError(f"temperature: must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k: must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p: must be in (0, 1], got {self.top_p}")


def sampling_logits(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """The logits of the distribution ``sample`` draws from ([..., V] float32, -inf = excluded)."""
    logits = logits.astype(jnp.float32)
    if cfg.temperature == 0:
        return logits
    logits = logits / cfg.temperature
    neg = jnp.finfo(jnp.float32).min
    if cfg.top_k:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, neg)
    if cfg.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # keep while the mass before < p
        keep_sorted = mass_before < cfg.top_p
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
        logits = jnp.where(keep, logits, neg)
    return logits


def scored_logits(logits: jax.Array, tokens: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """The sampling distribution's logits for scoring ``tokens`` under it ([..., V] float32).

    ``sampling_logits`` of ``logits``, except that each scored token stays in the truncated set:
    a token the rollout drew from its top-k / top-p set is never given probability 0 because
    the scorer's own set, from slightly different logits, ended one token earlier.

    Args:
      logits: [..., V].
      tokens: [...] int32, the token scored at each position.
    """
    dist = sampling_logits(logits, cfg)
    if cfg.temperature == 0 or (cfg.top_k == 0 and cfg.top_p == 1):
        return dist
    tempered = logits.astype(jnp.float32) / cfg.temperature
    scored = jnp.arange(logits.shape[-1]) == tokens[..., None]
    return jnp.where(scored, tempered, dist)


def sample(logits: jax.Array, key: jax.Array, cfg: SamplingConfig, greedy=None):
    """Draw one token per row.

    Args:
      logits: [B, V] float32.
      key: a PRNG key, or one per row ([B] keys): row b's draw then depends on its key alone,
        not on the rows beside it (the rollout engine's per-row keys).
      greedy: None, or a traced bool (scalar or [B]): where True, the argmax and its log-prob
        under the untempered softmax, as ``temperature: 0`` (one program serves both).
    Returns:
      (tokens [B] int32, logprobs [B] float32 of those tokens under the sampled distribution)
    """
    dist = sampling_logits(logits, cfg)
    if cfg.temperature == 0:
        tokens = jnp.argmax(dist, axis=-1)
    elif _per_row(key):
        tokens = jax.vmap(lambda k, row: jax.random.categorical(k, row))(key, dist)
    else:
        tokens = jax.random.categorical(key, dist, axis=-1)
    if greedy is not None and cfg.temperature != 0:
        argmax = sampling_logits(logits, SamplingConfig(temperature=0.0))
        tokens = jnp.where(greedy, jnp.argmax(argmax, axis=-1), tokens)
        dist = jnp.where(jnp.reshape(greedy, (-1, 1)), argmax, dist)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(dist, axis=-1), tokens[:, None], -1)[:, 0]
    return tokens.astype(jnp.int32), logprobs


def _per_row(key: jax.Array) -> bool:
    """Whether ``key`` is a batch of keys: [B] typed keys or [B, 2] raw uint32 ones."""
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    return key.ndim == (1 if typed else 2)
