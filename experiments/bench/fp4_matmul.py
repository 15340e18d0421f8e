"""Check and time the FP4 matmul kernels against the best BF16 path on the same GPU, in one run.

    PYTHONPATH=. python3 experiments/bench/fp4_matmul.py            # the performance table
    PYTHONPATH=. python3 experiments/bench/fp4_matmul.py --parts grouped  # some of its parts
    PYTHONPATH=. python3 experiments/bench/fp4_matmul.py --sweep    # tiling sweep, dense M=16
    PYTHONPATH=. python3 experiments/bench/fp4_matmul.py --gemv     # M=1: one-token kernel sweep
    PYTHONPATH=. python3 experiments/bench/fp4_matmul.py --gemv --quick  # same, three tilings
    PYTHONPATH=. python3 experiments/bench/fp4_matmul.py --mgpu     # tensor-core kernel, M<=64
    PYTHONPATH=. python3 experiments/bench/fp4_matmul.py --mgpu --quick  # defaults only
    PYTHONPATH=. python3 experiments/bench/fp4_matmul.py --grouped-mgpu  # MoE: both kernels
    PYTHONPATH=. python3 experiments/bench/fp4_matmul.py --bounds --ms 1,16  # what bounds it
    PYTHONPATH=. python3 experiments/bench/fp4_matmul.py --w4a4 --ms 1,16,64  # W4A4 vs W4A16
    PYTHONPATH=. python3 experiments/bench/fp4_matmul.py --smoke    # tiny shapes, CPU interpret

Method (shared/BENCHMARKING.md): every kernel is first compared with its pure-JAX reference on
fresh random inputs (NaN fails); times are medians of repeated back-to-back runs of one jitted
program that calls the op on ``SETS`` distinct weight copies (so no call is served from L2),
after a warm-up; the table prints each FP4 time against the best BF16 path measured in the same
process: XLA's matmul with the weight as [K, N] or as [N, K], and the BF16 variant of the kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dequant, layouts
from pallas_kernels import fp4_activation as fact
from pallas_kernels import fp4_grouped_matmul as gm
from pallas_kernels import fp4_grouped_matmul_triton as gt
from pallas_kernels import fp4_matmul as fm
from pallas_kernels import fp4_matmul_gemv as fmv
from pallas_kernels import fp4_matmul_mgpu as fmm
from pallas_kernels import fp4_matmul_triton as ft
from trace_jax import fp4

# Datasheet HBM bandwidth (bytes/s) by device kind; a kind not listed counts as the H200's.
HBM_PEAK = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12}


def hbm_peak(device_kind: str) -> float:
    """The datasheet HBM bandwidth of the GPU named ``device_kind`` (e.g. "NVIDIA H200")."""
    return next((v for name, v in HBM_PEAK.items() if name in device_kind), HBM_PEAK["H200"])


# the fractions of HBM bandwidth the benches print are of the GPU that runs them
HBM_BYTES_PER_S = hbm_peak(jax.devices()[0].device_kind)
HBM_LABEL = f"of {HBM_BYTES_PER_S / 1e12:.2f} TB/s"
SETS = 4  # distinct weight copies per timed program (each > L2 or rotated past it)
CALLS = 8  # op calls per timed program
DENSE_SHAPES = ((8192, 28672), (4096, 14336))  # (K, N)
TABLE_PARTS = ("dense", "w4a4", "grouped")
REL_TOL = 8e-3  # bf16 output rounding is ~2e-3 relative per element


# ----------------------------------------------------------------------------- timing


def time_op(fn, arg_sets, reps: int = 5, min_s: float = 0.03, warm_s: float = 0.1) -> float:
    """Median seconds per call of ``fn(*args)`` over back-to-back runs of a batched program,
    after ``warm_s`` of untimed runs (the first timing after a program switch was seen 1.3-3x
    slow without them; they make it rarer, not gone)."""
    calls = [arg_sets[i % len(arg_sets)] for i in range(CALLS)]
    prog = jax.jit(lambda cs: [fn(*a) for a in cs])
    jax.block_until_ready(prog(calls))
    t0 = time.perf_counter()
    jax.block_until_ready(prog(calls))
    once = max(time.perf_counter() - t0, 1e-6)
    iters = max(1, int(min_s / once))
    out = None
    for _ in range(int(warm_s / once)):
        out = prog(calls)
    jax.block_until_ready(out)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = prog(calls)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / (iters * CALLS))
    return statistics.median(samples)


def rel_error(y, ref) -> float:
    y = np.asarray(y, np.float32)
    ref = np.asarray(ref, np.float32)
    if not np.all(np.isfinite(y)):
        return float("nan")
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def check(name, y, ref, log):
    err = rel_error(y, ref)
    ok = bool(err <= REL_TOL)  # NaN compares False
    log.append(dict(check=name, rel_err=err, ok=ok))
    if not ok:
        print(f"CHECK FAILED {name}: rel err {err}", flush=True)
    return ok


# ----------------------------------------------------------------------------- data


@dataclasses.dataclass
class DenseCase:
    k: int
    n: int
    fmt: str
    w_bf16: list  # [K, N] bf16 per set
    wt_bf16: list  # [N, K] bf16 per set
    packed: list  # Fp4Weight per set


def make_dense(k, n, fmt, sets, seed=0):
    w_bf16, wt_bf16, packed = [], [], []
    for s in range(sets):
        w = jax.random.normal(jax.random.key(seed * 100 + s), (k, n), jnp.float32) * 0.02
        qt = fp4.quantize(w, fmt, axis=0)
        packed.append(jax.block_until_ready(layouts.prepack(qt)))
        wb = w.astype(jnp.bfloat16)
        w_bf16.append(wb)
        wt_bf16.append(jnp.asarray(wb.T, copy=True))
        del w
    return DenseCase(k, n, fmt, w_bf16, wt_bf16, packed)


def make_x(m, k, seed):
    return jax.random.normal(jax.random.key(seed), (m, k), jnp.float32).astype(jnp.bfloat16)


def fp4_bytes(m, k, n, fmt, w4a4=False):
    spec = fp4.get_format(fmt)
    w = n * k // 2 + n * k // spec.block_size + 4 * n
    x = m * k // 2 + m * k // 16 + 4 * m if w4a4 else 2 * m * k
    return w + x + 2 * m * n


def bf16_bytes(m, k, n):
    return 2 * (n * k + m * k + m * n)


# ----------------------------------------------------------------------------- dense


def xla_bf16(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def xla_bf16_t(x, wt):
    return jax.lax.dot_general(
        x, wt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    ).astype(jnp.bfloat16)


def xla_bf16_best(case: DenseCase, xs) -> float:
    """Seconds per call of XLA's BF16 matmul, the faster of the two weight layouts."""
    return min(
        time_op(xla_bf16, list(zip(xs, case.w_bf16, strict=True))),
        time_op(xla_bf16_t, list(zip(xs, case.wt_bf16, strict=True))),
    )


def bf16_kernel_config(m):
    bm = max(16, min(64, 1 << max(0, (m - 1).bit_length())))
    return ft.Fp4MatmulConfig(block_n=128, block_k=128, block_m=bm, num_warps=4, num_stages=4)


def best_bf16(case: DenseCase, m, log, seed):
    xs = [make_x(m, case.k, seed + i) for i in range(SETS)]
    t_xla = time_op(xla_bf16, list(zip(xs, case.w_bf16, strict=True)))
    t_xla_t = time_op(xla_bf16_t, list(zip(xs, case.wt_bf16, strict=True)))
    t_ker = float("inf")
    cfg = bf16_kernel_config(m)
    try:
        kern = lambda x, wt: ft.bf16_matmul(x, wt, config=cfg)  # noqa: E731
        if check(
            f"bf16 kernel m={m} k={case.k}",
            kern(xs[0], case.wt_bf16[0]),
            xla_bf16(xs[0], case.w_bf16[0]),
            log,
        ):
            t_ker = time_op(kern, list(zip(xs, case.wt_bf16, strict=True)))
    except Exception as e:  # a lowering failure is reported, not fatal
        print(f"bf16 kernel m={m}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    best = min(t_xla, t_xla_t, t_ker)
    log.append(
        dict(
            bf16=True,
            m=m,
            k=case.k,
            n=case.n,
            xla_kn=t_xla,
            xla_nk=t_xla_t,
            kernel=t_ker,
            best=best,
        )
    )
    return best, dict(xla_kn=t_xla, xla_nk=t_xla_t, kernel=t_ker)


def _bytes_only(c, s, offset, fmt):
    """Diagnostic tile decode: nibbles converted without scales (wrong values, never checked)."""
    del s, offset, fmt
    return (c & 15).astype(jnp.bfloat16), (c >> 4).astype(jnp.bfloat16)


dequant.DEQUANT_TILE["bytes_only"] = _bytes_only


def run_fp4(case: DenseCase, m, log, seed, config=None, w4a4=False, label="", linear=False):
    """Check then time one FP4 kernel configuration; returns seconds or NaN on failure.
    ``linear``: through ``fp4_linear``, the dispatcher (its default route for M; W4A4 when
    ``w4a4``) instead of the kernel's entry point.

    The diagnostic "bytes_only" decode is timed without the check (its values are wrong).
    """
    xs = [make_x(m, case.k, seed + i) for i in range(SETS)]
    if w4a4 == "xla":  # the activation quantized and decoded by XLA, then the same matmul
        fn = lambda x, w: fm.fp4_matmul_w4a4(fact.quantize_activation(x), w, config=config)  # noqa: E731
        ref = fm.fp4_matmul_w4a4_reference(xs[0], case.packed[0])
    elif w4a4:
        mode = w4a4 if isinstance(w4a4, str) else "before"
        fn = lambda x, w: fm.fp4_matmul_w4a4(  # noqa: E731
            x, w, config=config, activation_dequant=mode
        )
        ref = fm.fp4_matmul_w4a4_reference(xs[0], case.packed[0])
    else:
        fn = lambda x, w: fm.fp4_matmul(x, w, config=config)  # noqa: E731
        ref = fm.fp4_matmul_reference(xs[0], case.packed[0])
    if linear:
        fn = lambda x, w: fm.fp4_linear(x, w, w4a4=bool(w4a4))  # noqa: E731
    try:
        y = fn(xs[0], case.packed[0])
        if (
            getattr(config, "dequant", None) == "bytes_only"
            or getattr(config, "decode", None) == "none"
        ):
            return time_op(fn, list(zip(xs, case.packed, strict=True)))
        if not check(f"{label} fp4 {case.fmt} m={m} k={case.k} n={case.n}", y, ref, log):
            return float("nan")
        return time_op(fn, list(zip(xs, case.packed, strict=True)))
    except Exception as e:
        print(
            f"{label} {case.fmt} m={m} cfg={config}: {type(e).__name__}: {str(e)[:400]}", flush=True
        )
        return float("nan")


# Large tiles of the Triton kernel for M >= 256 (block_m, block_n, block_k, num_warps): the
# default's 64 x 64 tiles read x once per 64 columns of W and W once per 64 rows of x.
LARGE_M_TILES = (
    (128, 128, 64, 8),
    (256, 128, 64, 8),
    (128, 256, 64, 8),
)


def large_m_paths(case: DenseCase, log, ms, tiles=()):
    """The two candidates the dispatcher chooses between at large M, each with its BF16 time,
    and the kernel at each of ``tiles`` (``LARGE_M_TILES`` entries)."""
    rows = []
    for m in ms:
        tb = t_bf16_cache.get((case.k, m)) or best_bf16(case, m, log, seed=5)[0]
        xs = [make_x(m, case.k, 60 + i) for i in range(SETS)]
        ref = fm.fp4_matmul_reference(xs[0], case.packed[0])
        cands = [
            ("kernel", lambda x, w: fm.fp4_matmul(x, w)),
            ("dequantize + XLA", lambda x, w: fm.xla_linear(x, w)),
        ]
        for bm, bn, bk, warps in tiles:
            cfg = ft.Fp4MatmulConfig(
                block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=3
            )
            cands.append(
                (
                    f"kernel {bm}x{bn}x{bk} w{warps}",
                    lambda x, w, c=cfg: fm.fp4_matmul(x, w, config=c),
                )
            )
        for name, fn in cands:
            try:
                ok = check(f"{name} {case.fmt} m={m}", fn(xs[0], case.packed[0]), ref, log)
                t = time_op(fn, list(zip(xs, case.packed, strict=True))) if ok else float("nan")
            except Exception as e:  # a tiling that does not compile (shared memory, registers)
                print(f"{name} m={m}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                t = float("nan")
            rows.append(
                (
                    f"dense {case.fmt} {name}",
                    case.k,
                    case.n,
                    m,
                    t,
                    tb,
                    fp4_bytes(m, case.k, case.n, case.fmt),
                )
            )
    return rows


def run_dispatch(case: DenseCase, m, log, seed):
    xs = [make_x(m, case.k, seed + i) for i in range(SETS)]
    fn = lambda x, w: fm.fp4_linear(x, w)  # noqa: E731
    if not check(
        f"dispatch {case.fmt} m={m}",
        fn(xs[0], case.packed[0]),
        fm.fp4_matmul_reference(xs[0], case.packed[0]),
        log,
    ):
        return float("nan")
    return time_op(fn, list(zip(xs, case.packed, strict=True)))


# ----------------------------------------------------------------------------- modes


def _sweep_variants(case, m, base, variants, t_bf16, log, rows, w4a4=False):
    """Time ``base`` with each override in ``variants``; returns (best seconds, best config)."""
    best = (float("inf"), base)
    for v in variants:
        try:
            cfg = dataclasses.replace(base, **v)
        except ValueError as e:
            print(f"  skip {v}: {e}", flush=True)
            continue
        t = run_fp4(case, m, log, seed=11, config=cfg, w4a4=w4a4, label="sweep")
        frac = fp4_bytes(m, case.k, case.n, case.fmt, w4a4) / t / HBM_BYTES_PER_S
        desc = {
            f.name: getattr(cfg, f.name)
            for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(ft.Fp4MatmulConfig(), f.name)
        }
        rows.append(
            (
                case.fmt + (" w4a4" if w4a4 else ""),
                case.k,
                case.n,
                m,
                json.dumps(desc),
                t,
                t_bf16,
                frac,
            )
        )
        print(
            f"  {case.fmt}{' w4a4' if w4a4 else ''} k={case.k} m={m} {json.dumps(desc):90s} "
            f"{t * 1e6:8.1f} us x{t_bf16 / t:5.2f} {100 * frac:5.1f}% HBM",
            flush=True,
        )
        if t == t and cfg.dequant != "bytes_only" and t < best[0]:
            best = (t, cfg)
    return best


def sweep(log):
    """Tiling search: stage 1 at K=8192 N=28672 M=16, then around the best, then other shapes."""
    rows = []
    case = make_dense(8192, 28672, "nvfp4", SETS)
    bf = {m: best_bf16(case, m, log, seed=7) for m in (1, 16, 64, 256)}
    for m, (_, parts) in bf.items():
        print(
            f"[bf16] k=8192 m={m} " + " ".join(f"{a}={b * 1e6:.1f}" for a, b in parts.items()),
            flush=True,
        )
    base = ft.Fp4MatmulConfig(block_n=128, block_k=256, block_m=16)
    stage1 = [
        dict(dequant="bytes_only", x_layout="split"),
        dict(dequant="bytes_only", x_layout="strided"),
        dict(x_layout="split"),
        dict(x_layout="split", dequant="portable"),
        dict(x_layout="split", block_n=64),
        dict(x_layout="split", block_k=512),
        dict(x_layout="split", block_k=128),
        dict(x_layout="split", split_k=2),
        dict(x_layout="split", num_warps=8),
    ]
    t1, best = _sweep_variants(case, 16, base, stage1, bf[16][0], log, rows)
    stage2 = [
        dict(num_stages=2),
        dict(num_stages=3),
        dict(num_stages=5),
        dict(num_stages=6),
        dict(block_n=64, block_k=512),
        dict(block_n=256, num_warps=8),
        dict(block_n=64, num_warps=2),
        dict(split_k=4),
        dict(block_n=64, split_k=2),
        dict(block_k=512, num_warps=8, num_stages=3),
        dict(block_k=1024, num_warps=8, num_stages=2),
    ]
    t2, best2 = _sweep_variants(case, 16, best, stage2, bf[16][0], log, rows)
    best = best2 if t2 < t1 else best
    print(f"BEST m=16: {best}", flush=True)
    _sweep_variants(case, 1, best, [{}, dict(split_k=2), dict(block_n=64)], bf[1][0], log, rows)
    b64 = dataclasses.replace(best, block_m=64)
    _sweep_variants(
        case,
        64,
        b64,
        [
            {},
            dict(num_warps=8),
            dict(block_n=64),
            dict(block_k=128),
            dict(block_k=128, num_warps=8),
            dict(num_stages=3),
        ],
        bf[64][0],
        log,
        rows,
    )
    _sweep_variants(
        case,
        256,
        b64,
        [
            dict(block_m=128, num_warps=8),
            dict(block_m=64),
            dict(block_m=128, block_n=64, num_warps=8),
            dict(block_m=256, block_n=64, num_warps=8),
        ],
        bf[256][0],
        log,
        rows,
    )
    xs = [make_x(256, case.k, 3 + i) for i in range(SETS)]
    t_xla = time_op(lambda x, w: fm.xla_linear(x, w), list(zip(xs, case.packed, strict=True)))
    rows.append(
        (
            "nvfp4 xla fallback",
            case.k,
            case.n,
            256,
            "{}",
            t_xla,
            bf[256][0],
            fp4_bytes(256, case.k, case.n, "nvfp4") / t_xla / HBM_BYTES_PER_S,
        )
    )
    for m in (16, 64):
        cfg = best if m == 16 else b64
        _sweep_variants(case, m, cfg, [{}], bf[m][0], log, rows, w4a4=True)
    del case
    mx = make_dense(8192, 28672, "mxfp4", SETS, seed=3)
    _sweep_variants(mx, 16, best, [{}, dict(dequant="portable")], bf[16][0], log, rows)
    del mx
    small = make_dense(4096, 14336, "nvfp4", SETS, seed=4)
    for m in (1, 16, 64):
        tb, parts = best_bf16(small, m, log, seed=7)
        print(
            f"[bf16] k=4096 m={m} " + " ".join(f"{a}={b * 1e6:.1f}" for a, b in parts.items()),
            flush=True,
        )
        cfg = best if m < 64 else b64
        _sweep_variants(
            small,
            m,
            cfg,
            [{}, dict(split_k=2), dict(split_k=4), dict(block_n=64), dict(block_n=64, split_k=2)],
            tb,
            log,
            rows,
        )
    print("\n| format | K | N | M | config (vs defaults) | us | best bf16 us | speedup | HBM |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for f, k, n, m, v, t, tb, frac in rows:
        print(
            f"| {f} | {k} | {n} | {m} | {v} | {t * 1e6:.1f} | {tb * 1e6:.1f} | {tb / t:.2f}x "
            f"| {100 * frac:.0f} % |"
        )


t_bf16_cache: dict = {}  # (K, M) -> best BF16 seconds, shared by both formats


def tune(log):
    """Short tiling search (NVFP4, both dense shapes); returns {(K, M): best config}."""
    base = ft.Fp4MatmulConfig(block_n=64, block_k=128, block_m=16, split_k=2)
    v16 = [
        {},
        dict(num_stages=3),
        dict(num_stages=2),
        dict(split_k=4),
        dict(block_n=32),
        dict(block_n=32, split_k=4),
        dict(block_k=64),
        dict(prefetch=True, num_stages=1),
        dict(prefetch=True, num_stages=1, split_k=4),
        dict(prefetch=True, num_stages=1, block_n=128, num_warps=8),
        dict(block_n=128, num_warps=8),
        dict(block_k=256, num_stages=3),
    ]
    v64 = [
        dict(block_m=64),
        dict(block_m=64, num_stages=3),
        dict(block_m=64, split_k=4),
        dict(block_m=64, prefetch=True, num_stages=1),
        dict(block_m=64, block_n=128, num_warps=8),
    ]
    best = {}
    for k, n in DENSE_SHAPES:
        case = make_dense(k, n, "nvfp4", SETS, seed=1)
        for m, variants in ((16, v16), (64, v64)):
            tb = best_bf16(case, m, log, seed=5)[0]
            t, cfg = _sweep_variants(case, m, base, variants, tb, log, [])
            best[(k, m)] = cfg
            print(f"TUNED k={k} m={m}: {t * 1e6:.1f} us {cfg}", flush=True)
        del case
    best = {**best, **{(k, 1): best[(k, 16)] for k, _ in DENSE_SHAPES}}
    return best


def with_gemv_layout(case: DenseCase, block_k: int, block_n: int) -> DenseCase:
    """The same weights with the one-token layout packed for ``block_k`` and row tile
    ``block_n`` (0: rows in order)."""
    packed = [layouts.with_gemv_layout(p, block_k, block_n) for p in case.packed]
    return dataclasses.replace(case, packed=jax.block_until_ready(packed))


GEMV_VARIANTS = (  # (block_n, block_k, split_k, warps, stages, prefetch, tiled[, decode])
    (32, 256, 1, 4, 1, 1, True, "f16"),
    (32, 256, 1, 4, 1, 1, True),
    (32, 256, 1, 4, 1, 2, True),
    (32, 512, 1, 4, 1, 1, True),
    (32, 256, 2, 4, 1, 1, True),
    (64, 256, 1, 4, 1, 1, True),
    (64, 256, 2, 4, 1, 1, True),
    (64, 512, 2, 4, 1, 1, True),
    (64, 256, 1, 8, 1, 1, True),
    (128, 256, 2, 8, 1, 1, True),
    (16, 256, 1, 2, 1, 1, True),
    (16, 512, 1, 2, 1, 1, True),
    (32, 256, 1, 4, 1, 1, True, "none"),
)


QUICK_GEMV_VARIANTS = (
    (32, 256, 1, 8, 1, 1, True),
    (32, 128, 1, 4, 1, 2, True),
    (16, 256, 2, 2, 1, 1, True),
)


def gemv(log, variants=GEMV_VARIANTS):
    """M = 1: the one-token kernel (``fp4_matmul_gemv``, packed word layout) over a tiling grid
    at both dense shapes (NVFP4), then every dense shape and both formats against the earlier
    GEMV form (``gemv_config``, ``mma=False``), the MMA kernel and the best BF16 path."""
    best = {}
    for k, n in DENSE_SHAPES:
        case = make_dense(k, n, "nvfp4", SETS, seed=1)
        tb = best_bf16(case, 1, log, seed=5)[0]
        t_bf16_cache[(k, 1)] = tb
        best[k] = (float("inf"), None)
        for bn, bk, split, warps, stages, prefetch, tiled, *decode in variants:
            cc = with_gemv_layout(case, bk, bn if tiled else 0)
            cfg = fmv.Fp4GemvConfig(
                block_n=bn,
                block_k=bk,
                split_k=split,
                num_warps=warps,
                num_stages=stages,
                prefetch=prefetch,
                decode=decode[0] if decode else "asm",
            )
            t = run_fp4(cc, 1, log, seed=11, config=cfg, label="gemv sweep")
            del cc
            frac = fp4_bytes(1, k, n, "nvfp4") / t / HBM_BYTES_PER_S
            log.append(
                dict(gemv_sweep=dataclasses.asdict(cfg), tiled=tiled, k=k, us=t * 1e6, hbm=frac)
            )
            print(
                f"  gemv k={k} tiled={tiled} {cfg}: {t * 1e6:.1f} us x{tb / t:.2f} "
                f"{100 * frac:.0f} % HBM",
                flush=True,
            )
            if t < best[k][0] and cfg.decode != "none":
                best[k] = (t, cfg, tiled)
        print(f"BEST gemv k={k}: {best[k][1:]} {best[k][0] * 1e6:.1f} us", flush=True)
        del case
    rows = []
    for fmt in ("nvfp4", "mxfp4"):
        for k, n in DENSE_SHAPES:
            case = make_dense(k, n, fmt, SETS, seed=1 if fmt == "nvfp4" else 2)
            tb = t_bf16_cache[(k, 1)]
            _, best_cfg, best_tiled = best[k]
            for name, c in (
                ("GEMV form (mma=False)", ft.gemv_config(k, n)),
                ("one-token kernel, sweep best", best_cfg),
                ("fp4_matmul default (dispatch)", None),
            ):
                cc = case
                if c is best_cfg:
                    cc = with_gemv_layout(case, c.block_k, c.block_n if best_tiled else 0)
                t = run_fp4(cc, 1, log, seed=9, config=c, label="gemv")
                del cc
                rows.append((f"dense {fmt} M=1 {name}", k, n, 1, t, tb, fp4_bytes(1, k, n, fmt)))
            del case
    print_table(rows)
    return rows


def table(log, parts=TABLE_PARTS, shapes=DENSE_SHAPES):
    """The performance table of the kernels' targets, every row through the default route a
    user gets (each FP4 row checked against its reference first):

    * "dense": ``fp4_linear`` (the dispatcher) on a ``prepack``ed NVFP4 and MXFP4 weight, M = 1,
      16, 64, 256, against the best BF16 path (XLA in both weight layouts, the BF16 variant of
      the kernel); after each shape a "bound" row: XLA's read of the FP4 weight bytes the
      route streams against its read of the BF16 weight (the ratio a kernel streaming both at
      XLA's efficiency would reach);
    * "w4a4": ``fp4_linear(w4a4=True)`` (NVFP4, M <= 64), with the W4A16 time of the same run;
    * "grouped": ``fp4_grouped_linear`` on ``prepack_grouped`` experts (E=128, top-8; 16, 64
      and 256 tokens) against XLA's ``ragged_dot`` and JAX's Mosaic GPU ``ragged_dot`` on the
      BF16 weights.
    """
    rows = []

    def add(row):  # printed as measured, so a run cut short keeps its rows
        rows.append(row)
        print("  row", table_line(row), flush=True)

    fmts = ("nvfp4", "mxfp4") if "dense" in parts else ("nvfp4",) if "w4a4" in parts else ()
    for fmt in fmts:
        for k, n in shapes:
            case = make_dense(k, n, fmt, SETS, seed=1 if fmt == "nvfp4" else 2)
            for m in (1, 16, 64, 256) if "dense" in parts else (1, 16, 64):
                if (k, m) not in t_bf16_cache:  # one BF16 measurement per shape, both formats
                    t_bf16_cache[(k, m)] = best_bf16(case, m, log, seed=5)[0]
                tb = t_bf16_cache[(k, m)]
                # Each route timed twice, W4A16 and W4A4 alternately, the faster kept: one
                # timing can be slowed by a transient (seen: the first after the BF16
                # baseline at a shape, 1.3-3x); every timing goes to the log.
                routes = [False] if "dense" in parts else []
                if fmt == "nvfp4" and "w4a4" in parts and m <= 64:
                    routes.append(True)
                times = {w4: [] for w4 in routes}
                for _ in range(2):
                    for w4 in routes:
                        t = run_fp4(case, m, log, seed=9, w4a4=w4, label="table", linear=True)
                        times[w4].append(t)
                        log.append(dict(table=fmt, k=k, n=n, m=m, w4a4=w4, us=t * 1e6))
                best = {w4: min(ts) for w4, ts in times.items()}
                if False in best:
                    add((f"dense W4A16 {fmt}", k, n, m, best[False], tb, fp4_bytes(m, k, n, fmt)))
                if True in best:
                    vs = (
                        f" ({100 * (best[True] / best[False] - 1):+.0f} % vs W4A16)"
                        if False in best
                        else ""
                    )
                    add((f"dense W4A4 nvfp4{vs}", k, n, m, best[True], tb,
                         fp4_bytes(m, k, n, fmt, w4a4=True)))  # fmt: skip
            if "dense" in parts:  # the measured bound of the rows above
                t_read, wbytes = xla_read(case.packed)
                name = f"bound: XLA's read of the {fmt} weight bytes (bf16 column: of the bf16 one)"
                add((name, k, n, "-", t_read, xla_read_bf16(case.w_bf16), wbytes))
            del case
    if "grouped" in parts:
        rows += grouped_rows(log, linear=True)
    print_table(rows)
    return rows


GROUPED_SHAPES = ((2048, 1536), (768, 2048))  # (K, N): gate/up and down
EXPERTS, TOP_K = 128, 8


def route(tokens, seed):
    """Group sizes of ``tokens`` tokens each sent to TOP_K distinct experts uniformly."""
    rng = np.random.default_rng(seed)
    picks = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)])
    return jnp.asarray(np.bincount(picks.ravel(), minlength=EXPERTS), jnp.int32)


# JAX's BF16 Mosaic GPU ragged_dot (block_m, block_n, block_k, max_concurrent_steps,
# grid_block_n): a baseline of the grouped rows
JAX_RAGGED_CONFIGS = ((64, 128, 64, 4, 1), (64, 128, 128, 4, 1))


def jax_ragged_dot_mgpu(xs, wb, gss, log, label):
    """Seconds per call of JAX's own BF16 grouped matmul (``ragged_dot_mgpu``, Hopper), the
    fastest of ``JAX_RAGGED_CONFIGS`` that passes its check against XLA's; inf if none runs."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    ref = jax.lax.ragged_dot(xs[0], wb[0], gss[0], preferred_element_type=jnp.float32)
    best = float("inf")
    for bm, bn, bk, steps, gbn in JAX_RAGGED_CONFIGS:
        fn = jax.jit(
            lambda x, w, g, bm=bm, bn=bn, bk=bk, steps=steps, gbn=gbn: ragged_dot_mgpu.ragged_dot(
                x, w, group_sizes=g, block_m=bm, block_n=bn, block_k=bk,
                max_concurrent_steps=steps, grid_block_n=gbn,
            )
        )  # fmt: skip
        try:
            if check(f"jax ragged_dot_mgpu {label} {bm},{bn},{bk}", fn(xs[0], wb[0], gss[0]),
                     ref, log):  # fmt: skip
                best = min(best, time_op(fn, list(zip(xs, wb, gss, strict=True))))
        except Exception as e:  # a config that does not fit or lower is reported, not fatal
            print(f"jax ragged_dot_mgpu {bm},{bn},{bk}: {type(e).__name__}: {str(e)[:300]}")
    return best


def grouped_rows(log, configs=(None,), mgpu_configs=(), linear=False):
    """Grouped rows: this module's Triton kernel at ``configs`` and the tensor-core kernel
    (``fp4_grouped_matmul_mgpu``) at ``mgpu_configs`` (None: its default) against XLA's
    ``ragged_dot`` on BF16 weights; with ``linear``, instead the dispatcher
    (``fp4_grouped_linear``, tensor-core layout prepacked) against the faster of XLA's
    ``ragged_dot`` and JAX's Mosaic GPU one."""
    if linear:
        configs, mgpu_configs = (), ("linear",)
    rows = []
    for k, n in GROUPED_SHAPES:
        packed, wb = [], []
        for s in range(SETS):
            w = jax.random.normal(jax.random.key(50 + s), (EXPERTS, k, n), jnp.float32) * 0.02
            packed.append(
                jax.block_until_ready(
                    layouts.prepack_grouped(
                        fp4.quantize(w, "nvfp4", axis=1), mgpu=bool(mgpu_configs)
                    )
                )
            )
            wb.append(w.astype(jnp.bfloat16))
            del w
        for tokens in (16, 64, 256):
            t_rows = tokens * TOP_K
            gss = [route(tokens, 7 * tokens + i) for i in range(SETS)]
            xs = [make_x(t_rows, k, 90 + i) for i in range(SETS)]
            ragged = lambda x, w, g: jax.lax.ragged_dot(  # noqa: E731
                x, w, g, preferred_element_type=jnp.float32
            ).astype(jnp.bfloat16)
            t_bf16 = time_op(ragged, list(zip(xs, wb, gss, strict=True)))
            if linear:
                t_jax = jax_ragged_dot_mgpu(xs, wb, gss, log, f"k={k} tokens={tokens}")
                print(f"  bf16 k={k} tokens={tokens}: XLA ragged_dot {t_bf16 * 1e6:.1f} us, "
                      f"JAX ragged_dot_mgpu {t_jax * 1e6:.1f} us", flush=True)  # fmt: skip
                t_bf16 = min(t_bf16, t_jax)
            active = int(np.count_nonzero(np.asarray(gss[0])))
            nbytes = active * (n * k // 2 + n * k // 16 + 4 * n) + 2 * t_rows * (k + n)
            cands = [(c, False) for c in configs] + [(c, True) for c in mgpu_configs]
            for cfg, use_mgpu in cands:
                if cfg == "linear":
                    fn = gm.fp4_grouped_linear
                elif use_mgpu:
                    fn = lambda x, w, g, c=cfg: fmm.fp4_grouped_matmul_mgpu(x, w.mgpu, g, c)  # noqa: E731
                else:
                    fn = lambda x, w, g, c=cfg: gt.fp4_grouped_matmul_triton(x, w, g, config=c)  # noqa: E731
                try:
                    ok = check(
                        f"grouped k={k} tokens={tokens}",
                        fn(xs[0], packed[0], gss[0]),
                        gm.fp4_grouped_matmul_reference(xs[0], packed[0], gss[0]),
                        log,
                    )
                    t = time_op(fn, list(zip(xs, packed, gss, strict=True))) if ok else np.nan
                except Exception as e:
                    print(f"grouped {cfg}: {type(e).__name__}: {str(e)[:400]}", flush=True)
                    t = float("nan")
                name = f"grouped nvfp4 {tokens} tok ({active} experts hit)"
                name += "" if cfg == "linear" else " mgpu" if use_mgpu else ""
                if cfg not in (None, "linear"):
                    name += " " + json.dumps(
                        {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
                    )
                rows.append((name, k, n, t_rows, t, t_bf16, nbytes))
                print(
                    f"  {name} k={k}: {t * 1e6:.1f} us vs ragged_dot bf16 {t_bf16 * 1e6:.1f}",
                    flush=True,
                )
        del packed, wb
    return rows


MGPU_VARIANTS = (  # (block_k, stages, split_k, warpgroups, decode, split_in); None: default
    None,
    (256, 3, 4, 1, "asm", "grid"),
    (128, 4, 1, 1, "asm", "grid"),
    (128, 3, 1, 2, "asm", "grid"),
    (256, 3, 2, 1, "asm", "warpgroups"),
    (128, 4, 2, 1, "asm", "warpgroups"),
)


def mgpu(
    log, variants=MGPU_VARIANTS, ms=(1, 16, 64), fmt="nvfp4", shapes=DENSE_SHAPES, triton=True
):
    """FP4 on the tensor cores (``fp4_matmul_mgpu``, Mosaic GPU): identity rows bit for bit
    first, then each dense shape and M against ``fp4_matmul``'s default and the best BF16 path
    (and the Triton kernel's default where ``triton``)."""
    qt = fp4.quantize(jax.random.normal(jax.random.key(3), (256, 256)) * 0.05, fmt, axis=0)
    eye = jnp.eye(256, dtype=jnp.bfloat16)
    y = fmm.fp4_matmul_mgpu(eye, layouts.prepack_mgpu(qt), fmm.MgpuMatmulConfig(block_k=128))
    exact = bool(
        np.array_equal(np.asarray(y, np.float32), np.asarray(fp4.dequantize(qt, jnp.bfloat16)))
    )
    log.append(dict(check="mgpu identity rows bit-exact", ok=exact))
    print(f"mgpu identity rows bit-exact: {exact}", flush=True)
    rows = []
    for k, n in shapes:
        case = make_dense(k, n, fmt, SETS, seed=1)
        # prepack made the layout where it is on by default (NVFP4); the dispatch row is then
        # this kernel at its default, so the variants skip it
        mw = [p.mgpu or jax.block_until_ready(layouts.prepack_mgpu(p.qtensor)) for p in case.packed]
        todo = [v for v in variants if v is not None or case.packed[0].mgpu is None]
        for m in ms:
            tb = best_bf16(case, m, log, seed=5)[0]
            routes = [("fp4_matmul (dispatch)", None)]
            if triton:
                routes.append(("Triton kernel, default_config", ft.default_config(m, k, n)))
            for name, c in routes:
                t = run_fp4(case, m, log, seed=9, config=c, label=name)
                print(f"  {name} k={k} m={m}: {t * 1e6:.1f} us, bf16 {tb * 1e6:.1f} us", flush=True)
                rows.append((f"{fmt} {name}", k, n, m, t, tb, fp4_bytes(m, k, n, fmt)))
            xs = [make_x(m, k, 9 + i) for i in range(SETS)]
            ref = fm.fp4_matmul_reference(xs[0], case.packed[0])
            for v in todo:
                cfg = (
                    fmm.default_config(m, k, n)
                    if v is None
                    else fmm.MgpuMatmulConfig(*v[:3], warpgroups=v[3], decode=v[4], split_in=v[5])
                )
                fn = lambda x, w, cfg=cfg: fmm.fp4_matmul_mgpu(x, w, cfg)  # noqa: E731
                try:
                    y = fn(xs[0], mw[0])  # the diagnostic decode's values are wrong: not checked
                    ok = cfg.decode == "none" or check(f"mgpu m={m} k={k} {cfg}", y, ref, log)
                    t = time_op(fn, list(zip(xs, mw, strict=True))) if ok else float("nan")
                except Exception as e:
                    print(f"mgpu m={m} k={k} {cfg}: {type(e).__name__}: {str(e)[:600]}", flush=True)
                    t = float("nan")
                label = "default" if v is None else f"bk={v[0]} st={v[1]} sk={v[2]} wg={v[3]}"
                label += " no decode" if cfg.decode == "none" else ""
                label += " K on warpgroups" if cfg.split_in == "warpgroups" else ""
                print(f"  mgpu k={k} m={m} {label}: {t * 1e6:.1f} us x{tb / t:.2f}", flush=True)
                log.append(dict(mgpu=label, k=k, m=m, us=t * 1e6, bf16_us=tb * 1e6))
                rows.append((f"{fmt} mgpu {label}", k, n, m, t, tb, fp4_bytes(m, k, n, fmt)))
        del case, mw
    print_table(rows)
    return rows


def dispatch(log, ms, fmt="nvfp4", shapes=DENSE_SHAPES):
    """``fp4_matmul`` on a ``prepack``ed weight (its default route per M) against XLA's BF16
    matmul in both weight layouts; each row printed as it is measured."""
    rows = []
    for k, n in shapes:
        case = make_dense(k, n, fmt, SETS, seed=1)
        for m in ms:
            xs = [make_x(m, k, 5 + i) for i in range(SETS)]
            tb = xla_bf16_best(case, xs)
            t = run_fp4(case, m, log, seed=9, label="dispatch")
            print(
                f"  dispatch {fmt} k={k} m={m}: {t * 1e6:.1f} us, XLA bf16 {tb * 1e6:.1f} us",
                flush=True,
            )
            rows.append((f"{fmt} fp4_matmul (dispatch)", k, n, m, t, tb, fp4_bytes(m, k, n, fmt)))
        del case
    return rows


def w4a4_rows(log, ms, shapes):
    """W4A4 against W4A16 at the default routes: the activation quantized by the fused kernel
    (``fp4_activation``, the default) and by XLA (``quantize_activation``, then the same
    matmul); each row printed as measured."""
    rows = []
    for k, n in shapes:
        case = make_dense(k, n, "nvfp4", SETS, seed=1)
        for m in ms:
            xs = [make_x(m, k, 5 + i) for i in range(SETS)]
            tb = xla_bf16_best(case, xs)
            t16 = run_fp4(case, m, log, seed=9, label="w4a16")
            t4 = run_fp4(case, m, log, seed=9, w4a4="before", label="w4a4 fused")
            tx = run_fp4(case, m, log, seed=9, w4a4="xla", label="w4a4 xla")
            print(
                f"  k={k} m={m}: W4A16 {t16 * 1e6:.1f} us, W4A4 fused {t4 * 1e6:.1f} us "
                f"({100 * (t4 / t16 - 1):+.0f} %), W4A4 XLA-quantized {tx * 1e6:.1f} us "
                f"({100 * (tx / t16 - 1):+.0f} %), XLA bf16 {tb * 1e6:.1f} us",
                flush=True,
            )
            for name, t, w4 in (("W4A16", t16, False), ("W4A4 fused", t4, True),
                                ("W4A4 XLA-quantized", tx, True)):  # fmt: skip
                rows.append((f"nvfp4 {name}", k, n, m, t, tb, fp4_bytes(m, k, n, "nvfp4", w4)))
        del case
    return rows


def grouped_bounds(log, token_counts=(16, 64), variants=()):
    """The grouped tensor-core kernel at its default: the whole op (routing plan, padding,
    kernel, masking of unrouted rows in XLA) against the kernel alone (``fmm.grouped_partials``
    on a plan made beforehand) and XLA's ``ragged_dot`` on BF16 weights; HBM % on expert bytes;
    the routing plan alone, in XLA and in its Triton kernel (``grouped_plan``).
    ``variants``: (block_k, stages, block_m, warpgroups, prologue, tiles) tilings
    (``_grouped_variants``) whose whole op is timed too."""
    rows = []
    for k, n in GROUPED_SHAPES:
        packed, wb = [], []
        for s in range(SETS):
            w = jax.random.normal(jax.random.key(50 + s), (EXPERTS, k, n), jnp.float32) * 0.02
            qt = fp4.quantize(w, "nvfp4", axis=1)
            packed.append(jax.block_until_ready(layouts.prepack_grouped(qt, mgpu=True)))
            wb.append(w.astype(jnp.bfloat16))
            del w
        for tokens in token_counts:
            t_rows = tokens * TOP_K
            gss = [route(tokens, 7 * tokens + i) for i in range(SETS)]
            xs = [make_x(t_rows, k, 90 + i) for i in range(SETS)]
            cfg = fmm.default_grouped_config(t_rows, EXPERTS, k)
            plans = [fmm.grouped_plan(g, t_rows, cfg.block_m) for g in gss]
            xps = [fmm.pad_rows_for_windows(x, cfg.block_m) for x in xs]
            ragged = lambda x, w, g: jax.lax.ragged_dot(  # noqa: E731
                x, w, g, preferred_element_type=jnp.float32
            ).astype(jnp.bfloat16)
            whole = lambda x, w, g: fmm.fp4_grouped_matmul_mgpu(x, w.mgpu, g)  # noqa: E731
            ok = check(
                f"grouped bounds k={k} tokens={tokens}",
                whole(xs[0], packed[0], gss[0]),
                gm.fp4_grouped_matmul_reference(xs[0], packed[0], gss[0]),
                log,
            )
            kern = lambda x, w, p, c=cfg, t=t_rows: fmm.grouped_partials(  # noqa: E731
                x, w.mgpu, p.expert, p.first_row, p.valid, c, rows=t
            )
            # the routing plan alone, XLA's and the Triton kernel's, over CALLS distinct
            # routings (no two calls of a timed program alike for XLA to merge)
            routings = [(route(tokens, 500 + i),) for i in range(CALLS)]
            plan = functools.partial(fmm.grouped_plan, rows=t_rows, block_m=cfg.block_m)
            times = dict(
                whole=time_op(whole, list(zip(xs, packed, gss, strict=True))) if ok else np.nan,
                kernel=time_op(kern, list(zip(xps, packed, plans, strict=True))),
                ragged_dot_bf16=time_op(ragged, list(zip(xs, wb, gss, strict=True))),
                plan_xla=time_op(plan, routings),
                plan_kernel=time_op(functools.partial(plan, kernel=True), routings),
            )
            for bk, st, bm, wg, prologue, tiles in variants:
                c = fmm.MgpuMatmulConfig(
                    block_k=bk, stages=st, block_m=bm, warpgroups=wg, prologue=prologue, tiles=tiles
                )
                fn = lambda x, w, g, c=c: fmm.fp4_grouped_matmul_mgpu(x, w.mgpu, g, c)  # noqa: E731
                try:
                    y = fn(xs[0], packed[0], gss[0])
                    ref = gm.fp4_grouped_matmul_reference(xs[0], packed[0], gss[0])
                    ok = check(f"grouped k={k} tokens={tokens} {c}", y, ref, log)
                    t = time_op(fn, list(zip(xs, packed, gss, strict=True))) if ok else np.nan
                except Exception as e:
                    print(f"grouped {c}: {type(e).__name__}: {str(e)[:400]}", flush=True)
                    t = float("nan")
                print(f"  grouped k={k} tokens={tokens} bk={bk} st={st} bm={bm} wg={wg} "
                      f"tiles={tiles} {prologue}: {t * 1e6:.1f} us", flush=True)  # fmt: skip
                log.append(dict(grouped=f"k={k} tokens={tokens}", cfg=str(c), us=t * 1e6))
            active = int(np.count_nonzero(np.asarray(gss[0])))
            wbytes = active * (n * k // 2 + n * k // 16 + 4 * n)
            log.append(dict(grouped_bounds=f"k={k} tokens={tokens}", cfg=str(cfg),
                            **{a: t * 1e6 for a, t in times.items()}))  # fmt: skip
            print(
                f"  grouped k={k} tokens={tokens} ({active} experts) {cfg}: "
                + ", ".join(f"{a} {t * 1e6:.1f} us" for a, t in times.items()),
                flush=True,
            )
            rows.append((k, n, tokens, active, times, wbytes))
        del packed, wb
    print("\n| K | N | tokens | experts hit | whole op (us) | kernel alone | ragged_dot bf16 | "
          "speedup (whole / kernel) | HBM % on expert bytes (whole / kernel) | "
          "plan alone, XLA / kernel (us) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for k, n, tokens, active, t, wb in rows:
        tw, tk, tb = t["whole"], t["kernel"], t["ragged_dot_bf16"]
        print(
            f"| {k} | {n} | {tokens} | {active} | {tw * 1e6:.1f} | {tk * 1e6:.1f} | "
            f"{tb * 1e6:.1f} | {tb / tw:.2f}x / {tb / tk:.2f}x | "
            f"{100 * wb / tw / HBM_BYTES_PER_S:.0f} / {100 * wb / tk / HBM_BYTES_PER_S:.0f} | "
            f"{t['plan_xla'] * 1e6:.1f} / {t['plan_kernel'] * 1e6:.1f} |"
        )
    return rows


def moe_layer(log, token_counts=(16, 64)):
    """A whole MoE expert block as the model runs it: gate/up (K=2048, N=1536) -> SwiGLU ->
    down (K=768, N=2048), both grouped matmuls on the same routing in one jitted program (XLA
    may share the routing plan between them), FP4 through ``fp4_grouped_linear`` against BF16
    ``ragged_dot``; HBM % on the expert bytes of both weights."""
    (k1, n1), (k2, n2) = GROUPED_SHAPES
    rows = []
    ws = []
    for s in range(SETS):
        pair = []
        for k, n, seed in ((k1, n1, 60), (k2, n2, 70)):
            w = jax.random.normal(jax.random.key(seed + s), (EXPERTS, k, n), jnp.float32) * 0.02
            qt = fp4.quantize(w, "nvfp4", axis=1)
            pair += [
                jax.block_until_ready(layouts.prepack_grouped(qt, mgpu=True)),
                w.astype(jnp.bfloat16),
            ]
            del w
        ws.append(pair)

    def swiglu(h):
        g, u = jnp.split(h, 2, axis=-1)
        return (jax.nn.silu(g.astype(jnp.float32)) * u).astype(jnp.bfloat16)

    def fp4_layer(x, g, wgu, wd):
        return gm.fp4_grouped_linear(swiglu(gm.fp4_grouped_linear(x, wgu, g)), wd, g)

    def bf16_layer(x, g, wgu, wd):
        def rd(a, w):
            return jax.lax.ragged_dot(a, w, g, preferred_element_type=jnp.float32)

        return rd(swiglu(rd(x, wgu).astype(jnp.bfloat16)), wd).astype(jnp.bfloat16)

    for tokens in token_counts:
        t_rows = tokens * TOP_K
        gss = [route(tokens, 7 * tokens + i) for i in range(SETS)]
        xs = [make_x(t_rows, k1, 90 + i) for i in range(SETS)]
        fp4_args = [(x, g, w[0], w[2]) for x, g, w in zip(xs, gss, ws, strict=True)]
        bf_args = [(x, g, w[1], w[3]) for x, g, w in zip(xs, gss, ws, strict=True)]
        ref = jax.jit(
            lambda x, g, a, b: bf16_layer(
                x,
                g,
                fp4.dequantize(a.qtensor, jnp.bfloat16),
                fp4.dequantize(b.qtensor, jnp.bfloat16),
            )
        )(*fp4_args[0])
        ok = check(f"moe layer tokens={tokens}", jax.jit(fp4_layer)(*fp4_args[0]), ref, log)
        t = time_op(fp4_layer, fp4_args) if ok else float("nan")
        tb = time_op(bf16_layer, bf_args)
        active = int(np.count_nonzero(np.asarray(gss[0])))
        nbytes = sum(active * (n * k // 2 + n * k // 16 + 4 * n) for k, n in GROUPED_SHAPES)
        log.append(dict(moe_layer=tokens, us=t * 1e6, bf16_us=tb * 1e6))
        print(f"  moe layer {tokens} tok ({active} experts): fp4 {t * 1e6:.1f} us, bf16 "
              f"{tb * 1e6:.1f} us, {tb / t:.2f}x", flush=True)  # fmt: skip
        rows.append(
            (f"MoE layer nvfp4, {tokens} tok ({active} hit)", k1, n1, t_rows, t, tb, nbytes)
        )
    return rows


def _weight_arrays(packed):
    """The code and scale arrays the default route streams from a ``prepack``ed weight."""
    if packed.mgpu is not None:
        return packed.mgpu.words, packed.mgpu.scales
    return packed.codes, packed.scales


def xla_read(packed):
    """(seconds per read, bytes) of XLA summing the weight bytes the default route streams
    (``_weight_arrays`` of each of ``packed``): the best a plain XLA kernel streams them."""
    read = lambda *arrays: sum(jnp.sum(a, dtype=jnp.uint32) for a in arrays)  # noqa: E731
    return (
        time_op(read, [_weight_arrays(p) for p in packed]),
        sum(a.nbytes for a in _weight_arrays(packed[0])),
    )


def xla_read_bf16(ws):
    """Seconds per read of XLA summing the BF16 weights ``ws`` (float32 accumulation)."""
    return time_op(lambda w: jnp.sum(w, dtype=jnp.float32), [(w,) for w in ws])


def bounds(log, ms, shapes):
    """What bounds the tensor-core kernel: at each shape and M, the whole op (``fp4_matmul``:
    padding, kernel, split-K sum, scales, transpose), the kernel alone
    (``fmm.dense_partials``), the kernel without the decode arithmetic (``decode="none"``),
    and XLA reading the same weight bytes (a sum over the code words and scales); each as a
    fraction of the GPU's HBM bandwidth on the weight bytes."""
    rows = []
    for k, n in shapes:
        case = make_dense(k, n, "nvfp4", SETS, seed=1)
        mw = [p.mgpu for p in case.packed]
        t_read, wbytes = xla_read(case.packed)
        for m in ms:
            cfg = fmm.default_config(m, k, n)
            xs = [make_x(m, k, 5 + i) for i in range(SETS)]
            xps = [jnp.pad(x, ((0, -m % 8), (0, 0))) for x in xs]
            ok = check(
                f"bounds m={m} k={k}",
                fm.fp4_matmul(xs[0], case.packed[0]),
                fm.fp4_matmul_reference(xs[0], case.packed[0]),
                log,
            )
            tb = xla_bf16_best(case, xs)
            bare = dataclasses.replace(cfg, decode="none")
            pairs = list(zip(xps, mw, strict=True))
            times = dict(
                whole=time_op(fm.fp4_matmul, list(zip(xs, case.packed, strict=True))),
                kernel=time_op(lambda x, w, c=cfg: fmm.dense_partials(x, w, c), pairs),
                no_decode=time_op(lambda x, w, c=bare: fmm.dense_partials(x, w, c), pairs),
                xla_read=t_read,
            )
            if not ok:
                times["whole"] = float("nan")
            log.append(
                dict(bounds=f"k={k} m={m}", cfg=str(cfg), **{a: t * 1e6 for a, t in times.items()})
            )
            print(
                f"  bounds k={k} m={m} {cfg}: "
                + ", ".join(f"{a} {t * 1e6:.1f} us" for a, t in times.items())
                + f", XLA bf16 {tb * 1e6:.1f} us",
                flush=True,
            )
            rows.append((k, n, m, times, tb, wbytes))
        del case, mw
    print(
        "\n| K | N | M | whole op (us) | kernel alone | kernel, no decode | XLA read of the "
        "weight bytes | XLA bf16 | HBM % on weight bytes (whole / kernel / no decode / read) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for k, n, m, t, tb, wb in rows:
        pct = " / ".join(f"{100 * wb / v / HBM_BYTES_PER_S:.0f}" for v in t.values())
        vals = " | ".join(f"{v * 1e6:.1f}" for v in t.values())
        print(f"| {k} | {n} | {m} | {vals} | {tb * 1e6:.1f} | {pct} |")
    return rows


def table_line(row):
    """One row of the performance table, Markdown."""
    name, k, n, m, t, tb, nbytes = row
    frac = nbytes / t / HBM_BYTES_PER_S if t == t else float("nan")
    return (
        f"| {name} | {k} | {n} | {m} | {t * 1e6:.1f} | {tb * 1e6:.1f} | {tb / t:.2f}x | "
        f"{100 * frac:.0f} % |"
    )


def print_table(rows):
    print(
        f"\n| case | K | N | M | time (us) | best bf16 (us) | speedup | {HBM_LABEL}, bytes moved |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(table_line(row))


def smoke(log):
    """Tiny shapes through the interpreter: exercises the script's plumbing on a CPU."""
    for fmt in ("nvfp4", "mxfp4"):
        w = jax.random.normal(jax.random.key(0), (256, 128), jnp.float32)
        qt = fp4.quantize(w, fmt, axis=0)
        x = make_x(4, 256, 1)
        cfg = ft.Fp4MatmulConfig(block_n=64, block_k=128)
        check(
            f"smoke {fmt}",
            fm.fp4_matmul(x, qt, config=cfg, interpret=True),
            fm.fp4_matmul_reference(x, qt),
            log,
        )
        check(
            f"smoke one-token {fmt}",
            fm.fp4_matmul(x[:1], layouts.prepack(qt), interpret=True),
            fm.fp4_matmul_reference(x[:1], qt),
            log,
        )
    print(json.dumps(log, indent=1))


def _int_tuples(text: str) -> list[tuple[int, ...]]:
    """'1,2;3,4' -> [(1, 2), (3, 4)]; '' -> []."""
    return [tuple(int(v) for v in t.split(",")) for t in text.split(";")] if text else []


def _grouped_variants(text: str) -> list[tuple]:
    """'256,3,8,1;256,3,8,1,kernel,t2' -> (block_k, stages, block_m, warpgroups, prologue,
    tiles) tuples: after the four numbers, "xla" or "kernel" (``MgpuMatmulConfig.prologue``,
    default "kernel") and "t<N>" (``tiles``, default 1), in either order."""
    out = []
    for t in text.split(";") if text else []:
        fields = t.split(",")
        nums, flags = fields[:4], fields[4:]
        prologue = [f for f in flags if f in ("xla", "kernel")]
        tiles = [f[1:] for f in flags if f.startswith("t") and f[1:].isdigit()]
        if (
            len(nums) != 4
            or not all(v.isdigit() for v in nums)
            or len(prologue) > 1
            or len(tiles) > 1
            or len(prologue) + len(tiles) != len(flags)
        ):
            raise SystemExit(
                "--variants: 'block_k,stages,block_m,warpgroups[,xla|kernel][,t<tiles>]', "
                f"got {t!r}"
            )
        out.append((*map(int, nums), (prologue or ["kernel"])[0], int((tiles or ["1"])[0])))
    return out


def _mgpu_variants(text: str) -> list[tuple]:
    """'256,3,2,1;256,3,2,1,none;256,3,2,1,wk' -> (block_k, stages, split_k, warpgroups,
    decode, split_in) tuples: "none" (the diagnostic without the decode), "wk" (the K parts on
    the warpgroups of one program, ``split_in="warpgroups"``)."""
    out = []
    for t in text.split(";") if text else []:
        fields = t.split(",")
        nums = [int(v) for v in fields if v.isdigit()]
        flags = {v for v in fields if not v.isdigit()}
        if len(nums) != 4 or flags - {"none", "wk"}:
            raise SystemExit(
                f"--variants: 'block_k,stages,split_k,warpgroups[,none][,wk]', got {t!r}"
            )
        decode = "none" if "none" in flags else "asm"
        out.append((*nums, decode, "warpgroups" if "wk" in flags else "grid"))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tune", action="store_true", help="Triton kernel: short tiling search")
    ap.add_argument("--grouped-sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--gemv", action="store_true", help="M=1 without the matrix unit")
    ap.add_argument(
        "--quick", action="store_true", help="--gemv: three tilings; --mgpu: defaults only"
    )
    ap.add_argument("--large-m", action="store_true", help="the dispatcher's large-M paths")
    ap.add_argument("--mgpu", action="store_true", help="FP4 tensor-core kernel, M <= 256")
    ap.add_argument("--grouped-mgpu", action="store_true", help="grouped: Triton vs tensor-core")
    ap.add_argument("--dispatch", action="store_true", help="fp4_matmul's default route vs XLA")
    ap.add_argument("--moe-layer", action="store_true", help="gate/up + down (--ms: tokens)")
    ap.add_argument("--w4a4", action="store_true", help="W4A4 (fused / XLA quantize) vs W4A16")
    ap.add_argument(
        "--grouped-bounds", action="store_true", help="grouped: whole op vs kernel (--ms: tokens)"
    )
    ap.add_argument("--bounds", action="store_true", help="whole op, kernel, no decode, XLA read")
    ap.add_argument(
        "--ms", default="1,16,64", help="--mgpu, --dispatch, --bounds, --w4a4: the token counts M"
    )
    ap.add_argument("--fmt", default="nvfp4", help="--mgpu: nvfp4 or mxfp4")
    ap.add_argument(
        "--variants",
        default="",
        help="--mgpu: tilings 'block_k,stages,split_k,warpgroups[,none][,wk];...' (none: no "
        "decode; wk: K parts on the warpgroups); "
        "--grouped-bounds: 'block_k,stages,block_m,warpgroups[,xla|kernel][,t<N>];...' (kernel: "
        "the routing plan in one Triton launch, x read past its end; tN: N tiles per program)",
    )
    ap.add_argument(
        "--shapes", default="", help="--mgpu, --dispatch: 'K,N;...' instead of both dense shapes"
    )
    ap.add_argument(
        "--parts", default=",".join(TABLE_PARTS), help="the table: which of its parts to run"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    log: list = []
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    if args.smoke:
        smoke(log)
        return 0
    t0 = time.time()
    ms = tuple(int(v) for v in args.ms.split(","))
    shapes = _int_tuples(args.shapes) or DENSE_SHAPES
    if args.sweep:
        sweep(log)
    elif args.grouped_sweep:
        base = ft.Fp4MatmulConfig(block_n=64, block_k=128, block_m=16, num_stages=3)
        cfgs = [base] + [
            dataclasses.replace(base, **v)
            for v in (
                dict(num_stages=4),
                dict(block_n=128),
                dict(prefetch=True, num_stages=1),
                dict(block_n=32),
                dict(block_k=256),
            )
        ]
        print_table(grouped_rows(log, cfgs))
    elif args.tune:
        tune(log)
    elif args.grouped_mgpu:
        variants = () if args.quick else ((256, 3, 8), (256, 3, 16), (256, 3, 32), (128, 4, 16))
        mcfgs = [None] + [
            fmm.MgpuMatmulConfig(block_k=bk, stages=st, block_m=bm) for bk, st, bm in variants
        ]
        print_table(grouped_rows(log, (None,), mcfgs))
    elif args.mgpu:
        variants = _mgpu_variants(args.variants) or ((None,) if args.quick else MGPU_VARIANTS)
        mgpu(log, variants, ms, args.fmt, shapes, triton=not args.variants)
    elif args.moe_layer:
        print_table(moe_layer(log, ms))
    elif args.w4a4:
        print_table(w4a4_rows(log, ms, shapes))
    elif args.bounds:
        bounds(log, ms, shapes)
    elif args.grouped_bounds:
        grouped_bounds(log, ms, _grouped_variants(args.variants))
    elif args.dispatch:
        print_table(dispatch(log, ms, args.fmt, shapes))
    elif args.gemv:
        gemv(log, QUICK_GEMV_VARIANTS if args.quick else GEMV_VARIANTS)
    elif args.large_m:
        rows = []
        for k, n in DENSE_SHAPES:
            case = make_dense(k, n, "nvfp4", SETS, seed=1)
            rows += large_m_paths(case, log, (256, 1024), LARGE_M_TILES)
            del case
        print_table(rows)
    else:
        parts = tuple(args.parts.split(","))
        if set(parts) - set(TABLE_PARTS):
            raise SystemExit(f"--parts: some of {','.join(TABLE_PARTS)}, got {args.parts!r}")
        table(log, parts, shapes)
    with open(os.path.join(args.out, "fp4_matmul_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    failed = [c for c in log if "check" in c and not c["ok"]]
    print(f"\n{len(failed)} failed checks; {time.time() - t0:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
