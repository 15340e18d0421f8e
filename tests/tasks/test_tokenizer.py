"""Byte tokenizer: exact round trip, special ids, errors naming characters outside the alphabet."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace_jax.tasks import BOS, EOS, EOT, PAD, TOKENIZER, TokenizerError

# The alphabet: tab, newline, carriage return, and every non-control character.
alphabet_text = st.text(
    st.characters(
        blacklist_categories=("Cs",),
        blacklist_characters=[chr(c) for c in [*range(9), 11, 12, *range(14, 32), 127]],
    )
)


@given(alphabet_text)
def test_round_trip_exact(text):
    ids = TOKENIZER.encode(text)
    assert all(0 <= i < TOKENIZER.vocab_size for i in ids)
    assert not set(ids) & {PAD, BOS, EOS, EOT}
    assert TOKENIZER.decode(ids) == text


def test_vocab_fits_tiny_model_and_ascii_ids_are_byte_values():
    assert TOKENIZER.vocab_size == 256
    assert TOKENIZER.encode("A1+\n") == [65, 49, 43, 10]
    assert len({PAD, BOS, EOS, EOT}) == 4 and PAD == 0


@pytest.mark.parametrize("bad", ["\x00", "\x1b", "\x7f", "\x0b"])
def test_control_characters_raise_naming_the_character(bad):
    with pytest.raises(TokenizerError, match=rf"{bad!r}".replace("\\", "\\\\") + r".*position 3"):
        TOKENIZER.encode("abc" + bad)


def test_lone_surrogate_raises():
    with pytest.raises(TokenizerError, match="surrogate"):
        TOKENIZER.encode("a\ud800")


def test_decode_strict_rejects_special_and_out_of_range_ids():
    with pytest.raises(TokenizerError, match="<eos>"):
        TOKENIZER.decode([65, EOS])
    with pytest.raises(TokenizerError, match="out of range"):
        TOKENIZER.decode([65, 300])
    with pytest.raises(TokenizerError, match="UTF-8"):
        TOKENIZER.decode([0xC3])  # a lead byte with no continuation


def test_prompt_ids_and_completion_text():
    assert TOKENIZER.prompt_ids("hi") == [BOS, 104, 105]
    # The completion stops at the first stop/pad id; what follows is ignored.
    assert TOKENIZER.completion_text([*TOKENIZER.encode("ok"), EOS, 65, 66]) == "ok"
    assert TOKENIZER.completion_text([*TOKENIZER.encode("n"), EOT, 65]) == "n"
    # Invalid UTF-8 from a sampler is replaced, never raised.
    assert TOKENIZER.completion_text([0xC3, 65]) == "\ufffdA"


@given(st.lists(st.integers(0, 255), max_size=64))
def test_completion_text_never_raises(ids):
    assert isinstance(TOKENIZER.completion_text(ids), str)
