"""The guided-mismatch benchmark's breakdown finds a mismatch planted in the rollout's codes:
one element of one guided site, at a known row and token, shows up as exactly one more
mismatched element there and nowhere else."""

import dataclasses

import jax.numpy as jnp
import numpy as np
from tiny_rl import SMALL_RL

from experiments.__main__ import resolve
from experiments.bench import guided_mismatch
from trace_jax.guidance import GuidanceCache
from trace_jax.rl.loop import RLRun


def test_breakdown_finds_a_planted_mismatch(tmp_path):
    _, cfg = resolve(
        "configs/reasoning/fp4_trace_all.yaml", [*SMALL_RL, "steps=0", "code_metrics_rows=4"]
    )
    run = RLRun(dataclasses.replace(cfg, plot=False), tmp_path / "run")
    run.run()
    params = run.final_state.params
    problems = [run.io.problem("train", i) for i in range(cfg.prompts_per_step)]
    with GuidanceCache(tmp_path / "spill") as cache:
        batch, _, _ = run.collect(params, 0, problems, cache)
    guided = run.trainer.guided_sites
    before = guided_mismatch.mismatches(run, params, batch)

    rows = np.asarray(batch.code_rows)
    mask = np.asarray(batch.loss_mask)[rows]
    r = len(rows) - 1
    p = int(np.flatnonzero(mask[r])[-1])  # the last sampled token of the last recorded row
    site = sorted(n for n in batch.rollout_codes if n in guided)[0]
    qt = batch.rollout_codes[site]
    index = (r, p) + (0,) * (qt.codes.ndim - 2)
    # the low bit of the first element's code: its magnitude one codebook step away
    codes = qt.codes.at[index].set(qt.codes[index] ^ jnp.uint8(1))
    planted = dataclasses.replace(
        batch, rollout_codes={**batch.rollout_codes, site: dataclasses.replace(qt, codes=codes)}
    )
    after = guided_mismatch.mismatches(run, params, planted)
    diff = after[site] - before[site]
    assert diff[r, p] == 1 and np.sum(np.abs(diff)) == 1
    for name in before:
        if name not in (site, "far"):
            np.testing.assert_array_equal(after[name], before[name])

    rep0 = guided_mismatch.breakdown(run, params, batch, guided)
    rep = guided_mismatch.breakdown(run, params, planted, guided)
    hit = {w["row"]: w["guided_mismatched"] for w in rep["worst_rows"]}
    hit0 = {w["row"]: w["guided_mismatched"] for w in rep0["worst_rows"]}
    assert hit[int(rows[r])] == hit0.get(int(rows[r]), 0) + 1
    width = sum(int(np.prod(q.shape[2:])) for n, q in batch.rollout_codes.items() if n in guided)
    tokens = int(mask.sum())
    assert rep["tokens"] == tokens
    assert np.isclose(rep["guided_code_rate"] - rep0["guided_code_rate"], 1 / (tokens * width))
