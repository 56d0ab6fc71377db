"""Elementwise activations, from a table of their derivatives."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ggnchunk._rules.base import LayerRule
from ggnchunk._windows import gather

__all__ = ["DERIVATIVES", "ActivationRule"]

_aten = torch.ops.aten

DERIVATIVES: dict[type[nn.Module], Callable[[nn.Module, Tensor], Tensor]] = {
    nn.ReLU: lambda m, x: _aten.threshold_backward(torch.ones_like(x), x, 0),
    nn.SiLU: lambda m, x: _aten.silu_backward(torch.ones_like(x), x),
    nn.GELU: lambda m, x: _aten.gelu_backward(
        torch.ones_like(x), x, approximate=m.approximate
    ),
    nn.Tanh: lambda m, x: _aten.tanh_backward(torch.ones_like(x), torch.tanh(x)),
    nn.Sigmoid: lambda m, x: _aten.sigmoid_backward(torch.ones_like(x), torch.sigmoid(x)),
    nn.Hardswish: lambda m, x: _aten.hardswish_backward(torch.ones_like(x), x),
    nn.LeakyReLU: lambda m, x: _aten.leaky_relu_backward(
        torch.ones_like(x), x, m.negative_slope, False
    ),
    nn.ELU: lambda m, x: _aten.elu_backward(torch.ones_like(x), m.alpha, 1, 1, False, x),
    nn.Softplus: lambda m, x: _aten.softplus_backward(
        torch.ones_like(x), x, m.beta, m.threshold
    ),
    nn.Hardsigmoid: lambda m, x: _aten.hardsigmoid_backward(torch.ones_like(x), x),
    nn.Hardtanh: lambda m, x: _aten.hardtanh_backward(  # also nn.ReLU6
        torch.ones_like(x), x, m.min_val, m.max_val
    ),
    nn.Mish: lambda m, x: _aten.mish_backward(torch.ones_like(x), x),
}
"""``{activation class: f'(x) from the module and its input}``, from the layers' own
backward kernels applied to ones. A class is handled only if it is here: a new
activation is one new entry (its derivative), never a guess."""


def derivative(module: nn.Module, x: Tensor) -> Tensor:
    """``f'(x)`` for an activation layer from :data:`DERIVATIVES`.

    Args:
        module: The activation layer.
        x: Its input, ``[N, ...]``.

    Returns:
        ``[N, ...]``.

    Raises:
        TypeError: If neither the layer's class nor a base class of it is in the table.
    """
    for cls in type(module).__mro__:
        fn = DERIVATIVES.get(cls)
        if fn is not None:
            return fn(module, x)
    raise TypeError(
        f"{type(module).__name__} has no derivative in ggnchunk's activation table; add "
        "one to ggnchunk._rules.activation.DERIVATIVES (or leave the layer to autograd)."
    )


class ActivationRule(LayerRule):
    """Elementwise activations: their derivative, once per pass, times the vectors.

    ``torch.func`` has no batching rule for most activation backward kernels (it loops
    over the columns). The derivative ``f'(x)`` (``[N, ...]``) comes from the layer's
    own backward kernel applied to ones (:data:`DERIVATIVES`), and multiplies all
    columns at once.
    """

    param_names = ()
    description = "derivative once per pass, times all columns"
    param_free = True

    @property
    def classes(self) -> tuple[type[nn.Module], ...]:  # type: ignore[override]
        """The activation classes of :data:`DERIVATIVES`."""
        return tuple(DERIVATIVES)

    def per_sample(self, ctx, grads):
        return {}

    def backprop(self, ctx, grads):
        return grads * derivative(ctx.module, ctx.x)

    windowed = True

    def backprop_windowed(self, ctx, block):
        slope = derivative(ctx.module, ctx.x)
        if slope.dim() != block.data.dim() - 1:
            return None
        return block.with_data(
            block.data * gather(slope, block.start, block.box, block.size)
        )

    def column_bytes(self, ctx, element):
        return 2 * math.prod(ctx.out_shape) * element

    def transient_bytes(self, ctx, element):
        return 3 * ctx.x.numel() * element  # ones, f(x) and the derivative
