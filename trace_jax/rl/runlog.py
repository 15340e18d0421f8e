"""Run outputs: metrics as JSONL and TensorBoard, a progress line with ETA, and PNG curves.

``metrics.jsonl`` holds one JSON object per step (``{"step": n, ...}``); on resume it is cut back
to the checkpointed step so that the file equals that of an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


class MetricsLog:
    """Appends step metrics to ``<run_dir>/metrics.jsonl`` and TensorBoard event files.

    Args:
      run_dir: the run directory.
      resume_step: keep the records of steps <= this (a resumed run), drop the rest; None
        starts a new file.
      tensorboard: also write ``<run_dir>/tensorboard``.
    """

    def __init__(self, run_dir: Path, resume_step: int | None = None, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        kept = []
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._writer = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(str(Path(run_dir) / "tensorboard"), flush_secs=10)

    def write(self, step: int, values: Mapping[str, float]) -> None:
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
    """The records of a ``metrics.jsonl`` file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class Progress:
    """A one-line progress bar with rate and ETA on stderr (a line per update when not a tty)."""

    def __init__(self, total: int, desc: str = "", start: int = 0, stream=None):
        self.total, self.desc, self.done = total, desc, start
        self.stream = stream or sys.stderr
        self._t0, self._n0 = time.perf_counter(), start

    def update(self, done: int, info: str = "") -> None:
        self.done = done
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


def plot_curves(
    runs: Mapping[str, Sequence[dict]], keys: Sequence[str], path: Path, title: str = ""
) -> Path:
    """One panel per metric key, one line per run (label -> its metric records)."""
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
            pts = [(r["step"], r[key]) for r in recs if key in r]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=label, marker="." if len(pts) < 30 else None)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
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
