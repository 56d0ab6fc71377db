"""Memory sizes: parsing ``"2GiB"``-style budgets and printing sizes in messages."""

from __future__ import annotations

import math
import re

__all__ = ["MiB", "format_bytes", "parse_memory"]

MiB = 2**20

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
