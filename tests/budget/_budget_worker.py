"""Run one budgeted call in this (fresh) process and print its peak RSS growth as JSON.

``python -m tests.budget._budget_worker PROBLEM BUDGET SCENARIO [auto]``: ``SCENARIO``
is ``first`` (the first call in the process), ``warm`` (after a small call),
``after_large`` (after an earlier one-pass call, as a notebook's previous cell),
``trimmed`` (after a first budgeted call whose freed memory went back to the OS: the
benchmark's warm call) or ``twice`` (the first two calls, printed as a list, with the
code each paged in) or ``set_up`` (the first call, the one-time set-up it pays before
its baseline paid before the measure's baseline instead). The peak is the kernel's own
high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` just before the
call) minus the resident set size just before the call: exactly what a user measuring
the call sees. No allocator variables are set: the parent removes them. A last argument
``auto`` adds ``chunk_size="auto"`` to the budgeted calls. An argument
``--reference=PATH`` keeps the unbudgeted reference diagonal there: a later case of the
same problem (a deterministic build: seed 0, one thread) loads it instead of computing
it again.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import sys

import torch

import ggnchunk
from benchmarks import problems
from benchmarks.peak import high_water_mark_mib, status_bytes


def main() -> None:
    argv = [a for a in sys.argv if not a.startswith("--reference=")]
    stored = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--reference=")]
    name, budget, scenario = argv[1:4]
    if argv[4:] == ["auto"]:  # auto mode within the budget
        _OPTIONS["chunk_size"] = "auto"
    torch.set_num_threads(1)
    model, loss_func, x, y = problems.build(name)  # seed 0, eval mode
    if scenario == "twice":  # the first call in the process, then a second one
        print(json.dumps([_call(model, loss_func, x, y, budget) for _ in range(2)]))
        return
    if scenario == "set_up":  # the first call, its one-time set-up paid before
        # (which a call pays before its own baseline; the measure here starts earlier)
        from ggnchunk._memory import parse_memory
        from ggnchunk._warmup import (
            ensure_batched_autograd,
            ensure_matmul_pool,
            warm_up_for,
        )

        first = next(model.parameters())
        warm_up_for(model, first.dtype, first.device)
        ensure_batched_autograd()
        parameters = sum(p.numel() for p in model.parameters())
        ensure_matmul_pool(first.dtype, first.device, parse_memory(budget), parameters)
    elif scenario == "warm":
        ggnchunk.diag_ggn(model, loss_func, x[:2], y[:2], num_chunks=2)
    elif scenario == "after_large":
        ggnchunk.diag_ggn(model, loss_func, x, y)
    elif scenario == "trimmed":  # the benchmark's warm call: after a first budgeted call
        ggnchunk.diag_ggn(model, loss_func, x, y, max_memory=budget, **_OPTIONS)
        gc.collect()
        _malloc_trim()
    try:
        record, diag = _measured(model, loss_func, x, y, budget)
    except ggnchunk.MemoryBudgetError as error:  # refused before any pass: a record
        print(json.dumps({"refused": str(error)}))
        return
    reference = _reference(model, loss_func, x, y, stored[0] if stored else None)
    # relative to the diagonal's largest entry: a parameter whose diagonal is exactly
    # zero (a bias before an instance norm) has only float32 rounding in both calls
    scale = max(float(v.abs().max()) for v in reference.values())
    error = max(float((diag[k] - reference[k]).abs().max()) for k in diag)
    error /= max(scale, 1e-30)
    print(json.dumps({**record, "error": error}))


def _reference(model, loss_func, x, y, path: str | None) -> dict:
    """The unbudgeted diagonal (7 chunks), computed once per ``path`` (see the module)."""
    if path is not None and os.path.exists(path):
        return torch.load(path)
    reference = ggnchunk.diag_ggn(model, loss_func, x, y, num_chunks=7)
    if path is not None:  # written whole, then renamed: a reader never sees a part
        torch.save(reference, f"{path}.{os.getpid()}")
        os.replace(f"{path}.{os.getpid()}", path)
    return reference


_OPTIONS: dict = {}  # more of the budgeted call's options (auto mode)


def _measured(model, loss_func, x, y, budget: str) -> tuple[dict, dict]:
    """One budgeted call: its peak, the code it paged in (``RssFile``), its plan."""
    code = status_bytes("RssFile")
    measured = high_water_mark_mib(
        lambda: ggnchunk.diag_ggn(
            model, loss_func, x, y, max_memory=budget, return_report=True, **_OPTIONS
        )
    )
    if measured is None or code is None:
        raise RuntimeError("the budget tests need Linux's /proc/self/clear_refs")
    peak_mib, (diag, report) = measured
    record = {
        "peak_mib": peak_mib, "code_mib": (status_bytes("RssFile") - code) / 2**20,
        "passes": report.num_passes, "chunk_size": report.chunk_size,
        # what the call reports as its one-time set-up, paid before its baseline (the
        # data it left resident, and the code it paged in)
        "setup_mib": report.setup_bytes / 2**20,
    }  # fmt: skip
    return record, diag


def _malloc_trim() -> None:
    """Return the memory the allocator keeps to the OS (glibc), as the benchmark does."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _call(model, loss_func, x, y, budget: str) -> dict:
    """One budgeted call's record (see :func:`_measured`)."""
    return _measured(model, loss_func, x, y, budget)[0]


if __name__ == "__main__":
    main()
