"""The chunk scheduler: budgets, auto-tuning, out-of-memory recovery, batch splitting.

Scheduling logic is tested with a simulated memory tracker (deterministic); the real
peak memory under a budget is measured in fresh processes in test_budget_memory.py.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings

import pytest
import torch
from torch import nn

import ggnchunk
from ggnchunk import (
    ChunkScheduler,
    MemoryBudgetError,
    MemoryBudgetWarning,
    OutOfMemoryRecoveryWarning,
)
from ggnchunk._engine import GGNComputation
from ggnchunk._memory import (
    HostMemory,
    UnsupportedDeviceError,
    memory_backend,
    parse_memory,
)
from ggnchunk._scheduling.autotune import AutotuneCache
from ggnchunk._scheduling.budget import Decision
from tests.cases import LOSSES, MODELS
from tests.reference import assert_diag_close

MiB = 2**20
GiB = 2**30


class SimulatedMemory:
    """Peak of a chunk = level + fixed + per_index * size; fails above ``limit``."""

    def __init__(self, fixed=10 * MiB, per_index=MiB, limit=None):
        self.fixed, self.per_index, self.limit = fixed, per_index, limit
        self.level, self.size = 0, 0

    def current(self):
        return self.level

    def measure(self, fn):
        result = fn()
        return result, self.level + self.fixed + self.per_index * self.size, 1e-3

    def run(self, start, stop):
        self.size = stop - start
        if self.limit is not None and self.fixed + self.per_index * self.size > self.limit:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return torch.tensor(float(sum(range(start, stop))))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512MiB", 512 * MiB), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000),
     ("300 mb", 300_000_000), ("4096", 4096), (1024, 1024), ("1e3KB", 10**6)],
)  # fmt: skip
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("bad", ["2 parsecs", "GiB", "-1GiB", 0, -5, 1.5, True, "1,5GB"])
def test_parse_memory_rejects(bad):
    with pytest.raises((ValueError, TypeError), match="max_memory"):
        parse_memory(bad)


@pytest.mark.parametrize("budget_mib", [20, 50, 200, 5000])
def test_budget_mode_fits_the_budget_and_covers_everything(budget_mib):
    sim = SimulatedMemory()
    total, report = ChunkScheduler(max_memory=budget_mib * MiB, tracker=sim).run(
        1000, sim.run
    )
    assert total.item() == sum(range(1000))
    assert report.peak_extra_bytes <= budget_mib * MiB
    covered = sorted((c.start, c.stop) for c in report.chunks)
    assert covered[0][0] == 0 and covered[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
    # sizes grow geometrically from measured chunks up to what the budget allows (up to
    # the safety margin), which then runs the bulk of the range
    expected = int((HostMemory.planning_share * budget_mib * MiB - 10 * MiB) // MiB)
    sizes = [c.stop - c.start for c in report.chunks]
    assert max(sizes) <= expected
    assert all(b <= 2 * a for a, b in itertools.pairwise(sizes[1:]))
    if expected < 250:
        assert report.chunk_size == expected
    else:  # the range ends before the growth does: the rest in one chunk
        assert len(sizes) <= 12 and report.chunk_size == sizes[-1]


def test_budget_too_small_for_one_index():
    sim = SimulatedMemory(fixed=30 * MiB)
    with pytest.raises(MemoryBudgetError, match=r"max_memory is 20\.0 MiB.*31\.0 MiB"):
        ChunkScheduler(max_memory="20MiB", tracker=sim).run(100, sim.run)


def test_auto_picks_the_fastest_size_and_caches_it():
    ggnchunk.clear_autotune_cache()
    sim = SimulatedMemory()

    def timed_measure(fn):  # time per index is lowest at 32 indices per chunk
        result, peak, _ = SimulatedMemory.measure(sim, fn)
        return result, peak, sim.size * (1.0 + abs(sim.size - 32) / 32) * 1e-3

    sim.measure = timed_measure
    # 100 MiB fit 82 indices: 24 more passes in budget mode, enough to be worth tuning
    scheduler = ChunkScheduler(chunk_size="auto", max_memory="100MiB", tracker=sim,
                               cache_key="toy")  # fmt: skip
    total, report = scheduler.run(2000, sim.run)
    assert total.item() == sum(range(2000))
    assert report.mode == "auto" and 16 <= report.chunk_size <= 64
    again, report2 = scheduler.run(2000, sim.run)
    assert report2.from_cache and report2.chunk_size == report.chunk_size
    assert again.item() == total.item()
    ggnchunk.clear_autotune_cache()


@pytest.mark.parametrize("mode", ["fixed", "budget"])
def test_out_of_memory_splits_and_keeps_finished_chunks(mode):
    sim = SimulatedMemory(limit=40 * MiB)  # chunks of more than 30 indices fail
    calls = []

    def run(start, stop):
        calls.append((start, stop))
        return sim.run(start, stop)

    kwargs = (
        {"num_chunks": 4} if mode == "fixed" else {"max_memory": "1GiB", "tracker": sim}
    )
    with pytest.warns(OutOfMemoryRecoveryWarning, match="ran out of memory") as record:
        total, report = ChunkScheduler(**kwargs).run(200, run)
    assert len(record) == 1
    assert record[0].filename == __file__  # the warning points at the caller's line
    assert total.item() == sum(range(200))
    assert report.out_of_memory_splits > 0
    assert all(c.stop - c.start <= 30 for c in report.chunks)
    done = [(c.start, c.stop) for c in report.chunks]
    assert len(set(done)) == len(done)  # no finished chunk was run twice


def test_out_of_memory_of_a_single_index_reaches_the_user():
    sim = SimulatedMemory(limit=5 * MiB)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        ChunkScheduler(num_chunks=2).run(10, sim.run)


def test_no_recovery_when_switched_off():
    sim = SimulatedMemory(limit=40 * MiB)
    with pytest.raises(torch.OutOfMemoryError):
        ChunkScheduler(num_chunks=2, recover_oom=False).run(100, sim.run)


def test_other_errors_are_not_retried():
    def run(start, stop):
        raise ValueError("a bug, not a lack of memory")

    with pytest.raises(ValueError, match="a bug"):
        ChunkScheduler(num_chunks=2).run(10, run)


# -- through diag_ggn ---------------------------------------------------------------------


def _problem(model_index=1, loss_index=0, seed=0):
    model, x = MODELS[model_index].make(seed)
    with torch.no_grad():
        out = model(x)
    torch.manual_seed(seed + 1)
    loss_func, targets = LOSSES[loss_index].build(out)
    return model, loss_func, x, targets


class _SimulatedDevice(SimulatedMemory):
    """Simulated memory for diag_ggn: the chunk size comes from the engine's backward."""

    def __init__(self, monkeypatch, **kwargs):
        super().__init__(**kwargs)
        original = GGNComputation.backward
        sim = self

        def backward(run, start, stop):
            sim.size = stop - start
            if sim.limit is not None and sim.fixed + sim.per_index * sim.size > sim.limit:
                raise RuntimeError(
                    "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't "
                    "allocate memory: you tried to allocate 123456789 bytes."
                )
            return original(run, start, stop)

        monkeypatch.setattr(GGNComputation, "backward", backward)
        monkeypatch.setattr(ggnchunk._api, "memory_backend", lambda device, what: sim)
        # the engine's analytic bound, simulated too: the plan follows the simulation
        monkeypatch.setattr(GGNComputation, "column_bytes", lambda run: sim.per_index)
        monkeypatch.setattr(
            GGNComputation, "fixed_bytes", lambda run, columns=None: sim.fixed
        )


@pytest.mark.parametrize("loss_index", range(len(LOSSES)))
@pytest.mark.parametrize(
    "kwargs",
    [{"max_memory": "40MiB"}, {"chunk_size": "auto", "max_memory": "60MiB"},
     {"chunk_size": 5, "batch_chunk_size": 2},
     {"max_memory": "30MiB", "batch_chunk_size": 1}],
    ids=["budget", "auto", "batch2-size5", "batch1-budget"],
)  # fmt: skip
def test_scheduled_results_equal_one_pass(monkeypatch, loss_index, kwargs):
    model_index = 5 if LOSSES[loss_index].needs_classes else 1  # image-shaped outputs
    model, loss_func, x, targets = _problem(model_index, loss_index)
    one_pass = ggnchunk.diag_ggn(model, loss_func, x, targets)
    _SimulatedDevice(monkeypatch, per_index=MiB // 2)
    ggnchunk.clear_autotune_cache()
    actual, report = ggnchunk.diag_ggn(model, loss_func, x, targets, return_report=True,
                                       **kwargs)  # fmt: skip
    assert_diag_close(actual, one_pass, rtol=1e-5, label=str(kwargs))
    assert report.num_passes > len(report.batch_chunks)  # really chunked
    if "batch_chunk_size" in kwargs:
        assert len(report.batch_chunks) == -(-x.shape[0] // kwargs["batch_chunk_size"])


def test_out_of_memory_recovery_inside_diag_ggn_is_exact(monkeypatch):
    model, loss_func, x, targets = _problem(1, 0)
    one_pass = ggnchunk.diag_ggn(model, loss_func, x, targets)
    _SimulatedDevice(monkeypatch, limit=10 * MiB + 9 * MiB)  # more than 9 columns fail
    with pytest.warns(OutOfMemoryRecoveryWarning, match="at most 9 columns") as record:
        actual, report = ggnchunk.diag_ggn(model, loss_func, x, targets, num_chunks=2,
                                           return_report=True)  # fmt: skip
    assert record[0].filename == __file__  # the user's call, not ggnchunk's internals
    assert_diag_close(actual, one_pass, rtol=1e-5)
    assert report.chunk_size <= 9 and report.schedules[0].out_of_memory_splits >= 2


def test_batch_chunks_refuse_coupled_samples():
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)).train()
    with pytest.raises(ValueError, match="training mode, where it couples the samples"):
        ggnchunk.diag_ggn(model, nn.MSELoss(), torch.randn(6, 4), torch.randn(6, 3),
                          batch_chunk_size=2)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [({"max_memory": "1GiB", "num_chunks": 2}, "max_memory was given together"),
     ({"chunk_size": "fast"}, "chunk_size='fast' is not understood"),
     ({"chunk_size": "auto", "num_chunks": 3}, "'auto' chooses the chunking"),
     ({"max_memory": "lots"}, "max_memory='lots' is not a memory size"),
     ({"batch_chunk_size": 0}, "batch_chunk_size must be a positive int")],
)  # fmt: skip
def test_bad_scheduler_arguments(kwargs, pattern):
    model, loss_func, x, targets = _problem(1, 0)
    with pytest.raises((ValueError, TypeError), match=pattern):
        ggnchunk.diag_ggn(model, loss_func, x, targets, **kwargs)


def test_budget_too_small_raises_memory_budget_error(monkeypatch):
    model, loss_func, x, targets = _problem(1, 0)
    _SimulatedDevice(monkeypatch, fixed=30 * MiB)
    with pytest.raises(
        MemoryBudgetError, match=r"a chunk of 1 of the columns (already )?needs"
    ):
        ggnchunk.diag_ggn(model, loss_func, x, targets, max_memory="20MiB")


def test_a_failed_pass_adds_nothing_and_never_reruns_the_forward(monkeypatch):
    """A pass that fails midway (out of memory) is retried in halves from the same graph.

    The model draws a dropout mask; the forward must run exactly once (the user's random
    state advances as for one forward pass), and the partial pass must leave no trace.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 6))
    x, y = torch.randn(4, 5), torch.randn(4, 6)
    torch.manual_seed(7)
    expected = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y)  # dropout active: train mode
    expected_state = torch.get_rng_state()
    real_grad, calls, forwards = torch.autograd.grad, [], []
    model.register_forward_hook(lambda *args: forwards.append(1))

    def grad(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # midway through the first chunk's sweep
            raise torch.OutOfMemoryError("simulated: out of memory in the middle of a pass")
        return real_grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", grad)
    torch.manual_seed(7)
    with pytest.warns(OutOfMemoryRecoveryWarning):
        actual = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, num_chunks=2)
    assert len(calls) > 3 and len(forwards) == 1
    assert torch.equal(torch.get_rng_state(), expected_state)
    assert_diag_close(actual, expected, rtol=1e-5)
    assert_diag_close(actual, expected, rtol=1e-5)


@pytest.mark.parametrize("fail_at", [1, 2])  # the output layer takes its one-hot form
def test_a_pass_that_fails_after_adding_some_parameters_is_retried_exactly(
    monkeypatch, fail_at
):
    """Sweeps add to the diagonal in place: a retry must not add finished layers twice."""
    from ggnchunk._rules import LinearRule
    from tests.reference import reference_diag_ggn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 4)
    ).double()
    x, y = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    expected = reference_diag_ggn(model, nn.MSELoss(), x, y)
    real_diag, calls = LinearRule.diag, []

    def diag(self, ctx, grads):
        calls.append(grads.shape[0])
        if len(calls) == fail_at:  # the first sweep (all 4 columns) fails here
            raise torch.OutOfMemoryError("simulated: out of memory in a layer's rule")
        return real_diag(self, ctx, grads)

    monkeypatch.setattr(LinearRule, "diag", diag)
    with pytest.warns(OutOfMemoryRecoveryWarning):
        actual = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, num_chunks=1)
    assert calls[0] == 4 and len(calls) > 2
    assert_diag_close(actual, expected, rtol=1e-10)


def test_known_cost_refuses_before_any_work():
    sim = SimulatedMemory()
    calls = []

    def run(start, stop):
        calls.append((start, stop))
        return sim.run(start, stop)

    scheduler = ChunkScheduler(max_memory=20 * MiB, tracker=sim)
    with pytest.raises(MemoryBudgetError, match="max_memory is 20.0 MiB"):
        scheduler.run(10, run, baseline=0, cost=(19 * MiB, 2 * MiB))
    assert calls == []


def test_a_refusal_shows_bytes_where_the_sizes_round_alike():
    """It read "max_memory is 8.0 MiB, but ... needs up to 8.0 MiB" (1,000 B short)."""
    sim = SimulatedMemory()
    scheduler = ChunkScheduler(max_memory=8 * MiB, tracker=sim)
    with pytest.raises(MemoryBudgetError) as refused:
        scheduler.run(10, sim.run, baseline=0, cost=(8 * MiB - 24, 1024))
    message = str(refused.value)
    assert "max_memory is 8,388,608 B" in message, message
    assert "needs up to 8,389,608 B" in message, message


def test_known_cost_asked_again_after_the_first_index_never_refuses_done_work():
    # the first pass leaves memory behind (one-time set-up), so that after it the bound
    # says one index no longer fits: the scheduler goes on with one index per pass
    # (warning when a pass goes above the budget) instead of throwing the work away
    sim = SimulatedMemory(fixed=2 * MiB, per_index=MiB)
    asked = []

    def bound():
        asked.append(sim.level)
        return 2 * MiB, MiB

    def run(start, stop):
        value = sim.run(start, stop)
        sim.level = 19 * MiB  # left behind by the first pass
        return value

    scheduler = ChunkScheduler(max_memory=20 * MiB, tracker=sim)
    with pytest.warns(MemoryBudgetWarning, match="cannot shrink further") as record:
        total, report = scheduler.run(6, run, baseline=0, cost=bound)
    assert record[0].filename == __file__
    assert len(asked) == 2  # before any work, and after the first index
    assert total.item() == sum(range(6))
    assert [(c.start, c.stop) for c in report.chunks] == [(i, i + 1) for i in range(6)]


def test_known_cost_that_overshot_is_remembered_by_the_next_call():
    # the bound sees a third of what a chunk takes (as the windowed passes' copies that
    # no rule counts): the first call overshoots (even at the half size a first call
    # starts with), warns and shrinks; the next call of the same problem starts from the
    # size that fitted instead of overshooting again
    ggnchunk.clear_autotune_cache()
    sim = SimulatedMemory(fixed=2 * MiB, per_index=3 * MiB)
    scheduler = ChunkScheduler(max_memory=40 * MiB, tracker=sim, cache_key="underestimated")
    with pytest.warns(MemoryBudgetWarning, match="above the 40.0 MiB budget"):
        total, first = scheduler.run(100, sim.run, baseline=0, cost=(2 * MiB, MiB))
    assert total.item() == sum(range(100))
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryBudgetWarning)
        total, again = scheduler.run(100, sim.run, baseline=0, cost=(2 * MiB, MiB))
    assert total.item() == sum(range(100))
    assert again.peak_extra_bytes <= HostMemory.planning_share * 40 * MiB
    sizes = [[c.stop - c.start for c in r.chunks] for r in (first, again)]
    assert sizes[0][0] == sizes[1][0] == 1  # the bound's first index
    assert sizes[0][2] < sizes[0][1]  # the first call shrank after its overshoot ...
    assert sizes[1][1] == sizes[0][2]  # ... and the next call starts there
    assert again.peak_extra_bytes < first.peak_extra_bytes
    ggnchunk.clear_autotune_cache()


class FreshHeap(SimulatedMemory):
    """Chunks above ``large`` indices take ``extra`` more (a fresh heap's pages)."""

    def __init__(self, extra, large, **kwargs):
        super().__init__(**kwargs)
        self.extra, self.large = extra, large

    def measure(self, fn):
        result, peak, seconds = super().measure(fn)
        return result, peak + (self.extra if self.size > self.large else 0), seconds


def test_known_cost_overshot_within_the_budget_grows_back_in_the_next_call():
    # a process's first call on a fresh heap can take more than the bound (and than
    # later calls): its chunks above the planning target, not above the budget, are cut
    # quietly. The next call starts there but grows back to the bound's size once its
    # measured chunks fit, and the call after it starts at the bound's size (the cut was
    # remembered for good: ResNet-18 frozen but layer1 ran 51 passes of 2 columns in
    # every warm call where 16 of 7 fit)
    ggnchunk.clear_autotune_cache()
    sim = FreshHeap(extra=6 * MiB, large=20, fixed=2 * MiB, per_index=MiB)
    scheduler = ChunkScheduler(max_memory=40 * MiB, tracker=sim, cache_key="fresh heap")
    bound_size = int((HostMemory.planning_share * 40 * MiB - 2 * MiB) // MiB)
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryBudgetWarning)
        for extra in (6 * MiB, 0, 0):
            sim.extra = extra
            total, report = scheduler.run(100, sim.run, baseline=0, cost=(2 * MiB, MiB))
            assert total.item() == sum(range(100))
            assert report.peak_extra_bytes <= 40 * MiB
            reports.append([c.stop - c.start for c in report.chunks])
    first, second, third = reports
    cut = first[-2]
    assert max(first) > cut and cut < bound_size  # above the target: cut quietly
    assert second[1] == cut  # the next call starts at the cut ...
    assert max(second) > cut  # ... and grows back toward the bound's size
    assert third[1] == bound_size  # the call after it starts at the bound's size
    ggnchunk.clear_autotune_cache()


def test_known_cost_whose_one_index_overshot_is_remembered_by_the_next_call():
    # one index alone is above the budget (a fixed part the bound does not see): the
    # next call runs one index per pass from its start, not the bound's larger chunks
    ggnchunk.clear_autotune_cache()
    sim = SimulatedMemory(fixed=41 * MiB, per_index=MiB)
    scheduler = ChunkScheduler(max_memory=40 * MiB, tracker=sim, cache_key="one too big")
    for _ in range(2):
        with pytest.warns(MemoryBudgetWarning, match="cannot shrink further"):
            total, report = scheduler.run(20, sim.run, baseline=0, cost=(2 * MiB, MiB))
        assert total.item() == sum(range(20))
        assert [c.stop - c.start for c in report.chunks] == [1] * 20
        assert report.peak_extra_bytes == 42 * MiB
    ggnchunk.clear_autotune_cache()


def test_known_cost_first_call_starts_at_half_the_bound_on_the_cpu():
    # a problem's first call measures half the bound's size before growing to it: a
    # bound that underestimates by half is caught before a chunk goes above the budget
    ggnchunk.clear_autotune_cache()
    sim = SimulatedMemory(fixed=2 * MiB, per_index=2 * MiB)
    scheduler = ChunkScheduler(max_memory=40 * MiB, tracker=sim, cache_key="first")
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryBudgetWarning)
        total, report = scheduler.run(100, sim.run, baseline=0, cost=(2 * MiB, MiB))
    assert total.item() == sum(range(100))
    # the bound's size (32 here) would have peaked at 66 MiB on the second chunk
    assert [c.stop - c.start for c in report.chunks][:2] == [1, 16]
    assert report.peak_extra_bytes <= 40 * MiB
    ggnchunk.clear_autotune_cache()


class _FakeRun:
    """What ``_plan_for_budget`` asks of a computation: bounds with and without caches.

    With ``gram_from``, the full run's fixed part holds 30 MiB of Gram factors for
    chunks of that many columns or more.
    """

    may_window = False  # no windowed passes (see _FakeWindowedRun)

    def __init__(self, full, lean, gram_from=None):
        self.costs, self.lean = {False: full, True: lean}, False
        self.gram_from, self.columns = gram_from, None
        self.field_limit = None

    def set_lean(self, lean):
        self.lean = lean

    def limit_field_images(self, limit):
        self.field_limit = limit

    def fixed_bytes(self, columns=None):
        if columns is not None:
            self.columns = columns
        gram = not self.lean and self.gram_from and self.columns >= self.gram_from
        return self.costs[self.lean][0] + (30 * MiB if gram else 0)

    def column_bytes(self):
        return self.costs[self.lean][1]


@pytest.mark.parametrize(
    ("full", "lean", "expected"),
    [((40 * MiB, MiB), (MiB, MiB), True),  # lean fits twice as many columns per pass
     ((2 * MiB, MiB), (MiB, MiB), False),  # about the same passes: keep the caches
     ((60 * MiB, MiB), (10 * MiB, 2 * MiB), True),  # only lean fits the 70 MiB target
     ((90 * MiB, MiB), (80 * MiB, MiB), True),  # neither fits it: the smaller bound
     ((90 * MiB, MiB), (95 * MiB, MiB), False)],  # lean no smaller: keep the caches
)  # fmt: skip
def test_lean_runs_where_it_halves_the_passes_or_only_it_fits(
    monkeypatch, full, lean, expected
):
    from ggnchunk._api import _plan_for_budget

    monkeypatch.setattr(
        HostMemory, "planning_share", 0.7
    )  # the cases' numbers are for a 70% target

    run = _FakeRun(full, lean)
    chosen = _plan_for_budget(run, 100 * MiB, 5 * MiB, 100, torch.device("cpu"))
    assert chosen is expected and run.lean is expected
    assert (run.fixed_bytes(), run.column_bytes()) == (lean if expected else full)
    # windowed fields' images: nothing while choosing; then, kept (not lean), a quarter
    # of the room the bound leaves at most, and always room for one column
    room = int(0.7 * 100 * MiB) - 5 * MiB - full[0]
    assert run.field_limit == (0 if expected else max(0, min(room // 4, room - full[1])))


# 40 MiB: the all-columns bound (31 MiB fixed) leaves no room in the 28 MiB planning
# target (70%), one column per pass; without Gram factors 27 MiB hold 54 columns, 15
# passes of at most 53, and a bound made for 53 columns keeps no Gram factor. 10 GiB: one
# pass of all 784 columns, planned as before.
@pytest.mark.parametrize(("budget", "planned"), [(40 * MiB, 53), (10 * GiB, 784)])
def test_tight_budgets_plan_the_contraction_forms_for_their_chunk_size(
    monkeypatch, budget, planned
):
    from ggnchunk._api import _plan_for_budget

    monkeypatch.setattr(
        HostMemory, "planning_share", 0.7
    )  # the numbers above are for a 70% target

    run = _FakeRun((MiB, MiB // 2), (MiB, MiB // 2), gram_from=100)
    lean = _plan_for_budget(run, budget, 0, 784, torch.device("cpu"))
    assert not lean
    assert run.columns == planned  # the bounds were made for that chunk size
    assert run.fixed_bytes() == MiB + (30 * MiB if planned >= 100 else 0)


class _FakeWindowedRun(_FakeRun):
    """A run whose windowed passes carry fields: ``fields`` bytes while they travel.

    Windowed columns cost ``windowed`` bytes each, dense ones ``dense``; the fields
    travel unless the plan assumes their images kept (lean: always), and dense passes
    carry none.
    """

    def __init__(self, fields, windowed=MiB // 4, dense=MiB, has_fields=True):
        super().__init__((MiB, dense), (MiB, dense))
        self.fields, self.windowed, self.dense = fields, windowed, dense
        self.has_fields = has_fields  # else ``fields`` stands for the boxes' caches
        self.assume_fields_kept, self.dense_only, self.reason = False, False, None
        self.dense_limit = None

    @property
    def may_window(self):
        return True

    def plan_dense(self, dense, reason=None):
        self.dense_only, self.reason = dense, reason if dense else None

    def limit_dense_parts(self, room):
        self.dense_limit = (room - self.fixed_bytes()) // self.dense

    def fixed_bytes(self, columns=None):
        travel = not (self.dense_only or self.assume_fields_kept)
        return MiB + (self.fields if travel else 0)

    def column_bytes(self):
        return self.dense if self.dense_only else self.windowed


@pytest.mark.parametrize(
    ("fields", "dense_only", "says", "has_fields"),
    [(0, False, None, True),  # windowed passes plan 4x fewer passes: kept
     (60 * MiB, False, None, True),  # the fields leave room: windowed, the trial decides
     # the first pass (its fields travelling) fits the budget, though not the
     # planning target; the later ones keep the fields' images: windowed
     (80 * MiB, False, None, True),
     (100 * MiB, True, "no pass", True),  # no windowed pass fits (dense passes do)
     # no fields, what windowed passes keep at any size fills the budget: the reason
     # says so (it spoke of fields a 28x28 autoencoder does not have)
     (100 * MiB, True, "the boxes' caches", False)],
)  # fmt: skip
def test_windowed_plans_give_way_to_dense_ones_where_fields_fill_the_budget(
    monkeypatch, fields, dense_only, says, has_fields
):
    from ggnchunk._api import _plan_for_budget

    monkeypatch.setattr(HostMemory, "planning_share", 0.7)
    run = _FakeWindowedRun(fields, has_fields=has_fields)
    _plan_for_budget(run, 100 * MiB, 0, 1000, torch.device("cpu"))
    assert run.dense_only is dense_only
    if dense_only:
        assert "every pass runs dense" in run.reason and says in run.reason
        assert ("fields" in run.reason) is has_fields, run.reason
        assert (run.fixed_bytes(), run.column_bytes()) == (MiB, MiB)
    else:  # dense parts of windowed chunks: what the budget fits beside the fields
        assert run.reason is None
        assert run.dense_limit == (70 * MiB - MiB - fields) // MiB


def test_a_tight_budget_on_a_groupnorm_model_runs_dense_passes_exactly(monkeypatch):
    """The fields of windowed passes need more than 16 MiB here; dense passes fit.

    Before, the call was refused (a chunk of one column "needs up to 24.0 MiB"), and
    at budgets the windowed bound met ran one column per pass, 5x slower than dense.
    """
    from ggnchunk import _windows
    from tests.reference import assert_diag_close, reference_diag_ggn

    monkeypatch.setattr(_windows, "ENABLED", True)
    monkeypatch.setattr(_windows, "TRIAL", False)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
        nn.Conv2d(16, 3, 3, padding=1),
    ).double()  # fmt: skip
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    y = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    diag, report = ggnchunk.diag_ggn(
        model, nn.MSELoss(), x, y, max_memory="16MiB", return_report=True
    )
    assert not report.windowed and "every pass" in report.window_ends
    assert report.num_passes < 200  # dense chunks, not one column per pass
    expected = reference_diag_ggn(model, nn.MSELoss(), x, y)
    assert_diag_close(diag, expected, rtol=1e-9, label="groupnorm at 16 MiB")
    ggnchunk.clear_autotune_cache()


def _warner(module_name: str, path: str):
    """A function defined as if in module ``module_name`` (file ``path``) that warns."""
    namespace = {"__name__": module_name}
    code = (
        "import warnings\n"
        "from ggnchunk._checks import user_stacklevel\n"
        "def warn():\n"
        "    warnings.warn('from ' + __name__, UserWarning, stacklevel=user_stacklevel())\n"
    )
    exec(compile(code, path, "exec"), namespace)
    return namespace["warn"]


def test_warnings_skip_ggnchunk_and_torch_wrappers_but_not_sibling_packages():
    inner = _warner("ggnchunk._fake", "/x/ggnchunk/_fake.py")
    wrapped = torch.no_grad()(inner)  # as DiagGGNOptimizer.step is wrapped
    with pytest.warns(UserWarning, match="ggnchunk._fake") as record:
        wrapped()
    assert record[0].filename == __file__
    sibling = _warner("ggnchunk_extra.lib", "/x/ggnchunk_extra/lib.py")
    with pytest.warns(UserWarning, match="ggnchunk_extra") as record:
        sibling()  # another package whose name starts the same is the user's code
    assert record[0].filename == "/x/ggnchunk_extra/lib.py"


def test_auto_times_the_larger_size_again_before_believing_a_smaller_one():
    # the first two large chunks of a call run slower (the allocator still adapting to
    # their size): the half size looks twice as fast until the full size is timed again
    ggnchunk.clear_autotune_cache()
    sim, calls = SimulatedMemory(), []

    def timed_measure(fn):
        result, peak, _ = SimulatedMemory.measure(sim, fn)
        if sim.size >= 40:
            calls.append(sim.size)
        slow = sim.size >= 40 and len(calls) <= 2
        return result, peak, sim.size * (2.0 if slow else 1.0) * 1e-3

    sim.measure = timed_measure
    budget_mode = ChunkScheduler(max_memory="100MiB", tracker=sim).run(2000, sim.run)[1]
    calls.clear()
    scheduler = ChunkScheduler(chunk_size="auto", max_memory="100MiB", tracker=sim)
    total, report = scheduler.run(2000, sim.run)
    assert total.item() == sum(range(2000))
    assert report.chunk_size == budget_mode.chunk_size  # no smaller size was chosen
    ggnchunk.clear_autotune_cache()


# -- a measurement that sees nothing licenses no unbounded chunk (issue 21) --------------


class _HiddenMemory(SimulatedMemory):
    """Chunks of up to ``hidden`` indices read 0 bytes, larger ones their growth.

    As memory the allocator reuses, or a page-sized resolution, reads.
    """

    def __init__(self, hidden, **kwargs):
        super().__init__(**kwargs)
        self.hidden = hidden

    def measure(self, fn):
        result = fn()
        if self.size <= self.hidden:
            return result, self.level, 1e-3
        return result, self.level + self.fixed + self.per_index * self.size, 1e-3


@pytest.mark.parametrize("hidden", [1, 2, 8])
def test_a_zero_reading_never_licenses_an_unbounded_chunk(hidden):
    sim = _HiddenMemory(hidden, fixed=0, per_index=MiB)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        total, report = ChunkScheduler(max_memory="64MiB", tracker=sim).run(1024, sim.run)
    assert total.item() == sum(range(1024))
    sizes = [c.stop - c.start for c in report.chunks]
    # sizes grow at most twice the largest measured chunk at a time
    assert all(b <= 2 * max(sizes[: i + 1]) for i, b in enumerate(sizes[1:])), sizes
    peak = report.peak_extra_bytes
    overshoot = [w for w in caught if issubclass(w.category, MemoryBudgetWarning)]
    # the one chunk that could overshoot is twice a hidden size: warned if above budget
    assert peak <= 64 * MiB or overshoot, (peak, sizes)
    assert max(sizes) <= max(2 * hidden, int(HostMemory.planning_share * 64)), sizes
    # the report's chunk size is the one that ran the bulk of the range
    covered = {s: sum(x for x in sizes if x == s) for s in sizes}
    assert covered[report.chunk_size] == max(covered.values()), (report.chunk_size, sizes)


def test_the_overshoot_of_a_growth_chunk_is_checked_and_warned():
    # every chunk reads 0 until 32 indices, then a chunk of 64 shows 200 MiB: warned
    sim = _HiddenMemory(32, fixed=0, per_index=200 * MiB // 64)
    with pytest.warns(MemoryBudgetWarning, match="above the 64.0 MiB budget"):
        _, report = ChunkScheduler(max_memory="64MiB", tracker=sim).run(1024, sim.run)
    sizes = [c.stop - c.start for c in report.chunks]
    assert sizes[sizes.index(64) + 1] < 64  # shrunk at once


class _Noisy(SimulatedMemory):
    """Every other chunk reads ``noise`` bytes more (process RSS moves with the heap)."""

    def __init__(self, noise, **kwargs):
        super().__init__(**kwargs)
        self.noise, self.calls = noise, 0

    def measure(self, fn):
        result, peak, seconds = super().measure(fn)
        self.calls += 1
        return result, peak + (self.noise if self.calls % 2 == 0 else 0), seconds


@pytest.mark.parametrize(("noise_mib", "shrinks"), [(4, False), (10, True)])
def test_a_chunk_a_little_above_the_target_is_noise_not_a_reason_to_shrink(
    noise_mib, shrinks
):
    """Only a chunk above halfway from the target (68 MiB) to the budget (80) shrinks.

    A ResNet-18's one-column passes read 65-69.5 MiB around a 68.2 MiB target: cutting
    on every reading above the target made its warm calls 4 to 10 passes.
    """
    ggnchunk.clear_autotune_cache()
    fixed, per_index, budget = 60 * MiB, 3 * MiB // 2, 80 * MiB
    sizes = []
    for _ in range(3):  # a first call and warm calls (the cut is remembered)
        sim = _Noisy(noise_mib * MiB, fixed=fixed, per_index=per_index)
        scheduler = ChunkScheduler(max_memory=budget, tracker=sim, cache_key="noisy")
        with warnings.catch_warnings():
            warnings.simplefilter("error", MemoryBudgetWarning)  # never above the budget
            _, report = scheduler.run(40, sim.run, cost=(fixed, 2 * MiB))
        sizes.append([c.stop - c.start for c in report.chunks])
        assert report.peak_extra_bytes <= budget
    planned = int((HostMemory.planning_share * budget - fixed) // (2 * MiB))  # 4
    warm = sizes[-1][1:-1]
    if shrinks:  # 60 + 1.5 * 4 + 10 = 76 MiB > 74 MiB: cut below the bound's size
        assert max(warm) < planned, sizes
    else:  # 70 MiB: within the budget's margin, the bound's size stays
        assert set(warm) == {planned}, sizes
    ggnchunk.clear_autotune_cache()


# -- auto mode: the fastest plan, with or without a budget (issue 21) --------------------


def _u_shaped(best):
    def seconds(size):  # time per index lowest at ``best`` indices per chunk
        return size * (1.0 + abs(math.log2(size / best))) * 1e-3

    return seconds


class _Timed(SimulatedMemory):
    def __init__(self, seconds, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def measure(self, fn):
        result, peak, _ = super().measure(fn)
        return result, peak, self.seconds(self.size)


@pytest.mark.parametrize("best", [8, 64, 256])
@pytest.mark.parametrize("budget", [None, "4GiB"])
def test_auto_finds_the_fastest_size_not_the_largest_that_fits(best, budget):
    ggnchunk.clear_autotune_cache()
    sim = _Timed(_u_shaped(best), fixed=MiB, per_index=2**16)
    kwargs = {} if budget is None else {"max_memory": budget}
    total, report = ChunkScheduler(chunk_size="auto", tracker=sim, **kwargs).run(
        4096, sim.run
    )
    assert total.item() == sum(range(4096))
    assert report.chunk_size == best, [c.stop - c.start for c in report.chunks]
    ggnchunk.clear_autotune_cache()


@pytest.mark.parametrize("best", [4, 64, 512])
def test_auto_with_a_known_bound_starts_cache_friendly_and_climbs(best):
    # diag_ggn's path: the bound is known (no probe); 64 KiB per index fits 16 MiB at
    # 256 indices, where the search starts, and 4 GiB would fit everything
    ggnchunk.clear_autotune_cache()
    sim = _Timed(_u_shaped(best), fixed=MiB, per_index=2**16)
    _, report = ChunkScheduler(chunk_size="auto", max_memory="4GiB", tracker=sim).run(
        4096, sim.run, cost=(MiB, 2**16)
    )
    sizes = [c.stop - c.start for c in report.chunks]
    assert sizes[:2] == [1, 256], sizes  # one index, then the cache-friendly size
    assert report.chunk_size == best, sizes
    ggnchunk.clear_autotune_cache()


@pytest.mark.parametrize("total", [300, 700, 1536, 1537])
def test_auto_runs_a_rest_too_small_to_tune_in_one_chunk(total):
    """Auto runs a rest too small to compare sizes in one chunk, as budget mode would.

    Where the trials' share of the rest (half) cannot hold the first size and its
    double, nothing can be compared (the tutorial autoencoder ran 1 + 1024 + 2047
    columns in auto mode where budget mode ran 1 + 3071).
    """
    ggnchunk.clear_autotune_cache()
    sim = _Timed(_u_shaped(64), fixed=MiB, per_index=2**16)  # 256 indices in 16 MiB
    _, report = ChunkScheduler(chunk_size="auto", max_memory="4GiB", tracker=sim).run(
        total, sim.run, cost=(MiB, 2**16)
    )
    sizes = [c.stop - c.start for c in report.chunks]
    if (total - 1) // 2 < 3 * 256:  # after the first index: the rest in one chunk
        assert sizes == [1, total - 1], sizes
    else:  # room to compare: the search runs (its first size is the cache-friendly one)
        assert sizes[:2] == [1, 256], sizes
    # a budget that holds only part of the rest: never above what the memory allows
    ggnchunk.clear_autotune_cache()
    sim = _Timed(_u_shaped(64), fixed=MiB, per_index=2**16)
    _, report = ChunkScheduler(chunk_size="auto", max_memory="24MiB", tracker=sim).run(
        total, sim.run, cost=(MiB, 2**16)
    )
    sizes = [c.stop - c.start for c in report.chunks]
    assert max(MiB + s * 2**16 for s in sizes) <= 24 * MiB, sizes
    ggnchunk.clear_autotune_cache()


def test_auto_remembers_a_search_that_ended_at_budget_modes_plan():
    """Where larger chunks were never slower, later auto calls run budget mode's plan.

    The search stopped at the memory or at its trials' share: the next call must not
    time the same trials again (the U-Net's warm auto calls ran 1 + 64 + 128 + 256 +
    319 columns each, 0.39 s, where budget mode ran 1 + 767, 0.27 s).
    """

    def faster_when_larger(size):  # a fixed cost per pass, nothing else grows
        return 1e-2 + size * 1e-5

    def sizes_of(mode, calls):
        ggnchunk.clear_autotune_cache()
        runs = []
        for _ in range(calls):
            sim = _Timed(faster_when_larger, fixed=MiB, per_index=2**16)
            extra = {"chunk_size": "auto"} if mode == "auto" else {}
            scheduler = ChunkScheduler(
                max_memory="48MiB", tracker=sim, cache_key="larger is faster", **extra
            )
            _, report = scheduler.run(3000, sim.run, cost=(MiB, 2**16))
            runs.append([c.stop - c.start for c in report.chunks])
        ggnchunk.clear_autotune_cache()
        return runs

    budget = sizes_of("budget", 2)[1]  # a warm call (a first call starts at half)
    first, second, third = sizes_of("auto", 3)
    assert first[:3] == [1, 256, 512], first  # the search ran, and climbed
    assert second == third == budget, (first, second, budget)


class _Hoarding(torch.utils._python_dispatch.TorchDispatchMode):
    """Keeps every result alive while active: a call under it needs far more memory."""

    def __init__(self):
        super().__init__()
        self.kept = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.kept.append(out)
        return out


def test_calls_under_a_dispatch_mode_store_no_decisions():
    """A call under a dispatch mode reads the plain calls' decisions, and stores none.

    Under ``FlopCounterMode`` every operation runs through Python: a budgeted ResNet-18
    cut its chunks to 80 passes there, and the remembered cut held the next plain call
    to 100 passes (18 before). Simulated memory, as diag_ggn schedules (a known bound):
    under the mode each index takes three times what the bound says.
    """
    from torch.utils.flop_counter import FlopCounterMode

    from ggnchunk._scheduling.autotune import CACHE

    ggnchunk.clear_autotune_cache()

    def sizes(per_index, mode=None):
        sim = SimulatedMemory(fixed=MiB, per_index=per_index)
        scheduler = ChunkScheduler(max_memory="64MiB", tracker=sim, cache_key="toy")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ggnchunk.MemoryBudgetWarning)
            with mode if mode is not None else contextlib.nullcontext():
                total, report = scheduler.run(200, sim.run, baseline=0, cost=(MiB, MiB))
        assert total.item() == sum(range(200))
        return [c.stop - c.start for c in report.chunks]

    sizes(MiB)  # a first call (it starts from half the bound's size)
    plain = sizes(MiB)
    assert len(CACHE) == 1
    hoarded = sizes(3 * MiB, _Hoarding())  # more memory under the mode: cut chunks
    assert len(hoarded) > 2 * len(plain)
    assert len(CACHE) == 1  # and not remembered
    assert sizes(MiB) == plain  # the plain calls' plan, not the cut one
    assert sizes(3 * MiB, FlopCounterMode(display=False))[:2] == plain[:2]  # read
    # the windows-or-dense trial's outcome: read under a mode, stored only outside one
    from ggnchunk import _windows

    with FlopCounterMode(display=False):
        _windows.Choice("toy").settle(False)
        assert _windows.Choice("toy").choice is None
    _windows.Choice("toy").settle(True)
    with FlopCounterMode(display=False):
        read = _windows.Choice("toy")
        assert read.choice is True and read.remembered
    ggnchunk.clear_autotune_cache()


# -- memory backends and the autotune cache (issue 18) ----------------------------------
@pytest.mark.parametrize("kind", ["mps", "xpu", "meta"])
def test_a_device_without_a_memory_backend_is_refused_for_budgets(kind):
    """Budgets on a device whose memory cannot be read are refused, never run on RSS."""
    calls = []

    def fn(start, stop):
        calls.append((start, stop))

    with pytest.raises(UnsupportedDeviceError, match=f"not on '{kind}'.*num_chunks"):
        ChunkScheduler(max_memory="64MiB", device=kind).run(8, fn)
    with pytest.raises(UnsupportedDeviceError, match=r"chunk_size='auto'"):
        ChunkScheduler(chunk_size="auto", device=kind).run(8, fn)
    with pytest.raises(ValueError, match=f"not on '{kind}'"):
        ggnchunk.measure_peak_memory(lambda: None, device=kind)
    assert calls == []  # refused before any work
    # a fixed chunking measures nothing and runs on every device kind
    _, report = ChunkScheduler(num_chunks=3, device=kind).run(8, fn)
    assert calls == [(0, 3), (3, 6), (6, 8)] and report.mode == "fixed"


def test_memory_backends_by_device_kind():
    host = memory_backend("cpu")
    assert isinstance(host, HostMemory) and host.method == "rss-poll"
    assert host.current() > 0 and host.settled() > 0 and host.free() > 0
    result, peak, seconds = host.measure(lambda: torch.ones(2**20).sum())
    assert result == 2**20 and peak > 0 and seconds >= 0
    assert memory_backend("cuda").method == "cuda-allocator"  # nothing measured yet


def test_the_autotune_cache_is_bounded_and_least_recently_used():
    cache = AutotuneCache(size=3)
    for key in "abc":
        cache.put(key, Decision(1.0, 2.0))
    assert cache.get("a") is not None  # "a" is now the most recently used
    cache.put("d", Decision(1.0, 2.0))  # evicts "b", the least recently used
    assert len(cache) == 3 and cache.get("b") is None
    assert all(cache.get(key) is not None for key in "acd")
    cache.put(None, Decision(1.0, 2.0))  # no key: never cached
    assert len(cache) == 3 and cache.get(None) is None


def test_the_schedulers_cache_holds_at_most_its_size(monkeypatch):
    from ggnchunk._scheduling import autotune

    monkeypatch.setattr(autotune, "CACHE", AutotuneCache(size=4))
    monkeypatch.setattr("ggnchunk._scheduling.scheduler.CACHE", autotune.CACHE)
    for key in range(10):
        sim = SimulatedMemory()
        ChunkScheduler(max_memory="64MiB", cache_key=key, tracker=sim).run(20, sim.run)
    assert len(autotune.CACHE) == 4


def test_auto_without_a_budget_finds_its_decision_again(monkeypatch):
    """Auto mode without max_memory finds its cached decision in the next call.

    It plans for 90% of the free memory, which moves by some KiB from call to call: the
    cache's key holds it rounded (30 identical calls made 22 entries and re-ran the
    trials when it held the free bytes).
    """
    from ggnchunk._memory.backends import HostMemory
    from ggnchunk._scheduling.autotune import CACHE

    free = itertools.count(20 * 2**30, 4099)  # a little more free memory every call
    monkeypatch.setattr(HostMemory, "free", lambda self: next(free))
    ggnchunk.clear_autotune_cache()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 40))
    x, y = torch.randn(16, 6), torch.randn(16, 40)
    expected = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y)
    reports = []
    for _ in range(6):
        diag, report = ggnchunk.diag_ggn(
            model, nn.MSELoss(), x, y, chunk_size="auto", return_report=True
        )
        assert_diag_close(diag, expected, rtol=1e-5)
        reports.append(report.schedules[0])
    assert len(CACHE) == 1
    assert not reports[0].from_cache and all(r.from_cache for r in reports[1:])
    budgets = {r.budget_bytes for r in reports}
    assert (
        len(budgets) == 1 and 0.875 * 0.9 * 20 * 2**30 < budgets.pop() <= 0.9 * 20 * 2**30
    )


def test_a_chunk_that_measures_nothing_does_not_license_growth():
    """Growth keeps the steepest per-index cost measured before a blind chunk.

    A chunk that reuses freed memory measures nothing: per-sample gradients within
    8 MiB grew from such a chunk to twice its size and peaked at 26 MiB.
    """

    class Blind(SimulatedMemory):
        def __init__(self):
            super().__init__(fixed=0, per_index=MiB // 2)
            self.measured = 0

        def measure(self, fn):
            result, peak, seconds = super().measure(fn)
            self.measured += 1
            return result, (0 if self.measured == 7 else peak), seconds

    sim = Blind()
    total, report = ChunkScheduler(max_memory="8MiB", tracker=sim).run(200, sim.run)
    assert total.item() == sum(range(200))
    sizes = [c.stop - c.start for c in report.chunks]
    fit = int(HostMemory.planning_share * 8 * MiB // (MiB // 2))
    assert report.chunks[6].peak_extra_bytes == 0 and sizes[6] == fit  # the blind one
    assert max(sizes) == fit  # not twice it after the blind chunk
