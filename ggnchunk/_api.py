"""Public entry points: check arguments, plan chunks, run the engine, return a dict."""

from __future__ import annotations

from torch import Tensor, nn

from ggnchunk._checks import check_chunk_count, check_tensors, trainable_parameters
from ggnchunk._engine import GGNComputation
from ggnchunk._modules import check_model
from ggnchunk._scheduler import plan_chunks
from ggnchunk._sqrt_hessians import lookup_loss

__all__ = ["diag_ggn"]


def diag_ggn(
    model: nn.Module,
    loss_func: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    *,
    num_chunks: int | None = None,
    chunk_size: int | None = None,
) -> dict[str, Tensor]:
    """Exact diagonal of the generalized Gauss-Newton matrix of a batch's loss.

    Computes ``diag(sum_n J_n^T H_n J_n)`` for ``loss = loss_func(model(inputs), targets)``
    as the loss's ``reduction`` defines it, where ``J_n`` is the Jacobian of sample
    ``n``'s output w.r.t. the parameters and ``H_n`` the Hessian of the loss w.r.t. that
    output. One forward pass, then one backward pass per chunk of columns of the loss
    Hessian's symmetric square root ``S_n`` (``S_n S_n^T = H_n``); the chunks' diagonals
    add up to the exact result. Peak memory grows with the chunk's column count.

    Columns are the output coordinates for ``MSELoss`` and ``BCEWithLogitsLoss``
    (``prod(output_shape[1:])`` of them) and classes × positions for
    ``CrossEntropyLoss`` (``C * prod(output_shape[2:])``).

    Args:
        model: A model built from supported layers (see the README), with its output of
            shape ``[N, ...]``: ``[N, M]``, image-shaped ``[N, C, H, W]``, sequence-shaped
            ``[N, T, D]``, or logits ``[N, C, ...]`` for cross-entropy. Layers that couple
            samples (BatchNorm) must be in eval mode.
        loss_func: ``nn.MSELoss``, ``nn.BCEWithLogitsLoss`` or ``nn.CrossEntropyLoss``
            with ``reduction="mean"`` or ``"sum"``.
        inputs: Model inputs, shape ``[N, ...]``, on the model's device.
        targets: Targets: the output's shape for MSE and BCE; ``[N, ...]`` class indices or
            ``[N, C, ...]`` probabilities for cross-entropy.
        num_chunks: Number of backward passes, from 1 to the number of columns; chunk
            sizes differ by at most one.
        chunk_size: Largest number of columns per backward pass (the last chunk may be
            smaller). Give at most one of ``num_chunks`` and ``chunk_size``; with neither,
            one backward pass.

    Returns:
        One tensor per parameter with ``requires_grad``, keyed and ordered as
        ``model.named_parameters()``, each with the parameter's shape, dtype and device.

    Raises:
        TypeError: For arguments of the wrong type (the message names the argument).
        ValueError: For unsupported layers or losses, mismatched shapes, devices or
            dtypes, and out-of-range chunk arguments, before any backward pass.

    Example:
        >>> import torch, ggnchunk
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 4))
        >>> X = torch.randn(16, 4)
        >>> diag = ggnchunk.diag_ggn(model, torch.nn.MSELoss(), X, X, num_chunks=2)
        >>> [tuple(v.shape) for v in diag.values()]
        [(8, 4), (8,), (4, 8), (4,)]
    """
    handler = lookup_loss(loss_func)
    handler.check(loss_func)
    check_chunk_count(num_chunks, chunk_size)
    modules = check_model(model)
    params = trainable_parameters(model)
    check_tensors(params, inputs, targets)
    with GGNComputation(model, modules, loss_func, handler, inputs, targets, params) as run:
        run.forward()
        plan = plan_chunks(run.num_columns, num_chunks, chunk_size)
        for index, (start, stop) in enumerate(plan):
            run.backward(start, stop, retain_graph=index < len(plan) - 1)
        return {name: value for (name, _), value in zip(params, run.diagonal, strict=True)}
