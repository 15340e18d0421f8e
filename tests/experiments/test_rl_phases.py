"""The per-phase table of RL runs (experiments/bench/rl_phases.py): medians after each part's
first step (which compiles), the last values of the learning signals."""

import json

from experiments.bench import rl_phases


def test_medians_skip_each_parts_first_step(tmp_path, capsys):
    records = [{"step": 0, "sft/loss": 5.0, "sft/step_s": 30.0}]
    records += [{"step": i, "sft/loss": 4.0, "sft/step_s": s} for i, s in ((1, 0.3), (2, 0.5))]
    records += [
        {
            "step": 3,
            "reward": 0.1,
            "step_s": 90.0,
            "rollout/decode_s": 60.0,
            "eval/reward_start": 0.25,
        },
        {"step": 4, "reward": 0.2, "step_s": 2.0, "rollout/decode_s": 1.0, "eval/reward": 0.3},
        {"step": 5, "reward": 0.4, "step_s": 4.0, "rollout/decode_s": 1.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    row = rl_phases.phase_table(tmp_path)
    assert row["sft_steps"] == 3 and row["sft/step_s"] == 0.4  # median of 0.3 and 0.5
    assert row["rl_steps"] == 3 and row["step_s"] == 3.0 and row["rollout/decode_s"] == 1.25
    assert row["last reward"] == 0.4 and row["last eval/reward"] == 0.3
    assert row[rl_phases.OUTSIDE_DECODE] == 1.75  # median of 2 - 1 and 4 - 1.5
    assert rl_phases.eval_curve(tmp_path) == [(0, 0.25), (2, 0.3)]
    assert rl_phases.eval_curve(tmp_path, "eval/reward_bf16") == []
    # each process's device and commit, from the run's provenance
    line = {"first_step": 2, "commit": "0123456789", "dirty": True, "device": "Some GPU"}
    (tmp_path / "provenance.jsonl").write_text(json.dumps(line) + "\n")
    assert rl_phases.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path.name} from step 2: Some GPU, commit 0123456 +dirty" in out


def test_trace_step_time_against_qat(tmp_path):
    runs, rows = {}, {}
    for name, experiment, step in (
        ("q", "fp4_qat", 2.0),
        ("t", "fp4_trace", 2.1),
        ("b", "bf16_rollout", 1.0),
    ):
        d = tmp_path / name
        d.mkdir()
        (d / "config.yaml").write_text(f"experiment: {experiment}\nseed: 0\n")
        runs[name], rows[name] = d, {"step_s": step}
    (line,) = rl_phases.overheads(runs, rows)
    assert line.startswith("t (fp4_trace) against q (fp4_qat)") and line.endswith("+5.0 %")
    rows["q"] |= {rl_phases.OUTSIDE_DECODE: 1.6, "rollout/decode_step_ms": 5.0}
    rows["t"] |= {rl_phases.OUTSIDE_DECODE: 1.64, "rollout/decode_step_ms": 4.5}
    (line,) = rl_phases.overheads(runs, rows)
    assert line.endswith(
        "+5.0 %; outside the decode loop 1.64 s against 1.6 s, +2.5 %; "
        "per decode iteration 4.5 ms against 5 ms, -10.0 %"
    )
