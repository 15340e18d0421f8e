"""Trainer-vs-rollout log-prob mismatch of one policy, by rollout batch size and by expert
matmul: where a mismatch beyond the precision's floor comes from.

The config's warm start runs first (``steps=0``, in a temporary run directory); then, for each
``--prompts`` count P, a rollout batch of P x ``group_size`` sequences is drawn by the run's
engine (its experts through JAX's Hopper kernels where they apply, then through XLA's form) and
scored by the run's trainer over the whole batch and in chunks of ``--chunk`` sequences (again
with either expert matmul). Each line gives the RL loop's mismatch metrics of that pair (mean,
p99 and max |log-prob difference| over the sampled tokens, kl_k3, the share of tokens whose
router picks other experts than the rollout's), the largest |difference| between the whole and
the chunked scores, and the mean |difference| at the first sampled token and after it. With one
precision on both sides (BF16 rollout and trainer) the mismatch is the floor of the two sides'
summation orders; a batch size or a kernel that moves it far above that floor is a fault.

    python3 experiments/bench/rl_mismatch.py configs/reasoning/medium.yaml --prompts 32,128
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.grouped_matmul import expert_kernels
from experiments.runner import deterministic_flags, resolve
from trace_jax.guidance import GuidanceCache
from trace_jax.rl.loop import RLRun
from trace_jax.rl.trainer import RLBatch


def _first_sampled(mask: jax.Array) -> jax.Array:
    """[B, S] bool: each sequence's first sampled slot."""
    return mask & (jnp.cumsum(mask, axis=1) == 1)


def _mean(values: jax.Array, mask: jax.Array) -> float:
    return float(jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(jnp.sum(mask), 1))


def score_report(run: RLRun, params, batch: RLBatch, chunk: int) -> dict[str, float]:
    """The loop's mismatch metrics of ``batch`` under ``run``'s trainer, and its whole-batch
    scores against chunked ones."""
    logp, m = run.trainer.score(params, batch)
    out = {k: float(v) for k, v in m.items() if k.startswith("mismatch/") and k.count("/") == 1}
    out["train/entropy"] = float(m["train/entropy"])  # a sharper policy, larger |log p| gaps
    mask = batch.loss_mask
    diff = jnp.abs(logp - batch.rollout_logp)
    first = _first_sampled(mask)
    out["logp_abs/first_token"] = _mean(diff, first)
    out["logp_abs/later_tokens"] = _mean(diff, mask & ~first)
    parts = []
    for lo in range(0, batch.size, chunk):
        rows = jnp.arange(lo, min(lo + chunk, batch.size))
        part = batch.take(rows)
        parts.append(run.trainer.score(params, part)[0])
    chunked = jnp.concatenate(parts)
    out["whole_vs_chunked_max"] = float(jnp.max(jnp.where(mask, jnp.abs(logp - chunked), 0.0)))
    out["tokens"] = int(jnp.sum(mask))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key=value, as `python -m experiments run`")
    ap.add_argument(
        "--prompts", default="32,128", help="prompts per rollout batch, comma-separated"
    )
    ap.add_argument("--chunk", type=int, default=128, help="sequences per chunked scoring call")
    ap.add_argument("--json", default="", help="write the lines here too")
    args = ap.parse_args()
    _, cfg = resolve(args.config, args.overrides)
    cfg = dataclasses.replace(cfg, steps=0, plot=False, checkpoint_every=10**9)
    if cfg.deterministic:  # as the run's entry point sets it, before the backend starts
        os.environ["XLA_FLAGS"] = deterministic_flags(os.environ.get("XLA_FLAGS", ""), False, None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        run = RLRun(cfg, f"{tmp}/run")
        print(f"warm start ({cfg.warm_start.steps} steps): {run.run()['last']}", flush=True)
        params = run.final_state.params
        with GuidanceCache(f"{tmp}/spill") as cache:
            for p in [int(x) for x in args.prompts.split(",")]:
                problems = [run.io.problem("train", i) for i in range(p)]
                for rollout_kernels in (True, False):
                    jax.clear_caches()
                    with expert_kernels(rollout_kernels):
                        batch, rewards, _ = run.collect(params, 0, problems, cache)
                    for train_kernels in (True, False):
                        jax.clear_caches()
                        with expert_kernels(train_kernels):
                            rep = score_report(run, params, batch, args.chunk)
                        line = {
                            "prompts": p,
                            "sequences": batch.size,
                            "rollout_kernels": rollout_kernels,
                            "trainer_kernels": train_kernels,
                            "reward": float(np.mean(rewards)),
                            **rep,
                        }
                        rows.append(line)
                        print(json.dumps(line), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    keys = [
        "mismatch/logp_abs",
        "mismatch/logp_abs_p99",
        "mismatch/logp_abs_max",
        "mismatch/kl_k3",
        "mismatch/route_rate",
        "logp_abs/first_token",
        "logp_abs/later_tokens",
        "whole_vs_chunked_max",
        "train/entropy",
    ]
    print("\n| sequences | rollout kernels | trainer kernels | " + " | ".join(keys) + " |")
    print("|" + " --- |" * (3 + len(keys)))
    for r in rows:
        cells = [f"{r.get(k, float('nan')):.3g}" for k in keys]
        head = [str(r["sequences"]), str(r["rollout_kernels"]), str(r["trainer_kernels"])]
        print("| " + " | ".join(head + cells) + " |")


if __name__ == "__main__":
    main()
