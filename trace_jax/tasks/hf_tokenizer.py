"""A Hugging Face checkpoint's own tokenizer behind the ``Tokenizer`` interface.

``tokenizer.json`` runs through the ``tokenizers`` library; the chat template
(``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``) is rendered with
jinja2 in the sandbox and with the helpers transformers gives it; the special tokens are those
the checkpoint defines::

    tok = load_hf_tokenizer(folder)           # the folder ``hf_checkpoint=`` names
    io = TaskIO("reasoning", {}, tok)         # tasks rendered and scored through it

An episode under a Qwen-style template (``<|im_start|>role\\n...<|im_end|>\\n``)::

    <|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n                prompt_ids
    {action}<|im_end|>                                                      policy turn (loss)
    \\n<|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n   observation_ids

The end-of-turn token (``eot_id``) is the special token the template writes right after an
assistant message's text; an observation is the template's text between that token and the next
assistant message's text (a user turn, then the generation prompt). Without a chat template a
prompt is the plain text with the tokenizer's own special tokens (its post-processor: BOS for
Llama-style tokenizers), a policy turn ends with EOS and an observation is its plain text.

Special ids, resolved as transformers resolves them: ``eos_id`` is ``tokenizer_config.json``'s
``eos_token``, else the first ``eos_token_id`` of ``generation_config.json`` (``config.json``
when there is none); ``pad_id`` is ``pad_token``, else that file's ``pad_token_id``, else
``eos_id`` (as ``generate`` pads); the sampler stops on ``eot_id``, every ``eos_token_id`` of
the generation config and ``eos_id``.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers

from trace_jax.model.hf import CONFIG, CheckpointError, MissingCheckpointError, read_json
from trace_jax.tasks.tokenizer import TokenizerError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Message contents that locate the turns in a rendered conversation (no whitespace: templates
# may strip a message's content).
_PROMPT, _ACTION, _OBSERVATION = "@@prompt@@", "@@action@@", "@@observation@@"
# The special-token strings transformers passes to a template.
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' marks of assistant text for its
    masks): rendered as its body."""

    tags = {"generation"}  # noqa: RUF012  (jinja's Extension API)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: jinja's own escapes HTML characters
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled as transformers compiles it (sandboxed; ``trim_blocks``,
    ``lstrip_blocks``; ``raise_exception``, ``strftime_now`` and ``tojson``)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with its chat template and special ids (``Tokenizer``).

    Args:
      tokenizer: the tokenizer of ``tokenizer.json``.
      eos_id, pad_id, bos_id: the special ids (see the module docstring).
      generation_eos: the ids generation stops on (the generation config's ``eos_token_id``).
      chat_template: jinja source, or None.
      template_tokens: the special-token strings the template sees (``bos_token``, ...).
    Raises ``jinja2.TemplateError`` for a template that does not compile or render, and
    ``ValueError`` for one that does not show the contents of a user / assistant / user
    conversation.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        eos_id: int,
        pad_id: int,
        bos_id: int | None = None,
        generation_eos: Sequence[int] = (),
        chat_template: str | None = None,
        template_tokens: dict[str, str] | None = None,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = 1 + max(tokenizer.get_vocab(with_added_tokens=True).values())
        self.eos_id, self.pad_id, self.bos_id = eos_id, pad_id, bos_id
        self.template = None if chat_template is None else compile_chat_template(chat_template)
        self.template_tokens = dict(template_tokens or {})
        self.eot_id, self._observation = eos_id, ("", "")
        if self.template is not None:
            self.eot_id, self._observation = self._turn_layout()
        self._stops = tuple(dict.fromkeys((self.eot_id, *generation_eos, eos_id)))

    # ------------------------------------------------------------------ the chat template

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The chat template's text of ``messages`` (``{"role", "content"}`` dicts)."""
        if self.template is None:
            raise ValueError("this tokenizer has no chat template")
        return self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.template_tokens
        )

    def _turn_layout(self) -> tuple[int, tuple[str, str]]:
        """(end-of-turn id, the observation's text before and after its content)."""
        text = self.render(
            [
                {"role": "user", "content": _PROMPT},
                {"role": "assistant", "content": _ACTION},
                {"role": "user", "content": _OBSERVATION},
            ],
            add_generation_prompt=True,
        )
        if not all(text.count(s) == 1 for s in (_PROMPT, _ACTION, _OBSERVATION)):
            raise ValueError(
                "rendering a user / assistant / user conversation does not show each message's "
                "content once"
            )
        before, after = text[text.index(_ACTION) + len(_ACTION) :].split(_OBSERVATION)
        special = {
            i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special
        }
        first = self.encode(before)[:1]
        if first and first[0] in special and before.startswith(special[first[0]]):
            return first[0], (before[len(special[first[0]]) :], after)
        return self.eos_id, (before, after)

    # ------------------------------------------------------------------ the Tokenizer interface

    def encode(self, text: str) -> list[int]:
        """Text -> ids, without the tokenizer's added BOS/EOS (a special token's text: its id)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], *, errors: Literal["strict", "replace"] = "strict") -> str:
        """Ids -> text. ``"strict"`` keeps special tokens as their text and raises on an id outside
        the vocabulary; ``"replace"`` drops special and out-of-vocabulary ids (for sampled
        completions: the model's vocabulary may be larger than the tokenizer's)."""
        ids = [int(i) for i in ids]
        known = [
            0 <= i < self.vocab_size and self.tokenizer.id_to_token(i) is not None for i in ids
        ]
        if errors == "strict":
            if not all(known):
                pos = known.index(False)
                raise TokenizerError(f"id {ids[pos]} at position {pos} is not in the vocabulary")
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(
            [i for i, k in zip(ids, known, strict=True) if k], skip_special_tokens=True
        )

    def prompt_ids(self, prompt: str) -> list[int]:
        """The prompt as the user's turn, then the template's generation prompt (no template: the
        text with the tokenizer's own special tokens)."""
        if self.template is None:
            return self.tokenizer.encode(prompt, add_special_tokens=True).ids
        return self.encode(self.render([{"role": "user", "content": prompt}], True))

    def observation_ids(self, text: str) -> list[int]:
        """After a policy turn's end-of-turn token: the rest of the template's turn separator, the
        observation as a user turn, and the opening of the policy's next turn."""
        before, after = self._observation
        return self.encode(before + text + after)

    def end_of_turn(self, multi_turn: bool) -> int:
        return self.eot_id

    def stop_ids(self, multi_turn: bool) -> tuple[int, ...]:
        return self._stops

    def completion_text(self, ids: Sequence[int]) -> str:
        """Sampled ids -> text: cut at the first stop or pad id, special ids dropped."""
        cut = next(
            (p for p, i in enumerate(ids) if int(i) in (*self._stops, self.pad_id)), len(ids)
        )
        return self.decode(ids[:cut], errors="replace")


# ----------------------------------------------------------------------------- loading


def _token_id(tok: tokenizers.Tokenizer, config: dict, key: str, file: Path) -> int | None:
    """The id of ``config[key]`` (a token string, or transformers' ``{"content": ...}``)."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is None:
        return None
    if not isinstance(value, str):
        raise CheckpointError(f"{file}: {key} must be a token string, got {value!r}")
    i = tok.token_to_id(value)
    if i is None:
        raise CheckpointError(f"{file}: {key} {value!r} is not in the tokenizer's vocabulary")
    return i


def _ids(config: dict, key: str, file: Path) -> tuple[int, ...]:
    """``config[key]``: an id, a list of ids or absent."""
    value = config.get(key)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{file}: {key} must be a token id or a list of them, got {value!r}")
    return tuple(ids)


def _chat_template(folder: Path, config: dict) -> tuple[str | None, Path]:
    """The chat template's source and the file it comes from (None: the checkpoint has none)."""
    file = folder / CHAT_TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8"), file
    file = folder / TOKENIZER_CONFIG
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: transformers' chat uses "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if "default" not in named:
            raise CheckpointError(f"{file}: chat_template names no 'default' template")
        source = named["default"]
    if source is not None and not isinstance(source, str):
        kind = type(source).__name__
        raise CheckpointError(f"{file}: chat_template must be a string, got {kind}")
    return source, file


def load_hf_tokenizer(path: str | Path) -> HFTokenizer:
    """The tokenizer of a Hugging Face checkpoint folder (``tokenizer.json``, with
    ``tokenizer_config.json``, ``chat_template.jinja``, ``generation_config.json`` and
    ``config.json`` where present).

    Raises ``CheckpointError`` naming the file (and the key) for a missing or unreadable
    tokenizer, a chat template that does not compile or render, a special token outside the
    vocabulary, and a vocabulary with ids beyond ``config.json``'s ``vocab_size``.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise MissingCheckpointError(f"checkpoint folder {folder} does not exist")
    file = folder / TOKENIZER_FILE
    if not file.is_file():
        raise MissingCheckpointError(
            f"{file} does not exist (a checkpoint's runs prompt it in its own vocabulary)"
        )
    try:
        tok = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the library raises a bare Exception for every kind of fault
        raise CheckpointError(f"{file}: not a readable tokenizer ({e})") from None
    if tok.get_vocab_size(with_added_tokens=True) == 0:
        raise CheckpointError(f"{file}: the tokenizer has an empty vocabulary")
    tcfg_file = folder / TOKENIZER_CONFIG
    tcfg = read_json(tcfg_file, "the tokenizer config") if tcfg_file.is_file() else {}
    config_file = folder / CONFIG
    config = read_json(config_file, "the Hugging Face model config")
    gen_file = folder / GENERATION_CONFIG
    if gen_file.is_file():
        generation = read_json(gen_file, "the generation config")
    else:  # transformers' GenerationConfig.from_model_config
        gen_file, generation = config_file, config

    vocab_size = config.get("vocab_size")
    if not isinstance(vocab_size, int):
        raise CheckpointError(f"{config_file}: missing the key 'vocab_size' (an int)")
    ids = tok.get_vocab(with_added_tokens=True).values()
    if max(ids) >= vocab_size:
        raise CheckpointError(
            f"{file}: the tokenizer's vocabulary has ids up to {max(ids)} ({len(ids)} tokens), "
            f"beyond the model's vocab_size {vocab_size} in {config_file}"
        )
    generation_eos = _ids(generation, "eos_token_id", gen_file)
    for key, values in (
        ("eos_token_id", generation_eos),
        ("pad_token_id", _ids(generation, "pad_token_id", gen_file)),
    ):
        if any(i >= vocab_size for i in values):
            raise CheckpointError(f"{gen_file}: {key} {values} outside vocab_size {vocab_size}")
    eos = _token_id(tok, tcfg, "eos_token", tcfg_file)
    if eos is None and generation_eos:
        eos = generation_eos[0]
    if eos is None:
        raise CheckpointError(
            f"{folder}: no end-of-sequence token ({TOKENIZER_CONFIG} has no eos_token, "
            f"{gen_file.name} no eos_token_id)"
        )
    pad = _token_id(tok, tcfg, "pad_token", tcfg_file)
    if pad is None:
        pad = next(iter(_ids(generation, "pad_token_id", gen_file)), eos)
    bos = _token_id(tok, tcfg, "bos_token", tcfg_file)
    template_tokens = {}
    for key in _TEMPLATE_TOKENS:
        value = tcfg.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            template_tokens[key] = value
    source, template_file = _chat_template(folder, tcfg)
    try:
        return HFTokenizer(
            tok,
            eos_id=eos,
            pad_id=pad,
            bos_id=bos,
            generation_eos=generation_eos,
            chat_template=source,
            template_tokens=template_tokens,
        )
    except (jinja2.TemplateError, ValueError) as e:
        line = getattr(e, "lineno", None)
        where = f" (line {line})" if line else ""
        raise CheckpointError(f"{template_file}: chat template{where}: {e}") from None
