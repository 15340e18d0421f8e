"""Build or load a model straight into its rollout form, layer by layer.

The rollout engine keeps the routed experts packed: quantized to the policy's FP4 format once
(``engine.quantize_expert_weights``) and, for the Pallas backend, prepacked for the grouped
kernel (``engine.prepack_expert_weights``). Building the BF16 model first and packing it after
holds the whole BF16 model on the device (61 GB for Qwen3-30B-A3B, against about 19 GB with FP4
experts). Here each decoder layer is made (from the same random stream as
``Transformer(cfg, nnx.Rngs(seed))``, or from a sharded hub checkpoint, one parameter at a time)
and its experts packed before the next layer exists, so the device holds the rollout-form model
plus one layer's BF16 experts. The result is bit for bit the model that building then packing
gives, and ``RolloutEngine`` takes it as it is (packed experts pass through ``update_params``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.layouts import prepack_grouped
from trace_jax import fp4
from trace_jax.model import ModelConfig, QuantPolicy, Transformer, hf, layers
from trace_jax.model.transformer import DecoderLayer
from trace_jax.rollout.engine import RolloutConfig, pack_expert_weight

_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")
_INIT_SCALE = 0.02  # the embedding's and LM head's normal init (``transformer.Transformer``)

Path_ = tuple[str | int, ...]


def expert_packing(policy: QuantPolicy, rollout: RolloutConfig) -> tuple[bool, bool]:
    """(quantize, prepack): what ``RolloutEngine.update_params`` does to the routed experts under
    this policy and engine configuration."""
    quantize = rollout.fp4_weights and policy.expert_weights == "rtn"
    prepack = quantize and rollout.backend == "pallas" and "moe" in rollout.kernels
    return quantize, prepack


def init_rollout_model(
    cfg: ModelConfig, policy: QuantPolicy, rollout: RolloutConfig, *, seed: int = 0
) -> Transformer:
    """``Transformer(cfg, nnx.Rngs(seed))`` with its routed experts packed for ``rollout`` (as
    ``RolloutEngine(model, policy, rollout)`` packs them), made one layer at a time: the device
    never holds more than one layer's unpacked experts."""
    quantize, prepack = expert_packing(policy, rollout)
    abstract = _abstract(cfg)
    pd = jnp.dtype(cfg.param_dtype)
    rngs = nnx.Rngs(seed)

    def params() -> Iterator[tuple[Path_, jax.Array]]:
        # The order of Transformer.__init__: each draw from the stream is the same one.
        shape = _shape(abstract, ("embed_tokens",))
        yield ("embed_tokens",), jax.random.normal(rngs.params(), shape, pd) * _INIT_SCALE
        for i in range(cfg.num_layers):
            layer = DecoderLayer(cfg, i, rngs)
            for path, var in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
                yield ("layers", i, *path), var.get_value()
            _release(layer)
        yield ("norm", "weight"), jnp.ones(_shape(abstract, ("norm", "weight")), pd)
        if not cfg.tie_word_embeddings:
            shape = _shape(abstract, ("lm_head",))
            yield ("lm_head",), jax.random.normal(rngs.params(), shape, pd) * _INIT_SCALE

    pack = _packer(cfg, policy, quantize, prepack)
    return _assemble(abstract, ((p, pack(p, v)) for p, v in params()))


def load_rollout_model(
    path: str | Path,
    policy: QuantPolicy,
    rollout: RolloutConfig,
    cfg: ModelConfig | None = None,
    *,
    dtype: str | None = None,
) -> tuple[ModelConfig, Transformer]:
    """A hub checkpoint folder (``model.safetensors`` or a sharded index) loaded straight into
    its rollout form: parameters are read one at a time (``hf.iter_hf_params``), each put on
    the device as it completes and a layer's routed experts packed as soon as they have all
    arrived, so neither the host nor the device holds the whole BF16 model. Routed experts
    stored in the policy's FP4 format (an exported policy, ``trace_jax.model.export``) are
    taken as stored: their codes and scales, bit for bit, not quantized again.

    Args and result as ``hf.load_hf_checkpoint`` (``cfg`` default: the folder's
    ``config.json``, ``dtype`` overriding its parameter dtype), with the experts packed as
    ``RolloutEngine(model, policy, rollout)`` packs them.
    """
    if cfg is None:
        cfg = hf.checkpoint_config(path)
    if dtype is not None:
        cfg = cfg.replace(param_dtype=dtype)
    quantize, prepack = expert_packing(policy, rollout)
    pack = _packer(cfg, policy, quantize, prepack)
    stored = policy.fmt if quantize else None
    params = hf.iter_hf_params(path, cfg, packed=stored)
    values = ((p, pack(p, jax.device_put(v))) for p, v in params)
    return cfg, _assemble(_abstract(cfg), values)


def _packer(
    cfg: ModelConfig, policy: QuantPolicy, quantize: bool, prepack: bool
) -> Callable[[Path_, jax.Array], object]:
    experts = {("layers", i, "mlp", n) for i in cfg.moe_layers for n in _EXPERT_WEIGHTS}

    def pack(path: Path_, value: jax.Array | fp4.QTensor):
        if isinstance(value, fp4.QTensor):  # stored in the policy's format already
            return prepack_grouped(value) if prepack else value
        if quantize and path in experts:
            return jax.block_until_ready(pack_expert_weight(value, policy, prepack=prepack))
        return value

    return pack


def _release(module: nnx.Module) -> None:
    """Drop ``module``'s references to its arrays. A module's Variables are held in reference
    cycles, so its arrays would otherwise live until a garbage collection (a full one costs
    seconds in a process with a large heap)."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable):
            node.set_value(None)


def _abstract(cfg: ModelConfig) -> Transformer:
    return nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))


def _shape(abstract: Transformer, path: Path_) -> tuple[int, ...]:
    state = dict(nnx.to_flat_state(nnx.state(abstract, nnx.Param)))
    return tuple(state[path].shape)


def _assemble(abstract: Transformer, values) -> Transformer:
    """The model of ``abstract``'s structure with each parameter's value from ``values``
    ((flat path, array or packed expert weight) pairs, consumed one at a time)."""
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    variables = dict(nnx.to_flat_state(params))
    filled = {}
    for path, value in values:
        if path not in variables:
            raise KeyError(f"parameter {'.'.join(map(str, path))} is not one of the model's")
        want = tuple(variables[path].shape)
        if not isinstance(value, layers.PackedExpertWeight) and tuple(np.shape(value)) != want:
            raise ValueError(f"parameter {'.'.join(map(str, path))}: {np.shape(value)} != {want}")
        filled[path] = value
    missing = [p for p in variables if p not in filled]
    if missing:
        raise KeyError(f"parameters without a value: {missing[:4]}")
    state = nnx.from_flat_state([(p, var.replace(filled[p])) for p, var in variables.items()])
    return nnx.merge(graphdef, state, rest)
