"""Seconds of TRACE's guidance data path for one rollout batch at a preset's shapes: the
rollout's records (device) into the guidance cache (host), read back as the trainer's batch and
put on the device, as the RL loop does each step (``RLRun._guidance``).

    PYTHONPATH=. python3 experiments/bench/guidance_path.py --preset medium --batch 1024 --slots 64

The records are those the rollout engine keeps for the preset with TRACE guiding the deeper half
(shapes from the model's forward, zero-filled on the default device). Prints the bytes, then per
repeat the seconds of ``put_batch``, ``get`` and ``device_put``; the first repeat includes the
allocations that later ones reuse.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.guidance import GuidanceCache
from trace_jax.model import ModelConfig, QuantPolicy, Transformer


def rollout_records(cfg: ModelConfig, policy: QuantPolicy, batch: int, slots: int) -> dict:
    """Zero-filled device records [batch, slots, ...] of every site ``policy`` records."""
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(model)

    def records(state, tokens):
        return nnx.merge(graphdef, state)(tokens, policy=policy).records

    shapes = jax.eval_shape(records, state, jax.ShapeDtypeStruct((batch, slots), jnp.int32))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--batch", type=int, default=1024, help="sequences")
    ap.add_argument("--slots", type=int, default=64, help="token slots a sequence")
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--guided", default="last_half", help="guided_layers")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    cfg = ModelConfig.preset(a.preset)
    policy = QuantPolicy.rollout(a.fmt, guided_layers=a.guided)
    recs = rollout_records(cfg, policy, a.batch, a.slots)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(recs))
    print(
        f"{a.preset}, {a.batch} x {a.slots} slots, {a.fmt} guided {a.guided}: {len(recs)} sites, "
        f"{nbytes / 2**20:.1f} MiB, on {jax.devices()[0].device_kind}"
    )
    ids = list(range(a.batch))
    with tempfile.TemporaryDirectory() as spill, GuidanceCache(spill) as cache:
        for version in range(a.repeats):
            # fresh device arrays each time (a jax.Array keeps its host copy once made)
            batch = jax.block_until_ready(jax.tree.map(jnp.copy, recs))
            t0 = time.perf_counter()
            cache.put_batch(version, ids, batch)
            t1 = time.perf_counter()
            host = cache.get(version, ids)
            t2 = time.perf_counter()
            jax.block_until_ready(jax.device_put(host))
            t3 = time.perf_counter()
            cache.evict(version_below=version)
            print(
                f"put_batch {t1 - t0:.4f} s, get {t2 - t1:.4f} s, device_put {t3 - t2:.4f} s, "
                f"all {t3 - t0:.4f} s"
            )


if __name__ == "__main__":
    main()
