r"""An exact module extension for any per-sample block, computed with ``torch.func``.

BackPACK backpropagates a matrix ``M`` of shape ``[V, N, *output]`` through each layer.
For a block ``y_n = f(theta, x_n)`` that treats samples independently:

* to its input: ``[V, N, *input]``, the transposed Jacobian of the batched forward applied
  to each ``M[v]`` (``vmap`` over ``v`` of one ``vjp``);
* to its parameters: the diagonal contribution ``sum_{v, n} (J_theta(x_n)^T M[v, n])**2``,
  with per-sample ``vjp``\\s, ``vmap``-ed over ``v`` and looped over ``n`` (memory
  ``V * |theta|`` at a time; the scheduler's chunking bounds ``V``).

The block's own ``forward`` runs with its parameters swapped in functionally and without
hooks, so hooks of the engine never fire inside the transforms. Exact for any ``f``;
slower than BackPACK's hand-written rules. Blocks that mix samples are refused before the
backward passes (see :func:`check_per_sample`).
"""

from __future__ import annotations

from typing import Any

import torch
from backpack.extensions.module_extension import ModuleExtension
from torch import Tensor, nn

try:  # functional parameter swap without calling the module (so without its hooks)
    from torch.nn.utils.stateless import _reparametrize_module
except ImportError:  # pragma: no cover - torch without it
    _reparametrize_module = None

__all__ = ["AutogradJacobian", "call_without_hooks", "check_per_sample"]


def call_without_hooks(
    module: nn.Module, inputs: Tensor, params: dict[str, Tensor] | None = None
) -> Tensor:
    """``module.forward(inputs)`` with ``params`` swapped in, firing none of its hooks.

    Args:
        module: The block.
        inputs: Its input, shape ``[N, ...]``.
        params: Replacement tensors by name (``named_parameters`` names); ``None`` keeps
            the module's own.

    Returns:
        The block's output (its first element if the block returns a tuple).
    """
    if params:
        if _reparametrize_module is None:  # pragma: no cover
            raise RuntimeError("this torch has no functional parameter swap")
        with _reparametrize_module(module, params):
            out = module.forward(inputs)
    else:
        out = module.forward(inputs)
    return out[0] if isinstance(out, tuple) else out


def check_per_sample(name: str, module: nn.Module, inputs: Tensor, output: Tensor) -> None:
    """Refuse a block whose output for a sample depends on the other samples.

    Compares the block's output for the first sample alone with its row of the batched
    output (one extra forward of one sample).

    Args:
        name: The block's qualified name, for the message.
        module: The block.
        inputs: The batched input it received.
        output: The batched output it produced.

    Raises:
        ValueError: If the two differ.
    """
    if inputs.shape[0] < 2:
        return
    with torch.no_grad():
        alone = call_without_hooks(module, inputs[:1].detach())
    reference = output[:1].detach()
    tolerance = (
        1e-4 if reference.dtype in (torch.float16, torch.bfloat16, torch.float32) else 1e-9
    )
    scale = reference.abs().max().clamp_min(1e-30)
    if (
        alone.shape != reference.shape
        or (alone - reference).abs().max() > tolerance * scale
    ):
        raise ValueError(
            f"model.{name} ({type(module).__name__}) is handled by ggnchunk's torch.func "
            "fallback, which needs a per-sample function, but its output for one sample "
            "changes with the other samples of the batch (batch statistics, or randomness "
            "such as dropout in training mode). Call model.eval(), or replace the block."
        )


class AutogradJacobian(ModuleExtension):
    """Exact BackPACK extension of a per-sample block (parameters and input)."""

    def __init__(self) -> None:
        super().__init__(params=[])

    def __call__(
        self,
        extension: Any,
        module: nn.Module,
        g_inp: tuple[Tensor, ...],
        g_out: tuple[Tensor, ...],
    ) -> None:
        """Store parameter diagonals and backpropagate the matrix to the block's input.

        Args:
            extension: The running BackPACK extension.
            module: The block, with ``input0`` and ``output`` stored by the forward hook.
            g_inp: Gradients w.r.t. the inputs (unused).
            g_out: Gradients w.r.t. the output (unused).
        """
        backproped = extension.saved_quantities.retrieve_quantity(
            module.output.data_ptr(), True
        )
        if backproped is None:
            return
        inputs = module.input0.detach()
        params = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}
        if params:
            for name, value in self._param_diagonals(module, params, inputs, backproped):
                setattr(module.get_parameter(name), extension.savefield, value)
        if module.input0.requires_grad:
            backproped_input = self.backpropagate(
                extension, module, g_inp, g_out, backproped
            )
            extension.saved_quantities.save_quantity(
                module.input0.data_ptr(),
                backproped_input,
                extension.accumulate_backpropagated_quantities,
            )

    @staticmethod
    def _param_diagonals(
        module: nn.Module, params: dict[str, Tensor], inputs: Tensor, backproped: Tensor
    ) -> list[tuple[str, Tensor]]:
        def one_sample(p: dict[str, Tensor], x: Tensor) -> Tensor:
            return call_without_hooks(module, x.unsqueeze(0), p).squeeze(0)

        totals = {name: torch.zeros_like(p) for name, p in params.items()}
        for n in range(inputs.shape[0]):
            _, vjp_fn = torch.func.vjp(lambda p, n=n: one_sample(p, inputs[n]), params)
            (grads,) = torch.vmap(vjp_fn)(backproped[:, n])
            for name, grad in grads.items():
                totals[name] += (grad**2).sum(0)
        return list(totals.items())

    def backpropagate(
        self,
        extension: Any,
        module: nn.Module,
        g_inp: tuple[Tensor, ...],
        g_out: tuple[Tensor, ...],
        backproped: Tensor,
    ) -> Tensor:
        """Map ``[V, N, *output]`` to ``[V, N, *input]``.

        Args:
            extension: The running BackPACK extension (unused).
            module: The block, with ``input0`` stored by the forward hook.
            g_inp: Gradients w.r.t. the block's inputs (unused).
            g_out: Gradients w.r.t. the block's output (unused).
            backproped: The matrix backpropagated to the block's output.

        Returns:
            The matrix backpropagated to the block's input.
        """
        inputs = module.input0.detach()
        _, vjp_fn = torch.func.vjp(lambda x: call_without_hooks(module, x), inputs)
        return torch.vmap(vjp_fn)(backproped)[0]
