"""``trace_mismatch``: how far the trainer's FP4 forward is from the FP4 rollout, per mode.

One FP4 rollout (FP4 expert weights and activations, FP4 KV cache) of a batch of prompts records
guidance at every layer and, in diagnostic mode, its full codes. The trainer's forward then runs
over the same sequences with routing replay in each training mode: ``none`` (vanilla QAT: RTN at
every site), ``last_half`` (TRACE's default: guided in the deeper half) and ``all`` (guided
everywhere). For each it reports ``mismatch/logp_abs`` and ``mismatch/kl_k3`` over the sampled
tokens, the code mismatch rate and D_act per site and layer, the fraction of elements whose codes
are two or more steps apart (the only ones guidance cannot fix), the trainer's own routing
mismatch without replay, and the compact guidance bytes per token the mode needs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import jax
import numpy as np
from flax import nnx

from experiments.registry import register
from trace_jax.config import ConfigError
from trace_jax.guidance import model_guidance_bytes
from trace_jax.model import ModelConfig, QuantPolicy, Transformer, load_hf_checkpoint
from trace_jax.rl.diagnostics import mismatch_report, route_rate, train_policy, trainer_forward
from trace_jax.rollout import RolloutConfig, RolloutEngine, SamplingConfig

Mode = Literal["none", "last_half", "all"]


@dataclasses.dataclass(frozen=True)
class TraceMismatchConfig:
    """Attributes:
    seed: PRNG seed (random model weights, prompts and sampling).
    model: a ``ModelConfig`` preset name (random weights), unless ``hf_checkpoint`` is given.
    model_overrides: ``ModelConfig`` fields to change (e.g. ``{num_layers: 2}``).
    hf_checkpoint: a Qwen3-MoE / Qwen2-MoE checkpoint folder to load instead.
    dtype: compute dtype of the model.
    fmt: "nvfp4" or "mxfp4" (weights, activations and the KV cache).
    batch, prompt_len, max_new_tokens: rollout shape (random prompts).
    temperature: sampling temperature.
    modes: training modes to compare.
    plot: write ``code_rate_per_layer.png``.
    """

    seed: int = 0
    model: str = "tiny"
    model_overrides: dict = dataclasses.field(default_factory=dict)
    hf_checkpoint: str = ""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    fmt: Literal["nvfp4", "mxfp4"] = "nvfp4"
    batch: int = 16
    prompt_len: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    modes: tuple[Mode, ...] = ("none", "last_half", "all")
    plot: bool = True

    def __post_init__(self):
        for key in ("batch", "prompt_len", "max_new_tokens"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be positive, got {getattr(self, key)}")
        if not self.modes:
            raise ConfigError("modes: give at least one of none, last_half, all")


def _model(cfg: TraceMismatchConfig) -> Transformer:
    if cfg.hf_checkpoint:
        _, model = load_hf_checkpoint(cfg.hf_checkpoint)
        return model
    try:
        mcfg = ModelConfig.preset(cfg.model).replace(dtype=cfg.dtype, **cfg.model_overrides)
    except TypeError as e:
        raise ConfigError(f"model_overrides: {e}") from None
    return Transformer(mcfg, nnx.Rngs(cfg.seed))


@register("trace_mismatch", TraceMismatchConfig, "trainer-vs-FP4-rollout mismatch: QAT vs TRACE")
def run(cfg: TraceMismatchConfig, run_dir: Path) -> dict:
    model = _model(cfg)
    mcfg = model.cfg
    rollout_policy = QuantPolicy.rollout(cfg.fmt, guided_layers="all", record_codes=True)
    engine = RolloutEngine(
        model,
        rollout_policy,
        RolloutConfig(
            max_len=cfg.prompt_len + cfg.max_new_tokens,
            max_new_tokens=cfg.max_new_tokens,
            kv_cache=cfg.fmt,
            sampling=SamplingConfig(temperature=cfg.temperature),
        ),
    )
    key_prompts, key_sample = jax.random.split(jax.random.key(cfg.seed))
    prompts = jax.random.randint(key_prompts, (cfg.batch, cfg.prompt_len), 1, mcfg.vocab_size)
    state = engine.generate(np.asarray(prompts).tolist(), key_sample)

    results: dict = {"tokens": int(state.generated.sum())}
    for mode in cfg.modes:
        policy = train_policy(mode, cfg.fmt)
        out = trainer_forward(model, state, policy)
        report = mismatch_report(out, state, policy, mcfg.num_layers)
        sizes = model_guidance_bytes(mcfg, QuantPolicy.rollout(cfg.fmt, guided_layers=mode))
        report.update(sizes.metrics())
        routes = route_rate(model, state, policy)
        report["mismatch/route_rate"] = float(routes.mean())
        results[mode] = report
        print(
            f"{mode:10s} logp_abs {report['mismatch/logp_abs']:.2e}  kl_k3 "
            f"{report['mismatch/kl_k3']:.2e}  code_rate {report['mismatch/code_rate/all']:.4f}  "
            f"guided code_rate {report.get('mismatch/code_rate/guided', float('nan')):.4f} "
            f"(>= 2 steps apart {report.get('mismatch/code_far/guided', float('nan')):.4f})  "
            f"route_rate {report['mismatch/route_rate']:.4f}  "
            f"guidance {sizes.compact} B/token"
        )
    if cfg.plot:
        _plot(results, cfg.modes, mcfg.num_layers, run_dir / "code_rate_per_layer.png")
    return results


def _plot(results: dict, modes, num_layers: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode in modes:
        per_layer = []
        for layer in range(num_layers):
            rates = [
                v
                for k, v in results[mode].items()
                if k.startswith("mismatch/code_rate/") and k.endswith(f"/{layer}")
            ]
            per_layer.append(np.mean(rates) if rates else np.nan)
        ax.plot(range(num_layers), per_layer, marker="o", label=mode)
    ax.set_xlabel("layer")
    ax.set_ylabel("code mismatch rate (mean over sites)")
    ax.set_title("trainer vs FP4 rollout codes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
