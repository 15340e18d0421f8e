"""XLA's memory analysis of the trainer's scoring pass (``Trainer.score``: one forward over a
whole rollout batch) or of one minibatch gradient (``--program gradient``) at a preset's shapes,
compiled from shapes alone (no weights allocated), on whatever device JAX has.

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


def memory_analysis(cfg: ModelConfig, program: str, batch: int, seq: int):
    """XLA's ``CompiledMemoryStats`` of ``Trainer.score`` over ``batch`` sequences of ``seq``
    slots, or of ``Trainer.gradient`` with them as one minibatch ("gradient"), BF16 trainer,
    compiled from shapes alone on the default device."""
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    trainer = Trainer(model, QuantPolicy.bf16(), LossConfig(), optax.adamw(1e-5), minibatches=4)
    shape = jax.ShapeDtypeStruct
    b, s, k = batch, seq, cfg.num_experts_per_tok
    rl_batch = RLBatch(
        tokens=shape((b, s), jnp.int32),
        filled=shape((b, s), bool),
        loss_mask=shape((b, s), bool),
        rollout_logp=shape((b, s), jnp.float32),
        advantages=shape((b,), jnp.float32),
        routes=shape((len(cfg.moe_layers), b, s, k), jnp.int32),
    )
    params = nnx.state(model, nnx.Param)
    if program == "score":
        lowered = Trainer.score.lower(trainer, params, rl_batch)
    else:  # the whole batch as one minibatch, with proximal log-probs
        logp = shape((b, s), jnp.float32)
        rows = shape((b,), jnp.int32)
        lowered = Trainer.gradient.lower(trainer, params, rl_batch, logp, None, rows)
    return lowered.compile().memory_analysis()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--batch", type=int, default=64, help="sequences")
    p.add_argument("--seq", type=int, default=64, help="slots per sequence")
    p.add_argument("--layers", type=int, default=None, help="default: the preset's")
    p.add_argument(
        "--program",
        choices=("score", "gradient"),
        default="score",
        help="the scoring pass, or one minibatch gradient of --batch sequences",
    )
    a = p.parse_args()
    cfg = ModelConfig.preset(a.preset)
    if a.layers:
        cfg = cfg.replace(num_layers=a.layers)
    mem = memory_analysis(cfg, a.program, a.batch, a.seq)
    print(
        f"{a.program}: {a.preset} ({cfg.num_layers} layers), {a.batch} x {a.seq} tokens on "
        f"{jax.devices()[0].device_kind}: temporaries {mem.temp_size_in_bytes / 2**30:.2f} GiB,"
        f" arguments {mem.argument_size_in_bytes / 2**30:.2f} GiB"
    )


if __name__ == "__main__":
    main()
