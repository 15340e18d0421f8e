"""The policy model: Qwen3-MoE family in Flax NNX with named quantization sites."""

from trace_jax.model.config import PRESETS, ModelConfig
from trace_jax.model.policy import QuantPolicy, SiteContext, site_name
from trace_jax.model.transformer import ModelOutput, Transformer

__all__ = [
    "PRESETS",
    "ModelConfig",
    "ModelOutput",
    "QuantPolicy",
    "SiteContext",
    "Transformer",
    "site_name",
]
