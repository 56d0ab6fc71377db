"""Public entry points: check arguments, plan chunks, run the engine, return a dict."""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from math import inf
from typing import Any

import torch
from torch import Tensor, nn

from ggnchunk import _scheduling, _windows
from ggnchunk._autograd import forward_tensor_hooks_off, parameter_hooks_off
from ggnchunk._checks import (
    Batch,
    check_batch,
    check_positive_int,
    random_state_kept_on_error,
    usable,
    warnings_once,
)
from ggnchunk._distributed import (
    check_same_output,
    check_same_work,
    rank_and_size,
    resolve_group,
)
from ggnchunk._engine import (
    GGNComputation,
    Problem,
    check_kron_parameters,
    full_float32,
    model_lock,
)
from ggnchunk._kron import KronFactors, assemble
from ggnchunk._memory import MemoryBackend, memory_backend, parse_memory
from ggnchunk._quantities import (
    DiagonalGGN,
    KroneckerFactors,
    PerSampleDiagonal,
    Quantity,
    Sampling,
)
from ggnchunk._rules import ConvRule, FoldedRule
from ggnchunk._rules.folded import _FOLDED
from ggnchunk._scheduling import (
    ChunkScheduler,
    MemoryBudgetError,
    ScheduleReport,
    check_chunking,
    passes_within,
    plan_chunks,
    planning_share,
)
from ggnchunk._sqrt_hessians import AutogradLossSqrtHessian, averages
from ggnchunk._warmup import ensure_batched_autograd, ensure_matmul_pool, warm_up_for


@dataclass
class GGNReport:
    """How :func:`diag_ggn` computed a diagonal (``return_report=True``).

    Attributes:
        num_columns: Columns of the loss Hessian's square root per forward pass.
        batch_chunks: ``(start, stop)`` sample ranges, one forward pass each.
        schedules: One :class:`~ggnchunk.ScheduleReport` per sample range, two where
            the passes stopped where the columns span few directions (a segmenter's
            classifiers below its resize) and the second swept their Gram's factor
            from there (its ``factor`` set; docs: budgets, "Passes that stop at a
            cut").
        lean: Whether a tight ``max_memory`` made the passes lean: convolutions'
            patches unfolded one sample at a time in every pass instead of kept for the
            forward pass (less memory, more time).
        windowed: Whether the passes carried each column on the box of the map where
            it can be non-zero (image-shaped outputs with MSE, BCE or cross-entropy;
            see "How it works" in the docs).
        window_ends: Where windowed columns became dense vectors (their boxes covered
            most of the map there), ``{place: reason}``; empty if they stayed windowed
            to the end or no pass was windowed.
        setup_seconds: Time this call spent on the process's one-time set-up
            (``torch.func``'s set-up; on CUDA also kernels and library handles set up
            by a small warm-up computation), paid once per process (and kind of layer)
            by the first call with ``max_memory`` or ``chunk_size="auto"``; 0 on later
            calls and without a budget.
        setup_bytes: Resident memory of the process's one-time set-up, which
            ``max_memory`` does not count: what the set-up left behind (paid before the
            call's memory baseline, as if on a later call) and, on the CPU, the
            libraries' code the call paged in (pages mapped from files, shared and
            reclaimable, never counted on the CPU).
    """

    num_columns: int = 0
    batch_chunks: list[tuple[int, int]] = field(default_factory=list)
    schedules: list[ScheduleReport] = field(default_factory=list)
    lean: bool = False
    windowed: bool = False
    window_ends: dict[str, str] = field(default_factory=dict)
    setup_seconds: float = 0.0
    setup_bytes: int = 0

    @property
    def chunk_size(self) -> int:
        """Largest number of the square root's columns in one backward pass.

        The passes below a cut, over its Gram factor's columns, are not counted
        (their schedules have ``factor`` set).
        """
        schedules = [s for s in self.schedules if not s.factor] or self.schedules
        return max(max(c.stop - c.start for c in s.chunks) for s in schedules)

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

    def __repr__(self) -> str:
        """A one-line summary (the chunk records are in ``schedules``)."""
        chunk = self.chunk_size if self.schedules else None
        return (
            f"GGNReport(columns={self.num_columns}, passes={self.num_passes}, "
            f"chunk_size={chunk}, sub_batches={len(self.batch_chunks)}, "
            f"peak={_mib(self.peak_extra_bytes)}, lean={self.lean}, "
            f"windowed={self.windowed})"
        )


def _mib(value: float | None) -> str:
    return "not measured" if value is None else f"{value / 2**20:.1f} MiB"


@dataclass(frozen=True)
class ChunkOptions:
    """How a call splits its work: the chunking keywords, defined once, validated once.

    Every entry point (:func:`diag_ggn`, :func:`kron_ggn`,
    :func:`loss_grad_and_diag_ggn`, :func:`diag_ggn_dataset`,
    :class:`DiagGGNAccumulator` and the laplace-torch backend ``ChunkedGGN``) takes
    either ``options=ChunkOptions(...)`` or these fields as keyword arguments (or both,
    when they agree); an unknown keyword or a keyword that contradicts ``options``
    raises before any work.

    Attributes:
        num_chunks: Number of backward passes over the columns (chunk sizes differ by
            at most one; more chunks than columns give one column per pass).
        chunk_size: Largest number of columns per backward pass, or ``"auto"``: the
            fastest chunk size that fits ``max_memory`` (or 90% of the free device
            memory), found by timing real chunks and remembered for later calls with
            the same model, shapes and threads.
        max_memory: Budget for the peak memory the call adds above what was in use
            before it: bytes or a string such as ``"512MiB"``, ``"2GiB"``, ``"1.5GB"``.
            On CPU memory is the resident set size, on CUDA the caching allocator's
            allocated bytes.
        batch_chunk_size: Also split the batch into sub-batches of at most this many
            samples, each with its own forward pass (exact for ``mean`` and ``sum``).
        recover_oom: If a backward pass runs out of memory, split its chunk in halves
            and retry, keeping finished chunks (warns once).
        column_parallel: Split the columns over the ranks of the default
            ``torch.distributed`` process group (which must be initialized): every rank
            runs the forward pass on the same batch and its share of the columns, then
            the results are summed with one ``all_reduce``. ``False``: no
            communication. (Data parallelism, each rank its own batches, is
            :func:`diag_ggn_dataset`'s ``distributed``.)
        progress: Show a tqdm progress bar over the backward passes (needs ``tqdm``,
            ``pip install ggnchunk[progress]``).
    """

    num_chunks: int | None = None
    chunk_size: int | str | None = None
    max_memory: int | str | None = None
    batch_chunk_size: int | None = None
    recover_oom: bool = True
    column_parallel: bool = False
    progress: bool = False

    def __post_init__(self) -> None:
        check_chunking(self.num_chunks, self.chunk_size, self.max_memory)
        if self.batch_chunk_size is not None:
            check_positive_int(self.batch_chunk_size, "batch_chunk_size")
        for name in ("recover_oom", "column_parallel", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"{name} must be True or False, got {getattr(self, name)!r}."
                )

    def __repr__(self) -> str:
        given = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != f.default
        ]
        return f"ChunkOptions({', '.join(given)})"

    @property
    def measured(self) -> bool:
        """Whether the scheduler measures memory (budget and auto modes)."""
        return self.max_memory is not None or self.chunk_size == "auto"

    @classmethod
    def resolve(
        cls, options: ChunkOptions | None, chunking: dict[str, Any], where: str
    ) -> ChunkOptions:
        """The options of a call from ``options=`` and/or the chunking keywords.

        Args:
            options: A :class:`ChunkOptions` or ``None``.
            chunking: The keyword arguments given, each a field of this class.
            where: The entry point's name, for the messages.

        Returns:
            The validated options.

        Raises:
            TypeError: For an unknown keyword or ``options`` of another type.
            ValueError: For a keyword that contradicts ``options``.
        """
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(chunking) - set(names))
        if unknown:
            raise TypeError(
                f"{where} got unknown keyword argument(s) {unknown}; its chunking "
                f"keywords are the fields of ggnchunk.ChunkOptions: {', '.join(names)}."
            )
        if options is None:
            return cls(**chunking)
        if not isinstance(options, cls):
            raise TypeError(
                f"options must be a ggnchunk.ChunkOptions or None, got "
                f"{type(options).__name__}."
            )
        clash = [n for n, v in chunking.items() if v != getattr(options, n)]
        if clash:
            said = ", ".join(
                f"{n}={chunking[n]!r} vs {getattr(options, n)!r}" for n in clash
            )
            raise ValueError(
                f"{where}: the keyword(s) contradict options= ({said}); pass each "
                "setting once, in options or as a keyword."
            )
        return options


def _legacy_distributed(chunking: dict[str, Any], where: str) -> None:
    """Map the old ``distributed=`` of :func:`diag_ggn`/:func:`kron_ggn` (deprecated)."""
    if "distributed" not in chunking:
        return
    value = chunking.pop("distributed")
    if "column_parallel" in chunking:
        raise ValueError(
            f"{where}: pass column_parallel only (distributed is its deprecated name)."
        )
    warnings.warn(
        f"{where}(distributed=...) is deprecated: it is called column_parallel now "
        "(distributed means data-parallel in diag_ggn_dataset).",
        FutureWarning,
        stacklevel=3,
    )
    chunking["column_parallel"] = value


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
        _windows.ENABLED,  # the two paths' chunks cost differently: remembered apart
    )  # fmt: skip


def clear_autotune_cache() -> None:
    """Forget what earlier calls measured to choose how to run.

    Budget and auto modes remember their chunk sizes and memory fits, and image-shaped
    outputs remember whether windowed or dense passes were measured faster, each per
    problem (model structure, loss, shapes, dtype, device, threads), so that later calls
    on the same problem skip the measuring. Clear them after changing something these
    keys do not see (the machine's load, the allocator's settings) or for timings that
    include the measuring. A call under a Python dispatch mode (``FlopCounterMode``, a
    debug mode) reads them and stores none: what it measures is the mode's cost too.
    """
    _scheduling.clear_autotune_cache()
    _windows.forget_choices()


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


def _warm_up(problem: Problem, kernels: bool = True, budget: int | None = None) -> bool:
    """The process's one-time set-up for this problem, before the call's baseline.

    Args:
        problem: The call's problem.
        kernels: Whether to page in its kinds of layers' kernels too (where the memory
            measurement counts code, :attr:`MemoryBackend.counts_code`).
        budget: The call's budget in bytes (the matrix products' buffer pool is grown
            first where it is a sizeable share of it and the model is large);
            ``None`` without one.

    Returns:
        Whether anything was set up now (``False`` once the process has it).
    """
    ran = kernels and warm_up_for(problem.model, problem.dtype, problem.device)
    if budget is not None:
        parameters = sum(p.numel() for p in problem.model.parameters())
        ran = ensure_matmul_pool(problem.dtype, problem.device, budget, parameters) or ran
    if isinstance(problem.handler, AutogradLossSqrtHessian) or _has_glue(problem):
        # torch.func factorizes the loss, or backpropagates glue in batches: the
        # forward pass's checks set it up first (about 40 MiB counted as in use after
        # a first call's forward: 770 passes of 4 columns where a second call planned
        # 111 of 28, on a time-conditioned U-Net at 64 MiB)
        ran = ensure_batched_autograd() or ran
    return ran


def _has_glue(problem: Problem) -> bool:
    """Whether the model may have glue between its layers (read before its forward).

    A module that is neither a container nor a layer with a rule computes in its own
    ``forward`` (activations called as functions, residual sums, attention), which
    autograd backpropagates in batches. Conservative: a custom module whose forward only
    chains layers counts too.
    """
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    return any(
        type(module) not in containers and module not in problem.units
        for module in problem.model.modules()
    )


def _needs_batched_autograd(run: GGNComputation) -> bool:
    """Whether the sweeps may backpropagate through autograd in batches (``torch.func``).

    Glue between layers does, and so do the rules' fallbacks (convolutions with string
    zero padding, folded layers the kernels do not cover); a rule-only chain of layers
    does not. Conservative: when in doubt, true.
    """
    recording = getattr(run, "_recording", None)
    if recording is None:
        return True
    for source in getattr(recording, "_sources", {}).values():
        if not source.direct and (source.frontier or source.params):
            return True
    for call in recording.calls:
        rule, module = call.rule, call.ctx.module
        if isinstance(rule, FoldedRule):
            node, x = call.ctx.node, call.ctx.x
            if (
                node is None or len(node.next_functions) != 1 or x.dim() != 4
                or node.name() not in _FOLDED
            ):  # fmt: skip
                return True
        if (
            isinstance(rule, ConvRule) and module.padding_mode == "zeros"
            and isinstance(module.padding, str)
        ):  # fmt: skip
            return True  # (padded with values: the rule's own backward)
    return False


def _set_up_outside(
    tracker: MemoryBackend, set_up: Callable[[], Any], report: GGNReport,
    rise: bool = False,
) -> int:  # fmt: skip
    """Run a one-time set-up outside the budget; note its time and memory in ``report``.

    Returns the memory in use after it (settled), or with ``rise`` the bytes it left
    resident (the baseline moves up by them, as if the set-up had run before it).
    """
    settled = getattr(tracker, "settled", tracker.current)  # user trackers
    # cycles earlier work left (the young generations: about a millisecond) are freed
    # now, not during the call after its baseline, where their memory passed for room
    # the call had not needed (a second call planned 11 or 12 passes by chance)
    gc.collect(1)
    clock, before = time.perf_counter(), settled()
    if set_up() is False:  # already done in this process
        return 0 if rise else before
    after = settled()
    report.setup_seconds += time.perf_counter() - clock
    report.setup_bytes += max(0, after - before)
    return max(0, after - before) if rise else after


def _bounds_for_budget(
    run: GGNComputation, budget: int, level: int, total: int, device: torch.device
) -> tuple[bool, float]:
    """Make the run's memory bounds for a budget; return whether it runs lean.

    Two choices, both by the passes budget mode would plan (:func:`passes_within`):

    - The chunk size the contraction forms are planned for. The bound made for all
      columns keeps the Gram form's matrices of every layer where that form wins for a
      chunk of all columns; under a budget that only fits small chunks those matrices
      would never be used, and reserving them makes the chunks smaller still. Plan for
      the size the budget gives without them where that needs fewer passes.
    - Lean (no per-forward caches) where that at least halves the passes, or where one
      column of the full bound does not fit the planning target (a budget that the
      caches nearly fill): the lean run's smaller bound is then the safer plan.

    Both are chosen without the windowed fields' images (kept to save work in later
    passes, never needed): a run that is not lean then gives them a quarter of the room
    its bound leaves, at most, and always room for one column.

    Args:
        run: The computation, after its forward pass.
        budget: The budget in bytes.
        level: Bytes in use above the call's baseline (settled).
        total: Columns to compute.
        device: Where the work runs.

    Returns:
        Whether the run is lean (its bounds are set for the plan either way), and the
        passes planned.
    """

    def passes(cost: tuple[int, int]) -> float:
        return passes_within(budget, device, level, *cost, total)

    run.limit_field_images(0)
    # not lean, the fields' images are kept after the first pass (which the scheduler
    # runs alone, with the fields travelling, and then plans again): plan without them
    run.assume_fields_kept = True
    full = (run.fixed_bytes(total), run.column_bytes())
    # the least any plan reserves: the Gram form only where it wins for one column
    fewest = passes((run.fixed_bytes(1), full[1]))
    small = (run.fixed_bytes(-(-total // fewest)), full[1]) if fewest < inf else full
    if passes(full) > 1 and passes(small) < passes(full):
        full = small
    else:
        run.fixed_bytes(total)
    run.set_lean(True)
    run.assume_fields_kept = False  # lean keeps none: the fields travel in every pass
    lean = (run.fixed_bytes(), run.column_bytes())  # the Gram form is chosen by memory
    target = planning_share(device) * budget
    if 2 * passes(lean) <= passes(full) or (
        target < level + sum(full) and sum(lean) < sum(full)
    ):
        return True, passes(lean)
    run.set_lean(False)
    run.assume_fields_kept = True
    room = target - level - run.fixed_bytes()
    run.assume_fields_kept = False  # the first pass: the fields travel
    run.limit_field_images(int(max(0, min(room // 4, room - run.column_bytes()))))
    first = (run.fixed_bytes(), run.column_bytes())  # the bounds for the plan, fields
    # travelling (the first pass; where not even that fits, no plan does)
    return False, passes(full) if passes(first) < inf else inf


def _dense_after_first_pass(
    run: GGNComputation, budget: int, level: int, total: int, device: torch.device
) -> None:
    """After the first windowed pass: dense passes where windows would need many more.

    The plan before any pass estimates the fields' images from shapes; the first pass
    shows whether they were all kept. Where they were not, the fields travel in every
    windowed pass, and a budget they nearly fill leaves room for a few columns per pass
    (measured: 800 one-column passes on a residual GroupNorm model at 64 MiB, where
    dense passes take 69): then every later pass runs dense, as the plan does where the
    windowed passes are more than twice the dense ones.

    Args:
        run: The computation.
        budget: The budget in bytes.
        level: Bytes in use above the call's baseline before the first pass.
        total: Columns to compute.
        device: Where the work runs.
    """
    if run.windowed_passes != 1 or not run.may_window or run.field_images_kept:
        return

    def passes(cost: tuple[int, int]) -> float:
        return passes_within(budget, device, level, *cost, total)

    windowed = passes((run.fixed_bytes(), run.column_bytes()))
    run.plan_dense(True)
    dense = passes((run.fixed_bytes(), run.column_bytes()))
    run.plan_dense(False)
    if windowed > 2 * dense:
        run.plan_dense(
            True,
            "windowed passes carry fields (dense maps per sample) whose images the "
            f"budget cannot keep: {windowed:.0f} passes within max_memory against "
            f"{dense:.0f} dense; every pass after the first runs dense",
        )


def _plan_for_budget(
    run: GGNComputation, budget: int, level: int, total: int, device: torch.device
) -> bool:
    """Make the run's memory bounds for a budget; return whether it runs lean.

    Windowed passes carry the fields of normalizations over positions (GroupNorm's:
    dense maps per sample that travel like extra columns, and their images kept for the
    later passes); dense passes carry none. Where the fields leave a windowed pass so
    little room that it plans more than twice the dense passes (or none fit), every
    pass runs dense: a windowed pass is at most a few times cheaper per column, and a
    budget that dense passes meet is never refused for the windows' sake.

    Args:
        run: The computation, after its forward pass.
        budget: The budget in bytes.
        level: Bytes in use above the call's baseline (settled).
        total: Columns to compute.
        device: Where the work runs.

    Returns:
        Whether the run is lean (its bounds are set for the plan either way).
    """
    if not run.may_window:
        return _bounds_for_budget(run, budget, level, total, device)[0]
    run.plan_dense(True)
    _, dense = _bounds_for_budget(run, budget, level, total, device)
    run.plan_dense(False)
    lean, windowed = _bounds_for_budget(run, budget, level, total, device)
    if windowed < inf and windowed <= 2 * dense:
        # dense parts of the chunks (the trial's, or every pass's after it) hold what
        # the budget fits of dense columns, beside what the windowed plan keeps
        run.limit_dense_parts(int(planning_share(device) * budget) - level)
        return lean
    passes = "no pass" if windowed == inf else f"{windowed:.0f} passes"
    # what windowed passes keep whatever their size: fields where normalizations over
    # positions make them, else the boxes' caches (a 28x28 autoencoder's first call at
    # 7.7 MiB was told of fields it does not have)
    if run.has_fields:
        why = "windowed passes carry fields (dense maps per sample) that leave room for"
    else:
        why = "what windowed passes keep at any size (the boxes' caches) leaves room for"
    run.plan_dense(
        True,
        f"{why} {passes} within max_memory, dense passes {dense:.0f}: every pass runs "
        "dense",
    )
    return _bounds_for_budget(run, budget, level, total, device)[0]


def _below_cut(
    run: GGNComputation, columns: int, options: ChunkOptions, schedule: ScheduleReport,
    tracker: Any, baseline: int | None, bar: Any, device: torch.device,
) -> ScheduleReport:  # fmt: skip
    """Phase two of a call whose passes stopped at a cut: the factor's columns below.

    Within the same budget (planned from the dense bound, from the memory in use,
    which holds the factor), else in chunks of the passes' size (dense parts).

    Args:
        run: The computation, after its passes.
        columns: The factor's columns (:meth:`GGNComputation.columns_below_cut`).
        options: The call's (rank's) options.
        schedule: The passes' schedule.
        tracker: The call's memory tracker (``None``: unmeasured).
        baseline: The call's memory baseline.
        bar: The progress bar, or ``None``.
        device: Where the work runs.

    Returns:
        Phase two's schedule.
    """
    budget = schedule.budget_bytes if tracker is not None else None
    run.plan_below_cut()
    if budget is not None:
        # the level the plan starts from, without the heap the passes freed (a call
        # whose 768 one-column passes had kept 1.2 MiB more resident than in use was
        # refused below the cut at 8.8 MiB where every column to the inputs fits)
        level = getattr(tracker, "settled", tracker.current)()
        if baseline is not None:
            _plan_below_cut(run, budget, level - baseline, columns, device)
        scheduler = ChunkScheduler(
            max_memory=budget, device=device, recover_oom=options.recover_oom,
            what="factor columns", tracker=tracker,
        )  # fmt: skip
    else:
        scheduler = ChunkScheduler(
            chunk_size=min(columns, run.dense_part(schedule.chunk_size)),
            device=device, recover_oom=options.recover_oom, what="factor columns",
        )  # fmt: skip

    def below(a: int, b: int) -> None:
        run.below_cut(a, b)
        if bar is not None:
            bar.update(1)

    try:
        _, report = scheduler.run(
            columns, below, baseline=baseline, cost=run.below_cut_bytes
        )
    except MemoryBudgetError:  # raised before any pass below the cut
        # the call's first plan found room for one column from the output to the
        # inputs, which holds more than one column below the cut: never refused after
        # the passes' work (the plan's level can be higher now by what the heap kept)
        fallback = ChunkScheduler(
            chunk_size=1, device=device, recover_oom=options.recover_oom,
            what="factor columns",
        )  # fmt: skip
        _, report = fallback.run(columns, below)
    report.factor = True
    return report


def _plan_below_cut(
    run: GGNComputation, budget: int, level: int, total: int, device: torch.device
) -> None:
    """The chunk size the layers below a cut plan their contraction forms for, and lean.

    As :func:`_plan_for_budget` does above it: the Gram form's matrices that chunks of
    every factor column would keep are left out where the budget then fits fewer
    passes (its chunks are smaller than the size those matrices pay off at), and the
    layers run lean where that at least halves the passes or where nothing else fits
    (lean already where the passes above are). FCN-ResNet50 at 394 MiB, not lean above
    its cut: its 2048-channel head counted 36 MiB per factor column, 54 MiB in all,
    against 3.5 MiB lean, and ran 48 factor columns two at a time, 28 passes in all
    against 13 at 256 MiB; now 6 passes.

    Args:
        run: The computation, after its passes.
        budget: The budget in bytes.
        level: Bytes in use above the call's baseline (settled).
        total: The factor's columns.
        device: Where the work runs.
    """

    def passes(columns: int, lean: bool = False) -> float:
        run.plan_below_cut(columns, lean)
        return passes_within(budget, device, level, *run.below_cut_bytes(), total)

    if run.lean:  # the passes' plan chose the smaller bound: so do the layers below
        run.plan_below_cut(total)
        return
    planned, best = total, passes(total)
    fewest = passes(1)
    if fewest < best:
        small = -(-total // fewest)
        fitted = passes(small)
        if fitted < best:
            planned, best = small, fitted
    lean = passes(total, lean=True)  # (lean layers choose their forms by memory)
    if 2 * lean <= best or (best == inf and lean < inf):
        return
    run.plan_below_cut(planned, lean=False)


def _progress_bar(show: bool) -> Any:
    """A tqdm bar over backward passes, or ``None``; tqdm is imported only when asked."""
    if not show:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        raise ImportError(
            "progress=True needs tqdm: pip install tqdm (or ggnchunk[progress])."
        ) from None
    return tqdm(desc="GGN backward passes", unit="pass")


QuantitySpec = Callable[[Problem, int], Quantity]
"""Makes the quantity of one forward pass: ``spec(problem, samples)``."""


@warnings_once()
def _compute(
    problem: Problem, batch: Batch, targets: Tensor | None, options: ChunkOptions,
    scale: float, spec: QuantitySpec, group=None, with_gradient: bool = False,
    sampling: Sampling | None = None,
) -> tuple[Quantity, Tensor, list[Tensor], GGNReport]:  # fmt: skip
    """:func:`_compute_parts` with the parameters' gradient hooks muted (restored after).

    A call that raises leaves torch's random state as it was before it.

    The GGN (and the loss gradient returned with it) is the model function's: a
    clipping hook on a parameter would otherwise change the products of the parameters
    the glue's backward reaches, and not those of layers with rules.
    """
    with (
        random_state_kept_on_error(problem.device),
        parameter_hooks_off(problem.params),
        forward_tensor_hooks_off(),
    ):
        return _compute_parts(
            problem, batch, targets, options, scale, spec, group, with_gradient, sampling
        )


def _compute_parts(
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
    # one batch's columns split: the same work on every rank (checked before the
    # memory baseline: its few MiB of scratch are not the budget's)
    if group is not None:
        check_same_work(
            group,
            {
                "model parameters and buffers": [*problem.model.parameters(),
                                                 *problem.model.buffers()],
                "inputs": batch.tensors(),
                "targets": [] if targets is None else [targets],
            },
        )  # fmt: skip
    size = batch.size
    report = GGNReport(
        batch_chunks=plan_chunks(size, chunk_size=options.batch_chunk_size or size,
                                 what="samples")
    )  # fmt: skip
    params = problem.params
    merged: Quantity | None = None
    gradient = [torch.zeros_like(p) for p in params] if with_gradient else []
    loss = torch.zeros((), dtype=problem.dtype, device=problem.device)
    mean = problem.loss_func is not None and averages(problem.loss_func)
    tracker = (
        memory_backend(
            problem.device,
            what="chunk_size='auto'" if options.chunk_size == "auto" else "max_memory",
        )
        if options.measured
        else None
    )
    baseline = None
    if tracker is not None:  # one-time set-up is not the budget's: pay it first
        code = getattr(tracker, "code", lambda: 0)()
        kernels = getattr(tracker, "counts_code", True)
        total = parse_memory(options.max_memory) if options.max_memory else None
        baseline = _set_up_outside(
            tracker, lambda: _warm_up(problem, kernels, total), report
        )
    bar = _progress_bar(options.progress)
    for start, stop in report.batch_chunks:
        part = batch.slice(start, stop) if (start, stop) != (0, size) else batch
        sub_targets = targets[start:stop] if targets is not None else None
        quantity = spec(problem, stop - start)
        if merged is not None:
            quantity.continues(merged)
        key = _cache_key(problem, part)
        run = GGNComputation(problem, part, sub_targets, scale, quantity, sampling, key)
        with run:
            output = run.forward()
        if group is not None:
            check_same_output(group, output)
        if tracker is not None and _needs_batched_autograd(run):
            baseline += _set_up_outside(tracker, ensure_batched_autograd, report, True)
        columns = run.num_columns
        report.num_columns = columns
        first, last, local = 0, columns, options
        if group is not None:
            first, last, local = _share(columns, options, group)
        scheduler = ChunkScheduler(
            num_chunks=local.num_chunks, chunk_size=local.chunk_size,
            max_memory=local.max_memory, device=problem.device,
            recover_oom=local.recover_oom, what="columns", tracker=tracker,
            cache_key=key,
        )  # fmt: skip

        def backward(a: int, b: int, run=run, first=first) -> None:
            run.backward(first + a, first + b)
            if bar is not None:
                bar.update(1)

        level = 0
        if last > first:
            if local.max_memory is not None and tracker is not None:
                level = max(0, getattr(tracker, "settled", tracker.current)() - baseline)
                lean = _plan_for_budget(run, parse_memory(local.max_memory), level,
                                        last - first, problem.device)  # fmt: skip
                report.lean = report.lean or lean
            else:  # the bounds for chunks of up to all columns
                run.fixed_bytes()

            budget = None
            if local.max_memory is not None and tracker is not None:
                budget = parse_memory(local.max_memory)

            def bound(
                run=run, level=level, budget=budget, total=last - first
            ) -> tuple[int, int, Any]:  # asked again after the first pass
                if budget is not None:
                    _dense_after_first_pass(run, budget, level, total, problem.device)
                fixed, per_column = run.fixed_bytes(), run.column_bytes()
                return fixed, per_column, run.layer_bounds(fixed, per_column)

            # the factor at a cut: half the room at most (the plan counts it as fixed)
            run.expect(last - first, None if budget is None else (budget - level) // 2)
            _, schedule = scheduler.run(
                last - first, backward, baseline=baseline, cost=bound
            )
            report.schedules.append(schedule)
            below = run.columns_below_cut()
            if below:  # the passes stopped at a cut: its Gram's factor swept below
                report.schedules.append(
                    _below_cut(
                        run,
                        below,
                        local,
                        schedule,
                        tracker,
                        baseline,
                        bar,
                        problem.device,
                    )
                )
        report.windowed = report.windowed or run.windowed_passes > 0
        report.window_ends.update(run.window_ends)
        # the sub-batch's loss is its own mean: back to the sum, then to the scale (0
        # where a mean has no target in the sub-batch, every one ignored: its loss and
        # gradient are 0/0, and it adds nothing to the batch's)
        weight = scale * (
            float(problem.handler.normalizer(problem.loss_func, sub_targets))
            if mean else 1
        )  # fmt: skip
        if with_gradient and weight != 0:
            grads = run.gradient()
        run.close()
        if run.loss is not None and weight != 0:
            loss += weight * run.loss
        if merged is None:
            merged = quantity  # no second parameter-sized buffer for one sub-batch
        else:
            merged.absorb(quantity)
        if with_gradient and weight != 0:
            for acc, grad in zip(gradient, grads, strict=True):
                if grad is not None:
                    acc.add_(grad, alpha=weight)
        del run, quantity
    if bar is not None:
        bar.close()
    if tracker is not None:  # the libraries' code the call paged in: not the budget's
        report.setup_bytes += max(0, getattr(tracker, "code", lambda: 0)() - code)
    if group is not None:
        merged.all_reduce(group)
    return merged, loss, gradient, report


def diag_ggn(
    model: nn.Module,
    loss_func: nn.Module | Callable[[Tensor, Tensor], Tensor],
    inputs: Any,
    targets: Tensor,
    *,
    options: ChunkOptions | None = None,
    per_sample: bool = False,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
    return_report: bool = False,
    **chunking: Any,
) -> dict[str, Tensor] | tuple[dict[str, Tensor], GGNReport]:
    """Exact diagonal of the generalized Gauss-Newton matrix of a batch's loss.

    Computes ``diag(sum_n J_n^T H_n J_n)`` for ``loss = loss_func(model(inputs), targets)``
    as the loss's ``reduction`` defines it, where ``J_n`` is the Jacobian of sample
    ``n``'s output w.r.t. the parameters and ``H_n`` the Hessian of the loss w.r.t. that
    output. One forward pass, then one backward pass per chunk of columns of a square
    root ``S_n`` of ``H_n`` (``S_n S_n^T = H_n``); the chunks' diagonals add up to the
    exact result. Peak memory grows with the chunk's column count; ``max_memory`` picks
    the chunks for a budget.

    Args:
        model: An ``nn.Module`` whose output has the batch on axis 0, ``[N, ...]``.
            Supported layers get fast rules (``ggnchunk.supported_layers_table()``);
            other differentiable code between them is handled generically. Layers that
            couple samples (BatchNorm in training mode) raise ``SampleCouplingError``.
        loss_func: A loss with ``reduction="mean"`` or ``"sum"``: ``MSELoss``,
            ``BCEWithLogitsLoss``, ``CrossEntropyLoss``, ``NLLLoss``, the losses of
            ``ggnchunk.losses`` (``GaussianNLL``), or any twice-differentiable loss
            module or function ``loss(output, target)`` (a plain function is a sum)
            whose Hessian is computed generically; a loss that is not convex in the
            output warns (``NotConvexWarning``).
        inputs: The model's input: a tensor ``[N, ...]`` (``model(inputs)``), a
            tuple/list (``model(*inputs)``) or a dict (``model(**inputs)``) of tensors
            with the batch on axis 0, on the model's device.
        targets: Targets ``[N, ...]`` as the loss takes them.
        options: The chunking settings as one :class:`ChunkOptions` (optional).
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
        return_report: Also return a :class:`GGNReport` (columns, passes, peaks).
        **chunking: Or the same settings as keywords: ``num_chunks``, ``chunk_size``,
            ``max_memory``, ``batch_chunk_size``, ``recover_oom``, ``column_parallel``,
            ``progress`` (the fields of :class:`ChunkOptions`, documented there). With
            none of them, one backward pass over all columns. ``distributed`` is the
            deprecated name of ``column_parallel``.

    Returns:
        One tensor per parameter with ``requires_grad``, keyed and ordered as
        ``model.named_parameters()``, each with the parameter's shape (``[N, *shape]``
        with ``per_sample=True``), dtype and device; with ``return_report=True``, the
        pair ``(diagonal, report)``.

    Raises:
        TypeError: For arguments of the wrong type or unknown keywords (named).
        ValueError: For unsupported losses, mismatched shapes, devices or dtypes,
            conflicting chunk arguments, before any backward pass.
        SampleCouplingError: If samples influence each other (BatchNorm in training).
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
    _legacy_distributed(chunking, "diag_ggn")
    resolved = ChunkOptions.resolve(options, chunking, "diag_ggn")
    check_flag(per_sample, "per_sample")
    check_flag(return_report, "return_report")
    sampling = Sampling.of(mc_samples, generator)
    spec = PerSampleDiagonal if per_sample else DiagonalGGN
    result = _evaluate(
        model, loss_func, inputs, targets, resolved, spec=spec, sampling=sampling
    )
    diagonal = dict(zip(result.names, result.diagonal, strict=True))
    return (diagonal, result.report) if return_report else diagonal


def kron_ggn(
    model: nn.Module,
    loss_func: nn.Module | Callable[[Tensor, Tensor], Tensor],
    inputs: Any,
    targets: Tensor,
    *,
    options: ChunkOptions | None = None,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
    return_report: bool = False,
    **chunking: Any,
) -> dict[str, KronFactors] | tuple[dict[str, KronFactors], GGNReport]:
    """Per-layer Kronecker factors of the exact GGN (KFLR), chunked to fit a budget.

    For every ``nn.Linear`` and ``nn.Conv1d/2d/3d`` (``groups=1``) layer, the factors
    ``G`` (``[C_out, C_out]``) and ``A`` (``[K, K]``, ``K`` the weight's fan-in) with
    ``G ⊗ A`` approximating the GGN block of ``weight.flatten()`` and ``G`` the exact
    GGN block of the bias — BackPACK's ``KFLR`` and laplace-torch's
    ``BackPackGGN(stochastic=False)`` factors (see :class:`KronFactors`). ``G`` sums over
    the columns of the loss Hessian's square root, so it is split into chunks of columns
    exactly like :func:`diag_ggn`'s diagonal, with the same options and memory budget
    (the factors are counted); ``A`` needs the layer inputs only and is computed once
    per forward pass (normalized by the whole batch's size).

    A Linear on ``[N, ..., D]`` is treated as a 1×1 convolution over the extra axes:
    ``s`` is summed over them before its outer product, and ``A`` sums ``u u^T`` over
    them (BackPACK accepts ``[N, D]`` inputs only).

    Args:
        model: A model whose trainable parameters are all weights and biases of
            ``nn.Linear`` or ``nn.Conv1d/2d/3d`` layers (``groups=1``), each called once
            per forward pass; any other layers are allowed. Freeze other parameters
            with ``requires_grad_(False)``.
        loss_func: Any loss :func:`diag_ggn` accepts.
        inputs: As in :func:`diag_ggn` (a tensor, tuple/list or dict).
        targets: As in :func:`diag_ggn`.
        options: The chunking settings as one :class:`ChunkOptions` (optional).
        mc_samples: As in :func:`diag_ggn`: output factors from ``k`` sampled columns
            (unbiased; BackPACK's ``KFAC``-style Monte-Carlo estimate of ``G``).
        generator: As in :func:`diag_ggn`.
        return_report: Also return a :class:`GGNReport`.
        **chunking: Or the same settings as keywords, as in :func:`diag_ggn`
            (``column_parallel`` sums the output factors over the ranks).

    Returns:
        ``{layer name: KronFactors}`` in the order of ``model.named_parameters()``; with
        ``return_report=True``, the pair ``(factors, report)``.

    Raises:
        TypeError: For arguments of the wrong type or unknown keywords (named).
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
    _legacy_distributed(chunking, "kron_ggn")
    resolved = ChunkOptions.resolve(options, chunking, "kron_ggn")
    check_flag(return_report, "return_report")
    sampling = Sampling.of(mc_samples, generator)
    result = _evaluate(
        model, loss_func, inputs, targets, resolved, spec=KroneckerFactors,
        sampling=sampling,
    )  # fmt: skip
    return (result.factors, result.report) if return_report else result.factors


def loss_grad_and_diag_ggn(
    model: nn.Module,
    loss_func: nn.Module | Callable[[Tensor, Tensor], Tensor],
    inputs: Any,
    targets: Tensor,
    *,
    options: ChunkOptions | None = None,
    return_report: bool = False,
    **chunking: Any,
) -> (
    tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]
    | tuple[Tensor, dict[str, Tensor], dict[str, Tensor], GGNReport]
):
    """Loss, gradient and exact GGN diagonal from one forward pass (per sub-batch).

    The gradient comes for free with the first backward pass of the GGN computation;
    ``.grad`` is not touched.

    Args:
        model: As in :func:`diag_ggn`.
        loss_func: As in :func:`diag_ggn`.
        inputs: As in :func:`diag_ggn` (a tensor, tuple/list or dict).
        targets: As in :func:`diag_ggn`.
        options: The chunking settings as one :class:`ChunkOptions` (optional).
        return_report: Also return a :class:`GGNReport`.
        **chunking: Or the same settings as keywords, as in :func:`diag_ggn`; with
            ``batch_chunk_size``, loss and gradient are those of the whole batch.

    Returns:
        ``(loss, gradient, diagonal)``: the detached scalar loss; gradient and diagonal
        keyed and ordered as ``model.named_parameters()`` (trainable ones); with
        ``return_report=True``, ``(loss, gradient, diagonal, report)``.

    Raises:
        TypeError: For arguments of the wrong type or unknown keywords (named).
        ValueError: For everything :func:`diag_ggn` refuses.
        MemoryBudgetError: If ``max_memory`` is too small for one column per pass.

    Examples:
        >>> import torch, ggnchunk
        >>> model = torch.nn.Linear(3, 2)
        >>> X, y = torch.randn(8, 3), torch.randn(8, 2)
        >>> loss_func = torch.nn.MSELoss()
        >>> loss, grad, diag = ggnchunk.loss_grad_and_diag_ggn(model, loss_func, X, y)
        >>> bool(torch.allclose(loss, loss_func(model(X), y)))
        True
    """
    resolved = ChunkOptions.resolve(options, chunking, "loss_grad_and_diag_ggn")
    check_flag(return_report, "return_report")
    result = _evaluate(model, loss_func, inputs, targets, resolved, need_gradient=True)
    names = result.names
    out = (
        result.loss,
        dict(zip(names, result.gradient, strict=True)),
        dict(zip(names, result.diagonal, strict=True)),
    )
    return (*out, result.report) if return_report else out


def check_flag(value: Any, name: str) -> None:
    """Refuse a non-bool flag (``return_report="no"`` is not true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}.")


def evaluate(
    model: nn.Module,
    loss_func: nn.Module | Callable[[Tensor, Tensor], Tensor],
    inputs: Any,
    targets: Tensor,
    options: ChunkOptions,
    **quantity: Any,
) -> _Evaluation:
    """The integrations' entry point (``ggnchunk.laplace``, the dataset loop).

    Internal but stable for ggnchunk's own integrations: everything the public
    functions check is checked, and the result carries what they need beyond a dict:
    the loss, the gradient, the mean's normalizer and the report.

    Args:
        model: As in :func:`diag_ggn`.
        loss_func: As in :func:`diag_ggn`.
        inputs: As in :func:`diag_ggn`.
        targets: As in :func:`diag_ggn`.
        options: The validated chunking settings.
        **quantity: ``scale`` (``None``: follow the loss's reduction; ``1.0``: the
            ``reduction="sum"`` loss), ``need_gradient``, ``spec`` (the quantity of
            :mod:`ggnchunk._quantities`), ``sampling`` (Monte-Carlo columns).

    Returns:
        An ``_Evaluation``: ``loss``, ``gradient`` and ``diagonal`` (lists in the order
        of ``names``), ``report``, ``normalizer``, ``names`` and ``factors``
        (``spec=KroneckerFactors``).
    """
    return _evaluate(model, loss_func, inputs, targets, options, **quantity)


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
    group = resolve_group(True, model) if options.column_parallel else None
    loss_func = problem.loss_func
    normalizer = 1.0
    if averages(loss_func):
        normalizer = float(problem.handler.normalizer(loss_func, targets))
        if normalizer == 0 and scale is None:  # (a dataset loop scales by its total)
            raise ValueError(
                f"{type(loss_func).__name__} with reduction='mean' has nothing to average "
                "over: every target is ignore_index (or has weight 0), so torch's loss is "
                "0/0 (NaN) and so would be its curvature. Leave such batches out, or use "
                "reduction='sum' (whose GGN diagonal is then 0)."
            )
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
            problem, batch, usable(targets), options, scale, spec, group,
            need_gradient, sampling,
        )  # fmt: skip
    if isinstance(quantity, KroneckerFactors):
        factors = assemble(model, problem.names, *quantity.final(), samples=batch.size)
        return _Evaluation(loss, gradient, [], report, normalizer, problem.names, factors)
    return _Evaluation(loss, gradient, quantity.final(), report, normalizer, problem.names)
