"""The memory lower bound of an RL run, counted from its config: parts by hand, and a run over
the device's budget refused in one line naming the budget and the knobs."""

import dataclasses

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
    # an FP4 rollout's evaluation in BF16 holds the model's BF16 weights once more
    assert got["BF16 evaluation engine"] == 0
    both = dataclasses.replace(rl, eval_bf16=True)
    assert memory.plan(both, MEDIUM, max_len=70).parts["BF16 evaluation engine"] == 2 * n


def test_a_run_over_the_budget_is_refused_naming_it_and_the_knobs():
    rl = RLConfig(train_mode="bf16", rollout="bf16", loss=LossConfig(kl_coef=0.1), staleness=1)
    need = memory.plan(rl, MEDIUM, 70).total
    assert memory.check_fits(rl, MEDIUM, 70, budget=need).total == need
    with pytest.raises(ConfigError, match=r"memory: .* GiB of the device's 1\.0 GiB \(parameters"):
        memory.check_fits(rl, MEDIUM, 70, budget=2**30)
    with pytest.raises(ConfigError, match=r"raise minibatches, lower staleness, set ref_on_host"):
        memory.check_fits(rl, MEDIUM, 70, budget=need - 1)


def test_saved_activations_by_hand():
    # medium, 64 slots: per layer, attention (bf16: 3 x 1024 hidden, q and output 2 x 16 x 128,
    # k and v 2 x 2 x 128; f32 softmax 16 x 64) and MoE (bf16: 2 x 1024, and per slot of 8:
    # 2 x 1024 + 3 x 384; f32 router logits and probabilities 2 x 64)
    attention = 2 * (3 * 1024 + 2 * 16 * 128 + 2 * 2 * 128) + 4 * 16 * 64
    moe = 2 * (2 * 1024 + 8 * (2 * 1024 + 3 * 384)) + 4 * 2 * 64
    assert memory.saved_per_token(MEDIUM, 64) == 12 * (attention + moe)
    rl = RLConfig(prompts_per_step=16, group_size=8, minibatches=4)
    parts = memory.plan(rl, MEDIUM, 64).parts
    assert parts["trainer activations"] == 32 * 64 * (12 * (attention + moe) + 256 * 4)


def test_saved_activations_bound_what_xla_keeps():
    """The count per sequence is at most what XLA's memory analysis of the trainer's gradient
    (XLA:CPU) grows by with one more sequence: a lower bound, as check_fits refuses on it."""
    from experiments.bench.trainer_memory import memory_analysis

    cfg = MEDIUM.replace(
        num_layers=1,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        moe_intermediate_size=128,
        num_experts=16,
        num_experts_per_tok=4,
    )
    seq = 16
    small, large = (memory_analysis(cfg, "gradient", b, seq).temp_size_in_bytes for b in (8, 16))
    per_sequence = (large - small) / 8
    count = (memory.saved_per_token(cfg, seq) + cfg.vocab_size * 4) * seq
    assert 0 < count <= per_sequence


def test_likely_out_of_memory_is_told():
    rl = RLConfig(
        train_mode="bf16", rollout="bf16", prompts_per_step=128, group_size=8, minibatches=2
    )
    got = memory.plan(rl, MEDIUM, 64)
    told = []
    memory.check_fits(rl, MEDIUM, 64, budget=got.total, warn=told.append)
    assert got.gpu_estimate > got.total and len(told) == 1
    assert told[0].startswith("memory: this run likely needs") and "raise minibatches" in told[0]
    told.clear()
    memory.check_fits(rl, MEDIUM, 64, budget=got.gpu_estimate, warn=told.append)
    assert told == []


def test_peak_is_what_the_device_reports(monkeypatch):
    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    monkeypatch.setattr(
        memory.jax, "local_devices", lambda: [Device({"peak_bytes_in_use": 3 << 29})]
    )
    assert memory.peak_gib() == 1.5
    monkeypatch.setattr(memory.jax, "local_devices", lambda: [Device(None)])  # a CPU
    assert memory.peak_gib() is None
