"""The shared contraction's forms against the products squared one by one (float64)."""

from __future__ import annotations

import pytest
import torch

from ggnchunk._rules import kernels

# (V, N, O, K, P): several samples per product, slabs of columns, one column wider
# than a slab, one position
SHAPES = [(3, 4, 2, 5, 6), (7, 2, 3, 4, 9), (1, 3, 6, 2, 8), (5, 1, 4, 3, 1)]


def _expected(a, b):
    """Each sample's and column's products, squared and summed: ``[O, K]``."""
    total = torch.zeros(a.shape[2], b.shape[1], dtype=torch.float64)
    for v in range(a.shape[0]):
        for n in range(a.shape[1]):
            total += (a[v, n] @ b[n].T) ** 2
    return total


@pytest.mark.parametrize("slab", [10**6, 40, 7])
@pytest.mark.parametrize("slabs", [True, False])
@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_direct_squares(shape, lean, slabs, slab, monkeypatch):
    """Every slab width (all columns, some, one per product) gives the sum exactly."""
    monkeypatch.setattr(kernels, "SLAB", slab)
    monkeypatch.setattr(kernels, "SLABS", slabs)
    v, n, o, k, p = shape
    torch.manual_seed(0)
    a = torch.randn(n, v, o, p, dtype=torch.float64).transpose(0, 1)  # strided
    b = torch.randn(n, k, p, dtype=torch.float64)
    expected = _expected(a, b)
    torch.testing.assert_close(
        kernels.direct_squares(a, b, lean), expected, rtol=1e-12, atol=0
    )
    # added to a total of the caller's
    total = torch.ones(o, k, dtype=torch.float64)
    result = kernels.direct_squares(a, b, lean, total)
    assert result is total
    torch.testing.assert_close(total, expected + 1, rtol=1e-12, atol=0)


@pytest.mark.parametrize("contiguous", [True, False])
def test_add_row_sums(contiguous):
    """``into += rows.sum(0)``, in place, for contiguous and strided rows."""
    torch.manual_seed(0)
    rows = torch.randn(6, 3, 4, dtype=torch.float64)
    if not contiguous:
        rows = torch.randn(3, 6, 4, dtype=torch.float64).transpose(0, 1)
    into = torch.randn(3, 4, dtype=torch.float64)
    expected = into + rows.sum(0)
    before = into.data_ptr()
    kernels.add_row_sums(into, rows)
    assert into.data_ptr() == before
    torch.testing.assert_close(into, expected, rtol=1e-13, atol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_direct_bytes_bound_the_slabs(shape, monkeypatch):
    """No product with its rows is larger than :func:`direct_bytes` counts."""
    v, n, o, k, p = shape
    monkeypatch.setattr(kernels, "SLAB", 40)
    monkeypatch.setattr(kernels, "BLOCK", 80)
    sizes = []
    mm, bmm = torch.mm, torch.bmm

    def seen_mm(x, y):
        sizes.append(x.numel() + x.shape[0] * y.shape[1])
        return mm(x, y)

    def seen_bmm(x, y):
        sizes.append(x.numel() + x.shape[0] * x.shape[1] * y.shape[2])
        return bmm(x, y)

    monkeypatch.setattr(torch, "mm", seen_mm)
    monkeypatch.setattr(torch, "bmm", seen_bmm)
    a = torch.randn(v, n, o, p, dtype=torch.float64)
    b = torch.randn(n, k, p, dtype=torch.float64)
    kernels.direct_squares(a, b)
    assert sizes and max(sizes) <= kernels.direct_bytes(k, p), sizes


@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("form", ["gram", "direct"])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_square_sum_into_the_accumulator(shape, groups, form, lean, monkeypatch):
    """Each form, per group, returned or added into a caller's accumulator in place.

    The Gram form (and one position) add into ``into`` with one product (no
    ``[G, O, K]`` result beside it); the direct forms return their total.
    """
    monkeypatch.setattr(kernels, "use_gram", lambda *args, **kwargs: form == "gram")
    v, n, o, k, p = shape
    torch.manual_seed(1)
    a = torch.randn(v, n, groups, o, p, dtype=torch.float64)
    b = torch.randn(n, groups, k, p, dtype=torch.float64)
    expected = torch.stack([_expected(a[:, :, j], b[:, j]) for j in range(groups)])
    returned = kernels.square_sum(a, b, lean=lean)
    torch.testing.assert_close(returned, expected, rtol=1e-12, atol=0)
    into = torch.full((groups, o, k), 2.0, dtype=torch.float64)
    before = into.data_ptr()
    result = kernels.square_sum(a, b, lean=lean, into=into)
    added = into if result is None else into + result
    assert into.data_ptr() == before
    assert (result is None) == (form == "gram"), "the Gram form adds in place"
    torch.testing.assert_close(added, expected + 2, rtol=1e-12, atol=0)
