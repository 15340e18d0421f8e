"""``one CONFIG RUN_DIR``: in one process with 8 fake CPU devices; ``job CONFIG RUN_DIR``: in each
process of a job of two (one device each; ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
``JAX_PROCESS_ID`` set). Executed by ``test_multiprocess.py``; every check that needs a device
count fixed when JAX starts runs in these three processes (one set of compiled programs each).

``one``: the forward on a (data=2, fsdp=2, expert=2) mesh equals one device's
(``tests/model/sharded_forward_check.py``); an RL step (SGD, so that parameters compare) on that
mesh equals the single-device step and leaves every parameter where it was placed, and the
rollout engine on the mesh samples the single-device engine's tokens with its FP4 expert weights
quantized where the parameters are and its KV cache split over the batch (one mesh of every axis
at once: one compiled program for all three); then the ``loop`` checks on the first two devices.

``job``: the processes join, reduce a global batch and have the RL loop refuse what does not
split over them (``tests/experiments/distributed_check.py``); then the ``loop`` checks.

``loop``: host rows enter and leave the global batch (``check_batch_rows``), and the config
(``mesh_fsdp: 2``) runs through the entry point's ``execute`` with every weight of the rollout
and evaluation engines at every refit (FP4 expert codes and block scales), every parameter and
both AdamW moments of it split in halves over the two devices: across processes no process
holds a whole one. The test compares the metrics of the one process and of the job.
"""

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.runner import execute, init_distributed, resolve
from tests.experiments.distributed_check import check_global_batch
from tests.model.sharded_forward_check import check_forward
from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.model.sharding import (
    batch_part,
    batch_sharding,
    host_value,
    make_mesh,
    place_rows,
    process_rows,
    shard_model,
)
from trace_jax.rl.loop import RLRun
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


def check_steps():
    cfg = ModelConfig.preset("tiny").replace(num_layers=1)
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
    mesh = make_mesh(data=2, fsdp=2, expert=2)
    sharded = shard_model(Transformer(cfg, nnx.Rngs(0)), mesh)

    def put(a):  # from the host: no program to slice a device's array, one per shape
        return jax.device_put(np.asarray(a), batch_sharding(mesh, a.ndim))

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
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want_state.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    # the update leaves each parameter where it was placed (FSDP: split, not gathered)
    placed = jax.tree.map(lambda a: a.sharding, nnx.state(sharded, nnx.Param))
    for a, want_sharding in zip(
        jax.tree.leaves(state.params), jax.tree.leaves(placed), strict=True
    ):
        assert a.sharding.is_equivalent_to(want_sharding, a.ndim), (a.sharding, want_sharding)
    check_rollout(sharded, mesh, rs)
    print("sharded RL step OK")


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
    rows = len(PROMPTS) // (mesh.shape["data"] * mesh.shape["fsdp"])  # replicated over expert
    for a in jax.tree.leaves(got.cache)[:-1]:  # K and V of each layer; the lengths last
        assert a.addressable_shards[0].data.shape[0] == rows, a.sharding


def split_in_halves(name: str, tree) -> list[str]:
    """Assert that every array of ``tree`` is held in halves by the two devices (and so, across
    two processes, that neither holds a whole one); NVFP4's per-expert global scales, one float
    per expert, excepted. Returns the paths of the arrays checked."""
    checked = []
    for path, a in jax.tree_util.tree_leaves_with_path(tree):
        key = f"{name}{jax.tree_util.keystr(path)}"
        where = f"{key}: {a.shape} {a.sharding}"
        if key.endswith("global_scale"):
            continue
        assert len(a.sharding.device_set) == 2, where
        assert {s.data.size * 2 for s in a.addressable_shards} == {a.size}, where
        assert a.is_fully_addressable == (jax.process_count() == 1), where
        checked.append(key)
    return checked


def check_batch_rows():
    """Host rows and the global batch on the (fsdp=2) and the (expert=2) mesh of the first two
    devices: each process gives its part of a batch (``place_rows``), reads it back
    (``process_rows``) and gathers the whole (``host_value``); where ``expert`` spans processes
    they hold the same part, all rows."""
    whole = np.arange(12).reshape(4, 3)
    for axes, parts in ((dict(fsdp=2), jax.process_count()), (dict(expert=2), 1)):
        with jax.set_mesh(make_mesh(**axes)):
            part = jax.process_index() if parts > 1 else 0
            assert batch_part() == (part, parts), (axes, batch_part())
            rows = np.split(whole, parts)[part]
            batch = place_rows(rows)
            assert batch.shape == whole.shape
            assert batch.is_fully_addressable == (jax.process_count() == 1)
            np.testing.assert_array_equal(process_rows(batch), rows)
            np.testing.assert_array_equal(host_value(batch), whole)


def check_loop(config: str, run_dir: str):
    """The RL loop of ``config`` (FSDP over the two devices) through the entry point's
    ``execute``: the rollout and evaluation engines' weights after every refit, and the final
    parameters and AdamW moments, are split in halves."""
    exp, cfg = resolve(config, [])
    assert cfg.mesh_fsdp == 2 and cfg.rollout == "fp4", cfg
    runs, refits = [], []

    def pipeline(cfg, run_dir):
        run = RLRun(cfg, run_dir)
        for engine in (run.engine, run.eval_engine):  # what each rollout runs with
            refit = engine.update_params

            def checked(model, version=None, engine=engine, refit=refit):
                refit(model, version)
                name = "eval" if engine.greedy else "rollout"
                refits.append((name, split_in_halves(name, engine.state)))

            engine.update_params = checked
        runs.append(run)
        return run.run()

    execute(dataclasses.replace(exp, run=pipeline), cfg, Path(run_dir))
    (run,) = runs
    assert [name for name, _ in refits].count("rollout") == cfg.steps, refits
    assert "eval" in dict(refits)
    for _, checked in refits:  # gate, up and down FP4 codes of every MoE layer
        codes = [k for k in checked if k.endswith(".codes")]
        assert len(codes) == 3 * len(run.model_cfg.moe_layers), checked
    state = run.final_state
    adam = state.opt_state[1][0]  # chain(clip, adamw): adamw's ScaleByAdamState
    for name, tree in {"params": state.params, "adam.mu": adam.mu, "adam.nu": adam.nu}.items():
        split_in_halves(name, tree)
    print(f"process {jax.process_index()}: {len(refits)} refits split in halves")
    print("sharded RL loop OK")


def main():
    joined = init_distributed()
    if sys.argv[1] == "one":
        assert not joined and jax.device_count() == 8, jax.devices()
        check_forward()
        check_steps()
    else:
        assert joined and jax.process_count() == jax.device_count() == 2, jax.devices()
        check_global_batch()
    check_batch_rows()
    check_loop(*sys.argv[2:4])


if __name__ == "__main__":
    main()
