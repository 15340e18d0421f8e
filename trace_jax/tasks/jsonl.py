"""Reasoning problems from a GSM8K-form JSONL file: ``{"question": ..., "answer": "... #### 42"}``.

Each line is one record. The text after the last ``####`` is the final answer; the text before
it is the worked solution (GSM8K's ``<<48/2=24>>`` calculator annotations are removed). The
prompt is the question plus a newline; grading, demonstrations and the answer format are the
reasoning task's (``Answer: 42`` on the last line; see ``trace_jax.tasks.reasoning``).

The eval split is ``eval_path`` if given, else a content-hash share (``eval_fraction``) of
``path``. A malformed record raises ``JsonlError`` naming the file and line.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from trace_jax.config import ConfigError
from trace_jax.tasks.base import (
    Problem,
    Split,
    Turn,
    check_eval_fraction,
    check_index,
    check_split,
    register_task,
    require,
    split_of,
)
from trace_jax.tasks.reasoning import (
    AnswerProblem,
    answer_demonstration,
    answer_reward,
)
from trace_jax.tasks.tokenizer import TOKENIZER, TokenizerError

_CALCULATOR = re.compile(r"<<[^<>]*>>")


class JsonlError(ValueError):
    """A JSONL record is malformed; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class JsonlConfig:
    """Attributes:
    path: the JSONL file (GSM8K form).
    eval_path: a separate eval file; None: hold out ``eval_fraction`` of ``path``.
    eval_fraction: share of ``path`` held out for eval when ``eval_path`` is None.
    question_key: the record's question field.
    answer_key: the record's answer field.
    format_reward: reward for a well-formed but wrong answer, in [0, 1).
    max_records: read at most this many records per file (None: all).
    """

    path: str
    eval_path: str | None = None
    eval_fraction: float = 0.1
    question_key: str = "question"
    answer_key: str = "answer"
    format_reward: float = 0.0
    max_records: int | None = None

    def __post_init__(self):
        require(bool(self.path), "path", "must name a JSONL file")
        for key in ("path", "eval_path"):
            p = getattr(self, key)
            if p is not None and not Path(p).is_file():
                raise ConfigError(f"{key}: file {p} does not exist")
        if self.eval_path is None:
            check_eval_fraction(self.eval_fraction)
        require(
            0.0 <= self.format_reward < 1.0,
            "format_reward",
            f"must be in [0, 1), got {self.format_reward}",
        )
        if self.max_records is not None:
            require(self.max_records >= 1, "max_records", f"must be >= 1, got {self.max_records}")


def split_answer(answer: str) -> tuple[str, str]:
    """``"She has 3+4=<<3+4=7>>7.\\n#### 7"`` -> (``"She has 3+4=7."``, ``"7"``)."""
    if "####" not in answer:
        raise ValueError("answer has no '#### <final answer>'")
    solution, final = answer.rsplit("####", 1)
    final = final.strip().replace(",", "")
    if not final or "\n" in final:
        raise ValueError("the final answer after '####' is empty or spans lines")
    return _CALCULATOR.sub("", solution).strip(), final


def load_records(
    path: str | Path,
    *,
    question_key: str = "question",
    answer_key: str = "answer",
    max_records: int | None = None,
) -> list[tuple[str, str, str]]:
    """(question, solution, final answer) per record; JsonlError names file and line."""
    path = Path(path)
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise JsonlError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise JsonlError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            for key in (question_key, answer_key):
                if not isinstance(rec.get(key), str):
                    raise JsonlError(f"{where}: field {key!r} missing or not a string")
            try:
                solution, final = split_answer(rec[answer_key])
                for text in (rec[question_key], solution, final):
                    TOKENIZER.encode(text)
            except (ValueError, TokenizerError) as e:
                raise JsonlError(f"{where}: {e}") from None
            out.append((rec[question_key].strip(), solution, final))
            if max_records is not None and len(out) >= max_records:
                break
    if not out:
        raise JsonlError(f"{path}: no records")
    return out


@register_task("jsonl", "gsm8k", config=JsonlConfig)
class JsonlTask:
    """GSM8K-form JSONL problems graded like the reasoning task; see the module docstring."""

    name = "jsonl"
    multi_turn = False

    def __init__(self, config: JsonlConfig):
        self.config = config
        c = config
        kw = dict(question_key=c.question_key, answer_key=c.answer_key, max_records=c.max_records)
        records = load_records(c.path, **kw)
        if c.eval_path is not None:
            self._records = {"train": records, "eval": load_records(c.eval_path, **kw)}
        else:
            salt = ("jsonl", Path(c.path).name)
            self._records = {
                s: [r for r in records if split_of(r[0], c.eval_fraction, salt) == s]
                for s in ("train", "eval")
            }
            for s, recs in self._records.items():
                if not recs:
                    raise ConfigError(
                        f"eval_fraction: {c.eval_fraction} leaves the {s} split of {c.path} "
                        f"({len(records)} records) empty"
                    )

    def num_problems(self, split: Split) -> int:
        return len(self._records[check_split(split)])

    def problem(self, split: Split, index: int) -> AnswerProblem:
        index = check_index(index, self.num_problems(check_split(split)), split)
        question, solution, final = self._records[split][index]
        return AnswerProblem(
            id=f"{self.name}/{split}/{index}",
            prompt=question + "\n",
            answer=final,
            solution=solution,
        )

    def reward(self, problem: AnswerProblem, completion: str) -> float:
        return answer_reward(completion, problem.answer, self.config.format_reward)

    def demonstration(self, problem: AnswerProblem) -> str:
        return answer_demonstration(problem)

    def demonstration_turns(self, problem: AnswerProblem) -> list[Turn]:
        return [Turn("policy", self.demonstration(problem))]

    def env(self, problem: Problem) -> None:
        return None
