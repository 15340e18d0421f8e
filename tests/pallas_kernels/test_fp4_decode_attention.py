"""Decode attention over bf16 / fp8 / NVFP4 / MXFP4 KV caches vs its pure-JAX reference: Pallas
interpreter on the CPU, and the compiled kernel at the benchmark shapes on a GPU; ``kv_append``
against ``kv_cache.write``."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import kernel_checks as kc
import numpy as np
import pytest

from pallas_kernels import fp4_decode_attention as fa
from pallas_kernels import fp4_decode_attention_mgpu as tc
from pallas_kernels import fp4_decode_attention_triton as ft
from pallas_kernels import kv_layout
from trace_jax import fp4
from trace_jax.rollout import kv_cache

FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
SMALL = ft.DecodeAttentionConfig(block_k=16, num_splits=2)
POISONED = (4, 64, 2, 8, 64)  # B, S, Hkv, Hq, D: shared by the tests of SMALL's tiling

# hp (heads_per_program) 2: both KV heads' query groups share a program's rows, each row masked
# to its own head's slots


@pytest.mark.parametrize(
    ("fmt", "hp"),
    # every format with one head per program; two heads for each operand structure that the
    # two-head tile reshapes (bf16 values; fp8 values + per-token scales; FP4 codes + block
    # scales + per-token scales, the same for MXFP4 as for NVFP4)
    [(f, 1) for f in FORMATS] + [("bf16", 2), ("fp8", 2), ("nvfp4", 2)],
)
def test_matches_reference_with_poisoned_stale_slots(fmt, hp):
    # Lengths 1, the maximum and in between; slots past each length hold NaN bytes, which the
    # kernel must never read into the result.
    b, s, hkv, hq, d = POISONED
    q, k, v = kc.attn_inputs(fmt, b, s, hkv, hq, d, seed=1)
    lengths = jnp.array([1, s, 37, 16], jnp.int32)
    ref = fa.decode_attention_reference(q, k, v, lengths)
    kp, vp = kc.poison(k, lengths), kc.poison(v, lengths)
    cfg = dataclasses.replace(SMALL, heads_per_program=hp)
    y = fa.decode_attention(q, kp, vp, lengths, config=cfg, interpret=True)
    kc.assert_attn_close(y, ref)
    # The reference over the poisoned cache is the same (it masks before use).
    np.testing.assert_array_equal(
        np.asarray(fa.decode_attention_reference(q, kp, vp, lengths), np.float32),
        np.asarray(ref, np.float32),
    )


@pytest.mark.parametrize(
    ("fmt", "hp"),
    # the window's bounds are format-independent slot arithmetic (one and two heads per
    # program); each format's tile load at a window's unaligned start once
    [("bf16", 2), ("fp8", 1), ("nvfp4", 2), ("mxfp4", 1)],
)
def test_sliding_window(fmt, hp):
    # the inputs of test_matches_reference_with_poisoned_stale_slots (its draws and its
    # reference without the window, the same programs)
    b, s, hkv, hq, d = POISONED
    window = 21
    q, k, v = kc.attn_inputs(fmt, b, s, hkv, hq, d, seed=1)
    lengths = jnp.array([s, 40, 5, 22], jnp.int32)
    lo = jnp.maximum(lengths - window, 0)
    ref = fa.decode_attention_reference(q, k, v, lengths, window=window)
    kp, vp = kc.poison(k, lengths, lo), kc.poison(v, lengths, lo)
    cfg = dataclasses.replace(SMALL, heads_per_program=hp)
    y = fa.decode_attention(q, kp, vp, lengths, window=window, config=cfg, interpret=True)
    kc.assert_attn_close(y, ref)
    # The window changes the answer (the test would notice a kernel that ignores it).
    full = fa.decode_attention_reference(q, k, v, lengths)
    assert np.abs(np.asarray(full, np.float32) - np.asarray(ref, np.float32)).max() > 0.05


@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (12, 4), (32, 2)])
def test_gqa_ratios(hq, hkv):
    # G = 1 (MHA), 3 (padded to 16 rows, not a power of two) and 16 query heads per KV head.
    b, s, d = 2, 64, 32
    q, k, v = kc.attn_inputs("nvfp4", b, s, hkv, hq, d, seed=hq)
    lengths = jnp.array([s, 23], jnp.int32)
    cfg = ft.DecodeAttentionConfig(block_k=32, num_splits=1)
    y = fa.decode_attention(q, k, v, lengths, config=cfg, interpret=True)
    kc.assert_attn_close(y, fa.decode_attention_reference(q, k, v, lengths))


def test_splits_and_steps_agree():
    # More splits than blocks (empty splits), and one split walking every block.
    b, s, hkv, hq, d = 2, 128, 1, 4, 32
    q, k, v = kc.attn_inputs("mxfp4", b, s, hkv, hq, d, seed=5)
    lengths = jnp.array([20, s], jnp.int32)
    ref = fa.decode_attention_reference(q, k, v, lengths, sm_scale=0.3)
    for cfg in (
        ft.DecodeAttentionConfig(block_k=16, num_splits=8),
        ft.DecodeAttentionConfig(block_k=32, num_splits=1),
    ):
        y = fa.decode_attention(q, k, v, lengths, sm_scale=0.3, config=cfg, interpret=True)
        kc.assert_attn_close(y, ref)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_tiles_hold_d_positions_4m_plus_t(fmt):
    # The kernel's FP4 decode (the portable form interpret mode runs; the PTX form is checked
    # against the reference by the GPU tests) times its per-token column scale, against the
    # cache's own dequantization: tile t, column m is D position 4m + t, for every code value.
    s, d = 64, 128
    _, k, _ = kc.attn_inputs(fmt, 1, s, 1, 1, d, seed=9)

    @jax.jit  # one program (eager, each op of the decode compiled on its own)
    def decode(k):
        codes, scales, g = (a[0, :, 0] for a in kv_layout.operands(k))
        words = ft._codes_u16(codes)
        cfg = ft.DecodeAttentionConfig(dequant="portable")
        parts, col = ft._decode_tile([words, scales, g], cfg, fmt)
        got = jnp.stack([p.astype(jnp.float32) for p in parts], axis=-1).reshape(s, d)
        want = kv_cache.read(k, jnp.float32)[0, :, 0]
        return codes, ft._codes_u8(words), parts, got * col[:, None], want

    codes, back, parts, got, want = decode(k)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(codes))
    assert len(parts) == 4 and parts[0].shape == (s, d // 4) and parts[0].dtype == jnp.bfloat16
    assert np.unique(np.asarray(codes) & 0xF).size == 16  # every code value occurs
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=0)


def test_nan_in_a_valid_slot_is_loud():
    # the program of test_matches_reference_with_poisoned_stale_slots[nvfp4-1]: a NaN scale in
    # a valid slot of sequence 0 makes all its heads NaN and no other sequence's
    b, s, hkv, hq, d = POISONED
    q, k, v = kc.attn_inputs("nvfp4", b, s, hkv, hq, d, seed=1)
    g = k.global_scale.at[0, 3].set(jnp.nan)
    k = dataclasses.replace(k, global_scale=g)
    lengths = jnp.array([10, s, 37, 16], jnp.int32)
    y = np.asarray(fa.decode_attention(q, k, v, lengths, config=SMALL, interpret=True), np.float32)
    assert np.all(np.isnan(y[0])) and np.all(np.isfinite(y[1:]))


def test_reference_matches_plain_softmax():
    # The reference itself, against numpy on a bf16 cache (no quantization involved).
    b, s, hkv, hq, d = 2, 16, 2, 4, 8
    rng = np.random.default_rng(0)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    q = rng.standard_normal((b, hq, d)).astype(np.float32)
    k, v, q = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in (k, v, q))
    lengths = np.array([16, 5])
    ref = fa.decode_attention_reference(
        jnp.asarray(q, jnp.bfloat16),
        jnp.asarray(k, jnp.bfloat16),
        jnp.asarray(v, jnp.bfloat16),
        jnp.asarray(lengths, jnp.int32),
    )
    out = np.zeros((b, hq, d), np.float32)
    for i in range(b):
        for h in range(hq):
            kh = k[i, : lengths[i], h // (hq // hkv)]
            vh = v[i, : lengths[i], h // (hq // hkv)]
            logits = kh @ q[i, h] / np.sqrt(d)
            p = np.exp(logits - logits.max())
            out[i, h] = (p / p.sum()) @ vh
    np.testing.assert_allclose(np.asarray(ref, np.float32), out, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("fmt", "kernel"),
    # the kernel copies byte rows: MXFP4's (codes, scales, per-row global scale) are NVFP4's
    # structure at other widths
    [(f, False) for f in FORMATS] + [(f, True) for f in ("bf16", "fp8", "nvfp4")],
    ids=lambda v: {False: "xla", True: "kernel"}.get(v, v),
)
def test_kv_append_equals_cache_write(fmt, kernel):
    b, s, hkv, d = 3, 32, 2, 64
    base = np.random.default_rng(9).standard_normal((b, s, hkv, d), np.float32)
    buf = kc.stored_cache(fmt, jnp.asarray(base))
    x = kc.random_x(b * hkv, d, seed=10).reshape(b, 1, hkv, d)
    lengths = jnp.array([0, 31, 32], jnp.int32)  # first slot, last slot, full (dropped)
    valid = jnp.array([[True], [True], [True]])
    expect = _written(fmt, buf, x, lengths, valid)
    append = functools.partial(fa.kv_append, kernel=kernel, interpret=kernel)
    got = append(jax.tree.map(jnp.copy, buf), x, lengths)
    _assert_same_bytes(got, expect)
    # Something was written: the new token differs from what the slot held.
    before = jax.tree.leaves(buf)[0]
    assert not np.array_equal(np.asarray(jax.tree.leaves(got)[0]), np.asarray(before))
    # A sequence marked invalid is left alone.
    got2 = append(
        jax.tree.map(jnp.copy, buf), x[:, 0], lengths, valid=jnp.array([False, True, True])
    )
    np.testing.assert_array_equal(
        np.asarray(jax.tree.leaves(got2)[0][0]).view(np.uint8),
        np.asarray(jax.tree.leaves(buf)[0][0]).view(np.uint8),
    )


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_kv_append_many_writes_k_and_v_in_one_call(fmt):
    """K and V of a layer through one kernel launch equal two separate cache writes."""
    b, s, hkv, d = 4, 16, 2, 32
    k_buf, v_buf = (
        kc.stored_cache(fmt, kc.random_x(b * s * hkv, d, seed=i).reshape(b, s, hkv, d))
        for i in (1, 2)
    )
    k, v = (kc.random_x(b * hkv, d, seed=i).reshape(b, hkv, d) for i in (3, 4))
    lengths = jnp.array([5, 0, 15, 9], jnp.int32)
    valid = jnp.array([True, True, False, True])
    got = fa.kv_append_many(
        [jax.tree.map(jnp.copy, k_buf), jax.tree.map(jnp.copy, v_buf)],
        [k, v],
        lengths,
        valid=valid,
        interpret=True,
    )
    for out, buf, x in zip(got, (k_buf, v_buf), (k, v), strict=True):
        expect = fa.kv_append(jax.tree.map(jnp.copy, buf), x, lengths, valid=valid, kernel=False)
        _assert_same_bytes(out, expect)


@pytest.mark.parametrize(
    ("fmt", "tensor_cores", "window"),
    # each format through the Triton kernel's fused append and both through the Mosaic GPU
    # kernel's; the window (format-independent bounds that count the new token) in the Triton
    # kernel, which counts it itself (the Mosaic GPU kernel takes lengths + taken and bounds
    # the window as without an append: test_fp4_decode_attention_mgpu.test_sliding_window)
    [(f, False, None) for f in FORMATS]
    + [("nvfp4", False, 9), ("nvfp4", True, None), ("mxfp4", True, None)],
)
def test_fused_append_equals_append_then_attend(fmt, tensor_cores, window):
    """``decode_attention_append`` writes the same bytes as ``kv_append_many`` and attends as
    ``decode_attention`` over the written cache (the new token included where it was taken);
    with ``tensor_cores``, the Mosaic GPU kernel writes them (shapes it takes)."""
    # POISONED: the other tests' draws, quantization and reference programs serve these
    b, s, hkv, hq, d = POISONED
    if tensor_cores:  # 64-slot steps, 16-byte rows of scales
        s, hkv, hq, d = 128, 4, 16, 64 if fmt == "nvfp4" else 128
    q, k_buf, v_buf = kc.attn_inputs(fmt, b, s, hkv, hq, d, seed=11)
    k, v = (kc.random_x(b * hkv, d, seed=i).reshape(b, hkv, d) for i in (3, 4))
    lengths = jnp.array([0, 17, s - 1, s], jnp.int32)  # empty, middle, last slot, full (dropped)
    valid = jnp.array([True, False, True, True])
    want_k, want_v = fa.kv_append_many(
        [jax.tree.map(jnp.copy, k_buf), jax.tree.map(jnp.copy, v_buf)],
        [k, v],
        lengths,
        valid=valid,
        kernel=False,
    )
    taken = valid & (lengths < s)
    ref = fa.decode_attention_reference(q, want_k, want_v, lengths + taken, window=window)
    # stale slots, and the new slot
    kp, vp = kc.poison(k_buf, lengths), kc.poison(v_buf, lengths)
    cfg = None if tensor_cores else SMALL
    out, got_k, got_v = fa.decode_attention_append(
        q, kp, vp, k, v, lengths, valid=valid, window=window, config=cfg,
        tensor_cores=tensor_cores, interpret=True,
    )  # fmt: skip
    kc.assert_attn_close(out[taken | (lengths > 0)], ref[taken | (lengths > 0)])
    # Only the taken slots were written: the stored bytes equal the two-call path's.
    for got, want in ((got_k, want_k), (got_v, want_v)):
        _assert_same_bytes(kc.poison(got, lengths + taken), kc.poison(want, lengths + taken))


@functools.partial(jax.jit, static_argnums=(0,))  # one program (eager: an op at a time)
def _written(fmt, buf, x, lengths, valid):
    """``kv_cache.write`` of x [B, 1, Hkv, D] as the KV site stores it (its RTN)."""
    qt = None
    if fmt in ("nvfp4", "mxfp4"):
        qt = fp4.quantize(x, fmt, axis=-1, global_scale=kv_cache.site_global_scale(fmt))
    return kv_cache.write(buf, kv_cache.to_storage(fmt, x, qt), lengths, valid)


def _assert_same_bytes(got, expect):
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(expect), strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(e).view(np.uint8))


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("b", "s"), [(32, 8192), (8, 32768), (64, 2048)])
def test_gpu_benchmark_shapes(fmt, b, s):
    hkv, hq, d = 4, 32, 128
    q, k, v = kc.attn_inputs(fmt, b, s, hkv, hq, d, seed=b)
    lengths = jax.random.randint(jax.random.key(s), (b,), 1, s + 1, jnp.int32)
    lengths = lengths.at[0].set(1).at[1].set(s)
    ref = fa.decode_attention_reference(q, k, v, lengths)
    kp, vp = kc.poison(k, lengths), kc.poison(v, lengths)
    kc.assert_attn_close(fa.decode_attention(q, kp, vp, lengths), ref)
    if fmt in ("nvfp4", "mxfp4"):  # the tensor-core kernel
        kc.assert_attn_close(fa.decode_attention(q, kp, vp, lengths, tensor_cores=True), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_window_and_small_tiles(fmt):
    b, s, hkv, hq, d = 4, 512, 4, 32, 128
    q, k, v = kc.attn_inputs(fmt, b, s, hkv, hq, d, seed=3)
    lengths = jnp.array([1, s, 77, 300], jnp.int32)
    for window in (None, 50):
        lo = jnp.maximum(lengths - (window or s), 0)
        ref = fa.decode_attention_reference(q, k, v, lengths, window=window)
        kp, vp = kc.poison(k, lengths, lo), kc.poison(v, lengths, lo)
        two = ft.DecodeAttentionConfig(block_k=16, num_splits=4, num_warps=2, heads_per_program=2)
        for cfg in (None, ft.DecodeAttentionConfig(block_k=32, num_splits=4), two):
            y = fa.decode_attention(q, kp, vp, lengths, window=window, config=cfg)
            kc.assert_attn_close(y, ref)
        if fmt in ("nvfp4", "mxfp4"):  # the tensor-core kernel, default and other tilings
            y = fa.decode_attention(q, kp, vp, lengths, window=window, tensor_cores=True)
            kc.assert_attn_close(y, ref)
            fast = dict(auto_barriers=False, num_splits=4, p_parts=1)
            for cfg in (
                tc.MgpuAttentionConfig(num_splits=3, stages=3),
                tc.MgpuAttentionConfig(**fast),
            ):
                y = tc.decode_attention_mgpu(q, kp, vp, lengths, window=window, config=cfg)
                kc.assert_attn_close(y, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("b", "s"), [(64, 2048), (8, 32768)])
def test_gpu_fused_append_at_benchmark_shapes(fmt, b, s):
    hkv, hq, d = 4, 32, 128
    q, k_buf, v_buf = kc.attn_inputs(fmt, b, s, hkv, hq, d, seed=b + 1)
    k, v = (kc.random_x(b * hkv, d, seed=i).reshape(b, hkv, d) for i in (3, 4))
    lengths = jax.random.randint(jax.random.key(s), (b,), 0, s + 1, jnp.int32)
    lengths = lengths.at[0].set(0).at[1].set(s - 1).at[2].set(s)
    valid = jnp.arange(b) % 5 != 3
    want_k, want_v = fa.kv_append_many(
        [jax.tree.map(jnp.copy, k_buf), jax.tree.map(jnp.copy, v_buf)], [k, v], lengths, valid=valid
    )
    taken = valid & (lengths < s)
    ref = fa.decode_attention_reference(q, want_k, want_v, lengths + taken)
    keep = taken | (lengths > 0)
    for tensor_cores in (False, True) if fmt in ("nvfp4", "mxfp4") else (False,):
        out, got_k, got_v = fa.decode_attention_append(
            q,
            kc.poison(k_buf, lengths),
            kc.poison(v_buf, lengths),
            k,
            v,
            lengths,
            valid=valid,
            tensor_cores=tensor_cores,
        )
        kc.assert_attn_close(out[keep], ref[keep])
        for got, want in ((got_k, want_k), (got_v, want_v)):
            _assert_same_bytes(kc.poison(got, lengths + taken), kc.poison(want, lengths + taken))
