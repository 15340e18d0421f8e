"""Decode attention over the rollout KV cache (bf16, fp8, NVFP4, MXFP4), dequantized in-kernel.

One new query token per sequence attends to the cache slots ``[lo, length)`` of its sequence
(``lo = length - window`` with a sliding window, else 0). K and V are the cache's stored types
(``trace_jax.rollout.kv_cache``): bf16 arrays, ``FP8Tensor`` or ``fp4.QTensor`` quantized along D
with one global scale per token and head. The kernel reads those buffers in place; nothing is
repacked, so the cache can be written every step.

Kernel layout (Pallas, Triton lowering):

* Grid ``(Hkv, splits, B)``: one program per KV head, split of the sequence and sequence. The
  KV-head axis varies fastest, so the programs that share a token's 32-byte sectors of block and
  global scales run together and the sectors are fetched from HBM once.
* GQA: the ``G = Hq / Hkv`` query heads of a KV head are the rows of one [G, D] tile (padded to
  16 rows for the matrix unit), so K and V are read once per KV head.
* Split-K over the sequence (flash-decoding): each program walks ``block_k``-token steps of its
  share of ``[lo, length)`` with an online softmax and writes an unnormalised fp32 partial output
  with its running max and sum; ``_combine`` merges the splits in XLA.
* FP4: the packed codes are read as 16-bit words of four codes and decoded into four
  [block_k, D/4] bf16 tiles, tile t holding the D positions 4m + t (exact: E2M1 x block scale
  needs 6 significant bits; ``_NIBBLE_ASM``); q is split into the same four column sets in XLA,
  so ``q.k = sum_t q_t.k_t``, and the output comes back as four parts. Triton loads the code
  words straight into the matrix unit's operand layout, where each decoded bf16 pair comes from
  one 32-bit register with shifts and masks alone. The global scale (and the decode's
  power-of-two offset) is per token, so it multiplies a column of the logits for K and a column
  of the probabilities for V instead of every element.
* FP8: E4M3 values convert exactly to bf16; the per-token scale is applied as for FP4.

``decode_attention_reference`` is the pure-JAX definition (``kv_cache.read`` + softmax).
``kv_append`` writes one new token into the cache in place.
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

from pallas_kernels import fp4_decode_attention_mgpu as tc
from pallas_kernels.fp4_matmul import _dequant_portable, _scale_bf16_bits
from trace_jax import fp4
from trace_jax.fp4.formats import E8M0_NAN
from trace_jax.rollout import kv_cache

CacheFormat = kv_cache.CacheFormat
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


def default_splits(batch: int, kv_heads: int, steps: int) -> int:
    """Splits per (sequence, KV head) for about 1024 programs, without a split shorter than 4
    of the ``steps`` loop steps (4 to 8 splits were within noise of each other at B=32)."""
    splits = 1
    while batch * kv_heads * splits < 1024 and steps // (splits * 2) >= 4:
        splits *= 2
    return splits


def _prev_pow2(v: int) -> int:
    return 1 << max(0, v.bit_length() - 1)


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


# ----------------------------------------------------------------------------- stored cache


def cache_format(stored: kv_cache.Stored) -> CacheFormat:
    """The format name of a stored K or V buffer."""
    if isinstance(stored, fp4.QTensor):
        return stored.fmt.name
    if isinstance(stored, kv_cache.FP8Tensor):
        return "fp8"
    if stored.dtype == jnp.bfloat16:
        return "bf16"
    raise TypeError(f"decode_attention: unsupported cache array of dtype {stored.dtype}")


def _cache_shape(stored: kv_cache.Stored) -> tuple[int, int, int, int]:
    if isinstance(stored, fp4.QTensor):
        if stored.axis != 3 or not stored.per_row_global_scale:
            raise ValueError(
                "decode_attention: an FP4 cache is a QTensor [B, S, Hkv, D] quantized along D "
                "with one global scale per token and head (kv_cache.to_storage)"
            )
        return stored.shape
    if isinstance(stored, kv_cache.FP8Tensor):
        return stored.values.shape
    return stored.shape


def _operands(stored: kv_cache.Stored) -> list[jax.Array]:
    """The arrays the kernel reads, [B, S, Hkv, ...] each (trailing size-1 scale axes dropped)."""
    if isinstance(stored, fp4.QTensor):
        return [stored.codes, stored.block_scales, stored.global_scale[..., 0]]
    if isinstance(stored, kv_cache.FP8Tensor):
        return [stored.values, stored.scale[..., 0]]
    return [stored]


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
    scale = jax.lax.bitcast_convert_type(_scale_bf16_bits(s, offset, fmt), jnp.bfloat16)
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
    even, odd = _dequant_portable(_codes_u8(words), s, offset, fmt)  # D positions 2j, 2j + 1
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


def _combine(o_parts, m, l):
    """Merge the splits: o_parts [B, Hkv, splits, G, d] f32, m and l [B, Hkv, splits, G] (base 2).

    Returns [B, Hkv, G, d] f32 per part; a query with no valid slot gets zeros.
    """
    m_max = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp2(m - m_max)
    total = jnp.sum(w * l, axis=2)
    inv = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    return [jnp.sum(w[..., None] * o, axis=2) * inv[..., None] for o in o_parts]


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "window", "config", "tensor_cores", "interpret")
)
def decode_attention(
    q: jax.Array,
    k: kv_cache.Stored,
    v: kv_cache.Stored,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    config: DecodeAttentionConfig | None = None,
    tensor_cores: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """Attention of one new query token per sequence over the KV cache.

    Args:
      q: [B, Hq, D] bf16, the new tokens' queries (Hq a multiple of Hkv).
      k, v: the cache's stored K and V of one layer, logical [B, S, Hkv, D]: bf16 arrays,
        ``kv_cache.FP8Tensor`` or NVFP4/MXFP4 ``fp4.QTensor`` with per-row global scales (as
        ``kv_cache.to_storage`` makes them). Both in the same format.
      lengths: [B] int32, valid slots per sequence (the new token's K/V already written, so
        ``lengths`` counts it); slots >= length are ignored whatever they hold.
      sm_scale: logit scale, 1/sqrt(D) when None.
      window: attend to the last ``window`` slots only (sliding window); None: all.
      config: tiling; ``default_config(B, S, Hkv, fmt)`` when None.
      tensor_cores: an NVFP4 cache that ``fp4_decode_attention_mgpu.supports`` takes goes to
        that kernel (Mosaic GPU, its default tiling; ``config`` is not used); other caches here.
      interpret: run the Pallas interpreter (CPU tests).
    Returns:
      [B, Hq, D] bf16 (zeros for a sequence of length 0).
    """
    fmt, cfg = _check(q, k, v, window, config, interpret)
    if tensor_cores and tc.supports(k, v, q.shape[1]):
        return tc.decode_attention_mgpu(
            q, k, v, lengths, sm_scale=sm_scale, window=window, interpret=interpret
        )
    out, _ = _attention_call(
        q, _operands(k), _operands(v), lengths, fmt, cfg, sm_scale, window, interpret
    )
    return out


@functools.partial(
    jax.jit,
    donate_argnums=(1, 2),
    static_argnames=("sm_scale", "window", "config", "tensor_cores", "interpret"),
)
def decode_attention_append(
    q: jax.Array,
    k: kv_cache.Stored,
    v: kv_cache.Stored,
    new_k: jax.Array,
    new_v: jax.Array,
    lengths: jax.Array,
    *,
    qts: tuple[fp4.QTensor | None, fp4.QTensor | None] | None = None,
    valid: jax.Array | None = None,
    sm_scale: float | None = None,
    window: int | None = None,
    config: DecodeAttentionConfig | None = None,
    tensor_cores: bool = False,
    interpret: bool = False,
) -> tuple[jax.Array, kv_cache.Stored, kv_cache.Stored]:
    """Write the new token's K and V into the cache and attend over it, in one kernel launch.

    Equal to ``kv_append_many([k, v], [new_k, new_v], lengths, qts=qts, valid=valid)`` followed
    by ``decode_attention(q, k, v, lengths + taken)``, where ``taken`` marks the sequences whose
    token was written (``valid`` and ``lengths < S``). The new token is attended from its
    stored row (decoded in the kernel as the cache's slots are), so no program reads a slot
    that another one writes. ``k`` and ``v`` are donated and updated in place. An FP8 cache,
    or one whose tiles the compiled kernel does not take, goes through the two calls above.

    Args:
      q: [B, Hq, D] bf16, the new tokens' queries.
      k, v: the layer's stored K and V, logical [B, S, Hkv, D] (as ``decode_attention``).
      new_k, new_v: [B, Hkv, D] or [B, 1, Hkv, D], the new token's K and V (the KV sites'
        outputs).
      lengths: [B] int32, the first free slot of each sequence (the new token's slot).
      qts: for FP4 caches, the ``QTensor`` each KV site quantized (as ``kv_append``).
      valid: [B] bool, which sequences take a token (all when None).
      sm_scale, window, config, interpret: as ``decode_attention``.
      tensor_cores: as ``decode_attention``; that kernel writes the new rows too (the program
        whose tile holds the new slot puts them into its copy of the tile and the cache).
    Returns:
      (out [B, Hq, D] bf16, updated k, updated v).
    """
    fmt, cfg = _check(q, k, v, window, config, interpret)
    b, s = _cache_shape(k)[:2]
    qts = list(qts) if qts is not None else [None, None]
    ok = jnp.ones((b,), bool) if valid is None else valid.reshape(b)
    taken = ok & (lengths < s) & (lengths >= 0)
    if tensor_cores and tc.supports(k, v, q.shape[1]):  # the tensor-core kernel writes them
        news, _ = _new_storage([k, v], [new_k, new_v], qts)
        slots = jnp.where(taken, lengths, -1).astype(jnp.int32)
        append = (slots, *news)
        out, written = tc.attend(
            q, k, v, lengths + taken, sm_scale, window, None, interpret, append
        )
        k, v = _from_operands([k, v], written)
        return out, k, v
    if fmt == "fp8" or not (interpret or kernel_fits([k, v])):
        k, v = kv_append_many(
            [k, v], [new_k, new_v], lengths, qts=qts, valid=ok, interpret=interpret
        )
        out, _ = _attention_call(
            q, _operands(k), _operands(v), lengths + taken, fmt, cfg, sm_scale, window, interpret
        )
        return out, k, v
    news, qts = _new_storage([k, v], [new_k, new_v], qts)
    rows = [[a[:, 0] for a in _as_bytes(_operands(n))] for n in news]
    for i, qt in enumerate(qts):  # a per-tensor global scale (MXFP4's unit scale): one value
        if isinstance(qt, fp4.QTensor) and qt.global_scale.size == 1:
            rows[i][-1] = qt.global_scale.reshape(1, 1)  # read by every program; no broadcast
    slots = jnp.where(taken, lengths, -1).astype(jnp.int32)
    append = (slots, rows[0] + rows[1])
    out, written = _attention_call(
        q,
        _as_bytes(_operands(k)),
        _as_bytes(_operands(v)),
        lengths,
        fmt,
        cfg,
        sm_scale,
        window,
        interpret,
        append=append,
    )
    k, v = _from_operands([k, v], written)
    return out, k, v


def check_shapes(q, k, v, window, who: str = "decode_attention"):
    """Validate q, the cache and the window (shared with the tensor-core kernel); returns
    (cache format, (B, S, Hkv, D))."""
    fmt = cache_format(k)
    if cache_format(v) != fmt:
        raise ValueError(f"{who}: K is {fmt} but V is {cache_format(v)}")
    b, s, hkv, d = _cache_shape(k)
    if _cache_shape(v) != (b, s, hkv, d):
        raise ValueError(f"{who}: K {(b, s, hkv, d)} and V {_cache_shape(v)} differ")
    bq, hq, dq = q.shape
    if bq != b or dq != d or hq % hkv:
        raise ValueError(f"{who}: q {q.shape} does not fit a [B={b}, Hkv={hkv}] cache")
    if window is not None and window < 1:
        raise ValueError(f"{who}: window must be >= 1, got {window}")
    return fmt, (b, s, hkv, d)


def _check(q, k, v, window, config, interpret):
    """Validate the shapes; returns (cache format, tiling)."""
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


def _as_bytes(arrays: list[jax.Array]) -> list[jax.Array]:
    """1-byte floats viewed as uint8 (the kernel writes bytes; it reads either)."""
    return [
        jax.lax.bitcast_convert_type(a, jnp.uint8)
        if a.dtype.itemsize == 1 and a.dtype != jnp.uint8
        else a
        for a in arrays
    ]


def _from_operands(stored, arrays: list[jax.Array]):
    """Rebuild stored buffers (one, or a list) from their kernel operands in leaf order,
    byte-viewed and with trailing size-1 axes dropped or not (inverse of ``_operands`` and
    ``_row_views``)."""
    old = jax.tree.leaves(stored)
    leaves = [
        (jax.lax.bitcast_convert_type(a, o.dtype) if a.dtype != o.dtype else a).reshape(o.shape)
        for a, o in zip(arrays, old, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(stored), leaves)


def _attention_call(q, k_ops, v_ops, lengths, fmt, cfg, sm_scale, window, interpret, append=None):
    """The Pallas call over the cache operands ([B, S, Hkv, ...] each).

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
    parts = _combine(outs[:n], outs[n], outs[n + 1])
    out = parts[0] if len(parts) == 1 else jnp.stack(parts, axis=-1).reshape(b, hkv, group, d)
    written = list(outs[n + 2 :])
    if fp4_cache and written:
        nk = len(k_ops)
        written = [_codes_u8(a) if i % nk == 0 else a for i, a in enumerate(written)]
    return out.reshape(b, hq, d).astype(jnp.bfloat16), written


# ----------------------------------------------------------------------------- reference


@functools.partial(jax.jit, static_argnames=("sm_scale", "window"))
def decode_attention_reference(
    q: jax.Array,
    k: kv_cache.Stored,
    v: kv_cache.Stored,
    lengths: jax.Array,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
) -> jax.Array:
    """Pure-JAX definition: ``kv_cache.read`` to float32, masked softmax, -> [B, Hq, D] bf16.

    Same arguments as ``decode_attention``.
    """
    kf = kv_cache.read(k, jnp.float32)
    vf = kv_cache.read(v, jnp.float32)
    b, s, hkv, d = kf.shape
    hq = q.shape[1]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    qg = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d)
    hp = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bhgd,bshd->bhgs", qg, kf, precision=hp) * sm_scale
    pos = jnp.arange(s)[None, :]
    valid = pos < lengths[:, None]
    if window is not None:
        valid &= pos >= lengths[:, None] - window
    logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    total = jnp.sum(p, axis=-1, keepdims=True)
    vf = jnp.where(valid[:, :, None, None], vf, 0.0)
    out = jnp.einsum("bhgs,bshd->bhgd", p, vf, precision=hp)
    out = jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)
    return out.reshape(b, hq, d).astype(jnp.bfloat16)


# ----------------------------------------------------------------------------- append


def kv_append(
    stored: kv_cache.Stored,
    value: jax.Array,
    lengths: jax.Array,
    *,
    qt: fp4.QTensor | None = None,
    valid: jax.Array | None = None,
    kernel: bool | None = None,
    interpret: bool = False,
) -> kv_cache.Stored:
    """Quantize one new token's K or V and write it at slot ``lengths[b]`` of each sequence.

    Equal to ``kv_cache.write(stored, kv_cache.to_storage(fmt, value, qt), lengths, valid)``
    for a one-token chunk. ``stored`` is donated: its buffers are updated in place (call it
    inside a jit that donates the cache, or directly: the jitted call donates its argument).

    Args:
      stored: the layer's K or V buffer, logical [B, S, Hkv, D].
      value: [B, Hkv, D] or [B, 1, Hkv, D], the new token's K or V (the KV site's output).
      lengths: [B] int32, the first free slot of each sequence.
      qt: for FP4 caches, the ``QTensor`` the KV site quantized (logical [B, 1, Hkv, D]); None:
        quantized here as the site's RTN mode does (``fp4.quantize`` along D, per-row global
        scale for NVFP4).
      valid: [B] bool, which sequences take a token (all when None); slots >= S are dropped.
      kernel: write with the one-launch Pallas kernel (``append_rows``) instead of XLA
        scatters; None: on a GPU when the shapes allow it (``kernel_fits``).
      interpret: run the kernel in the Pallas interpreter (CPU tests).
    Returns:
      the updated buffer (same type and shapes as ``stored``).
    """
    (out,) = kv_append_many(
        [stored], [value], lengths, qts=[qt], valid=valid, kernel=kernel, interpret=interpret
    )
    return out


def kv_append_many(
    stored: list[kv_cache.Stored],
    values: list[jax.Array],
    lengths: jax.Array,
    *,
    qts: list[fp4.QTensor | None] | None = None,
    valid: jax.Array | None = None,
    kernel: bool | None = None,
    interpret: bool = False,
) -> list[kv_cache.Stored]:
    """``kv_append`` of several buffers (K and V of a layer) in one kernel launch.

    Args and result as ``kv_append``, one list entry per buffer; ``stored`` is donated.
    """
    if kernel is None:
        kernel = interpret or (jax.default_backend() == "gpu" and kernel_fits(stored))
    qts = list(qts) if qts is not None else [None] * len(stored)
    return _kv_append(list(stored), list(values), lengths, qts, valid, kernel, interpret)


def kernel_fits(stored: list[kv_cache.Stored]) -> bool:
    """Whether the compiled append kernel takes these buffers: every per-token tile [Hkv, X]
    (X = D, D/2, D/block or 1) has power-of-two sides (a Triton block-shape rule)."""
    pow2 = lambda v: v & (v - 1) == 0  # noqa: E731
    return all(pow2(a.shape[2]) and pow2(a.shape[3]) for a in _row_views(stored))


def _row_views(stored: list[kv_cache.Stored]) -> list[jax.Array]:
    """Each buffer's arrays as [B, S, Hkv, X] with 1-byte floats viewed as uint8."""
    return _as_bytes(jax.tree.leaves(stored))


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("kernel", "interpret"))
def _kv_append(stored, values, lengths, qts, valid, kernel, interpret):
    b = lengths.shape[0]
    news, _ = _new_storage(stored, values, qts)
    ok = jnp.ones((b,), bool) if valid is None else valid.reshape(b)
    if not kernel:
        return [
            kv_cache.write(buf, new, lengths, ok[:, None])
            for buf, new in zip(stored, news, strict=True)
        ]
    s = kv_cache._leading(stored[0])[1]
    slots = jnp.where(ok & (lengths < s) & (lengths >= 0), lengths, -1).astype(jnp.int32)
    bufs = _row_views(stored)
    rows = [a[:, 0] for a in _row_views(news)]
    return _from_operands(stored, append_rows(bufs, rows, slots, interpret=interpret))


def _new_storage(stored, values, qts):
    """The new token's K/V in each buffer's stored form, logical [B, 1, Hkv, D]; FP4 values
    without a site ``QTensor`` are quantized as the KV site's RTN mode does (along D).

    Returns (stored forms, the ``QTensor`` each FP4 one was made from (None otherwise)).
    """
    news, used = [], []
    for buf, value, qt in zip(stored, values, qts, strict=True):
        if value.ndim == 3:
            value = value[:, None]
        fmt = cache_format(buf)
        if fmt in ("nvfp4", "mxfp4") and qt is None:
            qt = fp4.quantize(value, fmt, axis=-1, global_scale=kv_cache._site_global_scale(fmt))
        news.append(kv_cache.to_storage(fmt, value, qt))
        used.append(qt)
    return news, used


def _append_kernel(slot_ref, *refs, n):
    rows, outs = refs[:n], refs[2 * n :]
    slot = slot_ref[0]

    @pl.when(slot >= 0)
    def _write():
        for row, out in zip(rows, outs, strict=True):
            out[slot] = row[...]


def append_rows(
    bufs: list[jax.Array], rows: list[jax.Array], slots: jax.Array, *, interpret: bool = False
) -> list[jax.Array]:
    """Write one row per sequence into each buffer in place, all buffers in one launch.

    Args:
      bufs: [B, S, H, X] arrays (donate them: outputs alias inputs, only the rows are written).
      rows: [B, H, X] arrays, one per buffer, of the buffer's dtype.
      slots: [B] int32, the slot each sequence's row goes to; negative: not written.
    Returns:
      the updated buffers.
    """
    n = len(bufs)
    b, s = bufs[0].shape[:2]
    for buf, row in zip(bufs, rows, strict=True):
        if buf.ndim != 4 or buf.shape[:2] != (b, s) or row.shape != (b, *buf.shape[2:]):
            raise ValueError(f"append_rows: row {row.shape} does not fit buffer {buf.shape}")
    return pl.pallas_call(
        functools.partial(_append_kernel, n=n),
        grid=(b,),
        in_specs=[pl.BlockSpec((1,), lambda i: (i,))]
        + [pl.BlockSpec((None, *r.shape[1:]), lambda i: (i, 0, 0)) for r in rows]
        + [pl.BlockSpec((None, *a.shape[1:]), lambda i: (i, 0, 0, 0)) for a in bufs],
        out_specs=[pl.BlockSpec((None, *a.shape[1:]), lambda i: (i, 0, 0, 0)) for a in bufs],
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in bufs],
        input_output_aliases={1 + n + i: i for i in range(n)},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="kv_append",
    )(slots, *rows, *bufs)
