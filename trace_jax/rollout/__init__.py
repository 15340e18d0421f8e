"""Rollout: batched generation with FP4 weights/activations and an FP4 KV cache."""

from trace_jax.rollout.engine import RolloutConfig, RolloutEngine, RolloutState
from trace_jax.rollout.kv_cache import KVCache, init_cache
from trace_jax.rollout.sampling import SamplingConfig, sample

__all__ = [
    "KVCache",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutState",
    "SamplingConfig",
    "init_cache",
    "sample",
]
