"""Pallas GPU kernels of the FP4 rollout, laid out in three levels (no module imports a level
above its own, nor a private name of another module):

* operand layouts, below every kernel: ``layouts`` (prepacked FP4 weights, built once at load),
  ``dequant`` (the Triton kernels' in-register FP4 decode), ``kv_layout`` (the KV cache's
  buffers as kernel operands, the flash-decoding split rule and merge). They depend on the
  formats only (``trace_jax.fp4``, with the KV cache's stored format ``trace_jax.fp4.kv_format``).
* kernels, each alone in its module: ``fp4_matmul_triton``, ``fp4_matmul_gemv``,
  ``fp4_matmul_mgpu`` (dense and grouped, one pipeline), ``fp4_grouped_matmul_triton``,
  ``fp4_activation``, ``fp4_decode_attention_triton``, ``fp4_decode_attention_mgpu``,
  ``kv_append_triton``.
* the ops, above them: ``fp4_matmul`` (``fp4_matmul``, ``fp4_matmul_w4a4``, ``fp4_linear``),
  ``fp4_grouped_matmul`` (``fp4_grouped_linear``) and ``fp4_decode_attention``
  (``decode_attention``, ``decode_attention_append``, ``kv_append``): each holds its op's
  pure-JAX reference, which the kernels are tested against, and picks the kernel a call runs;
  ``bf16_grouped_matmul``, the trainer's BF16 expert matmul and its gradients through JAX's own
  Hopper kernels (``ragged_dot_mgpu``, ``transposed_ragged_dot_mgpu``), where they apply.

``cuda_lowering`` lowers any of them for CUDA on a machine without a GPU (tooling, no kernel).
"""

# fuser is imported for its side effect only: the Pallas interpreter imports it on first use,
# and it registers a jit-key config value, which turns every jit cache entry made before into a
# miss (the rollout engine's jitted steps would each compile twice on the CPU).
from jax.experimental.pallas import fuser as _fuser  # noqa: F401
