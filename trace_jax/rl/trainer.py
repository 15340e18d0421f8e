"""The training side: an explicit train state, and jitted scoring, gradient and update steps.

The model's graph is static; what changes is a pytree ``TrainState`` (parameters, optimizer
state, step). Each piece is a pure jitted function; ``rl_step`` only sequences them:

    trainer = Trainer(model, QuantPolicy.trace(), LossConfig(), optax.adamw(1e-4))
    state = trainer.init()
    state, metrics = trainer.rl_step(state, batch, key)   # GRPO-family updates on a rollout batch
    state, metrics = trainer.sft_step(state, tokens, mask)  # supervised warm start

Semantics of an RL step (the README's RL section states them for users):
- Log-probabilities are those of the *sampling distribution* (temperature, top-k / top-p) the
  rollout drew from, the behaviour policy; the trainer scores its own logits under the same
  transform (``trace_jax.rollout.sampling.scored_logits``).
- With ``ppo_epochs * minibatches == 1`` the step is one update whose proximal log-probs are the
  forward's own (ratio 1; the importance weight is pi_train / pi_rollout). Otherwise the
  proximal log-probs are scored once, before the first update, and each of ``ppo_epochs``
  passes updates on ``minibatches`` disjoint shuffles of the batch, so the PPO ratio moves
  away from 1 and the clip acts.
- The trainer-vs-rollout mismatch metrics compare the proximal log-probs with the rollout's.
- KL to a frozen reference (``loss.kl_coef > 0``): the reference parameters are scored under the
  trainer's policy, guidance and routes; the k3 term enters each update.

The forward uses the training policy's quantization sites: ``bf16`` (none), ``qat`` (RTN fake
quant everywhere), ``trace`` (guided at the guided layers with the rollout's records, RTN
elsewhere). With routing replay the recorded experts are used. Parameters may be sharded
(``trace_jax.model.shard_model``: experts over ``expert``, every weight over ``fsdp``); the
optimizer's moments are made like their parameters, and the steps follow the input shardings.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from trace_jax import fp4
from trace_jax.model import QuantPolicy, Transformer
from trace_jax.model.sharding import commit
from trace_jax.rl import losses, metrics
from trace_jax.rl.timing import PhaseTimer
from trace_jax.rollout.sampling import SamplingConfig


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
        routing replay; always compared with the trainer router's own: ``mismatch/route_rate``),
        or None.
      guidance: site name -> the rollout's ``Guidance`` [B, S, ...] (guided sites).
      rollout_codes: site name -> the rollout's full ``QTensor`` [R, S, ...] of the rows
        ``code_rows`` (for the code metrics; empty: none).
      code_rows: [R] int32, the batch rows ``rollout_codes`` belong to.
    """

    tokens: jax.Array
    filled: jax.Array
    loss_mask: jax.Array
    rollout_logp: jax.Array
    advantages: jax.Array
    routes: jax.Array | None = None
    guidance: dict = dataclasses.field(default_factory=dict)
    rollout_codes: dict = dataclasses.field(default_factory=dict)
    code_rows: jax.Array | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def take(self, rows: jax.Array) -> RLBatch:
        """The sequences ``rows`` ([B'] int32): a minibatch (without the code records)."""
        return RLBatch(
            tokens=self.tokens[rows],
            filled=self.filled[rows],
            loss_mask=self.loss_mask[rows],
            rollout_logp=self.rollout_logp[rows],
            advantages=self.advantages[rows],
            routes=None if self.routes is None else self.routes[:, rows],
            guidance={k: fp4.take_rows(g, rows) for k, g in self.guidance.items()},
        )

    def slots(self, width: int) -> RLBatch:
        """The batch's first ``width`` slots of every sequence (the rest padding, which the
        loss, the metrics and the attention mask leave out): fewer slots for the trainer."""
        cut = lambda a: a[:, :width]  # noqa: E731
        return dataclasses.replace(
            self,
            tokens=cut(self.tokens),
            filled=cut(self.filled),
            loss_mask=cut(self.loss_mask),
            rollout_logp=cut(self.rollout_logp),
            routes=None if self.routes is None else self.routes[:, :, :width],
            guidance={k: fp4.take_slots(g, width) for k, g in self.guidance.items()},
            rollout_codes={k: fp4.take_slots(c, width) for k, c in self.rollout_codes.items()},
        )


def unguided(policy: QuantPolicy) -> QuantPolicy:
    """The policy with guided and record sites as plain RTN (for data without rollout records,
    e.g. evaluation of a trainer's policy on its own)."""
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
      sampling: the rollout's sampling distribution, under which tokens are scored.
      ppo_epochs, minibatches: updates per rollout batch (see the module docstring).
      optimizer_key: a hashable description of ``optimizer`` (its settings): trainers built
        alike then share their compiled steps (a resumed run's new trainer those of the killed
        one). None: the optimizer object itself.
    """

    def __init__(
        self,
        model: Transformer,
        policy: QuantPolicy,
        loss: losses.LossConfig,
        optimizer: optax.GradientTransformation,
        routing_replay: bool = True,
        sampling: SamplingConfig | None = None,
        ppo_epochs: int = 1,
        minibatches: int = 1,
        optimizer_key=None,
    ):
        if ppo_epochs <= 0 or minibatches <= 0:
            raise ValueError(f"ppo_epochs {ppo_epochs} and minibatches {minibatches} must be > 0")
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self._params = params
        self.cfg = model.cfg
        self.policy = policy
        self.loss = loss
        self.optimizer = optimizer
        self.routing_replay = routing_replay
        self.sampling = sampling or SamplingConfig()
        self.ppo_epochs = ppo_epochs
        self.minibatches = minibatches
        self.guided_sites = policy.guided_sites(self.cfg.num_layers)
        # The jitted steps take the trainer as a static argument; what they read of it besides
        # their arguments is this key (non-parameter model state would be baked in: identity).
        self._trace_key = (
            self.graphdef,
            policy,
            loss,
            self.sampling,
            routing_replay,
            ppo_epochs,
            minibatches,
            self.cfg,
            id(optimizer) if optimizer_key is None else optimizer_key,
            id(self) if jax.tree.leaves(self.rest) else None,
        )
        self._trace_hash = hash(self._trace_key)

    def __hash__(self) -> int:
        return self._trace_hash

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other._trace_key == self._trace_key

    def init(self, params=None) -> TrainState:
        # a copy: the steps donate the state, and the model passed in keeps its own arrays
        params = jax.tree.map(jnp.copy, self._params if params is None else params)
        # committed as a restored checkpoint's state is: each step compiles once (sharding.commit)
        return commit(TrainState(params, self.optimizer.init(params), jnp.zeros((), jnp.int32)))

    def model(self, params) -> Transformer:
        """A model with ``params`` (for the rollout engine or evaluation)."""
        return nnx.merge(self.graphdef, params, self.rest)

    @property
    def updates_per_batch(self) -> int:
        return self.ppo_epochs * self.minibatches

    # ------------------------------------------------------------------ forwards

    def _forward(self, params, batch: RLBatch, record_codes: bool = False):
        policy = self.policy
        if record_codes:
            policy = dataclasses.replace(policy, record_codes=True)
        return self.model(params)(
            batch.tokens,
            attention_mask=batch.filled,
            policy=policy,
            guidance=batch.guidance,
            replay_routes=batch.routes if self.routing_replay else None,
        )

    def _diagnostics(self, out, batch: RLBatch, logp: jax.Array) -> dict[str, jax.Array]:
        """Trainer-vs-rollout metrics of a forward ``out`` over the whole ``batch`` whose
        log-probs are ``logp`` (the proximal ones)."""
        m = metrics.logp_mismatch(logp, batch.rollout_logp, batch.loss_mask)
        if batch.rollout_codes:
            rows = batch.code_rows
            train = {
                k: fp4.take_rows(v, rows) for k, v in out.records.items() if k.endswith(".codes")
            }
            m.update(
                metrics.site_mismatch(
                    train, batch.rollout_codes, batch.loss_mask[rows], self.guided_sites
                )
            )
        if batch.routes is not None and out.router_choice is not None:
            per_layer = metrics.route_mismatch(out.router_choice, batch.routes, batch.loss_mask)
            m["mismatch/route_rate"] = jnp.mean(per_layer)
            for i, layer in enumerate(self.cfg.moe_layers):
                m[f"mismatch/route_rate/{layer}"] = per_layer[i]
        h = metrics.token_entropy(out.logits, batch.tokens, self.sampling)
        m["train/entropy"] = losses.aggregate(h, batch.loss_mask, "token")
        return m

    @functools.partial(jax.jit, static_argnums=(0,))
    def logprobs(self, params, batch: RLBatch) -> jax.Array:
        """[B, S] log-probs of the batch's tokens under the sampling distribution, with no
        gradient (e.g. of a reference policy's parameters)."""
        out = self._forward(params, batch)
        return metrics.token_logprobs(out.logits, batch.tokens, self.sampling)

    @functools.partial(jax.jit, static_argnums=(0,))
    def score(self, params, batch: RLBatch) -> tuple[jax.Array, dict]:
        """The proximal log-probs [B, S] of a batch and the trainer-vs-rollout metrics."""
        out = self._forward(params, batch, record_codes=bool(batch.rollout_codes))
        logp = metrics.token_logprobs(out.logits, batch.tokens, self.sampling)
        return logp, self._diagnostics(out, batch, logp)

    # ------------------------------------------------------------------ steps

    @functools.partial(jax.jit, static_argnums=(0,))
    def gradient(self, params, batch: RLBatch, old_logp, ref_logp, rows):
        """Gradient of the policy loss on the minibatch ``rows`` ([B'] int32) with proximal
        log-probs ``old_logp`` [B, S] (both None: the whole batch, one update, the forward's own
        log-probs as the proximal ones, and the trainer-vs-rollout metrics from that forward).

        Returns (grads, metrics).
        """
        whole = rows is None
        mb = batch if whole else batch.take(rows)
        mb_ref = ref_logp if whole or ref_logp is None else ref_logp[rows]

        def loss_fn(params):
            out = self._forward(params, mb, record_codes=whole and bool(batch.rollout_codes))
            logp = metrics.token_logprobs(out.logits, mb.tokens, self.sampling)
            old = jax.lax.stop_gradient(logp) if whole else old_logp[rows]
            loss, aux = losses.policy_loss(
                logp, old, mb.rollout_logp, mb.advantages, mb.loss_mask, self.loss, mb_ref
            )
            return loss, (aux, out, logp)

        (loss, (aux, out, logp)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        m = {**aux, "train/loss": loss}
        if whole:
            m.update(self._diagnostics(out, batch, jax.lax.stop_gradient(logp)))
        return grads, m

    @functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
    def apply(self, state: TrainState, grads) -> tuple[TrainState, jax.Array]:
        """The optimizer's update: (new state, global gradient norm)."""
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state, state.step + 1), optax.tree.norm(grads)

    def rl_step(
        self, state: TrainState, batch: RLBatch, key: jax.Array | None = None, ref_params=None
    ) -> tuple[TrainState, dict[str, float]]:
        """``updates_per_batch`` policy-gradient updates on a rollout batch (the state is donated).

        Args:
          key: shuffles the minibatches (needed when there are several).
          ref_params: the frozen reference policy's parameters (needed when ``kl_coef > 0``).
        Returns:
          the new state and metrics (floats): the loss terms averaged over the updates
          (``loss/*``, ``train/loss``, ``train/grad_norm``), ``mismatch/*`` of the proximal
          log-probs against the rollout's (and code metrics for the batch's sampled rows),
          ``train/entropy``, and the seconds of each part: ``train/score_s`` (proximal and
          reference log-probs), ``train/forward_backward_s``, ``train/optimizer_s``.
        """
        timer = PhaseTimer()
        ref_logp = None
        if self.loss.kl_coef > 0:
            if ref_params is None:
                raise ValueError("loss.kl_coef > 0 needs the reference parameters (ref_params)")
            ref_logp = timer("train/score_s", self.logprobs, ref_params, batch)
        per_update, step_metrics = [], {}
        if self.updates_per_batch == 1:
            grads, m = timer(
                "train/forward_backward_s", self.gradient, state.params, batch, None, ref_logp, None
            )
            step_metrics = {k: v for k, v in m.items() if not _per_update(k)}
            state, norm = timer("train/optimizer_s", self.apply, state, grads)
            per_update.append(
                {**{k: v for k, v in m.items() if _per_update(k)}, "train/grad_norm": norm}
            )
        else:
            if key is None:
                raise ValueError("several minibatches per batch need a key to shuffle them")
            old_logp, step_metrics = timer("train/score_s", self.score, state.params, batch)
            size = batch.size // self.minibatches
            for epoch in range(self.ppo_epochs):
                order = jax.random.permutation(jax.random.fold_in(key, epoch), batch.size)
                for i in range(self.minibatches):
                    rows = order[i * size : (i + 1) * size]
                    grads, m = timer(
                        "train/forward_backward_s",
                        self.gradient,
                        state.params,
                        batch,
                        old_logp,
                        ref_logp,
                        rows,
                    )
                    state, norm = timer("train/optimizer_s", self.apply, state, grads)
                    per_update.append({**m, "train/grad_norm": norm})
        out = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
        for k in per_update[0]:
            out[k] = float(jnp.mean(jnp.stack([u[k] for u in per_update])))
        out.update(timer.totals)
        return state, out

    @functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
    def sft_step(self, state: TrainState, tokens: jax.Array, loss_mask: jax.Array):
        """One supervised (next-token cross-entropy) update under the trainer's policy with its
        guided and record sites as RTN.

        Args:
          tokens: [B, S] int32 (right-padded).
          loss_mask: [B, S] bool, the tokens to predict (slot s is predicted from s - 1).
        """
        filled = jnp.cumsum(loss_mask[:, ::-1], axis=1)[:, ::-1] > 0  # up to the last target
        policy = unguided(self.policy)

        def loss_fn(params):
            out = self.model(params)(tokens, attention_mask=filled, policy=policy)
            logp = metrics.token_logprobs(out.logits, tokens)
            return -losses.aggregate(logp, loss_mask, "token")

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        state = TrainState(params, opt_state, state.step + 1)
        return state, {"sft/loss": loss, "train/grad_norm": optax.tree.norm(grads)}


def _per_update(key: str) -> bool:
    """Metrics of one update (averaged over a step's updates), not of the batch."""
    return key.startswith("loss/") or key == "train/loss"
