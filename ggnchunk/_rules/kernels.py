"""The shared contraction of the weight rules and what it keeps, side by side.

Many rules reduce to ``sum_{v,n} (sum_p A[v,n,g,o,p] B[n,g,k,p])**2`` with ``p`` running
over positions (tokens, pixels): :func:`square_sum` computes it either directly (form the
products, square) or in Gram form (``sum_{p,q} (A A^T)_{pq} (B B^T)_{pq}``), whichever
needs fewer operations; the Gram matrix of ``B`` does not depend on the chunk and is
computed once per forward pass. :func:`square_sum_bytes` is its memory bound, next to it
so that the two change together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ggnchunk._rules.base import Caches

__all__ = [
    "BLOCK",
    "SMALL_WEIGHT",
    "add_row_sums",
    "direct_bytes",
    "direct_squares",
    "products",
    "square_sum",
    "square_sum_bytes",
    "use_gram",
]

_GRAM_LIMIT = 2**24  # elements of the Gram matrices (64 MiB in float32) at most
BLOCK = 2**20  # elements of one batched product of the direct form (4 MiB in float32)
SMALL_WEIGHT = 2**16  # convolution weights backpropagated by the transposed convolution
# what the memory bound's sizes leave out where layers work on maps (kernels' workspaces,
# the allocator's partly reused blocks), as a factor: measured up to ~1.5x on CPU
# convolutions and the maps around them (:mod:`ggnchunk._graph.bound`)
MAPS_MARGIN = 1.5


def add_row_sums(into: Tensor, rows: Tensor) -> None:
    """``into += rows.sum(0)`` without a temporary of ``into``'s size.

    A weight's squares summed over the columns: the sum's temporary beside the total
    was a second weight-sized tensor (9 MiB for a 512-channel 3x3 convolution in
    float32), which the memory bound has to count. One product with a row of ones adds
    the rows in place.

    Args:
        into: ``[*S]``, contiguous.
        rows: ``[R, *S]`` (summed in place where contiguous, else through ``sum``).
    """
    if not rows.is_contiguous():
        into += rows.sum(0)
        return
    r = rows.shape[0]
    into.view(1, -1).addmm_(rows.new_ones(1, r), rows.view(r, -1))


SLAB = 2**19
"""Elements of one product of the direct form with its rows (2 MiB in float32): a
slab of columns whose products are squared and added while they are in the cache."""
SLABS = True  # an internal switch, for side-by-side runs (the products of whole chunks)


def direct_bytes(k: int, p: int) -> int:
    """Elements :func:`direct_squares` holds at once (a product with its rows).

    Args:
        k: Rows of the fixed side.
        p: Positions.

    Returns:
        ``BLOCK`` (a slab is at most half of it), or one row's product where that is
        more; nothing per column.
    """
    return max(BLOCK, p + k)


def direct_squares(
    a: Tensor, b: Tensor, lean: bool = False, total: Tensor | None = None
) -> Tensor:
    """``sum_{v,n} (sum_p a[v,n,o,p] b[n,k,p])**2`` as ``[O, K]``, product by product.

    The products are made for slabs of columns (or, where all of a sample's columns
    are few, for blocks of samples; where one column's are many, for blocks of its
    rows) of at most :data:`SLAB` elements with their rows,
    squared and added to the total while they are in the cache: one product per
    sample over all the chunk's columns wrote and read back a ``[V*O, K]`` block
    larger than the cache (the partly frozen ResNet-18's first layers: 100 columns x
    64 channels x 576, 15 MB per sample, 19 GFLOP/s where slabs of 8 columns reach
    46). Nothing kept per column.

    Args:
        a: ``[V, N, O, P]``, any strides.
        b: ``[N, K, P]``.
        lean: One sample per product at most (a tight budget).
        total: ``[O, K]``, contiguous, to add to (a total of the caller's own).

    Returns:
        ``[O, K]`` (``total``, where given).
    """
    v, n, o, p = a.shape
    k = b.shape[1]
    if total is None:
        total = a.new_zeros(o, k)
    column = o * (p + k)  # one column's rows and products, one sample
    if not SLABS:  # one product per sample (or block of samples) over every column
        step = 1 if lean else max(1, BLOCK // max(v * column, 1))
    elif v * column <= SLAB and not lean:
        step = max(1, SLAB // max(v * column, 1))
    else:
        step = 0
    if step:  # blocks of samples: [B, V*O, P] @ [B, P, K]
        for i in range(0, n, step):
            rows = a[:, i : i + step].transpose(0, 1)  # [B, V, O, P]
            rows = rows.reshape(rows.shape[0], v * o, p)  # one copy of the block's rows
            block = torch.bmm(rows, b[i : i + step].transpose(1, 2))
            add_row_sums(total, block.square_().view(-1, o, k))
        return total
    if column > SLAB:  # one column's products wider than a slab: blocks of its rows
        # (a 512-channel 3x3 convolution's are a weight, 18 MiB in float64, which the
        # total beside them doubled)
        height = max(1, SLAB // max(p + k, 1))
        for i in range(n):
            right = b[i].T  # [P, K]
            for j in range(v):
                for r in range(0, o, height):
                    total[r : r + height] += torch.mm(
                        a[j, i, r : r + height], right
                    ).square_()
        return total
    width = max(1, SLAB // max(column, 1))  # columns per product
    for i in range(n):
        right = b[i].T  # [P, K]
        for j in range(0, v, width):
            rows = a[j : j + width, i]
            # one copy of the slab's rows: one matrix product (strided, torch ran a
            # batched product of one [O, P] matrix per column, 2.8x slower)
            rows = rows.reshape(rows.shape[0] * o, p)
            add_row_sums(total, torch.mm(rows, right).square_().view(-1, o, k))
    return total


def use_gram(v: int, n: int, g: int, o: int, k: int, p: int, lean: bool = False) -> bool:
    if p == 1:
        return True
    if n * g * p * p * (o + k) > _GRAM_LIMIT:  # P x P factors too large to keep
        return False
    if lean:  # memory first: factors no larger than one column of the direct form
        return n * p * p * (o + k) <= o * k and n * o * p <= o * k
    direct = 2 * v * n * g * o * k * p + v * n * g * o * k
    gram = 2 * v * n * g * o * p * p + 2 * n * g * o * k * p * p
    return gram < direct


# the columns' Gram matrices over few positions are made from cache-sized blocks of the
# columns where the chunk is large (:func:`_blocked_gram`)
_BLOCKED_GRAM_POSITIONS = 9
_BLOCKED_GRAM_ELEMENTS = 2**23
BLOCKED_GRAM = True  # an internal switch, for side-by-side runs (benchmarks.gram_blocks)


def _blocked_gram(a: Tensor) -> Tensor:
    """``sum_v a[v, m, :]^T a[v, m, :]`` as ``[M, P, P]`` (``m = (n, g, o)``), blocked.

    One batched product over the strided ``[M, P, V]`` views read each column's
    ``P`` positions from a cache line shared with other rows, at about 1 GFLOP/s (the
    partly frozen LRASPP's 960-channel layers on 2x2 maps: 0.2 s per layer and chunk of
    3,072 columns): each block of ``v`` is copied once to ``[M, P, s]`` (``BLOCK``
    elements at most) and added by one batched product, 3-6x faster for ``P <= 9``
    (and slower from 16 positions, where the blocks' inner length gets short). The
    columns are read in place whatever their strides (a Linear's on a sequence have
    the positions before the features: no copy of the whole chunk).

    Args:
        a: ``[V, N, G, O, P]``, any strides.

    Returns:
        ``[N*G*O, P, P]``, contiguous.
    """
    v, p = a.shape[0], a.shape[-1]
    m = a[0].numel() // max(p, 1)
    step = max(1, BLOCK // max(m * p, 1))
    total = a.new_zeros(m, p, p)
    for i in range(0, v, step):
        block = a[i : i + step].permute(1, 2, 3, 4, 0).reshape(m, p, -1)  # [M, P, s]
        total.baddbmm_(block, block.transpose(1, 2))
    return total


def square_sum(
    a: Tensor,
    b: Tensor,
    cache: Caches | None = None,
    lean: bool = False,
    columns: int | None = None,
    into: Tensor | None = None,
) -> Tensor | None:
    """``sum_{v,n} (sum_p a[v,n,g,o,p] b[n,g,k,p])**2`` as ``[g, o, k]``.

    Args:
        a: ``[V, N, G, O, P]`` (chunk-dependent side).
        b: ``[N, G, K, P]`` (fixed for the forward pass).
        cache: Where the Gram matrix of ``b`` is kept between chunks (``gram``).
        lean: Choose the form by memory rather than by work (a tight budget).
        columns: The chunk size the memory bound was made for
            (:func:`square_sum_bytes`): larger chunks choose the form that size would,
            so that the bound holds for every chunk.
        into: ``[G, O, K]``, contiguous, of ``a``'s dtype (a view of the quantity's
            accumulator, :meth:`~ggnchunk._rules.base.RuleContext.accumulator`) to add
            the result to where the form allows it in one product that allocates
            nothing after it starts writing (one position: the squares summed first,
            then one batched product with ``beta=1``; the Gram form: one batched
            product of the two Gram matrices); no ``[G, O, K]`` temporary then.
            The other forms return their ``[G, O, K]`` (the direct forms' steps added
            in place into it, :func:`add_row_sums`: no second one beside it).

    Returns:
        ``[G, O, K]``, or ``None`` where the result was added to ``into``.
    """
    v, n, g, o, p = a.shape
    k = b.shape[2]
    if use_gram(v if columns is None else min(v, columns), n, g, o, k, p, lean):
        if p == 1:
            left = a.square().sum(0)[..., 0]  # [N, G, O]
            right = b[..., 0].square()  # [N, G, K]
            if into is None:
                return torch.einsum("ngo,ngk->gok", left, right)
            # both factors are made (copied where bmm needs it) before the product
            # writes into the accumulator
            left = left.permute(1, 2, 0).contiguous()  # [G, O, N]
            right = right.transpose(0, 1).contiguous()  # [G, N, K]
            into.baddbmm_(left, right)
            return None
        bb = None if cache is None else cache.gram
        if bb is None:
            bb = torch.einsum("ngkp,ngkq->ngkpq", b, b)
            if cache is not None:
                cache.gram = bb
        # rows [V, N*G*O, P]: no copy where the positions are last in memory (conv), one
        # transposing copy of each column's [P, O] block where they are not (Linear on
        # sequences); the Gram matrices then come from one bmm over strided views, where
        # einsum copied the columns into [N*G*O, P, V] element by element (5x slower for
        # a [4000, 2, 1, 256, 32] chunk of a transformer's MLP)
        if (
            BLOCKED_GRAM and p <= _BLOCKED_GRAM_POSITIONS
            and a.numel() >= _BLOCKED_GRAM_ELEMENTS
        ):  # fmt: skip
            aa = _blocked_gram(a).view(n, g, o, p, p)
        else:
            rows = a.reshape(v, n * g * o, p)
            aa = torch.bmm(rows.permute(1, 2, 0), rows.permute(1, 0, 2))
            aa = aa.view(n, g, o, p, p)
        if into is not None:  # one product per group over (n, p, q), added in place:
            # no [G, O, K] result beside the accumulator (9 MiB per 512-channel 3x3
            # layer, whose holes in the heap the next vectors split: a frozen
            # ResNet-18's trainable layer4 kept 2.4x its bytes in use resident)
            left = aa.permute(1, 2, 0, 3, 4).reshape(g, o, n * p * p)
            right = bb.permute(1, 0, 3, 4, 2).reshape(g, n * p * p, k)
            into.baddbmm_(left, right)
            return None
        return torch.einsum("ngopq,ngkpq->gok", aa, bb)
    if g == 1:
        return direct_squares(a[:, :, 0], b[:, 0], lean).unsqueeze(0)
    return torch.einsum("vngop,ngkp->vngok", a, b).square_().sum((0, 1))


def square_sum_bytes(
    n: int, g: int, o: int, k: int, p: int, columns: int = 2**20, lean: bool = False
) -> tuple[int, int]:
    """Elements :func:`square_sum` may keep: ``(fixed per chunk, per column)``.

    Args:
        n: Samples.
        g: Groups.
        o: Rows per group of the chunk-dependent side.
        k: Rows per group of the fixed side.
        p: Positions.
        columns: Most columns a chunk can have (the Gram form is chosen for large
            chunks only, so whether its factors are kept depends on it).
        lean: The form is chosen by memory (then it does not depend on the chunk).

    Returns:
        Upper bounds in elements: the Gram matrices (if the Gram form may be chosen) and
        the per-column products of the direct form.
    """
    if p == 1:  # squares summed over the columns first: nothing per column
        return n * g * (o + k), 0
    if lean:
        if use_gram(1, n, g, o, k, p, lean=True):  # both factors; ``a`` copied once
            return n * g * p * p * (o + k), n * g * o * p
        # one sample at a time (:func:`direct_squares` in slabs of ``SLAB`` elements,
        # but counted as one sample's products of every column: below)
        return 0, g * o * k
    gram = use_gram(1, n, g, o, k, p) or use_gram(columns, n, g, o, k, p)
    fixed = n * g * p * p * (o + k) if gram else 0
    # one sample's products of every column (``g == 1``), as before the slabs: the
    # slabs hold less (``direct_bytes``), but with nothing counted per column budgets
    # planned passes that were not lean, whose weight-sized totals and products left
    # the heap fragmented: a 512-channel head's one-column passes peaked 18 MiB above
    # their bound in 2 of 6 fresh runs (RSS), where the lean plan's held
    return fixed, o * k if g == 1 else n * g * o * k


def products(a: Tensor, b: Tensor) -> Tensor:
    """``sum_p a[v,n,g,o,p] b[n,g,k,p]`` as ``[V, N, G, O, K]`` (per-sample products).

    Args:
        a: ``[V, N, G, O, P]``.
        b: ``[N, G, K, P]``.

    Returns:
        ``[V, N, G, O, K]``.
    """
    return torch.einsum("vngop,ngkp->vngok", a, b)
