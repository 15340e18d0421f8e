"""Entry point: ``python -m experiments run configs/<name>.yaml key=value ...``.

Commands: ``run`` (one config into a run directory), ``list``, ``compare`` (several run
directories), ``sweep`` (a grid of runs from one shared warm start) and ``report`` (a sweep's
tables and figures). Every error a user can cause ends in one line on stderr naming the file or
key, exit code 2; Ctrl-C ends in one line naming the last checkpoint, exit code 130.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.registry import EXPERIMENTS, Experiment, get_experiment
from trace_jax.config import (
    ConfigError,
    apply_overrides,
    config_diff,
    flatten,
    format_diff,
    from_dict,
    load_yaml,
    to_dict,
)
from trace_jax.model.hf import CheckpointError
from trace_jax.rl import checkpoint as run_checkpoint
from trace_jax.rl import runlog

ALLOW_CHANGE = "--allow-config-change"
# Errors whose message names what the user should fix: printed as one line, exit code 2.
USER_ERRORS = (ConfigError, CheckpointError)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run; the message says where its last checkpoint is."""


def resolve(config_path: str, overrides: Sequence[str]) -> tuple[Experiment, Any]:
    """Load a config file (``experiment: <name>`` plus that experiment's fields) with overrides.

    ``task.name=X`` naming another task than the file's drops the file's ``task.args`` (they are
    that task's knobs); ``task.args.*`` overrides given with it apply.

    Returns:
      (experiment, config dataclass). Raises ``ConfigError`` naming the bad key.
    """
    data = load_yaml(config_path)
    return resolve_data(data, overrides, config_path)


def resolve_data(data: dict, overrides: Sequence[str], source: str) -> tuple[Experiment, Any]:
    """``resolve`` of an already loaded mapping (``source`` names it in errors)."""
    data = apply_overrides(_drop_other_task_args(data, overrides), overrides)
    name = data.pop("experiment", None)
    if name is None:
        raise ConfigError(f"{source}: missing the key 'experiment' (the registered name)")
    try:
        exp = get_experiment(name)
    except KeyError as e:
        raise ConfigError(f"experiment: {e.args[0]}") from None
    return exp, from_dict(exp.config_cls, data)


def _drop_other_task_args(data: dict, overrides: Sequence[str]) -> dict:
    task = data.get("task")
    if not isinstance(task, dict) or "args" not in task:
        return data
    names = [o.split("=", 1)[1].strip() for o in overrides if o.split("=", 1)[0] == "task.name"]
    if not names or names[-1] == task.get("name"):
        return data
    return {**data, "task": {k: v for k, v in task.items() if k != "args"}}


# ----------------------------------------------------------------------------- one run


def check_run_dir(run_dir: Path, resolved: dict, allow_change: bool) -> list:
    """Refuse (``ConfigError``, one line) a run directory whose steps were made with other
    settings, unless ``allow_change``. Returns the differences ``[(key, old, new)]``."""
    old = runlog.current_config(run_dir)
    diff = config_diff(old, resolved) if old is not None else []
    if diff and not allow_change:
        raise ConfigError(
            f"{run_dir} was run with other settings ({format_diff(diff)}); use a new --run-dir, "
            f"or pass {ALLOW_CHANGE} to continue it with the new settings"
        )
    return diff


def execute(exp: Experiment, cfg: Any, run_dir: Path, allow_change: bool = False) -> dict:
    """Run ``exp`` in ``run_dir`` (resuming its checkpoints): check and record the settings, run,
    and write ``results.json`` with the run's ``summary`` (RL runs). Nothing is written when the
    settings are refused.

    Raises ``ConfigError``/``CheckpointError`` with a one-line message naming the key or file, and
    ``Interrupted`` on Ctrl-C.
    """
    resolved = {"experiment": exp.name, **to_dict(cfg)}
    existed = run_dir.exists()
    diff = check_run_dir(run_dir, resolved, allow_change)
    run_dir.mkdir(parents=True, exist_ok=True)
    if diff or runlog.current_config(run_dir) is None:
        first = runlog.record_config(run_dir, resolved)
        if diff:
            print(f"continuing {run_dir} from step {first} with {format_diff(diff)}")
    try:
        with _quiet_orphaned_callbacks():
            results = exp.run(cfg, run_dir)
    except KeyboardInterrupt:
        raise Interrupted(_interrupted(run_dir)) from None
    except USER_ERRORS:
        if not existed and [p.name for p in run_dir.iterdir()] == [runlog.CONFIG]:
            (run_dir / runlog.CONFIG).unlink()  # refused before any work: leave nothing behind
            run_dir.rmdir()
        raise
    except Exception as e:
        if _raised_in(e, run_checkpoint.__file__):
            raise CheckpointError(_checkpoint_failure(run_dir, e)) from e
        raise
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        summary = runlog.summarize(runlog.read_metrics(metrics), getattr(cfg, "eval_split", "eval"))
        print(f"\n{'=' * 30} run summary {'=' * 30}\n{runlog.format_summary(summary)}")
        results = {**results, "summary": summary}
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    return results


def _without_closed_loop_reports(hook):
    """``hook`` (a ``sys.unraisablehook``) minus the reports of "Event loop is closed": after a
    failed restore, tensorstore still delivers results to the asyncio loop orbax has closed, and
    each is reported with a traceback that says nothing the one-line error does not."""

    def filtered(report):
        if not (
            isinstance(report.exc_value, RuntimeError) and "loop is closed" in str(report.exc_value)
        ):
            hook(report)

    return filtered


@contextlib.contextmanager
def _quiet_orphaned_callbacks():
    original = sys.unraisablehook
    sys.unraisablehook = _without_closed_loop_reports(original)
    try:
        yield
    finally:
        sys.unraisablehook = original


def _interrupted(run_dir: Path) -> str:
    steps = runlog.checkpoint_steps(run_dir)
    if not steps:
        return f"interrupted: {run_dir} has no checkpoint yet (a rerun starts from step 0)"
    last = run_dir / "checkpoints" / str(steps[-1])
    return f"interrupted: the last checkpoint is {last} (the same command resumes from it)"


def _raised_in(e: BaseException, filename: str) -> bool:
    target = Path(filename).resolve()
    return any(Path(f.filename).resolve() == target for f in traceback.extract_tb(e.__traceback__))


def _checkpoint_failure(run_dir: Path, e: Exception) -> str:
    steps = runlog.checkpoint_steps(run_dir)
    where = run_dir / "checkpoints" / (str(steps[-1]) if steps else "")
    first = (str(e).strip().splitlines() or [""])[0]
    first = first if len(first) <= 160 else first[:160] + "..."
    return (
        f"{where}: the run checkpoint cannot be used ({type(e).__name__}: {first}); remove it to "
        f"resume from an earlier one, or use a new --run-dir"
    )


def run_command(args: argparse.Namespace) -> int:
    exp, cfg = resolve(args.config, args.overrides)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.run_dir or f"runs/{exp.name}-{stamp}")
    execute(exp, cfg, run_dir, args.allow_config_change)
    print(f"\nrun directory: {run_dir}")
    return 0


# ----------------------------------------------------------------------------- compare

COMPARE_COLUMNS = (
    ("eval/reward_start", "eval start"),
    ("eval/reward_end", "eval end"),
    ("reward/last_fifth", "train last5th"),
    ("mismatch/logp_abs/last_fifth", "logp_abs"),
    ("mismatch/kl_k3/last_fifth", "kl_k3"),
)
COMPARE_KEYS = (
    "reward",
    "eval/reward",
    "mismatch/logp_abs",
    "mismatch/kl_k3",
    "train/entropy",
    "response_length",
)


def load_run(run_dir: Path) -> tuple[dict, list[dict], dict]:
    """(settings of its newest steps, metrics records, summary) of a run directory."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"{run_dir} has no metrics.jsonl")
    cfg = runlog.current_config(run_dir) or {}
    records = runlog.read_metrics(metrics)
    return cfg, records, runlog.summarize(records, cfg.get("eval_split", "eval"))


def seed_groups(configs: dict[str, dict]) -> list[tuple[str, list[str]]]:
    """Runs whose settings differ only by ``seed``, grouped: ``[(label, [run ...])]`` in order of
    first appearance; a label names the experiment and the keys that set groups apart."""
    flat = {run: _without_seed(cfg) for run, cfg in configs.items()}
    groups: dict[str, list[str]] = {}
    for run, f in flat.items():
        groups.setdefault(json.dumps(f, sort_keys=True, default=str), []).append(run)
    keys = sorted({k for f in flat.values() for k in f})
    varying = [
        k
        for k in keys
        if k != "experiment"
        and len({json.dumps(flat[runs[0]].get(k), default=str) for runs in groups.values()}) > 1
    ]
    out = []
    for runs in groups.values():
        f = flat[runs[0]]
        parts = [f"{k}={f.get(k)}" for k in varying]
        out.append((" ".join([str(f.get("experiment", "?")), *parts]), runs))
    return out


def _without_seed(cfg: dict) -> dict:
    return {k: v for k, v in flatten(cfg).items() if k != "seed"}


def mean_spread(values: Sequence[float]) -> tuple[float, float, int]:
    """Mean, sample standard deviation (0 for one value) and count of the finite ``values``."""
    import numpy as np

    v = np.asarray([x for x in values if x is not None], float)
    if v.size == 0:
        return float("nan"), float("nan"), 0
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0, int(v.size)


def compare(run_dirs: Sequence[str], out: str | None = None) -> int:
    """Curves of several runs (one line per run directory) and a table of their summaries, runs
    that differ only by seed aggregated as mean ± sd over n seeds."""
    runs = {}
    for d in run_dirs:
        if d in runs:
            raise ConfigError(f"compare: {d} is given twice")
        runs[d] = load_run(Path(d))
    path = Path(out) if out else Path(run_dirs[0]) / "compare.png"
    runlog.plot_curves(
        {d: recs for d, (_, recs, _) in runs.items()}, COMPARE_KEYS, path, title="runs compared"
    )
    splits = sorted({s.get("eval_split", "eval") for _, _, s in runs.values()})
    print(
        "eval = greedy reward on the held-out split"
        if splits == ["eval"]
        else f"eval = greedy reward on the {'/'.join(splits)} split"
    )
    print("train = reward of the sampled rollouts, mean of the last fifth of the RL steps")
    print("logp_abs, kl_k3 = trainer-vs-rollout mismatch, mean of the last fifth")
    groups = seed_groups({d: cfg for d, (cfg, _, _) in runs.items()})
    width = max(len(label) for label, _ in groups) if groups else 10
    head = " ".join(f"{name:>22s}" for _, name in COMPARE_COLUMNS)
    print(f"\n{'run (mean ± sd over n seeds)':{width}s} {'n':>2s} {head}")
    for label, members in groups:
        cells = []
        for key, _ in COMPARE_COLUMNS:
            m, sd, n = mean_spread([runs[d][2].get(key) for d in members])
            cells.append(f"{m:10.4g} ± {sd:<9.2g}" if n > 1 else f"{m:22.4g}")
        print(f"{label:{width}s} {len(members):2d} {' '.join(cells)}")
        for d in members:
            print(f"  {d}  (seed {runs[d][0].get('seed', '?')})")
    print(f"plot: {path}")
    return 0


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run a config")
    run_p.add_argument("config", help="path to configs/<name>.yaml")
    run_p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    run_p.add_argument("--run-dir", default=None, help="output folder (default runs/<name>-<time>)")
    run_p.add_argument(
        ALLOW_CHANGE,
        action="store_true",
        help="resume a run directory with other settings (recorded as "
        "config.changed-at-step-N.yaml; config.yaml keeps the first settings)",
    )
    sub.add_parser("list", help="list the registered experiments")
    cmp_p = sub.add_parser("compare", help="plot and tabulate several runs, seeds aggregated")
    cmp_p.add_argument("run_dirs", nargs="+", help="run directories with metrics.jsonl")
    cmp_p.add_argument("--out", default=None, help="PNG path (default: compare.png in the first)")
    args, extra = parser.parse_known_args(argv)
    # key=value after an option (``run x.yaml --run-dir d steps=3``) is an override too
    if extra and hasattr(args, "overrides") and all("=" in e and e[0] != "-" for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")

    try:
        if args.command == "compare":
            return compare(args.run_dirs, args.out)
        if args.command == "list":
            import experiments.pipelines  # noqa: F401

            for name, exp in sorted(EXPERIMENTS.items()):
                print(f"{name:24s} {exp.description}")
            return 0
        return run_command(args)
    except USER_ERRORS as e:
        kind = "checkpoint error" if isinstance(e, CheckpointError) else "config error"
        print(f"{kind}: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"\n{e}" if isinstance(e, Interrupted) else "\ninterrupted", file=sys.stderr)
        return 130


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


if __name__ == "__main__":
    # the reports can come after main returns, until the process ends
    sys.unraisablehook = _without_closed_loop_reports(sys.unraisablehook)
    sys.exit(main())
