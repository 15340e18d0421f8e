"""Program synthesis in the project's stack language (``trace_jax.tasks.interpreter``).

A problem is a hidden function from a family (``x*a+b``, ``x*x``, ``max(x, y)``, ...). The
prompt shows input -> output examples; the completion is a program, e.g.::

    Write a stack program.
    3 -> 10
    5 -> 16
    Program:

    3 * 1 + .

The program runs on each hidden test input (inputs pushed on the stack, ``.`` emits) under the
interpreter's limits; reward = fraction of hidden tests whose output equals the expected output
exactly. A program that fails to parse scores 0. Model text is only ever run by the interpreter.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from trace_jax.tasks import interpreter
from trace_jax.tasks.base import (
    UNBOUNDED,
    Problem,
    Split,
    Turn,
    check_eval_fraction,
    check_index,
    check_split,
    draw_in_split,
    register_task,
    require,
)

# family -> (number of inputs, constant ranges, reference program template, reference function
# (an int, or a tuple for several outputs), an independent check of the interpreter).
# Templates use {a}, {b}; inputs are drawn from [-max_input, max_input] unless ``positive``.
_Family = tuple[int, tuple[tuple[int, int], ...], str, Callable[..., int]]
FAMILIES: dict[str, _Family] = {
    "add_const": (1, ((1, 9),), "{a} + .", lambda x, a: x + a),
    "mul_const": (1, ((2, 9),), "{a} * .", lambda x, a: x * a),
    "affine": (1, ((2, 9), (1, 9)), "{a} * {b} + .", lambda x, a, b: x * a + b),
    "square": (1, (), "dup * .", lambda x: x * x),
    "square_add": (1, ((1, 9),), "dup * {a} + .", lambda x, a: x * x + a),
    "cube": (1, (), "dup dup * * .", lambda x: x * x * x),
    "abs": (1, (), "abs .", abs),
    "mod_const": (1, ((2, 9),), "{a} % .", lambda x, a: x % a),
    "greater": (1, ((0, 9),), "{a} > .", lambda x, a: int(x > a)),
    "sum2": (2, (), "+ .", lambda x, y: x + y),
    "diff2": (2, (), "- .", lambda x, y: x - y),
    "prod2": (2, (), "* .", lambda x, y: x * y),
    "max2": (2, (), "max .", max),
    "absdiff2": (2, (), "- abs .", lambda x, y: abs(x - y)),
    "sum_sq2": (2, (), "dup * swap dup * + .", lambda x, y: x * x + y * y),
    "double_times": (1, ((1, 4),), "{a} times 2 * end .", lambda x, a: x * 2**a),
    "count_up": (1, ((1, 5),), "drop {a} times i . end", lambda x, a: tuple(range(a))),
}
EASY_FAMILIES = ("add_const", "mul_const", "square", "sum2", "diff2", "max2")
PROMPT_HEADER = "Write a stack program.\n"
PROMPT_FOOTER = "Program:\n"


@dataclasses.dataclass(frozen=True)
class CodingProblem(Problem):
    """Attributes:
    family: the function family's name.
    constants: the family's constants (``a``, ``b``) in this problem.
    examples: (inputs, outputs) pairs shown in the prompt.
    tests: hidden (inputs, outputs) pairs the reward runs.
    solution: a reference program that passes every example and test.
    """

    family: str
    constants: tuple[int, ...]
    examples: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    tests: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    solution: str


@dataclasses.dataclass(frozen=True)
class CodingConfig:
    """Attributes:
    families: function families to draw from (names in ``coding.FAMILIES``).
    num_examples: input -> output pairs shown in the prompt.
    num_tests: hidden test cases the reward runs.
    max_input: test inputs are drawn from [-max_input, max_input].
    max_steps, max_stack, max_value, max_output: interpreter limits per test run.
    eval_fraction: share of the problem space held out for eval (by content hash).
    eval_size: number of eval problems.
    seed: the problem set's seed.
    """

    families: tuple[str, ...] = EASY_FAMILIES
    num_examples: int = 3
    num_tests: int = 8
    max_input: int = 9
    max_steps: int = 500
    max_stack: int = 32
    max_value: int = 10**9
    max_output: int = 16
    eval_fraction: float = 0.2
    eval_size: int = 128
    seed: int = 0

    def __post_init__(self):
        require(len(self.families) > 0, "families", "must name at least one family")
        for f in self.families:
            require(f in FAMILIES, "families", f"unknown family {f!r}; known: {sorted(FAMILIES)}")
        require(
            1 <= self.num_examples <= 16,
            "num_examples",
            f"must be in [1, 16], got {self.num_examples}",
        )
        require(1 <= self.num_tests <= 64, "num_tests", f"must be in [1, 64], got {self.num_tests}")
        require(
            1 <= self.max_input <= 10**4, "max_input", f"must be in [1, 1e4], got {self.max_input}"
        )
        check_eval_fraction(self.eval_fraction)
        require(self.eval_size >= 1, "eval_size", f"must be >= 1, got {self.eval_size}")
        self.limits  # validates the interpreter limits  # noqa: B018

    @property
    def limits(self) -> interpreter.Limits:
        return interpreter.Limits(
            max_steps=self.max_steps,
            max_stack=self.max_stack,
            max_value=self.max_value,
            max_output=self.max_output,
        )


def format_case(inputs: tuple[int, ...], outputs: tuple[int, ...]) -> str:
    return f"{' '.join(map(str, inputs))} -> {' '.join(map(str, outputs))}"


@register_task("coding", config=CodingConfig)
class CodingTask:
    """Write a stack-language program matching examples; see the module docstring."""

    name = "coding"
    multi_turn = False

    def __init__(self, config: CodingConfig = CodingConfig()):
        self.config = config
        self.limits = config.limits

    def num_problems(self, split: Split) -> int:
        return UNBOUNDED if check_split(split) == "train" else self.config.eval_size

    def problem(self, split: Split, index: int) -> CodingProblem:
        c = self.config
        index = check_index(index, self.num_problems(check_split(split)), split)

        def generate(rng: random.Random):
            family = rng.choice(c.families)
            _, ranges, template, _ = FAMILIES[family]
            constants = tuple(rng.randint(lo, hi) for lo, hi in ranges)
            solution = template.format(**dict(zip("ab", constants, strict=False)))
            cases = self._cases(family, solution, rng)
            examples = cases[: c.num_examples]
            lines = [PROMPT_HEADER, *(format_case(i, o) + "\n" for i, o in examples)]
            prompt = "".join([*lines, PROMPT_FOOTER])
            return prompt, (family, constants, solution, prompt, cases)

        # Train and eval are disjoint as prompts (a function may appear in both with other
        # examples).
        family, constants, solution, prompt, cases = draw_in_split(
            generate,
            task=self.name,
            seed=c.seed,
            split=split,
            index=index,
            eval_fraction=c.eval_fraction,
        )
        return CodingProblem(
            id=f"{self.name}/{split}/{index}",
            prompt=prompt,
            family=family,
            constants=constants,
            examples=cases[: c.num_examples],
            tests=cases[c.num_examples :],
            solution=solution,
        )

    def _cases(self, family: str, solution: str, rng: random.Random):
        """Examples then hidden tests: distinct inputs where the input space allows."""
        c = self.config
        arity = FAMILIES[family][0]
        want = c.num_examples + c.num_tests
        cases, seen = [], set()
        for attempt in range(20 * want):
            inputs = tuple(rng.randint(-c.max_input, c.max_input) for _ in range(arity))
            if inputs in seen and attempt < 10 * want:
                continue
            result = interpreter.run_program(solution, inputs, self.limits)
            if not result.ok:  # e.g. a value over the limit: draw another input
                continue
            seen.add(inputs)
            cases.append((inputs, result.output))
            if len(cases) == want:
                return tuple(cases)
        raise RuntimeError(f"coding: could not draw test inputs for {solution!r} within limits")

    def reward(self, problem: CodingProblem, completion: str) -> float:
        """Fraction of hidden tests passed; a program that does not parse scores 0."""
        try:
            interpreter.compile_program(completion, self.limits)
        except interpreter.StackError:
            return 0.0
        passed = 0
        for inputs, outputs in problem.tests:
            result = interpreter.run_program(completion, inputs, self.limits)
            passed += result.ok and result.output == outputs
        return passed / len(problem.tests)

    def demonstration(self, problem: CodingProblem) -> str:
        return problem.solution

    def demonstration_turns(self, problem: CodingProblem) -> list[Turn]:
        return [Turn("policy", problem.solution)]

    def env(self, problem: Problem) -> None:
        return None
