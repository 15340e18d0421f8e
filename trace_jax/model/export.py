"""Export a policy as a Hugging Face folder whose routed experts are FP4, in the
compressed-tensors layout that vLLM and SGLang load (``compressed``), the rest BF16.

The FP4 weights are given already quantized, one stacked ``fp4.QTensor`` per routed-expert weight
(what ``rollout.engine.pack_expert_weight`` makes of ``[E, in, out]``): the exported codes and
scales are the rollout's own, and ``hf.iter_hf_params(folder, cfg, packed=fmt)`` (or
``rollout.load.load_rollout_model``) reads them back bit for bit. ``quantize_experts`` makes them
with the caller's quantizer, keeping chosen MoE layers in BF16 and optionally giving gate and up
one global scale per expert (vLLM runs them as one fused ``w13`` weight with the gate's scale).

The folder holds ``config.json`` (with ``quantization_config``: the weights' scheme and an
``ignore`` list naming every Linear left unquantized), ``model.safetensors`` (or shards and an
index), ``trace_jax_export.json`` (provenance and the exact global scales, see ``compressed``)
and the tokenizer files of the source when it has them.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax import fp4
from trace_jax.config import ConfigError
from trace_jax.model import compressed, hf
from trace_jax.model.config import ModelConfig
from trace_jax.model.transformer import Transformer

Path_ = tuple[str | int, ...]
EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def keep_bf16_layers(spec: str, cfg: ModelConfig) -> frozenset[int]:
    """The MoE layers ``spec`` names: comma-separated ``first``, ``last`` (of the MoE layers)
    or decoder-layer indices; "" names none. ``ConfigError`` naming a bad item."""
    moe = list(cfg.moe_layers)
    out = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item in ("first", "last"):
            if not moe:
                raise ConfigError(f"--keep-bf16: {item}: the model has no MoE layer")
            out.add(moe[0] if item == "first" else moe[-1])
        elif item.isdigit() and int(item) in moe:
            out.add(int(item))
        else:
            where = f"MoE layers: {moe[0]}..{moe[-1]}" if moe else "the model has none"
            raise ConfigError(
                f"--keep-bf16: {item!r} is not 'first', 'last' or a MoE layer index ({where})"
            )
    return frozenset(out)


def quantize_experts(
    params: Mapping[Path_, Any],
    cfg: ModelConfig,
    pack: Callable[[jax.Array], fp4.QTensor],
    *,
    keep: frozenset[int] = frozenset(),
    shared_gate_up_scale: bool = False,
) -> dict[Path_, Any]:
    """``params`` with the routed-expert weights of the MoE layers not in ``keep`` quantized.

    Args:
      params: flat parameter path -> array (routed experts ``[E, in, out]``), or an
        ``fp4.QTensor`` for experts that come quantized already (kept as they are).
      pack: ``[E, in, out]`` -> stacked ``QTensor`` (the rollout's ``pack_expert_weight``).
      keep: MoE layers left unquantized (``keep_bf16_layers``).
      shared_gate_up_scale: quantize ``[gate | up]`` side by side along the output axis, so
        each expert's two weights share one global scale (their block scales and codes are
        then those of that scale, no longer the rollout's where the two amaxes differ).
    Returns:
      a new flat mapping, quantized weights as ``QTensor``.
    """
    out = dict(params)
    for layer in cfg.moe_layers:
        if layer in keep:
            for name in EXPERT_WEIGHTS:
                if isinstance(out[("layers", layer, "mlp", name)], fp4.QTensor):
                    raise ConfigError(
                        f"--keep-bf16: layer {layer}'s experts are stored in FP4 only; no BF16 "
                        "weights to keep"
                    )
            continue
        path = {name: ("layers", layer, "mlp", name) for name in EXPERT_WEIGHTS}
        if shared_gate_up_scale:
            gate, up = out[path["gate_proj"]], out[path["up_proj"]]
            if isinstance(gate, fp4.QTensor) or isinstance(up, fp4.QTensor):
                raise ConfigError(
                    "--shared-gate-up-scale: the experts are stored in FP4 already; requantizing "
                    "them would round twice (export from BF16 weights)"
                )
            both = pack(jnp.concatenate([jnp.asarray(gate), jnp.asarray(up)], axis=-1))
            n = gate.shape[-1]
            out[path["gate_proj"]], out[path["up_proj"]] = _split_outputs(both, n)
        for name in EXPERT_WEIGHTS:
            if not isinstance(out[path[name]], fp4.QTensor):
                out[path[name]] = jax.device_get(pack(jnp.asarray(out[path[name]])))
    return out


def _split_outputs(qt: fp4.QTensor, n: int) -> tuple[fp4.QTensor, fp4.QTensor]:
    """A stacked ``QTensor`` of ``[E, in, 2n]`` (quantized along ``in``) as those of its two
    ``[E, in, n]`` halves, which share its global scales."""
    k = qt.shape[0]
    halves = []
    for rows in (slice(0, n), slice(n, 2 * n)):
        halves.append(
            fp4.QTensor(
                codes=np.asarray(qt.codes)[:, rows],
                block_scales=np.asarray(qt.block_scales)[:, rows],
                global_scale=np.asarray(qt.global_scale),
                fmt=qt.fmt,
                shape=(k, n),
                axis=0,
            )
        )
    return halves[0], halves[1]


def save_fp4_checkpoint(
    params: Mapping[Path_, Any],
    cfg: ModelConfig,
    path: str | Path,
    *,
    base_config: dict[str, Any] | None = None,
    record: dict[str, Any] | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> list[Path]:
    """Write ``params`` as a hub folder: ``QTensor`` routed experts in the compressed-tensors
    layout, every other parameter in BF16.

    Args:
      params: flat parameter path -> array, or (routed experts only) a stacked ``QTensor`` as
        ``quantize_experts`` returns; all quantized weights share one format.
      path: folder (created); it must not hold safetensors weights already.
      base_config: an original ``config.json`` whose keys outside the model's are kept.
      record: provenance written to ``trace_jax_export.json`` (source, step, policy, ...).
      max_shard_bytes: as ``hf.save_hf_checkpoint``.
    Returns:
      the safetensors files written.
    """
    fmt = _check(params, cfg)
    folder = hf.new_weights_folder(path)
    tensors = hf.hub_tensors(cfg)
    bf16 = np.dtype(jnp.bfloat16)
    packed_modules, sizes = [], []
    for t in tensors:
        value = params[t.slots[0].param]
        if isinstance(value, fp4.QTensor):
            packed_modules.append(t.name.removesuffix(".weight"))
            sizes.append(math.prod(value.codes.shape[1:]) + math.prod(value.block_scales.shape[1:]))
        else:
            sizes.append(math.prod(t.shape) * bf16.itemsize)
    exact_scales: dict[str, str] = {}

    def arrays(indices: list[int]) -> Iterator[tuple[str, np.ndarray]]:
        plain = [tensors[i] for i in indices if not _is_packed(params, tensors[i])]
        yield from hf.hub_arrays(plain, params, bf16)
        for i in indices:
            t = tensors[i]
            if _is_packed(params, t):
                yield from _packed_arrays(t, params[t.slots[0].param], exact_scales).items()

    written = hf.write_shards(
        folder,
        sizes,
        arrays,
        max_shard_bytes,
        total_parameters=sum(math.prod(t.shape) for t in tensors),
    )
    packed = set(packed_modules)
    linears = [t.name.removesuffix(".weight") for t in tensors if _is_linear(t)]
    ignore = sorted({m for m in linears if m not in packed} | {"lm_head"})
    config = hf.hf_config(cfg.replace(param_dtype="bfloat16"), _without_quantization(base_config))
    if fmt is not None:
        config["quantization_config"] = compressed.quantization_config(fmt, ignore)
    (folder / hf.CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    entry = {**(record or {}), "format": fmt, "quantized_modules": len(packed)}
    entry["global_scales"] = dict(sorted(exact_scales.items()))
    (folder / compressed.EXPORT_RECORD).write_text(json.dumps(entry, indent=2) + "\n")
    return written


def copy_tokenizer_files(source: str | Path, folder: str | Path) -> list[str]:
    """Copy the tokenizer (and generation config) files ``source`` has into ``folder``;
    returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(folder) / name)
            copied.append(name)
    return copied


def _check(params: Mapping[Path_, Any], cfg: ModelConfig) -> str | None:
    """The quantized weights' format (None: none); ``CheckpointError`` naming a parameter that
    is missing, mis-shaped or quantized where it may not be."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    expected = {p: tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
    experts = {("layers", l, "mlp", n) for l in cfg.moe_layers for n in EXPERT_WEIGHTS}
    fmts = set()
    for p in sorted(set(expected) | set(params), key=str):
        name = ".".join(map(str, p))
        if p not in params or p not in expected:
            where = "parameters" if p not in params else "configuration"
            raise hf.CheckpointError(f"parameter {name} is missing from the {where}")
        value = params[p]
        if isinstance(value, fp4.QTensor):
            e, k, n = expected[p]
            stored = (e, n, k // 2)
            if p not in experts or tuple(value.codes.shape) != stored or value.axis != 0:
                raise hf.CheckpointError(
                    f"parameter {name}: only routed experts [E, in, out] quantized along 'in' "
                    f"are exported in FP4 (codes {list(stored)}); got codes "
                    f"{list(value.codes.shape)}"
                )
            fmts.add(value.fmt.name)
        elif tuple(np.shape(value)) != expected[p]:
            raise hf.CheckpointError(
                f"parameter {name} has shape {list(np.shape(value))}; expected "
                f"{list(expected[p])} for this model configuration"
            )
    if len(fmts) > 1:
        raise hf.CheckpointError(f"the experts are quantized in several formats: {sorted(fmts)}")
    return fmts.pop() if fmts else None


def _is_packed(params: Mapping[Path_, Any], t) -> bool:
    return isinstance(params[t.slots[0].param], fp4.QTensor)


def _is_linear(t) -> bool:
    """A hub tensor that is a Linear's weight (the embedding is not)."""
    return t.name.endswith(".weight") and len(t.shape) == 2 and "embed_tokens" not in t.name


def _packed_arrays(t, qt: fp4.QTensor, exact_scales: dict[str, str]) -> dict[str, np.ndarray]:
    """The stored tensors of expert ``t.slots[0].expert`` of ``qt``; records its global scale in
    ``exact_scales`` where the stored one's reciprocal is not exact."""
    module, x = t.name.removesuffix(".weight"), t.slots[0].expert
    gs = None
    if qt.fmt.has_global_scale:
        s_g = np.asarray(qt.global_scale, np.float32).reshape(-1)[x]
        gs, exact = compressed.export_global_scale(s_g)
        if not exact:
            exact_scales[module] = compressed.to_bits(s_g)
    return compressed.packed_tensors(
        module, np.asarray(qt.codes[x]), np.asarray(qt.block_scales[x]), gs
    )


def _without_quantization(config: dict[str, Any] | None) -> dict[str, Any] | None:
    if config is None:
        return None
    return {k: v for k, v in config.items() if k != "quantization_config"}
