r"""Resampling in the glue (``F.interpolate``) that all columns of a chunk cross at once.

torch's batching has no rule for any of ``F.interpolate``'s backward kernels (nearest,
nearest-exact, linear, bilinear, bicubic, trilinear, area, antialiased), so a
functional resize between layers (torchvision's segmentation heads upsample their logits
to the input size this way) ran once per column: minutes for a per-pixel loss.

Every mode of ``F.interpolate`` is separable: the output is the input with one matrix
``A_k`` (``[out_k, in_k]``) applied along each spatial axis,
:math:`y = x \times_1 A_1 \times_2 A_2 \cdots`, so the transposed Jacobian is
:math:`g \times_1 A_1^\top \times_2 A_2^\top \cdots`, a few matrix products torch does
batch. Each ``A_k`` is read off the user's own call: the same function, mode and
options applied to the identity along axis ``k`` (the other axes of size one, resampled
to size one, which every mode leaves unchanged). The forward pass is the user's call
itself; nothing of the user's code runs again.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["fold_interpolate", "resample_workspace"]

INTERPOLATE = F.interpolate
_ARGS = ("input", "size", "scale_factor", "mode", "align_corners",
         "recompute_scale_factor", "antialias")  # fmt: skip


class _FoldedResample(torch.autograd.Function):
    """``F.interpolate`` with a backward of matrix products along each spatial axis."""

    @staticmethod
    def forward(ctx, x, options, matrices):
        out = INTERPOLATE(x, **options)
        ctx.matrices = matrices
        ctx.workspace = _workspace(x.shape, out.shape)
        return out

    @staticmethod
    def backward(ctx, grad):
        # per column (batched by autograd): matrix products only, the axis that
        # shrinks the vectors most first
        for axis in _order(ctx.matrices):
            a = ctx.matrices[axis]  # [out, in]
            shape = grad.shape
            before, after = math.prod(shape[: 2 + axis]), math.prod(shape[3 + axis :])
            if after == 1:  # the last axis: one product of all rows
                rows = torch.mm(grad.reshape(-1, a.shape[0]), a)
            else:  # [P, out, F] -> [P, in, F], the matrix shared by the P slices
                rows = torch.bmm(a.t().expand(before, *a.t().shape),
                                 grad.reshape(before, a.shape[0], after))  # fmt: skip
            grad = rows.reshape(*shape[: 2 + axis], a.shape[1], *shape[3 + axis :])
        return grad, None, None


def _order(matrices: tuple[Tensor, ...]) -> list[int]:
    """Axes by how much their product shrinks the vectors (most first)."""
    return sorted(
        range(len(matrices)), key=lambda k: matrices[k].shape[1] / matrices[k].shape[0]
    )


def _workspace(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> int:
    """Elements per column the backward's steps take beyond its vectors, at most.

    Each step's result, and (but for the last axis) the matrix expanded over the
    leading slices, which torch's batched product may copy per column.
    """
    shape = list(out_shape)
    dims = len(shape) - 2
    total = 0
    for axis in sorted(range(dims), key=lambda k: in_shape[2 + k] / out_shape[2 + k]):
        before = math.prod(shape[: 2 + axis])
        if axis < dims - 1:
            total += before * in_shape[2 + axis] * out_shape[2 + axis]
        shape[2 + axis] = in_shape[2 + axis]
        total += math.prod(shape)
    return total


def resample_workspace(node: Any) -> int:
    """Elements per column a node of the recorded graph allocates beyond its vectors.

    Args:
        node: An autograd node of the glue.

    Returns:
        The folded resampling's intermediate products (all samples together), else 0.
    """
    if isinstance(node, _FoldedResample._backward_cls):
        return int(getattr(node, "workspace", 0))
    return 0


def _options(args: tuple, kwargs: dict) -> dict[str, Any] | None:
    bound = dict(zip(_ARGS, args, strict=False))
    for key, value in kwargs.items():
        if key not in _ARGS or key in bound:
            return None
        bound[key] = value
    return bound


def _axis_matrix(
    x: Tensor, options: dict[str, Any], axis: int, out_size: int
) -> Tensor | None:
    """``A_axis`` (``[out, in]``) of the call: the identity along ``axis`` resampled.

    Every axis is resampled as the last one (the others of size one, kept so: every
    mode maps one entry to itself); a size-one last axis is where torch's antialiased
    kernels go wrong (each output of ``[n, 1, n, 1]`` then repeats the first one).
    """
    dims = x.dim() - 2
    n = x.shape[2 + axis]
    basis = torch.eye(n, dtype=x.dtype, device=x.device).reshape(n, 1, *[1] * (dims - 1), n)
    call = dict(options)
    if call.get("size") is not None:
        call["size"] = [1] * (dims - 1) + [out_size]
    else:
        scale = call.get("scale_factor")
        scales = list(scale) if isinstance(scale, (tuple, list)) else [scale] * dims
        call["scale_factor"] = [1.0] * (dims - 1) + [float(scales[axis])]
    rows = INTERPOLATE(basis, **call)  # [in, 1, 1, ..., out]
    if rows.shape[-1] != out_size or rows.numel() != n * out_size:
        return None
    return rows.reshape(n, out_size).t().contiguous()


def _reproduces(x: Tensor, options: dict[str, Any], matrices: list[Tensor]) -> bool:
    """Whether the axis matrices map a random input as the call itself does."""
    generator = torch.Generator(device=x.device).manual_seed(0)  # the user's RNG untouched
    probe = torch.rand((1, 1, *x.shape[2:]), generator=generator, dtype=x.dtype,
                       device=x.device)  # fmt: skip
    expected = INTERPOLATE(probe, **options)
    mapped = probe
    for axis, a in enumerate(matrices):
        mapped = torch.matmul(a, mapped.movedim(2 + axis, -2)).movedim(-2, 2 + axis)
    tolerance = 100 * torch.finfo(x.dtype).eps * max(1.0, float(expected.abs().max()))
    return mapped.shape == expected.shape and bool(
        (mapped - expected).abs().max() <= tolerance
    )


def fold_interpolate(args: tuple, kwargs: dict) -> Tensor | None:
    """The folded call, or ``None`` where it would not be the same computation.

    Args:
        args: ``F.interpolate``'s positional arguments.
        kwargs: Its keyword arguments.

    Returns:
        The call's output, with the folded backward, or ``None``.
    """
    options = _options(args, kwargs)
    if options is None or not torch.is_grad_enabled():
        return None
    x = options.get("input")
    if type(x) is not Tensor and not isinstance(x, torch.nn.Parameter):
        return None  # subclasses keep their own dispatch
    if not x.requires_grad or not x.dtype.is_floating_point or x.is_nested:
        return None
    if x.dim() not in (3, 4, 5) or x.layout is not torch.strided:
        return None
    options = {k: v for k, v in options.items() if k != "input"}
    matrices = axis_matrices(x, options)
    if matrices is None:
        return None
    return _FoldedResample.apply(x, options, matrices)


def axis_matrices(x: Tensor, options: dict[str, Any]) -> tuple[Tensor, ...] | None:
    """The ``[out, in]`` matrix of each spatial axis of ``F.interpolate(x, **options)``.

    Each is the identity along its axis resampled; together they must map a random
    probe as the call does (a safety net: kernels not separable as assumed).

    Args:
        x: The call's input ``[N, C, *S]`` (only its shape, dtype and device are read).
        options: The call's other arguments.

    Returns:
        The matrices, or ``None`` where they do not reproduce the call (or it raises).
    """
    try:
        sizes = _out_sizes(x, options)
        with torch.no_grad():
            matrices = [_axis_matrix(x, options, axis, sizes[axis])
                        for axis in range(x.dim() - 2)]  # fmt: skip
            if any(a is None for a in matrices) or not _reproduces(x, options, matrices):
                return None
    except Exception:  # the user's own call runs (and raises) as it is
        return None
    return tuple(matrices)


def _out_sizes(x: Tensor, options: dict[str, Any]) -> tuple[int, ...]:
    """The call's output sizes along the spatial axes: the call on one map of zeros.

    Not on the ``meta`` device: its kernels for the linear modes are Python
    decompositions whose first use imports ``torch._dynamo`` (44 MiB of modules, counted
    as in use after a first budgeted call's forward pass: 4,096 one-column passes where
    a second call planned 29).
    """
    with torch.no_grad():
        out = INTERPOLATE(x.new_zeros((1, 1, *x.shape[2:])), **options)
    return tuple(out.shape[2:])
