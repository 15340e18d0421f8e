"""Tables and figures over several runs: ``compare`` (any run directories) and ``report`` (a
sweep directory: modes x seeds).

Runs that differ only by ``seed`` are aggregated as mean ± sample standard deviation over the n
seeds; every number comes from a run's ``metrics.jsonl`` through ``runlog.summarize``, the one
place a run's numbers are computed.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from trace_jax.config import ConfigError, flatten
from trace_jax.rl import runlog


def mean_spread(values: Sequence[float | None]) -> tuple[float, float, int]:
    """(mean, sample standard deviation, n) of the values that are not None; the deviation of
    one value is 0, and of none NaN."""
    v = np.asarray([x for x in values if x is not None], float)
    if v.size == 0:
        return math.nan, math.nan, 0
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0, int(v.size)


def fmt_spread(values: Sequence[float | None]) -> str:
    m, sd, n = mean_spread(values)
    return _cell({"mean": m, "sd": sd, "n": n})


def load_run(run_dir: Path) -> tuple[dict, list[dict], dict]:
    """(settings of its newest steps, metrics records, summary) of a run directory."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file() and not (run_dir / "metrics.jsonl.gz").is_file():
        raise ConfigError(f"{run_dir} has no metrics.jsonl")
    cfg = runlog.current_config(run_dir) or {}
    records = runlog.read_metrics(metrics)
    return cfg, records, runlog.summarize(records, cfg.get("eval_split", "eval"))


# ----------------------------------------------------------------------------- compare

COMPARE_COLUMNS = (
    ("eval/reward_start", "eval start"),
    ("eval/reward_end", "eval end"),
    ("reward/last_fifth", "train last 5th"),
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


def seed_groups(configs: Mapping[str, dict]) -> list[tuple[str, list[str]]]:
    """Runs whose settings differ only by ``seed``, grouped: ``[(label, [run ...])]`` in order of
    first appearance; a label names the experiment and the keys that set groups apart."""
    flat = {
        run: {k: v for k, v in flatten(cfg).items() if k != "seed"} for run, cfg in configs.items()
    }
    groups: dict[str, list[str]] = {}
    for run, f in flat.items():
        groups.setdefault(json.dumps(f, sort_keys=True, default=str), []).append(run)
    keys = sorted({k for f in flat.values() for k in f} - {"experiment"})
    firsts = [flat[runs[0]] for runs in groups.values()]
    varying = [k for k in keys if len({json.dumps(f.get(k), default=str) for f in firsts}) > 1]
    out = []
    for runs in groups.values():
        f = flat[runs[0]]
        label = " ".join([str(f.get("experiment", "?")), *(f"{k}={f.get(k)}" for k in varying)])
        out.append((label, runs))
    return out


def compare(
    run_dirs: Sequence[str], out: str | None = None, labels: Sequence[str] | None = None
) -> int:
    """Curves of several runs (one line per run directory, named by ``labels``, else by the
    folders' names where those differ, else by their paths) and a table of their summaries, runs
    that differ only by seed aggregated as mean ± sd over n seeds."""
    runs = {}
    for d in run_dirs:
        if d in runs:
            raise ConfigError(f"compare: {d} is given twice")
        runs[d] = load_run(Path(d))
    if labels is not None and len(labels) != len(run_dirs):
        raise ConfigError(f"--labels: {len(labels)} labels for {len(run_dirs)} run directories")
    if labels is None:
        names = [Path(d).name for d in run_dirs]
        labels = names if len(set(names)) == len(names) else list(run_dirs)
    path = Path(out) if out else Path(run_dirs[0]) / "compare.png"
    runlog.plot_curves(  # by RL step: runs with and without a warm start of their own align
        {label: runs[d][1] for label, d in zip(labels, run_dirs, strict=True)},
        COMPARE_KEYS,
        path,
        title="runs compared",
        points=lambda recs, key: list(rl_curve(recs, key).items()),
        xlabel="RL steps done",
    )
    splits = sorted({s.get("eval_split", "eval") for _, _, s in runs.values()})
    held_out = "the held-out split" if splits == ["eval"] else f"the {'/'.join(splits)} split"
    print(f"eval = greedy reward on {held_out}, before RL (start) and at the last evaluation")
    print("train = reward of the sampled rollouts, mean of the last fifth of the RL steps")
    print("logp_abs, kl_k3 = trainer-vs-rollout mismatch, mean of the last fifth")
    groups = seed_groups({d: cfg for d, (cfg, _, _) in runs.items()})
    width = max(len(label) for label, _ in groups)
    head = " ".join(f"{name:>20s}" for _, name in COMPARE_COLUMNS)
    print(f"\n{'run (mean ± sd over n seeds)':{width}s} {'n':>2s} {head}")
    for label, members in groups:
        cells = [
            f"{fmt_spread([runs[d][2].get(key) for d in members]):>20s}"
            for key, _ in COMPARE_COLUMNS
        ]
        print(f"{label:{width}s} {len(members):2d} {' '.join(cells)}")
        for d in members:
            print(f"  {d}  (seed {runs[d][0].get('seed', '?')})")
    print(f"plot: {path}")
    return 0


# ----------------------------------------------------------------------------- sweep report

TABLE_COLUMNS = (
    ("eval/reward_start", "eval reward, start"),
    ("eval/reward_end", "eval reward, end"),
    ("eval/reward_bf16_start", "eval reward in BF16, start"),
    ("eval/reward_bf16_end", "eval reward in BF16, end"),
    ("reward/first_fifth", "train reward, first 5th"),
    ("reward/last_fifth", "train reward, last 5th"),
    ("train/entropy/last_fifth", "entropy, last 5th"),
    ("reward/mixed_groups/last_fifth", "groups with a signal, last 5th"),
    ("mismatch/logp_abs/last_fifth", "logp_abs"),
    ("mismatch/kl_k3/last_fifth", "kl_k3"),
    ("mismatch/guided_code_agreement/last_fifth", "guided code agreement"),
    ("mismatch/code_one_step/all/last_fifth", "one-code-step share"),
    ("guidance/bytes_per_token", "guidance bytes/token"),
    ("guidance/ratio_to_full", "of full guidance"),
    ("rate/rollout/tokens_per_s", "decode tokens/s"),
    ("time/step_s", "s per RL step"),
)
SITE_LAYER = re.compile(r"^mismatch/code_rate/(.+)/(\d+)$")
TOTALS = ("step_s", "train/step_s")  # sums of other phases: drawn after them, marked


def rl_curve(records: Sequence[dict], key: str) -> dict[int, float]:
    """``{RL steps done: value}`` of ``key`` (RL step i's record counts as i + 1 steps done);
    for ``eval/reward`` (``eval/reward_bf16``), the evaluation before RL is at 0; a share of
    mismatches only where it is defined."""
    rl = [r for r in records if "reward" in r]
    out = {i + 1: float(r[key]) for i, r in enumerate(rl) if key in r}
    if key.startswith(runlog.SHARES_OF_MISMATCHES):  # undefined at a step without mismatches
        out = {i: v for i, v in out.items() if not math.isnan(v)}
    if key in runlog.EVAL_KEYS and rl and f"{key}_start" in rl[0]:
        out[0] = float(rl[0][f"{key}_start"])
    return dict(sorted(out.items()))


def sweep_data(sweep_dir: Path) -> dict[str, Any]:
    """The cells of a sweep directory by mode: ``{"modes": {mode: [cell, ...]}, "cells":
    {cell: {"state", "mode", "seed", "records", "summary"}}, "sweep": sweep.yaml}``. A mode is
    a cell's grid values other than ``seed``; only finished cells carry records."""
    from experiments.sweep import SWEEP_FILE, cell_state, warm_start_here

    file = sweep_dir / SWEEP_FILE
    if not file.is_file():
        raise ConfigError(f"{sweep_dir} is not a sweep directory (no {SWEEP_FILE})")
    sweep = yaml.safe_load(file.read_text())
    modes: dict[str, list[str]] = {}
    cells: dict[str, dict] = {}
    for name, values in sweep["cells"].items():
        mode = " ".join(
            str(v) if k == "experiment" else f"{k}={v}" for k, v in values.items() if k != "seed"
        )
        cell = {
            "state": cell_state(sweep_dir / name),
            "mode": mode or "all",
            "seed": values.get("seed"),
        }
        if cell["state"] == "done":
            _, records, summary = load_run(sweep_dir / name)
            results = json.loads((sweep_dir / name / "results.json").read_text())
            # post-hoc quantization (ptq_scale_rules): greedy eval reward per policy
            for policy, reward in (results.get("ptq_eval_reward") or {}).items():
                summary[f"ptq/{policy}"] = float(reward)
            cell.update(
                records=records,
                summary=summary,
                start=results.get("start_policy_sha256"),
                provenance=results.get("provenance") or [],
            )
            modes.setdefault(cell["mode"], []).append(name)
        cells[name] = cell
    ws = warm_start_here(sweep_dir, sweep.get("warm_start_dir")) / "results.json"
    start = json.loads(ws.read_text()).get("start_policy_sha256") if ws.is_file() else None
    return {"sweep": sweep, "modes": modes, "cells": cells, "warm_start": start}


def aggregate(data: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per mode: ``{key: {"mean", "sd", "n"}}`` over its finished seeds for every summary key,
    and ``collapsed``: the seeds whose sampled reward is 0 at each of their last
    ``COLLAPSE_STEPS`` RL steps (every group at reward 0 leaves GRPO no gradient: such a seed
    does not come back, and a mean over seeds with one in it describes neither kind of run)."""
    out = {}
    for mode, names in data["modes"].items():
        summaries = [data["cells"][n]["summary"] for n in names]
        keys = sorted({k for s in summaries for k in s if isinstance(s[k], float)})
        stats = {}
        for key in keys:
            values = [s.get(key) for s in summaries]
            m, sd, n = mean_spread(values)
            stats[key] = {"mean": m, "sd": sd, "n": n, **_order_stats(values)}
        collapsed = [data["cells"][n]["seed"] for n in names if _collapsed(data["cells"][n])]
        out[mode] = {
            "seeds": [data["cells"][n]["seed"] for n in names],
            "cells": names,
            "collapsed": collapsed,
            **stats,
        }
    return out


def _order_stats(values: Sequence[float | None]) -> dict[str, float]:
    """Median, minimum and maximum of the values that are not None (NaN for none): what a
    mean over a few seeds with one far off hides."""
    v = np.asarray([x for x in values if x is not None], float)
    if v.size == 0:
        return {"median": math.nan, "min": math.nan, "max": math.nan}
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max())}


MEDIAN_COLUMNS = (
    ("eval/reward_end", "eval reward, end"),
    ("eval/reward_bf16_end", "eval reward in BF16, end"),
    ("reward/last_fifth", "train reward, last 5th"),
)
"""The outcome columns given again as median [min, max] over seeds."""

COLLAPSE_STEPS = 10


def _collapsed(cell: Mapping[str, Any]) -> bool:
    """Whether a finished cell's sampled reward is 0 at each of its last ``COLLAPSE_STEPS`` RL
    steps."""
    rewards = [r["reward"] for r in cell.get("records", []) if "reward" in r]
    tail = rewards[-COLLAPSE_STEPS:]
    return bool(tail) and max(tail) == 0.0


def report(
    sweep_dir: str | Path, out: str | Path | None = None, reference: str | Path | None = None
) -> int:
    """Write ``report.md``, ``report.json`` and PNG figures for a sweep directory (default into
    ``<sweep_dir>/report``); ``reference``: another sweep directory, from the same warm start,
    whose ``bf16_rollout`` cells stand in for references this sweep does not run."""
    sweep_dir = Path(sweep_dir)
    data = sweep_data(sweep_dir)
    if not data["modes"]:
        raise ConfigError(f"{sweep_dir}: no cell has finished yet (run all its steps)")
    if reference is not None:
        data["reference"] = sweep_data(Path(reference))
        theirs, ours = data["reference"]["warm_start"], data["warm_start"]
        if theirs != ours:
            raise ConfigError(
                f"--reference {reference}: its warm start (sha256 {(theirs or 'unknown')[:16]}) "
                f"is not this sweep's ({(ours or 'unknown')[:16]}): its cells started RL from "
                "another policy"
            )
    out = Path(out) if out else sweep_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    agg = aggregate(data)
    figures = plot_sweep(data, out)
    (out / "report.json").write_text(json.dumps(agg, indent=2))
    (out / "report.md").write_text(markdown(sweep_dir, data, agg, figures))
    print((out / "report.md").read_text())
    print(f"report: {out / 'report.md'}")
    return 0


def markdown(sweep_dir: Path, data: Mapping, agg: Mapping, figures: Sequence[Path]) -> str:
    sweep = data["sweep"]
    splits = sorted(
        {c["summary"].get("eval_split", "eval") for c in data["cells"].values() if "summary" in c}
    )
    lines = [
        f"# Sweep `{sweep_dir}`",
        "",
        f"Base `{sweep.get('base')}` with overrides `{' '.join(sweep.get('overrides') or [])}`; "
        f"grid `{json.dumps(sweep.get('grid'))}`. {starts(data)} {origins(data)}",
        "",
        "Mean ± sample sd over the n finished seeds; collapsed: the seeds whose sampled reward "
        f"is 0 at each of their last {COLLAPSE_STEPS} RL steps (counted in the means). Eval "
        f"reward: greedy, on the {'/'.join(splits)} split, before RL (start) and at the last "
        "evaluation (end), with the rollout's precision and (`eval_bf16`) in BF16, as the "
        "BF16 reference evaluates. Train reward: the sampled rollouts, over the first and last "
        "fifth of the RL steps. Mismatch and code columns: mean of the last fifth. Throughput "
        "and step time: mean over the RL steps after the first that compiled nothing (a new "
        "program's compilation is no phase's cost).",
        "",
    ]
    cols = [(k, label) for k, label in TABLE_COLUMNS if any(k in a for a in agg.values())]
    # post-hoc quantizations of the final policy (``ptq/bf16`` is the last evaluation again)
    ptq = sorted({k for a in agg.values() for k in a if k.startswith("ptq/fp4 ptq")})
    cols += [(k, f"eval reward, post-hoc FP4 {k.removeprefix('ptq/fp4 ptq ')}") for k in ptq]
    lines.append("| mode | n | collapsed | " + " | ".join(label for _, label in cols) + " |")
    lines.append("| --- | --- | --- | " + " | ".join("---" for _ in cols) + " |")
    for mode, a in agg.items():
        n = len(a["cells"])
        cells = [_cell(a.get(k)) for k, _ in cols]
        down = ", ".join(f"seed {s}" for s in a["collapsed"]) or "0"
        lines.append(f"| {mode} | {n} | {down} | " + " | ".join(cells) + " |")
    outcome = [(k, label) for k, label in MEDIAN_COLUMNS if any(k in a for a in agg.values())]
    if outcome:
        lines += ["", "The same outcomes as median [min, max] over the seeds:", ""]
        lines.append("| mode | " + " | ".join(label for _, label in outcome) + " |")
        lines.append("| --- | " + " | ".join("---" for _ in outcome) + " |")
        for mode, a in agg.items():
            lines.append(f"| {mode} | " + " | ".join(_median(a.get(k)) for k, _ in outcome) + " |")
    phases = sorted({k for a in agg.values() for k in a if k.startswith("time/")})
    if phases:
        lines += ["", "Seconds per RL step by phase (mean ± sd over seeds):", ""]
        lines.append("| mode | " + " | ".join(f"`{p[5:]}`" for p in phases) + " |")
        lines.append("| --- | " + " | ".join("---" for _ in phases) + " |")
        for mode, a in agg.items():
            lines.append(f"| {mode} | " + " | ".join(_cell(a.get(p)) for p in phases) + " |")
    lines += against_reference(data)
    against = qat_overheads(data)
    if against:
        lines += ["", "TRACE's step time against vanilla QAT's (the paper: +7.4 %):", ""]
        lines += [f"- {line}" for line in against]
    unfinished = [f"`{n}` ({c['state']})" for n, c in data["cells"].items() if c["state"] != "done"]
    lines += ["", "Cells not finished (left out above): " + (", ".join(unfinished) or "none") + "."]
    lines += ["", *(f"![{p.stem}]({p.name})" for p in figures), ""]
    return "\n".join(lines)


REFERENCE = "bf16_rollout"
# Grid keys a BF16-rollout run does not read (its post-hoc quantization aside: fmt): a mode that
# sets them is set against the reference without them.
NOT_READ_BY_REFERENCE = ("fmt", "guided_layers", "guided_last_k")


def paired_ci(diffs: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of per-seed differences: the mean and its Student-t interval over the
    seeds (NaN bounds for one seed)."""
    from scipy import stats

    d = np.asarray(diffs, np.float64)
    m = float(d.mean())
    if d.size < 2:
        return m, math.nan, math.nan
    half = float(stats.t.ppf(0.5 + level / 2, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size))
    return m, m - half, m + half


def against_reference(data: Mapping[str, Any]) -> list[str]:
    """Markdown lines: each mode's final greedy reward minus the BF16 reference's of the same
    other grid values (those in ``NOT_READ_BY_REFERENCE`` aside; from ``data["reference"]``,
    another sweep of the same warm start, where this one runs none), paired by seed (the same
    seed draws the same prompts in the same order), mean and 95 % Student-t interval over the
    seeds both finished: in its own precision against the reference's BF16, both in BF16, and
    against each post-hoc FP4 quantization of the reference's policy (``ptq_scale_rules``; not
    across formats)."""

    def seeds_by_mode(d: Mapping[str, Any]) -> dict[str, dict[Any, dict]]:
        return {
            mode: {d["cells"][n]["seed"]: d["cells"][n]["summary"] for n in names}
            for mode, names in d["modes"].items()
        }

    by_mode = seeds_by_mode(data)
    pool = {m: s for m, s in by_mode.items() if m.partition(" ")[0] == REFERENCE}
    if "reference" in data:  # another sweep's references, where this one runs none of its own
        theirs = seeds_by_mode(data["reference"])
        pool |= {m: s for m, s in theirs.items() if m.partition(" ")[0] == REFERENCE}
    rules = sorted(
        {k for s in pool.values() for c in s.values() for k in c if k.startswith("ptq/fp4")}
    )
    columns = [
        ("eval/reward_end", "eval/reward_end", "own precision vs the reference's BF16"),
        ("eval/reward_bf16_end", "eval/reward_end", "both in BF16"),
        *(
            (
                "eval/reward_end",
                r,
                f"vs the reference post hoc {r.removeprefix('ptq/fp4 ptq ')}",
            )
            for r in rules
        ),
    ]
    rows = []
    for mode, seeds in by_mode.items():
        head, _, rest = mode.partition(" ")
        # the reference of the same other grid values, else of those a BF16 run reads
        name = " ".join(filter(None, (REFERENCE, rest)))
        dropped = []
        if name not in pool:
            words = rest.split()
            dropped = [w for w in words if w.partition("=")[0] in NOT_READ_BY_REFERENCE]
            name = " ".join([REFERENCE, *(w for w in words if w not in dropped)])
        ref = pool.get(name)
        if head == REFERENCE or not ref:
            continue
        row = [f"`{name}`"]
        for mine, theirs, _ in columns:
            if theirs.startswith("ptq/") and any(w.startswith("fmt=") for w in dropped):
                row.append("-")  # the reference quantized post hoc in another format
                continue
            diffs = [
                seeds[s][mine] - ref[s][theirs]
                for s in sorted(set(seeds) & set(ref), key=str)
                if mine in seeds[s] and theirs in ref[s]
            ]
            if not diffs:
                row.append("-")
                continue
            m, lo, hi = paired_ci(diffs)
            ci = f" [{lo:+.3f}, {hi:+.3f}]" if not math.isnan(lo) else ""
            row.append(f"{m:+.3f}{ci} (n={len(diffs)})")
        rows.append(f"| {mode} | " + " | ".join(row) + " |")
    if not rows:
        return []
    return [
        "",
        f"Final greedy eval reward minus the `{REFERENCE}` cell's (the reference column) of the "
        "same seed: mean [95 % Student-t interval] over the seeds both finished:",
        "",
        "| mode | reference | " + " | ".join(label for *_, label in columns) + " |",
        "| --- | --- | " + " | ".join("---" for _ in columns) + " |",
        *rows,
    ]


def qat_overheads(data: Mapping[str, Any]) -> list[str]:
    """Each TRACE mode's mean step time against the vanilla QAT mode of the same other grid
    values (``fp4_trace staleness=3`` against ``fp4_qat staleness=3``), over the finished cells
    of each kind of GPU apart (``device``: timings of two kinds are never set side by side):
    the whole step and the step outside its decode loop (whose length the longest response
    sets)."""
    by_mode: dict[str, dict[str, list[Mapping[str, float]]]] = {}
    for mode, names in data["modes"].items():  # the finished cells of each mode
        for c in (data["cells"][n] for n in names):
            by_mode.setdefault(mode, {}).setdefault(device(c), []).append(c["summary"])
    out = []
    for mode, kinds in by_mode.items():
        head, _, rest = mode.partition(" ")
        qat_mode = " ".join(filter(None, ("fp4_qat", rest)))
        if head not in ("fp4_trace", "fp4_trace_all"):
            continue
        for kind, cells in sorted(kinds.items()):
            qat = by_mode.get(qat_mode, {}).get(kind)
            if not qat:
                continue
            parts = []
            for label, value in (("step", _step_s), ("outside the decode loop", _outside_decode)):
                (t, _, nt), (q, _, nq) = (mean_spread([value(s) for s in g]) for g in (cells, qat))
                if nt and nq and q:
                    parts.append(f"{label} {t:.3g} s against {q:.3g} s, {100 * (t / q - 1):+.1f} %")
            if parts:
                n = f"{len(cells)} / {len(qat)} seeds"
                out.append(f"{mode} against {qat_mode} on {kind} ({n}): " + "; ".join(parts))
    return out


def device(cell: Mapping[str, Any]) -> str:
    """The kind of GPU (or CPU) a cell ran on, by its ``provenance``."""
    kinds = {p.get("device") for p in cell.get("provenance") or []} - {None}
    return kinds.pop() if len(kinds) == 1 else ("several devices" if kinds else "unknown device")


def _step_s(summary: Mapping[str, float]) -> float | None:
    return summary.get("time/step_s")


def _outside_decode(summary: Mapping[str, float]) -> float | None:
    step, decode = _step_s(summary), summary.get("time/rollout/decode_s")
    return None if step is None or decode is None else step - decode


def starts(data: Mapping) -> str:
    """Whether the finished cells started RL from the warm start's parameters, by their
    ``start_policy_sha256`` (bit-identical parameters have equal digests)."""
    ws = data.get("warm_start")
    done = {n: c.get("start") for n, c in data["cells"].items() if c["state"] == "done"}
    other = sorted(n for n, d in done.items() if d is None or d != ws)
    if ws and not other:
        return (
            f"Every finished cell started RL from the warm start's parameters (sha256 `{ws[:16]}`)."
        )
    return (
        "**Not every cell started RL from the warm start's parameters** (sha256 "
        f"`{(ws or 'unknown')[:16]}`): "
        + ", ".join(f"`{n}` (`{(done[n] or 'unknown')[:16]}`)" for n in other)
        + "."
    )


def origins(data: Mapping) -> str:
    """The commits and devices the finished cells' steps ran on (their ``provenance``), in
    bold where they are several: results of other code, or timings of other GPUs, side by
    side; where the commits are several, whether the code a run executes
    (``runlog.run_code``) was the same in all."""
    lines = [
        p
        for c in data["cells"].values()
        if c["state"] == "done"
        for p in c.get("provenance") or [{}]  # records from before provenance: unknown
    ]
    if not any(lines):
        return (
            "Where the cells ran was not recorded (no `provenance` in their results)."
            if lines
            else ""
        )
    commits = Counter(f"`{runlog.code_label(p)}`" for p in lines)
    devices = Counter(p.get("device", "unknown") for p in lines)
    listed = lambda d: ", ".join(f"{k} ({n})" for k, n in sorted(d.items()))  # noqa: E731
    code = (
        f"Every finished cell ran at commit {next(iter(commits))}"
        if len(commits) == 1
        else f"**The finished cells ran at several commits** (processes): {listed(commits)}"
    )
    if len(commits) > 1:  # documents and reports change between calls; what ran may not
        runs = Counter(runlog.run_code(p.get("tree")) or "unknown" for p in lines)
        what = "the code a run executes (`runlog.RUN_CODE`)"
        code += (
            f"; {what} was the same in every one (`{next(iter(runs))}`)"
            if len(runs) == 1 and "unknown" not in runs
            else f"; **{what} differed**: {listed(runs)}"
        )
    where = (
        f"on {next(iter(devices))}"
        if len(devices) == 1
        else f"**on several kinds of device** (timings not comparable): {listed(devices)}"
    )
    # XLA's code generation (its flags; on a CPU, the host's instruction set) changes float
    # roundings: a warm start's parameters, and every run from them, with it
    recorded = [p for p in lines if "xla_flags" in p]
    flags = Counter(f"`{p['xla_flags'] or '(none)'}`" for p in recorded)
    hosts = Counter(p.get("host", "unknown") for p in recorded)
    setting = ""
    if len(flags) > 1:
        setting += f"; **under several XLA_FLAGS** (other roundings): {listed(flags)}"
    elif flags:
        setting += f"; XLA_FLAGS {next(iter(flags))}"
    if len(hosts) > 1:
        setting += f"; **on several host CPUs**: {listed(hosts)}"
    elif hosts:
        setting += f"; host CPU {next(iter(hosts))}"
    return f"{code}, {where}{setting}."


def _cell(stat: Mapping[str, float] | None) -> str:
    """``mean ± sd`` (``mean`` alone for one seed, ``-`` for none)."""
    if not stat or stat["n"] == 0:
        return "-"
    m, sd = stat["mean"], stat["sd"]
    if stat["n"] == 1:
        return f"{m:.4g}"
    sd = 0.0 if sd <= 1e-12 * abs(m) else sd  # equal values: rounding, not spread
    return f"{m:.4g} ± {sd:.2g}"


def _median(stat: Mapping[str, float] | None) -> str:
    """``median [min, max]`` (the value alone for one seed, ``-`` for none)."""
    if not stat or stat["n"] == 0:
        return "-"
    if stat["n"] == 1:
        return f"{stat['median']:.4g}"
    return f"{stat['median']:.4g} [{stat['min']:.4g}, {stat['max']:.4g}]"


# ----------------------------------------------------------------------------- figures


def _curves(data: Mapping, key: str) -> dict[str, tuple[np.ndarray, ...]]:
    """Per mode: (steps, mean, n seeds, min, max over seeds) of ``key`` at the RL steps every
    seed logged."""
    out = {}
    for mode, names in data["modes"].items():
        curves = [rl_curve(data["cells"][n]["records"], key) for n in names]
        curves = [c for c in curves if c]
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        if not steps:
            continue
        values = np.array([[c[s] for s in steps] for c in curves])
        out[mode] = (np.array(steps), values.mean(0), len(curves), values.min(0), values.max(0))
    return out


def _panel(ax, curves, title: str, ylabel: str, log: bool = False) -> None:
    """Mean over seeds per mode; the band is the seeds' range (mean ± sd would leave the values'
    bounds where one seed collapses, below 0 on a log axis or above 1 for a reward)."""
    for mode, (steps, mean, n, lo, hi) in curves.items():
        (line,) = ax.plot(
            steps, mean, marker="." if len(steps) < 30 else None, label=f"{mode} (n={n})"
        )
        if n > 1:
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("RL steps done")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel(ylabel)
    if log and all((c[1] > 0).all() for c in curves.values()):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_sweep(data: Mapping, out: Path) -> list[Path]:
    """The sweep's PNG figures in ``out``; a figure whose metrics were not logged is skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    band = "line: mean over seeds, band: the seeds' range"
    figures = [
        (
            "eval_reward.png",
            [
                (
                    "eval/reward",
                    "greedy eval reward, the rollout's precision",
                    "mean reward",
                    False,
                ),
                (
                    "eval/reward_bf16",
                    "greedy eval reward in BF16 (all modes alike)",
                    "mean reward",
                    False,
                ),
            ],
        ),
        (
            "mismatch.png",
            [
                ("mismatch/logp_abs", "trainer-vs-rollout |Δ log p| per token", "nats", True),
                ("mismatch/kl_k3", "trainer-vs-rollout KL (k3) per token", "nats", True),
            ],
        ),
        (
            "codes.png",
            [
                (
                    "mismatch/guided_code_agreement",
                    "code agreement at guided sites",
                    "share of codes",
                    False,
                ),
                (
                    "mismatch/code_one_step/all",
                    "mismatches exactly one code step apart",
                    "share of mismatches",
                    False,
                ),
            ],
        ),
    ]

    def with_references(key: str) -> dict[str, tuple[np.ndarray, ...]]:
        out = _curves(data, key)
        if "reference" in data and key.startswith("eval/"):  # another sweep's references
            theirs = _curves(data["reference"], key)
            out |= {
                f"{m} (--reference)": c
                for m, c in theirs.items()
                if m.partition(" ")[0] == REFERENCE
            }
        return out

    for name, panels in figures:
        panels = [(p, with_references(p[0])) for p in panels]
        panels = [(p, c) for p, c in panels if c]
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
        for ax, ((key, title, ylabel, log), curves) in zip(axes.flat, panels, strict=True):
            _panel(ax, curves, f"{title}\n({key}; {band})", ylabel, log)
        save(fig, name)

    heat = _layer_heat(data)
    if heat:
        cols = min(2, len(heat))
        rows = math.ceil(len(heat) / cols)
        fig, axes = plt.subplots(
            rows,
            cols,
            figsize=(
                cols * (3.5 + 0.4 * _max_layers(heat)),
                0.8 + rows * (1.2 + 0.35 * _max_sites(heat)),
            ),
            squeeze=False,
        )
        for ax in list(axes.flat)[len(heat) :]:
            ax.axis("off")
        # one colour scale for every mode, so that panels compare at a glance
        top = max(float(np.nanmax(g)) if np.isfinite(g).any() else 0.0 for _, _, g in heat.values())
        for ax, (mode, (sites, layers, grid)) in zip(axes.flat, heat.items(), strict=False):
            im = ax.imshow(grid, aspect="auto", cmap="magma", vmin=0, vmax=max(top, 1e-6))
            ax.set_xticks(range(len(layers)), [str(x) for x in layers])
            ax.set_yticks(range(len(sites)), sites, fontsize=8)
            ax.set_xlabel("layer")
            ax.set_title(mode, fontsize=10)
            if grid.size <= 96:  # small enough to print each rate
                for (i, j), v in np.ndenumerate(grid):
                    color = "white" if v < 0.6 * max(top, 1e-6) else "black"
                    ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=7, color=color)
            fig.colorbar(im, ax=ax, label="code mismatch rate (share of codes)")
        fig.suptitle(
            "train-vs-rollout code mismatch by layer\n"
            "(mismatch/code_rate/<site>/<layer>, mean over the RL steps and seeds)",
            fontsize=10,
        )
        save(fig, "mismatch_by_layer.png")

    timing = _timing(data)
    if timing:
        rates, phases = timing
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1, 2.5]})
        modes = list(data["modes"])
        if rates:
            m = [rates.get(mode, (math.nan, 0))[0] for mode in modes]
            sd = [rates.get(mode, (math.nan, 0))[1] for mode in modes]
            axes[0].bar(
                range(len(modes)), m, yerr=sd, capsize=3, color=[f"C{i}" for i in range(len(modes))]
            )
            axes[0].set_xticks(range(len(modes)), modes, rotation=30, ha="right", fontsize=8)
            axes[0].set_ylabel("tokens / s")
            axes[0].set_title("decode throughput (rollout/tokens_per_s)", fontsize=10)
        else:
            axes[0].axis("off")
        names = sorted({p for per in phases.values() for p in per}, key=lambda p: (p in TOTALS, p))
        width = 0.8 / max(len(modes), 1)
        for i, mode in enumerate(modes):
            per = phases.get(mode, {})
            xs = np.arange(len(names)) + (i - (len(modes) - 1) / 2) * width
            axes[1].bar(
                xs,
                [per.get(p, (math.nan, 0))[0] for p in names],
                width,
                yerr=[per.get(p, (math.nan, 0))[1] for p in names],
                capsize=2,
                label=mode,
            )
        labels = [f"{p} (total)" if p in TOTALS else p for p in names]
        axes[1].set_xticks(range(len(names)), labels, rotation=30, ha="right", fontsize=8)
        axes[1].set_ylabel("seconds per RL step")
        axes[1].set_title(
            "time per phase (mean over the RL steps that compiled nothing; error bar: ± 1 sd "
            "over seeds)",
            fontsize=10,
        )
        axes[1].legend(fontsize=8)
        save(fig, "timing.png")
    return written


def _layer_heat(data: Mapping) -> dict[str, tuple[list[str], list[int], np.ndarray]]:
    out = {}
    for mode, names in data["modes"].items():
        sums: dict[tuple[str, int], list[float]] = {}
        for n in names:
            for r in data["cells"][n]["records"]:
                for k, v in r.items():
                    if (match := SITE_LAYER.match(k)) and "reward" in r:
                        sums.setdefault((match[1], int(match[2])), []).append(float(v))
        if not sums:
            continue
        sites = sorted({s for s, _ in sums})
        layers = sorted({layer for _, layer in sums})
        grid = np.full((len(sites), len(layers)), np.nan)
        for (s, layer), vals in sums.items():
            grid[sites.index(s), layers.index(layer)] = np.mean(vals)
        out[mode] = (sites, layers, grid)
    return out


def _max_layers(heat) -> int:
    return max(len(layers) for _, layers, _ in heat.values())


def _max_sites(heat) -> int:
    return max(len(sites) for sites, _, _ in heat.values())


def _timing(data: Mapping):
    rates, phases = {}, {}
    for mode, names in data["modes"].items():
        summaries = [data["cells"][n]["summary"] for n in names]
        m, sd, n = mean_spread([s.get("rate/rollout/tokens_per_s") for s in summaries])
        if n:
            rates[mode] = (m, sd)
        keys = sorted({k for s in summaries for k in s if k.startswith("time/")})
        phases[mode] = {k[5:]: mean_spread([s.get(k) for s in summaries])[:2] for k in keys}
    if not rates and not any(phases.values()):
        return None
    return rates, phases
