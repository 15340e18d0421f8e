"""The entry point runs a config end to end and refuses bad configs before any work."""

import json

import pytest
import yaml
from tiny_rl import LONG_HORIZON

from experiments.__main__ import main


def test_default_config_runs_and_writes_its_run_directory(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = main(["run", "configs/default.yaml", "rows=32", "cols=64", "--run-dir", str(run_dir)])
    assert rc == 0
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["experiment"] == "fp4_formats" and resolved["rows"] == 32
    results = json.loads((run_dir / "results.json").read_text())
    for v in results["errors"].values():
        assert (
            0 < v["rel_error"] < 0.3 and 4.25 <= v["bits_per_element"] <= 4 + 8 / 16 + 32 / 64
        )  # + a row scale
    for v in results["agreement"].values():
        # Guidance reproduces the rollout's codes at least as often as RTN does.
        assert v["guided_code_match"] >= v["rtn_code_match"]
        assert v["guided_d_act"] <= v["rtn_d_act"]
    assert (run_dir / "error_histograms.png").stat().st_size > 0
    assert "code match RTN" in capsys.readouterr().out


def test_bad_override_fails_before_any_work(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = main(["run", "configs/default.yaml", "colz=64", "--run-dir", str(run_dir)])
    assert rc == 2 and not run_dir.exists()
    assert "colz" in capsys.readouterr().err
    rc = main(["run", "configs/default.yaml", "cols=65", "--run-dir", str(run_dir)])
    assert rc == 2 and "cols: 65" in capsys.readouterr().err


def test_every_config_file_resolves():
    from pathlib import Path

    from experiments.__main__ import resolve
    from trace_jax.rl.loop import RLConfig
    from trace_jax.rl.tasks_io import TaskIO

    paths = sorted(p for p in Path("configs").rglob("*.yaml") if p.parent.name != "sweeps")
    assert len(paths) >= 3 + 3 * 6
    for path in paths:
        exp, cfg = resolve(str(path), [])
        assert exp.config_cls is type(cfg)
        if isinstance(cfg, RLConfig):  # the task and its knobs exist, sequences fit
            io = TaskIO(cfg.task.name, cfg.task.args)
            assert io.max_len(cfg.max_new_tokens, cfg.max_turns) > cfg.max_new_tokens


def test_every_sweep_file_resolves_and_shared_warm_starts_agree():
    from pathlib import Path

    from experiments.sweep import load_sweep, resolved

    warm_starts: dict[Path, dict] = {}
    sweeps = sorted(Path("configs/sweeps").glob("*.yaml"))
    assert sweeps
    for path in sweeps:
        sweep = load_sweep(str(path))  # every cell's config resolves
        assert sweep.cells
        # sweeps naming one warm start folder must agree on it, or the second would be refused
        ws = warm_starts.setdefault(sweep.warm_start_dir, resolved(sweep.warm_start))
        assert ws == resolved(sweep.warm_start), path


@pytest.mark.slow
def test_trace_mismatch_runs_and_guidance_shrinks_the_mismatch(tmp_path, capsys):
    run_dir = tmp_path / "run"
    # The three modes' trainer forwards are those of notebooks/trace_rl_quickstart.ipynb (its
    # 2-layer model, batch of 4 sequences of 26 slots): one compiled program each for both.
    args = ["batch=4", "prompt_len=14", "max_new_tokens=12", "model_overrides={num_layers: 2}"]
    args += ["--run-dir", str(run_dir)]
    assert main(["run", "configs/trace_mismatch.yaml", *args]) == 0
    results = json.loads((run_dir / "results.json").read_text())
    none, every = results["none"], results["all"]
    assert every["mismatch/logp_abs"] < none["mismatch/logp_abs"]
    # what guidance leaves is two or more code steps apart (a share of 1 of the mismatches)
    assert every["mismatch/code_rate/guided"] == 0 or every["mismatch/code_far/guided"] == 1
    assert none["mismatch/code_rate/all"] > every["mismatch/code_rate/all"]
    assert none["guidance/bytes_per_token"] == 0 < every["guidance/bytes_per_token"]
    assert (run_dir / "code_rate_per_layer.png").stat().st_size > 0
    assert "logp_abs" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_scripts_print_their_tables(capsys):
    # the rollout benchmark's own tests: tests/experiments/test_rollout_bench.py
    from experiments.bench import guidance_size

    guidance_size.main(["--presets", "tiny", "qwen3-30b-a3b"])
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b" in out and "full/compact" in out


@pytest.mark.slow
def test_a_multi_turn_rl_run_and_its_comparison(tmp_path, capsys):
    # post-hoc quantization (ptq_scale_rules): tests/experiments/test_hf_run.py, at the shapes
    # of its other run
    config, extra = LONG_HORIZON
    run_dir = tmp_path / "run"
    assert main(["run", config, *extra, "--run-dir", str(run_dir)]) == 0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2]
    assert (run_dir / "curves.png").stat().st_size > 0
    assert main(["compare", str(run_dir), "--out", str(tmp_path / "cmp.png")]) == 0
    out = capsys.readouterr().out
    assert str(run_dir) in out and (tmp_path / "cmp.png").stat().st_size > 0
