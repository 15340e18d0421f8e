"""Trainer steps: a policy learns a bandit, the update follows the reported loss, warm start,
and a 2-device sharded RL step equals the single-device one."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.rl import metrics
from trace_jax.rl.losses import LossConfig, group_advantages, policy_loss
from trace_jax.rl.trainer import RLBatch, Trainer, unguided
from trace_jax.rollout import RolloutConfig, RolloutEngine

ROOT = Path(__file__).resolve().parents[2]
CFG = ModelConfig.preset("tiny").replace(num_layers=2)
TARGETS = jnp.arange(100, 132)  # reward 1 for sampling one of these 32 of 256 tokens


def batch_from(state, advantages, replay=True):
    filled = jnp.arange(state.tokens.shape[1])[None] < state.lengths[:, None]
    return RLBatch(
        tokens=state.tokens,
        filled=filled,
        loss_mask=state.generated,
        rollout_logp=state.logprobs,
        advantages=advantages,
        routes=jnp.moveaxis(state.routes, 2, 0) if replay else None,
        guidance={k: v for k, v in state.guidance.items() if not k.endswith(".codes")},
    )


def target_mass(trainer, params, prompt):
    logits = trainer.model(params)(jnp.asarray([prompt])).logits[0, -1]
    return float(jax.nn.softmax(logits)[TARGETS].sum())


@pytest.mark.slow
def test_grpo_with_fp4_rollout_and_trace_learns_a_bandit():
    model = Transformer(CFG, nnx.Rngs(0))
    engine = RolloutEngine(
        model, QuantPolicy.rollout(), RolloutConfig(max_len=4, max_new_tokens=1, kv_cache="nvfp4")
    )
    trainer = Trainer(model, QuantPolicy.trace(), LossConfig(), optax.adam(3e-3))
    state = trainer.init()
    prompt = [1, 2, 3]
    before = target_mass(trainer, state.params, prompt)
    for step in range(12):
        engine.update_params(trainer.model(state.params), version=step)
        rs = engine.generate([prompt] * 64, jax.random.key(step))
        sampled = rs.tokens[:, 3]
        rewards = jnp.isin(sampled, TARGETS).astype(jnp.float32)
        adv = group_advantages(rewards.reshape(1, -1)).reshape(-1)
        state, m = trainer.rl_step(state, batch_from(rs, adv))
        assert np.isfinite(m["train/loss"]) and m["mismatch/logp_abs"] < 1e-3
    after = target_mass(trainer, state.params, prompt)
    assert before < 0.2 and after > 2 * before, (before, after)
    assert int(state.step) == 12


@pytest.mark.slow
def test_rl_step_update_follows_the_loss_and_logs_code_metrics():
    model = Transformer(CFG, nnx.Rngs(1))
    engine = RolloutEngine(
        model,
        QuantPolicy.rollout(record_codes=True),
        RolloutConfig(max_len=12, max_new_tokens=8, kv_cache="nvfp4"),
    )
    rs = engine.generate([[5, 6, 7]] * 4, jax.random.key(0))
    policy = QuantPolicy.trace(record_codes=True)
    trainer = Trainer(model, policy, LossConfig(), optax.sgd(1e-2))
    adv = jnp.asarray([1.0, -1.0, 0.5, -0.5])
    batch = batch_from(rs, adv)
    batch = RLBatch(**{**batch.__dict__, "guidance": rs.guidance})  # with the diagnostic codes
    state = trainer.init()
    params0 = jax.tree.map(jnp.copy, state.params)
    new, m = trainer.rl_step(state, batch)
    # diagnostic mode: per-site code metrics; the guided layer (1) reproduces the rollout codes
    assert m["mismatch/code_rate/kv.k/1"] < 0.01 and "mismatch/d_act/experts.down.act/0" in m
    assert m["mismatch/route_rate"] == 0.0  # routing replay

    # SGD: new params = old - lr * grad of the loss the step reports
    @jax.jit
    def loss(params):
        out = trainer.model(params)(
            batch.tokens,
            attention_mask=batch.filled,
            policy=policy,
            guidance={k: v for k, v in rs.guidance.items() if not k.endswith(".codes")},
            replay_routes=batch.routes,
        )
        logp = metrics.token_logprobs(out.logits, batch.tokens)
        return policy_loss(
            logp,
            jax.lax.stop_gradient(logp),
            batch.rollout_logp,
            adv,
            batch.loss_mask,
            LossConfig(),
        )[0]

    value, grads = jax.value_and_grad(loss)(params0)
    assert float(m["train/loss"]) == pytest.approx(float(value), rel=1e-5, abs=1e-7)
    want = jax.tree.map(lambda p, g: p - 1e-2 * g, params0, grads)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_warm_start_lowers_the_supervised_loss_without_guidance():
    model = Transformer(CFG, nnx.Rngs(2))
    trainer = Trainer(model, QuantPolicy.trace(), LossConfig(), optax.adam(1e-2))
    assert unguided(QuantPolicy.trace()).expert_acts == "rtn"
    tokens = jnp.tile(jnp.asarray([[1, 40, 41, 42, 43, 0]]), (8, 1))
    mask = jnp.asarray([[False, False, True, True, True, False]] * 8)
    state = trainer.init()
    losses = []
    for _ in range(10):
        state, m = trainer.sft_step(state, tokens, mask)
        losses.append(float(m["sft/loss"]))
    assert losses[-1] < losses[0] / 2, losses


@pytest.mark.slow
def test_two_device_sharded_rl_step_equals_one_device_and_the_loop_runs_sharded():
    env = dict(
        os.environ,
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
    )
    script = Path(__file__).with_name("sharded_step_check.py")
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sharded RL step OK" in proc.stdout and "sharded RL loop OK" in proc.stdout
