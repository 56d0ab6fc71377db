"""``python -m benchmarks`` end to end on its smallest problem, in a subprocess.

The quick mode on ``tiny_mlp_ae`` (a 32-16-32 autoencoder) with one repeat: every row of
the benchmark table (BackPACK's one pass, ggnchunk's budget, auto and one pass) is
measured in its own fresh process and lands in the JSON, ``table.md`` (with the targets)
and the results markdown.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_benchmarks_help():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m benchmarks")
    for option in ("--quick", "--only", "--threads", "--timeout", "--results-md"):
        assert option in done.stdout


def test_benchmarks_reject_an_unknown_problem(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--only", "no_such_problem",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "unknown problem" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_quick_benchmark_end_to_end(tmp_path):
    results_md = tmp_path / "RESULTS.md"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "tiny_mlp_ae",
         "--repeats", "1", "--budget-mib", "64", "--timeout", "50",
         "--out", str(tmp_path), "--results-md", str(results_md)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    folder = tmp_path / "cpu-1t"
    env = json.loads((folder / "environment.json").read_text())
    assert env["threads"] == 1 and env["matmul_flops"] > 0 and env["torch"]
    records = {
        r["role"]: r for r in map(json.loads, map(Path.read_text, folder.glob("*__*.json")))
    }
    assert set(records) == {"backpack", "budget", "auto", "one_pass"}
    for role, record in records.items():
        assert "error" not in record, (role, record["error"])
        assert record["median_s"] > 0 and record["peak_mib"] is not None
        assert record["threads"] == 1 and record["flops"] > 0
        if role != "backpack":  # equal to BackPACK's one pass
            assert record["rel_diff"] < 1e-5, (role, record["rel_diff"])
    assert records["budget"]["budget"]["mib"] == 64
    assert records["auto"]["params"] == {"chunk_size": "auto", "max_memory": "64.0MiB"}
    table = (folder / "table.md").read_text()
    for text in ("ggnchunk budget", "ggnchunk auto", "% of matmul peak", "targets"):
        assert text in table
    assert "auto ≤ 1.05× budget-mode time" in table
    assert "thread(s)" in results_md.read_text()
