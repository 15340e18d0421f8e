"""NVFP4 / MXFP4 reference encodings from torchao, for ``test_reference_parity.py``.

Run under the reference interpreter (torch + torchao + numpy; no trace_jax)::

    python reference_torchao.py INPUTS.npz OUTPUTS.npz

INPUTS.npz holds ``spec``, a JSON list of cases ``{"name", "fmt", "mode", "dtype"}``, and one
float32 array ``<name>/x`` per case, already in the layout to quantize (blocks along the last
axis). ``fmt`` is "nvfp4" or "mxfp4"; ``mode`` (NVFP4) is "tensor" for one global scale or "row"
for one global scale per row of the last axis; ``dtype`` is the dtype handed to torchao
("float32" or "bfloat16"; the stored values are exact in it).

OUTPUTS.npz holds, per case, ``<name>/codes`` (packed uint8, element 2i in the low nibble),
``<name>/scales`` (the raw block-scale bytes as uint8: E4M3 for NVFP4, biased E8M0 for MXFP4)
and, for NVFP4, ``<name>/global`` (float32, shape () or [rows, 1]).
"""

import json
import sys

import numpy as np
import torch
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale


def nvfp4_one_group(x: torch.Tensor):
    """One global scale for all of ``x`` [..., K] -> (codes, scale bytes, global scale)."""
    per_tensor_scale = per_tensor_amax_to_scale(torch.max(torch.abs(x)))
    scales, codes = nvfp4_quantize(x.contiguous(), block_size=16, per_tensor_scale=per_tensor_scale)
    scales = scales.reshape(*x.shape[:-1], x.shape[-1] // 16)
    return codes, scales.view(torch.uint8), per_tensor_scale


def nvfp4(x: torch.Tensor, mode: str):
    if mode == "tensor":
        return nvfp4_one_group(x)
    rows = [nvfp4_one_group(row[None]) for row in x.reshape(-1, x.shape[-1])]
    codes = torch.cat([r[0] for r in rows]).reshape(*x.shape[:-1], -1)
    scales = torch.cat([r[1] for r in rows]).reshape(*x.shape[:-1], -1)
    global_scale = torch.stack([r[2] for r in rows]).reshape(*x.shape[:-1], 1)
    return codes, scales, global_scale


def mxfp4(x: torch.Tensor):
    scales, codes = to_mx(
        x.contiguous(), torch.float4_e2m1fn_x2, 32, scaling_mode=ScaleCalculationMode.FLOOR
    )
    return codes, scales.view(torch.uint8), None


def main(inputs: str, outputs: str) -> None:
    data = np.load(inputs)
    out = {}
    for case in json.loads(str(data["spec"])):
        name = case["name"]
        x = torch.from_numpy(data[f"{name}/x"]).to(getattr(torch, case["dtype"]))
        if case["fmt"] == "nvfp4":
            codes, scales, global_scale = nvfp4(x, case["mode"])
        else:
            codes, scales, global_scale = mxfp4(x)
        out[f"{name}/codes"] = codes.numpy()
        out[f"{name}/scales"] = scales.numpy()
        if global_scale is not None:
            out[f"{name}/global"] = global_scale.to(torch.float32).numpy()
    np.savez(outputs, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
