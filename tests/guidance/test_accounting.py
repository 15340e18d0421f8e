"""Guidance bytes per token against hand-computed values and against real records' sizes."""

import jax
import numpy as np
import pytest
from shapes import MODEL, PROMPTS, ROLLOUT, rollout_config

from trace_jax import fp4
from trace_jax.guidance import (
    SiteSize,
    guidance_bytes_per_token,
    site_compact_bytes,
    site_full_bytes,
)


def tiny_sites(head_dim: int = 16) -> list[tuple[str, int, tuple[int, ...]]]:
    """4 layers; H = 64, top-2 of experts with I = 32, 2 KV heads of ``head_dim``."""
    sites = []
    for layer in range(4):
        sites += [
            ("experts.gate_up.act", layer, (64,)),
            ("experts.down.act", layer, (2, 32)),
            ("kv.k", layer, (2, head_dim)),
            ("kv.v", layer, (2, head_dim)),
        ]
    return sites


def test_nvfp4_per_row_bytes_by_hand():
    # per row of K elements: compact K/8 mantissa bytes + K/16 E4M3 scales + 4 (FP32 row scale);
    # full K/2 code bytes + K/16 + 4
    assert site_compact_bytes(SiteSize("a", 0, (64,)), "nvfp4", "row") == 8 + 4 + 4
    assert site_full_bytes(SiteSize("a", 0, (64,)), "nvfp4", "row") == 32 + 4 + 4
    assert site_compact_bytes(SiteSize("d", 0, (2, 32)), "nvfp4", "row") == 2 * (4 + 2 + 4)
    assert site_full_bytes(SiteSize("d", 0, (2, 32)), "nvfp4", "row") == 2 * (16 + 2 + 4)
    assert site_compact_bytes(SiteSize("k", 0, (2, 16)), "nvfp4", "row") == 2 * (2 + 1 + 4)
    assert site_full_bytes(SiteSize("k", 0, (2, 16)), "nvfp4", "row") == 2 * (8 + 1 + 4)
    # a per-tensor global scale is amortised over the batch: no bytes per token
    assert site_compact_bytes(SiteSize("a", 0, (64,)), "nvfp4", "tensor") == 8 + 4

    sizes = guidance_bytes_per_token(tiny_sites(), "nvfp4", guided_layers={2, 3})
    per_layer_compact = 16 + 20 + 14 + 14
    per_layer_full = 40 + 44 + 26 + 26
    assert sizes.compact == 2 * per_layer_compact == 128
    assert sizes.full == 4 * per_layer_full == 544
    assert (sizes.guided_elements, sizes.elements) == (2 * 192, 4 * 192)
    assert sizes.ratio_to_full == pytest.approx(128 / 544)
    assert sizes.bits_per_guided_element == pytest.approx(8 * 128 / 384)
    metrics = sizes.metrics()
    assert metrics["guidance/bytes_per_token"] == 128.0
    assert metrics["guidance/ratio_to_full"] == pytest.approx(128 / 544)


def test_mxfp4_bytes_by_hand():
    # per row: compact K/8 + K/32 E8M0 scales, full K/2 + K/32; MXFP4 has no global scale, so
    # asking for per-row global scales changes nothing
    sizes = guidance_bytes_per_token(tiny_sites(head_dim=32), "mxfp4", guided_layers=[3])
    assert sizes.compact == (8 + 2) + 2 * (4 + 1) * 3
    assert sizes.full == 4 * ((32 + 2) + 2 * (16 + 1) * 3)
    assert sizes == guidance_bytes_per_token(
        tiny_sites(head_dim=32), "mxfp4", guided_layers=[3], global_scale="tensor"
    )


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("shape", [(64,), (2, 32)])
def test_bytes_per_token_match_real_records(fmt, shape):
    # T tokens of a site: the rollout's Guidance and QTensor hold exactly T times the bytes
    t = 5
    mode = "row" if fmt == "nvfp4" else "tensor"
    x = jax.random.normal(jax.random.key(0), (t, *shape))
    qt = fp4.quantize(x, fmt, global_scale=mode)
    g = fp4.rollout_guidance(qt)
    site = SiteSize("s", 0, shape)
    scalar = 4 if fmt == "mxfp4" else 0  # MXFP4's placeholder global scale of 1.0, per tensor
    assert t * site_compact_bytes(site, fmt, mode) == g.nbytes - scalar
    assert t * site_full_bytes(site, fmt, mode) == qt.nbytes - scalar
    assert int(np.prod(shape)) * t * 4 // 8 <= qt.nbytes  # sanity: 4 bits per code at least


def test_no_guided_layers_and_bad_shapes():
    sizes = guidance_bytes_per_token(tiny_sites(), "nvfp4", guided_layers=())
    assert sizes.compact == 0 and sizes.full == 544 and sizes.ratio_to_full == 0.0
    with pytest.raises(ValueError, match=r"site kv.k of layer 0.*block size 32"):
        guidance_bytes_per_token(tiny_sites(head_dim=16), "mxfp4", guided_layers=[0])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_model_accounting_matches_the_engines_record_buffers(fmt):
    from flax import nnx

    from trace_jax.guidance import model_guidance_bytes
    from trace_jax.model import QuantPolicy, Transformer
    from trace_jax.rollout import RolloutEngine

    policy = QuantPolicy.rollout(fmt)
    model = Transformer(MODEL, nnx.Rngs(0))

    def record_bytes(max_len):
        eng = RolloutEngine(model, policy, rollout_config(fmt, max_len=max_len))
        return sum(g.nbytes for g in eng.start(len(PROMPTS)).guidance.values())

    # per token of each sequence: the difference of two buffer lengths (per-tensor placeholders
    # cancel); of tests/shapes.py's engine and one with a slot more (NVFP4: the rollout tests'
    # empty state, its program)
    more = record_bytes(ROLLOUT.max_len + 1) - record_bytes(ROLLOUT.max_len)
    assert more == len(PROMPTS) * model_guidance_bytes(MODEL, policy).compact


@pytest.mark.parametrize("preset", ["tiny", "small", "qwen3-30b-a3b", "qwen3-235b-a22b"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_compact_guidance_is_at_most_1_6_bits_per_element_plus_scales(preset, fmt):
    from trace_jax.guidance import model_guidance_bytes
    from trace_jax.model import ModelConfig, QuantPolicy

    cfg = ModelConfig.preset(preset)
    half = model_guidance_bytes(cfg, QuantPolicy.rollout(fmt))
    every = model_guidance_bytes(cfg, QuantPolicy.rollout(fmt, guided_layers="all"))
    block_only = model_guidance_bytes(cfg, QuantPolicy.rollout(fmt, act_global_scale="tensor"))
    # 1 mantissa bit + an 8-bit block scale per 16 (NVFP4) or 32 (MXFP4) elements
    assert block_only.bits_per_guided_element == (1.5 if fmt == "nvfp4" else 1.25)
    # + one FP32 global scale per row (NVFP4): rows are at least head_dim long; MXFP4 has none
    row_bits = 32 / min(cfg.head_dim, cfg.moe_intermediate_size, cfg.hidden_size)
    if fmt == "nvfp4":
        assert 1.5 < half.bits_per_guided_element <= 1.5 + row_bits
    else:
        assert half.bits_per_guided_element == 1.25
    assert every.compact == 2 * half.compact  # the deeper half of an even layer count
    assert every.full == half.full and 1 / half.ratio_to_full > 4.5  # vs full guidance
