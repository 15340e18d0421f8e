"""Rollout engine against full forwards: caches, sampling records, multi-turn, TRACE end to end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.rl.metrics import code_mismatch, logp_mismatch, signed_code_index, token_logprobs
from trace_jax.rollout import RolloutConfig, RolloutEngine, SamplingConfig

CFG = ModelConfig.preset("tiny")
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, nnx.Rngs(0))


def full_forward(model, state, policy, **kw):
    mask = jnp.arange(state.tokens.shape[1])[None] < state.lengths[:, None]
    return model(state.tokens, attention_mask=mask, policy=policy, **kw), mask


def test_bf16_cache_decode_matches_a_full_forward(model):
    eng = RolloutEngine(model, QuantPolicy.bf16(), RolloutConfig(max_len=24, max_new_tokens=8))
    state = eng.generate(PROMPTS, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(state.lengths), [len(p) + 8 for p in PROMPTS])
    np.testing.assert_array_equal(np.asarray(state.generated.sum(1)), [8, 8, 8])
    out, _ = full_forward(model, state, QuantPolicy.bf16())
    logp = token_logprobs(out.logits, state.tokens)
    gen = np.asarray(state.generated)
    # Temperature 1, no truncation: the recorded log-prob is the log-softmax of the logits, up
    # to the bf16 rounding of the cached K/V (the model computes in float32).
    diff = np.abs(np.asarray(logp - state.logprobs))[gen]
    assert diff.max() < 5e-3, diff.max()
    assert np.all(np.asarray(state.logprobs)[~gen] == 0)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_cache_decode_matches_a_forward_with_the_same_kv_fake_quant(model, fmt):
    policy = QuantPolicy(fmt=fmt, kv="rtn")
    eng = RolloutEngine(model, policy, RolloutConfig(max_len=24, max_new_tokens=8, kv_cache=fmt))
    state = eng.generate(PROMPTS, jax.random.key(1))
    out, _ = full_forward(model, state, policy)
    logp = token_logprobs(out.logits, state.tokens)
    diff = np.abs(np.asarray(logp - state.logprobs))[np.asarray(state.generated)]
    assert diff.max() < 1e-4, diff.max()
    assert (
        eng.start(3).cache.nbytes
        < RolloutEngine(model, QuantPolicy.bf16(), RolloutConfig(max_len=24)).start(3).cache.nbytes
        / 3
    )


def test_fp4_cache_requires_matching_kv_sites(model):
    with pytest.raises(ValueError, match="kv_cache: nvfp4 needs the policy's KV sites"):
        RolloutEngine(model, QuantPolicy.bf16(), RolloutConfig(kv_cache="nvfp4"))


def test_generation_is_deterministic_given_the_key_and_greedy_is_argmax(model):
    cfg = RolloutConfig(max_len=20, max_new_tokens=6)
    eng = RolloutEngine(model, QuantPolicy.bf16(), cfg)
    a = eng.generate(PROMPTS, jax.random.key(3))
    b = eng.generate(PROMPTS, jax.random.key(3))
    c = eng.generate(PROMPTS, jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    greedy = RolloutEngine(
        model,
        QuantPolicy.bf16(),
        RolloutConfig(max_len=20, max_new_tokens=6, sampling=SamplingConfig(temperature=0.0)),
    )
    g = greedy.generate(PROMPTS, jax.random.key(0))
    out, _ = full_forward(model, g, QuantPolicy.bf16())
    gen = np.asarray(g.generated)
    pred = np.asarray(jnp.argmax(out.logits, -1))[:, :-1]
    np.testing.assert_array_equal(np.asarray(g.tokens)[:, 1:][gen[:, 1:]], pred[gen[:, 1:]])


def test_stop_tokens_end_each_sequence_separately(model):
    cfg = RolloutConfig(
        max_len=40,
        max_new_tokens=30,
        sampling=SamplingConfig(temperature=3.0),
        stop_tokens=(5, 6, 7, 8),
    )
    state = RolloutEngine(model, QuantPolicy.bf16(), cfg).generate(PROMPTS, jax.random.key(5))
    tokens, gen = np.asarray(state.tokens), np.asarray(state.generated)
    for b in range(3):
        sampled = tokens[b][gen[b]]
        stops = np.isin(sampled, cfg.stop_tokens)
        # Either the budget ran out, or the sequence ended at its first stop token.
        if stops.any():
            assert np.argmax(stops) == len(sampled) - 1
        else:
            assert len(sampled) == 30
        assert state.lengths[b] == len(PROMPTS[b]) + len(sampled)


def test_overflowing_max_len_is_refused(model):
    eng = RolloutEngine(model, QuantPolicy.bf16(), RolloutConfig(max_len=8, max_new_tokens=2))
    with pytest.raises(ValueError, match=r"prompt lengths must be in 1\.\.7"):
        eng.generate([[1] * 8], jax.random.key(0))
    state = eng.generate([[1, 2, 3]], jax.random.key(0))
    with pytest.raises(ValueError, match="overflows max_len=8"):
        eng.append(state, jnp.ones((1, 4), jnp.int32))


def test_multi_turn_keeps_cache_and_records_aligned(model):
    policy = QuantPolicy.rollout()
    eng = RolloutEngine(
        model, policy, RolloutConfig(max_len=40, max_new_tokens=5, kv_cache="nvfp4")
    )
    state = eng.generate(PROMPTS, jax.random.key(6))
    env = jnp.asarray([[50, 51, 52], [60, 0, 0], [70, 71, 0]], jnp.int32)
    env_valid = env > 0
    before = np.asarray(state.lengths)
    state = eng.append(state, env, env_valid)
    np.testing.assert_array_equal(np.asarray(state.lengths), before + np.array([3, 1, 2]))
    state = eng.decode(state, jax.random.key(7))
    tokens, gen = np.asarray(state.tokens), np.asarray(state.generated)
    for b in range(3):
        n = int(env_valid[b].sum())
        np.testing.assert_array_equal(tokens[b, before[b] : before[b] + n], np.asarray(env[b, :n]))
        assert not gen[b, before[b] : before[b] + n].any()
        assert gen[b].sum() == 10
    # Every generated token's log-prob still matches a full forward over the whole sequence.
    out, _ = full_forward(model, state, QuantPolicy.qat())
    diff = np.abs(np.asarray(token_logprobs(out.logits, state.tokens) - state.logprobs))[gen]
    assert diff.max() < 1e-4, diff.max()
    # Guidance slots line up with tokens: replaying it reproduces the rollout exactly.
    trained, _ = full_forward(
        model,
        state,
        QuantPolicy.trace(),
        guidance=state.guidance,
        replay_routes=jnp.moveaxis(state.routes, 2, 0),
    )
    diff = np.abs(np.asarray(token_logprobs(trained.logits, state.tokens) - state.logprobs))[gen]
    assert diff.max() < 1e-4, diff.max()


def _trace_run(guided_layers):
    """bf16 model; rollout in FP4 with an FP4 cache; trainer forward in the matching mode."""
    cfg = CFG.replace(dtype="bfloat16", param_dtype="float32")
    model = Transformer(cfg, nnx.Rngs(2))
    rollout_policy = QuantPolicy.rollout(guided_layers="all", record_codes=True)
    eng = RolloutEngine(
        model, rollout_policy, RolloutConfig(max_len=48, max_new_tokens=32, kv_cache="nvfp4")
    )
    prompts = [[i, i + 1, i + 2] for i in range(1, 60, 4)]
    state = eng.generate(prompts, jax.random.key(8))
    if guided_layers == "none":
        train_policy = QuantPolicy.qat(record_codes=True)
    else:
        train_policy = QuantPolicy.trace(guided_layers=guided_layers, record_codes=True)
    guidance = {k: v for k, v in state.guidance.items() if not k.endswith(".codes")}
    out, _ = full_forward(
        model,
        state,
        train_policy,
        guidance=guidance,
        replay_routes=jnp.moveaxis(state.routes, 2, 0),
    )
    return state, out, train_policy, cfg


def test_trace_end_to_end_codes_agree_except_beyond_one_code_step_and_mismatch_shrinks():
    report = {}
    for guided in ("none", "last_half", "all"):
        state, out, policy, cfg = _trace_run(guided)
        mask = jnp.arange(state.tokens.shape[1])[None] < state.lengths[:, None]
        gen = state.generated
        report[guided] = float(
            logp_mismatch(token_logprobs(out.logits, state.tokens), state.logprobs, gen)[
                "mismatch/logp_abs"
            ]
        )
        rates = []
        for layer in range(cfg.num_layers):
            for site in ("experts.gate_up.act", "experts.down.act", "kv.k", "kv.v"):
                name = f"layers.{layer}.{site}.codes"
                train, rollout = out.records[name], state.guidance[name]
                stats = code_mismatch(train, rollout, mask)
                rates.append(float(stats["code_rate"]))
                if policy.site_mode("kv", layer, cfg.num_layers) == "guided":
                    # A guided code differs from the rollout's only when the rollout code is
                    # not a neighbour of the trainer's input: then it has the rollout's
                    # mantissa parity, an even number (>= 2) of code steps away.
                    from trace_jax import fp4

                    d = np.abs(
                        np.asarray(
                            signed_code_index(fp4.code_values(train))
                            - signed_code_index(fp4.code_values(rollout))
                        )
                    )
                    m = np.broadcast_to(
                        np.asarray(mask).reshape(*mask.shape, *[1] * (d.ndim - 2)), d.shape
                    )
                    assert np.all(d[m] % 2 == 0), (name, np.unique(d[m]))
                    assert float(stats["code_rate"]) < 0.01, (name, float(stats["code_rate"]))
        report[guided + "/max_code_rate"] = max(rates)
    print(report)
    assert report["all"] <= report["last_half"] <= report["none"]
    assert report["all"] < report["none"] / 5
    assert report["none/max_code_rate"] > report["all/max_code_rate"]
