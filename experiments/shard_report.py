"""``python -m experiments shard-report --preset qwen3-30b-a3b --mesh data=1,fsdp=8,expert=8``:
the bytes each device holds of an RL run's sharded state, from shapes alone.

The model, the trainer's AdamW state, the rollout's FP4 expert weights and the KV cache are built
abstractly (``nnx.eval_shape`` / ``jax.eval_shape``: no allocation, no device) and placed by the
sharding rules of ``trace_jax.model.sharding`` on a mesh given by its axis sizes: experts over
``expert``, every parameter and its moments over ``fsdp``, the batch (and so the KV cache) over
``data`` x ``fsdp``. The rollout's weights are counted as placed by the same rules.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from trace_jax.config import ConfigError
from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.model.sharding import BATCH_AXES, MESH_AXES, per_device_bytes, shard_bytes
from trace_jax.rollout import kv_cache
from trace_jax.rollout.engine import quantize_expert_weights


def parse_mesh(text: str) -> dict[str, int]:
    """``data=1,fsdp=8,expert=8`` -> axis sizes (missing axes: 1)."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in sizes or not value.isdigit() or int(value) <= 0:
            raise ConfigError(
                f"--mesh: {item!r} is not <axis>=<positive int> with axis one of {MESH_AXES}"
            )
        sizes[name] = int(value)
    return sizes


def shard_report(
    cfg: ModelConfig,
    axis_sizes: dict[str, int],
    batch: int,
    context: int,
    fmt: str = "nvfp4",
    kv: str = "nvfp4",
) -> dict[str, int]:
    """Bytes per device of each part of a run's state on a mesh of ``axis_sizes``.

    Args:
      cfg: the model; batch x context: the rollout's sequences and slots per sequence (KV cache).
      fmt: the rollout's FP4 format of the routed-expert weights; kv: the KV cache's format.
    Returns:
      {"parameters", "gradients", "AdamW state", "rollout weights", "KV cache"}: bytes of the
      largest shard each device holds (the trainer's master weights in ``cfg.param_dtype``).
    """
    if batch % (axis_sizes.get("data", 1) * axis_sizes.get("fsdp", 1)):
        raise ConfigError(f"batch: {batch} does not split over data x fsdp ({axis_sizes})")
    params = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param)
    # the trainer's optimizer (``RLRun``): its moments keep their parameter's logical axes
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = jax.eval_shape(optimizer.init, params)
    engine = nnx.eval_shape(
        lambda: quantize_expert_weights(Transformer(cfg, nnx.Rngs(0)), QuantPolicy.rollout(fmt))
    )
    cache = jax.eval_shape(
        lambda: kv_cache.init_cache(
            kv, cfg.num_layers, batch, context, cfg.num_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype)
        )
    )
    # every cache array is [B, ...]: the batch over data x fsdp
    kv_bytes = sum(
        shard_bytes(a.shape, a.dtype, PartitionSpec(BATCH_AXES), axis_sizes)
        for a in jax.tree.leaves(cache)
    )
    p = per_device_bytes(params, axis_sizes)
    return {
        "parameters": p,
        "gradients": p,
        "AdamW state": per_device_bytes(opt_state, axis_sizes),
        "rollout weights": per_device_bytes(nnx.state(engine, nnx.Param), axis_sizes),
        "KV cache": kv_bytes,
    }


def format_report(name: str, mesh: dict[str, int], batch: int, context: int, parts: dict) -> str:
    """One markdown table row: the preset, the mesh, then GiB per device of each part."""
    mesh_text = ",".join(f"{k}={v}" for k, v in mesh.items())
    gib = [f"{v / 2**30:.2f}" for v in parts.values()]
    total = f"{sum(parts.values()) / 2**30:.2f}"
    return f"| {name} | {mesh_text} | {batch} x {context} | " + " | ".join([*gib, total]) + " |"


def shard_report_command(args: argparse.Namespace) -> int:
    cfg = ModelConfig.preset(args.preset)
    mesh = parse_mesh(args.mesh)
    parts = shard_report(cfg, mesh, args.batch, args.context, args.format, args.kv)
    if not args.no_header:
        cols = " | ".join(parts)
        print(f"| preset | mesh | batch x context | {cols} | total (GiB per device) |")
        print("|" + "---|" * (len(parts) + 4))
    print(format_report(args.preset, mesh, args.batch, args.context, parts))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("shard-report", help="bytes per device of a preset's sharded run state")
    p.add_argument("--preset", required=True, help="a model preset (e.g. qwen3-30b-a3b)")
    p.add_argument("--mesh", default="", help="axis sizes, e.g. data=1,fsdp=8,expert=8")
    p.add_argument("--batch", type=int, default=64, help="rollout sequences (KV cache)")
    p.add_argument("--context", type=int, default=4096, help="KV-cache slots per sequence")
    p.add_argument("--format", default="nvfp4", choices=("nvfp4", "mxfp4"), help="rollout FP4")
    kv_formats = ("bf16", "fp8", "nvfp4", "mxfp4")
    p.add_argument("--kv", default="nvfp4", choices=kv_formats, help="KV-cache format")
    p.add_argument("--no-header", action="store_true", help="print the table row only")
