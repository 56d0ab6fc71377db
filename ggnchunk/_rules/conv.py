"""Convolutions and transposed convolutions (1d, 2d, 3d)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ggnchunk._glue_kernels import pad_transposed
from ggnchunk._rules.base import LayerRule, RuleContext, gram_of_sums, squares, trainable
from ggnchunk._rules.geometry import (
    as_tuple,
    explicit_padding,
    patch_index,
    unfold,
    window_view,
)
from ggnchunk._rules.kernels import (
    BLOCK,
    MAPS_MARGIN,
    SMALL_WEIGHT,
    add_row_sums,
    direct_bytes,
    direct_squares,
    products,
    square_sum,
    square_sum_bytes,
    use_gram,
)
from ggnchunk._windows import Windowed, end_of, gather, mix, valid

__all__ = ["ConvRule", "ConvTransposeRule"]


def _weight_gradient_of_squares(
    ctx: RuleContext, mask: Tensor, transposed: bool
) -> dict[str, Tensor]:
    """A convolution's weight gradient for input ``x**2`` and output gradient ``mask``."""
    module, x = ctx.module, ctx.x
    dims = x.dim() - 2
    squares = ctx.caches.squares
    if squares is None:
        squares = x.square()
        if not ctx.lean:
            ctx.caches.squares = squares
    mask = mask.expand(x.shape[0], *mask.shape[1:])
    out = {}
    if trainable(module, "weight"):
        # a transposed convolution's output padding as the call made it: forward's
        # ``output_size=`` argument overrides the module's ``output_padding``
        output_padding = [0] * dims
        if transposed:
            output_padding = [
                size - ((i - 1) * s - 2 * p + d * (k - 1) + 1)
                for size, i, s, p, d, k in zip(
                    ctx.out_shape[2:], x.shape[2:], as_tuple(module.stride, dims),
                    as_tuple(module.padding, dims), as_tuple(module.dilation, dims),
                    as_tuple(module.kernel_size, dims), strict=True,
                )
            ]  # fmt: skip
        out["weight"] = torch.ops.aten.convolution_backward(
            mask, squares, module.weight.detach(), None, as_tuple(module.stride, dims),
            as_tuple(module.padding, dims), as_tuple(module.dilation, dims), transposed,
            list(output_padding), module.groups, [False, True, False],
        )[1]  # fmt: skip
    if trainable(module, "bias"):
        out["bias"] = mask.sum([0, *range(2, mask.dim())])
    return out


def _on(block: Windowed, values: Any) -> Tensor:
    """Per-axis integers as a tensor on the device of the block's box starts."""
    return torch.tensor(values, dtype=torch.int64, device=block.start.device)


def _transposed_by_products(
    data: Tensor, weight: Tensor, stride: tuple[int, ...], dilation: tuple[int, ...],
    groups: int,
) -> Tensor:  # fmt: skip
    """``conv_transpose(data, weight)`` (no padding) as one product and shifted sums.

    The maps are laid out last (``[C, *box, B]``), so that each kernel offset's share
    is added into the output's positions it reaches as rows of ``B`` values.

    Args:
        data: ``[B, C, *box]``.
        weight: The convolution's weight ``[C, Ci/G, *k]``.
        stride: Stride per spatial dimension.
        dilation: Dilation per spatial dimension.
        groups: ``G``.

    Returns:
        ``[B, Ci, *out]`` (a strided view), ``out = (box - 1) * stride + (k - 1) *
        dilation + 1``.
    """
    b, c = data.shape[:2]
    box, kernel = tuple(data.shape[2:]), tuple(weight.shape[2:])
    g, i = groups, weight.shape[1]
    out = [
        (w - 1) * s + (k - 1) * d + 1
        for w, s, k, d in zip(box, stride, kernel, dilation, strict=True)
    ]
    rows = data.reshape(b, g, c // g, -1).permute(1, 2, 3, 0).reshape(g, c // g, -1)
    shares = torch.bmm(weight.reshape(g, c // g, -1).transpose(1, 2), rows)
    shares = shares.view(g, i, *kernel, *box, b)
    result = data.new_zeros(g, i, *out, b)
    for offset in itertools.product(*(range(k) for k in kernel)):
        reach = tuple(
            slice(k * d, k * d + (w - 1) * s + 1, s)
            for k, d, w, s in zip(offset, dilation, box, stride, strict=True)
        )
        result[(slice(None), slice(None), *reach)] += shares[
            (slice(None), slice(None), *offset)
        ]
    return result.view(g * i, *out, b).movedim(-1, 0)


def _one_position_transposed(data: Tensor, weight: Tensor, groups: int) -> Tensor:
    """``conv_transpose(data, weight)`` of one-position maps: one matrix product.

    Each input position meets each kernel offset once: the output is the vectors times
    the weight's rows, laid out as the kernel (oneDNN's transposed convolution of the
    segmenter's ``[10240, 16, 1, 1]`` vectors took 5.1 ms, the product 2.2-2.5 ms).

    Args:
        data: ``[B, C, 1...]``.
        weight: The convolution's weight ``[C, Ci/G, *k]``.
        groups: ``G``.

    Returns:
        ``[B, Ci, *k]``.
    """
    b, c = data.shape[:2]
    kernel, i = tuple(weight.shape[2:]), weight.shape[1]
    if groups == 1:
        return (data.reshape(b, c) @ weight.reshape(c, -1)).view(b, i, *kernel)
    g = groups
    rows = data.reshape(b, g, c // g).transpose(0, 1)  # [G, B, C/G]
    result = torch.bmm(rows, weight.reshape(g, c // g, -1))  # [G, B, I * K]
    return result.transpose(0, 1).reshape(b, g * i, *kernel)


def _transposed_box(
    block: Windowed, module: nn.Module, box: tuple[int, ...], start: Tensor,
    stride: tuple[int, ...], dilation: tuple[int, ...], x: Tensor,
) -> Windowed:  # fmt: skip
    """A convolution's input gradient on boxes: the transposed convolution of each box."""
    dims = x.dim() - 2
    data = block.data[:, :1] if block.sample_free else block.data
    v, n, c = data.shape[:3]
    folded = data.reshape(v * n, c, *block.box)
    if math.prod(block.box) == 1 and max(dilation) == 1:
        result = _one_position_transposed(folded, module.weight.detach(), module.groups)
    elif max(block.box) <= 2 and max(stride) > 1:  # oneDNN's strided transposed
        # convolution of tiny maps: 1.4-4x slower at 1 thread (the 28x28 AE's layers)
        result = _transposed_by_products(folded, module.weight.detach(), stride, dilation,
                                         module.groups)  # fmt: skip
    else:
        conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[dims - 1]
        result = conv(
            folded, module.weight.detach(), None, stride, 0, 0, module.groups, dilation
        )
    size = tuple(x.shape[2:])
    # in place: a new tensor (another map-sized one per step, freshly paged in)
    result = result.unflatten(0, (v, n)).mul_(valid(start, box, size).to(result.dtype))
    if block.sample_free:
        result = result.expand(v, block.data.shape[1], *result.shape[2:])
    return Windowed(result, start, size)


def _weight_squares(
    ctx: RuleContext, block: Windowed, start: Tensor, box: tuple[int, ...], fields: Any,
    transposed: bool, per_sample: bool = False, weights: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """``sum_{v,n}`` of squared weight products of a (transposed) convolution on boxes.

    One column's products are the weight gradient of the layer on the inputs under its
    box ``start``/``box`` with the vectors of ``block`` (the outputs those inputs
    reach): all columns and samples at once as a grouped convolution's weight gradient
    (one group per column, sample and group of the layer), no unfolded patches.

    Args:
        ctx: The layer's context.
        block: ``[V, N, Cout, *out box]`` vectors at the layer's output (with fields'
            coefficients where ``fields`` is given).
        start: ``[V, d]`` input box starts (inputs outside the map read as zero).
        box: The input box size.
        fields: The fields' per-sample products (``{"weight": [K, N, *weight]}``) or
            ``None``.
        transposed: A transposed convolution (weights ``[Cin, Cout/G, *k]``).
        per_sample: Sum over the columns only (each sample's squares).
        weights: Weights of the weight's entries: the squares weighted and summed over
            them instead, per column and sample.

    Returns:
        ``weight.shape`` (``[N, *weight.shape]`` per sample, ``[V, N]`` with weights).
    """
    module, x = ctx.module, ctx.x
    dims = x.dim() - 2
    kernel, stride, dilation = (
        as_tuple(t, dims) for t in (module.kernel_size, module.stride, module.dilation)
    )
    data, out_box, size = block.data, block.box, tuple(x.shape[2:])
    v, n, c = data.shape[:3]
    g, ci = module.groups, x.shape[1]
    weight = module.weight
    # oneDNN's workspace for a grouped weight gradient (outside torch's allocator)
    # grows with the groups: measured up to twice the gradient itself (8 or more
    # channels per group on both sides; none at 1). With one group per column and
    # sample it took twice the tensors' memory (RSS 21 MiB for 57 columns of the
    # 28x28 decoder) and, past the cache, 6x the time per column: a step holds
    # BLOCK elements with it
    per = n * (c * math.prod(out_box) + ci * math.prod(box) + 3 * weight.numel())
    step = max(1, BLOCK // max(per, 1))
    if weights is not None:
        total = data.new_zeros(v, n)
    else:
        total = data.new_zeros((n, *weight.shape) if per_sample else weight.shape)
    for i in range(0, v, step):
        grads = data[i : i + step]
        count = grads.shape[0] * n
        inputs = gather(x, start[i : i + step], box, size)  # zero outside the map
        rows = (count * ci, c // g) if transposed else (count * c, ci // g)
        prods = torch.ops.aten.convolution_backward(
            grads.reshape(1, count * c, *out_box), inputs.reshape(1, count * ci, *box),
            weight.new_empty(1).expand(*rows, *kernel), None, stride, [0] * dims,
            dilation, transposed, [0] * dims, count * g, [False, True, False],
        )[1].view(-1, n, *weight.shape)  # fmt: skip
        if fields is not None:
            mix(block.coeffs[i : i + step], fields["weight"], into=prods)  # a new tensor
        if weights is None and not per_sample:  # added in place: no sum beside total
            add_row_sums(total, prods.flatten(0, 1).square_())
            continue
        value = squares(prods, per_sample, weights)
        if weights is not None:
            total[i : i + step] = value
        else:
            total += value
    return total


def _bias_squares(
    block: Windowed, fields: Any, per_sample: bool, weights: Tensor | None
) -> Tensor:
    """Squared bias products on boxes, reduced as :func:`.base.squares` reduces them."""
    v, n, c = block.data.shape[:3]
    sums = block.data.reshape(v, n, c, -1).sum(3)
    if fields is not None:
        sums = sums + mix(block.coeffs, fields["bias"])
    return squares(sums, per_sample, weights)


PATCHES: bool | None = None
"""Weight products on boxes from the patches each box reads (``True``), as a grouped
convolution's weight gradient (``False``), or by their sizes (``None``)."""


def _use_patches(ctx: RuleContext, block: Windowed, grouped: int) -> bool:
    """Whether the patches of the output boxes are the cheaper form of the products.

    Both forms do the same multiply-adds. The patches repeat each input once per kernel
    offset that reads it (``K`` times at stride 1); the grouped convolution reads each
    column's input region once (``grouped`` elements per column and sample) but runs
    one small group per column and sample, and oneDNN's grouped weight gradient pays
    per group.
    """
    if PATCHES is not None:
        return PATCHES
    patches = ctx.x.shape[1] * ctx.module.weight[0, 0].numel() * math.prod(block.box)
    # measured at 1 thread: the patches 1.4-2.8x faster up to 3.2x the grouped form's
    # elements (the 28x28 and tutorial autoencoders), as fast at 6.3x (the U-Net's
    # 10x10 boxes at 3x3 kernels)
    return patches <= 4 * grouped


def _patch_squares(
    ctx: RuleContext, block: Windowed, fields: Any, transposed: bool,
    padding: tuple[int, ...], x: Tensor | None = None, per_sample: bool = False,
    weights: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """``sum_{v,n}`` of squared weight products from the patches of each output box.

    A column's products are ``sum_o grads[o] * patch[o]`` over its output box, the patch
    of ``o`` being the inputs each kernel offset meets there (:func:`patch_index`; zero
    at padding and at a transposed convolution's stride gaps): one batched product per
    step of columns, no grouped convolution and no region around the box.

    Args:
        ctx: The layer's context (zero padding).
        block: ``[V, N, Cout, *box]`` vectors at the layer's output.
        fields: The fields' per-sample products (``{"weight": [K, N, *weight]}``) or
            ``None``.
        transposed: A transposed convolution (weights ``[Cin, Cout/G, *k]``).
        padding: Left zero padding per spatial dimension.
        x: The input to read instead of the layer's (a map padded with values, read
            with ``padding`` 0), or ``None``.
        per_sample: Sum over the columns only (each sample's squares).
        weights: Weights of the weight's entries: the squares weighted and summed over
            them instead, per column and sample.

    Returns:
        ``weight.shape`` (``[N, *weight.shape]`` per sample, ``[V, N]`` with weights).
    """
    module, x = ctx.module, ctx.x if x is None else x
    dims = x.dim() - 2
    kernel, stride, dilation = (
        as_tuple(t, dims) for t in (module.kernel_size, module.stride, module.dilation)
    )
    data, box = block.data, block.box
    v, n, c = data.shape[:3]
    g, ci = module.groups, x.shape[1]
    o, i_g, kk, pb = c // g, ci // g, math.prod(kernel), math.prod(box)
    weight = module.weight
    # the input as rows of positions (a last row of zeros for entries read nowhere):
    # picking a box's patches copies whole rows
    rows = F.pad(x.detach().reshape(n * ci, -1), (0, 1)).t().contiguous()
    phi = None
    if fields is not None:  # the fields' products in the order of the products below
        if transposed:  # [*, N, G, I, O, K] to [*, N, G, O, K, I]
            phi = fields["weight"].reshape(-1, n, g, i_g, o, kk).permute(0, 1, 2, 4, 5, 3)
        else:  # [*, N, G, O, I, K] to [*, N, G, O, K, I]
            phi = fields["weight"].reshape(-1, n, g, o, i_g, kk).transpose(4, 5)
        phi = phi.reshape(-1, n, g * o * kk * i_g)
    # a step's tensors (per column: its patches picked and reordered, its vectors, its
    # products) and the index tables of a span of columns (int64, with two temporaries
    # as large) share BLOCK elements
    # one position per box, no fields, squares summed: a column's products are an outer
    # product, whose squares are the outer product of its sides' squares, so a step's
    # squares summed over its columns are one product of those (no products formed:
    # the segmenter's 16->16 layer below its 1x1 head wrote and squared 2.7 MB per step)
    outer = OUTER and pb == 1 and phi is None and weights is None
    per = n * (2 * ci * kk * pb + c * pb + (0 if outer else weight.numel()))
    step = max(1, (3 * BLOCK // 4) // max(per, 1))
    span = max(step, BLOCK * data.element_size() // (4 * 24 * pb * kk))
    samples = n if per_sample else 1
    if weights is not None:  # in the products' order: [G, O, K * I]
        if transposed:  # [G * I, O, K] to [G, O, K, I]
            weights = weights.reshape(g, i_g, o, kk).permute(0, 2, 3, 1)
        else:  # [G * O, I, K] to [G, O, K, I]
            weights = weights.reshape(g, o, i_g, kk).transpose(2, 3)
        weights = weights.reshape(g, o, kk * i_g)
        total = data.new_zeros(v, n)
    else:
        total = data.new_zeros(samples, g, o, kk * i_g)
    for first in range(0, v, span):
        index = patch_index(
            block.start[first : first + span], box, kernel, stride, padding, dilation,
            tuple(x.shape[2:]), transposed,
        )  # fmt: skip
        for j in range(0, index.shape[0], step):
            part = index[j : j + step]
            w = part.shape[0]
            patches = rows.index_select(0, part.view(-1)).view(w, pb, kk, n, g, i_g)
            if outer:
                _outer_squares(total, data[first + j : first + j + w], patches, g)
                continue
            patches = patches.permute(0, 3, 4, 1, 2, 5).reshape(w * n * g, pb, kk * i_g)
            # contiguous: vectors with the columns laid out last (a transposed
            # convolution's products on boxes) sent torch's CPU bmm into a loop of
            # one small product per matrix, 30x slower (the 28x28 decoder)
            grads = data[first + j : first + j + w].reshape(w * n * g, o, pb).contiguous()
            prods = torch.bmm(grads, patches)  # [W * N * G, O, K * I]
            if phi is not None:
                coeffs = block.coeffs[first + j : first + j + w]
                mix(coeffs, phi, into=prods.view(w, n, -1))
            if weights is None and not per_sample:  # added in place, no sum beside it
                add_row_sums(total[0], prods.view(w * n, g, o, kk * i_g).square_())
                continue
            value = squares(prods.view(w, n, g, o, kk * i_g), per_sample, weights)
            if weights is not None:
                total[first + j : first + j + w] = value
            else:
                total += value
    if weights is not None:
        return total
    total = total.view(samples, g, o, kk, i_g)
    # to the weight's layout: [G * O, I, K], or [G * I, O, K] transposed (a view, but
    # for a grouped transposed convolution's, copied: :meth:`ConvRule._sizes`)
    order = (0, 1, 4, 2, 3) if transposed else (0, 1, 2, 4, 3)
    result = total.permute(order).reshape(samples, *weight.shape)
    return result if per_sample else result[0]


OUTER = True
"""Squares on one-position boxes as products of the sides' squares (an internal switch,
for side-by-side runs: the products formed and squared otherwise)."""


def _outer_squares(total: Tensor, grads: Tensor, patches: Tensor, g: int) -> None:
    """Add one-position boxes' squared weight products to ``total``, in place.

    A column's products on a box of one position are ``grads ⊗ patch``, and their squares
    ``grads**2 ⊗ patch**2``: summed over columns (and samples, where ``total`` has one
    row) they are one batched product of the squared sides per group.

    Args:
        total: ``[S, G, O, K * I]`` (``S`` is 1, or ``N`` per sample), contiguous.
        grads: ``[W, N, G * O, 1...]`` vectors at the layer's output.
        patches: ``[W, 1, K, N, G, I]`` each column's patch (squared in place).
        g: The layer's groups ``G``.
    """
    w, n = grads.shape[:2]
    o = grads.shape[2] // g
    kk, i_g = patches.shape[2], patches.shape[5]
    left = grads.reshape(w, n, g, o).square()
    right = patches.square_().view(w, kk, n, g, i_g)
    if total.shape[0] == 1:  # [G, O, W * N] @ [G, W * N, K * I]
        left = left.permute(2, 3, 0, 1).reshape(g, o, w * n)
        right = right.permute(3, 0, 2, 1, 4).reshape(g, w * n, kk * i_g)
        total[0].baddbmm_(left, right)
    else:  # per sample: [N * G, O, W] @ [N * G, W, K * I]
        left = left.permute(1, 2, 3, 0).reshape(n * g, o, w)
        right = right.permute(2, 3, 0, 1, 4).reshape(n * g, w, kk * i_g)
        total.view(n * g, o, kk * i_g).baddbmm_(left, right)


MATRIX_BACKPROP = True
"""Backprop 1x1 convolutions, and wider kernels between one-position maps, as matrix
products (an internal switch, for side-by-side measurements: ``benchmarks.conv_matrix``)."""


def _native(x: Tensor) -> bool:
    """Whether torch runs this convolution's backprop with its native CPU kernels.

    Without oneDNN (float64, or oneDNN off), ``slow_conv_transpose2d`` and
    ``thnn_conv2d`` unfold every kernel offset of all ``V * N`` maps at once: on
    transformers' GLPN in float64 that was 9x the maps (a 256 MiB budget peaked at
    384 MiB before the bound counted it).
    """
    if x.device.type != "cpu":
        return False
    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    return not (onednn and x.dtype == torch.float32)


def _placed_taps(
    patches: Tensor, shape: torch.Size, kernel: tuple, dilation: tuple, padding: tuple
) -> Tensor:
    """The input gradient of a 2-d convolution with one output position.

    Args:
        patches: ``[B, 1, Cin*KH*KW]``, the patch's gradient.
        shape: The input's shape ``[N, Cin, H, W]`` (only ``Cin, H, W`` are read).
        kernel: ``(KH, KW)``.
        dilation: ``(DH, DW)``.
        padding: ``(PH, PW)``, zeros.

    Returns:
        ``[B, Cin, H, W]``: each kernel tap's value at the input it read (taps that
        read the padding dropped; no two taps read the same input).
    """
    b, c = patches.shape[0], shape[1]
    taps = patches.view(b, c, *kernel)
    result = patches.new_zeros(b, c, *shape[2:])
    inside, within = [], []
    reaching = _reaching_taps(shape[2:], (1,) * len(kernel), kernel, padding, dilation)
    for (first, stop), d, p in zip(reaching, dilation, padding, strict=True):
        if stop <= first:  # every tap reads the padding
            return result
        inside.append(slice(first, stop))
        within.append(slice(first * d - p, (stop - 1) * d - p + 1, d))
    result[:, :, within[0], within[1]] = taps[:, :, inside[0], inside[1]]
    return result


def _flipped(weight: Tensor, groups: int) -> Tensor:
    """The kernel whose convolution is the transposed one of ``weight`` at stride 1.

    ``[O, I/G, *K]`` to ``[I, O/G, *K]``: input and output channels swapped within each
    group, every spatial axis reversed.
    """
    o, i_g, *kernel = weight.shape
    swapped = weight.reshape(groups, o // groups, i_g, *kernel).transpose(1, 2)
    return swapped.reshape(groups * i_g, o // groups, *kernel).flip(
        list(range(2, 2 + len(kernel)))
    )


def _reaching_taps(
    size_in: Any, size_out: Any, kernel: tuple[int, ...], padding: tuple[int, ...],
    dilation: tuple[int, ...],
) -> list[tuple[int, int]]:  # fmt: skip
    """Per axis, the taps ``[first, stop)`` of a stride-1 convolution that read the input.

    Tap ``t`` reads input ``o + t * d - p`` for output ``o``: it reaches an input for some
    output where ``[t * d - p, size_out - 1 + t * d - p]`` meets ``[0, size_in - 1]``.
    """
    taps = []
    for n_in, n_out, k, p, d in zip(size_in, size_out, kernel, padding, dilation,
                                    strict=True):  # fmt: skip
        first = max(0, -((n_out - 1 - p) // d))  # ceil((p - n_out + 1) / d)
        last = min(k - 1, (n_in - 1 + p) // d)
        taps.append((first, last + 1))  # empty where every tap reads padding
    return taps


def _cropped_backprop(
    folded: Tensor, weight: Tensor, groups: int, taps: list[tuple[int, int]],
    padding: tuple[int, ...], dilation: tuple[int, ...], x_shape: torch.Size,
) -> Tensor:  # fmt: skip
    """The input gradient of a stride-1 convolution from the taps that read the input.

    ``dx[i] = sum_t w[t] g[i + p - t d]`` over the taps ``t`` in ``[a, b)`` (the others
    read only padding): the convolution of ``g``, padded by ``(b - 1) d - p`` before and
    whatever makes the input's length after (negative pads crop), with the flipped
    kernel of those taps. A single tap of a depthwise kernel is a scale per channel.

    Args:
        folded: Gradients at the output ``[V*N, C_out, *out]``.
        weight: ``[C_out, C_in/G, *K]``.
        groups: The layer's groups.
        taps: Per axis, ``(first, stop)`` from :func:`_reaching_taps`.
        padding: Per axis, the zeros before the input.
        dilation: Per axis.
        x_shape: The layer's input shape ``[N, C_in, *in]``.

    Returns:
        ``[V*N, C_in, *in]``.
    """
    dims = len(taps)
    if any(b <= a for a, b in taps):  # every tap reads padding: the input is unread
        return folded.new_zeros(folded.shape[0], x_shape[1], *x_shape[2:])
    weight = weight[(slice(None), slice(None), *(slice(a, b) for a, b in taps))]
    sizes_in, sizes_out = x_shape[2:], folded.shape[2:]
    if (
        all(b - a == 1 for a, b in taps)
        and weight.shape[1] == 1
        and groups == weight.shape[0]
    ):
        # depthwise, one tap per axis: a scale per channel, shifted by the tap's offset
        offsets = [a * d - p for (a, _), p, d in zip(taps, padding, dilation, strict=True)]
        pads = []
        for off, n_in, n_out in zip(reversed(offsets), reversed(sizes_in),
                                    reversed(sizes_out), strict=True):  # fmt: skip
            pads += [off, n_in - n_out - off]  # dx[i] = w g[i - off]
        scale = weight.reshape(1, -1, *([1] * dims))
        return (F.pad(folded, pads) if any(pads) else folded) * scale
    if groups == 1 and all(n == 1 for n in (*sizes_in, *sizes_out)):
        # one position in and out (a deep stage on small images: ResNet-18's layer4 at
        # 32x32): the tap that reads it is a matrix, one product (84 ms with the whole
        # 3x3 kernel, 19 ms as a convolution with the tap, 5 ms as this, for 800 vectors
        # of 512 channels)
        rows = folded.reshape(folded.shape[0], -1)
        return torch.mm(rows, weight.reshape(weight.shape[0], -1)).view(
            folded.shape[0], -1, *sizes_in
        )
    # the zeros before and after each axis: the same on both sides goes to the
    # convolution (no copy: padding a 4x4 map to 8x8 copied 4x the columns, and made
    # the LRASPP's pass 2.3x slower than the whole kernel), the rest to ``F.pad``
    pads, common = [], []
    for (a, b), p, d, n_in, n_out in zip(
        reversed(taps), reversed(padding), reversed(dilation), reversed(sizes_in),
        reversed(sizes_out), strict=True,
    ):  # fmt: skip
        before = (b - 1) * d - p
        after = n_in + (b - 1 - a) * d - before - n_out
        both = max(0, min(before, after))
        pads += [before - both, after - both]
        common.insert(0, both)
    conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    if any(pads):
        folded = F.pad(folded, pads)
    return conv(folded, _flipped(weight, groups), None, 1, common, dilation, groups)


def _patches_backprop(
    folded: Tensor,
    weight: Tensor,
    x_shape: torch.Size,
    kernel: tuple[int, ...],
    dilation: tuple[int, ...],
    padding: tuple[int, ...],
    stride: tuple[int, ...],
) -> Tensor:
    """A 2-d convolution's input gradient through its patches' gradients (groups 1).

    One matrix product over every vector's positions: the rows copied once (a few per
    vector), where a batched product with the weight broadcast to every vector ran at a
    third of the speed (ResNet-18's layer3, 56 vectors); then summed back onto the input.

    Args:
        folded: ``[B, Cout, *out]``, the vectors at the output.
        weight: ``[Cout, Cin, KH, KW]``.
        x_shape: The input's shape ``[N, Cin, H, W]`` (only ``Cin, H, W`` are read).
        kernel: ``(KH, KW)``.
        dilation: ``(DH, DW)``.
        padding: ``(PH, PW)``, zeros.
        stride: ``(SH, SW)``.

    Returns:
        ``[B, Cin, H, W]``.
    """
    b, cout = folded.shape[:2]
    positions = math.prod(folded.shape[2:])
    rows = folded.reshape(b, cout, positions).transpose(1, 2)
    patches = torch.mm(rows.reshape(b * positions, cout), weight.reshape(cout, -1)).view(
        b, positions, -1
    )  # [B, P, Cin*K]
    if positions == 1:  # one output position: its taps land on distinct inputs, one
        # strided copy (``F.fold`` took 4x as long: ResNet-18's layer4 on 32x32 images)
        return _placed_taps(patches, x_shape, kernel, dilation, padding)
    return F.fold(patches.transpose(1, 2), x_shape[2:], kernel, dilation, padding, stride)


def _sliced_patches(module: nn.Module, x: Tensor, positions: int) -> bool:
    """Whether a chunk's vectors cross a large 2-d convolution in slices of patches.

    The one test of the route, for :meth:`ConvRule.backprop` and the memory bound alike
    (2-d, groups 1: ``F.fold`` and one product with the whole weight).

    Without oneDNN (float64, or oneDNN off) torch's input-gradient kernel for a large
    weight (``_slow_conv2d_backward``) runs one matrix product per vector, with as many
    columns as output positions: on few positions each product reads the whole weight
    for a few multiply-adds. FCN-ResNet50's head (3x3, 2048 to 512 channels, 2x2 maps,
    float64) took 14.3 s for 192 vectors, 96 columns of a pass: 26x the 0.55 s of the
    patches' form in slices of ``Cout // P`` vectors (each slice's patches no larger
    than the weight, which the memory bound counts per column already); 1.4x at 8x8
    maps, slower from ``Cout < 2 P`` (64 channels on 16x16: 0.60 against 0.42 s).

    Args:
        module: The convolution.
        x: Its input.
        positions: Output positions per map.

    Returns:
        Whether :meth:`ConvRule.backprop` takes the patches' form in slices.
    """
    return (
        x.dim() == 4 and module.groups == 1 and _native(x)
        and module.weight.numel() > SMALL_WEIGHT and not _pointwise(module)
        and module.out_channels >= 2 * positions
    )  # fmt: skip


def _pointwise(module: nn.Module) -> bool:
    """Whether a convolution's backprop is a channel mix (:func:`_pointwise_backprop`)."""
    dims = module.weight.dim() - 2
    return (
        module.groups == 1 and module.padding_mode == "zeros"
        and math.prod(module.kernel_size) == 1
        and not any(p for pair in explicit_padding(module, dims) for p in pair)
    )  # fmt: skip


def _pointwise_backprop(
    folded: Tensor, weight: Tensor, x_shape: torch.Size, stride: tuple[int, ...]
) -> Tensor:
    """The input gradient of a 1x1 convolution without groups or padding: a channel mix.

    ``dx[c, i * s] = sum_o w[o, c] g[o, i]``, zero on the positions the stride skips.
    As matrix products (oneDNN's convolution kernels ran these 2-5x slower on one
    thread): with the channels last below 64 positions (one product over every
    vector's positions), with the weight broadcast over the vectors from 64 positions
    (one ``[C_in, C_out] @ [C_out, P]`` product per vector, no transposed copies).

    Args:
        folded: Gradients at the output ``[V*N, C_out, *out]``.
        weight: ``[C_out, C_in, 1, ...]``.
        x_shape: The layer's input shape ``[N, C_in, *in]``.
        stride: Per axis.

    Returns:
        ``[V*N, C_in, *in]``.
    """
    rows, c_out, *out = folded.shape
    c_in = x_shape[1]
    matrix = weight.reshape(c_out, c_in)
    positions = math.prod(out)
    if positions == 1:
        mixed = torch.mm(folded.reshape(rows, c_out), matrix).view(rows, c_in, *out)
    elif positions < 64:
        last = folded.movedim(1, -1).reshape(rows * positions, c_out)
        mixed = torch.mm(last, matrix).view(rows, *out, c_in).movedim(-1, 1)
    else:
        mixed = torch.matmul(matrix.T, folded.reshape(rows, c_out, positions))
        mixed = mixed.view(rows, c_in, *out)
    if all(s == 1 for s in stride):
        return mixed.contiguous()
    result = folded.new_zeros(rows, c_in, *x_shape[2:])
    result[(slice(None), slice(None), *(slice(None, None, s) for s in stride))] = mixed
    return result


class ConvRule(LayerRule):
    """``nn.Conv1d/2d/3d``: any stride, padding (also ``"same"``, non-zero modes), groups.

    The input's patches are unfolded once per forward pass.
    """

    classes = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    description = "groups, dilation, stride, all padding modes; patches unfolded once"

    def accepts(self, module: nn.Module) -> bool:
        """Padded with values: the pads its ``forward`` applies are its ``padding``.

        ``forward`` pads by ``_reversed_padding_repeated_twice``, made from
        ``padding`` when the layer was built; a ``padding`` changed afterwards is not
        what it computes (zeros are applied from ``padding`` itself).
        """
        if module.padding_mode == "zeros":
            return True
        pads = explicit_padding(module, len(module.kernel_size))  # (a tuple once built)
        flat = [p for pair in reversed(pads) for p in pair]
        return list(getattr(module, "_reversed_padding_repeated_twice", flat)) == flat

    def _patches(self, ctx: RuleContext, sample: int | None = None) -> Tensor:
        """``[N, G, K, P]`` (cached unless lean), or ``[1, G, K, P]`` of one sample."""
        cached = ctx.caches.patches
        if cached is not None:
            return cached if sample is None else cached[sample : sample + 1]
        module, x = ctx.module, ctx.x
        if sample is not None:
            x = x[sample : sample + 1]
        dims = x.dim() - 2
        pads = explicit_padding(module, dims)
        zeros = 0
        if module.padding_mode == "zeros" and all(a == b for a, b in pads):
            # padded by unfold, which gathers the taps where the padded map would be
            # larger than the patches (an ASPP's dilation 36 on a 4x4 map)
            zeros = tuple(a for a, _ in pads)
        else:
            flat = [p for pair in reversed(pads) for p in pair]
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            if any(flat):
                x = F.pad(x, flat, mode=mode)
        patches = unfold(
            x, as_tuple(module.kernel_size, dims), as_tuple(module.stride, dims), zeros,
            as_tuple(module.dilation, dims),
        )  # fmt: skip
        g = module.groups
        patches = patches.reshape(x.shape[0], g, -1, patches.shape[-1])  # [N, G, K, P]
        if sample is None and not ctx.lean:
            ctx.caches.patches = patches
        return patches

    def _a(self, ctx: RuleContext, grads: Tensor) -> Tensor:
        v, n, c = grads.shape[:3]
        g = ctx.module.groups
        return grads.reshape(v, n, g, c // g, -1)

    def diag(self, ctx, grads):
        module, out = ctx.module, {}
        a = self._a(ctx, grads)
        if trainable(module, "weight"):
            _, n, g, o, p = a.shape
            k = module.weight[0].numel()
            if ctx.lean and not self._lean_gram(ctx):  # as the bound chose (_totals)
                # one sample's patches at a time, made again in every chunk; the
                # squares added in place (no weight-sized sum beside the total where
                # the products are contiguous: one group). Not into the accumulator:
                # an out-of-memory error mid-way would leave it partly added to
                total = a.new_zeros(g, o, k)
                for i in range(n):
                    b = self._patches(ctx, i)[0]  # [G, K, P]
                    if g == 1:  # in slabs of columns
                        direct_squares(a[:, i : i + 1, 0], b, True, total[0])
                        continue
                    prods = torch.einsum("vgop,gkp->vgok", a[:, i], b)
                    add_row_sums(total, prods.square_())
                out["weight"] = total.reshape(module.weight.shape)
            else:
                if ctx.lean and ctx.caches.gram is not None:
                    # the Gram matrix is built: only the shape is read, no patches
                    b = a.new_empty(()).expand(n, g, k, p)
                else:
                    b = self._patches(ctx)
                into = ctx.accumulator("weight", a.dtype)
                weight = square_sum(
                    a, b, ctx.caches, ctx.lean, ctx.columns,
                    None if into is None else into.view(g, o, k),
                )  # fmt: skip
                if weight is not None:
                    out["weight"] = weight.reshape(module.weight.shape)
        if trainable(module, "bias"):
            out["bias"] = a.sum(4).square().sum((0, 1)).reshape(-1)
        return out

    def per_sample(self, ctx, grads):
        module, out = ctx.module, {}
        a = self._a(ctx, grads)
        v, n = a.shape[:2]
        if trainable(module, "weight"):
            out["weight"] = products(a, self._patches(ctx)).reshape(
                v, n, *module.weight.shape
            )
        if trainable(module, "bias"):
            out["bias"] = a.sum(4).reshape(v, n, -1)
        return out

    def diag_per_sample(self, ctx, grads):
        # one output position (a squeeze-excitation's or LRASPP's 1x1 convolution of a
        # pooled map): sum_v (g ⊗ patch)² = (sum_v g²) ⊗ patch², no [V, N, *weight]
        # products (LRASPP's 960 -> 128 scale: 6 GB in float64 for 3,072 columns, 35 s)
        if math.prod(ctx.out_shape[2:]) != 1:
            return None
        module, out = ctx.module, {}
        squares = self._a(ctx, grads)[..., 0].square().sum(0)  # [N, G, O]
        n = squares.shape[0]
        if trainable(module, "weight"):
            patches = self._patches(ctx)[..., 0].square()  # [N, G, K]
            out["weight"] = (squares[..., None] * patches[:, :, None]).reshape(
                n, *module.weight.shape
            )
        if trainable(module, "bias"):
            out["bias"] = squares.reshape(n, -1)
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
        return gram_of_sums(grads, 2)

    def input_factor(self, ctx, into=None):
        k = ctx.module.weight[0].numel()
        result = ctx.x.new_zeros(k, k) if into is None else into
        for i in range(ctx.x.shape[0]):  # one sample's patches [K, P] at a time
            patches = self._patches(ctx, i)[0, 0]  # groups == 1
            result.addmm_(patches, patches.T)
        return result

    def backprop(self, ctx, grads):
        module, x = ctx.module, ctx.x
        dims = x.dim() - 2
        pairs = explicit_padding(module, dims)  # "same" and "valid" resolved
        if module.padding_mode != "zeros" or any(a != b for a, b in pairs):
            # padded with values, or "same" with an even kernel (one more on the right)
            return self._backprop_padded(ctx, grads)
        v, n = grads.shape[:2]
        folded = grads.reshape(v * n, *grads.shape[2:])
        kernel, stride, dilation = (
            as_tuple(t, dims) for t in (module.kernel_size, module.stride, module.dilation)
        )
        padding = tuple(a for a, _ in pairs)
        weight = module.weight.detach()
        positions = math.prod(grads.shape[3:])
        if (
            MATRIX_BACKPROP and module.groups == 1 and all(s == 1 for s in stride)
            and math.prod(x.shape[2:]) == 1 and positions == 1
            and math.prod(kernel) > 1  # (1x1 kernels: the channel mix below)
        ):  # fmt: skip
            # one position in and out (a 3x3 kernel on a deep stage's 1x1 maps): the
            # tap that reads it, one matrix product (ResNet-18's layer4 at 32x32
            # images: 5 ms for 800 vectors, 84 ms with the whole kernel; before the few
            # vectors' product below, which makes every tap's patches: 9x the work).
            # At stride 1 at most one tap per axis reads the one input from the one
            # output (``t * d == p``)
            taps = _reaching_taps(x.shape[2:], grads.shape[3:], kernel, padding, dilation)
            return _cropped_backprop(
                folded, weight, 1, taps, padding, dilation, x.shape
            ).reshape(v, n, *x.shape[1:])
        # the vectors whose patches' gradients are no larger than the weight
        step = weight.shape[0] // positions
        if (dims == 2 and module.groups == 1 and v * n <= step) or _sliced_patches(
            module, x, positions
        ):
            # few vectors on few positions (a deep stage, a small chunk): the patches'
            # gradients as one product and summed back onto the input. oneDNN's kernels
            # reorder the whole weight first (9 MiB for ResNet-18's last stage, as much
            # as 60 columns' patches there), which set the floor of a tight budget.
            # More vectors than that, without oneDNN: the same, ``step`` vectors at a
            # time (:func:`_sliced_patches`)
            geometry = (weight, x.shape, kernel, dilation, padding, stride)
            if v * n <= step:
                result = _patches_backprop(folded, *geometry)
            else:
                result = folded.new_empty(v * n, *x.shape[1:])
                for a in range(0, v * n, step):  # step >= 2 (Cout >= 2 P)
                    b = min(v * n, a + step)
                    result[a:b] = _patches_backprop(folded[a:b], *geometry)
            return result.reshape(v, n, *x.shape[1:])
        if MATRIX_BACKPROP and _pointwise(module):
            # a 1x1 convolution (pointwise layers, ResNets' downsampling shortcuts)
            return _pointwise_backprop(folded, weight, x.shape, stride).reshape(
                v, n, *x.shape[1:]
            )
        if weight.numel() > SMALL_WEIGHT:  # oneDNN's transposed convolution reorders
            # the weight (+9 MiB on ResNet-18's last stage): the input gradient kernel
            result = torch.ops.aten.convolution_backward(
                folded, folded.new_empty(1).expand(v * n, *x.shape[1:]), weight, None,
                stride, padding, dilation, False, [0] * dims, module.groups,
                [True, False, False],
            )[0]  # fmt: skip
            return result.reshape(v, n, *x.shape[1:])
        if (
            module.groups > 1
            and all(s == 1 for s in stride)
            and all(
                p <= d * (k - 1) for p, d, k in zip(padding, dilation, kernel, strict=True)
            )
        ):  # grouped, stride 1: a convolution with the flipped kernel, oneDNN's forward
            # kernel (10x faster than its transposed convolution for MobileNetV3's
            # dilated 5x5 depthwise layers, never slower for grouped ones, 1 thread)
            conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
            taps = _reaching_taps(x.shape[2:], grads.shape[3:], kernel, padding, dilation)
            if any(b - a < k for (a, b), k in zip(taps, kernel, strict=True)):
                # taps that read padding only at every position are left out (a dilated
                # 5x5 depthwise layer on MobileNetV3's 1x1 maps: its centre tap alone,
                # where the whole kernel took 65% of the LRASPP's pass)
                return _cropped_backprop(
                    folded, weight, module.groups, taps, padding, dilation, x.shape
                ).reshape(v, n, *x.shape[1:])
            reach = [d * (k - 1) - p for p, d, k in zip(padding, dilation, kernel,
                                                       strict=True)]  # fmt: skip
            flipped = _flipped(weight, module.groups)
            result = conv(folded, flipped, None, 1, reach, dilation, module.groups)
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
    def _backprop_padded(ctx: RuleContext, grads: Tensor) -> Tensor:
        """Padded with values, or with zeros unevenly: all columns at once.

        Values: ``reflect``, ``replicate``, ``circular``; zeros unevenly:
        ``padding="same"`` with a kernel of even length. The convolution's input
        gradient on the padded map, then the pad's backward, each once on ``V * N``
        samples; autograd's own backward of the layer ran per column (torch's batching
        has no rule for either kernel).
        """
        module, x = ctx.module, ctx.x
        dims = x.dim() - 2
        v, n = grads.shape[:2]
        pairs = explicit_padding(module, dims)
        padded = [
            s + left + right for s, (left, right) in zip(x.shape[2:], pairs, strict=True)
        ]
        folded = grads.reshape(v * n, *grads.shape[2:])
        result = torch.ops.aten.convolution_backward(
            folded, folded.new_empty(1).expand(v * n, x.shape[1], *padded),
            module.weight.detach(), None, as_tuple(module.stride, dims), [0] * dims,
            as_tuple(module.dilation, dims), False, [0] * dims, module.groups,
            [True, False, False],
        )[0]  # fmt: skip
        pad = [p for pair in reversed(pairs) for p in pair]  # F.pad's order
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        back = pad_transposed(result, (v * n, *x.shape[1:]), pad, mode)
        return back.reshape(v, n, *x.shape[1:])

    windowed = True

    windowed_squares = True

    def diag_windowed(self, ctx, block, per_sample=False, weights=None):
        module, out = ctx.module, {}
        weights = weights or {}
        fields = self._field_products(ctx, block)
        how = {"per_sample": per_sample, "weights": weights.get("weight")}
        if trainable(module, "weight") and module.padding_mode == "zeros":
            out["weight"] = self._weight_windowed(ctx, block, fields, **how)
        elif trainable(module, "weight"):  # padded with values: patches of the padded map
            dims = ctx.x.dim() - 2
            pads = [p for pair in reversed(explicit_padding(module, dims)) for p in pair]
            padded = F.pad(ctx.x.detach(), pads, mode=module.padding_mode)
            out["weight"] = _patch_squares(
                ctx, block, fields, False, (0,) * dims, padded, **how
            )
        if trainable(module, "bias"):
            out["bias"] = _bias_squares(block, fields, per_sample, weights.get("bias"))
        return out

    @staticmethod
    def _weight_windowed(
        ctx: RuleContext, block: Windowed, fields: Any, per_sample: bool,
        weights: Tensor | None,
    ) -> Tensor:  # fmt: skip
        """``sum_{v,n}`` of squared weight products, each column on its box.

        One column's products are the weight gradient of a convolution of the input
        region under its box with its vectors: all columns and samples at once as a
        grouped convolution's weight gradient (one group per column and sample), no
        unfolded patches.
        """
        module, x = ctx.module, ctx.x
        dims = x.dim() - 2
        kernel, stride, dilation = (
            as_tuple(t, dims) for t in (module.kernel_size, module.stride, module.dilation)
        )
        left = [p[0] for p in explicit_padding(module, dims)]
        region = tuple(
            (b - 1) * s + (k - 1) * d + 1
            for b, s, k, d in zip(block.box, stride, kernel, dilation, strict=True)
        )
        how = {"per_sample": per_sample, "weights": weights}
        if _use_patches(ctx, block, x.shape[1] * math.prod(region)):
            return _patch_squares(ctx, block, fields, False, tuple(left), **how)
        start = block.start * _on(block, stride) - _on(block, left)
        return _weight_squares(ctx, block, start, region, fields, False, **how)

    def backprop_windowed(self, ctx, block):
        module, x = ctx.module, ctx.x
        if module.padding_mode != "zeros":
            return None
        dims = x.dim() - 2
        kernel, stride, dilation = (
            as_tuple(t, dims) for t in (module.kernel_size, module.stride, module.dilation)
        )
        left = [p[0] for p in explicit_padding(module, dims)]
        # output u reads inputs u*s - p + k*d: the box's inputs from its start on
        box = tuple(
            (b - 1) * s + (k - 1) * d + 1
            for b, s, k, d in zip(block.box, stride, kernel, dilation, strict=True)
        )
        start = block.start * _on(block, stride) - _on(block, left)
        return end_of(_transposed_box(block, module, box, start, stride, dilation, x))

    @staticmethod
    def _sizes(ctx: RuleContext) -> tuple[int, int, int]:
        module = ctx.module
        n, g = ctx.out_shape[0], module.groups
        positions = math.prod(ctx.out_shape[2:])
        k = module.weight.numel() // module.out_channels
        o = module.out_channels // g
        patches = 2 * n * g * k * positions  # padded input and unfolded patches
        # a small weight is reordered by the transposed convolution of the backprop (or
        # flipped, then reordered, by the convolution of a grouped one)
        reorder = 2 * module.weight.numel() if module.weight.numel() <= SMALL_WEIGHT else 0
        # the windowed products' steps take BLOCK (the direct form's slabs as much, or
        # one column's product where more), and the input as rows of positions
        # (padded with values first where the padding is not zeros)
        rows = ctx.x.numel() * (1 if module.padding_mode == "zeros" else 2)
        # beside them, the products' squares' totals (:meth:`_totals`)
        step = direct_bytes(k, positions) + reorder + rows + ConvRule._totals(ctx)
        if not ctx.lean:
            fixed, per_column = square_sum_bytes(n, g, o, k, positions, ctx.columns)
            return fixed + patches, per_column, step
        # lean: nothing kept but Gram matrices; all patches at once only to build those
        # (and for per-sample products), one sample's otherwise; the input's squares for
        # the output layer's one-hot form
        fixed, per_column = square_sum_bytes(n, g, o, k, positions, lean=True)
        whole = fixed > 0 or ctx.shared
        transient = (patches if whole else 2 * g * k * positions) + reorder
        if ctx.output:
            transient += ctx.x.numel()
        return fixed, per_column, max(transient, step)

    @staticmethod
    def _totals(ctx: RuleContext) -> int:
        """Elements of the weight's squares summed over a chunk, held during its step.

        A weight-sized total (or the Gram form's value; 18 MiB in float64 for
        ResNet-style 512-channel layers, which a video network's budget went above
        before it was counted). Each step's squares are added in place
        (:func:`add_row_sums`), but a grouped layer's lean loop sums its non-contiguous
        products first: a second weight. One position (a ResNet's last maps on small
        images): the squares are summed first and added to the diagonal's accumulator
        by one product where it is handed in, no total; so is a lean pass's Gram form
        (chosen by sizes alone, whatever the chunk).
        """
        module = ctx.module
        positions = math.prod(ctx.out_shape[2:])
        if ctx.in_place and (positions == 1 or (ctx.lean and ConvRule._lean_gram(ctx))):
            return 0
        return (2 if ctx.lean and module.groups > 1 else 1) * module.weight.numel()

    @staticmethod
    def _lean_gram(ctx: RuleContext) -> bool:
        """Whether a lean pass takes the Gram form (:func:`use_gram`, by sizes alone)."""
        module = ctx.module
        g = module.groups
        k = module.weight[0].numel()
        positions = math.prod(ctx.out_shape[2:])
        n, o = ctx.out_shape[0], module.out_channels // g
        return use_gram(1, n, g, o, k, positions, lean=True)

    def totals_bytes(self, ctx, element):
        return min(self._totals(ctx) * element, self.transient_bytes(ctx, element))

    @staticmethod
    def _backprop_columns(ctx: RuleContext) -> int:
        """Elements per column of the backprop's workspace beyond its vectors."""
        module = ctx.module
        # 1x1 convolutions' matrix products (:func:`_pointwise_backprop`), and no less
        # than the transposed convolution's workspace below, which these layers took
        # before (the margin a fragmented heap's budgets were measured with)
        extra = 0
        if MATRIX_BACKPROP and _pointwise(module):
            positions = math.prod(ctx.out_shape[2:])
            strided = any(s != 1 for s in as_tuple(module.stride, ctx.x.dim() - 2))
            if 1 < positions < 64:  # the vectors with their channels last, and the
                # product before its copy to channels first (or onto the strided map)
                extra = math.prod(ctx.out_shape) + ctx.x.numel()
            elif strided:  # the product before it is placed on the strided map
                extra = ctx.x.numel()
        positions = math.prod(ctx.out_shape[2:])
        if _sliced_patches(module, ctx.x, positions):
            # the patches' gradients of a slice of vectors and fold's copy of them, per
            # column (a slice holds at most a chunk's vectors)
            kernel = module.weight.numel() // module.out_channels
            extra = max(extra, 2 * ctx.out_shape[0] * positions * kernel)
        if _native(ctx.x) and ctx.x.dim() == 5:
            # ``slow_conv3d``'s input gradient: the columns of every kernel offset for
            # all ``V * N`` maps at once, twice (measured: 2 x 13.5 MiB per sample for
            # 64 -> 64 channels on 4x16x16 in float64; a one-column pass of a Conv3d
            # stack peaked at 53 MiB against a 44.7 MiB budget before this was counted)
            kernel = module.weight.numel() // module.out_channels  # (Cin / G) K
            columns = math.prod(ctx.out_shape[:1] + ctx.out_shape[2:]) * module.groups
            return max(extra, 2 * columns * kernel)
        if not (_native(ctx.x) and module.weight.numel() <= SMALL_WEIGHT):
            return extra
        # the native transposed convolution's columns: every kernel offset's map (a
        # large weight's input-gradient kernel takes twice the maps, counted already).
        # They are the workspace the bound's margin on maps stands for: counted once,
        # at their size
        kernel = module.weight.numel() // module.out_channels  # (Cin / G) K
        columns = math.prod(ctx.out_shape[:1] + ctx.out_shape[2:]) * module.groups
        return max(extra, math.ceil(columns * kernel / MAPS_MARGIN))

    def column_bytes(self, ctx, element):
        # the products, then the backprop (its vectors counted by the sweep's bound at
        # the layer): one after the other
        products = 2 * math.prod(ctx.out_shape) + self._sizes(ctx)[1]
        return max(products, self._backprop_columns(ctx)) * element

    def fixed_bytes(self, ctx, element):
        return self._sizes(ctx)[0] * element

    def transient_bytes(self, ctx, element):
        return self._sizes(ctx)[2] * element

    def backprop_bytes(self, ctx, element):
        # no products (a weight's worth per column where the direct form runs): the
        # backprop's copies of the vectors, the patches' gradients of few vectors (and
        # their copy for ``F.fold``), or the native kernel's columns; padded with
        # values, the input gradient on the padded map before the pad's backward
        module, x = ctx.module, ctx.x
        weight = module.weight.numel()
        reorder = 2 * weight if weight <= SMALL_WEIGHT else 0
        n, positions = ctx.out_shape[0], math.prod(ctx.out_shape[2:])
        patches = 2 * n * positions * (weight // module.out_channels) * module.groups
        # the patches' form runs for chunks of at most ``out_channels // (N P)`` columns
        # (their patches no larger than the weight): never where that is 0, for one
        # column only where it is 1 (its two copies then cost once what they would
        # cost every column: ResNet-18's layer2 at 8 samples planned half the columns)
        most = module.out_channels // max(n * positions, 1)
        transient = reorder
        if most <= 1:
            transient = max(reorder, patches * most)
            patches = 0
        column = max(2 * math.prod(ctx.out_shape), patches, self._backprop_columns(ctx))
        if module.padding_mode != "zeros" or module.padding == "same":
            column += 2 * x.numel()
        return column * element, 0, transient * element


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
            as_tuple(module.kernel_size, dims), as_tuple(module.stride, dims),
            as_tuple(module.padding, dims), as_tuple(module.dilation, dims),
        )  # fmt: skip

    def _sides(self, ctx: RuleContext, grads: Tensor) -> tuple[Tensor, Tensor]:
        module, x = ctx.module, ctx.x
        v, n, c = grads.shape[:3]
        g = module.groups
        patches = unfold(
            grads.reshape(v * n, c, *grads.shape[3:]), *self._geometry(module, x.dim() - 2),
            positions=tuple(x.shape[2:]),
        )  # fmt: skip
        a = patches.reshape(v, n, g, -1, patches.shape[-1])  # [V, N, G, Cout/G*K, P]
        return a, self._b(ctx)

    @staticmethod
    def _b(ctx: RuleContext) -> Tensor:
        b = ctx.caches.grouped
        if b is None:
            x, g = ctx.x, ctx.module.groups
            b = ctx.caches.grouped = x.reshape(x.shape[0], g, x.shape[1] // g, -1)
        return b  # [N, G, Cin/G, P]

    def diag(self, ctx, grads):
        module, out = ctx.module, {}
        v, n, c = grads.shape[:3]
        if trainable(module, "weight"):
            dims = ctx.x.dim() - 2
            kernel = as_tuple(module.kernel_size, dims)
            g = module.groups
            view = window_view(
                grads.reshape(v * n, c, *grads.shape[3:]),
                *self._geometry(module, dims),
                positions=tuple(ctx.x.shape[2:]),
            )  # [V*N, Cout, *kernel, *positions], no copy
            b = self._b(ctx)
            offsets = [()]
            for k in kernel:
                offsets = [(*o, i) for o in offsets for i in range(k)]
            # in the weight's layout [G, Cin/G, Cout/G, K], written as [G, O, K, I]:
            # no weight-sized copy at the end
            result = grads.new_zeros(g, b.shape[2], c // g, len(offsets))
            written = result.permute(0, 2, 3, 1)
            for j, offset in enumerate(offsets):
                a = view[(slice(None), slice(None), *offset)].reshape(v, n, g, c // g, -1)
                written[:, :, j] = square_sum(  # one Gram matrix of b
                    a, b, ctx.caches, columns=ctx.columns
                )
            out["weight"] = result.view(module.weight.shape)
        if trainable(module, "bias"):
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
        if tuple(result.shape[2:]) != tuple(x.shape[2:]):
            # ``output_padding`` at or past the stride: the grid's last patches are no
            # input's (window_view)
            result = result[(..., *(slice(0, size) for size in x.shape[2:]))]
        return result.reshape(v, n, *x.shape[1:])

    windowed = True

    def _region(self, ctx: RuleContext, block: Windowed) -> tuple[Tensor, tuple, Windowed]:
        """The input box of each column and the output region that reaches it.

        Input ``i`` reaches outputs ``i*s - p + k*d``: the inputs reaching a box
        ``[o, o + B)`` start at ``ceil((o + p - (K-1)d) / s)``, at most
        ``(B - 1 + (K-1)d) // s + 1`` of them; the region of outputs they read starts at
        ``i*s - p``. Returns ``(input start [V, d], input box, block on the region)``.
        """
        module, x = ctx.module, ctx.x
        kernel, stride, padding, dilation = self._geometry(module, x.dim() - 2)
        reach = _on(block, [(k - 1) * d for k, d in zip(kernel, dilation, strict=True)])
        s, p = _on(block, stride), _on(block, padding)
        start = -torch.div(-(block.start + p - reach), s, rounding_mode="floor")
        box, region = self._boxes(module, block.box, x.dim() - 2)
        return start, box, block.rebox(start * s - p, region)

    def _boxes(
        self, module: nn.Module, out_box: tuple[int, ...], dims: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The input box reaching an output box, and the output region it writes."""
        kernel, stride, _, dilation = self._geometry(module, dims)
        reach = [(k - 1) * d for k, d in zip(kernel, dilation, strict=True)]
        box = tuple(
            (b - 1 + r) // st + 1 for b, r, st in zip(out_box, reach, stride, strict=True)
        )
        region = tuple(
            (b - 1) * st + r + 1 for b, r, st in zip(box, reach, stride, strict=True)
        )
        return box, region

    windowed_squares = True

    def diag_windowed(self, ctx, block, per_sample=False, weights=None):
        module, out = ctx.module, {}
        weights = weights or {}
        fields = self._field_products(ctx, block)
        if trainable(module, "weight"):
            out["weight"] = self._weight_windowed(
                ctx, block, fields, per_sample, weights.get("weight")
            )
        if trainable(module, "bias"):
            out["bias"] = _bias_squares(block, fields, per_sample, weights.get("bias"))
        return out

    def _weight_windowed(
        self, ctx: RuleContext, block: Windowed, fields: Any, per_sample: bool,
        weights: Tensor | None,
    ) -> Tensor:  # fmt: skip
        """``sum_{v,n}`` of squared weight products, each column on its box.

        One column's products are the weight gradient of a transposed convolution of
        the inputs under its box that wrote the output region its vectors lie in: all
        columns and samples at once as a grouped transposed convolution's weight
        gradient (one group per column, sample and group of the layer). One kernel call
        per block of columns, where a loop over the kernel's offsets ran one small
        batched product each (1.6x slower on the 28x28 decoder's 16->8 layer).
        """
        module, dims = ctx.module, ctx.x.dim() - 2
        box, region = self._boxes(module, block.box, dims)
        grouped = ctx.x.shape[1] * math.prod(box) + module.out_channels * math.prod(region)
        how = {"per_sample": per_sample, "weights": weights}
        if _use_patches(ctx, block, grouped):
            padding = as_tuple(module.padding, dims)
            return _patch_squares(ctx, block, fields, True, padding, **how)
        start, box, region = self._region(ctx, block)
        return _weight_squares(ctx, region, start, box, fields, True, **how)

    def backprop_windowed(self, ctx, block):
        module, x = ctx.module, ctx.x
        dims = x.dim() - 2
        _, stride, _, dilation = self._geometry(module, dims)
        start, box, region = self._region(ctx, block)
        data = region.data[:, :1] if region.sample_free else region.data
        v, n, c = data.shape[:3]
        conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
        result = conv(
            data.reshape(v * n, c, *region.box), module.weight.detach(), None, stride, 0,
            dilation, module.groups,
        )  # fmt: skip
        size = tuple(x.shape[2:])
        mask = valid(start, box, size).to(result.dtype)
        result = result.view(v, n, x.shape[1], *box).mul_(mask)  # a new tensor
        if region.sample_free:
            result = result.expand(v, region.data.shape[1], *result.shape[2:])
        return end_of(Windowed(result, start, size))

    def per_sample(self, ctx, grads):
        module, out = ctx.module, {}
        v, n, c = grads.shape[:3]
        if trainable(module, "weight"):
            a, b = self._sides(ctx, grads)
            prods = products(a, b)  # [V, N, G, Cout/G*K, Cin/G]
            out["weight"] = prods.transpose(3, 4).reshape(v, n, *module.weight.shape)
        if trainable(module, "bias"):
            out["bias"] = grads.reshape(v, n, c, -1).sum(3)
        return out

    def column_bytes(self, ctx, element):
        module, x = ctx.module, ctx.x
        n, out = ctx.out_shape[0], math.prod(ctx.out_shape)
        per_offset = n * module.out_channels * math.prod(x.shape[2:])
        kernel = math.prod(as_tuple(module.kernel_size, x.dim() - 2))
        products = module.weight.numel() // kernel
        # the native kernels' columns for the input gradient: every kernel offset's map
        # (the workspace the bound's margin on maps stands for: counted once)
        columns = math.ceil(kernel * per_offset / MAPS_MARGIN) if _native(x) else 0
        work = 2 * out + per_offset + products + math.prod(x.shape)
        return max(work, columns) * element  # the products, then the backprop

    def fixed_bytes(self, ctx, element):
        module, x = ctx.module, ctx.x
        n, g, p = x.shape[0], module.groups, math.prod(x.shape[2:])
        o, k = module.out_channels // g, module.in_channels // g
        return square_sum_bytes(n, g, o, k, p, ctx.columns)[0] * element  # Gram matrix

    def transient_bytes(self, ctx, element):
        # samples batched in the direct form; the windowed products' steps, and the
        # input as rows of positions; beside them the squares' weight-sized total, and
        # one kernel offset's sums (a grouped layer's windowed total is copied to the
        # weight's layout at the end: two weights)
        module, x = ctx.module, ctx.x
        g, p = module.groups, math.prod(x.shape[2:])
        direct = direct_bytes(module.in_channels // g, p)
        return (direct + x.numel() + self._totals(ctx)) * element

    @staticmethod
    def _totals(ctx: RuleContext) -> int:
        weight = ctx.module.weight.numel()
        kernel = math.prod(as_tuple(ctx.module.kernel_size, ctx.x.dim() - 2))
        return 2 * weight if ctx.module.groups > 1 else weight + weight // kernel

    def totals_bytes(self, ctx, element):
        return self._totals(ctx) * element
