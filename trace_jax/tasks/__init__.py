"""Verifiable tasks and environments, the tokenizer, and prompt streams.

    from trace_jax.tasks import TOKENIZER, make_task, prompt_stream

    task = make_task("reasoning", num_operands=2)
    problem = task.problem("train", 0)
    ids = TOKENIZER.prompt_ids(problem.prompt)          # BOS + prompt bytes
    reward = task.reward(problem, TOKENIZER.completion_text(sampled_ids))

Tasks: ``reasoning`` (arithmetic, ``Answer:`` line), ``countdown`` (reach a target),
``coding`` (stack-language programs run by
``interpreter``), ``gridworld`` / ``long_horizon`` (multi-turn), ``jsonl`` / ``gsm8k`` (a file).
A Hugging Face checkpoint's own tokenizer and chat template: ``trace_jax.tasks.hf_tokenizer``.
"""

from trace_jax.tasks import coding, gridworld, jsonl, reasoning  # noqa: F401  (registers tasks)
from trace_jax.tasks.base import (
    SPLITS,
    UNBOUNDED,
    Env,
    Problem,
    Split,
    Task,
    Turn,
    demonstration_tokens,
    episode_tokens,
    make_task,
    play_episode,
    task_names,
)
from trace_jax.tasks.coding import CodingConfig, CodingProblem, CodingTask
from trace_jax.tasks.data import eval_problems, prompt_dataset, prompt_stream
from trace_jax.tasks.gridworld import GridEnv, GridProblem, GridworldConfig, GridworldTask
from trace_jax.tasks.interpreter import Limits, RunResult, run_program
from trace_jax.tasks.jsonl import JsonlConfig, JsonlError, JsonlTask
from trace_jax.tasks.reasoning import (
    AnswerProblem,
    CountdownConfig,
    CountdownProblem,
    CountdownTask,
    ReasoningConfig,
    ReasoningTask,
    answer_reward,
)
from trace_jax.tasks.tokenizer import (
    BOS,
    EOS,
    EOT,
    PAD,
    TOKENIZER,
    ByteTokenizer,
    Tokenizer,
    TokenizerError,
)

__all__ = [
    "BOS",
    "EOS",
    "EOT",
    "PAD",
    "SPLITS",
    "TOKENIZER",
    "UNBOUNDED",
    "AnswerProblem",
    "ByteTokenizer",
    "CodingConfig",
    "CodingProblem",
    "CodingTask",
    "CountdownConfig",
    "CountdownProblem",
    "CountdownTask",
    "Env",
    "GridEnv",
    "GridProblem",
    "GridworldConfig",
    "GridworldTask",
    "JsonlConfig",
    "JsonlError",
    "JsonlTask",
    "Limits",
    "Problem",
    "ReasoningConfig",
    "ReasoningTask",
    "RunResult",
    "Split",
    "Task",
    "Tokenizer",
    "TokenizerError",
    "Turn",
    "answer_reward",
    "demonstration_tokens",
    "episode_tokens",
    "eval_problems",
    "make_task",
    "play_episode",
    "prompt_dataset",
    "prompt_stream",
    "run_program",
    "task_names",
]
