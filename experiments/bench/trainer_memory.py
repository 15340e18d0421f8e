"""XLA's memory analysis of the trainer's scoring pass (``Trainer.score``: one forward over a
whole rollout batch) at a preset's shapes, compiled from shapes alone (no weights allocated), on
whatever device JAX has.

  PYTHONPATH=. python3 experiments/bench/trainer_memory.py --preset medium --batch 64 \
      --seq 64 --layers 1

Prints the temporaries and the arguments in GiB.
"""

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import RLBatch, Trainer


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--batch", type=int, default=64, help="sequences")
    p.add_argument("--seq", type=int, default=64, help="slots per sequence")
    p.add_argument("--layers", type=int, default=None, help="default: the preset's")
    a = p.parse_args()
    cfg = ModelConfig.preset(a.preset)
    if a.layers:
        cfg = cfg.replace(num_layers=a.layers)
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    trainer = Trainer(model, QuantPolicy.bf16(), LossConfig(), optax.adamw(1e-5), minibatches=4)
    shape = jax.ShapeDtypeStruct
    b, s, k = a.batch, a.seq, cfg.num_experts_per_tok
    batch = RLBatch(
        tokens=shape((b, s), jnp.int32),
        filled=shape((b, s), bool),
        loss_mask=shape((b, s), bool),
        rollout_logp=shape((b, s), jnp.float32),
        advantages=shape((b,), jnp.float32),
        routes=shape((len(cfg.moe_layers), b, s, k), jnp.int32),
    )
    params = nnx.state(model, nnx.Param)
    mem = Trainer.score.lower(trainer, params, batch).compile().memory_analysis()
    print(
        f"{a.preset} ({cfg.num_layers} layers), {b} x {s} tokens on {jax.devices()[0].device_kind}:"
        f" temporaries {mem.temp_size_in_bytes / 2**30:.2f} GiB,"
        f" arguments {mem.argument_size_in_bytes / 2**30:.2f} GiB"
    )


if __name__ == "__main__":
    main()
