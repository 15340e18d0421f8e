"""With 8 fake CPU devices: the forward on a (data=2, fsdp=2, expert=2) mesh equals the
single-device one with its layers scanned (per layer: the RL step of ``sharded_step_check.py``).

Run by ``tests/rl/sharded_step_check.py`` (``test_multiprocess.py``) in the process of its other
8-device checks, because the device count is fixed when JAX starts
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
"""

import jax
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
    # Layers scanned over the sharded parameters (stacked per run, experts still split); the
    # per-layer forward on this mesh is checked against one device's by the RL step and the
    # rollout of ``sharded_step_check.py`` (one forward program on the mesh here, not two).
    scanned = sharded
    scanned.cfg = cfg.replace(scan_layers=True)
    assert "scan" in str(
        jax.make_jaxpr(lambda t: scanned(t, policy=QuantPolicy.qat()).logits)(tokens)
    )
    with jax.set_mesh(mesh):  # from the host: no program that slices a device's array
        batch = jax.device_put(np.asarray(tokens), batch_sharding(mesh))
        logits, routes = forward(scanned, batch)
    # batch over data (the compiler may keep the vocabulary over fsdp, from the LM head)
    assert logits.sharding.spec[0] in ("data", ("data", "fsdp")), logits.sharding
    np.testing.assert_array_equal(np.asarray(routes), np.asarray(want_routes))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5)
    print("sharded forward OK", np.abs(np.asarray(logits) - np.asarray(want_logits)).max())
