"""Train-rollout mismatch metrics (TRACE.md section 7), pure functions of arrays.

Token masks select the tokens that count (policy-generated tokens); all means are over them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax import fp4


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Log-prob of each token under the logits of the previous position.

    Args:
      logits: [B, S, V] float32 (position s predicts token s + 1).
      tokens: [B, S] int32.
    Returns:
      [B, S] float32; slot 0 (no previous position) is 0.
    """
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0)))


def _masked_mean(x, mask):
    mask = mask.astype(jnp.float32)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def logp_mismatch(train_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array) -> dict:
    """``mismatch/logp_abs`` (mean, p99, max) and ``mismatch/kl_k3`` over the masked tokens.

    kl_k3 is the sampled-token estimate mean(r - 1 - log r), r = pi_train / pi_rollout.
    """
    diff = train_logp - rollout_logp
    absd = jnp.abs(diff)
    log_r = jnp.where(mask, diff, 0.0)
    k3 = jnp.exp(log_r) - 1.0 - log_r
    masked = jnp.where(mask, absd, jnp.nan)
    return {
        "mismatch/logp_abs": _masked_mean(absd, mask),
        "mismatch/logp_abs_p99": jnp.nanpercentile(masked, 99),
        "mismatch/logp_abs_max": jnp.max(jnp.where(mask, absd, 0.0)),
        "mismatch/kl_k3": _masked_mean(k3, mask),
    }


def _token_mask(mask: jax.Array, values: jax.Array) -> jax.Array:
    """Broadcast a [B, S] token mask over a site's trailing element axes."""
    return jnp.broadcast_to(mask.reshape(*mask.shape, *([1] * (values.ndim - 2))), values.shape)


def code_mismatch(train: fp4.QTensor, rollout: fp4.QTensor, mask: jax.Array) -> dict:
    """``code_rate`` (fraction of elements whose E2M1 value differs; +0/-0 equal) and ``d_act``
    = ||Q_train - Q_rollout||_F / ||Q_rollout||_F over the masked tokens of a [B, S, ...] site."""
    q_t, q_r = fp4.code_values(train), fp4.code_values(rollout)
    m = _token_mask(mask, q_t)
    differs = (q_t != q_r) & m
    x_t = jnp.where(m, fp4.dequantize(train), 0.0)
    x_r = jnp.where(m, fp4.dequantize(rollout), 0.0)
    return {
        "code_rate": jnp.sum(differs) / jnp.maximum(jnp.sum(m), 1),
        "d_act": jnp.linalg.norm(x_t - x_r) / jnp.maximum(jnp.linalg.norm(x_r), 1e-30),
    }


def signed_code_index(values: jax.Array) -> jax.Array:
    """Position of E2M1 values on the signed codebook, -7..7 (+0 and -0 are 0)."""
    mags = jnp.asarray(fp4.E2M1_VALUES[:8])
    idx = jnp.searchsorted(mags, jnp.abs(values))
    return jnp.where(values < 0, -idx, idx)


def route_mismatch(train_routes: jax.Array, rollout_routes: jax.Array, mask: jax.Array):
    """``route_rate`` per MoE layer: fraction of tokens whose top-k expert *set* differs.

    Args:
      train_routes, rollout_routes: [L, B, S, k] int32.
      mask: [B, S] bool.
    Returns:
      [L] float32.
    """
    same = jnp.all(jnp.sort(train_routes, -1) == jnp.sort(rollout_routes, -1), axis=-1)
    m = mask[None].astype(jnp.float32)
    return jnp.sum((~same) * m, axis=(1, 2)) / jnp.maximum(jnp.sum(m, axis=(1, 2)), 1.0)


def _site_key(name: str) -> tuple[str, str]:
    """ "layers.3.kv.k" -> ("kv.k", "3")."""
    _, layer, site = name.split(".", 2)
    return site, layer


def site_mismatch(
    train_records: dict, rollout_records: dict, mask: jax.Array
) -> dict[str, jax.Array]:
    """Per-site code mismatch of a diagnostic-mode pair of forwards (TRACE.md section 7).

    Args:
      train_records, rollout_records: the ``<site>.codes`` QTensors [B, S, ...] that
        ``QuantPolicy(record_codes=True)`` records on each side (other keys are ignored).
      mask: [B, S] bool, the tokens that count.
    Returns:
      ``mismatch/code_rate/<site>/<layer>``, ``mismatch/d_act/<site>/<layer>`` and
      ``mismatch/code_far/<site>/<layer>``: the fraction of elements whose codes are two or more
      steps apart on the signed codebook (the only mismatches guided rounding leaves: the
      rollout's code was not a neighbour of the trainer's input).
    """
    out = {}
    for name, train in train_records.items():
        if not name.endswith(".codes") or name not in rollout_records:
            continue
        rollout = rollout_records[name]
        site, layer = _site_key(name.removesuffix(".codes"))
        stats = code_mismatch(train, rollout, mask)
        steps = jnp.abs(
            signed_code_index(fp4.code_values(train)) - signed_code_index(fp4.code_values(rollout))
        )
        m = _token_mask(mask, steps)
        out[f"mismatch/code_rate/{site}/{layer}"] = stats["code_rate"]
        out[f"mismatch/d_act/{site}/{layer}"] = stats["d_act"]
        out[f"mismatch/code_far/{site}/{layer}"] = jnp.sum((steps >= 2) & m) / jnp.maximum(
            jnp.sum(m), 1
        )
    return out
