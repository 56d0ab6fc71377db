"""Every scheduler mode on every small range: each index exactly once, never out of range.

A simulated computation (memory, time and out-of-memory errors are all simulated, so
the tests are deterministic and fast) runs through :class:`ChunkScheduler` in fixed,
budget and auto mode for every ``total`` from 1 to 20. Its function checks its range as
a user's indexing would and returns a count vector, so that the scheduler's sum must be
exactly one at every index.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ggnchunk
from ggnchunk import ChunkScheduler, OutOfMemoryRecoveryWarning

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20
TOTALS = range(1, 21)


def _per_chunk(size: int) -> float:
    """Seconds of a chunk: a fixed cost per pass, so larger chunks are faster per index."""
    return 1e-3


def _u_shaped(size: int) -> float:
    """Seconds of a chunk: per index lowest at 3 indices per chunk."""
    return size * (1.0 + abs(size - 3) / 4) * 1e-3


class Simulated:
    """A user's function over ``[0, total)`` and the memory tracker that measures it.

    A chunk of ``s`` indices peaks at ``fixed + per_index * s`` bytes above the baseline
    and takes ``seconds(s)``; a chunk of more than ``oom_above`` indices raises
    ``torch.OutOfMemoryError``.
    """

    def __init__(self, total, fixed=10 * MiB, per_index=MiB, oom_above=None,
                 seconds=_per_chunk):  # fmt: skip
        self.total, self.fixed, self.per_index = total, fixed, per_index
        self.oom_above, self.seconds = oom_above, seconds
        self.calls: list[tuple[int, int]] = []  # completed chunks, in order
        self.failed: list[tuple[int, int]] = []  # chunks that ran out of memory

    # the tracker
    def current(self) -> int:
        return 0

    def measure(self, fn):
        result = fn()
        size = self.calls[-1][1] - self.calls[-1][0]
        return result, self.fixed + self.per_index * size, self.seconds(size)

    # the user's function
    def fn(self, start: int, stop: int) -> torch.Tensor:
        if not (0 <= start < stop <= self.total):
            raise IndexError(f"fn({start}, {stop}) for a range of {self.total} indices")
        if self.oom_above is not None and stop - start > self.oom_above:
            self.failed.append((start, stop))
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        self.calls.append((start, stop))
        counts = torch.zeros(self.total, dtype=torch.int64)
        counts[start:stop] = 1
        return counts


def _check_exactly_once(sim: Simulated, result, report, label: str) -> None:
    total = sim.total
    assert result is not None, label
    assert torch.equal(result, torch.ones(total, dtype=torch.int64)), (
        f"{label}: index counts {result.tolist()}, calls {sim.calls}"
    )
    calls = sim.calls
    assert calls[0][0] == 0 and calls[-1][1] == total, f"{label}: {calls}"
    assert all(a[1] == b[0] for a, b in itertools.pairwise(calls)), f"{label}: {calls}"
    assert all(a < b for a, b in calls), f"{label}: empty chunk in {calls}"
    assert [(c.start, c.stop) for c in report.chunks] == calls, label
    assert report.total == total, label


def _run(total, sim_kwargs=None, **scheduler_kwargs):
    sim = Simulated(total, **(sim_kwargs or {}))
    scheduler = ChunkScheduler(tracker=sim, **scheduler_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, report = scheduler.run(total, sim.fn)
    recovered = [w for w in caught if issubclass(w.category, OutOfMemoryRecoveryWarning)]
    label = f"total={total}, {scheduler_kwargs}, {sim_kwargs}"
    _check_exactly_once(sim, result, report, label)
    return sim, report, recovered, label


@pytest.fixture(autouse=True)
def _fresh_cache():
    ggnchunk.clear_autotune_cache()
    yield
    ggnchunk.clear_autotune_cache()


# -- fixed mode ---------------------------------------------------------------------------


@pytest.mark.parametrize("total", TOTALS, ids=lambda t: f"total={t}")
def test_fixed_mode_every_option(total):
    for k in range(1, total + 4):
        sim, _, _, label = _run(total, num_chunks=k)
        assert len(sim.calls) == min(k, total), label
        sim, _, _, label = _run(total, chunk_size=k)
        assert len(sim.calls) == -(-total // min(k, total)), label


# -- budget and auto mode -----------------------------------------------------------------

# (fixed bytes, bytes per index, budget): memory that does not grow with the chunk (as
# glibc's reuse can make it look), that grows slowly, fast, and a budget that one index
# only just fits
COSTS = {
    "flat": (10 * MiB, 0, 64 * MiB),
    "1KiB-per-index": (10 * MiB, 2**10, 64 * MiB),
    "1MiB-per-index": (10 * MiB, MiB, 16 * MiB),
    "8MiB-per-index": (2 * MiB, 8 * MiB, 64 * MiB),
    "one-index-just-fits": (10 * MiB, 8 * MiB, 20 * MiB),
}


@pytest.mark.parametrize("cost", COSTS)
@pytest.mark.parametrize("mode", ["budget", "auto"])
@pytest.mark.parametrize("total", TOTALS, ids=lambda t: f"total={t}")
def test_budget_and_auto_modes_cover_every_index_once(total, mode, cost):
    fixed, per_index, budget = COSTS[cost]
    kwargs = {"max_memory": budget} | ({"chunk_size": "auto"} if mode == "auto" else {})
    _, report, recovered, label = _run(
        total, {"fixed": fixed, "per_index": per_index}, **kwargs
    )
    assert report.mode == mode and not recovered, label
    assert report.chunk_size >= 1, label


@pytest.mark.parametrize("seconds", [_per_chunk, _u_shaped], ids=["per-chunk", "u-shaped"])
@pytest.mark.parametrize("total", TOTALS, ids=lambda t: f"total={t}")
def test_auto_mode_without_a_budget(total, seconds):
    _, report, _, label = _run(total, {"seconds": seconds}, chunk_size="auto")
    assert report.mode == "auto", label


@pytest.mark.parametrize("cost", ["1MiB-per-index", "8MiB-per-index"])
@pytest.mark.parametrize("total", TOTALS, ids=lambda t: f"total={t}")
def test_auto_mode_tuning_on_small_ranges(total, cost):
    """The trial loop stays in range on every small range."""
    fixed, per_index, budget = COSTS[cost]
    sim_kwargs = {"fixed": fixed, "per_index": per_index, "seconds": _u_shaped}
    _run(total, sim_kwargs, chunk_size="auto", max_memory=budget)


@pytest.mark.parametrize("mode", ["budget", "auto"])
@pytest.mark.parametrize("total", TOTALS, ids=lambda t: f"total={t}")
def test_cached_decisions_cover_every_index_once(total, mode):
    kwargs = {"max_memory": 16 * MiB, "cache_key": "small"}
    if mode == "auto":
        kwargs["chunk_size"] = "auto"
    _, first, _, _ = _run(total, **kwargs)
    _, again, _, label = _run(total, **kwargs)
    assert not first.from_cache and again.from_cache, label


# -- out of memory ------------------------------------------------------------------------

MODES = {
    "fixed-one-chunk": {"num_chunks": 1},
    "fixed-chunk_size-4": {"chunk_size": 4},
    "budget": {"max_memory": "1GiB"},
    "auto": {"max_memory": "1GiB", "chunk_size": "auto"},
}


@pytest.mark.parametrize("oom_above", [1, 2, 3], ids=lambda m: f"oom-above-{m}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("total", TOTALS, ids=lambda t: f"total={t}")
def test_out_of_memory_splits_still_cover_every_index_once(total, mode, oom_above):
    sim, report, recovered, label = _run(total, {"oom_above": oom_above}, **MODES[mode])
    assert all(b - a <= oom_above for a, b in sim.calls), f"{label}: {sim.calls}"
    assert report.out_of_memory_splits == len(sim.failed), label
    assert len(recovered) == (1 if sim.failed else 0), label
    assert all(0 <= a < b <= total for a, b in sim.failed), f"{label}: {sim.failed}"


# -- auto mode is never much slower than budget mode --------------------------------------


@pytest.mark.parametrize("total", [1, 2, 3, 10, 100, 784, 3072], ids=lambda t: f"total={t}")
@pytest.mark.parametrize("budget_mib", [12, 20, 100], ids=lambda b: f"budget={b}MiB")
def test_auto_is_never_much_slower_than_budget_mode(total, budget_mib):
    """Larger chunks faster per index: auto's trials cost at most one pass."""
    sim_kwargs = {"per_index": MiB // 8, "seconds": lambda s: 1e-3 + 1e-5 * s}
    budget_sim, budget, _, _ = _run(total, sim_kwargs, max_memory=budget_mib * MiB)
    passes = len(budget_sim.calls)
    auto_sim, auto, _, label = _run(
        total, sim_kwargs, max_memory=budget_mib * MiB, chunk_size="auto"
    )
    assert len(auto_sim.calls) <= passes + 1, label
    auto_seconds = sum(sim_kwargs["seconds"](b - a) for a, b in auto_sim.calls)
    budget_seconds = sum(sim_kwargs["seconds"](b - a) for a, b in budget_sim.calls)
    assert auto_seconds <= 1.05 * budget_seconds, label
    assert auto.chunk_size == budget.chunk_size, label


# -- recover_oom must be a bool -----------------------------------------------------------


@pytest.mark.parametrize("value", ["yes", 1, None, "False"], ids=repr)
def test_recover_oom_must_be_a_bool(value):
    with pytest.raises(TypeError, match=r"recover_oom must be a bool.*pass True .* False"):
        ChunkScheduler(recover_oom=value)


def test_recover_oom_is_checked_by_diag_ggn_before_any_work():
    model = nn.Linear(3, 2)
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(TypeError, match="recover_oom"):
        ggnchunk.diag_ggn(model, nn.MSELoss(), torch.randn(4, 3), torch.randn(4, 2),
                          recover_oom="yes")  # fmt: skip
    assert not calls  # no forward pass


@pytest.mark.parametrize("value", [True, False])
def test_recover_oom_accepts_bools(value):
    assert ChunkScheduler(recover_oom=value).recover_oom is value


# -- python -m benchmarks.plot ------------------------------------------------------------


def test_benchmarks_plot_help():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.plot", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m benchmarks.plot")
    assert "folder" in done.stdout and "table.md" in done.stdout


def test_benchmarks_plot_names_a_folder_without_results(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.plot", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "has no environment.json" in done.stderr and "Traceback" not in done.stderr


class Retaining(Simulated):
    """A C heap that keeps ``retain`` bytes resident after every pass until trimmed.

    The resident set size then climbs pass after pass though nothing is in use: what
    glibc did to ResNet-18 under an 80 MiB budget (issue 21: the level before a pass rose
    from 47 to 85 MiB). ``settled`` (the tracker's trim) gives the kept bytes back.
    """

    def __init__(self, total, retain, **kwargs):
        super().__init__(total, **kwargs)
        self.retain, self.kept = retain, 0

    def current(self) -> int:
        return self.kept

    def settled(self) -> int:
        self.kept = 0
        return 0

    def measure(self, fn):
        result, peak, seconds = super().measure(fn)
        peak += self.kept
        self.kept += self.retain
        return result, peak, seconds


@pytest.mark.parametrize("total", [8, 20])
def test_budget_passes_start_from_a_settled_heap(total):
    """Each pass's peak stays within the budget though the heap kept freed blocks."""
    budget = 64 * MiB
    sim = Retaining(total, retain=30 * MiB, fixed=10 * MiB, per_index=4 * MiB)
    result, report = ChunkScheduler(tracker=sim, max_memory=budget).run(total, sim.fn)
    _check_exactly_once(sim, result, report, f"total={total}")
    assert len(report.chunks) > 1, report.chunks  # the budget forced several passes
    peaks = [chunk.peak_extra_bytes for chunk in report.chunks]
    assert max(peaks) <= budget, [p / MiB for p in peaks]


# -- a bound split by the steps of the work ------------------------------------------------


class _Level:
    """An executor as :class:`~ggnchunk._scheduling.budget.BudgetPlanner` plans with."""

    settle_above = 0
    what = "columns"

    def settled_level(self) -> int:
        return 0

    def level(self) -> int:
        return 0


SPLITS = {
    # a large transient where few bytes per index are held (a ResNet's 512-channel
    # layers' weight totals at 1x1 maps), a small one where many are (its first layers)
    "resnet-like": [(10 * MiB, 3 * MiB), (21 * MiB, MiB // 10), (16 * MiB, MiB // 4)],
    "one-step": [(12 * MiB, 2 * MiB)],
    "equal-slopes": [(5 * MiB, MiB), (9 * MiB, MiB)],
    "nothing-fits-the-target": [(60 * MiB, MiB), (10 * MiB, 3 * MiB)],
}


@pytest.mark.parametrize("total", [1, 2, 7, 64, 1000])
@pytest.mark.parametrize("split", SPLITS)
def test_a_split_bound_plans_the_largest_size_every_step_fits(split, total):
    """The line made from a split bound fits the largest size whose every step fits.

    Brute force over the sizes: the plan's size is the largest ``s`` with
    ``max_i(fixed_i + s * per_index_i)`` within the target (1 where none is), every
    smaller size fits too, and the line lies on or above the split bound at that size.
    """
    from ggnchunk._memory import backend_class
    from ggnchunk._scheduling.budget import BudgetPlanner

    steps = SPLITS[split]
    budget = 64 * MiB
    fixed = max(f for f, _ in steps)
    per_index = max(p for _, p in steps)
    planner = BudgetPlanner(_Level(), budget, total, backend_class(torch.device("cpu")))
    decision = planner.from_cost((fixed, per_index, steps))
    size = planner.fit_size(decision)

    def split_bound(s: int) -> float:
        return max(f + s * p for f, p in steps)

    fitting = [s for s in range(1, total + 1) if split_bound(s) <= planner.target]
    assert size == (max(fitting) if fitting else 1), (size, fitting[-3:])
    if fitting:
        assert all(split_bound(s) <= planner.target for s in range(1, size + 1))
    assert decision.fixed + size * decision.per_index >= split_bound(size) - 1e-6
    # never a larger plan than the unsplit line would make where that line fits
    line = planner.fit_size(ggnchunk._scheduling.budget.Decision(fixed, per_index))
    assert size >= line


def test_a_split_bound_refuses_by_its_largest_step():
    """One index that fits no step within the budget is refused, by the split's count."""
    from ggnchunk._memory import backend_class
    from ggnchunk._scheduling.budget import BudgetPlanner, MemoryBudgetError

    steps = [(30 * MiB, MiB), (20 * MiB, 40 * MiB)]
    planner = BudgetPlanner(_Level(), 50 * MiB, 10, backend_class(torch.device("cpu")))
    with pytest.raises(MemoryBudgetError, match="needs up to 60.0 MiB"):
        planner.from_cost((30 * MiB, 40 * MiB, steps))
    # the line alone would need 70 MiB; the split 60 MiB fits a 64 MiB budget
    planner = BudgetPlanner(_Level(), 64 * MiB, 10, backend_class(torch.device("cpu")))
    planner.from_cost((30 * MiB, 40 * MiB, steps))


def test_scheduler_arguments_that_used_to_raise_raw_errors():
    with pytest.raises(TypeError, match=r"cache_key must be hashable .* list \['a'\]"):
        ggnchunk.ChunkScheduler(max_memory="1GiB", cache_key=["a"])
    with pytest.raises(ValueError, match="device='gpu0' is not a torch device"):
        ggnchunk.ChunkScheduler(num_chunks=2, device="gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("mode", [{"max_memory": "1GiB"}, {"chunk_size": "auto"}])
def test_a_measured_mode_on_cuda_without_cuda_is_refused_clearly(mode):
    """It reached torch's raw 'Found no NVIDIA driver' error."""
    scheduler = ggnchunk.ChunkScheduler(device="cuda", **mode)
    with pytest.raises(ValueError, match="CUDA is not available here.*device='cpu'"):
        scheduler.run(10, lambda a, b: torch.tensor(1.0))
    fixed = ggnchunk.ChunkScheduler(device="cuda", num_chunks=2)  # measures nothing
    assert fixed.run(10, lambda a, b: torch.tensor(1.0))[0].item() == 2


_AFTER_EARLIER_WORK = """
import warnings, torch
from ggnchunk import ChunkScheduler
warnings.simplefilter("error")
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Tanh(),
                            torch.nn.Linear(256, 10))
X, y = torch.randn(200, 512), torch.randn(200, 10)
params = {k: v.detach() for k, v in model.named_parameters()}
def loss(p, x, t):
    return ((torch.func.functional_call(model, p, (x[None],)) - t[None]) ** 2).sum()
per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
def chunk(a, b):
    g = per_sample(params, X[a:b], y[a:b])
    return sum(v.pow(2).flatten(1).sum(1).sum() for v in g.values())
expected = sum(chunk(i, min(i + 16, 200)) for i in range(0, 200, 16))  # earlier work
total, report = ChunkScheduler(max_memory="8MiB").run(200, chunk)
assert torch.allclose(total, expected, rtol=1e-5), (total, expected)
print(max(c.peak_extra_bytes for c in report.chunks) / 2**20, len(report.chunks))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_the_scheduler_after_earlier_work_of_the_same_kind_holds_a_small_budget():
    """Per-sample gradients after a loop of the same hold 8 MiB.

    Chunks that reused the loop's freed heap measured nothing and grew to 16-26 MiB;
    the heap is now given back before the baseline, so every chunk is seen.
    """
    done = subprocess.run(
        [sys.executable, "-c", _AFTER_EARLIER_WORK], capture_output=True, text=True,
        timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    peak, passes = map(float, done.stdout.split())
    assert peak <= 8.0 and passes < 100
