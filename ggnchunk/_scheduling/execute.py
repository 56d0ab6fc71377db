"""Execution: run chunks, measure them, add up their results, split on out-of-memory."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ggnchunk._checks import user_stacklevel

if TYPE_CHECKING:
    from ggnchunk._memory.backends import Cap

__all__ = [
    "ChunkRecord",
    "Executor",
    "OutOfMemoryRecoveryWarning",
    "ScheduleReport",
    "is_out_of_memory",
]


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
    """What a :class:`~ggnchunk.ChunkScheduler` did.

    Attributes:
        total: Size of the index range.
        mode: ``"fixed"``, ``"budget"`` or ``"auto"``.
        chunk_size: The chunk size used for the bulk of the range.
        budget_bytes: The memory budget, if any.
        chunks: Every completed chunk, in order.
        out_of_memory_splits: How many chunks were split after running out of memory.
        uncapped_passes: How many passes ran again without the device allocator's cap
            of a budget after running out of memory under it (CUDA).
        fixed_bytes: Fitted memory of the computation at zero chunk size (budget modes).
        bytes_per_index: Fitted memory per index of a chunk (budget modes).
        from_cache: Whether the decision came from the autotune cache.
        factor: Whether the indices were columns of a cut's Gram factor (the passes
            below a cut, :class:`~ggnchunk.GGNReport`), not of the loss Hessian's
            square root.
    """

    total: int
    mode: str
    chunk_size: int
    budget_bytes: int | None = None
    chunks: list[ChunkRecord] = field(default_factory=list)
    out_of_memory_splits: int = 0
    uncapped_passes: int = 0
    fixed_bytes: float | None = None
    bytes_per_index: float | None = None
    from_cache: bool = False
    factor: bool = False

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


class Executor:
    """Runs chunks of one scheduled computation and keeps what they produced.

    Every chunk is measured where a tracker is given (peak and the level before it,
    above ``baseline``); its result is added to :attr:`result` and its record appended
    to :attr:`report`. A chunk that runs out of memory is split in halves and retried
    (chunks already done are kept); a single index that runs out of memory raises.

    Args:
        fn: ``fn(start, stop)``, returning ``None`` or something to add up.
        report: The report the records go to.
        tracker: What measures memory (``current``, ``measure`` and optionally
            ``settled``), or ``None`` for unmeasured (fixed) runs.
        baseline: Bytes in use before the computation (peaks are counted from here).
        recover_oom: Whether to split chunks that run out of memory.
        release: Called after a chunk ran out of memory (a device allocator's cache).
        what: What the indices count, for messages.
    """

    def __init__(
        self,
        fn: Callable[[int, int], Any],
        report: ScheduleReport,
        tracker: Any = None,
        baseline: int = 0,
        recover_oom: bool = True,
        release: Callable[[], None] | None = None,
        what: str = "indices",
    ):
        self.fn = fn
        self.report = report
        self.tracker = tracker
        self.baseline = baseline
        self.recover_oom = recover_oom
        self.release = release
        self.what = what
        self.result: Any = None
        # above this level (bytes above the baseline), memory is settled before a pass
        self.settle_above: int | None = None
        self._largest_failed = 0
        # the device allocator's cap of a budget (a Cap, whose lifted() runs a pass
        # without it), or None: a pass that runs out of memory under the cap and may
        # not be split (one index, or recover_oom off) runs again once uncapped, as it
        # would have without a cap, and is measured and warned of as any overshoot
        self.cap: Cap | None = None

    def level(self) -> int:
        """Bytes in use above the baseline now."""
        return max(0, self.tracker.current() - self.baseline)

    def settled_level(self) -> int:
        """Bytes in use above the baseline after caches of freed memory gave it back."""
        settled = getattr(self.tracker, "settled", self.tracker.current)  # user trackers
        return max(0, settled() - self.baseline)

    def _once(self, start: int, stop: int) -> ChunkRecord:
        if self.tracker is None:
            begin = time.perf_counter()
            value = self.fn(start, stop)
            record = ChunkRecord(start, stop, time.perf_counter() - begin)
        else:
            level = self.level()
            if self.settle_above is not None and level > self.settle_above:
                # above the level planning began from: on the CPU, mostly blocks the C
                # heap kept after earlier passes freed them (resident, counted by the
                # budget, not in use); give them back before the pass, which would
                # otherwise peak on top of them (ResNet-18's level climbed from 47 to
                # 85 MiB over five passes under an 80 MiB budget, issue 21)
                level = self.settled_level()
            value, peak, seconds = self.tracker.measure(lambda: self.fn(start, stop))
            record = ChunkRecord(start, stop, seconds, max(0, peak - self.baseline), level)
        self.result = _add(self.result, value)
        self.report.chunks.append(record)
        return record

    def run_range(self, start: int, stop: int) -> list[ChunkRecord]:
        """Run ``[start, stop)``, splitting it in halves on out-of-memory errors.

        Under a device allocator's cap (:attr:`cap`), a pass that may not be split
        (one index, or ``recover_oom`` off) runs once more with the cap lifted.

        Args:
            start: First index.
            stop: One past the last index.

        Returns:
            The records of the chunks that ran (one, or the parts of a split).
        """
        pending, done = [(start, stop)], []
        while pending:
            a, b = pending.pop(0)
            failed = None
            try:
                done.append(self._once(a, b))
            except BaseException as error:
                if not is_out_of_memory(error):
                    raise
                if self.cap is not None and (b - a == 1 or not self.recover_oom):
                    failed = "capped"
                elif self.recover_oom and b - a > 1:
                    failed = "split"
                else:
                    raise
            if failed is None:
                continue
            # outside the except block: the failed pass's tensors are freed
            if self.release is not None:
                self.release()
            if failed == "capped":  # once more, uncapped (a second failure is raised)
                self.report.uncapped_passes += 1
                with self.cap.lifted():
                    done.append(self._once(a, b))
                continue
            self.report.out_of_memory_splits += 1
            self._largest_failed = max(self._largest_failed, b - a)
            middle = (a + b) // 2
            pending[:0] = [(a, middle), (middle, b)]
        return done

    def warn_if_recovered(self) -> None:
        """Warn once where chunks were split after running out of memory."""
        if self.report.out_of_memory_splits:
            worked = max(c.stop - c.start for c in self.report.chunks)
            warnings.warn(
                f"ggnchunk: a chunk of {self._largest_failed} {self.what} ran out of "
                f"memory and was split ({self.report.out_of_memory_splits} split(s)); "
                f"the rest ran with chunks of at most {worked} {self.what}. The result "
                f"is exact. Pass chunk_size={worked} (or max_memory) to avoid the retries.",
                OutOfMemoryRecoveryWarning,
                stacklevel=user_stacklevel(),
            )
