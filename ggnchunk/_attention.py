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
nested tensors, inputs whose leading axes differ (broadcast). Grouped-query attention
(``enable_gqa=True``: Mistral, Qwen2, Llama 3 with fewer key heads) is folded with each
key head repeated for its query heads, and the keys' gradients summed back per head. A
float mask that requires grad (a learned relative-position bias: BEiT, Swin) gets
:math:`dS`, summed over the axes it was broadcast along.

A column's gradient at the attention's output is often zero on most query rows: an
output pixel's column at a U-Net's bottleneck reaches the tokens of its receptive
field, a token's column at a language model's last block that token alone. Those
columns are computed on their non-zero rows only (:func:`_columns_backward`), exactly.

Only the thread that runs the engine's forward pass is affected (torch function modes
are thread-local), and only while that forward runs.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
from torch import Tensor

from ggnchunk._autograd import is_batched, on_columns

__all__ = ["SDPA", "attention_workspace", "fold_attention", "fold_eager_tail", "unchecked"]

SDPA = torch._C._nn.scaled_dot_product_attention
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")  # fmt: skip


class _FoldedAttention(torch.autograd.Function):
    """``scaled_dot_product_attention`` with a backward that batches over columns."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, groups):
        if groups > 1:
            out = SDPA(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                       enable_gqa=True)  # fmt: skip
        else:
            out = SDPA(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
        ctx.save_for_backward(q, k, v, mask)
        ctx.groups = groups
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
        key_shapes = (k.shape, v.shape)
        if ctx.groups > 1:  # grouped-query attention: query head h reads key head
            # h // groups; the keys' gradients are summed over their groups
            k = k.repeat_interleave(ctx.groups, -3)
            v = v.repeat_interleave(ctx.groups, -3)
        elif k.shape[:-2] != q.shape[:-2]:  # keys broadcast over the queries' leading
            # axes (one key head for all query heads: Falcon's multi-query attention)
            k = k.expand(*q.shape[:-2], *k.shape[-2:])
            v = v.expand(*q.shape[:-2], *v.shape[-2:])
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
        need_q, need_k, need_v, need_mask = ctx.needs_input_grad[:4]
        if need_mask:  # a learned bias (relative positions) needs every column's dS
            dq, dk, dv, dmask = _per_column(ctx, q, k, v, mask, grad, p, q3, k3, v3)
            dk = (
                None
                if dk is None
                else _grouped(dk[None], 1, key_shapes[0], ctx.groups, lead)[0]
            )
            dv = (
                None
                if dv is None
                else _grouped(dv[None], 1, key_shapes[1], ctx.groups, lead)[0]
            )
            return dq, dk, dv, dmask, None, None, None
        o = torch.bmm(p, v3)  # O = P V (not per column): the rows' sums of P * dP
        scaled = (q3 * ctx.scale, k3 * ctx.scale)
        needs = (need_q, need_k, need_v)

        def backward(g: Tensor) -> tuple[Tensor | None, ...]:
            dq, dk, dv = _columns_backward(g, p, o, scaled, v3, needs)
            count = g.shape[0]
            return (
                None if dq is None else dq.reshape(count, *q.shape),
                _grouped(dk, count, key_shapes[0], ctx.groups, lead),
                _grouped(dv, count, key_shapes[1], ctx.groups, lead),
            )

        return (*on_columns([grad], backward), None, None, None, None)


class _EagerAttention(_FoldedAttention):
    """``nn.MultiheadAttention``'s ``need_weights=True`` tail with the folded backward.

    Its output is the call's own last product, ``bmm(P, v)`` of the probabilities it
    computed (``q`` already scaled), so the same numbers; the backward is the folded
    attention's (``P`` made again from ``q``, ``k`` and the mask), the rows' form
    included.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, probs):
        ctx.save_for_backward(q, k, v, mask)
        ctx.groups, ctx.is_causal, ctx.scale = 1, False, 1.0
        ctx.workspace = _workspace(q, k, v)
        return torch.bmm(probs, v)

    @staticmethod
    def backward(ctx, grad):
        return *_FoldedAttention.backward(ctx, grad)[:4], None


def fold_eager_tail(
    q: Tensor, keys: Tensor, v: Tensor, mask: Tensor | None, probs: Tensor
) -> Tensor | None:
    """``bmm(probs, v)`` of ``probs = softmax(bmm(q, keys))`` folded, or ``None``.

    Args:
        q: ``[B, L, D]`` queries, scaled.
        keys: ``[B, D, S]``, the keys transposed.
        v: ``[B, S, Dv]``.
        mask: An additive float mask broadcast to ``[B, L, S]`` (``baddbmm``'s input),
            or ``None``.
        probs: ``[B, L, S]``, the call's softmax of the scores.

    Returns:
        The output ``[B, L, Dv]`` (the same numbers), with the folded backward.
    """
    tensors = (q, keys, v) if mask is None else (q, keys, v, mask)
    if not all(type(t) is Tensor or isinstance(t, torch.nn.Parameter) for t in tensors):
        return None
    if (
        any(t.dim() != 3 or t.is_nested for t in (q, keys, v))
        or len({t.dtype for t in tensors}) != 1
    ):
        return None
    if not q.dtype.is_floating_point or not any(t.requires_grad for t in (q, keys, v)):
        return None
    if mask is not None and (mask.requires_grad or mask.dim() > 3):
        return None
    return _EagerAttention.apply(q, keys.transpose(-2, -1), v, mask, probs.detach())


def _grouped(
    grads: Tensor | None, count: int, shape: torch.Size, groups: int, lead: torch.Size
) -> Tensor | None:
    """Keys' or values' gradients ``[V, ...]`` on the query heads, summed per key head.

    Args:
        grads: ``[V, *lead, S, D]`` on the queries' leading axes: the key heads repeated
            (``groups`` query heads per key head), or the keys broadcast along them.
        count: ``V``.
        shape: The keys' (or values') own shape ``[..., Hk, S, D]``.
        groups: Query heads per key head (1: none, or broadcast keys).
        lead: The queries' leading axes.

    Returns:
        ``[V, *shape]``, or ``None``.
    """
    if grads is None:
        return None
    if groups > 1:
        heads = shape[-3]
        grads = grads.reshape(count, *shape[:-3], heads, groups, *shape[-2:])
        return grads.sum(-3)
    # broadcast keys: summed over the query axes they were expanded along
    return _summed_to(grads.reshape(count, *lead, *shape[-2:]), (count, *shape))


def _per_column(
    ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, grad: Tensor, p: Tensor,
    q3: Tensor, k3: Tensor, v3: Tensor,
) -> tuple[Tensor | None, ...]:  # fmt: skip
    """The backward on one column's view (batched by autograd), with the mask's dS."""
    b, length, keys = p.shape
    # only products and elementwise maths. The rows' sums of P * dP are dO . O (O = P V,
    # not per column), so no second [L, S] map per column is made for them
    g = grad.reshape(b, length, v.shape[-1])
    rows = (g * torch.bmm(p, v3)).sum(-1, keepdim=True)
    ds = (torch.bmm(g, v3.transpose(1, 2)) - rows) * p
    need_q, need_k, need_v = ctx.needs_input_grad[:3]
    dq = torch.bmm(ds, k3 * ctx.scale).reshape(q.shape) if need_q else None
    dk = torch.bmm(ds.transpose(1, 2), q3 * ctx.scale).reshape(k.shape) if need_k else None
    dv = None
    if need_v:  # one product per slice with P (not per column) on the left: the
        # columns fold into its rows, where a batched product with P copied P
        # once per column (as large as dP)
        dv = torch.stack([torch.mm(p[i].t(), g[i]) for i in range(b)]).reshape(v.shape)
    # dS, summed over the axes the mask was broadcast along
    lead = q.shape[:-2]
    dmask = _summed_to(ds.reshape(*lead, length, keys), mask.shape)
    return dq, dk, dv, dmask


SPARSE_SHARE = 0.5
"""Columns whose output gradient is non-zero on at most this share of the query rows
take the rows' form (:func:`_columns_backward`)."""


def _columns_backward(
    grad: Tensor, p: Tensor, o: Tensor, scaled: tuple[Tensor, Tensor], v3: Tensor,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # fmt: skip
    """The backward of all columns ``[V, *lead, L, Dv]`` at once.

    A column's output gradient is often zero on most query rows: an output pixel's
    column reaches a bottleneck's attention on its receptive field's tokens only, a
    token's column reaches the last block's attention on that token alone. Rows with a
    zero ``dO`` have a zero ``dS`` (``dS = P * (dO V^T - dO . O)``) and add nothing to
    ``dV``, ``dK`` or ``dQ``: such columns are computed on their non-zero rows (``r``
    of them, the most any of them has), four products of ``r x S`` instead of
    ``L x S`` per column, slice and head. Exact: the same sums without their zero
    terms. The other columns take the full form, batched in the same products.

    Args:
        grad: ``[V, *lead, L, Dv]``, the columns' output gradients.
        p: ``[B, L, S]`` attention probabilities (``B`` = the lead axes' product).
        o: ``[B, L, Dv]``, ``P V``.
        scaled: ``Q`` and ``K`` as ``[B, L, D]``, ``[B, S, D]``, times the scale.
        v3: ``[B, S, Dv]``.
        needs: Which of ``dQ``, ``dK``, ``dV`` to make.

    Returns:
        ``dQ`` ``[V, B, L, D]``, ``dK`` ``[V, B, S, D]``, ``dV`` ``[V, B, S, Dv]``
        (``None`` where not needed).
    """
    count, (b, length), dim_v = grad.shape[0], p.shape[:2], v3.shape[-1]
    g = grad.reshape(count, b, length, dim_v)
    if is_batched(g):  # a batching this backward cannot unwrap: no data-dependent sizes
        return _on_rows(g, None, p, o, scaled, v3, needs)
    live = g.ne(0).any(3).any(1)  # [V, L]: rows with a non-zero gradient (NaN counts)
    sizes = live.sum(1)
    sparse = sizes <= SPARSE_SHARE * length
    if not bool(sparse.any()):
        return _on_rows(g, None, p, o, scaled, v3, needs)
    # each column's live rows first, in order (a zero row pads the shorter ones)
    rows = torch.sort(live.to(torch.uint8), stable=True, dim=1, descending=True).indices
    width = max(int(sizes[sparse].max()), 1)
    if bool(sparse.all()):
        return _on_rows(g, rows[:, :width], p, o, scaled, v3, needs)
    picked, rest = sparse.nonzero().squeeze(1), (~sparse).nonzero().squeeze(1)
    parts = (
        _on_rows(g[picked], rows[picked, :width], p, o, scaled, v3, needs),
        _on_rows(g[rest], None, p, o, scaled, v3, needs),
    )
    results = []
    for few, full in zip(*parts, strict=True):
        if few is None:
            results.append(None)
            continue
        out = few.new_empty(count, *few.shape[1:])
        out[picked], out[rest] = few, full
        results.append(out)
    return tuple(results)


def _on_rows(
    g: Tensor, rows: Tensor | None, p: Tensor, o: Tensor, scaled: tuple[Tensor, Tensor],
    v3: Tensor, needs: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # fmt: skip
    """:func:`_columns_backward` of columns ``g`` ``[V, B, L, Dv]`` on query ``rows``.

    ``rows`` ``[V, r]`` (every row where ``g`` is non-zero among them; ``None``: all).
    The products run per slice ``B`` with the columns folded into their rows.
    """
    count, b, length, dim_v = g.shape
    q3, k3 = scaled
    keys = p.shape[2]
    if rows is None:
        width = length
        gr = g.transpose(0, 1)  # [B, V, L, Dv]
        pr = p.unsqueeze(1)  # [B, 1, L, S]
        orow = o.unsqueeze(1)
    else:
        width = rows.shape[1]
        gr = g.gather(2, rows[:, None, :, None].expand(count, b, width, dim_v))
        gr = gr.transpose(0, 1)  # [B, V, r, Dv]
        pr, orow, qr = p[:, rows], o[:, rows], q3[:, rows]  # [B, V, r, *]
    gr = gr.contiguous()
    ds = torch.bmm(gr.view(b, count * width, dim_v), v3.transpose(1, 2))
    ds = ds.view(b, count, width, keys)
    ds.sub_((gr * orow).sum(-1, keepdim=True)).mul_(pr)  # dS = P * (dO V^T - dO . O)
    need_q, need_k, need_v = needs
    dq = dk = dv = None
    if need_q:
        dqr = torch.bmm(ds.view(b, count * width, keys), k3).view(b, count, width, -1)
        if rows is None:
            dq = dqr.transpose(0, 1)
        else:
            dq = dqr.new_zeros(b, count, length, dqr.shape[-1]).scatter_(
                2, rows[None, :, :, None].expand(dqr.shape), dqr
            ).transpose(0, 1)  # fmt: skip
    flat = ds.view(b * count, width, keys) if rows is not None else None
    if need_k:
        if rows is None:  # dK = dS^T Q: per slice, the columns' dS side by side
            dk = torch.matmul(ds.transpose(2, 3), q3.unsqueeze(1))
        else:
            dk = torch.bmm(flat.transpose(1, 2), qr.reshape(b * count, width, -1))
            dk = dk.view(b, count, keys, -1)
        dk = dk.transpose(0, 1)
    if need_v:
        if rows is None:  # one product per slice with P (not per column) on the left
            cols = gr.permute(0, 2, 1, 3).reshape(b, length, count * dim_v)
            dv = torch.bmm(p.transpose(1, 2), cols).view(b, keys, count, dim_v)
            dv = dv.permute(2, 0, 1, 3)
        else:
            dv = torch.bmm(pr.reshape(b * count, width, keys).transpose(1, 2),
                           gr.view(b * count, width, dim_v))  # fmt: skip
            dv = dv.view(b, count, keys, dim_v).transpose(0, 1)
    return dq, dk, dv


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
    if isinstance(node, (_FoldedAttention._backward_cls, _EagerAttention._backward_cls)):
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
    if k.shape[:-1] != v.shape[:-1] or q.dim() != k.dim():
        return None
    groups = 1
    if q.shape[:-2] != k.shape[:-2] and bound.get("enable_gqa", False):
        # grouped-query attention: query head h reads key head h // groups
        heads, key_heads = q.shape[-3], k.shape[-3] if k.dim() > 2 else 0
        if q.shape[:-3] != k.shape[:-3] or key_heads == 0 or heads % key_heads:
            return None
        groups = heads // key_heads
    elif q.shape[:-2] != k.shape[:-2]:  # keys broadcast along one leading axis of size
        # one (multi-query attention with one key head): others are left as they are
        ones = [i for i, (a, b) in enumerate(zip(q.shape[:-2], k.shape[:-2], strict=True))
                if a != b]  # fmt: skip
        if len(ones) != 1 or k.shape[ones[0]] != 1:
            return None
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
    return _FoldedAttention.apply(q, k, v, mask, causal, scale, groups)


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
