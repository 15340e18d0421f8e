"""Train-rollout mismatch of one rollout batch: the trainer's forward over the rollout's
sequences, compared token by token and code by code (TRACE.md section 7)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax import fp4
from trace_jax.model import ModelOutput, QuantPolicy, Transformer
from trace_jax.model.policy import GuidedLayers
from trace_jax.rl import metrics
from trace_jax.rollout import RolloutState, SamplingConfig


def train_policy(guided: GuidedLayers, fmt: str = "nvfp4") -> QuantPolicy:
    """The trainer's policy in diagnostic mode (``record_codes``) for a choice of guided layers:
    "none" is vanilla QAT (RTN at every site), otherwise TRACE guided at those layers."""
    if guided == "none":
        return QuantPolicy.qat(fmt, record_codes=True)
    return QuantPolicy.trace(fmt, guided_layers=guided, record_codes=True)


def guidance_of(state: RolloutState) -> dict:
    """The rollout's guidance records, without the diagnostic ``<site>.codes`` entries."""
    return {k: v for k, v in state.guidance.items() if not k.endswith(".codes")}


def codes_of(state: RolloutState) -> dict:
    """The rollout's full codes (site name -> ``QTensor`` [R, S, ...] of ``state.code_rows``)."""
    return {k.removesuffix(".codes"): v for k, v in state.guidance.items() if k.endswith(".codes")}


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
    out: ModelOutput,
    state: RolloutState,
    policy: QuantPolicy,
    num_layers: int,
    sampling: SamplingConfig | None = None,
) -> dict[str, float]:
    """Token, code and routing mismatch of a trainer forward ``out`` against the rollout
    ``state``, over the generated tokens.

    Log-probs are scored under ``sampling`` (the rollout's sampling distribution; None: the
    model's softmax, right for temperature 1). Code metrics (``metrics.site_mismatch``; the
    trainer's forward in diagnostic mode, ``record_codes=True``) cover the rows whose codes the
    rollout recorded. ``mismatch/route_rate`` compares the trainer router's own top-k with the
    rollout's experts.
    """
    report = _report(out, state, policy, num_layers, sampling)
    return {k: float(v) for k, v in jax.device_get(report).items()}


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _report(out, state, policy, num_layers, sampling) -> dict[str, jax.Array]:
    """``mismatch_report``'s values as float32 scalars (one program)."""
    gen = state.generated
    train_logp = metrics.token_logprobs(out.logits, state.tokens, sampling)
    report = metrics.logp_mismatch(train_logp, state.logprobs, gen)
    rows = state.code_rows
    train = {k: fp4.take_rows(v, rows) for k, v in out.records.items() if k.endswith(".codes")}
    report.update(
        metrics.site_mismatch(train, codes_of(state), gen[rows], policy.guided_sites(num_layers))
    )
    if out.router_choice is not None:
        per_layer = metrics.route_mismatch(out.router_choice, jnp.moveaxis(state.routes, 2, 0), gen)
        report["mismatch/route_rate"] = jnp.mean(per_layer)
    return report
