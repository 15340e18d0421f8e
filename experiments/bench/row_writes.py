"""Do the rollout's row writes put every row where it belongs, on this device and with XLA's
deterministic ops?

The rollout writes each step's tokens, log-probs, routes, K/V rows and guidance records into its
[B, S, ...] buffers with one scatter per buffer (``kv_format.scatter_rows``): row b's chunk at
slots ``lengths[b] + t`` where ``valid[b, t]``, the invalid positions sent out of range and
dropped. Until ``a851a84`` that scatter did not declare its indices unique, and under
``--xla_gpu_deterministic_ops`` (the ``medium`` recipe's ``deterministic: true``) XLA rewrote it;
since then the GPU's trainer-vs-rollout mismatch at ``medium`` fell ~10x and TRACE's guided
sites went from 0.1-4 % mismatched codes to ~1e-6. This script writes rollout-shaped chunks
(a prefill chunk of ragged prompts, then decode steps with finished rows) both ways, the old
scatter and ``scatter_rows``, and compares each with a NumPy reference, element by element.

Usage (GPU machine): ``PYTHONPATH=. python3 experiments/bench/row_writes.py [--deterministic]``
(the flag sets ``--xla_gpu_deterministic_ops=true`` before JAX starts). Prints one line per
buffer and form: differing elements and (row, slot) pairs; 0 everywhere is the pass.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__" and "--deterministic" in sys.argv:  # before JAX starts its backend
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.fp4.kv_format import scatter_rows


def old_scatter_rows(buf, chunk, lengths, valid, mode="drop"):
    """``scatter_rows`` as it was before ``a851a84``: the same indices, not declared unique
    (``mode="clip"``: a faulty form, which writes invalid positions into the last slot)."""
    b, t = valid.shape
    slots = lengths[:, None] + jnp.arange(t, dtype=lengths.dtype)[None]
    slots = jnp.where(valid, slots, buf.shape[1])
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    return buf.at[rows, slots].set(chunk.astype(buf.dtype), mode=mode)


def reference(buf, chunk, lengths, valid):
    """The same write in NumPy, one row at a time."""
    out = np.array(buf)
    for b in range(valid.shape[0]):
        for t in np.flatnonzero(valid[b]):
            slot = lengths[b] + t
            if slot < out.shape[1]:
                out[b, slot] = chunk[b, t]
    return out


def rollout_writes(batch: int, slots: int, prompt: int, steps: int, trailing, dtype, seed: int):
    """[(name, buf, chunk, lengths, valid)]: a prefill chunk of ragged prompts (right-padded),
    then ``steps`` decode steps in which a growing share of the rows has finished."""
    rng = np.random.default_rng(seed)
    integer = np.issubdtype(dtype, np.integer)
    make = lambda *shape: (  # noqa: E731
        rng.integers(0, 256, shape).astype(dtype)
        if integer
        else rng.standard_normal(shape).astype(np.float32).astype(dtype)
    )
    buf = np.zeros((batch, slots, *trailing), dtype)
    prompts = rng.integers(prompt // 2, prompt + 1, batch)
    valid = np.arange(prompt)[None] < prompts[:, None]
    writes = [("prefill", buf, make(batch, prompt, *trailing), np.zeros(batch, np.int32), valid)]
    lengths = prompts.astype(np.int32)
    for step in range(steps):
        live = rng.random(batch) > step / (2 * steps)  # rows finish as decoding goes on
        writes.append((f"decode {step}", None, make(batch, 1, *trailing), lengths, live[:, None]))
        lengths = lengths + live
    return writes


def check(form, writes) -> list[tuple[str, int, int]]:
    """Run ``writes`` in order with ``form`` (jitted, buffer donated, as the engine does) and
    the reference; (name, differing elements, differing (row, slot) pairs) per write."""
    write = jax.jit(form, donate_argnums=0)
    ref = dev = None
    out = []
    for name, buf, chunk, lengths, valid in writes:
        if buf is not None:
            ref, dev = np.array(buf), jnp.asarray(buf)
        ref = reference(ref, chunk, lengths, valid)
        dev = write(dev, jnp.asarray(chunk), jnp.asarray(lengths), jnp.asarray(valid))
        got = np.asarray(dev)
        differ = got.view(np.uint8) != ref.view(np.uint8)
        pairs = differ.reshape(*differ.shape[:2], -1).any(-1)
        out.append((name, int(differ.sum()), int(pairs.sum())))
    return out


def engine_rollouts(preset: str, layers: int, batch: int, new: int) -> dict[str, dict]:
    """One rollout of a random ``preset`` model (``layers`` of its layers; FP4 weights, NVFP4
    cache, guidance and full codes recorded at every layer; the backend the RL loop picks on
    this device) per row-write form: ``{form: {buffer: numpy array}}``, the same prompts and
    key for both, every program compiled afresh for each form."""
    from flax import nnx

    from trace_jax.fp4 import kv_format
    from trace_jax.model import ModelConfig, QuantPolicy, Transformer
    from trace_jax.rollout import RolloutConfig, RolloutEngine, kv_cache

    cfg = ModelConfig.preset(preset).replace(num_layers=layers)
    model = Transformer(cfg, nnx.Rngs(0))
    policy = QuantPolicy.rollout(guided_layers="all", record_codes=True)
    backend = "pallas" if jax.default_backend() == "gpu" else "xla"
    rollout = RolloutConfig(
        max_len=16 + new, max_new_tokens=new, kv_cache="nvfp4", backend=backend, code_rows=8
    )
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, rng.integers(8, 17))) for _ in range(batch)]
    out = {}
    for name, form in (("old", old_scatter_rows), ("scatter_rows", scatter_rows)):
        kv_format.scatter_rows = kv_cache.scatter_rows = form  # what the engine's writes call
        jax.clear_caches()
        state = RolloutEngine(model, policy, rollout).generate(prompts, jax.random.key(1))
        arrays = {"tokens": state.tokens, "logprobs": state.logprobs, "routes": state.routes}
        for site, record in state.guidance.items():
            for field in ("codes", "mantissa_bits", "block_scales", "global_scale"):
                if hasattr(record, field):
                    arrays[f"{site}.{field}"] = getattr(record, field)
        out[name] = {k: np.asarray(v) for k, v in arrays.items()}
    kv_format.scatter_rows = kv_cache.scatter_rows = scatter_rows
    jax.clear_caches()
    return out


def compare_rollouts(out: dict[str, dict]) -> int:
    """Print the buffers in which the two forms' rollouts differ; returns how many do."""
    old, new = out["old"], out["scatter_rows"]
    differ = [k for k in new if old[k].view(np.uint8).tobytes() != new[k].view(np.uint8).tobytes()]
    for k in differ:
        print(f"  {k}: {int((old[k] != new[k]).sum())} of {old[k].size} elements differ")
    print(f"engine rollouts: {len(differ)} of {len(new)} buffers differ between the two forms")
    return len(differ)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deterministic", action="store_true", help="XLA's deterministic GPU ops")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--slots", type=int, default=112)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument(
        "--engine",
        default=None,
        metavar="PRESET",
        help="instead: one engine rollout per form of a random PRESET model, compared bit for bit",
    )
    p.add_argument("--layers", type=int, default=2, help="with --engine: layers of the preset")
    p.add_argument("--new", type=int, default=48, help="with --engine: tokens generated")
    args = p.parse_args(argv)
    if args.engine:
        print(
            f"device {jax.devices()[0].device_kind}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
        )
        return (
            1
            if compare_rollouts(engine_rollouts(args.engine, args.layers, args.batch, args.new))
            else 0
        )
    print(f"device {jax.devices()[0].device_kind}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    buffers = {  # the engine's buffers, by element type and trailing shape
        "tokens int32 [B, S]": ((), np.int32),
        "logprobs float32 [B, S]": ((), np.float32),
        "K/V bf16 [B, S, 4, 64]": ((4, 64), jnp.bfloat16),
        "codes uint8 [B, S, 8, 32]": ((8, 32), np.uint8),
    }
    bad = 0
    for label, (trailing, dtype) in buffers.items():
        writes = rollout_writes(
            args.batch, args.slots, args.prompt, args.steps, trailing, dtype, seed=0
        )
        for form_name, form in (("old", old_scatter_rows), ("scatter_rows", scatter_rows)):
            rows = check(form, writes)
            wrong = sum(n for _, n, _ in rows)
            pairs = sum(n for _, _, n in rows)
            first = next((name for name, n, _ in rows if n), "-")
            print(
                f"{label:28s} {form_name:12s} differing elements {wrong:9d}, "
                f"(row, slot) pairs {pairs:7d}, first in {first}"
            )
            bad += form is scatter_rows and wrong > 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
