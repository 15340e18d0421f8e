"""Where the trainer's codes leave the rollout's at guided sites: one rollout batch of a TRACE
mode, per rollout backend, broken down by layer, by token position and by sequence.

The config's warm start runs first (``steps=0``, or ``init_checkpoint=`` a policy); then, for
each ``--backends`` entry, an engine of the run's config with that backend (and Pallas kernels,
when named) rolls out ``--prompts`` prompts x ``group_size`` samples, recording every site's
codes for ``code_metrics_rows`` sequences, and the run's trainer scores the batch with the
rollout's guidance and routes (the RL loop's ``score`` pass). Guided rounding reproduces the
rollout's code wherever the trainer's input lies within one code step of it (TRACE.md section
3), so a mismatch at a guided site marks a trainer input that moved farther: the tables say at
which layers, at which positions (the first sampled token, later ones, the last slots of the
cache) and in which sequences (by length, whether the budget ended them) they sit. On the CPU
(XLA's arithmetic and the interpreted kernels' alike) guided mismatches are rare and all two or
more steps apart (tests/rollout/test_engine.py); a GPU backend far above that is the kernels'
arithmetic, and the breakdown says where to look.

    python3 experiments/bench/guided_mismatch.py configs/reasoning/medium.yaml \
        experiment=fp4_trace_all --prompts 32 --backends pallas,xla
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import tempfile

import jax
import numpy as np

from experiments.runner import deterministic_flags, resolve
from trace_jax import fp4
from trace_jax.guidance import GuidanceCache
from trace_jax.rl import metrics
from trace_jax.rl.loop import RLRun
from trace_jax.rollout.engine import RolloutEngine


@functools.partial(jax.jit, static_argnums=0)
def _trainer_records(trainer, params, batch) -> dict:
    """The trainer's forward over ``batch`` recording its codes: its records (one program)."""
    return trainer._forward(params, batch, record_codes=True).records


def mismatches(run: RLRun, params, batch) -> dict[str, np.ndarray]:
    """site name -> [R, S] int: elements per token whose trainer code differs from the
    rollout's (+0 and -0 equal), for the batch's ``code_rows``; and "far" -> the same counting
    only those two or more codebook steps apart (summed over sites)."""
    records = _trainer_records(run.trainer, params, batch)
    rows = batch.code_rows
    per_site, far = {}, 0
    for name, rollout in sorted(batch.rollout_codes.items()):
        train = fp4.take_rows(records[name + ".codes"], rows)
        q_t, q_r = fp4.code_values(train), fp4.code_values(rollout)
        steps = np.abs(
            np.asarray(metrics.signed_code_index(q_t)) - np.asarray(metrics.signed_code_index(q_r))
        )
        steps = steps.reshape(*steps.shape[:2], -1)
        per_site[name] = np.sum(steps > 0, axis=-1)
        far = far + np.sum(steps > 1, axis=-1)
    per_site["far"] = far
    return per_site


def breakdown(run: RLRun, params, batch, guided: frozenset[str]) -> dict:
    """The tables' numbers for one scored batch (see the module docstring)."""
    counts = mismatches(run, params, batch)
    far = counts.pop("far")
    rows = np.asarray(batch.code_rows)
    mask = np.asarray(batch.loss_mask)[rows]
    lengths = np.asarray(batch.filled)[rows].sum(1)
    # elements of one token of each site (the record's shape past [B, S])
    elems = {n: int(np.prod(batch.rollout_codes[n].shape[2:])) for n in counts}
    g_names = [n for n in counts if n in guided]
    g_count = sum(counts[n] for n in g_names) if g_names else np.zeros_like(mask, int)
    g_width = sum(elems[n] for n in g_names)
    first = mask & (np.cumsum(mask, axis=1) == 1)
    slot = np.arange(mask.shape[1])[None]
    tail = mask & (slot >= run.max_len - 16)

    def rate(where):
        n = int(np.sum(where)) * g_width
        return (float(np.sum(np.where(where, g_count, 0)) / n) if n else float("nan")), int(
            np.sum(where)
        )

    report = {"tokens": int(mask.sum()), "guided_sites": len(g_names)}
    report["guided_code_rate"], _ = rate(mask)
    report["far_share"] = float(
        np.sum(np.where(mask, far, 0)) / max(np.sum(np.where(mask, sum(counts.values()), 0)), 1)
    )
    report["first_token"] = rate(first)
    report["later_tokens"] = rate(mask & ~first)
    report["last_16_slots"] = rate(tail)
    by_layer = {}
    for n in g_names:
        site, layer = metrics.site_key(n)
        c = np.sum(np.where(mask, counts[n], 0)) / max(int(mask.sum()) * elems[n], 1)
        by_layer.setdefault(int(layer), {})[site] = float(c)
    report["by_layer"] = dict(sorted(by_layer.items()))
    per_row = np.sum(np.where(mask, g_count, 0), axis=1)
    budget_end = mask.sum(1) >= run.cfg.max_new_tokens
    order = np.argsort(-per_row)[:8]
    report["worst_rows"] = [
        {
            "row": int(rows[i]),
            "length": int(lengths[i]),
            "sampled": int(mask[i].sum()),
            "budget_ended": bool(budget_end[i]),
            "guided_mismatched": int(per_row[i]),
            "tokens_hit": int(np.sum((g_count[i] > 0) & mask[i])),
        }
        for i in order
    ]
    report["rows_hit"] = int(np.sum(per_row > 0))
    report["rows"] = len(rows)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key=value, as `python -m experiments run`")
    ap.add_argument("--prompts", type=int, default=32, help="prompts in the rollout batch")
    ap.add_argument(
        "--backends",
        default="pallas,xla",
        help="rollout backends, comma-separated; pallas:K1+K2 names the engine's kernels "
        "(moe, attention, attention_tc), e.g. pallas:moe,pallas:attention",
    )
    ap.add_argument("--json", default="", help="write the reports here too")
    args = ap.parse_args()
    _, cfg = resolve(args.config, args.overrides)
    cfg = dataclasses.replace(cfg, steps=0, plot=False, checkpoint_every=10**9)
    if not cfg.code_metrics:
        raise SystemExit(
            "guided_mismatch: the config records no codes (an FP4 rollout and a "
            "QAT/TRACE trainer with code_metrics_rows > 0)"
        )
    if cfg.deterministic:
        os.environ["XLA_FLAGS"] = deterministic_flags(os.environ.get("XLA_FLAGS", ""), False, None)
    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        run = RLRun(cfg, f"{tmp}/ws")
        print(f"warm start ({cfg.warm_start.steps} steps): {run.run()['last']}", flush=True)
        params = run.final_state.params
        problems = [run.io.problem("train", i) for i in range(args.prompts)]
        with GuidanceCache(f"{tmp}/spill") as cache:
            for variant in args.backends.split(","):
                backend, _, kernels = variant.partition(":")
                ecfg = dataclasses.replace(run.engine.cfg, backend=backend)
                if kernels:
                    ecfg = dataclasses.replace(ecfg, kernels=tuple(kernels.split("+")))
                engine = RolloutEngine(run.trainer.model(params), run.rollout_policy, ecfg)
                batch, rewards, _ = run.collect(params, 0, problems, cache, engine=engine)
                rep = breakdown(run, params, batch, run.trainer.guided_sites)
                rep["reward"] = float(np.mean(rewards))
                reports[variant] = rep
                print(variant, json.dumps(rep), flush=True)
                del engine, batch
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    print(
        "\n| rollout | guided code_rate | far share | first token | later tokens | last 16 slots "
        "| rows hit | tokens |"
    )
    print("|" + " --- |" * 8)
    for b, r in reports.items():
        cells = [f"{r['guided_code_rate']:.2e}", f"{r['far_share']:.3f}"]
        cells += [
            f"{r[k][0]:.2e} ({r[k][1]})" for k in ("first_token", "later_tokens", "last_16_slots")
        ]
        cells += [f"{r['rows_hit']}/{r['rows']}", str(r["tokens"])]
        print(f"| {b} | " + " | ".join(cells) + " |")
    for b, r in reports.items():
        print(f"\n{b}: guided code_rate by layer and site")
        for layer, sites in r["by_layer"].items():
            print(f"  {layer:3d} " + "  ".join(f"{s} {v:.2e}" for s, v in sorted(sites.items())))
        print(f"{b}: rows with the most guided mismatches")
        for w in r["worst_rows"]:
            print("  " + json.dumps(w))


if __name__ == "__main__":
    main()
