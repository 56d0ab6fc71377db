"""Public entry points: check arguments, plan chunks, run the engine, return a dict."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ggnchunk._checks import check_positive_int, check_tensors, trainable_parameters
from ggnchunk._distributed import all_reduce_sum, rank_and_size, resolve_group
from ggnchunk._engine import BrokenChainError, GGNComputation
from ggnchunk._memory import PeakTracker
from ggnchunk._modules import CONTAINERS, check_model
from ggnchunk._scheduler import ChunkScheduler, ScheduleReport, check_chunking, plan_chunks
from ggnchunk._sqrt_hessians import lookup_loss

__all__ = ["GGNReport", "diag_ggn", "loss_grad_and_diag_ggn"]


@dataclass
class GGNReport:
    """How :func:`diag_ggn` computed a diagonal (``return_report=True``).

    Attributes:
        num_columns: Columns of the loss Hessian's square root per forward pass.
        batch_chunks: ``(start, stop)`` sample ranges, one forward pass each.
        schedules: One :class:`~ggnchunk.ScheduleReport` per sample range.
    """

    num_columns: int = 0
    batch_chunks: list[tuple[int, int]] = field(default_factory=list)
    schedules: list[ScheduleReport] = field(default_factory=list)

    @property
    def chunk_size(self) -> int:
        """Largest number of columns in one backward pass."""
        return max(max(c.stop - c.start for c in s.chunks) for s in self.schedules)

    @property
    def num_passes(self) -> int:
        """Number of backward passes, retries after running out of memory included."""
        return sum(len(s.chunks) for s in self.schedules)

    @property
    def peak_extra_bytes(self) -> int | None:
        """Largest measured peak extra memory (budget and auto modes), else ``None``."""
        peaks = [
            s.peak_extra_bytes for s in self.schedules if s.peak_extra_bytes is not None
        ]
        return max(peaks) if peaks else None


def _cache_key(model, loss_func, inputs, params, device) -> tuple:
    structure = tuple(
        (name, type(m).__name__, tuple((n, tuple(p.shape)) for n, p in m.named_parameters(
            recurse=False)))
        for name, m in model.named_modules()
    )  # fmt: skip
    return (
        structure, type(loss_func).__name__, getattr(loss_func, "reduction", None),
        tuple(inputs.shape), inputs.dtype, tuple(p.dtype for _, p in params), str(device),
        torch.get_num_threads(),
    )  # fmt: skip


def _custom_ancestors(
    model: nn.Module, name: str | None, atomic: frozenset[str]
) -> list[str]:
    """Custom containers above layer ``name``, deepest first, not yet single units."""
    if name is None:
        return []
    parts = name.split(".") if name else []
    found = []
    for depth in range(len(parts) - 1, -1, -1):
        candidate = ".".join(parts[:depth])
        module = model.get_submodule(candidate)
        if candidate not in atomic and not isinstance(module, CONTAINERS):
            found.append(candidate)
    return found


def _container_of(
    model: nn.Module, broken: BrokenChainError, atomic: frozenset[str]
) -> str | None:
    """The custom container whose forward most likely holds the operation BackPACK missed.

    First the containers that the previous layer is in but the broken one is not (their
    forward ended with the operation, e.g. a residual ``x + f(x)``), then the broken
    layer's own containers, deepest first. Each retry makes one more container a unit.
    """
    own = _custom_ancestors(model, broken.module_name, atomic)
    before = [c for c in _custom_ancestors(model, broken.previous, atomic) if c not in own]
    candidates = before + own
    return candidates[0] if candidates else None


@dataclass
class _Evaluation:
    """What one batch gives: loss, gradient and diagonal, as lists in parameter order."""

    loss: Tensor
    gradient: list[Tensor]
    diagonal: list[Tensor]
    report: GGNReport
    normalizer: float  # of the mean reduction (1 for sum)


def _compute(
    model, modules, loss_func, handler, inputs, targets, params, scale, scheduler,
    baseline, batch, batch_chunk_size, device, group=None,
) -> tuple[list[Tensor], Tensor, list[Tensor], GGNReport]:  # fmt: skip
    """Every sub-batch: forward, then the scheduled backward passes; summed results.

    Loss, gradient and diagonal are those of ``scale * (the loss with reduction="sum")``.
    """
    report = GGNReport(
        batch_chunks=plan_chunks(batch, chunk_size=min(batch_chunk_size or batch, batch),
                                 what="samples")
    )  # fmt: skip
    total = [torch.zeros_like(p) for _, p in params]
    gradient = [torch.zeros_like(p) for _, p in params]
    loss = torch.zeros((), dtype=params[0][1].dtype, device=device)
    mean = loss_func.reduction == "mean"
    for start, stop in report.batch_chunks:
        sub_inputs, sub_targets = inputs[start:stop], targets[start:stop]
        with GGNComputation(
            model, modules, loss_func, handler, sub_inputs, sub_targets, params, scale
        ) as run:
            run.forward()
            columns = run.num_columns
            report.num_columns = columns

            first, last = 0, columns
            if group is not None:  # chunk-parallel: this rank's share of the columns
                rank, size = rank_and_size(group)
                shares = plan_chunks(columns, num_chunks=min(size, columns))
                first, last = shares[rank] if rank < len(shares) else (columns, columns)

            def backward(a: int, b: int, run=run, first=first, last=last) -> None:
                run.backward(first + a, first + b, retain_graph=first + b < last)

            scheduler.cache_key = _cache_key(model, loss_func, sub_inputs, params, device)
            start_level = baseline
            if baseline is not None and device.type == "cpu" and scheduler.tracker:
                # RSS that grew during the forward pass beyond its tensors is one-time
                # set-up (libraries and kernels loaded on first use): not the call's cost
                grown = scheduler.tracker.current() - run.forward_bytes()
                start_level = max(baseline, grown)
            if last > first:
                _, schedule = scheduler.run(last - first, backward, baseline=start_level)
                report.schedules.append(schedule)
            if run.gradient is None:  # a rank without columns: no pass ran
                run.gradient = run.plain_gradient()
            # the sub-batch's loss is its own mean: back to the sum, then to the scale
            factor = scale * (
                float(handler.normalizer(loss_func, sub_targets)) if mean else 1
            )
            loss += factor * run.loss
            for acc, grad_acc, value, grad in zip(
                total, gradient, run.diagonal, run.gradient, strict=True
            ):
                acc.add_(value)
                if grad is not None:
                    grad_acc.add_(grad, alpha=factor)
    if group is not None:
        all_reduce_sum(total, None, group)
    return total, loss, gradient, report


def diag_ggn(
    model: nn.Module,
    loss_func: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    *,
    num_chunks: int | None = None,
    chunk_size: int | str | None = None,
    max_memory: int | str | None = None,
    batch_chunk_size: int | None = None,
    recover_oom: bool = True,
    distributed: bool = False,
    return_report: bool = False,
) -> dict[str, Tensor] | tuple[dict[str, Tensor], GGNReport]:
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
            smaller), or ``"auto"``: the fastest chunk size that fits ``max_memory`` (or
            90% of the free device memory), found by timing real chunks and remembered
            for later calls with the same model, shapes and threads.
        max_memory: Budget for the peak memory the computation adds above what was in
            use before the call: bytes or a string such as ``"512MiB"``, ``"2GiB"``,
            ``"1.5GB"``. The chunk size is chosen from measured chunks (see
            :class:`~ggnchunk.ChunkScheduler`). On CPU memory is the resident set size,
            on CUDA the caching allocator's allocated bytes.
        batch_chunk_size: Also split the batch into sub-batches of at most this many
            samples, each with its own forward pass (and its own output chunking). Exact
            for ``mean`` and ``sum``: the mean's normalizer is that of the whole batch.
        recover_oom: If a backward pass runs out of memory, split its chunk in halves and
            retry, keeping finished chunks (warns once with the chunk size that worked).
            If the failed pass was the last one, which frees the graph as it goes, the
            forward pass is run again first (with the same random state).
        distributed: Chunk-parallel over the default ``torch.distributed`` process group
            (which must be initialized): every rank runs the forward pass on the same
            batch and its share of the columns, then the diagonals are summed with one
            ``all_reduce``; every rank returns the full result. ``False`` (default):
            no communication.
        return_report: Also return a :class:`GGNReport` (chunk sizes, passes, peaks).

    Returns:
        One tensor per parameter with ``requires_grad``, keyed and ordered as
        ``model.named_parameters()``, each with the parameter's shape, dtype and device;
        with ``return_report=True``, the pair ``(diagonal, report)``.

    Raises:
        TypeError: For arguments of the wrong type (the message names the argument).
        ValueError: For unsupported layers or losses, mismatched shapes, devices or
            dtypes, and out-of-range or conflicting chunk arguments, before any backward
            pass.
        MemoryBudgetError: If ``max_memory`` is too small for one column per pass.

    Example:
        >>> import torch, ggnchunk
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 4))
        >>> X = torch.randn(16, 4)
        >>> diag = ggnchunk.diag_ggn(model, torch.nn.MSELoss(), X, X, num_chunks=2)
        >>> [tuple(v.shape) for v in diag.values()]
        [(8, 4), (8,), (4, 8), (4,)]
    """
    if not isinstance(distributed, bool):
        raise TypeError(f"distributed must be True or False, got {distributed!r}.")
    result = _evaluate(
        model, loss_func, inputs, targets, num_chunks, chunk_size, max_memory,
        batch_chunk_size, recover_oom, distributed=distributed,
    )  # fmt: skip
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    diagonal = dict(zip(names, result.diagonal, strict=True))
    return (diagonal, result.report) if return_report else diagonal


def loss_grad_and_diag_ggn(
    model: nn.Module,
    loss_func: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    *,
    num_chunks: int | None = None,
    chunk_size: int | str | None = None,
    max_memory: int | str | None = None,
    batch_chunk_size: int | None = None,
    recover_oom: bool = True,
) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """Loss, gradient and exact GGN diagonal from one forward pass (per sub-batch).

    The gradient comes for free with the first backward pass of the GGN computation;
    ``.grad`` is not touched. Arguments as in :func:`diag_ggn`.

    Args:
        model: As in :func:`diag_ggn`.
        loss_func: As in :func:`diag_ggn`.
        inputs: As in :func:`diag_ggn`.
        targets: As in :func:`diag_ggn`.
        num_chunks: As in :func:`diag_ggn`.
        chunk_size: As in :func:`diag_ggn`.
        max_memory: As in :func:`diag_ggn`.
        batch_chunk_size: As in :func:`diag_ggn`; loss and gradient are those of the
            whole batch.
        recover_oom: As in :func:`diag_ggn`.

    Returns:
        ``(loss, gradient, diagonal)``: the detached scalar loss; gradient and diagonal
        keyed and ordered as ``model.named_parameters()`` (trainable ones).

    Example:
        >>> import torch, ggnchunk
        >>> model = torch.nn.Linear(3, 2)
        >>> X, y = torch.randn(8, 3), torch.randn(8, 2)
        >>> loss_func = torch.nn.MSELoss()
        >>> loss, grad, diag = ggnchunk.loss_grad_and_diag_ggn(model, loss_func, X, y)
        >>> bool(torch.allclose(loss, loss_func(model(X), y)))
        True
    """
    result = _evaluate(
        model, loss_func, inputs, targets, num_chunks, chunk_size, max_memory,
        batch_chunk_size, recover_oom,
    )  # fmt: skip
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    return (
        result.loss,
        dict(zip(names, result.gradient, strict=True)),
        dict(zip(names, result.diagonal, strict=True)),
    )


def _evaluate(
    model, loss_func, inputs, targets, num_chunks, chunk_size, max_memory,
    batch_chunk_size, recover_oom, scale: float | None = None, distributed: bool = False,
) -> _Evaluation:  # fmt: skip
    """Check everything, then compute; ``scale=None`` follows the loss's reduction."""
    handler = lookup_loss(loss_func)
    handler.check(loss_func)
    check_chunking(num_chunks, chunk_size, max_memory)
    check_model(model)
    params = trainable_parameters(model)
    check_tensors(params, inputs, targets)
    group = resolve_group(True, model) if distributed else None
    batch = inputs.shape[0]
    if batch_chunk_size is not None:
        batch_chunk_size = check_positive_int(batch_chunk_size, "batch_chunk_size")
    device = params[0][1].device
    tracker = (
        PeakTracker(device) if (max_memory is not None or chunk_size == "auto") else None
    )
    baseline = tracker.current() if tracker is not None else None
    normalizer = 1.0
    if loss_func.reduction == "mean":
        normalizer = float(handler.normalizer(loss_func, targets))
    if scale is None:
        scale = 1.0 / normalizer
    scheduler = ChunkScheduler(
        num_chunks=num_chunks,
        chunk_size=chunk_size,
        max_memory=max_memory,
        device=device,
        recover_oom=recover_oom,
        what="columns",
        tracker=tracker,
    )
    atomic: frozenset[str] = frozenset()
    while True:  # custom containers whose forward BackPACK cannot follow become units
        try:
            total, loss, gradient, report = _compute(
                model, check_model(model, atomic), loss_func, handler, inputs, targets,
                params, scale, scheduler, baseline, batch, batch_chunk_size, device, group,
            )  # fmt: skip
            break
        except BrokenChainError as broken:
            container = _container_of(model, broken, atomic)
            if container is None:
                raise
            atomic = atomic | {container}
    return _Evaluation(loss, gradient, total, report, normalizer)
