"""``ModelConfig``: the Qwen3-MoE / Qwen2-MoE family as one frozen dataclass, with presets."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

from trace_jax.config import ConfigError

DType = Literal["float32", "bfloat16"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Attributes:
    vocab_size: token vocabulary.
    hidden_size: residual width H.
    num_layers: decoder layers L.
    num_heads, num_kv_heads, head_dim: grouped-query attention (Hq, Hkv, D).
    intermediate_size: SwiGLU width of the dense MLP on non-MoE layers.
    num_experts, num_experts_per_tok, moe_intermediate_size: routed experts E, top-k, width I.
    norm_topk_prob: renormalise the top-k router probabilities to sum to 1.
    decoder_sparse_step, mlp_only_layers: layer l is MoE iff l is not in ``mlp_only_layers`` and
      ``(l + 1) % decoder_sparse_step == 0`` (the Hugging Face rule).
    shared_expert_intermediate_size: width of the sigmoid-gated shared expert (Qwen2-MoE); 0: none.
    qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3).
    attention_bias: biases on the q/k/v projections (Qwen2).
    rms_norm_eps, rope_theta: as in Hugging Face.
    tie_word_embeddings: LM head shares the embedding matrix.
    param_dtype: storage dtype of the parameters (float32 master weights for training).
    dtype: compute dtype of activations.
    scan_layers: run each run of consecutive alike layers (same kind, same site modes) as one
      ``lax.scan`` over their stacked parameters: one compiled layer body per run instead of one
      per layer, so compile time stops growing with depth. A compute choice, not architecture
      (the parameters stay per layer); the rollout engine scans its prefill, not its decode step.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 128
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    qk_norm: bool = True
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    param_dtype: DType = "float32"
    dtype: DType = "float32"
    scan_layers: bool = False

    def __post_init__(self):
        positive = (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "decoder_sparse_step",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads: {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok: {self.num_experts_per_tok} must be in 1..{self.num_experts}"
            )
        for layer in self.mlp_only_layers:
            if not 0 <= layer < self.num_layers:
                raise ConfigError(
                    f"mlp_only_layers: layer {layer} is not in 0..{self.num_layers - 1}"
                )

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * d
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for layer in range(self.num_layers):
            total += attn + 2 * h
            if self.is_moe_layer(layer):
                total += (
                    h * self.num_experts + 3 * self.num_experts * h * self.moe_intermediate_size
                )
                if self.shared_expert_intermediate_size:
                    total += 3 * h * self.shared_expert_intermediate_size + h
            else:
                total += 3 * h * self.intermediate_size
        return total

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        if name not in PRESETS:
            raise ConfigError(f"model preset {name!r} is not one of {sorted(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def from_hf(cls, config: str | Path | dict[str, Any], **overrides: Any) -> ModelConfig:
        """From a Hugging Face ``config.json`` (path, folder or dict) of Qwen3-MoE or Qwen2-MoE."""
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ConfigError(f"Hugging Face config {path} does not exist")
            config = json.loads(path.read_text())
        model_type = config.get("model_type")
        if model_type not in ("qwen3_moe", "qwen2_moe"):
            raise ConfigError(
                f"model_type: {model_type!r} is not supported (expected qwen3_moe or qwen2_moe)"
            )
        qwen3 = model_type == "qwen3_moe"
        if qwen3 and config.get("attention_bias"):
            raise ConfigError(
                "attention_bias: Qwen3-MoE checkpoints with attention biases are not supported"
            )
        if config.get("use_sliding_window"):
            raise ConfigError("use_sliding_window: sliding-window attention is not supported")
        if config.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act: {config['hidden_act']!r} is not supported (only silu)")
        num_heads = config["num_attention_heads"]
        # transformers >= 5 writes ``rope_parameters``, older versions ``rope_theta`` and
        # ``rope_scaling``; as in transformers, the RoPE dict's theta wins over a top-level one.
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_parameters.rope_type: {rope_type!r} is not supported")
        # transformers >= 5 saves Qwen3-MoE's expert count under its alias ``num_local_experts``.
        num_experts = config.get("num_experts", config.get("num_local_experts"))
        if num_experts is None:
            raise ConfigError("num_experts: missing from the Hugging Face config")
        # Missing keys take the transformers defaults of Qwen3MoeConfig / Qwen2MoeConfig.
        kwargs = dict(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            intermediate_size=config["intermediate_size"],
            num_experts=num_experts,
            num_experts_per_tok=config["num_experts_per_tok"],
            moe_intermediate_size=config["moe_intermediate_size"],
            norm_topk_prob=config.get("norm_topk_prob", False),
            decoder_sparse_step=config.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=0
            if qwen3
            else config.get("shared_expert_intermediate_size", 5632),
            qk_norm=qwen3,
            attention_bias=False if qwen3 else config.get("qkv_bias", True),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
        )
        kwargs.update(overrides)
        return cls(**kwargs)


PRESETS: dict[str, ModelConfig] = {
    # CPU tests: well under 5 M parameters.
    "tiny": ModelConfig(),
    # Trains on one GPU in minutes: ~150 M parameters, 32 experts of which 4 are active.
    "small": ModelConfig(
        vocab_size=32_768,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=1536,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        param_dtype="float32",
        dtype="bfloat16",
    ),
    # The study's model on one GPU: ~0.96 B parameters (~0.17 B active), Qwen3-30B-A3B's
    # proportions (64 experts of width 0.375 H, top-8, GQA 8:1 with 128-wide heads, q width 2 H)
    # and a vocabulary sized to the tasks' byte-level tokenizer.
    "medium": ModelConfig(
        vocab_size=256,
        hidden_size=1024,
        num_layers=12,
        num_heads=16,
        num_kv_heads=2,
        head_dim=128,
        intermediate_size=3072,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=384,
        param_dtype="float32",
        dtype="bfloat16",
        scan_layers=True,
    ),
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151_936,
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=6144,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        rope_theta=1_000_000.0,
        param_dtype="bfloat16",
        dtype="bfloat16",
    ),
    "qwen3-235b-a22b": ModelConfig(
        vocab_size=151_936,
        hidden_size=4096,
        num_layers=94,
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=12288,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
        rope_theta=1_000_000.0,
        param_dtype="bfloat16",
        dtype="bfloat16",
    ),
}
