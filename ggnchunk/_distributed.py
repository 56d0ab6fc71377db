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

__all__ = [
    "all_reduce_sum", "check_same_output", "check_same_work", "rank_and_size",
    "resolve_group",
]  # fmt: skip


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


def _extremes(values: Tensor, group: Any) -> tuple[list[Any], list[Any]]:
    """The smallest and largest of each entry of ``values`` over the ranks.

    Every rank gets the same two lists, so a check on them refuses on all ranks at once.

    Args:
        values: A vector, the same length on every rank.
        group: The process group.

    Returns:
        ``(lows, highs)`` as Python numbers.
    """
    import torch.distributed as dist

    low = values.to(_device_for(group, values.device))
    high = low.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    return low.tolist(), high.tolist()


def _check_same_model(model: nn.Module, group: Any) -> None:
    signature = repr([(n, tuple(p.shape)) for n, p in model.named_parameters()
                      if p.requires_grad])  # fmt: skip
    digest = int(hashlib.sha1(signature.encode()).hexdigest()[:15], 16)
    digests = torch.tensor([digest], device=next(model.parameters()).device)
    low, high = _extremes(digests, group)
    if low != high:
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


# words (int16) summed at a time by the fingerprints: a chunk's int64 copy is 2 MiB
_WORDS = 1 << 18
# output values projected at a time (after the forward pass, inside a call's budget)
_VALUES = 1 << 16


def _fingerprint(tensors: list[Tensor]) -> int:
    """A 60-bit digest of the tensors' bits, shapes and dtypes, the same on any device.

    Integer sums of the bits (plain and position-weighted, exact in int64) rather than
    floating-point sums, whose rounding can differ between devices and kernels.

    Args:
        tensors: The tensors, in a fixed order.

    Returns:
        The digest.
    """
    parts: list[object] = []
    for tensor in tensors:
        data = tensor.detach()
        if data.layout != torch.strided:
            data = data.to_dense()
        data = data.contiguous().reshape(-1)
        if data.dtype == torch.bool:
            data = data.to(torch.uint8)
        raw = data.view(torch.uint8)
        if raw.numel() % 2 or raw.storage_offset() % 2:  # whole int16 words, aligned
            raw = torch.cat([raw, raw.new_zeros(raw.numel() % 2)])
        words = raw.view(torch.int16)
        plain = weighted = 0
        for start in range(0, words.numel(), _WORDS):
            piece = words[start : start + _WORDS].long()
            weights = torch.arange(start, start + piece.numel(), device=piece.device)
            plain += int(piece.sum())
            weighted += int((piece * (weights % 1021 + 1)).sum())
        parts.append((tuple(tensor.shape), str(tensor.dtype), plain, weighted))
    return int(hashlib.sha1(repr(parts).encode()).hexdigest()[:15], 16)


def check_same_work(group: Any, parts: dict[str, list[Tensor]]) -> None:
    """Refuse, on every rank at once, where the ranks would split different work.

    Column-parallel calls split the columns of one forward pass over the ranks and sum
    their shares: that is the diagonal only if every rank has the same model (values,
    not only shapes), inputs and targets. Checked bit for bit, before the forward pass.

    Args:
        group: The process group.
        parts: What must agree, by the name the error gives it (``"inputs"``, ...).

    Raises:
        ValueError: On every rank, if a part differs between ranks.
    """
    names = list(parts)
    first = next((t for name in names for t in parts[name]), None)
    digests = torch.tensor(
        [_fingerprint(parts[name]) for name in names],
        device=first.device if first is not None else None,
    )
    low, high = _extremes(digests, group)
    differ = [name for name, a, b in zip(names, low, high, strict=True) if a != b]
    if differ:
        raise ValueError(
            f"column_parallel=True: the ranks' {' and '.join(differ)} differ. Each rank "
            "computes a share of the columns of one batch and the shares are summed, so "
            "every rank must call with the same model (the same parameter and buffer "
            "values: load the same weights, or broadcast them from rank 0), inputs and "
            "targets. For a different batch on each rank use diag_ggn_dataset (which "
            "sums the ranks' batches) or DiagGGNAccumulator.all_reduce instead."
        )


def check_same_output(group: Any, output: Tensor) -> None:
    """Refuse, on every rank at once, where the ranks' forward passes computed differently.

    With the same model and inputs (:func:`check_same_work`), a forward pass that draws
    random numbers (dropout in training mode, a VAE's noise) still differs between ranks
    unless their random states agree; each rank's share would be of its own draws.
    Compared by two projections and the squared norm, within 1e-3 of the output's norm,
    so that kernels that sum in another order do not count as a difference (a random
    draw differs by far more).

    Args:
        group: The process group.
        output: This rank's model output.

    Raises:
        ValueError: On every rank, if the outputs differ.
    """
    flat = output.detach().reshape(-1)
    stats = torch.zeros(3, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _VALUES):  # inside the budget: 2 MiB at most
        values = flat[start : start + _VALUES].double()
        positions = torch.arange(start, start + values.numel(), device=values.device,
                                 dtype=torch.float64)  # fmt: skip
        # two fixed directions: a difference's projections on them are about its norm
        # times 1/sqrt(2) each, whatever its pattern (a difference of rounding, 1e-7 of
        # the norm in float32; one of random draws, about the norm itself)
        stats[0] += torch.cos(positions) @ values
        stats[1] += torch.sin(0.618 * positions) @ values
        stats[2] += values.square().sum()
    low, high = _extremes(stats, group)
    spread = [b - a for a, b in zip(low, high, strict=True)]
    if max(spread[:2]) > 1e-3 * high[2] ** 0.5 or spread[2] > 1e-3 * high[2]:
        raise ValueError(
            "column_parallel=True: the ranks' forward passes gave different outputs for "
            "the same model and inputs, so the model draws random numbers in forward "
            "(dropout in training mode, a VAE's noise) and the ranks' random states "
            "differ. Seed every rank alike before the call (torch.manual_seed(seed) on "
            "each), or call model.eval() where the draws are not part of the model."
        )
