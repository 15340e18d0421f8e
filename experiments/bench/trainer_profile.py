"""Where a trainer step's device time goes: the scoring pass and one minibatch's gradient at a
preset's shapes, timed, then profiled op by op.

A synthetic rollout batch (random tokens and replayed routes, the last ``--new`` slots of each
sequence sampled) goes through ``Trainer.score`` (one forward over the whole batch) and
``Trainer.gradient`` on one minibatch, each timed after a warm-up call (median of
``--repeats``). Then ``--profile-calls`` gradient calls run under JAX's profiler; the device's
kernels are summed by the HLO instruction that launched them, labelled with the JAX operation
that instruction came from (its ``op_name`` in the compiled program), largest first.

    python experiments/bench/trainer_profile.py --preset medium --batch 256 --minibatch 64
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import statistics
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.profiler import ProfileData

from experiments.bench.grouped_matmul import expert_kernels
from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import RLBatch, Trainer

POLICIES = {"bf16": QuantPolicy.bf16, "qat": QuantPolicy.qat}


def synthetic_batch(cfg: ModelConfig, batch: int, seq: int, new: int, seed: int = 0) -> RLBatch:
    """B sequences of ``seq`` slots, all filled, the last ``new`` sampled; routes: k distinct
    experts per token, uniformly at random (the trainer replays them)."""
    kt, kr, ka = jax.random.split(jax.random.key(seed), 3)
    layers = len(cfg.moe_layers)
    scores = jax.random.uniform(kr, (layers, batch, seq, cfg.num_experts))
    routes = jax.lax.top_k(scores, cfg.num_experts_per_tok)[1].astype(jnp.int32)
    sampled = jnp.broadcast_to(jnp.arange(seq) >= seq - new, (batch, seq))
    return RLBatch(
        tokens=jax.random.randint(kt, (batch, seq), 4, cfg.vocab_size, jnp.int32),
        filled=jnp.ones((batch, seq), bool),
        loss_mask=sampled,
        rollout_logp=jnp.full((batch, seq), -1.0, jnp.float32),
        advantages=jax.random.normal(ka, (batch,), jnp.float32),
        routes=routes,
    )


def median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # warm-up: compilation
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the JAX operation it came from (``metadata={op_name=...}``)."""
    names = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]+)\"", hlo_text, re.M):
        names.setdefault(m.group(1), m.group(2))
    return names


def kernel_times(fn, calls: int) -> tuple[dict[str, float], int]:
    """Device nanoseconds per HLO instruction over ``calls`` calls of ``fn``, and the number of
    kernels (the host's XLA ops where there is no GPU)."""
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir):
            for _ in range(calls):
                jax.block_until_ready(fn())
        (path,) = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
        data = ProfileData.from_file(path)
    planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
    if not planes:
        planes = [p for p in data.planes if p.name == "/host:CPU"]
    per_op: dict[str, float] = collections.defaultdict(float)
    count = 0
    warnings.filterwarnings("ignore", "builtin type event_stats", DeprecationWarning)
    for plane in planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats:
                    per_op[stats["hlo_op"]] += event.duration_ns
                    count += 1
    return per_op, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers of the preset")
    parser.add_argument("--policy", choices=tuple(POLICIES), default="bf16")
    parser.add_argument("--batch", type=int, default=256, help="sequences scored")
    parser.add_argument("--minibatch", type=int, default=64, help="sequences per gradient")
    parser.add_argument("--seq", type=int, default=68, help="slots per sequence")
    parser.add_argument("--new", type=int, default=48, help="sampled slots per sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-calls", type=int, default=2)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--expert-matmul",
        choices=("auto", "xla"),
        default="auto",
        help="xla: the experts' matmul in XLA's blocked form even where JAX's Hopper kernels apply",
    )
    args = parser.parse_args(argv)
    with expert_kernels(args.expert_matmul == "auto"):
        return profile(args)


def profile(args: argparse.Namespace) -> int:
    """Time and profile the trainer (``main``'s arguments)."""
    cfg = ModelConfig.preset(args.preset)
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers)
    model = Transformer(cfg, nnx.Rngs(0))
    trainer = Trainer(
        model, POLICIES[args.policy](), LossConfig(), optax.adamw(1e-6),
        minibatches=args.batch // args.minibatch,
    )  # fmt: skip
    params = trainer.init().params
    batch = synthetic_batch(cfg, args.batch, args.seq, args.new)
    rows = jnp.arange(args.minibatch, dtype=jnp.int32)
    old_logp = batch.rollout_logp

    def gradient():
        return trainer.gradient(params, batch, old_logp, None, rows)

    t_score = median_seconds(lambda: trainer.score(params, batch), args.repeats)
    t_grad = median_seconds(gradient, args.repeats)
    device = jax.devices()[0].device_kind
    print(
        f"{args.preset} ({cfg.num_layers} layers), {args.policy}, experts' matmul "
        f"{args.expert_matmul}, {args.seq} slots a sequence, "
        f"{device}; median of {args.repeats}:\n"
        f"  score, {args.batch} sequences: {t_score * 1e3:.1f} ms\n"
        f"  gradient, {args.minibatch} sequences: {t_grad * 1e3:.1f} ms",
        flush=True,
    )
    hlo = Trainer.gradient.lower(trainer, params, batch, old_logp, None, rows).compile().as_text()
    labels = op_names(hlo)
    per_op, kernels = kernel_times(gradient, args.profile_calls)
    total = sum(per_op.values())
    print(
        f"\ngradient, profiled over {args.profile_calls} calls: {kernels} kernels, "
        f"{total / 1e6 / args.profile_calls:.1f} ms of device time a call; largest first:"
    )
    print("| HLO instruction | ms a call | share | JAX operation |")
    print("| --- | --- | --- | --- |")
    for op, ns in sorted(per_op.items(), key=lambda kv: -kv[1])[: args.top]:
        label = labels.get(op, "")[-110:]
        ms = ns / 1e6 / args.profile_calls
        print(f"| {op} | {ms:.2f} | {100 * ns / total:.1f} % | {label} |")
    by_label: dict[str, float] = collections.defaultdict(float)
    for op, ns in per_op.items():
        by_label[labels.get(op, "(unlabelled)")] += ns
    print("\n| JAX operation (instructions summed) | ms a call | share |")
    print("| --- | --- | --- |")
    for label, ns in sorted(by_label.items(), key=lambda kv: -kv[1])[: args.top]:
        ms = ns / 1e6 / args.profile_calls
        print(f"| {label[-110:]} | {ms:.2f} | {100 * ns / total:.1f} % |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
