"""FP4 format specifications: the E2M1 element and the NVFP4 / MXFP4 block-scaled formats.

This module is the one definition of each format in the project. Everything that encodes or
decodes FP4 (quantizers, kernels, exporters, tests) reads its constants from here.

E2M1 (OCP MX spec v1.0, section 5.3.3): 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit.
A 4-bit code is ``sign << 3 | magnitude_code``; magnitude codes 0..7 decode to
0, 0.5, 1, 1.5, 2, 3, 4, 6. The mantissa bit is the low bit of the magnitude code.

NVFP4: blocks of 16 elements along the contraction axis, one E4M3 scale per block, one FP32
global scale per tensor (or per row, see ``quantize``). MXFP4: blocks of 32, one E8M0
(power-of-two) scale per block, no global scale.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Value of each 3-bit magnitude code 0..7."""

E2M1_VALUES = np.array(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES), np.float32)
"""Value of each 4-bit code 0..15 (codes 8..15 are the negatives; code 8 is -0.0)."""

E2M1_MAX = 6.0
E2M1_SIGN_BIT = 0x8
E2M1_MAGNITUDE_MASK = 0x7

E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
"""Smallest normal E4M3 value: NVFP4 block scales are clamped to [E4M3_MIN_NORMAL, E4M3_MAX]."""

E4M3_MAX_FOUR_OVER_SIX = 256.0
"""4/6 scaling divides the global scale by 256 instead of 448 so that the 1.5x larger "scale to 4"
block scale still fits E4M3."""

E8M0_BIAS = 127
E8M0_NAN = 0xFF
E2M1_EMAX = 2
"""Exponent of E2M1's largest power of two (4 = 2**2): MX scale = 2**(floor(log2 amax) - 2)."""

F32_MIN_NORMAL = float(np.finfo(np.float32).tiny)

ScaleFormat = Literal["e4m3", "e8m0"]


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """A block-scaled FP4 format.

    Attributes:
      name: "nvfp4" or "mxfp4".
      block_size: elements per block along the quantized (contraction) axis.
      scale_format: "e4m3" (NVFP4, with an FP32 global scale) or "e8m0" (MXFP4, none).
    """

    name: str
    block_size: int
    scale_format: ScaleFormat

    @property
    def has_global_scale(self) -> bool:
        return self.scale_format == "e4m3"

    @property
    def bits_per_element(self) -> float:
        """Storage bits per element: 4 for the code plus the block scale's share."""
        return 4.0 + 8.0 / self.block_size


NVFP4 = FormatSpec(name="nvfp4", block_size=16, scale_format="e4m3")
MXFP4 = FormatSpec(name="mxfp4", block_size=32, scale_format="e8m0")
FORMATS: dict[str, FormatSpec] = {f.name: f for f in (NVFP4, MXFP4)}


def get_format(fmt: str | FormatSpec) -> FormatSpec:
    """Resolve ``"nvfp4"``, ``"mxfp4"`` or a ``FormatSpec`` to a ``FormatSpec``."""
    if isinstance(fmt, FormatSpec):
        return fmt
    if isinstance(fmt, str) and fmt.lower() in FORMATS:
        return FORMATS[fmt.lower()]
    raise ValueError(
        f"unknown FP4 format {fmt!r}; expected one of {sorted(FORMATS)} or a FormatSpec"
    )
