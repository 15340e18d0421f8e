"""The RL loop: a killed run resumes to the same metrics (staleness, several updates per batch
and the KL reference included); every mode starts RL from one BF16 warm start; guidance under
staleness stays with its samples; multi-turn episodes keep environment tokens out of the loss and
aligned with what the environment said."""

import dataclasses
import json
import time

import jax
import numpy as np
import pytest
from flax import nnx
from tiny_rl import LONG_HORIZON

from experiments.__main__ import resolve
from trace_jax.config import ConfigError, from_dict
from trace_jax.guidance import GuidanceVersionError
from trace_jax.model import ModelConfig, Transformer, restore_params, save_params
from trace_jax.rl import loop
from trace_jax.rl.trainer import Trainer
from trace_jax.rollout import RolloutEngine


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
        guidance_path="host",  # through the cache:
        guidance_host_bytes=0,  # every guidance record goes through a tensorstore spill
        staleness=1,
        diagnostic=True,
        plot=False,
    )
    return from_dict(loop.RLConfig, {**base, **kw})


# The resume test's settings beyond small(): everything a resume must restore exactly.
HARD = dict(staleness=2, ppo_epochs=2, minibatches=2, loss={"kl_coef": 0.05})


def timing(key: str) -> bool:
    return key.endswith(("_s", "_ms"))


def records(run_dir):
    """The metrics of each step without the wall-clock ones, as JSON text (NaN compares equal)."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.append(json.dumps({k: v for k, v in r.items() if not timing(k)}, sort_keys=True))
    return out


class Killed(Exception):
    pass


STEPS = (
    Trainer.sft_step,
    Trainer.logprobs,
    Trainer.score,
    Trainer.gradient,
    Trainer.apply,
    RolloutEngine._decode,
)


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_metrics_of_an_uninterrupted_one(tmp_path, monkeypatch):
    cfg = small(**HARD)
    saved, real_save = [], loop.RunCheckpointer.save
    monkeypatch.setattr(
        loop.RunCheckpointer,
        "save",
        lambda self, step, *a: [saved.append(step), real_save(self, step, *a)],
    )
    loop.RLRun(cfg, tmp_path / "a", log=lambda *_: None).run()
    compiled = [step._cache_size() for step in STEPS]
    assert saved == [1, 3]  # every checkpoint_every steps and the last one, no more
    text = (tmp_path / "a" / "metrics.jsonl").read_text()
    raw = [json.loads(line) for line in text.splitlines()]
    want = records(tmp_path / "a")
    assert [r["step"] for r in raw] == list(range(4))
    assert "sft/loss" in raw[0] and "mismatch/logp_abs" in raw[1] and "eval/reward" in raw[2]
    assert raw[0]["sft/step_s"] > 0  # the warm start timed too
    assert raw[1]["compile_s"] > 0  # the first RL step compiles its programs
    assert raw[1]["guidance/bytes_per_token"] > 0
    # two versions stale: the first RL steps sample with the warm-started parameters; each
    # sample is trained with its own version's guidance: at lag 0 it gives the rollout's codes,
    # later the trainer's inputs also drift by the updates since (logged apart: the agreement)
    assert [r["policy_version_lag"] for r in raw[1:]] == [0, 1, 2]
    assert raw[1]["mismatch/guided_code_agreement"] > 0.99
    assert raw[1]["mismatch/code_rate/kv.k/0"] < 0.01 and "mismatch/d_act/kv.v/0" in raw[1]
    for r in raw[1:]:
        assert 0 < r["mismatch/guided_code_agreement"] <= 1 and r["loss/kl_ref"] >= 0
        # every phase timed; tokens/s counts the decode loop only
        for phase in (
            "rollout/refit_s",
            "rollout/prefill_s",
            "rollout/decode_s",
            "rollout/env_s",
            "guidance/transfer_s",
            "train/score_s",
            "train/forward_backward_s",
            "train/optimizer_s",
            "step_s",
        ):
            assert r[phase] > 0, phase
        generated = r["response_length"] * 4
        assert r["rollout/tokens_per_s"] * r["rollout/decode_s"] == pytest.approx(generated)
        assert r["reward/mixed_groups"] in (0.0, 0.5, 1.0)  # 2 groups of 2 samples
        # the loop's iterations: the longest of the 4 responses, at most max_new_tokens
        assert r["response_length"] <= r["rollout/decode_steps"] <= min(6, generated)
        assert r["rollout/decode_step_ms"] * r["rollout/decode_steps"] == pytest.approx(
            1e3 * r["rollout/decode_s"]
        )
    # the updates after the first leave the reference; a resumed run restores it (below)
    assert raw[1]["loss/kl_ref"] > 0

    # Kill the second run inside step 2, after the checkpoint of step 1.
    real_step = loop.RLRun.rl_step

    def dying(self, state, rollout_params, step, *a):
        if step == 2:
            raise Killed
        return real_step(self, state, rollout_params, step, *a)

    monkeypatch.setattr(loop.RLRun, "rl_step", dying)
    with pytest.raises(Killed):
        loop.RLRun(cfg, tmp_path / "b", log=lambda *_: None).run()
    assert [json.loads(r)["step"] for r in records(tmp_path / "b")] == [0, 1]
    monkeypatch.setattr(loop.RLRun, "rl_step", real_step)
    logs = []
    loop.RLRun(cfg, tmp_path / "b", log=logs.append).run()
    assert logs == ["resuming from the checkpoint of step 1"]
    assert records(tmp_path / "b") == want
    assert any((tmp_path / "b" / "tensorboard").iterdir())
    # The killed and the resumed run compiled nothing the first had not: the state restored
    # from a checkpoint is committed to its device, as a fresh run's is (a jitted program is
    # compiled per pattern of committed arguments)
    grown = [step._cache_size() - n for step, n in zip(STEPS, compiled, strict=True)]
    assert grown == [0] * len(STEPS), grown


def test_multi_turn_episodes_append_observations_outside_the_loss(tmp_path):
    # The engine of the CLI's long-horizon run (tests/experiments/test_cli.py): its programs.
    config, overrides = LONG_HORIZON
    run = loop.RLRun(resolve(config, overrides)[1], tmp_path, log=lambda *_: None)
    io, engine, max_turns = run.io, run.engine, run.cfg.max_turns
    problems = [io.problem("train", i) for i in range(4)]  # the run's batch
    state, rewards = io.rollout(engine, problems, jax.random.key(1), max_turns=max_turns)
    assert rewards.shape == (4,) and np.all((rewards >= 0) & (rewards <= 1))
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
        assert 1 <= turns <= max_turns


def params_of(folder):
    model = Transformer(ModelConfig.preset("tiny").replace(num_layers=1), nnx.Rngs(9))
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(restore_params(folder, model)))]


def test_every_mode_starts_rl_from_one_bf16_warm_start(tmp_path):
    """The warm start is BF16 whatever the mode (as a pretrained model would be): a
    warm-start-only run (``steps: 0``) writes ``policy/``; a run of another mode started from it
    with ``init_checkpoint`` begins RL from exactly those parameters."""
    quiet = dict(log=lambda *_: None)
    warm = dict(steps=0, eval_problems=0)
    loop.RLRun(small(**warm), tmp_path / "warm_trace", **quiet).run()
    loop.RLRun(small(**warm, train_mode="qat"), tmp_path / "warm_qat", **quiet).run()
    start = params_of(tmp_path / "warm_trace" / "policy")
    for a, b in zip(start, params_of(tmp_path / "warm_qat" / "policy"), strict=True):
        np.testing.assert_array_equal(a, b)
    # TRACE RL from the QAT run's warm start (small()'s programs, compiled once for the module)
    cfg = small(
        warm_start={"steps": 0},
        init_checkpoint=str(tmp_path / "warm_qat"),
        steps=1,
        eval_problems=0,
    )
    loop.RLRun(cfg, tmp_path / "trace", **quiet).run()
    for a, b in zip(start, params_of(tmp_path / "trace" / "policy"), strict=True):
        np.testing.assert_array_equal(a, b)
    # A policy of another model config is refused, naming the folder.
    other = tmp_path / "two_layers"
    save_params(other, Transformer(ModelConfig.preset("tiny").replace(num_layers=2), nnx.Rngs(0)))
    with pytest.raises(ConfigError, match=r"init_checkpoint: .*two_layers does not hold"):
        loop.RLRun(small(warm_start={"steps": 0}, init_checkpoint=str(other)), tmp_path / "x")
    with pytest.raises(ConfigError, match=r"init_checkpoint: .* is neither"):
        loop.RLRun(small(warm_start={"steps": 0}, init_checkpoint=str(tmp_path / "none")), "/x")


def test_an_fp4_run_evaluates_in_bf16_as_the_bf16_reference_does(tmp_path):
    """``eval_bf16``: an FP4-rollout run also evaluates with the BF16 reference's engine (its
    policy and config), so from one warm start both report the same BF16 reward before RL; the
    reference logs its own evaluation under both keys, with no second engine."""
    from trace_jax.model import QuantPolicy
    from trace_jax.rl import runlog

    quiet = dict(log=lambda *_: None)
    loop.RLRun(small(steps=0, eval_problems=0), tmp_path / "warm", **quiet).run()
    runs = {}
    for name, mode in {"bf16": dict(train_mode="bf16", rollout="bf16"), "trace": {}}.items():
        cfg = small(
            warm_start={"steps": 0},
            init_checkpoint=str(tmp_path / "warm"),
            steps=1,
            eval_bf16=True,
            **mode,
        )
        runs[name] = loop.RLRun(cfg, tmp_path / name, **quiet)
        runs[name].run()
    ref, fp4 = runs["bf16"], runs["trace"]
    assert ref.bf16_eval_engine is None and fp4.eval_engine.policy != QuantPolicy.bf16()
    assert fp4.bf16_eval_engine.policy == ref.eval_engine.policy == QuantPolicy.bf16()
    assert fp4.bf16_eval_engine.cfg == ref.eval_engine.cfg
    first = {n: runlog.read_metrics(tmp_path / n / "metrics.jsonl")[0] for n in runs}
    want = first["bf16"]["eval/reward_start"]
    assert first["bf16"]["eval/reward_bf16_start"] == want
    assert first["trace"]["eval/reward_bf16_start"] == want
    summary = runlog.summarize(runlog.read_metrics(tmp_path / "trace" / "metrics.jsonl"))
    assert summary["eval/reward_bf16_start"] == want and "eval/reward_bf16_end" in summary
    # The reference with its own warm start samples and trains as the one started from that warm
    # start's policy: RL's keys count from the first RL step.
    own = small(steps=1, eval_bf16=True, train_mode="bf16", rollout="bf16", eval_problems=0)
    loop.RLRun(own, tmp_path / "own", **quiet).run()
    from_policy = dataclasses.replace(ref.cfg, eval_problems=0)
    loop.RLRun(from_policy, tmp_path / "from_policy", **quiet).run()
    rl = lambda run: [json.loads(r) for r in records(tmp_path / run)][-1]  # noqa: E731
    mine, theirs = rl("own"), rl("from_policy")
    assert mine.pop("step") == 1 and theirs.pop("step") == 0
    assert mine == theirs


def test_guidance_under_a_corrupted_version_tag_is_refused(tmp_path, monkeypatch):
    """Under staleness 2 the samples of version v - 2 are trained with that version's guidance;
    guidance filed under any other version never reaches them."""
    from trace_jax.guidance import GuidanceCache

    real_put = GuidanceCache.put_batch

    def mislabelled(self, version, ids, records):
        return real_put(self, version + 1, ids, records)

    monkeypatch.setattr(GuidanceCache, "put_batch", mislabelled)
    cfg = small(warm_start={"steps": 0}, staleness=2)
    with pytest.raises(GuidanceVersionError, match="recorded under version"):
        loop.RLRun(cfg, tmp_path / "run", log=lambda *_: None).run()


def test_guidance_in_place_trains_as_guidance_through_the_cache(tmp_path):
    """The engine's records handed over on the device (``guidance_path=device``) and the same
    records through the cache and a tensorstore spill: one run, to the bit. (The second saves
    no checkpoint: ``checkpoint_every: 0``.)"""
    cfg = small(staleness=0, steps=2, eval_every=10)
    loop.RLRun(cfg, tmp_path / "host", log=lambda *_: None).run()
    device = dataclasses.replace(cfg, guidance_path="device", checkpoint_every=0)
    loop.RLRun(device, tmp_path / "device", log=lambda *_: None).run()
    host, dev = records(tmp_path / "host"), records(tmp_path / "device")
    assert len(dev) == 3 and dev == host
    saved = lambda run: sorted(p.name for p in (tmp_path / run / "checkpoints").glob("*"))  # noqa: E731
    assert saved("host") == ["1", "2"] and saved("device") == []
    last = json.loads((tmp_path / "device" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["guidance/bytes"] > 0 and "guidance/transfer_s" not in last


def test_configs_refuse_bad_combinations():
    with pytest.raises(ConfigError, match=r"train_mode: trace .* needs rollout: fp4"):
        small(train_mode="trace", rollout="bf16")
    with pytest.raises(ConfigError, match=r"loss\.is_cap"):
        small(loss={"is_cap": -1.0})
    with pytest.raises(ConfigError, match=r"task\.name: unknown task 'chess'"):
        loop.RLRun(small(task={"name": "chess"}), "/tmp/unused")
    with pytest.raises(ConfigError, match=r"routing_replay: train_mode trace needs it"):
        small(routing_replay=False)
    small(routing_replay=False, train_mode="qat")  # unguided modes may train without replay
    with pytest.raises(ConfigError, match=r"minibatches: 3 does not divide the batch of 4"):
        small(minibatches=3)
    with pytest.raises(ConfigError, match=r"init_checkpoint: .* warm_start\.steps: 0"):
        small(init_checkpoint="runs/x")
    with pytest.raises(ConfigError, match=r"top_p"):
        small(top_p=0.0)
    assert dataclasses.replace(small(), staleness=2).staleness == 2


def test_trimmed_width_by_hand():
    filled = np.arange(40)[None] < np.asarray([[3], [17], [9]])  # rows of 3, 17 and 9 slots
    assert loop.trimmed_width(filled) == 32  # 17 up to a multiple of 16
    assert loop.trimmed_width(filled, 8) == 24
    assert loop.trimmed_width(filled[:, :20], 16) == 20  # at most S
    assert loop.trimmed_width(filled[:1], 16) == 16


def test_mixed_groups_by_hand():
    rewards = np.array([0, 0, 0, 1, 1, 1, 0.5, 0.5, 0, 0, 0, 0])  # 4 groups of 3
    assert loop.mixed_groups(rewards, 3) == 0.25  # only the third group differs inside
    assert loop.mixed_groups(rewards, 4) == pytest.approx(2 / 3)
    assert loop.mixed_groups(np.ones(6), 2) == 0.0


def test_learning_rate_schedules_by_hand():
    cosine = loop.learning_rate(1e-3, 10, "cosine", 110)
    assert float(cosine(0)) == 0 and float(cosine(5)) == pytest.approx(5e-4)
    assert float(cosine(10)) == pytest.approx(1e-3) and float(cosine(110)) == pytest.approx(0)
    assert float(cosine(60)) == pytest.approx(5e-4, rel=1e-4)  # half-way down the cosine
    warm = loop.learning_rate(2e-5, 4, "constant", 0)
    assert [float(warm(i)) for i in (0, 2, 4, 100)] == pytest.approx([0, 1e-5, 2e-5, 2e-5])
    assert float(loop.learning_rate(3e-3, 0, "constant", 0)(7)) == pytest.approx(3e-3)


def test_scanned_layers_and_decode_reach_the_trainer_and_both_engines(tmp_path):
    over = {"num_layers": 1, "dtype": "bfloat16", "scan_layers": True}
    run = loop.RLRun(small(scan_decode=True, model_overrides=over), tmp_path, log=lambda *_: None)
    assert run.engine.cfg.scan_decode and run.eval_engine.cfg.scan_decode
    assert run.engine.model_cfg.scan_layers and run.trainer.cfg.scan_layers


def test_a_time_limited_run_ends_evaluated_and_checkpointed_and_resumes(tmp_path, monkeypatch):
    """``time_limit_min``: the step after which another would not fit is the last (evaluated,
    checkpointed); the same settings, limit or not, resume the run to its end."""
    run = loop.RLRun(small(time_limit_min=1.0), tmp_path / "probe", log=lambda *_: None)
    run.started, run.eval_s = time.monotonic() - 50, 5.0  # 50 s gone; an evaluation takes 5 s
    assert not run._out_of_time(1.0) and run._out_of_time(4.0)  # 50 + 2 x step + 5 vs 60 s
    assert not run._out_of_time(0.0)  # nothing timed yet: the first step always runs
    real = loop.RLRun._out_of_time
    monkeypatch.setattr(loop.RLRun, "_out_of_time", lambda self, s: bool(s) and s > 0)
    logs = []
    cfg = small(warm_start={"steps": 1, "batch": 4}, steps=2, eval_every=5, time_limit_min=1.0)
    assert loop.RLRun(cfg, tmp_path / "run", log=logs.append).run()["complete"] is False
    raw = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in raw] == [0, 1] and "eval/reward" in raw[1]
    assert logs[-1].startswith("time_limit_min: stopping after step 2 of 3")
    monkeypatch.setattr(loop.RLRun, "_out_of_time", real)
    assert loop.RLRun(dataclasses.replace(cfg, time_limit_min=0.0), tmp_path / "run").run()[
        "complete"
    ]
    raw = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in raw] == [0, 1, 2] and "eval/reward" in raw[2]


def test_the_greedy_evaluation_records_nothing_and_decodes_as_the_rollout(tmp_path):
    """Every FP4 mode evaluates with one engine policy, the naive FP4 rollout's (no records), and
    it decodes greedily what the TRACE rollout's policy (recording guidance) decodes."""
    from trace_jax.model import QuantPolicy

    modes = {m: small(train_mode=m) for m in ("bf16", "qat", "trace", "trace_all")}
    assert loop.eval_policy(small(train_mode="bf16", rollout="bf16")) == QuantPolicy.bf16()
    naive = loop.rollout_policy(modes["bf16"])  # FP4 rollout, BF16 trainer: records nothing
    assert {loop.eval_policy(c) for c in modes.values()} == {naive}

    run = loop.RLRun(modes["trace"], tmp_path / "run", log=lambda *_: None)
    model = run.trainer.model(run.trainer.init().params)
    recording = RolloutEngine(model, run.rollout_policy, run.eval_engine.cfg, greedy=True)
    run.eval_engine.update_params(model)
    prompts = [run.io.tok.prompt_ids(run.io.problem("eval", i).prompt) for i in range(4)]
    key = jax.random.key(0)
    got = run.eval_engine.generate(prompts, key)
    want = recording.generate(prompts, key)
    assert not any(not k.endswith(".codes") for k in got.guidance)
    assert any(not k.endswith(".codes") for k in want.guidance)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
