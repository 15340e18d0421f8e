"""The RL loop across processes: a batch split over processes samples what the whole batch
would (per-row keys)."""

import jax
import numpy as np
from flax import nnx

from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.rollout import RolloutConfig, RolloutEngine


def test_a_row_samples_the_same_tokens_in_any_part_of_its_batch():
    model = Transformer(ModelConfig.preset("tiny").replace(num_layers=1), nnx.Rngs(0))
    engine = RolloutEngine(model, QuantPolicy.bf16(), RolloutConfig(max_len=16, max_new_tokens=8))
    prompts = [[1, 2, 3]] * 4  # one prompt: the rows differ by their keys alone
    key = jax.random.key(3)
    whole = engine.generate(prompts, key)
    tokens = np.asarray(whole.tokens)
    assert len({tuple(t) for t in tokens}) == 4, tokens  # each row has its own key
    for part in ([0, 1], [2, 3], [3]):  # e.g. process 1's half of the batch
        got = engine.generate([prompts[i] for i in part], key, row_ids=np.asarray(part))
        np.testing.assert_array_equal(np.asarray(got.tokens), tokens[part])
        # float32 rounding: XLA:CPU picks its matmul kernels by shape, and the batch is a dim
        want = np.asarray(whole.logprobs)[part]
        np.testing.assert_allclose(np.asarray(got.logprobs), want, rtol=4e-7, atol=0)
