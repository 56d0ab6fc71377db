"""The chunk scheduler: one object that runs a computation over chunks of an index range.

Generic: nothing here knows about GGNs. It ties together the parts of
:mod:`ggnchunk._scheduling`: fixed plans (:mod:`~ggnchunk._scheduling.plan`), execution
with out-of-memory splitting (:mod:`~ggnchunk._scheduling.execute`), the budget model
(:mod:`~ggnchunk._scheduling.budget`) and auto mode's timing trials and cache
(:mod:`~ggnchunk._scheduling.autotune`); memory is measured by the device's backend
(:mod:`ggnchunk._memory.backends`).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Hashable
from typing import Any

import torch

from ggnchunk._checks import check_positive_int
from ggnchunk._memory import MemoryBackend, memory_backend, parse_memory
from ggnchunk._memory.backends import _BACKENDS
from ggnchunk._scheduling.autotune import CACHE, tune
from ggnchunk._scheduling.budget import BudgetPlanner, Cost, Decision
from ggnchunk._scheduling.execute import Executor, ScheduleReport
from ggnchunk._scheduling.plan import bulk_size, check_chunking, plan_chunks

__all__ = ["ChunkScheduler", "Mode"]


class Mode(str, enum.Enum):
    """How a :class:`ChunkScheduler` chooses its chunks (compares equal to its value)."""

    FIXED = "fixed"
    BUDGET = "budget"
    AUTO = "auto"

    def __str__(self) -> str:
        return self.value


def _needs(mode: Mode) -> str:
    return "chunk_size='auto'" if mode is Mode.AUTO else "max_memory"


def _known_backend(device: torch.device) -> type[MemoryBackend] | None:
    return _BACKENDS.get(device.type)


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
      the free device memory), real chunks (nothing is computed twice) are timed on a
      grid of sizes, from a cache-friendly one doubling toward the budget's limit
      (:func:`~ggnchunk._scheduling.autotune.tune`), and the fastest per index is used
      for the rest. Where larger chunks were no slower until the memory stopped the
      search, or the range is too small to compare sizes, the rest runs as budget mode
      runs it. The decision is cached under ``cache_key`` for later calls, as cuDNN's
      benchmark mode does: later calls run the chosen size, or budget mode's plan,
      without timing trials.

    Every mode works for every ``total >= 1``: ``fn`` is only called with
    ``0 <= start < stop <= total``, and every index is covered exactly once, in order.

    In every mode a chunk that runs out of memory is split in halves and retried (chunks
    already done are kept); a single index that runs out of memory raises. ``fn`` must
    leave no partial contribution behind when it raises.

    On CUDA, a ``max_memory`` caps the process's caching allocator while the chunks run
    (its per-process memory fraction, at ``baseline`` plus the budget; put back
    afterwards), so that libraries which size scratch memory from the free device
    memory (cuDNN's workspaces) stay within it. A chunk that cannot be split (one
    index, or ``recover_oom=False``) and runs out of memory under the cap runs once
    more without it. A ``tracker`` of your own gets no cap.

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
            ``measure(fn) -> (result, peak bytes, seconds)``; by default the
            memory backend of ``device`` (:mod:`ggnchunk._memory.backends`). Tests
            pass a simulated one.

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
        try:
            hash(cache_key)
        except TypeError:
            raise TypeError(
                f"cache_key must be hashable (a str, int or tuple), got "
                f"{type(cache_key).__name__} {cache_key!r}."
            ) from None
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"device={device!r} is not a torch device; pass e.g. 'cpu', 'cuda' or "
                "'cuda:1' (where the chunks' memory is measured)."
            ) from None
        self.num_chunks = num_chunks
        self.chunk_size = chunk_size
        self.budget = None if max_memory is None else parse_memory(max_memory)
        self.device = resolved
        self.recover_oom = recover_oom
        self.cache_key = cache_key
        self.what = what
        self.tracker = tracker
        if chunk_size == "auto":
            self.mode = Mode.AUTO
        elif self.budget is not None:
            self.mode = Mode.BUDGET
        else:
            self.mode = Mode.FIXED

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
            UnsupportedDeviceError: For a budget or auto mode on a device kind whose
                memory ggnchunk cannot measure.
            ValueError: If ``total`` is not positive.
        """
        total = check_positive_int(total, "total")
        report = ScheduleReport(
            total=total, mode=self.mode.value, chunk_size=0, budget_bytes=self.budget
        )
        if self.mode is Mode.FIXED:
            known = _known_backend(self.device)
            release = None if known is None else known(self.device).release_cached
            executor = Executor(fn, report, None, 0, self.recover_oom, release, self.what)
            plan = plan_chunks(total, self.num_chunks, self.chunk_size, what=self.what)
            report.chunk_size = max(b - a for a, b in plan)
            for start, stop in plan:
                executor.run_range(start, stop)
        else:
            if (
                self.tracker is None and self.device.type == "cuda"
                and not torch.cuda.is_available()
            ):  # fmt: skip
                raise ValueError(
                    f"device={str(self.device)!r}, but CUDA is not available here, so "
                    "its memory cannot be measured for max_memory or chunk_size='auto'; "
                    "pass the device the work runs on (device='cpu')."
                )
            backend = memory_backend(self.device, what=_needs(self.mode))
            tracker = self.tracker if self.tracker is not None else backend
            if baseline is None:
                # freed memory that the C heap kept (earlier work's) is given back
                # first: a chunk reusing it measures nothing, and growth from such
                # chunks overshot small budgets (per-sample gradients after a loop of
                # the same: 16-26 MiB within 8 MiB)
                baseline = getattr(tracker, "settled", tracker.current)()
            executor = Executor(
                fn, report, tracker, baseline, self.recover_oom, backend.release_cached,
                self.what,
            )  # fmt: skip
            budget = self.budget
            if budget is None:  # auto mode without a budget: 90% of what is free,
                # rounded down to 3 significant bits so that the cache's key (which
                # holds it) is the same from call to call (22 entries for 30 identical
                # calls when the free bytes were the key)
                budget = _coarse(int(0.9 * (backend.free() + executor.level())))
            report.budget_bytes = budget
            planner = BudgetPlanner(executor, budget, total, type(backend))
            # a given budget caps the device's allocator (cuDNN's workspaces are sized
            # from the free device memory, which no bound or measurement sees ahead)
            cap = (
                tracker.capped(baseline + budget)
                if self.budget is not None and isinstance(tracker, MemoryBackend)
                else contextlib.nullcontext(None)
            )
            with cap as executor.cap:
                try:
                    _run_adaptive(planner, self.mode, self.cache_key, cost)
                finally:
                    executor.cap = None
        executor.warn_if_recovered()
        return executor.result, report


def _coarse(size: int) -> int:
    """``size`` rounded down to its 3 most significant bits (at most 1/8 less).

    Args:
        size: Bytes, at least 0.

    Returns:
        The rounded bytes.
    """
    step = 1 << max(0, size.bit_length() - 3)
    return size - size % step


def _run_adaptive(
    planner: BudgetPlanner, mode: Mode, key: Hashable | None, cost: Cost | None
) -> None:
    """Budget and auto modes: start (from the bound, the cache, or a probe), tune, adapt.

    Every chunk is measured and checked against the budget
    (:meth:`~ggnchunk._scheduling.budget.BudgetPlanner.next_size`): one above halfway
    from the planning target to the budget shrinks the size for the rest (and warns when
    it went above the budget itself); without a known bound, sizes grow geometrically
    from measured chunks (at most twice the largest measured size at a time, less where
    the measured growth per index says the target is nearer), so that a measurement that
    sees nothing (memory the allocator reuses, a page-sized resolution) never licenses an
    unbounded chunk.
    """
    total, executor, report = planner.total, planner.executor, planner.executor.report
    cache_key = None if key is None else (key, str(mode), planner.budget, total)
    cached = CACHE.get(cache_key)
    if cost is not None:
        decision, start, size, grow = _start_from_bound(planner, cost)
        if cached is not None and cached.overshot and start < total:
            # an earlier call of the same problem measured chunks of this size above
            # the target, which the bound does not see: start where that call ended.
            # Above the budget itself, never larger again; above the planning target
            # only (a process's first call on a fresh heap, which later calls do not
            # pay: ResNet-18 frozen but layer1 at 24.5 MiB, 3 columns at 20.9 MiB then,
            # 2 columns at 8 MiB in every later call), grown from measured chunks
            # toward the bound's size, as a first call grows from half of it
            size = min(size, cached.overshot)
            if cached.over_budget:
                planner.ceiling = min(planner.ceiling, cached.over_budget, size)
            decision.overshot = cached.overshot
            decision.over_budget = cached.over_budget
        elif cached is not None and planner.backend.sees_reuse and cached.fitted:
            # the GPU grows from measurements: start from the largest chunk the last
            # call measured within the target (not the size it would have tried next:
            # cuDNN's workspaces jump, 83 MiB at 273 columns and 6.5 GiB at 512 measured)
            size = min(max(size, cached.fitted), planner.ceiling)
        elif (
            cached is None and mode is Mode.BUDGET and not planner.backend.sees_reuse
            and size >= 4 and (
                size < total - start
                # the rest in one chunk, but that chunk's bound is more than half the
                # target: a heap that earlier work left fragmented can take up to ~2.3x
                # the bound's bytes (measured: a windowed GroupNorm model, 799 columns,
                # 104-113 MiB in a fresh process and 250-280 MiB after the exactness
                # tests had run in it)
                or decision.fixed + (total - start) * decision.per_index
                > planner.target / 2
            )
        ):  # fmt: skip
            # a problem's first call on the CPU: a fresh heap can take more than the
            # bound says (and more than later calls); half the bound's size first,
            # grown from its measured peak to at most the bound's size
            size = min(size, total - start) // 2
    elif cached is None:
        decision, start = planner.probe()
        size, grow = min(total, 2), True  # then geometric growth from measured chunks
    else:
        decision, start, grow = cached, 0, not cached.tuned
        report.from_cache = True
        size = cached.chunk_size or planner.fit_size(cached)
    if mode is Mode.AUTO and start < total:
        if cached is not None and cached.tuned and cached.chunk_size:
            report.from_cache = True
            size, grow, decision.tuned = min(size, cached.chunk_size), False, True
        elif cached is not None:
            # an earlier call's search (the key holds the mode) found nothing faster
            # than budget mode's plan: run that plan, without timing trials again (the
            # U-Net's warm calls ran their trials' 1 + 64 + 128 + 256 + 319 columns in
            # every call, 0.39 s, where budget mode ran 1 + 767, 0.27 s)
            report.from_cache = True
        else:
            bounded = cost is not None and not planner.backend.sees_reuse
            start, size, tuned = tune(planner, start, size, decision, bounded)
            decision.tuned = tuned
            grow = grow and not tuned
    while start < total:
        stop = min(total, start + size)
        records = executor.run_range(start, stop)
        start = stop
        size = planner.next_size(records, size, grow)
    decision.chunk_size = size
    decision.fitted = max(
        [decision.fitted or 0]
        + [
            c.stop - c.start for c in report.chunks
            if c.peak_extra_bytes is not None and c.peak_extra_bytes <= planner.target
        ]
    ) or None  # fmt: skip
    if planner.overshot is not None and decision.fitted is not None:
        decision.fitted = min(decision.fitted, planner.overshot)
    if planner.over_budget is not None:
        decision.over_budget = min(
            decision.over_budget or planner.over_budget, planner.over_budget
        )
    if planner.overshot is not None:  # where this call's chunks were cut to (never
        decision.overshot = planner.overshot  # above a remembered over_budget ceiling)
    elif not decision.over_budget:  # no chunk above the target this time: the next
        decision.overshot = None  # call starts from the bound's size again
    decision.per_index = max(1.0, (planner.target - decision.fixed) / max(size, 1))
    CACHE.put(cache_key, decision)
    report.fixed_bytes = decision.fixed
    report.bytes_per_index = decision.per_index
    report.chunk_size = bulk_size([c.stop - c.start for c in report.chunks])


def _start_from_bound(
    planner: BudgetPlanner, cost: Cost
) -> tuple[Decision, int, int, bool]:
    """The plan from a known bound: one index first, then the bound counted from there.

    One index must fit (checked before any work). The first chunk of a call can leave
    one-time set-up behind (kernels and libraries loaded on first use), so the plan is
    made again after it. Where measurements cannot see memory the allocator reuses
    (process RSS), no chunk ever grows past the bound's size.

    Returns:
        ``(decision, next start, size, grow)``.
    """
    planner.from_cost(cost)
    records = planner.executor.run_range(0, 1) if planner.total > 1 else []
    start = records[-1].stop if records else 0
    decision = planner.from_cost(cost, check=False)
    size = planner.fit_size(decision)
    if any((r.peak_extra_bytes or 0) > planner.budget for r in records):
        # one index alone went above the budget, which the bound does not see: one
        # index per pass from here (warned), remembered for the next call
        size = planner.next_size(records, 1, False)
    if not planner.backend.sees_reuse:
        planner.ceiling = size
    elif records:
        # the GPU: libraries size their workspaces from the device's free memory, which
        # no bound sees (cuDNN takes the largest workspace of its candidate plans: on an
        # H200, 6-11 GiB for a 28x28 autoencoder whose bound said 2 GiB); sizes grow from
        # the measured index, twice at most at a time (BudgetPlanner.next_size)
        size = min(size, 2 * (records[-1].stop - records[-1].start))
        # growth per index is measured from the first index's peak, so a large transient
        # cost of every pass (a cuDNN workspace of GiBs at 2 columns as at 1, measured on
        # an H200) does not pass for a cost per index and stall the growth
        planner.one = records[-1].peak_extra_bytes
    return decision, start, size, True
