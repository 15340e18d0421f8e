"""Multi-step arithmetic with a required answer format, and the answer-match reward.

A problem is an expression such as ``3+4*2``; the prompt is ``"Compute: 3+4*2\\n"``. The
demonstration reduces one operation per step (multiplication first, then left to right) and
ends with the answer line::

    3+4*2=3+8=11
    Answer: 11

A single-operation problem's demonstration is the answer line alone (``Answer: 7``): a worked
line would only repeat the prompt, and the short form is what a tiny model learns fastest.

Reward: 1 if the completion ends with ``Answer: <value>`` and the value equals the problem's
answer; ``format_reward`` if it ends with a well-formed ``Answer: <number>`` that is wrong;
0 otherwise. The easiest setting (the default: two operands in 0-9, addition) is learnable by a
model of a few million parameters within a few hundred RL steps.
"""

from __future__ import annotations

import dataclasses
import random
import re
from decimal import Decimal, InvalidOperation

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

ANSWER_PREFIX = "Answer:"
_OPS = ("+", "-", "*")


@dataclasses.dataclass(frozen=True)
class AnswerProblem(Problem):
    """A problem graded by matching the final answer.

    Attributes:
      answer: the reference answer, e.g. ``"42"``.
      solution: worked steps written before the answer line (may be empty).
    """

    answer: str
    solution: str


def parse_answer(completion: str) -> str | None:
    """The text after ``Answer:`` on the last non-blank line, None if that line is no answer.

    The answer line must end the completion (trailing whitespace allowed); linear time.
    """
    last = completion.rstrip().rsplit("\n", 1)[-1].lstrip(" \t")
    if not last.startswith(ANSWER_PREFIX):
        return None
    return last[len(ANSWER_PREFIX) :].strip()


def normalize_number(text: str) -> Decimal | None:
    """``"1,234"``, ``"$5"``, ``"3.50"``, ``"-7."`` -> Decimal; None if not a number."""
    t = text.strip().replace(",", "").removeprefix("$").rstrip(".")
    if not re.fullmatch(r"[-+]?\d+(\.\d+)?", t) or len(t) > 64:
        return None
    try:
        return Decimal(t)
    except InvalidOperation:
        return None


def answer_reward(completion: str, answer: str, format_reward: float = 0.0) -> float:
    """1.0 for a matching final answer, ``format_reward`` for a well-formed wrong one, else 0.

    Numbers compare by value (``"1,000"`` == ``"1000.0"``); other answers compare as stripped
    strings.
    """
    got = parse_answer(completion)
    if got is None:
        return 0.0
    want_num, got_num = normalize_number(answer), normalize_number(got)
    if want_num is not None:
        if got_num is None:
            return 0.0
        return 1.0 if got_num == want_num else format_reward
    return 1.0 if got.strip() == answer.strip() else format_reward


def answer_demonstration(problem: AnswerProblem) -> str:
    answer_line = f"{ANSWER_PREFIX} {problem.answer}"
    return f"{problem.solution}\n{answer_line}" if problem.solution else answer_line


@dataclasses.dataclass(frozen=True)
class ReasoningConfig:
    """Attributes:
    num_operands: operands per expression (2-8); steps = num_operands - 1.
    min_operands: if set, the operand count is drawn uniformly from [min_operands,
      num_operands] (a mixed-difficulty curriculum); None: always ``num_operands``.
    max_value: operands are drawn from [0, max_value].
    ops: operators to draw from, a subset of ``+ - *``.
    format_reward: reward for a well-formed but wrong answer, in [0, 1).
    show_steps: demonstrations of multi-operation problems write the reductions before the
      answer line (False: the answer line only).
    eval_fraction: share of the problem space held out for eval (by content hash).
    eval_size: number of eval problems (indices 0..eval_size-1; small spaces repeat).
    seed: the problem set's seed (the stream order has its own seed).
    """

    num_operands: int = 2
    min_operands: int | None = None
    max_value: int = 9
    ops: tuple[str, ...] = ("+",)
    format_reward: float = 0.0
    show_steps: bool = True
    eval_fraction: float = 0.1
    eval_size: int = 256
    seed: int = 0

    def __post_init__(self):
        require(
            2 <= self.num_operands <= 8,
            "num_operands",
            f"must be in [2, 8], got {self.num_operands}",
        )
        if self.min_operands is not None:
            require(
                2 <= self.min_operands <= self.num_operands,
                "min_operands",
                f"must be in [2, num_operands={self.num_operands}], got {self.min_operands}",
            )
        require(
            1 <= self.max_value <= 10**6, "max_value", f"must be in [1, 1e6], got {self.max_value}"
        )
        require(len(self.ops) > 0, "ops", "must name at least one operator")
        for op in self.ops:
            require(op in _OPS, "ops", f"{op!r} is not one of {list(_OPS)}")
        require(
            0.0 <= self.format_reward < 1.0,
            "format_reward",
            f"must be in [0, 1), got {self.format_reward}",
        )
        check_eval_fraction(self.eval_fraction)
        require(self.eval_size >= 1, "eval_size", f"must be >= 1, got {self.eval_size}")


def reduction_steps(operands: list[int], ops: list[str]) -> list[str]:
    """The expression after each single-operation reduction (``*`` first, then left to right).

    ``[3, 4, 2], ["+", "*"]`` -> ``["3+4*2", "3+8", "11"]``.
    """
    nums, ops = list(operands), list(ops)
    steps = [render(nums, ops)]
    while ops:
        i = ops.index("*") if "*" in ops else 0
        a, b, op = nums[i], nums[i + 1], ops[i]
        value = a * b if op == "*" else a + b if op == "+" else a - b
        nums[i : i + 2] = [value]
        del ops[i]
        steps.append(render(nums, ops))
    return steps


def render(nums: list[int], ops: list[str]) -> str:
    out = str(nums[0])
    for op, n in zip(ops, nums[1:], strict=True):
        out += f"{op}{n}"
    return out


@register_task("reasoning", "arithmetic", config=ReasoningConfig)
class ReasoningTask:
    """Multi-step arithmetic with an ``Answer:`` line; see the module docstring."""

    name = "reasoning"
    multi_turn = False

    def __init__(self, config: ReasoningConfig = ReasoningConfig()):
        self.config = config

    def num_problems(self, split: Split) -> int:
        return UNBOUNDED if check_split(split) == "train" else self.config.eval_size

    def problem(self, split: Split, index: int) -> AnswerProblem:
        c = self.config
        index = check_index(index, self.num_problems(check_split(split)), split)

        def generate(rng: random.Random):
            n = rng.randint(c.min_operands, c.num_operands) if c.min_operands else c.num_operands
            nums = [rng.randint(0, c.max_value) for _ in range(n)]
            ops = [rng.choice(c.ops) for _ in range(n - 1)]
            return render(nums, ops), (nums, ops)

        nums, ops = draw_in_split(
            generate,
            task=self.name,
            seed=c.seed,
            split=split,
            index=index,
            eval_fraction=c.eval_fraction,
        )
        steps = reduction_steps(nums, ops)
        return AnswerProblem(
            id=f"{self.name}/{split}/{index}",
            prompt=f"Compute: {steps[0]}\n",
            answer=steps[-1],
            solution="=".join(steps) if c.show_steps and len(steps) > 2 else "",
        )

    def reward(self, problem: AnswerProblem, completion: str) -> float:
        return answer_reward(completion, problem.answer, self.config.format_reward)

    def demonstration(self, problem: AnswerProblem) -> str:
        return answer_demonstration(problem)

    def demonstration_turns(self, problem: AnswerProblem) -> list[Turn]:
        return [Turn("policy", self.demonstration(problem))]

    def env(self, problem: Problem) -> None:
        return None


# --- countdown: reach a target with given numbers -------------------------------------------

_EXPR_TOKEN = re.compile(r"\d+|[-+*()]|\S")
_MAX_EXPR_CHARS = 256
_MAX_EXPR_DEPTH = 16


def evaluate_expression(text: str) -> tuple[int, list[int]] | None:
    """Value and literals of an expression over non-negative integers with ``+ - * ( )``.

    Usual precedence, no unary minus. Returns None for anything else (never Python ``eval``):
    unknown characters, bad syntax, more than 256 characters or nesting deeper than 16.
    """
    if len(text) > _MAX_EXPR_CHARS:
        return None
    tokens = _EXPR_TOKEN.findall(text)
    literals: list[int] = []
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def expr(depth: int) -> int:
        nonlocal pos
        value = term(depth)
        while peek() in ("+", "-"):
            op = tokens[pos]
            pos += 1
            rhs = term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(depth: int) -> int:
        nonlocal pos
        value = factor(depth)
        while peek() == "*":
            pos += 1
            value *= factor(depth)
        return value

    def factor(depth: int) -> int:
        nonlocal pos
        tok = peek()
        if tok is None:
            raise ValueError("unexpected end")
        pos += 1
        if tok == "(":
            if depth >= _MAX_EXPR_DEPTH:
                raise ValueError("nested too deeply")
            value = expr(depth + 1)
            if peek() != ")":
                raise ValueError("missing ')'")
            pos += 1
            return value
        if tok.isascii() and tok.isdigit():
            literals.append(int(tok))
            return literals[-1]
        raise ValueError(f"unexpected {tok!r}")

    try:
        value = expr(0)
    except ValueError:
        return None
    if pos != len(tokens) or not tokens:
        return None
    return value, literals


@dataclasses.dataclass(frozen=True)
class CountdownProblem(Problem):
    """Attributes:
    numbers: the numbers to combine, each used exactly once.
    target: the value to reach.
    solution: a reference expression, e.g. ``"(3+5)*2"``.
    steps: the reference's worked steps, one operation per line.
    """

    numbers: tuple[int, ...]
    target: int
    solution: str
    steps: str


@dataclasses.dataclass(frozen=True)
class CountdownConfig:
    """Attributes:
    num_numbers: numbers per problem (2-6), each to be used exactly once.
    max_value: numbers are drawn from [1, max_value].
    ops: operators to draw the reference solution from (subset of ``+ - *``).
    format_reward: reward for an answer expression that parses but misses, in [0, 1).
    eval_fraction, eval_size, seed: as in ``ReasoningConfig``.
    """

    num_numbers: int = 3
    max_value: int = 9
    ops: tuple[str, ...] = ("+", "-", "*")
    format_reward: float = 0.0
    eval_fraction: float = 0.1
    eval_size: int = 256
    seed: int = 0

    def __post_init__(self):
        require(
            2 <= self.num_numbers <= 6, "num_numbers", f"must be in [2, 6], got {self.num_numbers}"
        )
        require(
            1 <= self.max_value <= 1000, "max_value", f"must be in [1, 1000], got {self.max_value}"
        )
        require(len(self.ops) > 0, "ops", "must name at least one operator")
        for op in self.ops:
            require(op in _OPS, "ops", f"{op!r} is not one of {list(_OPS)}")
        require(
            0.0 <= self.format_reward < 1.0,
            "format_reward",
            f"must be in [0, 1), got {self.format_reward}",
        )
        check_eval_fraction(self.eval_fraction)
        require(self.eval_size >= 1, "eval_size", f"must be >= 1, got {self.eval_size}")


@register_task("countdown", config=CountdownConfig)
class CountdownTask:
    """Combine the given numbers with ``+ - *`` and parentheses to reach a target.

    Prompt ``"Use 3 5 2 to make 16.\\n"``; demonstration::

        3+5=8
        8*2=16
        Answer: (3+5)*2

    Reward 1 if the final answer is an expression using each given number exactly once and
    evaluating to the target (any such expression counts), ``format_reward`` if it parses but
    misses, else 0.
    """

    name = "countdown"
    multi_turn = False

    def __init__(self, config: CountdownConfig = CountdownConfig()):
        self.config = config

    def num_problems(self, split: Split) -> int:
        return UNBOUNDED if check_split(split) == "train" else self.config.eval_size

    def problem(self, split: Split, index: int) -> CountdownProblem:
        c = self.config
        index = check_index(index, self.num_problems(check_split(split)), split)

        def generate(rng: random.Random):
            nums = [rng.randint(1, c.max_value) for _ in range(c.num_numbers)]
            expr, value, additive, lines = str(nums[0]), nums[0], False, []
            for n in nums[1:]:
                op = rng.choice(c.ops)
                new = value * n if op == "*" else value + n if op == "+" else value - n
                lines.append(f"{value}{op}{n}={new}")
                if op == "*" and additive:
                    expr = f"({expr})"
                expr, value, additive = f"{expr}{op}{n}", new, op != "*"
            shown = sorted(nums)
            key = f"{shown}->{value}"
            return key, (tuple(shown), value, expr, "\n".join(lines))

        numbers, target, solution, steps = draw_in_split(
            generate,
            task=self.name,
            seed=c.seed,
            split=split,
            index=index,
            eval_fraction=c.eval_fraction,
        )
        return CountdownProblem(
            id=f"{self.name}/{split}/{index}",
            prompt=f"Use {' '.join(map(str, numbers))} to make {target}.\n",
            numbers=numbers,
            target=target,
            solution=solution,
            steps=steps,
        )

    def reward(self, problem: CountdownProblem, completion: str) -> float:
        answer = parse_answer(completion)
        result = None if answer is None else evaluate_expression(answer)
        if result is None:
            return 0.0
        value, literals = result
        ok = value == problem.target and sorted(literals) == sorted(problem.numbers)
        return 1.0 if ok else self.config.format_reward

    def demonstration(self, problem: CountdownProblem) -> str:
        return f"{problem.steps}\n{ANSWER_PREFIX} {problem.solution}"

    def demonstration_turns(self, problem: CountdownProblem) -> list[Turn]:
        return [Turn("policy", self.demonstration(problem))]

    def env(self, problem: Problem) -> None:
        return None
