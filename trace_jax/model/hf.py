"""Hugging Face safetensors import and export for the Qwen3-MoE / Qwen2-MoE family.

The hub layout (what ``save_pretrained`` writes) stores every linear map as ``[out, in]`` and
every routed expert as its own tensors; ours is ``[in, out]`` with attention split into heads
and routed experts stacked:

    model.embed_tokens.weight                  [V, H]        embed_tokens             [V, H]
    model.layers.{l}.self_attn.q_proj.weight   [Hq*D, H]     self_attn.q_proj         [H, Hq, D]
    model.layers.{l}.self_attn.{k,v}_proj.weight [Hkv*D, H]  self_attn.{k,v}_proj     [H, Hkv, D]
    model.layers.{l}.self_attn.o_proj.weight   [H, Hq*D]     self_attn.o_proj         [Hq, D, H]
    model.layers.{l}.self_attn.{q,k,v}_proj.bias (Qwen2)     self_attn.{q,k,v}_bias   [heads, D]
    model.layers.{l}.self_attn.{q,k}_norm.weight (Qwen3)     self_attn.{q,k}_norm     [D]
    model.layers.{l}.mlp.gate.weight           [E, H]        mlp.router               [H, E]
    model.layers.{l}.mlp.experts.{e}.{gate,up}_proj.weight [I, H]   mlp.{gate,up}_proj[e] [H, I]
    model.layers.{l}.mlp.experts.{e}.down_proj.weight      [H, I]   mlp.down_proj[e]      [I, H]
    model.layers.{l}.mlp.shared_expert.*, mlp.shared_expert_gate.weight [1, H] (Qwen2-MoE)
    model.layers.{l}.mlp.{gate,up,down}_proj.weight  (dense layers)
    model.layers.{l}.{input,post_attention}_layernorm.weight, model.norm.weight
    lm_head.weight                             [V, H]        lm_head                  [H, V]

Import also accepts the fused expert layout transformers >= 5 keeps in memory (and writes with
``save_original_format=False``): ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first) and
``mlp.experts.down_proj [E, H, I]``. Every conversion is a transpose or reshape, so a round trip
at the stored dtype is bit-exact. Reading goes tensor by tensor through ``safetensors.safe_open``
(memory-mapped), filling preallocated parameters; a parameter is handed to JAX (and placed on its
mesh sharding) as soon as its last tensor has arrived, so host memory beyond the parameters is one
tensor at a time.

Folders with FP4 weights in the compressed-tensors layout (``compressed``; ``export`` writes
them) are read too: each weight dequantized as the format defines it, or, with
``iter_hf_params(..., packed=fmt)``, routed experts kept as the stored codes and scales.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes  # registers "bfloat16" with numpy: safetensors' numpy API needs it for BF16
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from trace_jax import fp4
from trace_jax.config import ConfigError
from trace_jax.model import compressed
from trace_jax.model.config import ModelConfig
from trace_jax.model.sharding import DEFAULT_RULES, logical_to_spec
from trace_jax.model.transformer import Transformer

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
# Non-persistent buffers some older checkpoints still carry; never parameters.
HARMLESS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
Path_ = tuple[str | int, ...]


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not match the model configuration (the
    message names the file, and the tensor or key)."""


class MissingCheckpointError(CheckpointError, FileNotFoundError):
    """A checkpoint folder or file that does not exist."""


@contextlib.contextmanager
def _safe_open(file: Path) -> Iterator[Any]:
    """``safetensors.safe_open`` whose failure on a truncated or corrupt file names the file."""
    try:
        handle = safetensors.safe_open(file, framework="numpy")
    except (safetensors.SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
    with handle as f:
        yield f


def read_json(file: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``file``; a missing, malformed or non-object file is a
    ``CheckpointError`` naming it."""
    if not file.is_file():
        raise MissingCheckpointError(f"{file} does not exist ({what})")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


# ----------------------------------------------------------------------------- the layout table


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where (part of) a hub tensor lands among our parameters.

    param: flat path of our parameter, e.g. ``("layers", 3, "mlp", "gate_proj")``.
    expert: index along the parameter's leading expert axis, or None for the whole parameter.
    layout: ``"copy"``; ``"reshape"``; ``"t"`` (swap the last two axes, then reshape to ours);
      ``"t_first_half"`` / ``"t_second_half"`` (swap, then the first / second half of the last
      axis: the fused gate_up tensor).
    """

    param: Path_
    expert: int | None
    layout: str


@dataclasses.dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]
    slots: tuple[_Slot, ...]


def _to_ours(x: np.ndarray, layout: str, shape: tuple[int, ...]) -> np.ndarray:
    if layout == "copy":
        return x
    if layout == "reshape":
        return x.reshape(shape)
    x = np.swapaxes(x, -1, -2)
    if layout == "t":
        return x.reshape(shape)
    half = x.shape[-1] // 2
    return x[..., :half] if layout == "t_first_half" else x[..., half:]


def _to_hub(p: np.ndarray, layout: str, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of ``_to_ours`` for the unfused layouts (export writes the hub layout)."""
    if layout == "copy":
        return p
    if layout == "reshape":
        return p.reshape(shape)
    assert layout == "t", layout
    return np.swapaxes(p.reshape(*shape[:-2], shape[-1], shape[-2]), -1, -2)


def hub_tensors(cfg: ModelConfig, fused_layers: frozenset[int] = frozenset()) -> list[_Tensor]:
    """The tensors of ``cfg``'s hub checkpoint, in export order (``fused_layers``: MoE layers
    whose experts are stored fused)."""
    h, d, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    out: list[_Tensor] = []

    def add(name, shape, param, layout="t", expert=None):
        out.append(_Tensor(name, tuple(shape), (_Slot(tuple(param), expert, layout),)))

    def mlp(prefix, param, inner):
        add(f"{prefix}.gate_proj.weight", (inner, h), (*param, "gate_proj"))
        add(f"{prefix}.up_proj.weight", (inner, h), (*param, "up_proj"))
        add(f"{prefix}.down_proj.weight", (h, inner), (*param, "down_proj"))

    add("model.embed_tokens.weight", (v, h), ("embed_tokens",), "copy")
    for l in range(cfg.num_layers):
        pre, ours = f"model.layers.{l}", ("layers", l)
        att, att_ours = f"{pre}.self_attn", (*ours, "self_attn")
        add(f"{pre}.input_layernorm.weight", (h,), (*ours, "input_layernorm", "weight"), "copy")
        for proj, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
            add(f"{att}.{proj}_proj.weight", (heads * d, h), (*att_ours, f"{proj}_proj"))
            if cfg.attention_bias:
                add(f"{att}.{proj}_proj.bias", (heads * d,), (*att_ours, f"{proj}_bias"), "reshape")
        add(f"{att}.o_proj.weight", (h, cfg.num_heads * d), (*att_ours, "o_proj"))
        if cfg.qk_norm:
            add(f"{att}.q_norm.weight", (d,), (*att_ours, "q_norm", "weight"), "copy")
            add(f"{att}.k_norm.weight", (d,), (*att_ours, "k_norm", "weight"), "copy")
        add(
            f"{pre}.post_attention_layernorm.weight",
            (h,),
            (*ours, "post_attention_layernorm", "weight"),
            "copy",
        )
        m, m_ours = f"{pre}.mlp", (*ours, "mlp")
        if not cfg.is_moe_layer(l):
            mlp(m, m_ours, cfg.intermediate_size)
            continue
        e, i = cfg.num_experts, cfg.moe_intermediate_size
        add(f"{m}.gate.weight", (e, h), (*m_ours, "router"))
        if l in fused_layers:
            out.append(
                _Tensor(
                    f"{m}.experts.gate_up_proj",
                    (e, 2 * i, h),
                    (
                        _Slot((*m_ours, "gate_proj"), None, "t_first_half"),
                        _Slot((*m_ours, "up_proj"), None, "t_second_half"),
                    ),
                )
            )
            add(f"{m}.experts.down_proj", (e, h, i), (*m_ours, "down_proj"))
        else:
            for x in range(e):
                for name, shape in (
                    ("gate_proj", (i, h)),
                    ("up_proj", (i, h)),
                    ("down_proj", (h, i)),
                ):
                    add(f"{m}.experts.{x}.{name}.weight", shape, (*m_ours, name), expert=x)
        if cfg.shared_expert_intermediate_size:
            mlp(
                f"{m}.shared_expert",
                (*m_ours, "shared_expert"),
                cfg.shared_expert_intermediate_size,
            )
            add(f"{m}.shared_expert_gate.weight", (1, h), (*m_ours, "shared_expert_gate"))
    add("model.norm.weight", (h,), ("norm", "weight"), "copy")
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", (v, h), ("lm_head",))
    return out


# ----------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class _Entry:
    """A stored tensor; ``packed``: an FP4 weight (compressed-tensors layout) standing in for
    the dequantized float32 tensor it names."""

    file: Path
    shape: tuple[int, ...]
    dtype: str
    packed: compressed.PackedWeight | None = None


def _checkpoint_entries(folder: Path) -> dict[str, _Entry]:
    """Every tensor of a checkpoint folder with its file, shape and dtype (headers only)."""
    index = folder / SAFE_INDEX
    if index.is_file():
        weight_map = read_json(index, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: missing the mapping 'weight_map'")
        files = sorted(set(weight_map.values()))
    elif (folder / SAFE_WEIGHTS).is_file():
        weight_map, files = {}, [SAFE_WEIGHTS]
    elif not folder.is_dir():
        raise MissingCheckpointError(f"checkpoint folder {folder} does not exist")
    else:
        raise CheckpointError(f"{folder} holds neither {SAFE_WEIGHTS} nor {SAFE_INDEX}")
    entries: dict[str, _Entry] = {}
    for name in files:
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"{index} lists {name}, which does not exist in {folder}")
        with _safe_open(file) as f:
            for key in f.keys():
                if key in entries:
                    raise CheckpointError(
                        f"tensor {key!r} is stored twice: in {entries[key].file} and {file}"
                    )
                s = f.get_slice(key)
                entries[key] = _Entry(file, tuple(s.get_shape()), s.get_dtype())
    for key, name in weight_map.items():
        if key not in entries or entries[key].file.name != name:
            raise CheckpointError(f"{index} maps tensor {key!r} to {name}, which does not hold it")
    return _with_packed_weights(folder, entries)


def _with_packed_weights(folder: Path, entries: dict[str, _Entry]) -> dict[str, _Entry]:
    """``entries`` with each FP4 weight's stored parts (``X.weight_packed``, ...) replaced by
    one ``X.weight`` entry of its dequantized shape (``compressed``)."""
    if not any(k.endswith("." + compressed.PACKED) for k in entries):
        return entries
    config = folder / CONFIG
    try:
        fmt = compressed.checkpoint_format(read_json(config, "the model config"), config)
        if fmt is None:
            raise compressed.LayoutError(
                f"{folder} holds packed FP4 tensors but {config} has no quantization_config"
            )
        weights = compressed.group_packed(entries, fmt, compressed.read_exact_global_scales(folder))
    except compressed.LayoutError as e:
        raise CheckpointError(str(e)) from None
    parts = {name for w in weights.values() for name, _ in w.parts}
    out = {k: e for k, e in entries.items() if k not in parts}
    for name, w in weights.items():
        if name in out:
            raise CheckpointError(f"tensor {name!r} is stored both plain and packed in {folder}")
        out[name] = _Entry(dict(w.parts)[f"{w.module}.{compressed.PACKED}"], w.shape, "F32", w)
    return out


def _fused_layers(cfg: ModelConfig, entries: dict[str, _Entry]) -> frozenset[int]:
    return frozenset(
        l for l in cfg.moe_layers if f"model.layers.{l}.mlp.experts.gate_up_proj" in entries
    )


def _check_entries(
    folder: Path, tensors: list[_Tensor], entries: dict[str, _Entry], cfg: ModelConfig
) -> None:
    for t in tensors:
        if t.name not in entries:
            raise CheckpointError(
                f"tensor {t.name!r} (expected shape {list(t.shape)}) is missing from the "
                f"checkpoint in {folder}"
            )
        e = entries[t.name]
        if e.shape != t.shape:
            raise CheckpointError(
                f"tensor {t.name!r} has shape {list(e.shape)} in {e.file}; expected "
                f"{list(t.shape)} for this model configuration"
            )
        if e.dtype not in _DTYPES:
            raise CheckpointError(
                f"tensor {t.name!r} in {e.file} has dtype {e.dtype}; expected one of "
                f"{sorted(_DTYPES)}"
            )
    known = {t.name for t in tensors}
    if cfg.tie_word_embeddings:
        known.add("lm_head.weight")  # a tied copy; checked equal to the embedding after loading
    extra = sorted(k for k in entries if k not in known and not HARMLESS.search(k))
    if extra:
        shown = ", ".join(f"{k!r} ({entries[k].file.name})" for k in extra[:8])
        more = f" and {len(extra) - 8} more" if len(extra) > 8 else ""
        raise CheckpointError(
            f"the checkpoint in {folder} holds {len(extra)} tensor(s) this model configuration "
            f"does not use: {shown}{more}"
        )


def read_hf_params(
    path: str | Path,
    cfg: ModelConfig,
    *,
    mesh: Mesh | None = None,
    rules: dict[str, str | None] = DEFAULT_RULES,
) -> nnx.State:
    """Read a hub checkpoint folder into the parameter ``nnx.State`` of ``Transformer(cfg)``.

    The folder holds ``model.safetensors`` or ``model.safetensors.index.json`` with its shards.
    Tensors are cast to ``cfg.param_dtype``. With ``mesh``, each parameter is placed with the
    sharding its logical axes map to under ``rules`` (default: one device).

    Raises ``CheckpointError`` naming the tensor, the expected and found shape and the file for a
    missing or mis-shaped tensor, and naming them for tensors the configuration does not use.
    """
    folder = Path(path)
    entries = _checkpoint_entries(folder)
    tensors = hub_tensors(cfg, _fused_layers(cfg, entries))
    _check_entries(folder, tensors, entries, cfg)

    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    variables = dict(nnx.to_flat_state(nnx.state(abstract, nnx.Param)))
    pd = np.dtype(jax.numpy.dtype(cfg.param_dtype))
    pending = {p: 0 for p in variables}
    for t in tensors:
        for s in t.slots:
            pending[s.param] += 1
    missing = [p for p, n in pending.items() if n == 0]
    assert not missing, f"parameters without a hub tensor: {missing}"

    buffers: dict[Path_, np.ndarray] = {}
    arrays: dict[Path_, jax.Array] = {}

    def place(param: Path_, value: np.ndarray) -> jax.Array:
        if mesh is None:
            return jax.device_put(value)
        axes = variables[param].get_metadata().get("logical_axes")
        return jax.device_put(value, NamedSharding(mesh, logical_to_spec(axes, rules)))

    by_file: dict[Path, list[_Tensor]] = {}
    for t in tensors:
        by_file.setdefault(entries[t.name].file, []).append(t)
    for file, file_tensors in by_file.items():
        with _safe_open(file) as f:
            for t in file_tensors:
                x = _get_tensor(f, t.name, entries[t.name], file)
                for s in t.slots:
                    shape = tuple(variables[s.param].shape)
                    if s.expert is None:
                        value = np.array(_to_ours(x, s.layout, shape), dtype=pd, order="C")
                    else:
                        if s.param not in buffers:
                            buffers[s.param] = np.empty(shape, pd)
                        buf = buffers[s.param]
                        buf[s.expert] = _to_ours(x, s.layout, buf.shape[1:])
                        value = buf
                    pending[s.param] -= 1
                    if pending[s.param] == 0:
                        arrays[s.param] = place(s.param, value)
                        buffers.pop(s.param, None)
                del x

    if cfg.tie_word_embeddings and "lm_head.weight" in entries:
        _check_tied_copy(entries, folder)
    return nnx.from_flat_state([(p, var.replace(arrays[p])) for p, var in variables.items()])


def iter_hf_params(
    path: str | Path, cfg: ModelConfig, *, packed: str | None = None
) -> Iterator[tuple[Path_, np.ndarray | fp4.QTensor]]:
    """Read a hub checkpoint folder parameter by parameter, on the host.

    Yields (flat parameter path of ``Transformer(cfg)``, its value in our layout as a numpy array
    of ``cfg.param_dtype``) as soon as the parameter's last tensor has been read, shard by shard
    (a layer's routed experts become one [E, in, out] array once the last of them has arrived).
    Nothing is placed on a device: the caller decides what each parameter becomes there (the
    rollout's layer-by-layer build quantizes the experts of one layer at a time). Checks and
    errors as ``read_hf_params``.

    ``packed``: "nvfp4" or "mxfp4": routed experts stored in this FP4 format (compressed-tensors
    layout) are yielded as they are stored, one stacked ``fp4.QTensor`` per weight (the
    rollout's form, ``compressed.qtensors``); other FP4 weights are dequantized.
    """
    folder = Path(path)
    entries = _checkpoint_entries(folder)
    tensors = hub_tensors(cfg, _fused_layers(cfg, entries))
    _check_entries(folder, tensors, entries, cfg)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    shapes = {p: tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
    pd = np.dtype(jax.numpy.dtype(cfg.param_dtype))
    pending = dict.fromkeys(shapes, 0)
    for t in tensors:
        for s in t.slots:
            pending[s.param] += 1
    buffers: dict[Path_, np.ndarray] = {}
    by_file: dict[Path, list[_Tensor]] = {}
    for t in tensors:
        by_file.setdefault(entries[t.name].file, []).append(t)
    stored: dict[Path_, dict[int, compressed.PackedWeight]] = {}
    for file, file_tensors in by_file.items():
        with safetensors.safe_open(file, framework="numpy") as f:
            for t in file_tensors:
                pw = entries[t.name].packed
                s = t.slots[0]
                if pw is not None and pw.fmt.name == packed and s.expert is not None:
                    stored.setdefault(s.param, {})[s.expert] = pw
                    pending[s.param] -= 1
                    if pending[s.param] == 0:
                        experts = stored.pop(s.param)
                        if len(experts) != shapes[s.param][0]:
                            raise _partly_packed(folder, s.param)
                        yield s.param, compressed.qtensors([experts[e] for e in sorted(experts)])
                    continue
                x = _get_tensor(f, t.name, entries[t.name], file)
                for s in t.slots:
                    if s.expert is None:
                        ours = _to_ours(x, s.layout, shapes[s.param])
                        value = np.array(ours, dtype=pd, order="C")
                    else:
                        if s.param not in buffers:
                            buffers[s.param] = np.empty(shapes[s.param], pd)
                        buf = buffers[s.param]
                        buf[s.expert] = _to_ours(x, s.layout, buf.shape[1:])
                        value = buf
                    pending[s.param] -= 1
                    if pending[s.param] == 0:
                        if s.param in stored:
                            raise _partly_packed(folder, s.param)
                        buffers.pop(s.param, None)
                        yield s.param, value
                del x
    if cfg.tie_word_embeddings and "lm_head.weight" in entries:
        _check_tied_copy(entries, folder)


def _partly_packed(folder: Path, param: Path_) -> CheckpointError:
    name = ".".join(map(str, param))
    return CheckpointError(f"{folder}: the experts of {name} are stored partly packed, partly not")


def checkpoint_config(path: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of a hub checkpoint folder's ``config.json``, with parameters and
    compute in the checkpoint's stored dtype (float32 or bfloat16), as ``load_hf_checkpoint``
    takes it by default. A missing or faulty file is a ``CheckpointError`` naming it."""
    return _config_of(Path(path))


def _get_tensor(f, name: str, entry: _Entry, file: Path) -> np.ndarray:
    if entry.packed is not None:
        return compressed.dequantize(entry.packed)
    unsupported = CheckpointError(
        f"tensor {name!r} in {file} is {entry.dtype}, which this safetensors version does not "
        f"return as {_DTYPES[entry.dtype]} through its numpy API; upgrade safetensors"
    )
    try:
        x = f.get_tensor(name)
    except TypeError as e:
        raise unsupported from e
    if x.dtype != _DTYPES[entry.dtype]:
        raise unsupported
    return x


def _check_tied_copy(entries: dict[str, _Entry], folder: Path) -> None:
    def read(name):
        with _safe_open(entries[name].file) as f:
            return _get_tensor(f, name, entries[name], entries[name].file)

    head, embed = read("lm_head.weight"), read("model.embed_tokens.weight")
    if head.shape != embed.shape or head.tobytes() != embed.tobytes():
        raise CheckpointError(
            f"the configuration ties the embeddings, but lm_head.weight in "
            f"{entries['lm_head.weight'].file} differs from model.embed_tokens.weight ({folder})"
        )


def _stored_dtype(hf: dict[str, Any]) -> str:
    name = str(hf.get("dtype") or hf.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    return name if name in ("float32", "bfloat16") else "bfloat16"


def _config_of(folder: Path) -> ModelConfig:
    """The ``ModelConfig`` of a checkpoint folder's ``config.json``, in its stored dtype; any
    fault of the file is a ``CheckpointError`` naming it (and the key)."""
    if not folder.is_dir():
        raise MissingCheckpointError(f"checkpoint folder {folder} does not exist")
    file = folder / CONFIG
    hf = read_json(file, "the Hugging Face model config")
    stored = _stored_dtype(hf)
    try:
        return ModelConfig.from_hf(hf, param_dtype=stored, dtype=stored)
    except KeyError as e:
        raise CheckpointError(f"{file}: missing the key {e.args[0]!r}") from None
    except (ConfigError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{file}: {e}") from None


def load_hf_checkpoint(
    path: str | Path,
    cfg: ModelConfig | None = None,
    *,
    dtype: str | None = None,
    mesh: Mesh | None = None,
    rules: dict[str, str | None] = DEFAULT_RULES,
) -> tuple[ModelConfig, Transformer]:
    """Load a Qwen3-MoE / Qwen2-MoE hub checkpoint folder into a ``Transformer``.

    Args:
      path: folder with ``config.json`` and ``model.safetensors`` (or a sharded index).
      cfg: the model configuration; default ``ModelConfig.from_hf(path)`` with parameters and
        compute in the checkpoint's dtype (``config.json``'s ``dtype``: float32 or bfloat16).
      dtype: parameter dtype, overriding ``cfg.param_dtype``.
      mesh, rules: as in ``read_hf_params``.
    Returns:
      (cfg, model) with ``model.cfg == cfg``.
    """
    if cfg is None:
        cfg = _config_of(Path(path))
    if dtype is not None:
        cfg = cfg.replace(param_dtype=dtype)
    params = read_hf_params(path, cfg, mesh=mesh, rules=rules)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)
    return cfg, nnx.merge(graphdef, params, rest)


# ----------------------------------------------------------------------------- writing


def hf_config(cfg: ModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` of ``cfg`` for transformers (Qwen3-MoE, or Qwen2-MoE when the config has
    a shared expert and no q/k norm). ``base``: an original ``config.json`` whose other keys
    (token ids, ``max_position_embeddings``, ...) are kept."""
    qwen3 = cfg.qk_norm
    if qwen3 and (cfg.attention_bias or cfg.shared_expert_intermediate_size):
        raise ConfigError(
            "a config with q/k norm is Qwen3-MoE, which has no attention biases or shared expert"
        )
    if not qwen3 and not cfg.shared_expert_intermediate_size:
        raise ConfigError("a config without q/k norm is Qwen2-MoE, which needs a shared expert")
    derived = {  # keys ours replace, including the aliases transformers versions use
        "num_local_experts",
        "rope_scaling",
        "torch_dtype",
        "qkv_bias",
        "attention_bias",
        "shared_expert_intermediate_size",
        "head_dim",
    }
    out = {k: v for k, v in (base or {}).items() if k not in derived}
    out.update(
        architectures=["Qwen3MoeForCausalLM" if qwen3 else "Qwen2MoeForCausalLM"],
        model_type="qwen3_moe" if qwen3 else "qwen2_moe",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        # Both spellings: ``rope_parameters`` for transformers >= 5, ``rope_theta`` before.
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=list(cfg.mlp_only_layers),
        use_sliding_window=False,
        dtype=cfg.param_dtype,
    )
    if qwen3:
        out["attention_bias"] = False
    else:
        out["qkv_bias"] = cfg.attention_bias
        out["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    return out


def _flat_params(model_or_state: nnx.Module | nnx.State) -> dict[Path_, Any]:
    state = (
        nnx.state(model_or_state, nnx.Param)
        if isinstance(model_or_state, nnx.Module)
        else model_or_state
    )
    return {
        p: (v.get_value() if isinstance(v, nnx.Variable) else v)
        for p, v in nnx.to_flat_state(state)
    }


def _plan_shards(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    shards: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if shards[-1] and used + n > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += n
    return shards


def save_hf_checkpoint(
    model_or_state: nnx.Module | nnx.State,
    cfg: ModelConfig,
    path: str | Path,
    *,
    max_shard_bytes: int = 5 * 2**30,
    dtype: str | None = None,
    base_config: dict[str, Any] | None = None,
) -> list[Path]:
    """Write parameters as a hub checkpoint (``save_pretrained``'s layout) and ``config.json``.

    Args:
      model_or_state: a ``Transformer(cfg)`` or its parameter ``nnx.State``.
      path: folder (created); it must not already hold safetensors weights.
      max_shard_bytes: above this the tensors are split over ``model-0000i-of-0000n.safetensors``
        files with a ``model.safetensors.index.json``; a tensor is never split.
      dtype: stored dtype ("float32" or "bfloat16"); default each parameter's own dtype.
      base_config: an original ``config.json`` dict whose keys outside the model's are kept.
    Returns:
      the safetensors files written.
    """
    folder = new_weights_folder(path)
    params = _checked_params(model_or_state, cfg)
    tensors = hub_tensors(cfg)
    out_dtype = None if dtype is None else np.dtype(jax.numpy.dtype(dtype))

    def itemsize(t: _Tensor) -> int:
        return (out_dtype or np.dtype(params[t.slots[0].param].dtype)).itemsize

    sizes = [math.prod(t.shape) * itemsize(t) for t in tensors]
    written = write_shards(
        folder,
        sizes,
        lambda shard: hub_arrays([tensors[i] for i in shard], params, out_dtype),
        max_shard_bytes,
        total_parameters=sum(math.prod(t.shape) for t in tensors),
    )
    save_dtype = dtype or jax.numpy.dtype(params[("embed_tokens",)].dtype).name
    config = hf_config(cfg.replace(param_dtype=save_dtype), base_config)
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return written


def new_weights_folder(path: str | Path) -> Path:
    """``path`` created; a ``FileExistsError`` naming it if it holds weights already."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    stale = sorted(folder.glob("model*.safetensors*"))
    if stale:
        raise FileExistsError(f"{folder} already holds weights ({stale[0].name}); use a new folder")
    return folder


def _checked_params(model_or_state: nnx.Module | nnx.State, cfg: ModelConfig) -> dict[Path_, Any]:
    """The flat parameters of ``model_or_state``; a ``CheckpointError`` naming a parameter that
    is missing or mis-shaped for ``cfg``."""
    params = _flat_params(model_or_state)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    expected = {p: tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
    for p in sorted(set(expected) | set(params), key=str):
        name = ".".join(map(str, p))
        if p not in params or p not in expected:
            where = "model" if p not in params else "configuration"
            raise CheckpointError(f"parameter {name} is missing from the {where}")
        if tuple(params[p].shape) != expected[p]:
            raise CheckpointError(
                f"parameter {name} has shape {list(params[p].shape)}; expected "
                f"{list(expected[p])} for this model configuration"
            )
    return params


def write_shards(
    folder: Path,
    sizes: list[int],
    arrays: Callable[[list[int]], Iterator[tuple[str, np.ndarray]]],
    max_shard_bytes: int,
    *,
    total_parameters: int,
) -> list[Path]:
    """Write tensors ``0..len(sizes)-1`` (``sizes[i]`` bytes each, in this order) as
    ``model.safetensors``, or above ``max_shard_bytes`` as numbered shards with an index.

    ``arrays(indices)`` yields (name, contiguous array) for the tensors of one shard; a tensor is
    never split. Returns the files written."""
    shards = _plan_shards(sizes, max_shard_bytes)
    names = (
        [SAFE_WEIGHTS]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    written, weight_map = [], {}
    for shard, name in zip(shards, names, strict=True):
        tensors_out = dict(arrays(shard))
        safetensors.numpy.save_file(tensors_out, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors_out, name))
        written.append(folder / name)
        del tensors_out
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(sizes), "total_parameters": total_parameters},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (folder / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return written


def hub_arrays(
    tensors: list[_Tensor], params: dict[Path_, Any], out_dtype: np.dtype | None
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, contiguous hub-layout array) per tensor; each parameter is copied to the host once
    and dropped after its last tensor."""
    left: dict[Path_, int] = {}
    for t in tensors:
        left[t.slots[0].param] = left.get(t.slots[0].param, 0) + 1
    host: dict[Path_, np.ndarray] = {}
    for t in tensors:
        (slot,) = t.slots
        if slot.param not in host:
            host[slot.param] = np.asarray(params[slot.param])
        p = host[slot.param]
        if slot.expert is not None:
            p = p[slot.expert]
        x = _to_hub(p, slot.layout, t.shape)
        yield t.name, np.ascontiguousarray(x if out_dtype is None else x.astype(out_dtype))
        left[slot.param] -= 1
        if not left[slot.param]:
            del host[slot.param]
