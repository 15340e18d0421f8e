"""The entry point runs a config end to end and refuses bad configs before any work."""

import json

import yaml

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

    for path in sorted(Path("configs").glob("*.yaml")):
        exp, cfg = resolve(str(path), [])
        assert exp.config_cls is type(cfg)
