"""Run laplace-torch's own test suite with ggnchunk's ``ChunkedGGN`` as the diag backend.

laplace-torch's tests live in its repository, not in the wheel, so this script needs a
copy of the repository (``git clone https://github.com/aleximmer/Laplace``; a bare
mirror works too). It is not part of CI (no network there); CI runs the rewritten
checks in ``tests/test_laplace_suite.py`` instead.

What it does:

1. Exports ``tests/`` at ``--rev`` (default: the tag of the installed laplace-torch
   version if the repository has it, else ``HEAD``) into a temporary directory.
2. Adds a ``conftest.py`` that substitutes the curvature backend: every diag-structured
   Laplace (``DiagLaplace``, ``DiagLLLaplace``, ``DiagSubnetLaplace``) built with a GGN
   backend (the default ``CurvlinopsGGN``, ``AsdlGGN``, ``BackPackGGN``, …; EF and
   Hessian backends and ``stochastic=True`` are left alone) gets the backend under test,
   and in the backend-level test modules (``test_curv_backends_*.py``) the name
   ``BackPackGGN`` (``stochastic=False``) is the backend under test. The substitute's
   ``kron`` is its own (``ChunkedGGN`` raises); its ``full`` is laplace-torch's
   ``torch.func`` ``GGNInterface.full`` for ``ChunkedGGN`` (the backend-level tests
   compare ``diag`` with the diagonal of ``full``).
3. Runs pytest three times: with ``BackPackGGN`` (``stochastic=False``), with
   ``ChunkedGGN`` and with ``ChunkedGGN(max_memory=--budget)``.
4. Only the files in ``FILES`` run (``--files`` to change), without the tests in
   ``DESELECT`` (non-diag tests; ``--everything`` keeps them).
   A test counts as a *diag test* when, in some run, a substitution happened in it (a
   diag Laplace was built with the substitute, or the substitute's ``diag`` was
   called) and the substitute's ``kron`` was never called. It prints, for each backend,
   how many diag tests pass, and every diag test that passes with ``BackPackGGN`` but
   fails with ``ChunkedGGN``, with its error (apart from ``EXPECTED``: tests that assert
   a limitation of the BackPACK backend).

Usage::

    python -m tools.laplace_suite --repo /path/to/Laplace[.git] [--budget 256MiB]
        [--files test_baselaplace.py ...] [--keep DIR] [--json OUT.json]

Exit status 0 when every diag test that passes with ``BackPackGGN`` passes with both
``ChunkedGGN`` runs, 1 otherwise, 2 when the repository is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from importlib.metadata import version
from pathlib import Path

DEFAULT_REPOS = (
    Path("/work/.mirror/aleximmer+Laplace/repo"),
    Path(__file__).resolve().parents[1] / "third_party" / "Laplace",
)
RUNS = ("backpack", "chunked", "budget")
# the files where a diag GGN backend is used (the rest test kron, functional Laplace,
# matrices and utilities only)
FILES = (
    "test_baselaplace.py",
    "test_lllaplace.py",
    "test_subnetlaplace.py",
    "test_laplace.py",
    "test_serialization.py",
    "test_subset_params.py",
    "test_curv_backends_backpack.py",
    "test_curv_backends_interface.py",
    "test_curv_backends_asdl.py",
    "test_curv_backends_curvlinops.py",
)
# tests that build no diag Laplace and call no diag (deselected unless --everything):
# the full, kron and low-rank parametrizations, and the backend-interface tests that draw
# 10,000 Monte-Carlo samples to compare stochastic GGNs with a full one (most of the time)
DESELECT = (
    "FullLaplace or KronLaplace or LowRankLaplace or FullLLLaplace or KronLLLaplace "
    "or FullSubnetLaplace or (stoch and curvlinops_against_backpack_full)"
)
# diag tests whose assertion is a limitation of the BackPACK backend, not a result:
# (test name prefix, id suffix) -> why
EXPECTED = {
    ("test_dict_data[", "-BackPackGGN-DiagLaplace]"): (
        "asserts that fit refuses dict batches for a backend named BackPack*; ChunkedGGN "
        "takes them, and the test's AsdlGGN and CurvlinopsGGN parametrizations (both "
        "ChunkedGGN here) check its fit and predictions on dict batches"
    ),
    ("test_incompatible_backend[", "]"): (
        "asserts that Laplace refuses a BackPack* backend for a model with frozen "
        "parameters; ChunkedGGN takes them (test_subset_params' other tests check it)"
    ),
}
LABELS = {
    "backpack": "BackPackGGN(stochastic=False)",
    "chunked": "ChunkedGGN()",
    "budget": "ChunkedGGN(max_memory={budget})",
}

CONFTEST = '''
"""Written by ggnchunk's tools/laplace_suite.py: substitutes the diag GGN backend."""

import inspect
import json
import os

import pytest

import laplace.baselaplace as _baselaplace
from laplace.curvature import BackPackGGN, GGNInterface

from ggnchunk.laplace import ChunkedGGN

_MODE = os.environ["GGNCHUNK_SUITE_MODE"]
_BUDGET = os.environ.get("GGNCHUNK_SUITE_BUDGET", "256MiB")
_RECORD = os.environ["GGNCHUNK_SUITE_RECORD"]
_flags: set = set()
_records: dict = {}


def _recorded(cls):
    """Subclass ``cls`` so that diag/kron/full calls are recorded for the test."""

    class Recorded(cls):
        def diag(self, *args, **kwargs):
            _flags.add("diag")
            return super().diag(*args, **kwargs)

        def kron(self, *args, **kwargs):
            _flags.add("kron")
            return super().kron(*args, **kwargs)

        def full(self, *args, **kwargs):
            _flags.add("full")
            if issubclass(cls, ChunkedGGN):  # laplace-torch's torch.func reference
                return GGNInterface.full(self, *args, **kwargs)
            return super().full(*args, **kwargs)

    return Recorded


if _MODE == "backpack":

    class SuiteBackPackGGN(_recorded(BackPackGGN)):
        def __new__(cls, *args, stochastic=False, **kwargs):
            if stochastic:
                return BackPackGGN(*args, stochastic=True, **kwargs)
            return super().__new__(cls)

    Substitute = SuiteBackPackGGN
else:

    class SuiteChunkedGGN(_recorded(ChunkedGGN)):
        def __new__(cls, *args, stochastic=False, **kwargs):
            if stochastic:
                return BackPackGGN(*args, stochastic=True, **kwargs)
            return super().__new__(cls)

        def __init__(self, *args, **kwargs):
            if _MODE == "budget":
                kwargs.setdefault("max_memory", _BUDGET)
            super().__init__(*args, **kwargs)

    Substitute = SuiteChunkedGGN

_original_init = _baselaplace.BaseLaplace.__init__
_signature = inspect.signature(_original_init)


def _init(self, *args, **kwargs):
    bound = _signature.bind(self, *args, **kwargs)
    backend = bound.arguments.get("backend")
    backend_kwargs = bound.arguments.get("backend_kwargs") or {}
    if (
        isinstance(self, _baselaplace.DiagLaplace)
        and (backend is None or issubclass(backend, GGNInterface))
        and not backend_kwargs.get("stochastic", False)
    ):
        bound.arguments["backend"] = Substitute
        _flags.add("laplace")
    return _original_init(*bound.args, **bound.kwargs)


_baselaplace.BaseLaplace.__init__ = _init


def pytest_collection_modifyitems(items):
    for module in {item.module for item in items if item.module is not None}:
        if module.__name__.rsplit(".", 1)[-1].startswith("test_curv_backends"):
            if getattr(module, "BackPackGGN", None) is BackPackGGN:
                module.BackPackGGN = Substitute


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _flags.clear()
    yield
    _records.setdefault(item.nodeid, {})["flags"] = sorted(_flags)


def pytest_runtest_logreport(report):
    entry = _records.setdefault(report.nodeid, {})
    if report.when == "call" or report.outcome != "passed":
        if entry.get("outcome") in (None, "passed"):
            entry["outcome"] = report.outcome
            if report.failed:
                lines = [
                    line for line in str(report.longrepr).splitlines()
                    if line.startswith("E ")
                ]
                entry["error"] = (lines[0][1:].strip() if lines else
                                  str(report.longrepr).splitlines()[-1])[:300]


def pytest_sessionfinish(session, exitstatus):
    with open(_RECORD, "w") as file:
        json.dump(_records, file)
'''


def _find_repo(path: str | None) -> Path:
    """The git directory of laplace-torch's repository.

    Args:
        path: ``--repo`` (a work tree, a ``.git`` directory or a bare mirror), or
            ``None`` for the default places.

    Returns:
        The git directory.

    Raises:
        SystemExit: If no repository is found.
    """
    candidates = [Path(path)] if path else list(DEFAULT_REPOS)
    for candidate in candidates:
        for git_dir in (candidate / ".git", candidate):
            if (git_dir / "HEAD").exists() and (git_dir / "objects").exists():
                return git_dir
    print(
        "laplace-torch's repository not found (looked in "
        f"{', '.join(map(str, candidates))}); clone it with\n"
        "  git clone https://github.com/aleximmer/Laplace\n"
        "and pass --repo Laplace.",
        file=sys.stderr,
    )
    raise SystemExit(2)


def _git(git_dir: Path, *args: str) -> str:
    return subprocess.run(
        ["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True, text=True
    ).stdout


def _pick_revision(git_dir: Path, rev: str | None) -> str:
    """``rev``, or the tag of the installed laplace-torch version, or ``HEAD``."""
    if rev:
        return rev
    installed = version("laplace-torch")
    tags = _git(git_dir, "tag").split()
    for tag in (installed, f"v{installed}"):
        if tag in tags:
            return tag
    print(
        f"laplace-torch {installed} is installed; the repository has no tag for it "
        f"(tags: {', '.join(tags[-5:])}), using HEAD.",
        file=sys.stderr,
    )
    return "HEAD"


def _export(git_dir: Path, rev: str, target: Path) -> None:
    """Write ``tests/`` at ``rev`` into ``target`` with the substituting conftest."""
    archive = subprocess.run(
        ["git", f"--git-dir={git_dir}", "archive", rev, "tests"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    (target / "conftest.py").write_text(CONFTEST)
    (target / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")


def _run(
    target: Path, mode: str, files: list[str], budget: str, everything: bool
) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(
        GGNCHUNK_SUITE_MODE=mode,
        GGNCHUNK_SUITE_BUDGET=budget,
        GGNCHUNK_SUITE_RECORD=str(target / f"record-{mode}.json"),
        PYTHONPATH=os.pathsep.join([str(target), env.get("PYTHONPATH", "")]),
    )
    paths = [str(target / "tests" / f) for f in files if (target / "tests" / f).exists()]
    select = [] if everything else ["-k", f"not ({DESELECT})"]
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-rN", *select, *paths],
        cwd=target,
        env=env,
        stdout=open(target / f"log-{mode}.txt", "w"),
        stderr=subprocess.STDOUT,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the three suites and print the counts.

    Args:
        argv: Command-line arguments (``None``: ``sys.argv``).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", help="laplace-torch's repository (work tree or bare)")
    parser.add_argument("--rev", help="revision of the tests (default: see above)")
    parser.add_argument("--budget", default="256MiB", help="max_memory of the third run")
    parser.add_argument("--files", nargs="*", default=list(FILES), help="test files")
    parser.add_argument(
        "--everything",
        action="store_true",
        help="also run the deselected non-diag tests (DESELECT)",
    )
    parser.add_argument("--keep", help="export into this directory and keep it")
    parser.add_argument("--json", help="write the per-test records here")
    parser.add_argument("--serial", action="store_true", help="one run at a time")
    args = parser.parse_args(argv)

    git_dir = _find_repo(args.repo)
    rev = _pick_revision(git_dir, args.rev)
    commit = _git(git_dir, "rev-parse", rev).strip()
    with tempfile.TemporaryDirectory(prefix="laplace-suite-") as tmp:
        target = Path(args.keep) if args.keep else Path(tmp)
        target.mkdir(parents=True, exist_ok=True)
        _export(git_dir, rev, target)
        print(f"laplace-torch tests at {rev} ({commit[:10]}) in {target}")
        start = time.perf_counter()
        records = {}
        processes = {}
        for mode in RUNS:
            processes[mode] = _run(target, mode, args.files, args.budget, args.everything)
            if args.serial:
                processes[mode].wait()
        for mode, process in processes.items():
            process.wait()
            path = target / f"record-{mode}.json"
            if not path.exists():
                print((target / f"log-{mode}.txt").read_text()[-3000:], file=sys.stderr)
                raise SystemExit(f"pytest run {mode!r} wrote no record")
            records[mode] = json.loads(path.read_text())
        elapsed = time.perf_counter() - start
        return _report(records, args, elapsed)


def _expected(nodeid: str) -> str | None:
    """Why a test is an expected difference (see ``EXPECTED``), else ``None``."""
    name = nodeid.rsplit("::", 1)[-1]
    for (start, end), why in EXPECTED.items():
        if name.startswith(start) and name.endswith(end):
            return why
    return None


def _report(records: dict[str, dict], args: argparse.Namespace, elapsed: float) -> int:
    """Print the counts and the regressions; return the exit status."""
    nodeids = sorted(set().union(*records.values()))

    def flags(nodeid: str) -> set[str]:
        found: set[str] = set()
        for mode in RUNS:
            found |= set(records[mode].get(nodeid, {}).get("flags", []))
        return found

    diag = [n for n in nodeids if flags(n) & {"laplace", "diag"} and "kron" not in flags(n)]

    def passed(mode: str, nodeid: str) -> bool:
        return records[mode].get(nodeid, {}).get("outcome") == "passed"

    print(f"{len(nodeids)} tests collected, {len(diag)} diag tests ({elapsed:.0f} s)")
    for mode in RUNS:
        count = sum(passed(mode, n) for n in diag)
        label = LABELS[mode].format(budget=args.budget)
        print(f"  {label:32s} {count:4d} / {len(diag)} pass")
    status = 0
    for mode in ("chunked", "budget"):
        lost = [n for n in diag if passed("backpack", n) and not passed(mode, n)]
        expected = [n for n in lost if _expected(n)]
        lost = [n for n in lost if not _expected(n)]
        label = LABELS[mode].format(budget=args.budget)
        if expected:
            print(
                f"\npass with BackPackGGN, fail with {label} as expected (the test asserts "
                f"a limitation of the BackPACK backend): {len(expected)}"
            )
            for nodeid in expected:
                print(f"  {nodeid}\n    {textwrap.shorten(_expected(nodeid), 200)}")
        if lost:
            status = 1
            print(f"\npass with BackPackGGN, fail with {label}: {len(lost)}")
            for nodeid in lost:
                error = records[mode].get(nodeid, {}).get("error", "?")
                print(f"  {nodeid}\n    {textwrap.shorten(error, 200)}")
    gained = [n for n in diag if not passed("backpack", n) and passed("chunked", n)]
    print(f"\nfail with BackPackGGN, pass with ChunkedGGN(): {len(gained)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"diag": diag, "records": records}, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
