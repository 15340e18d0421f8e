"""Run directories, summaries, comparisons and errors of ``python -m experiments``: a reused run
directory refuses other settings unless told, a resume records what produced its steps, every
user error is one line with exit code 2, Ctrl-C names the last checkpoint, compare keeps and
aggregates every run."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from cpu_jobs import ROOT, cpu_env

from experiments import runner
from experiments.__main__ import main, resolve
from experiments.runner import MEM_FRACTION
from trace_jax.config import ConfigError
from trace_jax.rl import loop, runlog


def test_task_name_override_drops_the_files_task_args():
    config = "configs/reasoning/fp4_trace.yaml"  # task: reasoning with num_operands, max_value
    _, cfg = resolve(config, [])
    assert cfg.task.args == {"num_operands": 2, "max_value": 9}
    _, cfg = resolve(config, ["task.name=coding"])
    assert cfg.task.name == "coding" and cfg.task.args == {}
    _, cfg = resolve(config, ["task.name=coding", "task.args.num_examples=2"])
    assert cfg.task.args == {"num_examples": 2}
    _, cfg = resolve(config, ["task.args.num_examples=2", "task.name=coding"])  # either order
    assert cfg.task.args == {"num_examples": 2}
    _, cfg = resolve(config, ["task.name=reasoning", "task.args.max_value=5"])  # the same task
    assert cfg.task.args == {"num_operands": 2, "max_value": 5}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A Hugging Face export of the 1-layer tiny model (the RL tokenizer's vocabulary)."""
    from flax import nnx

    from trace_jax.model import ModelConfig, Transformer
    from trace_jax.model.hf import save_hf_checkpoint

    cfg = ModelConfig.preset("tiny").replace(num_layers=1)
    folder = tmp_path_factory.mktemp("hf") / "tiny"
    save_hf_checkpoint(Transformer(cfg, nnx.Rngs(0)), cfg, folder)
    return folder


def damaged(src: Path, dst: Path, name: str, data: bytes) -> Path:
    shutil.copytree(src, dst)
    (dst / name).write_bytes(data)
    return dst


def test_user_errors_end_in_one_line_naming_the_key_or_file(
    tmp_path, capsys, hf_folder, small_yaml, one_line
):
    config = small_yaml()
    weights = (hf_folder / "model.safetensors").read_bytes()
    hf_config = json.loads((hf_folder / "config.json").read_text())
    truncated = damaged(hf_folder, tmp_path / "trunc", "model.safetensors", weights[:1000])
    not_json = damaged(hf_folder, tmp_path / "notjson", "config.json", b"{vocab_size: 1")
    no_key = {k: v for k, v in hf_config.items() if k != "num_attention_heads"}
    no_key = damaged(hf_folder, tmp_path / "nokey", "config.json", json.dumps(no_key).encode())
    junk = tmp_path / "junk"  # a run directory whose policy/ is not a parameter checkpoint
    (junk / "policy").mkdir(parents=True)
    (junk / "policy" / "_METADATA").write_text("{not orbax")
    cases = [
        (["model=huge"], "model preset 'huge'"),
        (["task.name=chess"], "task.name: unknown task 'chess'"),
        (["task.args.num_operandz=3"], "task.args.num_operandz: unknown config key;"),
        ([f"hf_checkpoint={tmp_path / 'nowhere'}"], f"{tmp_path / 'nowhere'} does not exist"),
        ([f"hf_checkpoint={truncated}"], f"{truncated / 'model.safetensors'}: not a readable"),
        ([f"hf_checkpoint={not_json}"], f"{not_json / 'config.json'}: not valid JSON"),
        ([f"hf_checkpoint={no_key}"], f"{no_key / 'config.json'}: missing the key"),
        ([f"init_checkpoint={tmp_path}"], "init_checkpoint: starts RL from a saved policy"),
        ([f"init_checkpoint={tmp_path / 'nowhere'}", "warm_start.steps=0"], "init_checkpoint: "),
        ([f"init_checkpoint={junk}", "warm_start.steps=0"], f"{junk / 'policy'} does not hold"),
    ]
    for overrides, want in cases:
        run_dir = tmp_path / "run"
        assert main(["run", config, *overrides, "--run-dir", str(run_dir)]) == 2, overrides
        assert want in one_line(capsys.readouterr().err), overrides
        assert not run_dir.exists(), "a refused run leaves no run directory behind"


class Stop(Exception):
    pass


@pytest.mark.slow
def test_ctrl_c_resume_with_other_settings_and_the_summary(
    tmp_path, capsys, monkeypatch, small_yaml, one_line
):
    config, run_dir = small_yaml(), tmp_path / "run"
    args = ["run", config, "--run-dir", str(run_dir)]

    # Ctrl-C inside the second RL step (step 2), after the checkpoint of step 1.
    real_step = loop.RLRun.rl_step

    def interrupted(self, state, rollout_params, step, *a):
        if step == 2:
            raise KeyboardInterrupt
        return real_step(self, state, rollout_params, step, *a)

    monkeypatch.setattr(loop.RLRun, "rl_step", interrupted)
    assert main(args) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("interrupted") and str(run_dir / "checkpoints" / "1") in err
    monkeypatch.setattr(loop.RLRun, "rl_step", real_step)

    # Other settings: refused in one line naming the keys, before anything is written.
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert main([*args, "steps=3", "eval_problems=8", "time_limit_min=9"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "eval_problems 4 -> 8, steps 2 -> 3" in line and "--allow-config-change" in line
    assert "time_limit_min" not in line  # how long a process may run is not a setting
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before

    # Allowed: config.yaml keeps the settings of steps 0-1; those of step 2 on are recorded.
    assert main([*args, "steps=3", "--allow-config-change"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["steps"] == 2
    changed = yaml.safe_load((run_dir / "config.changed-at-step-2.yaml").read_text())
    assert changed == {**yaml.safe_load((run_dir / "config.yaml").read_text()), "steps": 3}
    assert len(list(run_dir.glob("config*.yaml"))) == 2
    records = runlog.read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    # Each process that ran steps is on record: from which step, the code, the device.
    origin = json.loads((run_dir / "results.json").read_text())["provenance"]
    assert origin == runlog.read_provenance(run_dir)
    assert [p["first_step"] for p in origin] == [0, 2]  # the refused start wrote nothing
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert origin[-1]["commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    assert origin[-1]["device"] == jax.devices()[0].device_kind

    # The summary in results.json is a hand computation over metrics.jsonl.
    rl = records[1:]  # step 0 is the warm start
    summary = json.loads((run_dir / "results.json").read_text())["summary"]
    assert summary["rl_steps"] == 3 and summary["fifth"] == 1
    assert summary["eval/reward_start"] == rl[0]["eval/reward_start"]
    assert summary["eval/reward_end"] == rl[-1]["eval/reward"]
    assert summary["reward/first_fifth"] == rl[0]["reward"]
    assert summary["reward/last_fifth"] == rl[-1]["reward"]
    assert summary["mismatch/logp_abs/last_fifth"] == rl[-1]["mismatch/logp_abs"]
    assert summary["mismatch/kl_k3/last_fifth"] == rl[-1]["mismatch/kl_k3"]
    assert summary["time/train/step_s"] == pytest.approx(
        np.mean([r["train/step_s"] for r in rl[1:]])
    )
    assert "eval reward (greedy, eval split), end of RL" in out

    # The same settings as the newest steps (not config.yaml's): a resume, nothing to redo.
    assert main([*args, "steps=3"]) == 0
    assert runlog.read_metrics(run_dir / "metrics.jsonl") == records

    # A damaged checkpoint: one line naming it.
    shutil.rmtree(run_dir / "checkpoints" / "3" / "tree")
    assert main([*args, "steps=3"]) == 2
    assert f"{run_dir / 'checkpoints' / '3'}: the run checkpoint" in one_line(
        capsys.readouterr().err
    )


def write_run(
    run_dir: Path, cfg: dict, rewards: list[float], evals: list[float], warm: int = 1
) -> None:
    """A run directory by hand: config.yaml and metrics.jsonl of ``warm`` warm-start steps and
    RL steps."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    records = [{"step": s, "sft/loss": 1.0} for s in range(warm)]
    for i, r in enumerate(rewards):
        rec = {"step": warm + i, "reward": r, "mismatch/logp_abs": 0.01 * (i + 1)}
        if i == 0:
            rec["eval/reward_start"] = evals[0]
        if i == len(rewards) - 1:
            rec["eval/reward"] = evals[1]
        records.append(rec)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_compare_keeps_every_run_and_aggregates_seeds(tmp_path, capsys, monkeypatch):
    base = {"experiment": "fp4_trace", "seed": 0, "lr": 0.001, "eval_split": "eval"}
    runs = {
        "a0": ({**base, "seed": 0}, [0.0, 0.1, 0.2, 0.3, 0.4], [0.1, 0.5]),
        "a1": ({**base, "seed": 1}, [0.0, 0.2, 0.2, 0.3, 0.6], [0.2, 0.7]),
        "a2": ({**base, "seed": 2}, [0.1, 0.1, 0.1, 0.1, 0.2], [0.0, 0.3]),
        "b0": ({**base, "lr": 0.003}, [0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0]),
    }
    for name, (cfg, rewards, evals) in runs.items():  # a2 with a longer warm start of its own
        write_run(tmp_path / name, cfg, rewards, evals, warm=4 if name == "a2" else 1)
    dirs = [str(tmp_path / n) for n in runs]
    plotted = {}

    def plot(runs, keys, path, **kw):
        plotted.update({(d, k): kw["points"](recs, k) for d, recs in runs.items() for k in keys})
        return real_plot(runs, keys, path, **kw)

    real_plot = runlog.plot_curves
    monkeypatch.setattr(runlog, "plot_curves", plot)
    assert main(["compare", *dirs, "--out", str(tmp_path / "cmp.png")]) == 0
    # curves by RL steps done: the evaluation before RL at 0, whatever the warm start's length;
    # each run named by its folder
    assert plotted["a0", "eval/reward"] == [(0, 0.1), (5, 0.5)]
    assert plotted["a2", "eval/reward"] == [(0, 0.0), (5, 0.3)]
    assert [x for x, _ in plotted["a2", "reward"]] == [1, 2, 3, 4, 5]
    plotted.clear()
    assert (
        main(["compare", *dirs[:2], "--labels", "one,two", "--out", str(tmp_path / "c.png")]) == 0
    )
    assert {label for label, _ in plotted} == {"one", "two"}
    assert main(["compare", *dirs[:2], "--labels", "one", "--out", str(tmp_path / "c.png")]) == 2
    out = capsys.readouterr().out
    assert "eval = greedy reward on the held-out split" in out
    assert "train = reward of the sampled rollouts" in out
    for d in dirs:  # every run is listed by its directory
        assert d in out
    # the three seeds of lr=0.001: mean ± sample sd of the final eval reward, n = 3
    group = next(line for line in out.splitlines() if line.startswith("fp4_trace lr=0.001 "))
    want = np.array([0.5, 0.7, 0.3])
    cells = group.split()
    assert cells[2] == "3"
    assert float(cells[6]) == pytest.approx(want.mean(), abs=5e-4) and cells[7] == "±"
    assert float(cells[8]) == pytest.approx(want.std(ddof=1), abs=5e-3)
    assert (tmp_path / "cmp.png").stat().st_size > 0


def test_summarize_is_a_hand_computation():
    recs = [{"step": 0, "sft/loss": 2.0, "step_s": 9.0}]
    for i in range(10):
        recs.append(
            {
                "step": i + 1,
                "reward": float(i),
                "mismatch/logp_abs": 0.1 * i,
                "mismatch/kl_k3": 0.01 * i,
                "rollout/decode_s": 10.0 if i == 0 else 1.0 + i,  # the first step compiles
                "rollout/tokens_per_s": 100.0 * (i + 1),
                "step_s": 2.0,
                "mismatch/code_one_step/all": float("nan") if i % 2 else 0.9 + 0.01 * i,
                **({"eval/reward_start": 0.25} if i == 0 else {}),
                **({"eval/reward": 0.5 + 0.1 * i} if i % 5 == 4 else {}),
                "guidance/ratio_to_full": 0.1 + 0.01 * i,  # a run's last is its own
            }
        )
    s = runlog.summarize(recs, "train")
    assert s["guidance/ratio_to_full"] == pytest.approx(0.19)
    assert s["rl_steps"] == 10 and s["fifth"] == 2 and s["eval_split"] == "train"
    assert s["eval/reward_start"] == 0.25 and s["eval/reward_end"] == pytest.approx(1.4)
    assert s["reward/first_fifth"] == 0.5 and s["reward/last_fifth"] == 8.5
    assert s["mismatch/logp_abs/last_fifth"] == pytest.approx(0.85)
    assert s["mismatch/kl_k3/last_fifth"] == pytest.approx(0.085)
    assert s["time/rollout/decode_s"] == pytest.approx(np.mean([1.0 + i for i in range(1, 10)]))
    assert s["time/step_s"] == 2.0  # the warm start's step_s is not an RL step's
    assert s["rate/rollout/tokens_per_s"] == pytest.approx(
        np.mean([100.0 * i for i in range(2, 11)])
    )
    assert "time/rollout/tokens_per_s" not in s
    # a share of mismatches skips the steps without any (NaN); a NaN mismatch is kept
    assert s["mismatch/code_one_step/all/last_fifth"] == pytest.approx(0.98)
    diverged = runlog.summarize([{"step": 0, "reward": 0.0, "mismatch/logp_abs": float("nan")}])
    assert np.isnan(diverged["mismatch/logp_abs/last_fifth"])
    table = runlog.format_summary(s)
    assert "eval reward (greedy, train split), end of RL" in table
    assert "train reward (sampled), last 2 of 10 RL steps" in table
    assert "compact / full guidance" in table


# A fresh process: does ``execute`` set the flag before anything (e.g. asking for the process
# index) starts the backend? On a GPU a late flag is refused, so `deterministic: true` runs failed.
FRESH_EXECUTE = """
import dataclasses, os, sys
from pathlib import Path
from jax._src import xla_bridge
from experiments import runner
from experiments.registry import Experiment

@dataclasses.dataclass(frozen=True)
class Cfg:
    deterministic: bool = True

def run(cfg, run_dir):
    return {"started_before_flags": started[0]}

started = []
flags = runner.deterministic_flags
runner.deterministic_flags = lambda f, s, b: started.append(s) or flags(f, s, b)
results = runner.execute(Experiment("probe", Cfg, run, ""), Cfg(), Path(sys.argv[1]))
print({"started_before_flags": results["started_before_flags"]})
print("memory fraction", [os.environ.get(v) for v in runner.MEM_FRACTION_VARS])
"""


def test_execute_sets_the_deterministic_flag_before_the_backend_starts(tmp_path):
    env = cpu_env(devices=1)
    for name in runner.MEM_FRACTION_VARS:  # as a caller that set no share
        env.pop(name, None)

    args = [sys.executable, "-c", FRESH_EXECUTE, str(tmp_path / "run")]
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "{'started_before_flags': False}" in out, out
    # a run owns its GPU: most of its memory, unless the caller said otherwise (under either
    # name: JAX refuses both at once)
    assert f"memory fraction ['{MEM_FRACTION}', None]" in out, out
    for given in ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.45"}, {"XLA_CLIENT_MEM_FRACTION": "0.5"}):
        env = dict(given)
        runner.set_memory_fraction(env, MEM_FRACTION)
        assert env == given


def test_deterministic_sets_xlas_flag_before_the_gpu_starts_and_refuses_after():
    from experiments.runner import DETERMINISTIC, deterministic_flags

    assert deterministic_flags("", False, lambda: "gpu") == DETERMINISTIC
    assert deterministic_flags("--xla_a=1", False, lambda: "gpu") == f"--xla_a=1 {DETERMINISTIC}"
    assert deterministic_flags(DETERMINISTIC, True, lambda: "gpu") == DETERMINISTIC
    assert deterministic_flags("", True, lambda: "cpu") == DETERMINISTIC  # CPU: deterministic
    with pytest.raises(ConfigError, match=r"deterministic: the GPU backend started before"):
        deterministic_flags("", True, lambda: "gpu")
