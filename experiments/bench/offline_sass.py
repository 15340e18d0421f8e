"""Instruction counts of the decode-attention kernel's inner loop for the H200 (sm_90), on a
machine without a GPU.

The Pallas Triton kernel is lowered on the CPU for the CUDA platform (JAX's own lowering, as
on the GPU, with the H200's description given in place of a device's), its Triton IR is compiled
for sm_90 by PyPI's ``triton`` (``pip install triton``; any environment: the IR is a file) and
disassembled with the ``cuobjdump`` it ships; the script prints the registers per thread and
the instructions of the largest loop (one step over ``block_k`` cache slots) by opcode. The
compiler versions differ from the GPU machine's XLA-bundled Triton, so compare configurations
with each other, not with device figures.

Usage (two steps, the second in an environment with ``triton``)::

    PYTHONPATH=. python3 experiments/bench/offline_sass.py ir --fmt nvfp4 --out /tmp/k.ttir \\
        [--config '{"block_k": 16}']
    python3 experiments/bench/offline_sass.py sass /tmp/k.ttir --warps 1 --stages 3
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

BENCH_SHAPE = (32, 8192, 4)  # B, S, Hkv of the benchmark's first row: the default tiling


def triton_ir(fmt: str = "nvfp4", overrides: dict | None = None) -> tuple[str, dict]:
    """The decode-attention kernel's Triton IR (text) as the GPU lowering makes it, and its
    launch options {"num_warps", "num_stages"}. ``overrides``: ``DecodeAttentionConfig`` fields
    over ``default_config`` at the benchmark shape."""
    import dataclasses

    from experiments.bench import fp4_attention as bench
    from pallas_kernels import cuda_lowering
    from pallas_kernels import fp4_decode_attention as fda

    cfg = dataclasses.replace(fda.default_config(*BENCH_SHAPE, fmt), **(overrides or {}))
    q, k, v, lengths = bench.make_case(2, 2 * cfg.block_k * cfg.num_splits, fmt, 1, 0)[0]
    captured = cuda_lowering.triton_modules(
        lambda q, k, v, n: fda.decode_attention(q, k, v, n, config=cfg), q, k, v, lengths
    )
    if len(captured) != 1:
        raise RuntimeError(f"expected one Triton kernel in the lowering, got {len(captured)}")
    return captured[0], {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def compile_sass(ttir: str, num_warps: int, num_stages: int) -> tuple[str, str]:
    """SASS text and resource usage of a Triton IR file compiled for sm_90 (needs ``triton``)."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        raise SystemExit(
            "offline_sass: the sass step needs PyPI triton (pip install triton)"
        ) from e
    kernel = triton.compile(
        ttir,
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    cubin = Path(ttir).with_suffix(".cubin")
    cubin.write_bytes(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True)
    usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True)
    res = " ".join(line.strip() for line in usage.stdout.splitlines() if "REG:" in line)
    return sass.stdout, res


_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def loop_stats(sass: str) -> tuple[int, collections.Counter]:
    """Instructions of the largest loop of a ``cuobjdump -sass`` listing (the span from a
    backward branch's target to the branch), and their count per opcode (predicates and
    modifiers dropped)."""
    instrs = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTR.match, sass.splitlines()) if m]
    span = None
    for addr, text in instrs:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            if span is None or addr - lo > span[1] - span[0]:
                span = (lo, addr)
    if span is None:
        raise ValueError("loop_stats: no backward branch in the listing")
    body = [text for addr, text in instrs if span[0] <= addr <= span[1]]
    ops = collections.Counter(
        re.sub(r"^@!?U?P[T\d]+\s+", "", text).split()[0].split(".")[0] for text in body
    )
    return len(body), ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    ir = sub.add_parser("ir", help="lower the kernel on the CPU and write its Triton IR")
    ir.add_argument("--fmt", default="nvfp4")
    ir.add_argument("--config", default="{}", help="DecodeAttentionConfig overrides (JSON)")
    ir.add_argument("--out", required=True)
    sa = sub.add_parser("sass", help="compile a Triton IR file for sm_90 and count the loop")
    sa.add_argument("ttir")
    sa.add_argument("--warps", type=int, required=True)
    sa.add_argument("--stages", type=int, required=True)
    args = ap.parse_args(argv)
    if args.step == "ir":
        text, opts = triton_ir(args.fmt, json.loads(args.config))
        Path(args.out).write_text(text)
        print(
            f"wrote {args.out}; compile with --warps {opts['num_warps']} "
            f"--stages {opts['num_stages']}"
        )
        return 0
    sass, res = compile_sass(args.ttir, args.warps, args.stages)
    n, ops = loop_stats(sass)
    print(res)
    print(f"inner loop: {n} instructions")
    print(", ".join(f"{op} {c}" for op, c in ops.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
