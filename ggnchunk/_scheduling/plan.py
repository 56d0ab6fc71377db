"""Fixed plans: contiguous chunks that partition ``[0, total)``, and option checks."""

from __future__ import annotations

from ggnchunk._checks import check_positive_int
from ggnchunk._memory import parse_memory

__all__ = ["Plan", "bulk_size", "check_chunking", "plan_chunks"]

Plan = list[tuple[int, int]]


def plan_chunks(
    total: int,
    num_chunks: int | None = None,
    chunk_size: int | None = None,
    what: str = "columns",
) -> Plan:
    """Split ``[0, total)`` into contiguous, non-empty chunks.

    Both options are clamped to ``total``, so that one setting works for problems of
    every size: more chunks than indices means one index per chunk, and a chunk size
    larger than ``total`` means one chunk.

    Args:
        total: Size of the index range, at least 1.
        num_chunks: Number of chunks, at least 1; ``min(num_chunks, total)`` chunks are
            made, whose sizes differ by at most one (the first ``total % num_chunks`` are
            one larger).
        chunk_size: Largest chunk, at least 1 (clamped to ``total``); only the last chunk
            may be smaller. At most one of ``num_chunks`` and ``chunk_size`` may be
            given; with neither, one chunk covers everything.
        what: What the indices count, for error messages.

    Returns:
        ``[(start, stop), ...]`` covering ``[0, total)`` in order, every chunk non-empty.

    Raises:
        TypeError: If ``total``, ``num_chunks`` or ``chunk_size`` is not an int.
        ValueError: If one of them is not positive, or both options are given.

    Examples:
        >>> plan_chunks(10, num_chunks=3)
        [(0, 4), (4, 7), (7, 10)]
        >>> plan_chunks(10, chunk_size=4)
        [(0, 4), (4, 8), (8, 10)]
        >>> plan_chunks(2, num_chunks=8)  # clamped: one index per chunk
        [(0, 1), (1, 2)]
        >>> plan_chunks(3, chunk_size=100)  # clamped: one chunk
        [(0, 3)]
    """
    total = check_positive_int(total, f"the number of {what} (total)")
    if num_chunks is not None and chunk_size is not None:
        raise ValueError("pass only one of num_chunks and chunk_size.")
    if num_chunks is not None:
        num_chunks = min(check_positive_int(num_chunks, "num_chunks"), total)
        base, extra = divmod(total, num_chunks)
        sizes = [base + 1] * extra + [base] * (num_chunks - extra)
    elif chunk_size is not None:
        chunk_size = min(check_positive_int(chunk_size, "chunk_size"), total)
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


def check_chunking(num_chunks: object, chunk_size: object, max_memory: object) -> None:
    """Check that the chunking arguments are consistent (before any work).

    Args:
        num_chunks: The user's ``num_chunks``.
        chunk_size: The user's ``chunk_size`` (an int or ``"auto"``).
        max_memory: The user's ``max_memory``.

    Raises:
        ValueError: For conflicting or out-of-range values.
        TypeError: For values of the wrong type.
    """
    if chunk_size == "auto":
        if num_chunks is not None:
            raise ValueError(
                f"num_chunks={num_chunks!r} and chunk_size='auto' were both given; "
                "'auto' chooses the chunking itself. Pass only one of them."
            )
    elif isinstance(chunk_size, str):
        raise ValueError(
            f"chunk_size={chunk_size!r} is not understood; pass a positive int or 'auto'."
        )
    else:
        if num_chunks is not None and chunk_size is not None:
            raise ValueError(
                f"num_chunks={num_chunks!r} and chunk_size={chunk_size!r} were both given; "
                "they say the same thing two ways. Pass only one of them."
            )
        if num_chunks is not None:
            check_positive_int(num_chunks, "num_chunks", " Use num_chunks=1 for one pass.")
        if chunk_size is not None:
            check_positive_int(chunk_size, "chunk_size")
        if max_memory is not None and (num_chunks is not None or chunk_size is not None):
            raise ValueError(
                "max_memory was given together with a fixed chunking "
                f"(num_chunks={num_chunks!r}, chunk_size={chunk_size!r}); the budget "
                "chooses the chunk size. Pass max_memory alone, or with chunk_size='auto' "
                "to also tune for speed."
            )
    if max_memory is not None:
        parse_memory(max_memory)


def bulk_size(sizes: list[int]) -> int:
    """The chunk size that covered the most indices (ties: the larger).

    Args:
        sizes: The size of every chunk run.

    Returns:
        That size (0 for no chunks).
    """
    covered: dict[int, int] = {}
    for size in sizes:
        covered[size] = covered.get(size, 0) + size
    return max(covered, key=lambda s: (covered[s], s)) if covered else 0
