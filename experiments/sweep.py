"""Sweeps: a grid of runs over one base config, every run starting RL from one shared warm start.

A sweep file (``configs/sweeps/<name>.yaml``)::

    base: configs/reasoning/fp4_trace.yaml     # a run config (path from the working directory)
    overrides: [steps=100, eval_every=20]       # for every run, the warm start included
    grid:                                       # every combination is a cell
      experiment: [bf16_rollout, fp4_qat, fp4_trace]
      seed: [0, 1, 2]
    sweep_dir: runs/sweeps/<name>               # optional (default: runs/sweeps/<file stem>)
    warm_start_dir: runs/sweeps/x/warm_start    # optional (default: <sweep_dir>/warm_start)
    keep_checkpoints: false                     # optional (default true): see below

``python -m experiments sweep <file> [key=value ...]`` (the ``key=value`` overrides join the
file's) first runs the base config's warm start alone (``steps=0``) into ``warm_start_dir``
(sweeps of one base may share it: a finished one is not run again), then each cell, with
``warm_start.steps=0 init_checkpoint=<warm_start_dir>``, into ``<sweep_dir>/<cell>``
(``fp4_trace-seed0``),
one after another in this process through the same path as ``run`` (config checks, summary,
``results.json``). A cell is done when its ``results.json`` exists and is not of a run that
``time_limit_min`` ended early; a sweep started again skips done cells and resumes a partial
one from its checkpoints. A cell that fails with an error that
is not the user's (a crash, out of memory) leaves ``error.txt`` with its traceback and the sweep
goes on; it is tried again on the next start. ``<sweep_dir>/sweep.yaml`` records the resolved
sweep; a start with another base, overrides or grid is refused, in one line naming the keys,
unless ``--allow-config-change``. Grid keys must not change the shared warm start (the model,
the task, ``warm_start.*``, ``init_checkpoint``). Where the warm start's folder does not outlive
a machine (the GPU calls) it is run again on the next start, and a finished cell whose
``start_policy_sha256`` differs from the warm start's stops the sweep in one line: only a
``deterministic: true`` warm start on the same kind of GPU repeats the same parameters.

``--budget-min M`` bounds the whole sweep's wall clock (a GPU call's): each cell runs with
``time_limit_min`` at most the minutes left, so the cell under way when the budget ends stops
evaluated and checkpointed (the same command continues it where its folder survives), and no
cell starts with less than ``MIN_CELL_MIN`` minutes left; ``--min-cell-min M``: no cell not yet
begun starts with less than M (on a machine that will not outlive the call, a cell cut at
its end is lost), while a begun one still continues.

``--jobs N`` runs up to N cells at once, each in its own process (``python -m experiments sweep
<file> --only <cell>``, its output in ``<sweep_dir>/logs/<cell>.log``) with a share of the GPU's
memory (``XLA_CLIENT_MEM_FRACTION`` 0.9 / N unless a share is set), after the warm start's own
process (``--warm-start-only``): on one GPU a cell's steps leave the device idle between small
kernels, which another cell's steps can fill.

With ``keep_checkpoints: false`` a cell that finishes keeps its records (settings, metrics,
results, plots) and loses its checkpoints and its copy of the starting policy (a `medium` run's
are ~15 GB; a GPU machine's disk holds a few), so it cannot be continued: a start that would
continue one with other settings is refused in one line.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import gc
import gzip
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from trace_jax.config import ConfigError, format_diff, load_yaml, to_dict
from trace_jax.rl import runlog

SWEEP_FILE = "sweep.yaml"
WARM_START = "warm_start"
ERROR_FILE = "error.txt"
# What a finished cell loses under keep_checkpoints: false (its records stay).
PRUNED = ("checkpoints", "policy", "guidance_spill")
# Grid keys that would change the warm start every cell shares.
SHARED = ("model", "model_overrides", "hf_checkpoint", "task", "warm_start", "init_checkpoint")
CellState = Literal["done", "partial", "failed", "todo"]
# --budget-min: no cell starts with fewer minutes left (its programs' compilation alone)
MIN_CELL_MIN = 1.0


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of a sweep: its folder name, grid values and resolved (experiment, config)."""

    name: str
    values: dict[str, Any]
    exp: Any
    cfg: Any


@dataclasses.dataclass(frozen=True)
class Sweep:
    file: str
    sweep_dir: Path
    warm_start_dir: Path
    base: str
    overrides: tuple[str, ...]
    grid: dict[str, list]
    base_config: dict[str, Any]
    warm_start: Cell
    cells: tuple[Cell, ...]
    keep_checkpoints: bool = True
    extra: tuple[str, ...] = ()  # the command line's overrides (joined to the file's in overrides)

    def record(self) -> dict[str, Any]:
        """What ``sweep.yaml`` holds: the base resolved with the overrides (the settings every
        cell shares but its grid values; the warm start's but ``steps: 0``), the grid, the warm
        start's folder and every cell's grid values."""
        return {
            "base": self.base,
            "overrides": list(self.overrides),
            "base_config": self.base_config,
            "grid": self.grid,
            "warm_start_dir": str(self.warm_start_dir),
            "keep_checkpoints": self.keep_checkpoints,
            "cells": {c.name: c.values for c in self.cells},
        }


def _flow(value: Any) -> str:
    """A value as a one-line YAML override (``[0, 1]``, ``{a: 1}``, ``0.001``)."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def cell_name(values: dict[str, Any]) -> str:
    """``fp4_trace-staleness3-fmt=mxfp4-seed0``: the experiment, then per other grid key
    ``<key><number>`` or ``<key>=<value>``."""

    def part(key, value):
        text = _flow(value)
        if key == "experiment":
            return text
        return f"{key}{text}" if text[:1].isdigit() or text[:1] == "-" else f"{key}={text}"

    name = "-".join(part(k, v) for k, v in values.items())
    for bad in "/ \\:*?\"'<>|{}[],":
        name = name.replace(bad, "_")
    return name


def load_sweep(path: str, extra_overrides: Sequence[str] = ()) -> Sweep:
    """Read a sweep file and resolve the warm start and every cell (ConfigError names the key)."""
    from experiments.runner import resolve_data

    spec = load_yaml(path)
    known = ("base", "overrides", "grid", "sweep_dir", "warm_start_dir", "keep_checkpoints")
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise ConfigError(f"{path}: {', '.join(unknown)}: unknown; known: {', '.join(known)}")
    base = spec.get("base")
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: expected the path of a run config")
    overrides = spec.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"{path}: overrides: expected a list of key=value strings")
    overrides = (*overrides, *extra_overrides)
    keep = spec.get("keep_checkpoints", True)
    if not isinstance(keep, bool):
        raise ConfigError(f"{path}: keep_checkpoints: expected true or false, got {keep!r}")
    grid = spec.get("grid") or {}
    if not isinstance(grid, dict) or not grid:
        raise ConfigError(f"{path}: grid: expected a mapping of key -> list of values")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}: grid.{key}: expected a non-empty list of values")
        if key.split(".")[0] in SHARED:
            raise ConfigError(
                f"{path}: grid.{key}: would change the warm start every cell shares; sweep it "
                "in separate sweep files"
            )
    sweep_dir = Path(spec.get("sweep_dir") or Path("runs/sweeps") / Path(path).stem)
    data = load_yaml(base)
    ws_dir = Path(spec.get("warm_start_dir") or sweep_dir / WARM_START)
    base_config = resolved(Cell("base", {}, *resolve_data(data, overrides, base)))
    warm_start = Cell(WARM_START, {}, *resolve_data(data, [*overrides, "steps=0"], base))
    cells = []
    for combo in itertools.product(*grid.values()):
        values = dict(zip(grid, combo, strict=True))
        cell_overrides = [f"{k}={_flow(v)}" for k, v in values.items()]
        shared = ["warm_start.steps=0", f"init_checkpoint={ws_dir}"]
        try:
            exp, cfg = resolve_data(data, [*overrides, *cell_overrides, *shared], base)
        except ConfigError as e:
            raise ConfigError(f"{path}: cell {cell_name(values)}: {e}") from None
        cells.append(Cell(cell_name(values), values, exp, cfg))
    names = [c.name for c in cells]
    if len(set(names)) < len(names) or WARM_START in names:
        raise ConfigError(f"{path}: grid: cells share a folder name ({', '.join(names)})")
    return Sweep(
        str(path),
        sweep_dir,
        ws_dir,
        base,
        tuple(overrides),
        grid,
        base_config,
        warm_start,
        tuple(cells),
        keep,
        tuple(extra_overrides),
    )


def cell_state(run_dir: Path) -> CellState:
    """done (``results.json`` of a complete run), failed (``error.txt``), partial (started, or
    ended early by ``time_limit_min``) or todo."""
    results = run_dir / "results.json"
    if results.is_file() and json.loads(results.read_text()).get("complete", True):
        return "done"
    if (run_dir / ERROR_FILE).is_file():
        return "failed"
    return "partial" if run_dir.exists() else "todo"


def finished(run_dir: Path, cell: Cell) -> bool:
    """Whether ``run_dir`` holds the finished run of ``cell``'s settings (after an allowed change
    of the sweep, a finished cell with other settings is continued with the new ones)."""
    if cell_state(run_dir) != "done":
        return False
    from experiments.runner import settings_diff

    return not settings_diff(runlog.current_config(run_dir) or {}, resolved(cell))


def resolved(cell: Cell) -> dict[str, Any]:
    return {"experiment": cell.exp.name, **to_dict(cell.cfg)}


def check_record(sweep: Sweep, allow_change: bool) -> list:
    """Refuse (one line) a sweep directory made by another sweep, unless ``allow_change``."""
    from experiments.runner import ALLOW_CHANGE, settings_diff

    file = sweep.sweep_dir / SWEEP_FILE
    if not file.is_file():
        return []
    old = yaml.safe_load(file.read_text()) or {}
    new = sweep.record()
    keys = ("base_config", "grid", "warm_start_dir")
    diff = settings_diff({k: old.get(k) for k in keys}, {k: new[k] for k in keys})
    if diff and not allow_change:
        raise ConfigError(
            f"{sweep.sweep_dir} was swept with other settings ({format_diff(diff)}); use another "
            f"sweep_dir, or pass {ALLOW_CHANGE} to continue it with the new settings"
        )
    return diff


def run_sweep(
    sweep: Sweep,
    only: str | None = None,
    dry_run: bool = False,
    allow_change: bool = False,
    warm_start_only: bool = False,
    jobs: int = 1,
    budget_min: float = 0.0,
    min_cell_min: float | None = None,
) -> int:
    """Run (or with ``dry_run`` list) the warm start and the cells matching ``only`` (a glob on
    cell names; none with ``warm_start_only``), ``jobs`` cells at a time (above 1: each in its
    own process, ``run_parallel``), within ``budget_min`` minutes (0: no bound), starting no
    cell not yet begun with fewer than ``min_cell_min`` of them left (default
    ``MIN_CELL_MIN``; a begun one continues with that much). Returns 0, or 1 when a cell
    failed."""
    from experiments.runner import execute

    started = time.monotonic()
    if jobs < 1:
        raise ConfigError(f"--jobs: must be >= 1, got {jobs}")
    if budget_min < 0 or (budget_min and jobs > 1):
        raise ConfigError(
            f"--budget-min: a positive number of minutes with --jobs 1, got {budget_min}"
        )
    if min_cell_min is not None and not (budget_min and min_cell_min >= MIN_CELL_MIN):
        raise ConfigError(
            f"--min-cell-min: at least {MIN_CELL_MIN:g} minutes, with --budget-min, got "
            f"{min_cell_min:g}"
        )
    cells = [c for c in sweep.cells if only is None or fnmatch.fnmatchcase(c.name, only)]
    if not cells:
        raise ConfigError(
            f"--only {only}: matches none of {', '.join(c.name for c in sweep.cells)}"
        )
    diff = check_record(sweep, allow_change)
    pruned = [
        c.name
        for c in cells
        if cell_state(sweep.sweep_dir / c.name) == "done"
        and not finished(sweep.sweep_dir / c.name, c)
        and not (sweep.sweep_dir / c.name / "checkpoints").exists()
    ]
    if pruned:
        raise ConfigError(
            f"{', '.join(pruned)}: finished with other settings and without checkpoints "
            "(keep_checkpoints: false), so they cannot be continued with these; move them aside "
            "to run them again"
        )
    if dry_run:
        print(listing(sweep, cells))
        return 0
    sweep.sweep_dir.mkdir(parents=True, exist_ok=True)
    if diff or not (sweep.sweep_dir / SWEEP_FILE).is_file():
        (sweep.sweep_dir / SWEEP_FILE).write_text(yaml.safe_dump(sweep.record(), sort_keys=False))
    if jobs > 1:
        return run_parallel(sweep, cells, jobs, allow_change)
    ws = sweep.warm_start
    if not finished(sweep.warm_start_dir, ws):
        print(f"\n=== {sweep.warm_start_dir}: the warm start every cell starts from")
        execute(ws.exp, ws.cfg, sweep.warm_start_dir, allow_change)
    check_starts(sweep)
    if warm_start_only:
        return 0
    failed = []
    for i, cell in enumerate(cells):
        run_dir = sweep.sweep_dir / cell.name
        state = cell_state(run_dir)
        if finished(run_dir, cell):
            print(f"=== {run_dir}: done, skipped")
            continue
        cfg = cell.cfg
        if budget_min:
            left = budget_min - (time.monotonic() - started) / 60
            if left < MIN_CELL_MIN:
                print(f"--budget-min {budget_min:g}: {left:.1f} min left, no cell started")
                break
            begun = (run_dir / "checkpoints").is_dir()  # else it starts from the warm start
            if min_cell_min and not begun and left < min_cell_min:
                print(f"=== {run_dir}: not started, {left:.1f} min left (--min-cell-min)")
                continue
            if not cfg.time_limit_min or cfg.time_limit_min > left:
                cfg = dataclasses.replace(cfg, time_limit_min=left)
        print(f"\n=== {run_dir} ({i + 1}/{len(cells)}, {state})")
        (run_dir / ERROR_FILE).unlink(missing_ok=True)
        try:
            execute(cell.exp, cfg, run_dir, allow_change)
        except ConfigError as e:  # every cell would fail alike: stop
            raise ConfigError(f"{cell.name}: {e}") from None
        except Exception:  # a crash or a damaged checkpoint: recorded, and the sweep goes on
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / ERROR_FILE).write_text(traceback.format_exc())
            print(
                f"{run_dir}: failed ({sys.exc_info()[1]!r}); see {run_dir / ERROR_FILE}",
                file=sys.stderr,
            )
            failed.append(cell.name)
        if not sweep.keep_checkpoints and cell_state(run_dir) == "done":
            for name in PRUNED:
                shutil.rmtree(run_dir / name, ignore_errors=True)
        gc.collect()  # the cell's parameters and engines, before the next allocates its own
    return ending(sweep, cells, failed, "tried again on the next start")


def ending(sweep: Sweep, cells: Sequence[Cell], failed: Sequence[str], why: str) -> int:
    """The sweep's closing lines: each cell's state, the report's command, the failed cells.
    Returns 0, or 1 when a cell failed."""
    print("\n" + listing(sweep, cells))
    print(f"report: python -m experiments report {sweep.sweep_dir}")
    if failed:
        print(f"failed cells ({why}): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def run_parallel(sweep: Sweep, cells: Sequence[Cell], jobs: int, allow_change: bool) -> int:
    """The warm start in a process of its own, then ``cells`` (those not finished), up to
    ``jobs`` processes at once, each a ``sweep --only <cell>`` of this sweep's file and
    overrides, its output in ``<sweep_dir>/logs/<cell>.log``. Returns 0, or 1 when a cell's
    process failed (its log names why)."""
    command = [sys.executable, "-m", "experiments", "sweep", sweep.file, *sweep.extra]
    from experiments.runner import ALLOW_CHANGE, set_memory_fraction

    if allow_change:
        command.append(ALLOW_CHANGE)
    env = dict(os.environ)
    set_memory_fraction(env, f"{0.9 / jobs:.3f}")
    print(f"\n=== {sweep.warm_start_dir}: the warm start every cell starts from", flush=True)
    if subprocess.run([*command, "--warm-start-only"], env=env).returncode:
        return 1
    logs = sweep.sweep_dir / "logs"
    logs.mkdir(exist_ok=True)
    todo = [c for c in cells if not finished(sweep.sweep_dir / c.name, c)]
    running: dict[str, tuple[subprocess.Popen, Any]] = {}
    failed = []
    try:
        while todo or running:
            while todo and len(running) < jobs:
                cell = todo.pop(0)
                log = (logs / f"{cell.name}.log").open("w")
                print(f"=== {sweep.sweep_dir / cell.name}: started (log {log.name})", flush=True)
                proc = subprocess.Popen(
                    [*command, "--only", cell.name], env=env, stdout=log, stderr=subprocess.STDOUT
                )
                running[cell.name] = (proc, log)
            time.sleep(0.2)
            for name, (proc, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[name]
                print(f"=== {sweep.sweep_dir / name}: exit code {proc.returncode}", flush=True)
                if proc.returncode:
                    failed.append(name)
    finally:  # interrupted (Ctrl-C, a time limit): each cell stops as Ctrl-C stops a run
        for proc, _ in running.values():
            proc.send_signal(signal.SIGINT)
        for proc, log in running.values():
            try:
                proc.wait(timeout=120)  # its files closed, its last checkpoint named
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
    return ending(sweep, cells, failed, f"logs in {logs}")


# What ``archive`` keeps of each run: its settings, results, error and metrics (gzipped).
ARCHIVED = ("config*.yaml", "results.json", runlog.PROVENANCE, ERROR_FILE)


def warm_start_here(sweep_dir: Path, recorded: str | None) -> Path:
    """The warm start of the sweep in ``sweep_dir`` as found here: its own folder (the
    default), else the one ``recorded`` in its ``sweep.yaml``; a relative path recorded on
    another machine (a GPU call's ``runs/sweeps/...``, brought back under some folder here) is
    looked up from each folder above ``sweep_dir`` too."""
    own = sweep_dir / WARM_START
    if own.is_dir() or not recorded:
        return own
    path = Path(recorded)
    if path.is_absolute() or path.is_dir():
        return path
    found = (a / path for a in sweep_dir.resolve().parents if (a / path).is_dir())
    return next(found, path)


def archive(sweep_dir: str | Path, dest: str | Path) -> int:
    """Copy a sweep's records (``sweep.yaml``; per cell and for the warm start: settings,
    ``results.json``, ``error.txt``, ``metrics.jsonl`` gzipped; no parameters, checkpoints or
    plots) into ``dest``, which ``report`` then reads as it reads the sweep: the evidence of a
    study kept in the repository (a cell of ~200 steps: ~50 KB). Cells are merged into an
    archive that exists (a study run over several machines); ``sweep.yaml`` must agree."""
    sweep_dir, dest = Path(sweep_dir), Path(dest)
    file = sweep_dir / SWEEP_FILE
    if not file.is_file():
        raise ConfigError(f"{sweep_dir} is not a sweep directory (no {SWEEP_FILE})")
    record = yaml.safe_load(file.read_text())
    ws = warm_start_here(sweep_dir, record.get("warm_start_dir"))
    record["warm_start_dir"] = str(dest / WARM_START)
    old = dest / SWEEP_FILE
    if old.is_file():
        keys = ("base_config", "grid")
        kept = yaml.safe_load(old.read_text())
        if any(kept.get(k) != record.get(k) for k in keys):
            raise ConfigError(f"{dest}: holds another sweep's records ({', '.join(keys)} differ)")
        record["cells"] = {**kept.get("cells", {}), **record.get("cells", {})}
    dest.mkdir(parents=True, exist_ok=True)
    runs = {WARM_START: ws, **{name: sweep_dir / name for name in record.get("cells", {})}}
    copied, kept_done = 0, []
    for name, run_dir in runs.items():
        if not run_dir.is_dir():
            continue
        out = dest / name
        if cell_state(out) == "done" and cell_state(run_dir) != "done":
            kept_done.append(name)  # a finished record is not replaced by an unfinished one
            continue
        shutil.rmtree(out, ignore_errors=True)  # no file of an earlier copy left beside these
        out.mkdir()
        for pattern in ARCHIVED:
            for f in run_dir.glob(pattern):
                shutil.copy2(f, out / f.name)
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file():
            (out / "metrics.jsonl.gz").write_bytes(gzip.compress(metrics.read_bytes(), mtime=0))
        copied += 1
    old.write_text(yaml.safe_dump(record, sort_keys=False))
    print(f"archived {copied} runs of {sweep_dir} into {dest}")
    if kept_done:
        print(f"kept the finished records of {', '.join(kept_done)} (unfinished in {sweep_dir})")
    return 0


def start_digest(run_dir: Path) -> str | None:
    """The ``start_policy_sha256`` of a finished run (its RL's starting parameters; a warm start's
    final ones)."""
    results = run_dir / "results.json"
    return json.loads(results.read_text()).get("start_policy_sha256") if results.is_file() else None


def check_starts(sweep: Sweep) -> None:
    """Refuse (one line) to go on when a finished cell started RL from other parameters than the
    warm start holds: on machines whose disks do not outlive a call the warm start is run again
    in each call, and only a deterministic one on the same kind of GPU gives the same policy."""
    start = start_digest(sweep.warm_start_dir)
    other = {
        c.name: d
        for c in sweep.cells
        if finished(sweep.sweep_dir / c.name, c)
        and (d := start_digest(sweep.sweep_dir / c.name)) != start
    }
    if other:
        cells = ", ".join(f"{n} ({(d or 'unknown')[:16]})" for n, d in sorted(other.items()))
        raise ConfigError(
            f"{cells}: started RL from other parameters than the warm start in "
            f"{sweep.warm_start_dir} (sha256 {(start or 'unknown')[:16]}); a warm start run again "
            "on another kind of GPU, or without deterministic: true, gives another policy: move "
            "those cells aside, or run where their warm start ran"
        )


def listing(sweep: Sweep, cells: Sequence[Cell]) -> str:
    """One line per run of the sweep: state and folder."""
    dirs = [sweep.warm_start_dir, *(sweep.sweep_dir / c.name for c in cells)]
    rows = [(d, cell_state(d)) for d in dirs]
    counts = {s: sum(1 for _, st in rows if st == s) for s in ("done", "partial", "failed", "todo")}
    head = f"sweep {sweep.sweep_dir}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    return "\n".join([head, *(f"  {state:8s} {d}" for d, state in rows)])
