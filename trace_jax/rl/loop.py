"""The RL loop: warm start, then rollout -> reward -> guidance cache -> train, with every
baseline one config value away, metrics, checkpoints and resume.

Training-side modes (``train_mode``): ``bf16`` (no quantization), ``qat`` (RTN fake quant at
every site), ``trace`` (guided at the guided layers, RTN elsewhere), ``trace_all`` (guided
everywhere). Rollout precision (``rollout``): ``bf16`` or ``fp4`` (routed-expert weights and
activations and the KV cache in ``fmt``). Every mode starts RL from the same policy: the
supervised warm start runs in BF16 (as a pretrained model would be), writes ``policy/`` to the
run directory, and ``init_checkpoint`` starts another run's RL from it. A step:

1. refit: the engine takes the parameters of ``staleness`` versions ago (0: the current ones),
   quantizing (and, for the Pallas backend, prepacking) its FP4 expert weights once;
2. it generates ``group_size`` samples for each of ``prompts_per_step`` prompts, recording
   log-probs of the sampling distribution, expert routes and, under TRACE, guidance
   (multi-turn tasks alternate policy turns and environment observations, not trained on);
3. rewards and group advantages; the guidance goes through the ``GuidanceCache`` keyed by
   (policy version, sample id) and the trainer fetches its batch from it;
4. ``ppo_epochs`` x ``minibatches`` GRPO-family updates (``trace_jax.rl.trainer``) with routing
   replay, the trainer-vs-rollout importance correction and, with ``loss.kl_coef``, the k3 KL to
   the frozen policy RL started from;
5. metrics (reward, entropy, length, mismatch, code agreement at guided sites, seconds of every
   phase, guidance bytes) go to ``metrics.jsonl`` and TensorBoard; checkpoints every
   ``checkpoint_every`` steps.

A killed run restarts from its last checkpoint (``resume``) and continues exactly: every random
draw is a function of (seed, step) and the data stream's position is checkpointed.

Across processes (a multi-controller JAX job, ``experiments.runner.init_distributed``): the mesh
spans every process's devices; the train state, the rollout and evaluation engines' weights
(FSDP / expert splits kept, FP4 expert weights quantized where they lie: no process gathers the
model) and states, and the batches are global arrays. Every process reads the same prompt
streams and keeps its contiguous part of each batch, whole groups (``sharding.batch_part``: the
rows its devices hold; ``prompts_per_step`` and ``warm_start.batch`` divide by the process
count): it renders their prompts, runs their environments and scores them on the host, while
the engine decodes the global batch (row i samples with the key of row i): the run is that of
one process with the same mesh. Where ``expert`` spans processes they hold the same part (the
batch is replicated over ``expert``). Rollout-side metrics are gathered over processes (seconds:
the slowest process's); process 0 alone writes metrics, TensorBoard, plots and logs. Every
process saves and restores the orbax checkpoints (the run directory is on a filesystem all
processes share) and keeps its own guidance cache (``guidance_spill/p<k>``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from trace_jax import fp4
from trace_jax.config import ConfigError
from trace_jax.guidance import GuidanceCache, model_guidance_bytes
from trace_jax.model import (
    ModelConfig,
    QuantPolicy,
    Transformer,
    batch_sharding,
    load_hf_checkpoint,
    make_mesh,
    params_digest,
    restore_params,
    save_params,
    shard_model,
)
from trace_jax.model.sharding import batch_part, host_value, place_rows, process_rows
from trace_jax.rl import memory, runlog, tasks_io
from trace_jax.rl.checkpoint import RunCheckpointer
from trace_jax.rl.losses import LossConfig, group_advantages
from trace_jax.rl.trainer import RLBatch, Trainer, TrainState
from trace_jax.rollout import RolloutConfig, RolloutEngine, RolloutState, SamplingConfig
from trace_jax.tasks import TOKENIZER, Tokenizer, prompt_stream
from trace_jax.tasks.hf_tokenizer import load_hf_tokenizer

TrainMode = Literal["bf16", "qat", "trace", "trace_all"]


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """Attributes:
    name: a registered task ("reasoning", "coding", "long_horizon", "jsonl").
    args: the task's own knobs (e.g. difficulty), passed to ``make_task``.
    """

    name: str = "reasoning"
    args: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start on the task's demonstrations, before RL.

    Attributes:
      steps: updates (0: none).
      batch: demonstrations per update.
      lr: peak learning rate.
      warmup_steps: linear warm-up from 0 to ``lr`` over this many updates.
      schedule: after the warm-up, "constant" or "cosine" (decays to 0 at the last update).
    """

    steps: int = 0
    batch: int = 32
    lr: float = 3e-3
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"

    def __post_init__(self):
        if self.steps < 0 or self.warmup_steps < 0:
            raise ConfigError("steps and warmup_steps: must be >= 0")
        if self.lr <= 0:
            raise ConfigError(f"lr: must be positive, got {self.lr}")

    def learning_rate(self) -> optax.Schedule:
        """The warm start's schedule of ``steps`` updates."""
        return learning_rate(self.lr, self.warmup_steps, self.schedule, self.steps)


def learning_rate(peak: float, warmup: int, schedule: str, total: int) -> optax.Schedule:
    """Linear warm-up to ``peak`` over ``warmup`` updates, then constant or a cosine decay to 0
    at update ``total``."""
    if schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, peak, max(warmup, 1), max(total, warmup + 1), end_value=0.0
        )
    if warmup == 0:
        return optax.constant_schedule(peak)
    return optax.linear_schedule(0.0, peak, warmup)


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Attributes:
    seed: every random draw derives from it and the step.
    task: which task and its knobs.
    model: a ``ModelConfig`` preset (random init), unless ``hf_checkpoint`` is set.
    model_overrides: ``ModelConfig`` fields to change (e.g. ``{num_layers: 2}``).
    hf_checkpoint: a Qwen3-MoE / Qwen2-MoE checkpoint folder to start from; its tasks are rendered
      and scored with its own ``tokenizer.json``, chat template and special tokens.
    init_checkpoint: start RL from these parameters: a run directory (its ``policy/``, the
      policy its RL started from, e.g. a warm-start-only run with ``steps: 0``) or a folder
      written by ``trace_jax.model.save_params``; the model config must match.
    train_mode: "bf16", "qat", "trace" or "trace_all".
    rollout: "bf16" or "fp4".
    fmt: "nvfp4" or "mxfp4".
    guided_layers: for ``trace``: "last_half" (default) or "last_k" (with ``guided_last_k``).
    guided_last_k: see ``guided_layers``.
    steps: RL steps (0: only the warm start, whose result is written to ``policy/``).
    prompts_per_step, group_size: P prompts, G samples each (B = P * G sequences).
    max_new_tokens: policy tokens per turn.
    max_turns: policy turns per episode (multi-turn tasks).
    temperature, top_k, top_p: rollout sampling; the log-probs on both sides are those of this
      sampling distribution (the behaviour policy).
    lr, weight_decay, grad_clip: AdamW on the RL updates (peak learning rate).
    lr_warmup_steps: linear warm-up of the RL learning rate over this many updates.
    loss: GRPO-family options.
    ppo_epochs, minibatches: passes over each rollout batch and updates per pass (proximal
      log-probs taken once before the first; 1 x 1: one on-policy update).
    routing_replay: train with the rollout's expert choices (required by the guided modes:
      expert-activation guidance is per expert slot of the rollout's routes).
    staleness: rollouts come from the parameters of this many versions ago; their samples are
      trained with their own guidance (TRACE.md section 4).
    rollout_backend: "auto" (Pallas kernels on a GPU, XLA elsewhere), "xla" or "pallas".
    scan_decode: with a model that scans its layers (``scan_layers``, on in ``medium``), scan
      them in the rollout's decode step too: compile time independent of depth, each decode
      step slower (weights and cache sliced out of stacked copies; see ``RolloutConfig``).
    trim_padding: the trainer takes each rollout batch cut to its longest sequence, rounded up
      to a multiple of ``TRIM_MULTIPLE`` slots (the slots past it are padding in every row): less
      work a step where responses end early, one compiled trainer program per width met.
    code_metrics_rows: sequences per step whose full rollout codes are recorded for the code
      metrics (``mismatch/code_*``, ``guided_code_agreement``; 0: none; evenly spaced over the
      batch).
    diagnostic: record full codes of every sequence (code metrics over the whole batch).
    ref_on_host: keep the frozen reference policy (``loss.kl_coef > 0``) in host memory.
    warm_start: supervised steps before RL.
    eval_every: evaluate greedily on the eval split every this many RL steps (and at the end).
    eval_problems: eval problems per evaluation.
    eval_split: the split evaluated: "eval" (held out) or "train" (the first training problems;
      for tasks so small that a tiny model can only memorise them).
    eval_bf16: also evaluate with BF16 weights, activations and KV cache, as the BF16-rollout
      reference evaluates (``eval/reward_bf16``; an FP4-rollout run compiles one more engine,
      a BF16 one logs its ``eval/reward``): every mode's policy measured the same way.
    ptq_scale_rules: for a BF16-rollout run (``rollout: bf16``; others evaluate in FP4 already),
      after its last RL step the greedy reward of its policy quantized post hoc with each
      weight scale rule ("max6": RTN; "four_over_six"), evaluated by the FP4 modes' evaluation
      engine on the problems of ``eval/reward``: ``ptq_eval_reward`` in the results, with the
      BF16 reward as ``bf16`` (none with ``eval_problems: 0``).
    checkpoint_every: checkpoint every this many steps (and at the end); 0: never (a benchmark's
      run, which a kill loses; a warm start still writes its ``policy/``).
    deterministic: XLA's deterministic GPU ops (``--xla_gpu_deterministic_ops``, set by the
      entry point before the GPU starts): a warm start repeated on another machine gives
      bit-identical parameters (compare ``start_policy_sha256``); scatter-adds are slower.
    time_limit_min: wall-clock minutes this process may run (0: no limit): the step that would
      leave too little time for another is the last, evaluated and checkpointed; the same
      command resumes the run (this key does not count as a change of settings).
    guidance_path: how the rollout's guidance reaches the trainer. "device": the engine's
      records as they are on the device (rollout and trainer share it, and each batch is
      trained in the step that rolled it out: nothing to move); "host": TRACE's data path for
      a rollout and trainer apart (TRACE.md section 4), through the versioned guidance cache
      (device -> host memory -> disk past ``guidance_host_bytes`` -> the trainer's devices),
      timed as ``guidance/transfer_s``. Both give the trainer the same records.
    guidance_host_bytes: host-memory budget of the guidance cache before it spills to disk.
    mesh_data, mesh_fsdp, mesh_expert: device mesh (data x fsdp x expert): routed experts are
      split over ``expert``; every parameter and its AdamW moments over ``fsdp`` (its largest
      dimension that divides, as FSDP does); the batch over ``data`` x ``fsdp`` (1 x 1 x 1: one
      device). In a multi-process job the mesh spans all ``jax.device_count()`` devices and
      each process's devices hold one contiguous part of the batch, the same part where they
      differ along ``expert`` (see the module docstring).
    tensorboard: also write TensorBoard event files.
    plot: write PNG curves at the end.
    """

    seed: int = 0
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    model: str = "tiny"
    model_overrides: dict = dataclasses.field(default_factory=dict)
    hf_checkpoint: str = ""
    init_checkpoint: str = ""
    train_mode: TrainMode = "trace"
    rollout: Literal["bf16", "fp4"] = "fp4"
    fmt: Literal["nvfp4", "mxfp4"] = "nvfp4"
    guided_layers: Literal["last_half", "last_k"] = "last_half"
    guided_last_k: int = 4
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 16
    max_turns: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    lr: float = 1e-3
    lr_warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    ppo_epochs: int = 1
    minibatches: int = 1
    routing_replay: bool = True
    staleness: int = 0
    rollout_backend: Literal["auto", "xla", "pallas"] = "auto"
    scan_decode: bool = False
    trim_padding: bool = False
    code_metrics_rows: int = 8
    diagnostic: bool = False
    ref_on_host: bool = False
    warm_start: WarmStartConfig = dataclasses.field(default_factory=WarmStartConfig)
    eval_every: int = 10
    eval_problems: int = 64
    eval_split: Literal["eval", "train"] = "eval"
    eval_bf16: bool = False
    ptq_scale_rules: tuple[Literal["max6", "four_over_six"], ...] = ()
    checkpoint_every: int = 10
    time_limit_min: float = 0.0
    deterministic: bool = False
    guidance_path: Literal["device", "host"] = "device"
    guidance_host_bytes: int = 1 << 30
    mesh_data: int = 1
    mesh_fsdp: int = 1
    mesh_expert: int = 1
    tensorboard: bool = True
    plot: bool = True

    def __post_init__(self):
        positive = ("prompts_per_step", "group_size", "max_new_tokens", "max_turns")
        for key in (*positive, "ppo_epochs", "minibatches"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be positive, got {getattr(self, key)}")
        for key in (
            "steps",
            "lr_warmup_steps",
            "staleness",
            "eval_problems",
            "guidance_host_bytes",
            "time_limit_min",
            "checkpoint_every",
        ):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}: must be >= 0, got {getattr(self, key)}")
        if self.code_metrics_rows < 0:
            raise ConfigError(f"code_metrics_rows: must be >= 0, got {self.code_metrics_rows}")
        for key in ("eval_every", "mesh_data", "mesh_fsdp", "mesh_expert"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be positive, got {getattr(self, key)}")
        batch = self.prompts_per_step * self.group_size
        if batch % self.minibatches:
            raise ConfigError(
                f"minibatches: {self.minibatches} does not divide the batch of {batch} sequences"
            )
        for key, size in (
            ("prompts_per_step", batch // self.minibatches),
            ("warm_start.batch", self.warm_start.batch),
        ):
            if size % (self.mesh_data * self.mesh_fsdp):
                raise ConfigError(
                    f"{key}: its (mini)batch {size} does not split over mesh_data x mesh_fsdp"
                )
        if self.train_mode in ("trace", "trace_all") and self.rollout != "fp4":
            raise ConfigError(
                f"train_mode: {self.train_mode} replays FP4 rollout guidance; it needs rollout: fp4"
            )
        if self.train_mode in ("trace", "trace_all") and not self.routing_replay:
            raise ConfigError(
                f"routing_replay: train_mode {self.train_mode} needs it (the expert-activation "
                "guidance is per expert slot of the rollout's routes)"
            )
        if self.init_checkpoint and self.warm_start.steps:
            raise ConfigError(
                "init_checkpoint: starts RL from a saved policy; set warm_start.steps: 0 "
                f"(got {self.warm_start.steps})"
            )
        # The sampling distribution is checked where it is defined.
        SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @property
    def backend(self) -> Literal["xla", "pallas"]:
        """The rollout engine's backend: "auto" is Pallas on a GPU."""
        if self.rollout_backend != "auto":
            return self.rollout_backend
        return "pallas" if jax.default_backend() == "gpu" else "xla"

    @property
    def code_metrics(self) -> bool:
        """Whether rollout and trainer record full codes for the code metrics."""
        quantized = self.rollout == "fp4" and self.train_mode != "bf16"
        return quantized and (self.diagnostic or self.code_metrics_rows > 0)


# ----------------------------------------------------------------------------- policies


def rollout_policy(cfg: RLConfig) -> QuantPolicy:
    """What the engine runs: BF16, or FP4 recording guidance at the layers the trainer guides
    (and full codes where the code metrics need them)."""
    if cfg.rollout == "bf16":
        return QuantPolicy.bf16()
    layers = {"trace": cfg.guided_layers, "trace_all": "all"}.get(cfg.train_mode, "none")
    return QuantPolicy.rollout(
        cfg.fmt,
        guided_layers=layers,
        guided_last_k=cfg.guided_last_k,
        record_codes=cfg.code_metrics,
    )


def eval_policy(cfg: RLConfig) -> QuantPolicy:
    """The greedy evaluation's engine: the rollout's precision without its records (nothing
    reads them), so that every FP4 mode evaluates with one program, the naive FP4 rollout's."""
    if cfg.rollout == "bf16":
        return QuantPolicy.bf16()
    return fp4_eval_policy(cfg.fmt)


def fp4_eval_policy(fmt: str, **kw) -> QuantPolicy:
    """The FP4 modes' evaluation (``QuantPolicy`` fields in ``kw``, e.g. a weight scale rule)."""
    return QuantPolicy.rollout(fmt, guided_layers="none", **kw)


def train_policy(cfg: RLConfig) -> QuantPolicy:
    """The trainer's forward for ``cfg.train_mode``."""
    if cfg.train_mode == "bf16":
        return QuantPolicy.bf16()
    if cfg.train_mode == "qat":
        return QuantPolicy.qat(cfg.fmt)
    layers = "all" if cfg.train_mode == "trace_all" else cfg.guided_layers
    return QuantPolicy.trace(cfg.fmt, guided_layers=layers, guided_last_k=cfg.guided_last_k)


def model_config(cfg: RLConfig, vocab_size: int) -> ModelConfig:
    """The preset with ``model_overrides`` (not for ``hf_checkpoint``, whose config.json rules)."""
    try:
        mcfg = ModelConfig.preset(cfg.model).replace(**cfg.model_overrides)
    except TypeError as e:
        raise ConfigError(f"model_overrides: {e}") from None
    if mcfg.vocab_size < vocab_size:
        raise ConfigError(f"model: vocab_size {mcfg.vocab_size} < the tokenizer's {vocab_size}")
    return mcfg


def build_model(cfg: RLConfig) -> tuple[Transformer, Tokenizer]:
    """The model RL starts from and the tokenizer its tasks are rendered with: a checkpoint's
    weights and its own tokenizer and chat template, or a random preset and the byte tokenizer
    (its vocabulary checked to fit)."""
    if cfg.hf_checkpoint:
        _, model = load_hf_checkpoint(cfg.hf_checkpoint)
        return model, load_hf_tokenizer(cfg.hf_checkpoint)
    return Transformer(model_config(cfg, TOKENIZER.vocab_size), nnx.Rngs(cfg.seed)), TOKENIZER


def _check_processes(cfg: RLConfig, processes: int) -> None:
    """What a job of ``processes`` processes needs of the config (one line naming the key)."""
    if processes == 1:
        return
    sizes = {"prompts_per_step": cfg.prompts_per_step}
    if cfg.warm_start.steps:
        sizes["warm_start.batch"] = cfg.warm_start.batch
    for key, size in sizes.items():
        if size % processes:
            raise ConfigError(
                f"{key}: {size} does not split over the job's {processes} processes "
                "(JAX_NUM_PROCESSES)"
            )
    if cfg.ref_on_host:
        raise ConfigError(f"ref_on_host: one process only (this job has {processes})")


# ----------------------------------------------------------------------------- the run


class RLRun:
    """One run: builds everything from the config, then ``run()`` (resuming if a checkpoint
    exists in ``run_dir``)."""

    def __init__(self, cfg: RLConfig, run_dir: str | Path, *, log=print):
        self.started, self.eval_s = time.monotonic(), 0.0  # for time_limit_min
        self.start_digest = None  # sha256 of the parameters RL starts from (``_start_policy``)
        self.processes, self.process = jax.process_count(), jax.process_index()
        self.primary = self.process == 0  # writes the run's files and logs
        _check_processes(cfg, self.processes)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.log = log if self.primary else lambda *_: None
        self.io = tasks_io.TaskIO(cfg.task.name, cfg.task.args)  # its knobs checked first
        if not cfg.hf_checkpoint:  # before allocating anything (a checkpoint's config: below)
            self.max_len = self.io.max_len(cfg.max_new_tokens, cfg.max_turns)
            memory.check_fits(
                cfg, model_config(cfg, self.io.vocab_size), self.max_len, warn=self._memory_warning
            )
        model, tokenizer = build_model(cfg)
        if cfg.hf_checkpoint:  # its tasks are rendered by its own tokenizer
            self.io = tasks_io.TaskIO(cfg.task.name, cfg.task.args, tokenizer)
            self.max_len = self.io.max_len(cfg.max_new_tokens, cfg.max_turns)
            memory.check_fits(cfg, model.cfg, self.max_len, warn=self._memory_warning)
        if cfg.init_checkpoint:
            _restore_policy(cfg.init_checkpoint, model)
        self.mesh = None
        mesh_size = cfg.mesh_data * cfg.mesh_fsdp * cfg.mesh_expert
        if self.processes > 1 and mesh_size != jax.device_count():
            raise ConfigError(
                f"mesh_data x mesh_fsdp x mesh_expert: {cfg.mesh_data} x {cfg.mesh_fsdp} x "
                f"{cfg.mesh_expert}; a job of {self.processes} processes runs on a mesh of all "
                f"its {jax.device_count()} devices"
            )
        if mesh_size > 1:
            if mesh_size > jax.device_count():
                raise ConfigError(
                    f"mesh_data x mesh_fsdp x mesh_expert: {cfg.mesh_data} x {cfg.mesh_fsdp} x "
                    f"{cfg.mesh_expert} devices asked for, {jax.device_count()} present"
                )
            if model.cfg.num_experts % cfg.mesh_expert:
                raise ConfigError(
                    f"mesh_expert: {cfg.mesh_expert} does not divide the "
                    f"{model.cfg.num_experts} experts"
                )
            self.mesh = make_mesh(data=cfg.mesh_data, fsdp=cfg.mesh_fsdp, expert=cfg.mesh_expert)
            model = shard_model(model, self.mesh)
        try:  # this process's part of every batch (its devices' rows): part k of n
            self.part, self.parts = batch_part(self.mesh) if self.mesh else (0, 1)
        except ValueError as e:
            raise ConfigError(f"mesh_data x mesh_fsdp x mesh_expert: {e}") from None
        self.model_cfg = model.cfg
        self.rollout_policy = rollout_policy(cfg)

        # Warm start and RL have their own AdamW (same state structure); RL starts from a
        # fresh optimizer state, as the warm start's moments describe another objective.
        def adamw(lr: optax.Schedule):
            return optax.chain(
                optax.clip_by_global_norm(cfg.grad_clip),
                optax.adamw(lr, weight_decay=cfg.weight_decay),
            )

        # what each optimizer is made of (trainers built alike share their compiled steps)
        clip_decay = (cfg.grad_clip, cfg.weight_decay)
        rl_optimizer = ("adamw", cfg.lr, cfg.lr_warmup_steps, *clip_decay)
        ws = cfg.warm_start
        sft_optimizer = ("adamw", ws.lr, ws.warmup_steps, ws.schedule, ws.steps, *clip_decay)

        self.trainer = Trainer(
            model,
            train_policy(cfg),
            cfg.loss,
            adamw(learning_rate(cfg.lr, cfg.lr_warmup_steps, "constant", 0)),
            cfg.routing_replay,
            sampling=cfg.sampling,
            ppo_epochs=cfg.ppo_epochs,
            minibatches=cfg.minibatches,
            optimizer_key=rl_optimizer,
        )
        # The warm start is the same for every mode: BF16, as a pretrained model would be.
        self.sft_trainer = Trainer(
            model,
            QuantPolicy.bf16(),
            cfg.loss,
            adamw(cfg.warm_start.learning_rate()),
            optimizer_key=sft_optimizer,
        )
        kv = cfg.fmt if cfg.rollout == "fp4" else "bf16"
        code_rows = cfg.code_metrics_rows
        rollout_cfg = RolloutConfig(
            max_len=self.max_len,
            max_new_tokens=cfg.max_new_tokens,
            kv_cache=kv,
            sampling=cfg.sampling,
            stop_tokens=self.io.stop_tokens,
            pad_token=self.io.pad_id,
            fp4_weights=cfg.rollout == "fp4",
            backend=cfg.backend,
            code_rows=None if cfg.diagnostic else code_rows or None,
            scan_decode=cfg.scan_decode,
        )
        # The engines take the mesh's arrays as they are split (no copy gathered anywhere).
        self.engine = RolloutEngine(model, self.rollout_policy, rollout_cfg)
        # Greedy evaluation with the rollout's precision and config, recording nothing: batches
        # of the rollout's size, one program for every FP4 mode (the naive rollout's).
        self.eval_engine = RolloutEngine(model, eval_policy(cfg), rollout_cfg, greedy=True)
        # The BF16 reference's evaluation, for an FP4 rollout's policy (eval_bf16): that run's
        # engine config, so that both measure a policy alike.
        self.bf16_eval_engine = None
        if cfg.eval_bf16 and cfg.rollout == "fp4":
            bf16_cfg = dataclasses.replace(rollout_cfg, kv_cache="bf16", fp4_weights=False)
            self.bf16_eval_engine = RolloutEngine(model, QuantPolicy.bf16(), bf16_cfg, greedy=True)
        self.guidance_bytes = model_guidance_bytes(self.model_cfg, self.rollout_policy)
        self.ref_params = None  # the frozen policy RL started from (for loss.kl_coef > 0)

    @property
    def _memory_warning(self):
        """Where ``memory.check_fits`` says a run likely will not fit: the log, on a GPU."""
        return self.log if jax.default_backend() == "gpu" else None

    # ------------------------------------------------------------------ processes

    def _rows(self, size: int) -> tuple[int, int]:
        """This process's rows [lo, hi) of a batch of ``size``: its contiguous part
        (``batch_part``; the whole batch in one process)."""
        part = size // self.parts
        return self.part * part, (self.part + 1) * part

    def _gather(self, local: np.ndarray) -> np.ndarray:
        """Every process's rows (numpy, [the batch's rows, ...], in order) of a batch whose rows
        ``local`` ([rows, ...]) are this process's part."""
        return host_value(place_rows(local))

    def _slowest(self, times: dict[str, float]) -> dict[str, float]:
        """Seconds of each phase: the slowest process's (as float32)."""
        if self.processes == 1 or not times:
            return times
        keys = sorted(times)
        every = multihost_utils.process_allgather(np.asarray([times[k] for k in keys], np.float32))
        return {k: float(v) for k, v in zip(keys, np.max(every, axis=0), strict=True)}

    def _replicated(self, a) -> jax.Array:
        """A value every process holds (host) as an array replicated over the mesh."""
        if self.processes == 1:
            return jnp.asarray(a)
        everywhere = NamedSharding(self.mesh, PartitionSpec())
        return jax.make_array_from_process_local_data(everywhere, np.asarray(a))

    # ------------------------------------------------------------------ pieces

    def _key(self, step: int, what: int) -> jax.Array:
        """The key of ``what`` at the run's ``step``. RL steps count from the first RL step, so
        that a run with its own warm start and one started from that warm start's policy
        (``init_checkpoint``) sample alike, step for step; warm-start steps have keys of their
        own."""
        rl = step - self.cfg.warm_start.steps
        index, what = (rl, what) if rl >= 0 else (step, what + 16)
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.cfg.seed), index), what)

    def rollout(self, engine: RolloutEngine, problems: list, key: jax.Array, times=None):
        """Generate for ``problems`` (this process's rows of the batch; one sequence each),
        running environments if multi-turn. Returns (state of the whole batch, this process's
        rewards [rows]); ``times`` (a dict) collects the seconds of each part."""
        return self.io.rollout(engine, problems, key, self.cfg.max_turns, times=times)

    def evaluate(self, params, step: int) -> dict[str, float]:
        """Greedy rollouts on the eval split with the rollout's precision: mean reward
        (``eval/reward``), and with ``eval_bf16`` in BF16 too (``eval/reward_bf16``)."""
        if self.cfg.eval_problems == 0:
            return {}
        t0 = time.monotonic()
        out = {"eval/reward": self._greedy_reward(self.eval_engine, params, step)}
        if self.cfg.eval_bf16:  # a BF16 rollout's own evaluation is the BF16 one
            engine = self.bf16_eval_engine
            out["eval/reward_bf16"] = (
                out["eval/reward"] if engine is None else self._greedy_reward(engine, params, step)
            )
        self.eval_s = time.monotonic() - t0
        return out

    def _greedy_reward(self, engine: RolloutEngine, params, step: int) -> float:
        n = self.cfg.eval_problems
        engine.update_params(self.trainer.model(params), version=step)
        problems = [self.io.problem(self.cfg.eval_split, i) for i in range(n)]
        # In batches of the rollout's size (the last one filled up with repeats, not counted),
        # each process rolling out its part.
        size = self.cfg.prompts_per_step * self.cfg.group_size
        lo, hi = self._rows(size)
        rewards = []
        for i in range(0, n, size):
            chunk = [problems[(i + j) % n] for j in range(lo, hi)]  # the last one wraps around
            key = jax.random.fold_in(self._key(step, 2), i)
            _, got = self.rollout(engine, chunk, key)
            rewards.extend(self._gather(got)[: min(size, n - i)])
        return float(np.mean(rewards))

    def _place(self, tree, batch_axis: int = 0):
        """This process's rows of a batch (host arrays, [rows, ...], and records of them) as the
        global batch on the mesh, split over ``data`` x ``fsdp`` (``sharding.place_rows``; on one
        device: device arrays)."""

        def put(a):
            if np.ndim(a) == 0:  # not per row (a placeholder scale): the same in every process
                return self._replicated(a)
            return place_rows(np.asarray(a), batch_axis)

        return _with_rows(jax.tree.map(put, tree), batch_axis, self.parts)

    def _split(self, tree, batch_axis: int = 0):
        """The rollout's arrays of the whole batch split over ``data`` x ``fsdp`` as the trainer
        takes them (as they are on one device)."""
        if self.mesh is None:
            return tree

        def put(a):
            if a.ndim == 0:  # not per row (a record's placeholder scale): on every device
                return jax.device_put(a, NamedSharding(self.mesh, PartitionSpec()))
            return jax.device_put(a, batch_sharding(self.mesh, a.ndim, batch_axis))

        return jax.tree.map(put, tree)

    def warm_start_step(self, state: TrainState, problems: list) -> tuple[TrainState, dict]:
        lo, hi = self._rows(len(problems))
        tokens, mask = self._place(self.io.demonstrations(problems[lo:hi], self.max_len))
        return self.sft_trainer.sft_step(state, tokens, mask)

    def _guidance(self, rs: RolloutState, version: int, ids: list, cache: GuidanceCache):
        """The rollout's guidance for the trainer as device arrays (``guidance_path``): the
        records of samples ``ids`` of policy ``version``, as the engine left them or through
        the cache (device -> host -> spill -> trainer)."""
        records = {k: v for k, v in rs.guidance.items() if not k.endswith(".codes")}
        if not records:
            return {}, {}
        # the records of the whole batch (every process has rows of the same shapes)
        nbytes = sum(r.nbytes for r in records.values())
        if self.cfg.guidance_path == "device":
            return self._split(records), {"guidance/bytes": float(nbytes)}
        t0 = time.perf_counter()
        # this process's rows of the records, as the cache keeps them (host arrays)
        mine = _with_rows(jax.tree.map(process_rows, records), 0, 1 / self.parts)
        # older versions are never trained on again: evicted before this one comes in, and this
        # batch's records leave once on the trainer's device, so that the host budget holds one
        # batch (a TRACE-all batch of the medium recipe: ~0.7 GB) instead of spilling to disk
        cache.evict(version_below=version)
        cache.put_batch(version, ids, mine)
        fetched = cache.get(version, ids)
        guidance = jax.block_until_ready(self._place(fetched))
        cache.discard(version, ids)
        return guidance, {
            "guidance/transfer_s": time.perf_counter() - t0,
            "guidance/bytes": float(nbytes),
        }

    def collect(
        self,
        rollout_params,
        step: int,
        problems: list,
        cache: GuidanceCache,
        version: int = 0,
        engine: RolloutEngine | None = None,
    ) -> tuple[RLBatch, np.ndarray, dict[str, float]]:
        """Roll out ``problems`` (this process's prompts, ``group_size`` samples each) with the
        policy ``rollout_params`` of ``version``, on ``engine`` (the run's), into the trainer's
        batch: tokens, rollout log-probs, group advantages, routes and the records through the
        guidance cache. Returns (batch, this process's rewards, seconds and bytes of each part:
        ``rollout/*``, ``guidance/*``)."""
        cfg, engine = self.cfg, engine or self.engine
        g = cfg.group_size
        batch_problems = [pr for pr in problems for _ in range(g)]
        first = self._rows(len(problems) * self.parts)[0] * g  # its first row of the batch
        t0 = time.perf_counter()
        engine.update_params(self.trainer.model(rollout_params), version=version)
        jax.block_until_ready(engine.state)
        times = {"rollout/refit_s": time.perf_counter() - t0}
        rs, rewards = self.rollout(engine, batch_problems, self._key(step, 1), times)
        adv = group_advantages(self._place(rewards).reshape(-1, g), cfg.loss.advantage)
        rows = dict(
            tokens=rs.tokens,
            filled=rs.filled,
            loss_mask=rs.generated,
            rollout_logp=rs.logprobs,
            advantages=adv.reshape(-1),
        )
        ids = [f"{step}/{first + i}" for i in range(len(batch_problems))]
        guidance, transfer = self._guidance(rs, version, ids, cache)
        codes = {
            k.removesuffix(".codes"): v for k, v in rs.guidance.items() if k.endswith(".codes")
        }
        batch = RLBatch(
            **self._split(rows),
            routes=self._split(jnp.moveaxis(rs.routes, 2, 0), batch_axis=1),
            guidance=guidance,
            rollout_codes=codes,
            code_rows=rs.code_rows,
        )
        if cfg.trim_padding:  # every process's batch to one width: the longest of all rows
            batch = batch.slots(trimmed_width(rs.filled))
        return batch, rewards, {**times, **transfer}

    def rl_step(
        self, state: TrainState, rollout_params, step: int, problems: list, cache: GuidanceCache
    ):
        cfg = self.cfg
        p, g = cfg.prompts_per_step, cfg.group_size
        rl_index = step - cfg.warm_start.steps
        version = max(rl_index - cfg.staleness, 0)
        lo, hi = self._rows(p)  # this process's prompts: whole groups
        t_step = time.perf_counter()
        runlog.compile_seconds()  # from here: what this step compiles
        batch, rewards, times = self.collect(rollout_params, step, problems[lo:hi], cache, version)
        ref = self.ref_params
        if ref is not None and cfg.ref_on_host:
            ref = jax.device_put(ref, jax.tree.map(lambda a: a.sharding, state.params))
        state, m = self.trainer.rl_step(state, batch, self._key(step, 4), ref)
        all_rewards = self._gather(rewards)
        per_row = jnp.sum(batch.loss_mask, axis=1)
        generated, longest = map(int, jax.device_get((jnp.sum(per_row), jnp.max(per_row))))
        m.update(times)
        m.update(self._slowest({k: v for k, v in m.items() if k.endswith("_s")}))
        m.update(
            {
                "reward": float(all_rewards.mean()),
                # groups whose samples' rewards differ: the only ones with a nonzero advantage
                "reward/mixed_groups": mixed_groups(all_rewards, g),
                "response_length": generated / (p * g),
                "rollout/tokens_per_s": generated / m["rollout/decode_s"],
                # the decode loop runs until the longest response ends: its iterations (one
                # turn) and the seconds of each, comparable across batches and modes
                "rollout/decode_steps": longest,
                "rollout/decode_step_ms": 1e3 * m["rollout/decode_s"] / max(longest, 1),
                "train/step_s": sum(
                    v for k, v in m.items() if k.startswith("train/") and k.endswith("_s")
                ),
                "step_s": self._slowest({"s": time.perf_counter() - t_step})["s"],
                runlog.COMPILE_KEY: self._slowest({"s": runlog.compile_seconds()})["s"],
                "policy_version_lag": float(rl_index - version),
            }
        )
        if self.guidance_bytes.compact:
            m.update(self.guidance_bytes.metrics())
        if (peak := memory.peak_gib()) is not None:
            m["memory/peak_gib"] = peak
        return state, m

    # ------------------------------------------------------------------ driver

    def run(self) -> dict[str, Any]:
        if self.mesh is None:
            return self._run()
        with jax.set_mesh(self.mesh):
            return self._run()

    def _start_policy(self, params) -> None:
        """Write the policy RL starts from to ``<run_dir>/policy`` (once) and, for the KL
        term, keep it as the frozen reference. Every process takes part in the save."""
        path = self.run_dir / "policy"
        exists = path.exists()
        if self.processes > 1:  # all have looked before any writes: all save, or none
            multihost_utils.sync_global_devices("policy")
        if not exists:
            save_params(path, self.trainer.model(params))
        # in results.json: runs' starts compared (across processes each leaf is gathered to the
        # host of every process: it holds a part of it)
        whole = jax.tree.map(host_value, params) if self.processes > 1 else params
        self.start_digest = params_digest(whole)
        if self.cfg.loss.kl_coef > 0:
            ref = restore_params(path, self.trainer.model(_copy(params)))
            self.ref_params = nnx.state(ref, nnx.Param)
            if self.cfg.ref_on_host:
                self.ref_params = jax.device_put(self.ref_params, jax.devices("cpu")[0])

    def _out_of_time(self, step_s: float) -> bool:
        """Whether, after a step of ``step_s`` seconds, another (and an evaluation) may not fit
        in ``time_limit_min``: the coming step is then the last of this process."""
        limit = self.cfg.time_limit_min * 60
        if not limit or not step_s:
            return False
        elapsed = time.monotonic() - self.started
        out = elapsed + 2 * step_s + self.eval_s > limit
        if self.processes > 1:  # process 0's clock decides for all: they stop at one step
            out = bool(multihost_utils.broadcast_one_to_all(np.asarray(out)))
        return out

    def _step(self, step: int, state: TrainState, history: list, streams: dict, cache, last=False):
        """Step ``step`` of the run: a warm-start update, or an RL step (the first one takes
        the policy RL starts from; the ``last`` one is evaluated). Returns (state, history,
        metrics)."""
        cfg = self.cfg
        if step < cfg.warm_start.steps:
            t0 = time.perf_counter()
            state, m = self.warm_start_step(state, next(streams["sft_stream"]))
            m = {k: float(v) for k, v in m.items()}  # waits for the step
            m["sft/step_s"] = self._slowest({"s": time.perf_counter() - t0})["s"]
            if cfg.steps == 0 and step == cfg.warm_start.steps - 1:  # what the warm start gives
                m.update(self.evaluate(state.params, step))
            return state, history, m
        before = {}
        if step == cfg.warm_start.steps:  # the policy RL starts from
            self._start_policy(state.params)
            state = dataclasses.replace(self.trainer.init(state.params), step=state.step)
            history = [_copy(state.params)] * cfg.staleness
            before = {f"{k}_start": v for k, v in self.evaluate(state.params, step).items()}
        rollout_params = history[0] if history else state.params
        if history:  # this version, for the rollouts `staleness` steps from now
            history = [*history[1:], _copy(state.params)]
        problems = next(streams["rl_stream"])
        state, m = self.rl_step(state, rollout_params, step, problems, cache)
        m.update(before)
        rl_done = step - cfg.warm_start.steps + 1
        if rl_done % cfg.eval_every == 0 or last:
            m.update(self.evaluate(state.params, step))
        return state, history, m

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        total = cfg.warm_start.steps + cfg.steps
        ckpt = RunCheckpointer(self.run_dir / "checkpoints")
        state = self.trainer.init()
        history = [_copy(state.params)] * cfg.staleness  # the last versions' params, oldest first
        streams = {  # grain prompt streams; their positions are checkpointed
            "sft_stream": prompt_stream(
                self.io.task, "train", batch_size=cfg.warm_start.batch, seed=cfg.seed
            ),
            "rl_stream": prompt_stream(
                self.io.task, "train", batch_size=cfg.prompts_per_step, seed=cfg.seed + 1
            ),
        }
        start = 0
        latest = ckpt.latest_step()
        if latest is not None:
            (state, history), meta = ckpt.restore(latest, (state, history))
            start = int(meta["next_step"])
            for name, stream in streams.items():
                stream.set_state(meta[name])
            self.log(f"resuming from the checkpoint of step {latest}")
            if start > cfg.warm_start.steps:  # RL had started: its reference is on disk
                self._start_policy(state.params)
        logger = runlog.MetricsLog(
            self.run_dir,
            resume_step=start - 1 if latest is not None else None,
            tensorboard=cfg.tensorboard,
            write=self.primary,
        )
        spill = self.run_dir / "guidance_spill"
        if self.processes > 1:  # each process's cache holds its own rows
            spill = spill / f"p{self.process}"
        if spill.exists():  # leftovers of a killed run: records are recomputed, never reused
            for f in sorted(spill.rglob("*"), reverse=True):
                f.unlink() if f.is_file() else f.rmdir()
        cache = GuidanceCache(spill, host_budget_bytes=cfg.guidance_host_bytes)
        progress = runlog.Progress(total, "train", start=start, show=self.primary)
        last: dict[str, float] = {}
        try:  # a failing or interrupted run still closes its files (checkpoints stay)
            step_s = 0.0  # the last step's seconds, for time_limit_min
            done = start  # steps done
            for step in range(start, total):
                t0 = time.monotonic()
                out_of_time = self._out_of_time(step_s)
                final = step == total - 1 or out_of_time  # evaluated and checkpointed
                state, history, m = self._step(step, state, history, streams, cache, final)
                step_s, done = time.monotonic() - t0, step + 1
                logger.write(step, m)
                last = m
                info = " ".join(
                    f"{label} {m[k]:.3g}" for k, label in PROGRESS_KEYS.items() if k in m
                )
                progress.update(step + 1, info)
                every = cfg.checkpoint_every
                if every and ((step + 1) % every == 0 or final):
                    meta = {name: stream.get_state() for name, stream in streams.items()}
                    ckpt.save(step, (state, history), {"next_step": step + 1, **meta})
                if out_of_time and step < total - 1:
                    saved = "checkpoint saved; the same command resumes"
                    self.log(
                        f"time_limit_min: stopping after step {step + 1} of {total} "
                        f"({saved if every else 'checkpoint_every: 0, nothing saved'})"
                    )
                    break
            if cfg.steps == 0 and done == total:  # a warm start only: others start from it
                self._start_policy(state.params)
        finally:
            cache.close()
            logger.close()
            ckpt.close()
        self.final_state = state
        records = runlog.read_metrics(self.run_dir / "metrics.jsonl")
        if cfg.plot and records and self.primary:
            runlog.plot_curves({cfg.train_mode: records}, PLOT_KEYS, self.run_dir / "curves.png")
        results = {
            "last": last,
            "records": len(records),
            "complete": done == total,
            "start_policy_sha256": self.start_digest,
        }
        post_hoc = cfg.ptq_scale_rules and cfg.rollout == "bf16" and cfg.eval_problems
        if post_hoc and cfg.steps and done == total:
            results["ptq_eval_reward"] = self.post_hoc_rewards(state.params)
        return results

    def post_hoc_rewards(self, params) -> dict[str, float]:
        """Greedy reward of the BF16 policy ``params`` (``bf16``) and of it quantized post hoc
        with each of ``ptq_scale_rules`` (``fp4 ptq (<rule>)``): FP4 expert weights and
        activations and an FP4 KV cache, as the FP4 modes' evaluation rolls out; all on the
        ``eval_problems`` of ``eval/reward`` with one key."""
        cfg = self.cfg
        step = cfg.warm_start.steps + cfg.steps  # keys of their own, after the run's last step
        rewards = {"bf16": self._greedy_reward(self.eval_engine, params, step)}
        fp4_cfg = dataclasses.replace(self.eval_engine.cfg, kv_cache=cfg.fmt, fp4_weights=True)
        for rule in cfg.ptq_scale_rules:
            policy = fp4_eval_policy(cfg.fmt, weight_scale_rule=rule)
            engine = RolloutEngine(self.trainer.model(params), policy, fp4_cfg, greedy=True)
            rewards[f"fp4 ptq ({rule})"] = self._greedy_reward(engine, params, step)
        self.log(f"post-hoc quantization of the policy (greedy reward, {cfg.eval_split} split)")
        for name, reward in rewards.items():
            self.log(f"  {name:28s} {reward:.3f}")
        return rewards


# trim_padding's widths: multiples of this many slots (few compiled widths, little padding)
TRIM_MULTIPLE = 16


def trimmed_width(filled: jax.Array, multiple: int = TRIM_MULTIPLE) -> int:
    """The slots a batch keeps under ``trim_padding``: its longest sequence (``filled`` [B, S]
    bool, each row a prefix of True) rounded up to ``multiple``, at most S."""
    longest = int(jnp.max(jnp.sum(filled, axis=1)))
    return min(-(-longest // multiple) * multiple, filled.shape[1])


def mixed_groups(rewards: np.ndarray, group_size: int) -> float:
    """The share of groups (``group_size`` consecutive samples of one prompt in ``rewards``
    [P * G]) whose rewards are not all equal: GRPO's signal (an all-equal group's advantages
    are zero)."""
    groups = np.asarray(rewards, np.float64).reshape(-1, group_size)
    return float(np.mean(groups.max(axis=1) > groups.min(axis=1)))


def _restore_policy(path: str, model: Transformer) -> None:
    """Load ``init_checkpoint`` into ``model``: a run directory's ``policy/`` or a folder of
    ``save_params``. Raises ``ConfigError`` naming the folder when it is missing or does not fit
    the model."""
    folder = Path(path)
    if (folder / "policy").is_dir():
        folder = folder / "policy"
    if not folder.is_dir():
        raise ConfigError(
            f"init_checkpoint: {path} is neither a run directory with policy/ nor "
            "a parameter folder"
        )
    try:
        restore_params(folder, model)
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
        cause = e.__cause__ or e  # restore_params names the folder already: keep the reason
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
        raise ConfigError(
            f"init_checkpoint: {folder} does not hold parameters of this model config ({first})"
        ) from None


def _with_rows(tree, batch_axis: int, factor: float):
    """``tree`` whose records (``fp4.Guidance`` / ``QTensor``, a shape of B rows along
    ``batch_axis`` in their static fields) have ``factor`` times the rows: records whose arrays
    are now the global batch's (``factor``: the parts of a batch) or a process's part of it
    (``1 / parts``)."""

    def scale(r):
        if factor == 1 or not isinstance(r, fp4.Guidance | fp4.QTensor):
            return r
        shape = list(r.shape)
        shape[batch_axis] = round(shape[batch_axis] * factor)
        return dataclasses.replace(r, shape=tuple(shape))

    return jax.tree.map(scale, tree, is_leaf=lambda x: isinstance(x, fp4.Guidance | fp4.QTensor))


def _copy(tree):
    """A copy of arrays that a donating step would otherwise invalidate."""
    return jax.tree.map(jnp.copy, tree)


PROGRESS_KEYS = {
    "sft/loss": "sft_loss",
    "reward": "reward",
    "eval/reward": "eval_reward",
    "eval/reward_bf16": "eval_bf16",
    "mismatch/logp_abs": "logp_abs",
    "mismatch/guided_code_agreement": "guided_agree",
}
PLOT_KEYS = (
    "reward",
    "reward/mixed_groups",
    "eval/reward",
    "eval/reward_bf16",
    "mismatch/logp_abs",
    "mismatch/kl_k3",
    "mismatch/guided_code_agreement",
    "mismatch/route_rate",
    "train/entropy",
    "loss/clip_frac",
    "response_length",
    "sft/loss",
)
