"""Sweeps and their report: a grid of 2 modes x 2 seeds runs from one warm start, a killed sweep
started again runs only its missing cells (resuming the partial one), a crashed cell is recorded
and retried, other settings are refused, and the report's numbers are those of the cells'
metrics files."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import yaml
from cpu_jobs import ROOT, cpu_env
from flax import nnx

from experiments import sweep as sweep_mod
from experiments.__main__ import main
from experiments.runner import MEM_FRACTION_VARS
from experiments.sweep import SWEEP_FILE, load_sweep
from trace_jax.model import ModelConfig, Transformer, params_digest, restore_params
from trace_jax.rl import loop, runlog

CELLS = ["fp4_trace-seed0", "fp4_trace-seed1", "fp4_trace_all-seed0", "fp4_trace_all-seed1"]


def sweep_file(tmp_path: Path, base: str, **extra) -> str:
    spec = {
        "base": base,
        "overrides": ["eval_every=3"],  # an evaluation at the end only
        "grid": {"experiment": ["fp4_trace", "fp4_trace_all"], "seed": [0, 1]},
        "sweep_dir": str(tmp_path / "sweep"),
        **extra,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_sweep_files_resolve_every_cell_and_refuse_bad_grids(
    tmp_path, capsys, small_yaml, one_line
):
    base = small_yaml()
    sweep = load_sweep(sweep_file(tmp_path, base))
    assert [c.name for c in sweep.cells] == CELLS
    ws = str(tmp_path / "sweep" / "warm_start")
    for cell in sweep.cells:
        assert cell.exp.name == cell.values["experiment"] and cell.cfg.seed == cell.values["seed"]
        assert cell.cfg.init_checkpoint == ws and cell.cfg.warm_start.steps == 0
        assert cell.cfg.eval_every == 3 and cell.cfg.steps == 2
    assert sweep.warm_start.cfg.steps == 0 and sweep.warm_start.cfg.warm_start.steps == 1
    assert main(["sweep", sweep_file(tmp_path, base), "--dry-run", "--only", "*_all-*"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].endswith("3 todo") and [line.split()[0] for line in listed[1:]] == ["todo"] * 3
    assert listed[2].endswith("fp4_trace_all-seed0")

    for extra, want in [
        ({"grid": {"model": ["tiny", "small"]}}, "grid.model: would change the warm start"),
        ({"grid": {"seed": []}}, "grid.seed: expected a non-empty list"),
        ({"grid": {"lrr": [1]}}, "cell lrr1: lrr: unknown config key"),
        ({"gird": {}}, "gird: unknown"),
    ]:
        assert main(["sweep", sweep_file(tmp_path, base, **extra)]) == 2
        assert want in one_line(capsys.readouterr().err)
    assert main(["sweep", sweep_file(tmp_path, base), "--only", "bf16*"]) == 2
    assert "--only bf16*: matches none" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "sweep").exists()


class Crash(Exception):
    pass


@pytest.mark.slow
def test_a_killed_sweep_resumes_its_missing_cells_and_reports(
    tmp_path, capsys, monkeypatch, small_yaml, one_line
):
    path = sweep_file(tmp_path, small_yaml(), keep_checkpoints=False)
    sweep_dir = tmp_path / "sweep"
    real_step, real_init = loop.RLRun.rl_step, loop.RLRun.__init__

    # Killed inside the second RL step of the third cell (after the checkpoint of step 0).
    def killed(self, state, rollout_params, step, *a):
        if self.run_dir.name == CELLS[2] and step == 1:
            raise KeyboardInterrupt
        return real_step(self, state, rollout_params, step, *a)

    monkeypatch.setattr(loop.RLRun, "rl_step", killed)
    assert main(["sweep", path]) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(sweep_dir / CELLS[2] / "checkpoints" / "0") in err
    monkeypatch.setattr(loop.RLRun, "rl_step", real_step)

    assert main(["sweep", path, "--dry-run"]) == 0
    listed = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    states = ["done", "done", "done", "partial", "todo"]
    assert listed == [
        [s, str(sweep_dir / d)] for s, d in zip(states, ["warm_start", *CELLS], strict=True)
    ]

    # Started again: only the missing cells are built; the partial one resumes from its
    # checkpoint; a crash in the last is recorded and the sweep ends with exit code 1.
    started = []

    def init(self, cfg, run_dir, **kw):
        started.append(Path(run_dir).name)
        if Path(run_dir).name == CELLS[3]:
            raise Crash("out of memory")
        real_init(self, cfg, run_dir, **kw)

    monkeypatch.setattr(loop.RLRun, "__init__", init)
    assert main(["sweep", path]) == 1
    out = capsys.readouterr().out
    assert started == CELLS[2:] and "resuming from the checkpoint of step 0" in out
    assert "out of memory" in (sweep_dir / CELLS[3] / "error.txt").read_text()
    monkeypatch.setattr(loop.RLRun, "__init__", real_init)
    assert main(["sweep", path, "--only", "*seed1"]) == 0  # retried; the rest is done
    capsys.readouterr()
    for cell in CELLS:
        assert (sweep_dir / cell / "results.json").is_file()
        cfg = yaml.safe_load((sweep_dir / cell / "config.yaml").read_text())
        assert cfg["init_checkpoint"] == str(sweep_dir / "warm_start")
        steps = [r["step"] for r in runlog.read_metrics(sweep_dir / cell / "metrics.jsonl")]
        assert steps == [0, 1]
        # keep_checkpoints: false: a finished cell keeps its records only
        assert not any((sweep_dir / cell / d).exists() for d in ("checkpoints", "policy"))
    assert (sweep_dir / "warm_start" / "policy").is_dir()
    assert not (sweep_dir / CELLS[3] / "error.txt").exists()

    # Other settings for the same folder: refused in one line, before anything runs; a time
    # limit is not another setting (the cells stay done).
    assert main(["sweep", path, "steps=3"]) == 2
    assert "base_config.steps 2 -> 3" in one_line(capsys.readouterr().err)
    assert main(["sweep", path, "time_limit_min=5", "--dry-run"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == ["done"] * 5

    # The report: mean ± sd over the two seeds of each mode, from the metrics files.
    assert main(["report", str(sweep_dir)]) == 0
    out_dir = sweep_dir / "report"
    agg = json.loads((out_dir / "report.json").read_text())
    table = (out_dir / "report.md").read_text()
    for mode in ("fp4_trace", "fp4_trace_all"):
        rl = [
            [
                r
                for r in runlog.read_metrics(sweep_dir / f"{mode}-seed{s}" / "metrics.jsonl")
                if "reward" in r
            ]
            for s in (0, 1)
        ]
        for key, values in [
            ("mismatch/logp_abs/last_fifth", [recs[-1]["mismatch/logp_abs"] for recs in rl]),
            ("eval/reward_end", [recs[-1]["eval/reward"] for recs in rl]),
            ("reward/first_fifth", [recs[0]["reward"] for recs in rl]),
            ("time/step_s", [recs[1]["step_s"] for recs in rl]),
        ]:
            stat = agg[mode][key]
            assert stat["n"] == 2 and stat["mean"] == pytest.approx(np.mean(values))
            assert stat["sd"] == pytest.approx(np.std(values, ddof=1))
        row = next(line for line in table.splitlines() if line.startswith(f"| {mode} | 2 |"))
        logp = agg[mode]["mismatch/logp_abs/last_fifth"]
        assert f"{logp['mean']:.4g} ± {logp['sd']:.2g}" in row
    # Every cell's RL started from the warm start's parameters, checked by digest, not assumed.
    start = json.loads((sweep_dir / "warm_start" / "results.json").read_text())
    start = start["start_policy_sha256"]
    assert start == params_digest(restore_params(sweep_dir / "warm_start" / "policy", tiny_model()))
    assert (
        f"Every finished cell started RL from the warm start's parameters (sha256 `{start[:16]}`)"
        in table
    )
    # The records archived (no parameters; merged into an archive that exists) report alike.
    kept = tmp_path / "kept"
    assert main(["archive", str(sweep_dir), str(kept)]) == 0
    assert main(["archive", str(sweep_dir), str(kept)]) == 0
    assert not any(kept.rglob("policy")) and not any(kept.rglob("checkpoints"))
    assert (kept / CELLS[0] / "metrics.jsonl.gz").is_file()
    assert main(["report", str(kept), "--out", str(tmp_path / "r-kept")]) == 0
    archived = json.loads((tmp_path / "r-kept" / "report.json").read_text())
    assert archived == agg
    assert f"sha256 `{start[:16]}`)" in (tmp_path / "r-kept" / "report.md").read_text()
    # records brought from a GPU machine: the warm start's path recorded there is not one here
    moved = tmp_path / "moved"
    shutil.copytree(kept, moved)
    record = yaml.safe_load((moved / SWEEP_FILE).read_text())
    record["warm_start_dir"] = "runs/sweeps/on-the-gpu-machine/warm_start"
    (moved / SWEEP_FILE).write_text(yaml.safe_dump(record))
    assert main(["archive", str(moved), str(tmp_path / "kept2")]) == 0
    assert (tmp_path / "kept2" / "warm_start" / "results.json").read_bytes() == (
        kept / "warm_start" / "results.json"
    ).read_bytes()
    # ... and one whose warm start is another sweep's folder (a path relative to where the
    # machine ran it), brought back under runs/sweeps/ beside it
    brought = tmp_path / "brought" / "runs" / "sweeps"
    shutil.copytree(kept / "warm_start", brought / "other" / "warm_start")
    shutil.copytree(moved, brought / "this")
    shutil.rmtree(brought / "this" / "warm_start")
    record["warm_start_dir"] = "runs/sweeps/other/warm_start"
    (brought / "this" / SWEEP_FILE).write_text(yaml.safe_dump(record))
    assert main(["archive", str(brought / "this"), str(tmp_path / "kept3")]) == 0
    assert main(["report", str(brought / "this"), "--out", str(tmp_path / "r-brought")]) == 0
    assert (
        "Every finished cell started RL from the warm start's parameters"
        in (tmp_path / "r-brought" / "report.md").read_text()
    )
    assert (tmp_path / "kept3" / "warm_start" / "results.json").read_bytes() == (
        kept / "warm_start" / "results.json"
    ).read_bytes()
    # another sweep's references: only from the same warm start
    args = ["report", str(sweep_dir), "--reference", str(kept), "--out", str(tmp_path / "r3")]
    assert main(args) == 0
    ws = json.loads((kept / "warm_start" / "results.json").read_text())
    (kept / "warm_start" / "results.json").write_text(
        json.dumps({**ws, "start_policy_sha256": "e" * 64})
    )
    assert main(args) == 2
    assert "its warm start (sha256 eeeeeeeeeeeeeeee) is not this sweep's" in one_line(
        capsys.readouterr().err
    )
    (kept / "warm_start" / "results.json").write_text(json.dumps(ws))
    # a cell unfinished in a later sweep directory does not replace its finished record
    partial = tmp_path / "later"
    (partial / CELLS[0]).mkdir(parents=True)
    (partial / SWEEP_FILE).write_text((sweep_dir / SWEEP_FILE).read_text())
    (partial / CELLS[0] / "metrics.jsonl").write_text('{"step": 0}\n')
    assert main(["archive", str(partial), str(kept)]) == 0
    assert f"kept the finished records of {CELLS[0]}" in capsys.readouterr().out
    assert len(runlog.read_metrics(kept / CELLS[0] / "metrics.jsonl")) == 2
    results = sweep_dir / CELLS[1] / "results.json"
    results.write_text(
        json.dumps({**json.loads(results.read_text()), "start_policy_sha256": "f" * 64})
    )
    for cell, reward in zip(CELLS[:2], (0.75, 0.25), strict=True):  # a reference's PTQ rewards
        results = sweep_dir / cell / "results.json"
        ptq = {"bf16": 0.5, "fp4 ptq (max6)": reward}
        results.write_text(json.dumps({**json.loads(results.read_text()), "ptq_eval_reward": ptq}))
    # ... and one that ran at another commit, on another device
    (origin,) = json.loads(results.read_text())["provenance"]
    assert "ran at commit" in table  # the sweep's own cells: one commit, one device
    assert "; XLA_FLAGS `" in table and "several XLA_FLAGS" not in table
    other = {**origin, "commit": "0123456789abcdef", "dirty": True, "tree": None}
    other.update(device="Other GPU", xla_flags="--xla_gpu_deterministic_ops=true")
    results.write_text(json.dumps({**json.loads(results.read_text()), "provenance": [other]}))
    assert main(["report", str(sweep_dir), "--out", str(tmp_path / "r2")]) == 0
    flagged = (tmp_path / "r2" / "report.md").read_text()
    header = next(line for line in flagged.splitlines() if line.startswith("| mode | n |"))
    assert header.endswith("| eval reward, post-hoc FP4 (max6) |") and "bf16 (post" not in header
    row = next(line for line in flagged.splitlines() if line.startswith("| fp4_trace | 2 |"))
    assert row.endswith(f"| 0.5 ± {np.std([0.75, 0.25], ddof=1):.2g} |")
    assert "**Not every cell started RL from the warm start's parameters**" in flagged
    assert f"`{CELLS[1]}` (`ffffffffffffffff`)" in flagged
    assert (
        "**The finished cells ran at several commits** (processes)" in flagged
        and "`0123456 +dirty` (1)" in flagged
        # the other process's code unknown (no tree recorded): not taken as the same
        and "**the code a run executes (`runlog.RUN_CODE`) differed**" in flagged
    )
    assert (
        "**on several kinds of device** (timings not comparable): "
        f"Other GPU (1), {origin['device']} (4)" in flagged  # processes: a resumed cell has two
    )
    own = f"`{origin['xla_flags'] or '(none)'}` (4)"
    assert "**under several XLA_FLAGS** (other roundings): " in flagged and own in flagged
    assert "`--xla_gpu_deterministic_ops=true` (1)" in flagged
    assert f"; host CPU {runlog.host_cpu()}." in flagged  # one host: named, not flagged
    # ... and the sweep, started again, stops before it runs anything else
    assert main(["sweep", path]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{CELLS[1]} (ffffffffffffffff): started RL from other parameters" in err
    assert f"(sha256 {start[:16]})" in err
    # a finished cell without its checkpoints is not continued with other settings
    assert main(["sweep", path, "steps=3", "--allow-config-change"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{CELLS[0]}, {CELLS[1]}" in err and "cannot be continued" in err
    for name in ("eval_reward", "mismatch", "codes", "mismatch_by_layer", "timing"):
        assert f"![{name}]({name}.png)" in table
        image = plt_imread(out_dir / f"{name}.png")
        assert image.shape[0] > 200 and image.shape[1] > 400 and image.std() > 0


def test_report_names_the_seeds_whose_sampled_reward_ends_at_zero():
    """Hand-made records of four seeds: seed 0 at reward 0 over its last 10 steps, seed 2 over
    its last 12; seed 1 never, seed 3 at 0 but for one step of its last 10. Only 0 and 2 are
    collapsed; the means still count every seed."""
    from experiments.report import aggregate, markdown

    def records(rewards):
        return [{"step": i, "reward": r} for i, r in enumerate(rewards)]

    rewards = {
        0: [0.5] * 5 + [0.0] * 10,
        1: [0.5] * 15,
        2: [0.5] * 3 + [0.0] * 12,
        3: [0.5] * 5 + [0.0] * 4 + [0.1] + [0.0] * 5,
    }
    data = {
        "sweep": {"base": "b.yaml", "grid": {"seed": list(rewards)}},
        "modes": {"m": [f"m-seed{s}" for s in rewards]},
        "cells": {
            f"m-seed{s}": {
                "seed": s,
                "state": "done",
                "records": records(r),
                "summary": {"reward/last_fifth": float(np.mean(r[-3:]))},
            }
            for s, r in rewards.items()
        },
        "warm_start": None,
    }
    agg = aggregate(data)
    assert agg["m"]["collapsed"] == [0, 2]
    assert agg["m"]["reward/last_fifth"]["mean"] == pytest.approx(0.5 / 4)
    row = next(
        line for line in markdown(Path("s"), data, agg, []).splitlines() if line.startswith("| m |")
    )
    assert row.startswith("| m | 4 | seed 0, seed 2 | ")
    # the outcome again as median [min, max]: 0 for three seeds' last steps, 0.5 for one
    stat = agg["m"]["reward/last_fifth"]
    assert (stat["median"], stat["min"], stat["max"]) == (0.0, 0.0, 0.5)
    text = markdown(Path("s"), data, agg, [])
    assert "| m | 0 [0, 0.5] |" in text


def tiny_model() -> Transformer:
    """A model of the sweep's config (conftest.SMALL), to restore its policies into."""
    return Transformer(
        ModelConfig.preset("tiny").replace(num_layers=1, dtype="bfloat16"), nnx.Rngs(0)
    )


def plt_imread(path: Path) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(path)


def test_a_run_ended_by_its_time_limit_is_a_partial_cell(tmp_path):
    from experiments.sweep import cell_state

    (tmp_path / "results.json").write_text(json.dumps({"complete": False, "records": 3}))
    assert cell_state(tmp_path) == "partial"
    (tmp_path / "results.json").write_text(json.dumps({"complete": True, "records": 5}))
    assert cell_state(tmp_path) == "done"


def sweep_subprocess(**fakes) -> types.SimpleNamespace:
    """The ``subprocess`` the sweep module sees, with ``fakes`` (the rest of the process keeps
    the real one: a run's provenance asks git)."""
    names = ("run", "Popen", "STDOUT", "TimeoutExpired", "CompletedProcess")
    return types.SimpleNamespace(**{n: getattr(subprocess, n) for n in names} | fakes)


@pytest.mark.slow
def test_jobs_run_cells_in_processes_at_once_from_one_warm_start(
    tmp_path, capsys, monkeypatch, small_yaml
):
    """``--jobs 2``: the warm start's command, then both cells' at once, each with its log and
    half the GPU's memory; each command is a ``sweep`` of this file and overrides that runs its
    part (run here in this process, whose compiled programs the other tests share: the real
    processes' handling is the interrupt test's), and both cells start RL from the warm start's
    parameters."""
    commands = []

    def run_here(args, env, **kw):  # a process's command, run in this one
        assert args[:4] == [sys.executable, "-m", "experiments", "sweep"]
        commands.append((args[4:], env["XLA_CLIENT_MEM_FRACTION"]))
        return subprocess.CompletedProcess(args, main(args[3:]))

    class Done:
        def __init__(self, args, env, stdout, stderr):
            self.returncode = run_here(args, env).returncode
            print("=== cell output", file=stdout, flush=True)

        def poll(self):
            return self.returncode

    for name in MEM_FRACTION_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sweep_mod, "subprocess", sweep_subprocess(run=run_here, Popen=Done))
    spec = sweep_file(tmp_path, small_yaml(), grid={"experiment": ["fp4_trace"], "seed": [0, 1]})
    assert main(["sweep", spec, "eval_every=5", "--jobs", "2"]) == 0
    assert commands == [
        ([spec, "eval_every=5", "--warm-start-only"], "0.450"),
        ([spec, "eval_every=5", "--only", CELLS[0]], "0.450"),
        ([spec, "eval_every=5", "--only", CELLS[1]], "0.450"),
    ]
    out = capsys.readouterr().out.splitlines()
    parent = [re.match(r"=== \S+: (started|exit code)", line) for line in out]
    assert [m[1] for m in parent if m] == ["started", "started", "exit code", "exit code"]
    sweep = tmp_path / "sweep"
    digest = json.loads((sweep / "warm_start" / "results.json").read_text())["start_policy_sha256"]
    for cell in CELLS[:2]:
        results = json.loads((sweep / cell / "results.json").read_text())
        assert results["complete"] and results["start_policy_sha256"] == digest
        assert "=== cell output" in (sweep / "logs" / f"{cell}.log").read_text()
        assert runlog.current_config(sweep / cell)["eval_every"] == 5  # the CLI's override
    assert not (sweep / CELLS[2]).exists()  # not in the grid
    assert main(["sweep", spec, "eval_every=5", "--jobs", "0"]) == 2


def test_an_interrupted_parallel_sweep_stops_its_cells(tmp_path, monkeypatch, small_yaml):
    """Ctrl-C (or a time limit) in the parent of ``--jobs``: every running cell gets the SIGINT
    a run stops on (its files closed, its last checkpoint named), and is waited for; also where
    the sweep runs with SIGINT ignored (started in the background), which its cells inherit:
    a cell's process, as the entry point does, stops on it again (``runner.stop_on_sigint``)."""
    started = []

    procs = []

    ready = tmp_path / "ready"
    ready.mkdir()
    cell = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); time.sleep(60)"
    cell = f"from experiments.runner import stop_on_sigint; stop_on_sigint(); {cell}"

    def popen(args, **kw):  # a cell that says it runs, then runs until interrupted
        started.append(args[-1])
        procs.append(subprocess.Popen([sys.executable, "-c", cell, str(ready / args[-1])], **kw))
        return procs[-1]

    warm_start = lambda *a, **k: subprocess.CompletedProcess(a, 0)  # noqa: E731
    monkeypatch.setattr(sweep_mod, "subprocess", sweep_subprocess(run=warm_start, Popen=popen))
    real_sleep, slept = time.sleep, []

    def sleep(seconds):  # Ctrl-C at the sweep's first wait, once its cells run (a signal sent
        if not slept:  # to a process still starting could be lost before it can handle it)
            slept.append(seconds)
            while len(list(ready.iterdir())) < len(procs):
                real_sleep(0.05)
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr(sweep_mod.time, "sleep", sleep)
    sweep = load_sweep(sweep_file(tmp_path, small_yaml()))
    t0 = time.monotonic()
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in `sweep ... &` in a script
    try:
        with pytest.raises(KeyboardInterrupt):
            sweep_mod.run_sweep(sweep, jobs=3)
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert started == CELLS[:3] and time.monotonic() - t0 < 30  # stopped, not waited out
    assert [p.returncode for p in procs] == [-2] * 3  # each ended by the SIGINT it got
    for cell in CELLS[:3]:
        assert (tmp_path / "sweep" / "logs" / f"{cell}.log").is_file()


ENTRY_POINT_UNDER_IGNORED_SIGINT = """
import runpy, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a command started in the background
sys.argv = ["experiments", "list"]
try:
    runpy.run_module("experiments", run_name="__main__")
except SystemExit:
    print("stops on SIGINT:", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


def test_the_entry_point_stops_on_sigint_where_started_with_it_ignored():
    run = subprocess.run(
        [sys.executable, "-c", ENTRY_POINT_UNDER_IGNORED_SIGINT],
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert "stops on SIGINT: True" in run.stdout, run.stdout + run.stderr[-2000:]


def test_a_budget_ends_the_sweep_in_time(tmp_path, monkeypatch, capsys, small_yaml):
    """``--budget-min``: each cell runs with the minutes left as its time limit (or its own,
    where smaller), and none starts with less than ``MIN_CELL_MIN`` left. The runs here are
    stand-ins that take 4 minutes of a fake clock each."""
    from experiments import runner

    clock, limits = [0.0], []

    def execute(exp, cfg, run_dir, allow_change):
        limits.append((Path(run_dir).name, round(cfg.time_limit_min, 6)))
        clock[0] += 4 * 60

    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(sweep_mod.time, "monotonic", lambda: clock[0])
    spec = sweep_file(tmp_path, small_yaml(time_limit_min=7.0))
    assert main(["sweep", spec, "--budget-min", "14"]) == 0
    assert limits == [
        ("warm_start", 7.0),  # the warm start runs as configured; its minutes count
        (CELLS[0], 7.0),  # 10 left: the cell's own limit is smaller
        (CELLS[1], 6.0),  # 6 left
        (CELLS[2], 2.0),  # 2 left; after it none
    ]
    assert "--budget-min 14: -2.0 min left, no cell started" in capsys.readouterr().out
    assert main(["sweep", spec, "--budget-min", "5", "--jobs", "2"]) == 2
    assert main(["sweep", spec, "--min-cell-min", "5"]) == 2  # only within a budget
    # --min-cell-min: a cell not begun needs that many minutes; a begun one (checkpointed)
    # continues with less
    for cell in CELLS:
        shutil.rmtree(tmp_path / "sweep" / cell, ignore_errors=True)
    (tmp_path / "sweep" / CELLS[2] / "checkpoints").mkdir(parents=True)
    limits.clear()
    assert main(["sweep", spec, "--budget-min", "10", "--min-cell-min", "5"]) == 0
    assert limits == [
        ("warm_start", 7.0),  # (the stand-in leaves no finished warm start: it runs again)
        (CELLS[0], 6.0),  # 6 left
        (CELLS[2], 2.0),  # 2 left: CELLS[1] not started, the begun CELLS[2] continued
    ]
    assert f"{CELLS[1]}: not started, 2.0 min left (--min-cell-min)" in capsys.readouterr().out


def test_report_sets_trace_against_qat_of_the_same_other_grid_values():
    """Mean step times (and outside the decode loop) of each TRACE mode against the QAT mode
    that differs from it only by ``experiment``, on one kind of GPU at a time, by hand;
    guidance bytes a run's last."""
    from experiments.report import qat_overheads

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    cells = []

    def cell(mode, step, decode, gpu=h100, seeds=1):
        summary = {"time/step_s": step, "time/rollout/decode_s": decode}
        for _ in range(seeds):
            provenance = [{"first_step": 0, "device": gpu}]
            cells.append(dict(mode=mode, state="done", summary=summary, provenance=provenance))

    cell("fp4_qat", 2.0, 0.5, seeds=3)
    cell("fp4_trace", 2.1, 0.5, seeds=2)
    cell("fp4_trace", 2.4, 0.8)  # the third seed: 2.2 s, 1.6 outside the decode loop
    cell("fp4_trace", 1.5, 0.5, gpu=h200)  # no QAT on an H200: not compared
    cell("fp4_trace_all staleness=3", 3.0, 1.0, seeds=2)
    cell("fp4_qat staleness=3", 2.5, 0.5, seeds=3)
    cell("fp4_trace fmt=mxfp4", 2.0, 0.4)  # no QAT of its grid values: left out
    cells.append(dict(mode="fp4_qat", state="partial"))  # unfinished: not counted
    data = {"cells": {str(i): c for i, c in enumerate(cells)}, "modes": {}}
    for name, c in data["cells"].items():
        if c["state"] == "done":
            data["modes"].setdefault(c["mode"], []).append(name)
    assert qat_overheads(data) == [
        f"fp4_trace against fp4_qat on {h100} (3 / 3 seeds): step 2.2 s against 2 s, +10.0 %; "
        "outside the decode loop 1.6 s against 1.5 s, +6.7 %",
        f"fp4_trace_all staleness=3 against fp4_qat staleness=3 on {h100} (2 / 3 seeds): step "
        "3 s against 2.5 s, +20.0 %; outside the decode loop 2 s against 2 s, +0.0 %",
    ]
    records = [{"step": 0, "reward": 0.1, "guidance/bytes_per_token": 9.0}]
    records += [
        {"step": 1, "reward": 0.2, "guidance/bytes_per_token": 8.0},
        {"step": 2, "reward": 0.3},
    ]
    assert runlog.summarize(records)["guidance/bytes_per_token"] == 8.0


def test_report_pairs_each_mode_with_the_reference_by_seed():
    """Differences to the BF16 reference of the same seed, mean and 95 % interval by hand
    (Student's t with 2 degrees of freedom: 4.303); a mode whose other grid values a BF16 run
    does not read (fmt) is set against the plain reference, but for the post-hoc quantization
    (another format); one whose reference runs elsewhere, against that sweep's."""
    from experiments.report import against_reference

    def cell(mode, seed, **summary):
        return {"mode": mode, "seed": seed, "state": "done", "summary": summary}

    def sweep(cells):
        modes = {}
        for i, c in enumerate(cells):
            if c["state"] == "done":
                modes.setdefault(c["mode"], []).append(str(i))
        return {"cells": {str(i): c for i, c in enumerate(cells)}, "modes": modes}

    ref = {0: 0.5, 1: 0.6, 2: 0.4}
    trace = {0: 0.55, 1: 0.58, 2: 0.47}  # differences +0.05, -0.02, +0.07
    refs = [
        cell("bf16_rollout", s, **{"eval/reward_end": r, "ptq/fp4 ptq (max6)": r - 0.1})
        for s, r in ref.items()
    ]
    cells = refs + [cell("fp4_trace", s, **{"eval/reward_end": r}) for s, r in trace.items()]
    cells += [cell("fp4_qat fmt=mxfp4", 0, **{"eval/reward_end": 0.3})]
    cells += [cell("fp4_qat staleness=3", 0, **{"eval/reward_end": 0.3})]  # no reference
    cells += [cell("fp4_qat", 1, **{"eval/reward_end": 0.5}), {"state": "partial", "seed": 2}]
    lines = against_reference(sweep(cells))
    d = np.array([0.05, -0.02, 0.07])
    half = 4.303 * d.std(ddof=1) / np.sqrt(3)
    trace_row = next(line for line in lines if line.startswith("| fp4_trace |"))
    own = f"{d.mean():+.3f} [{d.mean() - half:+.3f}, {d.mean() + half:+.3f}] (n=3)"
    ptq = (
        f"{d.mean() + 0.1:+.3f} [{d.mean() + 0.1 - half:+.3f}, {d.mean() + 0.1 + half:+.3f}] (n=3)"
    )
    assert trace_row == f"| fp4_trace | `bf16_rollout` | {own} | - | {ptq} |"
    assert "| fp4_qat | `bf16_rollout` | -0.100 (n=1) | - | +0.000 (n=1) |" in lines
    assert "| fp4_qat fmt=mxfp4 | `bf16_rollout` | -0.200 (n=1) | - | - |" in lines
    assert not any("staleness" in line for line in lines)  # staleness: a BF16 run reads it
    # a sweep without references of its own, against another's
    alone = sweep([cell("fp4_trace guided_last_k=2", 0, **{"eval/reward_end": 0.45})])
    assert against_reference(alone) == []
    lines = against_reference({**alone, "reference": sweep(refs)})
    assert "| fp4_trace guided_last_k=2 | `bf16_rollout` | -0.050 (n=1) | - | +0.050 (n=1) |" in (
        lines
    )
