"""Registers, shared memory and occupancy of the decode-attention kernel, from Nsight Compute.

Occupancy diagnostic for the GPU benchmarks: each configuration runs once in a child process
under ``ncu`` (launch statistics and occupancy sections of the kernel's first launch).
Usage (GPU machine): ``PYTHONPATH=. python3 experiments/bench/kernel_resources.py``; prints the
per-thread registers, shared memory per block, and theoretical and achieved occupancy per case.
Needs ``ncu`` (the CUDA toolkit's) on PATH or under /usr/local/cuda*/bin.
"""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
import sys

CASES = {
    # name: (format, block_k, splits, warps, stages)
    "bf16 64x8 w4 s2": ("bf16", 64, 8, 4, 2),
    "nvfp4 64x8 w4 s2": ("nvfp4", 64, 8, 4, 2),
    "nvfp4 64x8 w4 s3": ("nvfp4", 64, 8, 4, 3),
    "nvfp4 128x4 w4 s2": ("nvfp4", 128, 4, 4, 2),
    "mxfp4 64x8 w4 s2": ("mxfp4", 64, 8, 4, 2),
}
METRICS = (
    "Registers Per Thread",
    "Static Shared Memory Per Block",
    "Dynamic Shared Memory Per Block",
    "Block Limit Registers",
    "Block Limit Shared Mem",
    "Theoretical Occupancy",
    "Achieved Occupancy",
    "Duration",
    "Memory Throughput",
    "DRAM Throughput",
)


def find_tool(name: str) -> str | None:
    return shutil.which(name) or next(iter(glob.glob(f"/usr/local/cuda*/bin/{name}")), None)


def run_case(name: str) -> None:
    """Child process: run one decode-attention case once (B=32 S=8192)."""
    import jax

    from experiments.bench import fp4_attention as bench
    from pallas_kernels import fp4_decode_attention as fa

    fmt, bk, splits, warps, stages = CASES[name]
    q, k, v, n = bench.make_case(32, 8192, fmt, 1, seed=1)[0]
    cfg = fa.DecodeAttentionConfig(
        block_k=bk, num_splits=splits, num_warps=warps, num_stages=stages
    )
    jax.block_until_ready(fa.decode_attention(q, k, v, n, config=cfg))


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        run_case(sys.argv[2])
        return 0
    ncu = find_tool("ncu")
    print(f"ncu: {ncu}", flush=True)
    if ncu is None:
        return 1
    for name in CASES:
        cmd = [ncu, "--section", "LaunchStats", "--section", "Occupancy", "--section",
               "SpeedOfLight", "-k", "regex:decode_attention", "-c", "1",
               sys.executable, __file__, "--child", name]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
        out = res.stdout + res.stderr
        print(f"{name}: rc={res.returncode}", flush=True)
        lines = [ln.strip() for ln in out.splitlines() if any(m in ln for m in METRICS)]
        for ln in lines:
            print(f"  {re.sub(r'\s+', ' ', ln)}", flush=True)
        if not lines:
            print("  " + "\n  ".join(out.strip().splitlines()[-8:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
