"""Fewer columns with the same Gram matrix, where the columns live in a small space.

Below a wide output layer the columns span few directions: a language model's head maps
a token's ``C`` columns (one per word of the vocabulary) to its ``D``-wide input, and
``C`` is often many times ``D``. What the diagonal and the Kronecker factors add up
below depends on the columns only through each sample's Gram matrix
``sum_v g_v g_v^T``, so any columns with the same Gram give the same result, exactly.

Where every column is non-zero on one position of the first axis after the samples (a
token), the Gram is block-diagonal over positions, and a position's block is
``A^T A`` for its columns ``A`` (``[C, D]`` per sample). Its QR factor ``R``
(``[min(C, D), D]``, ``R^T R = A^T A``) gives ``min(C, D)`` columns on that position in
place of ``C``. Vectors without such an axis (``[V, N, D]``) are one block.

The sweep replaces the columns only where nothing else of the sweep is alive (no other
vectors waiting, no parameter whose per-column products are summed over several uses),
so every later step sees the new columns alone. Per-column tensors that a quantity
carries to a later layer (``carried``: a tied table's rows, :mod:`ggnchunk._rules.tied`)
are mapped with the columns: the new columns are ``Q^T A`` for each block's reduced QR
factor ``Q`` (``A = Q R``), and the carried ``B`` become ``Q^T B``. A sum over columns
of products ``f(a_v) g(b_v)``, ``f`` linear, is then unchanged: ``sum_w (Q^T B)_w
f((Q^T A)_w) = sum_v B_v f((Q Q^T A)_v)`` and ``Q Q^T A = A``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ggnchunk._windows import Windowed, dense

# the columns are replaced only where they become at most this share of the old count:
# the QR factors cost about what the columns save at a ratio of 1/3 (measured: an MLP
# autoencoder's 784 columns replaced by 256 below its head took its call from 0.22 s to
# 0.47 s, 1 thread; a vocabulary's 1,000 columns per token by 64 took 44 s to 16 s)
WORTH = 0.25

# what a cut's Gram factor may hold at once, in ``[N, D, D]`` float64 tensors: ``R``,
# fewer than ``D`` rows waiting, their concatenation and its QR's copy (two each), and
# the new ``R`` (:meth:`Cut.reserve_bytes`)
FACTOR_COPIES = 7

# a cut is taken where a column's sweep below it costs at least this many times ``D^2``
# multiply-adds per sample, ``D`` the entries per sample at the cut: the factor's folds
# cost 2-4 ``D^2`` float64 flops per column and sample (a QR of ``D + V`` rows per pass
# of ``V >= D`` columns, of ``2D`` rows per ``D`` rows added otherwise). Measured at 1
# thread: a segmenter-like model with two small convolutions below the cut (counted
# from shapes, :meth:`~.bound.MemoryBound.column_macs`) gained 1.9x at 2.75 ``D^2``
# (32x32 images, ``num_chunks=3``) and lost 3.6x at 0.69 ``D^2`` (64x64, 256 MiB:
# 5.8 s against 1.6 s); LRASPP's backbone costs 219 ``D^2``, an MLP autoencoder's
# encoder below its 32-wide bottleneck 408 ``D^2``
FOLD_COST = 1.0


def compressed(vectors: Tensor, carried: dict[int, Tensor] | None = None) -> Tensor | None:
    """Columns with the same per-sample Gram matrix as ``vectors``, where fewer.

    Args:
        vectors: ``[V, N, D]`` or ``[V, N, T, D]``: ``V`` columns for each of ``N``
            samples.
        carried: Per-column tensors ``[V, N, ...]`` of the same columns, replaced in
            place by their images ``[V', N, ...]`` where the columns are replaced.

    Returns:
        ``[V', N, *shape]`` with ``V' <= WORTH * V`` and, for every sample ``n``,
        ``sum_v out[v, n] out[v, n]^T == sum_v vectors[v, n] vectors[v, n]^T`` (up to
        rounding); ``None`` where no such columns are found (a column on several
        positions, or not enough fewer).
    """
    if vectors.dim() not in (3, 4) or not vectors.is_floating_point():
        return None  # features, or tokens' features; not maps (channels on axis 2)
    v = vectors.shape[0]
    if vectors.dim() == 3:  # one block: the features
        width = vectors.shape[2]
        if width > WORTH * v:
            return None
        whole = [torch.arange(v, device=vectors.device)]
        return _blocks(vectors.unsqueeze(2), whole, carried).squeeze(2)
    positions, width = vectors.shape[2:]
    if width > WORTH * v:  # no position can hold enough more columns than its width
        return None

    live = vectors.ne(0).any(dim=3).any(dim=1)  # [V, positions]; NaN counts as non-zero
    counts = live.sum(dim=1)
    if bool((counts > 1).any()):
        return None  # a column on several positions: its block is not one position's
    where = live.int().argmax(dim=1)
    where = torch.where(counts == 1, where, positions)  # zero columns: dropped
    groups = [torch.nonzero(where == p).flatten() for p in range(positions)]
    total = sum(min(len(g), width) for g in groups)
    if total > WORTH * v:
        return None
    if not total:  # every column zero (a loss linear in the output): one zero column
        for key, value in (carried or {}).items():
            carried[key] = value.new_zeros(1, *value.shape[1:])
        return vectors.new_zeros(1, *vectors.shape[1:])
    return _blocks(vectors, groups, carried)


def compressed_jointly(
    values: list[Any], carried: dict[int, Tensor] | None = None
) -> list[Tensor] | None:
    """Columns with the same per-sample Gram over every place the sweep holds, together.

    Where the sweep holds vectors at several places (a segmenter's two classifiers
    below the final resize, say), what it adds up later is a sum over columns of
    products of linear images of all of them at once: the Gram matrix of the
    concatenated vectors, per sample, is all that matters. Maps count here too: below
    a resize to the full image the columns (one per output pixel and class) span only
    the small map's directions, ``C·H·W`` of them per sample.

    The new columns are the rows of the columns' QR factor ``R`` (``R^T R`` is the
    Gram), rotated by its SVD and without the directions no column reaches (such as
    cross-entropy's per pixel; :func:`trimmed`), or, where the quantity carries
    per-column rows, ``R``'s own (``Q`` maps the rows too).

    Args:
        values: The vectors at each place, ``[V, N, ...]`` tensors or windowed blocks
            of the same columns and samples.
        carried: As for :func:`compressed`.

    Returns:
        The new vectors per place (``[V', N, ...]`` each, ``V' <= WORTH * V``, dense),
        or ``None`` where they are not enough fewer.
    """
    shapes = _shapes(values)
    if shapes is None:
        return None
    v, n = shapes[0][:2]
    widths = [math.prod(shape[2:]) for shape in shapes]
    if sum(widths) > WORTH * v:
        return None
    flat = torch.cat([dense(value).reshape(v, n, -1) for value in values], dim=2)
    if not flat.is_floating_point():
        return None
    if carried:  # their images need the columns' QR factor Q
        whole = [torch.arange(v, device=flat.device)]
        out = _blocks(flat.unsqueeze(2), whole, carried).squeeze(2)  # [V', N, D]
    else:  # R, without the directions no column reaches
        r = torch.linalg.qr(flat.double().transpose(0, 1), mode="r")[1]  # [N, k, D]
        out = trimmed(r, flat.dtype)
    parts = out.split(widths, dim=2)
    return [
        part.reshape(part.shape[0], n, *shape[2:])
        for part, shape in zip(parts, shapes, strict=True)
    ]


def trimmed(r: Tensor, dtype: torch.dtype) -> Tensor:
    """Columns with the Gram matrix ``r^T r`` per sample, none in a direction it lacks.

    The QR factor of the columns (not their Gram matrix) keeps directions whose
    singular values span many orders of magnitude (outputs in different units): a
    direction ``1e-8`` times the largest is lost in a float64 Gram's eigenvalues, not
    in ``R``'s singular values. Each of ``R``'s columns is scaled to norm 1 before its
    SVD (Householder QR is accurate column by column, so a coordinate ``1e17`` times
    smaller than another keeps its directions there); singular values at most
    ``D * eps`` times the largest, in every sample, add at most ``(D * eps)^2`` of the
    scaled Gram and are dropped.

    Args:
        r: ``[N, k, D]`` (float64), the columns' R factor per sample.
        dtype: The columns' dtype.

    Returns:
        ``[R, N, D]``, ``R <= min(k, D)``: the rows of ``S V^T diag(c)``
        (``r diag(c)^-1 = U S V^T``, ``c`` the norms of ``r``'s columns).
    """
    norms = torch.linalg.vector_norm(r, dim=1, keepdim=True)  # [N, 1, D]
    norms = torch.where(norms > 0, norms, torch.ones_like(norms))
    _, values, vh = torch.linalg.svd(r / norms, full_matrices=False)  # descending
    top = values[:, :1]
    tiny = values <= values.shape[1] * torch.finfo(values.dtype).eps * top
    keep = max(1, int((~tiny).sum(dim=1).max()))
    factor = values[:, :keep, None] * vh[:, :keep] * norms  # [N, R, D]
    return factor.transpose(0, 1).to(dtype).contiguous()


def _shapes(values: list[Any]) -> list[tuple[int, ...]] | None:
    """Every place's dense shape, where all hold vectors of the same columns and samples."""
    shapes = [_shape(value) for value in values]
    if not shapes or any(shape is None for shape in shapes):
        return None
    if any(shape[:2] != shapes[0][:2] for shape in shapes):
        return None
    return shapes


def _shape(value: Any) -> tuple[int, ...] | None:
    """A place's vectors' dense shape ``[V, N, ...]``, or ``None`` (not vectors)."""
    if isinstance(value, Windowed):
        return (*value.data.shape[:3], *value.size)
    if isinstance(value, Tensor) and value.dim() >= 3:
        return tuple(value.shape)
    return None


def _blocks(
    flat: Tensor, groups: list[Tensor], carried: dict[int, Tensor] | None = None
) -> Tensor:
    """Per position ``p``, the R factor of its columns ``groups[p]`` on it, per sample.

    Args:
        flat: ``[V, N, P, D]``.
        groups: For each position, the columns non-zero on it (on no other).
        carried: Per-column tensors ``[V, N, ...]``, replaced by ``Q^T`` of theirs
            (``Q``: each block's reduced QR factor, per sample).

    Returns:
        ``[sum_p min(len(groups[p]), D), N, P, D]``, each column on one position.
    """
    n, positions, width = flat.shape[1:]
    sizes = [min(len(g), width) for g in groups]
    out = flat.new_zeros(sum(sizes), n, positions, width)
    kept = {key: value.new_zeros(len(out), *value.shape[1:]) for key, value in
            (carried or {}).items()}  # fmt: skip
    start = 0
    for p, (group, size) in enumerate(zip(groups, sizes, strict=True)):
        if not size:
            continue
        block = flat[group, :, p].transpose(0, 1)  # [N, C, D]
        # float64 for the factor (a float32 QR's rounding is the columns' own size)
        if kept:
            q, r = torch.linalg.qr(block.double())  # [N, C, k], [N, k, D]
            for key, value in carried.items():
                mine = value[group].double()  # [C, N, ...]
                mapped = torch.einsum("nck,cnx->knx", q, mine.flatten(2))
                kept[key][start : start + size] = mapped.reshape(size, *value.shape[1:])
        else:
            r = torch.linalg.qr(block.double(), mode="r")[1]  # [N, min(C, D), D]
        out[start : start + size, :, p] = r.transpose(0, 1).to(flat.dtype)
        start += size
    if carried is not None:
        carried.update(kept)
    return out


def _factor_bytes(samples: int, width: int) -> int:
    """A cut's factor at most: :data:`FACTOR_COPIES` ``[N, D, D]`` float64 tensors.

    ``R``, fewer than ``D`` rows waiting, their concatenation and the QR's copy of it,
    and the new ``R``.
    """
    return FACTOR_COPIES * 8 * samples * width * width


class Cut:
    """Where a call's chunked sweeps stop, and the factor of every chunk's Gram there.

    A segmenter's columns (one per output pixel and class) span only its small maps'
    directions below the final resize, but a chunk of them has too few columns for
    :func:`compressed_jointly` to gain: a budget's passes each sweep the whole model.
    Over a call's chunks, though, the sweeps below such a place need only the Gram
    matrix of all the chunks' vectors there, per sample (their sum is a sum over
    columns, and what is added up below depends on the columns through it alone).

    So the call runs in two phases. The chunks' sweeps (phase one) stop before the
    first layer where the vectors at every place the sweep holds have at most
    :data:`WORTH` times as many entries per sample, together, as the columns that reach
    them over the call (the first sweep decides where; the later ones stop at the same
    place) and add their vectors to the Gram ``G_n = sum_v g_v g_v^T``, kept as its QR
    factor ``R_n`` (``[N, D, D]``, float64, ``R_n^T R_n = G_n``: the factor of the
    earlier ``R`` stacked on the rows added since, once there are ``D`` of them, which
    keeps directions whose scales differ by more than float64's square root, as a Gram
    matrix would not). A sweep's rows count once it has finished (:meth:`commit`): one
    that fails is retried in parts, which add them.
    Then the columns of a factor of it (at most ``D`` per sample, :func:`trimmed`) are
    swept from there to the inputs (phase two, in chunks of their own). Exact: the
    parts above the cut see every column once, the parts below see columns with the
    same Gram.

    Not used where the quantity carries per-column rows past the cut (a tied table's),
    which the Gram does not hold.

    Args:
        total: Columns the call's chunks cover.
        room: Bytes the factor may take with its folds (:meth:`reserve_bytes`;
            ``None``: no limit); a place whose factor needs more is not a cut.
        macs: ``macs(index)``: multiply-adds per column and sample of a sweep from
            before call ``index`` to the inputs (``None``: not weighed); a place whose
            factor's folds cost more (:data:`FOLD_COST`) is not a cut.
    """

    def __init__(
        self, total: int, room: int | None, macs: Callable[[int], int] | None = None
    ) -> None:
        self.total = total
        self.room = room
        self.macs = macs
        self.decided = False
        self.index: int | None = None  # the call before which the sweeps stop
        # (at layer outputs, key, shape after [V, N]) per place, in the places' order
        self.layout: list[tuple[bool, Any, tuple[int, ...]]] = []
        self.r: Tensor | None = None  # [N, k, D]: R^T R is the Gram of rows folded
        self.pending: list[Tensor] = []  # [N, V, D]: committed rows not folded yet
        self.fresh: Tensor | None = None  # the current sweep's rows (not committed)
        self.folded: Tensor | None = None  # or R with them folded in (not committed)
        self.columns: Tensor | None = None  # [R, N, D] after :meth:`factor`
        self.samples = self.width = 0  # N and D, once decided

    @property
    def on(self) -> bool:
        """Whether the sweeps stop at a place (decided by the first one)."""
        return self.index is not None

    def step(self, waiting: Any, call: Any, columns: int, carried: dict) -> Any:
        """Before a layer call in a phase-one sweep: stop here, or go on.

        Args:
            waiting: The sweep's waiting vectors (:class:`~.parts._Waiting`).
            call: The layer call next.
            columns: Columns of the sweep's seed.
            carried: The quantity's per-column tensors (see :func:`compressed`).

        Returns:
            :data:`~.traverse.STOP` where the sweep ends (its vectors added to the
            factor ``R``), else ``None``.
        """
        from ggnchunk._graph.traverse import STOP

        if self.decided and self.index != call.index:
            return None
        values = waiting.places()
        shapes = _shapes(values)
        if shapes is None:
            return None
        v, n = shapes[0][:2]
        places = [(True, key) for key in waiting.outs]
        places += [(False, key) for key in waiting.srcs]
        layout = [(o, k, s[2:]) for (o, k), s in zip(places, shapes, strict=True)]
        if self.decided:
            if layout != self.layout:  # (never seen) this sweep goes on to the inputs
                return None
            self._gather(values, v, n)
            return STOP
        width = sum(math.prod(shape[2:]) for shape in shapes)
        # columns reaching this place over the call: the seed's scaled by this chunk's
        # share (a per-token compression above may have made them fewer already)
        reaching = v * self.total / max(columns, 1)
        first = values[0].data if isinstance(values[0], Windowed) else values[0]
        if width > WORTH * reaching or not first.is_floating_point():
            return None
        if carried:  # a tied table's rows: not in the Gram
            self.decided = True
            return None
        if self.room is not None and _factor_bytes(n, width) > self.room:
            return None
        if self.macs is not None and FOLD_COST * width * width > self.macs(call.index):
            return None
        self._gather(values, v, n)
        self.decided, self.index, self.layout = True, call.index, layout
        self.samples, self.width = n, width
        return STOP

    def sweep_done(self) -> None:
        """A phase-one sweep ended: where the first did not stop, none does."""
        self.decided = True

    @torch.no_grad()
    def _gather(self, values: list[Any], v: int, n: int) -> None:
        # (no graph: vectors a rule made from a trainable weight carry one, and the
        # rows kept would keep every earlier pass's alive through it)
        flat = torch.cat([dense(value).reshape(v, n, -1) for value in values], dim=2)
        fresh = flat.double().transpose(0, 1)  # [N, V, D]
        del flat
        rows = sum(p.shape[1] for p in self.pending) + fresh.shape[1]
        if rows >= fresh.shape[2]:  # as many rows as R has columns: one QR for all
            self.folded = self._fold([*self.pending, fresh])
        else:
            self.fresh = fresh

    def commit(self) -> None:
        """The sweep that stopped here finished: its rows join the Gram.

        Rows are added only once their sweep has finished (its quantity's work done):
        a sweep that fails (out of memory) is retried in parts, which add them again.
        Never allocates (a failure here would come after the quantity's work).
        """
        if self.folded is not None:
            self.r, self.pending, self.folded = self.folded, [], None
        elif self.fresh is not None:
            self.pending.append(self.fresh)
            self.fresh = None

    def discard(self) -> None:
        """The sweep failed: its rows are dropped (its parts will add them)."""
        self.fresh = self.folded = None

    def _fold(self, rows: list[Tensor]) -> Tensor:
        """``R`` of the earlier ``R`` stacked on ``rows`` (a new tensor; none changed).

        Run once as many rows wait as ``R`` has columns, not every pass: a QR of
        ``[N, D + V, D]`` per pass of ``V << D`` columns took 29 s of a 33 s call.
        """
        if self.r is not None:
            rows = [self.r, *rows]
        stacked = rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)
        return torch.linalg.qr(stacked, mode="r")[1]

    def reserve_bytes(self) -> int:
        """What the Gram's factor takes at most, folds included, for the plan.

        Returns:
            Bytes (:func:`_factor_bytes`; 0 before the cut).
        """
        return _factor_bytes(self.samples, self.width) if self.on else 0

    def factor(self, dtype: torch.dtype) -> int:
        """Factor the Gram (once; ``R`` is freed): the number of phase-two columns.

        Args:
            dtype: The computation's dtype.

        Returns:
            ``R``: columns per sample of a factor ``C_n`` (``C_n C_n^T = G_n``); 0
            where no sweep stopped.
        """
        if self.columns is None and (self.r is not None or self.pending):
            with torch.no_grad():
                r = self._fold(self.pending) if self.pending else self.r
                self.r, self.pending = None, []
                self.columns = trimmed(r, dtype)
        return 0 if self.columns is None else self.columns.shape[0]

    def waiting(self, start: int, stop: int, images: Any) -> Any:
        """Phase two's vectors for factor columns ``start:stop``, at the cut's places.

        Args:
            start: First column.
            stop: One past the last.
            images: The recording's field cache (for the waiting vectors).

        Returns:
            A :class:`~.parts._Waiting` holding ``[stop - start, N, ...]`` per place.
        """
        from ggnchunk._graph.parts import _Waiting

        columns = self.columns[start:stop]
        v, n = columns.shape[:2]
        widths = [math.prod(shape) for _, _, shape in self.layout]
        waiting = _Waiting(images)
        for (at_output, key, shape), part in zip(
            self.layout, columns.split(widths, dim=2), strict=True
        ):
            store = waiting.outs if at_output else waiting.srcs
            waiting.add(store, key, part.reshape(v, n, *shape).clone(), fresh=True)
        return waiting
