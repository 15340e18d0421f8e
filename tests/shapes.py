"""The tiny engine shapes shared by the tests that need no specific one.

A rollout engine's compiled steps (``_start``, ``_append``, ``_decode``) depend on the model
config, the policy, the ``RolloutConfig`` and the batch (and, for ``_append``, the prompts'
width padded to a power of two), not on the weights: engines built from these shapes compile
their programs once, in the first test that runs them, and every later one, in any file or
process (both xdist workers, subprocesses), loads them from the persistent compilation cache
(``.pytest_cache/jax-cache``). Each new shape costs a few seconds of compile per step: reuse these.

- ``MODEL``: the tiny preset (4 layers, float32 compute: rollouts match full forwards tightly),
  with ``PROMPTS`` and ``ROLLOUT``, under ``QuantPolicy.bf16()`` with a bf16 cache
  (``rollout_config()``) or ``QuantPolicy.rollout()`` with an NVFP4 cache
  (``rollout_config("nvfp4")``).
- ``MODEL_BF16``: the tiny preset with 1 layer computing in bf16 (the RL configs' tiny model,
  ``model_overrides={num_layers: 1, dtype: bfloat16}``; the W4A16 Pallas kernel needs bf16).
"""

import dataclasses

from trace_jax.model import ModelConfig
from trace_jax.rollout import RolloutConfig

MODEL = ModelConfig.preset("tiny")
MODEL_BF16 = MODEL.replace(num_layers=1, dtype="bfloat16")
# 3 prompts of 3, 7 and 1 tokens: one prefill chunk of 8 (chunks pad to a power of two)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
# 32 slots, 8 new tokens a decode call: room for a second turn after the longest prompt
ROLLOUT = RolloutConfig(max_len=32, max_new_tokens=8)


def rollout_config(kv_cache: str = "bf16", **kw) -> RolloutConfig:
    """``ROLLOUT`` with the cache format ``kv_cache`` (and any other field of ``kw``)."""
    return dataclasses.replace(ROLLOUT, kv_cache=kv_cache, **kw)
