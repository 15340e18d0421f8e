"""Bytes per token of the compact guidance cache, and of full guidance (TRACE section 4).

Plain numbers in: the caller lists the quantization sites of its model with their per-token
shapes (from a ``ModelConfig``) and says which layers are guided::

    sites = [SiteSize("kv.k", l, (cfg.num_kv_heads, cfg.head_dim)) for l in range(L)] + ...
    sizes = guidance_bytes_per_token(sites, "nvfp4", guided_layers=range(L // 2, L))
    sizes.metrics()  # {"guidance/bytes_per_token": ..., "guidance/ratio_to_full": ...}

Compact guidance: at the sites of the guided layers, 1 mantissa bit per element, the block
scales and (NVFP4, per-row global scale) one FP32 scale per row. Full guidance: the 4-bit code
of every element, the block scales and the global scales, at every site of every layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable
from typing import Literal, NamedTuple

from trace_jax import fp4
from trace_jax.model import ModelConfig, QuantPolicy

GlobalScale = Literal["row", "tensor"]


class SiteSize(NamedTuple):
    """One quantization site of one layer.

    Attributes:
      name: the site, e.g. "kv.k" or "experts.down.act" (used in error messages only).
      layer: its layer index.
      shape: the per-token shape, quantized along its last axis: ``(H,)`` for the activation
        entering the gate/up matmuls, ``(k, I)`` for the down matmul's input (one row per routed
        slot), ``(Hkv, D)`` for K or V.
    """

    name: str
    layer: int
    shape: tuple[int, ...]


def _check(site: SiteSize, fmt: fp4.FormatSpec) -> None:
    if not site.shape or site.shape[-1] % fmt.block_size:
        raise ValueError(
            f"site {site.name} of layer {site.layer}: per-token shape {site.shape} has no last "
            f"axis that is a multiple of the {fmt.name} block size {fmt.block_size}"
        )


def _per_token(nbytes, shape: tuple[int, ...]) -> int:
    """Bytes one more token adds to a [tokens, *shape] tensor: per-row scales count, a
    per-tensor scale (amortised over all tokens) does not."""
    return nbytes((2, *shape)) - nbytes((1, *shape))


def site_compact_bytes(site: SiteSize, fmt: str | fp4.FormatSpec, global_scale: GlobalScale) -> int:
    """Bytes per token of the compact record (1 mantissa bit + scales) of one site."""
    spec = fp4.get_format(fmt)
    _check(site, spec)
    return _per_token(lambda s: fp4.guidance_nbytes(s, spec, -1, global_scale), tuple(site.shape))


def site_full_bytes(site: SiteSize, fmt: str | fp4.FormatSpec, global_scale: GlobalScale) -> int:
    """Bytes per token of the full record (4-bit codes + scales) of one site."""
    spec = fp4.get_format(fmt)
    elements = math.prod(site.shape)
    # the compact record with each 1-bit mantissa widened to the 4-bit code
    return site_compact_bytes(site, spec, global_scale) + 3 * elements // 8


@dataclasses.dataclass(frozen=True)
class GuidanceBytes:
    """Attributes:
    compact: bytes per token of the compact guidance at the guided sites.
    full: bytes per token of full guidance at all sites of all layers.
    guided_elements: quantized elements per token at the guided sites.
    elements: quantized elements per token at all sites.
    """

    compact: int
    full: int
    guided_elements: int
    elements: int

    @property
    def ratio_to_full(self) -> float:
        """compact / full (the paper's "~6x less" is 1 / this)."""
        return self.compact / self.full if self.full else 0.0

    @property
    def bits_per_guided_element(self) -> float:
        """Compact bits per guided element, scales included."""
        return 8.0 * self.compact / self.guided_elements if self.guided_elements else 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "guidance/bytes_per_token": float(self.compact),
            "guidance/full_bytes_per_token": float(self.full),
            "guidance/ratio_to_full": self.ratio_to_full,
            "guidance/bits_per_guided_element": self.bits_per_guided_element,
        }


def guidance_bytes_per_token(
    sites: Iterable[SiteSize | tuple[str, int, tuple[int, ...]]],
    fmt: str | fp4.FormatSpec,
    guided_layers: Collection[int],
    *,
    global_scale: GlobalScale = "row",
) -> GuidanceBytes:
    """Compact and full guidance bytes per token.

    Args:
      sites: every quantization site that can be guided (activations and K/V), in all layers,
        as ``SiteSize`` or ``(name, layer, per-token shape)``.
      fmt: "nvfp4", "mxfp4" or a ``FormatSpec``.
      guided_layers: the layer indices whose sites keep compact guidance.
      global_scale: "row" (one FP32 scale per token and row, the policy default for NVFP4) or
        "tensor" (per batch, counted as 0 bytes per token). MXFP4 has none either way.
    """
    spec = fp4.get_format(fmt)
    mode: GlobalScale = global_scale if spec.has_global_scale else "tensor"
    guided = set(guided_layers)
    compact = full = guided_elements = elements = 0
    for raw in sites:
        site = SiteSize(raw[0], raw[1], tuple(raw[2]))
        n = math.prod(site.shape)
        full += site_full_bytes(site, spec, mode)
        elements += n
        if site.layer in guided:
            compact += site_compact_bytes(site, spec, mode)
            guided_elements += n
    return GuidanceBytes(
        compact=compact, full=full, guided_elements=guided_elements, elements=elements
    )


def model_sites(cfg: ModelConfig, policy: QuantPolicy) -> list[SiteSize]:
    """Every activation and K/V site of ``cfg`` that ``policy`` quantizes, with its per-token
    shape as the model records it: ``experts.gate_up.act`` (H,), ``experts.down.act`` (k, I)
    on MoE layers, ``kv.k`` / ``kv.v`` (Hkv, D) on every layer."""
    sites = []
    for layer in range(cfg.num_layers):
        if policy.expert_acts != "off" and cfg.is_moe_layer(layer):
            sites.append(SiteSize("experts.gate_up.act", layer, (cfg.hidden_size,)))
            sites.append(
                SiteSize(
                    "experts.down.act",
                    layer,
                    (cfg.num_experts_per_tok, cfg.moe_intermediate_size),
                )
            )
        if policy.kv != "off":
            for name in ("kv.k", "kv.v"):
                sites.append(SiteSize(name, layer, (cfg.num_kv_heads, cfg.head_dim)))
    return sites


def model_guidance_bytes(cfg: ModelConfig, policy: QuantPolicy) -> GuidanceBytes:
    """Guidance bytes per token of a model under a rollout policy: compact records at the sites
    the policy records (``record`` mode, in its guided layers), full guidance at all its sites."""
    sites = model_sites(cfg, policy)
    recorded = [
        s
        for s in sites
        if policy.site_mode("kv" if s.name.startswith("kv.") else "act", s.layer, cfg.num_layers)
        == "record"
    ]
    compact = guidance_bytes_per_token(
        recorded,
        policy.fmt,
        guided_layers=range(cfg.num_layers),
        global_scale=policy.act_global_scale,
    )
    full = guidance_bytes_per_token(
        sites, policy.fmt, guided_layers=(), global_scale=policy.act_global_scale
    )
    return dataclasses.replace(compact, full=full.full, elements=full.elements)
