"""Train-rollout mismatch metrics (TRACE.md section 7), pure functions of arrays.

Token masks select the tokens that count (policy-generated tokens); all means are over them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import fp4
from trace_jax.model.layers import take_last
from trace_jax.rollout.sampling import SamplingConfig, scored_logits


def _next_token_logits(logits: jax.Array, tokens: jax.Array, sampling: SamplingConfig | None):
    """[B, S, V] -> [B, S - 1, V] float32: position s's distribution over token s + 1, under the
    sampling transform when one is given."""
    if sampling is None:
        return logits[:, :-1].astype(jnp.float32)
    return scored_logits(logits[:, :-1], tokens[:, 1:], sampling)


def token_logprobs(
    logits: jax.Array, tokens: jax.Array, sampling: SamplingConfig | None = None
) -> jax.Array:
    """Log-prob of each token under the logits of the previous position.

    Args:
      logits: [B, S, V] float32 (position s predicts token s + 1).
      tokens: [B, S] int32.
      sampling: score under the rollout's sampling distribution (temperature, top-k/top-p; see
        ``trace_jax.rollout.sampling.scored_logits``); None: the model's own softmax.
    Returns:
      [B, S] float32; slot 0 (no previous position) is 0.
    """
    lp = jax.nn.log_softmax(_next_token_logits(logits, tokens, sampling), axis=-1)
    picked = take_last(lp, tokens[:, 1:, None])[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0)))


def token_entropy(
    logits: jax.Array, tokens: jax.Array, sampling: SamplingConfig | None = None
) -> jax.Array:
    """[B, S] entropy of the distribution that produced token s (slot 0: 0), aligned like
    ``token_logprobs`` and under the same ``sampling`` transform."""
    lp = jax.nn.log_softmax(_next_token_logits(logits, tokens, sampling), axis=-1)
    h = -jnp.sum(jnp.exp(lp) * lp, axis=-1)
    return jnp.pad(h, ((0, 0), (1, 0)))


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


def signed_code_index(values: jax.Array) -> jax.Array:
    """Position of E2M1 values on the signed codebook, -7..7 (+0 and -0 are 0), int32.

    The magnitudes 0, 0.5, 1, 1.5 | 2, 3 | 4, 6 are at 2a | a + 2 | a / 2 + 4: elementwise
    arithmetic (a search would be a loop in the program)."""
    a = jnp.abs(values)
    idx = jnp.where(a < 2, 2 * a, jnp.where(a < 4, a + 2, a / 2 + 4)).astype(jnp.int32)
    return jnp.where(values < 0, -idx, idx)


CODE_STATS = ("code_rate", "code_one_step", "code_far", "d_act")
"""The per-site code metrics (TRACE.md section 7; defined in ``code_counts``'s docstring)."""


def code_counts(train: fp4.QTensor, rollout: fp4.QTensor, mask: jax.Array) -> dict:
    """Sums over the masked tokens of a [B, S, ...] site from which its code metrics follow.

    Returns float32 scalars: ``elements``; ``mismatched`` (elements whose E2M1 values differ,
    +0 and -0 equal); ``one_step`` (mismatched ones exactly one step apart on the signed
    codebook); ``sq_diff`` = ||Q_train - Q_rollout||_F^2 and ``sq_rollout`` = ||Q_rollout||_F^2
    of the dequantized values. Then ``code_rate = mismatched / elements``, ``code_one_step =
    one_step / mismatched`` (the paper's statistic), ``code_far = 1 - code_one_step`` (two or more
    steps apart: the only mismatches guided rounding leaves) and ``d_act = sqrt(sq_diff /
    sq_rollout)``; the shares are undefined (NaN) where no code differs.
    """
    q_t, q_r = fp4.code_values(train), fp4.code_values(rollout)
    m = _token_mask(mask, q_t)
    steps = jnp.abs(signed_code_index(q_t) - signed_code_index(q_r))
    x_t = jnp.where(m, fp4.dequantize(train), 0.0)
    x_r = jnp.where(m, fp4.dequantize(rollout), 0.0)
    count = lambda b: jnp.sum(b & m, dtype=jnp.float32)  # noqa: E731
    return {
        "elements": jnp.sum(m, dtype=jnp.float32),
        "mismatched": count(steps > 0),
        "one_step": count(steps == 1),
        "sq_diff": jnp.sum(jnp.square(x_t - x_r)),
        "sq_rollout": jnp.sum(jnp.square(x_r)),
    }


def code_stats(counts: dict) -> dict[str, jax.Array]:
    """``CODE_STATS`` from (summed) ``code_counts``; all NaN where no element counted (no
    sampled token among the recorded rows), never a rate of 0 that nothing measured."""
    mismatched, elements = counts["mismatched"], counts["elements"]
    share = lambda n: jnp.where(mismatched > 0, n / jnp.maximum(mismatched, 1), jnp.nan)  # noqa: E731
    measured = lambda v: jnp.where(elements > 0, v, jnp.nan)  # noqa: E731
    return {
        "code_rate": measured(mismatched / jnp.maximum(elements, 1)),
        "code_one_step": share(counts["one_step"]),
        "code_far": share(mismatched - counts["one_step"]),
        "d_act": measured(jnp.sqrt(counts["sq_diff"] / jnp.maximum(counts["sq_rollout"], 1e-30))),
    }


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


def site_key(name: str) -> tuple[str, str]:
    """ "layers.3.kv.k" -> ("kv.k", "3")."""
    _, layer, site = name.split(".", 2)
    return site, layer


def site_mismatch(
    train_records: dict,
    rollout_codes: dict,
    mask: jax.Array,
    guided_sites: frozenset[str] = frozenset(),
) -> dict[str, jax.Array]:
    """Code metrics of the trainer's forward against the rollout's codes (TRACE.md section 7).

    Args:
      train_records: the trainer's records; its ``<site>.codes`` QTensors [B', S, ...] count.
      rollout_codes: site name -> the rollout's ``QTensor`` [B', S, ...] for the same rows.
      mask: [B', S] bool, the tokens that count (the generated ones).
      guided_sites: the site names the trainer guides.
    Returns:
      ``mismatch/<stat>/<site>/<layer>`` for each ``CODE_STATS`` stat and site both sides
      recorded, the same pooled over ``all``, ``guided`` and ``unguided`` sites
      (``mismatch/<stat>/<group>``, with ``mismatch/code_elements/<group>``, the elements
      counted), and ``mismatch/guided_code_agreement`` (the share of
      guided-site elements whose trainer code is the rollout's: 1 - ``code_rate/guided``).
    """
    # Sites of one kind and shape (a site of every layer) go through code_counts at once, mapped
    # over their layers: one copy of its operations in the program instead of one per layer.
    groups: dict[tuple, list[str]] = {}
    for name, rollout in rollout_codes.items():
        if name + ".codes" not in train_records:
            continue
        key = (site_key(name)[0], jax.tree.structure(rollout))
        groups.setdefault(key, []).append(name)
    stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)  # noqa: E731
    out, pooled = {}, {}
    for (site, _), names in groups.items():
        train = stack([train_records[n + ".codes"] for n in names])
        rollout = stack([rollout_codes[n] for n in names])
        counts = jax.vmap(code_counts, in_axes=(0, 0, None))(train, rollout, mask)
        for stat, values in code_stats(counts).items():
            for i, name in enumerate(names):
                out[f"mismatch/{stat}/{site}/{site_key(name)[1]}"] = values[i]
        guided = np.array([n in guided_sites for n in names])
        for group, layers in (("all", None), ("guided", guided), ("unguided", ~guided)):
            if layers is not None and not layers.any():
                continue
            acc = pooled.setdefault(group, dict.fromkeys(counts, 0.0))
            for k, v in counts.items():
                acc[k] = acc[k] + jnp.sum(v if layers is None else v[np.flatnonzero(layers)])
    for group, counts in pooled.items():
        for stat, value in code_stats(counts).items():
            out[f"mismatch/{stat}/{group}"] = value
        # how many elements the group's rates are of (their resolution)
        out[f"mismatch/code_elements/{group}"] = counts["elements"]
    if "guided" in pooled:
        out["mismatch/guided_code_agreement"] = 1.0 - out["mismatch/code_rate/guided"]
    return out
