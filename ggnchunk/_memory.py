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

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PeakMemory", "measure_peak_memory"]

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

    Example:
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
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device)
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
