"""Reasoning task: reward on hand-made completions, demonstrations, determinism, disjoint splits."""

import pytest

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
