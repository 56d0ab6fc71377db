"""Public entry points: check arguments, plan chunks, run the engine, return a dict."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from math import inf

import torch
from torch import Tensor, nn

from ggnchunk._checks import Batch, check_batch, check_positive_int
from ggnchunk._distributed import rank_and_size, resolve_group
from ggnchunk._engine import (
    GGNComputation,
    Problem,
    check_kron_parameters,
    full_float32,
    model_lock,
)
from ggnchunk._kron import KronFactors, assemble
from ggnchunk._memory import PeakTracker, parse_memory
from ggnchunk._quantities import (
    DiagonalGGN,
    KroneckerFactors,
    PerSampleDiagonal,
    Quantity,
    Sampling,
)
from ggnchunk._scheduler import (
    ChunkScheduler,
    ScheduleReport,
    check_chunking,
    passes_within,
    plan_chunks,
    planning_share,
)


@dataclass
class GGNReport:
    """How :func:`diag_ggn` computed a diagonal (``return_report=True``).

    Attributes:
        num_columns: Columns of the loss Hessian's square root per forward pass.
        batch_chunks: ``(start, stop)`` sample ranges, one forward pass each.
        schedules: One :class:`~ggnchunk.ScheduleReport` per sample range.
        lean: Whether a tight ``max_memory`` made the passes lean: convolutions'
            patches unfolded one sample at a time in every pass instead of kept for the
            forward pass (less memory, more time).
    """

    num_columns: int = 0
    batch_chunks: list[tuple[int, int]] = field(default_factory=list)
    schedules: list[ScheduleReport] = field(default_factory=list)
    lean: bool = False

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


@dataclass(frozen=True)
class ChunkOptions:
    """The chunking arguments of a call, validated once at the entry point.

    Attributes:
        num_chunks: Fixed number of backward passes over the columns.
        chunk_size: Fixed largest chunk, or ``"auto"``.
        max_memory: Memory budget (bytes or a string with a unit).
        batch_chunk_size: Largest number of samples per forward pass.
        recover_oom: Split chunks that run out of memory.
        distributed: Chunk-parallel over the default process group.
    """

    num_chunks: int | None = None
    chunk_size: int | str | None = None
    max_memory: int | str | None = None
    batch_chunk_size: int | None = None
    recover_oom: bool = True
    distributed: bool = False

    def __post_init__(self) -> None:
        check_chunking(self.num_chunks, self.chunk_size, self.max_memory)
        if self.batch_chunk_size is not None:
            check_positive_int(self.batch_chunk_size, "batch_chunk_size")
        for name in ("recover_oom", "distributed"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"{name} must be True or False, got {getattr(self, name)!r}."
                )

    @property
    def measured(self) -> bool:
        """Whether the scheduler measures memory (budget and auto modes)."""
        return self.max_memory is not None or self.chunk_size == "auto"


def _cache_key(problem: Problem, batch: Batch) -> tuple:
    structure = tuple(
        (name, type(m).__name__, tuple((n, tuple(p.shape)) for n, p in m.named_parameters(
            recurse=False)))
        for name, m in problem.model.named_modules()
    )  # fmt: skip
    loss = problem.loss_func
    shapes = tuple((tuple(t.shape), t.dtype) for t in batch.tensors())
    return (
        structure, type(loss).__name__, getattr(loss, "reduction", None), shapes,
        problem.dtype, str(problem.device), torch.get_num_threads(),
    )  # fmt: skip


@dataclass
class _Evaluation:
    """What one batch gives: loss, gradient and diagonal, as lists in parameter order."""

    loss: Tensor
    gradient: list[Tensor]
    diagonal: list[Tensor]
    report: GGNReport
    normalizer: float  # of the mean reduction (1 for sum)
    names: list[str]
    factors: dict[str, KronFactors] | None = None  # kron_ggn (diagonal is empty)


def _share(columns: int, options: ChunkOptions, group) -> tuple[int, int, ChunkOptions]:
    """This rank's contiguous share of the columns, and the options for it.

    ``num_chunks``/``chunk_size`` describe the whole computation: the global plan is cut
    into one run of whole chunks per rank, so all ranks together run ``num_chunks``
    passes. Budget and auto modes give each rank an equal share and schedule it.
    """
    rank, size = rank_and_size(group)
    if options.num_chunks is not None or isinstance(options.chunk_size, int):
        chunks = plan_chunks(columns, options.num_chunks, options.chunk_size)
        parts = plan_chunks(len(chunks), num_chunks=size)
        if rank >= len(parts):
            return columns, columns, options
        first, last = parts[rank]
        local = replace(options, num_chunks=last - first, chunk_size=None)
        return chunks[first][0], chunks[last - 1][1], local
    shares = plan_chunks(columns, num_chunks=size)
    if rank >= len(shares):
        return columns, columns, options
    return shares[rank][0], shares[rank][1], options


def _plan_for_budget(
    run: GGNComputation, budget: int, level: int, total: int, device: torch.device
) -> bool:
    """Make the run's memory bounds for a budget; return whether it runs lean.

    Two choices, both by the passes budget mode would plan (:func:`passes_within`):

    - The chunk size the contraction forms are planned for. The bound made for all
      columns keeps the Gram form's factors of every layer where that form wins for a
      chunk of all columns; under a budget that only fits small chunks those factors
      would never be used, and reserving them makes the chunks smaller still. Plan for
      the size the budget gives without them where that needs fewer passes.
    - Lean (no per-forward caches) where that at least halves the passes, or where one
      column of the full bound does not fit the planning target (a budget that the
      caches nearly fill): the lean run's smaller bound is then the safer plan.

    Args:
        run: The computation, after its forward pass.
        budget: The budget in bytes.
        level: Bytes in use above the call's baseline (settled).
        total: Columns to compute.
        device: Where the work runs.

    Returns:
        Whether the run is lean (its bounds are set for the plan either way).
    """

    def passes(cost: tuple[int, int]) -> float:
        return passes_within(budget, device, level, *cost, total)

    full = (run.fixed_bytes(total), run.column_bytes())
    # the least any plan reserves: the Gram form only where it wins for one column
    fewest = passes((run.fixed_bytes(1), full[1]))
    small = (run.fixed_bytes(-(-total // fewest)), full[1]) if fewest < inf else full
    if passes(full) > 1 and passes(small) < passes(full):
        full = small
    else:
        run.fixed_bytes(total)
    run.set_lean(True)
    lean = (run.fixed_bytes(), run.column_bytes())  # the Gram form is chosen by memory
    target = planning_share(device) * budget
    if 2 * passes(lean) <= passes(full) or (
        target < level + sum(full) and sum(lean) < sum(full)
    ):
        return True
    run.set_lean(False)
    return False


QuantitySpec = Callable[[Problem, int], Quantity]
"""Makes the quantity of one forward pass: ``spec(problem, samples)``."""


def _compute(
    problem: Problem, batch: Batch, targets: Tensor | None, options: ChunkOptions,
    scale: float, spec: QuantitySpec, group=None, with_gradient: bool = False,
    sampling: Sampling | None = None,
) -> tuple[Quantity, Tensor, list[Tensor], GGNReport]:  # fmt: skip
    """Every sub-batch: forward, then the scheduled backward passes; merged results.

    Loss, gradient and quantity are those of ``scale * (the loss with reduction="sum")``
    (no loss and no gradient when ``problem.loss_func`` is ``None``). Returns the
    quantity of the first sub-batch with the later ones merged into it (and summed over
    the ranks of ``group``).
    """
    size = batch.size
    report = GGNReport(
        batch_chunks=plan_chunks(size, chunk_size=options.batch_chunk_size or size,
                                 what="samples")
    )  # fmt: skip
    params = problem.params
    merged: Quantity | None = None
    gradient = [torch.zeros_like(p) for p in params] if with_gradient else []
    loss = torch.zeros((), dtype=problem.dtype, device=problem.device)
    mean = problem.loss_func is not None and problem.loss_func.reduction == "mean"
    tracker = PeakTracker(problem.device) if options.measured else None
    baseline = (
        getattr(tracker, "settled", tracker.current)() if tracker is not None else None
    )
    for start, stop in report.batch_chunks:
        part = batch.slice(start, stop) if (start, stop) != (0, size) else batch
        sub_targets = targets[start:stop] if targets is not None else None
        quantity = spec(problem, stop - start)
        run = GGNComputation(problem, part, sub_targets, scale, quantity, sampling)
        with run:
            run.forward()
        columns = run.num_columns
        report.num_columns = columns
        first, last, local = 0, columns, options
        if group is not None:
            first, last, local = _share(columns, options, group)
        scheduler = ChunkScheduler(
            num_chunks=local.num_chunks, chunk_size=local.chunk_size,
            max_memory=local.max_memory, device=problem.device,
            recover_oom=local.recover_oom, what="columns", tracker=tracker,
            cache_key=_cache_key(problem, part),
        )  # fmt: skip

        def backward(a: int, b: int, run=run, first=first) -> None:
            run.backward(first + a, first + b)

        if last > first:
            if local.max_memory is not None and tracker is not None:
                level = max(0, getattr(tracker, "settled", tracker.current)() - baseline)
                lean = _plan_for_budget(run, parse_memory(local.max_memory), level,
                                        last - first, problem.device)  # fmt: skip
                report.lean = report.lean or lean
            else:  # the bounds for chunks of up to all columns
                run.fixed_bytes()

            def bound(run=run) -> tuple[int, int]:  # asked again after the first pass
                return run.fixed_bytes(), run.column_bytes()

            _, schedule = scheduler.run(
                last - first, backward, baseline=baseline, cost=bound
            )
            report.schedules.append(schedule)
        if with_gradient:
            grads = run.gradient()
        run.close()
        if run.loss is not None:
            # the sub-batch's loss is its own mean: back to the sum, then to the scale
            factor = scale * (
                float(problem.handler.normalizer(problem.loss_func, sub_targets))
                if mean else 1
            )  # fmt: skip
            loss += factor * run.loss
        if merged is None:
            merged = quantity  # no second parameter-sized buffer for one sub-batch
        else:
            merged.absorb(quantity)
        if with_gradient:
            for acc, grad in zip(gradient, grads, strict=True):
                if grad is not None:
                    acc.add_(grad, alpha=factor)
        del run, quantity
    if group is not None:
        merged.all_reduce(group)
    return merged, loss, gradient, report


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
    per_sample: bool = False,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
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
        per_sample: Return each sample's own GGN diagonal, ``[N, *param.shape]`` per
            parameter (``diag(J_n^T H_n J_n)``; they add up to the batch's diagonal).
            The result is ``N`` times larger and every parameter takes the per-sample
            products' path; the memory budget counts both.
        mc_samples: Monte-Carlo estimate instead of the exact value: the loss
            Hessian's square root ``S_n`` is replaced by ``k = mc_samples`` random
            columns ``S_n eps_j / sqrt(k)`` (``eps_j ~ N(0, I)``, independent per
            sample), an unbiased estimate (``E[S eps eps^T S^T] = H``) for every loss,
            computed with the same chunking, budget and sub-batches over ``k`` columns
            (``report.num_columns == k``). ``None`` (default): exact.
        generator: With ``mc_samples``: the ``torch.Generator`` one seed is drawn
            from per call (``None``: one draw from the global RNG per call).
        return_report: Also return a :class:`GGNReport` (chunk sizes, passes, peaks).

    Returns:
        One tensor per parameter with ``requires_grad``, keyed and ordered as
        ``model.named_parameters()``, each with the parameter's shape (``[N, *shape]``
        with ``per_sample=True``), dtype and device; with ``return_report=True``, the
        pair ``(diagonal, report)``.

    Raises:
        TypeError: For arguments of the wrong type (the message names the argument).
        ValueError: For unsupported layers or losses, mismatched shapes, devices or
            dtypes, and out-of-range or conflicting chunk arguments, before any backward
            pass.
        MemoryBudgetError: If ``max_memory`` is too small for one column per pass.

    Examples:
        >>> import torch, ggnchunk
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 4))
        >>> X = torch.randn(16, 4)
        >>> diag = ggnchunk.diag_ggn(model, torch.nn.MSELoss(), X, X, num_chunks=2)
        >>> [tuple(v.shape) for v in diag.values()]
        [(8, 4), (8,), (4, 8), (4,)]
    """
    options = ChunkOptions(
        num_chunks, chunk_size, max_memory, batch_chunk_size, recover_oom, distributed
    )
    if not isinstance(per_sample, bool):
        raise TypeError(f"per_sample must be True or False, got {per_sample!r}.")
    sampling = Sampling.of(mc_samples, generator)
    spec = PerSampleDiagonal if per_sample else DiagonalGGN
    result = _evaluate(
        model, loss_func, inputs, targets, options, spec=spec, sampling=sampling
    )
    diagonal = dict(zip(result.names, result.diagonal, strict=True))
    return (diagonal, result.report) if return_report else diagonal


def kron_ggn(
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
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
    return_report: bool = False,
) -> dict[str, KronFactors] | tuple[dict[str, KronFactors], GGNReport]:
    """Per-layer Kronecker factors of the exact GGN (KFLR), chunked to fit a budget.

    For every ``nn.Linear`` and ``nn.Conv1d/2d/3d`` (``groups=1``) layer, the factors
    ``G`` (``[C_out, C_out]``) and ``A`` (``[K, K]``, ``K`` the weight's fan-in) with
    ``G ⊗ A`` approximating the GGN block of ``weight.flatten()`` and ``G`` the exact
    GGN block of the bias — BackPACK's ``KFLR`` and laplace-torch's
    ``BackPackGGN(stochastic=False)`` factors (see :class:`KronFactors`). ``G`` sums over
    the columns of the loss Hessian's square root, so it is split into chunks of columns
    exactly like :func:`diag_ggn`'s diagonal, with the same options and memory budget;
    ``A`` needs the layer inputs only and is computed once per forward pass.

    A Linear on ``[N, ..., D]`` is treated as a 1×1 convolution over the extra axes:
    ``s`` is summed over them before its outer product, and ``A`` sums ``u u^T`` over
    them (BackPACK accepts ``[N, D]`` inputs only).

    Args:
        model: A model whose trainable parameters are all weights and biases of
            ``nn.Linear`` or ``nn.Conv1d/2d/3d`` layers (``groups=1``), each called once
            per forward pass; any other layers (activations, pooling, normalization
            without trainable parameters, glue) are allowed. Freeze other parameters
            with ``requires_grad_(False)``.
        loss_func: Any loss :func:`diag_ggn` accepts.
        inputs: As in :func:`diag_ggn`.
        targets: As in :func:`diag_ggn`.
        num_chunks: As in :func:`diag_ggn`.
        chunk_size: As in :func:`diag_ggn`.
        max_memory: As in :func:`diag_ggn` (the factors are counted).
        batch_chunk_size: As in :func:`diag_ggn`; ``A`` is normalized by the whole
            batch's size.
        recover_oom: As in :func:`diag_ggn`.
        distributed: As in :func:`diag_ggn` (output factors summed over the ranks).
        mc_samples: As in :func:`diag_ggn`: output factors from ``k`` sampled columns
            (unbiased; BackPACK's ``KFAC``-style Monte-Carlo estimate of ``G``).
        generator: As in :func:`diag_ggn`.
        return_report: Also return a :class:`GGNReport`.

    Returns:
        ``{layer name: KronFactors}`` in the order of ``model.named_parameters()``; with
        ``return_report=True``, the pair ``(factors, report)``.

    Raises:
        TypeError: For arguments of the wrong type (the message names the argument).
        ValueError: For a trainable parameter without Kronecker factors (named, before
            any work), a layer called twice or with shared parameters, and everything
            :func:`diag_ggn` refuses.
        MemoryBudgetError: If ``max_memory`` is too small for one column per pass.

    Examples:
        >>> import torch, ggnchunk
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> X, y = torch.randn(16, 4), torch.randn(16, 3)
        >>> factors = ggnchunk.kron_ggn(model, torch.nn.MSELoss(), X, y, num_chunks=2)
        >>> {k: (tuple(f.output.shape), tuple(f.input.shape)) for k, f in factors.items()}
        {'0': ((8, 8), (4, 4)), '2': ((3, 3), (8, 8))}
    """
    options = ChunkOptions(
        num_chunks, chunk_size, max_memory, batch_chunk_size, recover_oom, distributed
    )
    sampling = Sampling.of(mc_samples, generator)
    result = _evaluate(
        model, loss_func, inputs, targets, options, spec=KroneckerFactors,
        sampling=sampling,
    )  # fmt: skip
    return (result.factors, result.report) if return_report else result.factors


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

    Examples:
        >>> import torch, ggnchunk
        >>> model = torch.nn.Linear(3, 2)
        >>> X, y = torch.randn(8, 3), torch.randn(8, 2)
        >>> loss_func = torch.nn.MSELoss()
        >>> loss, grad, diag = ggnchunk.loss_grad_and_diag_ggn(model, loss_func, X, y)
        >>> bool(torch.allclose(loss, loss_func(model(X), y)))
        True
    """
    options = ChunkOptions(
        num_chunks, chunk_size, max_memory, batch_chunk_size, recover_oom
    )
    result = _evaluate(model, loss_func, inputs, targets, options, need_gradient=True)
    names = result.names
    return (
        result.loss,
        dict(zip(names, result.gradient, strict=True)),
        dict(zip(names, result.diagonal, strict=True)),
    )


def _evaluate(
    model, loss_func, inputs, targets, options: ChunkOptions,
    scale: float | None = None, need_gradient: bool = False,
    spec: QuantitySpec = DiagonalGGN, sampling: Sampling | None = None,
) -> _Evaluation:  # fmt: skip
    """Check everything, then compute; ``scale=None`` follows the loss's reduction.

    ``spec`` makes each forward pass's quantity (:mod:`ggnchunk._quantities`); its merged
    result is ``diagonal`` (a list per parameter) or, for ``KroneckerFactors``, the
    assembled ``factors``.
    """
    problem = Problem.build(model, loss_func)
    if spec is KroneckerFactors:
        check_kron_parameters(problem)
    batch = check_batch(
        list(zip(problem.names, problem.params, strict=True)), inputs, targets
    )
    group = resolve_group(True, model) if options.distributed else None
    loss_func = problem.loss_func
    normalizer = 1.0
    if loss_func.reduction == "mean":
        normalizer = float(problem.handler.normalizer(loss_func, targets))
    if scale is None:
        scale = 1.0 / normalizer
    # autocast would cast the sweeps' products too: everything runs in the parameters'
    # dtype (float32 for a float32 model under autocast), as the README says; and float32
    # in full float32 (TF32 convolutions, cuDNN's default, change results at 1e-3)
    with (
        model_lock(model),
        torch.autocast(problem.device.type, enabled=False),
        full_float32(),
    ):
        quantity, loss, gradient, report = _compute(
            problem, batch, targets.detach(), options, scale, spec, group,
            need_gradient, sampling,
        )  # fmt: skip
    if isinstance(quantity, KroneckerFactors):
        factors = assemble(model, problem.names, *quantity.final(), samples=batch.size)
        return _Evaluation(loss, gradient, [], report, normalizer, problem.names, factors)
    return _Evaluation(loss, gradient, quantity.final(), report, normalizer, problem.names)
