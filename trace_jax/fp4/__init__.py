"""FP4 formats and numerics: NVFP4 / MXFP4 quantization, fake quant and rollout-guided rounding.

>>> qt = quantize(x, "nvfp4")                 # QTensor: packed codes + scales
>>> x_hat = dequantize(qt, jnp.bfloat16)
>>> y = fake_quant(x, "nvfp4")               # QAT: RTN forward, straight-through backward
>>> g = rollout_guidance(quantize(x_rollout, "nvfp4", global_scale="row"))
>>> y = guided_fake_quant(x_train, g)         # TRACE: rollout-guided forward, STE backward
"""

from trace_jax.fp4.e2m1 import (
    decode_e2m1,
    guided_round,
    mantissa_bit,
    pack_bits,
    pack_nibbles,
    round_to_e2m1,
    unpack_bits,
    unpack_nibbles,
)
from trace_jax.fp4.formats import (
    E2M1_MAX,
    E2M1_VALUES,
    FORMATS,
    MXFP4,
    NVFP4,
    FormatSpec,
    get_format,
)
from trace_jax.fp4.qtensor import QTensor
from trace_jax.fp4.quantize import dequantize, quantize, unpacked_codes
from trace_jax.fp4.transforms import (
    Guidance,
    code_values,
    fake_quant,
    guidance_nbytes,
    guided_fake_quant,
    guided_quantize,
    rollout_guidance,
    straight_through,
    take_rows,
    take_slots,
    with_row_global_scale,
)

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "FORMATS",
    "MXFP4",
    "NVFP4",
    "FormatSpec",
    "Guidance",
    "QTensor",
    "code_values",
    "decode_e2m1",
    "dequantize",
    "fake_quant",
    "get_format",
    "guidance_nbytes",
    "guided_fake_quant",
    "guided_quantize",
    "guided_round",
    "mantissa_bit",
    "pack_bits",
    "pack_nibbles",
    "quantize",
    "rollout_guidance",
    "round_to_e2m1",
    "straight_through",
    "take_rows",
    "take_slots",
    "unpack_bits",
    "unpack_nibbles",
    "unpacked_codes",
    "with_row_global_scale",
]
