"""The peak extra memory of a callable, on any device kind with a memory backend.

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ggnchunk._memory.backends import memory_backend
from ggnchunk._memory.sizes import MiB

__all__ = ["PeakMemory", "measure_peak_memory"]


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
        ValueError: For a device whose memory ggnchunk cannot measure (neither CPU nor
            CUDA), or an interval that is not positive.

    Examples:
        >>> import torch
        >>> from ggnchunk import measure_peak_memory
        >>> m = measure_peak_memory(lambda: torch.ones(2**22).sum())
        >>> m.peak_extra_bytes >= 0
        True
    """
    device = torch.device(device)
    backend = memory_backend(device, what=f"measure_peak_memory(device={str(device)!r})")
    if not interval > 0:
        raise ValueError(f"interval must be a positive number of seconds, got {interval}.")
    result, baseline, peak, seconds = backend.measure_call(
        lambda: fn(*args, **kwargs), interval
    )
    return PeakMemory(
        max(0, peak - baseline), baseline, str(device), backend.method, seconds, result
    )
