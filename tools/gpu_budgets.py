"""On a CUDA machine: what cuDNN's workspaces do to budgets, in one short run.

Usage::

    python -m tools.gpu_budgets [--problem conv_ae_28] [--scale 4] [--share 0.2]

The first GPU runs (2026-11-27, one H200) found a convolutional autoencoder whose one
pass took 10.0 GiB with cuDNN and 0.2 GiB without: cuDNN sizes a convolution's workspace
from the device's free memory, which no bound sees. This prints, as one JSON object:

- the one-pass peak with cuDNN, without it, and after ``empty_cache`` (MiB);
- three budgeted calls in a row at ``share`` of the one-pass peak (the third after an
  uncapped one pass, whose workspaces the allocator caches): their chunk sizes, each
  chunk's peak (MiB), the call's peak, the time, the warnings, the passes split or run
  again uncapped after running out of memory under the allocator's cap, and the
  allocator's fraction afterwards;
- whether the folded glue took all columns at once (``on_columns`` on the device
  thread, see ``ggnchunk._autograd``).

Without a CUDA device it says so and exits 0. ``python -m tools.gpu_check`` runs it as
a part of its report.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

MiB = 2**20


def _peak(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``fn``'s allocator peak above the memory in use before it (MiB), and its result."""
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / MiB, result


def budgets(problem: str, scale: int, share: float) -> dict[str, Any]:
    """The figures the module docstring lists, for one benchmark problem.

    Args:
        problem: A name of ``benchmarks.problems``.
        scale: Its batch scale.
        share: The budget as a share of the one-pass peak.

    Returns:
        A JSON-ready dict.
    """
    import ggnchunk
    from benchmarks.problems import build

    model, loss, x, y = build(problem, "cuda", scale=scale)
    out: dict[str, Any] = {"problem": problem, "scale": scale,
                           "cudnn": torch.backends.cudnn.version()}  # fmt: skip
    ggnchunk.diag_ggn(model, loss, x, y)  # set-up, workspaces
    out["one_pass_mib"] = _peak(lambda: ggnchunk.diag_ggn(model, loss, x, y))[0]
    with torch.backends.cudnn.flags(enabled=False):
        ggnchunk.diag_ggn(model, loss, x, y)
        out["one_pass_no_cudnn_mib"] = _peak(lambda: ggnchunk.diag_ggn(model, loss, x, y))[
            0
        ]
    torch.cuda.empty_cache()
    out["one_pass_after_empty_cache_mib"] = _peak(
        lambda: ggnchunk.diag_ggn(model, loss, x, y)
    )[0]
    budget = int(share * out["one_pass_mib"] * MiB)
    out["budget_mib"] = budget / MiB
    for label in ("budgeted_first", "budgeted_again", "budgeted_after_uncapped"):
        if label == "budgeted_after_uncapped":
            # an uncapped call's workspaces left in the allocator's cache, as a test
            # process has them (the second loan: 6.98 GB under a 2 GiB budget there)
            ggnchunk.diag_ggn(model, loss, x, y)
            out["cached_before_mib"] = round(
                (torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / MiB, 1
            )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            peak, (_, report) = _peak(
                lambda: ggnchunk.diag_ggn(
                    model, loss, x, y, max_memory=budget, return_report=True
                )
            )
            seconds = time.perf_counter() - start
        chunks = report.schedules[0].chunks
        out[label] = {
            "seconds": round(seconds, 3),
            "peak_mib": round(peak, 1),
            "sizes": [c.stop - c.start for c in chunks],
            "chunk_peaks_mib": [round((c.peak_extra_bytes or 0) / MiB, 1) for c in chunks],
            "oom_splits": report.schedules[0].out_of_memory_splits,
            "uncapped_passes": report.schedules[0].uncapped_passes,
            "fraction_after": torch.cuda.get_per_process_memory_fraction(),
            "warnings": [f"{w.category.__name__}: {str(w.message)[:160]}" for w in caught],
        }
    out["folded_glue"] = folded_glue_paths("cuda")
    return out


class _Glue(torch.nn.Module):
    """Convolutions with a reflection pad and max pooling between them (folded glue)."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Conv2d(3, 4, 3)
        self.second = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        h = self.first(torch.nn.functional.pad(x, (1, 1, 1, 1), mode="reflect"))
        h = torch.nn.functional.max_pool2d(torch.relu(h), 2)
        return self.second(h).flatten(1)


@contextlib.contextmanager
def folded_paths() -> Iterator[list[bool]]:
    """Record, per folded glue node's backward in the block, whether it got all columns.

    Yields:
        The list the block's records go to (``True``: all columns at once, ``False``:
        the per-column fallback of a leading axis of one).
    """
    from ggnchunk import _autograd, _glue_kernels

    seen: list[bool] = []
    original = _glue_kernels.on_columns

    def spy(grads, backward):
        def recorded(*columns):
            seen.append(not any(_autograd._legacy_batched(c) for c in columns))
            return backward(*columns)

        return original(grads, recorded)

    _glue_kernels.on_columns = spy
    try:
        yield seen
    finally:
        _glue_kernels.on_columns = original


def folded_glue_paths(device: str = "cuda") -> dict[str, int]:
    """How many folded glue backward calls got all columns at once, and how many not.

    Args:
        device: Where the small model runs.

    Returns:
        ``{"all_columns": n, "column_by_column": m}``.
    """
    import ggnchunk

    torch.manual_seed(0)
    model = _Glue().to(device)
    x = torch.randn(2, 3, 8, 8, device=device)
    target = torch.randn(2, 64, device=device)
    with folded_paths() as seen, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ggnchunk.diag_ggn(model, torch.nn.MSELoss(), x, target, num_chunks=2)
    return {"all_columns": sum(seen), "column_by_column": len(seen) - sum(seen)}


def main(argv: list[str] | None = None) -> int:
    """Print the figures as JSON; 0 without a CUDA device (nothing to measure)."""
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_budgets")
    parser.add_argument("--problem", default="conv_ae_28")
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--share", type=float, default=0.2)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_budgets: no CUDA device is available; nothing to measure.")
        return 0
    print(json.dumps(budgets(args.problem, args.scale, args.share), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
