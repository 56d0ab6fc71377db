"""Floating-point operations counted by torch's ``FlopCounterMode``, groups included.

Torch's formula for ``convolution_backward`` counts the weight gradient as one
convolution of the input with the output gradient and ignores ``groups``: a grouped
convolution's weight gradient is counted ``groups`` times too large. The windowed path
computes all columns' weight products as one convolution with a group per column and
sample, so torch's count would be thousands of times what runs. Here each of the two
gradients costs what the forward convolution costs (the same multiply-adds in another
order), which holds for every ``groups``, stride, dilation and transposition.

Torch also has no formula for the in-place products ``baddbmm_`` and ``addmm_`` (counted
as zero), which the windowed path uses to add its fields' products into place; they
cost what ``baddbmm`` and ``addmm`` cost.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["flop_counter"]


def _conv_backward(
    grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
    _output_padding, _groups, output_mask, out_shape=None, **kwargs,
) -> int:  # fmt: skip
    # the forward convolution: 2 * batch * weight entries (channels per group included)
    # * positions of the side with the kernel's sliding window
    positions = (x_shape if transposed else grad_out_shape)[2:]
    forward = 2 * x_shape[0] * math.prod(w_shape) * math.prod(positions)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def _product(_self_shape, a_shape, b_shape, *_args, out_shape=None, **_kwargs) -> int:
    # (batched) matrix product: 2 * batch * m * k * n, as torch counts bmm and mm
    *batch, m, k = a_shape
    return 2 * math.prod(batch) * m * k * b_shape[-1]


def flop_counter() -> FlopCounterMode:
    """A ``FlopCounterMode`` (no display) that counts grouped convolutions' backward right.

    Returns:
        The mode; ``get_total_flops()`` after use.
    """
    return FlopCounterMode(
        display=False,
        custom_mapping={
            torch.ops.aten.convolution_backward: _conv_backward,
            torch.ops.aten.baddbmm_: _product,
            torch.ops.aten.addmm_: _product,
        },
    )
