"""Layer-by-layer build of the rollout form: bit for bit the model that building then packing
gives (random init and a sharded hub checkpoint), the engine's tokens and log-probs unchanged,
and never the whole unpacked model alive at once."""

import dataclasses
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from shapes import MODEL, PROMPTS, rollout_config

from pallas_kernels.layouts import Fp4Weight
from trace_jax import fp4
from trace_jax.config import ConfigError
from trace_jax.model import QuantPolicy, Transformer, load_hf_checkpoint
from trace_jax.model.hf import save_hf_checkpoint
from trace_jax.rollout import RolloutEngine, load
from trace_jax.rollout.engine import prepack_expert_weights, quantize_expert_weights

# 2 layers: building the rollout form runs eagerly, layer by layer (the engine test excepted)
CFG = MODEL.replace(num_layers=2)
POLICY = QuantPolicy.rollout("nvfp4")
ROLLOUT = {  # tests/shapes.py's engine shape
    "xla": rollout_config("nvfp4"),
    "pallas": rollout_config("nvfp4", backend="pallas"),
}


def built_then_packed(model, rollout):
    """What RolloutEngine.update_params makes of a BF16 model (a copy)."""
    graphdef, state = nnx.split(model)
    model = quantize_expert_weights(nnx.merge(graphdef, jax.tree.map(jnp.copy, state)), POLICY)
    return prepack_expert_weights(model) if rollout.backend == "pallas" else model


def assert_bit_equal(a, b):
    sa, sb = nnx.state(a), nnx.state(b)
    assert jax.tree.structure(sa) == jax.tree.structure(sb)
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(
            np.asarray(x).reshape(-1).view(np.uint8), np.asarray(y).reshape(-1).view(np.uint8)
        )


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, nnx.Rngs(0))


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_layer_by_layer_init_equals_building_then_packing(model, backend):
    built = load.init_rollout_model(CFG, POLICY, ROLLOUT[backend], seed=0)
    expect = Fp4Weight if backend == "pallas" else fp4.QTensor
    assert isinstance(built.layers[0].mlp.gate_proj.get_value(), expect)
    assert_bit_equal(built, built_then_packed(model, ROLLOUT[backend]))
    # and the seed is used: another one gives other weights
    other = load.init_rollout_model(CFG, QuantPolicy.bf16(), ROLLOUT[backend], seed=1)
    assert not np.array_equal(other.embed_tokens.get_value(), model.embed_tokens.get_value())


def test_a_bf16_policy_keeps_the_experts_unpacked(model):
    built = load.init_rollout_model(CFG, QuantPolicy.bf16(), ROLLOUT["xla"], seed=0)
    assert_bit_equal(built, model)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_sharded_checkpoint_loads_straight_into_the_rollout_form(model, tmp_path, backend):
    files = save_hf_checkpoint(model, CFG, tmp_path, max_shard_bytes=200_000)
    assert len(files) > 2  # each layer's experts spread over shards
    cfg, built = load.load_rollout_model(tmp_path, POLICY, ROLLOUT[backend])
    assert cfg == CFG
    _, loaded = load_hf_checkpoint(tmp_path)
    assert_bit_equal(built, built_then_packed(loaded, ROLLOUT[backend]))
    assert_bit_equal(built, built_then_packed(model, ROLLOUT[backend]))


def test_engine_generates_the_same_tokens_and_logprobs():
    # one engine (one compiled program), given the BF16 model, then the layer-by-layer one; of
    # the tiny preset's 4 layers: tests/shapes.py's rollout engine, its programs
    cfg = MODEL
    rollout = ROLLOUT["xla"]
    engine = RolloutEngine(Transformer(cfg, nnx.Rngs(0)), POLICY, rollout)
    key = jax.random.key(3)
    want = engine.generate(PROMPTS, key)
    built = load.init_rollout_model(cfg, POLICY, rollout, seed=0)
    engine.update_params(built)
    # packed experts pass through update_params as they are: the same device buffers (the
    # engine commits them to their device, which copies nothing)
    for a, b in zip(jax.tree.leaves(engine.state), jax.tree.leaves(nnx.state(built)), strict=True):
        assert a.unsafe_buffer_pointer() == b.unsafe_buffer_pointer()
    got = engine.generate(PROMPTS, key)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.logprobs), np.asarray(want.logprobs))
    assert np.asarray(got.generated).sum() == 3 * ROLLOUT["xla"].max_new_tokens


def test_never_holds_every_layer_unpacked(monkeypatch):
    # Live device bytes while each expert weight is packed, against the unpacked experts of
    # all layers: layer by layer, at most one layer's are alive besides the packed model.
    cfg = dataclasses.replace(CFG, num_layers=8)
    pack, seen = load.pack_expert_weight, []

    def watched(w, policy, *, prepack):
        seen.append(sum(a.nbytes for a in jax.live_arrays()) - start)
        return pack(w, policy, prepack=prepack)

    monkeypatch.setattr(load, "pack_expert_weight", watched)
    start = sum(a.nbytes for a in jax.live_arrays())
    gc.disable()  # without a garbage collection: freed as each layer is done, not when one runs
    try:
        built = load.init_rollout_model(cfg, POLICY, ROLLOUT["xla"], seed=0)
    finally:
        gc.enable()
    layer_experts = 3 * cfg.num_experts * cfg.hidden_size * cfg.moe_intermediate_size * 4
    unpacked_model = cfg.num_layers * layer_experts
    packed_model = sum(a.nbytes for a in jax.tree.leaves(nnx.state(built)))
    assert len(seen) == 3 * cfg.num_layers
    assert max(seen) <= packed_model + layer_experts < unpacked_model


def test_engines_check_the_form_of_packed_experts(model):
    """A Pallas-packed model given to an XLA engine runs with its QTensors; a model packed in
    another format, or packed at all for a BF16 engine, is refused naming both formats."""
    packed = load.init_rollout_model(CFG, POLICY, ROLLOUT["pallas"], seed=0)
    engine = RolloutEngine(packed, POLICY, ROLLOUT["xla"])
    weights = [p.get_value() for p in _experts(nnx.merge(engine.graphdef, engine.state))]
    assert weights and all(type(w) is fp4.QTensor for w in weights)
    mx = QuantPolicy.rollout("mxfp4")
    with pytest.raises(ConfigError, match=r"packed in nvfp4; this engine's are mxfp4"):
        RolloutEngine(packed, mx, dataclasses.replace(ROLLOUT["xla"], kv_cache="mxfp4"))
    with pytest.raises(ConfigError, match=r"packed in nvfp4; this engine's are unquantized"):
        RolloutEngine(
            packed, QuantPolicy.bf16(), dataclasses.replace(ROLLOUT["xla"], kv_cache="bf16")
        )


def _experts(model):
    return [
        getattr(layer.mlp, name)
        for layer in model.layers
        if layer.is_moe
        for name in ("gate_proj", "up_proj", "down_proj")
    ]
