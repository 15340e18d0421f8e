"""The training side: an explicit train state and jitted RL and supervised steps.

The model's graph is static; what changes is a pytree ``TrainState`` (parameters, optimizer
state, step). A step is a pure function ``(state, batch) -> (state, metrics)``:

    trainer = Trainer(model, QuantPolicy.trace(), LossConfig(), optax.adamw(1e-4))
    state = trainer.init()
    state, metrics = trainer.rl_step(state, batch)       # GRPO-family step on a rollout batch
    state, metrics = trainer.sft_step(state, tokens, mask)  # supervised warm start

The forward uses the training policy's quantization sites: ``bf16`` (none), ``qat`` (RTN fake
quant everywhere), ``trace`` (guided at the guided layers with the rollout's records, RTN
elsewhere). With routing replay the recorded experts are used. Parameters may be sharded
(``trace_jax.model.shard_model``); the steps follow the input shardings.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from trace_jax.model import QuantPolicy, Transformer
from trace_jax.rl import losses, metrics


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Attributes:
    params: the model's ``nnx.Param`` state (float32 master weights).
    opt_state: the optimizer's state.
    step: int32 scalar, optimizer updates so far.
    """

    params: Any
    opt_state: Any
    step: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RLBatch:
    """One rollout batch, B sequences of S slots.

    Attributes:
      tokens: [B, S] int32.
      filled: [B, S] bool, slots below each sequence's length.
      loss_mask: [B, S] bool, tokens the policy sampled (environment tokens excluded).
      rollout_logp: [B, S] float32, the log-probs the rollout sampled with.
      advantages: [B] float32.
      routes: [L_moe, B, S, k] int32 the rollout's experts (replayed when the trainer does
        routing replay; else compared with the trainer's own: ``mismatch/route_rate``), or None.
      guidance: site name -> the rollout's records [B, S, ...] (guided sites; in diagnostic mode
        also ``<site>.codes``).
      ref_logp: [B, S] reference-policy log-probs, or None.
    """

    tokens: jax.Array
    filled: jax.Array
    loss_mask: jax.Array
    rollout_logp: jax.Array
    advantages: jax.Array
    routes: jax.Array | None = None
    guidance: dict = dataclasses.field(default_factory=dict)
    ref_logp: jax.Array | None = None


def entropy(logits: jax.Array) -> jax.Array:
    """[B, S, V] -> [B, S] entropy of the next-token distribution, aligned like
    ``metrics.token_logprobs`` (slot s: the distribution that produced token s)."""
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    h = -jnp.sum(jnp.exp(lp) * lp, axis=-1)
    return jnp.pad(h, ((0, 0), (1, 0)))


def unguided(policy: QuantPolicy) -> QuantPolicy:
    """The policy with guided and record sites as plain RTN (for data without rollout records,
    e.g. supervised warm start or evaluation)."""
    plain = lambda mode: "rtn" if mode in ("guided", "record") else mode  # noqa: E731
    return dataclasses.replace(policy, expert_acts=plain(policy.expert_acts), kv=plain(policy.kv))


class Trainer:
    """Jitted RL and supervised steps of one model under one training policy.

    Args:
      model: the policy (its parameters become ``TrainState.params``; the module is not updated).
      policy: the training-side quantization policy.
      loss: the RL loss options.
      optimizer: an optax transformation.
      routing_replay: use the batch's recorded experts in the forward (Rollout Routing Replay).
    """

    def __init__(
        self,
        model: Transformer,
        policy: QuantPolicy,
        loss: losses.LossConfig,
        optimizer: optax.GradientTransformation,
        routing_replay: bool = True,
    ):
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self._params = params
        self.cfg = model.cfg
        self.policy = policy
        self.loss = loss
        self.optimizer = optimizer
        self.routing_replay = routing_replay

    def init(self, params=None) -> TrainState:
        # a copy: the steps donate the state, and the model passed in keeps its own arrays
        params = jax.tree.map(jnp.copy, self._params if params is None else params)
        return TrainState(params, self.optimizer.init(params), jnp.zeros((), jnp.int32))

    def model(self, params) -> Transformer:
        """A model with ``params`` (for the rollout engine or evaluation)."""
        return nnx.merge(self.graphdef, params, self.rest)

    # ------------------------------------------------------------------ forwards

    def _forward(self, params, batch: RLBatch, policy: QuantPolicy):
        model = self.model(params)
        guidance = {k: v for k, v in batch.guidance.items() if not k.endswith(".codes")}
        return model(
            batch.tokens,
            attention_mask=batch.filled,
            policy=policy,
            guidance=guidance,
            replay_routes=batch.routes if self.routing_replay else None,
        )

    @functools.partial(jax.jit, static_argnums=(0, 3))
    def logprobs(self, params, batch: RLBatch, policy: QuantPolicy | None = None) -> jax.Array:
        """[B, S] log-probs of the batch's tokens (e.g. under a reference policy's params)."""
        out = self._forward(params, batch, policy or self.policy)
        return metrics.token_logprobs(out.logits, batch.tokens)

    # ------------------------------------------------------------------ steps

    def _apply(self, state: TrainState, grads) -> tuple[TrainState, jax.Array]:
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state, state.step + 1), optax.tree.norm(grads)

    @functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
    def rl_step(self, state: TrainState, batch: RLBatch) -> tuple[TrainState, dict]:
        """One policy-gradient update on a rollout batch (one update per batch: the trainer's
        pre-update log-probs are the forward's own, so the PPO ratio starts at 1 and the
        importance weight is pi_train / pi_rollout).

        Returns the new state and metrics: the loss terms, ``mismatch/*`` of the trainer's
        log-probs against the rollout's (and per-site code metrics in diagnostic mode),
        ``train/entropy``, ``train/grad_norm``.
        """

        def loss_fn(params):
            out = self._forward(params, batch, self.policy)
            logp = metrics.token_logprobs(out.logits, batch.tokens)
            loss, aux = losses.policy_loss(
                logp,
                jax.lax.stop_gradient(logp),
                batch.rollout_logp,
                batch.advantages,
                batch.loss_mask,
                self.loss,
                ref_logp=batch.ref_logp,
            )
            return loss, (aux, out, logp)

        (loss, (aux, out, logp)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state, grad_norm = self._apply(state, grads)
        m = dict(aux)
        m.update(metrics.logp_mismatch(logp, batch.rollout_logp, batch.loss_mask))
        m.update(metrics.site_mismatch(out.records, batch.guidance, batch.filled))
        if batch.routes is not None and out.routes is not None:
            m["mismatch/route_rate"] = jnp.mean(
                metrics.route_mismatch(out.routes, batch.routes, batch.loss_mask)
            )
        h = entropy(out.logits)
        m["train/entropy"] = losses.aggregate(h, batch.loss_mask, "token")
        m["train/grad_norm"] = grad_norm
        m["train/loss"] = loss
        return state, m

    @functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
    def sft_step(self, state: TrainState, tokens: jax.Array, loss_mask: jax.Array):
        """One supervised (next-token cross-entropy) update.

        Args:
          tokens: [B, S] int32 (right-padded).
          loss_mask: [B, S] bool, the tokens to predict (slot s is predicted from s - 1).
        """
        filled = jnp.cumsum(loss_mask[:, ::-1], axis=1)[:, ::-1] > 0  # up to the last target
        batch = RLBatch(
            tokens=tokens,
            filled=filled,
            loss_mask=loss_mask,
            rollout_logp=jnp.zeros(tokens.shape, jnp.float32),
            advantages=jnp.zeros(tokens.shape[:1], jnp.float32),
        )

        policy = unguided(self.policy)

        def loss_fn(params):
            out = self._forward(params, batch, policy)
            logp = metrics.token_logprobs(out.logits, tokens)
            return -losses.aggregate(logp, loss_mask, "token")

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        state, grad_norm = self._apply(state, grads)
        return state, {"sft/loss": loss, "train/grad_norm": grad_norm}
