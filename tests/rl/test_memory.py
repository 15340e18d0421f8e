"""The memory lower bound of an RL run, counted from its config: parts by hand, and a run over
the device's budget refused in one line naming the budget and the knobs."""

import pytest

from trace_jax.config import ConfigError
from trace_jax.model import ModelConfig
from trace_jax.rl import memory
from trace_jax.rl.loop import RLConfig
from trace_jax.rl.losses import LossConfig

MEDIUM = ModelConfig.preset("medium")


def test_parts_by_hand():
    rl = RLConfig(train_mode="trace", rollout="fp4", prompts_per_step=4, group_size=2, staleness=3)
    got = memory.plan(rl, MEDIUM, max_len=70).parts
    n = MEDIUM.num_params()
    assert got["parameters"] == 4 * n and got["AdamW moments"] == 8 * n
    assert got["stale parameters"] == 3 * 4 * n and got["KL reference"] == 0
    experts = 12 * 3 * 64 * 1024 * 384  # layers x (gate, up, down) x E x H x I
    assert memory.expert_params(MEDIUM) == experts
    # NVFP4 experts: 4 bits + one E4M3 byte per 16; the rest bf16; two engines
    assert got["rollout engines (2)"] == 2 * ((n - experts) * 2 + experts * 9 // 16)
    # NVFP4 K and V per token, layer and head: D/2 code bytes + D/16 scales + a 4-byte scale
    assert got["KV cache"] == 2 * 12 * 8 * 70 * 2 * (64 + 8 + 4)
    # medium scans its layers: the trainer stacks their f32 parameters and, backward, gradients
    attn = 1024 * 128 * (16 * 2 + 2 * 2) + 2 * 128
    layer = attn + 2 * 1024 + 1024 * 64 + experts // 12
    assert got["scanned layer copies"] == 2 * 12 * layer * 4
    unscanned = memory.plan(rl, MEDIUM.replace(scan_layers=False), max_len=70).parts
    assert unscanned["scanned layer copies"] == 0


def test_a_run_over_the_budget_is_refused_naming_it_and_the_knobs():
    rl = RLConfig(train_mode="bf16", rollout="bf16", loss=LossConfig(kl_coef=0.1), staleness=1)
    need = memory.plan(rl, MEDIUM, 70).total
    assert memory.check_fits(rl, MEDIUM, 70, budget=need).total == need
    with pytest.raises(ConfigError, match=r"memory: .* GiB of the device's 1\.0 GiB \(parameters"):
        memory.check_fits(rl, MEDIUM, 70, budget=2**30)
    with pytest.raises(ConfigError, match=r"raise minibatches, lower staleness, set ref_on_host"):
        memory.check_fits(rl, MEDIUM, 70, budget=need - 1)
