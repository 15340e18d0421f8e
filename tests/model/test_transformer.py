"""The MoE transformer: dispatch vs a dense reference, causality, padding, routing replay, sites."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax.model import ModelConfig, QuantPolicy, Transformer, layers
from trace_jax.model.policy import SiteContext
from trace_jax.tasks import TOKENIZER

CFG = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, nnx.Rngs(0))


# One compiled program per distinct call (policy, inputs given, shapes) instead of a hundred or
# more small eager ones per forward; the tests below share its [2, 12] calls.
@functools.partial(nnx.jit, static_argnames=("policy",))
def forward(model, tokens, policy=None, **inputs):
    return model(tokens, policy=policy, **inputs)


def traced(model, tokens, **kwargs):
    """The forward's output shapes (and any error it raises while tracing), compiling nothing."""
    return nnx.eval_shape(lambda m: m(tokens, **kwargs), model)


def tokens(b=2, t=12, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size)


def test_tiny_preset_is_small_and_param_count_is_exact(model):
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == CFG.num_params() < 5_000_000
    assert 100e6 <= ModelConfig.preset("small").num_params() <= 300e6
    medium = ModelConfig.preset("medium")
    assert 0.5e9 <= medium.num_params() <= 1e9 and medium.num_experts_per_tok == 8
    assert medium.vocab_size == TOKENIZER.vocab_size  # sized to the tasks' byte tokenizer
    assert abs(ModelConfig.preset("qwen3-30b-a3b").num_params() / 30.5e9 - 1) < 0.01
    assert abs(ModelConfig.preset("qwen3-235b-a22b").num_params() / 235.1e9 - 1) < 0.01


def test_moe_dispatch_equals_a_dense_per_token_reference(model):
    x = jax.random.normal(jax.random.key(1), (3, 5, CFG.hidden_size))
    (y, experts, _), e, want = _moe_and_dense_reference(model.layers[1].mlp, x)
    np.testing.assert_array_equal(np.asarray(experts).reshape(-1, 2), np.asarray(e))
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-6)


@nnx.jit
def _moe_and_dense_reference(moe, x):
    """The MoE layer's (y, experts, choice), and the router's top-k and the dense per-token
    reference output, in one program."""
    out = moe(x, SiteContext(QuantPolicy(), CFG.num_layers), layer=1)
    logits = x.reshape(-1, CFG.hidden_size) @ moe.router[...]
    probs = jax.nn.softmax(logits, -1)
    w, e = jax.lax.top_k(probs, CFG.num_experts_per_tok)
    w = w / w.sum(-1, keepdims=True)
    xf = x.reshape(-1, 1, CFG.hidden_size)
    g = jnp.einsum(
        "nkh,nkhi->nki", jnp.broadcast_to(xf, (xf.shape[0], 2, xf.shape[2])), moe.gate_proj[...][e]
    )
    u = jnp.einsum("nh,nkhi->nki", xf[:, 0], moe.up_proj[...][e])
    d = jnp.einsum("nki,nkih->nkh", jax.nn.silu(g) * u, moe.down_proj[...][e])
    return out, e, jnp.sum(d * w[..., None], 1).reshape(x.shape)


def test_logits_are_causal(model):
    tok = tokens()
    a = forward(model, tok).logits
    b = forward(model, tok.at[:, 8:].set((tok[:, 8:] + 1) % CFG.vocab_size)).logits
    np.testing.assert_array_equal(np.asarray(a[:, :8]), np.asarray(b[:, :8]))
    assert not np.allclose(np.asarray(a[:, 8:]), np.asarray(b[:, 8:]))


def test_left_padding_with_mask_and_positions_matches_the_unpadded_sequence(model):
    tok = tokens()  # [2, 12]: the unpadded forward is the other tests' program
    ref = forward(model, tok).logits
    pad = 3
    padded = jnp.concatenate([jnp.zeros((2, pad), tok.dtype), tok], axis=1)
    mask = jnp.broadcast_to(jnp.arange(12 + pad) >= pad, padded.shape)
    pos = jnp.broadcast_to(jnp.maximum(jnp.arange(12 + pad) - pad, 0), padded.shape)
    out = forward(model, padded, attention_mask=mask, positions=pos).logits[:, pad:]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_replaying_recorded_routes_reproduces_the_forward_and_moves_gradient_to_the_router(model):
    tok = tokens()
    out = forward(model, tok)
    assert out.routes.shape == (len(CFG.moe_layers), 2, 12, CFG.num_experts_per_tok)
    again = forward(model, tok, replay_routes=out.routes)
    np.testing.assert_array_equal(np.asarray(again.logits), np.asarray(out.logits))
    # Replaying other experts changes the expert set but the router still gets gradient.
    other = (out.routes + 1) % CFG.num_experts
    replayed = forward(model, tok, replay_routes=other)
    np.testing.assert_array_equal(np.asarray(replayed.routes), np.asarray(other))
    # The router's own choice is still reported: what this forward would have picked (the
    # first MoE layer sees the same input; later ones see the replayed experts' outputs).
    np.testing.assert_array_equal(np.asarray(out.router_choice), np.asarray(out.routes))
    np.testing.assert_array_equal(np.asarray(again.router_choice), np.asarray(out.routes))
    np.testing.assert_array_equal(np.asarray(replayed.router_choice[0]), np.asarray(out.routes[0]))
    assert not np.array_equal(np.asarray(replayed.router_choice), np.asarray(other))
    # The router's gradient under replayed experts it did not choose: the gradients of
    # test_scanned_layers_compute_what_the_per_layer_loop_does (one program pair for both).


def test_replay_routes_of_the_wrong_shape_is_refused(model):
    with pytest.raises(ValueError, match="replay_routes has shape"):
        traced(model, tokens(), replay_routes=jnp.zeros((1, 2, 12, 2), jnp.int32))


def test_trace_with_the_rollout_inputs_reproduces_the_rollout_exactly(model):
    tok = tokens()
    # Eager: the FP4 sites' jitted programs are shared by the layers and the calls (one jit of
    # the whole quantized forward compiles longer than these).
    rollout = model(tok, policy=QuantPolicy.rollout(guided_layers="all"))
    assert len(rollout.records) == 4 * CFG.num_layers
    trained = model(
        tok,
        policy=QuantPolicy.trace(guided_layers="all"),
        guidance=rollout.records,
        replay_routes=rollout.routes,
    )
    np.testing.assert_array_equal(np.asarray(trained.logits), np.asarray(rollout.logits))
    bf16 = forward(model, tok)
    assert not np.allclose(np.asarray(bf16.logits), np.asarray(rollout.logits))


def test_guidance_shapes_follow_the_token_layout(model):
    rollout = traced(model, tokens(2, 12), policy=QuantPolicy.rollout())
    g = rollout.records
    assert set(g) == {
        f"layers.{i}.{s}"
        for i in (2, 3)
        for s in ("experts.gate_up.act", "experts.down.act", "kv.k", "kv.v")
    }
    assert g["layers.3.experts.gate_up.act"].shape == (2, 12, CFG.hidden_size)
    assert g["layers.3.experts.down.act"].shape == (2, 12, 2, CFG.moe_intermediate_size)
    assert g["layers.3.kv.k"].shape == (2, 12, CFG.num_kv_heads, CFG.head_dim)


def test_guided_expert_activations_without_routing_replay_are_refused(model):
    """The down-projection guidance is per (token, expert slot) of the rollout's routes; without
    replay the trainer's slot j may hold another expert's input."""
    tok = tokens()
    rollout = traced(model, tok, policy=QuantPolicy.rollout(guided_layers="all"))
    with pytest.raises(ValueError, match=r"layer 0: guided expert activations need replay_routes"):
        traced(model, tok, policy=QuantPolicy.trace(guided_layers="all"), guidance=rollout.records)
    # Guided KV sites alone (per token) need no replay.
    kv_only = dataclasses.replace(QuantPolicy.trace(guided_layers="all"), expert_acts="rtn")
    traced(model, tok, policy=kv_only, guidance=rollout.records)


def test_missing_guidance_is_an_error(model):
    with pytest.raises(KeyError, match=r"layers\.2\.kv\.k is guided but no guidance"):
        traced(model, tokens(), policy=QuantPolicy.trace())


def test_policy_resolution():
    p = QuantPolicy.trace()
    assert [p.site_mode("act", layer, 8) for layer in (0, 3, 4, 7)] == [
        "rtn",
        "rtn",
        "guided",
        "guided",
    ]
    q = QuantPolicy.trace(guided_layers="last_k", guided_last_k=2)
    assert [q.site_mode("kv", layer, 8) for layer in (5, 6)] == ["rtn", "guided"]
    assert QuantPolicy.rollout(guided_layers="none").site_mode("kv", 7, 8) == "rtn"
    assert QuantPolicy.bf16().site_mode("act", 7, 8) == "off"


def test_qat_weights_are_fake_quantized_per_expert_along_the_contraction_axis(model):
    from trace_jax import fp4

    w = model.layers[0].mlp.gate_proj[...]  # [E, H, I]
    wq = SiteContext(QuantPolicy.qat(), CFG.num_layers).expert_weight(w)
    want = fp4.dequantize(fp4.quantize(w[3], "nvfp4", axis=0))
    np.testing.assert_array_equal(np.asarray(wq[3]), np.asarray(want))


def test_a_dense_layer_config_and_a_shared_expert():
    cfg = CFG.replace(mlp_only_layers=(0,), shared_expert_intermediate_size=48)
    m = Transformer(cfg, nnx.Rngs(1))
    assert cfg.moe_layers == (1, 2, 3) and not m.layers[0].is_moe
    out = m(tokens())
    assert out.routes.shape[0] == 3
    n = sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert n == cfg.num_params()


def test_route_renormalisation():
    logits = jax.random.normal(jax.random.key(2), (5, 8))
    w, e = layers.route(logits, 3, norm_topk_prob=True)
    np.testing.assert_allclose(np.asarray(w.sum(-1)), 1.0, rtol=1e-6)
    w2, _ = layers.route(logits, 3, norm_topk_prob=False)
    p = jax.nn.softmax(logits, -1)
    np.testing.assert_allclose(np.asarray(w2), np.asarray(jnp.take_along_axis(p, e, -1)))


def test_scanned_layers_compute_what_the_per_layer_loop_does():
    """``scan_layers`` runs alike consecutive layers as one ``lax.scan``; logits, routes, K/V,
    the rollout's records (codes bit for bit) and the guided trainer's gradients (replaying other
    experts than the router's) equal the per-layer loop's, on a stack with a dense layer and
    TRACE's RTN and guided runs (2 layers each: the fewest that scan; every layer more is
    compiled again in the loop's programs)."""
    cfg = CFG.replace(num_layers=5, mlp_only_layers=(0,))
    m = Transformer(cfg, nnx.Rngs(3))
    tok = tokens()  # the other tests' shape: the eager per-layer loop reuses their FP4 programs
    last2 = dict(guided_layers="last_k", guided_last_k=2)
    rollout, trace = QuantPolicy.rollout(record_codes=True, **last2), QuantPolicy.trace(**last2)
    assert m._runs(SiteContext(trace, 5)) == [(0, 1), (1, 3), (3, 5)]
    assert m._runs(SiteContext(QuantPolicy(), 5)) == [(0, 1), (1, 5)]
    assert "scan" in str(jax.make_jaxpr(lambda t: m(t, scan_layers=True).logits)(tok))
    assert "scan" not in str(jax.make_jaxpr(lambda t: m(t).logits)(tok))

    # One compiled body instead of several: float sums may associate differently (f32 ulps).
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
    loop, scan = (m(tok, policy=rollout, scan_layers=s) for s in (False, True))

    def same(a, b):  # codes, mantissa bits and routes exactly; scales and values to f32 ulps
        a, b = np.asarray(a), np.asarray(b)
        (close if np.issubdtype(a.dtype, np.floating) else np.testing.assert_array_equal)(a, b)

    jax.tree.map(
        same,
        (loop.logits, loop.kv, loop.routes, loop.router_choice, loop.records),
        (scan.logits, scan.kv, scan.routes, scan.router_choice, scan.records),
    )
    # codes at every site (dense layer 0: K, V; MoE layers 1-4: 4 sites), guidance at layers 3-4
    assert len(scan.records) == 2 + 4 * 4 + 2 * 4
    guidance = {k: v for k, v in loop.records.items() if not k.endswith(".codes")}
    other = (loop.routes + 1) % cfg.num_experts  # replayed experts the router did not choose

    def loss(params, scan_layers):
        out = nnx.merge(nnx.graphdef(m), params)(
            tok, policy=trace, guidance=guidance, replay_routes=other, scan_layers=scan_layers
        )
        return jnp.mean(out.logits**2)

    grads = [jax.jit(jax.grad(loss), static_argnums=1)(nnx.state(m), s) for s in (False, True)]
    jax.tree.map(close, *grads)
    assert float(jnp.abs(grads[1]["layers"][4]["mlp"]["gate_proj"][...]).sum()) > 0
    # Replaying experts it did not choose, the router still gets gradient (through the replayed
    # experts' probabilities), in every MoE layer.
    for i in cfg.moe_layers:
        assert float(jnp.abs(grads[0]["layers"][i]["mlp"]["router"][...]).sum()) > 0
