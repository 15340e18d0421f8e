"""Run outputs: metrics as JSONL and TensorBoard, a progress line with ETA, PNG curves, the
run's summary, and the record of the settings and the code and device that produced its steps.

``metrics.jsonl`` holds one JSON object per step (``{"step": n, ...}``); on resume it is cut back
to the checkpointed step so that the file equals that of an uninterrupted run. ``config.yaml``
holds the settings of step 0; a resume with other settings adds ``config.changed-at-step-N.yaml``
(those of steps N onward) and never rewrites ``config.yaml``. ``provenance.jsonl`` holds one line
per process that ran steps: from which step, the commit, the device, the JAX version, the date and
the command.
"""

from __future__ import annotations

import datetime
import functools
import gzip
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml


class MetricsLog:
    """Appends step metrics to ``<run_dir>/metrics.jsonl`` and TensorBoard event files.

    Args:
      run_dir: the run directory.
      resume_step: keep the records of steps <= this (a resumed run), drop the rest; None
        starts a new file.
      tensorboard: also write ``<run_dir>/tensorboard``.
      write: False: write nothing (the processes of a multi-process job but the first).
    """

    def __init__(
        self,
        run_dir: Path,
        resume_step: int | None = None,
        tensorboard: bool = True,
        write: bool = True,
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._writer, self._write = None, write
        if not write:
            return
        kept = []
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(str(Path(run_dir) / "tensorboard"), flush_secs=10)

    def write(self, step: int, values: Mapping[str, float]) -> None:
        if not self._write:
            return
        record = {"step": int(step), **{k: _plain(v) for k, v in values.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, float) and math.isfinite(v):
                    self._writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _plain(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file, in order (or of its gzip archive,
    ``metrics.jsonl.gz``, where the file itself is absent)."""
    path = Path(path)
    packed = path.with_name(path.name + ".gz")
    if not path.exists() and packed.is_file():
        text = gzip.decompress(packed.read_bytes()).decode()
    else:
        text = path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class Progress:
    """A one-line progress bar with rate and ETA on stderr (a line per update when not a tty);
    ``show=False``: silent (the processes of a multi-process job but the first)."""

    def __init__(self, total: int, desc: str = "", start: int = 0, stream=None, show=True):
        self.total, self.desc, self.done, self.show = total, desc, start, show
        self.stream = stream or sys.stderr
        self._t0, self._n0 = time.perf_counter(), start

    def update(self, done: int, info: str = "") -> None:
        self.done = done
        if not self.show:
            return
        elapsed = time.perf_counter() - self._t0
        rate = (done - self._n0) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else float("nan")
        width = 24
        filled = int(width * done / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        line = (
            f"{self.desc} [{bar}] {done}/{self.total} {_duration(elapsed)} elapsed, "
            f"ETA {_duration(eta)} {info}"
        )
        tty = getattr(self.stream, "isatty", lambda: False)()
        self.stream.write(("\r" + line) if tty else line + "\n")
        if tty and done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def _duration(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


def curve_points(records: Sequence[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` in the records that log it; the greedy evaluation before RL,
    logged as ``eval/reward_start`` (``eval/reward_bf16_start``), is the first point of
    ``eval/reward`` (``eval/reward_bf16``)."""
    also = f"{key}_start" if key in EVAL_KEYS else key
    return [(r["step"], r[key] if key in r else r[also]) for r in records if key in r or also in r]


def plot_curves(
    runs: Mapping[str, Sequence[dict]],
    keys: Sequence[str],
    path: Path,
    title: str = "",
    points: Callable[[Sequence[dict], str], list[tuple[int, float]]] = curve_points,
    xlabel: str = "step",
) -> Path:
    """One panel per metric key, one line per run (label -> its metric records); ``points``
    gives a run's (x, value) of a key."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in keys if any(k in r for recs in runs.values() for r in recs)]
    if not keys:
        raise ValueError(f"none of the metrics {list(keys)} was logged")
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        for label, recs in runs.items():
            pts = points(recs, key)
            if pts:
                ax.plot(*zip(*pts, strict=True), label=label, marker="." if len(pts) < 30 else None)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel(xlabel)
        if key.startswith("mismatch/"):
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- run summary


# The greedy evaluations: in the rollout's precision, and in BF16 (``eval_bf16``).
EVAL_KEYS = ("eval/reward", "eval/reward_bf16")

LAST_FIFTH = (
    "train/entropy",
    "reward/mixed_groups",
    "mismatch/logp_abs",
    "mismatch/kl_k3",
    "mismatch/guided_code_agreement",
    "mismatch/code_one_step/all",
)


# Constant through a run (its last value is the run's): TRACE's guidance per token, compact, full.
LAST = ("guidance/bytes_per_token", "guidance/full_bytes_per_token", "guidance/ratio_to_full")
# A step's seconds of making programs (``compile_seconds``): the steps with some are left out of
# the phases' means (a new program's compilation is no phase's cost), and it is no phase
COMPILE_KEY = "compile_s"
# JAX's monitoring events of making a program: its lowering to MLIR and the backend's
# compilation (or load from the persistent cache). Neither nests (tracing, which does, is out).
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_compiling = {"seconds": 0.0, "listening": False}


def _on_event(event: str, duration: float, **_: Any) -> None:
    if event in COMPILE_EVENTS:
        _compiling["seconds"] += duration


def compile_seconds() -> float:
    """Seconds this process's JAX spent lowering and compiling programs (``COMPILE_EVENTS``)
    since the last call (the first call starts the count and returns 0)."""
    if not _compiling["listening"]:
        import jax

        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _compiling["listening"] = True
    seconds, _compiling["seconds"] = _compiling["seconds"], 0.0
    return seconds


# Shares of the code mismatches of a step: undefined (NaN) at a step without mismatches.
SHARES_OF_MISMATCHES = ("mismatch/code_one_step/", "mismatch/code_far/")


def summarize(records: Sequence[Mapping[str, Any]], eval_split: str = "eval") -> dict[str, Any]:
    """The numbers a run ends with, from its ``metrics.jsonl`` records (one function, used by the
    run's final table, ``compare`` and the sweep report).

    RL steps are the records with a train ``reward``; a fifth is ``max(1, n // 5)`` of them.
    Returns a flat dict (a metric that was not logged is left out):

      eval_split, rl_steps, fifth: the split evaluated, the RL step count, the fifth's length.
      eval/reward_start, eval/reward_end: greedy reward on ``eval_split`` before the first RL
        update and at the last evaluation; eval/reward_bf16_start, eval/reward_bf16_end: the
        same evaluated in BF16 (``eval_bf16``).
      reward/first_fifth, reward/last_fifth: mean train reward (sampled rollouts).
      <key>/last_fifth for the ``LAST_FIFTH`` keys (``train/entropy``, ``reward/mixed_groups``,
        ``mismatch/logp_abs``, ``mismatch/kl_k3``, the code agreement at guided sites and the
        one-code-step share of code mismatches):
        means over the steps of the last fifth that logged the key (for a share of mismatches,
        that had a mismatch).
      the ``LAST`` keys (guidance bytes per token, compact and full, and their ratio): the
        last value logged.
      time/<key>: for every logged ``<key>`` ending in ``_s`` (seconds of a phase), its mean over
        the RL steps after the first that compiled nothing (``COMPILE_KEY``: a new trainer width
        under ``trim_padding``, a resumed run's first step; all after the first where each
        compiled); ``rate/<key>`` likewise for ``_per_s``; ``timed_steps``: their count.
    """
    rl = [r for r in records if "reward" in r]
    n = len(rl)
    k = max(1, n // 5)
    out: dict[str, Any] = {"eval_split": eval_split, "rl_steps": n, "fifth": k}

    def mean(key, recs):
        values = [float(r[key]) for r in recs if key in r]
        if key.startswith(SHARES_OF_MISMATCHES):  # NaN: no mismatch to share out that step
            values = [v for v in values if not math.isnan(v)]
        return sum(values) / len(values) if values else None

    stats = {}
    for key in EVAL_KEYS:
        start = next((r[f"{key}_start"] for r in records if f"{key}_start" in r), None)
        end = [r[key] for r in records if key in r]
        stats[f"{key}_start"], stats[f"{key}_end"] = start, end[-1] if end else None
    stats |= {
        "reward/first_fifth": mean("reward", rl[:k]),
        "reward/last_fifth": mean("reward", rl[-k:]),
        **{f"{key}/last_fifth": mean(key, rl[-k:]) for key in LAST_FIFTH},
        **{key: next((r[key] for r in reversed(rl) if key in r), None) for key in LAST},
    }
    timed = [r for r in rl[1:] if not r.get(COMPILE_KEY)] or (rl[1:] if n > 1 else rl)
    out["timed_steps"] = len(timed)
    for key in sorted({key for r in rl for key in r if key.endswith("_s")} - {COMPILE_KEY}):
        group = "rate" if key.endswith("_per_s") else "time"
        stats[f"{group}/{key}"] = mean(key, timed)
    out.update({key: float(v) for key, v in stats.items() if v is not None})
    return out


def summary_rows(summary: Mapping[str, Any]) -> list[tuple[str, str, float]]:
    """``(key, label, value)`` of a ``summarize`` dict, in reading order, labelled for a table."""
    split, n, k = (summary.get(key) for key in ("eval_split", "rl_steps", "fifth"))
    labels = {
        "eval/reward_start": f"eval reward (greedy, {split} split), start of RL",
        "eval/reward_end": f"eval reward (greedy, {split} split), "
        + ("end of RL" if n else "after the warm start"),
        "eval/reward_bf16_start": f"eval reward in BF16 (greedy, {split} split), start of RL",
        "eval/reward_bf16_end": f"eval reward in BF16 (greedy, {split} split), "
        + ("end of RL" if n else "after the warm start"),
        "reward/first_fifth": f"train reward (sampled), first {k} of {n} RL steps",
        "reward/last_fifth": f"train reward (sampled), last {k} of {n} RL steps",
        **{f"{key}/last_fifth": f"{key}, mean of the last {k} RL steps" for key in LAST_FIFTH},
        "guidance/bytes_per_token": "guidance bytes per token (compact)",
        "guidance/full_bytes_per_token": "guidance bytes per token (full)",
        "guidance/ratio_to_full": "compact / full guidance",
    }
    rows = [(key, label, summary[key]) for key, label in labels.items() if key in summary]
    n = summary.get("timed_steps")
    steps = f"the {'' if n is None else f'{n} '}RL steps that compiled nothing"
    for key in sorted(summary):
        if key.startswith("time/"):
            rows.append((key, f"{key[5:]}: mean seconds a step over {steps}", summary[key]))
        elif key.startswith("rate/"):
            rows.append((key, f"{key[5:]}: mean over {steps}", summary[key]))
    return rows


def format_summary(summary: Mapping[str, Any]) -> str:
    """The summary as a two-column text table."""
    rows = summary_rows(summary)
    width = max((len(label) for _, label, _ in rows), default=0)
    return "\n".join(f"{label:{width}s}  {value:.4g}" for _, label, value in rows)


# ----------------------------------------------------------------------------- run directory

CONFIG = "config.yaml"
CONFIG_CHANGE = "config.changed-at-step-{step}.yaml"


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """The steps of the complete checkpoints in ``<run_dir>/checkpoints`` (orbax writes a step to
    a temporary folder and renames it to the bare step number when it is complete)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())


def config_history(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``[(first step, config file)]`` of a run directory, oldest first: ``config.yaml`` (step 0)
    and one ``config.changed-at-step-N.yaml`` per resume with changed settings."""
    run_dir = Path(run_dir)
    out = [(0, run_dir / CONFIG)] if (run_dir / CONFIG).is_file() else []
    prefix, suffix = CONFIG_CHANGE.split("{step}")
    for p in run_dir.glob(CONFIG_CHANGE.format(step="*")):
        step = p.name.removeprefix(prefix).removesuffix(suffix)
        if step.isdigit():
            out.append((int(step), p))
    return sorted(out)


def current_config(run_dir: str | Path) -> dict | None:
    """The settings the newest steps of a run directory ran with (None: a new directory)."""
    history = config_history(run_dir)
    return yaml.safe_load(history[-1][1].read_text()) if history else None


def record_config(run_dir: str | Path, resolved: Mapping[str, Any]) -> int:
    """Record ``resolved`` as the settings of the steps a (resumed) run is about to log.

    A run resumes after its newest checkpoint: the settings of step N onward go to
    ``config.changed-at-step-N.yaml`` and ``config.yaml`` keeps those of step 0. Without a
    checkpoint every step is logged anew, so ``config.yaml`` is written. Records of steps that
    will be logged again are removed. Returns N (0 for ``config.yaml``).
    """
    run_dir = Path(run_dir)
    steps = checkpoint_steps(run_dir)
    first = steps[-1] + 1 if steps else 0
    for step, path in config_history(run_dir):
        if step >= first and path.name != CONFIG:
            path.unlink()
    name = CONFIG_CHANGE.format(step=first) if first else CONFIG
    (run_dir / name).write_text(yaml.safe_dump(dict(resolved), sort_keys=False))
    return first


PROVENANCE = "provenance.jsonl"
_ROOT = Path(__file__).resolve().parents[2]  # the checkout the package runs from


def _git(*args: str, env: Mapping[str, str] | None = None) -> str | None:
    """``git -C <checkout> args`` (``env``: variables added)'s output; None where it fails."""
    try:
        out = subprocess.run(
            ["git", "-C", str(_ROOT), *args],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, **env} if env else None,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def worktree_tree() -> str | None:
    """The git tree id of the files the checkout holds (tracked and untracked, not ignored), as
    they are on disk: the tree of the commit whose files these are, whatever HEAD the checkout
    records (a copy of the working tree, as a GPU machine is sent, can carry an older ``.git``).
    Hashed into a temporary index and object folder: the repository is not written. None
    outside a git checkout."""
    objects = _git("rev-parse", "--path-format=absolute", "--git-path", "objects")
    if objects is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            "GIT_INDEX_FILE": os.path.join(tmp, "index"),
            "GIT_OBJECT_DIRECTORY": os.path.join(tmp, "objects"),
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": objects,
        }
        os.mkdir(env["GIT_OBJECT_DIRECTORY"])
        if _git("add", "-A", env=env) is None:
            return None
        return _git("write-tree", env=env)


@functools.cache
def _commits_by_tree() -> dict[str, str]:
    """The local repository's commits (every ref's history) by their tree id."""
    log = _git("log", "--all", "--format=%T %H") or ""
    return dict(line.split() for line in log.splitlines())  # newest first: the oldest stays


def code_label(p: Mapping[str, Any]) -> str:
    """A provenance line's code as shown: the short hash of this repository's commit whose files
    the process ran (by its ``tree``), else its checkout's HEAD with ``+dirty`` where tracked
    files differed from it; "unknown" where neither was recorded."""
    commit = _commits_by_tree().get(p.get("tree") or "")
    if commit:
        return commit[:7]
    if not p.get("commit"):
        return "unknown"
    return p["commit"][:7] + (" +dirty" if p.get("dirty") else "")


# What a run executes: the package, the kernels, the configs and the entry point's path to the
# loop (not the reports, benchmarks, tests or documents, which a study's records outlive).
RUN_CODE = (
    "trace_jax",
    "pallas_kernels",
    "configs",
    "experiments/__main__.py",
    "experiments/registry.py",
    "experiments/runner.py",
    "experiments/sweep.py",
    "experiments/pipelines",
    "pyproject.toml",
)


@functools.cache
def run_code(tree: str | None) -> str | None:
    """A short id of the ``RUN_CODE`` paths' contents in the git tree ``tree`` (a provenance
    line's ``tree``): equal for two processes that ran the same code, whatever else (documents,
    reports, tests) differed between their commits. None where this repository does not hold
    the tree."""
    if not tree:
        return None
    listing = _git("ls-tree", "--full-tree", tree, "--", *RUN_CODE)
    if not listing:
        return None
    return hashlib.sha1(listing.encode()).hexdigest()[:10]


def host_cpu() -> str:
    """The host's CPU model (``/proc/cpuinfo``'s first ``model name``; else the platform's
    processor string, "unknown" where neither says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def provenance() -> dict[str, Any]:
    """What this process runs: ``commit`` (the checkout's HEAD; None outside a git checkout),
    ``dirty`` (tracked files differ from it), ``tree`` (``worktree_tree``: the files' git tree,
    which names the commit they are where HEAD is stale), ``device`` (kind of the first device),
    ``devices``, ``host`` (``host_cpu``), ``xla_flags`` (``XLA_FLAGS``: XLA's code generation
    changes a run's float roundings, and a CPU warm start's parameters with it), ``jax``,
    ``date`` (UTC) and ``command``."""
    import jax

    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no")) if commit else None
    return {
        "commit": commit,
        "dirty": dirty,
        "tree": worktree_tree(),
        "device": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "host": host_cpu(),
        "xla_flags": os.environ.get("XLA_FLAGS", "").strip(),
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }


def record_provenance(run_dir: str | Path) -> list[dict]:
    """Append this process's ``provenance()`` to ``<run_dir>/provenance.jsonl`` as the origin of
    the steps from the run's next one on (after its newest checkpoint; the lines of steps that
    will be logged again go). Returns every line, oldest first."""
    path = Path(run_dir) / PROVENANCE
    steps = checkpoint_steps(run_dir)
    first = steps[-1] + 1 if steps else 0
    kept = [r for r in read_provenance(run_dir) if r["first_step"] < first]
    kept.append({"first_step": first, **provenance()})
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


def read_provenance(run_dir: str | Path) -> list[dict]:
    """The lines of ``<run_dir>/provenance.jsonl`` ([] when there is none)."""
    path = Path(run_dir) / PROVENANCE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
