"""Code metrics: the signed codebook index by hand, and ``site_mismatch`` (sites of a kind mapped
over their layers at once) against its definition site by site (``code_counts``, ``code_stats``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import fp4
from trace_jax.rl import metrics


def test_signed_code_index_by_hand():
    values = np.array(
        [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32
    )
    want = [0, 1, 2, 3, 4, 5, 6, 7, 0, -1, -2, -3, -4, -5, -6, -7]
    got = metrics.signed_code_index(jnp.asarray(values))
    assert got.dtype == jnp.int32 and got.tolist() == want


def test_site_mismatch_equals_its_definition_site_by_site():
    rng = np.random.default_rng(0)
    b, s = 3, 5
    shapes = {"experts.gate_up.act": (b, s, 64), "kv.k": (b, s, 2, 32)}
    rollout, train = {}, {}
    for layer in range(4):
        for site, shape in shapes.items():
            name = f"layers.{layer}.{site}"
            x = rng.standard_normal(shape).astype(np.float32)
            noisy = x + rng.standard_normal(shape).astype(np.float32) * 0.05 * (layer + 1)
            rollout[name] = fp4.quantize(jnp.asarray(x), "nvfp4", global_scale="row")
            train[name + ".codes"] = fp4.quantize(jnp.asarray(noisy), "nvfp4", global_scale="row")
    mask = jnp.asarray(rng.random((b, s)) < 0.7)
    guided = frozenset(n for n in rollout if int(n.split(".")[1]) >= 2)
    got = metrics.site_mismatch(train, rollout, mask, guided)

    pooled = {}
    for name, r in rollout.items():
        counts = metrics.code_counts(train[name + ".codes"], r, mask)
        site, layer = metrics.site_key(name)
        for stat, value in metrics.code_stats(counts).items():
            np.testing.assert_allclose(
                got[f"mismatch/{stat}/{site}/{layer}"], value, rtol=1e-6, err_msg=name
            )
        for group in ("all", "guided" if name in guided else "unguided"):
            acc = pooled.setdefault(group, dict.fromkeys(counts, 0.0))
            for k, v in counts.items():
                acc[k] += float(v)
    assert pooled["all"]["mismatched"] > 0
    for group, counts in pooled.items():
        for stat, value in metrics.code_stats(jax.tree.map(jnp.float32, counts)).items():
            assert float(got[f"mismatch/{stat}/{group}"]) == pytest.approx(float(value), rel=1e-5)
        # the elements of the masked tokens: 64 + 2 x 32 per token and layer of the group
        layers = {"all": 4, "guided": 2, "unguided": 2}[group]
        want = float(jnp.sum(mask)) * 128 * layers
        assert float(got[f"mismatch/code_elements/{group}"]) == want
    want = 1 - float(got["mismatch/code_rate/guided"])
    assert float(got["mismatch/guided_code_agreement"]) == pytest.approx(want)
    per_layer = [k for k in got if k.count("/") == 3]
    assert len(per_layer) == 4 * len(metrics.CODE_STATS) * len(shapes)

    # no sampled token among the rows: every statistic unmeasured (NaN), none a rate of 0
    empty = metrics.site_mismatch(train, rollout, jnp.zeros_like(mask), guided)
    for k, v in empty.items():
        if k.startswith("mismatch/code_elements/"):
            assert float(v) == 0, k
        else:
            assert np.isnan(float(v)), k
