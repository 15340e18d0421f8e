"""Reads trace-jax's FP4 exports with the ``compressed-tensors`` library (reference environment).

Run by ``test_export.py`` with ``TRACE_REF_PYTHON``:
``python reference_compressed_tensors.py OUT.npz FOLDER...``.

For each folder it goes the way a loader of the format does (transformers' compressed-tensors
integration): a skeleton of the checkpoint's modules (``Linear`` for every stored linear weight),
``apply_quantization_config`` with the folder's own ``quantization_config`` (compressed-tensors'
target and ``ignore`` matching decides which modules are quantized), ``compress_model`` to give
them the compressed parameters, ``load_state_dict(strict=True)`` of the stored tensors (every
tensor must be one of those parameters, with its shape), then ``decompress_model``. It writes
``<i>/<module>`` -> the decompressed weight (bfloat16, as float32) for every quantized module,
``<i>/<module>/f32`` -> compressed-tensors' ``dequantize`` of the same tensors in float32 (NVFP4),
``<i>/<module>/q`` and ``/scale`` -> its reading of the E2M1 values and the block scales
(float32), and ``<i>.quantized`` -> the names of the modules compressed-tensors quantized.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
from compressed_tensors.quantization.lifecycle.forward import dequantize
from safetensors.torch import load_file

SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "weight")


def stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    out = {}
    for name in files:
        out.update(load_file(folder / name))
    return out


def skeleton(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Modules named as the checkpoint's tensors: ``Linear`` for 2-D weights and packed
    weights, ``Embedding`` for the embedding, a bare module holding 1-D weights."""
    root = torch.nn.Module()
    for name, t in sorted(tensors.items()):
        module_name, param = name.rsplit(".", 1)
        if param not in ("weight", "weight_packed"):
            continue
        if param == "weight_packed":
            module = torch.nn.Linear(2 * t.shape[1], t.shape[0], bias=False)
        elif "embed_tokens" in module_name:
            module = torch.nn.Embedding(*t.shape)
        elif t.ndim == 2:
            module = torch.nn.Linear(t.shape[1], t.shape[0], bias=False)
        else:
            module = torch.nn.Module()
            module.weight = torch.nn.Parameter(torch.empty(t.shape))
        parent = root
        for part in module_name.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(module_name.split(".")[-1], module)
    return root


def main(out_path: str, *folders: str) -> None:
    arrays = {}
    for i, folder in enumerate(map(Path, folders)):
        config = json.loads((folder / "config.json").read_text())
        qconfig = QuantizationConfig.model_validate(config["quantization_config"])
        tensors = stored_tensors(folder)
        model = skeleton(tensors)
        apply_quantization_config(model, qconfig, show_progress=False)
        quantized = sorted(
            n for n, m in model.named_modules() if getattr(m, "quantization_scheme", None)
        )
        compressor = ModelCompressor(quantization_config=qconfig)
        with torch.no_grad():
            compressor.compress_model(model)
            model.load_state_dict(tensors, strict=True)
        compressor.decompress_model(model)
        modules = dict(model.named_modules())
        for name in quantized:
            weight = modules[name].weight.detach()
            assert weight.dtype == torch.bfloat16, weight.dtype
            arrays[f"{i}/{name}"] = weight.float().numpy()
            scheme = modules[name].quantization_scheme
            packed, scale = tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"]
            m, n = packed.shape
            q = unpack_fp4_from_uint8(packed, m, 2 * n, dtype=torch.float32)
            arrays[f"{i}/{name}/q"] = q.numpy()
            if scheme.weights.strategy == "tensor_group":  # NVFP4: the float32 value itself
                arrays[f"{i}/{name}/scale"] = scale.float().numpy()
                arrays[f"{i}/{name}/f32"] = dequantize(
                    x_q=q,
                    scale=scale.float(),
                    global_scale=tensors[f"{name}.weight_global_scale"],
                    args=scheme.weights,
                    dtype=torch.float32,
                ).numpy()
            else:
                arrays[f"{i}/{name}/scale"] = decompress_mx_scale(scale).float().numpy()
        arrays[f"{i}.quantized"] = np.array(quantized)
    np.savez(out_path, **arrays)


if __name__ == "__main__":
    main(*sys.argv[1:])
