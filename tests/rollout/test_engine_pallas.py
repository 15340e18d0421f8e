"""Rollout engine with backend="pallas" (grouped FP4 kernel for the routed experts, in the Pallas
interpreter on the CPU) against backend="xla" (dequantize + ``ragged_dot``).

The kernel is W4A16, so the model computes in bf16 here (tests/shapes.py's ``MODEL_BF16``, the
tiny preset with 1 layer and dtype bf16; with a float32 compute dtype the MoE layers fall back to
the XLA path: tests/model/test_layers.py).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from shapes import MODEL_BF16, PROMPTS, ROLLOUT, rollout_config

from pallas_kernels import fp4_decode_attention, layouts
from pallas_kernels import fp4_grouped_matmul_triton as gt
from pallas_kernels.layouts import Fp4Weight
from trace_jax import fp4
from trace_jax.fp4.formats import E2M1_MAX, E4M3_MAX
from trace_jax.model import QuantPolicy, Transformer
from trace_jax.rollout import RolloutConfig, RolloutEngine, SamplingConfig

# 1 layer: compiling the decode programs (Pallas interpreter inside) dominates, and it is per layer
CFG = MODEL_BF16
NEW = ROLLOUT.max_new_tokens
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
    """backend -> sampling -> engine (one compile per backend: greedy is the runtime flag, on
    the sampling engine's programs; weights swapped by update_params)."""
    return {
        backend: {
            name: RolloutEngine(
                models["pow2"],
                POLICY,
                # the MoE kernel only: the attention kernel sums in another order (tested below)
                rollout_config(backend=backend, kernels=("moe",)),
                greedy=name == "greedy",
            )
            for name in ("sampled", "greedy")
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
    ~5e-3, with 4 layers; here, with 1 layer, measured max 7.0e-4, mean 1.7e-4), with tokens that
    are not near ties unchanged."""
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


def _count_calls(monkeypatch, module, name: str) -> list:
    """Replace ``module.name`` by a wrapper that records the stored K of each call (its second
    argument); the calls are made while a decode step is traced."""
    calls, fn = [], getattr(module, name)

    def counted(*args, **kw):
        calls.append(args[1])
        return fn(*args, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def _greedy_pallas_engine(model, policy, kv, max_len, new, kernels=("moe", "attention")):
    return RolloutEngine(
        model,
        policy,
        RolloutConfig(
            max_len=max_len,
            max_new_tokens=new,
            kv_cache=kv,
            backend="pallas",
            kernels=kernels,
            sampling=SamplingConfig(temperature=0.0),
        ),
    )


@functools.partial(nnx.jit, static_argnames="policy")
def _full_forward_logits(model, tokens, lengths, policy):
    """Logits [B, S, V] of a full forward over each sequence's first ``lengths`` tokens (one
    program: eager, the forward compiles op by op, longer)."""
    mask = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
    return model(tokens, attention_mask=mask, policy=policy).logits


def _assert_matches_a_full_forward(model, state, policy, new: int, tol: float):
    """Every decoded token's log-prob is a full forward's over the same sequence (``policy``:
    the reference path), within ``tol``."""
    logits = _full_forward_logits(model, state.tokens, state.lengths, policy)
    ref = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    ref = jnp.take_along_axis(ref, state.tokens[:, 1:, None], -1)[..., 0]
    gen = np.asarray(state.generated)[:, 1:]
    diff = np.abs(np.asarray(ref) - np.asarray(state.logprobs)[:, 1:])[gen]
    assert gen.sum() == new * len(PROMPTS) and diff.max() < tol, diff.max()


@pytest.mark.slow
def test_decode_with_both_kernels_equals_a_full_forward(models, monkeypatch):
    """backend="pallas" with the decode-attention (fused K/V append) and MoE kernels over a
    bf16 cache: every decoded token's log-prob equals a full forward's over the same sequence
    (the reference path) within the bound that holds for the XLA engine too (measured: max
    1.9e-3). An NVFP4 cache: test_tensor_core_attention_decodes_as_the_triton_kernel."""
    calls = _count_calls(monkeypatch, fp4_decode_attention, "decode_attention_append")
    retrace_engines()  # counted at trace time: no program of an engine built alike
    model = models["generic"]
    eng = _greedy_pallas_engine(model, QuantPolicy.bf16(), "bf16", ROLLOUT.max_len, NEW)
    state = eng.generate(PROMPTS, jax.random.key(0))
    _assert_matches_a_full_forward(model, state, QuantPolicy.bf16(), NEW, 3e-3)
    assert len(calls) == CFG.num_layers  # one traced decode step, every layer
    assert all(isinstance(k, jax.Array) for k in calls)


@pytest.mark.slow
def test_tensor_core_attention_decodes_as_the_triton_kernel(monkeypatch):
    """An NVFP4 cache of 4 KV heads of 64 dims and 64 slots (shapes the tensor-core kernel
    takes; the MoE layers in XLA). kernels=("attention",): the decode steps attend with the
    Triton decode-attention kernel (the K/V append fused into its launch), every decoded token's
    log-prob a full forward's over the same sequence within the bound that holds for the XLA
    engine too (2.5e-2; measured 1.5e-3; the bf16 forward with FP4 activation sites amplifies
    one-ulp differences). kernels=("attention_tc",): they attend
    (and append K/V) with the Mosaic GPU kernel (its interpreter here) and generate what the
    Triton kernel's engine generates, log-probs within 1e-2 (measured 1.6e-3: the kernels
    differ in the precision of p and the order of the sums). The MoE kernel with an NVFP4
    policy: the engines fixture's tests; with the attention kernel: the bf16 cache's test."""
    from pallas_kernels import fp4_decode_attention_mgpu as tc

    calls = _count_calls(monkeypatch, fp4_decode_attention, "decode_attention_append")
    tc_calls = _count_calls(monkeypatch, tc, "attend")
    retrace_engines()  # counted at trace time: no program of an engine built alike
    cfg = dataclasses.replace(CFG, num_heads=8, num_kv_heads=4, head_dim=64)
    model = Transformer(cfg, nnx.Rngs(1))
    policy = QuantPolicy.rollout("nvfp4")
    states = {}
    for kernels in (("attention",), ("attention_tc",)):
        eng = _greedy_pallas_engine(model, policy, "nvfp4", 64, 3, kernels)
        states[kernels[0]] = eng.generate(PROMPTS, jax.random.key(0))
        if kernels == ("attention",):
            assert len(calls) == cfg.num_layers and not tc_calls  # one traced step, every layer
            assert all(isinstance(k, fp4.QTensor) for k in calls)
    triton, tensor_cores = states["attention"], states["attention_tc"]
    _assert_matches_a_full_forward(model, triton, QuantPolicy.qat("nvfp4"), 3, 2.5e-2)
    gen = np.asarray(triton.generated)
    np.testing.assert_array_equal(np.asarray(tensor_cores.tokens), np.asarray(triton.tokens))
    diff = np.abs(np.asarray(tensor_cores.logprobs) - np.asarray(triton.logprobs))[gen]
    assert diff.max() < 1e-2, diff.max()
    # traced once: the layers' calls share one trace of the jitted append + attention
    assert tc_calls and all(isinstance(k, fp4.QTensor) for k in tc_calls)


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
