"""FP4 export in the compressed-tensors layout: the rollout's own codes and scales go out and come
back bit for bit, the config names every unquantized Linear, and (``reference``) the
compressed-tensors library decompresses the files to trace-jax's dequantized weights, bit for bit.
"""

import functools
import json
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from trace_jax import fp4
from trace_jax.fp4.quantize import block_scale_values
from trace_jax.model import CheckpointError, ModelConfig, QuantPolicy, Transformer, export, hf
from trace_jax.model import compressed as ct
from trace_jax.rollout import RolloutConfig, RolloutEngine, load
from trace_jax.rollout.engine import pack_expert_weight

# tests/rollout/test_load.py's model and engine shapes (their compiled programs are reused)
CFG = ModelConfig.preset("tiny").replace(num_layers=2)
NVFP4, MXFP4 = QuantPolicy.rollout("nvfp4"), QuantPolicy.rollout("mxfp4")
ROLLOUT = RolloutConfig(max_len=24, max_new_tokens=8, kv_cache="nvfp4")
EXPERTS = [("layers", l, "mlp", n) for l in CFG.moe_layers for n in export.EXPERT_WEIGHTS]
REPO = Path(__file__).resolve().parents[2]


def as_bytes(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def assert_same_qtensor(a: fp4.QTensor, b: fp4.QTensor):
    assert (a.fmt, a.shape, a.axis) == (b.fmt, b.shape, b.axis)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.dtype(x.dtype) == np.dtype(y.dtype) and x.shape == y.shape
        np.testing.assert_array_equal(as_bytes(x), as_bytes(y))


def flat(model) -> dict:
    return {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def stored(folder: Path) -> dict[str, np.ndarray]:
    file = folder / "model.safetensors"
    with safetensors.safe_open(file, framework="numpy") as f:
        names = list(f.keys())
    return {n: ct.read_raw(file, n) for n in names}


@pytest.fixture(scope="module")
def policy_model():
    """A policy, the engine's rollout form of its experts (the refit), and its exports: NVFP4;
    NVFP4 with the first MoE layer in BF16 and gate/up sharing a global scale; MXFP4."""
    model = Transformer(CFG, nnx.Rngs(0))
    engine = RolloutEngine(model, NVFP4, ROLLOUT)
    rollout = {p: v.get_value() for p, v in nnx.to_flat_state(engine.state) if p in EXPERTS}
    return model, flat(model), rollout


@pytest.fixture(scope="module")
def folders(policy_model, tmp_path_factory):
    _, params, _ = policy_model
    root = tmp_path_factory.mktemp("export")

    def write(name, policy, **options):
        pack = functools.partial(pack_expert_weight, policy=policy)
        out = export.quantize_experts(params, CFG, pack, **options)
        export.save_fp4_checkpoint(out, CFG, root / name)
        return root / name

    return {
        "nvfp4": write("nvfp4", NVFP4),
        "options": write("options", NVFP4, keep=frozenset({0}), shared_gate_up_scale=True),
        "mxfp4": write("mxfp4", MXFP4),
    }


def test_the_rollout_form_comes_back_bit_for_bit(policy_model, folders):
    _, params, rollout = policy_model
    _, back = load.load_rollout_model(folders["nvfp4"], NVFP4, ROLLOUT)
    back = flat(back)
    for p in EXPERTS:
        assert_same_qtensor(back[p], rollout[p])
    for p, v in params.items():  # the rest is BF16
        if p not in EXPERTS:
            np.testing.assert_array_equal(as_bytes(back[p]), as_bytes(jnp.asarray(v, jnp.bfloat16)))


def test_the_files_hold_the_rollouts_codes_scales_and_reciprocal_global_scales(
    policy_model, folders
):
    _, _, rollout = policy_model
    tensors = stored(folders["nvfp4"])
    record = json.loads((folders["nvfp4"] / ct.EXPORT_RECORD).read_text())["global_scales"]
    exact = 0
    for _, layer, _, name in EXPERTS:
        qt = rollout[("layers", layer, "mlp", name)]
        for e in range(CFG.num_experts):
            m = f"model.layers.{layer}.mlp.experts.{e}.{name}"
            np.testing.assert_array_equal(tensors[f"{m}.weight_packed"], np.asarray(qt.codes[e]))
            assert tensors[f"{m}.weight_scale"].dtype == ml_dtypes.float8_e4m3fn
            np.testing.assert_array_equal(
                as_bytes(tensors[f"{m}.weight_scale"]), as_bytes(qt.block_scales[e])
            )
            s_g = np.float32(qt.global_scale[e])
            (gs,) = tensors[f"{m}.weight_global_scale"]
            # compressed-tensors' convention: the stored scale is the reciprocal of ours; where
            # no float32 has s_g as its reciprocal, the record keeps s_g's bits
            assert abs(gs * s_g - 1) < 2**-22
            if np.float32(1) / gs == s_g:
                exact += 1
                assert m not in record
            else:
                assert record[m] == ct.to_bits(s_g)
    assert 0 < exact < len(EXPERTS) * CFG.num_experts  # both cases occur in this model


def test_the_config_ignores_exactly_the_unquantized_linears(folders):
    plain = stored(folders["nvfp4"]).items()
    linears = {n.removesuffix(".weight") for n, t in plain if n.endswith(".weight") and t.ndim == 2}
    linears -= {"model.embed_tokens"}
    for name, bf16_experts in (("nvfp4", set()), ("options", {0})):
        config = json.loads((folders[name] / "config.json").read_text())
        qc = config["quantization_config"]
        assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "nvfp4-pack-quantized")
        weights = qc["config_groups"]["group_0"]["weights"]
        assert (weights["num_bits"], weights["type"], weights["strategy"]) == (
            4,
            "float",
            "tensor_group",
        )
        assert weights["group_size"] == 16 and qc["config_groups"]["group_0"]["targets"] == [
            "Linear"
        ]
        packed = {n.removesuffix(".weight_packed") for n in stored(folders[name]) if "packed" in n}
        experts = {
            f"model.layers.{l}.mlp.experts.{e}.{w}"
            for l in CFG.moe_layers
            for e in range(CFG.num_experts)
            for w in export.EXPERT_WEIGHTS
        }
        kept = {m for m in experts if int(m.split(".")[2]) in bf16_experts}
        assert packed == experts - kept
        assert set(qc["ignore"]) == (linears - experts) | kept


def test_kept_layers_stay_bf16_and_gate_up_share_the_larger_global_scale(policy_model, folders):
    _, params, rollout = policy_model
    back = dict(hf.iter_hf_params(folders["options"], CFG, packed="nvfp4"))
    for name in export.EXPERT_WEIGHTS:  # layer 0 kept: its BF16 weights
        p = ("layers", 0, "mlp", name)
        np.testing.assert_array_equal(
            as_bytes(jnp.asarray(back[p], jnp.bfloat16)),
            as_bytes(jnp.asarray(params[p], jnp.bfloat16)),
        )
    gate, up = (back[("layers", 1, "mlp", n)] for n in ("gate_proj", "up_proj"))
    own = {n: rollout[("layers", 1, "mlp", n)] for n in ("gate_proj", "up_proj")}
    # amax of [gate | up] is the larger amax: one global scale, the larger of the two own ones
    larger = np.maximum(own["gate_proj"].global_scale, own["up_proj"].global_scale)
    np.testing.assert_array_equal(gate.global_scale, larger)
    np.testing.assert_array_equal(up.global_scale, larger)
    for e in range(CFG.num_experts):  # the weight whose scale it is keeps its rollout codes
        name = (
            "gate_proj"
            if own["gate_proj"].global_scale[e] >= own["up_proj"].global_scale[e]
            else "up_proj"
        )
        mine = gate if name == "gate_proj" else up
        np.testing.assert_array_equal(np.asarray(mine.codes[e]), np.asarray(own[name].codes[e]))
    assert_same_qtensor(
        back[("layers", 1, "mlp", "down_proj")], rollout[("layers", 1, "mlp", "down_proj")]
    )


def test_mxfp4_export_stores_e8m0_scales_and_comes_back(policy_model, folders):
    _, params, _ = policy_model
    tensors = stored(folders["mxfp4"])
    assert not any(n.endswith("weight_global_scale") for n in tensors)
    qc = json.loads((folders["mxfp4"] / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    back = dict(hf.iter_hf_params(folders["mxfp4"], CFG, packed="mxfp4"))
    for p in EXPERTS:
        assert_same_qtensor(back[p], jax.device_get(pack_expert_weight(params[p], MXFP4)))


def test_dequantized_load_requantizes_to_the_same_codes_and_block_scales(policy_model, folders):
    _, _, rollout = policy_model
    _, model = hf.load_hf_checkpoint(folders["nvfp4"], dtype="float32")
    params = flat(model)
    for p in EXPERTS:
        again, own = pack_expert_weight(params[p], NVFP4), rollout[p]
        np.testing.assert_array_equal(np.asarray(again.codes), np.asarray(own.codes))
        np.testing.assert_array_equal(as_bytes(again.block_scales), as_bytes(own.block_scales))
        # the format's value q * (s_b / gs) is (q * s_b) * s_g to float32 rounding only: the
        # global scale of its amax is s_g to a few roundings (exact: load_rollout_model above)
        g, o = np.asarray(again.global_scale), np.asarray(own.global_scale)
        assert np.all(np.abs(g / o - 1) < 2**-20)


def test_a_damaged_export_is_refused_naming_the_tensor_or_key(folders, tmp_path):
    folder = tmp_path / "x"
    shutil.copytree(folders["nvfp4"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": None}))
    with pytest.raises(CheckpointError, match="has no quantization_config"):
        hf.load_hf_checkpoint(folder)
    qc = {**config["quantization_config"], "format": "int-quantized"}
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(CheckpointError, match=r"quantization_config\.format is 'int-quantized'"):
        hf.load_hf_checkpoint(folder)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = stored(folder)
    gone = "model.layers.1.mlp.experts.5.up_proj.weight_scale"
    del tensors[gone]
    safetensors.numpy.save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"tensor '{gone}' is missing"):
        hf.load_hf_checkpoint(folder)


@pytest.mark.reference
def test_compressed_tensors_reads_the_rollouts_codes_and_decompresses_bit_for_bit(
    policy_model, folders, tmp_path, ref_python
):
    """compressed-tensors, on its own: it quantizes exactly the modules stored packed, reads the
    rollout's E2M1 codes and block scales, and decompresses to ``load_hf_checkpoint``'s weights."""
    _, params, rollout = policy_model
    expected = {
        "nvfp4": rollout,
        "mxfp4": {p: pack_expert_weight(params[p], MXFP4) for p in EXPERTS},
    }
    names = ["nvfp4", "options", "mxfp4"]
    out = tmp_path / "reference.npz"
    script = Path(__file__).with_name("reference_compressed_tensors.py")
    proc = subprocess.run(
        [ref_python, str(script), str(out), *(str(folders[n]) for n in names)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"reference_compressed_tensors.py failed:\n{proc.stderr[-4000:]}"
    with np.load(out) as f:
        ref = dict(f)
    for i, name in enumerate(names):
        packed = {n.removesuffix(".weight_packed") for n in stored(folders[name]) if "packed" in n}
        assert set(ref[f"{i}.quantized"]) == packed  # their matching of our config's targets
        _, model = hf.load_hf_checkpoint(folders[name], dtype="float32")
        ours = flat(model)
        for module in packed:
            _, _, layer, _, _, e, w = module.split(".")
            p, e = ("layers", int(layer), "mlp", w), int(e)
            if name in expected:  # the rollout's codes and block scales, as they read them
                qt = expected[name][p]
                codes = np.asarray(fp4.unpack_nibbles(qt.codes[e]))
                np.testing.assert_array_equal(ref[f"{i}/{module}/q"], fp4.E2M1_VALUES[codes])
                scales = np.asarray(block_scale_values(qt.block_scales[e], qt.fmt))
                np.testing.assert_array_equal(ref[f"{i}/{module}/scale"], scales)
            value = np.asarray(ours[p][e]).T  # [out, in] float32
            bf16 = np.asarray(jnp.asarray(value, jnp.bfloat16).astype(jnp.float32))
            np.testing.assert_array_equal(
                bf16.view(np.uint32), ref[f"{i}/{module}"].view(np.uint32)
            )
            if name != "mxfp4":  # NVFP4's float32 value (MXFP4's is exact in BF16)
                f32 = ref[f"{i}/{module}/f32"]
                np.testing.assert_array_equal(value.view(np.uint32), f32.view(np.uint32))
