r"""Pads, pooling, shuffles, masks, gathers, softmax, convolutions, products in the glue.

torch's batching (``torch.autograd.grad(..., is_grads_batched=True)``) has no rule for
the backward kernels of ``F.pad`` (every mode), max and average pooling (also adaptive),
``pixel_shuffle``, ``flip``, ``roll``, ``masked_fill``, ``where``, ``softmax``, batch
norm, ``table[index]``, ``torch.gather`` or a convolution: it runs them once per
column (one kernel launch each). While the engine's forward pass runs,
:func:`ggnchunk._folding.folded_glue` routes those calls outside layers with a rule
through :class:`_FoldedGlue` (:class:`_FoldedTensors` for calls of several tensors:
batch norm, convolutions, weight norm): its forward is the user's own call (same
function, same arguments; nothing of the user's code runs again), and its backward
runs on all columns at once (:func:`ggnchunk._autograd.on_columns`), with the columns
folded into the kernels' batch axis:

- **linear calls** (pads, average pooling, pixel shuffles, ``flip``, ``roll``, and
  ``masked_fill`` and ``where`` in the tensor that needs grad): torch's own backward
  kernel of the call, on ``V * N`` samples (or, without one, autograd's backward of the
  same call taken on an all-zeros input of ``V * N`` samples);
- **max pooling** (also adaptive): each output's vectors are added at its recorded
  argmax (``scatter_add``), as torch's kernel does;
- **softmax** and **log-softmax**: :math:`y \odot (g - \langle g, y\rangle)` and
  :math:`g - e^{y} \sum g` along the axis, the recorded output broadcast over the columns;
- **batch norm with running statistics** (timm's ``BatchNormAct2d``): an affine map per
  channel, with the weight's and bias's products;
- **rows of a table** (``table[index]``, relative-position tables): the columns added
  back at their rows (``index_add``); ``torch.gather`` (DeBERTa's relative attention):
  added back where they were read (``scatter_add``);
- **convolutions** and **transposed convolutions** whose weight is computed in
  ``forward`` or fixed (weight standardization, weight and spectral norm, HiFi-GAN's
  weight-normed upsampling, a blur kernel; :class:`_Conv`): the
  input's products as one ``convolution_backward`` on ``V * N`` samples, the weight's as
  one with ``V * Cout`` output channels (the samples summed, as autograd sums them);
- **weight norm** (``torch._weight_norm``, weight-normed layers): its two products in
  closed form on the columns (:class:`_WeightNorm`);
- **matrix products** (``bmm``, ``matmul``, ``@``, ``baddbmm``: eager attention's
  ``softmax(q kᵀ) v``): torch batches them, but copies each column's ``[L, S]`` map
  whole for a transposed operand; here each side's product is one ``matmul`` with the
  columns folded where that copies less (:class:`_Product`);
- **a learned 0-d scalar** times (or dividing) a map: its products as one
  matrix-vector product over the columns (torch's batching ran the full sum to the
  scalar once per column; :class:`_ByScalar`).

On the CPU (``benchmarks/results/glue-kernels-*``) this is 1.4-2× faster than torch's
loop per call for most of them. Layer, group and instance norms in the glue are left to
torch: their folded backward measured 2.5× slower than the loop, with 2-3× its memory.

A folded node records the arguments of the torch node it stands for under the same
``_saved_*`` names (``stands_for``: its name), so the windowed glue reads pads and 2-d
pooling on its boxes as before. Calls it cannot reproduce exactly (an unusual argument,
a tensor subclass, an input that needs no grad) are left as they are.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ggnchunk._autograd import is_batched, on_columns, will_run

__all__ = [
    "FOLDERS",
    "fold_glue_call",
    "folded_conv",
    "folded_product",
    "folded_rows",
    "glue_kernel_workspace",
    "pad_transposed",
    "scatter_to_argmax",
]


class _FoldedGlue(torch.autograd.Function):
    """A glue call whose backward takes all columns at once (see the module)."""

    @staticmethod
    def forward(ctx, spec: _Spec, x: Tensor) -> Any:
        result = spec.call(x)
        out, extra = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
        spec.recorded(ctx, x, out, extra)
        ctx.spec = spec
        ctx.in_shape = tuple(x.shape)
        ctx.workspace = spec.workspace(x.shape, out.shape)
        if spec.saves_output:
            ctx.save_for_backward(out)
        if extra:
            ctx.mark_non_differentiable(*extra)
            return (out, *extra)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor, *_: Any) -> tuple[None, Tensor | None]:
        spec, saved = ctx.spec, ctx.saved_tensors
        (result,) = on_columns([grad], lambda g: (spec.transposed(ctx, g, saved),))
        return None, result


class _FoldedTensors(torch.autograd.Function):
    """A glue call of several tensors (batch norm, a convolution, weight norm).

    All columns at once, at every tensor that needs grad; the spec says what to save.
    """

    @staticmethod
    def forward(ctx, spec: _Several, *tensors: Tensor | None) -> Tensor:
        out = spec.call(*tensors)
        ctx.spec = spec
        spec.recorded(ctx, tensors)
        ctx.shapes = [None if t is None else tuple(t.shape) for t in tensors]
        ctx.workspace = spec.workspace(tensors, out)
        ctx.save_for_backward(*spec.kept(tensors))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        spec, saved = ctx.spec, ctx.saved_tensors
        # what this pass asks for (a weight's products only where they are wanted)
        # (the node's inputs are the call's tensors that are not None, in order)
        positions = itertools.accumulate(shape is not None for shape in ctx.shapes)
        needs = tuple(
            need and will_run(ctx, position - 1)
            for position, need in zip(positions, ctx.needs_input_grad[1:], strict=True)
        )
        results = on_columns([grad], lambda g: spec.transposed(saved, ctx.shapes, g, needs))
        return (None, *results)


class _Several:
    """The folded form of a call of several tensors (see :class:`_FoldedTensors`)."""

    def __init__(self) -> None:
        self.tensors: tuple[Tensor | None, ...] = ()  # the call's, until it ran

    def call(self, *tensors: Tensor | None) -> Tensor:
        raise NotImplementedError

    def kept(self, tensors: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        """What the backward needs of the call's tensors (saved on the node)."""
        return tensors

    def recorded(self, ctx: Any, tensors: tuple[Tensor | None, ...]) -> None:
        """Note on the node what the torch node it stands for would have saved."""

    def workspace(self, tensors: tuple[Tensor | None, ...], out: Tensor) -> int:
        """Elements per column (all samples) the backward takes beyond its vectors."""
        return 0

    def release(self) -> None:
        """Drop the call's tensors (the node saves what its backward needs)."""
        self.tensors = ()

    def transposed(
        self, saved: tuple[Tensor | None, ...], shapes: list, grads: Tensor,
        needs: tuple[bool, ...],
    ) -> tuple[Tensor | None, ...]:  # fmt: skip
        """The columns' products at each tensor (``None`` where none is needed).

        Args:
            saved: What :meth:`kept` saved.
            shapes: The call's tensors' shapes (``None`` for an absent one).
            grads: The columns at the output, ``[V, *out.shape]``.
            needs: Which tensors need them.

        Returns:
            One ``[V, *shape]`` tensor (or ``None``) per tensor of the call.
        """
        raise NotImplementedError


class _Conv(_Several):
    r"""``F.conv1d/2d/3d`` or ``F.conv_transpose1d/2d/3d`` whose weight is computed.

    Weight standardization (timm's ``StdConv2d``, NFNets), weight and spectral norm
    (parametrized layers; HiFi-GAN's weight-normed transposed upsampling), a fixed blur
    kernel: layers without a rule, whose ``convolution_backward`` torch's batching runs
    once per column. Here the columns are folded into the batch for the input's
    products (:math:`V N` samples), and into the output channels for the weight's (one
    weight gradient of :math:`V C_{out}` channels, the samples summed as autograd sums
    them).
    """

    def __init__(self, args: dict[str, Any], dims: int, transposed: bool = False):
        super().__init__()
        self.args, self.dims, self.is_transposed = args, dims, transposed

    def call(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if self.is_transposed:
            conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)
            return conv[self.dims - 1](x, weight, bias, **self.args)
        conv = (F.conv1d, F.conv2d, F.conv3d)[self.dims - 1]
        return conv(x, weight, bias, **self.args)

    def kept(self, tensors):
        x, weight, _ = tensors  # the input for the weight's products only
        return (x if weight.requires_grad else None, weight)

    def workspace(self, tensors, out):
        # per column: its vectors in the weight product's order, its weight product
        weight = tensors[1]
        return out.numel() + (weight.numel() if weight.requires_grad else 0)

    def geometry(self) -> tuple[list[int], list[int], list[int], bool, list[int], int]:
        """``convolution_backward``'s arguments from ``stride`` to ``groups``."""
        args = self.args
        return (
            args["stride"], args["padding"], args["dilation"], self.is_transposed,
            args.get("output_padding", [0] * self.dims), args["groups"],
        )  # fmt: skip

    def transposed(self, saved, shapes, grads, needs):
        """Input ``[N, Cin, *S]``, weight and bias products.

        The weight is ``[Cout, Cin / G, *K]`` (``[Cin, Cout / G, *K]`` for a transposed
        convolution). Columns at the output ``[V, N, Cout, *S']``; see
        :meth:`_Several.transposed`.
        """
        (x, weight), in_shape = saved, shapes[0]
        v, n, c = grads.shape[:3]
        out = grads.shape[3:]
        common = self.geometry()
        g = common[-1]
        dx = dw = db = None
        w = weight.detach()
        if needs[0]:
            folded = grads.reshape(v * n, c, *out)
            dx = torch.ops.aten.convolution_backward(
                folded, folded.new_empty(1).expand(v * n, *in_shape[1:]), w, None,
                *common, [True, False, False],
            )[0].reshape(v, n, *in_shape[1:])  # fmt: skip
        if needs[1] and x is not None:
            # channels in the order [G, V, Cout/G]: each group's columns side by side
            order = grads.reshape(v, n, g, c // g, *out).transpose(0, 1).transpose(1, 2)
            order = order.reshape(n, g * v * (c // g), *out)
            if self.is_transposed:  # [Cin, V·Cout/G, *K]
                shape = (w.shape[0], v * w.shape[1], *w.shape[2:])
            else:  # [G·V·Cout/G, Cin/G, *K]
                shape = (g * v * (c // g), *w.shape[1:])
            dw = torch.ops.aten.convolution_backward(
                order, x.detach(), w.new_empty(1).expand(shape), None, *common,
                [False, True, False],
            )[1]  # fmt: skip
            if self.is_transposed:
                dw = dw.reshape(w.shape[0], v, *w.shape[1:]).transpose(0, 1)
            else:
                dw = dw.reshape(g, v, c // g, *w.shape[1:]).transpose(0, 1)
            dw = dw.reshape(v, *w.shape)
        if needs[2]:
            db = grads.sum([1, *range(3, grads.dim())])
        return dx, dw, db


class _WeightNorm(_Several):
    r"""``w = g \, v / \lVert v \rVert`` (the norm over every axis but ``dim``).

    With :math:`u = v / \lVert v \rVert`: :math:`\partial g = \sum \partial w \odot u`
    and :math:`\partial v = (g / \lVert v \rVert)(\partial w - u \sum \partial w \odot u)`,
    the sums over the axes the norm is taken over, per column.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def call(self, v: Tensor, g: Tensor) -> Tensor:
        return torch._weight_norm(v, g, self.dim)

    def workspace(self, tensors, out):
        return 2 * tensors[0].numel()  # the products with the direction, per column

    def transposed(self, saved, shapes, grads, needs):
        """The direction ``v`` (the weight's shape) and magnitude ``g``'s products.

        ``g`` has ones on the normed axes, or is a scalar for ``dim=-1``; columns at
        the weight ``[V, *v.shape]``; see :meth:`_Several.transposed`.
        """
        v, g = (t.detach() for t in saved)
        axes = tuple(range(v.dim())) if self.dim == -1 else tuple(
            a for a in range(v.dim()) if a != self.dim % v.dim()
        )  # fmt: skip
        norm = v.square().sum(axes, keepdim=True).sqrt()
        u = v / norm
        along = (grads * u).sum(tuple(a + 1 for a in axes), keepdim=True)  # [V, ...1...]
        dg = dv = None
        if needs[1]:
            dg = along.reshape(grads.shape[0], *g.shape)
        if needs[0]:
            dv = (g.reshape(norm.shape) / norm) * (grads - u * along)
        return dv, dg


class _BatchNormEval(_Several):
    r"""Batch normalization with running statistics: an affine map per channel.

    :math:`y = (x - \mu) r w + b` with the recorded running mean :math:`\mu` and
    :math:`r = (\sigma^2 + \epsilon)^{-1/2}`: :math:`\partial x = g\,r w`,
    :math:`\partial w = \sum g\,(x - \mu) r`, :math:`\partial b = \sum g` (sums over the
    samples and positions).
    """

    def __init__(self, args: dict[str, Any], mean: Tensor, var: Tensor, eps: float):
        super().__init__()
        self.args, self.mean, self.var, self.eps = args, mean, var, eps

    def call(self, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
        return F.batch_norm(x, self.mean, self.var, weight=weight, bias=bias, **self.args)

    def kept(self, tensors):
        return tensors[:2]  # the input and the weight

    def workspace(self, tensors, out):
        return tensors[0].numel()  # the weight's products before their sums

    def transposed(self, saved, shapes, grads, needs):
        """Input ``[N, C, *S]``, weight ``[C]`` (or ``None``) and bias products.

        Columns at the output ``[V, *x.shape]``; see :meth:`_Several.transposed`.
        """
        x, weight = saved
        channel = [1] * x.dim()
        channel[1] = x.shape[1]
        rstd = (self.var.detach() + self.eps).rsqrt().reshape(channel)
        scale = rstd if weight is None else rstd * weight.detach().reshape(channel)
        dx = grads * scale if needs[0] else None
        sums = [0] + [d + 1 for d in range(x.dim()) if d != 1]  # all but columns, channels
        dw = db = None
        if needs[1] and weight is not None:
            xhat = (x.detach() - self.mean.detach().reshape(channel)) * rstd
            dw = (grads * xhat).sum(sums[1:])
        if needs[2]:
            db = grads.sum(sums[1:])
        return dx, dw, db


class _ByScalar(_Several):
    r"""``a * s``, ``s * a`` or ``a / s`` with ``s`` a 0-d tensor that needs grad.

    A learned scalar in the glue (ReZero's ``h + alpha * f(h)``, a layer scale or a
    temperature kept as a 0-d parameter): torch's batching has no rule for the full sum
    that reduces the columns' products to its shape, so it ran that once per column.
    Here :math:`\partial s = \langle g, a\rangle` (times :math:`-1/s^2` for a
    quotient) as one matrix-vector product over the columns, and
    :math:`\partial a = g\,s` (:math:`g / s`). The node stands for torch's
    ``MulBackward0``/``DivBackward0`` with the same saved values, so windowed glue reads
    it as before.
    """

    def __init__(self, func: Callable[..., Any], divide: bool, scalar_first: bool):
        super().__init__()
        self.func, self.divide, self.scalar_first = func, divide, scalar_first

    def call(self, *tensors: Tensor | None) -> Tensor:
        return self.func(*tensors)

    def recorded(self, ctx, tensors):
        ctx.stands_for = "DivBackward0" if self.divide else "MulBackward0"
        ctx._saved_self, ctx._saved_other = tensors

    def workspace(self, tensors, out):
        return out.numel()  # the columns made contiguous for the product

    def transposed(self, saved, shapes, grads, needs):
        """Products at both operands; see :meth:`_Several.transposed`."""
        first, second = (t.detach() for t in saved)
        scalar, tensor = (first, second) if self.scalar_first else (second, first)
        need_scalar, need_tensor = needs if self.scalar_first else needs[::-1]
        count = grads.shape[0]
        d_scalar = d_tensor = None
        if need_tensor:
            d_tensor = grads / scalar if self.divide else grads * scalar
        if need_scalar:
            dot = torch.mv(grads.reshape(count, -1), tensor.reshape(-1))
            d_scalar = -dot / (scalar * scalar) if self.divide else dot
        if self.scalar_first:
            return d_scalar, d_tensor
        return d_tensor, d_scalar


class _Product(_Several):
    r"""A matrix product ``a @ b`` (``bmm``, ``matmul``; ``baddbmm`` adds ``input``).

    Eager attention's ``softmax(q kᵀ) v`` (``nn.MultiheadAttention`` with its default
    ``need_weights=True``, attention written out): torch's batching of a product's
    backward copies the columns' ``[L, S]`` maps whole (a transposed operand made
    contiguous per column: about a quarter of such a pass's time, and two more maps per
    column). Here :math:`\partial a = \alpha\, g\, b^\top` and
    :math:`\partial b = \alpha\, a^\top g` (summed over the axes an operand was
    broadcast along), :math:`\partial\,\mathrm{input} = \beta g`, each as one product
    in which either the recorded operand is broadcast over the columns or the columns
    are folded into the rows (columns) of the other side: whichever copies less.
    """

    def __init__(self, func: Callable[..., Any], alpha: float, beta: float, added: bool):
        super().__init__()
        self.func, self.alpha, self.beta, self.added = func, alpha, beta, added

    def call(self, *tensors: Tensor | None) -> Tensor:
        if self.added:
            return self.func(*tensors, beta=self.beta, alpha=self.alpha)
        return self.func(*tensors)

    def kept(self, tensors):
        *_, a, b = tensors  # each operand for the other's products only
        return (a if b.requires_grad else None, b if a.requires_grad else None)

    def workspace(self, tensors, out):
        # per column: the larger of the two products' copies (a side or the columns)
        *_, a, b = tensors
        return out.numel() + max(a.numel(), b.numel())

    def transposed(self, saved, shapes, grads, needs):
        """Products at ``input`` (``baddbmm``), ``a`` and ``b``.

        Columns at the output ``[V, *out.shape]``; see :meth:`_Several.transposed`.
        """
        a, b = (None if t is None else t.detach() for t in saved)
        *first, a_shape, b_shape = shapes
        *first_needs, need_a, need_b = needs
        vector = len(b_shape) == 1  # ``a @ v``: ``v`` as one column, the output squeezed
        if vector:
            grads, b_shape = grads.unsqueeze(-1), (*b_shape, 1)
            b = None if b is None else b.unsqueeze(-1)
        results: list[Tensor | None] = []
        if self.added:
            results.append(
                _columns_summed_to(_scaled(grads, self.beta), first[0])
                if first_needs[0]
                else None
            )
        da = db = None
        if need_a:
            da = _columns_summed_to(
                _scaled(_times_transposed(grads, b), self.alpha), a_shape
            )
        if need_b:
            db = _columns_summed_to(
                _scaled(_transposed_times(a, grads), self.alpha), b_shape
            )
            db = db.squeeze(-1) if vector else db
        return (*results, da, db)


def _scaled(values: Tensor, factor: float) -> Tensor:
    return values if factor == 1 else values * factor


def _times_transposed(g: Tensor, b: Tensor) -> Tensor:
    """``g @ bᵀ`` for columns ``g`` ``[V, *batch, m, n]`` and one ``b`` ``[*, k, n]``."""
    v, *batch, m, n = g.shape
    k = b.shape[-2]
    # broadcast b over the columns: torch copies it once per column (not at all for a
    # matrix); or fold the columns into g's rows: one copy of g
    if b.dim() == 2 or k <= m:
        return torch.matmul(g, b.mT)
    rows = g.movedim(0, -3).reshape(*batch, v * m, n)
    return torch.matmul(rows, b.mT).reshape(*batch, v, m, k).movedim(-3, 0)


def _transposed_times(a: Tensor, g: Tensor) -> Tensor:
    """``aᵀ @ g`` for one ``a`` ``[*, m, k]`` and columns ``g`` ``[V, *batch, m, n]``."""
    v, *batch, m, n = g.shape
    k = a.shape[-1]
    # broadcast a over the columns (a copy per column), or fold the columns into g's
    # columns (one copy of g)
    if k <= n:
        return torch.matmul(a.mT, g)
    cols = g.movedim(0, -1).reshape(*batch, m, n * v)
    return torch.matmul(a.mT, cols).reshape(*batch, k, n, v).movedim(-1, 0)


def _columns_summed_to(values: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Columns ``[V, *broadcast]`` summed over the axes a ``shape`` operand took on."""
    extra = values.dim() - 1 - len(shape)
    if extra:
        values = values.sum(tuple(range(1, 1 + extra)))
    ones = tuple(
        i + 1 for i, size in enumerate(shape) if size == 1 and values.shape[i + 1] != 1
    )
    values = values.sum(ones, keepdim=True) if ones else values
    return values.reshape(values.shape[0], *shape)


class _Spec:
    """One call's folded form: the call, its backward on ``[V, *out]`` columns."""

    saves_output = False

    def __init__(self, func: Callable[..., Any], args: dict[str, Any]):
        self.func, self.args = func, args
        self.stands_for: str | None = None  # the torch node's name, where read
        self.saved: dict[str, Any] = {}  # its saved arguments, by their names

    def call(self, x: Tensor) -> Any:
        return self.func(x, **self.args)

    def recorded(self, ctx: Any, x: Tensor, out: Tensor, extra: tuple) -> None:
        """Note on the node what the torch node it stands for would have saved."""
        if self.stands_for is not None:
            ctx.stands_for = self.stands_for
            for name, value in self.saved.items():
                setattr(ctx, f"_saved_{name}", value)

    def workspace(self, in_shape: torch.Size, out_shape: torch.Size) -> int:
        """Elements per column (all samples) the backward takes beyond its vectors."""
        return 0

    def release(self) -> None:
        """Drop what only the forward needed (the recorded graph holds this spec)."""
        self.input = None

    def transposed(self, ctx: Any, grads: Tensor, saved: tuple) -> Tensor:
        raise NotImplementedError


Direct = Callable[[Tensor, tuple[int, ...]], Tensor]
"""A backward on the folded columns: ``(grads, folded input shape) -> input grads``."""


class _Linear(_Spec):
    """A linear call acting on the last ``keep`` axes: its own backward, ``V·N`` samples.

    With ``direct``, the backward kernel torch would run per column runs once, on the
    columns folded into the leading axis. Without, the call is taken on an all-zeros
    input (one element, expanded) with the columns folded in, and autograd's own
    backward of it gives the columns' transposed Jacobian products.
    """

    def __init__(self, func: Callable[..., Any], args: dict[str, Any], keep: int,
                 direct: Direct | None = None):  # fmt: skip
        super().__init__(func, args)
        self.keep, self.direct = keep, direct

    def release(self) -> None:
        super().release()
        if self.direct is not None:  # the backward needs neither the call nor its
            self.func, self.args = None, {}  # arguments (a ``where``'s other side)

    def workspace(self, in_shape: torch.Size, out_shape: torch.Size) -> int:
        if self.direct is not None:
            return math.prod(in_shape)  # a contiguous copy a kernel may make
        # the call's output on the zeros, and a contiguous copy of the input a
        # kernel may make
        return math.prod(in_shape) + math.prod(out_shape)

    def transposed(self, ctx: Any, grads: Tensor, saved: tuple) -> Tensor:
        shape = ctx.in_shape
        v = grads.shape[0]
        lead = v * math.prod(shape[: len(shape) - self.keep])
        folded = (lead, *shape[len(shape) - self.keep :])
        if self.direct is not None:
            tail = grads.shape[grads.dim() - self.keep :]
            return self.direct(grads.reshape(lead, *tail), folded).reshape(v, *shape)
        zero = torch.zeros((), dtype=grads.dtype, device=grads.device, requires_grad=True)
        with torch.enable_grad():
            probe = zero.expand(folded)
            out = self.call(probe)
            out = out[0] if isinstance(out, tuple) else out
            (back,) = torch.autograd.grad(out, probe, grads.reshape(out.shape))
        return back.reshape(v, *shape)


class _MaxPool(_Spec):
    """Max pooling (``d`` spatial axes, also adaptive): vectors go to the argmax."""

    def __init__(self, func, args, dims: int, indices_asked: bool):
        super().__init__(func, args)
        self.dims, self.indices_asked = dims, indices_asked
        self.indices: Tensor | None = None

    def call(self, x):
        out, self.indices = self.func(x, **self.args, return_indices=True)
        return (out, self.indices) if self.indices_asked else out

    def recorded(self, ctx, x, out, extra):
        super().recorded(ctx, x, out, extra)
        ctx._saved_result1 = self.indices  # also where the user did not ask for them

    def release(self):
        super().release()
        self.indices = None  # the node keeps them (``_saved_result1``)

    def transposed(self, ctx, grads, saved):
        return scatter_to_argmax(grads, ctx._saved_result1, ctx.in_shape, self.dims)


def scatter_to_argmax(
    columns: Tensor, indices: Tensor, in_shape: tuple[int, ...], dims: int
) -> Tensor:
    """Max pooling's transposed Jacobian: each output's vectors added at its argmax.

    Args:
        columns: ``[V, *lead, *out]`` vectors at the pooling's output (``dims`` spatial
            axes last).
        indices: ``[*lead, *out]``: the recorded argmax of each output, a position in
            the flattened input plane (as ``return_indices=True`` gives it).
        in_shape: The input's shape ``(*lead, *in)``.
        dims: How many spatial axes the pooling has.

    Returns:
        ``[V, *in_shape]``.
    """
    v = columns.shape[0]
    plane = math.prod(in_shape[len(in_shape) - dims :])
    flat = columns.reshape(v, *in_shape[: len(in_shape) - dims], -1)
    index = indices.reshape(1, *indices.shape[: indices.dim() - dims], -1).expand(
        flat.shape
    )
    result = flat.new_zeros(*flat.shape[:-1], plane)
    if is_batched(flat):  # torch batches it (or loops): out of place
        return result.scatter_add(-1, index, flat).reshape(v, *in_shape)
    # in place: the out-of-place form copies the zeros once more (2.4× the time)
    return result.scatter_add_(-1, index, flat).reshape(v, *in_shape)


class _Rows(_Spec):
    """``x[index]`` or ``x[:, ..., index]``: the columns added back at their rows.

    The rows of one axis (``axis``) gathered by an integer tensor.
    """

    def call(self, x):
        axis = self.args["axis"]
        return x[(slice(None),) * axis + (self.args["index"],)]

    def workspace(self, in_shape, out_shape):
        return 0

    def transposed(self, ctx, grads, saved):
        shape, axis = ctx.in_shape, self.args["axis"]
        index = self.args["index"].reshape(-1).to(torch.int64) % shape[axis]
        flat = grads.reshape(
            grads.shape[0], *shape[:axis], index.numel(), *shape[axis + 1 :]
        )
        result = flat.new_zeros(grads.shape[0], *shape)
        return result.index_add(1 + axis, index, flat)


class _Points(_Spec):
    """``x[i, j]``: points of the leading axes gathered by integer tensors.

    OpenAI CLIP's end tokens, ``x[arange(N), text.argmax(-1)]``: the index tensors
    broadcast together; the columns are added back at their points (one ``index_add``
    on the leading axes flattened), where torch's batching ran ``index_put`` once per
    column.
    """

    def call(self, x):
        return x[self.args["index"]]

    def transposed(self, ctx, grads, saved):
        shape, index = ctx.in_shape, self.args["index"]
        lead, rest = shape[: len(index)], shape[len(index) :]
        linear = torch.zeros((), dtype=torch.int64, device=grads.device)
        for entry, size in zip(index, lead, strict=True):
            linear = linear * size + entry.to(device=grads.device, dtype=torch.int64) % size
        count = grads.shape[0]
        source = grads.reshape(count, linear.numel(), *rest)
        result = grads.new_zeros(count, math.prod(lead), *rest)
        result.index_add_(1, linear.reshape(-1), source)
        return result.view(count, *shape)


class _Gather(_Spec):
    """``torch.gather(x, dim, index)``: the columns added back where they were read.

    DeBERTa's relative attention gathers its content-to-position scores along the keys;
    torch's batching ran ``gather_backward`` once per column. One ``scatter_add`` takes
    all columns, on a copy of the index as the call read it.
    """

    def call(self, x):
        return torch.gather(x, self.args["dim"], self.args["index"])

    def transposed(self, ctx, grads, saved):
        index, count = self.args["index"], grads.shape[0]
        result = grads.new_zeros(count, *ctx.in_shape)
        spread = index.to(grads.device).unsqueeze(0).expand(count, *index.shape)
        return result.scatter_add_(1 + self.args["dim"], spread, grads)


class _Softmax(_Spec):
    saves_output = True

    def __init__(self, func, args, log: bool, x_dtype: torch.dtype):
        super().__init__(func, args)
        self.log, self.x_dtype = log, x_dtype

    def workspace(self, in_shape, out_shape):
        return 0

    def transposed(self, ctx, grads, saved):
        (y,) = saved
        dim = self.args["dim"] % y.dim() - y.dim()  # from the end: the columns lead
        if is_batched(grads):  # torch batches (or loops)
            kernel = (
                torch._log_softmax_backward_data if self.log
                else torch._softmax_backward_data
            )  # fmt: skip
            return kernel(grads, y.expand_as(grads), dim, y.dtype).to(self.x_dtype)
        # the output broadcast over the columns, not copied per column (torch's kernel
        # would take it contiguous: twice the memory); one array per column is made
        if self.log:
            back = torch.addcmul(grads, y.exp(), grads.sum(dim, keepdim=True), value=-1)
        else:
            back = grads * y
            back.addcmul_(y, back.sum(dim, keepdim=True), value=-1)
        return back.to(self.x_dtype)


class _Activation(_Spec):
    """A functional activation in the glue (``F.silu``, ``F.gelu``, ``torch.tanh``, ...).

    torch's batching has no rule for most activation backward kernels, so it ran them
    once per column (a kernel call and a copy into the stacked result each: 6,148
    ``silu_backward`` calls in one pass of a 32x32 time-conditioned U-Net). Here the
    derivative ``f'(x)`` is made once, in the forward pass, by the same backward kernel
    applied to ones (as :class:`ggnchunk._rules.activation.ActivationRule` does for the
    layers), and multiplies all columns at once. The node stands for torch's own
    (``stands_for``), so the windowed glue crosses it as the pointwise node it is.
    """

    def __init__(self, func, args, slope: Callable[[Tensor, Tensor], Tensor], name: str):
        super().__init__(func, args)
        self.slope = slope  # (input, output) -> f'(input)
        self.stands_for = name

    def recorded(self, ctx, x, out, extra):
        super().recorded(ctx, x, out, extra)
        with torch.no_grad():
            ctx.slope = self.slope(x.detach(), out.detach())

    def release(self) -> None:
        super().release()
        self.func, self.args = None, {}  # the backward needs the slope only

    def transposed(self, ctx, grads, saved):
        return grads * ctx.slope  # [V, *x] (or one column's [*x]) times [*x]


# function: (its argument names, the activation layer it computes, its node's name). The
# derivative is the layers' own (:func:`ggnchunk._rules.activation.derivative`: torch's
# backward kernel applied to ones), from the layer made with the call's arguments
_ACTIVATIONS: dict[Any, tuple[tuple[str, ...], type[torch.nn.Module], str]] = {
    F.silu: (("input", "inplace"), torch.nn.SiLU, "SiluBackward0"),
    F.gelu: (("input", "approximate"), torch.nn.GELU, "GeluBackward0"),
    F.mish: (("input", "inplace"), torch.nn.Mish, "MishBackward0"),
    F.hardswish: (("input", "inplace"), torch.nn.Hardswish, "HardswishBackward0"),
    F.hardsigmoid: (("input", "inplace"), torch.nn.Hardsigmoid, "HardsigmoidBackward0"),
    F.leaky_relu: (("input", "negative_slope", "inplace"), torch.nn.LeakyReLU,
                   "LeakyReluBackward0"),
    F.elu: (("input", "alpha", "inplace"), torch.nn.ELU, "EluBackward0"),
    F.softplus: (("input", "beta", "threshold"), torch.nn.Softplus, "SoftplusBackward0"),
    F.hardtanh: (("input", "min_val", "max_val", "inplace"), torch.nn.Hardtanh,
                 "HardtanhBackward0"),
    F.relu6: (("input", "inplace"), torch.nn.ReLU6, "HardtanhBackward0"),
    torch.tanh: (("input",), torch.nn.Tanh, "TanhBackward0"),
    Tensor.tanh: (("input",), torch.nn.Tanh, "TanhBackward0"),
}  # fmt: skip
"""Functional activations folded in the glue (see :class:`_Activation`)."""


def _activation(func: Any) -> Callable[[tuple, dict], _Spec | None]:
    names, layer, name = _ACTIVATIONS[func]

    def fold(args: tuple, kwargs: dict) -> _Spec | None:
        bound = _bind(names, args, kwargs)
        if bound is None or not _foldable(bound.get("input")) or bound.get("inplace"):
            return None  # in place: torch's own (its node saves the output)
        x = bound.pop("input")
        bound.pop("inplace", None)
        if not all(
            isinstance(v, (int, float, str)) and not isinstance(v, bool)
            for v in bound.values()
        ):
            return None
        # (imported here: the rules import this module's transposed pads)
        from ggnchunk._rules.activation import derivative

        module = layer(**bound)
        spec = _Activation(func, bound, lambda x, y: derivative(module, x), name)
        return _on(spec, x)

    return fold


# -- binding the user's calls ----------------------------------------------------------


def _on(spec: _Spec, x: Tensor) -> _Spec:
    spec.input = x  # the call's tensor that needs grad
    return spec


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any] | None:
    bound = dict(zip(names, args, strict=False))
    if len(args) > len(names):
        return None
    for key, value in kwargs.items():
        if key not in names or key in bound:
            return None
        bound[key] = value
    return bound


def _plain(x: Any) -> bool:
    """A plain floating tensor (subclasses keep their own dispatch)."""
    return (
        (type(x) is Tensor or isinstance(x, torch.nn.Parameter))
        and x.dtype.is_floating_point and not x.is_nested and x.layout is torch.strided
    )  # fmt: skip


def _foldable(x: Any) -> bool:
    return _plain(x) and x.requires_grad and torch.is_grad_enabled()


def _ints(value: Any, dims: int) -> tuple[int, ...] | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * dims
    if isinstance(value, (tuple, list)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        value = tuple(value)
        if len(value) == 1:
            return value * dims
        return value if len(value) == dims else None
    return None


def _pad(args: tuple, kwargs: dict) -> _Spec | None:
    bound = _bind(("input", "pad", "mode", "value"), args, kwargs)
    if bound is None or not _foldable(bound.get("input")):
        return None
    x, pad = bound["input"], bound.get("pad")
    mode = bound.get("mode", "constant")
    if not isinstance(pad, (tuple, list)) or not pad or len(pad) % 2:
        return None
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in pad):
        return None
    d = len(pad) // 2
    if mode == "constant":
        if d > x.dim():
            return None
        keep = x.dim()
    elif mode in ("reflect", "replicate", "circular"):
        if d > 3 or x.dim() not in (d + 1, d + 2):
            return None
        keep = d + 1
    else:
        return None
    options = {"pad": list(pad), "mode": mode, "value": bound.get("value")}
    spec = _Linear(F.pad, options, keep, _pad_backward(mode, list(pad)))
    if mode == "constant":
        spec.stands_for, spec.saved = "ConstantPadNdBackward0", {"pad": tuple(pad)}
    elif mode != "circular":
        kind = "Reflection" if mode == "reflect" else "Replication"
        spec.stands_for = f"{kind}Pad{d}DBackward0"
        spec.saved = {"padding": tuple(pad)}
    return _on(spec, x)


def _shaped(like: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A tensor of ``shape`` whose values no kernel reads (one element, expanded)."""
    return like.new_zeros(()).expand(shape)


def _pad_backward(mode: str, pad: list[int]) -> Direct | None:
    d = len(pad) // 2
    if mode == "constant":
        return lambda g, shape: torch.constant_pad_nd(g, [-p for p in pad])
    if mode == "circular":
        return None
    kind = "reflection" if mode == "reflect" else "replication"
    kernel = getattr(torch.ops.aten, f"{kind}_pad{d}d_backward")
    return lambda g, shape: kernel(g, _shaped(g, shape), pad)


def pad_transposed(
    grads: Tensor, shape: tuple[int, ...], pad: list[int], mode: str
) -> Tensor:
    """``F.pad``'s backward: ``grads`` on the padded maps back onto maps of ``shape``.

    One call on all the maps at once (the columns folded into the batch axis): torch's
    own backward kernel (reflection, replication, constant), or autograd's backward of
    the pad taken on zeros (circular).

    Args:
        grads: ``[B, C, *padded]``.
        shape: ``(B, C, *S)``.
        pad: ``F.pad``'s pads (last axis first).
        mode: ``F.pad``'s mode.

    Returns:
        ``[B, C, *S]``.
    """
    direct = _pad_backward(mode, pad)
    if direct is not None:
        return direct(grads, shape)
    with torch.enable_grad():
        probe = grads.new_zeros((), requires_grad=True).expand(shape)
        (back,) = torch.autograd.grad(F.pad(probe, pad, mode=mode), probe, grads)
    return back


def _pool_call(
    names: tuple[str, ...], dims: int, args: tuple, kwargs: dict
) -> tuple[dict[str, Any], Tensor] | None:
    """A pooling call's other arguments and its input ``[N?, C, *S]``, or None."""
    bound = _bind(names, args, kwargs)
    if bound is None or not _foldable(bound.get("input")):
        return None
    x = bound.pop("input")
    return (bound, x) if x.dim() in (dims + 1, dims + 2) else None


def _window(bound: dict[str, Any], dims: int) -> tuple[tuple[int, ...], ...] | None:
    """A pooling's kernel, stride (the kernel where not given) and padding, or None."""
    kernel = _ints(bound.get("kernel_size"), dims)
    stride = bound.get("stride")
    stride = kernel if stride is None or stride == [] else _ints(stride, dims)
    padding = _ints(bound.get("padding", 0), dims)
    return None if None in (kernel, stride, padding) else (kernel, stride, padding)


def _avg_pool(func: Any) -> Callable[[tuple, dict], _Spec | None]:
    dims = _POOL_DIMS[func]
    names = ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")
    if dims > 1:
        names += ("divisor_override",)

    def fold(args: tuple, kwargs: dict) -> _Spec | None:
        call = _pool_call(names, dims, args, kwargs)
        if call is None:
            return None
        bound, x = call
        window = _window(bound, dims)
        direct = None
        if dims > 1 and window is not None:
            kernel, stride, padding = window
            backward = getattr(torch.ops.aten, f"avg_pool{dims}d_backward")
            options = (list(kernel), list(stride), list(padding),
                       bool(bound.get("ceil_mode", False)),
                       bool(bound.get("count_include_pad", True)),
                       bound.get("divisor_override"))  # fmt: skip

            def direct(g: Tensor, shape: tuple[int, ...]) -> Tensor:
                return backward(g, _shaped(g, shape), *options)

        spec = _Linear(func, bound, dims + 1, direct)
        if dims == 2 and x.dim() == 4 and window is not None:
            spec.stands_for = "AvgPool2DBackward0"
            spec.saved = {
                "kernel_size": kernel, "stride": stride, "padding": padding,
                "ceil_mode": bool(bound.get("ceil_mode", False)),
                "count_include_pad": bool(bound.get("count_include_pad", True)),
                "divisor_override": bound.get("divisor_override"),
            }  # fmt: skip
        return _on(spec, x)

    return fold


def _adaptive_avg_pool(func: Any) -> Callable[[tuple, dict], _Spec | None]:
    dims = _POOL_DIMS[func]

    def fold(args: tuple, kwargs: dict) -> _Spec | None:
        call = _pool_call(("input", "output_size"), dims, args, kwargs)
        if call is None:
            return None
        bound, x = call
        direct = None
        if _ints(bound.get("output_size"), dims) == (1,) * dims:  # a global average

            def direct(g: Tensor, shape: tuple[int, ...]) -> Tensor:
                plane = math.prod(shape[2:])
                return (g / plane).expand(shape).contiguous()

        elif dims > 1:
            backward = getattr(torch.ops.aten, f"_adaptive_avg_pool{dims}d_backward")

            def direct(g: Tensor, shape: tuple[int, ...]) -> Tensor:
                return backward(g, _shaped(g, shape))

        return _on(_Linear(func, bound, dims + 1, direct), x)

    return fold


def _max_pool(func: Any) -> Callable[[tuple, dict], _Spec | None]:
    dims, adaptive = _POOL_DIMS[func], func in _ADAPTIVE_MAX
    names = (
        ("input", "output_size", "return_indices") if adaptive
        else ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode",
              "return_indices")
    )  # fmt: skip
    with_indices = _WITH_INDICES[func]

    def fold(args: tuple, kwargs: dict) -> _Spec | None:
        call = _pool_call(names, dims, args, kwargs)
        if call is None:
            return None
        bound, x = call
        asked = bool(bound.pop("return_indices", False))
        spec = _MaxPool(with_indices, bound, dims, asked)
        if not adaptive and dims == 2 and x.dim() == 4:
            window = _window(bound, 2)
            dilation = _ints(bound.get("dilation", 1), 2)
            if window is not None and dilation is not None:  # read on boxes
                kernel, stride, padding = window
                spec.stands_for = "MaxPool2DWithIndicesBackward0"
                spec.saved = {
                    "kernel_size": kernel, "stride": stride, "padding": padding,
                    "dilation": dilation, "ceil_mode": bool(bound.get("ceil_mode", False)),
                }  # fmt: skip
        return _on(spec, x)

    return fold


def _softmax(log: bool, names: tuple[str, ...]) -> Callable[[tuple, dict], _Spec | None]:
    def fold(args: tuple, kwargs: dict) -> _Spec | None:
        bound = _bind(names, args, kwargs)
        if bound is None or not _foldable(bound.get("input")):
            return None
        x = bound.pop("input")
        dim, dtype = bound.get("dim"), bound.get("dtype")
        if not isinstance(dim, int) or isinstance(dim, bool) or x.dim() == 0:
            return None
        if not -x.dim() <= dim < x.dim():
            return None
        floating = isinstance(dtype, torch.dtype) and dtype.is_floating_point
        if dtype is not None and not floating:
            return None
        return _on(_Softmax(_SOFTMAX[log], {"dim": dim, "dtype": dtype}, log, x.dtype), x)

    return fold


def _flip(args: tuple, kwargs: dict) -> _Spec | None:
    if len(args) > 2 and not kwargs:  # x.flip(-1, -2)
        args = (args[0], list(args[1:]))
    bound = _bind(("input", "dims"), args, kwargs)
    if bound is None or not _foldable(bound.get("input")):
        return None
    x, dims = bound["input"], bound.get("dims")
    dims = _axes(dims, x.dim())
    if dims is None:
        return None
    direct = lambda g, shape: g.flip(dims)  # noqa: E731
    spec = _Linear(torch.flip, {"dims": dims}, x.dim(), direct)
    spec.stands_for = "FlipBackward0"  # the windowed glue flips boxes
    spec.saved = {"dims": tuple(d % x.dim() for d in dims)}
    return _on(spec, x)


def _roll(args: tuple, kwargs: dict) -> _Spec | None:
    bound = _bind(("input", "shifts", "dims"), args, kwargs)
    if bound is None or not _foldable(bound.get("input")):
        return None
    x, shifts, dims = bound["input"], bound.get("shifts"), bound.get("dims")
    if dims is None or (isinstance(dims, (tuple, list)) and not dims):
        return None  # a roll of the flattened tensor mixes samples
    axes = _axes(dims, x.dim())
    if axes is None:
        return None
    shifts = list(shifts) if isinstance(shifts, (tuple, list)) else [shifts]
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in shifts):
        return None
    back = [-s for s in shifts]
    direct = lambda g, shape: g.roll(back, axes)  # noqa: E731
    return _on(_Linear(torch.roll, {"shifts": shifts, "dims": axes}, x.dim(), direct), x)


def _shuffle(unshuffle: bool) -> Callable[[tuple, dict], _Spec | None]:
    name = "downscale_factor" if unshuffle else "upscale_factor"
    func = F.pixel_unshuffle if unshuffle else F.pixel_shuffle

    def fold(args: tuple, kwargs: dict) -> _Spec | None:
        bound = _bind(("input", name), args, kwargs)
        if bound is None or not _foldable(bound.get("input")) or bound["input"].dim() < 3:
            return None
        factor = bound.get(name)
        if not isinstance(factor, int) or isinstance(factor, bool):
            return None
        inverse = F.pixel_shuffle if unshuffle else F.pixel_unshuffle
        spec = _Linear(func, {name: factor}, 3, lambda g, shape: inverse(g, factor))
        spec.stands_for = (
            "PixelUnshuffleBackward0" if unshuffle else "PixelShuffleBackward0"
        )
        spec.saved = {name: factor}
        return _on(spec, bound["input"])

    return fold


def _masked_fill(args: tuple, kwargs: dict) -> _Spec | None:
    bound = _bind(("input", "mask", "value"), args, kwargs)
    if bound is None or not _foldable(bound.get("input")):
        return None
    x, mask, value = bound["input"], bound.get("mask"), bound.get("value")
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() > x.dim():
        return None
    if isinstance(value, Tensor) and (value.requires_grad or value.dim() != 0):
        return None
    if torch.broadcast_shapes(mask.shape, x.shape) != x.shape:
        return None
    direct = lambda g, shape: g.masked_fill(mask, 0)  # noqa: E731
    options = {"mask": mask, "value": value}
    return _on(_Linear(torch.masked_fill, options, x.dim(), direct), x)


def _where(args: tuple, kwargs: dict) -> _Spec | None:
    bound = _bind(("condition", "input", "other"), args, kwargs)
    if bound is None or len(bound) != 3:
        return None
    condition, a, b = bound["condition"], bound["input"], bound["other"]
    if not isinstance(condition, Tensor) or condition.dtype != torch.bool:
        return None
    grads = [isinstance(t, Tensor) and t.requires_grad for t in (a, b)]
    if grads != [True, False] and grads != [False, True]:
        return None
    x, other = (a, b) if grads[0] else (b, a)
    if not _foldable(x) or (isinstance(other, Tensor) and other.dtype != x.dtype):
        return None
    try:
        shape = torch.broadcast_shapes(condition.shape, x.shape,
                                       getattr(other, "shape", ()))  # fmt: skip
    except RuntimeError:
        return None
    if shape != x.shape:
        return None  # the input broadcast: its gradient is a sum (left to torch)
    first = grads[0]

    def where(t: Tensor, other: Any) -> Tensor:
        return (
            torch.where(condition, t, other) if first else torch.where(condition, other, t)
        )

    def direct(g: Tensor, shape: tuple[int, ...]) -> Tensor:
        return torch.where(condition, g, 0) if first else torch.where(condition, 0, g)

    return _on(_Linear(where, {"other": other}, x.dim(), direct), x)


def _affine(value: Any, x: Tensor, shape: tuple[int, ...]) -> bool:
    """Whether a norm's weight or bias is absent or a plain tensor of ``shape``."""
    if value is None:
        return True
    return _plain(value) and value.dtype == x.dtype and tuple(value.shape) == shape


def _norm_input(x: Any, *affine: Any) -> bool:
    """A norm's input: floating, plain, and something of the call needs grad."""
    if not _plain(x):
        return False
    needs = x.requires_grad or any(
        isinstance(t, Tensor) and t.requires_grad for t in affine
    )
    return needs and torch.is_grad_enabled()


def _batch_norm(args: tuple, kwargs: dict) -> _BatchNormEval | None:
    names = ("input", "running_mean", "running_var", "weight", "bias", "training",
             "momentum", "eps")  # fmt: skip
    bound = _bind(names, args, kwargs)
    if bound is None or bound.get("training", False):
        return None  # batch statistics mix the samples: the engine's checks say so
    x, w, b = bound.get("input"), bound.get("weight"), bound.get("bias")
    mean, var = bound.get("running_mean"), bound.get("running_var")
    if not _norm_input(x, w, b) or x.dim() < 2 or x.numel() == 0:
        return None
    channels = x.shape[1]
    if not (_affine(w, x, (channels,)) and _affine(b, x, (channels,))):
        return None
    for stat in (mean, var):
        if not isinstance(stat, Tensor) or stat.requires_grad or stat.shape != (channels,):
            return None
    eps = float(bound.get("eps", 1e-5))
    options = {"training": False, "momentum": bound.get("momentum", 0.1), "eps": eps}
    spec = _BatchNormEval(options, mean, var, eps)
    spec.tensors = (x, w, b)
    return spec


# the internal switch (tests, benchmarks): False leaves transposed convolutions in the
# glue to torch's loop per column, and their weights to one pass per sample, as before
TRANSPOSED_CONVS = True


def _conv(dims: int, transposed: bool = False) -> Callable[[tuple, dict], _Conv | None]:
    if transposed:
        names = ("input", "weight", "bias", "stride", "padding", "output_padding",
                 "groups", "dilation")  # fmt: skip
    else:
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")

    def fold(args: tuple, kwargs: dict) -> _Conv | None:
        bound = _bind(names, args, kwargs)
        if bound is None or (transposed and not TRANSPOSED_CONVS):
            return None
        x, w, b = bound.get("input"), bound.get("weight"), bound.get("bias")
        if not (_norm_input(x, w, b) and _plain(w)) or x.dim() != dims + 2:
            return None  # an unbatched input, or nothing needs grad: torch's own
        if x.dtype != w.dtype or w.dim() != dims + 2 or x.numel() == 0:
            return None
        if b is not None and not (_plain(b) and b.dtype == w.dtype and b.dim() == 1):
            return None
        stride = _ints(bound.get("stride", 1), dims)
        padding = _ints(bound.get("padding", 0), dims)  # "same"/"valid": torch's own
        dilation = _ints(bound.get("dilation", 1), dims)
        groups = bound.get("groups", 1)
        if None in (stride, padding, dilation) or not isinstance(groups, int):
            return None
        args = {"stride": list(stride), "padding": list(padding),
                "dilation": list(dilation), "groups": groups}  # fmt: skip
        if transposed:
            output_padding = _ints(bound.get("output_padding", 0), dims)
            if output_padding is None:
                return None
            args["output_padding"] = list(output_padding)
        spec = _Conv(args, dims, transposed)
        spec.tensors = (x, w, b)
        return spec

    return fold


def folded_conv(node: Any) -> tuple[Callable[[], Tensor | None], tuple] | None:
    """A folded convolution's input (made when asked) and geometry, if ``node`` is one.

    Args:
        node: An autograd node.

    Returns:
        ``(input, (stride, padding, dilation, transposed, output_padding, groups))``
        (``convolution_backward``'s arguments), or ``None`` where ``node`` is no folded
        convolution (:class:`_Conv`). The input is ``None`` where the weight needs no
        products (not saved).
    """
    spec = getattr(node, "spec", None)
    if not isinstance(spec, _Conv):
        return None
    return (lambda: node.saved_tensors[0]), spec.geometry()


def folded_product(node: Any) -> tuple[Callable[[], Tensor | None], float] | None:
    """A folded matrix product's left factor (made when asked) and ``alpha``, if any.

    Args:
        node: An autograd node.

    Returns:
        ``(a, alpha)`` of ``alpha · a @ b`` (``bmm``, ``matmul``, ``baddbmm``), or
        ``None`` where ``node`` is no folded product (:class:`_Product`). ``a`` is
        ``None`` where ``b`` needs no products (not saved).
    """
    spec = getattr(node, "spec", None)
    if not isinstance(spec, _Product):
        return None
    return (lambda: node.saved_tensors[0]), spec.alpha


def folded_rows(node: Any) -> tuple[Tensor, int, tuple[int, ...]] | None:
    """A folded ``table[index]``'s index, axis and table shape, if ``node`` is one.

    Args:
        node: An autograd node.

    Returns:
        ``(index, axis, the table's shape)``, or ``None`` where ``node`` is no folded
        gather of rows (:class:`_Rows`).
    """
    spec = getattr(node, "spec", None)
    if not isinstance(spec, _Rows):
        return None
    return spec.args["index"], spec.args["axis"], tuple(node.in_shape)


def _weight_norm(args: tuple, kwargs: dict) -> _WeightNorm | None:
    bound = _bind(("v", "g", "dim"), args, kwargs)
    if bound is None:
        return None
    v, g, dim = bound.get("v"), bound.get("g"), bound.get("dim", 0)
    if not (_plain(v) and _plain(g) and isinstance(dim, int) and v.dim() > 0):
        return None
    if not (v.requires_grad or g.requires_grad) or not torch.is_grad_enabled():
        return None
    if v.dtype != g.dtype or not -v.dim() <= dim < v.dim():
        return None
    if dim == -1 or (dim < 0 and v.dim() == 1):
        if g.numel() != 1:
            return None
    elif g.numel() != v.shape[dim] or g.dim() not in (1, v.dim()):
        return None
    spec = _WeightNorm(dim)
    spec.tensors = (v, g)
    return spec


def _by_scalar(func: Callable[..., Any], divide: bool) -> Callable[[tuple, dict], Any]:
    def fold(args: tuple, kwargs: dict) -> _ByScalar | None:
        bound = _bind(("input", "other"), args, kwargs)
        if bound is None or len(bound) != 2:
            return None
        a, b = bound["input"], bound["other"]
        if not (_plain(a) and _plain(b)) or a.dtype != b.dtype:
            return None
        scalar_first = a.dim() == 0
        scalar, tensor = (a, b) if scalar_first else (b, a)
        if scalar.dim() != 0 or tensor.dim() == 0 or not _foldable(scalar):
            return None
        if divide and scalar_first:  # s / a: torch's own node
            return None
        spec = _ByScalar(func, divide, scalar_first)
        spec.tensors = (a, b)
        return spec

    return fold


def _product(func: Callable[..., Any]) -> Callable[[tuple, dict], _Product | None]:
    added = func in (torch.baddbmm, Tensor.baddbmm)
    names = ("input", "batch1", "batch2", "beta", "alpha") if added else ("input", "other")

    def fold(args: tuple, kwargs: dict) -> _Product | None:
        bound = _bind(names, args, kwargs)
        if bound is None:
            return None
        first = bound.get("input") if added else None
        a, b = (bound.get("batch1"), bound.get("batch2")) if added else (
            bound.get("input"), bound.get("other")
        )  # fmt: skip
        tensors = (a, b) if first is None else (first, a, b)
        if added and first is None:
            return None
        if not all(_plain(t) for t in tensors) or len({t.dtype for t in tensors}) != 1:
            return None
        vector = b.dim() == 1 and not added  # ``h @ v``: torch loops ``ger`` per column
        if a.dim() < 2 or (b.dim() < 2 and not vector):
            return None
        if not (_foldable(a) or _foldable(b)):
            return None
        sides = (a.shape[-2], a.shape[-1], 1 if vector else b.shape[-1])
        if max(sides) < 2 * min(sides) and not vector:
            # no [L, S] map beside a thin side (square products: a GPT-2-style model
            # with 16 tokens of width 16 measured 0.92-0.97x folded): torch's batching
            # copies no more than the folded products here
            return None
        if added and (a.dim() != 3 or b.dim() != 3 or first.requires_grad):
            return None  # baddbmm's input: a fixed bias or torch.empty (with beta=0)
        scales = [bound.get("alpha", 1), bound.get("beta", 1)]
        if not all(type(c) in (int, float) for c in scales):
            return None
        spec = _Product(func, float(scales[0]), float(scales[1]), added)
        spec.tensors = tensors
        return spec

    return fold


def _getitem(args: tuple, kwargs: dict) -> _Spec | None:
    """``table[index]`` or ``table[:, index]``: rows of one axis gathered.

    By one integer tensor; the table is a parameter, mostly: an embedding table, a
    relative-position bias read as ``biases[:, idxs]`` by timm's LeViT and
    EfficientFormer.
    """
    if len(args) != 2 or kwargs:
        return None
    x, index = args
    points = _points(x, index)
    if points is not None:
        return points
    axis = 0
    if isinstance(index, tuple):  # whole slices (and at most one ``...``) around one
        # index: x[:, idx], x[..., [-2], :] (Falcon's fused query, key and value heads)
        axis, index = _index_axis(index, getattr(x, "ndim", 0))
    if (
        isinstance(index, list) and index and all(type(i) is int for i in index)
    ):  # a list of integers indexes as the tensor of them
        index = torch.tensor(index, dtype=torch.int64, device=x.device)
    if type(index) is not Tensor or index.dtype not in (torch.int64, torch.int32):
        return None
    if not _foldable(x) or x.dim() <= axis or index.requires_grad or index.is_nested:
        return None
    index = index.clone()  # as the call read it (see :func:`_points`)
    return _on(_Rows(Tensor.__getitem__, {"index": index, "axis": axis}), x)


def _gather(args: tuple, kwargs: dict) -> _Spec | None:
    bound = _bind(("input", "dim", "index", "sparse_grad"), args, kwargs)
    if bound is None or bound.get("sparse_grad", False):
        return None
    x, dim, index = bound.get("input"), bound.get("dim"), bound.get("index")
    if not _foldable(x) or type(dim) is not int or type(index) is not Tensor:
        return None
    if index.dtype != torch.int64 or index.requires_grad or index.dim() != x.dim():
        return None
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        return None  # torch's own call says what is wrong
    index = index.clone()  # as the call read it (see :func:`_points`)
    return _on(_Gather(torch.gather, {"dim": dim % x.dim(), "index": index}), x)


def _points(x: Any, index: Any) -> _Spec | None:
    """``x[i, j, ...]``: two or more leading integer tensors, then whole slices."""
    if not isinstance(index, tuple) or not _foldable(x):
        return None
    tensors = []
    for entry in index:
        if type(entry) is not Tensor:
            break
        tensors.append(entry)
    tail = index[len(tensors) :]
    full = slice(None)
    if len(tensors) < 2 or len(tensors) > x.dim():
        return None
    if not all(e is Ellipsis or (isinstance(e, slice) and e == full) for e in tail):
        return None
    if sum(e is Ellipsis for e in tail) > 1:
        return None
    if any(
        t.dtype not in (torch.int64, torch.int32) or t.requires_grad or t.is_nested
        for t in tensors
    ):  # fmt: skip
        return None
    try:
        torch.broadcast_shapes(*(t.shape for t in tensors))
    except RuntimeError:
        return None
    # the indices as the call read them: the backward runs later, and one changed in
    # place by then would put the columns elsewhere (torch's own node refuses it)
    index = tuple(t.clone() for t in tensors)
    return _on(_Points(Tensor.__getitem__, {"index": index}), x)


def _index_axis(entries: tuple, rank: int) -> tuple[int, Any]:
    """The axis of the one index among whole slices and at most one ``...``.

    Args:
        entries: The subscript's entries.
        rank: The indexed tensor's number of axes.

    Returns:
        ``(axis, index)``, or ``(0, None)`` where the subscript is anything else.
    """
    full = slice(None)
    plain = [
        i for i, e in enumerate(entries)
        if not (e is Ellipsis or (isinstance(e, slice) and e == full))
    ]  # fmt: skip
    ellipses = [i for i, e in enumerate(entries) if e is Ellipsis]
    if len(plain) != 1 or len(ellipses) > 1:
        return 0, None
    where = plain[0]
    # after an ellipsis the axis is counted from the end
    axis = rank - (len(entries) - where) if ellipses and ellipses[0] < where else where
    if not 0 <= axis < rank:
        return 0, None
    return axis, entries[where]


def _axes(dims: Any, rank: int) -> list[int] | None:
    """Axes counted from the end (so a leading axis of columns leaves them), or None."""
    dims = [dims] if isinstance(dims, int) else dims
    if not isinstance(dims, (tuple, list)) or not dims:
        return None
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return None
    if not all(-rank <= d < rank for d in dims) or rank == 0:
        return None
    axes = [d % rank - rank for d in dims]
    if -rank in axes and rank > 1:
        return None  # the first axis: samples (left to torch)
    return axes


_POOL_DIMS = {
    F.avg_pool1d: 1, F.avg_pool2d: 2, F.avg_pool3d: 3,
    F.adaptive_avg_pool1d: 1, F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3,
    F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3,
    F.max_pool1d_with_indices: 1, F.max_pool2d_with_indices: 2,
    F.max_pool3d_with_indices: 3,
    F.adaptive_max_pool1d: 1, F.adaptive_max_pool2d: 2, F.adaptive_max_pool3d: 3,
    F.adaptive_max_pool1d_with_indices: 1, F.adaptive_max_pool2d_with_indices: 2,
    F.adaptive_max_pool3d_with_indices: 3,
}  # fmt: skip
_WITH_INDICES = {
    F.max_pool1d: F.max_pool1d_with_indices, F.max_pool2d: F.max_pool2d_with_indices,
    F.max_pool3d: F.max_pool3d_with_indices,
    F.max_pool1d_with_indices: F.max_pool1d_with_indices,
    F.max_pool2d_with_indices: F.max_pool2d_with_indices,
    F.max_pool3d_with_indices: F.max_pool3d_with_indices,
    F.adaptive_max_pool1d: F.adaptive_max_pool1d_with_indices,
    F.adaptive_max_pool2d: F.adaptive_max_pool2d_with_indices,
    F.adaptive_max_pool3d: F.adaptive_max_pool3d_with_indices,
    F.adaptive_max_pool1d_with_indices: F.adaptive_max_pool1d_with_indices,
    F.adaptive_max_pool2d_with_indices: F.adaptive_max_pool2d_with_indices,
    F.adaptive_max_pool3d_with_indices: F.adaptive_max_pool3d_with_indices,
}  # fmt: skip
_ADAPTIVE_MAX = frozenset({
    F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d,
    F.adaptive_max_pool1d_with_indices, F.adaptive_max_pool2d_with_indices,
    F.adaptive_max_pool3d_with_indices,
})  # fmt: skip
_ADAPTIVE_AVG = (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)
_SOFTMAX = {False: torch.softmax, True: torch.log_softmax}

FOLDERS: dict[Any, Callable[[tuple, dict], Any]] = {
    F.pad: _pad,
    **{f: _avg_pool(f) for f in (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)},
    **{f: _adaptive_avg_pool(f) for f in _ADAPTIVE_AVG},
    **{f: _max_pool(f) for f in _WITH_INDICES},
    F.softmax: _softmax(False, ("input", "dim", "_stacklevel", "dtype")),
    F.log_softmax: _softmax(True, ("input", "dim", "_stacklevel", "dtype")),
    torch.softmax: _softmax(False, ("input", "dim", "dtype")),
    torch.log_softmax: _softmax(True, ("input", "dim", "dtype")),
    Tensor.softmax: _softmax(False, ("input", "dim", "dtype")),
    Tensor.log_softmax: _softmax(True, ("input", "dim", "dtype")),
    torch.flip: _flip,
    Tensor.flip: _flip,
    torch.roll: _roll,
    Tensor.roll: _roll,
    F.pixel_shuffle: _shuffle(False),
    F.pixel_unshuffle: _shuffle(True),
    torch.masked_fill: _masked_fill,
    Tensor.masked_fill: _masked_fill,
    torch.where: _where,
    torch.gather: _gather,
    Tensor.gather: _gather,
    F.batch_norm: _batch_norm,
    **{f: _activation(f) for f in _ACTIVATIONS},
    Tensor.__getitem__: _getitem,
    F.conv1d: _conv(1),
    F.conv2d: _conv(2),
    F.conv3d: _conv(3),
    F.conv_transpose1d: _conv(1, transposed=True),
    F.conv_transpose2d: _conv(2, transposed=True),
    F.conv_transpose3d: _conv(3, transposed=True),
    torch._weight_norm: _weight_norm,
    **{f: _by_scalar(f, False) for f in (torch.mul, Tensor.mul, Tensor.__mul__)},
    **{f: _by_scalar(f, True) for f in (torch.div, Tensor.div, Tensor.__truediv__)},
    **{
        f: _product(f)
        for f in (
            torch.bmm,
            Tensor.bmm,
            torch.matmul,
            Tensor.matmul,
            Tensor.__matmul__,
            torch.baddbmm,
            Tensor.baddbmm,
        )
    },
}
"""The glue calls folded, by the function torch's function mode sees."""


def fold_glue_call(func: Any, args: tuple, kwargs: dict) -> Any:
    """The folded call, or ``None`` where it would not be the same computation.

    Args:
        func: The function torch's function mode saw.
        args: Its positional arguments.
        kwargs: Its keyword arguments.

    Returns:
        The call's output (the user's own call), with a backward on all columns.
    """
    fold = FOLDERS.get(func)
    try:
        spec = None if fold is None else fold(args, kwargs)
    except Exception:  # arguments this reading did not foresee: torch's own call runs
        return None  # (and raises what it raises), as without the folding
    if spec is None:
        return None
    try:
        if isinstance(spec, _Several):
            return _FoldedTensors.apply(spec, *spec.tensors)
        return _FoldedGlue.apply(spec, spec.input)
    finally:  # the graph keeps what the backward needs, not the call's inputs
        spec.release()


def glue_kernel_workspace(node: Any) -> int:
    """Elements per column a folded glue node's backward takes beyond its vectors.

    Args:
        node: An autograd node of the glue.

    Returns:
        The workspace (all samples together), or 0 for other nodes.
    """
    if isinstance(node, (_FoldedGlue._backward_cls, _FoldedTensors._backward_cls)):
        return int(getattr(node, "workspace", 0))
    return 0
