"""The README cannot drift from the code, and the examples in docstrings run."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

from tools.sync_readme import README, render

ROOT = Path(__file__).resolve().parent.parent


def test_readme_layer_table_is_generated_from_the_registry():
    text = README.read_text()
    assert render(text) == text, "README.md is out of date: run `make readme`"


def test_ci_runs_the_readme_test_command():
    readme = README.read_text()
    block = readme.split("<!-- test-command -->", 1)[1]
    command = re.search(r"```bash\n(.+?)\n```", block, re.DOTALL).group(1).strip()
    assert command in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize(
    "module",
    [
        "ggnchunk._api",
        "ggnchunk._scheduler",
        "ggnchunk._memory",
        "ggnchunk._dataset",
        "ggnchunk.optim",
    ],
)
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module), verbose=False)
    assert result.attempted > 0 and result.failed == 0
