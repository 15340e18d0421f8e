"""The common interface of tasks: problems, rewards, demonstrations, environments, a registry.

A task is an object with::

    name: str                  # registered name
    multi_turn: bool           # True: the policy talks to ``env(problem)`` turn by turn
    config                     # its frozen config dataclass
    problem(split, index) -> Problem        # deterministic in (config, split, index)
    num_problems(split) -> int              # size of the split (procedural train splits: 2**31-1)
    reward(problem, completion) -> float    # in [0, 1]
    demonstration(problem) -> str           # a completion with reward 1
    demonstration_turns(problem) -> list[Turn]
    env(problem) -> Env | None              # None for single-turn tasks

Train and eval problems are disjoint by content: a problem's split is a hash of its canonical
key (``split_of``), and ``problem(split, index)`` draws candidates until one falls in ``split``.

Tasks are built by name from keyword knobs, type-checked against the task's config dataclass::

    task = make_task("reasoning", num_operands=3, ops=["+", "-"])
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from trace_jax.config import ConfigError, from_dict
from trace_jax.tasks.tokenizer import TOKENIZER, Tokenizer

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")
UNBOUNDED = 2**31 - 1  # nominal size of a procedurally generated train split


@dataclasses.dataclass(frozen=True)
class Problem:
    """One prompt of a task. Tasks subclass it with their own (hashable) data fields.

    Attributes:
      id: unique within the task, e.g. ``"reasoning/train/17"``.
      prompt: the text the policy continues (after BOS).
    """

    id: str
    prompt: str


@dataclasses.dataclass(frozen=True)
class Turn:
    """One segment of an episode after the prompt: the policy's text or the environment's."""

    role: Literal["policy", "env"]
    text: str


@runtime_checkable
class Env(Protocol):
    """A multi-turn environment. The prompt already holds the initial observation."""

    max_turns: int

    def reset(self, problem: Problem) -> str:
        """Start an episode of ``problem``; returns the initial observation (the prompt's tail)."""
        ...

    def step(self, action: str) -> tuple[str, bool, float]:
        """Apply one policy turn; returns (observation text to append, done, reward).

        The reward is 0 before ``done``; the episode's reward comes with ``done=True``.
        """
        ...


@runtime_checkable
class Task(Protocol):
    name: str
    multi_turn: bool
    config: Any

    def problem(self, split: Split, index: int) -> Problem: ...
    def num_problems(self, split: Split) -> int: ...
    def reward(self, problem: Problem, completion: str) -> float: ...
    def demonstration(self, problem: Problem) -> str: ...
    def demonstration_turns(self, problem: Problem) -> list[Turn]: ...
    def env(self, problem: Problem) -> Env | None: ...


# --- deterministic generation -------------------------------------------------------------


def stable_hash(*parts: object) -> int:
    """A 64-bit hash of ``repr(parts)`` that is the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def split_of(key: str, eval_fraction: float, salt: object = 0) -> Split:
    """The split a problem with canonical ``key`` belongs to (fraction ``eval_fraction`` eval)."""
    return "eval" if stable_hash("split", salt, key) % 1_000_000 < eval_fraction * 1e6 else "train"


def check_split(split: str) -> Split:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return split  # type: ignore[return-value]


def check_index(index: int, size: int, split: str) -> int:
    if not isinstance(index, int | np.integer) or isinstance(index, bool):
        raise TypeError(f"problem index must be an int, got {index!r}")
    if not 0 <= index < size:
        raise IndexError(f"problem index {index} outside the {split} split of size {size}")
    return int(index)


def draw_in_split[P](
    generate: Callable[[random.Random], tuple[str, P]],
    *,
    task: str,
    seed: int,
    split: Split,
    index: int,
    eval_fraction: float,
    max_attempts: int = 10_000,
) -> P:
    """Draw ``generate(rng) -> (key, value)`` until ``key`` falls in ``split``; deterministic."""
    for attempt in range(max_attempts):
        rng = random.Random(stable_hash(task, seed, split, index, attempt))
        key, value = generate(rng)
        if split_of(key, eval_fraction, salt=(task, seed)) == split:
            return value
    raise RuntimeError(
        f"{task}: no {split} problem in {max_attempts} draws; the problem space is too small "
        f"for eval_fraction={eval_fraction}"
    )


# --- config validation --------------------------------------------------------------------


def require(ok: bool, key: str, message: str) -> None:
    """Raise ConfigError naming ``key`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


def check_eval_fraction(value: float, key: str = "eval_fraction") -> None:
    require(0.0 < value < 1.0, key, f"must be in (0, 1), got {value!r}")


# --- token layout for warm start ----------------------------------------------------------


def episode_tokens(
    prompt: str,
    turns: Sequence[Turn],
    *,
    multi_turn: bool,
    tokenizer: Tokenizer = TOKENIZER,
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and loss mask of a whole episode, in ``tokenizer``'s render.

    Layout: ``prompt_ids(prompt)`` then each turn; a policy turn is its text followed by
    ``end_of_turn(multi_turn)`` (byte tokenizer: ``BOS prompt``, turns ended by ``EOT`` or
    ``EOS``), an environment turn is ``observation_ids(text)`` (in a chat template: the
    observation's turn and the opening of the policy's next one). The mask is True on policy
    tokens and their terminator only.

    Returns:
      ids: [n] int32; loss_mask: [n] bool.
    """
    ids = tokenizer.prompt_ids(prompt)
    mask = [False] * len(ids)
    stop = tokenizer.end_of_turn(multi_turn)
    for turn in turns:
        if turn.role == "policy":
            t = [*tokenizer.encode(turn.text), stop]
        else:
            t = tokenizer.observation_ids(turn.text)
        ids.extend(t)
        mask.extend([turn.role == "policy"] * len(t))
    return np.asarray(ids, np.int32), np.asarray(mask, np.bool_)


def demonstration_tokens(
    task: Task, problem: Problem, tokenizer: Tokenizer = TOKENIZER
) -> tuple[np.ndarray, np.ndarray]:
    """``episode_tokens`` of the task's demonstration: supervised warm-start data."""
    return episode_tokens(
        problem.prompt,
        task.demonstration_turns(problem),
        multi_turn=task.multi_turn,
        tokenizer=tokenizer,
    )


def play_episode(
    task: Task, problem: Problem, act: Callable[[str], str]
) -> tuple[list[Turn], float]:
    """Run a multi-turn episode with a text policy ``act(transcript_so_far) -> action``.

    A plain-Python reference of the rollout loop (the RL loop does the same on tokens).
    Returns the turns (policy and env alternating) and the final reward.
    """
    env = task.env(problem)
    if env is None:
        raise ValueError(f"task {task.name!r} is single-turn; it has no environment")
    env.reset(problem)
    text, turns = problem.prompt, []
    for _ in range(env.max_turns):
        action = act(text)
        obs, done, reward = env.step(action)
        turns += [Turn("policy", action), Turn("env", obs)]
        text += action + obs
        if done:
            return turns, reward
    raise RuntimeError(f"environment of {problem.id} did not finish within {env.max_turns} turns")


# --- registry -----------------------------------------------------------------------------

_REGISTRY: dict[str, tuple[type, type]] = {}


def register_task(*names: str, config: type) -> Callable[[type], type]:
    """Class decorator: register a task class under ``names`` with its config dataclass."""

    def wrap(cls: type) -> type:
        for n in names:
            _REGISTRY[n] = (cls, config)
        return cls

    return wrap


def task_names() -> list[str]:
    return sorted(_REGISTRY)


def make_task(name: str, **knobs: Any) -> Task:
    """Build a registered task from keyword knobs (type-checked; ConfigError names a bad key)."""
    if name not in _REGISTRY:
        raise ConfigError(f"task.name: unknown task {name!r}; known: {', '.join(task_names())}")
    cls, config_cls = _REGISTRY[name]
    return cls(from_dict(config_cls, knobs))
