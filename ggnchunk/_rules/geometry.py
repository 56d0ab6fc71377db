"""Convolution geometry: argument tuples, explicit padding, unfolded patches."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["as_tuple", "explicit_padding", "patch_index", "unfold", "window_view"]


def as_tuple(value: int | tuple[int, ...], dims: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * dims


def explicit_padding(module: nn.Module, dims: int) -> list[tuple[int, int]]:
    """(left, right) zero padding per spatial dimension, ``"same"``/``"valid"`` resolved."""
    kernel = as_tuple(module.kernel_size, dims)
    dilation = as_tuple(module.dilation, dims)
    if module.padding == "valid":
        return [(0, 0)] * dims
    if module.padding == "same":
        pads = []
        for k, d in zip(kernel, dilation, strict=True):
            total = d * (k - 1)
            pads.append((total // 2, total - total // 2))
        return pads
    return [(p, p) for p in as_tuple(module.padding, dims)]


def window_view(
    x: Tensor, kernel, stride, padding, dilation, positions: tuple[int, ...] | None = None
) -> Tensor:
    """``[B, C, *kernel, *positions]`` strided view of the (zero-padded) input's patches.

    ``positions`` keeps the first positions along each axis: a transposed convolution
    whose ``output_padding`` reaches its stride (allowed below the dilation) has an
    output grid with more patches than input positions, and the extra ones are no
    input's.
    """
    dims = len(kernel)
    stride, padding, dilation = (as_tuple(t, dims) for t in (stride, padding, dilation))
    pads = [p for pad in reversed(padding) for p in (pad, pad)]
    if any(pads):
        x = F.pad(x, pads)
    for d in range(dims):
        x = x.unfold(2 + d, dilation[d] * (kernel[d] - 1) + 1, stride[d])
        if dilation[d] > 1:
            x = x[..., :: dilation[d]]
    order = [0, 1, *range(2 + dims, 2 + 2 * dims), *range(2, 2 + dims)]
    x = x.permute(order)
    if positions is not None and tuple(x.shape[2 + dims :]) != tuple(positions):
        x = x[(..., *(slice(0, p) for p in positions))]
    return x


def unfold(
    x: Tensor, kernel: tuple[int, ...], stride, padding, dilation,
    positions: tuple[int, ...] | None = None,
) -> Tensor:  # fmt: skip
    """Patches of ``x`` as a convolution sees them, for 1, 2 or 3 spatial dimensions.

    Args:
        x: ``[B, C, *spatial]``.
        kernel: Kernel size per spatial dimension.
        stride: Stride per spatial dimension.
        padding: Zero padding per spatial dimension.
        dilation: Dilation per spatial dimension.
        positions: Positions kept per spatial dimension (:func:`window_view`).

    Returns:
        ``[B, C * prod(kernel), P]``: row ``c * K + j`` is channel ``c`` at kernel offset
        ``j``, for each of the ``P`` output positions.
    """
    view = window_view(x, kernel, stride, padding, dilation, positions)
    return view.reshape(x.shape[0], x.shape[1] * math.prod(kernel), -1)


def patch_index(
    start: Tensor, box: tuple[int, ...], kernel: tuple[int, ...], stride: tuple[int, ...],
    padding: tuple[int, ...], dilation: tuple[int, ...], size: tuple[int, ...],
    transposed: bool,
) -> Tensor:  # fmt: skip
    """The input each kernel offset meets at each output position of each column's box.

    A convolution's output ``o`` reads input ``o*s - p + k*d`` at kernel offset ``k``; a
    transposed convolution's output ``o`` is written by input ``i`` with
    ``i*s - p + k*d = o``, where that ``i`` is whole and in the map.

    Args:
        start: ``[V, d]`` (int64) box starts in the output map.
        box: The output box size.
        kernel: Kernel size per spatial dimension.
        stride: Stride per spatial dimension.
        padding: Left zero padding per spatial dimension.
        dilation: Dilation per spatial dimension.
        size: The input map's spatial size.
        transposed: A transposed convolution.

    Returns:
        ``[V, prod(box) * prod(kernel)]`` (int64, box positions major): the flat index of
        the input in the map, or ``prod(size)`` where no input is read (padding, the
        stride's gaps, outside the map).
    """
    v, dims = start.shape[0], len(box)
    device = start.device
    index = torch.zeros((v, *box, *kernel), dtype=torch.int64, device=device)
    inside = torch.ones((v, *box, *kernel), dtype=torch.bool, device=device)
    step = 1
    for d in reversed(range(dims)):
        out = start[:, d, None, None] + torch.arange(box[d], device=device).view(1, -1, 1)
        offset = torch.arange(kernel[d], device=device).view(1, 1, -1) * dilation[d]
        if transposed:
            reach = out + padding[d] - offset
            i = torch.div(reach, stride[d], rounding_mode="floor")
            ok = (i * stride[d] == reach) & (i >= 0) & (i < size[d])
        else:
            i = out * stride[d] - padding[d] + offset
            ok = (i >= 0) & (i < size[d])
        shape = [v] + [1] * (2 * dims)
        shape[1 + d], shape[1 + dims + d] = box[d], kernel[d]
        index = index + (i.clamp(0, size[d] - 1) * step).view(shape)
        inside = inside & ok.view(shape)
        step *= size[d]
    return torch.where(inside, index, step).view(v, -1)
