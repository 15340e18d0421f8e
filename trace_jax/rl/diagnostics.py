"""Train-rollout mismatch of one rollout batch: the trainer's forward over the rollout's
sequences, compared token by token and code by code (TRACE.md section 7)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.model import ModelOutput, QuantPolicy, Transformer
from trace_jax.model.policy import GuidedLayers
from trace_jax.rl import metrics
from trace_jax.rollout import RolloutState


def train_policy(guided: GuidedLayers, fmt: str = "nvfp4") -> QuantPolicy:
    """The trainer's policy in diagnostic mode (``record_codes``) for a choice of guided layers:
    "none" is vanilla QAT (RTN at every site), otherwise TRACE guided at those layers."""
    if guided == "none":
        return QuantPolicy.qat(fmt, record_codes=True)
    return QuantPolicy.trace(fmt, guided_layers=guided, record_codes=True)


def guidance_of(state: RolloutState) -> dict:
    """The rollout's guidance records, without the diagnostic ``<site>.codes`` entries."""
    return {k: v for k, v in state.guidance.items() if not k.endswith(".codes")}


@functools.partial(nnx.jit, static_argnames=("policy", "replay"))
def trainer_forward(
    model: Transformer, state: RolloutState, policy: QuantPolicy, *, replay: bool = True
) -> ModelOutput:
    """The training side's forward over a rollout batch (jitted): its tokens [B, S], the recorded
    guidance at the policy's guided sites and (``replay``) the recorded experts (routing
    replay)."""
    return model(
        state.tokens,
        attention_mask=state.filled,
        policy=policy,
        guidance=guidance_of(state),
        replay_routes=jnp.moveaxis(state.routes, 2, 0) if replay else None,
    )


def mismatch_report(
    out: ModelOutput, state: RolloutState, policy: QuantPolicy, num_layers: int
) -> dict[str, float]:
    """Token and code mismatch of a trainer forward ``out`` against the rollout ``state``.

    Log-prob metrics are over the policy-generated tokens; code metrics (both sides in the
    policy's diagnostic mode, ``record_codes=True``) over every filled slot. Besides the per-site
    metrics of ``metrics.site_mismatch`` it gives their means over the sites the trainer guides
    (``.../guided``) and over all sites (``.../all``).
    """
    filled = state.filled
    train_logp = metrics.token_logprobs(out.logits, state.tokens)
    report = {
        k: float(v)
        for k, v in metrics.logp_mismatch(train_logp, state.logprobs, state.generated).items()
    }
    sites = {
        k: float(v) for k, v in metrics.site_mismatch(out.records, state.guidance, filled).items()
    }
    report.update(sites)
    for stat in ("code_rate", "code_far", "d_act"):
        all_v, guided_v = [], []
        for key, value in sites.items():
            _, name, site, layer = key.split("/")
            if name != stat:
                continue
            all_v.append(value)
            kind = "kv" if site.startswith("kv.") else "act"
            if policy.site_mode(kind, int(layer), num_layers) == "guided":
                guided_v.append(value)
        if all_v:
            report[f"mismatch/{stat}/all"] = float(np.mean(all_v))
        if guided_v:
            report[f"mismatch/{stat}/guided"] = float(np.mean(guided_v))
    return report


def route_rate(model: Transformer, state: RolloutState, policy: QuantPolicy) -> jax.Array:
    """``mismatch/route_rate`` per MoE layer [L_moe] of the trainer's own routing (no replay)."""
    out = trainer_forward(model, state, policy, replay=False)
    filled = state.filled
    return metrics.route_mismatch(out.routes, jnp.moveaxis(state.routes, 2, 0), filled)
