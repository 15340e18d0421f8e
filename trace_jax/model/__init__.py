"""The policy model: Qwen3-MoE family in Flax NNX with named quantization sites."""

from trace_jax.model.checkpoint import params_digest, restore_params, save_params
from trace_jax.model.config import PRESETS, ModelConfig
from trace_jax.model.hf import (
    CheckpointError,
    hf_config,
    load_hf_checkpoint,
    read_hf_params,
    save_hf_checkpoint,
)
from trace_jax.model.policy import QuantPolicy, SiteContext, site_name
from trace_jax.model.sharding import batch_sharding, make_mesh, shard_model
from trace_jax.model.transformer import ModelOutput, Transformer

__all__ = [
    "PRESETS",
    "CheckpointError",
    "ModelConfig",
    "ModelOutput",
    "QuantPolicy",
    "SiteContext",
    "Transformer",
    "batch_sharding",
    "hf_config",
    "load_hf_checkpoint",
    "make_mesh",
    "params_digest",
    "read_hf_params",
    "restore_params",
    "save_hf_checkpoint",
    "save_params",
    "shard_model",
    "site_name",
]
