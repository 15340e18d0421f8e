"""What an RL run holds in accelerator memory, counted from its config before anything is
allocated, so that a run that cannot fit says so (and which knob to turn) instead of failing
minutes later inside a compiled step.

The count is a lower bound: the arrays the run must hold at once (master parameters and AdamW
moments, one gradient, the stale-parameter history, the KL reference, each rollout engine's own
weights (and a BF16 evaluation engine's, ``eval_bf16``), the stacked copies of the layers'
parameters and gradients a scanned model (``scan_layers``) makes in the trainer, the KV cache
and rollout records of a batch, the trainer's logits and the activations its backward pass
keeps, ``saved_per_token``). Compiled programs need more (temporaries, fragmentation): a run
under the bound may still not fit (on a GPU it is told so when likely: ``gpu_estimate``), one
over it cannot.
"""

from __future__ import annotations

import dataclasses

import jax

from trace_jax import fp4
from trace_jax.config import ConfigError
from trace_jax.model import ModelConfig

_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per part of a run (see the module docstring)."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def gpu_estimate(self) -> int:
        """The total with the trainer's activations as large as an H100's programs hold them
        (``GPU_ACTIVATIONS``): not a bound, the figure a GPU run is likely to need."""
        return self.total + int((GPU_ACTIVATIONS - 1) * self.parts["trainer activations"])

    def describe(self) -> str:
        gib = lambda n: f"{n / 2**30:.1f}"  # noqa: E731
        return ", ".join(f"{k} {gib(v)}" for k, v in self.parts.items() if v)


def expert_params(cfg: ModelConfig) -> int:
    """Routed-expert parameters (the ones FP4 rollouts store in FP4)."""
    return len(cfg.moe_layers) * 3 * cfg.num_experts * cfg.hidden_size * cfg.moe_intermediate_size


def layer_params(cfg: ModelConfig) -> int:
    """The decoder layers' parameters (all but the embedding, the LM head and the final norm)."""
    return (
        cfg.num_params()
        - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
        - cfg.hidden_size
    )


def saved_per_token(cfg: ModelConfig, max_len: int) -> int:
    """Bytes per token that the trainer's backward pass keeps from the forward, summed over the
    layers: per attention block the block's input and its norm, q, k, v, the attention output and
    its projection (compute dtype) and the softmax over ``max_len`` keys (float32); per MoE block
    its input and norm, the router's logits and probabilities (float32), and for each of the k
    slots the token's row sorted by expert, the gate/up output, the activation and the down
    projection's row; per dense MLP its input, norm, gate/up output and activation. XLA's programs
    keep more (float32 copies, both sides of permutations): its memory analysis of the ``medium``
    gradient on the CPU grows by ~87 MB a 64-token sequence, this count by ~58 MB, and an H100's
    program asked for ~122 MB (``GPU_ACTIVATIONS``)."""
    c = _BYTES[cfg.dtype]
    h, d = cfg.hidden_size, cfg.head_dim
    attention = c * (3 * h + 2 * cfg.num_heads * d + 2 * cfg.num_kv_heads * d)
    attention += 4 * cfg.num_heads * max_len
    k, inter = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    moe = c * (2 * h + k * (2 * h + 3 * inter)) + 2 * 4 * cfg.num_experts
    dense = c * (2 * h + 3 * cfg.intermediate_size)
    moe_layers = len(cfg.moe_layers)
    return cfg.num_layers * attention + moe_layers * moe + (cfg.num_layers - moe_layers) * dense


# The trainer's activations on an H100 against ``saved_per_token``'s count: the `medium`
# gradient of 512 sequences of 64 tokens asked for 71.6 GiB of temporaries (9e04831), ~122 MB a
# sequence over the ~8.9 GiB that XLA:CPU's analysis of it holds whatever the batch
# (experiments/bench/trainer_memory.py --program gradient at 16 and 32 sequences).
GPU_ACTIVATIONS = 2.0


def plan(rl, cfg: ModelConfig, max_len: int) -> MemoryPlan:
    """The lower bound of an ``RLConfig`` ``rl`` on model ``cfg`` with sequences of ``max_len``."""
    n = cfg.num_params()
    master = _BYTES[cfg.param_dtype]
    compute = _BYTES[cfg.dtype]
    experts = expert_params(cfg)
    if rl.rollout == "fp4":  # packed codes + one scale byte per block
        fmt = fp4.get_format(rl.fmt)
        engine = (n - experts) * compute + experts * (4 * fmt.block_size + 8) // (
            8 * fmt.block_size
        )
        kv_bytes = 0.5 + 1 / fmt.block_size + (4 / cfg.head_dim if fmt.has_global_scale else 0)
    else:
        engine, kv_bytes = n * compute, 2
    batch = rl.prompts_per_step * rl.group_size
    tokens = batch * max_len
    kv = int(2 * cfg.num_layers * tokens * cfg.num_kv_heads * cfg.head_dim * kv_bytes)
    mb_tokens = tokens // rl.minibatches
    activations = mb_tokens * (saved_per_token(cfg, max_len) + cfg.vocab_size * 4)
    parts = {
        "parameters": n * master,
        "AdamW moments": 2 * n * master,
        "gradients": n * master,
        "stale parameters": rl.staleness * n * master,
        "KL reference": n * master if rl.loss.kl_coef > 0 and not rl.ref_on_host else 0,
        "scanned layer copies": 2 * layer_params(cfg) * master if cfg.scan_layers else 0,
        "rollout engines (2)": 2 * engine,
        "BF16 evaluation engine": n * compute if rl.rollout == "fp4" and rl.eval_bf16 else 0,
        "KV cache": kv,
        "trainer activations": activations,
    }
    return MemoryPlan(parts)


def peak_gib() -> float | None:
    """The most memory this process's first device has held (GiB), where it reports it (a GPU;
    None on a CPU): what a run really needs, against ``plan``'s estimate and the budget of
    several runs sharing a GPU (``sweep --jobs``)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def check_fits(
    rl, cfg: ModelConfig, max_len: int, budget: int | None = None, warn=None
) -> MemoryPlan:
    """Raise ``ConfigError`` naming the budget, the parts and the knobs when the run's lower
    bound exceeds ``budget`` bytes (default: the memory limit of this process's first device,
    when it reports one; no check otherwise). On a GPU, ``warn`` (a callable taking one line) is
    told when the likely need (``MemoryPlan.gpu_estimate``) exceeds the budget."""
    got = plan(rl, cfg, max_len)
    if budget is None:  # another process's devices report nothing here
        stats = jax.local_devices()[0].memory_stats() or {}
        budget = stats.get("bytes_limit")
    if not budget:
        return got
    knobs = (
        "lower prompts_per_step, group_size or max_new_tokens, raise minibatches, lower "
        "staleness, set ref_on_host, or take a smaller model preset"
    )
    if got.total > budget:
        raise ConfigError(
            f"memory: this run needs at least {got.total / 2**30:.1f} GiB of the device's "
            f"{budget / 2**30:.1f} GiB ({got.describe()}); {knobs}"
        )
    if warn is not None and got.gpu_estimate > budget:
        warn(
            f"memory: this run likely needs ~{got.gpu_estimate / 2**30:.1f} GiB of the device's "
            f"{budget / 2**30:.1f} GiB (trainer activations as an H100's programs hold them; at "
            f"least {got.total / 2**30:.1f} GiB); it may run out of memory: {knobs}"
        )
    return got
