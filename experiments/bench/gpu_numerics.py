"""Where XLA on the GPU computes the FP4 core's float steps differently from the CPU.

Each step of NVFP4 quantization (XLA's own float32 division and the FP4 core's ``exact_div``,
the float32 -> E4M3 conversion, the global and block scales, the codes) is run jitted on the GPU
and on the CPU over the same inputs; prints the count of differing results and a few examples
per step (every row but the raw ``a / b`` should read 0).
Usage (GPU machine): ``PYTHONPATH=. python3 experiments/bench/gpu_numerics.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import fp4
from trace_jax.fp4.formats import get_format
from trace_jax.fp4.quantize import e4m3_to_float32, exact_div, normalise


def on_both(fn, *args):
    """(GPU result, CPU result) of ``jax.jit(fn)(*args)`` as numpy arrays."""
    gpu = jax.jit(fn)(*args)
    cpu_dev = jax.devices("cpu")[0]
    with jax.default_device(cpu_dev):
        cpu = jax.jit(fn)(*[jax.device_put(a, cpu_dev) for a in args])
    return jax.tree.map(np.asarray, gpu), jax.tree.map(np.asarray, cpu)


def report(name, gpu, cpu, *inputs):
    gb = gpu.view(np.uint8 if gpu.dtype.itemsize == 1 else np.uint32)
    cb = cpu.view(np.uint8 if cpu.dtype.itemsize == 1 else np.uint32)
    bad = np.flatnonzero(gb.reshape(-1) != cb.reshape(-1))
    print(f"{name:36s} {bad.size:7d} of {gb.size} differ", flush=True)
    for i in bad[:4]:
        ins = ", ".join(f"{np.asarray(x).reshape(-1)[i]!r}" for x in inputs)
        print(f"    in ({ins}): gpu {gpu.reshape(-1)[i]!r} cpu {cpu.reshape(-1)[i]!r}", flush=True)


def main():
    rng = np.random.default_rng(0)
    n = 1 << 20
    a = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(np.float32)
    b = (np.abs(rng.standard_normal(n)) * np.exp2(rng.integers(-20, 20, n))).astype(np.float32)
    report("a / b", *on_both(lambda a, b: a / b, a, b), a, b)
    report("exact_div(a, b)", *on_both(exact_div, a, b), a, b)
    report("exact_div(1, b)", *on_both(lambda b: exact_div(1.0, b), b), b)
    s = np.exp2(rng.uniform(-6, np.log2(448), n)).astype(np.float32)
    report("f32 -> e4m3", *on_both(lambda s: s.astype(jnp.float8_e4m3fn), s), s)
    x = (rng.standard_normal((64, 1024)) * 3).astype(np.float32)
    for mode in ("tensor", "row"):
        g, c = on_both(lambda x, m=mode: fp4.quantize(x, "nvfp4", axis=-1, global_scale=m), x)
        report(f"nvfp4 {mode} global scale", g.global_scale, c.global_scale)
        report(f"nvfp4 {mode} block scales", g.block_scales, c.block_scales)
        report(f"nvfp4 {mode} codes", g.codes, c.codes)
        blocks, bs, sg = x.reshape(64, 64, 16), c.block_scales, c.global_scale
        z = lambda x, bs, sg: normalise(x, e4m3_to_float32(bs), sg, get_format("nvfp4"))  # noqa: E731
        report(f"nvfp4 {mode} normalised (CPU scales)", *on_both(z, blocks, bs, sg))


if __name__ == "__main__":
    main()
