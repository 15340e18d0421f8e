"""FP4 Linear weights in the compressed-tensors layout (what vLLM and SGLang load), both ways.

A quantized Linear ``X`` (hub weight ``[out, in]``, blocks along ``in``) is stored as::

    X.weight_packed        [out, in/2]   uint8          two E2M1 codes a byte, element 2i in the
                                                        low nibble, code = sign << 3 | magnitude
    X.weight_scale         [out, in/16]  float8_e4m3fn  NVFP4 block scales (MXFP4: [out, in/32]
                                                        uint8 biased E8M0 exponents)
    X.weight_global_scale  [1]           float32        NVFP4 only

The codes and block scales are ``trace_jax.fp4``'s bytes verbatim: a ``QTensor`` of the hub weight
quantized along ``in`` stores exactly ``[out, in/2]`` codes and ``[out, in/b]`` scales. The global
scale is where the conventions differ: compressed-tensors stores ``gs ~ 1/s_g`` and defines the
value of an element as ``q * (s_b / gs)``, vLLM multiplies by ``1 / gs``, while ours is
``(q * s_b) * s_g`` with ``s_g = amax / (6 * 448)``. Float32 has no exact reciprocal, so:

- export writes the ``gs`` whose float32 reciprocal is exactly ``s_g`` when one exists (about 83 %
  of float32 values): vLLM then scales by the rollout's own ``s_g``;
- where none exists, the nearest ``1 / s_g`` is written and the exact ``s_g`` goes to
  ``trace_jax_export.json`` (``global_scales``: module -> float32 bits), which import reads;
- import reads ``s_g = 1 / gs`` otherwise (any compressed-tensors checkpoint).

So the rollout form re-imported (``qtensors``) is bit for bit the exported one. Dequantized on load
(``dequantize``), a weight takes the format's own value ``q * (s_b / gs)`` in float32, which is what
compressed-tensors decompresses to; it can differ from the rollout's ``(q * s_b) * s_g`` in the
last bit of some elements.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from trace_jax import fp4
from trace_jax.fp4.formats import E2M1_VALUES, E8M0_BIAS, FormatSpec

QUANT_METHOD = "compressed-tensors"
FORMATS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
PACKED, SCALE, GLOBAL_SCALE = "weight_packed", "weight_scale", "weight_global_scale"
EXPORT_RECORD = "trace_jax_export.json"
"""The provenance of an export and the global scales whose reciprocal is not exact."""

_RAW_DTYPES = {
    "U8": np.dtype(np.uint8),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
}


class LayoutError(ValueError):
    """A checkpoint whose compressed-tensors tensors or config do not fit the layout (the
    message names the tensor or key and the file)."""


# ----------------------------------------------------------------------------- the config


def weight_scheme(fmt: str) -> dict[str, Any]:
    """compressed-tensors' weight ``QuantizationArgs`` of ``fmt`` (as its NVFP4A16 / MXFP4A16
    presets dump them)."""
    if fmt == "nvfp4":
        return {
            "num_bits": 4,
            "type": "float",
            "symmetric": True,
            "group_size": fp4.NVFP4.block_size,
            "strategy": "tensor_group",
            "dynamic": False,
            "scale_dtype": "torch.float8_e4m3fn",
        }
    return {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": fp4.MXFP4.block_size,
        "strategy": "group",
        "dynamic": False,
        "scale_dtype": "torch.uint8",
    }


def quantization_config(fmt: str, ignore: list[str]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config``: every ``Linear`` weight-only quantized in
    ``fmt`` except the modules in ``ignore`` (full module names)."""
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMATS[fmt],
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weight_scheme(fmt),
                "input_activations": None,
                "output_activations": None,
                "format": None,
            }
        },
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def checkpoint_format(config: Mapping[str, Any], file: Path) -> str | None:
    """ "nvfp4" / "mxfp4" for a ``config.json`` with a compressed-tensors FP4
    ``quantization_config``, None without one. Raises ``LayoutError`` naming the key for a
    quantization this reader does not take."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping) or qc.get("quant_method") != QUANT_METHOD:
        method = qc.get("quant_method") if isinstance(qc, Mapping) else qc
        raise LayoutError(
            f"{file}: quantization_config.quant_method is {method!r}; only {QUANT_METHOD!r} "
            f"FP4 checkpoints are read"
        )
    by_name = {v: k for k, v in FORMATS.items()}
    if qc.get("format") not in by_name:
        raise LayoutError(
            f"{file}: quantization_config.format is {qc.get('format')!r}; expected one of "
            f"{sorted(by_name)}"
        )
    fmt = by_name[qc["format"]]
    for name, group in (qc.get("config_groups") or {}).items():
        weights = (group or {}).get("weights") or {}
        want = weight_scheme(fmt)
        for key in ("num_bits", "type", "group_size", "strategy"):
            if weights.get(key) != want[key]:
                raise LayoutError(
                    f"{file}: quantization_config.config_groups.{name}.weights.{key} is "
                    f"{weights.get(key)!r}; {qc['format']} needs {want[key]!r}"
                )
    return fmt


# ----------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """The stored parts of one FP4 Linear weight.

    Attributes:
      module: the Linear's name, e.g. ``model.layers.0.mlp.experts.3.up_proj``.
      fmt: the format.
      shape: the hub weight's shape ``(out, in)``.
      parts: tensor name -> safetensors file, for ``weight_packed``, ``weight_scale`` and (NVFP4)
        ``weight_global_scale``.
      exact_global_scale: the rollout's float32 ``s_g`` from the export record, when the stored
        ``gs`` does not give it as ``1 / gs``.
    """

    module: str
    fmt: FormatSpec
    shape: tuple[int, int]
    parts: tuple[tuple[str, Path], ...]
    exact_global_scale: float | None = None

    def read(self, suffix: str) -> np.ndarray:
        name = f"{self.module}.{suffix}"
        return read_raw(dict(self.parts)[name], name)


def group_packed(
    entries: Mapping[str, Any], fmt: str, exact: Mapping[str, float]
) -> dict[str, PackedWeight]:
    """The FP4 weights among a checkpoint's tensors.

    Args:
      entries: tensor name -> an object with ``file``, ``shape`` and ``dtype`` (safetensors'
        dtype string), for every tensor of the checkpoint.
      fmt: the checkpoint's format (``checkpoint_format``).
      exact: module -> exact global scale (``read_exact_global_scales``).
    Returns:
      ``"X.weight"`` -> ``PackedWeight`` for every ``X.weight_packed``; the caller drops the
      parts from ``entries``. Raises ``LayoutError`` naming the tensor and file for a missing
      part or one of the wrong dtype or shape.
    """
    spec = fp4.get_format(fmt)
    scale_dtype = "F8_E4M3" if spec.has_global_scale else "U8"
    out = {}
    for name in sorted(entries):
        if not name.endswith("." + PACKED):
            continue
        module = name.removesuffix("." + PACKED)
        packed = entries[name]
        if packed.dtype != "U8" or len(packed.shape) != 2:
            raise LayoutError(
                f"tensor {name!r} in {packed.file} is {packed.dtype} {list(packed.shape)}; "
                "expected uint8 [out, in/2]"
            )
        n_out, n_in = packed.shape[0], 2 * packed.shape[1]
        want = {f"{module}.{SCALE}": (scale_dtype, (n_out, n_in // spec.block_size))}
        if spec.has_global_scale:
            want[f"{module}.{GLOBAL_SCALE}"] = ("F32", (1,))
        if n_in % spec.block_size:
            raise LayoutError(
                f"tensor {name!r} in {packed.file} packs {n_in} inputs, not a multiple of "
                f"{fmt}'s block size {spec.block_size}"
            )
        parts = [(name, packed.file)]
        for part, (dtype, shape) in want.items():
            e = entries.get(part)
            if e is None:
                raise LayoutError(
                    f"tensor {part!r} is missing (its weight_packed is in {packed.file})"
                )
            size_one = shape == (1,) and int(np.prod(e.shape)) == 1
            if e.dtype != dtype or (tuple(e.shape) != shape and not size_one):
                raise LayoutError(
                    f"tensor {part!r} in {e.file} is {e.dtype} {list(e.shape)}; expected "
                    f"{dtype} {list(shape)}"
                )
            parts.append((part, e.file))
        out[f"{module}.weight"] = PackedWeight(
            module, spec, (n_out, n_in), tuple(parts), exact.get(module)
        )
    return out


def read_exact_global_scales(folder: Path) -> dict[str, float]:
    """module -> exact float32 global scale from an export's record (empty without one)."""
    file = folder / EXPORT_RECORD
    if not file.is_file():
        return {}
    try:
        scales = json.loads(file.read_text()).get("global_scales", {})
        return {m: _from_bits(bits) for m, bits in scales.items()}
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
        raise LayoutError(f"{file}: not a valid export record ({e})") from None


def global_scale_of(pw: PackedWeight) -> np.float32:
    """The rollout's ``s_g`` of a stored NVFP4 weight: the record's, else ``1 / gs``."""
    if pw.exact_global_scale is not None:
        return np.float32(pw.exact_global_scale)
    gs = pw.read(GLOBAL_SCALE).reshape(()).astype(np.float32)
    return np.float32(1) / gs


def qtensors(weights: list[PackedWeight]) -> fp4.QTensor:
    """The experts' stored weights as the rollout's stacked ``QTensor`` (what
    ``engine.pack_expert_weight`` makes of ``[E, in, out]``): codes ``[E, out, in/2]``, block
    scales ``[E, out, in/b]``, global scales ``[E]`` float32 (1 for MXFP4), ``axis=0``."""
    spec = weights[0].fmt
    if any(w.fmt != spec or w.shape != weights[0].shape for w in weights):
        raise LayoutError(f"the experts of {weights[0].module} differ in format or shape")
    codes = np.stack([w.read(PACKED) for w in weights])
    scales = np.stack([w.read(SCALE) for w in weights])
    if spec.has_global_scale:
        s_g = np.array([global_scale_of(w) for w in weights], np.float32)
    else:
        s_g = np.ones(len(weights), np.float32)
    n_out, n_in = weights[0].shape
    return fp4.QTensor(
        codes=codes, block_scales=scales, global_scale=s_g, fmt=spec, shape=(n_in, n_out), axis=0
    )


def dequantize(pw: PackedWeight) -> np.ndarray:
    """The stored weight's value as the format defines it: ``[out, in]`` float32
    ``q * (s_b / gs)`` for NVFP4 (one rounding of the scale quotient, one of the product, as
    compressed-tensors decompresses), ``q * 2**(e - 127)`` for MXFP4 (exact)."""
    codes = np.asarray(fp4.unpack_nibbles(pw.read(PACKED)))
    q = E2M1_VALUES[codes]  # [out, in] float32
    b = pw.fmt.block_size
    if pw.fmt.has_global_scale:
        gs = pw.read(GLOBAL_SCALE).reshape(()).astype(np.float32)
        scale = pw.read(SCALE).astype(np.float32) / gs
    else:
        scale = np.ldexp(np.float32(1), pw.read(SCALE).astype(np.int32) - E8M0_BIAS)
    return q * np.repeat(scale.astype(np.float32), b, axis=-1)


@functools.lru_cache(maxsize=64)
def _header(file: str, mtime_ns: int, size: int) -> tuple[dict[str, Any], int]:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def read_raw(file: Path, name: str) -> np.ndarray:
    """One tensor of a safetensors file, read from its header's offsets (safetensors' numpy API
    has no float8 type)."""
    stat = Path(file).stat()
    header, start = _header(str(file), stat.st_mtime_ns, stat.st_size)
    entry = header[name]
    lo, hi = entry["data_offsets"]
    data = np.fromfile(file, np.uint8, count=hi - lo, offset=start + lo)
    return data.view(_RAW_DTYPES[entry["dtype"]]).reshape(entry["shape"])


# ----------------------------------------------------------------------------- writing


def export_global_scale(s_g: np.float32) -> tuple[np.float32, bool]:
    """(gs, exact): the float32 ``gs`` to store for the rollout's ``s_g``, the one nearest
    ``1 / s_g`` whose reciprocal is ``s_g`` where one exists (exact True), else ``1 / s_g``."""
    s_g = np.float32(s_g)
    nearest = np.float32(1) / s_g
    if not np.isfinite(nearest):
        return nearest, False
    lo = hi = nearest
    candidates = [nearest]
    for _ in range(2):  # the reciprocal's neighbours that can round back to s_g
        lo, hi = np.nextafter(lo, np.float32(0)), np.nextafter(hi, np.float32(np.inf))
        candidates += [lo, hi]
    for gs in candidates:
        if np.float32(1) / gs == s_g:
            return gs, True
    return nearest, False


def packed_tensors(
    module: str, codes: np.ndarray, scales: np.ndarray, gs: np.float32 | None
) -> dict[str, np.ndarray]:
    """The stored tensors of one expert's weight: ``codes [out, in/2]`` uint8, ``scales
    [out, in/b]``, ``gs`` (NVFP4) or None (MXFP4)."""
    out = {f"{module}.{PACKED}": np.ascontiguousarray(codes, np.uint8)}
    out[f"{module}.{SCALE}"] = np.ascontiguousarray(scales)
    if gs is not None:
        out[f"{module}.{GLOBAL_SCALE}"] = np.array([gs], np.float32)
    return out


def to_bits(x: float) -> str:
    """A float32's bit pattern as ``0x...`` (the export record keeps exact scales so)."""
    return f"0x{int(np.float32(x).view(np.uint32)):08x}"


def _from_bits(bits: str) -> float:
    return float(np.uint32(int(bits, 16)).view(np.float32))
