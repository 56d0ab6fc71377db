"""Kronecker factors of the exact GGN: the result type and its assembly from the engine.

The engine (the ``KroneckerFactors`` quantity) sums, per layer, the output factor
``G = sum_{v, n} s_{vn} s_{vn}^T`` over every column ``v`` of the loss Hessian's square
root (``s_{vn}``: the column backpropagated to the layer's output, summed over output
positions) and the input factor ``sum_n sum_p u_{np} u_{np}^T`` of the (unfolded)
inputs. Both conventions are BackPACK's ``KFLR``: the input factor is divided by the
number of samples, so ``G ⊗ A`` is the exact GGN block of the weight for one sample
with one output position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class KronFactors:
    """Kronecker factors of one layer's exact-GGN block (BackPACK's KFLR convention).

    For a layer with weight ``W`` of shape ``[C_out, *fan_in]`` (``nn.Linear``:
    ``[C_out, D_in]``; ``nn.ConvNd``: ``[C_out, C_in, *kernel]``), the GGN block of
    ``W.flatten()`` is approximated by ``torch.kron(output, input)``; the bias block is
    ``output`` exactly.

    Attributes:
        output: ``[C_out, C_out]``: ``sum_{v, n} s_{vn} s_{vn}^T``, ``s_{vn}`` column
            ``v`` of the loss Hessian's square root (scaled by the loss's reduction)
            backpropagated to the layer's output of sample ``n`` and summed over output
            positions (the axes between batch and features of a Linear, the spatial axes
            of a convolution). It is the exact GGN block of the bias.
        input: ``[K, K]`` with ``K = W[0].numel()``: ``(1/N) sum_n sum_p u_{np} u_{np}^T``
            over the layer's inputs ``u`` (a convolution's unfolded patches, in the
            order of ``W[0].flatten()``); ``None`` when the weight is frozen.
        weight: Qualified name of the weight parameter, ``None`` if it is frozen.
        bias: Qualified name of the bias parameter, ``None`` if absent or frozen.
    """

    output: Tensor
    input: Tensor | None
    weight: str | None
    bias: str | None

    def weight_block(self) -> Tensor:
        """The dense Kronecker approximation of the weight's GGN block.

        Returns:
            ``torch.kron(output, input)``, ``[W.numel(), W.numel()]``.

        Raises:
            ValueError: If the weight is frozen.
        """
        if self.input is None:
            raise ValueError("the weight is frozen: it has no Kronecker block.")
        return torch.kron(self.output, self.input)


def assemble(
    model: nn.Module,
    names: list[str],
    outputs: dict[str, Tensor],
    inputs: dict[str, Tensor],
    samples: int,
) -> dict[str, KronFactors]:
    """Per-layer factors in parameter order, zeros for layers the output never reached.

    Args:
        model: The user's model.
        names: Qualified names of the trainable parameters (all weights and biases of
            layers with factors, checked before).
        outputs: Summed output factors, keyed by layer name.
        inputs: Summed, not yet normalized input factors, keyed by layer name.
        samples: Number of samples ``N`` of the whole batch.

    Returns:
        ``{layer name: KronFactors}``, in the order of ``model.named_parameters()``.
    """
    layers: dict[str, dict[str, str]] = {}
    for name in names:
        layer, _, pname = name.rpartition(".")
        layers.setdefault(layer, {})[pname] = name
    result = {}
    for layer, params in layers.items():
        module = model.get_submodule(layer)
        weight = module.weight
        output = outputs.get(layer)
        if output is None:
            output = weight.new_zeros(weight.shape[0], weight.shape[0]).detach()
        factor = None
        if "weight" in params:
            factor = inputs.get(layer)
            if factor is None:
                fan_in = weight[0].numel()
                factor = weight.new_zeros(fan_in, fan_in).detach()
            factor = factor.div_(samples)  # in place: a second copy of a large input
            # factor (72 MiB for a Linear on 3,072 features) went above the budget
        result[layer] = KronFactors(
            output, factor, params.get("weight"), params.get("bias")
        )
    return result
