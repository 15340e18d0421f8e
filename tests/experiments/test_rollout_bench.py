"""The rollout benchmark (experiments/bench/rollout.py): its arguments, the byte floor against
the issue's hand count, and tiny runs of each timing mode and of the per-step profile."""

import jax
import pytest
from flax import nnx

from experiments.bench import rollout
from trace_jax.model import ModelConfig
from trace_jax.rollout import RolloutEngine
from trace_jax.rollout import engine as engine_module

TINY = ["--preset", "tiny", "--layers", "1", "--batches", "2", "--prompt", "4", "--window", "2"]
# The FP4 engine of the window runs, the profile and the row that does not fit: their decode
# programs over a generation of 8 (4 + 8 slots, windows of 2) are one.
ENGINE = "w4a4-xla"


def test_arguments_and_their_one_line_errors(capsys):
    args = rollout.parse_args(["--batches", "64,32", "--gens", "1024,8192", "--engines", "w4a16"])
    assert args.batches == [32, 64] and args.gens == [1024, 8192] and args.engines == ["w4a16"]
    for bad, what in (
        (["--engines", "w4a16,fp2"], "unknown engine 'fp2'"),
        (["--batches", "32,x"], "--batches: expected comma-separated integers"),
        (["--batches", "0"], "--batches: must be positive"),
        (["--gens", "6", "--window", "4"], "--gens: each must be at least 2 x --window"),
        (["--prompt", "-1"], "--prompt: must be positive"),
        (["--mode", "stream"], "invalid choice: 'stream'"),
    ):
        with pytest.raises(SystemExit) as exit_:
            rollout.parse_args(bad)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert what in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit, match="model preset 'huge'"):
        rollout.main(["--preset", "huge"])


def test_floor_matches_the_issues_count():
    # Qwen3-30B-A3B layer shapes, 4 layers, batch 32, ~128 tokens of context, H100 (3.35 TB/s):
    # the issue counts ~0.59 ms a step for the FP4 engine and ~1.49 ms for the BF16 one.
    cfg = ModelConfig.preset("qwen3-30b-a3b").replace(num_layers=4)
    for engine, want_ms in (("w4a16", 0.59), ("bf16", 1.49)):
        total = sum(rollout.step_bytes(cfg, rollout.ENGINES[engine], 32, 128).values())
        assert total / 3.35e12 * 1e3 == pytest.approx(want_ms, rel=0.02)
    # an NVFP4 cache slot: 64 code bytes, 8 scale bytes and a 4-byte global scale per head
    assert rollout.kv_bytes_per_token(cfg, "nvfp4") == 2 * 4 * 76
    assert rollout.kv_bytes_per_token(cfg, "bf16") == 2 * 4 * 256
    # a buffer two leaves share (a prepacked weight's codes and its QTensor's) counts once
    a, b = jax.numpy.zeros((3, 4), "uint8"), jax.numpy.zeros((5,), "float32")
    assert rollout.device_bytes({"codes": a, "qtensor": {"codes": a}, "scale": b}) == 12 + 20


def test_window_and_full_runs(capsys):
    (res,) = rollout.main([*TINY, "--engines", ENGINE, "--gens", "8", "--repeats", "1"])
    (row,) = res["rows"]
    assert row["batch"] == 2 and row["gen"] == 8 and len(row["step_ms"]) == 3
    assert row["tokens_per_s"] > 0 and 0 < row["of_floor"] and row["floor_bytes"] > 0
    assert res["weights_bytes"] > 0 and res["memory"][0]["state_bytes"] > 0
    (res,) = rollout.main([*TINY, "--engines", "bf16", "--gens", "4", "--mode", "full"])
    (row,) = res["rows"]
    assert row["mode"] == "full" and len(row["step_ms"]) == 1 and row["tokens_per_s"] > 0
    out = capsys.readouterr().out
    assert "w4a4-xla         2      8" in out and "bf16             2      4" in out
    assert "floor bytes per decode step" in out
    assert f"device: {jax.devices()[0].device_kind} (HBM " in out
    # an engine stopped before it reported its device: the bandwidth counted says it is a default
    stopped = dict(engine=ENGINE, rows=[], memory=[], profile=[], error="stopped (time limit)")
    rollout.report([stopped], ModelConfig.preset("tiny"), rollout.parse_args(TINY))
    assert "device: unknown (HBM 4.80 TB/s counted: no engine reported its device)" in (
        capsys.readouterr().out
    )


def test_profile_reaches_every_stand_in(monkeypatch):
    # The full step is compiled and timed (the window runs' program); each ablated step is only
    # traced (the profile checks at trace time that its stand-in was reached), its time set to
    # half the full step's: compiling the 7 ablated programs took most of this file's time, and
    # the code that would time them times the full step.
    real_time, real_profile, times = rollout.time_window, rollout.profile, []

    def time_window(engine, batch, position, repeats, seed):
        if not times:
            times.append(real_time(engine, batch, position, repeats, seed))
            return times[0]
        state = rollout._synthetic(engine, batch, position, jax.random.key(seed))
        out = jax.eval_shape(engine.decode, state, jax.random.key(seed))
        assert out.generated.shape == state.generated.shape
        times.append(times[0] / 2)
        return times[-1]

    def profile(*args):
        with monkeypatch.context() as m:
            m.setattr(rollout, "time_window", time_window)
            return real_profile(*args)

    monkeypatch.setattr(rollout, "profile", profile)
    args = [*TINY, "--engines", ENGINE, "--gens", "8", "--repeats", "1", "--profile"]
    (res,) = rollout.main(args)
    parts = [p["part"] for p in res["profile"]]
    assert parts == ["step", *rollout.PARTS, "rest"]
    assert len(times) == 1 + len(rollout.PARTS)  # the full step, then each ablation
    assert res["profile"][0]["ms"] == 1e3 * times[0] > 0
    # a later engine built alike traces its own step (no ablated one stays cached for it)
    sampled, sample = [], engine_module.sample
    monkeypatch.setattr(engine_module, "sample", lambda *a: sampled.append(1) or sample(*a))
    spec, args = rollout.ENGINES[ENGINE], rollout.parse_args(args)
    model = rollout.build_model(rollout.model_config(args), spec, "triton", 0)
    eng = RolloutEngine(model, spec.policy, spec.rollout(4 + 8, 2, "triton"))
    jax.eval_shape(eng.decode, rollout._synthetic(eng, 2, 8, jax.random.key(0)), jax.random.key(0))
    assert sampled


def test_what_does_not_fit_is_a_row_of_its_own(monkeypatch):
    # a device that holds the weights and the state of a 4 + 8 slot cache, not of 4 + 16: the
    # one program for both generations does not fit, one per generation does for 8 tokens
    args = rollout.parse_args([*TINY, "--engines", ENGINE, "--gens", "8,16"])
    spec = rollout.ENGINES[ENGINE]
    model = rollout.build_model(rollout.model_config(args), spec, "triton", 0)
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    eng = RolloutEngine(model, spec.policy, spec.rollout(4 + 8, 2, "triton"))
    shapes = jax.tree.leaves(jax.eval_shape(lambda: eng.start(2)))
    state = sum(x.size * x.dtype.itemsize for x in shapes)
    memory = dict(peak_bytes_in_use=None, bytes_in_use=None, bytes_limit=weights + state)
    # the window's states are committed as a prefill's are (one decode program for both)
    st = rollout._synthetic(eng, 2, 4, jax.random.key(0))
    assert all(x.committed for x in jax.tree.leaves(st))
    # --compile-only's model: the built model's shapes, dtypes and structure
    shapes = rollout.abstract_model(rollout.model_config(args), spec, "triton", 0)
    want = jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(model))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(shapes)) == want
    monkeypatch.setattr(rollout, "_memory", lambda: memory)
    (res,) = rollout.main([*TINY, "--engines", ENGINE, "--gens", "8,16", "--repeats", "1"])
    fits, too_big = res["rows"]
    assert fits["gen"] == 8 and fits["tokens_per_s"] > 0
    assert too_big["gen"] == 16 and too_big["error"].startswith("does not fit")
