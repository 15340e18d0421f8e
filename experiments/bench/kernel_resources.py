"""Registers, shared memory and occupancy of the decode-attention kernel, from Nsight Compute;
with ``--matmul``, what bounds the FP4 matmul kernels (instruction mix, issue-slot use, memory
throughput, stall reasons) at K=8192 N=28672.

Occupancy diagnostic for the GPU benchmarks: each configuration runs once in a child process
under ``ncu`` (launch statistics and occupancy sections of the kernel's first launch).
Usage (GPU machine): ``PYTHONPATH=. python3 experiments/bench/kernel_resources.py``; prints the
per-thread registers, shared memory per block, and theoretical and achieved occupancy per case.
``--attention-stalls '[{}, {"prefetch": 1}]'``: stall reasons, pipe use and occupancy of the
nvfp4 kernel at B=32 S=8192, one launch per configuration (``DecodeAttentionConfig`` fields; with
``"tensor_cores": true``, the tensor-core kernel's ``MgpuAttentionConfig`` fields).
Needs ``ncu`` (the CUDA toolkit's) on PATH or under /usr/local/cuda*/bin.
"""

from __future__ import annotations

import dataclasses
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
    "nvfp4 16x8 w1 s3 (default)": ("nvfp4", 16, 8, 1, 3),
    "mxfp4 32x8 w1 s2 (default)": ("mxfp4", 32, 8, 1, 2),
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
    from pallas_kernels import fp4_decode_attention_triton as ft

    fmt, bk, splits, warps, stages = CASES[name]
    q, k, v, n = bench.make_case(32, 8192, fmt, 1, seed=1)[0]
    cfg = ft.DecodeAttentionConfig(
        block_k=bk, num_splits=splits, num_warps=warps, num_stages=stages
    )
    jax.block_until_ready(fa.decode_attention(q, k, v, n, config=cfg))


MATMUL_METRICS = (
    "Duration",
    "DRAM Throughput",
    "Memory Throughput",
    "Executed Ipc Active",
    "Issue Slots Busy",
    "Issued Ipc Active",
    "SM Busy",
    "Executed Instructions",
    "Registers Per Thread",
    "Shared Memory Configuration Size",
    "Dynamic Shared Memory Per Block",
    "Theoretical Occupancy",
    "Achieved Occupancy",
    "Block Limit",
    "Warp Cycles Per Issued Instruction",
    "Avg. Active Threads Per Warp",
    "L1/TEX Hit Rate",
    "L2 Hit Rate",
    "Mem Busy",
    "Max Bandwidth",
    "Grid Size",
    "Block Size",
)


def run_matmul_cases() -> None:
    """Child process: each FP4 matmul kernel of interest runs exactly once (K=8192 N=28672):
    the earlier one-token GEMV form, the one-token kernel, the MMA kernel at M=16 and the
    same MMA kernel on bf16 weights at M=16."""
    import json

    import jax
    import jax.numpy as jnp

    from pallas_kernels import fp4_matmul as fm
    from pallas_kernels import fp4_matmul_gemv as fmv
    from pallas_kernels import fp4_matmul_triton as ft
    from pallas_kernels import layouts
    from trace_jax import fp4

    k, n = 8192, 28672
    w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02
    pw = jax.block_until_ready(layouts.prepack(fp4.quantize(w, "nvfp4", axis=0)))
    wt = jax.block_until_ready(jnp.asarray(w.T, jnp.bfloat16))
    del w
    x1 = jax.random.normal(jax.random.key(1), (1, k), jnp.float32).astype(jnp.bfloat16)
    x16 = jax.random.normal(jax.random.key(2), (16, k), jnp.float32).astype(jnp.bfloat16)
    bf16_cfg = ft.Fp4MatmulConfig(block_n=128, block_k=128, block_m=16)
    # The one-token kernel at the configuration given on the command line (JSON of
    # Fp4GemvConfig fields plus "tiled"), else the default of prepack.
    spec = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    tiled = spec.pop("tiled", True)
    cfg = fmv.Fp4GemvConfig(**spec) if spec else fmv.default_gemv_config(k, n)
    pw_one = layouts.with_gemv_layout(pw, cfg.block_k, cfg.block_n if tiled else 0)
    for name, fn in (
        ("gemv form (mma=False)", lambda: fm.fp4_matmul(x1, pw, config=ft.gemv_config(k, n))),
        (f"one-token kernel {cfg} tiled={tiled}", lambda: fm.fp4_matmul(x1, pw_one, config=cfg)),
        ("mma kernel m=16", lambda: fm.fp4_matmul(x16, pw)),
        ("bf16 kernel m=16", lambda: ft.bf16_matmul(x16, wt, config=bf16_cfg)),
    ):
        print(f"CASE {name}", flush=True)
        jax.block_until_ready(fn())


def matmul_main(ncu: str, out_dir: str) -> int:
    import os

    log_path = os.path.join(out_dir, "ncu_matmul.txt")  # written as the profiler goes

    cmd = [ncu, "--clock-control", "none", "--section", "SpeedOfLight", "--section",
           "ComputeWorkloadAnalysis", "--section", "WarpStateStats", "--section",
           "InstructionStats", "--section", "LaunchStats", "--section", "Occupancy",
           "--section", "MemoryWorkloadAnalysis", "--metrics",
           "sass__inst_executed_per_opcode,"
           "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,"
           "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,"
           "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,"
           "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,"
           "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,"
           "smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,"
           "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,"
           "smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,"
           "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,"
           "smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,"
           "smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,"
           "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,"
           "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,"
           "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,"
           "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,"
           "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,"
           "dram__bytes_read.sum", "--print-metric-instances", "values",
           "-k", "regex:fp4_|bf16_matmul", "-c", "4", "--log-file", log_path,
           sys.executable, __file__, "--child-matmul", *sys.argv[2:3]]  # fmt: skip
    # No preallocated pool: the profiler saves and restores device memory between its passes.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    print(res.stdout[-2000:] + res.stderr[-2000:], flush=True)
    with open(log_path) as f:
        out = f.read()
    print(f"ncu rc={res.returncode}", flush=True)
    for ln in out.splitlines():
        if (
            ln.startswith("CASE")
            or "fp4_" in ln
            or "bf16_matmul" in ln
            or "stalled" in ln
            or "pipe_" in ln
            or "inst_executed_per_opcode" in ln
            or "dram__bytes" in ln
            or any(m in ln for m in MATMUL_METRICS)
        ):
            print(f"  {re.sub(r'\s+', ' ', ln.strip())[:600]}", flush=True)
    return 0


ATTENTION_STALL_METRICS = (
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_membar_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio",
    "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "dram__bytes_read.sum",
    "sass__inst_executed_per_opcode",
)


def run_attention_configs() -> None:
    """Child process: one nvfp4 decode-attention launch (B=32 S=8192) per configuration given
    on the command line (a JSON list of ``DecodeAttentionConfig`` fields, {} the default; with
    ``"tensor_cores": true``, the tensor-core kernel and ``MgpuAttentionConfig`` fields)."""
    import json

    import jax

    from experiments.bench import fp4_attention as bench
    from pallas_kernels import fp4_decode_attention as fa
    from pallas_kernels import fp4_decode_attention_mgpu as fm
    from pallas_kernels import fp4_decode_attention_triton as ft

    q, k, v, n = bench.make_case(32, 8192, "nvfp4", 1, seed=1)[0]
    for spec in json.loads(sys.argv[2]):
        print(f"CASE {spec}", flush=True)
        spec = dict(spec)
        if spec.pop("tensor_cores", False):
            cfg = dataclasses.replace(fm.default_config(32, 8192, k.shape[2]), **spec)
            jax.block_until_ready(fm.decode_attention_mgpu(q, k, v, n, config=cfg))
            continue
        cfg = ft.DecodeAttentionConfig(**spec) if spec else None
        jax.block_until_ready(fa.decode_attention(q, k, v, n, config=cfg))


def attention_stalls(ncu: str, out_dir: str, specs: str) -> int:
    """Where the nvfp4 decode-attention kernel's warps wait (ncu stall reasons per issued
    instruction, pipe use, occupancy), one launch per configuration in ``specs``."""
    import os

    log_path = os.path.join(out_dir, "ncu_attention.txt")
    cmd = [ncu, "--clock-control", "none", "--section", "SpeedOfLight", "--section",
           "WarpStateStats", "--section", "LaunchStats", "--section", "Occupancy",
           "--section", "SchedulerStats", "--metrics", ",".join(ATTENTION_STALL_METRICS),
           "--print-metric-instances", "values",
           "-k", "regex:decode_attention|mosaic_gpu", "--log-file", log_path,
           sys.executable, __file__, "--child-attention", specs]  # fmt: skip
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    print(res.stdout[-1500:] + res.stderr[-1500:], flush=True)
    print(f"ncu rc={res.returncode}", flush=True)
    keys = (
        *METRICS,
        *("stalled", "pipe_", "dram__bytes", "Issue Slots", "Eligible Warps", "No Eligible"),
        "inst_executed_per_opcode",
        *("Active Warps Per Scheduler", "Warp Cycles Per Issued"),
    )
    with open(log_path) as f:
        for ln in f.read().splitlines():
            named = "decode_attention" in ln or "mosaic_gpu" in ln
            if ln.startswith("CASE") or named or any(m in ln for m in keys):
                print(f"  {re.sub(r'\s+', ' ', ln.strip())[:3000]}", flush=True)
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        run_case(sys.argv[2])
        return 0
    if len(sys.argv) == 3 and sys.argv[1] == "--child-attention":
        run_attention_configs()
        return 0
    if len(sys.argv) >= 2 and sys.argv[1] == "--child-matmul":
        run_matmul_cases()
        return 0
    ncu = find_tool("ncu")
    print(f"ncu: {ncu}", flush=True)
    if ncu is None:
        return 1
    if "--matmul" in sys.argv:
        import os

        return matmul_main(ncu, os.environ.get("OUT", "."))
    if len(sys.argv) == 3 and sys.argv[1] == "--attention-stalls":
        import os

        return attention_stalls(ncu, os.environ.get("OUT", "."), sys.argv[2])
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
