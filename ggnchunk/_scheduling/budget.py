"""The budget model: how large a chunk fits, checked against every measured chunk.

A chunk of ``s`` indices is modelled as ``fixed + per_index * s`` bytes above the
call's baseline. The model comes from a known bound (the engine's memory model), from a
cached decision, or from probing one index; every chunk run afterwards is measured, and
:meth:`BudgetPlanner.next_size` shrinks the size after a chunk above halfway from the
planning target to the budget (warning once where it went above the budget itself) or
grows it toward the target. The share of the budget that plans aim at is the device's
(its memory backend's ``planning_share``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ggnchunk._checks import user_stacklevel
from ggnchunk._memory import MemoryBackend, backend_class, format_bytes
from ggnchunk._scheduling.execute import ChunkRecord, Executor

__all__ = [
    "BudgetPlanner",
    "Cost",
    "Decision",
    "MemoryBudgetError",
    "MemoryBudgetWarning",
    "passes_within",
    "planning_share",
]

Bound = tuple[float, float] | tuple[float, float, "list[tuple[float, float]] | None"]
Cost = Bound | Callable[[], Bound]
"""A bound ``(fixed_bytes, bytes_per_index)``, or a callable asked when needed.

A third item, where given and not ``None``, splits the bound by the steps of the work:
``[(fixed_bytes, bytes_per_index)]``, each within the first two, a chunk of ``s``
indices needing the largest ``fixed + s * per_index`` of them (memory held at one step
only, beside what that step holds per index)."""


class MemoryBudgetError(MemoryError):
    """The smallest chunk (one index) does not fit the memory budget."""


class MemoryBudgetWarning(UserWarning):
    """A chunk's measured peak memory went above the budget; later chunks were shrunk."""


def planning_share(device: torch.device) -> float:
    """Share of a budget that plans aim at on ``device`` (the rest is a safety margin).

    Args:
        device: Where the work runs.

    Returns:
        A number in ``(0, 1]``.
    """
    return backend_class(device).planning_share


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


@dataclass
class Decision:
    """A fitted memory model and where a run ended (what the autotune cache keeps)."""

    fixed: float
    per_index: float
    chunk_size: int | None = None  # where the last call ended
    # auto mode chose a size below the budget's limit: do not grow. An auto decision
    # that is not tuned ended its search without a size faster than budget mode's
    # growth: later calls run budget mode's plan, with no trials
    tuned: bool = False
    overshot: int | None = None  # the size a chunk above the target was cut to
    # the size a chunk above the budget itself was cut to: no later call goes above it
    over_budget: int | None = None
    fitted: int | None = None  # the largest chunk that ran within the target


class BudgetPlanner:
    """Chunk sizes within one budget, for one run of an :class:`Executor`.

    Args:
        executor: Runs and measures the chunks.
        budget: The budget in bytes, above the executor's baseline.
        total: Size of the index range.
        backend: The memory backend class of the device (its planning share, and
            whether its measurements see memory the allocator reuses).
    """

    def __init__(
        self, executor: Executor, budget: int, total: int, backend: type[MemoryBackend]
    ):
        self.executor = executor
        self.budget = budget
        self.total = total
        self.backend = backend
        self.share = backend.planning_share
        self.ceiling = total  # no chunk above this size (a bound's, or one that overshot)
        self.one: int | None = None  # the probe's peak of one index (no bound known)
        # the steepest growth per index measured from one index to a chunk (no bound
        # known): a later chunk that measures nothing (memory the allocator reuses)
        # says nothing about its size, so growth never forgets it
        self.slope: float | None = None
        self.overshot: int | None = None  # the size a chunk above the target was cut to
        self.over_budget: int | None = None  # the size a chunk above the budget was cut to
        self._overshoot_warned = False
        self.first_level = max(0, executor.level())

    @property
    def first_level(self) -> int:
        """Memory in use above the baseline when planning began."""
        return self._first_level

    @first_level.setter
    def first_level(self, level: int) -> None:
        self._first_level = level
        self.executor.settle_above = level  # a pass above it starts from a settled heap

    @property
    def target(self) -> float:
        """The bytes plans aim at: the budget's planning share."""
        return self.share * self.budget

    @property
    def shrink_above(self) -> float:
        """Measured peaks above these bytes shrink later chunks: halfway to the budget.

        Plans aim at the target; a measured chunk a little above it is still within
        the budget, and its excess is often the measurement's own noise (process RSS
        moves with the heap's history: a ResNet-18's one-column passes read 65-69.5 MiB
        around a 68.2 MiB target), so shrinking there cut a 4-pass plan to 10 one-column
        passes without protecting the budget. Between the target and this level a
        chunk neither shrinks nor lets the next one grow; above it, half the margin is
        still left for the next chunk.
        """
        return self.target + 0.5 * (self.budget - self.target)

    @property
    def what(self) -> str:
        """What the indices count."""
        return self.executor.what

    def fit_size(self, decision: Decision) -> int:
        """The largest chunk the decision's model fits within the target.

        Args:
            decision: The memory model.

        Returns:
            A size in ``[1, total]``.
        """
        room = self.target - decision.fixed
        return max(1, min(self.total, int(room // max(decision.per_index, 1.0))))

    def from_cost(self, cost: Cost, check: bool = True) -> Decision:
        """The plan from a known bound; a budget below one index raises first.

        Args:
            cost: The bound, counted from the memory in use now.
            check: Whether to raise where one index does not fit. False for the re-plan
                after the first index ran (which fitted): the work done is kept.

        Returns:
            The decision (the level in use now plus the bound's fixed bytes).

        Raises:
            MemoryBudgetError: With ``check``, where one index does not fit.
        """
        fixed_bound, per_index, *rest = cost() if callable(cost) else cost
        steps = rest[0] if rest else None
        level = self.executor.settled_level()
        fixed = level + fixed_bound
        one = fixed + per_index
        if steps:  # the split bound: its largest step
            one = level + max(f + p for f, p in steps)
        if check and one > self.budget:
            have, need = format_bytes(self.budget), format_bytes(one)
            if have == need:  # rounded alike ("8.0 MiB, but ... needs up to 8.0 MiB")
                have, need = f"{self.budget:,} B", f"{math.ceil(one):,} B"
            raise MemoryBudgetError(
                f"max_memory is {have}, but a chunk of 1 of the "
                f"{self.what} needs up to {need} above "
                f"the memory in use before the call ({format_bytes(level)} of it already "
                f"in use after the forward pass, {format_bytes(per_index)} per "
                f"{self.what[:-1] if self.what.endswith('s') else self.what}). "
                "Raise max_memory, or make the problem smaller (e.g. batch_chunk_size "
                "for fewer samples per forward pass)."
            )
        self.first_level = level
        if steps:
            fixed = level + self._split_fixed(level, per_index, steps)
        return Decision(fixed, per_index)

    def _split_fixed(
        self, level: float, per_index: float, steps: list[tuple[float, float]]
    ) -> float:
        """The fixed bytes of a line through the split bound at the size it fits.

        ``s*``, the largest size whose every step fits the target, is the size the line
        ``fixed + s * per_index`` fits too (:meth:`fit_size`): the line meets the split
        bound's largest step at ``s*`` and lies above it from there (the steps hold no
        more per index than the line), so no larger size passes for fitting.

        Args:
            level: Bytes in use above the baseline.
            per_index: The line's bytes per index (the largest step's).
            steps: ``[(fixed, per index)]`` of the split bound.

        Returns:
            Bytes, at most the line's own fixed bytes.
        """
        size = min(int((self.target - level - f) // max(p, 1.0)) for f, p in steps)
        size = max(1, min(self.total, size))
        return max(f + size * p for f, p in steps) - size * per_index

    def probe(self) -> tuple[Decision, int]:
        """Measure one index, twice (where the range has three): its peak is the start.

        The first chunk of a call can pay one-time costs (kernels set up and workspaces
        allocated on first use); a second one-index chunk shows the steady state, and the
        smaller of the two peaks is the cost of one index. Nothing is extrapolated from
        it: a reading of zero (memory the allocator reused) would license any size.
        Larger chunks then grow geometrically from measured ones (:meth:`next_size`).

        Returns:
            A first decision (the level before, and the one index's growth above it as
            the cost per index) and the first index not yet computed.

        Raises:
            MemoryBudgetError: Where one index already needs more than the budget.
        """
        executor = self.executor
        before = executor.level()
        in_use = executor.tracker.current()
        (first,) = executor.run_range(0, 1)
        if not self.backend.sees_reuse:
            # Memory the first chunk leaves behind is one-time set-up (kernels, libraries
            # loaded lazily on first use), not a cost of the chunk: count from after it.
            retained = max(0, executor.tracker.current() - in_use)
            if retained:
                executor.baseline += retained
                first.peak_extra_bytes = max(0, first.peak_extra_bytes - retained)
        one, start = first.peak_extra_bytes, 1
        if self.total >= 3:
            (again,) = executor.run_range(1, 2)
            one, start = min(one, again.peak_extra_bytes), 2
        if one > self.budget:
            raise MemoryBudgetError(
                f"max_memory is {format_bytes(self.budget)}, but a chunk of 1 of the "
                f"{self.what} already needs {format_bytes(one)} "
                f"above the memory in use before the call ({format_bytes(before)} of it "
                "before the first chunk). Raise max_memory, or make the problem smaller "
                "(e.g. batch_chunk_size for fewer samples per forward pass)."
            )
        self.one, self.first_level = one, before
        return Decision(before, max(one - before, 1)), start

    def next_size(self, records: list[ChunkRecord], size: int, grow: bool) -> int:
        """The next chunk size after ``records`` (one planned chunk, or its OOM parts).

        Shrinks after a chunk above :attr:`shrink_above` (halfway from the target to the
        budget; warning once if it went above the budget), and with ``grow`` grows
        toward the target after a chunk within it: twice the chunk at most,
        less where the growth measured between one index and this chunk predicts the
        target sooner. Never above the ceiling (the bound's size, or a size that
        overshot) nor the range.

        Args:
            records: The records of the chunk just run.
            size: The size planned for it.
            grow: Whether the size may grow.

        Returns:
            The next size.
        """
        budget, target = self.budget, self.target
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
        if peak > self.shrink_above and done > 1 and own > 0.05 * target:  # shrink
            size = max(1, int(done * max(target - floor, 0) / max(peak - floor, 1)))
            size = min(size, done - 1)
            self.ceiling = min(self.ceiling, size)
            self.overshot = size if self.overshot is None else min(self.overshot, size)
            if peak > budget:  # above the safety target only: shrink quietly
                self._warn_overshoot(peak, size)
                self.over_budget = min(self.over_budget or size, size)
        elif peak > budget and done == 1:  # nothing left to shrink: say so
            self.ceiling = size = self.overshot = self.over_budget = 1
            self._warn_overshoot(peak, 1)
        elif grow and done >= size and len(records) == 1 and peak <= target:
            grown = 2 * done
            if self.one is not None and done > 1 and peak > self.one:
                # the growth per index measured from one index to this chunk
                self.slope = max(self.slope or 0.0, (peak - self.one) / (done - 1))
            if self.one is not None and self.slope:
                # the size whose peak that steepest growth puts at the target (a chunk
                # of 16 per-sample gradients measured 6 MiB of an 8 MiB budget, the next
                # one of 17 measured nothing, and the one after that, grown to 34 from
                # that nothing, peaked at 26 MiB)
                grown = min(grown, int(1 + (target - self.one) / self.slope + 1e-9))
            elif self.one is None and peak > floor:
                grown = min(grown, int(done * (target - floor) / (peak - floor)))
            size = max(size, grown)
        return max(1, min(self.total, self.ceiling, size))

    def _warn_overshoot(self, peak: int, size: int) -> None:
        if self._overshoot_warned:
            return
        self._overshoot_warned = True
        warnings.warn(
            f"ggnchunk: a chunk peaked at {format_bytes(peak)}, above the "
            f"{format_bytes(self.budget)} budget; the remaining chunks use at most {size} "
            f"{self.what}. The result is exact."
            + (
                " A chunk of 1 cannot shrink further: raise max_memory, or pass "
                "batch_chunk_size for fewer samples per forward pass."
                if size == 1
                else ""
            ),
            MemoryBudgetWarning,
            stacklevel=user_stacklevel(),
        )
