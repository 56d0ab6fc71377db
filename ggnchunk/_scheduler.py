"""Chunk scheduling: split an index range ``[0, total)`` into chunks and run them.

Generic: nothing here knows about GGNs. :func:`plan_chunks` makes fixed plans (lists of
``(start, stop)`` pairs that partition ``[0, total)`` in order); :class:`ChunkScheduler`
runs a computation over such chunks, choosing their size from a memory budget or by
timing, and recovers from out-of-memory errors.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from ggnchunk._checks import check_positive_int, user_stacklevel
from ggnchunk._memory import MiB, PeakTracker, format_bytes, free_memory, parse_memory

__all__ = [
    "ChunkRecord",
    "ChunkScheduler",
    "MemoryBudgetError",
    "MemoryBudgetWarning",
    "OutOfMemoryRecoveryWarning",
    "Plan",
    "ScheduleReport",
    "check_chunking",
    "clear_autotune_cache",
    "is_out_of_memory",
    "plan_chunks",
    "planning_share",
]

Plan = list[tuple[int, int]]


def plan_chunks(
    total: int,
    num_chunks: int | None = None,
    chunk_size: int | None = None,
    what: str = "columns",
) -> Plan:
    """Split ``[0, total)`` into contiguous, non-empty chunks.

    Both options are clamped to ``total``, so that one setting works for problems of
    every size: more chunks than indices means one index per chunk, and a chunk size
    larger than ``total`` means one chunk.

    Args:
        total: Size of the index range, at least 1.
        num_chunks: Number of chunks, at least 1; ``min(num_chunks, total)`` chunks are
            made, whose sizes differ by at most one (the first ``total % num_chunks`` are
            one larger).
        chunk_size: Largest chunk, at least 1 (clamped to ``total``); only the last chunk
            may be smaller. At most one of ``num_chunks`` and ``chunk_size`` may be
            given; with neither, one chunk covers everything.
        what: What the indices count, for error messages.

    Returns:
        ``[(start, stop), ...]`` covering ``[0, total)`` in order, every chunk non-empty.

    Raises:
        TypeError: If ``total``, ``num_chunks`` or ``chunk_size`` is not an int.
        ValueError: If one of them is not positive, or both options are given.

    Examples:
        >>> plan_chunks(10, num_chunks=3)
        [(0, 4), (4, 7), (7, 10)]
        >>> plan_chunks(10, chunk_size=4)
        [(0, 4), (4, 8), (8, 10)]
        >>> plan_chunks(2, num_chunks=8)  # clamped: one index per chunk
        [(0, 1), (1, 2)]
        >>> plan_chunks(3, chunk_size=100)  # clamped: one chunk
        [(0, 3)]
    """
    total = check_positive_int(total, f"the number of {what} (total)")
    if num_chunks is not None and chunk_size is not None:
        raise ValueError("pass only one of num_chunks and chunk_size.")
    if num_chunks is not None:
        num_chunks = min(check_positive_int(num_chunks, "num_chunks"), total)
        base, extra = divmod(total, num_chunks)
        sizes = [base + 1] * extra + [base] * (num_chunks - extra)
    elif chunk_size is not None:
        chunk_size = min(check_positive_int(chunk_size, "chunk_size"), total)
        sizes = [chunk_size] * (total // chunk_size)
        if total % chunk_size:
            sizes.append(total % chunk_size)
    else:
        sizes = [total]
    plan, start = [], 0
    for size in sizes:
        plan.append((start, start + size))
        start += size
    return plan


# -- the scheduler ----------------------------------------------------------------------

# Aim below the budget. On CUDA the allocator's statistics are exact; on the CPU the
# resident set size also holds what glibc keeps of freed blocks (fragmentation), which
# grows with allocation history: a first large pass measured up to 1.5x its live sizes.
# 0.85 on the CPU: the budget tests (fresh processes, default allocator, first call, warm
# and after a one-pass call) hold with it; the bounds themselves carry their own margin.
_SAFETY = {"cuda": 0.92, "cpu": 0.85}
_TRIAL_SHARE = 0.5  # auto mode spends at most this share of the range on timing trials
_TIE = 0.05  # auto mode: rates within 5% of the fastest count as equal (the larger wins)
# (timings of single chunks on a busy machine vary by 10-20%; a size that looks slower
# is timed up to three times before it is believed)
_CACHE_BYTES = 16 * MiB  # auto mode's first size: a chunk whose bound is about this


def planning_share(device: torch.device) -> float:
    """Share of a budget that plans aim at on ``device`` (the rest is a safety margin).

    Args:
        device: Where the work runs.

    Returns:
        A number in ``(0, 1]``.
    """
    return _SAFETY.get(device.type, _SAFETY["cpu"])


def passes_within(
    budget: int, device: torch.device, level: int, fixed: int, per_index: int, total: int
) -> float:
    """Passes budget mode plans for ``total`` indices with this cost; ``inf`` if none fit.

    Args:
        budget: The budget in bytes.
        device: Where the work runs (its safety margin applies).
        level: Bytes already in use above the call's baseline.
        fixed: Bytes a pass needs whatever its size.
        per_index: Bytes per index of a pass.
        total: Number of indices.

    Returns:
        The number of passes, or ``math.inf``.
    """
    if level + fixed + per_index > budget:
        return math.inf
    room = planning_share(device) * budget - level - fixed
    size = max(1, min(total, int(room // max(per_index, 1))))
    return math.ceil(total / size)


class MemoryBudgetError(MemoryError):
    """The smallest chunk (one index) does not fit the memory budget."""


class MemoryBudgetWarning(UserWarning):
    """A chunk's measured peak memory went above the budget; later chunks were shrunk."""


class OutOfMemoryRecoveryWarning(UserWarning):
    """A chunk ran out of memory and was split; the result is still exact."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure (CUDA or the CPU allocator).

    Args:
        error: The exception.

    Returns:
        ``True`` for ``torch.OutOfMemoryError`` and the CPU allocator's failures.
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, (RuntimeError, MemoryError)) and (
        "can't allocate memory" in text or "not enough memory" in text
        or isinstance(error, MemoryError)
    )  # fmt: skip


@dataclass
class ChunkRecord:
    """One completed chunk: its range, seconds and peak extra bytes (if measured)."""

    start: int
    stop: int
    seconds: float
    peak_extra_bytes: int | None = None
    level_before_bytes: int | None = None  # memory in use (above baseline) just before


@dataclass
class ScheduleReport:
    """What a :class:`ChunkScheduler` did.

    Attributes:
        total: Size of the index range.
        mode: ``"fixed"``, ``"budget"`` or ``"auto"``.
        chunk_size: The chunk size used for the bulk of the range.
        budget_bytes: The memory budget, if any.
        chunks: Every completed chunk, in order.
        out_of_memory_splits: How many chunks were split after running out of memory.
        fixed_bytes: Fitted memory of the computation at zero chunk size (budget modes).
        bytes_per_index: Fitted memory per index of a chunk (budget modes).
        from_cache: Whether the decision came from the autotune cache.
    """

    total: int
    mode: str
    chunk_size: int
    budget_bytes: int | None = None
    chunks: list[ChunkRecord] = field(default_factory=list)
    out_of_memory_splits: int = 0
    fixed_bytes: float | None = None
    bytes_per_index: float | None = None
    from_cache: bool = False

    @property
    def peak_extra_bytes(self) -> int | None:
        """Largest measured peak extra memory over all chunks."""
        peaks = [c.peak_extra_bytes for c in self.chunks if c.peak_extra_bytes is not None]
        return max(peaks) if peaks else None

    def __repr__(self) -> str:
        """A one-line summary, not every chunk record (those are in ``chunks``)."""
        peak = self.peak_extra_bytes
        budget = self.budget_bytes
        return (
            f"ScheduleReport(mode={self.mode!r}, total={self.total}, "
            f"passes={len(self.chunks)}, chunk_size={self.chunk_size}, "
            f"peak={'not measured' if peak is None else f'{peak / 2**20:.1f} MiB'}, "
            f"budget={'none' if budget is None else f'{budget / 2**20:.1f} MiB'}, "
            f"oom_splits={self.out_of_memory_splits})"
        )

    @property
    def seconds(self) -> float:
        """Seconds spent in chunks."""
        return sum(c.seconds for c in self.chunks)


@dataclass
class _Decision:
    fixed: float
    per_index: float
    chunk_size: int | None = None  # where the last call ended
    tuned: bool = False  # auto mode chose a size below the budget's limit: do not grow


_CACHE: dict[Hashable, _Decision] = {}


def clear_autotune_cache() -> None:
    """Forget the chunk sizes and memory fits remembered from earlier calls."""
    _CACHE.clear()


class ChunkScheduler:
    """Run ``fn(start, stop)`` over chunks that partition ``[0, total)``.

    Generic: ``fn`` may compute anything that is a sum over an index range (GGN columns,
    per-sample gradients, Jacobian rows); it either accumulates itself and returns
    ``None``, or returns a tensor (or list/tuple/dict of tensors) that the scheduler adds
    up. Three modes:

    * **fixed** (``num_chunks`` or an int ``chunk_size``): the plan of :func:`plan_chunks`
      (both clamped to ``total``).
    * **budget** (``max_memory``): the chunk size is chosen so that the peak memory above
      ``baseline`` stays within the budget. The memory of a chunk of size ``s`` is modelled
      as ``fixed + per_index * s``; the first chunk (one index) and a second chunk sized
      conservatively from it are measured to fit the model, and every later chunk is
      measured too, shrinking the size if one overshoots. If one index does not fit, a
      :class:`MemoryBudgetError` says how much it needs.
    * **auto** (``chunk_size="auto"``): within the budget (``max_memory``, or else 90% of
      the free device memory), the budget's chunk size and smaller ones are timed on real
      chunks (nothing is computed twice) and the fastest per index is used for the rest.
      Problems that budget mode runs in fewer than 20 passes are not tuned (a trial would
      cost more than it can save), so auto mode is never much slower than budget mode.
      The decision is cached under ``cache_key`` for later calls, as cuDNN's benchmark
      mode does.

    Every mode works for every ``total >= 1``: ``fn`` is only called with
    ``0 <= start < stop <= total``, and every index is covered exactly once, in order.

    In every mode a chunk that runs out of memory is split in halves and retried (chunks
    already done are kept); a single index that runs out of memory raises. ``fn`` must
    leave no partial contribution behind when it raises.

    Args:
        num_chunks: Fixed number of chunks.
        chunk_size: Fixed largest chunk size, or ``"auto"``.
        max_memory: Budget for the peak memory above ``baseline``: bytes or a string such
            as ``"2GiB"``.
        device: Device whose memory is budgeted and measured.
        recover_oom: Split chunks that run out of memory instead of raising; ``True``
            or ``False``.
        cache_key: Hashable key under which budget/auto decisions are remembered.
        what: What the indices count, for messages.
        tracker: What measures memory: an object with ``current() -> bytes`` and
            ``measure(fn) -> (result, peak bytes, seconds)``; by default a
            :class:`~ggnchunk._memory.PeakTracker` of ``device``. Tests pass a simulated
            one.

    Examples:
        Squared norms of per-sample gradients, summed over a large batch in chunks that
        fit 64 MiB, a computation that has nothing to do with the GGN:

        >>> import torch
        >>> from ggnchunk import ChunkScheduler
        >>> model = torch.nn.Linear(100, 10)
        >>> X, y = torch.randn(1000, 100), torch.randn(1000, 10)
        >>> params = dict(model.named_parameters())
        >>> def loss(p, x, t):
        ...     out = torch.func.functional_call(model, p, (x[None],))
        ...     return ((out - t[None]) ** 2).sum()
        >>> per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
        >>> def chunk(start, stop):
        ...     grads = per_sample(params, X[start:stop], y[start:stop])
        ...     return sum(g.pow(2).flatten(1).sum(1).sum() for g in grads.values())
        >>> total, report = ChunkScheduler(max_memory="64MiB").run(1000, chunk)
        >>> report.mode, total.shape
        ('budget', torch.Size([]))
    """

    def __init__(
        self,
        *,
        num_chunks: int | None = None,
        chunk_size: int | str | None = None,
        max_memory: int | str | None = None,
        device: str | torch.device = "cpu",
        recover_oom: bool = True,
        cache_key: Hashable | None = None,
        what: str = "indices",
        tracker: Any = None,
    ):
        check_chunking(num_chunks, chunk_size, max_memory)
        if not isinstance(recover_oom, bool):
            raise TypeError(
                f"recover_oom must be a bool, got {type(recover_oom).__name__} "
                f"{recover_oom!r}; pass True (split chunks that run out of memory) or "
                "False (let the out-of-memory error through)."
            )
        self.num_chunks = num_chunks
        self.chunk_size = chunk_size
        self.budget = None if max_memory is None else parse_memory(max_memory)
        self.device = torch.device(device)
        self.recover_oom = recover_oom
        self.cache_key = cache_key
        self.what = what
        self.tracker = tracker
        if chunk_size == "auto":
            self.mode = "auto"
        elif self.budget is not None:
            self.mode = "budget"
        else:
            self.mode = "fixed"

    def run(
        self,
        total: int,
        fn: Callable[[int, int], Any],
        baseline: int | None = None,
        cost: tuple[float, float] | Callable[[], tuple[float, float]] | None = None,
    ) -> tuple[Any, ScheduleReport]:
        """Run ``fn`` over chunks of ``[0, total)``.

        Args:
            total: Size of the index range.
            fn: ``fn(start, stop)``; its non-``None`` results are added up.
            baseline: Memory in use before the computation began (the budget counts
                from here); defaults to the memory in use now.
            cost: A known upper bound on the memory of a chunk of ``s`` indices,
                ``(fixed_bytes, bytes_per_index)``, counted from the memory in use now.
                With it, budget and auto modes plan from the bound instead of probing
                (a measured chunk above the budget still shrinks the size) and never
                grow past it on the CPU, where the resident set size cannot see memory
                that the allocator reuses. A callable is asked again after the first
                index ran, counted from the memory in use then (so what the first pass
                built and keeps is not counted twice).

        Returns:
            ``(sum of fn's results or None, report)``.

        Raises:
            MemoryBudgetError: If one index does not fit the budget.
            TypeError: If ``total`` is not an int.
            ValueError: If ``total`` is not positive.
        """
        total = check_positive_int(total, "total")
        tracker = None
        if self.mode != "fixed":
            tracker = self.tracker if self.tracker is not None else PeakTracker(self.device)
        if tracker is not None and baseline is None:
            baseline = tracker.current()
        state = _Run(self, total, fn, tracker, baseline or 0)
        state.cost = cost
        if self.mode == "fixed":
            plan = plan_chunks(total, self.num_chunks, self.chunk_size, what=self.what)
            state.report.chunk_size = max(b - a for a, b in plan)
            for start, stop in plan:
                state.run_range(start, stop)
            state.warn_if_recovered()
        else:
            state.run_adaptive()
        return state.result, state.report


def check_chunking(num_chunks: object, chunk_size: object, max_memory: object) -> None:
    """Check that the chunking arguments are consistent (before any work).

    Args:
        num_chunks: The user's ``num_chunks``.
        chunk_size: The user's ``chunk_size`` (an int or ``"auto"``).
        max_memory: The user's ``max_memory``.

    Raises:
        ValueError: For conflicting or out-of-range values.
        TypeError: For values of the wrong type.
    """
    if chunk_size == "auto":
        if num_chunks is not None:
            raise ValueError(
                f"num_chunks={num_chunks!r} and chunk_size='auto' were both given; "
                "'auto' chooses the chunking itself. Pass only one of them."
            )
    elif isinstance(chunk_size, str):
        raise ValueError(
            f"chunk_size={chunk_size!r} is not understood; pass a positive int or 'auto'."
        )
    else:
        if num_chunks is not None and chunk_size is not None:
            raise ValueError(
                f"num_chunks={num_chunks!r} and chunk_size={chunk_size!r} were both given; "
                "they say the same thing two ways. Pass only one of them."
            )
        if num_chunks is not None:
            check_positive_int(num_chunks, "num_chunks", " Use num_chunks=1 for one pass.")
        if chunk_size is not None:
            check_positive_int(chunk_size, "chunk_size")
        if max_memory is not None and (num_chunks is not None or chunk_size is not None):
            raise ValueError(
                "max_memory was given together with a fixed chunking "
                f"(num_chunks={num_chunks!r}, chunk_size={chunk_size!r}); the budget "
                "chooses the chunk size. Pass max_memory alone, or with chunk_size='auto' "
                "to also tune for speed."
            )
    if max_memory is not None:
        parse_memory(max_memory)


def _add(total: Any, value: Any) -> Any:
    if value is None:
        return total
    if total is None:
        return value
    if isinstance(value, dict):
        return {k: _add(total[k], v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_add(a, b) for a, b in zip(total, value, strict=True))
    return total + value


class _Run:
    """State of one :meth:`ChunkScheduler.run`."""

    def __init__(self, scheduler, total, fn, tracker, baseline):
        self.s = scheduler
        self.total = total
        self.fn = fn
        self.tracker = tracker
        self.baseline = baseline
        self.result = None
        self.report = ScheduleReport(
            total=total, mode=scheduler.mode, chunk_size=0, budget_bytes=scheduler.budget
        )
        self.largest_failed: int | None = None
        self.cost: tuple[float, float] | Callable[[], tuple[float, float]] | None = None
        self.overshoot_warned = False
        self._safety = _SAFETY.get(scheduler.device.type, _SAFETY["cpu"])
        self.budget = 0  # bytes (budget and auto modes)
        self.ceiling = total  # no chunk above this size (a size that overshot)
        self.one: int | None = None  # the probe's peak of one index (no bound known)
        self.first_level = 0  # memory in use above the baseline when planning began

    # one chunk, with out-of-memory recovery ------------------------------------------
    def _once(self, start: int, stop: int) -> ChunkRecord:
        if self.tracker is None:
            begin = time.perf_counter()
            value = self.fn(start, stop)
            record = ChunkRecord(start, stop, time.perf_counter() - begin)
        else:
            level = max(0, self.tracker.current() - self.baseline)
            if self.budget and level > self.first_level:
                # above the level planning began from: on the CPU, mostly blocks the C
                # heap kept after earlier passes freed them (resident, counted by the
                # budget, not in use); give them back before the pass, which would
                # otherwise peak on top of them (ResNet-18's level climbed from 47 to
                # 85 MiB over five passes under an 80 MiB budget, issue 21)
                settled = getattr(self.tracker, "settled", None)  # user trackers
                if settled is not None:
                    level = max(0, settled() - self.baseline)
            value, peak, seconds = self.tracker.measure(lambda: self.fn(start, stop))
            record = ChunkRecord(start, stop, seconds, max(0, peak - self.baseline), level)
        self.result = _add(self.result, value)
        self.report.chunks.append(record)
        return record

    def run_range(self, start: int, stop: int) -> list[ChunkRecord]:
        """Run ``[start, stop)``, splitting it in halves on out-of-memory errors."""
        pending, done = [(start, stop)], []
        while pending:
            a, b = pending.pop(0)
            failed = False
            try:
                done.append(self._once(a, b))
            except BaseException as error:
                if not (self.s.recover_oom and is_out_of_memory(error)) or b - a == 1:
                    raise
                failed = True
            if failed:  # outside the except block: the failed pass's tensors are freed
                if self.s.device.type == "cuda":
                    torch.cuda.empty_cache()
                self._note_failure(b - a)
                middle = (a + b) // 2
                pending[:0] = [(a, middle), (middle, b)]
        return done

    def _note_failure(self, size: int) -> None:
        self.report.out_of_memory_splits += 1
        if self.largest_failed is None:
            self.largest_failed = size
        self.largest_failed = max(self.largest_failed, size)

    def warn_if_recovered(self) -> None:
        if self.report.out_of_memory_splits:
            worked = max(c.stop - c.start for c in self.report.chunks)
            warnings.warn(
                f"ggnchunk: a chunk of {self.largest_failed} {self.s.what} ran out of "
                f"memory and was split ({self.report.out_of_memory_splits} split(s)); "
                f"the rest ran with chunks of at most {worked} {self.s.what}. The result "
                f"is exact. Pass chunk_size={worked} (or max_memory) to avoid the retries.",
                OutOfMemoryRecoveryWarning,
                stacklevel=user_stacklevel(),
            )

    # budget and auto modes -----------------------------------------------------------
    def _budget(self) -> int:
        if self.s.budget is not None:
            return self.s.budget
        return int(
            0.9 * (free_memory(self.s.device) + self.tracker.current() - self.baseline)
        )

    def _fit_size(self, decision: _Decision, budget: int) -> int:
        room = self._safety * budget - decision.fixed
        return max(1, min(self.total, int(room // max(decision.per_index, 1.0))))

    def run_adaptive(self) -> None:
        """Budget and auto modes: plan (from the bound, or probe), tune, then adapt.

        Every chunk is measured and checked against the budget (:meth:`_next_size`):
        one above the planning target shrinks the size for the rest (and warns when it
        went above the budget itself); without a known bound, sizes grow geometrically
        from measured chunks (at most twice the largest measured size at a time, less
        where the measured growth per index says the target is nearer), so that a
        measurement that sees nothing (memory the allocator reuses, a page-sized
        resolution) never licenses an unbounded chunk.
        """
        budget = self._budget()
        self.budget = budget
        self.first_level = max(0, self.tracker.current() - self.baseline)
        self.report.budget_bytes = budget
        key = self.s.cache_key
        cache_key = None if key is None else (key, self.s.mode, budget, self.total)
        cached = _CACHE.get(cache_key) if cache_key is not None else None
        start, grow = 0, True
        if self.cost is not None:
            self._from_cost(budget)  # one index must fit: checked before any work
            if self.total > 1:
                # the first chunk of a call can leave one-time set-up behind (kernels
                # and libraries loaded on first use): one index, then plan from after it
                start = self.run_range(0, 1)[-1].stop
            decision = self._from_cost(budget, check=False)
            size = self._fit_size(decision, budget)
            if self.s.device.type != "cuda":  # exact allocator statistics only: on
                self.ceiling = size  # the CPU, never past the bound's size
        elif cached is None:
            decision, start = self._probe(budget)
            size = min(self.total, 2)  # then geometric growth from measured chunks
        else:
            decision = cached
            self.report.from_cache = True
            size = decision.chunk_size or self._fit_size(decision, budget)
            grow = not decision.tuned
        if self.s.mode == "auto" and start < self.total:
            if cached is not None and cached.tuned and cached.chunk_size:
                self.report.from_cache = True
                size, grow, decision.tuned = min(size, cached.chunk_size), False, True
            else:
                start, size, tuned = self._tune(start, size, decision, grow)
                decision.tuned = tuned
                grow = grow and not tuned
        while start < self.total:
            stop = min(self.total, start + size)
            records = self.run_range(start, stop)
            start = stop
            size = self._next_size(records, size, grow)
        target = self._safety * budget
        decision.chunk_size = size
        decision.per_index = max(1.0, (target - decision.fixed) / max(size, 1))
        if cache_key is not None:
            _CACHE[cache_key] = decision
        self.report.fixed_bytes = decision.fixed
        self.report.bytes_per_index = decision.per_index
        self.report.chunk_size = _bulk_size(self.report.chunks)
        self.warn_if_recovered()

    def _next_size(self, records: list[ChunkRecord], size: int, grow: bool) -> int:
        """The next chunk size after ``records`` (one planned chunk, or its OOM parts).

        Shrinks after a chunk above the planning target (warning once if it went above
        the budget), and with ``grow`` grows toward the target: twice the chunk at most,
        less where the growth measured between one index and this chunk predicts the
        target sooner. Never above the ceiling (the bound's size, or a size that
        overshot) nor the range.
        """
        budget, target = self.budget, self._safety * self.budget
        if len(records) > 1:  # split after running out of memory: stay below that
            size = min(size, max(r.stop - r.start for r in records))
        largest = max(records, key=lambda r: r.stop - r.start)
        done, peak = largest.stop - largest.start, largest.peak_extra_bytes
        if peak is None:
            return size
        level = largest.level_before_bytes or 0
        # what stays resident whatever the chunk size (a lower bound, so growth stays
        # safe: a chunk twice as large adds at most twice as much above it)
        floor = min(self.first_level, level)
        own = peak - level
        if peak > target and done > 1 and own > 0.05 * target:  # overshoot: shrink
            size = max(1, int(done * max(target - floor, 0) / max(peak - floor, 1)))
            size = min(size, done - 1)
            self.ceiling = min(self.ceiling, size)
            if peak > budget:  # above the safety target only: shrink quietly
                self._warn_overshoot(peak, budget, size)
        elif peak > budget and done == 1:  # nothing left to shrink: say so
            self._warn_overshoot(peak, budget, 1)
        elif grow and done >= size and len(records) == 1 and peak <= target:
            grown = 2 * done
            if self.one is not None and done > 1 and peak > self.one:
                # the growth per index measured from one index to this chunk
                slope = (peak - self.one) / (done - 1)
                grown = min(grown, int(done + (target - peak) / slope + 1e-9))
            elif self.one is None and peak > floor:
                grown = min(grown, int(done * (target - floor) / (peak - floor)))
            size = max(size, grown)
        return max(1, min(self.total, self.ceiling, size))

    def _from_cost(self, budget: int, check: bool = True) -> _Decision:
        """The plan from the known bound; a budget below one index raises first.

        With ``check`` false (the re-plan after the first index ran, which fitted), the
        size is clamped to one index instead: the work done is not thrown away.
        """
        fixed_bound, per_index = self.cost() if callable(self.cost) else self.cost
        settled = getattr(self.tracker, "settled", self.tracker.current)  # user trackers
        level = max(0, settled() - self.baseline)
        fixed = level + fixed_bound
        if check and fixed + per_index > budget:
            raise MemoryBudgetError(
                f"max_memory is {format_bytes(budget)}, but a chunk of 1 of the "
                f"{self.s.what} needs up to {format_bytes(fixed + per_index)} above "
                f"the memory in use before the call ({format_bytes(level)} of it already "
                f"in use after the forward pass, {format_bytes(per_index)} per "
                f"{self.s.what[:-1] if self.s.what.endswith('s') else self.s.what}). "
                "Raise max_memory, or make the problem smaller (e.g. batch_chunk_size "
                "for fewer samples per forward pass)."
            )
        self.first_level = level
        return _Decision(fixed, per_index)

    def _warn_overshoot(self, peak: int, budget: int, size: int) -> None:
        if self.overshoot_warned:
            return
        self.overshoot_warned = True
        warnings.warn(
            f"ggnchunk: a chunk peaked at {format_bytes(peak)}, above the "
            f"{format_bytes(budget)} budget; the remaining chunks use at most {size} "
            f"{self.s.what}. The result is exact."
            + (
                " A chunk of 1 cannot shrink further: raise max_memory, or pass "
                "batch_chunk_size for fewer samples per forward pass."
                if size == 1
                else ""
            ),
            MemoryBudgetWarning,
            stacklevel=user_stacklevel(),
        )

    def _probe(self, budget: int) -> tuple[_Decision, int]:
        """Measure one index, twice (where the range has three): its peak is the start.

        The first chunk of a call can pay one-time costs (kernels set up and workspaces
        allocated on first use); a second one-index chunk shows the steady state, and the
        smaller of the two peaks is the cost of one index. Nothing is extrapolated from
        it: a reading of zero (memory the allocator reused) would license any size.
        Larger chunks then grow geometrically from measured ones (:meth:`_next_size`).

        Returns:
            A first decision (the level before, and the one index's growth above it as
            the cost per index) and the first index not yet computed.
        """
        before = max(0, self.tracker.current() - self.baseline)
        rss_before = self.tracker.current()
        (first,) = self.run_range(0, 1)
        if self.s.device.type == "cpu":
            # Memory the first chunk leaves behind is one-time set-up (kernels, libraries
            # loaded lazily on first use), not a cost of the chunk: count from after it.
            retained = max(0, self.tracker.current() - rss_before)
            if retained:
                self.baseline += retained
                first.peak_extra_bytes = max(0, first.peak_extra_bytes - retained)
        one, start = first.peak_extra_bytes, 1
        if self.total >= 3:
            (again,) = self.run_range(1, 2)
            one, start = min(one, again.peak_extra_bytes), 2
        if one > budget:
            raise MemoryBudgetError(
                f"max_memory is {format_bytes(budget)}, but a chunk of 1 of the "
                f"{self.s.what} already needs {format_bytes(one)} "
                f"above the memory in use before the call ({format_bytes(before)} of it "
                "before the first chunk). Raise max_memory, or make the problem smaller "
                "(e.g. batch_chunk_size for fewer samples per forward pass)."
            )
        self.one, self.first_level = one, before
        return _Decision(before, max(one - before, 1)), start

    def _tune(
        self, start: int, size_max: int, decision: _Decision, grow: bool
    ) -> tuple[int, int, bool]:
        """Time real chunks on a grid of sizes; return (next start, chosen size, tuned).

        Starts at a cache-friendly size (a chunk whose bound is about ``_CACHE_BYTES``;
        2 indices where no bound is known, after the probe), not the largest that
        fits: time per index is U-shaped in the chunk size (fixed costs per pass on the
        left, memory traffic on the right), and the largest chunks are often slower.
        The size then doubles while a chunk is not clearly slower per index than the
        best so far (a size that looks slower is timed up to three times before it is
        believed: the first chunks of a size pay fresh pages while the allocator adapts), up
        to what the memory allows (every trial is checked like any chunk); where the
        first doubling was slower, the size halves instead while that is faster. The
        largest size within ``_TIE`` of the fastest rate is chosen (fewer passes for
        equal speed). The trials are real work (nothing is computed twice) and stay
        within ``_TRIAL_SHARE`` of the range. ``tuned`` is false when the memory, not
        the time, stopped the search (budget mode's growth may go on).
        """
        remaining = self.total - start
        allowance = int(_TRIAL_SHARE * remaining)
        if self.cost is not None:
            first = _CACHE_BYTES // max(int(decision.per_index), 1)
            size = max(1, min(size_max, 1 << max(0, first.bit_length() - 1)))
        else:
            size = max(1, min(size_max, 2))
        limit = size_max if self.cost is not None else self.total
        if remaining <= 2 * size:  # too small to compare sizes
            return start, size, False
        tried: dict[int, float] = {}
        state = {"start": start, "used": 0, "allowed": limit}

        def timed(size: int) -> float | None:
            """Run one chunk of ``size`` (if the allowance has room): seconds per index."""
            if state["start"] >= self.total or state["used"] + size > allowance:
                return None
            first = state["start"]
            records = self.run_range(first, min(self.total, first + size))
            sizes = [r.stop - r.start for r in records]
            state["start"], state["used"] = records[-1].stop, state["used"] + sum(sizes)
            state["allowed"] = self._next_size(records, max(sizes), grow=True)
            rate = sum(r.seconds for r in records) / sum(sizes)
            done = max(sizes)
            tried[done] = min(rate, tried.get(done, float("inf")))
            return tried[done] if done == size else None

        def better(size: int) -> bool | None:
            """Time ``size`` (twice if it looks slower): is it not clearly slower?

            ``None`` where the allowance or the range had no room for it.
            """
            rate = timed(size)
            for _ in range(2):  # the first two chunks of a larger size pay fresh pages
                # (glibc serves the first from mmap, raises its threshold when freeing
                # it, then grows the heap for the second; the third reuses the heap)
                if rate is None or rate <= (1.0 + _TIE) * min(tried.values()):
                    break
                rate = timed(size) or rate
            if rate is None:
                return None
            return rate <= (1.0 + _TIE) * min(tried.values())

        if timed(size) is None:
            return state["start"], size, False
        base, verdict, going_up = size, None, False
        while True:
            nxt = min(2 * size, limit, state["allowed"])
            if nxt <= size:
                verdict = None  # the memory stopped the search
                break
            verdict = better(nxt)
            if not verdict:
                break
            size, going_up = nxt, True
        if verdict is None:  # larger sizes were no slower until the memory or the
            # allowance stopped the search: go on growing as budget mode does
            return state["start"], max(size, min(nxt, state["allowed"])), False
        if not going_up:
            size = base
            while size > 1 and better(size // 2):
                size //= 2
        fastest = min(tried.values())
        best = max(s for s, rate in tried.items() if rate <= (1.0 + _TIE) * fastest)
        return state["start"], min(best, state["allowed"]), True


def _bulk_size(chunks: list[ChunkRecord]) -> int:
    """The chunk size that covered the most indices (ties: the larger)."""
    covered: dict[int, int] = {}
    for c in chunks:
        covered[c.stop - c.start] = covered.get(c.stop - c.start, 0) + c.stop - c.start
    return max(covered, key=lambda s: (covered[s], s)) if covered else 0
