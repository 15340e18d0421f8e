"""GSM8K-form JSONL loader: records become reasoning problems; malformed lines name file:line."""

import json

import pytest

from trace_jax.config import ConfigError
from trace_jax.tasks import JsonlError, make_task
from trace_jax.tasks.jsonl import split_answer

RECORDS = [
    {
        "question": f"Tom has {n} apples and buys {n + 2} more. How many apples?",
        "answer": f"He has {n}+{n + 2}=<<{n}+{n + 2}={2 * n + 2}>>{2 * n + 2} apples.\n"
        f"#### {2 * n + 2:,}",
    }
    for n in range(0, 4000, 97)
]


def _write(path, records, extra_lines=()):
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_records_become_reasoning_problems(tmp_path):
    path = _write(tmp_path / "train.jsonl", RECORDS)
    task = make_task("jsonl", path=path, eval_fraction=0.2)
    n_train, n_eval = task.num_problems("train"), task.num_problems("eval")
    assert n_train + n_eval == len(RECORDS) and n_train > 0 and n_eval > 0
    prompts = set()
    for split, n in (("train", n_train), ("eval", n_eval)):
        for i in range(n):
            p = task.problem(split, i)
            prompts.add((split, p.prompt))
            assert p.prompt.startswith("Tom has") and p.prompt.endswith("\n")
            assert "<<" not in p.solution and "," not in p.answer
            assert task.reward(p, task.demonstration(p)) == 1.0
            assert task.reward(p, "Answer: -1") == 0.0
    assert not {q for s, q in prompts if s == "train"} & {q for s, q in prompts if s == "eval"}


def test_big_numbers_compare_by_value(tmp_path):
    path = _write(tmp_path / "a.jsonl", RECORDS)
    task = make_task("gsm8k", path=path, format_reward=0.1)
    p = next(
        task.problem("train", i)
        for i in range(task.num_problems("train"))
        if int(task.problem("train", i).answer) >= 1000
    )
    assert task.reward(p, f"Answer: {int(p.answer):,}") == 1.0
    assert task.reward(p, f"Answer: ${p.answer}") == 1.0
    assert task.reward(p, "Answer: 1") == 0.1


def test_separate_eval_file(tmp_path):
    train = _write(tmp_path / "train.jsonl", RECORDS[:10])
    evals = _write(tmp_path / "test.jsonl", RECORDS[10:13])
    task = make_task("jsonl", path=train, eval_path=evals)
    assert task.num_problems("train") == 10 and task.num_problems("eval") == 3
    assert task.problem("eval", 0).prompt == RECORDS[10]["question"] + "\n"


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"question": "q"}', "field 'answer' missing"),
        ('{"question": 3, "answer": "#### 1"}', "field 'question'"),
        ('{"question": "q", "answer": "no final answer"}', "no '#### <final answer>'"),
        ('{"question": "q", "answer": "x ####  "}', "empty"),
        ('{"question": "bell \\u0007", "answer": "#### 1"}', "not in the tokenizer"),
    ],
)
def test_malformed_record_names_file_and_line(tmp_path, bad_line, message):
    path = _write(tmp_path / "bad.jsonl", RECORDS[:3], ["", bad_line])
    with pytest.raises(JsonlError, match=rf"bad\.jsonl:5: .*{message}"):
        make_task("jsonl", path=path)


def test_missing_file_and_missing_path_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"path: file .*nope\.jsonl does not exist"):
        make_task("jsonl", path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match="path"):
        make_task("jsonl")


def test_split_answer():
    assert split_answer("a <<1+1=2>>2\n#### 1,200") == ("a 2", "1200")
    with pytest.raises(ValueError):
        split_answer("42")
