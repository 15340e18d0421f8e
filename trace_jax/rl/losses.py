"""GRPO-family policy losses, advantages and trainer-vs-rollout importance corrections.

Pure functions of arrays; every option is a field of ``LossConfig``. Shapes: B sequences of S
slots; ``mask`` [B, S] marks the loss-bearing tokens (sampled by the policy, not prompt or
environment tokens); log-probs are [B, S] float32 with slot s the log-prob of token s.

- Advantages: GRPO normalises each group's rewards by its mean and standard deviation;
  Dr.GRPO only subtracts the mean.
- Clipped surrogate with separate lower and upper clip ranges (DAPO's clip-higher).
- Aggregation: ``token`` (DAPO: mean over all tokens of the batch), ``sequence`` (GRPO: mean per
  sequence, then over sequences) or ``constant`` (Dr.GRPO: sum divided by B * S).
- Importance correction for the rollout having sampled from a different distribution (FP4
  kernels, stale weights): w = pi_old(y) / pi_rollout(y) with pi_old the trainer's distribution
  before the update. ``tis`` truncates w at ``is_cap``; ``mis`` masks the tokens (or sequences)
  whose w exceeds ``is_cap`` and keeps w elsewhere. ``is_level="sequence"`` uses the product of
  a sequence's token ratios instead.
- Optional KL to a reference policy with the k3 estimator.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from trace_jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Attributes:
    advantage: "grpo" (group mean and std) or "dr_grpo" (group mean only).
    aggregation: "token", "sequence" or "constant" (see the module docstring).
    clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
    is_correction: "none", "tis" (truncate) or "mis" (mask).
    is_level: "token" or "sequence".
    is_cap: the truncation / masking threshold of the importance weight.
    kl_coef: weight of the k3 KL to the reference policy (0: no reference forward).
    """

    advantage: Literal["grpo", "dr_grpo"] = "grpo"
    aggregation: Literal["token", "sequence", "constant"] = "token"
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_correction: Literal["none", "tis", "mis"] = "tis"
    is_level: Literal["token", "sequence"] = "token"
    is_cap: float = 5.0
    kl_coef: float = 0.0

    def __post_init__(self):
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ConfigError("clip_low/clip_high: need 0 <= clip_low < 1 and clip_high >= 0")
        if self.is_cap <= 0:
            raise ConfigError(f"is_cap: must be positive, got {self.is_cap}")
        if self.kl_coef < 0:
            raise ConfigError(f"kl_coef: must be >= 0, got {self.kl_coef}")


def group_advantages(rewards: jax.Array, kind: str = "grpo", eps: float = 1e-6) -> jax.Array:
    """rewards [P, G] (P prompts, G samples each) -> advantages [P, G] float32.

    grpo: (r - mean) / (std + eps) within each group; dr_grpo: r - mean. A group whose rewards
    are all equal gets zero advantages either way.
    """
    r = rewards.astype(jnp.float32)
    centred = r - jnp.mean(r, axis=1, keepdims=True)
    if kind == "dr_grpo":
        return centred
    if kind != "grpo":
        raise ValueError(f"advantage: {kind!r} is not one of grpo, dr_grpo")
    return centred / (jnp.std(r, axis=1, keepdims=True) + eps)


def importance_weights(
    old_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array, cfg: LossConfig
) -> tuple[jax.Array, jax.Array]:
    """The trainer-vs-rollout correction per token.

    Returns:
      (weights [B, S] float32, kept [B, S] bool): the factor each token's surrogate is
      multiplied by (0 where masked), and which tokens MIS kept (all tokens for tis/none).
    """
    log_w = jnp.where(mask, old_logp - rollout_logp, 0.0)
    if cfg.is_level == "sequence":
        log_w = jnp.broadcast_to(jnp.sum(log_w, axis=1, keepdims=True), mask.shape)
    w = jnp.exp(log_w)
    if cfg.is_correction == "none":
        return jnp.ones_like(w), mask
    if cfg.is_correction == "tis":
        return jnp.minimum(w, cfg.is_cap), mask
    kept = mask & (w <= cfg.is_cap)
    return jnp.where(kept, w, 0.0), kept


def aggregate(per_token: jax.Array, mask: jax.Array, how: str) -> jax.Array:
    """Reduce [B, S] per-token losses over the masked tokens (see the module docstring)."""
    m = mask.astype(jnp.float32)
    total = jnp.sum(per_token * m)
    if how == "token":
        return total / jnp.maximum(jnp.sum(m), 1.0)
    if how == "sequence":
        per_seq = jnp.sum(per_token * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
        has = jnp.any(mask, axis=1)
        return jnp.sum(jnp.where(has, per_seq, 0.0)) / jnp.maximum(jnp.sum(has), 1)
    if how == "constant":
        return total / (mask.shape[0] * mask.shape[1])
    raise ValueError(f"aggregation: {how!r} is not one of token, sequence, constant")


def kl_k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Per-token k3 estimate of KL(pi || pi_ref) at sampled tokens: exp(d) - d - 1 with
    d = ref_logp - logp."""
    d = ref_logp - logp
    return jnp.exp(d) - d - 1.0


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    rollout_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    ref_logp: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped, importance-corrected policy-gradient loss.

    Args:
      logp: [B, S] the trainer's log-probs (differentiated).
      old_logp: [B, S] the trainer's log-probs before this update (no gradient).
      rollout_logp: [B, S] the log-probs the rollout sampled with.
      advantages: [B] per sequence.
      mask: [B, S] bool, loss-bearing tokens.
      ref_logp: [B, S] reference policy log-probs (needed when ``cfg.kl_coef > 0``).
    Returns:
      (scalar loss, metrics)
    """
    old_logp = jax.lax.stop_gradient(old_logp)
    weights, kept = importance_weights(old_logp, rollout_logp, mask, cfg)
    ratio = jnp.exp(logp - old_logp)
    adv = advantages[:, None].astype(jnp.float32)
    clipped = jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    surrogate = jnp.maximum(-adv * ratio, -adv * clipped)
    per_token = weights * surrogate
    metrics = {}
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        kl = kl_k3(logp, jax.lax.stop_gradient(ref_logp))
        per_token = per_token + cfg.kl_coef * kl
        metrics["loss/kl_ref"] = aggregate(kl, mask, "token")
    loss = aggregate(per_token, mask, cfg.aggregation)
    is_clipped = (ratio < 1.0 - cfg.clip_low) | (ratio > 1.0 + cfg.clip_high)
    metrics.update(
        {
            "loss/policy": loss,
            "loss/clip_frac": aggregate(is_clipped.astype(jnp.float32), mask, "token"),
            "loss/is_weight": aggregate(weights, mask, "token"),
            "loss/is_masked_frac": 1.0 - aggregate(kept.astype(jnp.float32), mask, "token"),
        }
    )
    return loss, metrics
