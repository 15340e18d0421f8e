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
    args = parser.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
