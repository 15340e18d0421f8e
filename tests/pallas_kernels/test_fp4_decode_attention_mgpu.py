"""Tensor-core decode attention over an NVFP4 or MXFP4 cache (Mosaic GPU) vs the pure-JAX
reference: the Mosaic GPU interpreter on the CPU, its PTX decode run by a small interpreter of its
instructions against the decode's ``jnp`` definition, and the GPU path lowered for CUDA here. The
compiled kernel's GPU tests are those of the Triton kernel (tests/pallas_kernels/
test_fp4_decode_attention.py, ``tensor_cores=True``) at the same shapes."""

import re

import jax
import jax.numpy as jnp
import kernel_checks as kc
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import cuda_lowering
from pallas_kernels import fp4_decode_attention as fa
from pallas_kernels import fp4_decode_attention_mgpu as fm
from pallas_kernels import fp4_decode_attention_triton as ft
from trace_jax.rollout import kv_cache

CFG = fm.MgpuAttentionConfig(num_splits=2)


def _run(q, k, v, lengths, window=None, cfg=CFG, interpret=True):
    return fm.decode_attention_mgpu(
        q, k, v, lengths, window=window, config=cfg, interpret=interpret
    )


@pytest.mark.parametrize(
    ("b", "s", "hkv", "hq", "d", "lens", "cfg"),
    [
        # lengths 0, 1, the maximum and in between; G = 4 query heads padded to 8
        (4, 192, 4, 16, 128, [0, 1, 192, 70], CFG),
        # G = 8, one split per sequence, one buffer, V decoded during the scores' multiply
        (
            2,
            128,
            4,
            32,
            64,
            [128, 65],
            fm.MgpuAttentionConfig(num_splits=1, stages=1, overlap_v=True),
        ),
        # more splits than steps; 3 buffers; p rounded to bf16 once (test_sliding_window's
        # shapes: one draw program for both)
        (
            3,
            256,
            4,
            8,
            64,
            [3, 250, 129],
            fm.MgpuAttentionConfig(num_splits=3, stages=3, p_parts=1),
        ),
    ],
)
def test_matches_reference_with_poisoned_stale_slots(b, s, hkv, hq, d, lens, cfg):
    q, k, v = kc.attn_inputs("nvfp4", b, s, hkv, hq, d, seed=b + d)
    lengths = jnp.array(lens, jnp.int32)
    ref = fa.decode_attention_reference(q, k, v, lengths)
    y = _run(q, kc.poison(k, lengths), kc.poison(v, lengths), lengths, cfg=cfg)
    kc.assert_attn_close(y, ref)


def test_scores_spanning_many_binades():
    # q scaled 16x: scores over ~+-500 (base 2); the running max of a query head rises by
    # more than 8 at 14 of the 32 later (head, step) pairs of sequence 0, and p spans the
    # whole float32 range
    b, s, hkv, hq, d, lens = 2, 320, 4, 8, 64, [320, 200]
    q, k, v = kc.attn_inputs("nvfp4", b, s, hkv, hq, d, seed=3)
    q = (q.astype(jnp.float32) * 16).astype(jnp.bfloat16)
    lengths = jnp.array(lens, jnp.int32)
    ref = fa.decode_attention_reference(q, k, v, lengths)
    cfg = fm.MgpuAttentionConfig(num_splits=1)
    kc.assert_attn_close(_run(q, k, v, lengths, cfg=cfg), ref)


@pytest.mark.parametrize("window", [None, 30])
def test_mxfp4_matches_reference_with_poisoned_stale_slots(window):
    # NaN bytes (0xFF) in stale slots' E8M0 scales too: they must decode to finite values
    # (the shapes of test_matches_reference_with_poisoned_stale_slots' first case: one draw
    # program for both)
    b, s, hkv, hq, d, lens = 4, 192, 4, 16, 128, [1, 192, 100, 37]
    q, k, v = kc.attn_inputs("mxfp4", b, s, hkv, hq, d, seed=21)
    lengths = jnp.array(lens, jnp.int32)
    lo = None if window is None else jnp.maximum(lengths - window, 0)
    ref = fa.decode_attention_reference(q, k, v, lengths, window=window)
    y = _run(q, kc.poison(k, lengths, lo), kc.poison(v, lengths, lo), lengths, window=window)
    kc.assert_attn_close(y, ref)


# 7: the window inside one 64-slot step for one sequence, across a step boundary for another;
# 100: a window over two or three steps, its start inside the first (a window of 21 reads the
# same steps as 7)
@pytest.mark.parametrize("window", [7, 100])
def test_sliding_window(window):
    b, s, hkv, hq, d = 3, 256, 4, 8, 64
    q, k, v = kc.attn_inputs("nvfp4", b, s, hkv, hq, d, seed=5)
    lengths = jnp.array([1, 250, 130], jnp.int32)
    lo = jnp.maximum(lengths - window, 0)
    ref = fa.decode_attention_reference(q, k, v, lengths, window=window)
    y = _run(q, kc.poison(k, lengths, lo), kc.poison(v, lengths, lo), lengths, window=window)
    kc.assert_attn_close(y, ref)


def test_more_exact_than_the_triton_kernel():
    # Both kernels over one cache (same masking, splits and combine): this one keeps p in two
    # bf16 parts, so its error against the float32 reference is below the Triton kernel's,
    # which rounds p to bf16 once (both round the output to bf16 once). The inputs and
    # program of test_matches_reference_with_poisoned_stale_slots' first case.
    b, s, hkv, hq, d = 4, 192, 4, 16, 128
    q, k, v = kc.attn_inputs("nvfp4", b, s, hkv, hq, d, seed=b + d)
    lengths = jnp.array([97, 192, 1, 5], jnp.int32)
    ref = np.asarray(_reference_f32(q, k, v, lengths))
    cfg = ft.DecodeAttentionConfig(block_k=32, num_splits=2)  # p rounded alike at any block_k
    triton = np.asarray(fa.decode_attention(q, k, v, lengths, config=cfg, interpret=True))
    y = np.asarray(_run(q, k, v, lengths), np.float32)
    err = lambda out: np.linalg.norm(out.astype(np.float32) - ref)  # noqa: E731
    assert err(y) < err(triton)
    kc.assert_attn_close(y, ref)


@jax.jit
def _reference_f32(q, k, v, lengths):
    """The reference's softmax without its final bf16 rounding."""
    kf, vf = kv_cache.read(k, jnp.float32), kv_cache.read(v, jnp.float32)
    b, s, hkv, d = kf.shape
    qg = q.astype(jnp.float32).reshape(b, hkv, -1, d)
    hp = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bhgd,bshd->bhgs", qg, kf, precision=hp) / np.sqrt(d)
    valid = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
    p = jax.nn.softmax(jnp.where(valid, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhgs,bshd->bhgd", p, vf, precision=hp).reshape(b, -1, d)


def _thread_columns(d, layout, b):
    """The tile columns that thread ``b`` of a quad holds in each of its rows."""
    if layout == "wgmma":
        return [8 * j + 2 * b + v for j in range(d // 8) for v in range(2)]
    return [32 * u + 8 * b + e for u in range(d // 32) for e in range(8)]


@pytest.mark.parametrize("layout", ["wgmma", "vector"])
def test_column_order_is_a_permutation_of_whole_scale_blocks(layout):
    for d in (64, 128, 256):
        order = fm.column_order(d, layout)
        assert sorted(order) == list(range(d))
        # thread b's columns hold the D/4 positions from D b / 4
        for b in range(4):
            cols = _thread_columns(d, layout, b)
            assert sorted(order[cols]) == list(range(d // 4 * b, d // 4 * (b + 1)))


@pytest.mark.parametrize("layout", ["wgmma", "vector"])
def test_column_transposes_are_the_column_order(layout):
    for d in (64, 128, 256):
        x = jnp.arange(3 * d, dtype=jnp.int32).reshape(3, 1, d)
        cols = fm.to_columns(x, layout)
        np.testing.assert_array_equal(cols, np.asarray(x)[..., fm.column_order(d, layout)])
        np.testing.assert_array_equal(fm.from_columns(cols, layout), x)


# ----------------------------------------------------------------------------- the PTX decode

_BF16 = ml_dtypes.bfloat16


def _bf16_pair_mul(a: int, b: int) -> int:
    """mul.rn.bf16x2: each 16-bit half multiplied in bf16, rounded to nearest even."""
    out = 0
    for half in (0, 16):
        x, y = (np.array([(r >> half) & 0xFFFF], np.uint16).view(_BF16) for r in (a, b))
        prod = (x.astype(np.float32) * y.astype(np.float32)).astype(_BF16)
        out |= int(prod.view(np.uint16)[0]) << half
    return out


def _signed(v: int) -> int:
    return v - (1 << 32) if v & 0x80000000 else v


def _run_ptx(asm: str, args: list[int], n_out: int) -> list[int]:
    """Interpret the decode's PTX: the integer, predicate and ``mul.rn.bf16x2`` instructions
    it uses ($i operands, outputs first; registers p* are predicates)."""
    regs = {f"${n_out + i}": v for i, v in enumerate(args)}

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in asm.splitlines():
        m = re.match(r"\s*([\w.]+)\s+([^;]+);", line)
        if not m or m.group(1).startswith(".reg"):
            continue
        op, operands = m.group(1), [t.strip() for t in m.group(2).split(",")]
        dst, *src = operands
        a = [val(x) for x in src if not x.startswith("p")] if op != "selp.b32" else None
        if op == "and.b32":
            res = a[0] & a[1]
        elif op == "mul.lo.u32":
            res = a[0] * a[1]
        elif op == "shr.b32":
            res = a[0] >> a[1]
        elif op == "shl.b32":
            res = a[0] << a[1]
        elif op == "bfe.u32":
            res = (a[0] >> a[1]) & ((1 << a[2]) - 1)
        elif op == "max.u16x2":
            res = max(a[0] & 0xFFFF, a[1] & 0xFFFF) | max(a[0] >> 16, a[1] >> 16) << 16
        elif op == "max.u32":
            res = max(a)
        elif op in ("sub.s32", "add.s32", "max.s32"):
            x, y = (_signed(v) for v in a)
            res = {"sub.s32": x - y, "add.s32": x + y, "max.s32": max(x, y)}[op]
        elif op == "setp.lt.s32":
            res = _signed(a[0]) < _signed(a[1])
        elif op == "setp.eq.u32":
            res = a[0] == a[1]
        elif op == "selp.b32":
            res = val(src[0]) if regs[src[2]] else val(src[1])
        elif op == "mul.rn.bf16x2":
            res = _bf16_pair_mul(a[0], a[1])
        else:
            raise AssertionError(f"unexpected instruction {op}")
        regs[dst] = res if isinstance(res, bool) else res & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(n_out)]


@pytest.mark.parametrize("layout", ["wgmma", "vector"])
@pytest.mark.parametrize(("fmt", "d"), [("nvfp4", 64), ("nvfp4", 128), ("mxfp4", 128)])
def test_ptx_decode_in_the_register_layout_equals_its_definition(fmt, d, layout):
    # Each thread of the warpgroup as _decode_asm runs it: its two rows' code words and scale
    # bytes, the PTX, and the bf16 pairs placed where the wgmma register layout puts them
    # (register (j, rh) of thread 32 w + 4 a + b: row 16 w + 8 rh + a, columns 8 j + 2 b + v).
    rng = np.random.default_rng(d)
    words = rng.integers(0, 2**32, (64, d // 8), dtype=np.uint64).astype(np.uint32)
    if fmt == "nvfp4":  # E4M3 scales as the quantizer makes them: normal (exponent field >= 1)
        scales = rng.integers(0x08, 0x7F, (64, d // 16)).astype(np.uint8)
    else:  # E8M0 bytes: rows of near exponents, rows spanning > 126 binades, NaN blocks
        scales = rng.integers(100, 140, (64, 4)).astype(np.uint8)
        scales[::5, 1] = 250
        scales[::7, 2] = 255
        scales[3] = [0, 1, 0, 0]
        scales = scales.view(np.uint32)[:, 0]
    tile, factor = fm.decode_tile_reference(jnp.asarray(words), jnp.asarray(scales), fmt, layout)
    want = np.asarray(tile)
    got = np.zeros((64, d), np.uint16)
    got_factor = np.full(64, 2.0 ** (126 - fm._OFFSET), np.float32)
    nw, nb = d // 32, d // 64
    for t in range(128):
        w, a, b = t // 32, (t % 32) // 4, t % 4
        for rh in range(2):
            row = 16 * w + 8 * rh + a
            if fmt == "nvfp4":
                sc = [
                    int(scales[row, nb * b + q]) * fm._SCALE_MULT + fm._SCALE_BIAS
                    for q in range(nb)
                ]
            else:
                pair, bits = _run_ptx(fm._MX_SCALE_ASM, [int(scales[row]), 8 * b], 2)
                sc = [pair]
                got_factor[row] = np.array([bits], np.uint32).view(np.float32)[0]
            for u in range(nw):
                s_pair = sc[u // 2] if fmt == "nvfp4" else sc[0]
                outs = _run_ptx(fm._WORD_ASM, [int(words[row, nw * b + u]), s_pair], 4)
                for i, pair in enumerate(outs):
                    # "wgmma": register (4 u + i, rh); "vector": element 2 i of vector (u, rh),
                    # which holds columns 32 u + 8 b .. + 7
                    col = 8 * (4 * u + i) + 2 * b if layout == "wgmma" else 32 * u + 8 * b + 2 * i
                    got[row, col], got[row, col + 1] = pair & 0xFFFF, pair >> 16
    np.testing.assert_array_equal(got, want.view(np.uint16))
    np.testing.assert_array_equal(got_factor, np.asarray(factor))
    assert np.isfinite(want.astype(np.float32)).all()  # whatever the scale bytes


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_decode_reference_is_the_dequantized_cache(fmt):
    b, s, hkv, d = 1, 64, 4, 128
    _, k, _ = kc.attn_inputs(fmt, b, s, hkv, 8, d, seed=11)
    words, scales, g = fm._operands(k)
    head = scales[0, :, 2 * d // 16 : 3 * d // 16] if fmt == "nvfp4" else scales[0, :, 2]
    tile, factor = fm.decode_tile_reference(words[0, :, 2], head, fmt)
    got = np.asarray(tile, np.float32) * np.asarray(g[0, :, 2] * factor)[:, None]
    want = np.asarray(kv_cache.read(k, jnp.float32))[0, :, 2][:, fm.column_order(d)]
    np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------- configs, errors


def _abstract_inputs(fmt, b, s, hkv, hq, d):
    """``kc.attn_inputs``' shapes, dtypes and formats, nothing computed (for the checks that
    read no values)."""
    return jax.eval_shape(lambda: kc.attn_inputs(fmt, b, s, hkv, hq, d, seed=1))


def test_default_config_and_support():
    assert fm.default_config(32, 8192, 4).num_splits * 32 * 4 >= 1024
    assert fm.default_config(1, 64, 4).num_splits == 1
    _, k, v = _abstract_inputs("nvfp4", 1, 64, 4, 8, 64)
    assert fm.supports(k, v, 8)
    _, k2, v2 = _abstract_inputs("nvfp4", 1, 64, 2, 8, 64)  # 8-byte scale rows: no TMA
    assert not fm.supports(k2, v2, 8)
    _, k3, v3 = _abstract_inputs("mxfp4", 1, 64, 4, 8, 64)  # MXFP4: D = 128 only
    assert not fm.supports(k3, v3, 8)
    _, k4, v4 = _abstract_inputs("mxfp4", 1, 64, 4, 8, 128)
    assert fm.supports(k4, v4, 8) and not fm.supports(k4, v, 8)


def test_bad_inputs():
    # refused while tracing: traced on abstract inputs (nothing compiled)
    n = jax.ShapeDtypeStruct((2,), jnp.int32)
    q, k, v = _abstract_inputs("nvfp4", 2, 64, 2, 4, 64)
    with pytest.raises(ValueError, match="Hkv a multiple of 4"):
        jax.eval_shape(_run, q, k, v, n)
    q, k, v = _abstract_inputs("nvfp4", 2, 64, 4, 8, 64)
    q6 = jax.ShapeDtypeStruct((2, 6, 64), q.dtype)
    with pytest.raises(ValueError, match="does not fit"):
        jax.eval_shape(_run, q6, k, v, n)
    with pytest.raises(ValueError, match="window"):
        jax.eval_shape(lambda *a: _run(*a, window=0), q, k, v, n)
    with pytest.raises(ValueError, match="num_splits"):
        fm.MgpuAttentionConfig(num_splits=0)
    with pytest.raises(ValueError, match="p_parts"):
        fm.MgpuAttentionConfig(p_parts=3)


@pytest.mark.parametrize(
    "options",
    [{}, {"overlap_v": True}, {"auto_barriers": False, "p_parts": 1}],
)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_lowers_for_cuda(fmt, fused, options):
    # The GPU path (PTX decode, layout inference, TMA and barriers; the fused append's row
    # copies and the cache operands aliased to the kernel's outputs) lowered for CUDA here.
    b, s, hkv, hq, d = 2, 256, 4, 32, 128
    q, k, v = _abstract_inputs(fmt, b, s, hkv, hq, d)  # lowered, never run
    n = jnp.array([1, 200], jnp.int32)
    if fused:
        new = jnp.zeros((b, hkv, d), jnp.bfloat16)
        append = (jnp.where(n < s, n, -1), *(kc.stored_cache(fmt, new[:, None]),) * 2)

        def fn(q, k, v, n):
            return fm.attend(q, k, v, n + 1, None, 64, cfg, False, append)[0]
    else:

        def fn(q, k, v, n):
            return fm.decode_attention_mgpu(q, k, v, n, window=64, config=cfg)

    cfg = fm.MgpuAttentionConfig(**options)
    text = cuda_lowering.export_for_cuda(fn, q, k, v, n)
    call = text[text.index("stablehlo.custom_call @mosaic_gpu") :].split("\n", 1)[0]
    assert call.count("output_operand_alias<") == (6 if fused else 0)
