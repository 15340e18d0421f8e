"""``hf_checkpoint=`` through the entry point: a tiny Qwen3-MoE checkpoint with its own trained
tokenizer and chat template runs RL with its prompts rendered in the template and its special
tokens, and its trained policy exports as NVFP4 with that tokenizer and loads back; the BF16
reference with ``ptq_scale_rules`` evaluates such a policy quantized post hoc; a tokenizer that
does not fit the checkpoint is one line naming the file, exit code 2."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_checkpoints import (
    ENDOFTEXT,
    IM_END,
    SYSTEM,
    task_text,
    tiny_qwen3_checkpoint,
    train_tokenizer,
)
from tokenizers import Tokenizer

from experiments.__main__ import main
from trace_jax import fp4
from trace_jax.model import QuantPolicy, hf
from trace_jax.rl import runlog
from trace_jax.rl.checkpoint import read_policy_params
from trace_jax.rl.tasks_io import TaskIO
from trace_jax.rollout.engine import pack_expert_weight
from trace_jax.tasks.hf_tokenizer import load_hf_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    bpe = train_tokenizer(task_text())
    return tiny_qwen3_checkpoint(tmp_path_factory.mktemp("hf") / "qwen3", bpe), bpe


@pytest.mark.slow
def test_rl_from_a_checkpoint_prompts_it_in_its_chat_template(
    checkpoint, tmp_path, monkeypatch, small_yaml
):
    folder, bpe = checkpoint
    prompts = []  # (TaskIO, problems, prompt tokens [B, T], valid [B, T]) of every rollout
    real = TaskIO._prompts

    def recorded(self, problems):
        tokens, valid = real(self, problems)
        prompts.append((self, problems, np.asarray(tokens), np.asarray(valid)))
        return tokens, valid

    monkeypatch.setattr(TaskIO, "_prompts", recorded)
    run_dir = tmp_path / "run"
    # BF16 rollout and training, no warm start: the fewest programs to compile.
    config = small_yaml(experiment="bf16_rollout", warm_start={"steps": 0})
    assert main(["run", config, f"hf_checkpoint={folder}", "--run-dir", str(run_dir)]) == 0
    records = runlog.read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1] and "eval/reward" in records[-1]
    assert prompts, "no rollout"
    for io, problems, tokens, valid in prompts:
        end, pad = bpe.token_to_id(IM_END), bpe.token_to_id(ENDOFTEXT)
        assert io.stop_tokens == (end, pad) and io.pad_id == pad
        for p, row, ok in zip(problems, tokens, valid, strict=True):
            assert io.tok.decode(row[ok]) == (
                f"{SYSTEM}<|im_start|>user\n{p.prompt}<|im_end|>\n<|im_start|>assistant\n"
            )
            assert (row[~ok] == pad).all()

    # Out: the trained policy (the run's newest checkpoint) as NVFP4 with the checkpoint's
    # tokenizer. Read back packed, its experts hold the NVFP4 codes and scales of the trained
    # weights and every other parameter is the trained one in BF16, bit for bit; the exported
    # folder's tokenizer renders the prompts as the run did.
    out = tmp_path / "nvfp4"
    assert main(["export", str(run_dir), "--format", "nvfp4", "--out", str(out)]) == 0
    newest = max((run_dir / "checkpoints").iterdir(), key=lambda d: int(d.name))
    trained = {tuple(map(str, p)): v for p, v in read_policy_params(newest).items()}
    cfg = hf.checkpoint_config(out)
    read = dict(hf.iter_hf_params(out, cfg, packed="nvfp4"))
    assert {tuple(map(str, p)) for p in read} == set(trained)
    experts = 0
    for path, value in read.items():
        want = trained[tuple(map(str, path))]
        if isinstance(value, fp4.QTensor):
            experts += 1
            got = pack_expert_weight(jnp.asarray(want), QuantPolicy.rollout("nvfp4"))
            for x, y in zip(jax.tree.leaves(value), jax.tree.leaves(got), strict=True):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
        else:
            assert value.dtype == jnp.bfloat16, path  # the trainer's float32, rounded once
            np.testing.assert_array_equal(value, want.astype(value.dtype), err_msg=str(path))
    assert experts == 3 * len(cfg.moe_layers)
    io, problems, tokens, valid = prompts[-1]
    exported = load_hf_tokenizer(out)
    assert [exported.prompt_ids(p.prompt) for p in problems] == [
        list(row[ok]) for row, ok in zip(tokens, valid, strict=True)
    ]


@pytest.mark.slow
def test_post_hoc_quantization_of_the_policy_trained_from_a_checkpoint(
    checkpoint, tmp_path, monkeypatch, small_yaml
):
    """BF16 RL (the programs of the run above: the same checkpoint and shapes), then its policy
    quantized post hoc and evaluated on ``eval_split`` (here the training problems): the splits
    of the problems built for it are recorded."""
    from trace_jax.rl import loop

    folder, _ = checkpoint
    splits, real_problem, real_post_hoc = [], TaskIO.problem, loop.RLRun.post_hoc_rewards

    def problem(self, split, index):
        splits.append(split)
        return real_problem(self, split, index)

    def record_from_here(self, params):
        splits.clear()
        return real_post_hoc(self, params)

    monkeypatch.setattr(TaskIO, "problem", problem)
    monkeypatch.setattr(loop.RLRun, "post_hoc_rewards", record_from_here)
    run_dir = tmp_path / "run"
    config = small_yaml(
        experiment="bf16_rollout",
        warm_start={"steps": 0},
        ptq_scale_rules=["four_over_six"],
        eval_split="train",
        plot=True,
    )
    assert main(["run", config, f"hf_checkpoint={folder}", "--run-dir", str(run_dir)]) == 0
    assert [r["step"] for r in runlog.read_metrics(run_dir / "metrics.jsonl")] == [0, 1]
    assert (run_dir / "curves.png").stat().st_size > 0
    results = json.loads((run_dir / "results.json").read_text())
    assert set(results["ptq_eval_reward"]) == {"bf16", "fp4 ptq (four_over_six)"}
    # the BF16 policy's greedy reward again, on the problems of the last evaluation
    assert results["ptq_eval_reward"]["bf16"] == results["last"]["eval/reward"]
    assert splits and set(splits) == {"train"}
    assert results["summary"]["rl_steps"] == 2


def test_a_tokenizer_that_does_not_fit_the_checkpoint_is_one_line(
    checkpoint, tmp_path, capsys, small_yaml, one_line
):
    folder, bpe = checkpoint
    big = shutil.copytree(folder, tmp_path / "big")
    wider = Tokenizer.from_str(bpe.to_str())
    wider.add_tokens([f"<extra_{i}>" for i in range(256)])  # ids past the model's 256
    wider.save(str(big / "tokenizer.json"))
    none = shutil.copytree(folder, tmp_path / "none")
    (none / "tokenizer.json").unlink()
    for bad, wants in [
        (
            big,
            [
                f"{big / 'tokenizer.json'}: the tokenizer's vocabulary has ids up to 418",
                f"beyond the model's vocab_size 256 in {big / 'config.json'}",
            ],
        ),
        (none, [f"{none / 'tokenizer.json'} does not exist"]),
    ]:
        run_dir = tmp_path / "run"
        args = ["run", small_yaml(), f"hf_checkpoint={bad}", "--run-dir", str(run_dir)]
        assert main(args) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith("checkpoint error: ") and all(w in line for w in wants), line
        assert not run_dir.exists()
