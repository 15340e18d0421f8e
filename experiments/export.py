"""``python -m experiments export SOURCE --format nvfp4 --out DIR``: a policy as a Hugging Face
folder whose routed experts are FP4 in the compressed-tensors layout (vLLM, SGLang), the rest BF16.

SOURCE is one of:
- a run directory (``config.yaml``): the policy of its newest checkpoint (``checkpoints/<step>``,
  the trained one), or its ``policy/`` (the policy RL started from) when it has no checkpoint;
- a policy checkpoint of a run directory: ``<run>/policy`` or ``<run>/checkpoints/<step>``;
- a Hugging Face folder (``config.json``): BF16, or an export, whose FP4 experts are kept as they
  are stored when the format is the same.

The experts are quantized by the rollout's own refit (``engine.pack_expert_weight`` under the
run's rollout policy), so the exported codes and scales are those the rollout ran with, and
``load_rollout_model(DIR, ...)`` gives them back bit for bit. The model configuration comes from
the run's ``config.yaml`` (its preset and overrides, or its ``hf_checkpoint``'s ``config.json``,
whose other keys and tokenizer files are carried over).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from experiments.runner import resolve_data
from trace_jax.config import ConfigError
from trace_jax.model import ModelConfig, QuantPolicy, Transformer, export, hf
from trace_jax.rl import runlog
from trace_jax.rl.checkpoint import read_policy_params
from trace_jax.rl.loop import RLConfig, model_config, rollout_policy
from trace_jax.rollout.engine import pack_expert_weight

EXPORT_FORMATS = ("nvfp4", "mxfp4")


def export_command(args: argparse.Namespace) -> int:
    fmt = args.format.lower()
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"--format: {args.format!r} is not one of {', '.join(EXPORT_FORMATS)}")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out: {out} exists and is not an empty folder")
    source = Path(args.source)
    src = _read_source(source, fmt)
    keep = export.keep_bf16_layers(args.keep_bf16, src["cfg"])
    policy = src["policy"]
    for note in src["notes"]:
        print(f"note: {note}")
    params = export.quantize_experts(
        src["params"],
        src["cfg"],
        functools.partial(pack_expert_weight, policy=policy),
        keep=keep,
        shared_gate_up_scale=args.shared_gate_up_scale,
    )
    record = {
        "source": str(source.resolve()),
        "checkpoint": src["checkpoint"],
        "weight_quantization": {
            "fmt": policy.fmt,
            "scale_rule": policy.weight_scale_rule,
            "block_2d": policy.weight_block_2d,
            "shared_gate_up_scale": args.shared_gate_up_scale,
        },
        "keep_bf16_layers": sorted(keep),
    }
    files = export.save_fp4_checkpoint(
        params, src["cfg"], out, base_config=src["base_config"], record=record
    )
    tokenizer = export.copy_tokenizer_files(src["tokenizer"], out) if src["tokenizer"] else []
    kept = f", MoE layers {sorted(keep)} in BF16" if keep else ""
    print(f"exported {src['checkpoint']} as {fmt} to {out} ({len(files)} weight file(s){kept})")
    print(
        f"tokenizer: {', '.join(tokenizer)}"
        if tokenizer
        else "tokenizer: none in the source (the built-in byte-level tokenizer has no files)"
    )
    return 0


def _read_source(source: Path, fmt: str) -> dict[str, Any]:
    """cfg, params (flat path -> array or stored QTensor), policy, base_config, tokenizer folder,
    checkpoint (what was read) and notes, for any accepted SOURCE."""
    if (source / hf.CONFIG).is_file():
        return _hf_source(source, fmt)
    run_dir, checkpoint = _run_checkpoint(source)
    data = runlog.current_config(run_dir)
    exp, run_cfg = resolve_data(dict(data), [], str(run_dir / runlog.CONFIG))
    if not isinstance(run_cfg, RLConfig):
        raise ConfigError(f"{run_dir} is a run of {exp.name!r}, which trains no policy")
    if checkpoint is None:  # a run directory: its newest checkpoint, else the start policy
        steps = runlog.checkpoint_steps(run_dir)
        checkpoint = run_dir / "checkpoints" / str(steps[-1]) if steps else run_dir / "policy"
        if not checkpoint.is_dir():
            raise ConfigError(f"{run_dir}: a run directory without checkpoints/ or policy/")
    if run_cfg.hf_checkpoint:
        cfg = hf.checkpoint_config(run_cfg.hf_checkpoint)
        base = json.loads((Path(run_cfg.hf_checkpoint) / hf.CONFIG).read_text())
        tokenizer = Path(run_cfg.hf_checkpoint)
    else:
        cfg, base, tokenizer = model_config(run_cfg, 0), None, None
    stored = read_policy_params(checkpoint)
    params = _by_model_path(stored, cfg, checkpoint)
    cfg = cfg.replace(param_dtype=str(params[("embed_tokens",)].dtype))
    notes = []
    if run_cfg.rollout == "fp4" and run_cfg.fmt == fmt:
        policy = rollout_policy(run_cfg)
    else:
        policy = QuantPolicy.rollout(fmt)
        ran = f"an {run_cfg.fmt} rollout" if run_cfg.rollout == "fp4" else "a BF16 rollout"
        notes.append(f"the run had {ran}: these {fmt} codes are quantized after training")
    return dict(
        cfg=cfg,
        params=params,
        policy=policy,
        base_config=base,
        tokenizer=tokenizer,
        checkpoint=str(checkpoint.relative_to(run_dir.parent)),
        notes=notes,
    )


def _hf_source(source: Path, fmt: str) -> dict[str, Any]:
    cfg = hf.checkpoint_config(source)
    params = dict(hf.iter_hf_params(source, cfg, packed=fmt))
    return dict(
        cfg=cfg,
        params=params,
        policy=QuantPolicy.rollout(fmt),
        base_config=json.loads((source / hf.CONFIG).read_text()),
        tokenizer=source,
        checkpoint=str(source),
        notes=[],
    )


def _run_checkpoint(source: Path) -> tuple[Path, Path | None]:
    """(run directory, the checkpoint folder SOURCE names, None for the run directory itself);
    ``ConfigError`` naming SOURCE when it is neither."""
    if (source / runlog.CONFIG).is_file():
        return source, None
    if source.name == "policy" and (source.parent / runlog.CONFIG).is_file():
        return source.parent, source
    run = source.parent.parent
    in_run = source.parent.name == "checkpoints" and (run / runlog.CONFIG).is_file()
    if source.name.isdigit() and in_run:
        if not source.is_dir():
            steps = runlog.checkpoint_steps(run)
            raise ConfigError(f"{source}: no such checkpoint (the run has steps {steps})")
        return run, source
    what = "does not exist" if not source.exists() else "is not one"
    raise ConfigError(
        f"{source} {what}: expected a run directory (config.yaml), <run>/policy, "
        "<run>/checkpoints/<step> or a Hugging Face folder (config.json)"
    )


def _by_model_path(
    stored: dict[tuple[str, ...], np.ndarray], cfg: ModelConfig, checkpoint: Path
) -> dict[tuple[str | int, ...], np.ndarray]:
    """The stored parameters keyed by ``Transformer(cfg)``'s flat paths; ``ConfigError`` naming
    the checkpoint when they are not that model's."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    expected = {p: tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
    out = {}
    for p, shape in expected.items():
        value = stored.get(tuple(map(str, p)))
        if value is None or value.shape != shape:
            found = "missing" if value is None else f"of shape {list(value.shape)}"
            raise ConfigError(
                f"{checkpoint}: parameter {'.'.join(map(str, p))} is {found}; the run's model "
                f"config needs {list(shape)}"
            )
        out[p] = value
    return out
