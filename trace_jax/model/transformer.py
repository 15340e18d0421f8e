"""The Qwen3-MoE family (and Qwen2-MoE's shared expert) as thin Flax NNX modules.

Parameters carry logical axis names (``logical_axes`` metadata; ``sharding.py`` maps them onto a
mesh). Weights are stored ``[in, out]``; routed experts as ``[E, in, out]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax import fp4
from trace_jax.model import layers
from trace_jax.model.config import ModelConfig
from trace_jax.model.policy import ACT_SITES, KV_SITES, QuantPolicy, SiteContext, site_name


def _param(rngs: nnx.Rngs, shape, axes, dtype, scale: float = 0.02) -> nnx.Param:
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * scale, logical_axes=axes)


def _ones(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), logical_axes=axes)


def _zeros(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, dtype):
        self.weight = _ones((size,), ("norm",), dtype)
        self.eps = eps

    def __call__(self, x):
        return layers.rms_norm(x, self.weight[...], self.eps)


class Attention(nnx.Module):
    """GQA with RoPE and (Qwen3) per-head q/k RMSNorm; K and V pass the KV-cache sites."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, d, pd = cfg.hidden_size, cfg.head_dim, jnp.dtype(cfg.param_dtype)
        self.q_proj = _param(rngs, (h, cfg.num_heads, d), ("embed", "heads", "head_dim"), pd)
        self.k_proj = _param(rngs, (h, cfg.num_kv_heads, d), ("embed", "kv_heads", "head_dim"), pd)
        self.v_proj = _param(rngs, (h, cfg.num_kv_heads, d), ("embed", "kv_heads", "head_dim"), pd)
        self.o_proj = _param(rngs, (cfg.num_heads, d, h), ("heads", "head_dim", "embed"), pd)
        if cfg.attention_bias:
            self.q_bias = _zeros((cfg.num_heads, d), ("heads", "head_dim"), pd)
            self.k_bias = _zeros((cfg.num_kv_heads, d), ("kv_heads", "head_dim"), pd)
            self.v_bias = _zeros((cfg.num_kv_heads, d), ("kv_heads", "head_dim"), pd)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, pd)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, pd)
        self.cfg = cfg

    def project_kv(self, x, positions, sites: SiteContext, layer: int):
        """x: [B, T, H] -> ((k, v) [B, T, Hkv, D] after norm, RoPE and the KV-cache sites,
        (k_codes, v_codes) the sites' QTensors or None where a site is off)."""
        cfg, dt = self.cfg, x.dtype
        k = jnp.einsum("bth,hnd->btnd", x, self.k_proj[...].astype(dt))
        v = jnp.einsum("bth,hnd->btnd", x, self.v_proj[...].astype(dt))
        if cfg.attention_bias:
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        if cfg.qk_norm:
            k = self.k_norm(k)
        k = layers.rope(k, positions, cfg.rope_theta)
        k, k_codes = sites.quantized(site_name(layer, "kv.k"), k, layer, "kv")
        v, v_codes = sites.quantized(site_name(layer, "kv.v"), v, layer, "kv")
        return (k, v), (k_codes, v_codes)

    def __call__(
        self, x, positions, mask, sites: SiteContext, layer: int, kv_access=None, kv_state=None
    ):
        """Self-attention over the chunk, or over a KV cache through ``kv_access``.

        Args:
          x: [B, T, H]; positions: [B, T] int32.
          mask: [B, T, T] bool (used without a cache).
          kv_access: None, or ``fn(kv_state, q [B, T, Hq, D], (k, v), (k_codes, v_codes),
            positions) -> (out [B, T, Hq, D], new_state)`` that stores the chunk's K/V in this
            layer's cache ``kv_state`` and attends over it (see ``trace_jax.rollout``).
        Returns:
          ([B, T, H], the chunk's (k, v) without a cache, else the hook's new state)
        """
        cfg, dt = self.cfg, x.dtype
        q = jnp.einsum("bth,hnd->btnd", x, self.q_proj[...].astype(dt))
        if cfg.attention_bias:
            q = q + self.q_bias[...].astype(dt)
        if cfg.qk_norm:
            q = self.q_norm(q)
        q = layers.rope(q, positions, cfg.rope_theta)
        (k, v), codes = self.project_kv(x, positions, sites, layer)
        if kv_access is not None:
            out, state = kv_access(kv_state, q, (k, v), codes, positions)
        else:
            out, state = layers.attention(q, k.astype(dt), v.astype(dt), mask), (k, v)
        return jnp.einsum("btnd,ndh->bth", out, self.o_proj[...].astype(dt)), state


class MLP(nnx.Module):
    """SwiGLU MLP (dense layers and the shared expert)."""

    def __init__(self, hidden: int, inner: int, rngs: nnx.Rngs, dtype):
        self.gate_proj = _param(rngs, (hidden, inner), ("embed", "mlp"), dtype)
        self.up_proj = _param(rngs, (hidden, inner), ("embed", "mlp"), dtype)
        self.down_proj = _param(rngs, (inner, hidden), ("mlp", "embed"), dtype)

    def __call__(self, x):
        dt = x.dtype
        h = jax.nn.silu(x @ self.gate_proj[...].astype(dt)) * (x @ self.up_proj[...].astype(dt))
        return h @ self.down_proj[...].astype(dt)


class MoE(nnx.Module):
    """Routed SwiGLU experts (sorted dispatch + ``ragged_dot``), optional shared expert."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, i, e, pd = (
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.num_experts,
            jnp.dtype(cfg.param_dtype),
        )
        self.router = _param(rngs, (h, e), ("embed", "router"), pd)
        self.gate_proj = _param(rngs, (e, h, i), ("expert", "embed", "mlp"), pd)
        self.up_proj = _param(rngs, (e, h, i), ("expert", "embed", "mlp"), pd)
        self.down_proj = _param(rngs, (e, i, h), ("expert", "mlp", "embed"), pd)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(h, cfg.shared_expert_intermediate_size, rngs, pd)
            self.shared_expert_gate = _param(rngs, (h, 1), ("embed", None), pd)
        self.cfg = cfg

    def __call__(self, x, sites: SiteContext, layer: int, replay: jax.Array | None = None):
        """x: [B, T, H]; replay: None or [B, T, k] expert ids.

        Returns:
          (y [B, T, H], experts [B, T, k] used (the replayed ones under replay),
          choice [B, T, k] the router's own top-k)
        """
        cfg, dt = self.cfg, x.dtype
        b, t, h = x.shape
        k = cfg.num_experts_per_tok
        if replay is None and sites.site_mode(layer, "act") == "guided":
            # The down-projection input is recorded per (token, expert slot): without the
            # rollout's experts, slot j here may hold another expert's input than slot j there.
            raise ValueError(
                f"layer {layer}: guided expert activations need replay_routes (routing replay); "
                "their guidance is per expert slot of the rollout's routes"
            )
        logits = jnp.einsum(
            "bth,he->bte", x, self.router[...].astype(dt), preferred_element_type=jnp.float32
        ).reshape(b * t, -1)
        weights, choice = layers.route(logits, k, cfg.norm_topk_prob)
        experts = choice
        if replay is not None:
            weights, experts = layers.route(logits, k, cfg.norm_topk_prob, replay.reshape(b * t, k))
        order, group_sizes = layers.sort_by_expert(experts, cfg.num_experts)
        inverse = jnp.argsort(order)
        x_q = sites.activation(site_name(layer, "experts.gate_up.act"), x, layer)
        # [N*k, H] grouped by expert: each token repeated per slot, then permuted (the gradient
        # sums the k slots by a reduction, not by a scatter-add)
        xs = layers.permute_rows(jnp.repeat(x_q.reshape(b * t, h), k, axis=0), order)
        # Arrays (through the weight sites), or the rollout engine's packed FP4 weights.
        w_gate, w_up, w_down = (
            w if isinstance(w, layers.PackedExpertWeight) else sites.expert_weight(w)
            for w in (p.get_value() for p in (self.gate_proj, self.up_proj, self.down_proj))
        )
        gate = layers.expert_matmul(xs, w_gate, group_sizes)
        up = layers.expert_matmul(xs, w_up, group_sizes)
        act = jax.nn.silu(gate) * up
        if sites.site_mode(layer, "act") != "off":  # the site sees (and records) rows in
            # (token, slot) order: there and back (an off site would be two gathers for nothing)
            act = layers.permute_rows(act, inverse).reshape(b, t, k, -1)
            act = sites.activation(site_name(layer, "experts.down.act"), act, layer)
            act = layers.permute_rows(act.reshape(b * t * k, -1), order)
        down = layers.expert_matmul(act, w_down, group_sizes)
        down = layers.permute_rows(down, inverse).reshape(b * t, k, h)
        y = jnp.sum(down.astype(jnp.float32) * weights[..., None], axis=1).astype(dt)
        y = y.reshape(b, t, h)
        if cfg.shared_expert_intermediate_size:
            gate_s = jax.nn.sigmoid(x @ self.shared_expert_gate[...].astype(dt))
            y = y + gate_s * self.shared_expert(x)
        return y, experts.reshape(b, t, k), choice.reshape(b, t, k)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        self.is_moe = cfg.is_moe_layer(layer)
        if self.is_moe:
            self.mlp = MoE(cfg, rngs)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, rngs, pd)
        self.layer = layer

    def __call__(
        self, x, positions, mask, sites: SiteContext, replay=None, kv_access=None, kv_state=None
    ):
        attn, kv = self.self_attn(
            self.input_layernorm(x), positions, mask, sites, self.layer, kv_access, kv_state
        )
        x = x + attn
        hidden = self.post_attention_layernorm(x)
        routing = None
        if self.is_moe:
            mlp, *routing = self.mlp(hidden, sites, self.layer, replay)
        else:
            mlp = self.mlp(hidden)
        return x + mlp, routing, kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """Attributes:
    logits: [B, T, V] float32.
    routes: [L_moe, B, T, k] int32 chosen (or replayed) experts per MoE layer, in layer order.
    router_choice: [L_moe, B, T, k] int32 the router's own top-k (equal to ``routes`` without
      replay; under replay, what this forward would have chosen).
    records: site name -> ``Guidance`` (and ``QTensor`` under ``<site>.codes`` in diagnostic
      mode) for the sites the policy records.
    kv: per layer, the (k, v) [B, T, Hkv, D] the KV sites produced, or, with ``kv_access``,
      the new cache state the hook returned.
    """

    logits: jax.Array
    routes: jax.Array | None
    router_choice: jax.Array | None
    records: dict[str, fp4.Guidance | fp4.QTensor]
    kv: tuple[tuple[jax.Array, jax.Array], ...]


class Transformer(nnx.Module):
    """Qwen3-MoE decoder-only language model."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pd)
        self.cfg = cfg

    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        policy: QuantPolicy | None = None,
        guidance: dict[str, fp4.Guidance] | None = None,
        replay_routes: jax.Array | None = None,
        kv_access=None,
        kv_states: tuple | None = None,
        scan_layers: bool | None = None,
    ) -> ModelOutput:
        """Full forward over a batch of sequences.

        Args:
          tokens: [B, T] int32.
          positions: [B, T] int32, default ``arange(T)``.
          attention_mask: [B, T] bool, False for padding (keys of padding are never attended).
          policy: quantization policy (default: all sites off, BF16 / compute dtype).
          guidance: site name -> rollout ``Guidance`` for guided sites (shapes [B, T, ...]).
          replay_routes: [L_moe, B, T, k] recorded experts to replay (Rollout Routing Replay).
          kv_access: attend over a KV cache instead of the chunk alone (see ``Attention``); then
            ``positions`` and ``kv_states`` (one cache state per layer, alike pytrees) are given.
          scan_layers: scan runs of alike layers (default: ``cfg.scan_layers``).
        """
        cfg = self.cfg
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        valid = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
        mask = layers.causal_mask(positions, positions, valid)
        moe_layers = cfg.moe_layers
        if replay_routes is not None and replay_routes.shape[:3] != (len(moe_layers), b, t):
            raise ValueError(
                f"replay_routes has shape {replay_routes.shape}; expected "
                f"({len(moe_layers)}, {b}, {t}, {cfg.num_experts_per_tok}) for this batch"
            )
        if kv_access is not None and (kv_states is None or len(kv_states) != cfg.num_layers):
            raise ValueError(f"kv_access needs kv_states, one per layer ({cfg.num_layers})")
        sites = SiteContext(policy or QuantPolicy(), cfg.num_layers, guidance)
        scan = cfg.scan_layers if scan_layers is None else scan_layers
        x = layers.embed(self.embed_tokens[...], tokens).astype(cfg.dtype)
        routes, choices, kvs = [], [], []
        for start, stop in (
            self._runs(sites) if scan else [(i, i + 1) for i in range(len(self.layers))]
        ):
            moe = [moe_layers.index(i) for i in range(start, stop) if i in moe_layers]
            replay = None
            if replay_routes is not None and moe:
                replay = replay_routes[moe[0] : moe[-1] + 1]
            states = None if kv_access is None else kv_states[start:stop]
            if stop - start == 1:
                x, routing, kv = self.layers[start](
                    x,
                    positions,
                    mask,
                    sites,
                    None if replay is None else replay[0],
                    kv_access,
                    None if states is None else states[0],
                )
                routing = None if routing is None else [r[None] for r in routing]
                kv = [kv]
            else:
                x, routing, kv = self._scan_run(
                    start, stop, x, positions, mask, sites, replay, kv_access, states
                )
            kvs.extend(kv)
            if routing is not None:
                routes.append(routing[0])
                choices.append(routing[1])
        x = self.norm(x)
        head = self.embed_tokens[...].T if cfg.tie_word_embeddings else self.lm_head[...]
        logits = jnp.einsum(
            "bth,hv->btv", x, head.astype(x.dtype), preferred_element_type=jnp.float32
        )
        return ModelOutput(
            logits=logits,
            routes=jnp.concatenate(routes) if routes else None,
            router_choice=jnp.concatenate(choices) if choices else None,
            records=sites.records,
            kv=tuple(kvs),
        )

    def _runs(self, sites: SiteContext) -> list[tuple[int, int]]:
        """[start, stop) runs of consecutive layers alike: same kind (MoE or dense) and the same
        site modes under ``sites``' policy (so one traced body serves the whole run)."""

        def kind(i):
            return (self.layers[i].is_moe, sites.site_mode(i, "act"), sites.site_mode(i, "kv"))

        runs, start = [], 0
        for i in range(1, len(self.layers) + 1):
            if i == len(self.layers) or kind(i) != kind(start):
                runs.append((start, i))
                start = i
        return runs

    def _scan_run(self, start, stop, x, positions, mask, sites, replay, kv_access, states):
        """Layers ``start..stop-1`` as one ``lax.scan``: their parameters, guidance, replayed
        routes and cache states stacked on a leading axis; the body is layer ``start`` (site
        names of that layer inside, renamed per layer outside).

        Returns (x [B, T, H], [routes, choices] each [n_moe, B, T, k] or None, per-layer kv)."""
        graphdef = nnx.graphdef(self.layers[start])
        params = _stack([nnx.state(self.layers[i]) for i in range(start, stop)])
        prefix = [site_name(i, "") for i in range(start, stop)]
        guided = [k for k in ("act", "kv") if sites.site_mode(start, k) == "guided"]
        suffixes = [s for k in guided for s in (ACT_SITES if k == "act" else KV_SITES)]
        suffixes = [s for s in suffixes if self.layers[start].is_moe or s in KV_SITES]
        missing = [p + s for s in suffixes for p in prefix if p + s not in sites.guidance]
        if missing:
            raise KeyError(f"site {missing[0]} is guided but no guidance was given for it")
        guidance = {s: _stack([sites.guidance[p + s] for p in prefix]) for s in suffixes}
        xs = (params, guidance, replay, None if states is None else _stack(list(states)))

        def body(x, xs):
            layer_params, layer_guidance, layer_replay, state = xs
            layer = nnx.merge(graphdef, layer_params)
            inner = SiteContext(
                sites.policy,
                sites.num_layers,
                {prefix[0] + s: g for s, g in layer_guidance.items()},
            )
            x, routing, kv = layer(x, positions, mask, inner, layer_replay, kv_access, state)
            records = {n[len(prefix[0]) :]: r for n, r in inner.records.items()}
            return x, (routing, kv, records)

        x, (routing, kv, records) = jax.lax.scan(body, x, xs)
        for s, r in records.items():
            for j, p in enumerate(prefix):
                sites.records[p + s] = jax.tree.map(lambda a, j=j: a[j], r)
        kv = [jax.tree.map(lambda a, j=j: a[j], kv) for j in range(stop - start)]
        return x, routing, kv


def _stack(trees: list):
    """Alike pytrees -> one pytree of arrays stacked on a new leading axis."""
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)
