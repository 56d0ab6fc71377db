"""Readers of the glue's parameters: every sample's products off one backward pass.

A parameter used in the glue (not by a layer with a rule) needs its products per sample,
``[V, N, *param]``: a batch reduction would mix the samples before the square. Taken one
sample at a time, each a backward pass through the whole region with the other samples'
vectors zero, they cost ``N`` times the region per chunk: 21.7 s of a 23.3 s call on
torchvision's ViT at 32 images (``nn.MultiheadAttention``'s projections are glue).

Instead the engine looks at the nodes that read each parameter (its *readers*) and takes
the gradients at their outputs in one pass, for all samples at once:

- :class:`Broadcast`: the parameter broadcast against the output (``x + pos``,
  ``cls.expand(N, ...)``, a layer scale ``gamma * h``, ``alpha`` of an addition, a bias
  of ``addmm``, the affine weight and bias of a functional layer or group norm): each
  sample's gradient is its positions' gradients, scaled (by ``alpha``, the other factor,
  or the norm's normalized input) and summed to the parameter's shape.
- :class:`Product`: the parameter as the right factor of a matrix product
  (``rows @ W.T`` in ``F.linear``'s ``mm``/``addmm``): each sample's gradient is the sum
  over its rows of the outer products of the rows' gradients and the rows.
- :class:`~ggnchunk._autograd.Gather`: an embedding lookup: its rows' gradients added
  into the table per sample.
- :class:`ConvWeight`: the weight of a convolution in the glue (``F.conv2d(x, w)``,
  ``F.conv_transpose1d(x, w)``, a layer whose weight is computed in ``forward``): each
  sample's weight gradient, all
  samples and columns in one grouped ``convolution_backward`` (the samples as groups).
  Where the weight is computed from parameters alone (timm's ``StdConv2d`` weight
  standardization, weight and spectral norm), the products are carried back to those
  parameters through the recorded computation, batched over columns and samples:
  every sample reads the same weight, so the map from the weight to the parameters is
  the same for all of them.

Views that keep the elements' order (``gamma.reshape(1, -1, 1, 1)``) and a transpose of
a matrix (``W.T``) between the parameter and its reader are followed. So are parts of a
parameter (slices, selections, splits: ``pos[:, :T]``, ``w.chunk(3)[k]``) and views that
reorder it (permutations and transposes: ``torch.einsum`` permutes a weight before one
``bmm``, read as a matrix product; :class:`Placed`): each element read is one element
of the parameter, so the products are put at their places. A table's rows gathered in
the glue (``table[position_ids]``, folded by :mod:`ggnchunk._glue_kernels`) are a lookup.

Which positions of a reader's output belong to which sample cannot be read off shapes
(a sequence-first ``[T, N, D]`` with ``T == N`` looks batch-first;
``nn.MultiheadAttention`` flattens ``[T, N, E]`` into ``T·N`` rows). So it is proven on
the recorded graph, once per glue region (:func:`sample_strides`): random vectors from
the samples whose bit ``b`` of the index is 1, and then 0, for every bit (``2⌈log₂ N⌉``
vectors), are backpropagated to every reader. A position reached from both halves of a
bit mixes samples (the reader falls back); otherwise the halves that reach it spell its
sample's index. The readers are used where the map is ``sample(f) = (f // s) % N`` over
the flattened output for some stride ``s`` (a samples' axis, or rows grouped by sample);
positions no vector reaches have a zero gradient for every column. A region whose proof
and products would cross it about as often as one pass per sample (a small batch in few
passes) keeps the passes per sample (:func:`ggnchunk._graph.checks._worth_it`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Union

import torch
from torch import Tensor

from ggnchunk import _glue_kernels
from ggnchunk._autograd import (
    EdgeKey,
    Gather,
    GradientEdge,
    Node,
    accumulated_variable,
    batched_grad,
    blocked,
    edge_key,
    edge_numel,
    gather_of,
    grad_shape,
    output_count,
    saved_value,
)
from ggnchunk._glue_kernels import folded_conv, folded_product, folded_rows

if TYPE_CHECKING:
    from ggnchunk._graph.parts import _Source

__all__ = [
    "Broadcast",
    "ConvWeight",
    "Placed",
    "Product",
    "Reader",
    "computed_weight",
    "param_behind",
    "part_behind",
    "read_behind",
    "read_by",
    "read_part",
    "reader_groups",
    "reader_room",
    "release",
    "sample_strides",
    "shared_edges",
]


def _param_index(
    aligned: torch.Size, out: torch.Size, stride: int, samples: int, first: int, count: int
) -> Tensor:
    """The parameter's flat index at the output positions of some samples.

    Samples ``first`` to ``first + count - 1`` (at most the last), ``[count · F / N]``.
    """
    count = min(count, samples - first)
    blocks = out.numel() // (samples * stride)
    base = torch.arange(blocks)[:, None] * (samples * stride)
    base = base + (first + torch.arange(count))[:, None, None] * stride
    position = (base + torch.arange(stride)).reshape(-1)  # [count, blocks, stride]
    index = torch.zeros_like(position)
    step = 1
    for size, read in zip(reversed(out), reversed(aligned), strict=True):
        if read != 1:  # read along this axis: its coordinate counts
            index += (position % size) * step
            step *= size
        position = position // size
    return index


@dataclass(frozen=True)
class Broadcast:
    """A node reading a parameter broadcast against its output (see the module)."""

    edge: GradientEdge  # the node's output: where the gradient is taken
    aligned: torch.Size  # the parameter's shape as read, left-padded with ones to out's
    param: torch.Size
    dtype: torch.dtype
    scale: float = 1.0
    # the other factor of a product, or a norm's normalized input (made when asked)
    factor: Tensor | Callable[[], Tensor] | None = None
    # the index of one sample's positions by stride: read in every pass (kept as long
    # as the recording)
    _indices: dict[tuple[int, int], Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )

    def fits(self, out: torch.Size, stride: int, samples: int) -> bool:
        """Whether the parameter's index is the same for every sample at this stride."""
        first = _param_index(self.aligned, out, stride, samples, 0, 1)
        chunk = max(1, (1 << 20) // max(len(first), 1))  # bounded temporaries
        return all(
            bool((_param_index(self.aligned, out, stride, samples, n, chunk) ==
                  first.repeat(min(chunk, samples - n))).all())
            for n in range(1, samples, chunk)
        )  # fmt: skip

    def per_sample(self, grads: Tensor, samples: int, stride: int) -> Tensor:
        """Each sample's gradient of the parameter from the node's output gradients.

        Args:
            grads: ``[V, *out]``, the gradients at the node's output.
            samples: ``N``.
            stride: The samples' stride in the flattened output.

        Returns:
            ``[V, N, *param]``.
        """
        if self.factor is not None:
            grads = grads * (self.factor() if callable(self.factor) else self.factor)
        elif self.scale != 1.0:
            grads = grads * self.scale
        v, out = grads.shape[0], grads.shape[1:]
        if out[0] == samples and stride * samples == out.numel() and self.aligned[0] == 1:
            summed = grads.sum_to_size(v, samples, *self.aligned[1:])  # axis 0
            return summed.reshape(v, samples, *self.param).to(self.dtype)
        key = (stride, samples)
        if key not in self._indices:
            self._indices[key] = _param_index(self.aligned, out, stride, samples, 0, 1)
        index = self._indices[key]
        source = grads.reshape(v, -1, samples, stride).transpose(1, 2)
        source = source.reshape(v, samples, -1)
        result = grads.new_zeros(v, samples, math.prod(self.param))
        result.index_add_(2, index.to(grads.device), source)
        return result.reshape(v, samples, *self.param).to(self.dtype)


@dataclass(frozen=True)
class Product:
    """A parameter as the right factor of a matrix product ``rows @ W.T`` (or ``@ W``).

    Also a batched or broadcast product of several weights (``bmm``, ``torch.einsum``
    with a per-head weight ``"nhtd,hde->nhte"``, ``x @ w`` with ``x`` ``[N, H, T, D]``
    and ``w`` ``[H, D, E]``): ``pairs`` says which weight each output row uses, and
    each sample's products of a weight are those of its rows that use it.
    """

    edge: GradientEdge  # the product's output ``[..., O]``
    rows: Callable[[], Tensor]  # the left factor, ``[R, I]`` once reshaped (as saved)
    param: torch.Size  # ``[O, I]`` (transposed) or ``[I, O]`` (or ``[*P, I, O]``)
    dtype: torch.dtype
    transposed: bool
    alpha: float = 1.0
    pairs: Tensor | None = None  # ``[R]``: the weight of each output row (``None``: one)
    count: int = 1  # how many weights (``pairs``' values are ``0 .. count - 1``)
    vector: bool = False  # a vector ``[I]`` on the right (``h @ v``): one output column

    def _keys(
        self, pairs: Tensor, rows: int, width: int, stride: int, samples: int
    ) -> Tensor:  # fmt: skip
        """Each row's sample times ``count`` plus its weight (``pairs``)."""
        sample = torch.arange(rows).mul_(width).div_(stride, rounding_mode="floor")
        return sample.remainder_(samples).mul_(self.count).add_(pairs)

    def fits(self, out: torch.Size, stride: int, samples: int) -> bool:
        """Whether the samples group whole rows at this stride (alike for each weight)."""
        if self.vector:
            out = torch.Size((*out, 1))
        if stride % out[-1]:
            return False
        if self.pairs is None:
            return True
        rows = out.numel() // out[-1]
        counts = torch.bincount(
            self._keys(self.pairs, rows, out[-1], stride, samples),
            minlength=samples * self.count,
        )
        return bool((counts == counts[0]).all()) and int(counts[0]) > 0

    def per_sample(self, grads: Tensor, samples: int, stride: int) -> Tensor:
        """Each sample's gradient of the parameter: its rows' outer products summed.

        Args:
            grads: ``[V, *out]``, the gradients at the product's output.
            samples: ``N``.
            stride: The samples' stride in the flattened output (whole rows).

        Returns:
            ``[V, N, *param]``.
        """
        if self.vector:
            grads = grads.unsqueeze(-1)
        v, width = grads.shape[0], grads.shape[-1]
        rows = self.rows()
        rows = rows.reshape(-1, rows.shape[-1]).to(grads.dtype)
        if self.pairs is None:
            per_row = stride // width
            grouped = grads.reshape(v, -1, samples, per_row, width)
            inputs = rows.reshape(-1, samples, per_row, rows.shape[-1])
            spec = "vanqo,anqi->vnoi" if self.transposed else "vanqo,anqi->vnio"
        else:  # each sample's rows of each weight together, in equal numbers
            keys = self._keys(self.pairs, rows.shape[0], width, stride, samples)
            order = torch.argsort(keys, stable=True).to(grads.device)
            grouped = grads.reshape(v, -1, width)[:, order]
            grouped = grouped.view(v, samples, self.count, -1, width)
            inputs = rows[order].view(samples, self.count, -1, rows.shape[-1])
            spec = "vnpro,npri->vnpoi" if self.transposed else "vnpro,npri->vnpio"
        result = torch.einsum(spec, grouped, inputs)
        if self.alpha != 1.0:
            result = result * self.alpha
        return result.reshape(v, samples, *self.param).to(self.dtype)


@dataclass(frozen=True)
class ConvWeight:
    """A convolution's weight in the glue: a parameter, or computed from parameters."""

    edge: GradientEdge  # the convolution's output ``[B, Cout, *S']``
    x: Callable[[], Tensor | None]  # its input ``[B, Cin, *S]`` (saved by the node)
    weight: torch.Size  # ``[Cout, Cin / G, *K]`` (transposed: ``[Cin, Cout / G, *K]``)
    # stride, padding, dilation, transposed, output padding, groups
    args: tuple[list[int], list[int], list[int], bool, list[int], int]
    param: torch.Size
    dtype: torch.dtype
    # the computed weight's parameters, carried back to together (``None``: the weight
    # is the parameter, maybe through views)
    through: _Carried | None = None
    variable: Tensor | None = None  # the parameter (with ``through``)

    def fits(self, out: torch.Size, stride: int, samples: int) -> bool:
        """Whether the samples group whole rows of the batch axis at this stride."""
        return len(out) >= 3 and stride % math.prod(out[1:]) == 0

    def per_sample(self, grads: Tensor, samples: int, stride: int) -> Tensor:
        """Each sample's gradient of the weight, from the output's gradients.

        One weight gradient of a convolution with the samples as groups (each group's
        output channels the columns' ``[V, Cout]``) sums each sample's rows.

        Args:
            grads: ``[V, B, Cout, *S']``, the gradients at the convolution's output.
            samples: ``N``.
            stride: The samples' stride in the flattened output (whole rows).

        Returns:
            ``[V, N, *weight]``.
        """
        v, out = grads.shape[0], grads.shape[1:]
        x = self.x()
        if x is None:
            raise RuntimeError("a convolution's input was not saved for its weight")
        geometry = self.args
        transposed, groups = geometry[3], geometry[5]
        c, spatial, dims = out[1], out[2:], len(out) - 2
        per_row = stride // math.prod(out[1:])
        blocks = out[0] // (samples * per_row)
        cin = x.shape[1]
        # input: [A·T, N·Cin, *S] (a sample's rows side by side in the channels)
        rows = (
            x.detach().to(grads.dtype).reshape(blocks, samples, per_row, cin, *x.shape[2:])
        )
        rows = rows.transpose(1, 2).reshape(blocks * per_row, samples * cin, *x.shape[2:])
        # output: [A·T, N·G·V·(Cout/G), *S'] (per sample and group, the columns' channels)
        order = grads.reshape(v, blocks, samples, per_row, groups, c // groups, *spatial)
        order = order.permute(1, 3, 2, 4, 0, 5, *range(6, 6 + dims))
        channels = samples * groups * v * (c // groups)
        order = order.reshape(blocks * per_row, channels, *spatial)
        if transposed:  # [N·Cin, V·Cout/G, *K]: the samples' groups, their columns
            shape = (samples * cin, v * self.weight[1], *self.weight[2:])
        else:  # [N·G·V·Cout/G, Cin/G, *K]
            shape = (channels, *self.weight[1:])
        dw = torch.ops.aten.convolution_backward(
            order, rows, order.new_empty(1).expand(shape), None, *geometry[:5],
            samples * groups, [False, True, False],
        )[1]  # fmt: skip
        if transposed:
            dw = dw.reshape(samples, cin, v, *self.weight[1:]).permute(
                2, 0, 1, *range(3, 3 + 1 + dims)
            )
        else:
            dw = dw.reshape(samples, groups, v, c // groups, *self.weight[1:])
            dw = dw.permute(2, 0, 1, 3, *range(4, 4 + 1 + dims))
        return dw.reshape(v, samples, *self.weight)

    def read(self, grads: Tensor, samples: int, stride: int) -> Tensor:
        """:meth:`per_sample`, carried back through a computed weight where there is one.

        The parameters of one computed weight share its products and one backward pass
        through its computation (the first of them makes both, the others take theirs).
        """
        if self.through is None or self.variable is None:  # the parameter, maybe viewed
            products = self.per_sample(grads, samples, stride)
            return products.reshape(-1, samples, *self.param).to(self.dtype)
        return self.through.take(self, grads, samples, stride)


class _Carried:
    """A computed weight's products at its parameters, made once per gradient."""

    def __init__(self, edge: GradientEdge, variables: list[Tensor]) -> None:
        self.edge, self.variables = edge, variables
        self.key: Tensor | None = None  # the output gradients they were made from
        self.results: dict[int, Tensor] = {}

    def take(self, reader: ConvWeight, grads: Tensor, samples: int, stride: int) -> Tensor:
        if self.key is not grads:  # held, not its id: an id can be reused
            v = grads.shape[0]
            dw = reader.per_sample(grads, samples, stride).flatten(0, 1)
            with torch.enable_grad():  # the recorded computation, not a new one
                carried = batched_grad([self.edge], self.variables, [dw])
            del dw
            self.key = grads
            self.results = {
                id(variable): (
                    grads.new_zeros(v * samples, *variable.shape) if value is None
                    else value
                ).reshape(v, samples, *variable.shape).to(variable.dtype)
                for variable, value in zip(self.variables, carried, strict=True)
            }  # fmt: skip
        result = self.results.pop(id(reader.variable))
        if not self.results:
            self.key = None
        return result

    def release(self) -> None:
        """Drop what no reader took (a parameter read one sample at a time instead)."""
        self.key, self.results = None, {}


def release(readers: Sequence[Reader]) -> None:
    """Drop what computed weights hold after their readers' products were read.

    Args:
        readers: Readers whose products were read (one output gradient's).
    """
    for reader in readers:
        if isinstance(reader, ConvWeight) and reader.through is not None:
            reader.through.release()


@dataclass(frozen=True)
class Placed:
    """A reader of a part of a parameter (slices, selections, splits, and views).

    ``self.pos[:, :T]``, ``table[1 : T + 1]``, ``w.chunk(3)[k]``: the part's products
    per sample are those of a reader of the part, put at the part's elements of the
    parameter (zero elsewhere). A part is a map from distinct elements of the
    parameter, so each of its elements has one place. A part (or the whole parameter)
    times a constant number (``0.5 * self.pos``, ``-w``, ``w / 4``) has the products of
    the part times that number.
    """

    inner: Broadcast | Product  # reads the part (its ``param``: the part's shape)
    index: Tensor  # the parameter's flat index of each element of the part
    param: torch.Size
    dtype: torch.dtype
    scale: float = 1.0  # the part is read times this number (``0.5 * self.pos``)

    @property
    def edge(self) -> GradientEdge:
        """Where the part's reader takes its gradients."""
        return self.inner.edge

    def fits(self, out: torch.Size, stride: int, samples: int) -> bool:
        """Whether the part's reader reads per sample at this stride."""
        return self.inner.fits(out, stride, samples)

    def per_sample(self, grads: Tensor, samples: int, stride: int) -> Tensor:
        """``[V, N, *param]``: the part's products at their places, zero elsewhere."""
        part = self.inner.per_sample(grads, samples, stride)
        if self.scale != 1.0:
            part = part * self.scale
        v = part.shape[0]
        result = part.new_zeros(v, samples, self.param.numel())
        result[:, :, self.index.to(part.device)] = part.reshape(v, samples, -1)
        return result.reshape(v, samples, *self.param)


Reader = Union[Broadcast, Product, ConvWeight, Gather, Placed]  # noqa: UP007 (an alias)


def _lookup_fits(gather: Gather, out: torch.Size, stride: int, samples: int) -> bool:
    return stride % out[-1] == 0


def _sample_rows(
    gather: Gather, grads: Tensor, samples: int, stride: int
) -> tuple[Tensor, Tensor]:
    """A lookup's positions as (sample, row) keys beside their vectors, sample-major.

    Args:
        gather: The lookup.
        grads: ``[V, *indices.shape, D]``, the gradients at its output.
        samples: ``N``.
        stride: The samples' stride in the flattened output (whole rows of ``D``).

    Returns:
        ``sample * rows + row`` per position (``[P]``) and the vectors ``[V, P, D]``.
    """
    v, dim = grads.shape[0], grads.shape[-1]
    per = stride // dim
    index = gather.indices.reshape(-1, samples, per).transpose(0, 1).reshape(samples, -1)
    offsets = torch.arange(samples, device=index.device).mul_(gather.rows)
    index = (index + offsets[:, None]).reshape(-1)
    source = grads.reshape(v, -1, samples, per, dim).transpose(1, 2).reshape(v, -1, dim)
    return index, source


def lookup_per_sample(gather: Gather, grads: Tensor, samples: int, stride: int) -> Tensor:
    """Each sample's table gradient of an embedding lookup.

    Args:
        gather: The lookup.
        grads: ``[V, *indices.shape, D]``, the gradients at its output.
        samples: ``N``.
        stride: The samples' stride in the flattened output (whole rows of ``D``).

    Returns:
        ``[V, N, rows, D]``.
    """
    v, dim, rows = grads.shape[0], grads.shape[-1], gather.rows
    index, source = _sample_rows(gather, grads, samples, stride)
    result = grads.new_zeros(v, samples * rows, dim)
    result.index_add_(1, index, source)
    result = result.view(v, samples, rows, dim)
    if gather.padding_idx is not None:
        result[:, :, gather.padding_idx] = 0.0
    return result


@torch.no_grad()
def lookup_squares(gather: Gather, grads: Tensor, samples: int, stride: int) -> Tensor:
    """``sum_{v, n}`` of the squares of :func:`lookup_per_sample`, without forming it.

    Each sample's rows are the sums of the vectors at the positions that look them up:
    those sums are made per distinct (sample, row) pair, squared and added into the
    rows (``[V, pairs, D]``, not ``[V, N, rows, D]``).

    Args:
        gather: The lookup.
        grads: ``[V, *indices.shape, D]``, the gradients at its output.
        samples: ``N``.
        stride: The samples' stride in the flattened output (whole rows of ``D``).

    Returns:
        ``[rows, D]``.
    """
    v, dim, rows = grads.shape[0], grads.shape[-1], gather.rows
    index, source = _sample_rows(gather, grads, samples, stride)
    keys, inverse = torch.unique(index, return_inverse=True)
    summed = grads.new_zeros(v, keys.numel(), dim)
    summed.index_add_(1, inverse, source)
    result = grads.new_zeros(rows, dim)
    result.index_add_(0, keys % rows, summed.square().sum(0))
    if gather.padding_idx is not None:
        result[gather.padding_idx] = 0.0
    return result


def fits(reader: Reader, out: torch.Size, stride: int, samples: int) -> bool:
    """Whether ``reader`` can read per sample with this stride of its output."""
    if isinstance(reader, Gather):
        return _lookup_fits(reader, out, stride, samples)
    return reader.fits(out, stride, samples)


@torch.no_grad()  # the saved tensors (rows, factors, norms' inputs) require grad
def per_sample(reader: Reader, grads: Tensor, samples: int, stride: int) -> Tensor:
    """``[V, N, *param]``: each sample's gradient of the reader's parameter.

    Args:
        reader: The reader.
        grads: ``[V, *out]``, the gradients at its output.
        samples: ``N``.
        stride: The samples' stride in the flattened output.

    Returns:
        The products.
    """
    if isinstance(reader, Gather):
        return lookup_per_sample(reader, grads, samples, stride)
    if isinstance(reader, ConvWeight):
        return reader.read(grads, samples, stride)
    return reader.per_sample(grads, samples, stride)


# views that keep the elements' order: a gradient through them is a reshape
_RESHAPES = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "UnsqueezeBackward0",
    "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "SqueezeBackward3",
})  # fmt: skip


def param_behind(node: Node) -> tuple[Tensor, torch.Size, bool] | None:
    """The leaf that ``node`` is, or that a chain of views (or one ``W.T``) ends at.

    Args:
        node: A node of the autograd graph (an input of a reader).

    Returns:
        ``(leaf, the shape read, transposed)``, or ``None`` where ``node`` is neither an
        ``AccumulateGrad`` nor such a chain.
    """
    variable = accumulated_variable(node)
    if variable is not None:
        return variable, variable.shape, False
    name = node.name()
    shape = grad_shape(node, 0)
    if shape is None or output_count(node) != 1:
        return None
    if name == "TBackward0":
        inputs = [nxt for nxt, _ in node.next_functions if nxt is not None]
        variable = accumulated_variable(inputs[0]) if len(inputs) == 1 else None
        if variable is None or variable.dim() != 2:
            return None
        return variable, shape, True
    if name not in _RESHAPES:
        return None
    current = node
    while current.name() in _RESHAPES:
        inputs = [nxt for nxt, _ in current.next_functions if nxt is not None]
        if len(inputs) != 1 or output_count(current) != 1:
            return None
        current = inputs[0]
    variable = accumulated_variable(current)
    if variable is None or variable.numel() != shape.numel():
        return None
    return variable, shape, False


# parts of a tensor: each element of the part is one distinct element of the whole
_PARTS = frozenset({
    "SliceBackward0", "SelectBackward0", "SplitBackward0", "SplitWithSizesBackward0",
})  # fmt: skip


def _signed(value: object) -> int | None:
    """A saved integer (torch saves negative ones as unsigned 64-bit), or ``None``."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    return value - (1 << 64) if value >= 1 << 63 else value


# the largest parameter whose parts are placed (an int64 index of it is made once while
# the graph is walked: 128 MiB); larger ones take one pass per sample
_MOST_PLACED = 1 << 24

# views that reorder the elements (``torch.einsum`` permutes its operands)
_PERMUTES = frozenset({"PermuteBackward0", "TransposeBackward0", "TBackward0"})


# a tensor times a constant number: ``0.5 * w`` (torch saves the number as a 0-d
# tensor), ``w / 4``, ``-w``; the gradient of the tensor is the number times the
# gradient of the product
_SCALES = frozenset({
    "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1", "NegBackward0",
})  # fmt: skip


def _number(value: object) -> float | None:
    """A saved constant number (a Python number or a 0-d tensor with no grad)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if (
        isinstance(value, Tensor) and value.dim() == 0 and not value.requires_grad
        and not value.is_complex() and value.device.type != "meta"
    ):  # fmt: skip
        return float(value)
    return None


def _factor(node: Node) -> float | None:
    """The number a scaling node multiplies its one tensor input by, or ``None``."""
    name = node.name()
    if name == "NegBackward0":
        return -1.0
    taken = [k for k, (nxt, _) in enumerate(node.next_functions) if nxt is not None]
    if len(taken) != 1:
        return None
    if name.startswith("Div"):  # ``w / c`` only (``c / w`` is not linear in ``w``)
        c = _number(saved_value(node, "other")) if taken == [0] else None
        return None if c is None or c == 0.0 else 1.0 / c
    return _number(saved_value(node, "other" if taken == [0] else "self"))


def _part_of(index: Tensor, node: Node, number: int) -> Tensor | None:
    """``index`` as ``node`` takes its part at output ``number`` (or views it)."""
    name = node.name()
    if name in _RESHAPES:
        shape = grad_shape(node, 0)
        return None if shape is None else index.reshape(shape)
    if name == "TBackward0":
        return index.t() if index.dim() == 2 else None
    if name == "PermuteBackward0":
        dims = saved_value(node, "dims")
        if not isinstance(dims, (tuple, list)) or len(dims) != index.dim():
            return None
        order = [_signed(d) for d in dims]
        return None if None in order else index.permute(order)
    if name == "TransposeBackward0":
        first, second = (_signed(saved_value(node, k)) for k in ("dim0", "dim1"))
        if first is None or second is None:
            return None
        return index.transpose(first, second)
    dim = _signed(saved_value(node, "dim"))
    if dim is None or not -index.dim() <= dim < index.dim():
        return None
    if name == "SliceBackward0":
        start, end, step = (_signed(saved_value(node, k)) for k in ("start", "end", "step"))
        if start is None or end is None or step is None or step < 1:
            return None
        taken = (slice(None),) * (dim % index.dim()) + (slice(start, end, step),)
        return index[taken]
    if name == "SelectBackward0":
        at = _signed(saved_value(node, "index"))
        return None if at is None else index.select(dim, at)
    if name == "SplitBackward0":
        size = _signed(saved_value(node, "split_size"))
        return None if size is None or size < 1 else index.split(size, dim)[number]
    sizes = saved_value(node, "split_sizes")  # SplitWithSizesBackward0
    if not isinstance(sizes, (tuple, list)):
        return None
    return index.split([int(k) for k in sizes], dim)[number]


def part_behind(
    node: Node, number: int
) -> tuple[Tensor, torch.Size, Tensor, bool, float] | None:  # fmt: skip
    """The parameter that ``node`` (output ``number``) takes a part of, if it does.

    A chain of slices, selections, splits, views and products with constant numbers
    (at least one that is not an order-keeping view) from a leaf, maybe read
    transposed (``w.chunk(3)[0].T`` in ``F.linear``).

    Args:
        node: A node of the autograd graph (an input of a reader).
        number: Its output read.

    Returns:
        ``(leaf, the shape read, the leaf's flat index of each element of the part in
        the part's shape, transposed, the number the part is multiplied by)`` or
        ``None``.
    """
    if not READ_PARTS:
        return None
    shape = grad_shape(node, number)
    transposed = node.name() == "TBackward0"
    if transposed:
        inputs = [nxt for nxt in node.next_functions if nxt[0] is not None]
        if len(inputs) != 1:
            return None
        node, number = inputs[0]
    chain: list[tuple[Node, int]] = []
    scale = 1.0
    current, out = node, number
    while accumulated_variable(current) is None:
        name = current.name()
        if name in _SCALES:
            factor = _factor(current) if out == 0 else None
            if factor is None or len(chain) > 16:
                return None
            scale *= factor
            current, out = next(
                (nxt, k) for nxt, k in current.next_functions if nxt is not None
            )
            continue
        if name not in _PARTS and name not in _RESHAPES and name not in _PERMUTES:
            return None
        if name not in ("SplitBackward0", "SplitWithSizesBackward0") and out != 0:
            return None
        inputs = [nxt for nxt, _ in current.next_functions if nxt is not None]
        if len(inputs) != 1 or len(chain) > 16:
            return None
        chain.append((current, out))
        current, out = inputs[0], current.next_functions[0][1]
    variable = accumulated_variable(current)
    if (
        not transposed and scale == 1.0
        and all(step.name() in _RESHAPES for step, _ in chain)
    ):  # fmt: skip
        return None  # order-keeping views alone: :func:`param_behind`'s
    if not math.isfinite(scale):
        return None
    if variable.numel() > _MOST_PLACED:
        return None  # the places are found on an index of the whole parameter
    index: Tensor | None = torch.arange(variable.numel()).reshape(variable.shape)
    for step, taken in reversed(chain):
        index = _part_of(index, step, taken)
        if index is None:
            return None
    read = index.t() if transposed and index.dim() == 2 else index
    if shape is None or (transposed and index.dim() != 2) or read.shape != shape:
        return None
    return variable, shape, index, transposed, scale


def read_part(
    node: Node, position: int, variable: Tensor, shape: torch.Size, index: Tensor,
    transposed: bool, scale: float = 1.0,
) -> Placed | None:  # fmt: skip
    """The reader of a part of ``variable`` (:func:`part_behind`) that ``node`` is.

    Args:
        node: The node whose input ``position`` leads to the part.
        position: Which of its inputs.
        variable: The parameter.
        shape: The shape the node reads the part in.
        index: The parameter's flat index of each element of the part.
        transposed: Whether the node reads the part as ``part.T``.
        scale: The number the part is multiplied by before the node reads it.

    Returns:
        A :class:`Placed` broadcast or matrix product, or ``None``.
    """
    if variable.is_complex() or not variable.is_floating_point() or node.name() in _NORMS:
        return None
    inner = _product(node, position, variable, shape, transposed)
    if inner is None:  # the part as read, broadcast (``x + table.t()``)
        index = index.t() if transposed else index
        inner = _broadcast(node, position, variable, shape)
    if inner is None:
        return None
    inner = replace(inner, param=index.shape)
    return Placed(inner, index.reshape(-1), variable.shape, variable.dtype, scale)


def read_behind(
    node: Node, position: int, known: Callable[[Tensor], bool]
) -> tuple[Tensor, Reader | None] | None:  # fmt: skip
    """The trainable parameter at input ``position`` of ``node``, and its reader there.

    The parameter itself, behind views that keep the order or one ``.T``
    (:func:`param_behind`: its reader, or ``None`` where ``node`` reads it otherwise: a
    pass per sample), or a part of it (:func:`part_behind`, where the part has a
    reader; also ``W.T`` read by another than a matrix product).

    Args:
        node: A node of the glue.
        position: Which of its inputs.
        known: Whether a leaf is a trainable parameter of the call.

    Returns:
        ``(parameter, reader or None)``, or ``None`` where no trainable parameter is
        there (the walk goes on into the input).
    """
    nxt, number = node.next_functions[position]
    behind = param_behind(nxt)
    if node.name() in _SCALES and _factor(node) is not None:
        # a parameter (or a part) times a number, walked into: a reader that follows
        # the product to the parameter (:func:`part_behind`) may read it on another
        # path, whose gradient this node's output holds too; one pass per sample
        found = behind if behind is not None else part_behind(nxt, number)
        if found is not None and known(found[0]):
            return found[0], None
    if behind is not None and known(behind[0]):
        reader = read_by(node, position, *behind)
        if reader is None and behind[2]:  # ``W.T`` read by another than a product
            part = part_behind(nxt, number)
            reader = None if part is None else read_part(node, position, *part)
        return behind[0], reader
    part = part_behind(nxt, number) if behind is None else None
    if part is not None and known(part[0]):
        placed = read_part(node, position, *part)
        if placed is not None:
            return part[0], placed
    return None


def _normalized(node: Node) -> Callable[[], Tensor]:
    """The normalized input ``x̂`` of a layer or group norm's node, made when asked."""

    def make() -> Tensor:
        x = saved_value(node, "input")
        mean, rstd = saved_value(node, "result1"), saved_value(node, "result2")
        if node.name() == "NativeLayerNormBackward0":
            return (x - mean) * rstd
        n, groups = x.shape[0], int(saved_value(node, "group"))
        stats = (n, groups, 1)
        flat = x.reshape(n, groups, -1)
        return ((flat - mean.reshape(stats)) * rstd.reshape(stats)).reshape(x.shape)

    return make


_NORMS = ("NativeLayerNormBackward0", "NativeGroupNormBackward0")
_BROADCASTING = frozenset(
    {"AddBackward0", "SubBackward0", "MulBackward0", "ExpandBackward0", *_NORMS}
)


def _broadcast(
    node: Node, position: int, variable: Tensor, shape: torch.Size
) -> Broadcast | None:
    name = node.name()
    norm = name in _NORMS
    out = grad_shape(node, 0)
    if out is None or (output_count(node) != 1 and not norm):
        return None
    scale, factor = 1.0, None
    if name == "AddmmBackward0":  # the bias (input 0), times beta
        beta = saved_value(node, "beta")
        if position != 0 or not isinstance(beta, (int, float)) or isinstance(beta, bool):
            return None
        scale = float(beta)
    elif name not in _BROADCASTING:
        return None
    elif norm:  # the affine weight (1) and bias (2); a group norm's act on axis 1
        if position == 0 or len(shape) != 1:
            return None
        if name == "NativeGroupNormBackward0":
            shape = torch.Size((variable.numel(),) + (1,) * (len(out) - 2))
        if position == 1:
            factor = _normalized(node)
    elif name in ("AddBackward0", "SubBackward0") and position == 1:
        alpha = saved_value(node, "alpha")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            return None
        scale = float(alpha) * (-1.0 if name == "SubBackward0" else 1.0)
    elif name == "MulBackward0":
        other = saved_value(node, "other" if position == 0 else "self")
        if not isinstance(other, Tensor) or other.is_complex():
            return None
        factor = other.detach()
    if len(out) < len(shape):
        return None
    aligned = torch.Size((1,) * (len(out) - len(shape)) + tuple(shape))
    if any(a not in (1, o) for a, o in zip(aligned, out, strict=True)):
        return None
    return Broadcast(
        GradientEdge(node, 0), aligned, variable.shape, variable.dtype, scale, factor
    )


def _product(
    node: Node, position: int, variable: Tensor, shape: torch.Size, transposed: bool
) -> Product | None:
    """The reader of a matrix product's right factor read as ``shape``, if any.

    ``mm``, ``addmm``, ``bmm``, or a folded ``matmul``/``bmm``/``baddbmm`` of the glue.
    """
    name = node.name()
    folded = folded_product(node)
    if folded is not None:
        if not READ_FOLDED_PRODUCTS:
            return None
        rows_of, out, alpha = folded[0], grad_shape(node, 0), folded[1]
        if position != len(node.next_functions) - 1 or out is None:
            return None  # the left factor, or ``baddbmm``'s input
        return _pairs_product(node, rows_of, out, variable, shape, transposed, alpha)
    if (name, position) in (("MmBackward0", 1), ("BmmBackward0", 1)):
        left, alpha = "self", 1.0
    elif (name, position) == ("AddmmBackward0", 2):
        left, alpha = "mat1", saved_value(node, "alpha")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            return None
    else:
        return None
    out = grad_shape(node, 0)
    if out is None or len(out) not in (2, 3):
        return None
    return _pairs_product(
        node, lambda: saved_value(node, left), out, variable, shape, transposed, alpha
    )


def _pairs_product(
    node: Node, rows_of: Callable[[], Tensor | None], out: torch.Size, variable: Tensor,
    shape: torch.Size, transposed: bool, alpha: float,
) -> Product | None:  # fmt: skip
    """A :class:`Product` of the right factor read as ``shape`` (``[*B, I, O]``).

    The output ``[*L, R, O]``; the factor's batch axes ``B`` broadcast against ``L``
    (matched from the right), so each output row uses the weight at its broadcast index.
    """
    rows = rows_of()
    if not isinstance(rows, Tensor) or rows.is_complex() or rows.dim() < 2:
        return None
    if len(shape) == 1 and not transposed:  # ``h @ v``: ``v`` as one column
        if shape[0] != rows.shape[-1] or tuple(out) != tuple(rows.shape[:-1]):
            return None
        return Product(
            GradientEdge(node, 0), rows_of, variable.shape, variable.dtype, False,
            float(alpha), vector=True,
        )  # fmt: skip
    if len(shape) < 2:
        return None
    if len(out) < 2 or tuple(shape[-2:]) != (rows.shape[-1], out[-1]):
        return None  # ``shape`` is the right factor as read: ``[*B, I, O]``
    lead, batch = tuple(out[:-2]), tuple(shape[:-2])
    if len(batch) > len(lead) or rows.shape[-2] != out[-2]:
        return None
    if any(b not in (1, o) for b, o in zip(batch[::-1], lead[::-1], strict=False)):
        return None
    if rows.dim() != len(out) or tuple(rows.shape[:-2]) != lead:
        if any(
            r not in (1, o) for r, o in zip(rows.shape[-3::-1], lead[::-1], strict=False)
        ):
            return None
        saved = rows_of  # broadcast over the output's batch axes: expanded when read
        rows_of = lambda: saved().expand(*lead, *saved().shape[-2:])  # noqa: E731
    count = math.prod(batch)
    pairs = None
    if count > 1:
        index = torch.arange(count).reshape(batch).expand(lead)
        pairs = index.reshape(-1, 1).expand(-1, out[-2]).reshape(-1)
    if transposed and batch:
        return None  # ``W.T`` is a 2-d weight
    return Product(
        GradientEdge(node, 0), rows_of, variable.shape, variable.dtype, transposed,
        float(alpha), pairs, count,
    )  # fmt: skip


# the internal switch (tests, benchmarks): False leaves the right factors of the glue's
# folded matrix products (``x @ proj``, ``matmul``/``bmm`` of the glue) to one pass per
# sample, as before they were read
READ_FOLDED_PRODUCTS = True

# the internal switch (tests, benchmarks): False leaves parts of parameters (slices,
# selections, splits) and rows gathered in the glue to one pass per sample, as before
READ_PARTS = True

# the internal switch (tests, benchmarks): False leaves convolutions' weights and biases
# in the glue to one pass per sample, as before they were read
READ_CONV_WEIGHTS = True


def _conv_of(node: Node) -> tuple[Callable[[], Tensor | None], tuple, torch.Size] | None:
    """A convolution's input, geometry and weight shape, where ``node`` is one.

    ``ConvolutionBackward0`` (also transposed) or the glue's folded convolution. The
    geometry is ``(stride, padding, dilation, transposed, output_padding, groups)``.
    """
    if not READ_CONV_WEIGHTS:
        return None
    folded = folded_conv(node)
    if folded is not None:
        x, geometry = folded
        shapes = getattr(node, "shapes", None)
        if not shapes or shapes[1] is None:
            return None
        return x, geometry, torch.Size(shapes[1])
    if node.name() != "ConvolutionBackward0":
        return None
    names = ("stride", "padding", "dilation", "transposed", "output_padding", "groups")
    values = [saved_value(node, k) for k in names]
    weight = saved_value(node, "weight")
    if None in values or not isinstance(weight, Tensor) or weight.dim() < 3:
        return None
    stride, padding, dilation, transposed, output_padding, groups = values
    if transposed and not _glue_kernels.TRANSPOSED_CONVS:
        return None
    if len(padding) != weight.dim() - 2:
        return None
    geometry = (list(stride), list(padding), list(dilation), bool(transposed),
                list(output_padding), int(groups))  # fmt: skip
    return (lambda: saved_value(node, "input")), geometry, weight.shape


def _conv_weight(
    node: Node, position: int, variable: Tensor, shape: torch.Size,
    through: _Carried | None = None, computed_from: Tensor | None = None,
) -> ConvWeight | None:  # fmt: skip
    if position != 1:
        return None
    conv = _conv_of(node)
    if conv is None:
        return None
    x, args, weight = conv
    if tuple(shape) != tuple(weight) and through is None:
        return None
    return ConvWeight(
        GradientEdge(node, 0), x, weight, args, variable.shape, variable.dtype,
        through, computed_from,
    )  # fmt: skip


def computed_weight(
    node: Node, position: int, known: Callable[[Tensor], bool],
    stops: Callable[[EdgeKey], bool], most: int = 64,
) -> list[tuple[Tensor, ConvWeight]] | None:  # fmt: skip
    """Readers of parameters a convolution's weight is computed from alone, if any.

    Args:
        node: A node of the glue.
        position: The input of ``node`` that is looked at.
        known: Whether a leaf is a trainable parameter of the call.
        stops: Whether an edge is a layer output or another region's source (the
            computation must not reach either).
        most: The most nodes the computation may have.

    Returns:
        ``(parameter, reader)`` for every parameter the computation reaches, or
        ``None`` where ``node`` is no convolution read at its weight, or the weight is
        not computed from trainable parameters alone (a leaf that is not one, a layer's
        output, another region, or more than ``most`` nodes).
    """
    if position != 1 or _conv_of(node) is None:
        return None
    start, number = node.next_functions[position]
    if start is None or accumulated_variable(start) is not None:
        return None
    seen: set[int] = set()
    leaves: dict[int, Tensor] = {}
    stack = [start]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if len(seen) > most:
            return None
        variable = accumulated_variable(current)
        if variable is not None:
            if not known(variable) or not variable.is_floating_point():
                return None
            leaves[id(variable)] = variable
            continue
        if any(stops(edge_key((current, k))) for k in range(output_count(current))):
            return None
        stack.extend(nxt for nxt, _ in current.next_functions if nxt is not None)
    if not leaves:
        return None
    carried = _Carried(GradientEdge(start, number), list(leaves.values()))
    found = []
    for variable in leaves.values():
        reader = _conv_weight(node, position, variable, variable.shape, carried, variable)
        if reader is None:
            return None
        found.append((variable, reader))
    return found


def read_by(
    node: Node, position: int, variable: Tensor, shape: torch.Size, transposed: bool
) -> Reader | None:
    """The reader of ``variable`` that ``node`` is at input ``position``, if any.

    Args:
        node: The node whose input ``position`` leads to the parameter.
        position: Which of its inputs (``next_functions``).
        variable: The parameter.
        shape: The shape the node reads it in (through views or a transpose).
        transposed: Whether it is read as ``W.T``.

    Returns:
        A :class:`Broadcast`, :class:`Product` or lookup, or ``None`` (any other node:
        the parameter's products are then taken one sample at a time).
    """
    if variable.is_complex() or not variable.is_floating_point():
        return None
    product = _product(node, position, variable, shape, transposed)
    if product is not None or transposed:
        return product
    conv = _conv_weight(node, position, variable, shape)
    if conv is not None:
        return conv
    if position == 2 and variable.dim() == 1 and _conv_of(node) is not None:
        out = grad_shape(node, 0)  # the bias, broadcast over the output's channels
        if out is not None and len(out) >= 3 and out[1] == variable.numel():
            aligned = torch.Size([1, out[1], *([1] * (len(out) - 2))])
            return Broadcast(GradientEdge(node, 0), aligned, variable.shape, variable.dtype)
    if shape == variable.shape:
        gather = gather_of(node)
        if gather is None:
            gather = _rows_of(node, position, variable)
        if gather is not None:
            return gather
    return _broadcast(node, position, variable, shape)


def _rows_of(node: Node, position: int, variable: Tensor) -> Gather | None:
    """A table's rows gathered in the glue (``table[position_ids]``) as a lookup.

    The folded ``table[index]`` of a 2-d table along its first axis (transformers'
    Whisper decoder reads its positions so) is an embedding lookup without a padding
    row: the same gradient, rows added back at their indices.
    """
    rows = folded_rows(node) if READ_PARTS else None
    if rows is None or position != 0 or variable.dim() != 2:
        return None
    index, axis, shape = rows
    if axis != 0 or tuple(shape) != tuple(variable.shape) or index.dim() == 0:
        return None
    index = index.to(torch.int64) % shape[0]  # negative rows counted from the end
    return Gather(GradientEdge(node, 0), index, shape[0], None)


def _candidate_strides(out: torch.Size, samples: int) -> list[int]:
    """Strides ``s`` for which ``(f // s) % N`` can map ``out``'s positions to samples.

    The suffix products of its shape first (a samples' axis), then every other divisor
    of ``numel / N`` (rows grouped by sample after a flatten, ``[N·T, O]``).
    """
    numel = out.numel()
    if numel % samples:
        return []
    found = [math.prod(out[k:]) for k in range(len(out) + 1)]
    found = [s for s in dict.fromkeys(found) if numel % (s * samples) == 0]
    block = numel // samples
    small = [d for d in range(1, math.isqrt(block) + 1) if block % d == 0]
    found += [d for d in small + [block // d for d in reversed(small)] if d not in found]
    return found


class _Sightings:
    """What the probes saw at one reader's output, compactly (6 bytes a position).

    ``code``: the bits of the sample index, set by the probes of each bit's 1-half;
    ``reached``: a probe reached the position; ``mixed``: both halves of a bit did (two
    samples that differ reach it); ``every``: one half of every bit did; ``ones``: the
    1-half of the current bit did.

    A position that one sample's computation reaches is reached by every probe holding
    that sample: one half of every bit. One that only some bits' halves reach carries
    rounding alone: a value zero in exact arithmetic, that each probe rounds to zero or
    not (the first query of causal attention: its softmax over one key has a zero
    gradient, ``1 · (dP − dP)``). Its code is incomplete, so it proves nothing and is
    left out of the proof (two samples meeting there would still show as mixed).
    """

    def __init__(self, size: int, bits: int):
        self.code = torch.zeros(size, dtype=torch.int16 if bits < 16 else torch.int32)
        self.reached = torch.zeros(size, dtype=torch.bool)
        self.mixed = torch.zeros(size, dtype=torch.bool)
        self.every = torch.ones(size, dtype=torch.bool)
        self.ones: Tensor | None = None

    def see(self, probe: int, hit: Tensor) -> None:
        bit, half = divmod(probe, 2)
        self.reached |= hit
        if half == 0:  # the samples whose bit is 1
            self.code |= hit.to(self.code.dtype) << bit
            self.ones = hit
        else:
            self.mixed |= self.ones & hit
            self.every &= self.ones | hit
            self.ones = None

    def stride(self, reader: Reader, out: torch.Size, samples: int) -> int | None:
        """The stride these sightings prove, if any."""
        if bool(self.mixed.any()):
            return None  # a position reached from samples that differ
        position = (self.reached & self.every).nonzero().squeeze(1)
        candidates = torch.tensor(_candidate_strides(out, samples), dtype=torch.long)
        if len(candidates) and len(position):
            # a few positions rule out most candidates at once; survivors in full
            few = position[torch.linspace(0, len(position) - 1, 64).long().unique()]
            agree = (few[None] // candidates[:, None]) % samples == self.code[few][None]
            candidates = candidates[agree.all(1)]
        for stride in candidates.tolist():
            if fits(reader, out, stride, samples) and self._agrees(
                position, stride, samples
            ):
                return stride
        return None

    def _agrees(self, position: Tensor, stride: int, samples: int) -> bool:
        for start in range(0, len(position), 1 << 16):  # bounded temporaries
            part = position[start : start + (1 << 16)]
            if not bool(((part // stride) % samples == self.code[part]).all()):
                return False
        return True


def shared_edges(readers: Sequence[Reader]) -> list[tuple[GradientEdge, list[int]]]:
    """The readers' distinct outputs, each with the indices of the readers reading there.

    A norm's weight and bias are read at one output: its gradients are taken once.

    Args:
        readers: The readers.

    Returns:
        ``(edge, reader indices)`` pairs, in the readers' order.
    """
    found: dict[tuple[int, int], tuple[GradientEdge, list[int]]] = {}
    for k, reader in enumerate(readers):
        key = (id(reader.edge.node), reader.edge.output_nr)
        found.setdefault(key, (reader.edge, []))[1].append(k)
    return list(found.values())


def _group_strides(
    target: Tensor | GradientEdge,
    frontier: Sequence[GradientEdge],
    edges: Sequence[GradientEdge],
    grads: Tensor,
) -> list[_Sightings]:
    """What ``2 bits`` probes through the region see at each of ``edges``."""
    n = grads.shape[1]
    bits = (n - 1).bit_length()
    samples = torch.arange(n, device=grads.device)
    masks = []
    for bit in range(bits):
        ones = samples.bitwise_right_shift(bit).bitwise_and_(1).bool()
        masks += [ones, ~ones]  # probe 2b: bit b is 1; probe 2b + 1: it is 0
    sizes = [edge_numel(edge) for edge in edges]
    seen = [_Sightings(size, bits) for size in sizes]
    generator = torch.Generator(device=grads.device).manual_seed(0)
    step = max(1, grads.shape[0])  # as many probes per pass as the sweep's columns
    with blocked(frontier):
        for start in range(0, len(masks), step):
            part = torch.stack(masks[start : start + step])  # [P, N]
            probe = torch.rand(
                (len(part), *grads.shape[1:]), generator=generator, dtype=grads.dtype,
                device=grads.device,
            ).add_(0.5)  # fmt: skip
            probe *= part.view(*part.shape, *(1,) * (grads.dim() - 2))
            results = list(batched_grad([target], list(edges), [probe]))
            del probe
            for k in range(len(results)):
                result, results[k] = results[k], None
                for j in range(len(part)):
                    hit = (
                        torch.zeros(sizes[k], dtype=torch.bool)
                        if result is None
                        else result[j].reshape(-1).ne(0).cpu()
                    )
                    seen[k].see(start + j, hit)
                del result
    return seen


def sample_strides(
    target: Tensor | GradientEdge,
    frontier: Sequence[GradientEdge],
    readers: Sequence[Reader],
    grads: Tensor,
    room: int | None = None,
) -> list[int | None]:
    """Prove where each reader's output holds which sample (see the module).

    Proven per region, not per reader: a position that one region reaches from one
    sample can be reached from another sample by another region (a table read by
    per-sample indices that differ between the regions' paths).

    Args:
        target: Where the region's vectors start.
        frontier: The layer outputs that end it (blocked).
        readers: The readers of its parameters.
        grads: ``[V, N, ...]`` vectors at ``target`` (their shape, dtype, device; ``V``
            sets how many probes go in one pass, so they need no more memory).
        room: Most output elements per sample of readers probed together (``None``:
            all at once).

    Returns:
        Per reader, the samples' stride in its flattened output, or ``None`` where no
        stride describes them (the reader mixes samples, or groups them otherwise).
    """
    n = grads.shape[1]
    outs = [grad_shape(reader.edge.node, reader.edge.output_nr) for reader in readers]
    if n == 1:
        return [
            None if out is None or not fits(reader, out, out.numel(), 1) else out.numel()
            for reader, out in zip(readers, outs, strict=True)
        ]
    if not grads.is_floating_point() or any(out is None for out in outs):
        return [None] * len(readers)
    strides: list[int | None] = [None] * len(readers)
    edges = shared_edges(readers)
    for group in reader_groups([edge_numel(edge) // n for edge, _ in edges], room):
        seen = _group_strides(target, frontier, [edges[g][0] for g in group], grads)
        for g, sight in zip(group, seen, strict=True):
            for k in edges[g][1]:
                strides[k] = sight.stride(readers[k], outs[k], n)
    return strides


def reader_room(source: _Source, grads: Tensor) -> int:
    """Elements per sample of readers' outputs that one pass over a region takes.

    The region's own vectors, or the largest reader's (the memory bound reserves them:
    a deep residual stream reads a layer scale or a projection in every block).

    Args:
        source: The glue region.
        grads: ``[V, N, ...]`` vectors at its start.

    Returns:
        The count.
    """
    return max(grads[0, 0].numel(), source.reader_numel)


def reader_groups(sizes: Sequence[int], room: int | None) -> list[list[int]]:
    """Consecutive indices in groups of at most ``room`` elements (or one larger).

    Args:
        sizes: Each reader's output elements (per sample).
        room: The most per group (``None``: one group).

    Returns:
        The groups, as lists of indices.
    """
    groups: list[list[int]] = []
    held = 0
    for k, size in enumerate(sizes):
        if groups and (room is None or held + size <= room):
            groups[-1].append(k)
            held += size
        else:
            groups.append([k])
            held = size
    return groups
