"""Rollout engine against full forwards: caches, sampling records, multi-turn, TRACE end to end."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from shapes import MODEL, PROMPTS, ROLLOUT, rollout_config

from trace_jax import fp4
from trace_jax.guidance import GuidanceCache, GuidanceVersionError
from trace_jax.model import QuantPolicy, Transformer
from trace_jax.model.sharding import commit
from trace_jax.rl.diagnostics import guidance_of, mismatch_report, train_policy, trainer_forward
from trace_jax.rl.metrics import signed_code_index, token_logprobs
from trace_jax.rollout import RolloutConfig, RolloutEngine, SamplingConfig

# tests/shapes.py's engine shapes for the tests that need no other: engines of equal configs share
# compiled programs (through the persistent compilation cache), and compiling dominates these tests.
CFG = MODEL


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, nnx.Rngs(0))


def full_forward(model, state, policy, **kw):
    mask = jnp.arange(state.tokens.shape[1])[None] < state.lengths[:, None]
    return model(state.tokens, attention_mask=mask, policy=policy, **kw), mask


@nnx.jit
def bf16_logits(model, tokens, lengths):
    """The bf16 full forward's logits [B, S, V] over each sequence's first ``lengths`` tokens:
    one program for the bf16 tests (eager, the forward compiles op by op: longer)."""
    mask = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
    return model(tokens, attention_mask=mask, policy=QuantPolicy.bf16()).logits


@pytest.mark.parametrize("kv, tol", [("bf16", 2e-3), ("fp8", 2e-2)])
def test_bf16_and_fp8_cache_decode_matches_a_full_forward(model, kv, tol):
    eng = RolloutEngine(model, QuantPolicy.bf16(), rollout_config(kv))
    state = eng.generate(PROMPTS, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(state.lengths), [len(p) + 8 for p in PROMPTS])
    np.testing.assert_array_equal(np.asarray(state.generated.sum(1)), [8, 8, 8])
    logp = token_logprobs(bf16_logits(model, state.tokens, state.lengths), state.tokens)
    gen = np.asarray(state.generated)
    # Temperature 1, no truncation: the recorded log-prob is the log-softmax of the logits, up
    # to the rounding of the cached K/V (the model computes in float32; E4M3 keeps 3 mantissa
    # bits, bf16 7).
    diff = np.abs(np.asarray(logp - state.logprobs))[gen]
    assert diff.max() < tol, diff.max()
    assert np.all(np.asarray(state.logprobs)[~gen] == 0)


def test_fp4_cache_requires_matching_kv_sites(model):
    with pytest.raises(ValueError, match="kv_cache: nvfp4 needs the policy's KV sites"):
        RolloutEngine(model, QuantPolicy.bf16(), RolloutConfig(kv_cache="nvfp4"))


def test_generation_is_deterministic_given_the_key_and_greedy_is_argmax(model):
    cfg = ROLLOUT
    eng = RolloutEngine(model, QuantPolicy.bf16(), cfg)
    a = eng.generate(PROMPTS, jax.random.key(3))
    b = eng.generate(PROMPTS, jax.random.key(3))
    c = eng.generate(PROMPTS, jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    greedy = RolloutEngine(
        model,
        QuantPolicy.bf16(),
        dataclasses.replace(cfg, sampling=SamplingConfig(temperature=0.0)),
    )
    g = greedy.generate(PROMPTS, jax.random.key(0))
    gen = np.asarray(g.generated)
    pred = np.asarray(jnp.argmax(bf16_logits(model, g.tokens, g.lengths), -1))[:, :-1]
    np.testing.assert_array_equal(np.asarray(g.tokens)[:, 1:][gen[:, 1:]], pred[gen[:, 1:]])
    # Greedy as a runtime flag: the same tokens and log-probs, through the sampling engine's
    # compiled programs (the evaluation engine of an RL run shares the rollout's so).
    flag = RolloutEngine(model, QuantPolicy.bf16(), cfg, greedy=True)
    assert flag == eng
    compiled = RolloutEngine._decode._cache_size()
    f = flag.generate(PROMPTS, jax.random.key(9))
    assert RolloutEngine._decode._cache_size() == compiled
    for a, b in ((f.tokens, g.tokens), (f.logprobs, g.logprobs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
    eng = RolloutEngine(model, QuantPolicy.bf16(), ROLLOUT)
    with pytest.raises(ValueError, match=r"prompt lengths must be in 1\.\.31"):
        eng.generate([[1] * 32], jax.random.key(0))
    state = eng.generate(PROMPTS, jax.random.key(0))  # lengths 11, 15, 9
    with pytest.raises(ValueError, match=r"overflows max_len=32 for sequences \[1\]"):
        eng.append(state, jnp.ones((3, 18), jnp.int32))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_multi_turn_keeps_cache_and_records_aligned(model, fmt):
    policy = QuantPolicy.rollout(fmt)
    # the module's engine shape: nvfp4 shares the programs of the other rollout-policy tests
    eng = RolloutEngine(model, policy, rollout_config(fmt))
    state = eng.generate(PROMPTS, jax.random.key(6))
    # Observations of 3, 1 and 2 tokens, right-padded to the prompts' chunk width (8): the
    # prefill's program appends them.
    env = np.zeros((3, 8), np.int32)
    env[0, :3], env[1, :1], env[2, :2] = [50, 51, 52], [60], [70, 71]
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
        assert gen[b].sum() == 2 * ROLLOUT.max_new_tokens
    # Every generated token's log-prob still matches a full forward over the whole sequence,
    # its K/V fake-quantized as the FP4 cache stores them (the FP4 caches' decode test).
    out, _ = full_forward(model, state, QuantPolicy.qat(fmt))
    diff = np.abs(np.asarray(token_logprobs(out.logits, state.tokens) - state.logprobs))[gen]
    assert diff.max() < 1e-4, diff.max()
    bf16 = RolloutEngine(model, QuantPolicy.bf16(), ROLLOUT).start(3)
    assert state.cache.nbytes < bf16.cache.nbytes / 3
    # Guidance slots line up with tokens: replaying it reproduces the rollout exactly.
    trained, _ = full_forward(
        model,
        state,
        QuantPolicy.trace(fmt),
        guidance=state.guidance,
        replay_routes=jnp.moveaxis(state.routes, 2, 0),
    )
    diff = np.abs(np.asarray(token_logprobs(trained.logits, state.tokens) - state.logprobs))[gen]
    assert diff.max() < 1e-4, diff.max()


@pytest.fixture(scope="module")
def trace_rollout():
    """bf16 model; FP4 rollout with an FP4 cache recording guidance and codes at every layer."""
    cfg = CFG.replace(dtype="bfloat16", param_dtype="float32")
    model = Transformer(cfg, nnx.Rngs(2))
    rollout_policy = QuantPolicy.rollout(guided_layers="all", record_codes=True)
    eng = RolloutEngine(
        model, rollout_policy, RolloutConfig(max_len=40, max_new_tokens=24, kv_cache="nvfp4")
    )
    prompts = [[i, i + 1, i + 2] for i in range(1, 48, 4)]
    return model, eng.generate(prompts, jax.random.key(8))


GUIDED = ("none", "last_half", "all")


@pytest.fixture(scope="module")
def trainer_forwards(trace_rollout):
    """A rollout state -> {guided layers: the trainer's forward over it}, the three forwards in
    one program (compiled once: the RTN layers of "none" and "last_half" share their kernels,
    as do the guided layers of "last_half" and "all"); the TRACE rollout's, computed once."""
    model, state = trace_rollout
    graphdef, params = nnx.split(model)

    @jax.jit
    def forwards(params, state):
        model = nnx.merge(graphdef, params)
        return {g: trainer_forward(model, state, train_policy(g)) for g in GUIDED}

    rollout_out = forwards(params, state)
    return lambda st: rollout_out if st is state else forwards(params, st)


@pytest.mark.slow
def test_trace_end_to_end_codes_agree_except_beyond_one_code_step_and_mismatch_shrinks(
    trace_rollout, trainer_forwards
):
    _, state = trace_rollout
    filled = np.arange(state.tokens.shape[1])[None] < np.asarray(state.lengths)[:, None]
    report = {}
    for guided, out in trainer_forwards(state).items():
        policy = train_policy(guided, "nvfp4")
        report[guided] = mismatch_report(out, state, policy, CFG.num_layers)
        for name, train in out.records.items():
            if not name.endswith(".codes"):
                continue
            layer = int(name.split(".")[1])
            if policy.site_mode("kv", layer, CFG.num_layers) != "guided":
                continue
            # A guided code differs from the rollout's only when the rollout code is not a
            # neighbour of the trainer's input: then it has the rollout's mantissa parity, an
            # even number (>= 2) of code steps away.
            steps = np.abs(
                np.asarray(
                    signed_code_index(fp4.code_values(train))
                    - signed_code_index(fp4.code_values(state.guidance[name]))
                )
            )
            m = np.broadcast_to(filled.reshape(*filled.shape, *[1] * (steps.ndim - 2)), steps.shape)
            assert np.all(steps[m] % 2 == 0), (name, np.unique(steps[m]))
    print({g: {k: v for k, v in r.items() if k.count("/") < 3} for g, r in report.items()})
    logp = {g: r["mismatch/logp_abs"] for g, r in report.items()}
    assert logp["all"] <= logp["last_half"] <= logp["none"]
    assert logp["all"] < logp["none"] / 5
    # Guided sites keep only the mismatches guidance cannot fix (every one of them two or more
    # steps apart, a share of 1 where there are any), and those are rare.
    for g in ("last_half", "all"):
        r = report[g]
        assert r["mismatch/code_rate/guided"] < 0.01
        assert r["mismatch/code_rate/guided"] == 0 or r["mismatch/code_far/guided"] == 1.0
        assert r["mismatch/guided_code_agreement"] == pytest.approx(
            1 - r["mismatch/code_rate/guided"]
        )
    assert report["none"]["mismatch/code_rate/all"] > 10 * report["all"]["mismatch/code_rate/all"]
    # Without guidance most mismatches are one code step (the paper's > 99 % at scale).
    one = report["none"]["mismatch/code_one_step/all"]
    assert 0.5 < one < 1 and one + report["none"]["mismatch/code_far/all"] == pytest.approx(1)
    # The trainer router's own top-k is compared with the rollout's, also under replay.
    assert report["none"]["mismatch/route_rate"] > 0


def test_guidance_through_the_cache_and_a_spill_gives_the_same_trainer_forward(
    trace_rollout, trainer_forwards, tmp_path
):
    _, state = trace_rollout
    direct = trainer_forwards(state)["last_half"]
    with GuidanceCache(tmp_path / "spill", host_budget_bytes=0) as cache:
        ids = [f"prompt{b}" for b in range(state.tokens.shape[0])]
        cache.put_batch(3, ids, guidance_of(state))
        assert cache.stats().spilled_bytes > 0
        fetched = cache.get(3, ids[::-1])  # a micro-batch in another order
        with pytest.raises(GuidanceVersionError):
            cache.get(2, ids[:1])
    flipped = jax.tree.map(lambda a: a[::-1], state)
    # the cache's guidance in place of the rollout's (the ``.codes`` records, which the trainer
    # does not read, kept) and committed as the rollout's arrays are: the program of ``direct``
    fetched = commit(jax.tree.map(jnp.asarray, fetched))
    assert sorted(fetched) == sorted(guidance_of(state))
    replayed = dataclasses.replace(flipped, guidance={**flipped.guidance, **fetched})
    out = trainer_forwards(replayed)["last_half"]
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(direct.logits)[::-1])


def test_per_tensor_nvfp4_activation_scales_are_recorded_per_slot_and_guide_the_trainer():
    """``act_global_scale="tensor"``: each chunk (the prefill, then one decode step) has its own
    global scale; the records keep it per slot, and the trainer guided by them takes the
    rollout's codes."""
    model = Transformer(CFG.replace(num_layers=1), nnx.Rngs(0))
    kw = dict(guided_layers="all", record_codes=True, act_global_scale="tensor")
    eng = RolloutEngine(model, QuantPolicy.rollout(**kw), rollout_config("bf16"))
    state = eng.generate(PROMPTS, jax.random.key(3))
    policy = QuantPolicy.trace(**kw)
    out = trainer_forward(model, state, policy)
    report = mismatch_report(out, state, policy, 1)
    assert report["mismatch/code_rate/guided"] < 0.01, report["mismatch/code_rate/guided"]
    # The prompt's slots share the prefill's scale; decode slots each have their step's.
    g = np.asarray(state.guidance["layers.0.experts.gate_up.act"].global_scale)[..., 0]
    n = len(PROMPTS[0])
    assert np.all(g[0, :n] == g[0, 0]) and len(np.unique(g[0, n : int(state.lengths[0])])) > 1


def test_engines_built_alike_share_programs_and_use_their_own_weights(model):
    """Equal engine settings share compiled steps; each still decodes with its own weights."""
    other = Transformer(CFG, nnx.Rngs(5))
    a, b = (
        RolloutEngine(m, QuantPolicy.rollout(), rollout_config("nvfp4")) for m in (model, other)
    )
    assert a == b and hash(a) == hash(b)
    assert a != RolloutEngine(model, QuantPolicy.qat(), rollout_config("nvfp4"))
    key = jax.random.key(4)
    got = [e.generate(PROMPTS, key).logprobs for e in (a, b)]
    a.update_params(other)
    np.testing.assert_array_equal(np.asarray(a.generate(PROMPTS, key).logprobs), np.asarray(got[1]))
    assert not np.array_equal(np.asarray(got[0]), np.asarray(got[1]))


def test_a_scanned_prefill_gives_the_per_layer_engines_rollout(model, monkeypatch):
    """``scan_layers``: the prefill runs alike layers as one scan over stacked weights and cache
    states, the decode step per layer; tokens, log-probs, routes and guidance are the per-layer
    engine's (codes exactly, floats to f32 ulps)."""
    scanned = Transformer(CFG.replace(scan_layers=True), nnx.Rngs(0))  # the same weights
    runs, scan_run = [], Transformer._scan_run
    monkeypatch.setattr(
        Transformer, "_scan_run", lambda self, *a: runs.append(a[:2]) or scan_run(self, *a)
    )
    policy, cfg = QuantPolicy.rollout(), rollout_config("nvfp4")
    states = [RolloutEngine(model, policy, cfg).generate(PROMPTS, jax.random.key(4))]
    # the scanned engine's steps traced here, not taken from an earlier test (the worker's
    # other programs stay: jax.clear_caches() would make later tests compile them again)
    RolloutEngine._append.clear_cache()
    RolloutEngine._decode.clear_cache()
    states.append(RolloutEngine(scanned, policy, cfg).generate(PROMPTS, jax.random.key(4)))
    assert runs and all(r == (0, 2) or r == (2, 4) for r in runs)  # RTN half, recording half

    def same(a, b):
        a, b = np.asarray(a), np.asarray(b)
        if np.issubdtype(a.dtype, np.floating):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(a, b)

    jax.tree.map(
        same, dataclasses.replace(states[0], cache=None), dataclasses.replace(states[1], cache=None)
    )
    assert len(states[1].guidance) == 2 * 4


def test_the_decode_step_declares_every_scatter_unique():
    """Every scatter of the compiled decode loop (the token, log-prob, route, K/V and record
    writes of ``_append``, the MoE layer's counts) declares that it meets each index once: XLA's
    deterministic GPU ops rewrite any other (into loops or a sort and a scan; a rewrite whose
    writes the GPU's mismatch at ``medium`` was most likely measuring until ``a851a84``)."""
    import re

    cfg = CFG.replace(dtype="bfloat16", param_dtype="float32")
    policy = QuantPolicy.rollout(guided_layers="all", record_codes=True)
    rollout = RolloutConfig(max_len=16, max_new_tokens=8, kv_cache="nvfp4", code_rows=2)
    eng = RolloutEngine(Transformer(cfg, nnx.Rngs(2)), policy, rollout)
    state = eng.append(eng.start(4), [[1, 2, 3]] * 4)
    rows = jnp.arange(4, dtype=jnp.int32)
    lowered = RolloutEngine._decode.lower(eng, eng.state, state, jax.random.key(0), False, rows)
    lines = re.findall(r"= \S+ scatter\(.*", lowered.compile().as_text())
    assert lines  # the row writes at least
    for line in lines:
        assert "unique_indices=true" in line, line[:300]
