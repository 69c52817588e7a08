"""The README's Python examples run as written (in order, in one namespace)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).parents[1] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_names_the_two_commands():
    text = README.read_text()
    assert 'pip install -e ".[dev]" && parallax demo' in text
    assert "python -m pytest" in text


@pytest.mark.slow
def test_readme_python_examples_run():
    namespace = {}
    ran = 0
    for block in python_blocks():
        if "make_state, loss_fn, batches" in block:  # a pattern with user-supplied names
            continue
        exec(compile(block, str(README), "exec"), namespace)
        ran += 1
    assert ran >= 2
