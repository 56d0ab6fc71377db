r"""Windowed columns: each backpropagated column on the box where it can be non-zero.

A column of the loss Hessian's square root that is one-hot at an output pixel (MSE, BCE;
the classes of one pixel for cross-entropy) is non-zero, at every earlier layer, only
inside that pixel's receptive field. A :class:`Windowed` block carries a chunk's
vectors ``[V, N, C, *S]`` as ``data`` ``[V, N, C, *box]`` plus each column's box
``start`` (``[V, d]``, in the map's coordinates), one box size for all columns, so every
kernel stays batched. Entries of a box outside the map are kept at exactly zero.

Exactness never rests on guessing where values are: a block is made from dense vectors
by reading the extent of their non-zero entries (:func:`window`), and a rule that maps a
block computes every entry its box can reach. Where a box would cover most of the map,
or at a layer or glue without a windowed form, the block becomes dense
(:meth:`Windowed.dense`) and the sweep goes on as before; after glue, the dense vectors
are windowed again from their values.

A block's fields (dense maps per sample that a normalization over positions adds, see
:class:`Windowed`) do not depend on the chunk: the first sweep of a forward pass makes
their images (through each layer and glue, and their parameter products) and keeps them
in the recording's :class:`FieldCache`, so that later sweeps compute only the
coefficients.

``ENABLED`` switches the windowed path off (tests and benchmarks compare both); the
environment variable ``GGNCHUNK_WINDOWS=0`` does the same for a process.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

from ggnchunk._autograd import active_modes

__all__ = [
    "ENABLED",
    "Choice",
    "MAX_FILL",
    "FieldCache",
    "Windowed",
    "add",
    "dense",
    "end_of",
    "forget_choices",
    "gather",
    "resampled",
    "valid",
    "whole_cells",
    "window",
]

ENABLED = os.environ.get("GGNCHUNK_WINDOWS", "1") != "0"
"""Whether sweeps carry one-hot columns on boxes (internal switch)."""

MAX_FILL = 0.5
"""A box covering more than this share of its map ends the window (dense from there)."""

MIN_POSITIONS = 256
"""Outputs with fewer spatial positions sweep dense columns: on small maps the boxes
soon fill them, and windowing costs more than it saves (measured in issue 19's note)."""


class _Unions:
    """Blocks added on the union of their boxes, counted in the process.

    The only step whose box size can depend on where a column lies: two paths' boxes
    (a skip and a resampled path, say) are offset by the column's position modulo the
    paths' strides, so their union can be wider for some columns than for others. Every
    other windowed map sizes its box from the layers' geometry alone, the same for every
    column. The memory bound keeps a margin for alignment only where unions happened.
    One count for every thread: a sweep that sees the count change while it runs keeps
    the margin, whichever thread's union it was (never a union missed).
    """

    count = 0


UNIONS = _Unions()


TRIAL = True
"""Measure the first passes both ways and keep the faster path (off: always windows)."""

CLEARLY_SMALLER = 1 / 12
"""No trial where the first windowed pass's boxes held at most this share of the full
maps' elements at the layers' outputs (``Sweeps.windowed_share``): windows then win by
far (the tutorial autoencoder's 0.009, the 28x28 ``output_padding`` one's 0.069 and the
segmentation problem's 0.018 ran 4-90x faster windowed), and the trial's dense part
was most of a first call's excess over later calls (45 of the tutorial autoencoder's
60 ms). 0 always runs the trial."""


_DECIDED: OrderedDict[Hashable, bool] = OrderedDict()
"""Trials' outcomes by problem (model structure, loss, shapes, dtype, device, threads),
at most ``_DECIDED_SIZE``, least recently used first: later calls on the same problem
skip the trial, as the autotune cache lets them skip timing chunk sizes."""
_DECIDED_SIZE = 256


class Choice:
    """Whether a forward pass's sweeps carry windows: measured, not guessed.

    Both paths are exact; which is faster depends on the model (how soon the boxes fill
    the maps, how much glue there is). The first pass runs windowed (it pays the
    one-time caches); the second is the trial: a part of it (what a dense pass may hold
    under the budget, half the chunk at most) runs dense, and windows are timed at the
    size they run (the rest of the chunk), or on a part as large as the dense one where
    dense passes would run larger parts than the trial affords (time per column depends
    on the size); the path with the smaller time per column takes every later pass.
    The outcome is remembered under ``key``: a later call on the same problem starts
    from it and runs no trial.

    Args:
        key: The problem's key (``None``: nothing remembered).

    Attributes:
        choice: ``True`` (windows), ``False`` (dense) or ``None`` (not decided yet).
        passes: Windowed passes before the trial.
        remembered: Whether ``choice`` came from an earlier call's trial.
    """

    def __init__(self, key: Hashable | None = None) -> None:
        self.key = key
        self.choice: bool | None = None
        self.remembered = False
        if key is not None and key in _DECIDED:
            _DECIDED.move_to_end(key)
            self.choice, self.remembered = _DECIDED[key], True
        self.passes = 0

    @property
    def trial_next(self) -> bool:
        """Whether the next pass (of two columns or more) is the trial."""
        return TRIAL and self.choice is None and self.passes > 0

    def decide(self, windowed: float, dense: float) -> None:
        """Keep the path with the smaller time per column.

        Args:
            windowed: Seconds per column of the trial's windowed part.
            dense: Seconds per column of its dense part.
        """
        self.settle(windowed <= dense)

    def settle(self, windowed: bool) -> None:
        """Keep a path for the later passes (and later calls on the problem).

        Args:
            windowed: Whether they carry windows.
        """
        self.choice = windowed
        # a trial under a dispatch mode (every operation through Python) is not
        # remembered for plain calls: it times the mode as much as the paths
        if self.key is not None and not active_modes():
            _DECIDED[self.key] = self.choice
            _DECIDED.move_to_end(self.key)
            while len(_DECIDED) > _DECIDED_SIZE:
                _DECIDED.popitem(last=False)


def forget_choices() -> None:
    """Forget the trials' outcomes (``clear_autotune_cache`` calls it)."""
    _DECIDED.clear()


class Windowed:
    """Columns ``[V, N, C, *S]`` carried on one box per column, plus shared fields.

    The vectors are ``dense(data) + sum_k coeffs[v, n, k] * fields[k, n]``: a windowed
    part, and a few dense maps per sample (``fields``) that every column of the sample
    adds with its own coefficients. Normalizations over positions (GroupNorm) add them:
    their backward is local but for two directions per group that are the same for
    every column of a sample. The fields do not depend on the chunk (only the
    coefficients do): ``origin`` names where they were made and which maps moved them,
    so that a sweep can reuse them from the last one (:class:`FieldCache`).

    Args:
        data: ``[V, N, C, *box]``; entries outside the map are zero. The sample axis may
            be a stride-0 expansion (the same vectors for every sample).
        start: ``[V, d]`` (int64): each column's box start per spatial axis; may be
            negative or reach past the map.
        size: The map's spatial size ``S`` (``d`` entries).
        fields: ``[K, N, C, *S]``, or a function that makes them when they are first
            read (a rule's own fields, which a cached image may replace unmade), or
            ``None``.
        coeffs: ``[V, N, K]`` or ``None`` (with ``fields``).
        origin: A hashable key for the fields (the same key: the same maps in every
            sweep of the forward pass), or ``None`` where it is not known.
    """

    __slots__ = ("_fields", "coeffs", "data", "origin", "size", "start")

    def __init__(
        self, data: Tensor, start: Tensor, size: tuple[int, ...],
        fields: Tensor | Callable[[], Tensor] | None = None, coeffs: Tensor | None = None,
        origin: Hashable | None = None,
    ):  # fmt: skip
        self.data = data
        self.start = start
        self.size = tuple(size)
        self._fields = fields
        self.coeffs = coeffs
        self.origin = origin

    @property
    def fields(self) -> Tensor | None:
        """``[K, N, C, *S]`` or ``None`` (made now if they were left to be made)."""
        if callable(self._fields):
            self._fields = self._fields()
        return self._fields

    @property
    def has_fields(self) -> bool:
        """Whether the block has fields (made or not)."""
        return self._fields is not None

    @property
    def box(self) -> tuple[int, ...]:
        """The box size per spatial axis."""
        return tuple(self.data.shape[3:])

    @property
    def shape(self) -> torch.Size:
        """The dense shape ``[V, N, C, *S]``."""
        return torch.Size((*self.data.shape[:3], *self.size))

    @property
    def sample_free(self) -> bool:
        """The same windowed vectors for every sample (a stride-0 sample axis)."""
        return self.data.shape[1] > 1 and self.data.stride(1) == 0

    def fill(self) -> float:
        """The share of the map one box covers."""
        return math.prod(self.box) / max(math.prod(self.size), 1)

    def valid(self) -> Tensor:
        """``[V, 1, 1, *box]`` (bool): the box entries inside the map."""
        return valid(self.start, self.box, self.size)

    def windowed_part(self) -> Windowed:
        """The block without its fields."""
        if not self.has_fields:
            return self
        return Windowed(self.data, self.start, self.size)

    def dense(self) -> Tensor:
        """The block as dense vectors ``[V, N, C, *S]`` (fields included).

        Returns:
            A new tensor (a stride-0 sample axis stays one where there are no fields).
        """
        out = self._dense_data()
        if self.has_fields:
            if not out.is_contiguous() or out.shape[1] != self.fields.shape[1]:
                return out + mix(self.coeffs, self.fields)  # stride-0 samples
            mix(self.coeffs, self.fields, into=out)  # a new tensor: added in place
        return out

    def add_to(self, out: Tensor) -> Tensor:
        """Add the block (fields included) into dense vectors ``out``, in place.

        Args:
            out: ``[V, N, C, *S]``, a tensor the caller owns (no stride-0 axis).

        Returns:
            ``out``.
        """
        # the sweep's vectors carry no graph; ``out`` may be a view autograd made in its
        # backward (F.pad's gradient is a slice), which torch forbids writing into in
        # place under grad mode
        with torch.no_grad():
            if self.has_fields:
                mix(self.coeffs, self.fields, into=out)
            self._scatter_data(out.view(*out.shape[:3], -1))
        return out

    def _dense_data(self) -> Tensor:
        v, n, c = self.data.shape[:3]
        samples = 1 if self.sample_free else n
        out = self.data.new_zeros(v, samples, c, *self.size)
        self._scatter_data(out.view(v, samples, c, -1))
        return out.expand(v, n, *out.shape[2:]) if self.sample_free else out

    def _scatter_data(self, target: Tensor) -> None:
        """Add the windowed part into ``target`` ``[V, N or 1, C, prod(S)]``, in place."""
        data = self.data[:, :1] if self.sample_free else self.data
        v, samples, c = target.shape[:3]
        index, inside = _positions(self.start, self.box, self.size)  # [V, Pb]
        flat = data.reshape(v, data.shape[1], c, -1)
        flat = flat * inside.view(v, 1, 1, -1).to(flat.dtype)  # stay inside the map
        flat = flat.expand(v, samples, c, flat.shape[3])
        target.scatter_add_(3, index.view(v, 1, 1, -1).expand_as(flat), flat)

    def rebox(self, start: Tensor, box: tuple[int, ...]) -> Windowed:
        """The windowed part on other boxes (entries outside the old box are zero).

        Args:
            start: ``[V, d]`` new box starts.
            box: New box size.

        Returns:
            The block on the new boxes (fields as they are).
        """
        if tuple(box) == self.box and torch.equal(start, self.start):
            return self
        data = gather(self.data, start - self.start, box, self.box)
        return Windowed(data, start, self.size, self._fields, self.coeffs, self.origin)

    def expanded(self, samples: int) -> Windowed:
        """The block with a one-sample axis expanded (stride 0) to ``samples``.

        Args:
            samples: ``N``.

        Returns:
            The same vectors for every sample.
        """
        data = self.data.expand(self.data.shape[0], samples, *self.data.shape[2:])
        return Windowed(data, self.start, self.size, self._fields, self.coeffs, self.origin)

    def with_data(self, data: Tensor) -> Windowed:
        """The same boxes with other values (``[V, N, C', *box]``), without fields.

        Args:
            data: The values.

        Returns:
            A block on the same boxes.
        """
        return Windowed(data, self.start, self.size)


class FieldCache:
    """The fields' images of one forward pass, reused by all its sweeps.

    A block's fields are dense maps that do not depend on the chunk: made by a
    normalization, moved by every map the sweep crosses, turned into each layer's
    per-sample products. Each such result is kept here under a key that names what
    made it (:attr:`Windowed.origin`), so later sweeps compute only the coefficient
    side. The cache never holds more than :attr:`capacity` bytes (what the memory
    bound reserved for it; a result that does not fit is made again each time), keeps
    nothing while disabled (lean passes), and is emptied by :meth:`clear`.

    Attributes:
        capacity: Most bytes held (``None``: not planned, no limit).
        limit: Most bytes :meth:`plan` may give (a budget's share; ``None``: none).
        enabled: Whether results are kept.
        made: Results computed (each a propagation or product of fields).
        reused: Results taken from the cache instead.
    """

    def __init__(self) -> None:
        self._images: dict[Hashable, Any] = {}
        self._held = 0
        self.capacity: int | None = None
        self.limit: int | None = None
        self.frozen = False
        self.enabled = True
        self.made = 0
        self.reused = 0
        self.dropped = 0  # results made but not kept (no key, over capacity, disabled)

    @property
    def complete(self) -> bool:
        """Whether every result the sweeps asked for so far is held.

        Frozen after a sweep whose boxes follow the layers' geometry (the same keys in
        every sweep), a complete cache means later sweeps move no fields at all: their
        images are all held.
        """
        return self.frozen and self.enabled and self.dropped == 0

    @staticmethod
    def key(*parts: Hashable, block: Windowed | None = None) -> Hashable | None:
        """The key of a result made from ``block``'s fields by ``parts``.

        Args:
            *parts: What makes the result (a kind and a place).
            block: The block whose fields are mapped (``None``: no incoming fields).

        Returns:
            ``(*parts, block.origin)``, or ``None`` where the block's fields have no
            known origin (the result is then never kept).
        """
        if block is None or not block.has_fields:
            return parts
        if block.origin is None:
            return None
        return (*parts, block.origin)

    def get(self, key: Hashable | None, make: Callable[[], Any]) -> Any:
        """The result under ``key``, made (and kept where it fits) if not held.

        Args:
            key: From :meth:`key` (``None``: made, never kept).
            make: Makes the result (a tensor, or a tuple or dict of tensors); results
                are shared, so nothing may change them in place.

        Returns:
            The result.
        """
        if key is not None and key in self._images:
            self.reused += 1
            return self._images[key]
        value = make()
        self.made += 1
        kept = False
        if key is not None and self.enabled:
            size = _nbytes(value)
            if self.capacity is None or self._held + size <= self.capacity:
                self._images[key] = value
                self._held += size
                kept = True
        self.dropped += not kept
        return value

    @property
    def held_bytes(self) -> int:
        """Bytes of the results held now."""
        return self._held

    def plan(self, wanted: int) -> None:
        """Reserve ``wanted`` bytes, at most :attr:`limit` (not once frozen).

        Args:
            wanted: Bytes the results could need (an estimate).
        """
        if not self.frozen:
            self.capacity = wanted if self.limit is None else min(wanted, self.limit)

    def unbuilt_bytes(self) -> int:
        """Bytes the cache may still add (what the memory bound counts beyond use)."""
        if not self.enabled:
            return 0
        return max(0, (self.capacity or 0) - self._held)

    def freeze(self) -> None:
        """Keep what is held and nothing more (after a sweep: its keys recur)."""
        self.capacity = self._held
        self.frozen = True

    def set_enabled(self, enabled: bool) -> None:
        """Keep results, or keep none (and drop those held).

        Args:
            enabled: Whether results are kept.
        """
        self.enabled = enabled
        if not enabled:
            self.clear()

    def clear(self) -> None:
        """Drop every result held."""
        self._images.clear()
        self._held = 0


def _nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, tuple or dict), storages once."""
    stack, seen, total = [value], set(), 0
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, Tensor):
            ptr = item.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += item.untyped_storage().nbytes()
    return total


def mix(coeffs: Tensor, fields: Tensor, into: Tensor | None = None) -> Tensor:
    """``sum_k coeffs[v, n, k] * fields[k, n, ...]``, or that added into ``into``.

    One batched product per sample written straight into ``[V, N, ...]`` order: the
    product's own ``[N, V, ...]`` result, transposed, made every later addition a
    strided one (4x slower than the product on the U-Net's 16x32x32 maps).

    Args:
        coeffs: ``[V, N, K]``.
        fields: ``[K, N, ...]``.
        into: ``[V, N, ...]`` to add into, in place (contiguous), or ``None``.

    Returns:
        ``[V, N, ...]``, contiguous: ``into`` itself where given.
    """
    k, n = fields.shape[:2]
    flat = fields.reshape(k, n, -1)
    v = coeffs.shape[0]
    if into is not None and (into.shape[1] != n or not into.is_contiguous()):
        into += mix(coeffs, fields)  # broadcast over samples, or strided
        return into
    out = coeffs.new_empty(v, n, flat.shape[2]) if into is None else into.view(v, n, -1)
    beta = 0 if into is None else 1  # 0: the empty tensor's contents are ignored
    if n == 1:
        out[:, 0].addmm_(coeffs[:, 0], flat[:, 0], beta=beta)
    else:  # one product per sample: [N, V, K] @ [N, K, F], into [V, N, F] transposed
        coeffs = coeffs.expand(v, n, k)  # the same coefficients for every sample
        out.transpose(0, 1).baddbmm_(
            coeffs.transpose(0, 1), flat.transpose(0, 1), beta=beta
        )
    return out.view(v, n, *fields.shape[2:]) if into is None else into


def attach(
    back: Windowed | Tensor | None, fields: Tensor | None, coeffs: Tensor | None,
    origin: Hashable | None = None,
) -> Windowed | Tensor | None:  # fmt: skip
    """Mapped vectors with (mapped) fields added back: ``back + sum_k coeffs fields``.

    Args:
        back: A block without fields, dense vectors, or ``None`` (nothing reached).
        fields: ``[K, N, ...]`` or ``None``.
        coeffs: ``[V, N, K]`` or ``None``.
        origin: The fields' key (:attr:`Windowed.origin`).

    Returns:
        A block, or dense vectors.
    """
    if fields is None or back is None:
        return back
    if not isinstance(back, Windowed):
        return back + mix(coeffs, fields)
    n = max(back.data.shape[1], fields.shape[1])
    coeffs = coeffs.expand(coeffs.shape[0], n, coeffs.shape[2])
    return Windowed(back.data, back.start, back.size, fields, coeffs, origin)


def joined(
    parts: list[Windowed], cache: FieldCache | None = None, key: Hashable | None = None
) -> tuple[Tensor | None, Tensor | None, Hashable | None]:
    """The fields and coefficients of blocks added together.

    Fields whose coefficients are the same numbers add up into one field (exact:
    ``a f + a g = a (f + g)``). Where branches meet after a residual block, one branch
    carries the fields ``F`` with coefficients ``C`` and the other their images with the
    same ``C`` (then those its own norms added): those are summed, so the count of fields
    grows by what the block's norms add, not twice per block. Other fields are joined
    side by side.

    Args:
        parts: Blocks (those without fields add nothing).
        cache: Where the joined fields are kept (``None``: joined every time).
        key: Their key in ``cache`` (``None``: from the parts' origins and how they
            were joined).

    Returns:
        ``(fields [K, N, ...], coeffs [V, N, K], origin)``, or ``None`` three times.
    """
    parts = [p for p in parts if p.has_fields]
    if not parts:
        return None, None, None
    if len(parts) == 1:
        return parts[0].fields, parts[0].coeffs, parts[0].origin
    # how each part joins those before it: ("shared", k) when the first k
    # coefficients of one side are the other side's exactly, else ("apart", 0)
    steps, coeffs, shape = [], parts[0].coeffs, parts[0].fields.shape[1:]
    for part in parts[1:]:
        step = ("apart", 0)
        if part.fields.shape[1:] == shape:
            step = _shared(coeffs, part.coeffs)
        steps.append(step)
        if step[0] == "shared":
            coeffs = _wider(coeffs, part.coeffs)
        else:
            coeffs = joined_coeffs([coeffs, part.coeffs])
    if key is None and all(p.origin is not None for p in parts):
        key = ("joined", tuple(steps), *(p.origin for p in parts))

    def make() -> Tensor:
        fields = parts[0].fields
        for part, (how, k) in zip(parts[1:], steps, strict=True):
            if how == "apart":
                fields = torch.cat([fields, part.fields])
                continue
            wide, narrow = (
                (part.fields, fields) if part.fields.shape[0] >= fields.shape[0]
                else (fields, part.fields)
            )  # fmt: skip
            fields = torch.cat([wide[:k] + narrow, wide[k:]])
        return fields

    fields = make() if cache is None else cache.get(key, make)
    return fields, coeffs, key


def _shared(a: Tensor, b: Tensor) -> tuple[str, int]:
    """How two coefficient tensors join: ``("shared", k)`` or ``("apart", 0)``.

    Shared where the narrower ``[V, N, k]`` equals the first ``k`` of the wider
    exactly, for every column and sample.
    """
    k = min(a.shape[2], b.shape[2])
    if a.shape[0] != b.shape[0]:
        return ("apart", 0)
    n = max(a.shape[1], b.shape[1])
    left = a[:, :, :k].expand(a.shape[0], n, k)
    right = b[:, :, :k].expand(b.shape[0], n, k)
    return ("shared", k) if torch.equal(left, right) else ("apart", 0)


def _wider(a: Tensor, b: Tensor) -> Tensor:
    """The wider of two coefficient tensors whose common prefix is equal."""
    wide = a if a.shape[2] >= b.shape[2] else b
    n = max(a.shape[1], b.shape[1])
    return wide.expand(wide.shape[0], n, wide.shape[2])


def joined_coeffs(coeffs: list[Tensor]) -> Tensor:
    """Coefficients of joined fields: ``[V, N, K_1 + K_2 + ...]`` (in that order).

    Args:
        coeffs: ``[V, N or 1, K_i]`` each.

    Returns:
        Them side by side (one-sample axes expanded).
    """
    if len(coeffs) == 1:
        return coeffs[0]
    n = max(c.shape[1] for c in coeffs)
    return torch.cat([c.expand(c.shape[0], n, c.shape[2]) for c in coeffs], 2)


def valid(start: Tensor, box: tuple[int, ...], size: tuple[int, ...]) -> Tensor:
    """``[V, 1, 1, *box]`` (bool): which entries of each column's box are in the map.

    Args:
        start: ``[V, d]`` box starts.
        box: Box size.
        size: The map's spatial size.

    Returns:
        The mask.
    """
    inside = _positions(start, tuple(box), tuple(size))[1]
    return inside.view(start.shape[0], 1, 1, *box)


def _positions(
    start: Tensor, box: tuple[int, ...], size: tuple[int, ...]
) -> tuple[Tensor, Tensor]:
    """Flat map index of every box entry (clamped into the map) and whether it is inside.

    Returns:
        ``([V, prod(box)] int64, [V, prod(box)] bool)``.
    """
    v, dims = start.shape[0], len(box)
    index = torch.zeros((v, *box), dtype=torch.int64, device=start.device)
    inside = torch.ones((v, *box), dtype=torch.bool, device=start.device)
    stride = 1
    for d in reversed(range(dims)):
        coord = start[:, d : d + 1] + torch.arange(box[d], device=start.device)
        ok = (coord >= 0) & (coord < size[d])
        shape = [v] + [1] * dims
        shape[1 + d] = box[d]
        index = index + (coord.clamp(0, size[d] - 1) * stride).view(shape)
        inside = inside & ok.view(shape)
        stride *= size[d]
    return index.view(v, -1), inside.view(v, -1)


def gather(
    values: Tensor, start: Tensor, box: tuple[int, ...], size: tuple[int, ...]
) -> Tensor:
    """Boxes of a map, per column: zero where a box leaves the map.

    Args:
        values: ``[N, C, *size]`` (one map for every column) or ``[V, N, C, *size]``.
        start: ``[V, d]`` box starts in the map's coordinates.
        box: Box size.
        size: The map's spatial size.

    Returns:
        ``[V, N, C, *box]``.
    """
    v = start.shape[0]
    if values.dim() == len(size) + 2:  # one map: its boxes at every start, then pick
        return _boxes_of_one_map(values, start, tuple(box), tuple(size))
    index, inside = _positions(start, tuple(box), tuple(size))
    pb = index.shape[1]
    n, c = values.shape[1:3]
    free = n > 1 and values.stride(1) == 0
    flat = values[:, :1] if free else values
    flat = flat.reshape(v, flat.shape[1], c, -1)
    out = torch.gather(flat, 3, index.view(v, 1, 1, pb).expand(v, flat.shape[1], c, pb))
    if free:
        out = out.expand(v, n, c, pb)
    if not bool(inside.all()):
        out = out * inside.view(v, 1, 1, pb).to(out.dtype)
    return out.reshape(v, out.shape[1], c, *box)


def _boxes_of_one_map(
    values: Tensor, start: Tensor, box: tuple[int, ...], size: tuple[int, ...]
) -> Tensor:
    """:func:`gather` of one map ``[N, C, *size]``: one column index per box entry.

    The map is zero-padded by what the boxes reach outside it (no mask of the entries
    outside), flattened per channel, and every box's entries picked by one
    ``index_select`` of their flat offsets: 2-8x faster than indexing a strided view
    of every box (``unfold``), whose copy ran element by element.
    """
    dims = len(size)
    low = [max(0, -int(start[:, d].min())) for d in range(dims)]
    high = [max(0, int(start[:, d].max()) + box[d] - size[d]) for d in range(dims)]
    pad = [p for d in reversed(range(dims)) for p in (low[d], high[d])]
    padded = torch.nn.functional.pad(values, pad) if any(pad) else values
    shift = torch.tensor(low, device=start.device)  # every box inside the padded map
    index, _ = _positions(start + shift, box, tuple(padded.shape[2:]))
    index = index.reshape(-1)  # [V * prod(box)]
    n, c = values.shape[:2]
    picked = padded.reshape(n * c, -1).index_select(1, index)
    v = start.shape[0]  # [N, C, V, Pb] to [V, N, C, Pb]: a 4-d copy (a 5-d one is slower)
    return picked.view(n, c, v, -1).movedim(2, 0).reshape(v, n, c, *box)


def window(values: Tensor) -> Windowed | Tensor:
    """Dense vectors ``[V, N, C, *S]`` on boxes read from their non-zero entries.

    Exact: every entry outside a column's box is zero. Stays dense where the boxes would
    cover more than :data:`MAX_FILL` of the map, or there are no spatial axes.

    Args:
        values: ``[V, N, C, *S]``.

    Returns:
        A :class:`Windowed` block, or ``values`` itself.
    """
    if not isinstance(values, Tensor) or values.dim() < 4:
        return values
    v, n = values.shape[:2]
    size = tuple(values.shape[3:])
    free = n > 1 and values.stride(1) == 0
    probe = values[:, :1] if free else values
    nonzero = (probe != 0).flatten(1, 2).any(1)  # [V, *S]
    dims = len(size)
    starts, box = [], []
    for d in range(dims):
        others = [1 + e for e in range(dims) if e != d]
        hit = nonzero.any(others) if others else nonzero  # [V, S_d]
        idx = torch.arange(size[d], device=values.device)
        first = torch.where(hit, idx, size[d]).min(1).values
        last = torch.where(hit, idx, -1).max(1).values
        empty = last < first
        first = torch.where(empty, 0, first)
        last = torch.where(empty, 0, last)
        length = int((last - first + 1).max()) if v else 1
        # shift boxes inward so that they stay inside the map
        starts.append(first.clamp(max=size[d] - length))
        box.append(length)
    if math.prod(box) > MAX_FILL * math.prod(size):
        return values
    start = torch.stack(starts, 1).to(torch.int64)
    return Windowed(gather(values, start, tuple(box), size), start, size)


def dense(value: Any) -> Any:
    """Dense vectors for a :class:`Windowed` block; anything else as it is.

    Args:
        value: A block, a tensor or ``None``.

    Returns:
        ``value.dense()`` for a block, else ``value``.
    """
    return value.dense() if isinstance(value, Windowed) else value


def add(
    old: Any, value: Any, cache: FieldCache | None = None,
    owned: Callable[[Tensor], bool] | None = None,
) -> Any:  # fmt: skip
    """Vectors meeting at one place, added (a block on the union of both boxes).

    Args:
        old: A block or tensor.
        value: A block or tensor.
        cache: Where the joined fields are kept (:func:`joined`).
        owned: Whether a dense side (``old`` or ``value``) may be written into in
            place; by default neither is (a block is added into a copy).

    Returns:
        Their sum.
    """
    if isinstance(old, Windowed) and isinstance(value, Windowed):
        lo = torch.minimum(old.start, value.start)
        hi = torch.maximum(
            old.start + torch.tensor(old.box, device=lo.device),
            value.start + torch.tensor(value.box, device=lo.device),
        )
        box = tuple(int(b) for b in (hi - lo).max(0).values.tolist())
        UNIONS.count += 1
        if math.prod(box) <= MAX_FILL * math.prod(old.size):
            a, b = old.rebox(lo, box), value.rebox(lo, box)
            fields, coeffs, origin = joined([a, b], cache)
            summed = Windowed(a.data + b.data, lo, old.size)
            return attach(summed, fields, coeffs, origin)
    if isinstance(value, Windowed) or isinstance(old, Windowed):
        # one map allocated, not three: the other side as a new tensor, the block
        # added into it in place
        base, block = (old, value) if isinstance(value, Windowed) else (value, old)
        fresh = isinstance(base, Windowed)
        base = dense(base)
        if base.shape == block.shape and base.dtype == block.data.dtype:
            if not fresh and not (
                owned is not None and base.is_contiguous() and owned(base)
            ):
                base = base.clone(memory_format=torch.contiguous_format)
            elif not base.is_contiguous():  # a stride-0 sample axis, say
                base = base.contiguous()
            return block.add_to(base)
    return dense(old) + dense(value)


def end_of(value: Any, fill: float = MAX_FILL) -> Windowed | Tensor:
    """A rule's windowed result, dense if its box covers more than ``fill`` of the map.

    Args:
        value: A block.
        fill: The largest share of the map a box may cover.

    Returns:
        The block, or its dense vectors.
    """
    if isinstance(value, Windowed) and value.fill() > fill:
        return value.dense()
    return value


def resampled(block: Windowed, matrices: tuple[Tensor, ...], shape: Any = None) -> Any:
    """A block through a separable resize's backward: per axis, the matrix's box rows.

    Args:
        block: Vectors at the resize's output.
        matrices: One ``[out, in]`` matrix per spatial axis (the resize is their
            product, axis by axis).
        shape: The input's shape, checked against the matrices (``None``: not checked).

    Returns:
        The vectors at the input: one box size for all columns, the widest input range
        any run of the box's rows reaches.
    """
    data, starts, sizes = block.data, [], []
    for axis, a in enumerate(matrices):  # a: [out, in]
        a = a.to(data.dtype)
        b = block.box[axis]
        lo, hi = _row_ranges(a)
        width = _widest(lo, hi, b, a.shape[0])
        s = block.start[:, axis]
        rows = s[:, None] + torch.arange(b, device=s.device)  # [V, b]
        inside = (rows >= 0) & (rows < a.shape[0])
        clamped = rows.clamp(0, a.shape[0] - 1)
        first = torch.where(inside, lo[clamped], a.shape[1]).min(1).values
        first = torch.where(first >= a.shape[1], 0, first)  # an empty box
        cols = first[:, None] + torch.arange(width, device=s.device)  # [V, width]
        ok = (cols >= 0) & (cols < a.shape[1])
        sub = a[clamped[:, :, None], cols.clamp(0, a.shape[1] - 1)[:, None, :]]
        sub = sub * (inside[:, :, None] & ok[:, None, :]).to(sub.dtype)  # [V, b, w]
        # contract the axis: [V, ..., b, ...] with [V, b, w]
        moved = data.movedim(3 + axis, -1)
        lead = moved.shape[1:-1]
        flat = moved.reshape(moved.shape[0], -1, b)
        if flat.stride(1) == 0 or not flat.is_contiguous():
            flat = flat.contiguous()
        res = torch.bmm(flat, sub).reshape(moved.shape[0], *lead, width)
        data = res.movedim(-1, 3 + axis)
        starts.append(first)
        sizes.append(a.shape[1])
    out = Windowed(data, torch.stack(starts, 1), tuple(sizes))
    if shape is not None and tuple(shape[2:]) != tuple(sizes):
        raise RuntimeError("ggnchunk: a resize's matrices do not match (internal error)")
    return end_of(out, MAX_FILL)


def _row_ranges(a: Tensor) -> tuple[Tensor, Tensor]:
    """Per output row: the first input column it reads and one past the last."""
    nz = a != 0
    idx = torch.arange(a.shape[1], device=a.device)
    lo = torch.where(nz, idx, a.shape[1]).min(1).values
    hi = torch.where(nz, idx + 1, 0).max(1).values
    return lo, hi


def _widest(lo: Tensor, hi: Tensor, b: int, out: int) -> int:
    """The widest input range ``b`` consecutive output rows read, at any position."""
    best = 1
    for a0 in range(-(b - 1), out):
        r0, r1 = max(a0, 0), min(a0 + b, out) - 1
        if r1 < r0:
            continue
        first = int(lo[r0 : r1 + 1].min())
        last = int(hi[r0 : r1 + 1].max())
        if last > first:
            best = max(best, last - first)
    return best


def whole_cells(block: Windowed, factors: tuple[int, ...]) -> tuple[Windowed, Tensor]:
    """The block on its boxes widened to whole cells of ``factors`` positions per axis.

    ``b`` positions starting anywhere lie in at most ``(b + f - 2) // f + 1`` cells of
    ``f``: one box size for every column (nearest upsampling's and ``pixel_shuffle``'s
    backward sum or regroup each cell).

    Args:
        block: Vectors on boxes of a map whose axes are ``factors`` times a grid's.
        factors: Positions per cell along each spatial axis.

    Returns:
        ``(block on the cells' boxes, [V, d] first cell per column)``; the box holds
        ``(b + f - 2) // f + 1`` cells along each axis.
    """
    f = torch.tensor(factors, device=block.start.device)
    cells = torch.div(block.start, f, rounding_mode="floor")
    box = tuple(((b + k - 2) // k + 1) * k for k, b in zip(factors, block.box, strict=True))
    return block.rebox(cells * f, box), cells
