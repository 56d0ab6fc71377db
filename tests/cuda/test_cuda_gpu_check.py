"""``python -m tools.gpu_check``: the no-GPU exit, the parts' limits and the report writer.

Everything here runs on the CPU: the report is fed fake results, the junit parser reads
a real pytest run of a throw-away test file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tools import gpu_check

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check", "--out", str(tmp_path / "out")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA device" in done.stdout
    assert not (tmp_path / "out").exists()  # nothing written, nothing run


def test_makefile_has_the_gpu_check_target():
    text = (ROOT / "Makefile").read_text()
    assert "gpu-check:" in text and "-m tools.gpu_check" in text


def test_cuda_tests_are_collected_under_the_marker():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda", "--collect-only", "-q",
         "-p", "no:cacheprovider", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    files = {line.split("::")[0] for line in collected}
    for name in ("test_cuda.py", "test_cuda_memory.py", "test_cuda_models.py",
                 "test_cuda_tf32.py"):  # fmt: skip
        assert f"tests/cuda/{name}" in files, sorted(files)
    assert all(Path(f).name.startswith("test_cuda") for f in files), sorted(files)


def test_a_part_past_its_limit_is_killed_with_its_children_and_reported():
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('started', flush=True); time.sleep(60)\n"
    )
    start = time.perf_counter()
    part = gpu_check.run_part("slow", [sys.executable, "-c", code], timeout=3)
    assert time.perf_counter() - start < 30  # the child did not keep the pipe open
    assert part.timed_out and part.returncode != 0
    assert "started" in part.tail


def test_a_part_that_finishes_reports_its_exit_and_output():
    part = gpu_check.run_part(
        "quick", [sys.executable, "-c", "print('hello'); raise SystemExit(3)"], timeout=60
    )
    assert not part.timed_out and part.returncode == 3 and "hello" in part.tail


def test_junit_counts_and_failures_from_a_real_pytest_run(tmp_path):
    (tmp_path / "test_fake.py").write_text(
        textwrap.dedent("""
        import pytest

        def test_ok():
            pass

        def test_broken():
            assert 1 == 2, "the figure is off"

        @pytest.mark.skip(reason="no device")
        def test_skipped():
            pass

        @pytest.fixture
        def bad():
            raise RuntimeError("set-up failed")

        def test_error(bad):
            pass
    """)
    )
    junit = tmp_path / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--junitxml={junit}", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    outcome = gpu_check.parse_junit(junit)
    assert outcome.counts == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    by_test = {f["test"].split("::")[-1]: f["message"] for f in outcome.failures}
    assert "the figure is off" in by_test["test_broken"]
    assert "set-up failed" in by_test["test_error"]
    assert gpu_check.parse_junit(tmp_path / "missing.xml").counts["passed"] == 0


def _fake_benchmark(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "environment.json").write_text(
        json.dumps({"matmul_flops_start": 40e12, "matmul_flops": 50e12})
    )
    records = [
        {"problem": "unet_64", "label": "BackPACK one pass", "role": "backpack",
         "error": "NotImplementedError: GroupNorm"},
        {"problem": "unet_64", "label": "ggnchunk one pass", "role": "one_pass",
         "median_s": 0.5, "peak_mib": 800.0, "flops": 5e12},
        {"problem": "tutorial_conv_ae_n64", "label": "BackPACK one pass",
         "role": "backpack", "median_s": 2.0, "peak_mib": 1000.0, "flops": 10e12},
        {"problem": "tutorial_conv_ae_n64", "label": "ggnchunk budget", "role": "budget",
         "median_s": 0.5, "peak_mib": 90.0, "flops": 10e12, "passes": 12,
         "rel_diff": 3e-7},
    ]  # fmt: skip
    for r in records:
        name = f"{r['problem']}__{r['label'].replace(' ', '_')}.json"
        (folder / name).write_text(json.dumps(r))


def test_benchmark_rows_are_ratios_to_backpack_in_the_same_run(tmp_path):
    _fake_benchmark(tmp_path / "cuda-1t")
    rows, env = gpu_check.benchmark_rows(tmp_path / "cuda-1t")
    assert env["matmul_flops"] == 50e12
    budget = next(r for r in rows if r["role"] == "budget")
    assert budget["time_ratio"] == pytest.approx(0.5 / 2.0)
    assert budget["memory_ratio"] == pytest.approx(90.0 / 1000.0)
    assert budget["pct_of_matmul_peak"] == pytest.approx(100 * 10e12 / 0.5 / 50e12)
    one = next(r for r in rows if r["problem"] == "unet_64" and r["role"] == "one_pass")
    assert "time_ratio" not in one  # BackPACK failed: no ratio, the figures stay
    assert one["pct_of_matmul_peak"] == pytest.approx(100 * 5e12 / 0.5 / 50e12)
    failed = next(r for r in rows if r["problem"] == "unet_64" and r["role"] == "backpack")
    assert "GroupNorm" in failed["error"]
    assert [r["role"] for r in rows if r["problem"] == "tutorial_conv_ae_n64"] == [
        "backpack",
        "budget",
    ]


def test_report_holds_the_device_the_outcomes_and_every_figure(tmp_path):
    _fake_benchmark(tmp_path / "bench")
    rows, bench_env = gpu_check.benchmark_rows(tmp_path / "bench")
    env = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.9.0", "cuda_build": "12.8",
           "cudnn": 91002, "driver": "570.1", "capability": "9.0"}  # fmt: skip
    parts = [
        gpu_check.Part("tests", ["pytest"], returncode=1, seconds=200.0),
        gpu_check.Part("benchmark", ["bench"], returncode=-9, seconds=150.0,
                       timed_out=True, tail="last line of the benchmark"),
    ]  # fmt: skip
    tests = gpu_check.TestOutcome(
        counts={"passed": 40, "failed": 1, "errors": 0, "skipped": 2},
        failures=[{"test": "tests.cuda.test_cuda_memory::test_x", "message": "peak 5 > 4"}],
    )
    md, js = gpu_check.write_report(tmp_path / "report", env, parts, tests, rows, bench_env)
    text = md.read_text()
    for expected in ("NVIDIA H100 80GB HBM3", "2.9.0", "12.8", "91002", "570.1",
                     "40 passed", "1 failed", "2 skipped", "test_x", "peak 5 > 4",
                     "timed out", "last line of the benchmark", "50.00 TFLOP/s",
                     "0.25", "0.090", "20.0", "3.0e-07", "GroupNorm"):  # fmt: skip
        assert expected in text, expected
    data = json.loads(js.read_text())
    assert data["environment"]["device"] == env["device"]
    assert data["tests"]["counts"]["failed"] == 1
    assert data["parts"][1]["timed_out"] is True
    assert data["benchmark"]["matmul_flops"] == 50e12
    assert len(data["benchmark"]["rows"]) == len(rows)


def test_report_of_parts_not_run(tmp_path):
    md, js = gpu_check.write_report(tmp_path, {"device": "GPU"}, [], None, None)
    assert md.read_text().count("Not run.") == 2
    assert json.loads(js.read_text())["benchmark"] is None


def test_gpu_benchmark_rows_exist_with_their_gpu_sizes():
    from benchmarks.problems import GPU_PROBLEMS, PROBLEMS, build

    assert set(gpu_check.BENCH_PROBLEMS) <= set(PROBLEMS)
    assert set(GPU_PROBLEMS) <= set(PROBLEMS)
    shapes = {"tutorial_conv_ae_n64": (64, 3, 32, 32), "unet_64": (2, 3, 64, 64)}
    for name, shape in shapes.items():
        model, _, x, y = build(name, scale=4)  # the batch is the GPU's already
        assert tuple(x.shape) == shape
        assert model(x).shape == y.shape


def test_tests_run_file_by_file_within_the_budget(tmp_path, monkeypatch):
    header = "import time\nimport pytest\npytestmark = pytest.mark.cuda\n"
    files = {
        "test_a.py": header + "def test_ok():\n    pass\ndef test_bad():\n    assert 0\n",
        "test_b.py": header + "def test_slow():\n    time.sleep(120)\n",
        "test_c.py": header + "def test_never():\n    pass\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    names = [str(tmp_path / name) for name in files]
    monkeypatch.setattr(gpu_check, "cuda_test_files", lambda timeout: names)
    monkeypatch.setattr(gpu_check, "MIN_SECONDS_FOR_A_FILE", 3.0)
    parts: list[gpu_check.Part] = []
    # (3 s at least are left for the slow file once the first has run: it is killed)
    outcome = gpu_check.run_tests(tmp_path, 12.0, parts)
    assert [p.name for p in parts] == [f"tests {names[0]}", f"tests {names[1]}"]
    assert not parts[0].timed_out and parts[1].timed_out
    assert outcome.counts["passed"] == 1 and outcome.counts["failed"] == 1
    assert outcome.not_run == [names[2]]
    md, _ = gpu_check.write_report(tmp_path / "r", {}, parts, outcome, None)
    assert "Not run (time budget spent)" in md.read_text()


def test_report_holds_the_budgets_diagnosis_whole(tmp_path):
    budgets = '{"one_pass_mib": 10229.3, "one_pass_no_cudnn_mib": 228.2}'
    parts = [gpu_check.Part("budgets", ["python"], returncode=0, seconds=20.0,
                            tail=budgets)]  # fmt: skip
    md, _ = gpu_check.write_report(tmp_path, {"device": "GPU"}, parts, None, None)
    text = md.read_text()
    assert "Budgets and cuDNN's workspaces" in text and budgets in text


def test_budgets_diagnosis_without_a_gpu_and_its_glue_check_on_the_cpu(capsys):
    from tools import gpu_budgets

    if not torch.cuda.is_available():
        assert gpu_budgets.main([]) == 0
        assert "no CUDA device" in capsys.readouterr().out
    # the folded glue check itself, where the backward runs in the calling thread
    seen = gpu_budgets.folded_glue_paths("cpu")
    assert seen["all_columns"] > 0 and seen["column_by_column"] == 0
