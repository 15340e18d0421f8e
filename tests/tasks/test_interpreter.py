"""Stack-language interpreter: semantics on hand-written programs, limits, and fuzzing.

The fuzz tests assert that any text and any word sequence yields a RunResult (never an
exception) within the step, stack, value and output limits.
"""

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace_jax.tasks.interpreter import WORDS, Limits, compile_program, run_program


@pytest.mark.parametrize(
    ("program", "inputs", "output"),
    [
        ("2 3 + .", (), (5,)),
        ("dup * .", (7,), (49,)),
        ("- .", (10, 3), (7,)),  # first input deepest: 10 - 3
        ("/ . ", (-7, 2), (-4,)),  # floor division
        ("% .", (-7, 3), (2,)),  # floor modulo
        ("neg . abs .", (-5, -4), (4, 5)),  # prints the top first
        ("min . ", (3, -2), (-2,)),
        ("max .", (3, -2), (3,)),
        ("= . < . ", (1, 2, 3, 3), (1, 1)),
        ("> .", (5, 2), (1,)),
        ("swap . .", (1, 2), (1, 2)),
        ("over . . .", (1, 2), (1, 2, 1)),
        ("rot . . .", (1, 2, 3), (1, 3, 2)),
        ("drop .", (1, 2), (1,)),
        ("if 10 else 20 end .", (1,), (10,)),
        ("if 10 else 20 end .", (0,), (20,)),
        ("if 10 end 5 .", (0,), (5,)),
        ("3 times 2 * end .", (1,), (8,)),
        ("0 times 2 * end .", (1,), (1,)),
        ("-2 times 2 * end .", (1,), (1,)),
        ("4 times i . end", (), (0, 1, 2, 3)),
        ("2 times 3 times i end end + + + + + .", (), (0 + 1 + 2 + 0 + 1 + 2,)),
        ("2 times i if 7 . else 8 . end end", (), (8, 7)),
        ("  \n\t5\n.  ", (), (5,)),
        ("", (4,), ()),
    ],
)
def test_semantics_on_hand_written_programs(program, inputs, output):
    result = run_program(program, inputs)
    assert result.ok, result.error
    assert result.output == output


@pytest.mark.parametrize(
    ("program", "inputs", "error"),
    [
        ("+", (1,), "runtime error: '\\+' needs 2 values"),
        (".", (), "empty stack"),
        ("1 0 /", (), "by zero"),
        ("1 0 %", (), "by zero"),
        ("foo", (), "parse error: word 0: unknown word 'foo'"),
        ("1 end", (), "'end' without"),
        ("else", (), "'else' without"),
        ("1 if 2", (), "not closed"),
        ("i", (), "outside a 'times'"),
        ("5 i", (), "outside"),
        ("99999999999999999999999", (), "too large"),
        ("1000000001", (), "exceeds the value limit"),
        ("100000 dup *", (), "exceeds the value limit"),
        ("1 times 1 end 1 times", (), "not closed"),
        ("1000 times 1 drop end", (), "step limit"),
        ("100 times 1 end", (), "stack depth limit"),
        ("100 times 1 . end", (), "output limit"),
        ("dup dup dup dup dup dup dup dup", (1,), None),
        ("１ .", (), "unknown word"),  # full-width digits are not literals
    ],
)
def test_errors_are_results_with_clear_messages(program, inputs, error):
    result = run_program(program, inputs, Limits(max_stack=16, max_output=8))
    if error is None:
        assert result.ok
    else:
        assert not result.ok
        assert pytest.importorskip("re").search(error, result.error), result.error


def test_long_programs_are_rejected_before_running():
    limits = Limits(max_chars=20, max_words=4)
    assert "characters" in run_program("1 " * 20, (), limits).error
    assert "words" in run_program("1 1 1 1 1", (), limits).error


def test_bad_limits_raise_config_error():
    from trace_jax.config import ConfigError

    with pytest.raises(ConfigError, match="max_steps"):
        Limits(max_steps=0)


def test_partial_output_is_kept_on_error():
    result = run_program("1 . 2 . +", ())
    assert result.output == (1, 2) and "needs 2" in result.error


LIMITS = Limits(max_steps=300, max_stack=16, max_value=10**6, max_output=8)
words = st.one_of(
    st.sampled_from(sorted(WORDS)),
    st.integers(-(10**7), 10**7).map(str),
    st.sampled_from(["if", "times", "end", "else"]),  # weight control flow up
)


def _check_within_limits(result, limits):
    assert result.steps <= limits.max_steps
    assert len(result.output) <= limits.max_output
    assert all(abs(v) <= limits.max_value for v in result.output)
    assert result.ok or isinstance(result.error, str)


@given(st.text(max_size=300), st.lists(st.integers(-(10**6), 10**6), max_size=4))
def test_fuzz_arbitrary_text_never_crashes(text, inputs):
    _check_within_limits(run_program(text, inputs, LIMITS), LIMITS)


@given(st.lists(words, max_size=60), st.lists(st.integers(-50, 50), max_size=3))
def test_fuzz_word_sequences_never_crash_or_exceed_limits(program, inputs):
    text = " ".join(program)
    start = time.perf_counter()
    result = run_program(text, inputs, LIMITS)
    _check_within_limits(result, LIMITS)
    assert time.perf_counter() - start < 1.0  # the step limit bounds the work


@given(st.lists(st.sampled_from(["9", "times", "dup", "*", "end", "i", "+"]), max_size=40))
def test_fuzz_nested_loops_hit_the_step_limit_not_a_hang(program):
    text = " ".join(program)
    result = run_program(text, (2,), LIMITS)
    _check_within_limits(result, LIMITS)
    try:
        compile_program(text, LIMITS)
    except Exception:
        assert result.error.startswith("parse error")
