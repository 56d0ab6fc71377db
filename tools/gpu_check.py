"""Check ggnchunk on a CUDA GPU in one command: every CUDA test and a GPU benchmark.

Usage::

    python -m tools.gpu_check [--out results/gpu_check] [--tests-timeout S]
                              [--bench-timeout S] [--problems NAME ...] [--skip-bench]

On a machine with a CUDA device and the project installed (``pip install -e '.[test]'``)
it runs, each part in its own process group under its own time limit:

1. the CUDA tests (``pytest -m cuda``: every test marked ``cuda``), one pytest run per
   file (the quick files first, :data:`TEST_ORDER`) within the tests' limit, with their
   outcome counts and each failure's message; a file past the limit is killed and
   reported, the files after it are listed as not run;
2. a GPU benchmark (``python -m benchmarks --device cuda --quick --only ...``): BackPACK's
   one pass and ggnchunk's one pass, budget and auto modes on a small set of problems
   (:data:`BENCH_PROBLEMS`), with time and allocator peak as ratios to BackPACK's one
   pass and the share of the GPU's float32 matmul peak measured in the same run;
3. ``python -m tools.gpu_budgets`` (60 s at most): one-pass peaks with and without cuDNN,
   two budgeted calls' chunk sizes and peaks, and whether the folded glue took all
   columns at once on the device thread (the open questions of the first GPU runs).

and writes one report, ``report.md`` and ``report.json`` in ``--out`` (both paths are
printed): device, driver, torch/CUDA/cuDNN versions, the test outcomes and failures, and
every benchmark figure. A part that runs past its limit is reported as timed out (with
the end of its output) and the next part still runs. The default limits (tests 200 s,
benchmark 240 s, budgets 60 s) keep the whole check under 9 minutes. Measured on an H200
(torch 2.11, 2026-11-27): the tests took 111 s; the benchmark ran past 130 s and 160 s
(each method's first call in a fresh process pays CUDA's and cuDNN's start-up, 0.4-4.3
s).

Without a CUDA device it says so and exits 0 (nothing to check). Exit status 1 if a test
failed or a part failed or timed out, else 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_PROBLEMS = ("tutorial_conv_ae_n64", "unet_64", "resnet18")
"""The benchmark's rows here: the larger GPU batches (see benchmarks/problems.py)."""
TESTS_TIMEOUT_S = 200.0
BENCH_TIMEOUT_S = 240.0
BUDGETS_TIMEOUT_S = 60.0
"""``python -m tools.gpu_budgets``: cuDNN's workspaces against a budget (its output is in
the report whole)."""
TEST_ORDER = ("test_cuda.py", "test_cuda_tf32.py", "test_cuda_memory.py",
              "test_cuda_models.py")  # fmt: skip
"""Files run first (the rest after them, by name): the quick ones before the table."""
TAIL_CHARS = 4000


@dataclass
class Part:
    """What one part (tests or benchmark) did."""

    name: str
    command: list[str]
    returncode: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    tail: str = ""


@dataclass
class TestOutcome:
    """Outcome counts of the CUDA tests and each failure."""

    counts: dict[str, int] = field(default_factory=dict)
    failures: list[dict[str, str]] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)  # files left when time ran out


# -- running the parts --------------------------------------------------------------------


def run_part(
    name: str, command: list[str], timeout: float, env: dict | None = None
) -> Part:
    """Run ``command`` in its own process group; kill the group after ``timeout`` s."""
    part = Part(name, command)
    start = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        part.timed_out = True
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    part.seconds = time.perf_counter() - start
    part.returncode = process.returncode
    part.tail = (output or "")[-TAIL_CHARS:]
    return part


def parse_junit(path: Path) -> TestOutcome:
    """Outcome counts and failures from pytest's ``--junitxml`` file.

    Args:
        path: The XML file (a missing or unreadable file gives empty counts).

    Returns:
        Counts of ``passed``, ``failed``, ``errors`` and ``skipped``, and one
        ``{"test", "message"}`` per failure or error.
    """
    outcome = TestOutcome(counts={"passed": 0, "failed": 0, "errors": 0, "skipped": 0})
    try:
        tree = ET.parse(path)
    except (OSError, ET.ParseError):
        return outcome
    for case in tree.iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = [child.tag for child in case]
        if "failure" in kinds or "error" in kinds:
            child = case.find("failure")
            key = "failed"
            if child is None:
                child, key = case.find("error"), "errors"
            outcome.counts[key] += 1
            message = (child.get("message") or child.text or "").strip()
            outcome.failures.append({"test": test, "message": message[:1500]})
        elif "skipped" in kinds:
            outcome.counts["skipped"] += 1
        else:
            outcome.counts["passed"] += 1
    return outcome


def benchmark_rows(folder: Path) -> tuple[list[dict], dict]:
    """Every configuration of a benchmark results folder, with its ratios.

    Args:
        folder: ``<out>/cuda-<threads>`` written by ``python -m benchmarks``.

    Returns:
        ``(rows, environment)``: per problem and method, time (s), allocator peak
        (MiB), their ratios to BackPACK's one pass in the same run, GFLOP/s and the share
        of the float32 matmul peak, passes, chunk size, the error against the
        reference, or the failure.
    """
    env_file = folder / "environment.json"
    env = json.loads(env_file.read_text()) if env_file.is_file() else {}
    peak = env.get("matmul_flops") or env.get("matmul_flops_start")
    records = [json.loads(p.read_text()) for p in sorted(folder.glob("*__*.json"))]
    base = {
        r["problem"]: r for r in records if r.get("role") == "backpack" and "error" not in r
    }
    rows = []
    for r in records:
        row = {
            key: r.get(key)
            for key in ("problem", "label", "role", "median_s", "first_call_s",
                        "peak_mib", "cold_peak_mib", "passes", "chunk_size", "rel_diff",
                        "budget")
        }  # fmt: skip
        if "error" in r:
            row["error"] = str(r["error"])[:300]
        ref = base.get(r["problem"])
        if ref is not None and "error" not in r:
            if r.get("median_s") and ref.get("median_s"):
                row["time_ratio"] = r["median_s"] / ref["median_s"]
            if r.get("peak_mib") is not None and ref.get("peak_mib"):
                row["memory_ratio"] = r["peak_mib"] / ref["peak_mib"]
        if r.get("flops") and r.get("median_s"):
            row["gflops"] = r["flops"] / r["median_s"] / 1e9
            if peak:
                row["pct_of_matmul_peak"] = 100.0 * r["flops"] / r["median_s"] / peak
        rows.append(row)
    order = {"backpack": 0, "one_pass": 1, "budget": 2, "auto": 3}
    rows.sort(key=lambda row: (row["problem"], order.get(row["role"], 9), row["label"]))
    return rows, env


def cuda_test_files(timeout: float = 120.0) -> list[str]:
    """The test files holding tests marked ``cuda`` (``pytest -m cuda --collect-only``)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda", "--collect-only", "-q",
         "-p", "no:cacheprovider", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    files = [line.split("::")[0] for line in done.stdout.splitlines() if "::" in line]
    order = {name: i for i, name in enumerate(TEST_ORDER)}
    unique = list(dict.fromkeys(files))
    return sorted(unique, key=lambda f: (order.get(Path(f).name, len(order)), f))


MIN_SECONDS_FOR_A_FILE = 10.0  # a file is not started with less time left


def run_tests(out: Path, budget: float, parts: list[Part]) -> TestOutcome:
    """Every CUDA test, one pytest run per file within the remaining ``budget`` seconds.

    A file past the remaining time is killed and reported (its tests count as not
    run); the files after it are reported as not run. Each run's parts are appended
    to ``parts``.
    """
    start = time.perf_counter()
    total = TestOutcome(counts={"passed": 0, "failed": 0, "errors": 0, "skipped": 0})
    try:
        files = cuda_test_files(min(120.0, budget))
    except subprocess.TimeoutExpired:
        files = []
    total.counts["files"] = len(files)
    for index, name in enumerate(files):
        left = budget - (time.perf_counter() - start)
        if left < MIN_SECONDS_FOR_A_FILE:
            total.not_run = files[index:]
            break
        junit = out / f"junit-{Path(name).stem}.xml"
        junit.unlink(missing_ok=True)
        command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q",
                   "-p", "no:cacheprovider", f"--junitxml={junit}", name]  # fmt: skip
        parts.append(run_part(f"tests {name}", command, left))
        outcome = parse_junit(junit)
        for key, value in outcome.counts.items():
            total.counts[key] = total.counts.get(key, 0) + value
        total.failures += outcome.failures
        if parts[-1].timed_out:
            total.not_run = files[index + 1 :]
            break
    return total


# -- the environment ----------------------------------------------------------------------


def _driver() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def environment() -> dict:
    """Device, driver and versions (CUDA fields only where a device is available)."""
    import torch

    import ggnchunk

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
        text=True, check=False,
    ).stdout.strip() or None  # fmt: skip
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "ggnchunk": ggnchunk.__version__,
        "commit": commit,
        # the commit a copied tree reports can be stale (the GPU machine's was, on
        # 2026-11-27): the hash of the package's sources names the code that ran
        "source_sha256": source_hash(),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            device=torch.cuda.get_device_name(0),
            device_count=torch.cuda.device_count(),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            memory_gib=round(props.total_memory / 2**30, 1),
            cudnn=torch.backends.cudnn.version(),
            driver=_driver(),
            nccl=_nccl_version(),
        )
    return env


def source_hash() -> str:
    """The first 12 hex digits of a SHA-256 over ``ggnchunk/``'s Python sources."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "ggnchunk").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _nccl_version() -> str | None:
    try:
        import torch

        version = torch.cuda.nccl.version()
    except (ImportError, RuntimeError, AttributeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


# -- the report ---------------------------------------------------------------------------


def _cell(value, fmt: str = "{:.3g}") -> str:
    if value is None:
        return ""
    return fmt.format(value) if isinstance(value, (int, float)) else str(value)


def write_report(
    out: Path,
    env: dict,
    parts: list[Part],
    tests: TestOutcome | None,
    bench: list[dict] | None,
    bench_env: dict | None = None,
) -> tuple[Path, Path]:
    """Write ``report.md`` and ``report.json`` into ``out``; return their paths.

    Args:
        out: The folder (created).
        env: :func:`environment`'s record.
        parts: What each part ran, how long, and whether it timed out.
        tests: The CUDA tests' outcome (``None``: not run).
        bench: :func:`benchmark_rows` (``None``: not run).
        bench_env: The benchmark's own environment record (matmul peak).

    Returns:
        ``(markdown path, JSON path)``.
    """
    out.mkdir(parents=True, exist_ok=True)
    bench_env = bench_env or {}
    peak = bench_env.get("matmul_flops") or bench_env.get("matmul_flops_start")
    data = {
        "environment": env,
        "parts": [asdict(p) for p in parts],
        "tests": asdict(tests) if tests is not None else None,
        "benchmark": {"matmul_flops": peak, "rows": bench} if bench is not None else None,
    }
    json_path = out / "report.json"
    json_path.write_text(json.dumps(data, indent=2, default=str))

    lines = ["# ggnchunk GPU check", ""]
    keys = ("device", "capability", "memory_gib", "driver", "torch", "cuda_build",
            "cudnn", "nccl", "python", "ggnchunk", "commit", "source_sha256",
            "date")  # fmt: skip
    lines += ["| | |", "|---|---|"]
    lines += [f"| {k} | {env[k]} |" for k in keys if env.get(k) is not None]
    lines += [
        "",
        "## Parts",
        "",
        "| part | seconds | exit | outcome |",
        "|---|---|---|---|",
    ]
    for p in parts:
        state = "timed out" if p.timed_out else ("ok" if p.returncode == 0 else "failed")
        lines.append(f"| {p.name} | {p.seconds:.0f} | {p.returncode} | {state} |")
    lines += ["", "## CUDA tests", ""]
    if tests is None:
        lines.append("Not run.")
    else:
        lines.append(", ".join(f"{v} {k}" for k, v in tests.counts.items()) + ".")
        if tests.not_run:
            lines.append(f"Not run (time budget spent): {', '.join(tests.not_run)}.")
        for failure in tests.failures:
            lines += ["", f"- `{failure['test']}`", "", "  ```",
                      *("  " + line for line in failure["message"].splitlines()[:20]),
                      "  ```"]  # fmt: skip
    for p in parts:
        if p.name == "budgets":
            lines += ["", "## Budgets and cuDNN's workspaces (`tools.gpu_budgets`)", "",
                      "```", p.tail[-3500:], "```"]  # fmt: skip
            continue
        if p.timed_out or (p.returncode not in (0, None) and p.name == "benchmark"):
            state = "timed out" if p.timed_out else f"exit {p.returncode}"
            lines += ["", f"### End of the {p.name} output ({state})", "", "```",
                      p.tail[-2000:], "```"]  # fmt: skip
    lines += ["", "## GPU benchmark", ""]
    if bench is None:
        lines.append("Not run.")
    else:
        if peak:
            lines.append(
                f"float32 matmul peak (TF32 off), same run: {peak / 1e12:.2f} TFLOP/s. "
                "Ratios are to BackPACK's one pass in the same run."
            )
        lines += [
            "",
            "| problem | method | time (s) | × BackPACK | peak (MiB) | × BackPACK "
            "| passes | % of matmul peak | rel. diff |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in bench:
            if r.get("error"):
                lines.append(f"| {r['problem']} | {r['label']} | failed: "
                             f"{r['error'][:120]} | | | | | | |")  # fmt: skip
                continue
            lines.append(
                f"| {r['problem']} | {r['label']} | {_cell(r.get('median_s'), '{:.4f}')} "
                f"| {_cell(r.get('time_ratio'), '{:.2f}')} "
                f"| {_cell(r.get('peak_mib'), '{:.1f}')} "
                f"| {_cell(r.get('memory_ratio'), '{:.3f}')} | {_cell(r.get('passes'))} "
                f"| {_cell(r.get('pct_of_matmul_peak'), '{:.1f}')} "
                f"| {_cell(r.get('rel_diff'), '{:.1e}')} |"
            )
    md_path = out / "report.md"
    md_path.write_text("\n".join(lines) + "\n")
    return md_path, json_path


# -- the command --------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.gpu_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "gpu_check")
    parser.add_argument("--tests-timeout", type=float, default=TESTS_TIMEOUT_S)
    parser.add_argument("--bench-timeout", type=float, default=BENCH_TIMEOUT_S)
    parser.add_argument("--problems", nargs="+", default=list(BENCH_PROBLEMS))
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-budgets", action="store_true")
    parser.add_argument("--budgets-timeout", type=float, default=BUDGETS_TIMEOUT_S)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the check; return the exit status (0 without a CUDA device)."""
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device is available (torch {torch.__version__}, CUDA "
            f"build {torch.version.cuda}); nothing to check.",
            flush=True,
        )
        return 0
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    print(f"gpu_check: {env['device']}, torch {env['torch']}, CUDA {env['cuda_build']}",
          flush=True)  # fmt: skip
    parts: list[Part] = []
    tests = bench = bench_env = None
    if not args.skip_tests:
        tests = run_tests(out, args.tests_timeout, parts)
        print(f"gpu_check: tests {tests.counts}", flush=True)
    if not args.skip_bench:
        folder = out / "bench"
        shutil.rmtree(folder, ignore_errors=True)  # no figures from an earlier run
        per_process = max(30.0, args.bench_timeout / 3)
        command = [sys.executable, "-m", "benchmarks", "--device", "cuda", "--quick",
                   "--out", str(folder), "--timeout", str(per_process),
                   "--only", *args.problems]  # fmt: skip
        parts.append(run_part("benchmark", command, args.bench_timeout))
        bench, bench_env = benchmark_rows(folder / "cuda-1t")
        print(f"gpu_check: benchmark, {len(bench)} rows in {parts[-1].seconds:.0f} s"
              + (" (timed out)" if parts[-1].timed_out else ""), flush=True)  # fmt: skip
    if not args.skip_budgets:
        parts.append(run_part(
            "budgets", [sys.executable, "-m", "tools.gpu_budgets"], args.budgets_timeout
        ))  # fmt: skip
        print(f"gpu_check: budgets in {parts[-1].seconds:.0f} s", flush=True)
    md, js = write_report(out, env, parts, tests, bench, bench_env)
    print(f"gpu_check: wrote {md} and {js}", flush=True)
    failed = any(p.timed_out or p.returncode != 0 for p in parts) or bool(
        tests and (tests.counts.get("failed") or tests.counts.get("errors"))
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
