"""Rollout engine: prefill + jitted decode over a preallocated KV cache, capturing log-probs,
expert routes and TRACE guidance per token.

The state of a batch of sequences is explicit (``RolloutState``) and every step is a pure
function of (parameters, state). Tokens enter through ``append`` (prompts, or environment tokens
in multi-turn tasks) and ``decode`` (a ``lax.while_loop`` that samples, appends the sampled token
and stops per sequence at a stop token or its budget). Records are kept per slot: slot ``s`` of
sequence ``b`` holds its token, whether the policy generated it, the log-prob it was sampled
with, its experts per MoE layer and, at guided sites, its guidance.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import fp4_decode_attention
from pallas_kernels.layouts import Fp4Weight, prepack_grouped
from trace_jax import fp4
from trace_jax.config import ConfigError
from trace_jax.model import QuantPolicy, Transformer, layers
from trace_jax.model.sharding import (
    batch_part,
    commit,
    place_batch,
    place_rows,
    process_rows,
    processes_max,
)
from trace_jax.rollout import kv_cache
from trace_jax.rollout.sampling import SamplingConfig, sample


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Attributes:
    max_len: slots per sequence (prompt, generated and environment tokens together).
    max_new_tokens: policy tokens per ``decode`` call and sequence.
    kv_cache: cache storage: "bf16", "fp8", "nvfp4" or "mxfp4" (FP4 needs the policy's KV sites
      quantized in that format).
    sampling: temperature / top-k / top-p.
    stop_tokens: a sequence's decode ends after it samples one of these.
    pad_token: written in slots past a sequence's end.
    fp4_weights: quantize routed-expert weights once in ``update_params`` and keep them packed
      (the policy's expert weight format); else they are used as given.
    backend: "xla" (reference) or "pallas": the FP4 expert weights are also prepacked once in
      ``update_params`` for the grouped FP4 Pallas kernel, which the MoE layers then run (in the
      Pallas interpreter off the GPU; W4A16, so with a bf16 compute dtype; XLA where the kernel
      does not apply), and single-token decode steps attend with the decode-attention kernel
      over the stored cache (bf16 compute dtype).
    kernels: which Pallas kernels the "pallas" backend uses: "moe" (grouped FP4 expert matmul)
      and/or "attention" (decode attention, the K/V append fused into its launch) or
      "attention_tc" (an NVFP4 / MXFP4 cache the tensor-core kernel takes goes to it, the
      append fused in the same way; other caches as "attention").
    code_rows: under a policy that records full codes (``record_codes``, for code metrics), how
      many sequences of a batch record them (evenly spaced, ``sampled_rows``); None: all.
    scan_decode: with a model config that scans its layers (``scan_layers``), scan them in the
      decode step too (the prefill always does): compile time independent of depth, but each
      step then slices every layer's weights and cache out of stacked copies.
    """

    max_len: int = 256
    max_new_tokens: int = 64
    kv_cache: kv_cache.CacheFormat = "bf16"
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    stop_tokens: tuple[int, ...] = ()
    pad_token: int = 0
    fp4_weights: bool = True
    backend: Literal["xla", "pallas"] = "xla"
    kernels: tuple[Literal["moe", "attention", "attention_tc"], ...] = ("moe", "attention")
    code_rows: int | None = None
    scan_decode: bool = False

    def __post_init__(self):
        if self.max_len <= 0 or self.max_new_tokens <= 0:
            raise ConfigError("max_len and max_new_tokens must be positive")
        if self.code_rows is not None and self.code_rows <= 0:
            raise ConfigError(f"code_rows: must be positive or None, got {self.code_rows}")
        if self.backend not in ("xla", "pallas"):
            raise ConfigError(f"backend: must be 'xla' or 'pallas', got {self.backend!r}")
        if not set(self.kernels) <= {"moe", "attention", "attention_tc"}:
            raise ConfigError(
                f"kernels: {self.kernels!r} are not among 'moe', 'attention', 'attention_tc'"
            )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutState:
    """A batch of sequences being generated. S = max_len slots.

    Attributes:
      cache: the KV cache; ``cache.lengths`` [B] is each sequence's length.
      tokens: [B, S] int32.
      generated: [B, S] bool, True for tokens the policy sampled (loss-bearing).
      logprobs: [B, S] float32, the sampled token's log-prob (0 elsewhere).
      routes: [B, S, L_moe, k] int32 experts per token and MoE layer.
      guidance: site name -> ``Guidance`` with arrays [B, S, ...] at the guided sites (and, in
        the policy's diagnostic mode, ``<site>.codes`` -> the rollout's full ``QTensor``).
      last_logits: [B, V] float32, the logits after each sequence's last token.
      done: [B] bool, the sequence's current decode has ended.
      code_rows: [R] int32, the sequences whose ``<site>.codes`` records are kept (their rows
        of those records, in this order).
    """

    cache: kv_cache.KVCache
    tokens: jax.Array
    generated: jax.Array
    logprobs: jax.Array
    routes: jax.Array
    guidance: dict[str, Record]
    last_logits: jax.Array
    done: jax.Array
    code_rows: jax.Array

    @property
    def lengths(self) -> jax.Array:
        return self.cache.lengths

    @property
    def filled(self) -> jax.Array:
        """[B, S] bool: the slots below each sequence's length."""
        return jnp.arange(self.tokens.shape[1])[None] < self.lengths[:, None]


Record = fp4.Guidance | fp4.QTensor


def _record_buffer(record: Record, max_len: int) -> Record:
    """A [B, S, ...] buffer for a chunk's [B, T, ...] record: the record of an all-zero input,
    so that slots never written hold finite scales. NVFP4 global scales are kept per slot (a
    per-tensor scale belongs to the chunk that was quantized with it)."""
    shape = (record.shape[0], max_len, *record.shape[2:])
    mode = "row" if record.fmt.has_global_scale else "tensor"
    # Rows quantize independently: one zero row, broadcast (no float32 buffer of the records'
    # size). The quantized axis is the last (the sites quantize along their last axis).
    row = fp4.quantize(
        jnp.zeros((*(1,) * (len(shape) - 1), shape[-1]), jnp.float32), record.fmt, global_scale=mode
    )
    row = fp4.rollout_guidance(row) if isinstance(record, fp4.Guidance) else row
    lead = (*shape[:-1],)
    arrays = {
        f: a if jnp.ndim(a) == 0 else jnp.broadcast_to(a, (*lead, a.shape[-1]))
        for f, a in ((f, getattr(row, f)) for f in _array_fields(row))
    }
    return dataclasses.replace(row, **arrays, shape=shape)


def sampled_rows(batch: int, n: int | None) -> np.ndarray:
    """[min(n, batch)] int32: ``n`` rows spread evenly over a batch (all rows for None)."""
    if n is None or n >= batch:
        return np.arange(batch, dtype=np.int32)
    return (np.arange(n) * batch // n).astype(np.int32)


def _array_fields(record: Record) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(record) if not f.metadata.get("static"))


def _write_record(buf: Record, chunk: Record, lengths, valid) -> Record:
    """Scatter a chunk's record [B, T, ...] into the buffer at each sequence's next slots.
    An NVFP4 per-tensor global scale is written to every slot of the chunk; MXFP4's placeholder
    global scale of 1 is not per token: kept."""
    chunk = fp4.with_row_global_scale(chunk)

    def put(name):
        old, new = getattr(buf, name), getattr(chunk, name)
        return kv_cache.scatter_rows(old, new, lengths, valid) if new.ndim >= 2 else old

    return dataclasses.replace(buf, **{name: put(name) for name in _array_fields(buf)})


def quantize_expert_weights(model: Transformer, policy: QuantPolicy) -> Transformer:
    """Replace every routed-expert weight [E, K, N] by its packed per-expert FP4 ``QTensor``.

    The codes are those of the training side's ``SiteContext.expert_weight`` fake quant, so both
    paths use the same weights. Works in place on ``model`` and returns it.
    """

    for param in _expert_params(model):
        if not isinstance(param.get_value(), layers.PackedExpertWeight):
            param.set_value(pack_expert_weight(param.get_value(), policy))
    return model


def pack_expert_weight(
    w: jax.Array, policy: QuantPolicy, *, prepack: bool = False
) -> layers.PackedExpertWeight:
    """One routed-expert weight [E, K, N] in its rollout form: its per-expert FP4 ``QTensor``
    (the codes of the training side's expert-weight fake quant), and with ``prepack`` the
    grouped kernel's ``Fp4Weight``."""
    qt = jax.vmap(
        lambda we: fp4.quantize(
            we,
            policy.fmt,
            axis=0,
            scale_rule=policy.weight_scale_rule,
            block_2d=policy.weight_block_2d,
        )
    )(w)
    return prepack_grouped(qt) if prepack else qt


def prepack_expert_weights(model: Transformer) -> Transformer:
    """Replace every packed expert ``QTensor`` by the grouped Pallas kernel's ``Fp4Weight``
    (``prepack_grouped``: same codes, kernel-ready scales). In place; returns ``model``."""
    for param in _expert_params(model):
        if isinstance(param.get_value(), fp4.QTensor):
            param.set_value(prepack_grouped(param.get_value()))
    return model


def _expert_params(model: Transformer):
    for layer in model.layers:
        if layer.is_moe:
            for name in ("gate_proj", "up_proj", "down_proj"):
                yield getattr(layer.mlp, name)


class RolloutEngine:
    """Generates with FP4 (or BF16) weights, activations and KV cache; a small interface:
    ``update_params``, ``start``, ``append``, ``decode``, ``generate``."""

    def __init__(
        self, model: Transformer, policy: QuantPolicy, cfg: RolloutConfig, *, greedy=False
    ):
        """``greedy``: decode by argmax whatever ``cfg.sampling`` says, as a runtime flag (not
        part of the compiled programs' key: a greedy evaluation engine runs the programs of the
        sampling engine of its config)."""
        if cfg.kv_cache in ("nvfp4", "mxfp4") and (
            policy.kv not in ("rtn", "record") or policy.fmt != cfg.kv_cache
        ):
            raise ConfigError(
                f"kv_cache: {cfg.kv_cache} needs the policy's KV sites quantized in {cfg.kv_cache} "
                f"(policy.kv='rtn' or 'record', policy.fmt='{cfg.kv_cache}'); got "
                f"kv={policy.kv!r}, fmt={policy.fmt!r}"
            )
        self.cfg = cfg
        self.policy = policy
        self.greedy = greedy
        self.model_cfg = model.cfg
        self.version = -1
        self._record_shapes: dict[int, dict] = {}  # batch -> records of a one-token step
        self.update_params(model)

    # ------------------------------------------------------------------ parameters

    def update_params(self, model: Transformer, version: int | None = None) -> None:
        """Take new policy weights (copied; FP4 expert weights are quantized here, once).

        Expert weights that come packed already (``trace_jax.rollout.load``) must be in the
        engine's format; prepacked ones go back to their ``QTensor`` for an engine that does
        not run the grouped kernel."""
        graphdef, state = nnx.split(model)
        model = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
        fp4_experts = self.cfg.fp4_weights and self.policy.expert_weights == "rtn"
        kernel = self.cfg.backend == "pallas" and "moe" in self.cfg.kernels
        for param in _expert_params(model):
            w = param.get_value()
            qt = w.qtensor if isinstance(w, Fp4Weight) else w
            if not isinstance(qt, fp4.QTensor):
                continue
            if not fp4_experts or qt.fmt.name != self.policy.fmt:
                want = self.policy.fmt if fp4_experts else "unquantized (BF16)"
                raise ConfigError(
                    f"expert weights: the model's are packed in {qt.fmt.name}; this engine's "
                    f"are {want}"
                )
            if isinstance(w, Fp4Weight) and not kernel:
                param.set_value(qt)
        if fp4_experts:
            model = quantize_expert_weights(model, self.policy)
            if kernel:
                model = prepack_expert_weights(model)
        self.graphdef, state = nnx.split(model)
        self.state = commit(state)  # one compiled program per step (sharding.commit)
        self.version = self.version + 1 if version is None else version
        self._trace_key = (self.graphdef, self.cfg, self.policy, self.model_cfg)
        self._trace_hash = hash(self._trace_key)

    # The jitted steps take the engine as a static argument and read only what this key holds
    # (the parameters are arguments): engines built alike share their compiled programs, as a
    # resumed run's new engine does the killed run's.
    def __hash__(self) -> int:
        return self._trace_hash

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other._trace_key == self._trace_key

    # ------------------------------------------------------------------ state

    def start(self, batch: int) -> RolloutState:
        """An empty state for ``batch`` sequences (records sized on the first ``append``), split
        over the current mesh's batch axes (``place_batch``; in a multi-process job ``batch`` is
        the whole batch, every process's rows)."""
        return commit(self._start(batch))

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def _start(self, batch: int) -> RolloutState:
        # made in one program: on a mesh each device allocates its part only
        m, c = self.model_cfg, self.cfg
        dtype = jnp.dtype(m.dtype)
        cache = kv_cache.init_cache(
            c.kv_cache, m.num_layers, batch, c.max_len, m.num_kv_heads, m.head_dim, dtype
        )
        s = c.max_len
        return place_batch(
            RolloutState(
                cache=cache,
                tokens=jnp.full((batch, s), c.pad_token, jnp.int32),
                generated=jnp.zeros((batch, s), bool),
                logprobs=jnp.zeros((batch, s), jnp.float32),
                routes=jnp.zeros((batch, s, len(m.moe_layers), m.num_experts_per_tok), jnp.int32),
                guidance=self._empty_guidance(batch),
                last_logits=jnp.zeros((batch, m.vocab_size), jnp.float32),
                done=jnp.zeros((batch,), bool),
                code_rows=jnp.asarray(sampled_rows(batch, c.code_rows)),
            ),
            batch,
        )

    def _empty_guidance(self, batch: int) -> dict[str, Record]:
        """Zeroed [B, S, ...] buffers for every site the policy records (shapes by tracing)."""

        def records(state):
            model = nnx.merge(self.graphdef, state)
            cache = kv_cache.init_cache(
                self.cfg.kv_cache,
                self.model_cfg.num_layers,
                batch,
                1,
                self.model_cfg.num_kv_heads,
                self.model_cfg.head_dim,
            )
            tokens = jnp.zeros((batch, 1), jnp.int32)
            valid = jnp.ones((batch, 1), bool)
            return self._forward(model, cache, tokens, valid)[1]

        # The shapes depend on the model config and policy only: traced once per batch size.
        if batch not in self._record_shapes:
            self._record_shapes[batch] = jax.eval_shape(records, self.state)
        shapes = self._record_shapes[batch]
        rows = sampled_rows(batch, self.cfg.code_rows)
        out = {}
        for name, g in shapes.items():
            g = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), g)
            if name.endswith(".codes"):
                g = fp4.take_rows(g, rows)
            out[name] = _record_buffer(g, self.cfg.max_len)
        return out

    # ------------------------------------------------------------------ steps

    def _forward(self, model, cache: kv_cache.KVCache, tokens, valid):
        """Run a chunk [B, T] through the model over the cache.

        Returns (logits [B, T, V], records, routes [L_moe, B, T, k] or None, new cache).
        """
        lengths = cache.lengths
        t = tokens.shape[1]
        positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        new_lengths = lengths + jnp.sum(valid, axis=1, dtype=jnp.int32)
        s = cache.max_len
        slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (tokens.shape[0], s))
        kv_valid = slots < new_lengths[:, None]
        fmt, dtype = cache.fmt, jnp.dtype(self.model_cfg.dtype)

        # One new token per sequence in bf16 with the pallas backend: the decode-attention
        # kernel reads the stored cache (FP4 dequantized in the kernel); else XLA over the
        # dequantized cache (prefill and multi-token chunks always; caches of a length that is
        # not a multiple of the kernel's 16-slot steps).
        kernel = (
            self.cfg.backend == "pallas"
            and ({"attention", "attention_tc"} & set(self.cfg.kernels))
            and t == 1
            and dtype == jnp.bfloat16
            and s % 16 == 0
        )
        interpret = jax.default_backend() != "gpu"

        def kv_access(lc, q, kv, codes, positions):
            if kernel:  # K and V written by the attention kernel's launch (fused append)
                out, k_buf, v_buf = fp4_decode_attention.decode_attention_append(
                    q[:, 0],
                    lc.k,
                    lc.v,
                    *kv,
                    lengths,
                    qts=tuple(codes),
                    valid=valid[:, 0],
                    tensor_cores="attention_tc" in self.cfg.kernels,
                    interpret=interpret,
                )
                return out[:, None], kv_cache.LayerCache(k_buf, v_buf)
            k_buf, v_buf = (
                kv_cache.write(buf, kv_cache.to_storage(fmt, x, qt), lengths, valid)
                for buf, x, qt in zip((lc.k, lc.v), kv, codes, strict=True)
            )
            k_all, v_all = (kv_cache.read(x, dtype) for x in (k_buf, v_buf))
            out = layers.attention(q, k_all, v_all, layers.causal_mask(positions, slots, kv_valid))
            return out, kv_cache.LayerCache(k_buf, v_buf)

        # Prefill chunks scan the layers when the model config says so (compile time); the
        # decode step only if asked (each step would slice the weights and cache out of copies).
        out = model(
            tokens,
            positions=positions,
            policy=self.policy,
            kv_access=kv_access,
            kv_states=cache.layers,
            scan_layers=self.model_cfg.scan_layers and (t > 1 or self.cfg.scan_decode),
        )
        new_cache = kv_cache.KVCache(layers=out.kv, lengths=new_lengths, fmt=fmt)
        return out.logits, out.records, out.routes, new_cache

    @functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
    def _append(self, state_params, state: RolloutState, tokens, valid, generated, logprobs):
        model = nnx.merge(self.graphdef, state_params)
        lengths = state.cache.lengths
        logits, records, routes, cache = self._forward(model, state.cache, tokens, valid)
        put = functools.partial(kv_cache.scatter_rows, lengths=lengths, valid=valid)
        guidance = {}
        for name, buf in state.guidance.items():
            rec, rows = records[name], state.code_rows
            if name.endswith(".codes") and buf.shape[0] != tokens.shape[0]:
                rec = fp4.take_rows(rec, rows)
                guidance[name] = _write_record(buf, rec, lengths[rows], valid[rows])
            else:
                guidance[name] = _write_record(buf, rec, lengths, valid)
        new_routes = state.routes
        if routes is not None:
            new_routes = put(state.routes, jnp.moveaxis(routes, 0, 2))
        last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
        last_logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        any_valid = jnp.any(valid, axis=1)
        return dataclasses.replace(
            state,
            cache=cache,
            tokens=put(state.tokens, tokens),
            generated=put(state.generated, jnp.broadcast_to(generated, valid.shape)),
            logprobs=put(state.logprobs, logprobs),
            routes=new_routes,
            guidance=guidance,
            last_logits=jnp.where(any_valid[:, None], last_logits, state.last_logits),
        )

    def append(self, state: RolloutState, tokens, valid=None):
        """Feed tokens that the policy did not generate (prompts, environment observations).

        Args:
          tokens: [b, T] int32 (host or device values), right-padded per sequence: this
            process's rows of the batch (``sharding.batch_part``; all B in one process).
          valid: [b, T] bool (default all True); each row a prefix of True.
        Returns:
          the new state (the input state's buffers are donated).

        Chunks are padded (as invalid tokens) to a power-of-two width, so that prompts and
        observations of varying lengths compile a few programs, not one per width; in a
        multi-process job every process appends at once, to the width of the widest chunk.
        """
        tokens = np.asarray(tokens, np.int32)
        valid = np.ones(tokens.shape, bool) if valid is None else np.asarray(valid, bool)
        room = self.cfg.max_len - (process_rows(state.lengths) + valid.sum(1))
        if (room < 0).any():
            raise ValueError(
                f"appending {tokens.shape[1]} tokens overflows max_len={self.cfg.max_len} for "
                f"sequences {[int(i) for i in np.nonzero(room < 0)[0]]}"
            )
        width = processes_max(tokens.shape[1])
        bucket = min(1 << max(0, (width - 1).bit_length()), max(width, self.cfg.max_len))
        if bucket > tokens.shape[1]:
            pad = ((0, 0), (0, bucket - tokens.shape[1]))
            tokens = np.pad(tokens, pad, constant_values=self.cfg.pad_token)
            valid = np.pad(valid, pad)
        tokens, valid = place_rows(tokens), place_rows(valid)
        zeros = jnp.zeros_like(tokens, jnp.float32)
        state = self._append(self.state, state, tokens, valid, False, zeros)
        return dataclasses.replace(state, done=jnp.zeros_like(state.done))

    @functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
    def _decode(self, state_params, state: RolloutState, key, greedy, row_ids):
        cfg = self.cfg
        stop = jnp.asarray(cfg.stop_tokens or (-1,), jnp.int32)
        budget_end = jnp.minimum(state.lengths + cfg.max_new_tokens, cfg.max_len)
        done0 = state.done | (state.lengths >= budget_end)
        # Row b draws with fold_in(key, row_ids[b]), then fold_in of the decode step: its tokens
        # do not depend on which other rows share its batch.
        row_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, row_ids)

        def cond(carry):
            step, st = carry
            return (step < cfg.max_new_tokens) & ~jnp.all(st.done)

        def body(carry):
            step, st = carry
            keys = jax.vmap(jax.random.fold_in, (0, None))(row_keys, step)
            token, logprob = sample(st.last_logits, keys, cfg.sampling, greedy)
            live = ~st.done
            token = jnp.where(live, token, cfg.pad_token)
            st = self._append(
                state_params, st, token[:, None], live[:, None], True, logprob[:, None]
            )
            ended = jnp.isin(token, stop) | (st.lengths >= budget_end)
            return step + 1, dataclasses.replace(st, done=st.done | (live & ended))

        state = dataclasses.replace(state, done=done0)
        _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
        return state

    def decode(
        self, state: RolloutState, key: jax.Array, row_ids: jax.Array | None = None
    ) -> RolloutState:
        """Sample up to ``max_new_tokens`` per sequence (jitted loop; the state is donated).

        Sequences whose ``state.done`` is set are left as they are (``append`` clears it; a
        multi-turn driver sets it for finished episodes before decoding the next turn).

        ``row_ids``: [B] int32, each row's index in the whole batch it belongs to (default
        ``arange(B)``; the same in every process of a job): row b samples with the key
        ``fold_in(key, row_ids[b])`` (and of that, per decode step), so a part of a batch
        samples the tokens the whole batch would."""
        batch = state.tokens.shape[0]
        rows = np.arange(batch, dtype=np.int32) if row_ids is None else row_ids
        rows = jnp.asarray(rows, jnp.int32)
        if rows.shape != (batch,):
            raise ValueError(f"row_ids: shape {rows.shape}, want ({batch},)")
        return self._decode(self.state, state, key, jnp.asarray(self.greedy), rows)

    def generate(
        self, prompts: list[list[int]], key: jax.Array, row_ids: jax.Array | None = None
    ) -> RolloutState:
        """Prefill ``prompts`` (token id lists of any lengths; in a multi-process job this
        process's rows of the batch) and decode (``row_ids``: see ``decode``)."""
        if not prompts:
            raise ValueError("generate needs at least one prompt")
        longest = max(len(p) for p in prompts)
        if longest == 0 or longest >= self.cfg.max_len:
            raise ValueError(f"prompt lengths must be in 1..{self.cfg.max_len - 1}, got {longest}")
        tokens = np.asarray(
            [p + [self.cfg.pad_token] * (longest - len(p)) for p in prompts], np.int32
        )
        valid = np.asarray([[i < len(p) for i in range(longest)] for p in prompts], bool)
        state = self.append(self.start(len(prompts) * batch_part()[1]), tokens, valid)
        return self.decode(state, key, row_ids)
