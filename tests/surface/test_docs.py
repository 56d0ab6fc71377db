"""The docs cannot drift from the code, the site builds, docstring examples run."""

from __future__ import annotations

import doctest
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ggnchunk
from tools.sync_readme import PAGE, render

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", text, re.DOTALL)


def test_layer_table_is_generated_from_the_registry():
    text = PAGE.read_text()
    assert render(text) == text, f"{PAGE} is out of date: run `make tables`"


def test_ci_runs_the_readme_test_command():
    readme = README.read_text()
    block = readme.split("<!-- test-command -->", 1)[1]
    command = re.search(r"```bash\n(.+?)\n```", block, re.DOTALL).group(1).strip()
    assert command in (ROOT / ".ci" / "run").read_text()


def test_readme_commands_run_in_the_virtual_environment_it_sets_up():
    # `torchrun`, `python`, `pip` alone are not on the PATH of an unactivated venv
    for block in _bash_blocks(README.read_text()):
        for line in block.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                assert command.startswith((".venv/bin/", "python3 -m venv .venv")), line


def test_readme_links_point_to_files_that_exist():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the README links to the docs pages"
    for link in local:
        assert (ROOT / link).exists(), f"README.md links to missing {link}"


def test_api_reference_lists_every_public_name():
    page = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: ggnchunk\.(\w+)$", page, re.MULTILINE))
    assert set(ggnchunk.__all__) <= documented, set(ggnchunk.__all__) - documented


def test_docs_site_builds_without_warnings(tmp_path):
    # --strict: a broken link or anchor, a page missing from the navigation, or a
    # docstring mkdocstrings cannot parse fails the build
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "api" / "index.html").exists()


@pytest.mark.parametrize(
    "module",
    [
        "ggnchunk._api",
        "ggnchunk._scheduling.plan",
        "ggnchunk._scheduling.scheduler",
        "ggnchunk._memory.sizes",
        "ggnchunk._memory.measure",
        "ggnchunk._dataset",
        "ggnchunk.optim",
    ],
)
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module), verbose=False)
    assert result.attempted > 0 and result.failed == 0
