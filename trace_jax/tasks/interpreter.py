"""A small stack language ("stack") and its interpreter, with step, memory and output limits.

Model-written programs run here and nowhere else: never through Python ``exec``/``eval`` or a
shell. ``run_program`` never raises on any program text and never runs past its step limit;
every failure is a ``RunResult`` with an ``error`` message.

The language: a program is whitespace-separated words; the inputs are pushed on the stack
(first input deepest) before it runs; ``.`` pops a value and appends it to the output.

===========================  =============================================================
word                         effect (stack before -- after, top on the right)
===========================  =============================================================
``17``, ``-3``               push the integer
``+ - *``                    a b -- a+b, a-b, a*b
``/ %``                      a b -- a//b, a%b (floor division; b == 0 is an error)
``neg abs``                  a -- -a, |a|
``min max``                  a b -- min(a,b), max(a,b)
``= < >``                    a b -- 1 if a=b / a<b / a>b else 0
``dup drop swap over rot``   a -- a a;  a --;  a b -- b a;  a b -- a b a;  a b c -- b c a
``.``                        a -- (appends a to the output)
``if ... else ... end``      c -- (runs the first branch if c != 0, else the optional second)
``times ... end``            n -- (runs the body n times; n <= 0 runs it zero times)
``i``                        -- k (the 0-based iteration count of the innermost ``times``)
===========================  =============================================================

Limits (``Limits``): steps (words executed, jumps included), stack depth, absolute value of
every integer, number of output values, program length in characters and words.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from trace_jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Limits:
    """Attributes:
    max_steps: words executed (each loop iteration and jump counts) before a step-limit error.
    max_stack: stack depth limit.
    max_value: every integer on the stack (and every literal) must satisfy |v| <= max_value.
    max_output: number of values ``.`` may emit.
    max_chars: longest program text accepted.
    max_words: most words a program may contain.
    """

    max_steps: int = 1000
    max_stack: int = 64
    max_value: int = 10**9
    max_output: int = 16
    max_chars: int = 512
    max_words: int = 128

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{f.name}: must be a positive integer, got {v!r}")
        if self.max_value > 10**18:
            raise ConfigError(f"max_value: must be <= 1e18, got {self.max_value}")


@dataclasses.dataclass(frozen=True)
class RunResult:
    """Outcome of a run: the emitted values, and ``error`` (None on success)."""

    output: tuple[int, ...]
    error: str | None
    steps: int

    @property
    def ok(self) -> bool:
        return self.error is None


class StackError(Exception):
    """A parse or runtime error of a program (caught inside ``run``)."""


_BINARY = {"+", "-", "*", "/", "%", "min", "max", "=", "<", ">"}
_UNARY = {"neg", "abs"}
_STACK = {"dup", "drop", "swap", "over", "rot"}
_CONTROL = {"if", "else", "end", "times", "i", "."}
WORDS = frozenset(_BINARY | _UNARY | _STACK | _CONTROL)

# Compiled instructions: (opcode, argument). Jumps hold absolute targets.
_PUSH, _WORD, _JZ, _JMP, _LOOP_START, _LOOP_END, _INDEX = range(7)


def parse_int(word: str, limits: Limits) -> int | None:
    """The integer a literal word denotes, None if it is not a literal. ASCII digits only."""
    body = word[1:] if word[:1] == "-" else word
    if not body or not body.isascii() or not body.isdigit():
        return None
    if len(body) > 19:
        raise StackError(f"literal {word[:24]!r} is too large")
    value = int(word)
    if abs(value) > limits.max_value:
        raise StackError(f"literal {word} exceeds the value limit {limits.max_value}")
    return value


def compile_program(text: str, limits: Limits = Limits()) -> list[tuple[int, int | str]]:
    """Parse program text into flat instructions; raises StackError naming the bad word."""
    if not isinstance(text, str):
        raise StackError(f"program must be text, got {type(text).__name__}")
    if len(text) > limits.max_chars:
        raise StackError(f"program is {len(text)} characters; the limit is {limits.max_chars}")
    words = text.split()
    if len(words) > limits.max_words:
        raise StackError(f"program has {len(words)} words; the limit is {limits.max_words}")
    code: list[tuple[int, int | str]] = []
    open_blocks: list[tuple[str, int]] = []  # (kind, index of the instruction to patch)
    for pos, w in enumerate(words):
        literal = parse_int(w, limits)
        if literal is not None:
            code.append((_PUSH, literal))
        elif w == "if":
            open_blocks.append(("if", len(code)))
            code.append((_JZ, -1))
        elif w == "else":
            if not open_blocks or open_blocks[-1][0] != "if":
                raise StackError(f"word {pos}: 'else' without a matching 'if'")
            _, jz = open_blocks.pop()
            open_blocks.append(("else", len(code)))
            code.append((_JMP, -1))
            code[jz] = (_JZ, len(code))
        elif w == "times":
            open_blocks.append(("times", len(code)))
            code.append((_LOOP_START, -1))
        elif w == "end":
            if not open_blocks:
                raise StackError(f"word {pos}: 'end' without an open 'if' or 'times'")
            kind, at = open_blocks.pop()
            if kind == "times":
                code.append((_LOOP_END, at + 1))  # back to the body's first instruction
                code[at] = (_LOOP_START, len(code))  # zero iterations: skip past the end
            else:
                code[at] = (code[at][0], len(code))
        elif w == "i":
            if not any(kind == "times" for kind, _ in open_blocks):
                raise StackError(f"word {pos}: 'i' outside a 'times' loop")
            code.append((_INDEX, 0))
        elif w in WORDS:
            code.append((_WORD, w))
        else:
            shown = w if len(w) <= 24 else w[:24] + "..."
            raise StackError(f"word {pos}: unknown word {shown!r}")
    if open_blocks:
        raise StackError(f"'{open_blocks[-1][0]}' is not closed by 'end'")
    return code


def run_program(text: str, inputs: Sequence[int] = (), limits: Limits = Limits()) -> RunResult:
    """Run program ``text`` with ``inputs`` pushed first. Never raises; never exceeds limits."""
    try:
        code = compile_program(text, limits)
    except StackError as e:
        return RunResult((), f"parse error: {e}", 0)
    stack: list[int] = []
    output: list[int] = []
    loops: list[list[int]] = []  # [remaining, iteration] per active ``times``
    steps = 0
    pc = 0
    try:
        for v in inputs:
            _push(stack, int(v), limits)
        while pc < len(code):
            steps += 1
            if steps > limits.max_steps:
                raise StackError(f"step limit {limits.max_steps} reached")
            op, arg = code[pc]
            pc += 1
            if op == _PUSH:
                _push(stack, arg, limits)
            elif op == _WORD:
                _apply(arg, stack, output, limits)
            elif op == _JZ:
                if _pop(stack, "if") == 0:
                    pc = arg
            elif op == _JMP:
                pc = arg
            elif op == _LOOP_START:
                n = _pop(stack, "times")
                if n <= 0:
                    pc = arg
                else:
                    loops.append([n, 0])
            elif op == _LOOP_END:
                loop = loops[-1]
                loop[0] -= 1
                loop[1] += 1
                if loop[0] > 0:
                    pc = arg
                else:
                    loops.pop()
            elif op == _INDEX:
                _push(stack, loops[-1][1], limits)
    except StackError as e:
        return RunResult(tuple(output), f"runtime error: {e}", steps)
    return RunResult(tuple(output), None, steps)


def _push(stack: list[int], v: int, limits: Limits) -> None:
    if abs(v) > limits.max_value:
        raise StackError(f"value {_short(v)} exceeds the value limit {limits.max_value}")
    if len(stack) >= limits.max_stack:
        raise StackError(f"stack depth limit {limits.max_stack} reached")
    stack.append(v)


def _pop(stack: list[int], word: str) -> int:
    if not stack:
        raise StackError(f"'{word}' on an empty stack")
    return stack.pop()


def _short(v: int) -> str:
    s = str(v)
    return s if len(s) <= 24 else f"{s[:12]}...({len(s)} digits)"


def _apply(w: str, stack: list[int], output: list[int], limits: Limits) -> None:
    if w in _BINARY:
        if len(stack) < 2:
            raise StackError(f"'{w}' needs 2 values, the stack has {len(stack)}")
        b, a = stack.pop(), stack.pop()
        if w in "/%" and b == 0:
            raise StackError(f"'{w}' by zero")
        r = {
            "+": lambda: a + b,
            "-": lambda: a - b,
            "*": lambda: a * b,
            "/": lambda: a // b,
            "%": lambda: a % b,
            "min": lambda: min(a, b),
            "max": lambda: max(a, b),
            "=": lambda: int(a == b),
            "<": lambda: int(a < b),
            ">": lambda: int(a > b),
        }[w]()
        _push(stack, r, limits)
    elif w in _UNARY:
        a = _pop(stack, w)
        _push(stack, -a if w == "neg" else abs(a), limits)
    elif w == "dup":
        a = _pop(stack, w)
        stack.append(a)
        _push(stack, a, limits)
    elif w == "drop":
        _pop(stack, w)
    elif w == "swap":
        if len(stack) < 2:
            raise StackError(f"'swap' needs 2 values, the stack has {len(stack)}")
        stack[-1], stack[-2] = stack[-2], stack[-1]
    elif w == "over":
        if len(stack) < 2:
            raise StackError(f"'over' needs 2 values, the stack has {len(stack)}")
        _push(stack, stack[-2], limits)
    elif w == "rot":
        if len(stack) < 3:
            raise StackError(f"'rot' needs 3 values, the stack has {len(stack)}")
        stack.append(stack.pop(-3))
    elif w == ".":
        if len(output) >= limits.max_output:
            raise StackError(f"output limit {limits.max_output} reached")
        output.append(_pop(stack, "."))
    else:  # compile_program admits only known words
        raise StackError(f"unknown word {w!r}")
