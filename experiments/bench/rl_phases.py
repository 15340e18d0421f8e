"""Per-phase seconds of RL runs from their ``metrics.jsonl``: the median over the RL steps after
the first (which compiles), one row per run, and reward / eval reward / mismatch at the end;
before the table, the device and commit of each run's processes and its greedy evaluations by
RL step; after it, each TRACE run's median step time against each vanilla QAT run's.

    python experiments/bench/rl_phases.py runs/medium-bf16 runs/medium-trace ...
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import yaml

from experiments.report import rl_curve
from trace_jax.rl import runlog

PHASES = (
    "rollout/refit_s",
    "rollout/prefill_s",
    "rollout/decode_s",
    "rollout/env_s",
    "guidance/transfer_s",
    "train/score_s",
    "train/forward_backward_s",
    "train/optimizer_s",
    "step_s",
)


OUTSIDE_DECODE = "step_s outside decode"


def phase_table(run_dir: Path) -> dict[str, float]:
    """Medians of each phase, ``rollout/tokens_per_s`` and ``guidance/bytes`` over the
    RL steps of a run after its first (and of the warm start's steps after its first), the
    first RL step's seconds (compilation included); plus the last train reward, eval rewards
    and logp_abs."""
    records = runlog.read_metrics(Path(run_dir) / "metrics.jsonl")
    rl = [r for r in records if "reward" in r]
    sft = [r["sft/step_s"] for r in records if "sft/step_s" in r]
    steady = rl[1:] or rl
    row: dict[str, float] = {"sft_steps": float(len(sft)), "rl_steps": float(len(rl))}
    if sft:  # the warm start's steps after its first (which compiles)
        row["sft/step_s"] = statistics.median(sft[1:] or sft)
    if rl and "step_s" in rl[0]:  # compiles the rollout's and the trainer's programs
        row["first RL step_s"] = rl[0]["step_s"]
    for key in (*PHASES, "rollout/tokens_per_s", "rollout/decode_step_ms", "guidance/bytes"):
        values = [r[key] for r in steady if key in r]
        if values:
            row[key] = statistics.median(values)
    # the step without its decode loop, whose length one outlier response sets
    outside = [r["step_s"] - r["rollout/decode_s"] for r in steady if "rollout/decode_s" in r]
    if outside and "step_s" in steady[0]:
        row[OUTSIDE_DECODE] = statistics.median(outside)
    last = (
        "reward",
        "reward/mixed_groups",
        "train/entropy",
        "eval/reward",
        "eval/reward_bf16",
        "mismatch/logp_abs",
        "memory/peak_gib",
    )
    for key in (*last, "mismatch/guided_code_agreement"):
        values = [r[key] for r in rl if key in r]
        if values:
            row[f"last {key}"] = values[-1]
    return row


def eval_curve(run_dir: Path, key: str = "eval/reward") -> list[tuple[int, float]]:
    """(RL steps done, value) of a greedy evaluation, the one before RL at 0."""
    records = runlog.read_metrics(Path(run_dir) / "metrics.jsonl")
    return list(rl_curve(records, key).items())


def overheads(runs: dict[str, Path], rows: dict[str, dict[str, float]]) -> list[str]:
    """One line per TRACE run (``experiment`` fp4_trace or fp4_trace_all in its config.yaml):
    its median step time against each vanilla QAT run's (fp4_qat) among ``runs``."""
    experiment = {}
    for name, d in runs.items():
        config = d / "config.yaml"
        if config.exists():
            experiment[name] = (yaml.safe_load(config.read_text()) or {}).get("experiment")
    qat = [n for n, e in experiment.items() if e == "fp4_qat" and "step_s" in rows[n]]
    lines = []
    for name, e in experiment.items():
        if e in ("fp4_trace", "fp4_trace_all") and "step_s" in rows[name]:
            for q in qat:
                t, v = rows[name], rows[q]
                line = f"{name} ({e}) against {q} (fp4_qat): step {_versus(t, v, 'step_s', 's')}"
                for key, unit, what in (
                    (OUTSIDE_DECODE, "s", "outside the decode loop"),
                    ("rollout/decode_step_ms", "ms", "per decode iteration"),
                ):
                    if key in t and key in v:
                        line += f"; {what} {_versus(t, v, key, unit)}"
                lines.append(line)
    return lines


def _versus(a: dict, b: dict, key: str, unit: str) -> str:
    return f"{a[key]:.4g} {unit} against {b[key]:.4g} {unit}, {100 * (a[key] / b[key] - 1):+.1f} %"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+")
    args = parser.parse_args(argv)
    for d in args.run_dirs:  # where each ran and its learning curves first: the table last
        for p in runlog.read_provenance(d):
            commit = runlog.code_label(p)
            print(f"{Path(d).name} from step {p['first_step']}: {p['device']}, commit {commit}")
        for key in ("eval/reward", "eval/reward_bf16"):
            curve = eval_curve(Path(d), key)
            if curve:
                points = " ".join(f"{step}:{value:.3f}" for step, value in curve)
                print(f"{Path(d).name} {key} (RL steps: reward) {points}")
    runs = {Path(d).name: Path(d) for d in args.run_dirs}
    rows = {name: phase_table(d) for name, d in runs.items()}
    keys = list(dict.fromkeys(k for row in rows.values() for k in row))
    print(f"{'':34s}" + "".join(f"{name[:16]:>17s}" for name in rows))
    for key in keys:
        cells = "".join(
            f"{row[key]:17.4g}" if key in row else f"{'-':>17s}" for row in rows.values()
        )
        print(f"{key:34s}{cells}")
    # TRACE's step time against vanilla QAT's (the paper: +7.4 %)
    for line in overheads(runs, rows):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
