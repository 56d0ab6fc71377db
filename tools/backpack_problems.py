"""Run BackPACK's 99 ``DiagGGNExact`` test problems against ggnchunk and BackPACK itself.

The problems are BackPACK's own (``tests/backpack_problems.py`` rebuilds them from
BackPACK's test settings, without BackPACK's test package). For each problem, in float64:

- the brute force (``tests/reference.py``'s ``reference_diag_ggn``, ``torch.func``);
- ``ggnchunk.diag_ggn`` with ``num_chunks=1`` and ``num_chunks=3`` on a fresh, un-extended
  copy of the model (for the converted ResNets: the plain model, and also BackPACK's
  converted ``torch.fx`` model with ``num_chunks=1``);
- BackPACK's ``DiagGGNExact`` on ``extend(model)`` (its converted model where BackPACK's
  setting converts), against the float64 brute force of that model, in float64 and in
  float32 (the dtype of BackPACK's own tests; tolerance 1e-5);
- optionally (``--float32``) ``ggnchunk.diag_ggn`` in float32 against the float64 brute
  force.

Five problems have an all-zero GGN diagonal (every ReLU unit dead at seed 0); they are
flagged ``zero`` in the table: every method passes them trivially.

Errors are relative to the largest entry, as ``tests/reference.py``'s
``assert_diag_close`` measures them (per parameter, scale = its largest entry, floored at
1e-3 of the whole diagonal's largest); a result counts as ok below ``--rtol``
(default 1e-9; float32 uses 1e-5).

Usage::

    python -m tools.backpack_problems [--only SUBSTRING ...] [--float32] [--json OUT]

Exit status 0 when ggnchunk is ok on every problem it ran, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

import ggnchunk
from tests.backpack_problems import PROBLEMS, Problem
from tests.reference import reference_diag_ggn


@dataclass
class Row:
    """One problem's outcome (errors are relative; ``None`` where it did not run).

    Attributes:
        id: The problem's id.
        backpack: ``"ok"``, ``"wrong"`` or ``"error: ..."`` (float64).
        backpack_err: BackPACK's relative error against the brute force (float64).
        backpack32: As ``backpack``, in float32.
        backpack32_err: As ``backpack_err``, in float32.
        ggnchunk: ``"ok"``, ``"wrong"`` or ``"error: ..."``.
        ggnchunk_err: ggnchunk's worst relative error over the chunkings.
        float32_err: ggnchunk's float32 relative error, if run.
        ggnchunk_s: Seconds of the ``num_chunks=1`` call.
        backpack_s: Seconds of BackPACK's forward and backward pass (float64).
        reference_s: Seconds of the brute force.
        zero: Whether the exact diagonal is all zero (a trivial problem).
        details: Tracebacks' last lines, per failed part.
    """

    id: str
    zero: bool = False
    backpack: str = ""
    backpack_err: float | None = None
    backpack32: str = ""
    backpack32_err: float | None = None
    ggnchunk: str = ""
    ggnchunk_err: float | None = None
    float32_err: float | None = None
    ggnchunk_s: float | None = None
    backpack_s: float | None = None
    reference_s: float | None = None
    details: dict[str, str] = field(default_factory=dict)


def relative_error(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    """Worst per-parameter error, relative as in ``assert_diag_close``.

    Args:
        actual: Diagonal under test, keyed by parameter name.
        expected: Brute-force diagonal, same keys and shapes.

    Returns:
        ``max over parameters of max|a - e| / scale``; ``inf`` on a key or shape mismatch.
    """
    if list(actual) != list(expected):
        return float("inf")
    overall = max(e.abs().max().item() for e in expected.values())
    worst = 0.0
    for name, exp in expected.items():
        act = actual[name].detach().double()
        if act.shape != exp.shape:
            return float("inf")
        scale = max(exp.abs().max().item(), 1e-3 * overall)
        if scale == 0.0:
            scale = 1.0
        worst = max(worst, (act - exp).abs().max().item() / scale)
    return worst


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 160 else text[:157] + "..."


def backpack_diag_ggn(
    problem: Problem, dtype: torch.dtype
) -> tuple[dict[str, Tensor], dict[str, Tensor], float]:
    """BackPACK's ``DiagGGNExact`` on the problem as BackPACK's test runs it.

    Args:
        problem: The problem.
        dtype: Floating-point type of the model and data for BackPACK (the brute force is
            always float64, of the same parameter values).

    Returns:
        BackPACK's diagonal, the brute force of the same (converted) model, and the seconds
        of BackPACK's forward and backward pass.
    """
    from backpack import backpack, extend
    from backpack.extensions import DiagGGNExact

    expected = reference_diag_ggn(*problem.set_up(converted=True))
    model, loss_func, inputs, targets = problem.set_up(converted=True, dtype=dtype)
    model, loss_func = extend(model), extend(loss_func)
    start = time.perf_counter()
    with backpack(DiagGGNExact()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_func(model(inputs), targets).backward()
    seconds = time.perf_counter() - start
    result = {
        n: p.diag_ggn_exact.detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    return result, expected, seconds


def run_problem(problem: Problem, rtol: float, float32: bool) -> Row:
    """Run one problem through the brute force, ggnchunk and BackPACK.

    Args:
        problem: The problem.
        rtol: Largest relative error that counts as ok in float64.
        float32: Also run ggnchunk in float32 (tolerance 1e-5).

    Returns:
        The problem's row.
    """
    row = Row(problem.id)
    start = time.perf_counter()
    expected = reference_diag_ggn(*problem.set_up())
    row.reference_s = time.perf_counter() - start
    row.zero = all(bool((e == 0).all()) for e in expected.values())

    errors = []
    try:
        for num_chunks in (1, 3):
            model, loss_func, inputs, targets = problem.set_up()
            start = time.perf_counter()
            actual = ggnchunk.diag_ggn(
                model, loss_func, inputs, targets, num_chunks=num_chunks
            )
            if num_chunks == 1:
                row.ggnchunk_s = time.perf_counter() - start
            errors.append(relative_error(actual, expected))
        if problem.plain_module_fn is not None:
            converted = problem.set_up(converted=True)
            actual = ggnchunk.diag_ggn(*converted, num_chunks=1)
            errors.append(relative_error(actual, reference_diag_ggn(*converted)))
        row.ggnchunk_err = max(errors)
        row.ggnchunk = "ok" if row.ggnchunk_err <= rtol else "wrong"
        if float32:
            model, loss_func, inputs, targets = problem.set_up(dtype=torch.float32)
            actual = ggnchunk.diag_ggn(model, loss_func, inputs, targets, num_chunks=1)
            row.float32_err = relative_error(actual, expected)
            if row.float32_err > 1e-5:
                row.ggnchunk = "wrong (float32)"
    except Exception as exc:
        row.ggnchunk = "error: " + _short(exc)
        row.details["ggnchunk"] = traceback.format_exc(limit=-3)

    try:
        result, bp_expected, row.backpack_s = backpack_diag_ggn(problem, torch.float64)
        row.backpack_err = relative_error(result, bp_expected)
        row.backpack = "ok" if row.backpack_err <= rtol else "wrong"
    except Exception as exc:
        row.backpack = "error: " + _short(exc)
        row.details["backpack"] = traceback.format_exc(limit=-3)
    try:
        result, bp_expected, _ = backpack_diag_ggn(problem, torch.float32)
        row.backpack32_err = relative_error(result, bp_expected)
        row.backpack32 = "ok" if row.backpack32_err <= 1e-5 else "wrong"
    except Exception as exc:
        row.backpack32 = "error: " + _short(exc)
        row.details["backpack32"] = traceback.format_exc(limit=-3)
    return row


def _fmt(value: float | None, spec: str = ".1e") -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[Row]) -> None:
    """Print one line per problem, then the counts and every failure's message.

    Args:
        rows: The problems' rows.
    """
    width = max(len(r.id) for r in rows) + 5
    head = (
        f"{'problem':<{width}}  {'BackPACK':<8} {'bp err':>7} {'bp32':<6} {'bp32 err':>8}  "
        f"{'ggnchunk':<8} "
        f"{'gc err':>7} {'f32 err':>7}  {'gc s':>6} {'bp s':>6} {'ref s':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.id + (' zero' if r.zero else ''):<{width}}  "
            f"{r.backpack.split(':')[0]:<8} {_fmt(r.backpack_err):>7} "
            f"{r.backpack32.split(':')[0]:<6} {_fmt(r.backpack32_err):>8}  "
            f"{r.ggnchunk.split(':')[0]:<8} {_fmt(r.ggnchunk_err):>7} "
            f"{_fmt(r.float32_err):>7}  {_fmt(r.ggnchunk_s, '.3f'):>6} "
            f"{_fmt(r.backpack_s, '.3f'):>6} {_fmt(r.reference_s, '.2f'):>6}"
        )
    print()
    print(f"problems: {len(rows)} ({sum(r.zero for r in rows)} with an all-zero diagonal)")
    print(f"BackPACK ok, float64: {sum(r.backpack == 'ok' for r in rows)}")
    print(f"BackPACK ok, float32: {sum(r.backpack32 == 'ok' for r in rows)}")
    print(f"ggnchunk ok: {sum(r.ggnchunk == 'ok' for r in rows)}")
    for r in rows:
        for who, status in (
            ("BackPACK float64", r.backpack),
            ("BackPACK float32", r.backpack32),
            ("ggnchunk", r.ggnchunk),
        ):
            if status != "ok":
                print(f"  {r.id}: {who} {status}")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        Exit status: 0 when ggnchunk is ok on every problem run, else 1.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], help="id substrings to run")
    parser.add_argument("--rtol", type=float, default=1e-9)
    parser.add_argument("--float32", action="store_true", help="also check float32")
    parser.add_argument("--json", help="write the rows to this JSON file")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    problems = [p for p in PROBLEMS if not args.only or any(s in p.id for s in args.only)]
    rows = []
    for problem in problems:
        row = run_problem(problem, args.rtol, args.float32)
        print(
            f"{row.id}: BackPACK {row.backpack} ({_fmt(row.backpack_err)}), "
            f"float32 {row.backpack32} ({_fmt(row.backpack32_err)}), "
            f"ggnchunk {row.ggnchunk} ({_fmt(row.ggnchunk_err)})",
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0 if all(r.ggnchunk == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
