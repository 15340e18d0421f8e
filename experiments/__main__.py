"""Entry point: ``python -m experiments run configs/<name>.yaml key=value ...``."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import yaml

from experiments.registry import EXPERIMENTS, get_experiment
from trace_jax.config import ConfigError, apply_overrides, from_dict, load_yaml, to_dict


def resolve(config_path: str, overrides: list[str]):
    """Load a config file (``experiment: <name>`` plus that experiment's fields) with overrides.

    Returns:
      (experiment, config dataclass). Raises ``ConfigError`` naming the bad key.
    """
    data = apply_overrides(load_yaml(config_path), overrides)
    name = data.pop("experiment", None)
    if name is None:
        raise ConfigError(f"{config_path}: missing the key 'experiment' (the registered name)")
    try:
        exp = get_experiment(name)
    except KeyError as e:
        raise ConfigError(f"experiment: {e.args[0]}") from None
    return exp, from_dict(exp.config_cls, data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run a config")
    run_p.add_argument("config", help="path to configs/<name>.yaml")
    run_p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    run_p.add_argument("--run-dir", default=None, help="output folder (default runs/<name>-<time>)")
    sub.add_parser("list", help="list the registered experiments")
    cmp_p = sub.add_parser("compare", help="plot and tabulate several runs, one line per run")
    cmp_p.add_argument("run_dirs", nargs="+", help="run directories with metrics.jsonl")
    cmp_p.add_argument("--out", default=None, help="PNG path (default: compare.png in the first)")
    args = parser.parse_args(argv)

    if args.command == "compare":
        return compare(args.run_dirs, args.out)

    if args.command == "list":
        import experiments.pipelines  # noqa: F401

        for name, exp in sorted(EXPERIMENTS.items()):
            print(f"{name:24s} {exp.description}")
        return 0

    try:
        exp, cfg = resolve(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.run_dir or f"runs/{exp.name}-{stamp}")
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = {"experiment": exp.name, **to_dict(cfg)}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    results = exp.run(cfg, run_dir)
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nrun directory: {run_dir}")
    return 0


COMPARE_KEYS = (
    "reward",
    "eval/reward",
    "mismatch/logp_abs",
    "mismatch/kl_k3",
    "train/entropy",
    "response_length",
)


def compare(run_dirs: list[str], out: str | None = None) -> int:
    """Curves of several runs (label: the run's experiment and modes) and their final values."""
    from trace_jax.rl.runlog import plot_curves, read_metrics

    runs = {}
    for d in map(Path, run_dirs):
        metrics = d / "metrics.jsonl"
        if not metrics.is_file():
            print(f"compare: {d} has no metrics.jsonl", file=sys.stderr)
            return 2
        cfg = (
            yaml.safe_load((d / "config.yaml").read_text()) if (d / "config.yaml").is_file() else {}
        )
        label = cfg.get("experiment", d.name)
        if "train_mode" in cfg:
            label += f" ({cfg.get('rollout')} rollout, {cfg['train_mode']} train)"
        runs[label] = read_metrics(metrics)
    path = Path(out) if out else Path(run_dirs[0]) / "compare.png"
    plot_curves(runs, COMPARE_KEYS, path, title="runs compared")
    print(f"{'run':52s} " + " ".join(f"{k.split('/')[-1]:>12s}" for k in COMPARE_KEYS))
    for label, recs in runs.items():
        last = {
            k: next((r[k] for r in reversed(recs) if k in r), float("nan")) for k in COMPARE_KEYS
        }
        print(f"{label[:52]:52s} " + " ".join(f"{last[k]:12.4g}" for k in COMPARE_KEYS))
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
