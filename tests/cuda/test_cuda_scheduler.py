"""The scheduler's CUDA-only logic, through a simulated allocator (runs on the CPU).

On CUDA the allocator's statistics are exact, so budget mode starts from the engine's
bound and grows the chunk size from measured peaks where that bound was conservative; on
the CPU it never grows past the bound. The real allocator's figures are checked in
test_cuda_memory.py (skipped without a GPU).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ggnchunk import ChunkScheduler, MemoryBudgetWarning, OutOfMemoryRecoveryWarning
from ggnchunk._memory import CudaMemory, HostMemory
from tests.budget.test_scheduler import SimulatedMemory

MiB = 2**20


class SimulatedAllocator(SimulatedMemory):
    """Peak of a chunk = level + fixed + per_index * size, as ``max_memory_allocated``."""

    def __init__(self, fixed=8 * MiB, per_index=MiB, limit=None):
        super().__init__(fixed, per_index, limit)


@pytest.mark.parametrize("looseness", [2, 4, 16])
def test_cuda_grows_from_measurements_where_the_bound_was_conservative(looseness):
    sim = SimulatedAllocator()
    budget = 200 * MiB
    bound = (sim.fixed, looseness * sim.per_index)  # the engine's bound overstates
    scheduler = ChunkScheduler(max_memory=budget, device="cuda", tracker=sim)
    total, report = scheduler.run(5000, sim.run, baseline=0, cost=bound)
    assert total.item() == sum(range(5000))
    planned = int((CudaMemory.planning_share * budget - sim.fixed) // bound[1])
    fits = int((CudaMemory.planning_share * budget - sim.fixed) // sim.per_index)
    sizes = [c.stop - c.start for c in report.chunks]
    assert sizes[:2] == [1, 2]  # the first index, then growth from measured chunks
    assert max(sizes) > planned, "no growth from the measured peaks"
    assert report.chunk_size <= fits  # never past the target
    assert report.chunk_size >= 0.9 * fits  # and close to it
    assert all(c.peak_extra_bytes <= budget for c in report.chunks)
    assert report.peak_extra_bytes <= CudaMemory.planning_share * budget


def test_cpu_never_grows_past_the_bound():
    sim = SimulatedAllocator()
    budget = 200 * MiB
    bound = (sim.fixed, 4 * sim.per_index)
    scheduler = ChunkScheduler(max_memory=budget, device="cpu", tracker=sim)
    _, report = scheduler.run(5000, sim.run, baseline=0, cost=bound)
    planned = int((HostMemory.planning_share * budget - sim.fixed) // bound[1])
    assert max(c.stop - c.start for c in report.chunks) == planned


@pytest.mark.parametrize("understated", [2, 4, 16])
def test_cuda_holds_the_budget_where_the_bound_is_too_small(understated):
    """A bound below the truth: the budget holds, without an overshoot.

    Workspaces no bound sees (cuDNN sizes them from the free device memory; on an H200 a
    28x28 autoencoder took 3-5x its bound): sizes grow from measured chunks only.
    """
    sim = SimulatedAllocator(per_index=4 * MiB)
    budget = 200 * MiB
    scheduler = ChunkScheduler(max_memory=budget, device="cuda", tracker=sim)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryBudgetWarning)
        total, report = scheduler.run(
            2000, sim.run, baseline=0, cost=(sim.fixed, sim.per_index // understated)
        )
    assert total.item() == sum(range(2000))
    assert all(c.peak_extra_bytes <= budget for c in report.chunks)
    fits = int((CudaMemory.planning_share * budget - sim.fixed) // sim.per_index)
    assert fits >= report.chunk_size >= 0.9 * fits


class JumpingWorkspace(SimulatedAllocator):
    """Above ``at`` indices a chunk costs ``factor`` times more (another algorithm)."""

    def __init__(self, at: int, factor: int):
        super().__init__()
        self.at, self.factor = at, factor

    def measure(self, fn):
        result = fn()
        per_index = self.per_index * (self.factor if self.size > self.at else 1)
        return result, self.level + self.fixed + per_index * self.size, 1e-3


def test_cuda_shrinks_after_a_jump_no_measurement_foresaw():
    sim = JumpingWorkspace(at=40, factor=4)
    budget = 200 * MiB
    scheduler = ChunkScheduler(max_memory=budget, device="cuda", tracker=sim)
    with pytest.warns(MemoryBudgetWarning, match="above the 200.0 MiB budget"):
        total, report = scheduler.run(
            2000, sim.run, baseline=0, cost=(sim.fixed, sim.per_index)
        )
    assert total.item() == sum(range(2000))
    over = [c for c in report.chunks if c.peak_extra_bytes > budget]
    assert len(over) == 1, over  # one chunk, then the sizes that fitted
    assert report.chunks[-1].peak_extra_bytes <= budget


class TransientWorkspace(SimulatedAllocator):
    """Every pass also holds a workspace of ``workspace`` bytes, whatever its size."""

    def __init__(self, workspace: int):
        super().__init__(per_index=MiB // 4)
        self.workspace = workspace

    def measure(self, fn):
        result, peak, seconds = super().measure(fn)
        return result, peak + self.workspace, seconds


def test_cuda_grows_past_a_large_workspace_of_every_pass():
    """A pass's own workspace (the same at 1 and 2 columns) is no cost per column.

    On an H200, cuDNN gave the tutorial autoencoder's 2-column passes GiBs of workspace:
    read as a cost per column, it held budget mode at 2 columns for 1,537 passes.
    """
    budget = 200 * MiB
    sim = TransientWorkspace(int(0.7 * budget))
    scheduler = ChunkScheduler(max_memory=budget, device="cuda", tracker=sim)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryBudgetWarning)
        total, report = scheduler.run(
            3000, sim.run, baseline=0, cost=(sim.fixed, sim.per_index)
        )
    assert total.item() == sum(range(3000))
    room = CudaMemory.planning_share * budget - sim.workspace - sim.fixed
    fits = int(room // sim.per_index)
    assert fits >= report.chunk_size >= 0.9 * fits, [
        c.stop - c.start for c in report.chunks
    ]
    assert all(c.peak_extra_bytes <= budget for c in report.chunks)


def test_cuda_second_call_starts_from_a_measured_size_only():
    """The next call starts at the largest chunk measured within the target.

    Not at the size the last call would have tried next: that size was never measured,
    and cuDNN's workspaces jump (83 MiB at 273 columns, 6.5 GiB at 512, on an H200).
    """
    sim = JumpingWorkspace(at=400, factor=20)
    budget = 2000 * MiB
    scheduler = ChunkScheduler(max_memory=budget, device="cuda", tracker=sim, cache_key="k")
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryBudgetWarning)
        _, first = scheduler.run(600, sim.run, baseline=0, cost=(sim.fixed, sim.per_index))
        total, again = scheduler.run(
            600, sim.run, baseline=0, cost=(sim.fixed, sim.per_index)
        )
    assert total.item() == sum(range(600))
    assert max(c.stop - c.start for c in first.chunks) == 256
    assert [c.stop - c.start for c in again.chunks][:2] == [1, 256]


def test_cuda_out_of_memory_recovery_names_the_working_chunk_size():
    sim = SimulatedAllocator(limit=40 * MiB)  # more than 32 indices fail
    with pytest.warns(OutOfMemoryRecoveryWarning) as record:
        total, report = ChunkScheduler(num_chunks=3, device="cuda").run(300, sim.run)
    assert total.item() == sum(range(300))
    worked = max(c.stop - c.start for c in report.chunks)
    assert worked <= 32
    assert f"chunk_size={worked}" in str(record[0].message)


class FakeAllocator:
    """The caching allocator's counters, as torch.cuda reports them."""

    def __init__(self):
        self.allocated = self.peak = 0

    def alloc(self, size):
        self.allocated += size
        self.peak = max(self.peak, self.allocated)

    def free(self, size):
        self.allocated -= size

    def install(self, monkeypatch):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)  # (a simulated device)
        monkeypatch.setattr(cuda, "synchronize", lambda *a, **k: None)
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "memory_allocated", lambda *a, **k: self.allocated)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda *a, **k: self.peak)

        def reset(*args, **kwargs):
            self.peak = self.allocated

        monkeypatch.setattr(cuda, "reset_peak_memory_stats", reset)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_measure_peak_memory_sees_peaks_before_the_schedulers_own_resets(
    monkeypatch, device
):
    """The whole call's peak, though the scheduler resets the allocator's around chunks.

    measure_peak_memory gives the GPU benchmark's figures.
    """
    from ggnchunk import measure_peak_memory
    from ggnchunk._memory import CudaMemory as PeakTracker

    fake = FakeAllocator()
    fake.install(monkeypatch)
    fake.alloc(1000)  # in use before the call

    def call():
        fake.alloc(300)  # the forward pass and its transients
        fake.free(200)
        tracker = PeakTracker(torch.device("cuda:0"))
        for _ in range(3):  # three chunks, each measured (and reset) by the scheduler
            tracker.measure(lambda: (fake.alloc(50), fake.free(50)))
        fake.free(100)

    measured = measure_peak_memory(call, device=device)
    assert measured.baseline_bytes == 1000
    assert measured.peak_extra_bytes == 300
    tracker = PeakTracker(torch.device("cuda:0"))  # no measurement open: still resets
    fake.alloc(500)
    fake.free(500)
    tracker.measure(lambda: None)
    assert fake.peak == 1000


class CappedCudnn(FakeAllocator):
    """The caching allocator with a per-process fraction, and cuDNN's workspaces.

    A pass allocates its own bytes, then a workspace: the algorithm cuDNN wants (sized
    from the free device memory: ``wish``, large above ``jump`` columns) where the
    allocator gives it, else a smaller algorithm's (cuDNN halves its request until an
    allocation succeeds). The allocator serves a request from its cached free blocks
    where one is large enough, cap or not; a new segment only under the cap (after
    giving the cached blocks back). Own bytes that do not fit raise its out-of-memory
    error.
    """

    total = 100 * 2**30

    def __init__(self, per_index=MiB, jump=256, wish=6 * 2**30, small=MiB):
        super().__init__()
        self.per_index, self.jump, self.wish, self.small = per_index, jump, wish, small
        self.fraction, self.fractions = 1.0, []
        self.cached = 0  # free blocks the cache holds (reserved, not allocated)

    def install(self, monkeypatch):
        super().install(monkeypatch)
        cuda = torch.cuda
        monkeypatch.setattr(
            cuda, "get_per_process_memory_fraction", lambda *a: self.fraction
        )
        monkeypatch.setattr(cuda, "mem_get_info", lambda *a: (self.total, self.total))
        properties = type("Properties", (), {"total_memory": self.total})()
        monkeypatch.setattr(cuda, "get_device_properties", lambda *a: properties)
        monkeypatch.setattr(
            cuda, "memory_reserved", lambda *a: self.allocated + self.cached
        )

        def empty_cache():
            self.cached = 0

        def set_fraction(fraction, *args):
            self.fraction = fraction
            self.fractions.append(fraction)

        monkeypatch.setattr(cuda, "empty_cache", empty_cache)
        monkeypatch.setattr(cuda, "set_per_process_memory_fraction", set_fraction)

    def grab(self, size) -> bool:
        cap = self.fraction * self.total
        if size <= self.cached:  # a cached free block serves it
            self.cached -= size
        elif self.allocated + self.cached + size <= cap:  # a new segment
            pass
        elif self.allocated + size <= cap:  # the cached blocks given back, then one
            self.cached = 0
        else:
            return False
        self.alloc(size)
        return True

    def release(self, size):
        self.free(size)
        self.cached += size

    def run(self, start, stop):
        size = stop - start
        own = self.per_index * size
        if not self.grab(own):
            raise torch.OutOfMemoryError("simulated: CUDA out of memory (the cap)")
        workspace = self.wish if size > self.jump else self.small
        while workspace and not self.grab(workspace):  # cuDNN halves its request
            workspace //= 2
        self.release(workspace)
        self.release(own)
        return torch.tensor(float(sum(range(start, stop))))


@pytest.mark.parametrize("cached", [0, 8 * 2**30], ids=["empty-cache", "cached-blocks"])
@pytest.mark.parametrize("tracker", ["none", "backend"], ids=["scheduler", "diag_ggn"])
def test_a_budget_caps_the_allocator_so_cudnns_workspaces_fit(tracker, cached):
    """The workspaces of cuDNN jump (6.5 GiB at 510 columns, 2 GiB budget, H200).

    No bound or measurement sees the jump ahead; under the budget's cap on the allocator
    cuDNN falls back to an algorithm that fits, so no chunk goes above the budget, in
    the call that grows and in the next one (which started at an untried size before).
    The user's fraction is put back. ``diag_ggn`` hands the scheduler a backend of its
    own as the tracker (the first GPU check of the cap found it uncapped there). Free
    blocks an earlier uncapped call left in the cache would serve a workspace under any
    cap (the second GPU check): they are released first.
    """
    from ggnchunk._memory import backends

    sim = CappedCudnn()
    with pytest.MonkeyPatch.context() as monkeypatch:
        sim.install(monkeypatch)
        sim.alloc(300 * MiB)  # the forward pass's tensors (the baseline)
        sim.cached = cached  # an earlier one-pass call's workspace, freed to the cache
        budget = 2000 * MiB
        scheduler = ChunkScheduler(
            max_memory=budget, device="cuda", cache_key="cudnn",
            tracker=CudaMemory(torch.device("cuda")) if tracker == "backend" else None,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("error", MemoryBudgetWarning)
            for _ in range(2):
                total, report = scheduler.run(1000, sim.run, cost=(8 * MiB, MiB))
                assert total.item() == sum(range(1000))
                assert all(c.peak_extra_bytes <= budget for c in report.chunks), [
                    (c.stop - c.start, c.peak_extra_bytes / MiB) for c in report.chunks
                ]
                assert max(c.stop - c.start for c in report.chunks) > sim.jump
                assert sim.fraction == 1.0  # put back
        expected = (300 * MiB + budget) / sim.total
        assert sim.fractions[0] == pytest.approx(expected)
        assert backends._CAPS == {} and backends._USER_FRACTION == {}


def test_the_users_tighter_fraction_stays_and_the_cap_is_lifted_after_an_error():
    sim = CappedCudnn()
    with pytest.MonkeyPatch.context() as monkeypatch:
        sim.install(monkeypatch)
        sim.fraction = 0.001  # the user's own: 102 MiB of 100 GiB, tighter than the cap
        scheduler = ChunkScheduler(max_memory="2GiB", device="cuda")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MemoryBudgetWarning)
            scheduler.run(200, sim.run, cost=(8 * MiB, MiB))
        assert sim.fractions == [] and sim.fraction == 0.001
        sim.fraction = 1.0

        def failing(start, stop):
            if start >= 10:
                raise KeyboardInterrupt
            return sim.run(start, stop)

        with pytest.raises(KeyboardInterrupt):
            scheduler.run(200, failing, cost=(8 * MiB, MiB))
        assert len(sim.fractions) == 2 and sim.fraction == 1.0


def test_one_index_above_the_cap_runs_uncapped_with_a_warning():
    """One index that does not fit under the cap runs as it would without one.

    (The bound understated it.) It runs above the budget and is warned of.
    """
    sim = CappedCudnn(per_index=300 * MiB)
    with pytest.MonkeyPatch.context() as monkeypatch:
        sim.install(monkeypatch)
        scheduler = ChunkScheduler(max_memory="200MiB", device="cuda")
        with pytest.warns(MemoryBudgetWarning, match="above the 200.0 MiB budget"):
            total, report = scheduler.run(3, sim.run, cost=(8 * MiB, MiB))
        assert total.item() == 3
        assert [c.stop - c.start for c in report.chunks] == [1, 1, 1]
        assert report.uncapped_passes == 3 and report.out_of_memory_splits == 0
        assert sim.fraction == 1.0


def test_caps_of_calls_in_several_threads_end_in_any_order():
    """The loosest open cap applies; the user's fraction comes back after the last."""
    from ggnchunk._memory import backends

    sim = CappedCudnn()
    with pytest.MonkeyPatch.context() as monkeypatch:
        sim.install(monkeypatch)
        sim.fraction = 0.5  # the user's own
        device = CudaMemory(torch.device("cuda"))
        wide, tight = device.capped(20 * 2**30), device.capped(10 * 2**30)
        wide.__enter__()
        assert sim.fraction == pytest.approx(0.2)
        tight.__enter__()
        assert sim.fraction == pytest.approx(0.2)  # not the tighter one
        wide.__exit__(None, None, None)  # the first call ends first
        assert sim.fraction == pytest.approx(0.1)
        tight.__exit__(None, None, None)
        assert sim.fraction == 0.5
        assert backends._CAPS == {} and backends._USER_FRACTION == {}


def test_a_call_under_another_calls_tighter_cap_does_not_run_out_of_memory():
    """Two budgeted calls at once (two threads): neither fails where it would uncapped.

    One index of the second call needs 1.5 GiB; the first call's cap alone would allow
    1 GiB. The loosest open cap applies, and a pass with its cap lifted runs under none.
    """
    sim = CappedCudnn(per_index=1536 * MiB, wish=0, small=0)
    with pytest.MonkeyPatch.context() as monkeypatch:
        sim.install(monkeypatch)
        other = CudaMemory(torch.device("cuda")).capped(2**30)
        other.__enter__()  # another thread's call, open throughout
        try:
            for budget in ("4GiB", "1200MiB"):  # looser than the other's, and tighter
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", MemoryBudgetWarning)
                    total, _ = ChunkScheduler(max_memory=budget, device="cuda").run(
                        3, sim.run, cost=(8 * MiB, MiB)
                    )
                assert total.item() == 3
                assert sim.fraction == pytest.approx(2**30 / sim.total)
        finally:
            other.__exit__(None, None, None)
        assert sim.fraction == 1.0


class JumpingOwnBytes(CappedCudnn):
    """Above ``jump`` indices a pass's own bytes are 8x (another kernel's buffers)."""

    def run(self, start, stop):
        if stop - start > self.jump:
            self.per_index, per_index = 8 * self.per_index, self.per_index
            try:
                return super().run(start, stop)
            finally:
                self.per_index = per_index
        return super().run(start, stop)


def test_without_recovery_a_capped_pass_runs_again_uncapped_not_split():
    """``recover_oom=False`` keeps its meaning under a cap: no chunk is split.

    A chunk that runs out of memory under the cap runs again without it, as it would
    have run without a cap, and its overshoot is warned of and shrinks the rest.
    """
    sim = JumpingOwnBytes(per_index=MiB, jump=16, wish=0, small=0)
    with pytest.MonkeyPatch.context() as monkeypatch:
        sim.install(monkeypatch)
        scheduler = ChunkScheduler(max_memory="200MiB", device="cuda", recover_oom=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            total, report = scheduler.run(300, sim.run, cost=(8 * MiB, MiB))
    assert total.item() == sum(range(300))
    assert report.out_of_memory_splits == 0 and report.uncapped_passes >= 1
    assert not [w for w in caught if w.category is OutOfMemoryRecoveryWarning]
    assert [w for w in caught if w.category is MemoryBudgetWarning]
    assert max(c.stop - c.start for c in report.chunks) > sim.jump  # ran, uncapped
    assert sim.fraction == 1.0


def test_an_interrupt_while_the_cap_is_set_up_or_lifted_leaves_nothing_capped():
    from ggnchunk._memory import backends

    sim = CappedCudnn()
    with pytest.MonkeyPatch.context() as monkeypatch:
        sim.install(monkeypatch)
        sim.cached = 8 * 2**30  # the cap empties the cache first

        def interrupted():
            raise KeyboardInterrupt

        monkeypatch.setattr(torch.cuda, "empty_cache", interrupted)
        with (
            pytest.raises(KeyboardInterrupt),
            CudaMemory(torch.device("cuda")).capped(2**30),
        ):
            pass
        assert sim.fraction == 1.0
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        sim.cached = 0
        device = CudaMemory(torch.device("cuda"))
        with pytest.raises(KeyboardInterrupt), device.capped(2**30) as cap, cap.lifted():
            assert sim.fraction == 1.0
            raise KeyboardInterrupt
        assert sim.fraction == 1.0
        assert backends._CAPS == {} and backends._USER_FRACTION == {}
