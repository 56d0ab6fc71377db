"""Chunk plans partition the index range for every chunking."""

from __future__ import annotations

import pytest

from ggnchunk import plan_chunks


@pytest.mark.parametrize("total", [1, 2, 7, 64, 3072])
def test_every_num_chunks_partitions(total):
    for k in sorted(k for k in {1, 2, 3, total // 2, total - 1, total} if 1 <= k <= total):
        plan = plan_chunks(total, num_chunks=k)
        assert len(plan) == k
        sizes = [b - a for a, b in plan]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
        assert plan[0][0] == 0 and plan[-1][1] == total
        assert all(plan[i][1] == plan[i + 1][0] for i in range(k - 1))


@pytest.mark.parametrize("total", [1, 7, 100])
def test_every_chunk_size_partitions(total):
    for size in range(1, total + 1):
        plan = plan_chunks(total, chunk_size=size)
        sizes = [b - a for a, b in plan]
        assert all(s == size for s in sizes[:-1]) and 1 <= sizes[-1] <= size
        assert plan[0][0] == 0 and plan[-1][1] == total
        assert all(plan[i][1] == plan[i + 1][0] for i in range(len(plan) - 1))


def test_default_is_one_chunk():
    assert plan_chunks(5) == [(0, 5)]
