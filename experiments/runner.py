"""The run path every command shares: resolve a config file with overrides, check the run
directory against the settings that produced its steps, run, and write ``results.json`` with the
run's summary. Errors a user can cause are ``ConfigError``/``CheckpointError`` with a one-line
message; Ctrl-C is ``Interrupted``, naming the last checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

import jax
from jax._src import xla_bridge
from jax.experimental import multihost_utils

from experiments.registry import Experiment, get_experiment
from trace_jax.config import (
    ConfigError,
    apply_overrides,
    config_diff,
    format_diff,
    from_dict,
    load_yaml,
    to_dict,
)
from trace_jax.model.hf import CheckpointError
from trace_jax.rl import runlog

ALLOW_CHANGE = "--allow-config-change"
# Keys that change how long a process runs, not what the run computes: no change of settings.
OPERATIONAL = ("time_limit_min",)
# Errors whose message names what the user should fix: printed as one line, exit code 2.
USER_ERRORS = (ConfigError, CheckpointError)


DETERMINISTIC = "--xla_gpu_deterministic_ops=true"
# The share of a GPU's memory a run's process takes (JAX's default is 0.75: on an 80 GB H100 that
# leaves ~20 GB unused by a run that owns the GPU); a share the caller set rules (``sweep --jobs
# N`` sets 0.9 / N).
MEM_FRACTION = "0.92"
# JAX 0.11's name for it and the deprecated one (JAX refuses both at once)
MEM_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def set_memory_fraction(env: MutableMapping[str, str], fraction: str) -> None:
    """Set a process's share of its GPU's memory in ``env`` (read when its backend starts),
    unless one is set under either name."""
    if not any(env.get(name) for name in MEM_FRACTION_VARS):
        env[MEM_FRACTION_VARS[0]] = fraction


def init_distributed(environ=os.environ) -> bool:
    """Join a multi-process JAX job when the environment describes one; call it before anything
    touches a device. ``JAX_COORDINATOR_ADDRESS`` (host:port of process 0) with
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, or the address alone and the count and id that
    JAX detects from its cluster launcher (SLURM, Open MPI, Kubernetes). None set: one process.
    Returns whether it joined a job."""
    address = environ.get("JAX_COORDINATOR_ADDRESS", "")
    count, index = environ.get("JAX_NUM_PROCESSES", ""), environ.get("JAX_PROCESS_ID", "")
    if not address:
        if count or index:
            raise ConfigError(
                "JAX_NUM_PROCESSES, JAX_PROCESS_ID: set JAX_COORDINATOR_ADDRESS (host:port of "
                "process 0) too"
            )
        return False
    if not all(v.isdigit() for v in (count, index) if v) or bool(count) != bool(index):
        raise ConfigError(
            f"JAX_NUM_PROCESSES, JAX_PROCESS_ID: both or neither, non-negative integers "
            f"(got {count!r}, {index!r})"
        )
    num, pid = (int(count), int(index)) if count else (None, None)
    if num is not None and not pid < num:
        raise ConfigError(f"JAX_PROCESS_ID: {pid} is not below JAX_NUM_PROCESSES {num}")
    jax.distributed.initialize(address, num, pid)
    return True


def deterministic_flags(flags: str, started: bool, backend) -> str:
    """``XLA_FLAGS`` with XLA's deterministic GPU ops (``deterministic: true``). XLA reads its
    flags when the backend starts: a GPU backend started without them cannot honour the key
    (``ConfigError``); the CPU's ops are deterministic already. ``backend()``: the platform."""
    if DETERMINISTIC in flags.split():
        return flags
    if started and backend() == "gpu":
        raise ConfigError(
            f"deterministic: the GPU backend started before XLA_FLAGS could get {DETERMINISTIC}; "
            "set it in XLA_FLAGS before starting"
        )
    return f"{flags} {DETERMINISTIC}".strip()


def settings_diff(old: dict, new: dict) -> list:
    """``config_diff`` without the ``OPERATIONAL`` keys (at any depth)."""
    return [d for d in config_diff(old, new) if d[0].rsplit(".", 1)[-1] not in OPERATIONAL]


def stop_on_sigint() -> None:
    """SIGINT (Ctrl-C; what ``sweep --jobs`` sends its cells at a time limit) stops this process
    as Python's default does, by ``KeyboardInterrupt``: a run then closes its files and names
    its last checkpoint. Also where the process started with SIGINT ignored, as a command
    started in the background (``&`` in a script, and so its children) does: it would
    otherwise be waited out, then killed, with no checkpoint. In the main thread only."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
    diff = settings_diff(old, resolved) if old is not None else []
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

    In a multi-process job (``init_distributed``) every process runs; process 0 alone writes
    the settings, the summary and ``results.json``.

    Raises ``ConfigError``/``CheckpointError`` with a one-line message naming the key or file, and
    ``Interrupted`` on Ctrl-C.
    """
    resolved = {"experiment": exp.name, **to_dict(cfg)}
    if not xla_bridge.backends_are_initialized():
        set_memory_fraction(os.environ, MEM_FRACTION)
    if getattr(cfg, "deterministic", False):  # before anything starts the backend
        os.environ["XLA_FLAGS"] = deterministic_flags(
            os.environ.get("XLA_FLAGS", ""),
            xla_bridge.backends_are_initialized(),
            lambda: jax.default_backend(),
        )
    primary = jax.process_index() == 0
    existed = run_dir.exists()
    diff = check_run_dir(run_dir, resolved, allow_change)
    if jax.process_count() > 1:  # all have read the recorded settings before process 0 writes
        multihost_utils.sync_global_devices("run directory checked")
    run_dir.mkdir(parents=True, exist_ok=True)
    if primary and (diff or runlog.current_config(run_dir) is None):
        first = runlog.record_config(run_dir, resolved)
        if diff:
            print(f"continuing {run_dir} from step {first} with {format_diff(diff)}")
    if primary:
        runlog.record_provenance(run_dir)
    try:
        with _quiet_orphaned_callbacks():
            results = exp.run(cfg, run_dir)
    except KeyboardInterrupt:
        raise Interrupted(_interrupted(run_dir)) from None
    except USER_ERRORS:
        records = {runlog.CONFIG, runlog.PROVENANCE}
        if primary and not existed and {p.name for p in run_dir.iterdir()} <= records:
            for name in records:  # refused before any work: leave nothing behind
                (run_dir / name).unlink(missing_ok=True)
            run_dir.rmdir()
        raise
    if not primary:
        return results
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        summary = runlog.summarize(runlog.read_metrics(metrics), getattr(cfg, "eval_split", "eval"))
        print(f"\n{'=' * 30} run summary {'=' * 30}\n{runlog.format_summary(summary)}")
        results = {**results, "summary": summary}
    results = {**results, "provenance": runlog.read_provenance(run_dir)}
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    return results


def without_closed_loop_reports(hook):
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
    sys.unraisablehook = without_closed_loop_reports(original)
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
