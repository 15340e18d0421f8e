"""Decode attention kernel over the rollout KV cache (bf16, fp8, NVFP4, MXFP4), dequantized
in-kernel (Pallas, Triton lowering); its reference is
``fp4_decode_attention.decode_attention_reference``.

One new query token per sequence attends to the cache slots ``[lo, length)`` of its sequence
(``lo = length - window`` with a sliding window, else 0). K and V are the cache's stored types
(``trace_jax.fp4.kv_format``): bf16 arrays, ``FP8Tensor`` or ``fp4.QTensor`` quantized along D
with one global scale per token and head. The kernel reads those buffers in place
(``kv_layout.operands``); nothing is repacked, so the cache can be written every step.

Kernel layout:

* Grid ``(Hkv, splits, B)``: one program per KV head, split of the sequence and sequence. The
  KV-head axis varies fastest, so the programs that share a token's 32-byte sectors of block and
  global scales run together and the sectors are fetched from HBM once.
* GQA: the ``G = Hq / Hkv`` query heads of a KV head are the rows of one [G, D] tile (padded to
  16 rows for the matrix unit), so K and V are read once per KV head.
* Split-K over the sequence (flash-decoding): each program walks ``block_k``-token steps of its
  share of ``[lo, length)`` with an online softmax and writes an unnormalised fp32 partial output
  with its running max and sum; ``kv_layout.combine_splits`` merges the splits in XLA.
* FP4: the packed codes are read as 16-bit words of four codes and decoded into four
  [block_k, D/4] bf16 tiles, tile t holding the D positions 4m + t (exact: E2M1 x block scale
  needs 6 significant bits; ``_NIBBLE_ASM``); q is split into the same four column sets in XLA,
  so ``q.k = sum_t q_t.k_t``, and the output comes back as four parts. Triton loads the code
  words straight into the matrix unit's operand layout, where each decoded bf16 pair comes from
  one 32-bit register with shifts and masks alone. The global scale (and the decode's
  power-of-two offset) is per token, so it multiplies a column of the logits for K and a column
  of the probabilities for V instead of every element.
* FP8: E4M3 values convert exactly to bf16; the per-token scale is applied as for FP4.

The new token's K and V can be written in the same launch (``append``: the fused append of
``fp4_decode_attention.decode_attention_append``). Which kernel a call runs is
``fp4_decode_attention``'s choice.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dequant import dequant_portable, scale_bf16_bits
from pallas_kernels.kv_layout import check_shapes, combine_splits, default_splits
from trace_jax import fp4
from trace_jax.fp4.formats import E8M0_NAN
from trace_jax.fp4.kv_format import CacheFormat

Dequant = Literal["asm", "portable"]

_LOG2E = 1.4426950408889634
_NVFP4_OFFSET = 100  # as fp4_matmul: code * scale * 2**(100 - 126) is a normal bf16 for all codes
_MIN_ROWS = 16  # the matrix unit's narrow side: fewer query heads per KV head are padded
_NEG_INIT = -1e30  # running max before any valid slot (finite: exp2(-inf - -inf) would be NaN)


# ----------------------------------------------------------------------------- tuning


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """Tiling of the decode-attention kernel.

    Attributes:
      block_k: cache slots per loop step (a power of two >= 16 dividing the cache length).
      num_splits: programs per (sequence, KV head) along the sequence (flash-decoding splits).
      num_warps: warps per program.
      num_stages: software-pipelining depth of the slot loop.
      dequant: FP4 decode: "asm" (PTX bit operations, GPU only) or "portable" (plain jnp; used
        automatically in interpret mode).
      heads_per_program: KV heads whose query groups share one program's rows (their slots
        interleaved along the step's columns, each row masked to its own head's): with 8 query
        heads per KV head, 2 fill the matrix unit's 16 rows instead of padding them. 1 is used
        instead with the fused append, or when it does not divide the KV heads.
    """

    block_k: int = 64
    num_splits: int = 8
    num_warps: int = 4
    num_stages: int = 2
    dequant: Dequant = "asm"
    heads_per_program: int = 1

    def __post_init__(self):
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k must be a power of two >= 16, got {self.block_k}")
        if self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        if self.heads_per_program < 1:
            raise ValueError(f"heads_per_program must be >= 1, got {self.heads_per_program}")
        if self.dequant not in _DEQUANT:
            raise ValueError(f"dequant must be 'asm' or 'portable', got {self.dequant!r}")


def default_config(batch: int, max_len: int, kv_heads: int, fmt: CacheFormat):
    """Defaults per shape class (H200 sweeps at B=32 S=8192, BENCHMARKS.md).

    bf16 and fp8: 64-slot steps of 4-warp programs, 2 stages (32 and 128 slower for bf16).
    FP4: one-warp programs (NVFP4: 16-slot steps, 3 stages; MXFP4: 32-slot steps, 2 stages).
    The FP4 kernel is bound by instruction issue, not bytes (Nsight Compute); a one-warp program
    has no cross-warp reductions or barriers in its softmax and held 12 programs per
    multiprocessor against 3 of 4 warps. Splits are chosen so that ``batch * kv_heads * splits``
    is about 1024 programs without a split shorter than 4 steps (4 to 8 splits were within noise
    of each other at B=32).
    """
    step, warps, stages = {"nvfp4": (16, 1, 3), "mxfp4": (32, 1, 2)}.get(fmt, (64, 4, 2))
    block_k = min(step, _prev_pow2(max_len))
    while max_len % block_k:
        block_k //= 2
    splits = default_splits(batch, kv_heads, max(1, max_len // block_k))
    return DecodeAttentionConfig(
        block_k=block_k, num_splits=splits, num_warps=warps, num_stages=stages
    )


def _prev_pow2(v: int) -> int:
    return 1 << max(0, v.bit_length() - 1)


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


# ----------------------------------------------------------------------------- kernel


def _load_tile(refs, start, cfg, fmt: CacheFormat):
    """One step's K or V tile.

    Returns (parts, column_scale): parts are bf16 [block_k, D] (bf16, fp8) or the four tiles of
    D positions 4m + t, [block_k, D/4] each (FP4); column_scale [block_k] float32 multiplies the
    token's contribution (None when 1).
    """
    rows = pl.ds(start, cfg.block_k)
    hp = cfg.heads_per_program
    tiles = []
    for r in refs:
        t = r[rows, ...]
        if hp > 1:  # [bk, hp, ...] -> [bk * hp, ...]: column j is slot j // hp of head j % hp
            t = t.reshape(cfg.block_k * hp, *t.shape[2:])
        tiles.append(t)
    return _decode_tile(tiles, cfg, fmt)


def _decode_tile(arrays, cfg, fmt: CacheFormat):
    """``_load_tile``'s decode of the loaded operands ([rows, X] each, [rows] for per-token
    scales)."""
    if fmt == "bf16":
        return [arrays[0]], None
    if fmt == "fp8":
        return [arrays[0].astype(jnp.bfloat16)], arrays[1]
    codes, scales, g = arrays
    spec = fp4.get_format(fmt)
    if spec.scale_format == "e4m3":
        scales = jax.lax.bitcast_convert_type(scales, jnp.uint8)
        offset = jnp.int32(_NVFP4_OFFSET)
        col = g * np.float32(2.0 ** (126 - _NVFP4_OFFSET))
    else:
        # Per token: put the largest finite block exponent at the top of bf16's range (as
        # fp4_matmul.prepack does per weight row) and give the row's 2**(126 - offset) to the
        # column scale. NaN block scales (0xFF) are decoded as 2**-127 and make the column NaN,
        # so that a masked-out slot never yields a non-finite tile.
        s32 = scales.astype(jnp.int32)
        nan_block = s32 == E8M0_NAN
        s32 = jnp.where(nan_block, 0, s32)
        offset = 254 - jnp.max(s32, axis=1, keepdims=True)
        row_nan = jnp.max(nan_block.astype(jnp.int32), axis=1) > 0
        exp_bits = jnp.maximum(253 - offset[:, 0], 1)  # 2**(126 - offset), biased exponent
        col = g * jax.lax.bitcast_convert_type(exp_bits << 23, jnp.float32)
        col = jnp.where(row_nan, jnp.nan, col)
        scales = s32.astype(jnp.uint8)
    return list(_DEQUANT[cfg.dequant](codes, scales, offset, spec)), col


# ----------------------------------------------------------------------------- FP4 decode

# The FP4 codes of a row are read as 16-bit words (``_codes_u16``): word m holds the codes of D
# positions 4m .. 4m+3 in its nibbles 0 .. 3 (little-endian bytes, low nibble first), and the
# kernel decodes them into four tiles, tile t holding positions 4m + t. Every output element
# then comes from one input element at the same nibble of each 16-bit lane, so a 32-bit register
# of two words (two neighbouring positions of the matrix unit's operand) decodes to a bf16 pair
# with shifts and masks alone, with no byte regrouping. For nibble t, two shifted copies of the
# register bring its sign to bit 15 and its 3 magnitude bits to bits 8..6 of each lane; one
# masked merge gives bf16 pairs worth code * 2**-126 (the 0.5 code is a bf16 subnormal; bf16
# arithmetic keeps subnormals), and ``mul.bf16x2`` applies the block scales (as fp4_matmul's
# "asm" decode). Operands: $0 the output pair, $1 the code words, $2 the scale pair.
_NIBBLE_ASM = """
{{
.reg .b32 a, b;
{sign}
{mag}
and.b32 b, b, 0x01C001C0;
and.b32 a, a, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 $0, a, $2;
}}
"""
_NIBBLE_SHIFTS = (  # nibble t -> (sign copy, magnitude copy) of the code words $1
    ("shl.b32 a, $1, 12;", "shl.b32 b, $1, 6;"),
    ("shl.b32 a, $1, 8;", "shl.b32 b, $1, 2;"),
    ("shl.b32 a, $1, 4;", "shr.b32 b, $1, 2;"),
    ("mov.b32 a, $1;", "shr.b32 b, $1, 6;"),
)
# Nibbles 0 and 1 need both copies shifted left: one multiply of the isolated nibble makes both
# (x * (2**i + 2**j) = x << i | x << j, the copies in disjoint bits of each lane, no carry).
_NIBBLE_IMAD = """
{{
.reg .b32 a;
and.b32 a, $1, {mask};
mul.lo.u32 a, a, {mult};
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 $0, a, $2;
}}
"""
_NIBBLE_ASMS = (
    _NIBBLE_IMAD.format(mask="0x000F000F", mult=(1 << 12) + (1 << 6)),
    _NIBBLE_IMAD.format(mask="0x00F000F0", mult=(1 << 8) + (1 << 2)),
    *(_NIBBLE_ASM.format(sign=a, mag=b) for a, b in _NIBBLE_SHIFTS[2:]),
)
_FP4_PARTS = len(_NIBBLE_ASMS)


def _codes_u16(codes: jax.Array) -> jax.Array:
    """FP4 codes [..., D/2] (bytes) viewed as 16-bit words [..., D/4] (the same bytes)."""
    codes = jax.lax.bitcast_convert_type(codes, jnp.uint8) if codes.dtype != jnp.uint8 else codes
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return jax.lax.bitcast_convert_type(pairs, jnp.uint16)


def _codes_u8(words: jax.Array) -> jax.Array:
    """Inverse of ``_codes_u16``: [..., D/4] uint16 -> [..., D/2] uint8."""
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(
        *words.shape[:-1], words.shape[-1] * 2
    )


def _expand_scales(s, offset, fmt, n):
    """Block-scale bytes [R, groups] -> bf16 [R, n] of ``scale * 2**offset``, one per code word."""
    rows, groups = s.shape
    scale = jax.lax.bitcast_convert_type(scale_bf16_bits(s, offset, fmt), jnp.bfloat16)
    return jnp.broadcast_to(scale[:, :, None], (rows, groups, n // groups)).reshape(rows, n)


def _dequant_nibbles_asm(words, s, offset, fmt):
    """Code words [R, D/4] uint16 and scale bytes [R, D/block] -> the four tiles of D positions
    4m + t, bf16 [R, D/4] each, worth ``code * scale * 2**(offset - 126)`` (exact; GPU only)."""
    rows, n = words.shape
    scale = _expand_scales(s, offset, fmt, n)
    out = jax.ShapeDtypeStruct((rows, n), jnp.bfloat16)
    return tuple(
        plgpu.elementwise_inline_asm(
            asm, args=[words, scale], constraints="=r,r,r", pack=2, result_shape_dtypes=[out]
        )[0]
        for asm in _NIBBLE_ASMS
    )


def _dequant_nibbles_portable(words, s, offset, fmt):
    """As ``_dequant_nibbles_asm``, in plain jnp (``fp4_matmul``'s portable decode)."""
    even, odd = dequant_portable(_codes_u8(words), s, offset, fmt)  # D positions 2j, 2j + 1
    return even[:, 0::2], odd[:, 0::2], even[:, 1::2], odd[:, 1::2]


_DEQUANT = {"asm": _dequant_nibbles_asm, "portable": _dequant_nibbles_portable}


def _decode_attention_kernel(
    len_ref, *refs, fmt, cfg, n_parts, n_k, group, sm_scale, window, fused
):
    """One (``cfg.heads_per_program`` KV heads, split, sequence) program; ``group``: its query
    rows (the heads' query groups one after the other). Refs, in order: [slot] (fused), q
    parts, K and V cache operands, [the new token's stored K and V rows] (fused); outputs:
    o parts, m, l, [the K and V cache operands again, aliased] (fused)."""
    refs = list(refs)
    slot_ref = refs.pop(0) if fused else None
    take = lambda n: [refs.pop(0) for _ in range(n)]  # noqa: E731
    q_refs, k_refs, v_refs = take(n_parts), take(n_k), take(n_k)
    if fused:
        row_refs = take(2 * n_k)
    o_refs = take(n_parts)
    m_ref, l_ref = take(2)
    split = pl.program_id(1)
    bk = cfg.block_k
    rows = max(_MIN_ROWS, _next_pow2(group))
    row_mask = jnp.arange(rows) < group

    # Cache slots [lo, hi) are read from the cache; with the fused append, the new token (slot
    # ``hi`` when ``slot >= 0``) comes from its operands and is attended by split 0 only.
    hi = len_ref[...]
    new = jnp.logical_and(split == 0, slot_ref[...] >= 0) if fused else None
    end = hi + (slot_ref[...] >= 0).astype(jnp.int32) if fused else hi
    lo = jnp.maximum(end - window, 0) if window is not None else jnp.int32(0)
    lo_aligned = (lo // bk) * bk
    n_blocks = jnp.maximum(pl.cdiv(hi - lo_aligned, bk), 0)
    per_split = pl.cdiv(n_blocks, cfg.num_splits)
    first = split * per_split
    n_steps = jnp.clip(n_blocks - first, 0, per_split)

    qs = [plgpu.load(r, mask=row_mask[:, None], other=0.0) for r in q_refs]
    logit_scale = np.float32(sm_scale * _LOG2E)  # softmax in base 2
    dims = (((1,), (1,)), ((), ()))  # [rows, d] x [bk, d] -> [rows, bk]

    hp = cfg.heads_per_program
    cols = jnp.arange(bk * hp)
    # column j: slot j // hp of head j % hp; row r: a query of head r // (group // hp)
    own_head = (cols % hp)[None, :] == (jnp.arange(rows) // (group // hp))[:, None]

    def body(t, carry):
        accs, m, l = carry
        start = lo_aligned + (first + t) * bk
        pos = start + cols // hp if hp > 1 else start + cols
        valid = (pos >= lo) & (pos < hi)
        k_parts, k_col = _load_tile(k_refs, start, cfg, fmt)
        s = sum(
            jax.lax.dot_general(q, k, dims, preferred_element_type=jnp.float32)
            for q, k in zip(qs, k_parts, strict=True)
        )
        if k_col is None:
            s = s * logit_scale
        else:
            s = s * (k_col * logit_scale)[None, :]
        s = jnp.where(valid[None, :] & own_head if hp > 1 else valid[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        v_parts, v_col = _load_tile(v_refs, start, cfg, fmt)
        if v_col is not None:
            p = jnp.where(valid[None, :], p * v_col[None, :], 0.0)
        if fmt in ("bf16", "fp8"):
            # Stale slots may hold anything: 0 * NaN would reach the sum. FP4 tiles decode to
            # finite values from any bytes, and their column scale is masked above.
            v_parts = [jnp.where(valid[:, None], v, 0) for v in v_parts]
        p = p.astype(jnp.bfloat16)
        accs = tuple(
            acc * alpha[:, None] + jnp.dot(p, v, preferred_element_type=jnp.float32)
            for acc, v in zip(accs, v_parts, strict=True)
        )
        return accs, m_new, l

    d_part = q_refs[0].shape[-1]
    accs = tuple(jnp.zeros((rows, d_part), jnp.float32) for _ in range(n_parts))
    m = jnp.full((rows,), _NEG_INIT, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    accs, m, l = jax.lax.fori_loop(0, n_steps, body, (accs, m, l))
    if fused:
        k_new, v_new = (
            _decode_tile(_one_row(rs), cfg, fmt) for rs in (row_refs[:n_k], row_refs[n_k:])
        )
        accs, m, l = _attend_new_token(qs, k_new, v_new, new, logit_scale, accs, m, l)

        @pl.when(new)
        def _write():  # the cache operands' outputs alias their inputs: one row each
            slot = slot_ref[...]
            for row_ref, out_ref in zip(row_refs, refs, strict=True):
                out_ref[slot] = row_ref[...]

    for o_ref, acc in zip(o_refs, accs, strict=True):
        plgpu.store(o_ref, acc, mask=row_mask[:, None])
    plgpu.store(m_ref, m, mask=row_mask)
    plgpu.store(l_ref, l, mask=row_mask)


def _one_row(refs):
    """The new token's stored row (refs [X] or [] each) as one-row operands [1, X] / [1]."""
    return [r[...][None] for r in refs]


def _attend_new_token(qs, k_new, v_new, new, logit_scale, accs, m, l):
    """Fold the new token into the online softmax (where ``new``; a no-op elsewhere).

    qs: the q parts [rows, d] bf16; k_new / v_new: its K and V as ``_decode_tile`` returns
    them for one row (parts [1, d] bf16 and column scale [1] or None), exactly as the cache's
    slots decode.
    """
    (k_parts, k_col), (v_parts, v_col) = k_new, v_new
    s = sum(
        jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32), axis=1)
        for q, k in zip(qs, k_parts, strict=True)
    )
    s = s * (logit_scale if k_col is None else k_col * logit_scale)
    s = jnp.where(new, s, -jnp.inf)
    m_new = jnp.maximum(m, s)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new)
    pv = p if v_col is None else p * v_col
    accs = tuple(
        acc * alpha[:, None] + jnp.where(new, pv[:, None] * v.astype(jnp.float32), 0.0)
        for acc, v in zip(accs, v_parts, strict=True)
    )
    return accs, m_new, l * alpha + p


def resolve_config(q, k, v, window, config, interpret):
    """Validate q and the K and V buffers; returns (cache format, the tiling a call runs:
    ``config`` or ``default_config``, with the portable decode in interpret mode)."""
    fmt, (b, s, hkv, _) = check_shapes(q, k, v, window)
    cfg = config or default_config(b, s, hkv, fmt)
    if s % cfg.block_k:
        raise ValueError(f"decode_attention: cache length {s} is not a multiple of {cfg.block_k}")
    if interpret:
        cfg = dataclasses.replace(cfg, dequant="portable")
    return fmt, cfg


def _q_parts(x: jax.Array, fmt: CacheFormat) -> list[jax.Array]:
    """[..., D] -> for FP4 caches, its D positions 4m + t, t = 0..3 (the decoded tiles)."""
    if fmt in ("nvfp4", "mxfp4"):
        return [x[..., t::_FP4_PARTS] for t in range(_FP4_PARTS)]
    return [x]


def decode_attention_triton(
    q, k_ops, v_ops, lengths, fmt, cfg, sm_scale, window, interpret, append=None
):
    """The kernel over the cache operands (``kv_layout.operands``, [B, S, Hkv, ...] each):
    q [B, Hq, D], lengths [B] int32 (valid slots; the new token not counted with ``append``),
    ``cfg`` a ``DecodeAttentionConfig`` (``resolve_config``).

    ``append``: None, or (slots [B] int32, stored rows) for the fused append: the new token's
    rows [B, Hkv, ...], one per cache operand (K's then V's). Returns (out [B, Hq, D]
    bf16, the written cache operands (empty without ``append``)).
    """
    b, s, hkv = k_ops[0].shape[:3]
    hq, d = q.shape[1:]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    fp4_cache = fmt in ("nvfp4", "mxfp4")
    if fp4_cache:  # the codes as 16-bit words (``_codes_u16``), the cache's rows too
        k_ops = [_codes_u16(k_ops[0]), *k_ops[1:]]
        v_ops = [_codes_u16(v_ops[0]), *v_ops[1:]]
        if append is not None:
            slots, extra = append
            nk = len(k_ops)
            extra = [_codes_u16(a) if i % nk == 0 else a for i, a in enumerate(extra)]
            append = (slots, extra)
    if append is not None or hkv % cfg.heads_per_program:
        cfg = dataclasses.replace(cfg, heads_per_program=1)
    hp = cfg.heads_per_program
    group = hq // hkv * hp  # query rows per program
    hkv //= hp  # programs per sequence and split
    rows = max(_MIN_ROWS, _next_pow2(group))
    splits = cfg.num_splits

    q_parts = _q_parts(q.astype(jnp.bfloat16).reshape(b, hkv, group, d), fmt)
    dp = q_parts[0].shape[-1]

    heads = None if hp == 1 else hp

    def cache_spec(a):
        if a.ndim == 4:
            return pl.BlockSpec((None, s, heads, a.shape[3]), lambda h, j, i: (i, 0, h, 0))
        return pl.BlockSpec((None, s, heads), lambda h, j, i: (i, 0, h))

    def row_spec(a):  # [B, Hkv, ...] -> one (sequence, KV head)'s row; [1, 1]: shared
        if a.shape == (1, 1):
            return pl.BlockSpec((None, None), lambda h, j, i: (0, 0))
        return pl.BlockSpec(
            (None, None, *a.shape[2:]), lambda h, j, i: (i, h) + (0,) * (a.ndim - 2)
        )

    cache_ops = k_ops + v_ops
    in_specs = (
        [pl.BlockSpec((None,), lambda h, j, i: (i,))]
        + [pl.BlockSpec((None, None, rows, dp), lambda h, j, i: (i, h, 0, 0))] * len(q_parts)
        + [cache_spec(a) for a in cache_ops]
    )
    operands = [lengths.astype(jnp.int32), *q_parts, *cache_ops]
    part_shape = jax.ShapeDtypeStruct((b, hkv, splits, group, dp), jnp.float32)
    stat_shape = jax.ShapeDtypeStruct((b, hkv, splits, group), jnp.float32)
    out_specs = [pl.BlockSpec((None, None, None, rows, dp), lambda h, j, i: (i, h, j, 0, 0))] * len(
        q_parts
    ) + [pl.BlockSpec((None, None, None, rows), lambda h, j, i: (i, h, j, 0))] * 2
    out_shape = [part_shape] * len(q_parts) + [stat_shape] * 2
    aliases = {}
    if append is not None:
        slots, extra = append
        in_specs = (
            in_specs[:1]
            + [pl.BlockSpec((None,), lambda h, j, i: (i,))]
            + in_specs[1:]
            + [row_spec(a) for a in extra]
        )
        first_cache = 2 + len(q_parts)
        operands = [operands[0], slots, *operands[1:], *extra]
        out_specs += [cache_spec(a) for a in cache_ops]
        out_shape += [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in cache_ops]
        n_out = len(q_parts) + 2
        aliases = {first_cache + i: n_out + i for i in range(len(cache_ops))}
    kernel = functools.partial(
        _decode_attention_kernel,
        fmt=fmt,
        cfg=cfg,
        n_parts=len(q_parts),
        n_k=len(k_ops),
        group=group,
        sm_scale=sm_scale,
        window=window,
        fused=append is not None,
    )
    outs = pl.pallas_call(
        kernel,
        grid=(hkv, splits, b),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"decode_attention_{fmt}" + ("_append" if append is not None else ""),
    )(*operands)
    n = len(q_parts)
    parts = combine_splits(outs[:n], outs[n], outs[n + 1])
    out = parts[0] if len(parts) == 1 else jnp.stack(parts, axis=-1).reshape(b, hkv, group, d)
    written = list(outs[n + 2 :])
    if fp4_cache and written:
        nk = len(k_ops)
        written = [_codes_u8(a) if i % nk == 0 else a for i, a in enumerate(written)]
    return out.reshape(b, hq, d).astype(jnp.bfloat16), written
