"""An exact module extension for any parameter-free layer, computed with ``torch.func``.

BackPACK backpropagates a matrix ``M`` of shape ``[V, N, *output]`` through each layer as
``[V, N, *input]`` via transposed Jacobian products. For a layer ``y = f(x)`` without
parameters this is ``vmap(vjp(f, x))(M)``, exact for any ``f``: the same batched
computation BackPACK does by hand, derived by autograd instead. ``f`` is the layer's own
``forward`` (called directly, so no hooks fire).
"""

from __future__ import annotations

import torch
from backpack.extensions.module_extension import ModuleExtension
from torch import Tensor, nn

__all__ = ["AutogradJacobian"]


class AutogradJacobian(ModuleExtension):
    """Transposed-Jacobian products of a parameter-free layer by ``torch.func.vjp``."""

    def __init__(self) -> None:
        super().__init__(params=[])

    def backpropagate(
        self,
        extension: object,
        module: nn.Module,
        g_inp: tuple[Tensor, ...],
        g_out: tuple[Tensor, ...],
        backproped: Tensor,
    ) -> Tensor:
        """Map ``[V, N, *output]`` to ``[V, N, *input]``.

        Args:
            extension: The running BackPACK extension (unused).
            module: The layer, with ``input0`` stored by the forward hook.
            g_inp: Gradients w.r.t. the layer's inputs (unused).
            g_out: Gradients w.r.t. the layer's output (unused).
            backproped: The matrix backpropagated to the layer's output.

        Returns:
            The matrix backpropagated to the layer's input.
        """
        inputs = module.input0.detach()
        _, vjp_fn = torch.func.vjp(module.forward, inputs)
        return torch.vmap(vjp_fn)(backproped)[0]
