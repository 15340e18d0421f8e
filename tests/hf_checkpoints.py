"""Tiny Hugging Face checkpoints with their own tokenizer, made by the tests (no hub access): a
byte-level BPE tokenizer trained with ``tokenizers`` on task text, Qwen's special tokens after the
learned vocabulary, a chat template in Qwen's style and the token files of a Qwen3-MoE checkpoint
(``tokenizer_config.json``, ``generation_config.json``, ``config.json``'s token ids)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trace_jax.model import ModelConfig, Transformer
from trace_jax.model.hf import save_hf_checkpoint
from trace_jax.tasks import make_task

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
# Qwen2.5's template without tools: a default system turn, then <|im_start|>role\n...<|im_end|>\n.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def task_text(problems: int = 40) -> list[str]:
    """Prompts and demonstrations of the reasoning and gridworld tasks, and the template's words."""
    texts = [SYSTEM, "user\nassistant\n"]
    for task in (make_task("reasoning"), make_task("gridworld")):
        for i in range(problems):
            p = task.problem("train", i)
            texts += [p.prompt, *(t.text for t in task.demonstration_turns(p))]
    return texts


def train_tokenizer(texts: list[str], merges: int = 64) -> Tokenizer:
    """A byte-level BPE over printable ASCII and newline (so no task character is dropped) with
    ``merges`` merges, then Qwen's special tokens, which take the last ids."""
    alphabet = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    printable = "".join(map(chr, [10, *range(32, 127)]))
    ((mapped, _),) = alphabet.pre_tokenize_str(printable)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(mapped) + merges, initial_alphabet=list(mapped), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([ENDOFTEXT, IM_START, IM_END])
    return tok


def write_tokenizer(
    folder: Path, tok: Tokenizer, *, chat_template: str | None = QWEN_TEMPLATE, generation=True
) -> Path:
    """``tokenizer.json``, ``tokenizer_config.json`` (Qwen3's keys) and, with ``generation``,
    ``generation_config.json`` (Qwen3's: eos = [<|im_end|>, <|endoftext|>], pad = <|endoftext|>)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if generation:
        ids = {t: tok.token_to_id(t) for t in (ENDOFTEXT, IM_END)}
        generation_config = {
            "bos_token_id": ids[ENDOFTEXT],
            "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
            "pad_token_id": ids[ENDOFTEXT],
            "do_sample": True,
        }
        (folder / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    return folder


def token_ids(tok: Tokenizer) -> dict[str, int]:
    """Config.json's token ids of a Qwen3 checkpoint (bos = <|endoftext|>, eos = <|im_end|>)."""
    return {"bos_token_id": tok.token_to_id(ENDOFTEXT), "eos_token_id": tok.token_to_id(IM_END)}


def tiny_qwen3_checkpoint(folder: Path, tok: Tokenizer, num_layers: int = 1) -> Path:
    """A random Qwen3-MoE checkpoint of the ``tiny`` preset's shapes with ``tok`` and its files
    (parameters drawn with numpy: initializing the model would compile its initializers)."""
    cfg = ModelConfig.preset("tiny").replace(num_layers=num_layers)
    rng = np.random.default_rng(0)

    def value(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name == "weight":  # RMSNorm
            return np.ones(shape, np.float32)
        return 0.1 * rng.standard_normal(shape, np.float32)

    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    params = [
        (path, var.replace(value(path[-1], var.shape)))
        for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param))
    ]
    save_hf_checkpoint(nnx.from_flat_state(params), cfg, folder, base_config=token_ids(tok))
    return write_tokenizer(folder, tok)
