"""Run with 2 fake CPU devices: an RL step (SGD, so that parameters compare) on a (data=2), an
(expert=2) and an (fsdp=2) mesh equals the single-device step, the rollout engine on each mesh
samples the single-device engine's tokens, and the RL loop runs with FSDP.
Executed by ``test_trainer.py`` in a fresh process."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.model.sharding import batch_sharding, make_mesh, shard_model
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import RLBatch, Trainer
from trace_jax.rollout import RolloutConfig, RolloutEngine
from trace_jax.rollout.engine import _expert_params

ROLLOUT = RolloutConfig(max_len=12, max_new_tokens=6, kv_cache="nvfp4")
PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9]]


def step(model, batch, mesh=None):
    trainer = Trainer(model, QuantPolicy.trace(), LossConfig(), optax.sgd(0.1))
    state = trainer.init()
    if mesh is None:
        return trainer.rl_step(state, batch)
    with jax.set_mesh(mesh):
        return trainer.rl_step(state, batch)


def main():
    assert jax.device_count() == 2, jax.devices()
    cfg = ModelConfig.preset("tiny").replace(num_layers=2)
    model = Transformer(cfg, nnx.Rngs(0))
    engine = RolloutEngine(model, QuantPolicy.rollout(), ROLLOUT)
    rs = engine.generate(PROMPTS, jax.random.key(0))
    batch = RLBatch(
        tokens=rs.tokens,
        filled=jnp.arange(12)[None] < rs.lengths[:, None],
        loss_mask=rs.generated,
        rollout_logp=rs.logprobs,
        advantages=jnp.asarray([1.0, -1.0, 0.5, -0.5]),
        routes=jnp.moveaxis(rs.routes, 2, 0),
        guidance=rs.guidance,
    )
    want_state, want = step(Transformer(cfg, nnx.Rngs(0)), batch)
    for axes in (dict(data=2), dict(expert=2), dict(fsdp=2)):
        mesh = make_mesh(**axes)
        sharded = shard_model(Transformer(cfg, nnx.Rngs(0)), mesh)

        def put(a, mesh=mesh):
            return jax.device_put(a, batch_sharding(mesh, a.ndim))

        data = RLBatch(
            tokens=put(batch.tokens),
            filled=put(batch.filled),
            loss_mask=put(batch.loss_mask),
            rollout_logp=put(batch.rollout_logp),
            advantages=put(batch.advantages),
            routes=batch.routes,
            guidance=jax.tree.map(put, batch.guidance),
        )
        state, got = step(sharded, data, mesh)
        for key in ("train/loss", "mismatch/logp_abs", "train/grad_norm"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=key)
        for a, b in zip(
            jax.tree.leaves(state.params), jax.tree.leaves(want_state.params), strict=True
        ):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
        # the update leaves each parameter where it was placed (FSDP: split, not gathered)
        placed = jax.tree.map(lambda a: a.sharding, nnx.state(sharded, nnx.Param))
        for a, want_sharding in zip(
            jax.tree.leaves(state.params), jax.tree.leaves(placed), strict=True
        ):
            assert a.sharding.is_equivalent_to(want_sharding, a.ndim), (a.sharding, want_sharding)
        check_rollout(sharded, mesh, rs)
        print(axes, "ok")
    print("sharded RL step OK")
    check_loop()


def check_rollout(sharded, mesh, want):
    """The rollout engine on the mesh: its FP4 expert weights are quantized where the
    parameters are (split over ``fsdp`` / ``expert``, not gathered), its KV cache and records are
    split over the batch, and it samples the single-device engine's tokens."""
    with jax.set_mesh(mesh):
        engine = RolloutEngine(sharded, QuantPolicy.rollout(), ROLLOUT)
        got = engine.generate(PROMPTS, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)
    quantized = nnx.merge(engine.graphdef, engine.state)
    pairs = list(zip(_expert_params(sharded), _expert_params(quantized), strict=True))
    assert pairs
    for p, q in pairs:  # experts [E, K, N] -> codes [E, K, N / 2], on the same devices
        w, codes = p.get_value(), q.get_value().codes
        assert codes.addressable_shards[0].data.size * 2 == w.addressable_shards[0].data.size, (
            w.sharding,
            codes.sharding,
        )
    rows = len(PROMPTS) // (mesh.shape["data"] * mesh.shape["fsdp"])  # all rows on expert=2
    for a in jax.tree.leaves(got.cache)[:-1]:  # K and V of each layer; the lengths last
        assert a.addressable_shards[0].data.shape[0] == rows, a.sharding


def check_loop():
    """The RL loop with ``mesh_fsdp=2``: every parameter and both AdamW moments of it are split
    in halves over the two devices along its largest dimension, and the warm start and the RL
    steps run (the step itself is compared with one device above)."""
    import json
    import tempfile
    from pathlib import Path

    from trace_jax.config import from_dict
    from trace_jax.rl.loop import RLConfig, RLRun

    cfg = dict(
        model_overrides={"num_layers": 1, "dtype": "bfloat16"},
        steps=1,
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=6,
        warm_start={"steps": 2, "batch": 4},
        eval_problems=0,
        mesh_fsdp=2,
        tensorboard=False,
        plot=False,
    )
    run_dir = Path(tempfile.mkdtemp()) / "fsdp2"
    run = RLRun(from_dict(RLConfig, cfg), run_dir, log=lambda *_: None)
    run.run()
    logs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    state = run.final_state
    adam = state.opt_state[1][0]  # chain(clip, adamw): adamw's ScaleByAdamState
    for tree in (state.params, adam.mu, adam.nu):
        for a in jax.tree.leaves(tree):
            half = list(a.shape)
            half[int(np.argmax(a.shape))] //= 2  # the largest dimension (all even here)
            assert a.addressable_shards[0].data.shape == tuple(half), (a.shape, a.sharding)
    assert logs[1]["sft/loss"] < logs[0]["sft/loss"]
    assert np.isfinite(logs[2]["train/loss"]) and logs[2]["mismatch/logp_abs"] < 0.05
    print("sharded RL loop OK")


if __name__ == "__main__":
    main()
