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
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]


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
        assert record["first_call_plain"] and record["first_call_s"] > 0
        assert record["cold_peak_mib"] is not None
        if role != "backpack":  # equal to BackPACK's one pass
            assert record["rel_diff"] < 1e-5, (role, record["rel_diff"])
    assert records["budget"]["budget"]["mib"] == 64
    assert records["auto"]["params"] == {"chunk_size": "auto", "max_memory": "64.0MiB"}
    table = (folder / "table.md").read_text()
    for text in ("ggnchunk budget", "ggnchunk auto", "% of matmul peak", "targets"):
        assert text in table
    assert "auto ≤ 1.05× budget-mode time" in table
    both = records["auto"]["interleaved"]  # auto and budget alternated in one process
    assert both["params"] == records["budget"]["params"]
    assert len(both["times_s"]) == len(both["other_times_s"]) >= 1
    assert "alternated in one process" in table
    assert "First call in a fresh process against warm calls" in table
    assert "budget: first call within ±20% of a warm call's time" in table
    assert "auto: peak 50%–100% of the budget (first call, warm call)" in table
    assert "thread(s)" in results_md.read_text()


# -- where a run writes (issue 21: a quick run deleted the committed results) --------------

COMMITTED = ROOT / "benchmarks" / "results"


class _FakeBench:
    """Stands in for :class:`benchmarks.__main__.Bench`: records where it would write."""

    seen: ClassVar[list[Path]] = []

    def __init__(self, args, threads):
        self.out = args.out / f"{args.device}-{threads}t"
        _FakeBench.seen.append(args.out)

    def run(self, problems):
        self.out.mkdir(parents=True, exist_ok=True)
        return self.out


def test_default_out_is_a_new_git_ignored_folder_outside_the_committed_results():
    from benchmarks.__main__ import default_out

    first, later = default_out(1_700_000_000.0), default_out(1_700_000_001.0)
    assert first != later and first.name.startswith("run-")
    assert first.parent == ROOT / "results" / "benchmarks"
    assert COMMITTED not in first.parents
    done = subprocess.run(
        ["git", "check-ignore", "-q", str(first / "cpu-1t" / "x__y.json")],
        cwd=ROOT, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 0  # ignored by git


def test_a_run_without_out_writes_to_the_default_folder(tmp_path, monkeypatch):
    import benchmarks.__main__ as bench

    monkeypatch.setattr(bench, "Bench", _FakeBench)
    monkeypatch.setattr(bench, "default_out", lambda: tmp_path / "run-new")
    monkeypatch.setattr(bench.plot, "results_markdown", lambda folders: "tables")
    _FakeBench.seen = []
    bench.main(["--quick", "--only", "tiny_mlp_ae"])
    assert _FakeBench.seen == [tmp_path / "run-new"]
    assert (tmp_path / "run-new" / "RESULTS.md").read_text() == "tables"


def test_a_folder_with_an_earlier_runs_records_is_refused_and_kept(tmp_path, monkeypatch):
    import benchmarks.__main__ as bench

    folder = tmp_path / "cpu-1t"
    folder.mkdir()
    record = folder / "mlp_ae__ggnchunk_budget.json"
    record.write_text('{"kept": true}')
    monkeypatch.setattr(bench.Bench, "run", lambda self, problems: self.out)
    monkeypatch.setattr(bench.plot, "results_markdown", lambda folders: "")
    with pytest.raises(SystemExit, match="earlier run.*--overwrite.*--resume"):
        bench.main(["--quick", "--only", "tiny_mlp_ae", "--out", str(tmp_path)])
    assert record.read_text() == '{"kept": true}'
    bench.main(["--quick", "--only", "tiny_mlp_ae", "--out", str(tmp_path),
                "--overwrite", "--results-md", str(tmp_path / "R.md")])  # fmt: skip
    assert not record.exists()  # asked for


def test_the_committed_results_are_refused_without_overwrite(monkeypatch):
    import benchmarks.__main__ as bench

    assert any((COMMITTED / "cpu-1t").glob("*__*.json"))
    monkeypatch.setattr(bench, "Bench", _FakeBench)
    _FakeBench.seen = []
    with pytest.raises(SystemExit, match="committed results"):
        bench.main(["--quick", "--only", "mlp_ae", "--out", str(COMMITTED)])
    assert _FakeBench.seen == []  # refused before anything ran


def test_resume_needs_the_folder_of_the_run_it_completes(monkeypatch):
    import benchmarks.__main__ as bench

    monkeypatch.setattr(bench, "Bench", _FakeBench)
    with pytest.raises(SystemExit, match="--resume.*--out"):
        bench.main(["--quick", "--only", "tiny_mlp_ae", "--resume"])


def test_quick_leaves_out_the_slow_rows_unless_named(tmp_path, monkeypatch):
    import benchmarks.__main__ as bench
    from benchmarks.problems import DEFAULT_PROBLEMS, QUICK_SKIPPED

    ran = []
    monkeypatch.setattr(bench.Bench, "run", lambda self, problems: ran.append(problems))
    monkeypatch.setattr(bench.plot, "results_markdown", lambda folders: "")
    bench.main(["--quick", "--out", str(tmp_path / "a")])
    assert ran[-1] == [p for p in DEFAULT_PROBLEMS if p not in QUICK_SKIPPED]
    assert set(DEFAULT_PROBLEMS) >= QUICK_SKIPPED
    bench.main(["--quick", "--only", *QUICK_SKIPPED, "--out", str(tmp_path / "b")])
    assert set(ran[-1]) == QUICK_SKIPPED


# -- issue 21's targets: the first call in a fresh process ---------------------------------


def _record(role, **fields):
    return {"problem": "p", "label": role, "role": role, **fields}


def _targets(records):
    from benchmarks import plot

    return {g["target"]: g for g in plot.targets({}, {"p": records})}


@pytest.mark.parametrize(
    ("first_s", "met"), [(1.19, True), (0.81, True), (1.25, False), (0.75, False)]
)
def test_first_call_target_is_within_20_percent_of_the_warm_time(first_s, met):
    budget = {"mib": 100.0}
    rows = _targets([
        _record("budget", median_s=1.0, first_call_s=first_s, first_call_plain=True,
                peak_mib=60.0, cold_peak_mib=90.0, budget=budget),
    ])  # fmt: skip
    assert rows["budget: first call within ±20% of a warm call's time"]["met"] is met
    assert rows["budget: peak 50%–100% of the budget (first call, warm call)"]["met"]


def test_first_call_target_compares_with_every_warm_call_of_the_configuration():
    # one timed warm call (a quick run's long problem) that the machine slowed down, and
    # auto's own alternated calls of the same configuration in the same process
    auto = _record(
        "auto", median_s=12.2, times_s=[12.2], first_call_s=9.5, first_call_plain=True,
        interleaved={"times_s": [7.3, 8.6, 9.1], "other_times_s": [8.0, 8.6, 8.3]},
        peak_mib=60.0, cold_peak_mib=60.0, budget={"mib": 100.0},
    )  # fmt: skip
    row = _targets([auto])["auto: first call within ±20% of a warm call's time"]
    # median of 12.2, 7.3, 8.6, 9.1 is 8.85 s: 9.5 / 8.85 = 1.07, not 9.5 / 12.2 = 0.78
    assert row["met"] is True and "8.850 s warm = 1.07×" in row["measured"]
    slow = _record(
        "auto", median_s=5.0, times_s=[5.0], first_call_s=9.5, first_call_plain=True,
        interleaved={"times_s": [5.1, 4.9, 5.0]}, peak_mib=60.0, cold_peak_mib=60.0,
        budget={"mib": 100.0},
    )  # fmt: skip
    assert not _targets([slow])["auto: first call within ±20% of a warm call's time"]["met"]


@pytest.mark.parametrize(
    ("cold", "warm", "met"),
    [(50.0, 100.0, True), (49.0, 80.0, False), (80.0, 101.0, False), (101.0, 60.0, False)],
)
def test_budget_use_target_checks_the_first_and_the_warm_peak(cold, warm, met):
    rows = _targets([
        _record("auto", median_s=1.0, first_call_s=1.0, first_call_plain=True,
                peak_mib=warm, cold_peak_mib=cold, budget={"mib": 100.0}),
    ])  # fmt: skip
    assert rows["auto: peak 50%–100% of the budget (first call, warm call)"]["met"] is met


def test_a_refused_first_call_misses_both_targets_and_old_records_are_not_applicable():
    budget = {"mib": 10.0}
    error = "MemoryBudgetError: 22.5 / 11.2 MiB already in use"
    rows = _targets([
        _record("budget", median_s=1.0, first_call_s=0.1, first_call_plain=True,
                first_call_error=error, cold_error=error, peak_mib=6.0, budget=budget),
        _record("one_pass", median_s=1.0, first_call_s=5.0, peak_mib=6.0),  # old run
    ])  # fmt: skip
    first = rows["budget: first call within ±20% of a warm call's time"]
    assert first["met"] is False and "MemoryBudgetError" in first["measured"]
    use = rows["budget: peak 50%–100% of the budget (first call, warm call)"]
    assert use["met"] is False and "MemoryBudgetError" in use["measured"]
    assert rows["one pass: first call within ±20% of a warm call's time"]["met"] is None


# -- issue 21's problems ------------------------------------------------------------------


def test_issue_21_problems_train_what_they_say():
    import torch
    from torch import nn

    from benchmarks.problems import build

    model, loss_func, x, y = build("resnet18_frozen")
    trainable = {n.split(".")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"layer1", "fc"} and not model.training
    assert loss_func(model(x), y).ndim == 0

    model, loss_func, x, y = build("lraspp_frozen")
    backbone = model.model.backbone
    frozen = {n for n, b in backbone.named_children()
              if not any(p.requires_grad for p in b.parameters())}  # fmt: skip
    assert frozen == {str(i) for i in range(14)}
    assert all(not p.requires_grad for m in model.modules()
               if isinstance(m, nn.BatchNorm2d) for p in m.parameters())  # fmt: skip
    assert any(p.requires_grad for p in model.model.classifier.parameters())
    out = model(x)
    assert out.shape == (2, 3, 64, 64) and loss_func(out, y).ndim == 0

    model, loss_func, ids, targets = build("tiny_gpt")
    out = model(ids)
    assert out.shape == (2, 1000, 32) and targets.shape == (2, 32)
    # causal: a later token does not change an earlier position's logits
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 1000
    with torch.no_grad():
        assert torch.equal(model(changed)[..., :-1], model(ids)[..., :-1])


# -- the first call, as users meet it (issue 21) -----------------------------------------


@pytest.mark.parametrize("mode", ["time", "both"])
def test_the_first_call_is_timed_with_its_set_up_and_no_flop_counter(mode, monkeypatch):
    import time

    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from benchmarks import runner
    from benchmarks.methods import ggnchunk_method

    calls = []

    def lazy(model, loss_func, inputs, targets):
        """Sets itself up at its first call (as BackPACK's extend does)."""
        calls.append(len(_get_current_dispatch_mode_stack()))
        if len(calls) == 1:
            time.sleep(0.5)
        return ggnchunk_method(model, loss_func, inputs, targets, num_chunks=1)

    monkeypatch.setitem(runner.METHODS, "lazy", lazy)
    record = runner.run_here("tiny_mlp_ae", "lazy", {}, mode, repeats=2, flops=True,
                             peak="hwm")  # fmt: skip
    assert calls[0] == 0  # no FLOP counter (a dispatch mode) around the first call
    assert record["first_call_plain"] and record["first_call_s"] >= 0.5
    times = record["times_s"]
    assert max(times) < 0.5 <= record["first_call_s"]
    # short calls are repeated beyond ``repeats`` until MIN_TIMED_S of them (or the cap)
    assert 2 < len(times) <= runner.MAX_REPEATS
    assert len(times) == runner.MAX_REPEATS or sum(times) >= runner.MIN_TIMED_S
    assert sum(times[:-1]) < runner.MIN_TIMED_S  # and no further
    assert record["flops"] > 0 and calls[-1] == 1  # counted on an extra call


def test_an_interleaved_comparison_alternates_the_calls_and_compares_medians(
    monkeypatch,
):
    """Both configurations alternate after ``other``'s untimed first call."""
    from benchmarks import runner

    clock = [0.0]
    monkeypatch.setattr(runner.time, "perf_counter", lambda: clock[0])
    order = []

    def timed(name, seconds):
        def call():
            order.append(name)
            clock[0] += seconds[min(order.count(name), len(seconds)) - 1]

        return call

    # the other's first call is slow (set-up), and the round after it runs on the
    # heap that call left: neither counts
    result = runner.time_interleaved(
        timed("call", [0.5, 0.06]), timed("other", [5.0, 1.0, 0.12, 0.2, 0.12]), rounds=1
    )
    assert order[:5] == ["other", "call", "other", "call", "other"]
    # then rounds in turns: call first in even rounds, other first in odd ones
    rounds = len(result["times_s"])
    assert order[3:] == ["call", "other", "other", "call"] * (rounds // 2) + [
        "call", "other"
    ] * (rounds % 2)  # fmt: skip
    # rounds until each configuration took MIN_INTERLEAVED_S in all: 34 of 0.06 s
    assert len(result["times_s"]) == runner.MAX_ROUNDS  # capped
    assert result["ratio"] == pytest.approx(0.06 / 0.12)
    # long calls: the fewest rounds asked for
    order.clear()
    result = runner.time_interleaved(
        timed("call", [1.0]), timed("other", [1.0, 1.0, 2.0]), rounds=2
    )
    assert len(result["times_s"]) == 2 and result["ratio"] == pytest.approx(0.5)


def test_the_records_passes_are_the_timed_calls_not_the_counted_ones(monkeypatch):
    """A call under the FLOP counter can plan otherwise: its passes are kept apart."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from benchmarks import runner
    from benchmarks.methods import ggnchunk_method

    def planned(model, loss_func, inputs, targets):
        diag, info = ggnchunk_method(model, loss_func, inputs, targets, num_chunks=1)
        counted = bool(_get_current_dispatch_mode_stack())
        return diag, {**info, "passes": 80 if counted else 18}

    monkeypatch.setitem(runner.METHODS, "planned", planned)
    record = runner.run_here("tiny_mlp_ae", "planned", {}, "time", repeats=1, flops=True)
    assert record["passes"] == 18 and record["flops_passes"] == 80
    assert record["flops"] > 0


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("groups", [1, 4])
def test_flop_counter_counts_a_grouped_convolution_as_its_groups(groups, transposed):
    """The backward of a grouped convolution costs what its groups cost one by one.

    Each group counted on its own by torch's stock counter (whose formula is right
    without groups) against the grouped call counted by ``benchmarks.flops``.
    """
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.flops import flop_counter

    conv = F.conv_transpose2d if transposed else F.conv2d
    x = torch.randn(2, 8, 9, 9, requires_grad=True)
    w = torch.randn(8, 8 // groups, 3, 3, requires_grad=True)
    y = conv(x, w, stride=2, dilation=2, groups=groups)
    g = torch.randn_like(y)
    with flop_counter() as grouped:
        torch.autograd.grad(y, (x, w), g)
    per_group = 0
    parts = zip(x.chunk(groups, 1), w.chunk(groups, 0), g.chunk(groups, 1), strict=True)
    for xs, ws, gs in parts:
        ys = conv(xs, ws, stride=2, dilation=2)
        with FlopCounterMode(display=False) as one:
            torch.autograd.grad(ys, (xs, ws), gs)
        per_group += one.get_total_flops()
    assert grouped.get_total_flops() == per_group > 0


@pytest.mark.parametrize("batched", [False, True])
def test_flop_counter_counts_in_place_products_as_out_of_place_ones(batched):
    """``baddbmm_``/``addmm_`` (torch counts them as zero) cost what ``bmm``/``mm`` do."""
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.flops import flop_counter

    a, b = torch.randn(3, 5, 4), torch.randn(3, 4, 6)
    if not batched:
        a, b = a[0], b[0]
    with FlopCounterMode(display=False) as stock:
        out = torch.matmul(a, b)
    with flop_counter() as counted:
        out.baddbmm_(a, b) if batched else out.addmm_(a, b)
    assert counted.get_total_flops() == stock.get_total_flops() > 0


def test_a_switch_benchmark_writes_its_json_table_and_plot(tmp_path):
    """``ab.switch_main``: the A/B benchmarks' shared command line, on a toy case."""
    from torch import nn

    from benchmarks import (
        ab,
        conv_matrix,
        gram_blocks,
        matmul_readers,
        param_parts,
        per_sample,
    )

    def build(n):
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 5)
        )
        return model, nn.CrossEntropyLoss(), torch.randn(n, 3, 8, 8), torch.randint(5, (n,))

    ab.switch_main(
        ["--quick", "--out", str(tmp_path)], "A toy.\n", "toy", 1,
        module="ggnchunk._rules.kernels", switch="BLOCKED_GRAM", names=("off", "on"),
        cases=[("toy", "Toy", build, 2, {})], title="Toy comparison", ratio="off / on",
    )  # fmt: skip
    record = json.loads((tmp_path / "toy.json").read_text())
    (row,) = record["rows"]
    assert row["name"] == "toy N=2" and row["max_relative_gap_float32"] < 1e-5
    assert "Toy comparison" in (tmp_path / "toy.md").read_text()
    assert (tmp_path / "toy.png").stat().st_size > 0
    from ggnchunk._rules import kernels

    assert kernels.BLOCKED_GRAM  # the switch is left as it was
    for module in (conv_matrix, gram_blocks, matmul_readers, param_parts, per_sample):
        assert module.CASES and all(len(case) == 5 for case in module.CASES)
