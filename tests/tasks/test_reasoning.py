"""Reasoning task: reward on hand-made completions, demonstrations, determinism, disjoint splits."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace_jax.config import ConfigError
from trace_jax.tasks import AnswerProblem, make_task
from trace_jax.tasks.reasoning import parse_answer, reduction_steps


def _problem(answer="11"):
    return AnswerProblem(id="x", prompt="Compute: 3+4*2\n", answer=answer, solution="3+4*2=3+8=11")


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("3+4*2=3+8=11\nAnswer: 11", 1.0),
        ("Answer: 11", 1.0),
        ("Answer:11  \n", 1.0),
        ("3+4*2=14\nAnswer: 14", 0.25),  # well formed, wrong: the format reward
        ("11", 0.0),  # no answer line
        ("Answer: 11\nmore text", 0.0),  # the answer line must end the completion
        ("Answer: eleven", 0.0),
        ("The Answer: 11", 0.0),  # the answer line starts a line
        ("", 0.0),
        ("Answer: 11.0", 1.0),  # numbers compare by value
    ],
)
def test_reward_on_hand_made_completions(completion, reward):
    task = make_task("reasoning", format_reward=0.25)
    assert task.reward(_problem(), completion) == reward


def test_format_reward_defaults_to_zero():
    task = make_task("reasoning")
    assert task.reward(_problem(), "Answer: 12") == 0.0


def test_reduction_order_is_multiplication_first_then_left_to_right():
    assert reduction_steps([3, 4, 2], ["+", "*"]) == ["3+4*2", "3+8", "11"]
    assert reduction_steps([9, 5, 7], ["-", "-"]) == ["9-5-7", "4-7", "-3"]
    assert reduction_steps([2, 3, 4, 5], ["*", "-", "*"]) == ["2*3-4*5", "6-4*5", "6-20", "-14"]


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"num_operands": 4, "max_value": 99, "ops": ["+", "-", "*"]},
        {"num_operands": 5, "min_operands": 2, "ops": ["-", "*"]},
    ],
)
def test_demonstrations_score_one_and_answers_are_correct(knobs):
    task = make_task("reasoning", **knobs)
    for split in ("train", "eval"):
        for i in range(40):
            p = task.problem(split, i)
            assert task.reward(p, task.demonstration(p)) == 1.0
            expr = p.prompt.removeprefix("Compute: ").strip()
            # Independent check of the answer with integer arithmetic of the expression.
            assert int(p.answer) == _eval_expr(expr)
            assert parse_answer(task.demonstration(p)) == p.answer


def _eval_expr(expr):
    """Evaluate +,-,* over non-negative integer literals with usual precedence (no eval)."""
    terms, sign = [], 1
    product, num = None, ""
    for ch in expr + "+":
        if ch.isdigit():
            num += ch
            continue
        product = int(num) if product is None else product * int(num)
        num = ""
        if ch == "*":
            continue
        terms.append(sign * product)
        product, sign = None, (1 if ch == "+" else -1)
    return sum(terms)


def test_difficulty_knobs_shape_the_problems():
    task = make_task("reasoning", num_operands=4, max_value=99, ops=["*"])
    p = task.problem("train", 3)
    expr = p.prompt.removeprefix("Compute: ").strip()
    operands = expr.split("*")
    assert len(operands) == 4 and all(0 <= int(x) <= 99 for x in operands)


def test_deterministic_by_index_and_seed():
    a, b = make_task("reasoning", num_operands=3), make_task("reasoning", num_operands=3)
    assert [a.problem("train", i) for i in range(20)] == [b.problem("train", i) for i in range(20)]
    c = make_task("reasoning", num_operands=3, seed=1)
    assert [a.problem("train", i) for i in range(20)] != [c.problem("train", i) for i in range(20)]


def test_train_and_eval_are_disjoint():
    task = make_task("reasoning", num_operands=3, max_value=20)
    train = {task.problem("train", i).prompt for i in range(2000)}
    evals = {task.problem("eval", i).prompt for i in range(200)}
    assert evals and not train & evals
    # The easiest space (100 additions) still has both splits.
    easy = make_task("reasoning")
    assert not {easy.problem("train", i).prompt for i in range(1000)} & {
        easy.problem("eval", i).prompt for i in range(100)
    }


@pytest.mark.parametrize(
    ("knobs", "key"),
    [
        ({"num_operands": 1}, "num_operands"),
        ({"ops": ["/"]}, "ops"),
        ({"format_reward": 1.0}, "format_reward"),
        ({"max_value": 0}, "max_value"),
        ({"min_operands": 5, "num_operands": 3}, "min_operands"),
        ({"num_operands": "3"}, "num_operands"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_knobs_raise_config_error_naming_the_key(knobs, key):
    with pytest.raises(ConfigError, match=key):
        make_task("reasoning", **knobs)


def test_index_outside_split_raises():
    task = make_task("reasoning", eval_size=10)
    with pytest.raises(IndexError, match="eval"):
        task.problem("eval", 10)
    with pytest.raises(ValueError, match="split"):
        task.problem("test", 0)


# --- countdown ------------------------------------------------------------------------------


def _countdown(numbers=(2, 3, 5), target=25):
    from trace_jax.tasks.reasoning import CountdownProblem

    return CountdownProblem(
        id="c", prompt="", numbers=numbers, target=target, solution="(2+3)*5", steps=""
    )


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("2+3=5\n5*5=25\nAnswer: (2+3)*5", 1.0),
        ("Answer: 5*(3+2)", 1.0),  # any expression reaching the target counts
        ("Answer: ((5))*(2+3)", 1.0),
        ("Answer: 2+3*5", 0.5),  # parses, wrong value (17): the format reward
        ("Answer: 5*5", 0.5),  # reaches 25 but does not use every number
        ("Answer: (2+3)*5*1", 0.5),  # uses a number not given
        ("Answer: (2+3)*5+0", 0.5),
        ("Answer: (2+3*5", 0.0),  # syntax error
        ("Answer: 25", 0.5),  # a lone number parses but misses
        ("Answer: __import__('os')", 0.0),
        ("Answer: -2+3*5+12", 0.0),  # no unary minus
        ("(2+3)*5", 0.0),  # no answer line
        ("Answer: " + "(" * 40 + "2" + ")" * 40, 0.0),  # nested too deeply
    ],
)
def test_countdown_reward_on_hand_made_completions(completion, reward):
    task = make_task("countdown", format_reward=0.5)
    assert task.reward(_countdown(), completion) == reward


def test_countdown_demonstrations_and_disjoint_splits():
    task = make_task("countdown", num_numbers=4, max_value=20)
    train = set()
    for i in range(300):
        p = task.problem("train", i)
        train.add((p.numbers, p.target))
        assert task.reward(p, task.demonstration(p)) == 1.0
    for i in range(60):
        p = task.problem("eval", i)
        assert (p.numbers, p.target) not in train
        assert task.reward(p, task.demonstration(p)) == 1.0


@given(st.text(max_size=200))
def test_expression_evaluator_never_raises(text):
    from trace_jax.tasks.reasoning import evaluate_expression

    result = evaluate_expression(text)
    assert result is None or isinstance(result[0], int)


def test_demonstration_forms():
    one_op = make_task("reasoning")
    p = one_op.problem("train", 0)
    assert one_op.demonstration(p) == f"Answer: {p.answer}"  # the work would repeat the prompt
    multi = make_task("reasoning", num_operands=3)
    p = multi.problem("train", 0)
    lines = multi.demonstration(p).split("\n")
    assert lines[0].startswith(p.prompt.removeprefix("Compute: ").strip() + "=")
    assert lines[0].count("=") == 2 and lines[1] == f"Answer: {p.answer}"
    terse = make_task("reasoning", num_operands=3, show_steps=False)
    assert terse.demonstration(terse.problem("train", 0)) == f"Answer: {p.answer}"
