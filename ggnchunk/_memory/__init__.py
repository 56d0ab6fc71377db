"""Memory: sizes, one measuring backend per device kind, and the peak of a call.

* :mod:`~ggnchunk._memory.sizes`: ``parse_memory`` and ``format_bytes``.
* :mod:`~ggnchunk._memory.backends`: :class:`MemoryBackend` and its CUDA and host
  implementations (the only place that knows how a device's memory is read).
* :mod:`~ggnchunk._memory.measure`: :func:`measure_peak_memory` and its result.
"""

from ggnchunk._memory.backends import (
    CudaMemory,
    HostMemory,
    MemoryBackend,
    UnsupportedDeviceError,
    backend_class,
    free_memory,
    memory_backend,
    synchronize,
)
from ggnchunk._memory.measure import PeakMemory, measure_peak_memory
from ggnchunk._memory.sizes import MiB, format_bytes, parse_memory

__all__ = [
    "CudaMemory",
    "HostMemory",
    "MemoryBackend",
    "MiB",
    "PeakMemory",
    "UnsupportedDeviceError",
    "backend_class",
    "format_bytes",
    "free_memory",
    "measure_peak_memory",
    "memory_backend",
    "parse_memory",
    "synchronize",
]
