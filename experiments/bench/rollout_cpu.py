"""Rollout tokens/s of the tiny model per KV-cache format (a smoke figure on any device).

    PYTHONPATH=. python3 experiments/bench/rollout_cpu.py [--preset tiny --batch 16 --new 64]
        [--backends xla,pallas --formats bf16,nvfp4] [--layers N]

``--layers`` keeps a preset's layer shapes with fewer layers (e.g. ``--preset qwen3-30b-a3b
--layers 4`` on one GPU: the real model's matrices, experts and attention heads, so the decode
step's weight and cache bytes are those the kernels were built for).

For each cache format it builds an engine (BF16 policy for the ``bf16``/``fp8`` caches; FP4
weights, activations and cache with TRACE guidance recorded in the deeper half for ``nvfp4`` and
``mxfp4``), compiles prefill and the decode loop on a warm-up call, then times ``generate`` over
fresh keys (median of ``--repeats``) and prints decoded tokens/s and cache bytes, per engine
backend: ``xla`` (reference) or ``pallas`` (the FP4 MoE and decode-attention kernels; on a CPU
they run in the Pallas interpreter, so only a GPU figure means anything).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.rollout import RolloutConfig, RolloutEngine

FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")


def bench(
    preset: str,
    batch: int,
    prompt_len: int,
    new: int,
    repeats: int,
    formats=FORMATS,
    backends=("xla",),
    layers: int | None = None,
) -> list[dict]:
    cfg = ModelConfig.preset(preset).replace(dtype="bfloat16")
    if layers is not None:
        cfg = cfg.replace(num_layers=layers)
    model = Transformer(cfg, nnx.Rngs(0))
    prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (batch, prompt_len)).tolist()
    rows = []
    for backend, kv in ((b, f) for b in backends for f in formats):
        fp4_path = kv in ("nvfp4", "mxfp4")
        policy = QuantPolicy.rollout(kv) if fp4_path else QuantPolicy.bf16()
        engine = RolloutEngine(
            model,
            policy,
            RolloutConfig(
                max_len=prompt_len + new,
                max_new_tokens=new,
                kv_cache=kv,
                fp4_weights=fp4_path,
                backend=backend,
            ),
        )
        jax.block_until_ready(engine.generate(prompts, jax.random.key(0)).tokens)  # compile
        times, tokens = [], 0
        for r in range(repeats):
            t0 = time.perf_counter()
            state = engine.generate(prompts, jax.random.key(r + 1))
            jax.block_until_ready(state.tokens)
            times.append(time.perf_counter() - t0)
            tokens = int(state.generated.sum())
        rows.append(
            dict(
                backend=backend,
                kv=kv,
                weights_acts="fp4" if fp4_path else "bf16",
                tokens=tokens,
                seconds=statistics.median(times),
                tokens_per_s=tokens / statistics.median(times),
                cache_bytes=engine.start(batch).cache.nbytes,
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--backends", default="xla")
    parser.add_argument("--layers", type=int, default=None, help="the preset with N layers")
    args = parser.parse_args(argv)
    rows = bench(
        args.preset,
        args.batch,
        args.prompt_len,
        args.new,
        args.repeats,
        formats=args.formats.split(","),
        backends=args.backends.split(","),
        layers=args.layers,
    )
    layers = "" if args.layers is None else f" (layers: {args.layers})"
    print(
        f"device: {jax.devices()[0].device_kind}; preset {args.preset}{layers}, batch {args.batch}"
    )
    print(
        f"{'backend':7s} {'kv cache':8s} {'W/A':5s} {'tokens':>7s} {'s':>7s} {'tokens/s':>9s} "
        f"{'cache B':>10s}"
    )
    for r in rows:
        print(
            f"{r['backend']:7s} {r['kv']:8s} {r['weights_acts']:5s} {r['tokens']:7d} "
            f"{r['seconds']:7.3f} "
            f"{r['tokens_per_s']:9.0f} {r['cache_bytes']:10,d}"
        )


if __name__ == "__main__":
    main()
