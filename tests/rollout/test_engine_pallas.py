"""Rollout engine with backend="pallas" (grouped FP4 kernel for the routed experts, in the Pallas
interpreter on the CPU) against backend="xla" (dequantize + ``ragged_dot``).

The kernel is W4A16, so the model computes in bf16 here (the tiny preset with 2 layers and dtype
bf16; with a float32 compute dtype the MoE layers fall back to the XLA path:
tests/model/test_layers.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels import fp4_decode_attention, layouts
from pallas_kernels import fp4_grouped_matmul_triton as gt
from pallas_kernels.layouts import Fp4Weight
from trace_jax import fp4
from trace_jax.fp4.formats import E2M1_MAX, E4M3_MAX
from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.rollout import RolloutConfig, RolloutEngine, SamplingConfig

# 2 layers: compiling the decode programs (Pallas interpreter inside) dominates; each is per layer
CFG = dataclasses.replace(ModelConfig.preset("tiny"), num_layers=2, dtype="bfloat16")
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
NEW = 6
POLICY = QuantPolicy.rollout("nvfp4")  # FP4 expert weights, activations and KV, recorded
EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj")
# NVFP4 global scale amax / (6 * 448) is exactly 2**-15 for this expert amax.
POW2_AMAX = E2M1_MAX * E4M3_MAX * 2.0**-15


def _expert_params(model):
    for layer in model.layers:
        if layer.is_moe:
            for name in EXPERT_PARAMS:
                yield getattr(layer.mlp, name)


def pow2_global_scales(model):
    """A copy of ``model`` whose every expert's NVFP4 global scale is a power of two.

    Then each dequantized weight ``code * block_scale * global_scale`` has at most 6 significant
    bits, so the XLA path's bf16 weights are exact, as the kernel's are: both backends multiply
    the same bf16 activations by the same weights, exactly, and accumulate in float32; they
    differ only in the order of the float32 sums.
    """
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    for p in _expert_params(model):
        w = jnp.clip(p.get_value(), -POW2_AMAX, POW2_AMAX)
        p.set_value(w.at[:, 0, 0].set(POW2_AMAX))  # each expert's amax
    return model


@pytest.fixture(scope="module")
def models():
    base = Transformer(CFG, nnx.Rngs(0))
    return {"generic": base, "pow2": pow2_global_scales(base)}


@pytest.fixture(scope="module")
def engines(models):
    """backend -> sampling -> engine (one compile each; weights swapped by update_params)."""
    samplings = {"sampled": SamplingConfig(), "greedy": SamplingConfig(temperature=0.0)}
    return {
        backend: {
            name: RolloutEngine(
                models["pow2"],
                POLICY,
                # the MoE kernel only: the attention kernel sums in another order (tested below)
                RolloutConfig(
                    max_len=16, max_new_tokens=NEW, sampling=s, backend=backend, kernels=("moe",)
                ),
            )
            for name, s in samplings.items()
        }
        for backend in ("xla", "pallas")
    }


def retrace_engines():
    """Drop the engines' traced and compiled steps, so that the next engine traces its own (the
    worker's other programs stay: jax.clear_caches() would make later tests compile them again)."""
    RolloutEngine._append.clear_cache()
    RolloutEngine._decode.clear_cache()


def _generate(engines, model, sampling, key):
    out = {}
    for backend in ("xla", "pallas"):
        eng = engines[backend][sampling]
        eng.update_params(model)
        out[backend] = eng.generate(PROMPTS, key)
    return out["xla"], out["pallas"]


def _logprobs(state):
    gen = np.asarray(state.generated)
    assert gen.sum() == NEW * len(PROMPTS)
    return np.asarray(state.logprobs)[gen]


def test_expert_weights_are_prepacked_once(engines, models, monkeypatch):
    eng = engines["pallas"]["sampled"]
    eng.update_params(models["pow2"])
    ref = engines["xla"]["sampled"]
    ref.update_params(models["pow2"])
    state, ref_state = nnx.merge(eng.graphdef, eng.state), nnx.merge(ref.graphdef, ref.state)
    for p, q in zip(_expert_params(state), _expert_params(ref_state), strict=True):
        w, qt = p.get_value(), q.get_value()
        assert isinstance(w, Fp4Weight) and isinstance(qt, fp4.QTensor)
        # the XLA engine's packed bytes, unchanged; one [E, K, N] weight along K
        np.testing.assert_array_equal(np.asarray(w.codes), np.asarray(qt.codes))
        assert w.shape == (CFG.num_experts, *qt.shape) and w.qtensor.axis == 1
    # nothing is packed while generating
    monkeypatch.setattr(layouts, "prepack_grouped", None)
    monkeypatch.setattr(layouts, "prepack_arrays", None)
    monkeypatch.setattr(gt, "prepack_grouped", None)
    eng.generate(PROMPTS, jax.random.key(0))
    # the training model keeps its float weights
    for p in _expert_params(models["pow2"]):
        assert isinstance(p.get_value(), jax.Array)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_pallas_matches_xla_with_exact_weights(engines, models, sampling):
    for seed in range(1):
        xla, pallas = _generate(engines, models["pow2"], sampling, jax.random.key(seed))
        np.testing.assert_array_equal(np.asarray(pallas.tokens), np.asarray(xla.tokens))
        np.testing.assert_array_equal(np.asarray(pallas.routes), np.asarray(xla.routes))
        # Same exact products, float32 sums in another order: a bf16 output can round the
        # other way only when its float32 sum lies within ~1e-7 relative of a rounding
        # boundary, and it did not here (the log-probs agree to float32 noise).
        np.testing.assert_allclose(_logprobs(pallas), _logprobs(xla), rtol=0, atol=1e-5)
        # and the TRACE guidance recorded at the activation and KV sites is the same
        assert sorted(pallas.guidance) == sorted(xla.guidance)
        for name, g in xla.guidance.items():
            jax.tree.map(np.testing.assert_array_equal, pallas.guidance[name], g)


def test_pallas_matches_xla_with_any_nvfp4_weights(engines, models):
    """Generic global scales: the XLA path rounds every weight ``code * s_b * s_g`` to bf16
    (relative error <= 2**-9); the kernel keeps ``code * s_b`` exact and applies ``s_g`` to the
    float32 sum. So expert outputs differ by about one bf16 ulp, and the bf16 forward (with its
    FP4 activation sites) carries that to the log-probs. Bound: the same size as the XLA engine's
    own deviation from a full forward of the same model (max ~2e-2 nats over these tokens, mean
    ~5e-3, with 4 layers; here measured max 1.4e-3, mean 6.9e-4), with tokens that are not near
    ties unchanged."""
    xla, pallas = _generate(engines, models["generic"], "sampled", jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(pallas.tokens), np.asarray(xla.tokens))
    diff = np.abs(_logprobs(pallas) - _logprobs(xla))
    assert diff.max() < 5e-2 and diff.mean() < 1e-2, (diff.max(), diff.mean())
    assert diff.max() > 0  # the kernel did run: the XLA path's bf16 weight rounding shows


def test_training_forward_is_unaffected(engines, models):
    """The engines copy the weights: the training model keeps its float expert weights, and its
    QAT forward (weight sites fake-quantizing the arrays, XLA ragged_dot) is unchanged."""
    model = models["generic"]
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]], jnp.int32)
    forward = jax.jit(lambda st: nnx.merge(graphdef, st)(tokens, policy=QuantPolicy.qat()).logits)
    before = forward(state)
    engines["pallas"]["greedy"].update_params(model)
    _, after_state = nnx.split(model)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(after_state), strict=True):
        assert isinstance(b, jax.Array)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(forward(after_state)), np.asarray(before))


@pytest.mark.slow
@pytest.mark.parametrize("kv, tol", [("bf16", 3e-3), ("nvfp4", 2.5e-2)])
def test_decode_with_both_kernels_equals_a_full_forward(models, kv, tol, monkeypatch):
    """backend="pallas" with the decode-attention (fused K/V append) and MoE kernels: every
    decoded token's log-prob equals a full forward's over the same sequence (the reference
    path) within the bound that holds for the XLA engine too (measured: max 1.4e-3 bf16 KV,
    1.4e-2 NVFP4; the bf16 forward with FP4 activation sites amplifies one-ulp differences)."""
    policy = QuantPolicy.bf16() if kv == "bf16" else QuantPolicy.rollout(kv)
    forward_policy = QuantPolicy.bf16() if kv == "bf16" else QuantPolicy.qat(kv)
    model = models["generic"]
    calls = []
    kernel = fp4_decode_attention.decode_attention_append

    def counted(*args, **kw):  # runs at trace time: the decode step uses the fused kernel
        calls.append(args[1])
        return kernel(*args, **kw)

    monkeypatch.setattr(fp4_decode_attention, "decode_attention_append", counted)
    retrace_engines()  # counted at trace time: no program of an engine built alike
    eng = RolloutEngine(
        model,
        policy,
        RolloutConfig(
            max_len=16,
            max_new_tokens=NEW,
            kv_cache=kv,
            backend="pallas",
            sampling=SamplingConfig(temperature=0.0),
        ),
    )
    state = eng.generate(PROMPTS, jax.random.key(0))
    mask = jnp.arange(16)[None] < state.lengths[:, None]
    logits = model(state.tokens, attention_mask=mask, policy=forward_policy).logits
    ref = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    ref = jnp.take_along_axis(ref, state.tokens[:, 1:, None], -1)[..., 0]
    gen = np.asarray(state.generated)[:, 1:]
    diff = np.abs(np.asarray(ref) - np.asarray(state.logprobs)[:, 1:])[gen]
    assert gen.sum() == NEW * len(PROMPTS) and diff.max() < tol, diff.max()
    assert len(calls) == CFG.num_layers  # one traced decode step, every layer
    stored = fp4.QTensor if kv != "bf16" else jax.Array
    assert all(isinstance(k, stored) for k in calls)


@pytest.mark.slow
def test_tensor_core_attention_decodes_as_the_triton_kernel(monkeypatch):
    """kernels=("attention_tc",) over an NVFP4 cache (4 KV heads of 64 dims, 64 slots:
    shapes the tensor-core kernel takes): the decode steps attend (and append K/V) with the
    Mosaic GPU kernel (its interpreter here) and generate what the engine with
    the Triton decode-attention kernel generates, log-probs within 1e-2 (measured 5.5e-3: the
    kernels differ in the precision of p and the order of the sums; against a full forward both
    engines differ by up to 1.1e-2 on this model, the XLA engine by 1.0e-2)."""
    from pallas_kernels import fp4_decode_attention_mgpu as tc

    calls = []
    kernel = tc.attend

    def counted(*args, **kw):  # runs when the decode step is traced
        calls.append(args[1])
        return kernel(*args, **kw)

    monkeypatch.setattr(tc, "attend", counted)
    retrace_engines()  # counted at trace time: no program of an engine built alike
    cfg = dataclasses.replace(CFG, num_heads=8, num_kv_heads=4, head_dim=64)
    model = Transformer(cfg, nnx.Rngs(1))
    states = {}
    for kernels in (("attention",), ("attention_tc",)):  # MoE layers in XLA: not compared
        eng = RolloutEngine(
            model,
            QuantPolicy.rollout("nvfp4"),
            RolloutConfig(
                max_len=64,
                max_new_tokens=3,
                kv_cache="nvfp4",
                backend="pallas",
                kernels=kernels,
                sampling=SamplingConfig(temperature=0.0),
            ),
        )
        states[kernels[0]] = eng.generate(PROMPTS, jax.random.key(0))
    triton, tensor_cores = states["attention"], states["attention_tc"]
    gen = np.asarray(triton.generated)
    assert gen.sum() == 3 * len(PROMPTS)
    np.testing.assert_array_equal(np.asarray(tensor_cores.tokens), np.asarray(triton.tokens))
    diff = np.abs(np.asarray(tensor_cores.logprobs) - np.asarray(triton.logprobs))[gen]
    assert diff.max() < 1e-2, diff.max()
    # traced once: the layers' calls share one trace of the jitted append + attention
    assert calls and all(isinstance(k, fp4.QTensor) for k in calls)


@pytest.mark.gpu
def test_gpu_tensor_core_moe_route_matches_xla(monkeypatch):
    """Expert dims that are multiples of 64: the pallas engine's MoE layers run the
    tensor-core kernel (``fp4_grouped_matmul_mgpu``) and generate what the XLA engine
    generates."""
    from pallas_kernels import fp4_matmul_mgpu as fmm

    cfg = dataclasses.replace(CFG, hidden_size=128, moe_intermediate_size=64)
    model = pow2_global_scales(Transformer(cfg, nnx.Rngs(1)))
    calls = []
    real = fmm.fp4_grouped_matmul_mgpu
    monkeypatch.setattr(
        fmm, "fp4_grouped_matmul_mgpu", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    retrace_engines()  # counted at trace time: no program of an engine built alike
    out = {}
    for backend in ("xla", "pallas"):
        rc = RolloutConfig(
            max_len=16,
            max_new_tokens=NEW,
            sampling=SamplingConfig(temperature=0.0),
            backend=backend,
            kernels=("moe",),
        )
        eng = RolloutEngine(model, POLICY, rc)
        eng.update_params(model)
        out[backend] = eng.generate(PROMPTS, jax.random.key(0))
        if backend == "pallas":
            packed = list(_expert_params(nnx.merge(eng.graphdef, eng.state)))
            assert packed and all(p.get_value().mgpu is not None for p in packed)
    assert calls, "the tensor-core kernel did not run"
    np.testing.assert_array_equal(np.asarray(out["pallas"].tokens), np.asarray(out["xla"].tokens))
    np.testing.assert_allclose(_logprobs(out["pallas"]), _logprobs(out["xla"]), rtol=0, atol=1e-5)
