r"""Per-layer rules: a layer's parameter diagonals from its input and a batch of vectors.

For a layer ``y_n = f(theta, x_n)`` that treats samples independently, the engine hands
its rule the layer's recorded input ``x`` (``[N, ...]``) and the vectors ``G`` that the
chunk's square-root columns became at the layer's output (``[V, N, *y.shape[1:]]``). The
rule returns ``sum_{v, n} (J_theta(x_n)^T G[v, n])**2`` per parameter (:meth:`diag`), or
the per-(column, sample) products themselves when a parameter is shared and its products
must be added across uses before squaring (:meth:`per_sample`).

Only layers with parameters need a rule: everything between them is backpropagated by
autograd (see :mod:`ggnchunk._graph`), and a parameter without a rule (an LSTM's weights,
``nn.MultiheadAttention``'s projections, a parameter used in a functional call) gets its
per-sample products from the recorded graph instead. Rules never run the user's code:
they use the recorded input and torch's own functions.

Many rules reduce to ``sum_{v,n} (sum_p A[v,n,g,o,p] B[n,g,k,p])**2`` with ``p`` running
over positions (tokens, pixels): :func:`square_sum` computes it either directly (form the
products, square) or in Gram form (``sum_{p,q} (A A^T)_{pq} (B B^T)_{pq}``), whichever
needs fewer operations; the Gram factor of ``B`` does not depend on the chunk and is
computed once per forward pass.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

__all__ = [
    "RULES",
    "LayerRule",
    "RuleContext",
    "rule_for",
    "square_sum",
    "supported_layers_table",
]


# -- the shared contraction -------------------------------------------------------------


_GRAM_LIMIT = 2**24  # elements of the Gram factors (64 MiB in float32) at most
_BLOCK = 2**20  # elements of one batched product of the direct form (4 MiB in float32)
_SMALL_WEIGHT = 2**16  # convolution weights backpropagated by the transposed convolution


def _use_gram(v: int, n: int, g: int, o: int, k: int, p: int, lean: bool = False) -> bool:
    if p == 1:
        return True
    if n * g * p * p * (o + k) > _GRAM_LIMIT:  # P x P factors too large to keep
        return False
    if lean:  # memory first: factors no larger than one column of the direct form
        return n * p * p * (o + k) <= o * k and n * o * p <= o * k
    direct = 2 * v * n * g * o * k * p + v * n * g * o * k
    gram = 2 * v * n * g * o * p * p + 2 * n * g * o * k * p * p
    return gram < direct


def square_sum(
    a: Tensor,
    b: Tensor,
    cache: dict[str, Tensor] | None = None,
    lean: bool = False,
    columns: int | None = None,
) -> Tensor:
    """``sum_{v,n} (sum_p a[v,n,g,o,p] b[n,g,k,p])**2`` as ``[g, o, k]``.

    Args:
        a: ``[V, N, G, O, P]`` (chunk-dependent side).
        b: ``[N, G, K, P]`` (fixed for the forward pass).
        cache: Where the Gram factor of ``b`` is kept between chunks.
        lean: Choose the form by memory rather than by work (a tight budget).
        columns: The chunk size the memory bound was made for
            (:func:`square_sum_bytes`): larger chunks choose the form that size would,
            so that the bound holds for every chunk.

    Returns:
        ``[G, O, K]``.
    """
    v, n, g, o, p = a.shape
    k = b.shape[2]
    if _use_gram(v if columns is None else min(v, columns), n, g, o, k, p, lean):
        if p == 1:
            return torch.einsum(
                "ngo,ngk->gok", a.square().sum(0)[..., 0], b[..., 0].square()
            )
        bb = None if cache is None else cache.get("gram")
        if bb is None:
            bb = torch.einsum("ngkp,ngkq->ngkpq", b, b)
            if cache is not None:
                cache["gram"] = bb
        aa = torch.einsum("vngop,vngoq->ngopq", a, a)
        return torch.einsum("ngopq,ngkpq->gok", aa, bb)
    if g == 1 and p > k and not lean and v * o * (p + k) >= _BLOCK:  # one sample at a
        # time anyway, and its rows longer than its products: its columns as a strided
        # batch, without copying the rows
        total = a.new_zeros(o, k)
        for i in range(n):
            total += torch.matmul(a[:, i, 0], b[i, 0].T).square_().sum(0)
        return total.unsqueeze(0)
    if g == 1:  # blocks of samples: [B, V*O, P] @ [B, P, K], at most _BLOCK elements
        # of copied rows and products together (cache-sized: one sample at a time for
        # large ones, many small products in one call)
        step = 1 if lean else max(1, _BLOCK // max(v * o * (p + k), 1))
        total = a.new_zeros(o, k)
        for i in range(0, n, step):
            rows = a[:, i : i + step, 0].transpose(0, 1)  # [B, V, O, P]
            rows = rows.reshape(rows.shape[0], v * o, p)  # one copy of the block's rows
            block = torch.bmm(rows, b[i : i + step, 0].transpose(1, 2))
            total += block.square_().reshape(-1, o, k).sum(0)
        return total.unsqueeze(0)
    return torch.einsum("vngop,ngkp->vngok", a, b).square().sum((0, 1))


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
        Upper bounds in elements: the Gram factors (if the Gram form may be chosen) and
        the per-column products of the direct form.
    """
    if p == 1:  # squares summed over the columns first: nothing per column
        return n * g * (o + k), 0
    if lean:
        if _use_gram(1, n, g, o, k, p, lean=True):  # both factors; ``a`` copied once
            return n * g * p * p * (o + k), n * g * o * p
        return 0, g * o * k  # one sample at a time
    gram = _use_gram(1, n, g, o, k, p) or _use_gram(columns, n, g, o, k, p)
    fixed = n * g * p * p * (o + k) if gram else 0
    per_column = o * k if g == 1 else n * g * o * k
    return fixed, per_column


def products(a: Tensor, b: Tensor) -> Tensor:
    """``sum_p a[v,n,g,o,p] b[n,g,k,p]`` as ``[V, N, G, O, K]`` (per-sample products).

    Args:
        a: ``[V, N, G, O, P]``.
        b: ``[N, G, K, P]``.

    Returns:
        ``[V, N, G, O, K]``.
    """
    return torch.einsum("vngop,ngkp->vngok", a, b)


def _window_view(x: Tensor, kernel, stride, padding, dilation) -> Tensor:
    """``[B, C, *kernel, *positions]`` strided view of the (zero-padded) input's patches."""
    dims = len(kernel)
    stride, padding, dilation = (_tuple(t, dims) for t in (stride, padding, dilation))
    pads = [p for pad in reversed(padding) for p in (pad, pad)]
    if any(pads):
        x = F.pad(x, pads)
    for d in range(dims):
        x = x.unfold(2 + d, dilation[d] * (kernel[d] - 1) + 1, stride[d])
        if dilation[d] > 1:
            x = x[..., :: dilation[d]]
    order = [0, 1, *range(2 + dims, 2 + 2 * dims), *range(2, 2 + dims)]
    return x.permute(order)


def unfold(x: Tensor, kernel: tuple[int, ...], stride, padding, dilation) -> Tensor:
    """Patches of ``x`` as a convolution sees them, for 1, 2 or 3 spatial dimensions.

    Args:
        x: ``[B, C, *spatial]``.
        kernel: Kernel size per spatial dimension.
        stride: Stride per spatial dimension.
        padding: Zero padding per spatial dimension.
        dilation: Dilation per spatial dimension.

    Returns:
        ``[B, C * prod(kernel), P]``: row ``c * K + j`` is channel ``c`` at kernel offset
        ``j``, for each of the ``P`` output positions.
    """
    view = _window_view(x, kernel, stride, padding, dilation)
    return view.reshape(x.shape[0], x.shape[1] * math.prod(kernel), -1)


# -- rules ------------------------------------------------------------------------------


@dataclass
class RuleContext:
    """What a rule keeps from one call of its layer (set at forward time).

    Attributes:
        module: The layer.
        inputs: The layer's tensor inputs as it received them (detached leaves).
        versions: Their version counters then (an in-place change is detected).
        out_shape: Shape of the layer's output.
        extra: Anything else the rule stored (running statistics, caches).
        columns: Most columns a chunk can have (set once they are known; for bounds).
        lean: Keep no per-forward caches that can be recomputed per sample (a tight
            memory budget: unfolded patches are made one sample at a time per chunk).
        shared: The layer's parameters take the per-sample products' path.
        output: The layer produces the model output.
        node: The autograd node that produced the layer's output.
    """

    module: nn.Module
    inputs: tuple[Tensor, ...]
    versions: tuple[int, ...]
    out_shape: tuple[int, ...]
    extra: dict[str, Any] = field(default_factory=dict)
    columns: int = 2**20
    lean: bool = False
    shared: bool = False
    output: bool = False
    node: Any = None

    @property
    def x(self) -> Tensor:
        """The layer's first input, detached."""
        return self.inputs[0].detach()


class LayerRule(ABC):
    """Parameter diagonals of one kind of layer from its input and backpropagated vectors.

    Subclasses set ``classes`` (layers whose ``forward`` is the one the rule knows) and
    ``param_names``, and implement :meth:`per_sample`; :meth:`diag` may be overridden
    by a faster form that never materializes the per-sample products.
    """

    classes: tuple[type[nn.Module], ...] = ()
    param_names: tuple[str, ...] = ("weight", "bias")
    description: str = ""
    param_free = False
    """Layers without parameters, ruled only to map vectors back faster than autograd."""

    def record(self, ctx: RuleContext) -> None:  # noqa: B027 - optional hook
        """Store what the rule needs beyond the input (called at forward time).

        Args:
            ctx: The call's context.
        """

    def check(self, name: str, module: nn.Module) -> None:  # noqa: B027 - optional
        """Raise a ``ValueError`` if this layer cannot be handled exactly.

        Args:
            name: The layer's qualified name, for the message.
            module: The layer.
        """

    @abstractmethod
    def per_sample(self, ctx: RuleContext, grads: Tensor) -> dict[str, Tensor]:
        """Per-(column, sample) parameter products ``J_theta(x_n)^T G[v, n]``.

        Args:
            ctx: The call's context.
            grads: ``[V, N, *out_shape[1:]]``.

        Returns:
            ``{param_name: [V, N, *param.shape]}`` for the layer's trainable parameters.
        """

    def diag(self, ctx: RuleContext, grads: Tensor) -> dict[str, Tensor]:
        """``sum_{v, n}`` of the squared per-sample products.

        Args:
            ctx: The call's context.
            grads: ``[V, N, *out_shape[1:]]``.

        Returns:
            ``{param_name: [*param.shape]}``.
        """
        return {k: t.square().sum((0, 1)) for k, t in self.per_sample(ctx, grads).items()}

    sample_free_backprop = False
    """Whether :meth:`backprop` is the same linear map for every sample (no ``x``)."""

    def diag_onehot(self, ctx: RuleContext, mask: Tensor) -> dict[str, Tensor] | None:
        """The diagonal when the layer's output is the model output and columns are one-hot.

        Column ``v`` of the square root is ``s_{n,v} e_v``, so ``J_theta(x_n)^T`` of it is
        one row of the layer's per-sample Jacobian and its square needs ``x**2`` only:
        the chunk's diagonal is the layer's weight gradient for input ``x**2`` and output
        gradient ``mask = sum_v s_{n,v}**2 e_v`` — one kernel call, whatever the chunk
        size.

        Args:
            ctx: The call's context.
            mask: ``[N or 1, *out_shape[1:]]``.

        Returns:
            ``{param_name: [*param.shape]}``, or ``None`` where the rule has no such form.
        """
        return None

    def backprop(self, ctx: RuleContext, grads: Tensor) -> Tensor | None:
        """The vectors at the layer's input, ``[V, N, *input.shape[1:]]``, or ``None``.

        ``None`` lets autograd do it on the recorded graph (batched over ``V``); a rule
        that knows the transposed Jacobian folds ``V`` into the batch instead.

        Args:
            ctx: The call's context.
            grads: ``[V, N, *out_shape[1:]]``.

        Returns:
            The backpropagated vectors, or ``None``.
        """
        return None

    kron = False
    """Whether the rule gives Kronecker factors (``output_factor``, ``input_factor``)."""

    def kron_check(self, module: nn.Module) -> str | None:
        """Why this layer has no Kronecker factors, or ``None`` if it has.

        Args:
            module: The layer.

        Returns:
            A reason for the error message, or ``None``.
        """
        if not self.kron:
            return (
                "Kronecker factors are available for nn.Linear and nn.Conv1d/2d/3d "
                "(groups=1) only"
            )
        return None

    def output_factor(self, ctx: RuleContext, grads: Tensor) -> Tensor:
        """``sum_{v, n} s_{vn} s_{vn}^T`` with ``s_{vn}`` the vector summed over positions.

        The exact GGN block of the layer's bias (BackPACK's KFLR output factor).

        Args:
            ctx: The call's context.
            grads: ``[V, N, *out_shape[1:]]``.

        Returns:
            ``[C_out, C_out]``.
        """
        raise NotImplementedError  # pragma: no cover - guarded by ``kron``

    def input_factor(self, ctx: RuleContext) -> Tensor:
        """``sum_n sum_p u_{np} u_{np}^T`` over the (unfolded) inputs, not normalized.

        Args:
            ctx: The call's context.

        Returns:
            ``[K, K]`` with ``K`` the weight's fan-in (``weight[0].numel()``).
        """
        raise NotImplementedError  # pragma: no cover - guarded by ``kron``

    def column_bytes(self, ctx: RuleContext, element: int) -> int:
        """Bytes the rule allocates per column of a chunk, at most (for memory plans).

        Args:
            ctx: The call's context.
            element: Bytes per element.

        Returns:
            An upper bound per column.
        """
        return 2 * math.prod(ctx.out_shape) * element

    def fixed_bytes(self, ctx: RuleContext, element: int) -> int:
        """Bytes the rule keeps for the whole forward pass (caches), at most.

        Args:
            ctx: The call's context.
            element: Bytes per element.

        Returns:
            An upper bound.
        """
        return 0

    def backprop_bytes(self, ctx: RuleContext, element: int) -> tuple[int, int, int]:
        """Bytes of :meth:`backprop` alone (a frozen layer): per column, fixed, transient.

        Args:
            ctx: The call's context.
            element: Bytes per element.

        Returns:
            Upper bounds like :meth:`column_bytes`, :meth:`fixed_bytes` and
            :meth:`transient_bytes` for a call that has no trainable parameter.
        """
        return self.column_bytes(ctx, element), 0, self.transient_bytes(ctx, element)

    def transient_bytes(self, ctx: RuleContext, element: int) -> int:
        """Bytes the rule allocates and frees within its step, whatever the chunk size.

        Only one layer's step runs at a time, so a plan adds the largest of these.

        Args:
            ctx: The call's context.
            element: Bytes per element.

        Returns:
            An upper bound.
        """
        return 0


def _gram_of_sums(grads: Tensor, channel_axis: int) -> Tensor:
    """``sum_{v, n} s s^T`` with ``s = grads[v, n]`` summed over all but the channel axis.

    Args:
        grads: ``[V, N, ...]``.
        channel_axis: Axis of ``grads`` holding the channels.

    Returns:
        ``[C, C]``.
    """
    v, n = grads.shape[:2]
    if n > 1 and grads.stride(1) == 0:  # the same vectors for every sample
        return n * _gram_of_sums(grads[:, :1], channel_axis)
    moved = grads.movedim(channel_axis, 2)
    sums = moved.reshape(v * n, moved.shape[2], -1).sum(2)
    return sums.T @ sums


def _trainable(module: nn.Module, name: str) -> bool:
    param = getattr(module, name, None)
    return isinstance(param, nn.Parameter) and param.requires_grad


class LinearRule(LayerRule):
    """``nn.Linear`` on ``[N, ..., D]``; Gram form over the extra axes where cheaper."""

    classes = (nn.Linear,)
    description = "any leading axes `[N, ..., D]`"

    @staticmethod
    def _sides(ctx: RuleContext, grads: Tensor) -> tuple[Tensor, Tensor]:
        x = ctx.x
        n, i = x.shape[0], x.shape[-1]
        v, o = grads.shape[0], grads.shape[-1]
        a = grads.reshape(v, n, -1, o).transpose(2, 3).unsqueeze(2)  # [V,N,1,O,P]
        b = x.reshape(n, -1, i).transpose(1, 2).unsqueeze(1)  # [N,1,I,P]
        return a, b

    def diag(self, ctx, grads):
        module, out = ctx.module, {}
        a, b = self._sides(ctx, grads)
        if _trainable(module, "weight"):
            out["weight"] = square_sum(a, b, ctx.extra, columns=ctx.columns)[0]
        if _trainable(module, "bias"):
            out["bias"] = a.sum(4)[:, :, 0].square().sum((0, 1))
        return out

    def per_sample(self, ctx, grads):
        module, out = ctx.module, {}
        a, b = self._sides(ctx, grads)
        if _trainable(module, "weight"):
            out["weight"] = products(a, b)[:, :, 0]
        if _trainable(module, "bias"):
            out["bias"] = a.sum(4)[:, :, 0]
        return out

    sample_free_backprop = True

    def backprop(self, ctx, grads):
        return grads @ ctx.module.weight.detach()

    kron = True

    def output_factor(self, ctx, grads):
        return _gram_of_sums(grads, grads.dim() - 1)

    def input_factor(self, ctx):
        x = ctx.x
        flat = x.reshape(-1, x.shape[-1])
        return flat.T @ flat

    def diag_onehot(self, ctx, mask):
        module, x = ctx.module, ctx.x
        o, i = mask.shape[-1], x.shape[-1]
        mask = mask.expand(x.shape[0], *mask.shape[1:]).reshape(-1, o)
        out = {}
        if _trainable(module, "weight"):
            out["weight"] = mask.T @ x.reshape(-1, i).square()
        if _trainable(module, "bias"):
            out["bias"] = mask.sum(0)
        return out

    @staticmethod
    def _sizes(ctx: RuleContext) -> tuple[int, int]:
        x = ctx.x
        fixed, per_column = square_sum_bytes(
            x.shape[0], 1, ctx.out_shape[-1], x.shape[-1], x[0].numel() // x.shape[-1],
            ctx.columns,
        )  # fmt: skip
        return fixed, per_column

    def column_bytes(self, ctx, element):
        return (2 * math.prod(ctx.out_shape) + self._sizes(ctx)[1]) * element

    def fixed_bytes(self, ctx, element):
        return self._sizes(ctx)[0] * element

    def transient_bytes(self, ctx, element):
        x = ctx.x
        if x[0].numel() == x.shape[-1]:  # one position: squares summed, nothing blocked
            return 0
        return _BLOCK * element  # samples batched in the direct form (also when lean)

    def backprop_bytes(self, ctx, element):  # one product with the weight
        return self.column_bytes(ctx, element), 0, 0


def _tuple(value: int | tuple[int, ...], dims: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * dims


def _explicit_padding(module: nn.Module, dims: int) -> list[tuple[int, int]]:
    """(left, right) zero padding per spatial dimension, ``"same"``/``"valid"`` resolved."""
    kernel = _tuple(module.kernel_size, dims)
    dilation = _tuple(module.dilation, dims)
    if module.padding == "valid":
        return [(0, 0)] * dims
    if module.padding == "same":
        pads = []
        for k, d in zip(kernel, dilation, strict=True):
            total = d * (k - 1)
            pads.append((total // 2, total - total // 2))
        return pads
    return [(p, p) for p in _tuple(module.padding, dims)]


def _weight_gradient_of_squares(
    ctx: RuleContext, mask: Tensor, transposed: bool
) -> dict[str, Tensor]:
    """A convolution's weight gradient for input ``x**2`` and output gradient ``mask``."""
    module, x = ctx.module, ctx.x
    dims = x.dim() - 2
    squares = ctx.extra.get("squares")
    if squares is None:
        squares = x.square()
        if not ctx.lean:
            ctx.extra["squares"] = squares
    mask = mask.expand(x.shape[0], *mask.shape[1:])
    out = {}
    if _trainable(module, "weight"):
        output_padding = _tuple(module.output_padding, dims) if transposed else [0] * dims
        out["weight"] = torch.ops.aten.convolution_backward(
            mask, squares, module.weight.detach(), None, _tuple(module.stride, dims),
            _tuple(module.padding, dims), _tuple(module.dilation, dims), transposed,
            list(output_padding), module.groups, [False, True, False],
        )[1]  # fmt: skip
    if _trainable(module, "bias"):
        out["bias"] = mask.sum([0, *range(2, mask.dim())])
    return out


class ConvRule(LayerRule):
    """``nn.Conv1d/2d/3d``: any stride, padding (also ``"same"``, non-zero modes), groups.

    The input's patches are unfolded once per forward pass.
    """

    classes = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    description = "groups, dilation, stride, all padding modes; patches unfolded once"

    def _patches(self, ctx: RuleContext, sample: int | None = None) -> Tensor:
        """``[N, G, K, P]`` (cached unless lean), or ``[1, G, K, P]`` of one sample."""
        cached = ctx.extra.get("patches")
        if cached is not None:
            return cached if sample is None else cached[sample : sample + 1]
        module, x = ctx.module, ctx.x
        if sample is not None:
            x = x[sample : sample + 1]
        dims = x.dim() - 2
        pads = _explicit_padding(module, dims)
        flat = [p for pair in reversed(pads) for p in pair]
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        if any(flat):
            x = F.pad(x, flat, mode=mode)
        patches = unfold(
            x, _tuple(module.kernel_size, dims), _tuple(module.stride, dims), 0,
            _tuple(module.dilation, dims),
        )  # fmt: skip
        g = module.groups
        patches = patches.reshape(x.shape[0], g, -1, patches.shape[-1])  # [N, G, K, P]
        if sample is None and not ctx.lean:
            ctx.extra["patches"] = patches
        return patches

    def _a(self, ctx: RuleContext, grads: Tensor) -> Tensor:
        v, n, c = grads.shape[:3]
        g = ctx.module.groups
        return grads.reshape(v, n, g, c // g, -1)

    def diag(self, ctx, grads):
        module, out = ctx.module, {}
        a = self._a(ctx, grads)
        if _trainable(module, "weight"):
            v, n, g, o, p = a.shape
            k = module.weight[0].numel()
            if ctx.lean and not _use_gram(v, n, g, o, k, p, lean=True):
                # one sample's patches at a time, made again in every chunk
                total = a.new_zeros(g, o, k)
                for i in range(n):
                    b = self._patches(ctx, i)[0]  # [G, K, P]
                    total += torch.einsum("vgop,gkp->vgok", a[:, i], b).square_().sum(0)
                out["weight"] = total.reshape(module.weight.shape)
            else:
                if ctx.lean and "gram" in ctx.extra:  # the factor is built: only the
                    b = a.new_empty(()).expand(n, g, k, p)  # shape is read, no patches
                else:
                    b = self._patches(ctx)
                weight = square_sum(a, b, ctx.extra, ctx.lean, ctx.columns)
                out["weight"] = weight.reshape(module.weight.shape)
        if _trainable(module, "bias"):
            out["bias"] = a.sum(4).square().sum((0, 1)).reshape(-1)
        return out

    def per_sample(self, ctx, grads):
        module, out = ctx.module, {}
        a = self._a(ctx, grads)
        v, n = a.shape[:2]
        if _trainable(module, "weight"):
            out["weight"] = products(a, self._patches(ctx)).reshape(
                v, n, *module.weight.shape
            )
        if _trainable(module, "bias"):
            out["bias"] = a.sum(4).reshape(v, n, -1)
        return out

    sample_free_backprop = True

    def diag_onehot(self, ctx, mask):
        module = ctx.module
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            return None
        return _weight_gradient_of_squares(ctx, mask, transposed=False)

    kron = True

    def kron_check(self, module):
        if module.groups != 1:
            return (
                f"Kronecker factors of grouped convolutions (groups={module.groups}) are "
                "not one Kronecker product"
            )
        return None

    def output_factor(self, ctx, grads):
        return _gram_of_sums(grads, 2)

    def input_factor(self, ctx):
        k = ctx.module.weight[0].numel()
        result = ctx.x.new_zeros(k, k)
        for i in range(ctx.x.shape[0]):  # one sample's patches [K, P] at a time
            patches = self._patches(ctx, i)[0, 0]  # groups == 1
            result.addmm_(patches, patches.T)
        return result

    def backprop(self, ctx, grads):
        module, x = ctx.module, ctx.x
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            return None
        dims = x.dim() - 2
        v, n = grads.shape[:2]
        folded = grads.reshape(v * n, *grads.shape[2:])
        kernel, stride, padding, dilation = (
            _tuple(t, dims) for t in (module.kernel_size, module.stride, module.padding,
                                      module.dilation)
        )  # fmt: skip
        weight = module.weight.detach()
        if weight.numel() > _SMALL_WEIGHT:  # oneDNN's transposed convolution reorders
            # the weight (+9 MiB on ResNet-18's last stage): the input gradient kernel
            result = torch.ops.aten.convolution_backward(
                folded, folded.new_empty(1).expand(v * n, *x.shape[1:]), weight, None,
                stride, padding, dilation, False, [0] * dims, module.groups,
                [True, False, False],
            )[0]  # fmt: skip
            return result.reshape(v, n, *x.shape[1:])
        # few channels: the transposed convolution (up to 1.7x faster), with the rows
        # the stride dropped
        extra = [
            size - ((out - 1) * s - 2 * p + d * (k - 1) + 1)
            for size, out, s, p, d, k in zip(
                x.shape[2:], grads.shape[3:], stride, padding, dilation, kernel,
                strict=True,
            )
        ]  # fmt: skip
        conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[dims - 1]
        result = conv(folded, weight, None, stride, padding, extra, module.groups, dilation)
        return result.reshape(v, n, *x.shape[1:])

    @staticmethod
    def _sizes(ctx: RuleContext) -> tuple[int, int, int]:
        module = ctx.module
        n, g = ctx.out_shape[0], module.groups
        positions = math.prod(ctx.out_shape[2:])
        k = module.weight.numel() // module.out_channels
        o = module.out_channels // g
        patches = 2 * n * g * k * positions  # padded input and unfolded patches
        # a small weight is reordered by the transposed convolution of the backprop
        reorder = module.weight.numel() if module.weight.numel() <= _SMALL_WEIGHT else 0
        if not ctx.lean:
            fixed, per_column = square_sum_bytes(n, g, o, k, positions, ctx.columns)
            return fixed + patches, per_column, _BLOCK + reorder
        # lean: nothing kept but Gram factors; all patches at once only to build those
        # (and for per-sample products), one sample's otherwise; the input's squares for
        # the output layer's one-hot form
        fixed, per_column = square_sum_bytes(n, g, o, k, positions, lean=True)
        whole = fixed > 0 or ctx.shared
        transient = (patches if whole else 2 * g * k * positions) + reorder
        if ctx.output:
            transient += ctx.x.numel()
        return fixed, per_column, transient

    def column_bytes(self, ctx, element):
        return (2 * math.prod(ctx.out_shape) + self._sizes(ctx)[1]) * element

    def fixed_bytes(self, ctx, element):
        return self._sizes(ctx)[0] * element

    def transient_bytes(self, ctx, element):
        return self._sizes(ctx)[2] * element

    def backprop_bytes(self, ctx, element):
        weight = ctx.module.weight.numel()
        reorder = weight if weight <= _SMALL_WEIGHT else 0
        return self.column_bytes(ctx, element), 0, reorder * element


class ConvTransposeRule(LayerRule):
    """``nn.ConvTranspose1d/2d/3d``: stride, padding, ``output_padding``, groups, dilation.

    BackPACK 1.7.1's rule fails with ``output_padding > 0``, the standard stride-2 decoder
    layer; this one unfolds the backpropagated vectors on the output grid, whose patches
    line up with the input positions for every ``output_padding``.
    """

    classes = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
    description = "groups, dilation, stride, `output_padding`"

    @staticmethod
    def _geometry(module: nn.Module, dims: int) -> tuple[tuple[int, ...], ...]:
        return (
            _tuple(module.kernel_size, dims), _tuple(module.stride, dims),
            _tuple(module.padding, dims), _tuple(module.dilation, dims),
        )  # fmt: skip

    def _sides(self, ctx: RuleContext, grads: Tensor) -> tuple[Tensor, Tensor]:
        module, x = ctx.module, ctx.x
        v, n, c = grads.shape[:3]
        g = module.groups
        patches = unfold(
            grads.reshape(v * n, c, *grads.shape[3:]), *self._geometry(module, x.dim() - 2)
        )
        a = patches.reshape(v, n, g, -1, patches.shape[-1])  # [V, N, G, Cout/G*K, P]
        return a, self._b(ctx)

    @staticmethod
    def _b(ctx: RuleContext) -> Tensor:
        b = ctx.extra.get("b")
        if b is None:
            x, g = ctx.x, ctx.module.groups
            b = ctx.extra["b"] = x.reshape(x.shape[0], g, x.shape[1] // g, -1)
        return b  # [N, G, Cin/G, P]

    def diag(self, ctx, grads):
        module, out = ctx.module, {}
        v, n, c = grads.shape[:3]
        if _trainable(module, "weight"):
            dims = ctx.x.dim() - 2
            kernel = _tuple(module.kernel_size, dims)
            g = module.groups
            view = _window_view(
                grads.reshape(v * n, c, *grads.shape[3:]), *self._geometry(module, dims)
            )  # [V*N, Cout, *kernel, *positions], no copy
            b = self._b(ctx)
            offsets = [()]
            for k in kernel:
                offsets = [(*o, i) for o in offsets for i in range(k)]
            result = grads.new_zeros(g, c // g, len(offsets), b.shape[2])
            for j, offset in enumerate(offsets):
                a = view[(slice(None), slice(None), *offset)].reshape(v, n, g, c // g, -1)
                result[:, :, j] = square_sum(  # one Gram factor of b
                    a, b, ctx.extra, columns=ctx.columns
                )
            out["weight"] = result.permute(0, 3, 1, 2).reshape(module.weight.shape)
        if _trainable(module, "bias"):
            out["bias"] = grads.reshape(v, n, c, -1).sum(3).square().sum((0, 1))
        return out

    sample_free_backprop = True

    def diag_onehot(self, ctx, mask):
        return _weight_gradient_of_squares(ctx, mask, transposed=True)

    def backprop(self, ctx, grads):
        module, x = ctx.module, ctx.x
        dims = x.dim() - 2
        v, n, c = grads.shape[:3]
        conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
        _, stride, padding, dilation = self._geometry(module, dims)
        result = conv(
            grads.reshape(v * n, c, *grads.shape[3:]), module.weight.detach(), None,
            stride, padding, dilation, module.groups,
        )  # fmt: skip
        return result.reshape(v, n, *x.shape[1:])

    def per_sample(self, ctx, grads):
        module, out = ctx.module, {}
        v, n, c = grads.shape[:3]
        if _trainable(module, "weight"):
            a, b = self._sides(ctx, grads)
            prods = products(a, b)  # [V, N, G, Cout/G*K, Cin/G]
            out["weight"] = prods.transpose(3, 4).reshape(v, n, *module.weight.shape)
        if _trainable(module, "bias"):
            out["bias"] = grads.reshape(v, n, c, -1).sum(3)
        return out

    def column_bytes(self, ctx, element):
        module, x = ctx.module, ctx.x
        n, out = ctx.out_shape[0], math.prod(ctx.out_shape)
        per_offset = n * module.out_channels * math.prod(x.shape[2:])
        kernel = math.prod(_tuple(module.kernel_size, x.dim() - 2))
        products = module.weight.numel() // kernel
        return (2 * out + per_offset + products + math.prod(x.shape)) * element

    def fixed_bytes(self, ctx, element):
        module, x = ctx.module, ctx.x
        n, g, p = x.shape[0], module.groups, math.prod(x.shape[2:])
        o, k = module.out_channels // g, module.in_channels // g
        return square_sum_bytes(n, g, o, k, p, ctx.columns)[0] * element  # Gram factor

    def transient_bytes(self, ctx, element):
        return _BLOCK * element  # samples batched in the direct form


def _standardized(flat: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``x_hat`` and ``1/std`` over the last axis of ``flat`` ``[N, M, D]`` (biased var)."""
    rstd = (flat.var(-1, unbiased=False, keepdim=True) + eps).rsqrt()
    return (flat - flat.mean(-1, keepdim=True)) * rstd, rstd


class _NormRule(LayerRule):
    """Shared by the normalizations: ``y = x_hat * weight + bias`` per channel/feature."""

    def _x_hat(self, ctx: RuleContext) -> Tensor:
        raise NotImplementedError

    def _sum_axes(self, ctx: RuleContext, grads: Tensor) -> tuple[int, ...]:
        raise NotImplementedError

    def _reduce(self, ctx: RuleContext, t: Tensor) -> Tensor:
        """``[V, N, *out]`` → ``[V, N, *param.shape]`` (sum over the other axes)."""
        axes = self._sum_axes(ctx, t)
        return t.sum(axes) if axes else t

    def per_sample(self, ctx, grads):
        module, out = ctx.module, {}
        if _trainable(module, "weight"):
            x_hat = ctx.extra.get("x_hat")
            if x_hat is None:
                x_hat = ctx.extra["x_hat"] = self._x_hat(ctx)
            out["weight"] = self._reduce(ctx, grads * x_hat)
        if _trainable(module, "bias"):
            out["bias"] = self._reduce(ctx, grads)
        return out

    def fixed_bytes(self, ctx, element):
        return math.prod(ctx.out_shape) * element

    def _normalized(self, ctx: RuleContext) -> tuple[Tensor, Tensor]:
        """``x_hat`` ``[N, M, D]`` and ``1/std`` ``[N, M, 1]``: ``M`` normalized sets."""
        raise NotImplementedError

    def _backprop_normalized(
        self, ctx: RuleContext, grads: Tensor, weight_shape: tuple[int, ...]
    ) -> Tensor:
        """``dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))`` per normalized set.

        ``g`` is the vector times the affine weight; means over each set's elements.
        Broadcast over the columns: no per-column loop, no copy of ``x``.
        """
        module = ctx.module
        v = grads.shape[0]
        if module.weight is not None:
            grads = grads * module.weight.detach().view(weight_shape)
        x_hat, rstd = ctx.extra.get("normalized") or self._normalized(ctx)
        if not ctx.lean:
            ctx.extra["normalized"] = (x_hat, rstd)
        g = grads.reshape(v, *x_hat.shape)
        mean_x = (g * x_hat).mean(-1, keepdim=True)
        dx = g - g.mean(-1, keepdim=True)
        return dx.addcmul_(x_hat, mean_x, value=-1).mul_(rstd).reshape(grads.shape)

    def column_bytes(self, ctx, element):
        return 4 * math.prod(ctx.out_shape) * element

    def backprop_bytes(self, ctx, element):  # the standardized input is kept
        return self.column_bytes(ctx, element), self.fixed_bytes(ctx, element), 0


class BatchNormRule(_NormRule):
    """``nn.BatchNorm1d/2d/3d`` in eval mode with running statistics."""

    classes = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    description = "eval mode only (training mode couples samples)"

    def record(self, ctx):
        module = ctx.module
        ctx.extra["mean"] = module.running_mean.detach().clone()
        ctx.extra["var"] = module.running_var.detach().clone()

    def _x_hat(self, ctx):
        x = ctx.x
        shape = [1, -1] + [1] * (x.dim() - 2)
        mean = ctx.extra["mean"].to(x.dtype).view(shape)
        std = (ctx.extra["var"].to(x.dtype) + ctx.module.eps).sqrt().view(shape)
        return (x - mean) / std

    def _sum_axes(self, ctx, grads):
        return tuple(range(3, grads.dim()))

    sample_free_backprop = True

    def column_bytes(self, ctx, element):
        return 2 * math.prod(ctx.out_shape) * element  # one product, one scaled copy

    def backprop_bytes(self, ctx, element):  # nothing kept: running statistics only
        return self.column_bytes(ctx, element), 0, 0

    def backprop(self, ctx, grads):
        module = ctx.module
        scale = (ctx.extra["var"].to(grads.dtype) + module.eps).rsqrt()
        if module.weight is not None:
            scale = scale * module.weight.detach()
        return grads * scale.view(-1, *([1] * (grads.dim() - 3)))


class LayerNormRule(_NormRule):
    """``nn.LayerNorm`` (any ``normalized_shape``, with or without bias)."""

    classes = (nn.LayerNorm,)
    description = "any `normalized_shape`"

    def _x_hat(self, ctx):
        module = ctx.module
        return F.layer_norm(ctx.x, module.normalized_shape, None, None, module.eps)

    def _sum_axes(self, ctx, grads):
        kept = len(ctx.module.normalized_shape)
        return tuple(range(2, grads.dim() - kept))

    def _normalized(self, ctx):
        module, x = ctx.module, ctx.x
        d = math.prod(module.normalized_shape)
        return _standardized(x.reshape(x.shape[0], -1, d), module.eps)

    def backprop(self, ctx, grads):
        return self._backprop_normalized(ctx, grads, tuple(ctx.module.normalized_shape))


class GroupNormRule(_NormRule):
    """``nn.GroupNorm``."""

    classes = (nn.GroupNorm,)
    description = "per-sample statistics"

    def _x_hat(self, ctx):
        module = ctx.module
        return F.group_norm(ctx.x, module.num_groups, None, None, module.eps)

    def _sum_axes(self, ctx, grads):
        return tuple(range(3, grads.dim()))

    def _normalized(self, ctx):
        module, x = ctx.module, ctx.x
        return _standardized(x.reshape(x.shape[0], module.num_groups, -1), module.eps)

    def backprop(self, ctx, grads):
        shape = (-1, *([1] * (grads.dim() - 3)))
        return self._backprop_normalized(ctx, grads, shape)


class EmbeddingRule(LayerRule):
    """``nn.Embedding``: rows gathered by index; ``padding_idx``'s row gets 0.

    Sample ``n``'s product for row ``r`` is the sum of the output vectors at the positions
    whose index is ``r``.
    """

    classes = (nn.Embedding,)
    param_names = ("weight",)
    description = "any index shape; `padding_idx` row is 0 (BackPACK's fails in float64)"

    def _grouped(self, ctx: RuleContext, grads: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        module, indices = ctx.module, ctx.inputs[0]
        count, dim = module.num_embeddings, module.embedding_dim
        n = indices.shape[0]
        sample = torch.arange(n, device=indices.device).repeat_interleave(
            indices[0].numel()
        )
        keys = sample * count + indices.reshape(-1)
        unique, inverse = torch.unique(keys, return_inverse=True)
        v = grads.shape[0]
        summed = grads.new_zeros(v, unique.numel(), dim)
        summed.index_add_(1, inverse, grads.reshape(v, -1, dim))
        return unique, summed, grads.new_zeros(count, dim)

    def diag(self, ctx, grads):
        module = ctx.module
        unique, summed, result = self._grouped(ctx, grads)
        result.index_add_(0, unique % module.num_embeddings, summed.square().sum(0))
        if module.padding_idx is not None:
            result[module.padding_idx] = 0.0
        return {"weight": result}

    def per_sample(self, ctx, grads):
        module = ctx.module
        count = module.num_embeddings
        unique, summed, _ = self._grouped(ctx, grads)
        v, n = grads.shape[:2]
        result = grads.new_zeros(v, n * count, module.embedding_dim)
        result.index_add_(1, unique, summed)
        result = result.view(v, n, count, -1)
        if module.padding_idx is not None:
            result[:, :, module.padding_idx] = 0.0
        return {"weight": result}


class ActivationRule(LayerRule):
    """Elementwise activations: their derivative, once per pass, times the vectors.

    ``torch.func`` has no batching rule for most activation backward kernels (it loops
    over the columns). The derivative ``f'(x)`` (``[N, ...]``) comes from the layer's
    own backward kernel applied to ones, and multiplies all columns at once.
    """

    classes = (nn.ReLU, nn.SiLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.Hardswish,
               nn.LeakyReLU, nn.ELU, nn.Softplus, nn.Hardsigmoid, nn.Hardtanh,
               nn.Mish)  # fmt: skip
    param_names = ()
    description = "derivative once per pass, times all columns"
    param_free = True

    def per_sample(self, ctx, grads):
        return {}

    @staticmethod
    def _derivative(module: nn.Module, x: Tensor) -> Tensor:
        aten, ones = torch.ops.aten, torch.ones_like(x)
        if isinstance(module, nn.ReLU):
            return aten.threshold_backward(ones, x, 0)
        if isinstance(module, nn.SiLU):
            return aten.silu_backward(ones, x)
        if isinstance(module, nn.GELU):
            return aten.gelu_backward(ones, x, approximate=module.approximate)
        if isinstance(module, nn.Tanh):
            return aten.tanh_backward(ones, torch.tanh(x))
        if isinstance(module, nn.Sigmoid):
            return aten.sigmoid_backward(ones, torch.sigmoid(x))
        if isinstance(module, nn.Hardswish):
            return aten.hardswish_backward(ones, x)
        if isinstance(module, nn.LeakyReLU):
            return aten.leaky_relu_backward(ones, x, module.negative_slope, False)
        if isinstance(module, nn.ELU):
            return aten.elu_backward(ones, module.alpha, 1, 1, False, x)
        if isinstance(module, nn.Hardsigmoid):
            return aten.hardsigmoid_backward(ones, x)
        if isinstance(module, nn.Hardtanh):  # also nn.ReLU6
            return aten.hardtanh_backward(ones, x, module.min_val, module.max_val)
        if isinstance(module, nn.Mish):
            return aten.mish_backward(ones, x)
        return aten.softplus_backward(ones, x, module.beta, module.threshold)

    def backprop(self, ctx, grads):
        return grads * self._derivative(ctx.module, ctx.x)

    def column_bytes(self, ctx, element):
        return 2 * math.prod(ctx.out_shape) * element

    def transient_bytes(self, ctx, element):
        return 3 * ctx.x.numel() * element  # ones, f(x) and the derivative


def _avg_pool2d(node: Any, grads: Tensor, shape: tuple[int, ...]) -> Tensor:
    return torch.ops.aten.avg_pool2d_backward(
        grads, grads.new_empty(shape), node._saved_kernel_size, node._saved_stride,
        node._saved_padding, node._saved_ceil_mode, node._saved_count_include_pad,
        node._saved_divisor_override,
    )  # fmt: skip


def _nearest2d(node: Any, grads: Tensor, shape: tuple[int, ...]) -> Tensor:
    return torch.ops.aten.upsample_nearest2d_backward(
        grads, node._saved_output_size, list(shape), node._saved_scales_h,
        node._saved_scales_w,
    )  # fmt: skip


def _bilinear2d(node: Any, grads: Tensor, shape: tuple[int, ...]) -> Tensor:
    return torch.ops.aten.upsample_bilinear2d_backward(
        grads, node._saved_output_size, list(shape), node._saved_align_corners,
        node._saved_scales_h, node._saved_scales_w,
    )  # fmt: skip


def _max_pool2d(node: Any, grads: Tensor, shape: tuple[int, ...]) -> Tensor:
    # each output takes its input's value: scatter the vectors to the recorded argmax
    indices = node._saved_result1  # [N, C, h, w] into the flattened H*W of each plane
    n = indices.shape[0]
    v = grads.shape[0] // n
    flat = grads.reshape(v, n, shape[1], -1)
    result = grads.new_zeros(v, n, shape[1], math.prod(shape[2:]))
    index = indices.reshape(1, n, shape[1], -1).expand(v, -1, -1, -1)
    return result.scatter_add_(3, index, flat).reshape(shape)


_FOLDED: dict[str, Callable[[Any, Tensor, tuple[int, ...]], Tensor]] = {
    "MaxPool2DWithIndicesBackward0": _max_pool2d,
    "AvgPool2DBackward0": _avg_pool2d,
    "UpsampleNearest2DBackward0": _nearest2d,
    "UpsampleBilinear2DBackward0": _bilinear2d,
}


class FoldedRule(LayerRule):
    """Pooling and upsampling: the layer's own backward kernel on ``V * N`` samples.

    The kernel and its arguments are read from the autograd node the layer's forward
    pass created (``torch.func`` would loop over the columns); layers whose node is not
    one of these (other modes) are left to autograd.
    """

    classes = (nn.MaxPool2d, nn.AvgPool2d, nn.Upsample, nn.UpsamplingNearest2d,
               nn.UpsamplingBilinear2d)  # fmt: skip
    param_names = ()
    description = "2d max/average pooling, nearest/bilinear 2d: all columns at once"
    param_free = True

    def per_sample(self, ctx, grads):
        return {}

    def backprop(self, ctx, grads):
        node, x = ctx.node, ctx.x
        if node is None or len(node.next_functions) != 1 or x.dim() != 4:
            return None  # the kernels below take batched 2d inputs [N, C, H, W]
        kernel = _FOLDED.get(node.name())
        if kernel is None:
            return None
        v, n = grads.shape[:2]
        folded = kernel(node, grads.reshape(v * n, *grads.shape[2:]), (v * n, *x.shape[1:]))
        return folded.reshape(v, n, *x.shape[1:])

    def column_bytes(self, ctx, element):
        return (2 * math.prod(ctx.out_shape) + 2 * ctx.x.numel()) * element


RULES: tuple[LayerRule, ...] = (
    LinearRule(),
    ConvRule(),
    ConvTransposeRule(),
    BatchNormRule(),
    LayerNormRule(),
    GroupNormRule(),
    EmbeddingRule(),
    ActivationRule(),
    FoldedRule(),
)
"""Registry: one rule per kind of layer. A new layer is one new entry."""


def rule_for(module: nn.Module) -> LayerRule | None:
    """The rule for ``module`` if its computation is exactly the one the rule knows.

    A module qualifies when its class (or a subclass that does not override ``forward``,
    such as ``nn.MultiheadAttention``'s output projection) runs the known layer's
    ``forward``, it is not parametrized (``torch.nn.utils.parametrize``), and its own
    trainable parameters are among the rule's (``weight``, ``bias``; none for a frozen
    layer, whose rule then only maps the vectors back). Anything else is handled from
    the recorded graph.

    Args:
        module: A module.

    Returns:
        The rule, or ``None``.
    """
    if "forward" in vars(module) or parametrize.is_parametrized(module):
        return None
    forward = type(module).forward
    own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
    for rule in RULES:
        for cls in rule.classes:
            if isinstance(module, cls) and forward is cls.forward:
                # a frozen layer keeps its rule's backprop (no parameter products)
                if set(own) <= set(rule.param_names):
                    return rule
                return None
    return None


def supported_layers_table() -> str:
    """A markdown table of the layers with a dedicated rule, generated from :data:`RULES`.

    Returns:
        Markdown text: one row per layer class, then how everything else is handled.
    """
    rows = ["| layer | how | notes |", "|---|---|---|"]
    for rule in RULES:
        for cls in rule.classes:
            rows.append(f"| `nn.{cls.__name__}` | rule `{type(rule).__name__}` | "
                        f"{rule.description} |")  # fmt: skip
    rows.append(
        "| any other layer without parameters (dropout, max pooling, reshapes, `cat`,"
        " additions, attention maths, functional calls such as `F.silu`) | autograd on "
        "the recorded graph, batched over columns | no rule needed; in-place operations "
        "are fine |"
    )
    rows.append(
        "| any other parameter (RNN/LSTM/GRU, `nn.MultiheadAttention` projections, "
        "parameters used functionally, custom layers) | per-sample products from the "
        "recorded graph | exact; one batched backward per sample through the part of "
        "the graph that uses the parameter |"
    )
    return "\n".join(rows)
