"""Real peak memory under a budget, measured like the benchmarks: a fresh process each.

The tutorial's autoencoder (one pass: about +1,550 MiB) at three budgets; the peak
resident memory above the level before the call, polled every millisecond by
memory_profiler with glibc's mmap threshold pinned, must stay within the budget + 10%.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from benchmarks.runner import run_isolated


@pytest.mark.slow
@pytest.mark.parametrize("budget_mib", [100, 250, 600])
def test_peak_memory_stays_within_the_budget(budget_mib):
    with tempfile.TemporaryDirectory() as folder:
        record = run_isolated(
            "tutorial_conv_ae", "ggnchunk", {"max_memory": f"{budget_mib}MiB"}, "memory",
            Path(folder), threads=1, timeout=600,
        )  # fmt: skip
    assert "error" not in record, record.get("error")
    assert record["peak_mib"] <= 1.1 * budget_mib, record
    assert record["peak_mib"] >= 0.3 * budget_mib, record  # the budget is used, not ignored
