"""The README's Python example runs as written."""

import re
from pathlib import Path

import pytest


@pytest.mark.slow
def test_readme_python_example_runs(capsys):
    text = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        namespace: dict = {}
        exec(compile(block, "README.md", "exec"), namespace)  # the project's own documentation
    assert "bytes of guidance" in capsys.readouterr().out
