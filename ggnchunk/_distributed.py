"""torch.distributed helpers: which process group to use, checks, one all-reduce.

ggnchunk uses the process group the user already has (``torchrun`` and
``init_process_group``); it never starts processes itself. Every rank must call the same
collectives in the same order, so a rank without data still joins the all-reduce.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["all_reduce_sum", "rank_and_size", "resolve_group"]


def resolve_group(distributed: bool | None, model: nn.Module) -> Any:
    """The process group to sum over, or ``None``.

    Args:
        distributed: ``None``: the default group if one is initialized; ``True``: require
            one; ``False``: none.
        model: Checked to have the same trainable parameter shapes on every rank.

    Returns:
        ``torch.distributed.group.WORLD`` or ``None``.

    Raises:
        TypeError: If ``distributed`` is not ``None`` or a bool.
        RuntimeError: If ``distributed=True`` and no process group is initialized.
        ValueError: If the ranks' models differ in parameter names or shapes.
    """
    if distributed is not None and not isinstance(distributed, bool):
        raise TypeError(f"distributed must be None, True or False, got {distributed!r}.")
    if distributed is False:
        return None
    import torch.distributed as dist

    ready = dist.is_available() and dist.is_initialized()
    if not ready:
        if distributed:
            raise RuntimeError(
                "distributed=True, but no torch.distributed process group is initialized. "
                "Call torch.distributed.init_process_group(...) first (torchrun sets the "
                "environment it needs), or pass distributed=False."
            )
        return None
    group = dist.group.WORLD
    _check_same_model(model, group)
    return group


def _device_for(group: Any, fallback: torch.device) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return fallback if fallback.type == "cpu" else torch.device("cpu")


def _check_same_model(model: nn.Module, group: Any) -> None:
    import torch.distributed as dist

    signature = repr([(n, tuple(p.shape)) for n, p in model.named_parameters()
                      if p.requires_grad])  # fmt: skip
    digest = int(hashlib.sha1(signature.encode()).hexdigest()[:15], 16)
    device = _device_for(group, next(model.parameters()).device)
    low = torch.tensor([digest], dtype=torch.int64, device=device)
    high = low.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if low.item() != high.item():
        raise ValueError(
            "the ranks disagree on the model's trainable parameters (names or shapes); "
            "every rank must build the same model before computing a distributed GGN "
            "diagonal."
        )


def rank_and_size(group: Any) -> tuple[int, int]:
    """This process's rank and the group's size.

    Args:
        group: A process group.

    Returns:
        ``(rank, world_size)``.
    """
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def all_reduce_sum(
    tensors: list[Tensor], scalars: Tensor | None, group: Any
) -> tuple[list[Tensor], Tensor | None]:
    """Sum tensors (one flat buffer, one collective) and float64 scalars over the ranks.

    Args:
        tensors: Tensors of one dtype and device; summed in place and returned.
        scalars: Optional float64 vector summed too (a second collective).
        group: The process group.

    Returns:
        ``(tensors, scalars)`` summed over the ranks, on their original devices.
    """
    import torch.distributed as dist

    device = tensors[0].device
    comm = _device_for(group, device)
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(comm)
    dist.all_reduce(flat, group=group)
    flat = flat.to(device)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    if scalars is not None:
        scalars = scalars.to(comm)
        dist.all_reduce(scalars, group=group)
        scalars = scalars.cpu()
    return tensors, scalars
