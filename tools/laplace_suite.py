"""Run laplace-torch's own test suite with ggnchunk's ``ChunkedGGN`` as the GGN backend.

laplace-torch's tests live in its repository, not in the wheel, so this script needs a
copy of the repository (``git clone https://github.com/aleximmer/Laplace``; a bare
mirror works too). It is not part of CI (no network there); CI runs the rewritten
checks in ``tests/integrations/test_laplace_suite.py`` instead.

What it does:

1. Exports ``tests/`` at ``--rev`` (default: the tag of the installed laplace-torch
   version if the repository has it, else ``HEAD``) into a temporary directory.
2. Adds a ``conftest.py`` that substitutes the curvature backend for the Hessian
   structures under test (``--structure``): every diag-structured Laplace
   (``DiagLaplace``, ``DiagLLLaplace``, ``DiagSubnetLaplace``) for ``diag``, every
   Kronecker-structured one (``KronLaplace``, ``KronLLLaplace``: laplace-torch's only
   classes whose ``fit`` calls a backend's ``kron``; ``Laplace(...,
   hessian_structure="kron")`` and the marginal-likelihood training build them) for
   ``kron``, built with a GGN backend (the default ``CurvlinopsGGN``, ``AsdlGGN``,
   ``BackPackGGN``, ``AsdfghjklGGN``, …; EF and Hessian backends and
   ``stochastic=True`` are left alone) gets the backend under test. In the
   backend-level test modules (``test_curv_backends_*.py`` and ``test_matrix.py``) the
   name ``BackPackGGN`` (``stochastic=False``) is the backend under test, for its
   ``diag`` and its ``kron`` (these modules' tests compare them with the diagonal of
   ``full``, with each other and with the other backends' ``kron``). The substitute's
   ``full`` is laplace-torch's ``torch.func`` ``GGNInterface.full`` for ``ChunkedGGN``,
   which has no ``full`` of its own.
3. Runs pytest three times: with ``BackPackGGN`` (``stochastic=False``), with
   ``ChunkedGGN`` and with ``ChunkedGGN(max_memory=--budget)``, in parallel (each with
   a third of the cores as ``OMP_NUM_THREADS`` unless the environment sets it) or,
   with ``--serial``, one after the other.
4. Only the files in ``FILES`` of the structures under test run (``--files`` to
   change), without the tests that ``_deselect`` names (the full and low-rank
   structures' and the other structures' parametrizations; ``--everything`` keeps
   them).
   A test counts as a *kron test* when, in some run, a Kronecker-structured Laplace
   was built with the substitute or the substitute's ``kron`` was called, and as a
   *diag test* when a diag Laplace was built with the substitute or its ``diag`` was
   called, and its ``kron`` never. It prints, for each structure and backend, how many
   of these tests pass, every test that passes with ``BackPackGGN`` but fails with a
   ``ChunkedGGN`` run, with its error (apart from ``EXPECTED``: tests that assert a
   limitation of the BackPACK backend), every test that fails with ``BackPackGGN``
   and passes with ``ChunkedGGN``, with BackPACK's error, and every test that fails in
   all three runs, with the errors of BackPACK and ``ChunkedGGN``.

``--structure`` is ``diag`` (the default, the suite as before kron existed),
``kron`` or ``both`` (one set of three pytest runs that substitutes both and reports
each structure's tests; a test that builds a diag and a Kronecker Laplace, e.g.
``test_serialize_fail_different_hess_structures``, is then a kron test, so ``both``
counts one diag test fewer than ``diag``).

At laplace-torch's ``HEAD`` 44ea62a (laplace-torch 0.3 installed): diag 209 / 231 /
231 of 237 pass (BackPACK / ``ChunkedGGN`` / with a budget), kron 129 / 144 / 144 of
151. The kron tests that pass with BackPACK only are the ``EXPECTED`` ones; the 20 that
pass with ``ChunkedGGN`` only are laplace-torch refusing BackPACK (dict batches, frozen
parameters); ``test_reward_modeling[KronLaplace]`` fails in all runs (BackPACK has no
KFLR for the model, ``ChunkedGGN.kron`` refuses its batch-merging reshape) and so does
``test_matrix.py::test_bmm_dense`` in the full run (float32 ``allclose`` of an
eigendecomposition; it passes alone).

Usage::

    python -m tools.laplace_suite --repo /path/to/Laplace[.git] [--budget 256MiB]
        [--structure diag|kron|both] [--files test_baselaplace.py ...] [--keep DIR]
        [--json OUT.json]

Exit status 0 when every test of the structures under test that passes with
``BackPackGGN`` passes with both ``ChunkedGGN`` runs (apart from ``EXPECTED``), 1
otherwise, 2 when the repository is missing.
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
STRUCTURES = ("diag", "kron")
# the files where a GGN backend of the structure is used (the rest test full and
# functional Laplace, matrices and utilities only)
FILES = {
    "diag": (
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
    ),
    "kron": (
        "test_baselaplace.py",
        "test_lllaplace.py",
        "test_laplace.py",
        "test_serialization.py",
        "test_subset_params.py",
        "test_curv_backends_backpack.py",
        "test_curv_backends_asdl.py",
        "test_curv_backends_curvlinops.py",
        "test_curv_backends_asdfghjkl.py",
        "test_matrix.py",
    ),
}
# the Laplace classes of each structure, as they appear in test ids
CLASSES = {
    "diag": ("DiagLaplace", "DiagLLLaplace", "DiagSubnetLaplace"),
    "kron": ("KronLaplace", "KronLLLaplace"),
}
# tests deselected unless --everything: the parametrizations of the full and low-rank
# structures and of the structures not under test, and the backend-interface tests that
# draw 10,000 Monte-Carlo samples to compare stochastic GGNs with a full one (most of
# the time)
ALWAYS_DESELECTED = (
    "FullLaplace",
    "LowRankLaplace",
    "FullLLLaplace",
    "FullSubnetLaplace",
    "(stoch and curvlinops_against_backpack_full)",
)


def _deselect(structures: tuple[str, ...]) -> str:
    """The ``-k`` expression of the tests deselected for ``structures``.

    Args:
        structures: The structures under test.

    Returns:
        The expression (``"a or b or ..."``).
    """
    other = [name for s in STRUCTURES if s not in structures for name in CLASSES[s]]
    return " or ".join([*ALWAYS_DESELECTED[:-1], *other, ALWAYS_DESELECTED[-1]])


# tests whose assertion is a limitation of the BackPACK backend, not a result:
# (test name prefix, id suffix) -> why
EXPECTED = {
    ("test_dict_data[", "-BackPackGGN-DiagLaplace]"): (
        "asserts that fit refuses dict batches for a backend named BackPack*; ChunkedGGN "
        "takes them, and the test's AsdlGGN and CurvlinopsGGN parametrizations (both "
        "ChunkedGGN here) check its fit and predictions on dict batches"
    ),
    ("test_dict_data[", "-BackPackGGN-KronLaplace]"): (
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
"""Written by ggnchunk's tools/laplace_suite.py: substitutes the GGN backend."""

import inspect
import json
import os

import pytest

import laplace.baselaplace as _baselaplace
from laplace.curvature import BackPackGGN, GGNInterface

from ggnchunk.laplace import ChunkedGGN

_MODE = os.environ["GGNCHUNK_SUITE_MODE"]
_BUDGET = os.environ.get("GGNCHUNK_SUITE_BUDGET", "256MiB")
_STRUCTURES = os.environ.get("GGNCHUNK_SUITE_STRUCTURES", "diag").split(",")
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
    structure = None
    if isinstance(self, _baselaplace.DiagLaplace):
        structure = "diag"
    elif isinstance(self, _baselaplace.KronLaplace):
        structure = "kron"
    if (
        structure in _STRUCTURES
        and (backend is None or issubclass(backend, GGNInterface))
        and not backend_kwargs.get("stochastic", False)
    ):
        bound.arguments["backend"] = Substitute
        _flags.add("laplace-" + structure)
    return _original_init(*bound.args, **bound.kwargs)


_baselaplace.BaseLaplace.__init__ = _init


def pytest_collection_modifyitems(items):
    for module in {item.module for item in items if item.module is not None}:
        name = module.__name__.rsplit(".", 1)[-1]
        if name.startswith("test_curv_backends") or name == "test_matrix":
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
    target: Path,
    mode: str,
    files: list[str],
    budget: str,
    structures: tuple[str, ...],
    everything: bool,
    threads: int | None = None,
) -> subprocess.Popen:
    """Start one pytest run.

    Args:
        target: The export (``tests/`` and the conftest).
        mode: ``"backpack"``, ``"chunked"`` or ``"budget"``.
        files: The test files to run.
        budget: ``max_memory`` of the ``"budget"`` run.
        structures: The Hessian structures whose Laplace objects get the substitute.
        everything: Deselect nothing.
        threads: ``OMP_NUM_THREADS`` for torch where the environment sets none
            (``None``: torch's default).

    Returns:
        The pytest process; it writes ``record-{mode}.json`` and ``log-{mode}.txt``.
    """
    env = dict(os.environ)
    env.update(
        GGNCHUNK_SUITE_MODE=mode,
        GGNCHUNK_SUITE_BUDGET=budget,
        GGNCHUNK_SUITE_STRUCTURES=",".join(structures),
        GGNCHUNK_SUITE_RECORD=str(target / f"record-{mode}.json"),
        PYTHONPATH=os.pathsep.join([str(target), env.get("PYTHONPATH", "")]),
    )
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    paths = [str(target / "tests" / f) for f in files if (target / "tests" / f).exists()]
    select = [] if everything else ["-k", f"not ({_deselect(structures)})"]
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
    parser.add_argument(
        "--structure",
        choices=("diag", "kron", "both"),
        default="diag",
        help="Hessian structure(s) whose Laplace objects get ChunkedGGN (default: diag)",
    )
    parser.add_argument(
        "--files", nargs="*", help="test files (default: FILES of the structures)"
    )
    parser.add_argument(
        "--everything",
        action="store_true",
        help="also run the deselected tests (other structures' parametrizations)",
    )
    parser.add_argument("--keep", help="export into this directory and keep it")
    parser.add_argument("--json", help="write the per-test records here")
    parser.add_argument("--serial", action="store_true", help="one run at a time")
    args = parser.parse_args(argv)
    structures = STRUCTURES if args.structure == "both" else (args.structure,)
    if args.files is None:
        args.files = list(dict.fromkeys(f for s in structures for f in FILES[s]))

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
        # parallel runs share the cores: torch's default (one thread per core in each
        # run) oversubscribes them, which made the runs several times slower
        threads = None if args.serial else max(1, (os.cpu_count() or 1) // len(RUNS))
        for mode in RUNS:
            processes[mode] = _run(
                target,
                mode,
                args.files,
                args.budget,
                structures,
                args.everything,
                threads,
            )
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
        return _report(records, args, structures, elapsed)


def _expected(nodeid: str) -> str | None:
    """Why a test is an expected difference (see ``EXPECTED``), else ``None``."""
    name = nodeid.rsplit("::", 1)[-1]
    for (start, end), why in EXPECTED.items():
        if name.startswith(start) and name.endswith(end):
            return why
    return None


def _tests(records: dict[str, dict], structure: str) -> list[str]:
    """The tests of ``structure`` (see the module docstring), sorted.

    Args:
        records: Per run, the per-test records (``flags``, ``outcome``, ``error``).
        structure: ``"diag"`` or ``"kron"``.

    Returns:
        Their node ids.
    """
    chosen = []
    for nodeid in sorted(set().union(*records.values())):
        flags: set[str] = set()
        for mode in RUNS:
            flags |= set(records[mode].get(nodeid, {}).get("flags", []))
        if structure == "kron":
            ours = bool(flags & {"laplace-kron", "kron"})
        else:
            ours = bool(flags & {"laplace-diag", "diag"}) and "kron" not in flags
        if ours:
            chosen.append(nodeid)
    return chosen


def _report(
    records: dict[str, dict],
    args: argparse.Namespace,
    structures: tuple[str, ...],
    elapsed: float,
) -> int:
    """Print the counts and the differences; return the exit status.

    Args:
        records: Per run, the per-test records.
        args: The command-line arguments.
        structures: The structures under test.
        elapsed: Seconds the runs took.

    Returns:
        The exit status (see the module docstring).
    """
    collected = len(set().union(*records.values()))
    tests = {structure: _tests(records, structure) for structure in structures}
    counts = ", ".join(f"{len(tests[s])} {s} tests" for s in structures)
    print(f"{collected} tests collected, {counts} ({elapsed:.0f} s)")

    def passed(mode: str, nodeid: str) -> bool:
        return records[mode].get(nodeid, {}).get("outcome") == "passed"

    def error(mode: str, nodeid: str) -> str:
        record = records[mode].get(nodeid, {})
        return record.get("error", record.get("outcome", "not run"))

    status = 0
    for structure in structures:
        chosen = tests[structure]
        print(f"\n{structure} tests:")
        for mode in RUNS:
            count = sum(passed(mode, n) for n in chosen)
            label = LABELS[mode].format(budget=args.budget)
            print(f"  {label:32s} {count:4d} / {len(chosen)} pass")
        for mode in ("chunked", "budget"):
            lost = [n for n in chosen if passed("backpack", n) and not passed(mode, n)]
            expected = [n for n in lost if _expected(n)]
            lost = [n for n in lost if not _expected(n)]
            label = LABELS[mode].format(budget=args.budget)
            if expected:
                print(
                    f"\n{structure}: pass with BackPackGGN, fail with {label} as expected "
                    f"(the test asserts a limitation of the BackPACK backend): "
                    f"{len(expected)}"
                )
                for nodeid in expected:
                    print(f"  {nodeid}\n    {textwrap.shorten(_expected(nodeid), 200)}")
            if lost:
                status = 1
                print(
                    f"\n{structure}: pass with BackPackGGN, fail with {label}: {len(lost)}"
                )
                for nodeid in lost:
                    print(f"  {nodeid}\n    {textwrap.shorten(error(mode, nodeid), 200)}")
        gained = [n for n in chosen if not passed("backpack", n) and passed("chunked", n)]
        print(
            f"\n{structure}: fail with BackPackGGN, pass with ChunkedGGN(): {len(gained)}"
        )
        for nodeid in gained:
            print(f"  {nodeid}\n    {textwrap.shorten(error('backpack', nodeid), 200)}")
        failing = [n for n in chosen if not any(passed(mode, n) for mode in RUNS)]
        print(f"\n{structure}: fail in all three runs: {len(failing)}")
        for nodeid in failing:
            print(f"  {nodeid}")
            for mode in ("backpack", "chunked"):
                message = textwrap.shorten(error(mode, nodeid), 200)
                print(f"    {LABELS[mode].split('(')[0]}: {message}")
    if args.json:
        Path(args.json).write_text(json.dumps({**tests, "records": records}, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
