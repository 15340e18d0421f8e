"""``hf_checkpoint=`` through the entry point: a tiny Qwen3-MoE checkpoint with its own trained
tokenizer and chat template runs RL with its prompts rendered in the template and its special
tokens; a tokenizer that does not fit the checkpoint is one line naming the file, exit code 2."""

import shutil

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
from trace_jax.rl import runlog
from trace_jax.rl.tasks_io import TaskIO


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
