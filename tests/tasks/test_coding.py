"""Coding task: reward = fraction of hidden tests passed; references agree with the interpreter."""

import pytest

from trace_jax.config import ConfigError
from trace_jax.tasks import CodingProblem, make_task
from trace_jax.tasks.coding import FAMILIES


def _square_problem():
    return CodingProblem(
        id="x",
        prompt="",
        family="square",
        constants=(),
        examples=(((2,), (4,)),),
        tests=(((1,), (1,)), ((-3,), (9,)), ((0,), (0,)), ((2,), (4,))),
        solution="dup * .",
    )


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("dup * .", 1.0),
        ("  dup\n*\n.\n", 1.0),
        ("abs .", 0.5),  # right on 1 and 0 only
        ("dup + .", 0.5),  # right on 0 and 2 only
        ("dup * . 1 .", 0.0),  # extra output is wrong
        ("dup *", 0.0),  # nothing emitted
        ("dup * . +", 0.0),  # correct output, then a runtime error: fails
        ("print(x*x)", 0.0),  # not the language: parse error, never Python
        ("__import__('os').system('true')", 0.0),
        ("", 0.0),
    ],
)
def test_reward_on_hand_made_programs(completion, reward):
    task = make_task("coding")
    assert task.reward(_square_problem(), completion) == reward


def test_demonstrations_score_one_on_every_family():
    task = make_task("coding", families=sorted(FAMILIES), num_tests=6)
    seen = set()
    for split in ("train", "eval"):
        for i in range(60):
            p = task.problem(split, i)
            seen.add(p.family)
            assert task.reward(p, task.demonstration(p)) == 1.0
            assert len(p.examples) == 3 and len(p.tests) == 6
            assert p.prompt.endswith("Program:\n")
    assert len(seen) >= len(FAMILIES) - 3


def test_interpreter_outputs_match_independent_reference_functions():
    task = make_task("coding", families=sorted(FAMILIES))
    for i in range(100):
        p = task.problem("train", i)
        fn = FAMILIES[p.family][3]
        for inputs, outputs in p.examples + p.tests:
            want = fn(*inputs, *p.constants)
            assert outputs == (want if isinstance(want, tuple) else (want,)), (p.solution, inputs)


def test_examples_shown_in_prompt_and_tests_hidden():
    task = make_task("coding", families=["affine"], num_examples=2, num_tests=5)
    p = task.problem("train", 0)
    for inputs, outputs in p.examples:
        assert f"{' '.join(map(str, inputs))} -> {' '.join(map(str, outputs))}\n" in p.prompt
    assert p.solution not in p.prompt


def test_deterministic_and_disjoint_splits():
    task = make_task("coding")
    assert [task.problem("eval", i) for i in range(10)] == [
        make_task("coding").problem("eval", i) for i in range(10)
    ]
    train = {task.problem("train", i).prompt for i in range(500)}
    evals = {task.problem("eval", i).prompt for i in range(100)}
    assert not train & evals


@pytest.mark.parametrize(
    ("knobs", "key"),
    [
        ({"families": ["nope"]}, "families"),
        ({"families": []}, "families"),
        ({"num_tests": 0}, "num_tests"),
        ({"max_steps": 0}, "max_steps"),
        ({"eval_fraction": 1.5}, "eval_fraction"),
    ],
)
def test_bad_knobs_raise_config_error_naming_the_key(knobs, key):
    with pytest.raises(ConfigError, match=key):
        make_task("coding", **knobs)


def test_reward_respects_step_limit():
    task = make_task("coding", max_steps=20)
    assert task.reward(_square_problem(), "100 times 1 drop end dup * .") == 0.0
