"""Compact TRACE guidance bytes per token for the model presets (no device work).

    PYTHONPATH=. python3 experiments/bench/guidance_size.py [--presets tiny small qwen3-30b-a3b]

For each preset, format and choice of guided layers it prints the compact guidance the rollout
keeps per token (1 mantissa bit per element plus block scales and, for NVFP4, one FP32 scale per
row), the full guidance it replaces (4-bit codes and scales at every site of every layer), their
ratio, and the bits per guided element with and without the per-row global scales. Sites: the
routed-expert activations of every MoE layer and K/V of every layer (``model_sites``).
"""

from __future__ import annotations

import argparse

from trace_jax.guidance import model_guidance_bytes
from trace_jax.model import ModelConfig, QuantPolicy

GUIDED = ("last_half", "all")


def rows(presets: list[str]) -> list[dict]:
    out = []
    for preset in presets:
        cfg = ModelConfig.preset(preset)
        for fmt in ("nvfp4", "mxfp4"):
            for guided in GUIDED:
                sizes = model_guidance_bytes(cfg, QuantPolicy.rollout(fmt, guided_layers=guided))
                no_global = model_guidance_bytes(
                    cfg, QuantPolicy.rollout(fmt, guided_layers=guided, act_global_scale="tensor")
                )
                out.append(
                    dict(
                        preset=preset,
                        fmt=fmt,
                        guided=guided,
                        compact=sizes.compact,
                        full=sizes.full,
                        ratio=sizes.full / sizes.compact,
                        bits=sizes.bits_per_guided_element,
                        bits_no_global=no_global.bits_per_guided_element,
                    )
                )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small", "qwen3-30b-a3b"])
    args = parser.parse_args(argv)
    header = (
        f"{'preset':15s} {'fmt':6s} {'guided':10s} {'compact B/tok':>14s} {'full B/tok':>11s} "
        f"{'full/compact':>12s} {'bits/elem':>9s} {'w/o global':>10s}"
    )
    print(header)
    print("-" * len(header))
    for r in rows(args.presets):
        print(
            f"{r['preset']:15s} {r['fmt']:6s} {r['guided']:10s} {r['compact']:14,d} "
            f"{r['full']:11,d} {r['ratio']:12.2f} {r['bits']:9.3f} {r['bits_no_global']:10.3f}"
        )


if __name__ == "__main__":
    main()
