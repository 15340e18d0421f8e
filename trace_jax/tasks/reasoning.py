"""Multi-step arithmetic with a required answer format, and the answer-match reward.

A problem is an expression such as ``3+4*2``; the prompt is ``"Compute: 3+4*2\\n"``. The
demonstration reduces one operation per step (multiplication first, then left to right) and
ends with the answer line::

    3+4*2=3+8=11
    Answer: 11

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
# The answer line must end the completion (trailing whitespace allowed).
_ANSWER_LINE = re.compile(r"(?:^|\n)[ \t]*Answer:[ \t]*([^\n]*?)\s*\Z")
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
    """The text after the final ``Answer:`` if it ends the completion, else None."""
    m = _ANSWER_LINE.search(completion)
    return m.group(1) if m else None


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
    eval_fraction: share of the problem space held out for eval (by content hash).
    eval_size: number of eval problems (indices 0..eval_size-1; small spaces repeat).
    seed: the problem set's seed (the stream order has its own seed).
    """

    num_operands: int = 2
    min_operands: int | None = None
    max_value: int = 9
    ops: tuple[str, ...] = ("+",)
    format_reward: float = 0.0
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
            solution="=".join(steps),
        )

    def reward(self, problem: AnswerProblem, completion: str) -> float:
        return answer_reward(completion, problem.answer, self.config.format_reward)

    def demonstration(self, problem: AnswerProblem) -> str:
        return answer_demonstration(problem)

    def demonstration_turns(self, problem: AnswerProblem) -> list[Turn]:
        return [Turn("policy", self.demonstration(problem))]

    def env(self, problem: Problem) -> None:
        return None
