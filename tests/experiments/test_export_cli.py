"""``python -m experiments export``: a run directory's trained policy (its newest checkpoint, not
the ``policy/`` RL started from) goes out with the rollout's FP4 codes; bad input is one line."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import nnx

from experiments.__main__ import main
from experiments.runner import resolve_data
from tests.experiments.conftest import SMALL
from trace_jax.config import to_dict
from trace_jax.model import QuantPolicy, Transformer, save_params
from trace_jax.model.hf import iter_hf_params, save_hf_checkpoint
from trace_jax.rl.checkpoint import RunCheckpointer
from trace_jax.rl.loop import model_config, rollout_policy
from trace_jax.rl.trainer import TrainState
from trace_jax.rollout.engine import pack_expert_weight


def flat(model) -> dict:
    return {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as an RL run leaves it: config.yaml, the start policy in policy/, and a
    checkpoint of step 3 holding other (trained) parameters, an optimizer state and history."""
    exp, cfg = resolve_data(dict(SMALL), [], "SMALL")
    run = tmp_path_factory.mktemp("export_cli") / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"experiment": exp.name, **to_dict(cfg)}))
    mcfg = model_config(cfg, 0)
    start, trained = Transformer(mcfg, nnx.Rngs(0)), Transformer(mcfg, nnx.Rngs(1))
    save_params(run / "policy", start)
    p = nnx.state(trained, nnx.Param)
    ckpt = RunCheckpointer(run / "checkpoints")
    ckpt.save(3, (TrainState(p, optax.adamw(1e-3).init(p), jnp.int32(3)), [p]), {"next_step": 4})
    ckpt.close()
    return run, cfg, mcfg, flat(start), flat(trained), start


@pytest.mark.parametrize("which", ["run", "policy"])
def test_export_writes_the_policys_rollout_codes(run_dir, tmp_path, capsys, which):
    run, cfg, mcfg, start, trained, _ = run_dir
    source, params = (run, trained) if which == "run" else (run / "policy", start)
    out = tmp_path / "out"
    assert main(["export", str(source), "--format", "nvfp4", "--out", str(out)]) == 0
    assert "tokenizer: none" in capsys.readouterr().out
    record = json.loads((out / "trace_jax_export.json").read_text())
    assert record["checkpoint"] == ("run/checkpoints/3" if which == "run" else "run/policy")
    back = dict(iter_hf_params(out, mcfg, packed="nvfp4"))
    policy = rollout_policy(cfg)
    for path, value in params.items():
        if path[-1] in ("gate_proj", "up_proj", "down_proj"):  # the refit's codes and scales
            expect = jax.device_get(pack_expert_weight(value, policy))
            for x, y in zip(jax.tree.leaves(back[path]), jax.tree.leaves(expect), strict=True):
                np.testing.assert_array_equal(np.asarray(x).view(np.uint8), y.view(np.uint8))
        else:  # BF16
            bf16 = np.asarray(jnp.asarray(value, jnp.bfloat16).astype(jnp.float32))
            np.testing.assert_array_equal(back[path], bf16)


def test_a_hf_folder_exports_with_its_tokenizer_and_an_export_again_as_stored(
    run_dir, tmp_path, capsys
):
    _, _, mcfg, start, _, model = run_dir
    source = tmp_path / "hf"
    save_hf_checkpoint(model, mcfg, source)
    tokenizer = {"tokenizer.json": '{"model": {}}', "tokenizer_config.json": '{"eos_token": "x"}'}
    for name, text in tokenizer.items():
        (source / name).write_text(text)
    first, again = tmp_path / "first", tmp_path / "again"
    assert main(["export", str(source), "--format", "nvfp4", "--out", str(first)]) == 0
    assert main(["export", str(first), "--format", "nvfp4", "--out", str(again)]) == 0
    out = capsys.readouterr().out
    assert out.count("tokenizer: tokenizer.json, tokenizer_config.json") == 2
    for name, text in tokenizer.items():
        assert (again / name).read_text() == text
    stored = dict(iter_hf_params(again, mcfg, packed="nvfp4"))
    for path, value in start.items():
        if path[-1] in ("gate_proj", "up_proj", "down_proj"):  # quantized once, then kept
            expect = jax.device_get(pack_expert_weight(value, QuantPolicy.rollout("nvfp4")))
            for x, y in zip(jax.tree.leaves(stored[path]), jax.tree.leaves(expect), strict=True):
                np.testing.assert_array_equal(np.asarray(x).view(np.uint8), y.view(np.uint8))


def test_user_errors_are_one_line_and_exit_2(run_dir, tmp_path, capsys, one_line):
    run = run_dir[0]
    formats = tmp_path / "formats_run"
    formats.mkdir()
    (formats / "config.yaml").write_text(yaml.safe_dump({"experiment": "fp4_formats"}))
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    damaged = tmp_path / "damaged"
    (damaged / "policy").mkdir(parents=True)
    shutil.copyfile(run / "config.yaml", damaged / "config.yaml")
    cases = [
        ([str(tmp_path / "nowhere")], "does not exist"),
        ([str(tmp_path)], "is not one: expected a run directory"),
        ([str(run), "--format", "fp8"], "--format: 'fp8' is not one of nvfp4, mxfp4"),
        ([str(run), "--keep-bf16", "first,7"], "--keep-bf16: '7' is not 'first', 'last'"),
        ([str(run), "--out", str(full)], "exists and is not an empty folder"),
        ([str(run / "checkpoints" / "9")], "no such checkpoint (the run has steps [3])"),
        ([str(formats)], "is a run of 'fp4_formats', which trains no policy"),
        ([str(damaged)], "policy: not a readable parameter checkpoint"),
    ]
    for args, message in cases:
        if "--format" not in args:
            args = [*args, "--format", "nvfp4"]
        if "--out" not in args:
            args = [*args, "--out", str(tmp_path / "out")]
        assert main(["export", *args]) == 2, args
        assert message in one_line(capsys.readouterr().err)
        assert not (tmp_path / "out").exists()
