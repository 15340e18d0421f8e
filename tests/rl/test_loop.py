"""The RL loop: a killed run resumes to the same metrics; multi-turn episodes keep environment
tokens out of the loss and aligned with what the environment said."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax.config import ConfigError, from_dict
from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.rl import loop
from trace_jax.rl.tasks_io import TaskIO
from trace_jax.rollout import RolloutConfig, RolloutEngine

TIMING = ("rollout/s", "rollout/tokens_per_s", "train/step_s")


def small(**kw) -> loop.RLConfig:
    base = dict(
        model="tiny",
        model_overrides={"num_layers": 1, "dtype": "bfloat16"},
        steps=3,
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=6,
        warm_start={"steps": 1, "batch": 4},
        eval_every=2,
        eval_problems=4,  # a rollout batch: the greedy evaluation prefills with its program
        checkpoint_every=2,
        guidance_host_bytes=0,  # every guidance record goes through a tensorstore spill
        staleness=1,
        diagnostic=True,
        plot=False,
    )
    return from_dict(loop.RLConfig, {**base, **kw})


def records(run_dir):
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.append({k: v for k, v in r.items() if k not in TIMING})
    return out


class Killed(Exception):
    pass


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_metrics_of_an_uninterrupted_one(tmp_path, monkeypatch):
    cfg = small()
    loop.RLRun(cfg, tmp_path / "a", log=lambda *_: None).run()
    want = records(tmp_path / "a")
    assert [r["step"] for r in want] == list(range(4))
    assert "sft/loss" in want[0] and "mismatch/logp_abs" in want[1] and "eval/reward" in want[2]
    assert want[1]["guidance/bytes_per_token"] > 0
    # one version stale: the first RL step samples with the warm-started parameters, as does
    # the second; diagnostic mode logs per-site code metrics of the guided layer
    assert [r["policy_version_lag"] for r in want[1:]] == [0, 1, 1]
    assert want[1]["mismatch/code_rate/kv.k/0"] < 0.01 and "mismatch/d_act/kv.v/0" in want[1]
    assert want[1]["mismatch/route_rate"] == 0.0  # routing replay

    # Kill the second run inside step 2, after the checkpoint of step 1.
    real_step = loop.RLRun.rl_step

    def dying(self, state, rollout_params, step, *a):
        if step == 2:
            raise Killed
        return real_step(self, state, rollout_params, step, *a)

    monkeypatch.setattr(loop.RLRun, "rl_step", dying)
    with pytest.raises(Killed):
        loop.RLRun(cfg, tmp_path / "b", log=lambda *_: None).run()
    assert [r["step"] for r in records(tmp_path / "b")] == [0, 1]
    monkeypatch.setattr(loop.RLRun, "rl_step", real_step)
    logs = []
    loop.RLRun(cfg, tmp_path / "b", log=logs.append).run()
    assert logs == ["resuming from the checkpoint of step 1"]
    assert records(tmp_path / "b") == want
    assert any((tmp_path / "b" / "tensorboard").iterdir())


def test_multi_turn_episodes_append_observations_outside_the_loss():
    io = TaskIO("long_horizon", {"size": 4, "num_checkpoints": 0, "min_path": 2, "max_turns": 8})
    cfg = ModelConfig.preset("tiny").replace(num_layers=1)
    engine = RolloutEngine(
        Transformer(cfg, nnx.Rngs(0)),
        QuantPolicy.rollout(),
        RolloutConfig(
            max_len=io.max_len(4, 5),
            max_new_tokens=4,
            kv_cache="nvfp4",
            stop_tokens=io.stop_tokens,
        ),
    )
    problems = [io.problem("train", i) for i in range(3)]
    state, rewards = io.rollout(engine, problems, jax.random.key(1), max_turns=5)
    assert rewards.shape == (3,) and np.all((rewards >= 0) & (rewards <= 1))
    tokens, gen = np.asarray(state.tokens), np.asarray(state.generated)
    for b, p in enumerate(problems):
        # Replay the policy's turns through a fresh environment: the tokens between them are
        # exactly its observations, and none of them is marked as generated.
        env = io.task.env(p)
        env.reset(p)
        n = int(state.lengths[b])
        prompt = len(io.tok.prompt_ids(p.prompt))
        assert not gen[b, :prompt].any() and not gen[b, n:].any()
        pos, turns = prompt, 0
        while pos < n:
            end = pos
            while end < n and gen[b, end]:
                end += 1
            assert end > pos, "every turn starts with policy tokens"
            obs, done, _ = env.step(
                io.tok.decode(tokens[b, pos:end][gen[b, pos:end]], errors="replace")
            )
            turns += 1
            ids = io.tok.encode(obs)
            if done or end == n:
                break
            np.testing.assert_array_equal(tokens[b, end : end + len(ids)], ids)
            pos = end + len(ids)
        assert 1 <= turns <= 5


def test_configs_refuse_bad_combinations():
    with pytest.raises(ConfigError, match=r"train_mode: trace .* needs rollout: fp4"):
        small(train_mode="trace", rollout="bf16")
    with pytest.raises(ConfigError, match=r"loss\.is_cap"):
        small(loss={"is_cap": -1.0})
    with pytest.raises(ConfigError, match=r"task\.name: unknown task 'chess'"):
        loop.RLRun(small(task={"name": "chess"}), "/tmp/unused")
    assert dataclasses.replace(small(), staleness=2).staleness == 2
