"""Auto mode: time real chunks on a grid of sizes, and remember the decision.

The decisions are kept in a bounded least-recently-used cache (as cuDNN's benchmark mode
keeps its choices), keyed by the caller's key, the mode, the budget and the range size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from ggnchunk._autograd import active_modes
from ggnchunk._memory import MiB
from ggnchunk._scheduling.budget import BudgetPlanner, Decision

__all__ = ["AutotuneCache", "CACHE", "clear_autotune_cache", "tune"]

_TRIAL_SHARE = 0.5  # auto mode spends at most this share of the range on timing trials
_TIE = 0.05  # auto mode: rates within 5% of the fastest count as equal (the larger wins)
# (timings of single chunks on a busy machine vary by 10-20%; a size that looks slower
# is timed up to three times before it is believed)
_CACHE_BYTES = 16 * MiB  # auto mode's first size: a chunk whose bound is about this


class AutotuneCache:
    """Decisions of earlier calls, at most ``size`` of them (least recently used go).

    Args:
        size: How many decisions to keep.
    """

    def __init__(self, size: int = 256):
        self.size = size
        self._entries: OrderedDict[Hashable, Decision] = OrderedDict()

    def get(self, key: Hashable | None) -> Decision | None:
        """The decision under ``key`` (now the most recently used), or ``None``.

        Args:
            key: The key; ``None`` is never cached.

        Returns:
            The decision or ``None``.
        """
        if key is None or key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: Hashable | None, decision: Decision) -> None:
        """Remember ``decision`` under ``key`` (nothing for ``None``).

        Nothing is remembered from a call under a Python dispatch mode
        (:func:`~ggnchunk._autograd.active_modes`): it reads the plain calls' decisions
        (a ``FlopCounterMode`` then counts what they run) but its own measurements are
        not theirs (a budgeted ResNet-18 cut its chunks to 80 passes under the counter,
        and the remembered cut held the next plain call to 100 passes, 18 before).

        Args:
            key: The key.
            decision: The decision.
        """
        if key is None or active_modes():
            return
        self._entries[key] = decision
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every decision."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


CACHE = AutotuneCache()


def clear_autotune_cache() -> None:
    """Forget the chunk sizes and memory fits remembered from earlier calls."""
    CACHE.clear()


def tune(
    planner: BudgetPlanner,
    start: int,
    size_max: int,
    decision: Decision,
    bounded: bool,
) -> tuple[int, int, bool]:
    """Time real chunks on a grid of sizes; return (next start, chosen size, tuned).

    Starts at a cache-friendly size (a chunk whose bound is about ``_CACHE_BYTES``;
    2 indices where no bound is known, after the probe), not the largest that fits: time
    per index is U-shaped in the chunk size (fixed costs per pass on the left, memory
    traffic on the right), and the largest chunks are often slower. The size then
    doubles while a chunk is not clearly slower per index than the best so far (a size
    that looks slower is timed up to three times before it is believed: the first chunks
    of a size pay fresh pages while the allocator adapts), up to what the memory allows
    (every trial is checked like any chunk); where the first doubling was slower, the
    size halves instead while that is faster. The largest size within ``_TIE`` of the
    fastest rate is chosen (fewer passes for equal speed). The trials are real work
    (nothing is computed twice) and stay within ``_TRIAL_SHARE`` of the range; where
    that share cannot hold the first size and its double, nothing is timed and the rest
    runs as budget mode runs it (in one chunk where the memory allows).

    Args:
        planner: The run's budget planner (its executor runs the trials).
        start: The first index not yet computed.
        size_max: The largest size the memory allows now.
        decision: The memory model.
        bounded: Whether the model is a known bound (else it was probed).

    Returns:
        ``(next start, chosen size, tuned)``; ``tuned`` is false when the memory, not the
        time, stopped the search (budget mode's growth may go on).
    """
    total, run_range = planner.total, planner.executor.run_range
    remaining = total - start
    allowance = int(_TRIAL_SHARE * remaining)
    if bounded:
        first = _CACHE_BYTES // max(int(decision.per_index), 1)
        size = max(1, min(size_max, 1 << max(0, first.bit_length() - 1)))
    else:
        size = max(1, min(size_max, 2))
    limit = size_max if bounded else total
    if 3 * size > allowance:  # the trials cannot hold this size and its double, so
        # nothing can be compared: no trial, the rest in one chunk where the memory
        # allows, as budget mode runs it (the tutorial autoencoder's 3071 columns ran as
        # 1024 + 2047 where budget mode ran one chunk; a timed chunk, then growth)
        return start, max(size, min(remaining, size_max)), False
    tried: dict[int, float] = {}
    state = {"start": start, "used": 0, "allowed": limit}

    def timed(size: int) -> float | None:
        """Run one chunk of ``size`` (if the allowance has room): seconds per index."""
        if state["start"] >= total or state["used"] + size > allowance:
            return None
        first = state["start"]
        records = run_range(first, min(total, first + size))
        sizes = [r.stop - r.start for r in records]
        state["start"], state["used"] = records[-1].stop, state["used"] + sum(sizes)
        state["allowed"] = planner.next_size(records, max(sizes), grow=True)
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
