"""RL experiments: one pipeline, one registered name per baseline (the config's defaults differ).

| name | rollout | trainer |
| --- | --- | --- |
| ``bf16_rollout`` | BF16 | BF16 |
| ``fp4_rollout_bf16_train`` | FP4 (W/A of routed experts + KV) | BF16 (the mismatched baseline) |
| ``fp4_qat`` | FP4 | RTN fake quant at every site (vanilla QAT) |
| ``fp4_trace`` | FP4, guidance recorded in the deeper half | TRACE: guided there, RTN elsewhere |
| ``fp4_trace_all`` | FP4, guidance everywhere | guided everywhere |
| ``quickstart`` | as ``fp4_trace``, sized for a CPU, with a final QAT-vs-TRACE mismatch table |

``bf16_rollout`` with ``ptq_scale_rules`` also evaluates its final policy quantized post hoc
(RTN, 4/6: ``configs/<task>/ptq_eval.yaml``). Every one runs any task (``task.name``) and
writes ``metrics.jsonl``, TensorBoard events, orbax checkpoints and ``curves.png`` to its run
directory; a killed run resumes where its last checkpoint left off when started again with the
same ``--run-dir``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from experiments.registry import register
from trace_jax.model import QuantPolicy
from trace_jax.rl.diagnostics import mismatch_report, trainer_forward
from trace_jax.rl.loop import RLConfig, RLRun, TrainMode
from trace_jax.rollout import RolloutConfig, RolloutEngine, SamplingConfig


def _config(name: str, train_mode: TrainMode, rollout: Literal["bf16", "fp4"], doc: str) -> type:
    cls = dataclasses.make_dataclass(
        name,
        [
            ("train_mode", TrainMode, dataclasses.field(default=train_mode)),
            ("rollout", Literal["bf16", "fp4"], dataclasses.field(default=rollout)),
        ],
        bases=(RLConfig,),
        frozen=True,
    )
    cls.__doc__ = f"{doc}\n\n{RLConfig.__doc__}"
    cls.__module__ = __name__
    return cls


BASELINES = {
    "bf16_rollout": ("bf16", "bf16", "BF16 rollout and BF16 training (the reference)"),
    "fp4_rollout_bf16_train": ("bf16", "fp4", "FP4 rollout, BF16 trainer (naive FP4 rollout)"),
    "fp4_qat": ("qat", "fp4", "FP4 rollout, RTN fake-quant trainer (vanilla QAT)"),
    "fp4_trace": ("trace", "fp4", "FP4 rollout, TRACE trainer guided in the deeper half"),
    "fp4_trace_all": ("trace_all", "fp4", "FP4 rollout, TRACE trainer guided everywhere"),
}


def _run(cfg: RLConfig, run_dir: Path) -> dict:
    run = RLRun(cfg, run_dir)
    return run.run()


for _name, (_train, _rollout, _doc) in BASELINES.items():
    _cls = _config(
        "".join(p.capitalize() for p in _name.split("_")) + "Config", _train, _rollout, _doc
    )
    globals()[_cls.__name__] = _cls
    register(_name, _cls, _doc)(_run)


# ----------------------------------------------------------------------------- quickstart


@dataclasses.dataclass(frozen=True)
class QuickstartConfig(RLConfig):
    """Warm start, then GRPO with FP4 rollout and TRACE; at the end the mismatch of the TRACE
    trainer and of an RTN QAT trainer against the same FP4 rollouts.

    compare_prompts: prompts (x ``group_size``) of the final comparison batch.
    """

    train_mode: TrainMode = "trace"
    rollout: Literal["bf16", "fp4"] = "fp4"
    compare_prompts: int = 8


def compare_trainers(run: RLRun, params, step: int, prompts: int) -> dict[str, dict]:
    """Mismatch of the QAT and the TRACE trainer against one FP4 rollout batch that records
    guidance and codes at every layer (diagnostic mode)."""
    cfg = run.cfg
    model = run.trainer.model(params)
    policy = QuantPolicy.rollout(cfg.fmt, guided_layers="all", record_codes=True)
    engine = RolloutEngine(
        model,
        policy,
        RolloutConfig(
            max_len=run.max_len,
            max_new_tokens=cfg.max_new_tokens,
            kv_cache=cfg.fmt,
            sampling=SamplingConfig(temperature=cfg.temperature),
            stop_tokens=run.io.stop_tokens,
            pad_token=run.io.pad_id,
        ),
    )
    problems = [run.io.problem("eval", i) for i in range(prompts) for _ in range(cfg.group_size)]
    state, _ = run.io.rollout(engine, problems, run._key(step, 3), cfg.max_turns)
    out = {}
    trainers = {
        "qat (RTN)": QuantPolicy.qat(cfg.fmt, record_codes=True),
        "trace (deeper half)": QuantPolicy.trace(
            cfg.fmt, guided_layers=cfg.guided_layers, record_codes=True
        ),
        "trace (all layers)": QuantPolicy.trace(cfg.fmt, guided_layers="all", record_codes=True),
    }
    for name, tp in trainers.items():
        report = mismatch_report(trainer_forward(model, state, tp), state, tp, model.cfg.num_layers)
        out[name] = {
            k: report[k]
            for k in ("mismatch/logp_abs", "mismatch/kl_k3", "mismatch/code_rate/all")
            if k in report
        }
    return out


@register("quickstart", QuickstartConfig, "warm start + GRPO with FP4 rollout and TRACE (CPU)")
def quickstart(cfg: QuickstartConfig, run_dir: Path) -> dict:
    run = RLRun(cfg, run_dir)
    results = run.run()
    comparison = compare_trainers(run, run.final_state.params, 10**6, cfg.compare_prompts)
    print("\n" + "-" * 72)
    print(
        f"{'trainer vs the same FP4 rollouts':28s} {'logp_abs':>10s} {'kl_k3':>10s} "
        f"{'code_rate':>10s}"
    )
    for name, m in comparison.items():
        print(
            f"{name:28s} {m['mismatch/logp_abs']:10.2e} {m['mismatch/kl_k3']:10.2e} "
            f"{m.get('mismatch/code_rate/all', float('nan')):10.4f}"
        )
    print("-" * 72)
    print(f"plots: {run_dir / 'curves.png'}; metrics: {run_dir / 'metrics.jsonl'}")
    return {**results, "mismatch": comparison}
