"""Bytes per device of a sharded run's state, from shapes alone, against a hand count."""

import pytest

from experiments.__main__ import main
from experiments.shard_report import parse_mesh, shard_report
from trace_jax.model import ModelConfig

CFG = ModelConfig.preset("tiny").replace(num_layers=1)  # V=256 H=64 Hq=4 Hkv=2 D=32 E=8 I=32


def test_per_device_bytes_of_a_tiny_preset_on_a_small_mesh_match_a_hand_count():
    mesh = {"data": 1, "fsdp": 2, "expert": 2}
    got = shard_report(CFG, mesh, batch=4, context=16)
    # float32 elements each device holds; fsdp halves each weight's largest dimension, expert
    # halves the 8 experts
    embed = lm_head = 128 * 64  # [256, 64], [64, 256]: the vocabulary over fsdp
    norms = 32 + 2 * 32 + 2 * 16  # final and the layer's two [64]; q/k norms [32]
    attention = 32 * 4 * 32 + 2 * (32 * 2 * 32) + 4 * 32 * 32  # q, k, v [64, n, 32]; o [4, 32, 64]
    router = 32 * 8  # [64, 8]
    experts = 3 * (4 * 32 * 32)  # gate, up [8, 64, 32]; down [8, 32, 64]
    params = 4 * (embed + lm_head + norms + attention + router + experts)
    assert got["parameters"] == params == got["gradients"]
    assert got["AdamW state"] == 2 * params + 4  # mu, nu and adam's int32 step count
    # rollout: the same non-expert weights; each expert weight as NVFP4 (4-bit codes, an E4M3
    # scale per 16 values, a float32 global scale per expert), split over expert x fsdp
    fp4_expert = 8 * 64 * 32 // 2 // 4 + 8 * 64 * 32 // 16 // 4 + 4 * 8 // 2
    assert got["rollout weights"] == params - 4 * experts + 3 * fp4_expert
    # KV cache: K and V [4, 16, 2, 32] in NVFP4 (codes, a scale per 16, a float32 global scale
    # per token and head) and the int32 lengths [4]; the batch over data x fsdp
    kv = 2 * (4 * 16 * 2 * (32 // 2 + 32 // 16 + 4)) + 4 * 4
    assert got["KV cache"] == kv // 2


def test_on_one_device_the_report_counts_the_whole_model():
    got = shard_report(CFG, parse_mesh(""), batch=4, context=16, kv="bf16")
    assert got["parameters"] == 4 * CFG.num_params()
    assert got["KV cache"] == 2 * (4 * 16 * 2 * 32) * 4 + 4 * 4  # unquantized: float32 (tiny)


@pytest.mark.parametrize("mesh", ["fsdp=0", "tensor=2", "fsdp"])
def test_a_bad_mesh_is_one_line_and_exit_code_2(mesh, capsys):
    assert main(["shard-report", "--preset", "tiny", "--mesh", mesh]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--mesh" in err, err
