"""The kernel's own peak RSS around one call (Linux): what a user measuring it sees.

No dependency beyond the standard library, so that a fresh measuring process imports
nothing it would not import anyway (the budget tests' worker, the experiments).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MiB = 2**20


def status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``); ``None`` if absent.

    Args:
        field: The field's name.

    Returns:
        Its value in bytes, or ``None`` where the file or the field is missing.
    """
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_high_water_mark() -> bool:
    """Reset the kernel's peak RSS (``VmHWM``) to the current RSS; False if impossible.

    Returns:
        Whether the peak was reset.
    """
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return status_bytes("VmHWM") is not None


def high_water_mark_mib(call: Callable[[], Any]) -> tuple[float, Any] | None:
    """Run ``call`` once: its peak RSS above the RSS just before it [MiB], and its result.

    Args:
        call: What to measure.

    Returns:
        ``(peak MiB, result)``, or ``None`` (``call`` not run) where the kernel's peak
        cannot be reset (not Linux).
    """
    before = status_bytes("VmRSS")
    if before is None or not reset_high_water_mark():
        return None
    result = call()
    return (status_bytes("VmHWM") - before) / MiB, result
