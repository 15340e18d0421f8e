"""Hugging Face reference for ``test_hf.py``; runs in the reference environment (``make ref-env``).

    .venv-ref/bin/python tests/model/hf_reference.py SPEC.json

SPEC.json:
    out: folder for ``reference.npz`` and ``reference.json``.
    tokens: an ``.npz`` of int token batches ``b0, b1, ...`` ([B, T] each).
    build: cases to create with transformers: ``{name, model_type: qwen3_moe | qwen2_moe, config:
      kwargs of the config class, seed, dtype: float32 | bfloat16, saves: [{dir, max_shard_size
      (optional), original_format (default true)}]}``. Every parameter is drawn at random (norm
      weights around 1, nonzero biases, routers scaled for decisive routing) so that no tensor
      can be mapped to the wrong place unnoticed; the model is cast to ``dtype``, saved with
      ``save_pretrained`` and run in float32 (a bfloat16 case reloaded from its first save).
    load: checkpoints to load with ``AutoModelForCausalLM.from_pretrained`` and run in float32:
      ``{name, dir}``.

Per case, ``reference.npz`` holds ``{name}/logits/{i}`` [B, T, V] float32 and
``{name}/routes/{i}`` [L_moe, B, T, k] int32 (the top-k experts of each MoE layer, from the
router logits), and ``reference.json`` the loading report and the config as transformers read it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

FAMILIES = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
}


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    for name, p in model.named_parameters():
        x = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            x = 1.0 + 0.2 * x
        elif name.endswith(".bias"):
            x = 0.5 * x
        elif name.endswith("mlp.gate.weight"):
            x = x * (4.0 / hidden**0.5)  # well-separated router probabilities
        elif "embed_tokens" not in name:
            x = x / p.shape[-1] ** 0.5  # hub layout is [..., out, in]
        p.copy_(x)


@torch.no_grad()
def forward(model, batches: list[np.ndarray], name: str, arrays: dict[str, np.ndarray]) -> None:
    k = model.config.num_experts_per_tok
    for i, tokens in enumerate(batches):
        out = model(input_ids=torch.from_numpy(tokens).long(), output_router_logits=True)
        arrays[f"{name}/logits/{i}"] = out.logits.float().numpy()
        routes = [
            torch.topk(torch.softmax(r.float(), dim=-1), k, dim=-1).indices.reshape(
                *tokens.shape, k
            )
            for r in out.router_logits or ()
        ]
        if routes:
            arrays[f"{name}/routes/{i}"] = torch.stack(routes).int().numpy()


def config_report(config) -> dict:
    keys = (
        "model_type",
        "num_experts",
        "num_experts_per_tok",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "tie_word_embeddings",
        "head_dim",
        "rms_norm_eps",
        "shared_expert_intermediate_size",
        "qkv_bias",
        "attention_bias",
    )
    report = {k: getattr(config, k) for k in keys if hasattr(config, k)}
    report["rope_theta"] = config.rope_parameters["rope_theta"]
    report["rope_type"] = config.rope_parameters["rope_type"]
    return report


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    with np.load(spec["tokens"]) as f:
        batches = [f[f"b{i}"] for i in range(len(f.files))]
    arrays: dict[str, np.ndarray] = {}
    report: dict[str, dict] = {"transformers": transformers.__version__}
    torch.set_num_threads(4)

    for case in spec.get("build", []):
        config_cls, model_cls = FAMILIES[case["model_type"]]
        config = config_cls(**case["config"], attn_implementation="eager")
        torch.manual_seed(case["seed"])
        model = model_cls(config).eval()
        randomize(model, case["seed"])
        model = model.to(getattr(torch, case.get("dtype", "float32")))
        for save in case["saves"]:
            model.save_pretrained(
                save["dir"],
                max_shard_size=save.get("max_shard_size", "50GB"),
                save_original_format=save.get("original_format", True),
            )
        if case.get("dtype", "float32") != "float32":
            # Reload in float32 rather than upcasting in place: ``.to()`` also rounded the
            # rotary inv_freq buffer, which is no part of the checkpoint.
            model = AutoModelForCausalLM.from_pretrained(
                case["saves"][0]["dir"], dtype=torch.float32, attn_implementation="eager"
            ).eval()
        forward(model, batches, case["name"], arrays)
        report[case["name"]] = {"config": config_report(model.config)}

    for case in spec.get("load", []):
        model, info = AutoModelForCausalLM.from_pretrained(
            case["dir"],
            dtype=torch.float32,
            attn_implementation="eager",
            output_loading_info=True,
        )
        forward(model.eval(), batches, case["name"], arrays)
        report[case["name"]] = {
            "class": type(model).__name__,
            "config": config_report(model.config),
            "loading": {k: sorted(map(str, v)) for k, v in info.items()},
        }

    np.savez(out / "reference.npz", **arrays)
    (out / "reference.json").write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
