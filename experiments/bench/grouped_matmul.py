"""The trainer's routed-expert matmul, forward and backward, at a preset's shapes (GPU).

What a trainer step spends on the experts: ``trace_jax.model.layers.grouped_matmul`` in its
two forms, ``xla`` (the ragged_dot forward below 1 GiB of dense product, blocks above it; the
gradients by blocks) and ``kernels`` (JAX's Hopper kernels through
``pallas_kernels.bf16_grouped_matmul``: ``ragged_dot_mgpu`` for the forward and the input
gradient, ``transposed_ragged_dot_mgpu`` for the weight gradient), BF16 operands accumulated in
float32 in both. Rows are ``tokens x top-k``, routed uniformly at random; the weights are BF16
as the trainer casts them. Each variant is checked against the float32 reference before it is
timed; the table gives ms per call and TFLOP/s of the useful FLOPs (2 x rows x K x N forward,
three times that forward and backward).

    python experiments/bench/grouped_matmul.py --preset medium --tokens 4352,17408
"""

from __future__ import annotations

import argparse
import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.fp4_matmul import rel_error, time_op
from pallas_kernels import bf16_grouped_matmul
from trace_jax.model import ModelConfig
from trace_jax.model.layers import grouped_matmul, sort_by_expert


@contextlib.contextmanager
def expert_kernels(on: bool):
    """``layers.grouped_matmul`` with JAX's Hopper kernels where they apply (on) or XLA's
    blocked form (off)."""
    applies = bf16_grouped_matmul.applies
    if not on:
        bf16_grouped_matmul.applies = lambda x, w: False
    try:
        yield
    finally:
        bf16_grouped_matmul.applies = applies


VARIANTS = {"xla": False, "kernels": True}  # name -> expert_kernels(on)


def _case(cfg: ModelConfig, tokens: int, k_dim: int, n_dim: int, seed: int):
    """x [tokens*topk, K] bf16 sorted by expert, w [E, K, N] bf16, group_sizes, cotangent."""
    kx, kw, kr, kg = jax.random.split(jax.random.key(seed), 4)
    experts = jax.random.randint(kr, (tokens, cfg.num_experts_per_tok), 0, cfg.num_experts)
    _, group_sizes = sort_by_expert(experts, cfg.num_experts)
    rows = tokens * cfg.num_experts_per_tok
    x = jax.random.normal(kx, (rows, k_dim), jnp.bfloat16)
    w = jax.random.normal(kw, (cfg.num_experts, k_dim, n_dim)) / np.sqrt(k_dim)
    w = w.astype(jnp.bfloat16)
    ct = jax.random.normal(kg, (rows, n_dim), jnp.bfloat16)
    return x, w, group_sizes, ct


def _reference(x, w, group_sizes, ct):
    """float32 forward, input and weight gradients (XLA ragged_dot on float32, small shapes)."""
    f = lambda x, w: jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)  # noqa: E731
    out, vjp = jax.vjp(f, x.astype(jnp.float32), w.astype(jnp.float32))
    return (out, *vjp(ct.astype(jnp.float32)))


def measure(fn, x, w, group_sizes, ct, check_rows: int):
    """(fwd seconds, fwd+bwd seconds, max relative error of out/dx/dw on a slice)."""
    fwd = lambda x, w, gs: fn(x, w, gs)  # noqa: E731

    def fwd_bwd(x, w, gs):
        out, vjp = jax.vjp(lambda x, w: fn(x, w, gs), x, w)
        return vjp(ct.astype(out.dtype))

    # the check: the first check_rows rows, their group sizes clipped to them
    sizes = np.asarray(group_sizes)
    ends = np.minimum(np.cumsum(sizes), check_rows)
    gs_c = jnp.asarray(np.diff(ends, prepend=0), jnp.int32)
    xs, cs = x[:check_rows], ct[:check_rows]
    out = fn(xs, w, gs_c)
    _, vjp = jax.vjp(lambda x, w: fn(x, w, gs_c), xs, w)
    dx, dw = vjp(cs.astype(out.dtype))
    ref = _reference(xs, w, gs_c, cs)
    err = max(rel_error(a.astype(jnp.float32), r) for a, r in zip((out, dx, dw), ref, strict=True))
    t_fwd = time_op(fwd, [(x, w, group_sizes)])
    t_all = time_op(fwd_bwd, [(x, w, group_sizes)])
    return t_fwd, t_all, err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--tokens", default="4352,17408", help="tokens per call, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--check-rows", type=int, default=4096)
    args = parser.parse_args(argv)
    cfg = ModelConfig.preset(args.preset)
    h, f = cfg.hidden_size, cfg.moe_intermediate_size
    device = jax.devices()[0].device_kind
    print(f"{args.preset}: E={cfg.num_experts}, top-{cfg.num_experts_per_tok}, "
          f"gate/up [{h} -> {f}], down [{f} -> {h}]; device {device}")  # fmt: skip
    rows_out = []
    for tokens in map(int, args.tokens.split(",")):
        for k_dim, n_dim, name in ((h, f, "gate/up"), (f, h, "down")):
            case = _case(cfg, tokens, k_dim, n_dim, seed=tokens)
            print(f"{tokens} {name}: kernels apply: {bf16_grouped_matmul.applies(*case[:2])}")
            flops = 2 * tokens * cfg.num_experts_per_tok * k_dim * n_dim
            for v in args.variants.split(","):
                try:
                    with expert_kernels(VARIANTS[v]):
                        t_fwd, t_all, err = measure(grouped_matmul, *case, args.check_rows)
                except Exception as e:  # a variant that does not lower is reported, not fatal
                    print(f"{tokens} {name} {v}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                rows_out.append((tokens, name, v, t_fwd, t_all, flops, err))
                print(f"{tokens} {name} {v}: fwd {t_fwd * 1e3:.3f} ms, "
                      f"fwd+bwd {t_all * 1e3:.3f} ms, err {err:.1e}", flush=True)  # fmt: skip
    print("\n| tokens | matmul | variant | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s "
          "| rel. error |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for tokens, name, v, t_fwd, t_all, flops, err in rows_out:
        print(f"| {tokens} | {name} | {v} | {t_fwd * 1e3:.3f} | {flops / t_fwd / 1e12:.0f} | "
              f"{t_all * 1e3:.3f} | {3 * flops / t_all / 1e12:.0f} | {err:.1e} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
