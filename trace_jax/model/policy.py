"""Named quantization sites and the ``QuantPolicy`` that configures them (data, not code).

The model calls a site at every place TRACE quantizes; everything else stays in the compute dtype:

    layers.{l}.experts.{gate,up,down}.w   routed-expert weights (per-expert global scale)
    layers.{l}.experts.gate_up.act        the token's hidden state entering the gate/up matmuls
    layers.{l}.experts.down.act           the SwiGLU output entering the down matmul, per slot
    layers.{l}.kv.k, layers.{l}.kv.v      K (after q/k-norm and RoPE) and V entering the cache

Activation and KV sites run in one of four modes: ``off`` (compute dtype), ``rtn`` (fake quant
with the site's own scales, vanilla QAT), ``guided`` (TRACE: ``guided_fake_quant`` with the
rollout's record) or ``record`` (rollout side: RTN, and the site's ``Guidance`` is returned).
Guided and recorded modes apply to the guided layers only; other layers fall back to ``rtn``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

from trace_jax import fp4
from trace_jax.config import ConfigError

SiteMode = Literal["off", "rtn", "guided", "record"]
GuidedLayers = Literal["last_half", "last_k", "all", "none"]


ACT_SITES = ("experts.gate_up.act", "experts.down.act")
KV_SITES = ("kv.k", "kv.v")


def site_name(layer: int, site: str) -> str:
    """``site_name(17, "experts.down.act") == "layers.17.experts.down.act"``."""
    return f"layers.{layer}.{site}"


@dataclasses.dataclass(frozen=True)
class QuantPolicy:
    """Which sites are quantized, how, and in which format.

    Attributes:
      fmt: "nvfp4" or "mxfp4".
      expert_weights: "off" or "rtn" (both paths quantize the same master weights identically).
      expert_acts: mode of the routed-expert activation sites.
      kv: mode of the K/V cache sites.
      guided_layers: which layers the guided/record modes apply to: "last_half" (the paper's
        default), "last_k" (the last ``guided_last_k``), "all" or "none".
      guided_last_k: k for "last_k".
      act_global_scale: "row" (per token / per token and head) or "tensor".
      weight_scale_rule: "max6" or "four_over_six" for the expert weights.
      weight_block_2d: 16x16 weight blocks.
      mask_outside: zero the straight-through gradient outside the representable range.
      record_codes: diagnostic mode: every quantized activation/KV site also returns its full
        ``QTensor`` under ``<site>.codes`` (for the code mismatch metrics).
    """

    fmt: Literal["nvfp4", "mxfp4"] = "nvfp4"
    expert_weights: Literal["off", "rtn"] = "off"
    expert_acts: SiteMode = "off"
    kv: SiteMode = "off"
    guided_layers: GuidedLayers = "last_half"
    guided_last_k: int = 4
    act_global_scale: Literal["row", "tensor"] = "row"
    weight_scale_rule: Literal["max6", "four_over_six"] = "max6"
    weight_block_2d: bool = False
    mask_outside: bool = False
    record_codes: bool = False

    def __post_init__(self):
        if self.guided_last_k < 0:
            raise ConfigError(f"guided_last_k: must be >= 0, got {self.guided_last_k}")
        if self.fmt == "mxfp4" and self.act_global_scale == "row":
            # MXFP4 has no global scale: its block scales already make rows independent.
            object.__setattr__(self, "act_global_scale", "tensor")

    # ------------------------------------------------------------------ presets

    @classmethod
    def bf16(cls) -> QuantPolicy:
        return cls()

    @classmethod
    def qat(cls, fmt: str = "nvfp4", **kw) -> QuantPolicy:
        """Vanilla QAT / naive FP4: RTN fake quant at every site."""
        return cls(fmt=fmt, expert_weights="rtn", expert_acts="rtn", kv="rtn", **kw)

    @classmethod
    def trace(cls, fmt: str = "nvfp4", guided_layers: GuidedLayers = "last_half", **kw):
        """Training side of TRACE: guided at the guided layers, RTN elsewhere."""
        return cls(
            fmt=fmt,
            expert_weights="rtn",
            expert_acts="guided",
            kv="guided",
            guided_layers=guided_layers,
            **kw,
        )

    @classmethod
    def rollout(cls, fmt: str = "nvfp4", guided_layers: GuidedLayers = "last_half", **kw):
        """Rollout side: FP4 everywhere, recording guidance at the guided layers."""
        return cls(
            fmt=fmt,
            expert_weights="rtn",
            expert_acts="record",
            kv="record",
            guided_layers=guided_layers,
            **kw,
        )

    # ------------------------------------------------------------------ resolution

    def is_guided_layer(self, layer: int, num_layers: int) -> bool:
        if self.guided_layers == "all":
            return True
        if self.guided_layers == "none":
            return False
        first = (
            num_layers // 2
            if self.guided_layers == "last_half"
            else num_layers - self.guided_last_k
        )
        return layer >= first

    def site_mode(self, kind: Literal["act", "kv"], layer: int, num_layers: int) -> SiteMode:
        mode = self.expert_acts if kind == "act" else self.kv
        if mode in ("guided", "record") and not self.is_guided_layer(layer, num_layers):
            return "rtn"
        return mode

    def guided_sites(self, num_layers: int) -> frozenset[str]:
        """Names of the sites this policy guides (on a model of ``num_layers`` layers; a dense
        layer's expert sites do not exist and are never looked up)."""
        kinds = {"act": ACT_SITES, "kv": KV_SITES}
        return frozenset(
            site_name(layer, site)
            for layer in range(num_layers)
            for kind, sites in kinds.items()
            if self.site_mode(kind, layer, num_layers) == "guided"
            for site in sites
        )

    @property
    def format(self) -> fp4.FormatSpec:
        return fp4.get_format(self.fmt)


class SiteContext:
    """What a forward pass needs at its quantization sites, and what record sites emit.

    Created per call (not a pytree; lives only during tracing). ``guidance`` maps site names to
    the rollout's ``Guidance`` for guided sites; ``records`` collects record sites' output.
    """

    def __init__(
        self, policy: QuantPolicy, num_layers: int, guidance: dict[str, fp4.Guidance] | None = None
    ):
        self.policy = policy
        self.num_layers = num_layers
        self.guidance = guidance or {}
        self.records: dict[str, fp4.Guidance | fp4.QTensor] = {}

    def site_mode(self, layer: int, kind: Literal["act", "kv"]) -> SiteMode:
        """The mode of layer ``layer``'s activation or KV sites under this context's policy."""
        return self.policy.site_mode(kind, layer, self.num_layers)

    def activation(self, name: str, x: jax.Array, layer: int, kind: Literal["act", "kv"] = "act"):
        """Apply the site ``name`` to ``x`` ([..., K], quantized along the last axis)."""
        return self.quantized(name, x, layer, kind, want_codes=False)[0]

    def quantized(
        self,
        name: str,
        x: jax.Array,
        layer: int,
        kind: Literal["act", "kv"] = "act",
        want_codes: bool = True,
    ) -> tuple[jax.Array, fp4.QTensor | None]:
        """Apply the site and also return the ``QTensor`` whose dequantization is the value.

        Returns:
          (value in x's dtype, the site's QTensor or None when the site is off or
          ``want_codes`` is False)
        """
        p = self.policy
        mode = self.site_mode(layer, kind)
        if mode == "off":
            return x, None
        if mode == "guided":
            if name not in self.guidance:
                raise KeyError(f"site {name} is guided but no guidance was given for it")
            g = self.guidance[name]
            value = fp4.guided_fake_quant(x, g, mask_outside=p.mask_outside)
            if not (want_codes or p.record_codes):
                return value, None
            qt = fp4.guided_quantize(jax.lax.stop_gradient(x), g)
            if p.record_codes:
                self.records[name + ".codes"] = qt
            return value, qt if want_codes else None
        qt = None
        if mode == "record" or want_codes or p.record_codes:
            qt = fp4.quantize(jax.lax.stop_gradient(x), p.fmt, global_scale=p.act_global_scale)
        if mode == "record":
            self.records[name] = fp4.rollout_guidance(qt)
        if p.record_codes:
            self.records[name + ".codes"] = qt
        value = fp4.fake_quant(
            x, p.fmt, global_scale=p.act_global_scale, mask_outside=p.mask_outside
        )
        return value, qt if want_codes else None

    def expert_weight(self, w: jax.Array, contraction_axis: int = 1) -> jax.Array:
        """Expert weights [E, K, N], contraction ``K`` at axis 1; one global scale per expert."""
        p = self.policy
        if p.expert_weights == "off" or isinstance(w, fp4.QTensor):  # QTensor: already packed
            return w
        per_expert = lambda we: fp4.fake_quant(  # noqa: E731
            we,
            p.fmt,
            axis=contraction_axis - 1,
            scale_rule=p.weight_scale_rule,
            block_2d=p.weight_block_2d,
            mask_outside=p.mask_outside,
        )
        return jax.vmap(per_expert)(w)
