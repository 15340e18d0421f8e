"""Hugging Face import/export: logits parity with transformers, bit-exact round trips, errors.

The parity tests (``reference`` marker) build tiny random Qwen3-MoE / Qwen2-MoE models with
transformers in the reference environment (``hf_reference.py``, one subprocess for all cases),
load the saved checkpoints here and compare logits and routed experts; transformers also loads
checkpoints exported from here. The remaining tests need no reference environment.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from flax import nnx

from trace_jax.config import ConfigError
from trace_jax.model import ModelConfig, Transformer
from trace_jax.model.hf import (
    SAFE_INDEX,
    SAFE_WEIGHTS,
    CheckpointError,
    hf_config,
    load_hf_checkpoint,
    read_hf_params,
    save_hf_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]
REFERENCE_SCRIPT = Path(__file__).with_name("hf_reference.py")
VOCAB = 128
# One batch of several sequences, as long as the longest case needs: each model compiles one
# forward (a second, shorter batch added a program per model and no path this one misses).
BATCHES = ((3, 64),)

# Float32 on both sides; the two implementations differ only in summation order (matmul
# blocking, softmax and RMSNorm reductions over at most a few hundred terms), i.e. a few float32
# ulps (2^-24 ~ 6e-8 relative) per op. Through 3-4 residual layers of O(1) activations that is
# ~1e-6 of the logit scale (these cases: 3e-7 to 1.5e-6); 1e-5 of the largest |logit| leaves
# headroom for other BLAS builds and is five orders of magnitude below what one mis-mapped tensor
# or a flipped expert produces (O(1) of the scale).
REL_TOL = 1e-5

QWEN3 = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # != hidden / heads: catches a q/o orientation mix-up
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
)
QWEN3_TIED_DENSE = dict(
    QWEN3,
    num_hidden_layers=4,
    num_experts=6,
    num_experts_per_tok=3,
    norm_topk_prob=False,
    decoder_sparse_step=2,  # MoE on layers 1 and 3 ...
    mlp_only_layers=[3],  # ... but 3 is dense: only layer 1 is MoE
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)
QWEN2 = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    norm_topk_prob=False,
    mlp_only_layers=[0],
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
)
# Built here, randomized, exported, and loaded by transformers.
JAX_QWEN3 = ModelConfig(
    vocab_size=VOCAB,
    hidden_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=96,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    mlp_only_layers=(1,),
    rope_theta=10_000.0,
)
JAX_QWEN2 = JAX_QWEN3.replace(
    head_dim=12,
    num_experts=6,
    mlp_only_layers=(),
    decoder_sparse_step=2,
    qk_norm=False,
    attention_bias=True,
    shared_expert_intermediate_size=40,
    norm_topk_prob=False,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


def token_batches() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, size=shape, dtype=np.int32) for shape in BATCHES]


def randomized(cfg: ModelConfig, seed: int) -> Transformer:
    """A model with every parameter random (norm weights around 1, nonzero biases)."""
    rng = np.random.default_rng(seed)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    values = []
    for path, var in nnx.to_flat_state(params):
        shape, name = var.shape, path[-1]
        x = rng.standard_normal(shape, dtype=np.float32)
        if name == "weight":  # RMSNorm
            x = 1.0 + 0.2 * x
        elif name.endswith("_bias"):
            x = 0.5 * x
        elif name == "router":
            x = x * 4.0 / np.sqrt(shape[0])
        elif name in ("q_proj", "k_proj", "v_proj"):
            x = x / np.sqrt(shape[0])
        elif name == "o_proj":
            x = x / np.sqrt(shape[0] * shape[1])
        elif name != "embed_tokens":
            x = x / np.sqrt(shape[-2])  # [in, out] and [E, in, out]
        values.append((path, var.replace(jnp.asarray(x, var.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(values), rest)


def float32(cfg: ModelConfig) -> ModelConfig:
    return cfg.replace(param_dtype="float32", dtype="float32")


@nnx.jit
def _logits_and_routes(model: Transformer, tokens: jax.Array):
    out = model(tokens)
    return out.logits, out.routes


def forward(model: Transformer, tokens: np.ndarray):
    logits, routes = _logits_and_routes(model, jnp.asarray(tokens))
    return np.asarray(logits), None if routes is None else np.asarray(routes)


def assert_logits_close(ours: np.ndarray, want: np.ndarray) -> float:
    """max |ours - want| / max(1, max |want|) <= REL_TOL; returns that ratio."""
    assert ours.shape == want.shape
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(ours.astype(np.float64) - want).max()) / scale
    assert err <= REL_TOL, f"max |logit diff| / scale = {err:.3g} > {REL_TOL} (scale {scale:.3g})"
    return err


def tensors_of(folder: Path) -> dict[str, np.ndarray]:
    index = folder / SAFE_INDEX
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else [SAFE_WEIGHTS]
    )
    out = {}
    for name in files:
        out.update(safetensors.numpy.load_file(folder / name))
    return out


def assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = tensors_of(a), tensors_of(b)
    assert sorted(ta) == sorted(tb)
    for name, x in ta.items():
        y = tb[name]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert x.tobytes() == y.tobytes(), f"{name} differs"


def assert_same_params(a: Transformer, b: Transformer) -> None:
    fa = dict(nnx.to_flat_state(nnx.state(a, nnx.Param)))
    fb = dict(nnx.to_flat_state(nnx.state(b, nnx.Param)))
    assert fa.keys() == fb.keys()
    for path, var in fa.items():
        x, y = np.asarray(var.get_value()), np.asarray(fb[path].get_value())
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert x.tobytes() == y.tobytes(), f"{path} differs"


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def jax_exports(tmp_path_factory):
    """Randomized models built here and exported: {name: (cfg, model, folder)}."""
    root = tmp_path_factory.mktemp("jax_exports")
    out = {}
    for name, cfg, seed, shard in (
        ("jax_qwen3", JAX_QWEN3, 1, 60_000),
        ("jax_qwen2", JAX_QWEN2, 2, None),
    ):
        model = randomized(cfg, seed)
        kwargs = {} if shard is None else {"max_shard_bytes": shard}
        save_hf_checkpoint(model, cfg, root / name, **kwargs)
        out[name] = (cfg, model, root / name)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, jax_exports, ref_python):
    """Runs ``hf_reference.py`` once: builds and saves the transformers cases, runs them, and
    loads the checkpoints exported here. Returns (root, npz arrays, json report)."""
    python = ref_python
    root = tmp_path_factory.mktemp("hf_reference")
    np.savez(root / "tokens.npz", **{f"b{i}": t for i, t in enumerate(token_batches())})

    def case(name, model_type, config, seed, saves, dtype="float32"):
        saves = [{"dir": str(root / d), **extra} for d, extra in saves]
        return dict(
            name=name, model_type=model_type, config=config, seed=seed, saves=saves, dtype=dtype
        )

    spec = {
        "out": str(root),
        "tokens": str(root / "tokens.npz"),
        "build": [
            case(
                "qwen3",
                "qwen3_moe",
                QWEN3,
                0,
                [
                    ("qwen3", {}),
                    ("qwen3_sharded", {"max_shard_size": "40KB"}),
                    ("qwen3_fused", {"original_format": False}),
                ],
            ),
            case("qwen3_tied_dense", "qwen3_moe", QWEN3_TIED_DENSE, 1, [("qwen3_tied_dense", {})]),
            case("qwen2", "qwen2_moe", QWEN2, 2, [("qwen2", {"max_shard_size": "60KB"})]),
            case("qwen3_bf16", "qwen3_moe", QWEN3, 3, [("qwen3_bf16", {})], dtype="bfloat16"),
        ],
        "load": [
            {"name": name, "dir": str(folder)} for name, (_, _, folder) in jax_exports.items()
        ],
    }
    (root / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [python, str(REFERENCE_SCRIPT), str(root / "spec.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"hf_reference.py failed:\n{proc.stderr[-4000:]}"
    with np.load(root / "reference.npz") as f:
        arrays = dict(f)
    return root, arrays, json.loads((root / "reference.json").read_text())


# ----------------------------------------------------------------------------- parity


@pytest.mark.reference
@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied_dense", "qwen2", "qwen3_bf16"])
def test_logits_and_routes_match_transformers(reference, name):
    root, arrays, _ = reference
    cfg = float32(ModelConfig.from_hf(root / name))
    _, model = load_hf_checkpoint(root / name, cfg)
    for i, tokens in enumerate(token_batches()):
        logits, routes = forward(model, tokens)
        err = assert_logits_close(logits, arrays[f"{name}/logits/{i}"])
        print(f"{name} batch {i}: max |logit diff| / scale = {err:.2e}")
        np.testing.assert_array_equal(routes, arrays[f"{name}/routes/{i}"])


@pytest.mark.reference
@pytest.mark.parametrize("name", ["jax_qwen3", "jax_qwen2"])
def test_exported_checkpoints_load_in_transformers_with_the_same_logits(
    reference, jax_exports, name
):
    _, arrays, report = reference
    cfg, model, _ = jax_exports[name]
    loading = report[name]["loading"]
    assert loading["missing_keys"] == [] and loading["unexpected_keys"] == [], loading
    assert loading["mismatched_keys"] == [] and loading["error_msgs"] == [], loading
    seen = report[name]["config"]
    assert seen["num_experts"] == cfg.num_experts
    assert seen["rope_theta"] == cfg.rope_theta and seen["rope_type"] == "default"
    assert seen["mlp_only_layers"] == list(cfg.mlp_only_layers)
    assert seen["decoder_sparse_step"] == cfg.decoder_sparse_step
    assert seen["tie_word_embeddings"] == cfg.tie_word_embeddings
    assert seen["norm_topk_prob"] == cfg.norm_topk_prob
    for i, tokens in enumerate(token_batches()):
        logits, routes = forward(model, tokens)
        err = assert_logits_close(logits, arrays[f"{name}/logits/{i}"])
        print(f"{name} batch {i}: max |logit diff| / scale = {err:.2e}")
        np.testing.assert_array_equal(routes, arrays[f"{name}/routes/{i}"])


@pytest.mark.reference
def test_from_hf_reads_the_configs_transformers_writes(reference):
    root, _, report = reference
    assert "num_local_experts" in json.loads((root / "qwen3" / "config.json").read_text())
    want_qwen3 = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        qk_norm=True,
        attention_bias=False,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
    )
    assert ModelConfig.from_hf(root / "qwen3") == want_qwen3
    tied = ModelConfig.from_hf(root / "qwen3_tied_dense")
    assert tied == want_qwen3.replace(
        num_layers=4,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        mlp_only_layers=(3,),
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )
    assert tied.moe_layers == (1,)
    qwen2 = ModelConfig.from_hf(root / "qwen2")
    assert qwen2 == want_qwen3.replace(
        head_dim=12,
        num_experts=6,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        norm_topk_prob=False,
        mlp_only_layers=(0,),
        qk_norm=False,
        attention_bias=True,
    )
    assert report["qwen2"]["config"]["qkv_bias"] is True


@pytest.mark.reference
def test_sharded_and_fused_checkpoints_load_the_same_parameters(reference):
    root, _, _ = reference
    index = json.loads((root / "qwen3_sharded" / SAFE_INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 2
    fused = tensors_of(root / "qwen3_fused")
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    assert not any(".experts.0." in k for k in fused)
    cfg = float32(ModelConfig.from_hf(root / "qwen3"))
    _, single = load_hf_checkpoint(root / "qwen3", cfg)
    for variant in ("qwen3_sharded", "qwen3_fused"):
        _, other = load_hf_checkpoint(root / variant, cfg)
        assert_same_params(single, other)


@pytest.mark.reference
@pytest.mark.parametrize("name", ["qwen3", "qwen3_sharded", "qwen3_tied_dense", "qwen2"])
def test_round_trip_reproduces_the_transformers_files_bit_exactly(reference, tmp_path, name):
    root, _, _ = reference
    cfg = float32(ModelConfig.from_hf(root / name))
    _, model = load_hf_checkpoint(root / name, cfg)
    save_hf_checkpoint(model, cfg, tmp_path / "single")
    save_hf_checkpoint(
        nnx.state(model, nnx.Param), cfg, tmp_path / "sharded", max_shard_bytes=50_000
    )
    assert (tmp_path / "sharded" / SAFE_INDEX).is_file()
    for out in ("single", "sharded"):
        assert_same_tensors(root / name, tmp_path / out)
        assert ModelConfig.from_hf(tmp_path / out) == cfg
        _, again = load_hf_checkpoint(tmp_path / out, cfg)
        assert_same_params(model, again)


@pytest.mark.reference
def test_bf16_checkpoint_round_trips_through_bf16_and_float32_params(reference, tmp_path):
    root, _, _ = reference
    folder = root / "qwen3_bf16"
    assert tensors_of(folder)["model.norm.weight"].dtype == ml_dtypes.bfloat16
    cfg, model = load_hf_checkpoint(folder)  # dtype from config.json
    assert (cfg.param_dtype, cfg.dtype) == ("bfloat16", "bfloat16")
    assert model.embed_tokens.get_value().dtype == jnp.bfloat16
    save_hf_checkpoint(model, cfg, tmp_path / "bf16")
    assert_same_tensors(folder, tmp_path / "bf16")
    cfg32, model32 = load_hf_checkpoint(folder, dtype="float32")
    assert model32.embed_tokens.get_value().dtype == jnp.float32
    save_hf_checkpoint(model32, cfg32, tmp_path / "from_f32", dtype="bfloat16")
    assert_same_tensors(folder, tmp_path / "from_f32")
    assert json.loads((tmp_path / "from_f32" / "config.json").read_text())["dtype"] == "bfloat16"


# ----------------------------------------------------------------------------- no reference


def test_export_round_trip_is_bit_exact(jax_exports, tmp_path):
    for cfg, model, folder in jax_exports.values():
        _, loaded = load_hf_checkpoint(folder, cfg)
        assert_same_params(model, loaded)
        save_hf_checkpoint(loaded, cfg, tmp_path / folder.name)
        assert_same_tensors(folder, tmp_path / folder.name)
    assert (jax_exports["jax_qwen3"][2] / SAFE_INDEX).is_file()


def test_hf_config_round_trips_through_from_hf():
    for cfg in (JAX_QWEN3, JAX_QWEN2, ModelConfig.preset("qwen3-30b-a3b")):
        assert (
            ModelConfig.from_hf(hf_config(cfg), param_dtype=cfg.param_dtype, dtype=cfg.dtype) == cfg
        )
    base = {"max_position_embeddings": 40960, "eos_token_id": 7, "num_local_experts": 999}
    config = hf_config(JAX_QWEN3, base)
    assert config["max_position_embeddings"] == 40960 and config["eos_token_id"] == 7
    assert "num_local_experts" not in config and config["num_experts"] == JAX_QWEN3.num_experts
    with pytest.raises(ConfigError, match="shared expert"):
        hf_config(JAX_QWEN2.replace(shared_expert_intermediate_size=0))


def test_from_hf_follows_transformers_defaults_and_rejects_unsupported_rope():
    minimal = {
        "model_type": "qwen2_moe",
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    }
    cfg = ModelConfig.from_hf(minimal)
    assert cfg.attention_bias and not cfg.norm_topk_prob and not cfg.qk_norm
    assert cfg.shared_expert_intermediate_size == 5632 and cfg.num_kv_heads == 4
    assert cfg.rope_theta == 10_000.0 and cfg.head_dim == 8
    assert not ModelConfig.from_hf({**minimal, "qkv_bias": False}).attention_bias
    qwen3 = {**minimal, "model_type": "qwen3_moe", "rope_theta": 1e6}
    assert not ModelConfig.from_hf(qwen3).norm_topk_prob
    assert ModelConfig.from_hf(qwen3).rope_theta == 1e6
    both = {**qwen3, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert ModelConfig.from_hf(both).rope_theta == 5e5
    with pytest.raises(ConfigError, match="rope_type"):
        ModelConfig.from_hf({**qwen3, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="hidden_act"):
        ModelConfig.from_hf({**qwen3, "hidden_act": "gelu"})


def rewrite(src: Path, dst: Path, edit) -> None:
    """Copy the single-file checkpoint ``src`` to ``dst`` with ``edit(tensors)`` applied."""
    shutil.copytree(src, dst)
    tensors = edit(safetensors.numpy.load_file(dst / SAFE_WEIGHTS))
    safetensors.numpy.save_file(tensors, dst / SAFE_WEIGHTS, metadata={"format": "pt"})


def test_missing_mis_shaped_and_unexpected_tensors_are_named(jax_exports, tmp_path):
    cfg, _, folder = jax_exports["jax_qwen2"]
    name = "model.layers.1.mlp.experts.3.up_proj.weight"

    rewrite(folder, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError) as err:
        read_hf_params(tmp_path / "missing", cfg)
    assert name in str(err.value) and "[32, 48]" in str(err.value) and "missing" in str(err.value)
    assert str(tmp_path / "missing") in str(err.value)

    def reshape(t):
        t[name] = np.zeros((48, 32), t[name].dtype)
        return t

    rewrite(folder, tmp_path / "shape", reshape)
    with pytest.raises(CheckpointError) as err:
        read_hf_params(tmp_path / "shape", cfg)
    message = str(err.value)
    assert name in message and "[48, 32]" in message and "[32, 48]" in message
    assert str(tmp_path / "shape" / SAFE_WEIGHTS) in message

    extra = "model.layers.0.mlp.experts.9.up_proj.weight"
    rewrite(folder, tmp_path / "extra", lambda t: {**t, extra: np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match=extra.replace(".", r"\.")):
        read_hf_params(tmp_path / "extra", cfg)

    # Rotary buffers of older checkpoints are ignored; a tied lm_head copy must equal the embedding.
    def harmless(t):
        return {
            **t,
            "model.rotary_emb.inv_freq": np.ones(6, np.float32),
            "lm_head.weight": t["model.embed_tokens.weight"],
        }

    rewrite(folder, tmp_path / "harmless", harmless)
    read_hf_params(tmp_path / "harmless", cfg)

    def untied(t):
        return {**t, "lm_head.weight": t["model.embed_tokens.weight"] + 1}

    rewrite(folder, tmp_path / "untied", untied)
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        read_hf_params(tmp_path / "untied", cfg)


def test_sharded_index_pointing_at_the_wrong_file_is_an_error(jax_exports, tmp_path):
    _, _, folder = jax_exports["jax_qwen3"]
    shutil.copytree(folder, tmp_path / "bad")
    index = json.loads((tmp_path / "bad" / SAFE_INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = next(
        f for f in files if f != index["weight_map"]["model.norm.weight"]
    )
    (tmp_path / "bad" / SAFE_INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        read_hf_params(tmp_path / "bad", JAX_QWEN3)
    with pytest.raises(FileExistsError):
        save_hf_checkpoint(jax_exports["jax_qwen3"][1], JAX_QWEN3, folder)


def test_loading_onto_a_mesh_places_experts_by_their_logical_axes(jax_exports):
    from trace_jax.model.sharding import make_mesh

    cfg, model, folder = jax_exports["jax_qwen3"]
    mesh = make_mesh(1, 1)
    state = read_hf_params(folder, cfg, mesh=mesh)
    gate = state["layers"][0]["mlp"]["gate_proj"].get_value()
    assert gate.sharding.mesh == mesh and gate.sharding.spec[0] == "expert"
    np.testing.assert_array_equal(
        np.asarray(gate), np.asarray(model.layers[0].mlp.gate_proj.get_value())
    )


def test_unreadable_checkpoints_and_configs_are_named(jax_exports, tmp_path):
    # A truncated safetensors file, a config.json that is not JSON, lacks a key or is not an
    # object, and a missing folder: each a CheckpointError naming the file (and the key).
    _, _, folder = jax_exports["jax_qwen2"]
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    data = (folder / SAFE_WEIGHTS).read_bytes()
    (bad / SAFE_WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{bad / SAFE_WEIGHTS}: not a readable safetensors"):
        load_hf_checkpoint(bad)
    (bad / SAFE_WEIGHTS).write_bytes(data)
    good = json.loads((folder / "config.json").read_text())
    for text, match in [
        ("{bad", r"config\.json: not valid JSON"),
        (json.dumps({k: v for k, v in good.items() if k != "hidden_size"}), "key 'hidden_size'"),
        ("[1]", r"config\.json: expected a JSON object, got list"),
        (json.dumps({**good, "model_type": "llama"}), r"config\.json: model_type: 'llama'"),
    ]:
        (bad / "config.json").write_text(text)
        with pytest.raises(CheckpointError, match=match) as err:
            load_hf_checkpoint(bad)
        assert str(bad / "config.json") in str(err.value)
    with pytest.raises(FileNotFoundError, match=r"checkpoint folder .*nowhere does not exist"):
        load_hf_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"nowhere does not exist"):
        read_hf_params(tmp_path / "nowhere", JAX_QWEN2)
