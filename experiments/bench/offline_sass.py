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

The Mosaic GPU kernels' inline PTX (their FP4 decodes) cannot be compiled whole off the GPU;
``asm`` assembles each block for sm_90 with ``ptxas`` (``$PTXAS``, PyPI triton's, or one on the
PATH) and counts its instructions::

    PYTHONPATH=. python3 experiments/bench/offline_sass.py asm
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
    from pallas_kernels import fp4_decode_attention_triton as ft

    cfg = dataclasses.replace(ft.default_config(*BENCH_SHAPE, fmt), **(overrides or {}))
    q, k, v, lengths = bench.make_case(2, 2 * cfg.block_k * cfg.num_splits, fmt, 1, 0)[0]
    captured = cuda_lowering.triton_modules(
        lambda q, k, v, n: fda.decode_attention(q, k, v, n, config=cfg), q, k, v, lengths
    )
    if len(captured) != 1:
        raise RuntimeError(f"expected one Triton kernel in the lowering, got {len(captured)}")
    return captured[0], {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def plan_ir(rows: int = 128, experts: int = 128, block_m: int = 8) -> tuple[str, dict]:
    """The grouped matmul's routing-plan kernel (``fp4_matmul_mgpu.grouped_plan(kernel=True)``)
    as Triton IR, default the 16-token x top-8 MoE routing, and its launch options."""
    import jax.numpy as jnp

    from pallas_kernels import cuda_lowering
    from pallas_kernels import fp4_matmul_mgpu as fmm

    (text,) = cuda_lowering.triton_modules(
        lambda g: fmm.grouped_plan(g, rows, block_m, kernel=True),
        jnp.zeros((experts,), jnp.int32),
    )
    return text, {"num_warps": fmm.PLAN_WARPS, "num_stages": 1}


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


def find_ptxas() -> str | None:
    """``$PTXAS``, the ``ptxas`` that PyPI triton ships, or one on the PATH (None: none)."""
    import importlib.util
    import shutil

    if os.environ.get("PTXAS"):
        return os.environ["PTXAS"]
    spec = importlib.util.find_spec("triton")
    if spec and spec.origin:
        tool = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
        if tool.exists():
            return str(tool)
    return shutil.which("ptxas")


def inline_ptx_blocks() -> dict[str, tuple[str, int, int]]:
    """name -> (PTX text with $i operands, outputs, inputs) of the Mosaic GPU kernels' decodes."""
    from pallas_kernels import fp4_decode_attention_mgpu as attn
    from pallas_kernels import fp4_matmul_mgpu as matmul

    return {**attn.inline_ptx(), **matmul.inline_ptx()}


def ptx_entry(name: str, asm: str, n_out: int, n_in: int) -> str:
    """A PTX module whose one kernel loads the block's inputs from parameters, runs it and
    stores its outputs (so nothing is folded away)."""
    regs = [f"%r{i}" for i in range(n_out + n_in)]
    body = re.sub(r"\$(\d+)", lambda m: regs[int(m.group(1))], asm)
    params = ", ".join(["in .param .u64 out", *(f".param .u32 a{i}" for i in range(n_in))])
    loads = "\n".join(f"ld.param.u32 %r{n_out + i}, [a{i}];" for i in range(n_in))
    stores = "\n".join(f"st.global.u32 [%rd1+{4 * i}], %r{i};" for i in range(n_out))
    return f"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry {re.sub(r"[^a-z0-9]", "_", name)}({params.removeprefix("in ")})
{{
.reg .b32 %r<{n_out + n_in}>;
.reg .b64 %rd<2>;
{loads}
{body}
ld.param.u64 %rd0, [out];
cvta.to.global.u64 %rd1, %rd0;
{stores}
ret;
}}
"""


def assemble(ptx: str, ptxas: str) -> str:
    """``ptxas -arch=sm_90`` on a PTX module, then its SASS (the ``cuobjdump`` beside
    ``ptxas``, or on the PATH); raises CalledProcessError with ptxas' message on an error."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        subprocess.run(
            [ptxas, "-arch=sm_90", str(src), "-o", str(cubin)],
            capture_output=True,
            text=True,
            check=True,
        )
        tool = Path(ptxas).with_name("cuobjdump")
        tool = str(tool) if tool.exists() else shutil.which("cuobjdump")
        if tool is None:
            return ""
        return subprocess.run(
            [tool, "-sass", str(cubin)], capture_output=True, text=True, check=True
        ).stdout


def block_ops(sass: str) -> collections.Counter:
    """Opcodes of an ``assemble`` listing without the wrapper's loads, stores, moves and exit."""
    texts = [m.group(2) for m in map(_INSTR.match, sass.splitlines()) if m]
    wrapper = ("LDC", "ULDC", "STG", "EXIT", "BRA", "NOP", "MOV", "IMAD.MOV")
    return collections.Counter(
        t.split()[0].split(".")[0] for t in texts if not t.split()[0].startswith(wrapper)
    )


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
    return len(body), collections.Counter(map(_opcode, body))


def _opcode(text: str) -> str:
    """An instruction's opcode, its predicate and modifiers dropped."""
    return re.sub(r"^@!?U?P[T\d]+\s+", "", text).split()[0].split(".")[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    ir = sub.add_parser("ir", help="lower the kernel on the CPU and write its Triton IR")
    ir.add_argument(
        "--kernel", default="attention", choices=("attention", "plan"),
        help="the decode-attention kernel, or the grouped matmul's routing plan",
    )  # fmt: skip
    ir.add_argument("--fmt", default="nvfp4")
    ir.add_argument("--config", default="{}", help="DecodeAttentionConfig overrides (JSON)")
    ir.add_argument("--out", required=True)
    sa = sub.add_parser(
        "sass", help="compile a Triton IR file for sm_90 and count its loop (or all of it)"
    )
    sa.add_argument("ttir")
    sa.add_argument("--warps", type=int, required=True)
    sa.add_argument("--stages", type=int, required=True)
    sub.add_parser("asm", help="assemble the Mosaic GPU kernels' inline PTX for sm_90")
    args = ap.parse_args(argv)
    if args.step == "asm":
        ptxas = find_ptxas()
        if ptxas is None:
            raise SystemExit("offline_sass asm: no ptxas ($PTXAS, pip install triton, or PATH)")
        for name, (asm, n_out, n_in) in inline_ptx_blocks().items():
            ops = block_ops(assemble(ptx_entry(name, asm, n_out, n_in), ptxas))
            print(f"{name}: {sum(ops.values())} instructions ({dict(ops.most_common())})")
        return 0
    if args.step == "ir":
        if args.kernel == "plan":
            text, opts = plan_ir()
        else:
            text, opts = triton_ir(args.fmt, json.loads(args.config))
        Path(args.out).write_text(text)
        print(
            f"wrote {args.out}; compile with --warps {opts['num_warps']} "
            f"--stages {opts['num_stages']}"
        )
        return 0
    sass, res = compile_sass(args.ttir, args.warps, args.stages)
    print(res)
    try:
        n, ops = loop_stats(sass)
        print(f"inner loop: {n} instructions")
    except ValueError:  # a kernel without a loop: every instruction
        texts = [m.group(2) for m in map(_INSTR.match, sass.splitlines()) if m]
        ops = collections.Counter(map(_opcode, texts))
        print(f"no loop: {len(texts)} instructions")
    print(", ".join(f"{op} {c}" for op, c in ops.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
