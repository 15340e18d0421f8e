"""orbax round trip of the model parameters is exact."""

import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax.model import ModelConfig, Transformer
from trace_jax.model.checkpoint import params_digest, restore_params, save_params


def test_params_round_trip_exactly(tmp_path):
    cfg = ModelConfig.preset("tiny").replace(param_dtype="bfloat16")
    saved = Transformer(cfg, nnx.Rngs(0))
    save_params(tmp_path / "params", saved)
    restored = restore_params(tmp_path / "params", Transformer(cfg, nnx.Rngs(1)))
    a = jax.tree.leaves(nnx.state(saved, nnx.Param))
    b = jax.tree.leaves(nnx.state(restored, nnx.Param))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # equal parameters, equal digests; one bit of one element changes it
    assert params_digest(saved) == params_digest(restored)
    assert params_digest(saved) != params_digest(Transformer(cfg, nnx.Rngs(1)))
    w = restored.layers[0].mlp.router
    w[...] = w[...].at[0, 0].set(jax.lax.nextafter(w[...][0, 0], w[...][0, 0] + 1))
    assert params_digest(saved) != params_digest(restored)


def test_restoring_from_a_missing_folder_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no parameter checkpoint at .*nowhere"):
        restore_params(tmp_path / "nowhere", Transformer(ModelConfig.preset("tiny"), nnx.Rngs(0)))
