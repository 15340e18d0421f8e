"""A checkpoint's own tokenizer: prompts and episodes rendered in its chat template (against
hand-written text), its special tokens resolved as transformers resolves them, completions
decoded leniently, a multi-turn rollout laid out as the warm start's demonstrations, and every
fault of its files named."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from hf_checkpoints import (
    ENDOFTEXT,
    IM_END,
    QWEN_TEMPLATE,
    SYSTEM,
    task_text,
    token_ids,
    train_tokenizer,
    write_tokenizer,
)

from trace_jax.model.hf import CheckpointError
from trace_jax.rl.tasks_io import TaskIO
from trace_jax.tasks import TOKENIZER, Tokenizer, TokenizerError, Turn, episode_tokens
from trace_jax.tasks.hf_tokenizer import load_hf_tokenizer

MODEL_VOCAB = 256  # the tiny preset's


@pytest.fixture(scope="module")
def bpe():
    return train_tokenizer(task_text())


@pytest.fixture
def folder(tmp_path, bpe) -> Path:
    """A checkpoint folder's token files: Qwen3's, with the trained tokenizer."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": MODEL_VOCAB, **token_ids(bpe)}))
    return write_tokenizer(tmp_path, bpe)


def user_turn(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def test_prompt_and_single_turn_episode_render_in_the_chat_template(folder, bpe):
    tok = load_hf_tokenizer(folder)
    assert isinstance(tok, Tokenizer) and isinstance(TOKENIZER, Tokenizer)
    ids = tok.prompt_ids("Compute: 3+1\n")
    assert tok.decode(ids) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nCompute: 3+1\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    turns = [Turn("policy", "Answer: 4")]
    ids, mask = episode_tokens("Compute: 3+1\n", turns, multi_turn=False, tokenizer=tok)
    assert tok.decode(ids) == SYSTEM + user_turn("Compute: 3+1\n") + "Answer: 4<|im_end|>"
    # Only the policy's text and its end-of-turn token are in the loss.
    assert tok.decode(ids[mask]) == "Answer: 4<|im_end|>" and mask[-1]
    assert tok.completion_text(ids[mask].tolist()) == "Answer: 4"
    # The ids are the trained BPE's (the byte tokenizer's would differ), Qwen's specials last.
    assert ids[-1] == bpe.token_to_id(IM_END) == tok.vocab_size - 1
    assert list(ids[mask][:-1]) == bpe.encode("Answer: 4").ids


def test_multi_turn_episode_renders_observations_as_user_turns(folder):
    tok = load_hf_tokenizer(folder)
    turns = [
        Turn("policy", "e"),
        Turn("env", "at 1,2 next G\n"),
        Turn("policy", "s"),
        Turn("env", "done\n"),
    ]
    ids, mask = episode_tokens("Go to G.\n", turns, multi_turn=True, tokenizer=tok)
    assert tok.decode(ids) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nGo to G.\n<|im_end|>\n"
        "<|im_start|>assistant\ne<|im_end|>\n"
        "<|im_start|>user\nat 1,2 next G\n<|im_end|>\n"
        "<|im_start|>assistant\ns<|im_end|>\n"
        "<|im_start|>user\ndone\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # The same text as the template renders the whole conversation.
    messages = [{"role": "user", "content": "Go to G.\n"}] + [
        {"role": "assistant" if t.role == "policy" else "user", "content": t.text} for t in turns
    ]
    assert tok.decode(ids) == tok.render(messages, add_generation_prompt=True)
    assert tok.decode(ids[mask]) == "e<|im_end|>s<|im_end|>"


def test_special_tokens_resolve_as_transformers_does(folder, bpe):
    eos, pad = bpe.token_to_id(IM_END), bpe.token_to_id(ENDOFTEXT)
    tok = load_hf_tokenizer(folder)  # Qwen3's files
    assert (tok.eos_id, tok.pad_id, tok.eot_id, tok.bos_id) == (eos, pad, eos, None)
    assert tok.stop_ids(True) == tok.stop_ids(False) == (eos, pad)  # generation: [im_end, eot]
    io = TaskIO("reasoning", {}, tok)
    assert (io.stop_tokens, io.pad_id, io.vocab_size) == ((eos, pad), pad, tok.vocab_size)

    # No generation_config.json: config.json's eos_token_id; no pad token anywhere: EOS pads.
    (folder / "generation_config.json").unlink()
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tcfg, "pad_token": None}))
    tok = load_hf_tokenizer(folder)
    assert (tok.pad_id, tok.stop_ids(False)) == (eos, (eos,))

    # No eos_token and no chat template: generation's first eos id; plain text prompts.
    write_tokenizer(folder, bpe, chat_template=None)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**tcfg, "eos_token": None, "chat_template": None})
    )
    generation_eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    tok = load_hf_tokenizer(folder)
    assert tok.eos_id == generation_eos[0] == eos and tok.eot_id == eos
    assert tok.prompt_ids("Go\n") == bpe.encode("Go\n").ids == tok.observation_ids("Go\n")

    # chat_template.jinja takes precedence over tokenizer_config.json (transformers >= 4.43).
    (folder / "chat_template.jinja").write_text(QWEN_TEMPLATE.replace("helpful", "terse"))
    assert tok.decode(load_hf_tokenizer(folder).prompt_ids("x")).startswith(
        "<|im_start|>system\nYou are a terse assistant."
    )


def test_completions_decode_leniently_and_strict_decode_names_unknown_ids(folder, bpe):
    tok = load_hf_tokenizer(folder)
    text = tok.encode("Answer: 7")
    beyond = MODEL_VOCAB - 1  # the model samples ids the tokenizer does not have
    im_start = bpe.token_to_id("<|im_start|>")
    sampled = [*text[:2], beyond, im_start, *text[2:], tok.eot_id, *tok.encode("junk")]
    assert tok.completion_text(sampled) == "Answer: 7"
    assert tok.completion_text([*text, tok.pad_id, *text]) == "Answer: 7"
    with pytest.raises(TokenizerError, match=rf"id {beyond} at position 2"):
        tok.decode(sampled)


@dataclasses.dataclass
class ScriptedState:
    tokens: np.ndarray
    generated: np.ndarray
    lengths: np.ndarray
    done: np.ndarray


class ScriptedEngine:
    """The rollout engine's interface (``start``, ``append``, ``decode``) on the host, with a
    scripted policy: each decode writes the next action's ids and the stop token as generated."""

    def __init__(self, actions: list[list[int]], max_len: int, pad: int):
        self.actions, self.cfg = actions, SimpleNamespace(max_len=max_len)
        self.pad, self.turn = pad, 0

    def start(self, batch):
        s = self.cfg.max_len
        return ScriptedState(
            np.full((batch, s), self.pad, np.int32),
            np.zeros((batch, s), bool),
            np.zeros(batch, np.int32),
            np.zeros(batch, bool),
        )

    def _write(self, state, rows, generated):
        """A new state (the engine's are immutable) with ``rows[b]`` written after row b."""
        tokens, gen, lengths = state.tokens.copy(), state.generated.copy(), state.lengths.copy()
        for b, ids in rows.items():
            n = lengths[b]
            tokens[b, n : n + len(ids)] = ids
            gen[b, n : n + len(ids)] = generated
            lengths[b] += len(ids)
        return ScriptedState(tokens, gen, lengths, np.asarray(state.done))

    def append(self, state, tokens, valid):
        tokens, valid = np.asarray(tokens), np.asarray(valid)
        return self._write(state, {b: tokens[b][valid[b]] for b in range(len(tokens))}, False)

    def decode(self, state, key, row_ids=None):
        live = np.flatnonzero(~np.asarray(state.done))
        self.turn += 1
        return self._write(state, {b: self.actions[self.turn - 1] for b in live}, True)


def test_multi_turn_rollout_appends_observations_as_its_demonstrations_lay_them_out(folder):
    tok = load_hf_tokenizer(folder)
    io = TaskIO("gridworld", {"size": 3, "num_checkpoints": 0, "min_path": 2, "max_turns": 8}, tok)
    problem = io.problem("train", 0)
    turns = io.task.demonstration_turns(problem)
    moves = [t.text for t in turns if t.role == "policy"]
    engine = ScriptedEngine([[*tok.encode(m), tok.eot_id] for m in moves], 256, tok.pad_id)
    state, rewards = io.rollout(engine, [problem], jax.random.key(0), max_turns=8)
    assert rewards.tolist() == [1.0]  # the moves were decoded and scored through the tokenizer
    n = int(state.lengths[0])
    # The rollout is the demonstration episode but for the final observation (the episode ended).
    demo, mask = episode_tokens(problem.prompt, turns[:-1], multi_turn=True, tokenizer=tok)
    assert state.tokens[0, :n].tolist() == demo.tolist()
    assert state.generated[0, :n].tolist() == mask.tolist()
    # The warm start's batch holds the whole demonstration in the same render.
    full, full_mask = episode_tokens(problem.prompt, turns, multi_turn=True, tokenizer=tok)
    tokens, loss_mask = io.demonstrations([problem], io.max_len(4, 8))
    assert np.asarray(tokens)[0, : len(full)].tolist() == full.tolist()
    assert np.asarray(loss_mask)[0].sum() == full_mask.sum() == mask.sum()
    expected = SYSTEM + user_turn(problem.prompt)
    for t in turns[:-1]:
        expected += f"{t.text}<|im_end|>" if t.role == "policy" else "\n" + user_turn(t.text)
    assert tok.decode(state.tokens[0, :n]) == expected


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("tokenizer.json", None, r"tokenizer\.json: not a readable tokenizer"),
        ("tokenizer_config.json", "{not json", r"tokenizer_config\.json: not valid JSON"),
        ("tokenizer_config.json", {"eos_token": "<|eot_id|>"}, r"eos_token '<\|eot_id\|>' is not"),
        (
            "tokenizer_config.json",
            {"chat_template": "{% for %}"},
            r"json: chat template \(line 1\): ",
        ),
        ("chat_template.jinja", "{{ messages[0]['content'] }}", r"jinja: chat template: rendering"),
        (
            "config.json",
            {"vocab_size": 100},
            r"tokenizer\.json: the tokenizer's vocabulary has ids",
        ),
        ("config.json", {"vocab_size": None}, r"config\.json: missing the key 'vocab_size'"),
        ("generation_config.json", {"eos_token_id": [300]}, r"eos_token_id \(300,\) outside"),
    ],
)
def test_faults_of_the_token_files_are_named(folder, name, content, match):
    file = folder / name
    if content is None:  # truncated
        file.write_bytes(file.read_bytes()[:200])
    elif isinstance(content, str):
        file.write_text(content)
    else:
        old = json.loads(file.read_text()) if file.is_file() else {}
        file.write_text(json.dumps({**old, **content}))
    with pytest.raises(CheckpointError, match=match) as err:
        load_hf_tokenizer(folder)
    assert str(file) in str(err.value), err.value


def test_missing_tokenizer_is_named(folder, tmp_path):
    shutil.rmtree(tmp_path / "nowhere", ignore_errors=True)
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        load_hf_tokenizer(tmp_path / "nowhere")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=rf"{folder / 'tokenizer.json'} does not exist"):
        load_hf_tokenizer(folder)
