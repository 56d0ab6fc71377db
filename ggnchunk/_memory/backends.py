"""One memory backend per device kind: what is in use, the peak of a call, what is free.

Everything that depends on how a device's memory is measured lives here, behind
:class:`MemoryBackend`; the scheduler, the budget planner and the engine ask
:func:`memory_backend` (or :func:`backend_class` for the policy constants) and never
branch on ``device.type``.

* :class:`CudaMemory`: the caching allocator's statistics (``memory_allocated``,
  ``max_memory_allocated``). Exact for tensors, blind to other processes.
* :class:`HostMemory`: the process's anonymous resident memory (its data: the resident
  set size less the pages mapped from files), read from ``/proc/self/statm`` and polled
  by a thread while a measurement is open. It counts everything the process allocates,
  including blocks the C heap keeps after ``free``, and cannot see memory the allocator
  reuses. The libraries' code that a kernel's first use pages in (shared, read-only,
  reclaimable: 20-30 MiB in a process's first call) is not the computation's memory and
  is left out.

A device kind without a backend (``mps``, ``xpu``, ...) is refused by
:func:`memory_backend` with an error that says what to pass instead: measuring host
memory there would budget the wrong thing. Fixed chunkings need no measurement and run on
every device.

To add a device kind: subclass :class:`MemoryBackend` in this file and add it to
``_BACKENDS``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

__all__ = [
    "Cap",
    "CudaMemory",
    "HostMemory",
    "MemoryBackend",
    "UnsupportedDeviceError",
    "backend_class",
    "free_memory",
    "memory_backend",
    "synchronize",
]


class UnsupportedDeviceError(ValueError):
    """Memory cannot be measured on this device kind (budgets and auto-tuning need it)."""


class MemoryBackend:
    """Memory of one device: in use now, the peak of a call, and what is free.

    Class attributes (the policy the scheduler reads without measuring anything):

    Attributes:
        kind: The ``torch.device`` type this backend measures.
        method: How a peak is measured, as :class:`~ggnchunk.PeakMemory` reports it.
        planning_share: Share of a budget that plans aim at (the rest is a margin for
            what the measurement cannot see ahead of time).
        sees_reuse: Whether a measured peak includes memory the allocator reuses. Where
            it does not (process RSS), a measured chunk can look smaller than it is, so
            a plan never grows past the size its bound allows.
        counts_code: Whether the measurement counts what a kernel's first use sets up
            once per process (code paged in, library handles): then a budgeted call
            runs small problems of its kinds of layers before its baseline.

    Args:
        device: The device.
    """

    kind: ClassVar[str] = ""
    method: ClassVar[str] = ""
    planning_share: ClassVar[float] = 1.0
    sees_reuse: ClassVar[bool] = True
    counts_code: bool = True

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def current(self) -> int:
        """Bytes in use now."""
        raise NotImplementedError

    def code(self) -> int:
        """Resident bytes mapped from files (libraries' code); 0 where not measured."""
        return 0

    def settled(self) -> int:
        """Bytes in use now, after caches that only hold freed memory gave it back."""
        return self.current()

    def measure(self, fn: Callable[[], Any]) -> tuple[Any, int, float]:
        """Run ``fn()``; return its result, the peak bytes in use during it, and seconds.

        Args:
            fn: What to run.

        Returns:
            ``(result, peak_bytes, seconds)``; ``peak_bytes`` is absolute (compare it with
            :meth:`current` taken earlier).
        """
        raise NotImplementedError

    def measure_call(
        self, fn: Callable[[], Any], interval: float
    ) -> tuple[Any, int, int, float]:
        """Run ``fn()`` for :func:`~ggnchunk.measure_peak_memory`.

        Args:
            fn: What to run.
            interval: Polling interval in seconds, where the backend polls.

        Returns:
            ``(result, baseline_bytes, peak_bytes, seconds)``.
        """
        baseline = self.current()
        result, peak, seconds = self.measure(fn)
        return result, baseline, peak, seconds

    def free(self) -> int:
        """Bytes that a computation on the device could still use."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for the device's queued work (for timings); nothing where it is eager."""

    def release_cached(self) -> None:
        """Give cached free blocks back after running out of memory."""

    @contextlib.contextmanager
    def capped(self, limit: int) -> Iterator[Cap | None]:
        """Hold the device's allocator to ``limit`` bytes while the block runs.

        Where a library sizes scratch memory from what the device has free (cuDNN's
        convolution workspaces), a cap is what keeps it inside a budget: it then falls
        back to algorithms that fit. Nothing on devices whose allocator takes no cap.

        Args:
            limit: Bytes the allocator may hold in all.

        Yields:
            The :class:`Cap` (whose ``lifted()`` runs a pass without it: one that
            does not fit under it runs as it would uncapped, and is measured and warned
            of), or ``None`` where nothing is capped.
        """
        yield None


# -- CUDA: the caching allocator's statistics -------------------------------------------

# measure_peak_memory calls in progress on CUDA: (device, the peaks they were about to
# lose to a backend's reset of the allocator's peak statistics)
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


class CudaMemory(MemoryBackend):
    """CUDA: ``memory_allocated`` and ``max_memory_allocated``.

    :meth:`measure` resets the allocator's peak statistics, which also resets the peak
    a caller may be watching with ``torch.cuda.max_memory_allocated``;
    :func:`~ggnchunk.measure_peak_memory` is handed the peak before each reset, so it
    sees the whole call's.
    """

    kind = "cuda"
    method = "cuda-allocator"
    planning_share = 0.92  # the statistics are exact; the margin is for fragmentation
    sees_reuse = True

    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def measure(self, fn: Callable[[], Any]) -> tuple[Any, int, float]:
        torch.cuda.synchronize(self.device)
        _reset_peak(self.device)
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        return result, torch.cuda.max_memory_allocated(self.device), seconds

    def measure_call(
        self, fn: Callable[[], Any], interval: float
    ) -> tuple[Any, int, int, float]:
        device = self.device
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        watch = (_cuda_index(device), [])  # peaks before ggnchunk's own resets
        _WATCHERS.append(watch)
        start = time.perf_counter()
        try:
            result = fn()
            torch.cuda.synchronize(device)
        finally:
            del _WATCHERS[next(i for i, w in enumerate(_WATCHERS) if w is watch)]
        seconds = time.perf_counter() - start
        peak = max([torch.cuda.max_memory_allocated(device), *watch[1]])
        return result, baseline, peak, seconds

    def free(self) -> int:
        """Free device memory plus the allocator's cached free blocks."""
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device)
        return free + cached - torch.cuda.memory_allocated(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def release_cached(self) -> None:
        torch.cuda.empty_cache()

    @contextlib.contextmanager
    def capped(self, limit: int) -> Iterator[Cap | None]:
        """The caching allocator's per-process memory fraction, put back afterwards.

        cuDNN sizes a convolution's workspace from the free device memory and falls
        back to algorithms with smaller workspaces where the allocator refuses one
        (measured on an H200: one pass of a 28x28 autoencoder at 10 GiB with cuDNN,
        0.2 GiB without; a 2 GiB budget peaked at 6.5 GiB uncapped, 150 MiB capped).

        The fraction limits the bytes the allocator reserves, not those in use: the
        cache's free blocks are released first (they would serve any request, cap or
        not), and the cap allows ``limit`` plus the free space left inside segments in
        use (which the allocator can fill without reserving more). The fraction is the
        process's while the block runs: the user's own, where tighter, stays and comes
        back when the last budgeted call on the device ends. Calls open at once in
        several threads share the loosest of their caps (a tighter one would make the
        others run out of memory), and none while one of them runs a pass with its cap
        lifted.
        """
        index = _cuda_index(self.device)
        unsupported = False
        try:
            total = torch.cuda.get_device_properties(index).total_memory
            with _CAP_LOCK:
                user = _USER_FRACTION.get(index)
                if user is None:
                    user = torch.cuda.get_per_process_memory_fraction(index)
        except (AttributeError, RuntimeError):  # an allocator backend without a cap
            unsupported = True
        if unsupported:  # (outside the except: no error chained to the call's own)
            yield None
            return
        self.release_cached()  # cached free blocks would serve any request, cap or not
        holes = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        fraction = min(1.0, max(0.0, (limit + max(0, holes)) / total))
        if fraction >= user:  # the user's own cap is tighter
            yield None
            return
        cap = Cap(index, fraction, self.release_cached)
        try:
            with _CAP_LOCK:
                _USER_FRACTION.setdefault(index, user)
                _CAPS.setdefault(index, []).append(cap)
                _apply_caps(index)
            yield cap
        finally:
            with _CAP_LOCK:
                active = _CAPS.get(index, [])
                active[:] = [c for c in active if c is not cap]
                if index in _USER_FRACTION:
                    _apply_caps(index)


class Cap:
    """One budgeted call's cap on a CUDA device's allocator (:meth:`CudaMemory.capped`).

    Args:
        index: The device index.
        fraction: The share of the device's memory the call allows the allocator.
        release: Gives the allocator's cached free blocks back
            (:meth:`MemoryBackend.release_cached` of the call's backend).
    """

    def __init__(self, index: int, fraction: float, release: Callable[[], None]):
        self.index, self.fraction, self.lifts = index, fraction, 0
        self._release = release

    @contextlib.contextmanager
    def lifted(self) -> Iterator[None]:
        """Run the block without the cap (no open cap applies meanwhile).

        Afterwards the allocator's cached free blocks are released, so that what the
        block freed does not serve later requests past the cap.

        Yields:
            Nothing.
        """
        with _CAP_LOCK:
            self.lifts += 1
            _apply_caps(self.index)
        try:
            yield
        finally:
            with _CAP_LOCK:
                self.lifts -= 1
                if self.index in _USER_FRACTION:
                    _apply_caps(self.index)
            # what the uncapped pass freed stays cached and would serve the next passes
            # past the cap: given back
            self._release()


# the caps of budgeted calls open in any thread, per device index, and the fraction the
# user had before the first of them, which comes back when the last one ends, in
# whatever order calls end
_CAPS: dict[int, list[Cap]] = {}
_USER_FRACTION: dict[int, float] = {}
_CAP_LOCK = threading.Lock()


def _apply_caps(index: int) -> None:
    """Set device ``index``'s fraction from the open caps (under ``_CAP_LOCK``).

    The loosest open cap, the user's fraction where tighter; the user's fraction alone
    where a call runs a pass with its cap lifted, or where none is open (then the
    registry of the device is cleared, after the fraction is set).
    """
    active = _CAPS.get(index)
    user = _USER_FRACTION[index]
    if not active or any(c.lifts for c in active):
        fraction = user
    else:
        fraction = min(max(c.fraction for c in active), user)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    if not active:
        _CAPS.pop(index, None)
        _USER_FRACTION.pop(index, None)


# -- the host: the process's resident set size -----------------------------------------

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


class HostMemory(MemoryBackend):
    """CPU: anonymous resident memory, sampled every millisecond while measuring.

    The resident set size less its pages mapped from files (``/proc/self/statm``): the
    process's data, without the libraries' code that a first use of a kernel pages in
    (measured: 22-31 MiB in a process's first budgeted call, shared with other processes
    and reclaimable; counted against ``max_memory`` it had to be paged in by a warm-up
    before every first call, 50 ms on a 40 ms problem). Without ``/proc`` (not Linux),
    the whole resident set size, code included (:attr:`counts_code`).

    The kernel's own peak counter (``VmHWM``) is never reset, so a caller's measurement
    of the whole process stays intact.
    """

    kind = "cpu"
    method = "rss-poll"
    # the resident set size also holds what glibc keeps of freed blocks (fragmentation),
    # which grows with allocation history: a first large pass measured up to 1.5x its
    # live sizes. With 0.85 the budget tests (fresh processes, default allocator, first
    # call, warm and after a one-pass call) hold; the bounds carry their own margin.
    planning_share = 0.85
    sees_reuse = False

    def __init__(self, device: torch.device):
        super().__init__(device)
        self._page = 0
        try:
            import os

            self._page = os.sysconf("SC_PAGE_SIZE")
            self._statm()
        except (OSError, ValueError, AttributeError, IndexError):
            self._page = 0
        self.counts_code = not self._page

    def _statm(self) -> tuple[int, int]:
        """``(resident, shared)`` bytes: shared are the resident pages mapped from files."""
        with open("/proc/self/statm") as handle:
            fields = handle.read().split()
        return int(fields[1]) * self._page, int(fields[2]) * self._page

    def current(self) -> int:
        if self._page:
            resident, shared = self._statm()
            return resident - shared
        import psutil

        return psutil.Process().memory_info().rss

    def code(self) -> int:
        return self._statm()[1] if self._page else 0

    def settled(self) -> int:
        """The resident set size after ``malloc_trim(0)`` (glibc).

        Memory the C heap keeps after ``free`` is still resident, so the resident set
        size overstates what is in use; trimming returns it to the operating system
        (nothing in use is touched). Used for the level a plan starts from.

        Returns:
            As :meth:`current`.
        """
        _trim_heap()
        return self.current()

    def measure(self, fn: Callable[[], Any]) -> tuple[Any, int, float]:
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

    def measure_call(
        self, fn: Callable[[], Any], interval: float
    ) -> tuple[Any, int, int, float]:
        import psutil
        from memory_profiler import memory_usage

        baseline = psutil.Process().memory_info().rss
        start = time.perf_counter()
        peak_mib, result = memory_usage(
            (fn, (), {}), interval=interval, max_usage=True, retval=True
        )
        seconds = time.perf_counter() - start
        return result, baseline, int(peak_mib * 2**20), seconds

    def free(self) -> int:
        """Available system memory."""
        import psutil

        return psutil.virtual_memory().available


_BACKENDS: dict[str, type[MemoryBackend]] = {
    backend.kind: backend for backend in (CudaMemory, HostMemory)
}


def backend_class(device: torch.device | str, what: str = "max_memory") -> type:
    """The memory backend class of ``device``'s kind (its policy, nothing measured).

    Args:
        device: The device.
        what: What needs the measurement, for the error message.

    Returns:
        A :class:`MemoryBackend` subclass.

    Raises:
        UnsupportedDeviceError: Where no backend measures this device kind.
    """
    device = torch.device(device)
    try:
        return _BACKENDS[device.type]
    except KeyError:
        kinds = ", ".join(repr(kind) for kind in _BACKENDS)
        raise UnsupportedDeviceError(
            f"{what} needs the memory in use on the device, and ggnchunk can measure it "
            f"on {kinds} only, not on {device.type!r} (its host memory is not the "
            f"device's). On {device.type!r} pass a fixed chunking instead (num_chunks or "
            "an int chunk_size), or run on the CPU or a CUDA device."
        ) from None


def memory_backend(device: torch.device | str, what: str = "max_memory") -> MemoryBackend:
    """The memory backend measuring ``device``.

    Args:
        device: The device.
        what: What needs the measurement, for the error message.

    Returns:
        A fresh backend instance (cheap; keeps no state between measurements).

    Raises:
        UnsupportedDeviceError: Where no backend measures this device kind.
    """
    device = torch.device(device)
    return backend_class(device, what)(device)


def free_memory(device: torch.device) -> int:
    """Bytes that a computation on ``device`` could still use.

    Args:
        device: A CUDA device (free device memory plus the allocator's cached free
            blocks) or the CPU (available system memory).

    Returns:
        Bytes.
    """
    return memory_backend(device).free()


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work where its backend knows how (for timings).

    Args:
        device: The device; kinds without a backend are not waited for.
    """
    backend = _BACKENDS.get(torch.device(device).type)
    if backend is not None:
        backend(device).synchronize()
