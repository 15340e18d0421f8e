"""Byte-level tokenizer for the tasks: one token per UTF-8 byte, 256 ids in all.

Ids 0-3 are special markers (ASCII control codes the tasks never use as text); tab, newline,
carriage return, printable ASCII (32-126) and every byte of a multi-byte UTF-8 character
(128-255) are text and keep their byte value as id, so ``"A"`` is id 65. Other control
characters (NUL, ESC, DEL, ...) are not part of the alphabet and raise.

Layout of a sequence (see ``trace_jax.tasks.base.episode_tokens``)::

    BOS <prompt bytes> <completion bytes> EOS                        single-turn
    BOS <prompt bytes> <action> EOT <observation> <action> EOT ...   multi-turn

``EOS`` ends a single-turn completion and ``EOT`` ends one policy turn of a multi-turn episode;
both are stop tokens for the sampler. ``PAD`` fills batches.

``Tokenizer`` is the interface the task I/O takes: this byte tokenizer is the default of the
built-in presets; a Hugging Face checkpoint brings its own (``trace_jax.tasks.hf_tokenizer``),
which renders prompts and observations in the checkpoint's chat template.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, Protocol, runtime_checkable

PAD = 0
BOS = 1
EOS = 2
EOT = 3
SPECIAL_IDS = (PAD, BOS, EOS, EOT)
SPECIAL_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", EOT: "<eot>"}

# Bytes that are text: \t \n \r, printable ASCII, and UTF-8 lead/continuation bytes.
_TEXT_BYTES = frozenset([9, 10, 13, *range(32, 127), *range(128, 256)])


class TokenizerError(ValueError):
    """Text with a character outside the alphabet, or ids that are not text."""


@runtime_checkable
class Tokenizer(Protocol):
    """What tasks and the RL loop need of a tokenizer: text <-> ids, the special ids, and the
    render of an episode (prompt, the token ending a policy turn, environment observations).

    An episode's ids are ``prompt_ids(prompt)``, then per policy turn ``encode(text)`` followed by
    ``end_of_turn(multi_turn)`` (in the loss), per environment turn ``observation_ids(text)``
    (not in the loss); see ``trace_jax.tasks.base.episode_tokens``.
    """

    vocab_size: int  # 1 + the largest id the tokenizer produces
    pad_id: int
    bos_id: int | None
    eos_id: int
    eot_id: int

    def encode(self, text: str) -> list[int]: ...
    def decode(
        self, ids: Iterable[int], *, errors: Literal["strict", "replace"] = "strict"
    ) -> str: ...
    def prompt_ids(self, prompt: str) -> list[int]: ...
    def observation_ids(self, text: str) -> list[int]: ...
    def end_of_turn(self, multi_turn: bool) -> int: ...
    def stop_ids(self, multi_turn: bool) -> tuple[int, ...]: ...
    def completion_text(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Byte-level tokenizer: ``encode(str) -> list[int]``, ``decode(list[int]) -> str``.

    ``decode(encode(s)) == s`` for every string without control characters other than
    tab/newline/carriage return.
    """

    vocab_size: int = 256
    pad_id: int = PAD
    bos_id: int = BOS
    eos_id: int = EOS
    eot_id: int = EOT

    def encode(self, text: str) -> list[int]:
        """Text -> byte ids (no BOS/EOS added). Raises TokenizerError naming a bad character."""
        try:
            ids = list(text.encode("utf-8"))
        except UnicodeEncodeError as e:  # lone surrogates have no UTF-8 form
            raise TokenizerError(
                f"character {text[e.start]!r} at position {e.start} is a lone surrogate"
            ) from None
        if not _TEXT_BYTES.issuperset(ids):
            pos, ch = next(
                (p, c) for p, c in enumerate(text) if ord(c) < 128 and ord(c) not in _TEXT_BYTES
            )
            raise TokenizerError(
                f"character {ch!r} (U+{ord(ch):04X}) at position {pos} is not in the "
                "tokenizer's alphabet (control characters other than \\t \\n \\r)"
            )
        return ids

    def decode(self, ids: Iterable[int], *, errors: Literal["strict", "replace"] = "strict") -> str:
        """Byte ids -> text.

        ``errors="strict"`` raises on special ids, ids outside [0, 256) and invalid UTF-8;
        ``"replace"`` drops special and out-of-range ids and replaces invalid UTF-8 with U+FFFD
        (for sampled completions, which may be any id sequence).
        """
        out = bytearray()
        for pos, i in enumerate(ids):
            i = int(i)
            if 0 <= i < 256 and i in _TEXT_BYTES:
                out.append(i)
            elif errors == "strict":
                what = SPECIAL_NAMES.get(i, "not a text byte") if 0 <= i < 256 else "out of range"
                raise TokenizerError(f"id {i} at position {pos} is {what}; cannot decode as text")
        try:
            return out.decode("utf-8", errors=errors)
        except UnicodeDecodeError as e:
            raise TokenizerError(f"ids are not valid UTF-8: {e}") from None

    def prompt_ids(self, prompt: str) -> list[int]:
        """``BOS`` + the prompt's bytes: the context the policy continues."""
        return [BOS, *self.encode(prompt)]

    def observation_ids(self, text: str) -> list[int]:
        """An environment observation appended after a policy turn: its bytes."""
        return self.encode(text)

    def end_of_turn(self, multi_turn: bool) -> int:
        """The id that ends a policy turn: ``EOT`` in a multi-turn episode, else ``EOS``."""
        return EOT if multi_turn else EOS

    def stop_ids(self, multi_turn: bool) -> tuple[int, ...]:
        """Ids that end the sampler's decode of a turn."""
        return (self.end_of_turn(multi_turn),)

    def completion_text(self, ids: Sequence[int]) -> str:
        """Sampled completion ids -> text: cut at the first stop/pad id, lenient decode."""
        cut = len(ids)
        for pos, i in enumerate(ids):
            if int(i) in (EOS, EOT, PAD):
                cut = pos
                break
        return self.decode(ids[:cut], errors="replace")


TOKENIZER = ByteTokenizer()
