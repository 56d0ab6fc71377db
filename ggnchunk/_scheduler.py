"""Chunk planning: how to split an index range ``[0, total)`` into contiguous chunks.

Generic: nothing here knows about GGNs. A plan is a list of ``(start, stop)`` pairs that
partition ``[0, total)`` in order.
"""

from __future__ import annotations

from ggnchunk._checks import check_positive_int

__all__ = ["Plan", "plan_chunks"]

Plan = list[tuple[int, int]]


def plan_chunks(
    total: int,
    num_chunks: int | None = None,
    chunk_size: int | None = None,
    what: str = "columns",
) -> Plan:
    """Split ``[0, total)`` into contiguous chunks.

    Args:
        total: Size of the index range, at least 1.
        num_chunks: Number of chunks, ``1 <= num_chunks <= total``; sizes differ by at
            most one (the first ``total % num_chunks`` chunks are one larger).
        chunk_size: Largest chunk, ``1 <= chunk_size <= total``; only the last chunk may
            be smaller. At most one of ``num_chunks`` and ``chunk_size`` may be given;
            with neither, one chunk covers everything.
        what: What the indices count, for error messages.

    Returns:
        ``[(start, stop), ...]`` covering ``[0, total)`` in order.

    Raises:
        ValueError: If a value is out of range or both are given.

    Example:
        >>> plan_chunks(10, num_chunks=3)
        [(0, 4), (4, 7), (7, 10)]
        >>> plan_chunks(10, chunk_size=4)
        [(0, 4), (4, 8), (8, 10)]
    """
    if num_chunks is not None and chunk_size is not None:
        raise ValueError("pass only one of num_chunks and chunk_size.")
    if num_chunks is not None:
        num_chunks = check_positive_int(num_chunks, "num_chunks")
        if num_chunks > total:
            raise ValueError(
                f"num_chunks={num_chunks} is larger than the {total} {what} there are to "
                f"split; use num_chunks <= {total}."
            )
        base, extra = divmod(total, num_chunks)
        sizes = [base + 1] * extra + [base] * (num_chunks - extra)
    elif chunk_size is not None:
        chunk_size = check_positive_int(chunk_size, "chunk_size")
        if chunk_size > total:
            raise ValueError(
                f"chunk_size={chunk_size} is larger than the {total} {what} there are; "
                f"use chunk_size <= {total} (chunk_size={total} is one pass)."
            )
        sizes = [chunk_size] * (total // chunk_size)
        if total % chunk_size:
            sizes.append(total % chunk_size)
    else:
        sizes = [total]
    plan, start = [], 0
    for size in sizes:
        plan.append((start, start + size))
        start += size
    return plan
