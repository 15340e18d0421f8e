"""With 8 fake CPU devices: the forward on a (data=2, fsdp=2, expert=2) mesh equals the
single-device one, per layer and with its layers scanned.

Run by ``tests/rl/sharded_step_check.py`` (``test_multiprocess.py``) in the process of its other
8-device checks, because the device count is fixed when JAX starts
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.model.sharding import batch_sharding, make_mesh, shard_model


def check_forward():
    assert jax.device_count() == 8, jax.devices()
    # two alike layers: the scanned forward runs them as one scan (the shapes of the RL step's)
    cfg = ModelConfig.preset("tiny").replace(num_layers=2)
    tokens = jax.random.randint(jax.random.key(0), (4, 16), 0, cfg.vocab_size)

    @nnx.jit
    def forward(model, tokens):
        out = model(tokens, policy=QuantPolicy.qat())
        return out.logits, out.routes

    single = Transformer(cfg, nnx.Rngs(0))
    want_logits, want_routes = forward(single, tokens)

    mesh = make_mesh(data=2, fsdp=2, expert=2)
    sharded = shard_model(Transformer(cfg, nnx.Rngs(0)), mesh)
    experts = sharded.layers[0].mlp.gate_proj[...]  # [E, H, I]: E over expert, H over fsdp
    assert len(experts.sharding.device_set) == 8
    assert experts.addressable_shards[0].data.shape == (
        cfg.num_experts // 2,
        cfg.hidden_size // 2,
        cfg.moe_intermediate_size,
    )
    embed = sharded.embed_tokens[...]  # [V, H]: V over fsdp, replicated over data and expert
    assert embed.addressable_shards[0].data.shape == (cfg.vocab_size // 2, cfg.hidden_size)
    with jax.set_mesh(mesh):
        logits, routes = forward(sharded, jax.device_put(tokens, batch_sharding(mesh)))
    # batch over data (the compiler may keep the vocabulary over fsdp, from the LM head)
    assert logits.sharding.spec[0] in ("data", ("data", "fsdp")), logits.sharding
    np.testing.assert_array_equal(np.asarray(routes), np.asarray(want_routes))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5)
    # Layers scanned over the same sharded parameters (stacked per run, experts still split).
    scanned = nnx.merge(*nnx.split(sharded))
    scanned.cfg = cfg.replace(scan_layers=True)
    assert "scan" in str(
        jax.make_jaxpr(lambda t: scanned(t, policy=QuantPolicy.qat()).logits)(tokens)
    )
    with jax.set_mesh(mesh):
        logits, routes = forward(scanned, jax.device_put(tokens, batch_sharding(mesh)))
    np.testing.assert_array_equal(np.asarray(routes), np.asarray(want_routes))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5)
    print("sharded forward OK", float(jnp.abs(logits - want_logits).max()))
