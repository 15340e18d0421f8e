"""The rollout engine's benchmark (any device; only a GPU's figures mean anything): whole-model
decode tokens/s per engine against the best BF16 engine, peak device memory and the largest
batch x context each engine fits, the byte floor of a decode step and each engine's fraction of
it, and a per-step profile of the decode step.

    PYTHONPATH=. python3 experiments/bench/rollout.py --preset qwen3-30b-a3b \\
        --engines w4a16,w4a4,bf16,bf16-pallas --batches 32,64,128 --prompt 512 --gens 1024,8192
    PYTHONPATH=. python3 experiments/bench/rollout.py --preset qwen3-30b-a3b --layers 8 \\
        --engines w4a16,w4a4,bf16-pallas --batches 64 --gens 1024 --profile

Engines (``--engines``; ``ENGINES`` below): ``bf16`` (BF16 weights and KV, XLA attention over
the cache; the routed experts through JAX's Hopper grouped kernel ``ragged_dot_mgpu`` where it
applies, ``pallas_kernels.bf16_grouped_matmul``, else XLA's ``ragged_dot``; runs before
2026-12-07 had XLA's ``ragged_dot`` everywhere), ``bf16-pallas`` (the same weights, single-token
steps through the decode-attention kernel with its fused append over the BF16 cache), ``w4a16``
(NVFP4 routed experts, prepacked for the grouped kernel, NVFP4 KV cache through the
decode-attention kernel), ``w4a4`` (``w4a16`` with the expert activations quantized to NVFP4
per token), ``trace`` (TRACE's rollout policy: ``w4a4`` recording guidance in the deeper half),
and ``w4a16-xla`` / ``w4a4-xla`` (the FP4 engines' XLA reference path). FP4 engines are built
layer by layer straight into their rollout form (``trace_jax.rollout.load``), so the whole BF16
model never sits on the device; BF16 engines build the model as it is. ``--attention tc`` sends
the NVFP4 cache to the tensor-core decode-attention kernel.

Timing. ``--mode window`` (the default): a decode step costs the same whatever the cached values
are, and its time is linear in the context (attention reads each sequence's filled slots), so
the mean step over a generation of G tokens after a P-token prompt is measured as ``--window``
decode steps (one compiled ``decode`` call: the loop stays on the device) from states whose
lengths are P, P + G/2 and P + G - window (the cache's slots hold the zeros ``start`` wrote),
combined by Simpson's rule. One program serves every generation length (the cache holds
P + max(G) slots). ``--mode full``: a real prefill (chunks of ``--chunk``) and the whole
generation, timed as one ``decode`` call. Each timed call is warmed up (compiled) first; the
median of ``--repeats`` calls is kept; a call whose generated count or log-probs are wrong
fails its row.

Floor: the bytes a decode step must read (``step_bytes``: the experts a batch hits,
``E (1 - (1 - k/E)^B)`` per MoE layer, at their stored width, the router, attention and LM head
weights, the KV cache up to each sequence's length and the new token's K/V) over the GPU's HBM
bandwidth, at the generation's mean context; each engine's tokens/s as a fraction of its floor.

Memory: each engine runs in a process of its own (``--isolate``, the default on a GPU), whose
``peak_bytes_in_use`` is the engine's peak (over its batches, run in increasing order); the
largest context at each batch (and batch at each context) follows from the device's limit,
the weights, the measured workspace and the state's bytes per token.

Compilation: a deep model's decode step is unrolled over its layers, and a 48-layer program
takes minutes to compile. Each engine's decode programs are compiled before any is timed,
side by side in threads (``precompile``). ``--compile-only --cache-dir D`` compiles every
engine's programs from the models' shapes alone (no weights allocated, device memory taken as
needed), into the persistent compilation cache D, beside a measuring run with the same
``--cache-dir``: its engines load the programs D holds when they compile theirs (those of a
later engine, or of a later run over fewer layers), and wait for the compiling processes to end
before they time anything::

    R="python3 experiments/bench/rollout.py --preset qwen3-30b-a3b --cache-dir /tmp/jax-cache"
    export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the processes share the device
    $R --engines bf16-pallas --compile-only & $R --engines w4a16,bf16-pallas

SIGTERM (``timeout``) ends the run with the table of what was measured; ``--json`` is written
after each engine. ``--limit-gb`` counts the device as holding that many GB (the fit checks).

``--profile``: the decode step with one part at a time replaced by a stand-in of the same shape
(experts: zeros; attention: the K/V append alone; KV append: neither; LM head: zero logits;
router: the hidden state's first E features as logits; sampling: argmax; activation
quantization: off), each a compiled engine of its own; a part's time is what removing it saves,
"rest" what no part accounts for.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import functools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

# the engine's room on a GPU, unless a share is set (under JAX 0.11's name or the deprecated one,
# as experiments.runner.set_memory_fraction: JAX refuses both at once)
if not any(
    os.environ.get(v) for v in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
):
    os.environ["XLA_CLIENT_MEM_FRACTION"] = "0.95"
if "--compile-only" in sys.argv:  # beside an engine's process: take device memory as needed
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.layouts import Fp4Weight
from trace_jax.config import ConfigError
from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.model.sharding import commit
from trace_jax.rollout import RolloutConfig, RolloutEngine
from trace_jax.rollout import load as rollout_load
from trace_jax.rollout.engine import pack_expert_weight

# Datasheet HBM bandwidth (bytes/s) by device kind; a kind not listed counts as the H200's.
HBM_PEAK = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12}


@dataclasses.dataclass(frozen=True)
class Engine:
    """An engine configuration: policy, cache format, backend, kernels, FP4 expert weights."""

    policy: QuantPolicy
    kv: str
    backend: str
    kernels: tuple[str, ...]
    fp4: bool
    about: str

    def rollout(self, max_len: int, new: int, attention: str) -> RolloutConfig:
        kernels = tuple(
            "attention_tc" if k == "attention" and attention == "tc" else k for k in self.kernels
        )
        return RolloutConfig(
            max_len=max_len,
            max_new_tokens=new,
            kv_cache=self.kv,
            fp4_weights=self.fp4,
            backend=self.backend,
            kernels=kernels or ("attention",),
        )


_W4A16 = QuantPolicy(fmt="nvfp4", expert_weights="rtn", kv="rtn")
_W4A4 = dataclasses.replace(_W4A16, expert_acts="rtn")
ENGINES = {
    "bf16": Engine(QuantPolicy.bf16(), "bf16", "xla", (), False, "BF16, XLA"),
    "bf16-pallas": Engine(
        QuantPolicy.bf16(), "bf16", "pallas", ("attention",), False, "BF16, attention kernel"
    ),
    "w4a16": Engine(_W4A16, "nvfp4", "pallas", ("moe", "attention"), True, "NVFP4 W4A16 + KV"),
    "w4a4": Engine(_W4A4, "nvfp4", "pallas", ("moe", "attention"), True, "NVFP4 W4A4 + KV"),
    "trace": Engine(
        QuantPolicy.rollout("nvfp4"), "nvfp4", "pallas", ("moe", "attention"), True, "TRACE rollout"
    ),
    "w4a16-xla": Engine(_W4A16, "nvfp4", "xla", (), True, "NVFP4 W4A16 + KV, XLA"),
    "w4a4-xla": Engine(_W4A4, "nvfp4", "xla", (), True, "NVFP4 W4A4 + KV, XLA"),
}
PARTS = ("experts", "attention", "kv_append", "lm_head", "router", "sampling", "act_quant")


def hbm_peak(device_kind: str) -> float:
    """The datasheet HBM bandwidth of the GPU named ``device_kind`` (e.g. "NVIDIA H200")."""
    return next((v for name, v in HBM_PEAK.items() if name in device_kind), HBM_PEAK["H200"])


# ----------------------------------------------------------------------------- floor


def kv_bytes_per_token(cfg: ModelConfig, kv: str) -> float:
    """K and V bytes one token stores in one layer's cache (codes, block and global scales)."""
    d, h = cfg.head_dim, cfg.num_kv_heads
    per_head = {
        "bf16": 2 * d,
        "fp8": d + 4,
        "nvfp4": d / 2 + d / 16 + 4,
        "mxfp4": d / 2 + d / 32 + 4,
    }[kv]
    return 2 * h * per_head


def step_bytes(cfg: ModelConfig, engine: Engine, batch: int, context: float) -> dict[str, float]:
    """The bytes one decode step of ``batch`` sequences at mean length ``context`` must read
    (each weight it uses and each filled cache slot once) and write (the new K/V), by part."""
    p = jnp.dtype(cfg.param_dtype).itemsize  # unquantized weights are read as stored
    h, e, k, inner = (
        cfg.hidden_size,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
    )
    moe = len(cfg.moe_layers)
    dense = cfg.num_layers - moe
    hit = e * (1 - (1 - k / e) ** batch) if e else 0.0
    # NVFP4: 4-bit codes + an E4M3 scale per 16, and each output row's float32 scale
    per_expert = 3 * h * inner * (0.5625 if engine.fp4 else p) + (
        4 * (2 * inner + h) if engine.fp4 else 0
    )
    attn = (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * h * p
    kv = kv_bytes_per_token(cfg, engine.kv) * cfg.num_layers
    return {
        "experts": moe * hit * per_expert,
        "router": moe * h * e * p,
        "attention weights": cfg.num_layers * attn,
        "dense mlp": dense * 3 * h * cfg.intermediate_size * p,
        "lm head": h * cfg.vocab_size * p,
        "kv read": batch * context * kv,
        "kv write": batch * kv,
        "norms, embedding": (2 * cfg.num_layers + 1) * h * p + batch * h * p,
    }


# ----------------------------------------------------------------------------- engines


def build_model(cfg: ModelConfig, engine: Engine, attention: str, seed: int) -> Transformer:
    """The model in the engine's rollout form: FP4 engines layer by layer (their experts packed
    as each layer is made), BF16 engines as ``Transformer`` builds them."""
    if not engine.fp4:
        return Transformer(cfg, nnx.Rngs(seed))
    rollout = engine.rollout(16, 1, attention)
    return rollout_load.init_rollout_model(cfg, engine.policy, rollout, seed=seed)


def _memory() -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    return {k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")}


def _synthetic(engine: RolloutEngine, batch: int, position: int, key) -> object:
    """A state of ``batch`` sequences of length ``position`` (cache slots as ``start`` wrote
    them), ready to decode: a step costs the same whatever the cached values are."""
    st = engine.start(batch)
    lengths = jnp.full((batch,), position, jnp.int32)
    logits = jax.random.normal(key, st.last_logits.shape, jnp.float32)
    cache = dataclasses.replace(st.cache, lengths=lengths)
    # committed as a prefill's state is: one compiled decode program for both (and ``precompile``'s)
    st = commit(dataclasses.replace(st, cache=cache, last_logits=logits))
    return jax.block_until_ready(st)


def _check(out, batch: int, steps: int) -> str | None:
    generated = int(np.asarray(out.generated).sum())
    if generated != batch * steps:
        return f"generated {generated} tokens, expected {batch * steps}"
    lp = np.asarray(out.logprobs)[np.asarray(out.generated)]
    if not np.all(np.isfinite(lp)) or np.any(lp > 0):
        return "non-finite or positive log-probs"
    return None


def time_window(engine: RolloutEngine, batch: int, position: int, repeats: int, seed: int):
    """Seconds per decode step from ``position`` over ``engine.cfg.max_new_tokens`` steps
    (median of ``repeats`` calls; one warm-up call first), or an error string."""
    steps = engine.cfg.max_new_tokens
    times = []
    for r in range(repeats + 1):
        st = _synthetic(engine, batch, position, jax.random.key(seed + r))
        t0 = time.perf_counter()
        out = engine.decode(st, jax.random.key(seed + 100 + r))
        jax.block_until_ready(out.tokens)
        if r:
            times.append(time.perf_counter() - t0)
        if err := _check(out, batch, steps):
            return err
        del out
    return statistics.median(times) / steps


def time_full(engine: RolloutEngine, batch: int, prompt: int, chunk: int, repeats: int, seed: int):
    """Seconds per decode step of a real rollout: prefill of ``prompt`` random tokens in chunks,
    then ``max_new_tokens`` tokens as one ``decode`` call (the warm-up compiles it on one step
    from a nearly full state)."""
    cfg = engine.cfg
    steps = cfg.max_new_tokens
    warm = _synthetic(engine, batch, cfg.max_len - 1, jax.random.key(seed))
    jax.block_until_ready(engine.decode(warm, jax.random.key(seed)).tokens)
    vocab = engine.model_cfg.vocab_size
    times = []
    for r in range(repeats):
        tokens = jax.random.randint(jax.random.key(seed + r), (batch, prompt), 1, vocab)
        st = engine.start(batch)
        for i in range(0, prompt, chunk):
            st = engine.append(st, tokens[:, i : i + chunk])
        jax.block_until_ready(st.last_logits)
        t0 = time.perf_counter()
        out = engine.decode(st, jax.random.key(seed + 100 + r))
        jax.block_until_ready(out.tokens)
        times.append(time.perf_counter() - t0)
        if err := _check(out, batch, steps):
            return err
    return statistics.median(times) / steps


def _oom(err: Exception) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def device_bytes(tree) -> int:
    """Bytes of the distinct arrays (or shapes) in ``tree``: a buffer two leaves share (a
    prepacked weight's codes and its ``QTensor``'s) counts once."""
    leaves = {id(x): x for x in jax.tree.leaves(tree)}
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves.values())


def abstract_model(cfg: ModelConfig, engine: Engine, attention: str, seed: int) -> Transformer:
    """The model ``build_model`` makes, as shapes committed to the first device (nothing
    allocated): an engine's programs compile from it as from the real model."""
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(seed)))
    quantize, prepack = rollout_load.expert_packing(engine.policy, engine.rollout(16, 1, attention))
    pack = functools.partial(pack_expert_weight, policy=engine.policy, prepack=prepack)
    for layer in model.layers if quantize else ():
        for name in ("gate_proj", "up_proj", "down_proj") if layer.is_moe else ():
            param = getattr(layer.mlp, name)
            w = jax.eval_shape(pack, param.get_value())
            if isinstance(w, Fp4Weight):  # prepack_arrays keeps the QTensor's codes, not a copy
                w = dataclasses.replace(w, codes=w.qtensor.codes)
            param.set_value(w)
    graphdef, state = nnx.split(model)
    placed = {}  # a shared leaf stays one object (``device_bytes`` counts it once)
    state = jax.tree.map(lambda x: placed.setdefault(id(x), _on_device(x)), state)
    return nnx.merge(graphdef, state)


def _on_device(x) -> jax.ShapeDtypeStruct:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device)


def _engine(model, engine_spec: Engine, args, batch: int, new: int, gens: list[int], weights):
    """The engine of one decode program and its state's bytes; a MemoryError where the weights
    and the state alone exceed the device (not worth a compile to find out)."""
    eng = RolloutEngine(
        model, engine_spec.policy, engine_spec.rollout(args.prompt + max(gens), new, args.attention)
    )
    shapes = jax.eval_shape(functools.partial(eng.start, batch))
    state_bytes = device_bytes(shapes)
    limit = _limit(args)
    if limit and weights + state_bytes > limit:
        raise MemoryError(
            f"RESOURCE_EXHAUSTED: weights and state need "
            f"{(weights + state_bytes) / 1e9:.1f} GB of {limit / 1e9:.1f}"
        )
    return eng, state_bytes


def _limit(args) -> float | None:
    return args.limit_gb * 1e9 if args.limit_gb else _memory()["bytes_limit"]


def _plan(model, engine_spec: Engine, args, weights: int) -> list[tuple]:
    """(batch, new, gens, engine, state bytes) of each decode program, in the order they run."""
    return [
        p
        for batch in args.batches
        for new, gens in _programs(args)
        for p in _fitting(model, engine_spec, args, batch, new, gens, weights)
    ]


def _fitting(model, engine_spec: Engine, args, batch: int, new: int, gens: list[int], weights):
    """The plan entry of one program over ``gens``; where its state does not fit, of one
    program per generation length ((batch, new, [g], None, why) for one that does not fit
    either)."""
    try:
        return [(batch, new, gens, *_engine(model, engine_spec, args, batch, new, gens, weights))]
    except MemoryError as err:
        if len(gens) > 1:
            return [
                p
                for g in gens
                for p in _fitting(model, engine_spec, args, batch, new, [g], weights)
            ]
        return [(batch, new, gens, None, f"does not fit: {str(err)[:110]}")]


def precompile(jobs: list[tuple[str, RolloutEngine, int]], wait_for: str | None = None) -> None:
    """Compile the decode program of each (label, engine, batch) before any is timed: lowered
    one at a time (tracing holds the GIL), compiled in threads (XLA's compiler releases it), so
    that the programs of a deep model (its layers unrolled) compile side by side; a program that
    ``--compile-only`` put in the compilation cache loads from it. ``wait_for``: that cache's
    folder; then wait until the ``--compile-only`` processes are done (none of their work
    overlaps a timing)."""
    lowered = []
    for label, eng, batch in jobs:
        t0 = time.perf_counter()
        state = jax.tree.map(_on_device, jax.eval_shape(functools.partial(eng.start, batch)))
        rows = jnp.asarray(np.arange(batch, dtype=np.int32))  # as ``decode`` passes them
        low = RolloutEngine._decode.lower(
            eng, eng.state, state, jax.random.key(0), jnp.asarray(eng.greedy), rows
        )
        lowered.append((label, low, time.perf_counter() - t0))

    def compile_one(item):
        label, low, lower_s = item
        t0 = time.perf_counter()
        low.compile()
        print(
            f"  compiled {label}: traced and lowered in {lower_s:.1f} s, "
            f"compiled (or loaded) in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )

    if lowered:
        with ThreadPoolExecutor(len(lowered)) as pool:
            list(pool.map(compile_one, lowered))
    if wait_for:
        _compilers_lock(wait_for, fcntl.LOCK_EX)  # taken once no compiler holds it, then freed


def _compilers_lock(cache_dir: str, mode: int) -> None:
    """``--compile-only`` processes hold ``cache_dir``'s lock shared for their lifetime
    (``LOCK_SH``, released when they exit, however they end); ``LOCK_EX`` waits for them."""
    fd = os.open(os.path.join(cache_dir, "compiling.lock"), os.O_CREAT | os.O_RDWR)
    if mode == fcntl.LOCK_EX:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("  waiting for the --compile-only processes", flush=True)
            t0 = time.perf_counter()
            fcntl.flock(fd, fcntl.LOCK_EX)
            print(f"  waited {time.perf_counter() - t0:.0f} s", flush=True)
        os.close(fd)
    else:
        fcntl.flock(fd, mode)  # the descriptor stays open: held until the process ends


def _prepare(name: str, args, cfg: ModelConfig) -> tuple[dict, object, list[tuple]]:
    """An engine's result record, its model (built, or its shapes with ``--compile-only``) and
    the plan of its decode programs (``_plan``); the model is None where it does not fit."""
    engine_spec = ENGINES[name]
    out = {"engine": name, "device": jax.devices()[0].device_kind}
    out.update(rows=[], memory=[], profile=[])
    t0 = time.perf_counter()
    if args.compile_only:
        model = abstract_model(cfg, engine_spec, args.attention, args.seed)
    else:
        try:
            model = build_model(cfg, engine_spec, args.attention, args.seed)
        except Exception as err:
            if not _oom(err):
                raise
            out["error"] = f"model does not fit: {str(err).splitlines()[0][:120]}"
            return out, None, []
    weights = device_bytes(nnx.state(model))
    out["weights_bytes"], out["build_s"] = weights, time.perf_counter() - t0
    limit = _limit(args)
    if limit and weights > limit:
        out["error"] = f"model does not fit: {weights / 1e9:.2f} GB of {limit / 1e9:.2f}"
        print(f"  {name}: {out['error']}", flush=True)
        return out, None, []
    return out, model, _plan(model, engine_spec, args, weights)


def run_engine(name: str, args, cfg: ModelConfig) -> dict:
    """Every measurement of one engine: decode rows per (batch, generation), memory, profile.
    Its decode programs are compiled first (``precompile``); each program's rows are printed,
    and in a child process its result so far too, as soon as they are measured."""
    engine_spec = ENGINES[name]
    out, model, queue = _prepare(name, args, cfg)
    if model is None:
        return out
    kind = out["device"]
    if args.child:  # the device, weights and build time, kept where the process is stopped later
        _to_parent(out)
    label = f"{name} on {kind}"
    jobs = [(f"{label}, batch {b}, gens {g}", eng, b) for b, _, g, eng, _ in queue if eng]
    precompile(jobs, args.cache_dir)
    while queue:
        batch, new, gens, eng, info = queue.pop(0)
        slots = max(gens)
        try:
            if eng is None:
                raise MemoryError(info)
            steps = _measure(eng, batch, gens, args)
        except Exception as err:
            if not _oom(err):
                raise
            if eng is not None and len(gens) > 1:  # one program per generation length instead
                weights = out["weights_bytes"]
                split = (_fitting(model, engine_spec, args, batch, new, [g], weights) for g in gens)
                queue = [p for ps in split for p in ps] + queue
                continue
            why = info if eng is None else f"does not fit: {str(err).splitlines()[0][:110]}"
            out["memory"].append(dict(batch=batch, context=args.prompt + slots, oom=why))
            out["rows"].append(dict(batch=batch, gen=slots, device=kind, error=why))
            print(f"  {label}: batch {batch} gen {slots}: {why}", flush=True)
            continue
        mem = _memory()
        out["memory"].append(
            dict(batch=batch, context=args.prompt + slots, state_bytes=info, **mem)
        )
        for g, by_pos in steps.items():
            row = _row(cfg, engine_spec, batch, args.prompt, g, by_pos, args.mode)
            out["rows"].append(dict(row, device=kind))
            print(f"  {label}: {_progress(row, mem)}", flush=True)
        if args.child:
            _to_parent(out)
    if args.profile:
        out["profile"] = profile(model, engine_spec, cfg, args, args.batches[0])
    return out


def _measure(eng: RolloutEngine, batch: int, gens: list[int], args) -> dict:
    """gen -> {position: seconds per step (or an error string)} for one compiled program."""
    if args.mode == "full":
        (g,) = gens
        return {
            g: {
                args.prompt + g // 2: time_full(
                    eng, batch, args.prompt, args.chunk, args.repeats, args.seed
                )
            }
        }
    steps = {}
    for g in gens:
        for pos in (args.prompt, args.prompt + g // 2, args.prompt + g - args.window):
            steps.setdefault(g, {})[pos] = time_window(eng, batch, pos, args.repeats, args.seed)
    return steps


def _progress(row: dict, mem: dict) -> str:
    head = f"batch {row['batch']} gen {row['gen']}:"
    if "error" in row:
        return f"{head} {row['error']}"
    peak = mem.get("peak_bytes_in_use")
    peak = f", peak {peak / 1e9:.1f} GB" if peak else ""
    return (
        f"{head} {row['tokens_per_s']:.0f} tokens/s, {row['mean_step_ms']:.2f} ms a step, "
        f"{100 * row['of_floor']:.0f} % of its floor{peak}"
    )


def _programs(args) -> list[tuple[int, list[int]]]:
    """(max_new_tokens, the generation lengths it measures) of each compiled program: window
    mode, one program over the longest generation (one per length if that does not fit);
    full mode, one per generation."""
    if args.mode == "window":
        return [(args.window, list(args.gens))]
    return [(g, [g]) for g in args.gens]


def _row(cfg, engine_spec, batch, prompt, gen, by_pos, mode) -> dict:
    errors = [v for v in by_pos.values() if isinstance(v, str)]
    if errors:
        return dict(batch=batch, gen=gen, error=f"check failed: {errors[0]}")
    times = [by_pos[p] for p in sorted(by_pos)]
    mean = times[0] if len(times) == 1 else (times[0] + 4 * times[1] + times[2]) / 6
    context = prompt + gen / 2
    floor_bytes = sum(step_bytes(cfg, engine_spec, batch, context).values())
    floor_s = floor_bytes / hbm_peak(jax.devices()[0].device_kind)
    return dict(
        batch=batch,
        gen=gen,
        mode=mode,
        step_ms=[t * 1e3 for t in times],
        mean_step_ms=mean * 1e3,
        tokens_per_s=batch / mean,
        floor_bytes=floor_bytes,
        floor_tokens_per_s=batch / floor_s,
        of_floor=floor_s / mean,
    )


# ----------------------------------------------------------------------------- profile


@contextlib.contextmanager
def _patched(patches: list[tuple[object, str, object]]):
    """Set attributes for the duration; each stand-in must be reached while tracing."""
    old = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in old:
            setattr(obj, name, value)


class _Einsums:
    """``jax.numpy`` for the transformer module, with some einsum specs replaced."""

    def __init__(self, stand_ins: dict[str, Callable], hits: set):
        self._stand_ins, self._hits = stand_ins, hits

    def __getattr__(self, name):
        return getattr(jnp, name)

    def einsum(self, spec, *operands, **kw):
        if spec in self._stand_ins:
            self._hits.add(spec)
            return self._stand_ins[spec](*operands)
        return jnp.einsum(spec, *operands, **kw)


def _variants(engine_spec: Engine, hits: set) -> dict[str, list]:
    """Ablation name -> the patches that remove that part (stand-ins record that they ran)."""
    from pallas_kernels import fp4_decode_attention as fa
    from trace_jax.model import layers, policy, transformer
    from trace_jax.rollout import engine as engine_mod
    from trace_jax.rollout import kv_cache

    def reached(tag, fn):
        def wrapped(*a, **kw):
            hits.add(tag)
            return fn(*a, **kw)

        return wrapped

    def no_experts(x, w, group_sizes):
        return jnp.zeros((x.shape[0], w.shape[-1]), x.dtype)

    def append_only(q, k, v, new_k, new_v, lengths, *, qts=None, valid=None, **kw):
        k, v = fa.kv_append_many(
            [k, v],
            [new_k, new_v],
            lengths,
            qts=qts,
            valid=valid,
            interpret=kw.get("interpret", False),
        )
        return jnp.zeros_like(q), k, v

    def neither(q, k, v, new_k, new_v, lengths, **kw):
        return jnp.zeros_like(q), k, v

    def argmax_sample(logits, key, cfg, greedy=None):
        return jnp.argmax(logits, -1).astype(jnp.int32), jnp.zeros(logits.shape[:1], jnp.float32)

    def einsums(spec, fn):
        return [(transformer, "jnp", _Einsums({spec: reached(spec, fn)}, hits))]

    kernel_attention = engine_spec.backend == "pallas" and "attention" in engine_spec.kernels
    out = {
        "full": [],
        "experts": [(layers, "expert_matmul", reached("experts", no_experts))],
        "lm_head": einsums(
            "bth,hv->btv", lambda x, w: jnp.zeros((*x.shape[:2], w.shape[1]), jnp.float32)
        ),
        "router": einsums("bth,he->bte", lambda x, w: x[..., : w.shape[1]].astype(jnp.float32)),
        "sampling": [(engine_mod, "sample", reached("sampling", argmax_sample))],
    }
    if kernel_attention:
        out["attention"] = [(fa, "decode_attention_append", reached("attention", append_only))]
        out["kv_append"] = [(fa, "decode_attention_append", reached("kv_append", neither))]
    else:
        out["attention"] = [
            (layers, "attention", reached("attention", lambda q, k, v, m: jnp.zeros_like(q)))
        ]
        out["kv_append"] = [
            (kv_cache, "write", reached("kv_append", lambda stored, new, lengths, valid: stored))
        ]
    if engine_spec.policy.expert_acts != "off":
        out["act_quant"] = [
            (
                policy.SiteContext,
                "activation",
                reached("act_quant", lambda self, name, x, layer, kind="act": x),
            )
        ]
    return out


def _drop_step_programs() -> None:
    RolloutEngine._append.clear_cache()
    RolloutEngine._decode.clear_cache()


def profile(model, engine_spec: Engine, cfg: ModelConfig, args, batch: int) -> list[dict]:
    """Per-part ms of one decode step at ``--profile-position`` (module docstring)."""
    position = args.profile_position or args.prompt + min(args.gens) // 2
    max_len = args.prompt + max(args.gens)  # the measured engines' cache (XLA reads all of it)
    if position + args.window > max_len:
        raise ValueError(f"--profile-position: {position} + --window > {max_len} cache slots")
    rollout = engine_spec.rollout(max_len, args.window, args.attention)
    times = {}
    for name, patches in _variants(engine_spec, hits := set()).items():
        hits.clear()
        # Engines built alike share compiled programs: each variant must be traced anew with
        # its stand-in, so the engine's steps keep no program of the last one (the process's
        # other programs stay: a stand-in is reached only from these steps, checked below).
        _drop_step_programs()
        with _patched(patches):
            eng = RolloutEngine(model, engine_spec.policy, rollout)
            t = time_window(eng, batch, position, args.repeats, args.seed)
        if name != "full" and not hits:
            raise RuntimeError(f"profile: the stand-in for {name} was never reached")
        if isinstance(t, str) and name == "full":
            raise RuntimeError(f"profile: the full step failed its check: {t}")
        times[name] = t * 1e3 if not isinstance(t, str) else math.nan
    _drop_step_programs()  # nor does a later engine built alike run the last ablated step
    full = times["full"]
    parts = {p: full - times[p] for p in PARTS if p in times}
    if (
        "attention" in parts
        and engine_spec.backend == "pallas"
        and "attention" in engine_spec.kernels
    ):
        # attention: full minus the append alone; the append: the append alone minus neither
        parts["kv_append"] = times["attention"] - times["kv_append"]
    rows = [dict(part=p, ms=ms, share=ms / full) for p, ms in parts.items()]
    rest = full - sum(parts.values())
    return [
        dict(part="step", ms=full, share=1.0),
        *rows,
        dict(part="rest", ms=rest, share=rest / full),
    ]


# ----------------------------------------------------------------------------- driver


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--layers", type=int, default=None, help="the preset with N layers")
    parser.add_argument("--engines", default="bf16,bf16-pallas,w4a16,w4a4")
    parser.add_argument("--batches", default="2", help="comma-separated batch sizes")
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens")
    parser.add_argument("--gens", default="16", help="comma-separated generation lengths")
    parser.add_argument("--mode", choices=("window", "full"), default="window")
    parser.add_argument("--window", type=int, default=4, help="decode steps per timed window")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk (--mode full)")
    parser.add_argument("--attention", choices=("triton", "tc"), default="triton")
    parser.add_argument("--profile", action="store_true", help="the per-step profile too")
    parser.add_argument("--profile-position", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--isolate", choices=("auto", "yes", "no"), default="auto")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument(
        "--limit-gb", type=float, default=None, help="count the device as holding this many GB"
    )
    parser.add_argument("--cache-dir", default=None, help="persistent compilation cache folder")
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="compile the engines' decode programs into --cache-dir (beside a run that uses it)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.batches = _ints(parser, "--batches", args.batches)
    args.gens = _ints(parser, "--gens", args.gens)
    args.engines = args.engines.split(",")
    for name in args.engines:
        if name not in ENGINES:
            parser.error(f"--engines: unknown engine {name!r} (one of {', '.join(ENGINES)})")
    for flag, v in (
        ("--prompt", args.prompt),
        ("--window", args.window),
        ("--repeats", args.repeats),
        ("--chunk", args.chunk),
    ):
        if v <= 0:
            parser.error(f"{flag}: must be positive, got {v}")
    if args.layers is not None and args.layers <= 0:
        parser.error(f"--layers: must be positive, got {args.layers}")
    if args.limit_gb is not None and args.limit_gb <= 0:
        parser.error(f"--limit-gb: must be positive, got {args.limit_gb}")
    if args.compile_only and not args.cache_dir:
        parser.error("--compile-only: needs --cache-dir (the folder the run reads them from)")
    if args.mode == "window" and min(args.gens) < 2 * args.window:
        parser.error(f"--gens: each must be at least 2 x --window ({2 * args.window})")
    args.batches.sort()
    return args


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2
        self.exit(2, f"{self.prog}: {message}\n")


def _ints(parser, flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"{flag}: expected comma-separated integers, got {text!r}")
    if min(values) <= 0:
        parser.error(f"{flag}: must be positive, got {text!r}")
    return values


def model_config(args) -> ModelConfig:
    cfg = ModelConfig.preset(args.preset).replace(dtype="bfloat16")
    return cfg if args.layers is None else cfg.replace(num_layers=args.layers)


def _in_child(name: str, argv: list[str], result: dict) -> None:
    """Run one engine in a process of its own (its peak memory is its own), passing its
    progress lines through as they come. ``result`` holds its latest result (each program's
    rows as they are measured), also where the process dies or is stopped."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", name]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy()
    )
    result.update(engine=name, rows=[], memory=[], profile=[])
    last, done = "no output", False
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith("RESULT "):
                result.clear()
                result.update(json.loads(line[len("RESULT ") :]))
            elif line.startswith("DONE"):
                done = True
            elif line.strip():
                print(f"  | {line}" if not line.startswith("  ") else line, flush=True)
                last = line
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if not done:
        result["error"] = f"exit {proc.returncode}: {last.strip()[:160]}"


def _to_parent(result: dict) -> None:
    """An engine's result so far, for the parent process (``_in_child`` keeps the latest)."""
    print("RESULT " + json.dumps(result), flush=True)


class _Stopped(Exception):
    """SIGTERM (a time limit): report what was measured."""


def _stop(signum, frame):
    raise _Stopped


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        cfg = model_config(args)
    except ConfigError as err:
        raise SystemExit(f"rollout.py: {err}") from None
    if args.cache_dir:
        os.makedirs(args.cache_dir, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if args.child:
        result = run_engine(args.child, args, cfg)
        _to_parent(result)
        print("DONE", flush=True)
        return [result]
    if args.compile_only:
        compile_only(args, cfg)
        return []
    # auto: on a machine with an NVIDIA GPU; this process then never starts a device (it would
    # take the memory the engines' processes need)
    isolate = args.isolate == "yes" or (args.isolate == "auto" and os.path.exists("/dev/nvidiactl"))
    results = []
    try:
        for name in args.engines:
            print(f"== {name} ({ENGINES[name].about})", flush=True)
            results.append({})
            if isolate:
                _in_child(name, argv, results[-1])
            else:
                results[-1].update(run_engine(name, args, cfg))
            _write_json(args, results)
    except _Stopped:
        if results:
            results[-1]["error"] = "stopped (time limit); the rows above were measured"
        print("stopped (time limit)", flush=True)
    report([r for r in results if r], cfg, args)
    _write_json(args, results)
    return results


def compile_only(args, cfg: ModelConfig) -> None:
    """Compile every engine's decode programs from the models' shapes into ``--cache-dir``,
    holding its lock until done (``precompile``)."""
    _compilers_lock(args.cache_dir, fcntl.LOCK_SH)
    jobs = []
    for name in args.engines:
        out, _, plan = _prepare(name, args, cfg)
        label = f"{name} on {out['device']}"
        for batch, _, gens, eng, info in plan:
            if eng is None:
                print(f"  {label}: batch {batch} gens {gens}: {info}", flush=True)
            else:
                jobs.append((f"{label}, batch {batch}, gens {gens}", eng, batch))
    precompile(jobs)


def _write_json(args, results: list[dict]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)


def report(results: list[dict], cfg: ModelConfig, args) -> None:
    kind = next((r["device"] for r in results if "device" in r), None)
    layers = "" if args.layers is None else f" (layers: {args.layers})"
    counted = "counted" if kind else "counted: no engine reported its device"
    print(
        f"device: {kind or 'unknown'} (HBM {hbm_peak(kind or '') / 1e12:.2f} TB/s {counted}); "
        f"preset {args.preset}{layers}; prompt {args.prompt}; mode {args.mode}, window "
        f"{args.window}, repeats {args.repeats}; attention {args.attention}"
    )
    best_bf16 = {}
    for res in results:
        if res["engine"].startswith("bf16"):
            for r in res["rows"]:
                if "tokens_per_s" in r:
                    key = (r["batch"], r["gen"])
                    best_bf16[key] = max(best_bf16.get(key, 0), r["tokens_per_s"])
    print(
        f"\n{'engine':12s} {'batch':>5s} {'gen':>6s} {'step ms (start/mid/end)':>26s} "
        f"{'tokens/s':>10s} {'x bf16':>7s} {'floor tok/s':>11s} {'of floor':>8s}"
    )
    for res in results:
        if "error" in res:
            print(f"{res['engine']:12s} {res['error']}")
        for r in res["rows"]:
            if "error" in r:
                print(f"{res['engine']:12s} {r['batch']:5d} {r['gen']:6d} {r['error']}")
                continue
            ms = "/".join(f"{t:.2f}" for t in r["step_ms"])
            ref = best_bf16.get((r["batch"], r["gen"]))
            ratio = f"{r['tokens_per_s'] / ref:6.2f}x" if ref else f"{'-':>7s}"
            print(
                f"{res['engine']:12s} {r['batch']:5d} {r['gen']:6d} {ms:>26s} "
                f"{r['tokens_per_s']:10.0f} {ratio} {r['floor_tokens_per_s']:11.0f} "
                f"{100 * r['of_floor']:7.1f}%"
            )
    print(
        f"\n{'engine':12s} {'weights GB':>10s} {'build s':>7s} {'batch':>5s} {'context':>7s} "
        f"{'state B/token':>13s} {'peak GB':>8s} {'limit GB':>8s}  largest fit (estimate)"
    )
    for res in results:
        for m in res["memory"]:
            head = (
                f"{res['engine']:12s} {res.get('weights_bytes', 0) / 1e9:10.2f} "
                f"{res.get('build_s', 0):7.1f} {m['batch']:5d} {m['context']:7d}"
            )
            if m.get("oom"):
                print(f"{head} {m['oom']}")
                continue
            per_token = m["state_bytes"] / (m["batch"] * m["context"])
            if m.get("peak_bytes_in_use") is None:
                print(f"{head} {per_token:13.0f} {'-':>8s} {'-':>8s}  (no device memory stats)")
                continue
            fit = _fit(res["weights_bytes"], m, per_token)
            print(
                f"{head} {per_token:13.0f} {m['peak_bytes_in_use'] / 1e9:8.2f} "
                f"{m['bytes_limit'] / 1e9:8.2f}  {fit}"
            )
    if any(res["profile"] for res in results):
        print(f"\nper-step profile (batch {args.batches[0]}): part, ms per step, share")
        for res in results:
            for p in res["profile"]:
                print(
                    f"{res['engine']:12s} {p['part']:10s} {p['ms']:8.3f} {100 * p['share']:6.1f}%"
                )
    batch, context = args.batches[0], args.prompt + min(args.gens) / 2
    print(f"\nfloor bytes per decode step, batch {batch}, context {context:.0f} (MB):")
    kinds = {ENGINES[r["engine"]].fp4: r["engine"] for r in results}
    for name in kinds.values():
        parts = step_bytes(cfg, ENGINES[name], batch, context)
        detail = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in parts.items())
        print(f"{name:12s} total {sum(parts.values()) / 1e6:.1f}: {detail}")


def _fit(weights: int, m: dict, per_token: float) -> str:
    """The tokens of state the device holds beside the weights and this run's workspace."""
    workspace = max(m["peak_bytes_in_use"] - weights - m["state_bytes"], 0)
    tokens = (m["bytes_limit"] - weights - workspace) / per_token
    b, c = m["batch"], m["context"]
    return f"{tokens:,.0f} tokens: batch {b} x {tokens / b:,.0f}; {c} x batch {tokens / c:,.0f}"


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stop)
    main()
