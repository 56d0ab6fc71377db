"""GGN diagonals of a whole dataset: a streaming accumulator and a one-call loop.

The diagonal of the empirical risk over a dataset, as the loss's ``reduction`` defines
it: each batch contributes the diagonal of its *summed* loss, and for ``mean`` the total
is divided by the dataset's normalizer (the number of loss terms, or the sum of class
weights of the counted targets for a weighted cross-entropy), counted while iterating.
For plain losses that is weight ``batch_size / N`` per batch; for ``sum`` weight 1.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from ggnchunk._api import ChunkOptions, GGNReport, _evaluate
from ggnchunk._distributed import all_reduce_sum, resolve_group

__all__ = ["DiagGGNAccumulator", "diag_ggn_dataset"]


class DiagGGNAccumulator:
    """Streaming GGN diagonal: ``update`` per batch, ``compute`` at the end.

    Useful for online use (EWC, running Laplace fits): the state is a sum of per-batch
    diagonals plus the normalizer, so batches can come from anywhere and in any sizes,
    and ``state_dict``/``load_state_dict`` checkpoint it.

    Args:
        model: As in :func:`ggnchunk.diag_ggn`.
        loss_func: As in :func:`ggnchunk.diag_ggn`.
        **options: Chunking options of :func:`ggnchunk.diag_ggn` (``num_chunks``,
            ``chunk_size``, ``max_memory``, ``batch_chunk_size``, ``recover_oom``),
            used for every batch.

    Example:
        >>> import torch, ggnchunk
        >>> model = torch.nn.Linear(3, 2)
        >>> acc = ggnchunk.DiagGGNAccumulator(model, torch.nn.MSELoss(), num_chunks=2)
        >>> for _ in range(3):
        ...     _ = acc.update(torch.randn(4, 3), torch.randn(4, 2))
        >>> acc.num_samples, sorted(acc.compute())
        (12, ['bias', 'weight'])
    """

    _OPTIONS = ("num_chunks", "chunk_size", "max_memory", "batch_chunk_size", "recover_oom")

    def __init__(self, model: nn.Module, loss_func: nn.Module, **options: Any):
        unknown = set(options) - set(self._OPTIONS)
        if unknown:
            raise TypeError(
                f"unknown option(s) {sorted(unknown)}; DiagGGNAccumulator takes "
                f"{', '.join(self._OPTIONS)}."
            )
        self.model, self.loss_func = model, loss_func
        self.options = {"recover_oom": True, **dict.fromkeys(self._OPTIONS[:4]), **options}
        self._chunking = ChunkOptions(**self.options)
        self.reset()

    def reset(self) -> None:
        """Forget every batch seen so far."""
        self._sum: dict[str, Tensor] | None = None
        self.normalizer = 0.0
        self.num_samples = 0
        self.num_batches = 0
        self.last_report: GGNReport | None = None

    def update(self, inputs: Tensor, targets: Tensor) -> GGNReport:
        """Add one batch.

        Args:
            inputs: Batch inputs, ``[B, ...]``.
            targets: Batch targets.

        Returns:
            How the batch was chunked.
        """
        result = _evaluate(
            self.model, self.loss_func, inputs, targets, self._chunking, scale=1.0
        )
        names = result.names
        if self._sum is None:
            self._sum = dict(zip(names, result.diagonal, strict=True))
        else:
            for name, value in zip(names, result.diagonal, strict=True):
                self._sum[name].add_(value)
        self.normalizer += result.normalizer
        self.num_samples += int(targets.shape[0])
        self.num_batches += 1
        self.last_report = result.report
        return result.report

    def _require(self) -> dict[str, Tensor]:
        if self._sum is None:
            raise RuntimeError(
                "no batch was added yet; call update(inputs, targets) first."
            )
        return self._sum

    def compute(self) -> dict[str, Tensor]:
        """The diagonal of the risk over all batches added since the last reset.

        Returns:
            One tensor per trainable parameter, keyed and ordered as
            ``model.named_parameters()``.
        """
        total = self._require()
        if self.loss_func.reduction == "mean":
            return {name: value / self.normalizer for name, value in total.items()}
        return {name: value.clone() for name, value in total.items()}

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint of the accumulated state (tensors are copies).

        Returns:
            ``{"sum": {name: tensor}, "normalizer", "num_samples", "num_batches"}``.
        """
        return {
            "sum": None
            if self._sum is None
            else {k: v.clone() for k, v in self._sum.items()},
            "normalizer": self.normalizer,
            "num_samples": self.num_samples,
            "num_batches": self.num_batches,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint made by :meth:`state_dict`.

        Args:
            state: The checkpoint.

        Raises:
            ValueError: If its parameter names or shapes differ from the model's.
        """
        names = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        total = state["sum"]
        if total is not None:
            if list(total) != list(names) or any(
                total[n].shape != p.shape for n, p in names.items()
            ):
                raise ValueError(
                    "state['sum'] does not match the model's trainable parameters "
                    f"(names {list(total)[:3]}... vs {list(names)[:3]}...); load a "
                    "checkpoint made with the same model."
                )
            total = {n: total[n].to(p) for n, p in names.items()}
        self._sum = total
        self.normalizer = float(state["normalizer"])
        self.num_samples = int(state["num_samples"])
        self.num_batches = int(state["num_batches"])

    def all_reduce(self, group: Any = None) -> None:
        """Sum the state over the ranks of a process group (all ranks must call it).

        Args:
            group: A ``torch.distributed`` process group; ``None`` for the default one.
        """
        total = self._require()
        scalars = torch.tensor(
            [self.normalizer, float(self.num_samples), float(self.num_batches)],
            dtype=torch.float64,
        )
        reduced, scalars = all_reduce_sum(list(total.values()), scalars, group)
        self._sum = dict(zip(total, reduced, strict=True))
        self.normalizer = float(scalars[0])
        self.num_samples, self.num_batches = int(scalars[1]), int(scalars[2])


def diag_ggn_dataset(
    model: nn.Module,
    loss_func: nn.Module,
    data: Iterable[tuple[Tensor, Tensor]],
    *,
    progress: bool | None = None,
    distributed: bool | None = None,
    **options: Any,
) -> dict[str, Tensor]:
    """Exact GGN diagonal of the empirical risk over a whole dataset.

    Args:
        model: As in :func:`ggnchunk.diag_ggn`.
        loss_func: As in :func:`ggnchunk.diag_ggn`; its ``reduction`` says how batches
            combine (``sum``: weight 1; ``mean``: weight ``batch_size / N``, N counted
            while iterating).
        data: A ``DataLoader`` or any iterable of ``(inputs, targets)`` batches, already
            on the model's device or on the CPU (then moved batch by batch).
        progress: Show a tqdm progress bar with the chunking in use; ``None`` shows it
            only when standard error is a terminal.
        distributed: ``None``: sum over the ranks of the default process group if one is
            initialized; ``True``: require one; ``False``: never communicate. Each rank
            iterates its own share (a ``DistributedSampler`` or the user's sharding);
            every rank ends with the same result.
        **options: Chunking options of :func:`ggnchunk.diag_ggn` for every batch.

    Returns:
        One tensor per trainable parameter, keyed and ordered as
        ``model.named_parameters()``.

    Raises:
        ValueError: If ``data`` yields no batch (on all ranks).
    """
    group = resolve_group(distributed, model)
    accumulator = DiagGGNAccumulator(model, loss_func, **options)
    device = next(p.device for p in model.parameters() if p.requires_grad)
    show = sys.stderr.isatty() if progress is None else bool(progress)
    bar = None
    if show:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(data) if hasattr(data, "__len__") else None,
                       desc="GGN diagonal", unit="batch")  # fmt: skip
        except ImportError:  # pragma: no cover - tqdm is a dependency
            bar = None
    try:
        for batch in data:
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise TypeError(
                    "data must yield (inputs, targets) pairs; got "
                    f"{type(batch).__name__}. Wrap your dataset so it yields pairs."
                )
            inputs, targets = (t.to(device) for t in batch)
            report = accumulator.update(inputs, targets)
            if bar is not None:
                bar.set_postfix(
                    columns_per_pass=report.chunk_size, passes=report.num_passes
                )
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if group is not None:
        if accumulator._sum is None:  # a rank without data still joins the collective
            accumulator._sum = {
                n: torch.zeros_like(p)
                for n, p in model.named_parameters()
                if p.requires_grad
            }
        accumulator.all_reduce(group)
    if accumulator.num_batches == 0:
        raise ValueError("data yielded no batch; pass a non-empty DataLoader or iterable.")
    return accumulator.compute()
