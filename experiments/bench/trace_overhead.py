"""TRACE's cost against vanilla QAT on the same rollouts, phase by phase.

One model, one batch of prompts. Vanilla QAT: an FP4 rollout that records nothing, then the RTN
fake-quant trainer's update. TRACE: the same FP4 rollout recording guidance in the deeper half,
with ``--guidance-path host`` the guidance through the cache (device -> host -> trainer; with
``device``, the RL loop's default, the records stay where the rollout wrote them), then the
guided trainer's update on the same sequences. Each phase is timed after a warm-up call
(compilation excluded), the median of ``--repeats``; the table ends with the end-to-end overhead
(the paper: +7.4 %).

    python experiments/bench/trace_overhead.py --preset medium --batch 256 --new 48
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from trace_jax.guidance import GuidanceCache
from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.rl.diagnostics import guidance_of
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import RLBatch, Trainer
from trace_jax.rollout import RolloutConfig, RolloutEngine


def _median_time(fn, repeats: int) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())  # warm-up: compilation
    print(f"  first call (compilation included): {time.perf_counter() - t0:.1f} s", flush=True)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    print(f"  median of {repeats}: {statistics.median(times):.4f} s", flush=True)
    return statistics.median(times), out


def measure(
    preset: str,
    batch: int,
    prompt_len: int,
    new: int,
    repeats: int,
    backend: str,
    fmt: str = "nvfp4",
    layers: int | None = None,
    scan_decode: bool = False,
    sides: tuple[str, ...] = ("qat", "trace"),
    guidance_path: str = "device",
) -> dict[str, dict[str, float]]:
    """Seconds per phase for ``qat`` and ``trace`` (see the module docstring)."""
    cfg = ModelConfig.preset(preset)
    if layers:
        cfg = cfg.replace(num_layers=layers)
    model = Transformer(cfg, nnx.Rngs(0))
    rollout_cfg = RolloutConfig(
        max_len=prompt_len + new,
        max_new_tokens=new,
        kv_cache=fmt,
        backend=backend,
        scan_decode=scan_decode,
    )
    rng = np.random.default_rng(0)
    prompts = rng.integers(4, cfg.vocab_size, (batch, prompt_len)).tolist()
    key = jax.random.key(0)
    policies = {
        "qat": (QuantPolicy.qat(fmt), QuantPolicy.qat(fmt)),
        "trace": (QuantPolicy.rollout(fmt), QuantPolicy.trace(fmt)),
    }
    out: dict[str, dict[str, float]] = {}
    for name, (rollout_policy, train_policy) in policies.items():
        if name not in sides:
            continue
        print(f"{name}: engine, rollout, guidance, trainer", flush=True)
        engine = RolloutEngine(model, rollout_policy, rollout_cfg)
        phases: dict[str, float] = {}
        phases["refit"], _ = _median_time(
            lambda e=engine: e.update_params(model) or e.state, repeats
        )
        phases["rollout"], state = _median_time(lambda e=engine: e.generate(prompts, key), repeats)
        guidance = guidance_of(state)
        if guidance and guidance_path == "host":
            with tempfile.TemporaryDirectory() as spill, GuidanceCache(spill) as cache:
                ids, versions = list(range(batch)), itertools.count()

                def transfer(cache=cache, ids=ids, guidance=guidance, versions=versions):
                    version = next(versions)  # as the loop: one version per step
                    cache.put_batch(version, ids, guidance)
                    fetched = jax.tree.map(jnp.asarray, cache.get(version, ids))
                    cache.evict(version_below=version)
                    return fetched

                phases["guidance transfer"], guidance = _median_time(transfer, repeats)
        rl_batch = RLBatch(
            tokens=state.tokens,
            filled=state.filled,
            loss_mask=state.generated,
            rollout_logp=state.logprobs,
            advantages=jnp.asarray(rng.standard_normal(batch), jnp.float32),
            routes=jnp.moveaxis(state.routes, 2, 0),
            guidance=guidance,
        )
        trainer = Trainer(model, train_policy, LossConfig(), optax.adamw(1e-6))
        params = trainer.init().params
        phases["trainer forward+backward"], _ = _median_time(
            lambda t=trainer, b=rl_batch, p=params: t.gradient(p, b, None, None, None), repeats
        )
        out[name] = phases
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers of the preset")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", choices=("auto", "xla", "pallas"), default="auto")
    parser.add_argument("--fmt", choices=("nvfp4", "mxfp4"), default="nvfp4")
    parser.add_argument("--scan-decode", action="store_true", help="scan the decode step too")
    parser.add_argument("--qat-only", action="store_true", help="compile and time QAT's side only")
    parser.add_argument(
        "--guidance-path",
        choices=("device", "host"),
        default="device",
        help="host: time the guidance's way through the cache, as guidance_path=host does",
    )
    args = parser.parse_args(argv)
    backend = args.backend
    if backend == "auto":
        backend = "pallas" if jax.default_backend() == "gpu" else "xla"
    got = measure(
        args.preset,
        args.batch,
        args.prompt_len,
        args.new,
        args.repeats,
        backend,
        args.fmt,
        args.layers,
        args.scan_decode,
        ("qat",) if args.qat_only else ("qat", "trace"),
        args.guidance_path,
    )
    if args.qat_only:
        return 0
    qat, trace = got["qat"], got["trace"]
    print(
        f"\n{args.preset} ({args.layers or 'all'} layers), batch {args.batch}, prompt "
        f"{args.prompt_len}, {args.new} new tokens, {args.fmt}, rollout backend {backend}, "
        f"guidance {args.guidance_path}, "
        f"{jax.devices()[0].device_kind}; median of {args.repeats}, seconds"
    )
    print(f"{'phase':28s} {'QAT':>10s} {'TRACE':>10s} {'delta':>10s}")
    for phase in dict.fromkeys([*qat, *trace]):
        a, b = qat.get(phase, 0.0), trace.get(phase, 0.0)
        print(f"{phase:28s} {a:10.4f} {b:10.4f} {b - a:+10.4f}")
    total_q, total_t = sum(qat.values()), sum(trace.values())
    print(f"{'step (sum)':28s} {total_q:10.4f} {total_t:10.4f} {total_t - total_q:+10.4f}")
    print(f"TRACE overhead against QAT, end to end: {100 * (total_t / total_q - 1):+.1f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
