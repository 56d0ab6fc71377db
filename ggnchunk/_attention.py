r"""Attention that all columns of a chunk cross at once.

The glue between layers is backpropagated by autograd, batched over the chunk's columns
(``torch.autograd.grad(..., is_grads_batched=True)``). torch's batching has no rule for
the backward kernels of ``F.scaled_dot_product_attention`` (flash, efficient or the CPU
flash kernel), so it would run them once per column. While the engine's forward pass
runs, :func:`ggnchunk._folding.folded_glue` routes every call of
``F.scaled_dot_product_attention`` (also the one inside ``nn.MultiheadAttention``)
through :class:`_FoldedAttention`: its
forward is the user's call itself (same kernel, same arguments), its backward the exact
math form of the attention's transposed Jacobian,

.. math::

    P = \operatorname{softmax}(s\,Q K^\top + M),\quad dV = P^\top dO,\quad
    dS = P \odot (dO\,V^\top - \operatorname{rowsum}(dO \odot P V)),\quad
    dQ = s\,dS\,K,\quad dK = s\,dS^\top Q,

written with the operations torch's batching does have rules for (3-d ``bmm``,
elementwise maths), so that the columns are one batched computation. ``P`` is recomputed
from the recorded ``Q``, ``K`` (no user code runs again). Calls it cannot reproduce
exactly are left as they are: dropout inside attention (``dropout_p > 0``: its draws),
grouped-query attention with fewer key heads, nested tensors, inputs whose leading axes
differ. A float mask that requires grad (a learned relative-position bias: BEiT, Swin)
gets :math:`dS`, summed over the axes it was broadcast along.

Only the thread that runs the engine's forward pass is affected (torch function modes
are thread-local), and only while that forward runs.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
from torch import Tensor

__all__ = ["SDPA", "attention_workspace", "fold_attention", "unchecked"]

SDPA = torch._C._nn.scaled_dot_product_attention
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")  # fmt: skip


class _FoldedAttention(torch.autograd.Function):
    """``scaled_dot_product_attention`` with a backward that batches over columns."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale):
        out = SDPA(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
        ctx.save_for_backward(q, k, v, mask)
        ctx.is_causal = is_causal
        ctx.scale = q.shape[-1] ** -0.5 if scale is None else scale
        ctx.workspace = _workspace(q, k, v) + (
            math.prod(q.shape[:-1]) * k.shape[-2] if mask is not None and mask.requires_grad
            else 0
        )  # the learned bias's gradient, before its sums  # fmt: skip
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask = ctx.saved_tensors
        lead, (length, dim), (keys, dim_v) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
        b = math.prod(lead)
        q3, k3, v3 = (
            q.reshape(b, length, dim),
            k.reshape(b, keys, dim),
            v.reshape(b, keys, dim_v),
        )
        # not per column: the probabilities of the recorded forward pass
        scores = torch.bmm(q3, k3.transpose(1, 2)) * ctx.scale
        bias = _bias(mask, ctx.is_causal, lead, length, keys, scores)
        if bias is not None:
            scores = scores + bias
        p = torch.softmax(scores, -1)
        if bias is not None:  # rows without any key attended to: zero output
            p = p.nan_to_num(0.0)
        del scores, bias
        # per column (batched by autograd): only products and elementwise maths. The
        # rows' sums of P * dP are dO . O (O = P V, not per column), so no second
        # [L, S] map per column is made for them
        g = grad.reshape(b, length, dim_v)
        rows = (g * torch.bmm(p, v3)).sum(-1, keepdim=True)
        ds = (torch.bmm(g, v3.transpose(1, 2)) - rows) * p
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        dq = torch.bmm(ds, k3 * ctx.scale).reshape(q.shape) if need_q else None
        dk = (
            torch.bmm(ds.transpose(1, 2), q3 * ctx.scale).reshape(k.shape)
            if need_k
            else None
        )
        dv = None
        if need_v:  # one product per slice with P (not per column) on the left: the
            # columns fold into its rows, where a batched product with P copied P
            # once per column (as large as dP)
            dv = torch.stack([torch.mm(p[i].t(), g[i]) for i in range(b)])
            dv = dv.reshape(v.shape)
        dmask = None
        if ctx.needs_input_grad[3]:  # a learned bias (relative positions): dS, summed
            # over the axes the mask was broadcast along
            dmask = _summed_to(ds.reshape(*lead, length, keys), mask.shape)
        return dq, dk, dv, dmask, None, None


def _summed_to(values: Tensor, shape: torch.Size) -> Tensor:
    """``values`` summed over the axes a tensor of ``shape`` was broadcast along.

    ``Tensor.sum_to_size`` does this, but torch's batching has no rule for it (it would
    run once per column); plain sums it does batch.
    """
    extra = values.dim() - len(shape)
    if extra:
        values = values.sum(tuple(range(extra)))
    ones = tuple(i for i, n in enumerate(shape) if n == 1 and values.shape[i] != 1)
    return values.sum(ones, keepdim=True) if ones else values


def _bias(
    mask: Tensor | None, is_causal: bool, lead: tuple[int, ...], length: int, keys: int,
    like: Tensor,
) -> Tensor | None:  # fmt: skip
    """The additive mask ``[B, L, S]`` (``-inf`` where a bool mask is false), or None."""
    if is_causal:
        mask = torch.ones(length, keys, dtype=torch.bool, device=like.device).tril()
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(
            ~mask, -math.inf
        )
    return mask.to(like.dtype).expand(*lead, length, keys).reshape(like.shape)


def _workspace(q: Tensor, k: Tensor, v: Tensor) -> int:
    """Elements the backward allocates per column, at most (all samples together).

    Per column at most three ``[L, S]`` maps are alive at once (``dP`` and the
    difference, then the difference and ``dS``, then ``dS`` and a transposed copy for
    ``dK``), with ``dQ``, ``dK``, ``dV`` and their scaled copies; ``P`` and the scores
    are made once per backward (``O = P V`` too, and ``dV``'s products take ``P``
    unexpanded), counted here as two more maps per column so that one column's bound
    holds them. (Nine maps per column were counted before 461926a's backward, which
    made ``dP`` twice and expanded ``P`` per column.)
    """
    b = math.prod(q.shape[:-2])
    length, dim = q.shape[-2:]
    keys, dim_v = v.shape[-2:]
    probs = b * length * keys
    return 5 * probs + 3 * b * (length * dim + keys * dim) + 2 * b * (length + keys) * dim_v


def attention_workspace(node: Any) -> int:
    """Elements per column a node of the recorded graph allocates beyond its vectors.

    Args:
        node: An autograd node of the glue.

    Returns:
        The folded attention's workspace (all samples together), else 0.
    """
    if isinstance(node, _FoldedAttention._backward_cls):
        return int(getattr(node, "workspace", 0))
    return 0


def _arguments(args: tuple, kwargs: dict) -> dict[str, Any] | None:
    bound = dict(zip(SDPA_ARGS, args, strict=False))
    for key, value in kwargs.items():
        if key not in SDPA_ARGS or key in bound:
            return None
        bound[key] = value
    return bound


def fold_attention(args: tuple, kwargs: dict) -> Tensor | None:
    """The folded call, or ``None`` where it would not be the same computation."""
    bound = _arguments(args, kwargs)
    if bound is None or not torch.is_grad_enabled():
        return None
    q, k, v = (bound.get(name) for name in ("query", "key", "value"))
    mask = bound.get("attn_mask")
    if not all(isinstance(t, Tensor) and t.dim() >= 2 for t in (q, k, v)):
        return None
    if any(t.is_nested for t in (q, k, v)) or not any(t.requires_grad for t in (q, k, v)):
        return None
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1]:
        return None  # broadcast or grouped-query attention: left as it is
    if q.shape[-1] != k.shape[-1] or not q.dtype.is_floating_point:
        return None
    if float(bound.get("dropout_p", 0.0)) != 0.0:
        return None  # the draws cannot be reproduced
    causal = bool(bound.get("is_causal", False))
    if mask is not None:
        if not isinstance(mask, Tensor) or causal:
            return None
        if mask.requires_grad and not mask.dtype.is_floating_point:
            return None
        scores = (*q.shape[:-1], k.shape[-2])
        try:
            if torch.broadcast_shapes(mask.shape, scores) != scores:
                return None
        except RuntimeError:
            return None
    scale = bound.get("scale")
    return _FoldedAttention.apply(q, k, v, mask, causal, scale)


def unchecked(function: types.FunctionType) -> types.FunctionType | None:
    """``function``'s own code, without its entry ``has_torch_function`` dispatch.

    ``F.multi_head_attention_forward`` hands itself to an active torch function mode
    as a whole; run as this copy, its inner ``scaled_dot_product_attention`` call
    reaches the mode instead.
    """
    names = function.__code__.co_names
    if "has_torch_function" not in names or function.__code__.co_freevars:
        return None
    scope = {**function.__globals__, "has_torch_function": lambda *_: False}
    copy = types.FunctionType(
        function.__code__, scope, function.__name__, function.__defaults__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy
