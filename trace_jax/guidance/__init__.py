"""Compact TRACE guidance: the cache that carries rollout records to the trainer, and its size.

>>> cache = GuidanceCache(spill_dir, host_budget_bytes=8 << 30)
>>> cache.put_batch(version, sample_ids, rollout_state.guidance)   # [B, T, ...] records
>>> micro_batch = cache.get(version, ids)                          # numpy [B', T, ...]
>>> guidance_bytes_per_token(sites, "nvfp4", guided_layers=range(L // 2, L)).metrics()
"""

from trace_jax.guidance.accounting import (
    GuidanceBytes,
    SiteSize,
    guidance_bytes_per_token,
    model_guidance_bytes,
    model_sites,
    site_compact_bytes,
    site_full_bytes,
)
from trace_jax.guidance.cache import (
    FORMAT_VERSION,
    CacheStats,
    CorruptSpillError,
    GuidanceCache,
    GuidanceCacheError,
    GuidanceNotFoundError,
    GuidanceVersionError,
    Record,
    SpillFormatError,
    check_record,
    split_records,
    stack_records,
)

__all__ = [
    "FORMAT_VERSION",
    "CacheStats",
    "CorruptSpillError",
    "GuidanceBytes",
    "GuidanceCache",
    "GuidanceCacheError",
    "GuidanceNotFoundError",
    "GuidanceVersionError",
    "Record",
    "SiteSize",
    "SpillFormatError",
    "check_record",
    "guidance_bytes_per_token",
    "model_guidance_bytes",
    "model_sites",
    "site_compact_bytes",
    "site_full_bytes",
    "split_records",
    "stack_records",
]
