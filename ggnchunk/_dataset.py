"""GGN diagonals of a whole dataset: a streaming accumulator and a one-call loop.

The diagonal of the empirical risk over a dataset, as the loss's ``reduction`` defines
it: each batch contributes the diagonal of its *summed* loss, and for ``mean`` the total
is divided by the dataset's normalizer (the number of loss terms, or the sum of class
weights of the counted targets for a weighted cross-entropy), counted while iterating.
For plain losses that is weight ``batch_size / N`` per batch; for ``sum`` weight 1.

Batches are ``(inputs, targets)`` pairs, ``inputs`` as in :func:`ggnchunk.diag_ggn` (a
tensor, a tuple/list for ``model(*inputs)``, a dict for ``model(**inputs)``), or dict
batches in laplace-torch's convention (a Hugging Face-style ``{"input_ids": ...,
"labels": ...}``): the whole dict is the model's one argument, ``model(batch)``, the
targets are ``batch[dict_key_y]``, and ``batch[dict_key_x]`` is the batched input.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ggnchunk._api import ChunkOptions, GGNReport, evaluate
from ggnchunk._checks import random_state_kept_on_error, warnings_once
from ggnchunk._distributed import all_reduce_sum, resolve_group
from ggnchunk._quantities import Sampling
from ggnchunk._sqrt_hessians import FunctionLoss, as_loss_module, averages

__all__ = ["DiagGGNAccumulator", "diag_ggn_dataset"]

_PAIR_OR_DICT = (
    "an (inputs, targets) pair (inputs: a tensor, a tuple/list of model arguments or a "
    "dict of keyword arguments) or a dict batch holding the targets under dict_key_y"
)


class _MappingCall(nn.Module):
    """Calls ``model(mapping)`` when ggnchunk's engine calls ``self(**mapping)``.

    laplace-torch passes a dict batch whole to the model; the engine splits, checks and
    detaches the tensors of a dict of keyword arguments. This adapter rebuilds the
    mapping (of the batch's own type where it can be rebuilt from a dict) and makes the
    one call. Its parameters are the model's, named ``model.<name>``.

    Args:
        model: The model that takes one mapping.
        kind: The mapping type to rebuild (``dict`` where the batch's own type cannot be
            built from a dict).
    """

    def __init__(self, model: nn.Module, kind: type):
        super().__init__()
        self.model = model
        self.kind = kind
        self.training = model.training  # the flag only: the model's modes stay as they are

    def forward(self, **entries: Any) -> Any:
        """Call the model with the rebuilt mapping.

        Args:
            **entries: The mapping's entries.

        Returns:
            The model's output.
        """
        return self.model(self.kind(entries))


def mapping_call(model: nn.Module, batch: Mapping) -> tuple[nn.Module, dict[str, Any]]:
    """The model and inputs that make the engine call ``model(batch)`` (laplace-torch).

    Args:
        model: The model, which takes the whole mapping as its one argument.
        batch: The dict batch.

    Returns:
        ``(adapter, entries)``: ``diag_ggn(adapter, loss, entries, targets)`` calls
        ``model(batch)``; the adapter's parameter names carry the prefix ``model.``.

    Raises:
        TypeError: If a key of ``batch`` is not a string.
    """
    keys = [k for k in batch if not isinstance(k, str)]
    if keys:
        raise TypeError(
            f"dict batches must have string keys, got {keys[:3]}; use string keys such "
            "as 'input_ids' and 'labels'."
        )
    entries = dict(batch)
    kind: type = type(batch)
    if kind is not dict:
        try:
            kind(entries)
        except Exception:  # a mapping type that is not built from a dict
            kind = dict
    return _MappingCall(model, kind), entries


def split_batch(
    batch: Any, dict_key_x: str, dict_key_y: str, where: str = "each batch of data"
) -> tuple[Any, Tensor, bool]:
    """Inputs and targets of one loader batch.

    Args:
        batch: An ``(inputs, targets)`` pair or a dict batch (laplace-torch's
            convention: targets under ``dict_key_y``, the batched input under
            ``dict_key_x``, the whole dict passed to the model).
        dict_key_x: Key of the batched input tensor in dict batches.
        dict_key_y: Key of the targets in dict batches.
        where: What the batch is, for error messages.

    Returns:
        ``(inputs, targets, whole)``: ``whole`` is ``True`` for a dict batch, whose
        inputs (the dict) go to the model as its one argument (see :func:`mapping_call`).

    Raises:
        TypeError: For a batch that is neither a pair nor a dict, or non-tensor targets.
        KeyError: For a dict batch without ``dict_key_x`` or ``dict_key_y``.
        ValueError: If ``batch[dict_key_x]`` does not have the targets' batch size.
    """
    if isinstance(batch, Mapping):
        for name, key in (("dict_key_y", dict_key_y), ("dict_key_x", dict_key_x)):
            if key not in batch:
                raise KeyError(
                    f"{where} is a dict without the key {name}={key!r} "
                    f"(keys: {sorted(map(str, batch))}); pass {name}=<the key of the "
                    f"{'targets' if name == 'dict_key_y' else 'batched input tensor'}>."
                )
        targets, first = batch[dict_key_y], batch[dict_key_x]
        if not isinstance(targets, Tensor):
            raise TypeError(
                f"{where} is a dict whose {dict_key_y!r} entry "
                f"(dict_key_y) is a {type(targets).__name__}, not a tensor of targets; "
                "return tensors from the collate function."
            )
        size = targets.shape[0] if targets.dim() else None
        if not isinstance(first, Tensor) or first.dim() == 0 or first.shape[0] != size:
            shape = (
                tuple(first.shape) if isinstance(first, Tensor) else type(first).__name__
            )
            raise ValueError(
                f"{where} is a dict whose {dict_key_x!r} entry (dict_key_x) "
                f"has shape {shape} but the targets have shape {tuple(targets.shape)}; "
                "dict_key_x must name a tensor with the batch on axis 0, as long as the "
                "targets under dict_key_y."
            )
        return batch, targets, True
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, targets = batch
        if not isinstance(targets, Tensor):
            raise TypeError(
                f"{where} is a pair whose second item (the targets) is a "
                f"{type(targets).__name__}, not a tensor; yield (inputs, targets) pairs."
            )
        return inputs, targets, False
    what = (
        f"a {type(batch).__name__} of {len(batch)} items"
        if isinstance(batch, (tuple, list))
        else type(batch).__name__
    )
    raise TypeError(
        f"{where} must be {_PAIR_OR_DICT}; got {what}. Pack several model "
        "inputs as ((x1, x2), targets) or yield dicts."
    )


def _to_device(value: Any, device: torch.device) -> Any:
    """Move every tensor in nested tuples, lists and mappings to ``device``.

    Args:
        value: A tensor, a tuple/list/mapping of them (nested), or anything else.
        device: The target device.

    Returns:
        The same structure (a mapping keeps its type where it can be rebuilt from a
        dict) with its tensors on ``device``.
    """
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, Mapping):
        moved = {k: _to_device(v, device) for k, v in value.items()}
        if type(value) is not dict:
            try:
                return type(value)(moved)
            except Exception:  # a mapping type that is not built from a dict
                return moved
        return moved
    return value


_STATE_KEYS = ("sum", "normalizer", "num_samples", "num_batches")


def _loss_tag(loss: nn.Module) -> str:
    """What a checkpoint records of its loss: the class (or function) and reduction.

    Args:
        loss: The accumulator's loss module.

    Returns:
        For example ``"MSELoss(reduction='mean')"``.
    """
    if isinstance(loss, FunctionLoss):
        name = getattr(loss.fn, "__qualname__", "function")
    else:
        name = type(loss).__name__
    return f"{name}(reduction={getattr(loss, 'reduction', None)!r})"


class DiagGGNAccumulator:
    """Streaming GGN diagonal: ``update`` per batch, ``compute`` at the end.

    Useful for online use (EWC, running Laplace fits): the state is a sum of per-batch
    diagonals plus the normalizer, so batches can come from anywhere and in any sizes,
    and ``state_dict``/``load_state_dict`` checkpoint it.

    Args:
        model: As in :func:`ggnchunk.diag_ggn`.
        loss_func: As in :func:`ggnchunk.diag_ggn`.
        dict_key_x: Key of the batched input tensor in dict batches passed to
            :meth:`update` (laplace-torch's convention).
        dict_key_y: Key of the targets in dict batches passed to :meth:`update`.
        mc_samples: Monte-Carlo estimate from this many sampled columns per batch
            (see :func:`ggnchunk.diag_ggn`); ``None``: exact.
        generator: With ``mc_samples``: one seed is drawn from it per batch
            (``None``: one draw from the global RNG per batch).
        options: The chunking settings for every batch, as one
            :class:`~ggnchunk.ChunkOptions` (optional).
        **chunking: Or the same settings as keywords (the fields of
            :class:`~ggnchunk.ChunkOptions`: ``num_chunks``, ``chunk_size``,
            ``max_memory``, ``batch_chunk_size``, ``recover_oom``, ``column_parallel``,
            ``progress``).

    Examples:
        >>> import torch, ggnchunk
        >>> model = torch.nn.Linear(3, 2)
        >>> acc = ggnchunk.DiagGGNAccumulator(model, torch.nn.MSELoss(), num_chunks=2)
        >>> for _ in range(3):
        ...     _ = acc.update(torch.randn(4, 3), torch.randn(4, 2))
        >>> acc.num_samples, sorted(acc.compute())
        (12, ['bias', 'weight'])
    """

    def __init__(
        self,
        model: nn.Module,
        loss_func: nn.Module,
        *,
        options: ChunkOptions | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        mc_samples: int | None = None,
        generator: torch.Generator | None = None,
        **chunking: Any,
    ):
        self.options = ChunkOptions.resolve(options, chunking, "DiagGGNAccumulator")
        Sampling.of(mc_samples, generator)  # checked here, before any batch
        self.mc_samples, self.generator = mc_samples, generator
        # a plain function loss(output, target) is a sum (its module form says so)
        self.model, self.loss_func = model, as_loss_module(loss_func)
        self.dict_key_x, self.dict_key_y = dict_key_x, dict_key_y
        self.reset()

    def reset(self) -> None:
        """Forget every batch seen so far."""
        self._sum: dict[str, Tensor] | None = None
        self.normalizer = 0.0
        self.num_samples = 0
        self.num_batches = 0
        self.last_report: GGNReport | None = None

    def update(self, inputs: Any, targets: Tensor | None = None) -> GGNReport:
        """Add one batch.

        Args:
            inputs: Batch inputs as in :func:`ggnchunk.diag_ggn`: a tensor ``[B, ...]``,
                a tuple/list (``model(*inputs)``) or a dict (``model(**inputs)``). Without
                ``targets``: a whole loader batch, an ``(inputs, targets)`` pair or a
                dict batch in laplace-torch's convention (targets under ``dict_key_y``,
                the whole dict passed to the model: ``model(batch)``).
            targets: Batch targets, batch on axis 0; ``None`` when ``inputs`` is a batch.

        Returns:
            How the batch was chunked.
        """
        model, whole = self.model, False
        if targets is None:
            inputs, targets, whole = split_batch(
                inputs, self.dict_key_x, self.dict_key_y, where="update()'s batch"
            )
            if whole:
                model, inputs = mapping_call(self.model, inputs)
        result = evaluate(
            model, self.loss_func, inputs, targets, self.options, scale=1.0,
            sampling=Sampling.of(self.mc_samples, self.generator),
        )  # fmt: skip
        names = [n.removeprefix("model.") for n in result.names] if whole else result.names
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
        if averages(self.loss_func):
            return {name: value / self.normalizer for name, value in total.items()}
        return {name: value.clone() for name, value in total.items()}

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint of the accumulated state (tensors are copies).

        Returns:
            ``{"sum": {name: tensor}, "normalizer", "num_samples", "num_batches",
            "loss"}``; ``"loss"`` names the loss and its reduction, so that a checkpoint
            is not resumed with another loss.
        """
        return {
            "sum": None
            if self._sum is None
            else {k: v.clone() for k, v in self._sum.items()},
            "normalizer": self.normalizer,
            "num_samples": self.num_samples,
            "num_batches": self.num_batches,
            "loss": _loss_tag(self.loss_func),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint made by :meth:`state_dict`.

        Args:
            state: The checkpoint.

        Raises:
            TypeError: If ``state`` is not a mapping.
            ValueError: If a key is missing, if its parameter names or shapes differ
                from the model's, or if it was made with another loss.
        """
        if not isinstance(state, Mapping):
            raise TypeError(
                f"state must be a dict made by DiagGGNAccumulator.state_dict(), got "
                f"{type(state).__name__}."
            )
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(
                f"state lacks {missing}; load a checkpoint made by "
                "DiagGGNAccumulator.state_dict() (it holds "
                f"{[*_STATE_KEYS, 'loss']})."
            )
        tag, mine = state.get("loss"), _loss_tag(self.loss_func)
        if tag is not None and tag != mine:  # checkpoints before the tag have none
            raise ValueError(
                f"state was accumulated with the loss {tag}, but this accumulator's "
                f"loss is {mine}: a diagonal of one loss cannot be continued with "
                "another; make the accumulator with the checkpoint's loss."
            )
        names = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        total = state["sum"]
        if total is not None:
            if list(total) != list(names):
                raise ValueError(
                    "state['sum'] does not match the model's trainable parameters "
                    f"(names {list(total)[:3]}... vs {list(names)[:3]}...); load a "
                    "checkpoint made with the same model."
                )
            for name, param in names.items():
                if total[name].shape != param.shape:
                    raise ValueError(
                        f"state['sum'][{name!r}] has shape {tuple(total[name].shape)}, "
                        f"but the model's parameter has {tuple(param.shape)}; load a "
                        "checkpoint made with the same model."
                    )
            total = {n: total[n].to(p) for n, p in names.items()}
        self._sum = total
        self.normalizer = float(state["normalizer"])
        self.num_samples = int(state["num_samples"])
        self.num_batches = int(state["num_batches"])

    def all_reduce(self, group: Any = None) -> None:
        """Sum the state over the ranks of a process group (all ranks must call it).

        A rank that saw no batch joins with zeros (the others would otherwise wait in
        the collective until the group's timeout).

        Args:
            group: A ``torch.distributed`` process group; ``None`` for the default one.

        Raises:
            ValueError: If the accumulator's options split columns over the ranks
                (``column_parallel=True``): each update already summed the ranks'
                shares of one same batch, and summing again would count it once per
                rank.
        """
        if self.options.column_parallel:
            raise ValueError(
                "DiagGGNAccumulator.all_reduce sums the ranks' own batches, but this "
                "accumulator has column_parallel=True: each update already summed the "
                "ranks' shares of one batch, the same on every rank. Do not call "
                "all_reduce then, or make the accumulator without column_parallel and "
                "give each rank its own batches."
            )
        if self._sum is None:  # a rank without data still joins the collective
            self._sum = {
                n: torch.zeros_like(p)
                for n, p in self.model.named_parameters()
                if p.requires_grad
            }
        total = self._sum
        scalars = torch.tensor(
            [self.normalizer, float(self.num_samples), float(self.num_batches)],
            dtype=torch.float64,
        )
        reduced, scalars = all_reduce_sum(list(total.values()), scalars, group)
        self._sum = dict(zip(total, reduced, strict=True))
        self.normalizer = float(scalars[0])
        self.num_samples, self.num_batches = int(scalars[1]), int(scalars[2])
        if self.num_batches == 0:  # no rank saw a batch
            self._sum = None


def _refuse_padded_sampler(data: object) -> None:
    """Refuse a ``DistributedSampler`` that repeats samples to even out the ranks.

    With ``drop_last=False`` (its default) it pads the dataset with copies of its first
    samples up to a multiple of the ranks, so their curvature would count twice: 10
    samples on 3 ranks gave a diagonal 17% off.

    Args:
        data: The ``data`` argument of :func:`diag_ggn_dataset`.

    Raises:
        ValueError: If ``data`` is a ``DataLoader`` with such a sampler.
    """
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    if not isinstance(data, DataLoader):
        return
    inner = getattr(data.batch_sampler, "sampler", None)
    for sampler in (data.sampler, inner):
        if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
            continue
        extra = sampler.total_size - len(sampler.dataset)  # type: ignore[arg-type]
        if extra > 0:
            raise ValueError(
                f"data's DistributedSampler repeats {extra} sample(s) so that "
                f"{len(sampler.dataset)} samples split evenly over "  # type: ignore[arg-type]
                f"{sampler.num_replicas} ranks; their curvature would count twice. "
                "Give each rank its share without repeats instead, e.g. "
                "DataLoader(Subset(dataset, range(rank, len(dataset), world_size)), "
                "batch_size=...) (ranks may hold different numbers of samples)."
            )


def diag_ggn_dataset(
    model: nn.Module,
    loss_func: nn.Module,
    data: Iterable[Any],
    *,
    dict_key_x: str = "input_ids",
    dict_key_y: str = "labels",
    progress: bool | None = None,
    distributed: bool | None = None,
    options: ChunkOptions | None = None,
    **chunking: Any,
) -> dict[str, Tensor]:
    """Exact GGN diagonal of the empirical risk over a whole dataset.

    Args:
        model: As in :func:`ggnchunk.diag_ggn`.
        loss_func: As in :func:`ggnchunk.diag_ggn`; its ``reduction`` says how batches
            combine (``sum``: weight 1; ``mean``: weight ``batch_size / N``, N counted
            while iterating).
        data: A ``DataLoader`` or any iterable of batches, already on the model's device
            or on the CPU (then moved batch by batch, nested tensors too). A batch is an
            ``(inputs, targets)`` pair, ``inputs`` as in :func:`ggnchunk.diag_ggn` (a
            tensor, a tuple/list for ``model(*inputs)``, a dict for
            ``model(**inputs)``), or a dict batch in laplace-torch's convention: the
            targets are ``batch[dict_key_y]`` and the whole dict is the model's one
            argument, ``model(batch)``.
        dict_key_x: Key of the batched input tensor in dict batches (its axis 0 must be
            the targets' batch size).
        dict_key_y: Key of the targets in dict batches.
        progress: Show a tqdm progress bar with the chunking in use; ``None`` shows it
            only when standard error is a terminal.
        distributed: ``None``: sum over the ranks of the default process group if one is
            initialized; ``True``: require one; ``False``: never communicate. Each rank
            iterates its own share, without repeats (e.g. ``Subset(dataset,
            range(rank, len(dataset), world_size))``; a ``DistributedSampler`` that pads
            with copies is refused); every rank ends with the same result.
        options: The chunking settings for every batch, as one
            :class:`~ggnchunk.ChunkOptions` (optional); its ``progress`` shows a bar
            over the backward passes within each batch.
        **chunking: Or the same settings as keywords, as in :func:`ggnchunk.diag_ggn`,
            and ``mc_samples``/``generator`` of :class:`DiagGGNAccumulator`
            (Monte-Carlo columns, one seed per batch).

    Returns:
        One tensor per trainable parameter, keyed and ordered as
        ``model.named_parameters()``.

    Raises:
        ValueError: If ``data`` yields no batch (on all ranks), if its
            ``DistributedSampler`` repeats samples, or if ``column_parallel=True`` is
            given with a process group.
        TypeError: If a batch is neither an ``(inputs, targets)`` pair nor a dict.
        KeyError: If a dict batch lacks ``dict_key_x`` or ``dict_key_y``.

    Examples:
        >>> import torch, ggnchunk
        >>> class Net(torch.nn.Module):  # a model that takes a dict batch whole
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.linear = torch.nn.Linear(3, 2)
        ...     def forward(self, batch):
        ...         return self.linear(batch["input_ids"])
        >>> data = [{"input_ids": torch.randn(4, 3), "labels": torch.randn(4, 2)}]
        >>> diag = ggnchunk.diag_ggn_dataset(Net(), torch.nn.MSELoss(), data,
        ...                                  progress=False)
        >>> sorted(diag)
        ['linear.bias', 'linear.weight']
    """
    if isinstance(data, (Tensor, str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(
            f"data must be a DataLoader or another iterable of (inputs, targets) batches, "
            f"got {type(data).__name__}; wrap tensors as DataLoader(TensorDataset(X, y), "
            "batch_size=...)."
        )
    _refuse_padded_sampler(data)
    sampling = {k: chunking.pop(k) for k in ("mc_samples", "generator") if k in chunking}
    options = ChunkOptions.resolve(options, chunking, "diag_ggn_dataset")
    group = resolve_group(distributed, model)
    if group is not None and options.column_parallel:
        raise ValueError(
            "diag_ggn_dataset: column_parallel=True splits one batch's columns over the "
            "ranks, but with a process group each rank iterates its own batches and the "
            "ranks' sums are added (data-parallel); the two together would split "
            "different batches. Leave column_parallel out (each rank iterates its share "
            "of the data), or pass distributed=False with column_parallel=True and the "
            "same batches, in the same order, on every rank."
        )
    accumulator = DiagGGNAccumulator(
        model,
        loss_func,
        options=options,
        dict_key_x=dict_key_x,
        dict_key_y=dict_key_y,
        **sampling,
    )
    device = next(p.device for p in model.parameters() if p.requires_grad)
    show = sys.stderr.isatty() if progress is None else bool(progress)
    bar = None
    if show:
        try:  # tqdm is optional (ggnchunk[progress]): imported only when a bar is shown
            from tqdm.auto import tqdm
        except ImportError:
            if progress:
                raise ImportError(
                    "progress=True needs tqdm: pip install tqdm (or ggnchunk[progress])."
                ) from None
        else:
            bar = tqdm(total=len(data) if hasattr(data, "__len__") else None,
                       desc="GGN diagonal", unit="batch")  # fmt: skip
    try:
        # a finding about the model said once, not per batch; a loop that raises (a
        # bad batch, an interrupt) leaves the random state as it was, as diag_ggn does
        with warnings_once(), random_state_kept_on_error(device):
            for batch in data:
                split_batch(batch, dict_key_x, dict_key_y)  # its shape, before any copy
                report = accumulator.update(_to_device(batch, device))
                if bar is not None:
                    bar.set_postfix(
                        columns_per_pass=report.chunk_size, passes=report.num_passes
                    )
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if group is not None:
        accumulator.all_reduce(group)  # a rank without data joins with zeros
    if accumulator.num_batches == 0:
        raise ValueError("data yielded no batch; pass a non-empty DataLoader or iterable.")
    return accumulator.compute()
