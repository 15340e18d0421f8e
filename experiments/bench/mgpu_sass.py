"""The SASS of the tensor-core (Mosaic GPU) kernels, as the GPU's compiler makes it, and what
their main loop is made of (GPU only).

Compiles each kernel once with Mosaic GPU's dump switches on (``MOSAIC_GPU_DUMP_SASS``,
``MOSAIC_GPU_DUMP_PTXAS``, written to a scratch folder), then prints per kernel: registers and
shared memory (ptxas's report), the instructions of its longest loop (the one whose backward
branch spans the most instructions: the step loop), and that loop's opcodes by count. The
loop's SASS goes to ``$OUT/<case>.sass`` (one file per case).

    PYTHONPATH=. python3 experiments/bench/mgpu_sass.py attention \\
        '[{}, {"auto_barriers": false, "num_splits": 4, "p_parts": 1}]'
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import sys
import tempfile

_DUMP = tempfile.mkdtemp(prefix="mosaic_dump_")
os.environ.update(
    MOSAIC_GPU_DUMP_TO=_DUMP,
    MOSAIC_GPU_DUMP_SASS="1",
    MOSAIC_GPU_DUMP_PTXAS="1",
    MOSAIC_GPU_DUMP_PTX="1",
)

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def instructions(text: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every SASS instruction in a dump."""
    return [(int(a, 16), ins.strip()) for a, ins in _INSTR.findall(text)]


def opcode(ins: str) -> str:
    """The opcode of a SASS instruction, its predicate dropped, modifiers kept only for
    the family (``LDS.128`` -> ``LDS``)."""
    words = ins.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def longest_loop(instrs: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The instructions between the target of the backward branch spanning the most
    instructions and that branch (inclusive); [] when there is none."""
    addr = [a for a, _ in instrs]
    best = []
    for i, (a, ins) in enumerate(instrs):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", ins)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= a or target not in addr:
            continue
        body = instrs[addr.index(target) : i + 1]
        if len(body) > len(best):
            best = body
    return best


def summarize(case: str, out_dir: str) -> None:
    """Print the loop summary of every SASS file dumped so far, then empty the dump folder."""
    files = sorted(glob.glob(os.path.join(_DUMP, "**", "*"), recursive=True))
    for path in files:
        if not os.path.isfile(path):
            continue
        with open(path, errors="replace") as f:
            text = f.read()
        name = os.path.basename(path)
        if name.endswith(".ptx"):  # for ptxas and a disassembler elsewhere
            with open(os.path.join(out_dir, f"{case}.ptx"), "w") as f:
                f.write(text)
        if "ptxas" in name or ("Used" in text[:20000] and "registers" in text[:20000]):
            for ln in text.splitlines():
                if "Used" in ln or "spill" in ln or "smem" in ln:
                    print(f"  [{name}] {ln.strip()}")
        ins = instructions(text)
        if len(ins) < 50:
            continue
        loop = longest_loop(ins)
        hist = collections.Counter(opcode(i) for _, i in loop)
        print(f"{case}: {name}: {len(ins)} instructions, longest loop {len(loop)}")
        print("  " + ", ".join(f"{k} {v}" for k, v in hist.most_common(40)))
        with open(os.path.join(out_dir, f"{case}.sass"), "w") as f:
            f.write("\n".join(f"/*{a:04x}*/ {i}" for a, i in loop) + "\n")
    for path in files:
        if os.path.isfile(path):
            os.remove(path)


def attention(specs: list[dict], out_dir: str) -> None:
    import dataclasses

    import jax

    from experiments.bench import fp4_attention as bench
    from pallas_kernels import fp4_decode_attention_mgpu as fm

    for fmt in ("nvfp4", "mxfp4"):
        q, k, v, n = bench.make_case(32, 8192, fmt, 1, seed=1)[0]
        summarize("setup", out_dir)  # the quantizer's kernels, if any
        for j, spec in enumerate(specs):
            cfg = dataclasses.replace(fm.default_config(32, 8192, k.shape[2]), **spec)
            jax.block_until_ready(fm.decode_attention_mgpu(q, k, v, n, config=cfg))
            print(f"== attention {fmt} {spec}")
            summarize(f"attention_{fmt}_{j}", out_dir)


def main() -> int:
    out_dir = os.environ.get("OUT", ".")
    kind = sys.argv[1] if len(sys.argv) > 1 else "attention"
    specs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else [{}]
    if kind != "attention":
        raise SystemExit(f"mgpu_sass.py: unknown kernel {kind!r} (attention)")
    attention(specs, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
