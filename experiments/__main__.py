"""Entry point: ``python -m experiments run configs/<name>.yaml key=value ...``.

Commands: ``run`` (one config into a run directory), ``list``, ``compare`` (several run
directories), ``sweep`` (a grid of runs from one shared warm start), ``report`` (a sweep's
tables and figures), ``archive`` (a sweep's records without parameters, for keeping),
``export`` (a policy as an FP4 Hugging Face folder for vLLM / SGLang) and ``shard-report`` (a
preset's bytes per device on a mesh, from shapes alone).
Every error a user can cause ends in one line on stderr naming the file or key, exit code 2;
Ctrl-C ends in one line naming the last checkpoint, exit code 130.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from experiments.registry import EXPERIMENTS
from experiments.runner import (
    ALLOW_CHANGE,
    USER_ERRORS,
    Interrupted,
    execute,
    init_distributed,
    resolve,
    stop_on_sigint,
    without_closed_loop_reports,
)
from trace_jax.model.hf import CheckpointError

__all__ = ["main", "resolve"]


def run_command(args: argparse.Namespace) -> int:
    init_distributed()  # a multi-process job when the environment says so
    exp, cfg = resolve(args.config, args.overrides)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.run_dir or f"runs/{exp.name}-{stamp}")
    execute(exp, cfg, run_dir, args.allow_config_change)
    print(f"\nrun directory: {run_dir}")
    return 0


def sweep_command(args: argparse.Namespace) -> int:
    from experiments.sweep import load_sweep, run_sweep

    sweep = load_sweep(args.sweep, args.overrides)
    return run_sweep(
        sweep,
        args.only,
        args.dry_run,
        args.allow_config_change,
        args.warm_start_only,
        args.jobs,
        args.budget_min,
        args.min_cell_min,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    allow = dict(
        action="store_true",
        help="continue with other settings (config.yaml keeps the first; the new ones go to "
        "config.changed-at-step-N.yaml)",
    )
    run_p = sub.add_parser("run", help="run a config")
    run_p.add_argument("config", help="path to configs/<name>.yaml")
    run_p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    run_p.add_argument("--run-dir", default=None, help="output folder (default runs/<name>-<time>)")
    run_p.add_argument(ALLOW_CHANGE, **allow)
    sub.add_parser("list", help="list the registered experiments")
    cmp_p = sub.add_parser("compare", help="plot and tabulate several runs, seeds aggregated")
    cmp_p.add_argument("run_dirs", nargs="+", help="run directories with metrics.jsonl")
    cmp_p.add_argument("--out", default=None, help="PNG path (default: compare.png in the first)")
    cmp_p.add_argument(
        "--labels", default=None, help="comma-separated names of the runs in the plot's legend"
    )
    sweep_p = sub.add_parser("sweep", help="run a grid of configs from one shared warm start")
    sweep_p.add_argument("sweep", help="path to configs/sweeps/<name>.yaml")
    sweep_p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    sweep_p.add_argument("--only", default=None, help="run only the cells matching this glob")
    sweep_p.add_argument("--dry-run", action="store_true", help="list the cells and their state")
    sweep_p.add_argument(
        "--jobs", type=int, default=1, help="cells at once, each in its own process (one GPU)"
    )
    sweep_p.add_argument(
        "--budget-min",
        type=float,
        default=0.0,
        help="minutes for the whole sweep: cells end by then, checkpointed (0: no bound)",
    )
    sweep_p.add_argument(
        "--min-cell-min",
        type=float,
        default=None,
        help="with --budget-min: start no new cell with fewer minutes left (a machine that "
        "will not outlive the call loses what a cut cell did); a begun one continues",
    )
    sweep_p.add_argument(
        "--warm-start-only", action="store_true", help="run only the shared warm start"
    )
    sweep_p.add_argument(ALLOW_CHANGE, **allow)
    rep_p = sub.add_parser("report", help="tables and figures of a sweep directory")
    rep_p.add_argument("sweep_dir", help="the sweep's folder (with sweep.yaml)")
    rep_p.add_argument("--out", default=None, help="output folder (default <sweep_dir>/report)")
    rep_p.add_argument(
        "--reference",
        default=None,
        help="another sweep's folder whose bf16_rollout cells (same warm start) this one's are "
        "set against, where it has none of its own",
    )
    arc_p = sub.add_parser("archive", help="copy a sweep's records (no parameters) for keeping")
    arc_p.add_argument("sweep_dir", help="the sweep's folder (with sweep.yaml)")
    arc_p.add_argument("dest", help="the archive's folder (cells merged into one that exists)")
    exp_p = sub.add_parser("export", help="write a policy as an FP4 Hugging Face folder")
    exp_p.add_argument(
        "source", help="a run directory, <run>/policy, <run>/checkpoints/<step> or a HF folder"
    )
    exp_p.add_argument("--format", required=True, help="nvfp4 or mxfp4 (compressed-tensors)")
    exp_p.add_argument("--out", required=True, help="the folder to write (new or empty)")
    exp_p.add_argument(
        "--keep-bf16",
        default="",
        help="MoE layers whose experts stay BF16: comma-separated first, last or layer indices",
    )
    exp_p.add_argument(
        "--shared-gate-up-scale",
        action="store_true",
        help="one global scale per expert for gate and up (vLLM's fused w13 uses the gate's); "
        "their codes then follow that scale, not the rollout's",
    )
    from experiments.shard_report import add_parser

    add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args, extra = cli.parse_known_args(argv)
    # key=value after an option (``run x.yaml --run-dir d steps=3``) is an override too
    if extra and hasattr(args, "overrides") and all("=" in e and e[0] != "-" for e in extra):
        args.overrides += extra
    elif extra:
        cli.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "compare":
            from experiments.report import compare

            labels = args.labels.split(",") if args.labels else None
            return compare(args.run_dirs, args.out, labels)
        if args.command == "report":
            from experiments.report import report

            return report(args.sweep_dir, args.out, args.reference)
        if args.command == "archive":
            from experiments.sweep import archive

            return archive(args.sweep_dir, args.dest)
        if args.command == "list":
            import experiments.pipelines  # noqa: F401

            for name, exp in sorted(EXPERIMENTS.items()):
                print(f"{name:24s} {exp.description}")
            return 0
        if args.command == "sweep":
            return sweep_command(args)
        if args.command == "shard-report":
            from experiments.shard_report import shard_report_command

            return shard_report_command(args)
        if args.command == "export":
            from experiments.export import export_command

            return export_command(args)
        return run_command(args)
    except USER_ERRORS as e:
        kind = "checkpoint error" if isinstance(e, CheckpointError) else "config error"
        print(f"{kind}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"\n{e}" if isinstance(e, Interrupted) else "\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # tensorstore's orphaned-callback reports can come after main returns, until the process ends
    sys.unraisablehook = without_closed_loop_reports(sys.unraisablehook)
    stop_on_sigint()
    sys.exit(main())
