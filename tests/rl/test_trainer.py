"""Trainer steps: a policy learns a bandit, the update follows the reported loss, warm start
(the 2-device sharded RL step: ``sharded_step_check.py``, run by ``test_multiprocess.py``)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from shapes import MODEL_BF16

from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.model.sharding import commit
from trace_jax.rl import metrics
from trace_jax.rl.diagnostics import codes_of, guidance_of
from trace_jax.rl.losses import LossConfig, group_advantages, policy_loss
from trace_jax.rl.trainer import RLBatch, Trainer, unguided
from trace_jax.rollout import RolloutConfig, RolloutEngine, SamplingConfig

CFG = ModelConfig.preset("tiny").replace(num_layers=2)
TARGETS = jnp.arange(100, 132)  # reward for sampling one of these 32 of 256 tokens
# One rollout shape for the FP4 tests (their engine, score and gradient programs are shared):
# 8 prompts, 6 new tokens, full codes recorded for the code metrics.
ROLLOUT = RolloutConfig(max_len=12, max_new_tokens=6, kv_cache="nvfp4")
RECORDING = QuantPolicy.rollout(record_codes=True)
PROMPTS8 = [[5, 6, 7], [8, 9], [10], [11, 12, 13, 14]] * 2
ADV8 = jnp.asarray([1.0, -1.0, 0.5, -0.5, -1.0, 1.0, 0.25, -0.25])
# One loss for the FP4 update tests (their programs are shared), with the default TIS correction;
# the narrow clip acts only where several updates move the ratio away from 1.
KL = LossConfig(kl_coef=0.1, clip_low=0.05, clip_high=0.05)


def batch_from(state, advantages, replay=True):
    return RLBatch(
        tokens=state.tokens,
        filled=state.filled,
        loss_mask=state.generated,
        rollout_logp=state.logprobs,
        # committed like the rollout's arrays: one compiled program for every batch
        advantages=commit(jnp.asarray(advantages)),
        routes=jnp.moveaxis(state.routes, 2, 0) if replay else None,
        guidance=guidance_of(state),
        rollout_codes=codes_of(state),
        code_rows=state.code_rows,
    )


@functools.partial(jax.jit, static_argnums=0)  # one program (eagerly: one per op)
def target_mass(trainer, params, prompt):
    """The policy's probability of a token of TARGETS after ``prompt`` ([T] int32)."""
    logits = trainer.model(params)(prompt[None]).logits[0, -1]
    return jax.nn.softmax(logits)[TARGETS].sum()


@pytest.fixture(scope="module")
def fp4_batch():
    """A 2-layer model (the deeper layer guided) and an FP4 rollout batch of it with the
    rollout's codes of every row, shared by the update tests."""
    model = Transformer(CFG, nnx.Rngs(0))
    engine = RolloutEngine(model, RECORDING, ROLLOUT)
    return model, batch_from(engine.generate(PROMPTS8, jax.random.key(0)), ADV8)


@functools.cache  # one jitted function per model: the tests share its program
def loss_by_hand(model):
    """``grad(params, batch, old_logp, ref_logp, rows)``: the TRACE trainer's loss under KL
    (replayed routes, the batch's guidance) of the sequences ``rows`` ([B] bool) with proximal
    log-probs ``old_logp`` [B, S] composed here from the model and ``policy_loss``, its router's
    choice and its gradient: ``((loss, router_choice), grads)``. The token mean over the masked
    rows is the minibatch's; one compiled program for the whole batch and for minibatches."""
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, batch, old_logp, ref_logp, rows):
        out = nnx.merge(graphdef, params, rest)(
            batch.tokens,
            attention_mask=batch.filled,
            policy=QuantPolicy.trace(),
            guidance=batch.guidance,
            replay_routes=batch.routes,
        )
        logp = metrics.token_logprobs(out.logits, batch.tokens)
        mask = batch.loss_mask & rows[:, None]
        args = (batch.rollout_logp, batch.advantages, mask, KL, ref_logp)
        return policy_loss(logp, old_logp, *args)[0], out.router_choice

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


@pytest.mark.slow
def test_grpo_with_fp4_rollout_and_trace_learns_a_bandit(fp4_batch):
    """Reward: the share of a sample's 6 tokens among TARGETS; the KL term holds the policy
    near where it started (the update test's loss, so its programs are shared)."""
    model, _ = fp4_batch
    engine = RolloutEngine(model, RECORDING, ROLLOUT)
    trainer = Trainer(model, QuantPolicy.trace(), KL, optax.adam(1e-2))
    state = trainer.init()
    ref = jax.tree.map(jnp.copy, state.params)
    prompt = [1, 2, 3]
    before = float(target_mass(trainer, state.params, jnp.asarray(prompt)))
    for step in range(12):
        engine.update_params(trainer.model(state.params), version=step)
        rs = engine.generate([prompt] * 8, jax.random.key(step))
        rewards = jnp.isin(rs.tokens[:, 3:9], TARGETS).mean(axis=1)
        adv = group_advantages(rewards.reshape(1, -1)).reshape(-1)
        state, m = trainer.rl_step(state, batch_from(rs, adv), ref_params=ref)
        assert np.isfinite(m["train/loss"]) and m["mismatch/logp_abs"] < 1e-3
    after = float(target_mass(trainer, state.params, jnp.asarray(prompt)))
    assert before < 0.2 and after > 2 * before, (before, after)
    assert int(state.step) == 12


@pytest.mark.slow
def test_rl_step_update_follows_the_loss_with_its_kl_term_and_logs_code_metrics(fp4_batch):
    model, batch = fp4_batch
    policy = QuantPolicy.trace()
    lr = 1e-2
    trainer = Trainer(model, policy, KL, optax.sgd(lr))
    state = trainer.init()
    params0 = jax.tree.map(jnp.copy, state.params)

    @jax.jit  # one program (eagerly: one per parameter shape)
    def noisy(params):
        key = jax.random.key(2)
        return jax.tree.map(lambda p: p + 0.05 * jax.random.normal(key, p.shape, p.dtype), params)

    ref = noisy(state.params)
    with pytest.raises(ValueError, match="reference parameters"):
        trainer.rl_step(trainer.init(), batch)
    new, m = trainer.rl_step(state, batch, ref_params=ref)
    # code metrics over the generated tokens; the guided layer (1) reproduces the rollout codes
    assert m["mismatch/code_rate/kv.k/1"] < 0.01 and "mismatch/d_act/experts.down.act/0" in m
    assert m["mismatch/guided_code_agreement"] > 0.99

    # The loss by hand: ratio 1 (one update), the TIS weight min(pi_train / pi_rollout, 5)
    # times -advantage, plus 0.1 x the k3 estimate of KL to the reference, per token.
    scored = [trainer.score(p, batch)[0] for p in (params0, ref)]
    logp, ref_logp = (np.asarray(a, np.float64) for a in scored)
    mask = np.asarray(batch.loss_mask)
    d = (ref_logp - logp)[mask]
    kl = np.exp(d) - d - 1
    assert m["loss/kl_ref"] == pytest.approx(kl.mean(), rel=1e-4)
    # One update per batch: the ratio is 1, nothing is clipped (with several, see
    # test_several_updates_per_batch_score_the_proximal_policy_once_and_clip).
    assert m["loss/clip_frac"] == 0
    w = np.minimum(np.exp(logp - np.asarray(batch.rollout_logp, np.float64)), 5.0)[mask]
    adv = np.broadcast_to(np.asarray(ADV8)[:, None], mask.shape)[mask]
    assert m["train/loss"] == pytest.approx(np.mean(-adv * w + 0.1 * kl), rel=1e-4)

    # SGD: new params = old - lr * grad of the loss the step reports (proximal: the forward's own)
    every = jnp.ones(batch.size, bool)
    # the scored arrays as they came (committed): the minibatch test's calls are the same program
    (value, choice), grads = loss_by_hand(model)(params0, batch, *scored, every)
    assert float(m["train/loss"]) == pytest.approx(float(value), rel=1e-5, abs=1e-7)
    # The trainer router's own top-k against the rollout's experts, under replay.
    routes = metrics.route_mismatch(choice, batch.routes, batch.loss_mask)
    assert m["mismatch/route_rate"] == pytest.approx(float(routes.mean()))
    want = jax.tree.map(lambda p, g: p - lr * g, params0, grads)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_batch_cut_to_its_longest_sequence_trains_as_the_whole(fp4_batch):
    """``RLBatch.slots`` (``trim_padding``): without the slots that are padding in every row,
    the step reports the same loss, mismatch and code metrics and makes the same update."""
    model, batch = fp4_batch
    longest = int(jnp.max(jnp.sum(batch.filled, axis=1)))
    assert longest < batch.tokens.shape[1]  # the last slots are padding in every row
    cut = batch.slots(longest)
    assert cut.tokens.shape[1] == longest and cut.routes.shape[2] == longest
    assert all(g.shape[1] == longest for g in cut.guidance.values()) and cut.guidance
    assert all(c.shape[1] == longest for c in cut.rollout_codes.values()) and cut.rollout_codes
    trainer = Trainer(model, QuantPolicy.trace(), KL, optax.sgd(1e-2))  # the update test's
    ref = trainer.init().params
    (whole, m), (part, m_cut) = (
        trainer.rl_step(trainer.init(), b, ref_params=ref) for b in (batch, cut)
    )
    assert set(m) == set(m_cut)
    for key, value in m.items():
        if not key.endswith("_s"):
            assert m_cut[key] == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), key
    for a, b in zip(jax.tree.leaves(part.params), jax.tree.leaves(whole.params), strict=True):
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


CFG1 = CFG.replace(num_layers=1)


def test_trainer_scores_the_sampling_distribution_so_bf16_pairs_stay_at_the_floor():
    """The rollout's log-probs are of the tempered, top-p truncated distribution it sampled
    from; the trainer scores the same distribution, so temperature 0.7 and top-p 0.9 add no
    mismatch to a BF16 rollout / BF16 trainer pair."""
    model = Transformer(CFG1, nnx.Rngs(3))
    found = {}
    for name, sampling in {
        "plain": SamplingConfig(),
        "tempered": SamplingConfig(temperature=0.7, top_p=0.9),
    }.items():
        engine = RolloutEngine(
            model,
            QuantPolicy.bf16(),
            RolloutConfig(max_len=12, max_new_tokens=6, sampling=sampling),
        )
        batch = batch_from(engine.generate(PROMPTS8, jax.random.key(4)), ADV8)
        trainer = Trainer(
            model, QuantPolicy.bf16(), LossConfig(), optax.sgd(0.0), sampling=sampling
        )
        found[name] = float(trainer.score(trainer.init().params, batch)[1]["mismatch/logp_abs"])
        if name == "tempered":  # scoring the raw softmax instead: the bias this removes
            raw = Trainer(model, QuantPolicy.bf16(), LossConfig(), optax.sgd(0.0))
            found["raw"] = float(raw.score(raw.init().params, batch)[1]["mismatch/logp_abs"])
    assert found["tempered"] <= 2 * found["plain"] + 1e-6, found
    assert found["raw"] > 100 * max(found["plain"], 1e-7), found


def test_several_updates_per_batch_score_the_proximal_policy_once_and_clip(fp4_batch):
    model, batch = fp4_batch
    lr = 0.5
    trainer = Trainer(model, QuantPolicy.trace(), KL, optax.sgd(lr), ppo_epochs=2, minibatches=2)
    key = jax.random.key(7)
    params0 = jax.tree.map(jnp.copy, trainer.init().params)
    state, m = trainer.rl_step(trainer.init(), batch, key, ref_params=params0)
    assert int(state.step) == 4
    assert m["loss/clip_frac"] > 0, m  # the ratio moved away from 1 after the first update
    # By hand: the proximal and reference log-probs once, then SGD on each minibatch of the
    # same shuffles (the reference is where the updates started).
    old = trainer.score(params0, batch)[0]
    ref_logp = trainer.logprobs(params0, batch)
    grad = loss_by_hand(model)
    params = params0
    for epoch in range(2):
        order = jax.random.permutation(jax.random.fold_in(key, epoch), 8)
        for i in range(2):
            rows = jnp.zeros(8, bool).at[order[4 * i : 4 * i + 4]].set(True)
            grads = grad(params, batch, old, ref_logp, rows)[1]
            params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    # Invariant (independent of the hand computation's row plumbing): the step raised the
    # log-prob of every positive-advantage sequence and lowered every negative one.
    mask = np.asarray(batch.loss_mask)
    moved = np.sum(np.where(mask, np.asarray(trainer.score(state.params, batch)[0] - old), 0), 1)
    adv = np.asarray(ADV8)
    assert np.all(moved[adv > 0] > 0) and np.all(moved[adv < 0] < 0), (moved, adv)
    # One update per batch clips nothing:
    # test_rl_step_update_follows_the_loss_with_its_kl_term_and_logs_code_metrics


def test_trainers_built_alike_share_compiled_steps_and_others_do_not():
    """The jitted steps are keyed by what they read: equal settings share one program; another
    optimizer (or one described by nothing but its identity) gets its own."""
    models = [Transformer(CFG1, nnx.Rngs(s)) for s in (0, 1)]
    args = (QuantPolicy.qat(), LossConfig())
    slow, slow_again = (
        Trainer(m, *args, optax.sgd(0.1), optimizer_key=("sgd", 0.1)) for m in models
    )
    fast = Trainer(models[0], *args, optax.sgd(0.5), optimizer_key=("sgd", 0.5))
    assert slow == slow_again and hash(slow) == hash(slow_again) and slow != fast
    assert Trainer(models[0], *args, optax.sgd(0.1)) != Trainer(models[0], *args, optax.sgd(0.1))
    grads = jax.tree.map(jnp.ones_like, slow.init().params)
    one = jax.tree.leaves(slow.apply(slow.init(), grads)[0].params)[0]
    other = jax.tree.leaves(slow_again.apply(slow_again.init(), grads)[0].params)[0]
    five = jax.tree.leaves(fast.apply(fast.init(), grads)[0].params)[0]
    start = [jax.tree.leaves(t.init().params)[0] for t in (slow, slow_again, fast)]
    # each applies its own step to its own parameters (no constants baked into the program)
    np.testing.assert_allclose(np.asarray(one), np.asarray(start[0]) - 0.1, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(other), np.asarray(start[1]) - 0.1, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(five), np.asarray(start[2]) - 0.5, rtol=1e-6)


def test_gradient_programs_scatter_add_only_into_weights():
    """Where the backward adds several values into one slot it is by a reduction or a select,
    except the expert weights' and the embedding's gradients (summed over the rows they were
    gathered for): in the compiled RL gradient and warm-start step, every scatter of floats
    declares unique indices or targets one of those. A scatter-add of repeated indices is an
    atomic add on the GPU (nondeterministic) and a serialised loop under XLA's deterministic ops."""
    cfg = MODEL_BF16
    model = Transformer(cfg, nnx.Rngs(0))
    trainer = Trainer(model, QuantPolicy.bf16(), LossConfig(), optax.adamw(1e-3))
    state = trainer.init()
    b, s, k = 2, 8, cfg.num_experts_per_tok
    tokens = jnp.arange(b * s, dtype=jnp.int32).reshape(b, s) % cfg.vocab_size
    routes = (
        jnp.arange(k)[None, None, None, :] + jnp.arange(s)[None, None, :, None]
    ) % cfg.num_experts
    batch = RLBatch(
        tokens=tokens,
        filled=jnp.ones((b, s), bool),
        loss_mask=jnp.ones((b, s), bool),
        rollout_logp=jnp.zeros((b, s)),
        advantages=jnp.asarray([1.0, -1.0]),
        routes=jnp.broadcast_to(routes, (1, b, s, k)).astype(jnp.int32),
    )
    weights = {
        f"f32[{cfg.num_experts},{cfg.hidden_size},{cfg.moe_intermediate_size}]",
        f"f32[{cfg.num_experts},{cfg.moe_intermediate_size},{cfg.hidden_size}]",
        f"f32[{cfg.vocab_size},{cfg.hidden_size}]",
    }
    programs = {
        "gradient": Trainer.gradient.lower(trainer, state.params, batch, None, None, None),
        "sft_step": Trainer.sft_step.lower(trainer, state, tokens, batch.loss_mask),
    }
    for name, lowered in programs.items():
        lines = re.findall(r"= \S+ scatter\(.*", lowered.compile().as_text())
        assert lines, name  # the weights' gradients at least
        for line in lines:
            shape = re.match(r"= ([a-z0-9]+\[[0-9,]*\])", line).group(1)
            if "unique_indices=true" in line or shape.startswith(("s32", "u32", "pred")):
                continue
            assert shape in weights, f"{name}: {shape} {line[:200]}"
