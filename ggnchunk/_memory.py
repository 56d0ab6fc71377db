"""Peak extra memory of a callable, on CUDA or on the host, with one result type.

* CUDA: the caching allocator's statistics. ``reset_peak_memory_stats`` before the call,
  ``max_memory_allocated`` after; the extra memory is the peak minus what was allocated
  before the call. Exact for tensors, blind to other processes and to the allocator's
  cached-but-free blocks.
* CPU: the process's resident set size (RSS), polled by ``memory_profiler`` every
  ``interval`` seconds while the call runs; the extra memory is the peak RSS minus the RSS
  just before the call. RSS includes everything the process touches, so run each
  measurement in a fresh process and pin glibc's mmap threshold
  (``MALLOC_MMAP_THRESHOLD_=131072``) for repeatable numbers (see the benchmarks).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "PeakMemory",
    "PeakTracker",
    "free_memory",
    "measure_peak_memory",
    "parse_memory",
]

MiB = 2**20


@dataclass(frozen=True)
class PeakMemory:
    """Result of :func:`measure_peak_memory`.

    Attributes:
        peak_extra_bytes: Peak memory during the call minus the memory in use just before
            it (never negative).
        baseline_bytes: Memory in use just before the call (CUDA: allocated by tensors;
            CPU: resident set size of the process).
        device: ``"cuda:0"``-style device string or ``"cpu"``.
        method: ``"cuda-allocator"`` or ``"rss-poll"``.
        seconds: Wall time of the call (on CPU slowed a little by the poller).
        result: What the callable returned.

    On the CPU the peak is the rise of the process's resident set size: memory the
    allocator freed earlier and reuses does not move it, so after earlier calls a
    large computation can show a tiny peak (0.1 MiB). Measure in a fresh process (or
    on CUDA, where the allocator's own statistics are used) for the computation's size.
    The ``repr`` is a one-line summary without ``result``.
    """

    peak_extra_bytes: int
    baseline_bytes: int
    device: str
    method: str
    seconds: float
    result: Any

    @property
    def peak_extra_mib(self) -> float:
        """``peak_extra_bytes`` in MiB."""
        return self.peak_extra_bytes / MiB

    def __repr__(self) -> str:
        note = (
            " (CPU: RSS rise; reused memory not counted)"
            if self.method == "rss-poll"
            else ""
        )
        return (
            f"PeakMemory(peak_extra={self.peak_extra_mib:.1f} MiB{note}, "
            f"baseline={self.baseline_bytes / MiB:.1f} MiB, device={self.device!r}, "
            f"method={self.method!r}, seconds={self.seconds:.3f}, "
            f"result={type(self.result).__name__})"
        )


def measure_peak_memory(
    fn: Callable[..., Any],
    *args: Any,
    device: str | torch.device = "cpu",
    interval: float = 1e-3,
    **kwargs: Any,
) -> PeakMemory:
    """Run ``fn(*args, **kwargs)`` once and measure the peak memory it adds.

    Args:
        fn: The callable to measure.
        *args: Its positional arguments.
        device: Where to measure: a CUDA device (allocator statistics) or ``"cpu"``
            (resident set size, polled).
        interval: Polling interval in seconds on the CPU (ignored on CUDA).
        **kwargs: Its keyword arguments.

    Returns:
        The peak extra memory, the baseline, the wall time and ``fn``'s result.

    Raises:
        ValueError: For a device that is neither CPU nor CUDA, or an interval that is not
            positive.

    Examples:
        >>> import torch
        >>> from ggnchunk import measure_peak_memory
        >>> m = measure_peak_memory(lambda: torch.ones(2**22).sum())
        >>> m.peak_extra_bytes >= 0
        True
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        watch = (_cuda_index(device), [])  # peaks before ggnchunk's own resets
        _WATCHERS.append(watch)
        start = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
            torch.cuda.synchronize(device)
        finally:
            del _WATCHERS[next(i for i, w in enumerate(_WATCHERS) if w is watch)]
        watched = watch[1]
        seconds = time.perf_counter() - start
        peak = max([torch.cuda.max_memory_allocated(device), *watched])
        return PeakMemory(
            max(0, peak - baseline),
            baseline,
            str(device),
            "cuda-allocator",
            seconds,
            result,
        )
    if device.type != "cpu":
        raise ValueError(
            f"device={str(device)!r}: peak memory is measured on 'cpu' or a CUDA device; "
            "pass one of those."
        )
    if not interval > 0:
        raise ValueError(f"interval must be a positive number of seconds, got {interval}.")
    import psutil
    from memory_profiler import memory_usage

    baseline = psutil.Process().memory_info().rss
    start = time.perf_counter()
    peak_mib, result = memory_usage(
        (fn, args, kwargs), interval=interval, max_usage=True, retval=True
    )
    seconds = time.perf_counter() - start
    peak = int(peak_mib * MiB)
    return PeakMemory(max(0, peak - baseline), baseline, "cpu", "rss-poll", seconds, result)


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def format_bytes(count: float) -> str:
    """A size for messages, in the unit that shows it: ``"96 B"``, ``"1.5 KiB"``, ...

    Args:
        count: Bytes.

    Returns:
        The size with a binary unit (B, KiB, MiB, GiB, TiB).
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:,.0f} {unit}" if unit == "B" else f"{count:,.1f} {unit}"
        count /= 1024
    return f"{count:,.1f} TiB"


def parse_memory(value: int | str, name: str = "max_memory") -> int:
    """Bytes from an ``int`` or a string with a unit.

    Args:
        value: Bytes (``int``), or a string such as ``"512MiB"``, ``"2GiB"``, ``"1.5GB"``,
            ``"300 MB"``, ``"4096"``. Binary (KiB, MiB, GiB, TiB) and decimal (KB, MB,
            GB, TB) units, case-insensitive.
        name: The argument's name, for error messages.

    Returns:
        The number of bytes (positive).

    Raises:
        TypeError: For other types.
        ValueError: For unknown units or values that are not positive.

    Examples:
        >>> parse_memory("1.5GiB"), parse_memory("512MB"), parse_memory(1024)
        (1610612736, 512000000, 1024)
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"{name} must be bytes (int) or a string with a unit such as '2GiB', got "
            f"{type(value).__name__} {value!r}."
        )
    if isinstance(value, int):
        number = value
    else:
        import re

        match = re.fullmatch(
            r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value
        )
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a memory size; use bytes or a number with a "
                "unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers "
                "of 1024), e.g. '512MiB' or '1.5GB'."
            )
        amount = float(match.group(1)) * _UNITS[unit]
        if not math.isfinite(amount) or amount >= 2**63:
            raise ValueError(
                f"{name}={value!r} is larger than any machine's memory; give a size such "
                "as '2GiB', or leave max_memory out for no budget."
            )
        number = int(amount)
    if number <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}.")
    return number


# measure_peak_memory calls in progress on CUDA: (device, the peaks they were about to
# lose to a PeakTracker's reset of the allocator's peak statistics)
_WATCHERS: list[tuple[int, list[int]]] = []


def _cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _reset_peak(device: torch.device) -> None:
    """``reset_peak_memory_stats``, handing the peak so far to open measurements first."""
    index = _cuda_index(device) if _WATCHERS else None
    for watched_index, peaks in _WATCHERS:
        if watched_index == index:
            peaks.append(torch.cuda.max_memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)


_LIBC: Any = None


def _trim_heap() -> None:
    """``malloc_trim(0)`` where the C library is glibc; nothing elsewhere."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC(0)


class PeakTracker:
    """Current and peak memory of one device, cheap enough to read around every chunk.

    * CUDA: ``memory_allocated`` and ``max_memory_allocated`` (``measure`` calls
      ``reset_peak_memory_stats``, which also resets the peak a caller may be watching
      with ``torch.cuda.max_memory_allocated``; :func:`measure_peak_memory` is handed
      the peak before each reset, so it sees the whole call's).
    * CPU: the resident set size, sampled by a thread every millisecond while a
      measurement is open. The kernel's own peak counter (``VmHWM``) is never reset, so
      a caller's measurement of the whole process stays intact.

    Args:
        device: The device whose memory to track.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._page = 0
        if device.type == "cpu":
            try:
                import os

                self._page = os.sysconf("SC_PAGE_SIZE")
                self._statm()
            except (OSError, ValueError, AttributeError):
                self._page = 0

    def _statm(self) -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * self._page

    def current(self) -> int:
        """Bytes in use now (CUDA: allocated by tensors; CPU: resident set size)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        if self._page:
            return self._statm()
        import psutil

        return psutil.Process().memory_info().rss

    def settled(self) -> int:
        """Bytes in use now, after the C heap gave its free pages back (CPU, glibc).

        Memory the allocator keeps after ``free`` is still resident, so the resident set
        size overstates what is in use; ``malloc_trim(0)`` returns it to the operating
        system (nothing in use is touched). Used for the level a plan starts from.

        Returns:
            As :meth:`current`.
        """
        if self.device.type == "cpu":
            _trim_heap()
        return self.current()

    def measure(self, fn: Callable[[], Any]) -> tuple[Any, int, float]:
        """Run ``fn()``; return its result, the peak bytes in use during it, and seconds.

        Args:
            fn: What to run.

        Returns:
            ``(result, peak_bytes, seconds)``; ``peak_bytes`` is absolute (compare it with
            :meth:`current` taken earlier).
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            _reset_peak(self.device)
            start = time.perf_counter()
            result = fn()
            torch.cuda.synchronize(self.device)
            return (
                result,
                torch.cuda.max_memory_allocated(self.device),
                (time.perf_counter() - start),
            )
        import threading

        peak, done = [self.current()], threading.Event()

        def poll() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], self.current())
                done.wait(1e-3)

        thread = threading.Thread(target=poll, daemon=True)
        start = time.perf_counter()
        try:  # started inside: an interrupt anywhere after it still stops the thread
            thread.start()
            result = fn()
        finally:
            seconds = time.perf_counter() - start
            done.set()
            if thread.ident is not None:
                thread.join()
        return result, max(peak[0], self.current()), seconds


def free_memory(device: torch.device) -> int:
    """Bytes that a computation on ``device`` could still use.

    Args:
        device: CUDA device (free device memory plus the allocator's cached free blocks)
            or CPU (available system memory).

    Returns:
        Bytes.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached
    import psutil

    return psutil.virtual_memory().available
