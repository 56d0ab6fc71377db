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
    if _sparse_taps(x, kernel, stride, padding, dilation):
        return _gathered_view(x, kernel, stride, padding, dilation, positions)
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


def _outputs(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _sparse_taps(
    x: Tensor, kernel: tuple[int, ...], stride: tuple[int, ...],
    padding: tuple[int, ...], dilation: tuple[int, ...],
) -> bool:  # fmt: skip
    """Whether the zero-padded map is larger than the patches read from it.

    A dilated convolution padded by its dilation on a small map (an ASPP's atrous
    branches, dilation 36 on DeepLab's 4x4 maps of 32x32 images: 76x76 padded maps,
    ``[2, 960, 76, 76]`` for 16 positions' patches) reads a few taps of a padded map
    mostly made of zeros: padding it first took 42 MiB beside patches of 2 MiB, a
    transient the memory bound (which counts the patches twice) did not see, and a
    budgeted DeepLab peaked 1.46x above its budget.
    """
    if not any(padding):
        return False
    padded = math.prod(s + 2 * p for s, p in zip(x.shape[2:], padding, strict=True))
    sides = zip(x.shape[2:], kernel, stride, padding, dilation, strict=True)
    outputs = math.prod(_outputs(*t) for t in sides)
    return padded > math.prod(kernel) * outputs


def _gathered_view(
    x: Tensor, kernel: tuple[int, ...], stride: tuple[int, ...],
    padding: tuple[int, ...], dilation: tuple[int, ...],
    positions: tuple[int, ...] | None,
) -> Tensor:  # fmt: skip
    """:func:`window_view`'s patches gathered axis by axis, no padded map (a copy).

    Along each spatial axis the taps ``o * s - p + k * d`` are picked from the map with
    one zero slice appended (read where a tap falls in the padding), so nothing larger
    than the patches (and the map) is made.
    """
    dims = len(kernel)
    for d in range(dims):
        axis = 2 + 2 * d  # each axis before it is two now: (positions, taps)
        size = x.shape[axis]
        count = _outputs(size, kernel[d], stride[d], padding[d], dilation[d])
        if positions is not None:
            count = min(count, positions[d])
        taps = (
            torch.arange(count, device=x.device)[:, None] * stride[d] - padding[d]
            + torch.arange(kernel[d], device=x.device)[None, :] * dilation[d]
        )  # fmt: skip
        taps = torch.where((taps >= 0) & (taps < size), taps, size)  # [count, k]
        zeros = x.new_zeros(*x.shape[:axis], 1, *x.shape[axis + 1 :])
        x = torch.cat((x, zeros), axis).index_select(axis, taps.flatten())
        x = x.unflatten(axis, (count, kernel[d]))
    # [B, C, o1, k1, o2, k2, ...] to [B, C, k1, k2, ..., o1, o2, ...]
    order = [0, 1, *(3 + 2 * d for d in range(dims)), *(2 + 2 * d for d in range(dims))]
    return x.permute(order)


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
