"""``trace_mismatch``: how far the trainer's FP4 forward is from the FP4 rollout, per mode.

One FP4 rollout (FP4 expert weights and activations, FP4 KV cache; the engine's ``backend``,
XLA or the Pallas kernels) of a batch of prompts records guidance at every layer and its full
codes. The trainer's forward (XLA fake quant, as in RL) then runs over the same sequences, with
routing replay unless ``routing_replay: false``, in each training mode: ``none`` (vanilla QAT:
RTN at every site), ``last_half`` (TRACE's default: guided in the deeper half) and ``all``
(guided everywhere). For each it reports, over the generated tokens, ``mismatch/logp_abs`` and
``mismatch/kl_k3``, the code mismatch rate, the shares of mismatched codes one step and two or
more steps apart (the latter are the only ones guidance cannot fix) and D_act per site and
layer, the trainer router's own top-k against the rollout's, and the compact guidance bytes per
token the mode needs.
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
from trace_jax.rl.diagnostics import mismatch_report, train_policy, trainer_forward
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
    temperature: sampling temperature (the log-probs compared are of the tempered softmax).
    modes: training modes to compare.
    backend: the rollout engine's: "xla", "pallas" (the FP4 kernels) or "auto" (Pallas on a
      GPU).
    routing_replay: the trainer replays the rollout's experts (needed by the guided modes: the
      expert-activation guidance is per expert slot).
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
    backend: Literal["auto", "xla", "pallas"] = "auto"
    routing_replay: bool = True
    plot: bool = True

    def __post_init__(self):
        for key in ("batch", "prompt_len", "max_new_tokens"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be positive, got {getattr(self, key)}")
        if not self.modes:
            raise ConfigError("modes: give at least one of none, last_half, all")
        guided = [m for m in self.modes if m != "none"]
        if guided and not self.routing_replay:
            raise ConfigError(
                f"routing_replay: the guided modes {guided} need it (expert-activation guidance "
                "is per expert slot of the rollout's routes)"
            )


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
    backend = cfg.backend
    if backend == "auto":
        backend = "pallas" if jax.default_backend() == "gpu" else "xla"
    sampling = SamplingConfig(temperature=cfg.temperature)
    engine = RolloutEngine(
        model,
        rollout_policy,
        RolloutConfig(
            max_len=cfg.prompt_len + cfg.max_new_tokens,
            max_new_tokens=cfg.max_new_tokens,
            kv_cache=cfg.fmt,
            sampling=sampling,
            backend=backend,
        ),
    )
    key_prompts, key_sample = jax.random.split(jax.random.key(cfg.seed))
    prompts = jax.random.randint(key_prompts, (cfg.batch, cfg.prompt_len), 1, mcfg.vocab_size)
    state = engine.generate(np.asarray(prompts).tolist(), key_sample)

    results: dict = {"tokens": int(state.generated.sum()), "backend": backend}
    for mode in cfg.modes:
        policy = train_policy(mode, cfg.fmt)
        out = trainer_forward(model, state, policy, replay=cfg.routing_replay)
        report = mismatch_report(out, state, policy, mcfg.num_layers, sampling)
        sizes = model_guidance_bytes(mcfg, QuantPolicy.rollout(cfg.fmt, guided_layers=mode))
        report.update(sizes.metrics())
        results[mode] = report
        print(
            f"{mode:10s} logp_abs {report['mismatch/logp_abs']:.2e}  kl_k3 "
            f"{report['mismatch/kl_k3']:.2e}  code_rate {report['mismatch/code_rate/all']:.4f}  "
            f"guided code_rate {report.get('mismatch/code_rate/guided', float('nan')):.4f} "
            f"(of them >= 2 steps apart {report.get('mismatch/code_far/guided', float('nan')):.3f})"
            f"  one-step share of all mismatches "
            f"{report.get('mismatch/code_one_step/all', float('nan')):.3f}  "
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
