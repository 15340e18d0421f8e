"""Lower Pallas GPU kernels for CUDA on a machine without a GPU.

``jax.export(..., platforms=["cuda"])`` runs JAX's GPU lowering on any host: for Mosaic GPU
kernels it runs layout inference and lowers the kernel body (inline PTX included) into the
module; for Triton kernels the Pallas lowering needs the device's description (compute
capability), given here in place of a device's, and ``triton_modules`` returns each kernel's
Triton IR (a module may hold kernels of both kinds). Neither compiles to machine code: ptxas
and the GPU runtime are the device's part. Tests use it to catch GPU-only lowering errors on
the CPU; ``experiments/bench/offline_sass.py`` compiles the Triton IR with PyPI's ``triton``
to count instructions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
from jax import export

_TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call of a Pallas Triton kernel


def export_for_cuda(
    fn: Callable, *args, gpu: str = "NVIDIA H200", triton_ir: list[str] | None = None
) -> str:
    """The StableHLO text of ``jax.jit(fn)(*args)`` lowered for CUDA: Mosaic GPU kernels
    inside, and Pallas Triton kernels lowered as on ``gpu`` (a device kind JAX knows), their
    Triton IR serialized in the custom calls and, as text, appended to ``triton_ir``."""
    with _triton_lowering_for(gpu, [] if triton_ir is None else triton_ir):
        exported = export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(_TRITON_CALL)],
        )(*args)
    return exported.mlir_module()


@contextlib.contextmanager
def _triton_lowering_for(gpu: str, captured: list[str]):
    from jax._src.pallas.triton import gpu_info as gpu_info_lib
    from jax._src.pallas.triton import pallas_call_registration as registration

    info = gpu_info_lib.get_gpu_info_from_version(gpu_info_lib.GpuVersion(gpu))
    lower = registration.lowering.lower_jaxpr_to_triton_module
    get_gpu_info = registration.gpu_info_lib.get_gpu_info

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    registration.gpu_info_lib.get_gpu_info = lambda: info
    try:
        yield
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
        registration.gpu_info_lib.get_gpu_info = get_gpu_info


def triton_modules(fn: Callable, *args, gpu: str = "NVIDIA H200") -> list[str]:
    """The Triton IR (text) of every Pallas Triton kernel in ``jax.jit(fn)(*args)``, lowered
    for CUDA as on ``gpu`` (a device kind JAX knows, default the H200)."""
    captured: list[str] = []
    export_for_cuda(fn, *args, gpu=gpu, triton_ir=captured)
    return captured
