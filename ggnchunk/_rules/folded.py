"""Pooling and upsampling: the layer's own backward kernel on all columns at once."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ggnchunk._glue_kernels import scatter_to_argmax
from ggnchunk._resample import axis_matrices
from ggnchunk._rules.base import LayerRule
from ggnchunk._windows import Windowed, end_of, gather, resampled, valid, whole_cells

__all__ = ["WINDOWED", "FoldedRule", "pool_tiles"]


def pool_tiles(node: Any) -> tuple[int, ...] | None:
    """An average pooling's kernel where its windows tile the input, else ``None``.

    Kernel = stride (an empty stride, as ``F.avg_pool2d(x, 2)`` records it, is the
    kernel), no padding, floor mode, no divisor override: each input is in at most one
    window, and each window's divisor is its size.

    Args:
        node: The pooling's autograd node.

    Returns:
        The kernel size, or ``None``.
    """
    kernel = tuple(node._saved_kernel_size)
    stride = tuple(node._saved_stride) or kernel
    if (
        stride != kernel or any(node._saved_padding) or node._saved_ceil_mode
        or node._saved_divisor_override is not None
    ):  # fmt: skip
        return None
    return kernel


def _avg_pool2d(node: Any, grads: Tensor, shape: tuple[int, ...]) -> Tensor:
    kernel = pool_tiles(node)
    if kernel is not None:  # each output spread over its window: one copy, where
        # torch's kernel takes about three times as long on the CPU
        kh, kw = kernel
        b, c, h, w = grads.shape
        spread = (grads / (kh * kw))[:, :, :, None, :, None].expand(b, c, h, kh, w, kw)
        spread = spread.reshape(b, c, h * kh, w * kw)
        rest = (shape[3] - w * kw, shape[2] - h * kh)  # inputs no window reads
        return (
            torch.nn.functional.pad(spread, (0, rest[0], 0, rest[1]))
            if any(rest)
            else spread
        )
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
    # each output takes its input's value: the vectors go to the recorded argmax
    indices = node._saved_result1  # [N, C, h, w] into the flattened H*W of each plane
    n = indices.shape[0]
    columns = grads.reshape(grads.shape[0] // n, n, *grads.shape[1:])
    in_shape = (n, *shape[1:])
    return scatter_to_argmax(columns, indices, in_shape, 2).reshape(shape)


def _nearest_windowed(node: Any, block: Windowed, size: tuple[int, ...]) -> Any:
    """Nearest upsampling by integer factors: input ``i`` feeds outputs ``i*s`` on."""
    out = tuple(node._saved_output_size)
    scales = (node._saved_scales_h, node._saved_scales_w)
    if any(o % i for o, i in zip(out, size, strict=True)):
        return None
    factor = tuple(o // i for o, i in zip(out, size, strict=True))
    if any(s is not None and s != f for s, f in zip(scales, factor, strict=True)):
        return None  # torch maps with the given scale then, not the ratio
    region, start = whole_cells(block, factor)
    data = region.data
    v, n, c, h, w = data.shape
    summed = data.reshape(v, n, c, h // factor[0], factor[0], w // factor[1], factor[1])
    summed = summed.sum((4, 6))
    return end_of(Windowed(summed, start, size))


def avg_pool_windowed(node: Any, block: Windowed, size: tuple[int, ...]) -> Any:
    """Average pooling, kernel = stride, no padding: each output spread over its tile.

    Args:
        node: The pooling's autograd node (its saved arguments are read).
        block: Vectors at its output, ``[V, N, C, *box]`` on the output's boxes.
        size: The input's spatial size ``(H, W)``.

    Returns:
        The vectors at the input (boxes ``kernel`` times larger), or ``None`` where
        the windows do not tile the input.
    """
    kernel = pool_tiles(node)
    if kernel is None:
        return None
    data = block.data
    v, n, c, h, w = data.shape
    kh, kw = kernel
    spread = data[:, :, :, :, None, :, None].expand(v, n, c, h, kh, w, kw)
    spread = spread.reshape(v, n, c, h * kh, w * kw) / (kh * kw)
    start = block.start * torch.tensor(kernel, device=block.start.device)
    box = (h * kh, w * kw)
    spread.mul_(valid(start, box, size).to(spread.dtype))  # a new tensor
    return end_of(Windowed(spread, start, size))


def max_pool_windowed(node: Any, block: Windowed, size: tuple[int, ...]) -> Any:
    """Max pooling: each output's vectors go to its recorded argmax, inside the box.

    Output rows ``[s, s + b)`` read input rows from ``s * stride - padding`` to
    ``(s + b - 1) * stride - padding + dilation * (kernel - 1)``: one box size for every
    column. The argmax of each box entry (from the recorded indices, gathered on the
    boxes) becomes a position in the input box, where the vectors are added.

    Args:
        node: The pooling's autograd node (its saved arguments and indices are read).
        block: Vectors at its output, ``[V, N, C, *box]`` on the output's boxes.
        size: The input's spatial size ``(H, W)``.

    Returns:
        The vectors at the input, ``[V, N, C, *input_box]``, or ``None`` for a
        pooling that is not 2d.
    """
    kernel, stride = tuple(node._saved_kernel_size), tuple(node._saved_stride)
    stride = stride or kernel
    padding, dilation = tuple(node._saved_padding), tuple(node._saved_dilation)
    if len(kernel) != 2 or len(stride) != 2 or len(padding) != 2 or len(dilation) != 2:
        return None
    data = block.data
    v, n, c = data.shape[:3]
    device = block.start.device
    step = torch.tensor(stride, device=device)
    start = block.start * step - torch.tensor(padding, device=device)
    box = tuple(
        (b - 1) * s + d * (k - 1) + 1
        for b, s, d, k in zip(block.box, stride, dilation, kernel, strict=True)
    )
    indices = node._saved_result1  # [N, C, h, w]: flat positions in each input plane
    # two index maps of the box's size at most (counted in :meth:`column_bytes`)
    picked = gather(indices, block.start, block.box, block.size)  # [V, N, C, *box]
    first = start.view(v, 1, 1, 1, 1, 2)
    local = torch.div(picked, size[1], rounding_mode="floor")  # input rows
    picked -= local * size[1]  # input columns
    local -= first[..., 0]
    local *= box[1]
    local += picked
    del picked
    local -= first[..., 1]
    local.clamp_(0, box[0] * box[1] - 1)  # entries outside the map: zeros, anywhere
    flat = data.reshape(v, n, c, -1)
    out = flat.new_zeros(v, n, c, box[0] * box[1])
    out.scatter_add_(3, local.reshape(v, n, c, -1), flat)
    return end_of(Windowed(out.view(v, n, c, *box), start, size))


def _resize_options(module: nn.Module) -> dict[str, Any]:
    """An upsampling module's call as ``F.interpolate``'s arguments."""
    return {
        "size": module.size, "scale_factor": module.scale_factor, "mode": module.mode,
        "align_corners": module.align_corners,
        "recompute_scale_factor": getattr(module, "recompute_scale_factor", None),
    }  # fmt: skip


WINDOWED: dict[str, Callable[[Any, Windowed, tuple[int, ...]], Any]] = {
    "UpsampleNearest2DBackward0": _nearest_windowed,
    "AvgPool2DBackward0": avg_pool_windowed,
    "MaxPool2DWithIndicesBackward0": max_pool_windowed,
}
"""Windowed maps by autograd node, for the layers and for the same calls in glue."""
_MAX_POOL = "MaxPool2DWithIndicesBackward0"
_RESIZES = frozenset({"UpsampleBilinear2DBackward0", "UpsampleBicubic2DBackward0"})
_FOLDED: dict[str, Callable[[Any, Tensor, tuple[int, ...]], Tensor]] = {
    _MAX_POOL: _max_pool2d,
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

    def accepts(self, module):
        # a max pooling that also returns its indices (for nn.MaxUnpool2d) has a tuple
        # output the rule does not map: the recorded graph handles it (the folded glue
        # max pooling), as the functional form (the rule's diagonal was 0 where the
        # brute force gave 0.125)
        return not getattr(module, "return_indices", False)

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

    windowed = True

    def backprop_windowed(self, ctx, block):
        node, x = ctx.node, ctx.x
        if node is None or len(node.next_functions) != 1 or x.dim() != 4:
            return None
        size = tuple(x.shape[2:])
        name = node.name()
        if name in WINDOWED:
            return WINDOWED[name](node, block, size)
        if name in _RESIZES:  # the module's per-axis matrices, as the glue's resizes
            if ctx.caches.matrices is None:
                options = _resize_options(ctx.module)
                ctx.caches.matrices = axis_matrices(x, options) or False
            if ctx.caches.matrices is not False:
                return resampled(block, ctx.caches.matrices, x.shape)
        return None  # the dense kernel on the box made dense, windowed again

    def column_bytes(self, ctx, element):
        out = math.prod(ctx.out_shape)
        node = ctx.node
        # windowed max pooling's two int64 index maps of the output's (box) size
        index = 2 * 8 * out if node is not None and node.name() == _MAX_POOL else 0
        return (2 * out + 2 * ctx.x.numel()) * element + index
