r"""What a backward sweep computes: one object per quantity.

A sweep (:meth:`ggnchunk._graph.Recording.sweep`) moves a chunk of vectors ``G``
(``[V, N, *output]``: columns of the loss Hessian's square root, or of the identity over
the outputs) from the model output back over the recorded layers and glue. A
:class:`Quantity` is what it does with them where parameters are:

- at a layer call (:meth:`Quantity.layer`), with the vectors at the layer's output;
- at a glue region that uses parameters (:meth:`Quantity.glue`), with the vectors at the
  region's start (per-sample products of the parameters, one masked backward per sample);
- once the sweep is done (:meth:`Quantity.end`).

It also says what it keeps for one forward pass (:attr:`Quantity.result`), how that is
merged over the sub-batches of a call (:meth:`Quantity.absorb`) and over the ranks of a
column-parallel call (:meth:`Quantity.all_reduce`), and what its columns are
(:meth:`Quantity.factorize`).

- :class:`DiagonalGGN`: ``sum_{v,n} (J_n^T G[v, n])**2`` per parameter; summed.
- :class:`PerSampleDiagonal`: ``sum_v (J_n^T G[v, n])**2``, ``[N, *param]``; the
  sub-batches' parts concatenated (before the ranks' sum).
- :class:`KroneckerFactors`: output factors ``sum_{v,n} g g^T`` (summed over chunks,
  sub-batches and ranks) and input factors (once per forward pass; summed over
  sub-batches only).
- :class:`OutputVariance`: ``sum_p (J_n^T e_m)_p**2 s_p``, ``[N, *output]``;
  concatenated, then summed over the ranks (each holds its output coordinates).
- :class:`Gradient`: ``J^T dL/df`` (one vector, no column axis); summed.

Monte-Carlo columns (:class:`Sampling`) replace the exact square root for any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ggnchunk._autograd import (
    Gather,
    batched_grad,
    blocked,
    edge_numel,
    plain_grad,
    scatter_rows,
)
from ggnchunk._distributed import all_reduce_sum
from ggnchunk._graph.readers import (
    lookup_squares,
    reader_groups,
    reader_room,
    release,
    shared_edges,
)
from ggnchunk._graph.readers import per_sample as read_per_sample
from ggnchunk._rules.tied import embedding_cross as tied_cross
from ggnchunk._rules.tied import head_rows as tied_rows
from ggnchunk._sqrt_hessians import SqrtHessianFactor, identity_factor, sampled_factor
from ggnchunk._windows import Windowed, dense, mix

if TYPE_CHECKING:  # pragma: no cover
    from ggnchunk._engine import Problem
    from ggnchunk._graph import Call, Recording, _Source

__all__ = [
    "DiagonalGGN",
    "Gradient",
    "KroneckerFactors",
    "OutputVariance",
    "PerSampleDiagonal",
    "Quantity",
    "Sampling",
]


class Sampling:
    """Monte-Carlo columns: ``k`` random combinations ``S_n eps / sqrt(k)`` per sample.

    One seed is drawn per call, at the first forward pass's sampling (after the checks):
    from ``generator``, or once from the global RNG (``torch.randint`` on the CPU
    generator). Every forward pass of the call (sub-batches) then draws its noise from a
    private generator made from that seed, so a call advances the global RNG by exactly
    one draw and the same ``generator`` state gives the same estimate.

    Args:
        samples: ``k``, the number of sampled columns (positive).
        generator: Where the seed comes from (``None``: the global RNG).
        name: The argument's name, for messages.

    Raises:
        TypeError: For a ``samples`` that is not a positive int or a ``generator`` that
            is not a ``torch.Generator``.
    """

    def __init__(
        self, samples: int, generator: torch.Generator | None = None,
        name: str = "mc_samples",
    ):  # fmt: skip
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise TypeError(
                f"{name} must be a positive int (the number of sampled columns), got "
                f"{samples!r}."
            )
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a torch.Generator or None, got "
                f"{type(generator).__name__}."
            )
        self.samples = samples
        self._source = generator
        self._generator: torch.Generator | None = None

    @classmethod
    def of(cls, samples: int | None, generator: torch.Generator | None) -> Sampling | None:
        """The sampling an entry point's ``mc_samples``/``generator`` ask for.

        Args:
            samples: ``mc_samples`` (``None``: exact).
            generator: ``generator`` (only with ``mc_samples``).

        Returns:
            ``None`` for the exact computation.

        Raises:
            ValueError: For a generator without ``mc_samples``.
        """
        if samples is None:
            if generator is not None:
                raise ValueError(
                    "generator is only used with mc_samples (Monte-Carlo columns); pass "
                    "mc_samples=k, or no generator for the exact computation."
                )
            return None
        return cls(samples, generator)

    def draw(self, exact: SqrtHessianFactor) -> SqrtHessianFactor:
        """The sampled square root of one forward pass.

        Args:
            exact: The loss Hessian's exact square root for the forward pass.

        Returns:
            A sqrt with ``k`` columns.
        """
        if self._generator is None:
            device = self._source.device if self._source is not None else "cpu"
            seed = torch.randint(0, 2**62, (), generator=self._source, device=device).item()
            self._generator = torch.Generator().manual_seed(int(seed))
        return sampled_factor(exact, self.samples, self._generator)


class Quantity:
    """What a sweep computes at parameters, for one forward pass (base: nothing).

    Attributes:
        every_product: Every parameter takes the per-sample products' path (the
            recording's memory bound counts their products).
        batched: The vectors carry a column axis ``[V, N, ...]`` (else ``[N, ...]``).
    """

    every_product = False
    batched = True
    windowed = False
    """Columns one-hot at output positions may be carried on boxes (the diagonal)."""
    gram_only = False
    """What it adds up depends on the columns only through each sample's Gram matrix
    ``sum_v g_v g_v^T`` (the diagonal, Kronecker factors): the sweep may then replace the
    columns by fewer with the same Gram (:mod:`ggnchunk._graph.compress`)."""
    sums_squares = False
    """It adds each parameter's squared products summed over columns and samples (the
    diagonal), so a table may be squared where its products are made: a table shared
    by an embedding and an output head as the two layers' diagonals plus their cross
    term (:mod:`ggnchunk._rules.tied`, with per-column rows kept between the two in
    :attr:`carried`), a table used once by one glue lookup from the lookup's vectors."""

    def __init__(self, problem: Problem | None = None, samples: int = 0):
        self.problem = problem
        self.samples = samples
        # per-column tensors ``[V, N, ...]`` kept from one layer to a later one in a
        # sweep (linear in the columns: replaced with them where the sweep compresses)
        self.carried: dict[int, Tensor] = {}

    # -- columns and set-up -----------------------------------------------------------
    def factorize(
        self, output: Tensor, targets: Tensor, scale: float
    ) -> SqrtHessianFactor | None:
        """The columns to sweep: the loss Hessian's square root by default.

        Args:
            output: The detached model output ``[N, ...]``.
            targets: The detached targets.
            scale: Factor of the loss Hessian.

        Returns:
            The sqrt.
        """
        problem = self.problem
        return problem.handler.factorize(problem.loss_func, output, targets, scale)

    def check(self, recording: Recording) -> None:
        """Refuse what the quantity cannot compute, after the plan, before any sweep.

        Args:
            recording: The planned recording.
        """

    def start(self, recording: Recording) -> None:
        """Set up what the sweeps add to (after the checks).

        Args:
            recording: The planned recording.
        """

    def fixed_bytes(
        self, recording: Recording, element: int, cut: tuple[str, int] | None = None
    ) -> int:
        """Bytes the sweeps keep whatever the chunk size (rule caches by default).

        Args:
            recording: The planned recording.
            element: Bytes per element.
            cut: The sweeps' side of a cut (:meth:`Recording.column_bytes`), or ``None``.

        Returns:
            An upper bound.
        """
        return recording.fixed_bytes(element, cut)

    # -- one sweep --------------------------------------------------------------------
    def begin(self, sqrt: SqrtHessianFactor, start: int, stop: int) -> None:
        """A sweep over columns ``start:stop`` begins.

        Args:
            sqrt: The columns' sqrt (``None`` for a sweep below a cut, whose columns
                factor a Gram: :class:`ggnchunk._graph.compress.Cut`).
            start: First column.
            stop: Last column (exclusive).
        """

    def layer(self, recording: Recording, call: Call, grads: Tensor) -> None:
        """The work at a layer call's parameters.

        Args:
            recording: The recording.
            call: The layer call.
            grads: The vectors at its output, ``[V, N, *out]``.
        """

    def squares_on_boxes(self, recording: Recording, call: Call, grads: Any) -> bool:
        """Whether :meth:`layer` squares a windowed block's products on its boxes.

        Where it does, no products of the layer's parameters are kept (the memory
        bound leaves them out); elsewhere a windowed block is made dense for them.

        Args:
            recording: The recording.
            call: A layer call with trainable parameters.
            grads: The vectors at its output.

        Returns:
            ``False`` by default.
        """
        return False

    def backprop(self, recording: Recording, call: Call, grads: Tensor) -> Tensor | None:
        """The vectors at the call's input (the rule's map, else autograd).

        Args:
            recording: The recording.
            call: The layer call (with an input that needs them).
            grads: The vectors at its output.

        Returns:
            The vectors at its input.
        """
        return recording.backprop(call, grads)

    def through(self, source: _Source, grads: Tensor) -> tuple[Tensor | None, ...]:
        """Move vectors through a glue region to its frontier.

        Args:
            source: The glue region.
            grads: The vectors at its start.

        Returns:
            One tensor per frontier edge.
        """
        return batched_grad([source.target], source.frontier, [grads])

    def glue(self, recording: Recording, source: _Source, grads: Tensor) -> None:
        """The work at the parameters a glue region uses.

        Args:
            recording: The recording.
            source: The glue region.
            grads: The vectors at its start.
        """

    def glue_block(self, recording: Recording, source: _Source, block: Windowed) -> None:
        """:meth:`glue` for a windowed block with fields (by default on its dense form).

        Args:
            recording: The recording.
            source: The glue region.
            block: The vectors at its start.
        """
        self.glue(recording, source, block.dense())

    def end(self, recording: Recording) -> None:
        """The sweep finished.

        Args:
            recording: The recording.
        """

    def abort(self) -> None:
        """The sweep failed (out of memory); it may be retried in parts."""

    # -- merging ----------------------------------------------------------------------
    result: Any = None
    """What the quantity keeps for its forward pass."""

    def absorb(self, later: Quantity) -> None:
        """Merge a later sub-batch's quantity into this one.

        Args:
            later: The same quantity for the next sub-batch.
        """
        raise NotImplementedError  # pragma: no cover - each quantity defines it

    def continues(self, earlier: Quantity) -> None:
        """Before its forward pass: this sub-batch follows ``earlier``'s (merged) ones.

        A quantity that builds large results at its forward pass may add them to the
        earlier ones in place instead (nothing by default).

        Args:
            earlier: The merged quantity of the earlier sub-batches.
        """

    def all_reduce(self, group: Any) -> None:
        """Sum over the ranks of a column-parallel call (every rank joins).

        Args:
            group: The process group.
        """
        all_reduce_sum(self._reduced(), None, group)

    def _reduced(self) -> list[Tensor]:
        return list(self.result)

    def final(self) -> Any:
        """The merged result of the call.

        Returns:
            :attr:`result` after the merges.
        """
        return self.result


class _Products(Quantity):
    """Squares of per-(column, sample) products, added to per-parameter accumulators.

    A parameter used in one place takes its layer's fastest form; one used in several
    places (or in the glue, or everywhere for :attr:`every_product`) keeps its products
    until the sweep ends, added over its uses, then squared (:meth:`_square`).
    """

    def __init__(self, problem: Problem, samples: int):
        super().__init__(problem, samples)
        self._buffers: dict[int, Tensor] = {}
        self._skip: set[int] = set()
        self._done: set[int] = set()
        self._partial: list[tuple[tuple[int, int], set[int]]] = []  # failed sweeps
        # a tied table's parts (its two layers' diagonals and their cross term),
        # added to the result once the sweep is done: a failed sweep adds none
        self._tied: dict[int, Tensor] = {}

    def begin(self, sqrt: SqrtHessianFactor, start: int, stop: int) -> None:
        # a sweep that fails (out of memory) is retried in parts of its range, which
        # leave the parameters it finished alone: each column added once per parameter
        self._range = (start, stop)
        self._skip = set().union(
            *(done for (a, b), done in self._partial if a <= start and stop <= b)
        )
        self._done = set()
        self._buffers = {}
        self._tied = {}
        self.carried = {}

    def abort(self) -> None:
        self._partial.append((self._range, self._done))
        self._buffers = {}
        self._tied = {}
        self.carried = {}

    def _add(self, index: int, value: Tensor) -> None:
        if index in self._skip:
            return
        if index in self._tied:
            self._tied[index] += value
            return
        self._accumulate(index, value)
        self._done.add(index)

    def _accumulate(self, index: int, value: Tensor) -> None:
        self.result[index] += value

    def _keep(self, index: int, value: Tensor) -> None:
        buffers = self._buffers
        if index in buffers:
            buffers[index] += value
        else:
            # a copy: the products may be (views of) the vectors at the layer's output
            # or the seed, which the sums added here later must not change
            buffers[index] = value.clone()

    reduces_squares = False
    """Asks :meth:`~ggnchunk.extend.Rule.diag_windowed` for another reduction than the
    sum over columns and samples (only of rules with ``windowed_squares``)."""

    def squares_on_boxes(self, recording: Recording, call: Call, grads: Any) -> bool:
        rule = call.rule
        return (
            isinstance(grads, Windowed)
            and type(rule).has_diag_windowed()
            and (rule.windowed_squares or not self.reduces_squares)
            # products added over several uses first (all are kept in ``shared``
            # for the quantities that make every product; ``reused`` are those)
            and not any(i in recording.reused for i, _ in call.params)
        )

    def _on_boxes(self, recording: Recording, call: Call, grads: Any, **how: Any) -> bool:
        """Add a windowed block's reduced squares where :meth:`squares_on_boxes` holds.

        Args:
            recording: The recording.
            call: The layer call.
            grads: The vectors at its output.
            **how: :meth:`~ggnchunk.extend.Rule.diag_windowed`'s reduction.

        Returns:
            Whether they were added (else the caller takes the products' path).
        """
        if not (call.params and self.squares_on_boxes(recording, call, grads)):
            return False
        values = call.rule.diag_windowed(call.ctx, grads, **how)
        if values is None:
            return False
        for i, pname in call.params:
            self._add(i, values[pname])
        return True

    def layer(self, recording: Recording, call: Call, grads: Tensor) -> None:
        if not call.params:
            return
        shared = recording.shared
        if any(i in shared for i, _ in call.params):
            products = call.rule.per_sample(call.ctx, dense(grads))
            for i, pname in call.params:
                if i in shared:
                    self._keep(i, products[pname])
                else:
                    self._add(i, products[pname].square().sum((0, 1)))
            return
        self._unshared(call, grads)

    def _unshared(self, call: Call, grads: Tensor) -> None:
        values = None
        if isinstance(grads, Windowed):
            values = call.rule.diag_windowed(call.ctx, grads)
            if values is None:
                grads = grads.dense()
        if values is None:
            self._in_place(call, call.rule.diag, grads)
            return
        for i, pname in call.params:
            self._add(i, values[pname])

    def _in_place(self, call: Call, method: Any, argument: Any) -> bool:
        """Run a rule's ``method`` with the accumulators it may add to in place.

        Args:
            call: The layer's call.
            method: ``call.rule.diag`` or ``call.rule.diag_onehot``.
            argument: Its second argument (the columns, or the one-hot mask).

        Returns:
            Whether it gave the diagonal (``diag_onehot`` may decline with ``None``).
        """
        into = self._into(call) or None
        call.ctx.into = into
        try:
            values = method(call.ctx, argument)
        finally:
            call.ctx.into = None
        if values is None:
            return False
        for i, pname in call.params:
            if into is not None and pname in into and pname not in values:
                if i not in self._tied:  # a tied table's part: added at the end
                    self._done.add(i)  # the rule added its value to the result in place
            else:
                self._add(i, values[pname])
        return True

    def _into(self, call: Call) -> dict[str, Tensor]:
        """Accumulators a rule's :meth:`~ggnchunk.extend.Rule.diag` may add to in place.

        Only where the value would be added to :attr:`result` as it is (no temporary
        of the parameter's size then); none by default.
        """
        return {}

    def glue(self, recording: Recording, source: _Source, grads: Tensor) -> None:
        self._glue_products(recording, source, grads, self._buffers)

    def glue_block(self, recording: Recording, source: _Source, block: Windowed) -> None:
        """The glue's products of a block's windowed part, plus its fields' (kept).

        The products are linear in the vectors: those of ``dense(data) + sum_k
        coeffs[v, n, k] fields[k, n]`` are the windowed part's plus the coefficients
        times the fields' own, which are the same in every sweep of the forward pass
        (kept in :attr:`~ggnchunk._graph.Recording.images`). The windowed part is zero
        off its boxes, so its columns cross the glue's attention on their boxes' rows
        only (:mod:`ggnchunk._attention`); made dense, every column reached every row.
        """
        key = recording.images.key("glue-params", source.key, block=block)
        fields = block.fields
        n = max(block.data.shape[1], fields.shape[1])

        def make() -> dict[int, Tensor]:
            products: dict[int, Tensor] = {}
            whole = fields.expand(fields.shape[0], n, *fields.shape[2:])
            self._glue_products(recording, source, whole, products)
            return products

        products = recording.images.get(key, make)
        part = block.windowed_part().dense()
        self._glue_products(recording, source, part, self._buffers)
        coeffs = block.coeffs.expand(block.coeffs.shape[0], n, block.coeffs.shape[2])
        for i, value in products.items():  # [K, N, *param]
            if i in self._buffers:
                mix(coeffs, value, into=self._buffers[i])
            else:
                self._buffers[i] = mix(coeffs, value)

    @staticmethod
    def _glue_products(
        recording: Recording, source: _Source, grads: Tensor, buffers: dict[int, Tensor],
        squares: Callable[[int, Tensor], None] | None = None,
    ) -> None:  # fmt: skip
        """Per-(column, sample) products ``[V, N, *param]`` of a glue's parameters.

        Args:
            recording: The recording.
            source: The glue region.
            grads: ``[V, N, ...]`` vectors at its start.
            buffers: Where they are added, by parameter index.
            squares: Takes ``sum_{v, n}`` of a parameter's squared products instead,
                where they can be made without the products: a table used once, by
                one lookup read per sample (``None``: always the products).
        """
        v, n = grads.shape[:2]

        def add(i: int, sample: int | None, value: Tensor) -> None:
            if sample is None and i not in buffers:
                # a copy: a reader's products can be a view of the vectors themselves
                buffers[i] = value.clone(memory_format=torch.contiguous_format)
            elif sample is None:
                buffers[i] += value
            else:
                if i not in buffers:
                    buffers[i] = value.new_zeros(v, n, *value.shape[1:])
                buffers[i][:, sample] += value

        # parameters whose readers are proven per sample (:mod:`._graph.readers`): every
        # sample's products off one pass to the readers' outputs (a pass per sample costs
        # N times the region)
        fast = recording.per_sample_readers(source, grads)
        found = [(i, pair) for i, pairs in fast.items() for pair in pairs]
        # tables used once, by one lookup: squared from the lookup's vectors
        lone = recording.lone_lookups(source) if squares is not None else set()
        edges = shared_edges([reader for _, (reader, _) in found])
        sizes = [edge_numel(edge) // n for edge, _ in edges]
        for group in reader_groups(sizes, reader_room(source, grads)):
            with blocked(source.frontier):
                results = list(batched_grad(
                    [source.target], [edges[g][0] for g in group], [grads]
                ))  # fmt: skip
            for j, g in enumerate(group):
                value, results[j] = results[j], None
                for k in edges[g][1]:
                    i, (reader, stride) = found[k]
                    if value is None:
                        continue
                    if i in lone:  # empty without ``squares``
                        squares(i, lookup_squares(reader, value, n, stride))
                    else:
                        add(i, None, read_per_sample(reader, value, n, stride))
                release([found[k][1][0] for k in edges[g][1]])
                del value
        # any other parameter: one pass per sample, the other samples' vectors zero
        # (a lookup's gradients added into rows: batched over columns)
        wanted: list[tuple[int, Gather | None]] = []
        for i in source.params:
            if i not in fast:
                wanted += [(i, g) for g in source.gathers.get(i, [None])]
        if wanted:

            def each(i: int, sample: int, value: Tensor, gather: Gather | None) -> None:
                if gather is not None and i in lone:  # the sample's squares
                    squares(i, lookup_squares(gather, value, 1, value[0].numel()))
                else:
                    add(i, sample, value if gather is None else scatter_rows(gather, value))

            _Products._one_sample_at_a_time(recording, source, grads, wanted, each)

    @staticmethod
    def _one_sample_at_a_time(
        recording: Recording,
        source: _Source,
        grads: Tensor,
        wanted: list[tuple[int, Gather | None]],
        each: Callable[[int, int, Tensor, Gather | None], None],
    ) -> None:
        """The products of ``wanted`` parameters, one backward pass per sample.

        Args:
            recording: The recording.
            source: The glue region.
            grads: ``[V, N, ...]`` vectors at its start.
            wanted: ``(parameter index, its lookup or None)`` pairs.
            each: Takes ``(index, sample, gradient, lookup)``: the gradient of the
                parameter (``[V, *param]``), or at the lookup's output, with the other
                samples' vectors zero.
        """
        n = grads.shape[1]
        inputs = [recording.params[i] if g is None else g.edge for i, g in wanted]
        masked = torch.zeros(grads.shape, dtype=grads.dtype, device=grads.device)
        for sample in range(n):
            masked[:, sample] = grads[:, sample]
            with blocked(source.frontier):
                results = batched_grad([source.target], inputs, [masked])
            for (i, gather), value in zip(wanted, results, strict=True):
                if value is not None:
                    each(i, sample, value, gather)
            # only now: with one sample, autograd may return ``masked`` itself (or a
            # view of it) as a parameter's gradient
            masked[:, sample] = 0

    def end(self, recording: Recording) -> None:
        for i, value in self._buffers.items():
            self._add(i, self._square(i, value))
        self._buffers = {}
        tied, self._tied = self._tied, {}
        for i, value in tied.items():
            self._add(i, value)
        self.carried = {}

    def _square(self, index: int, products: Tensor) -> Tensor:
        return products.square().sum((0, 1))


class DiagonalGGN(_Products):
    """The GGN diagonal of the batch, one tensor per parameter (summed over samples)."""

    windowed = True
    gram_only = True
    sums_squares = True

    def __init__(self, problem: Problem, samples: int):
        super().__init__(problem, samples)
        self.result = [torch.zeros_like(p) for p in problem.params]
        self._mask: Tensor | None = None

    def begin(self, sqrt: SqrtHessianFactor, start: int, stop: int) -> None:
        super().begin(sqrt, start, stop)
        # (no sqrt: columns below a cut, not the output's)
        self._mask = None if sqrt is None else sqrt.squared_mask(start, stop)

    def _into(self, call: Call) -> dict[str, Tensor]:
        # the diagonal's accumulators themselves (a skipped parameter is left alone), a
        # tied table's parts for this sweep
        return {
            pname: self._tied.get(i, self.result[i])
            for i, pname in call.params
            if i not in self._skip
        }

    def layer(self, recording: Recording, call: Call, grads: Tensor) -> None:
        tied = [
            (i, pair) for i, _ in call.params
            if (pair := recording.tied.get(i)) is not None and i not in self._skip
        ]  # fmt: skip
        for i, _ in tied:
            if i not in self._tied:
                self._tied[i] = torch.zeros_like(self.result[i])
        super().layer(recording, call, grads)
        for i, (head, embedding) in tied:
            if call.index == head:  # the head's products on the tokens' rows
                self.carried[i] = tied_rows(
                    call.ctx, dense(grads), recording.calls[embedding].ctx
                )
            elif i in self.carried:  # the embedding: the cross term
                rows = self.carried.pop(i)
                self._add(i, tied_cross(call.ctx, dense(grads), rows))

    def glue(self, recording: Recording, source: _Source, grads: Tensor) -> None:
        # a table used once, by one lookup: its squares without [V, N, rows, D]
        self._glue_products(recording, source, grads, self._buffers, squares=self._add)

    def _unshared(self, call: Call, grads: Tensor) -> None:
        # one-hot columns at the model output: the diagonal from the mask alone
        if (
            self._mask is not None
            and call.ctx.output
            and self._in_place(call, call.rule.diag_onehot, self._mask)
        ):
            return
        super()._unshared(call, grads)

    def end(self, recording: Recording) -> None:
        super().end(recording)
        self._mask = None

    def absorb(self, later: Quantity) -> None:
        for acc, value in zip(self.result, later.result, strict=True):
            acc.add_(value)


# the internal switch (tests, benchmarks): False squares every layer's per-sample
# products, as before the rules' shortcuts (:meth:`~ggnchunk.extend.Rule.diag_per_sample`)
PER_SAMPLE_SHORTCUTS = True


class PerSampleDiagonal(_Products):
    """Each sample's GGN diagonal, ``[N, *param.shape]`` per parameter."""

    every_product = True
    windowed = True
    reduces_squares = True

    def __init__(self, problem: Problem, samples: int):
        super().__init__(problem, samples)
        self.result = [p.new_zeros(samples, *p.shape) for p in problem.params]
        self._parts: list[list[Tensor]] = [self.result]

    def _square(self, index: int, products: Tensor) -> Tensor:
        return products.square().sum(0)

    def layer(self, recording: Recording, call: Call, grads: Tensor) -> None:
        # a windowed block at a layer whose parameters are used nowhere else: each
        # sample's squares on the boxes (no [V, N, *param] products, no dense copy)
        if self._on_boxes(recording, call, grads, per_sample=True):
            return
        # a layer's parameters used nowhere else: squared per sample by the rule where
        # it has a shortcut (no [V, N, *param] products)
        if (
            PER_SAMPLE_SHORTCUTS and call.params
            and not any(i in recording.reused for i, _ in call.params)
        ):  # fmt: skip
            values = call.rule.diag_per_sample(call.ctx, dense(grads))
            if values is not None:
                for i, pname in call.params:
                    self._add(i, values[pname])
                return
        super().layer(recording, call, grads)

    def absorb(self, later: Quantity) -> None:
        self._parts.append(later.result)

    def final(self) -> list[Tensor]:
        if len(self._parts) > 1:
            self.result = [torch.cat(values) for values in zip(*self._parts, strict=True)]
            self._parts = [self.result]
        return self.result

    def _reduced(self) -> list[Tensor]:
        return self.final()  # the sub-batches' parts joined first


class OutputVariance(_Products):
    r"""Per-output variance under a diagonal posterior: ``sum_p (J_n^T e_m)_p**2 s_p``.

    The columns are the identity over the output coordinates (``m``, one per column, the
    same for every sample); at every parameter the squared per-sample products are
    weighted by the posterior variance ``s`` and summed over the parameter's entries,
    giving ``[V, N]`` per sweep, written to the output coordinates ``start:stop``.

    Args:
        problem: The checked problem (its loss is not used).
        samples: Samples of the forward pass.
        variance: The posterior variance, one tensor of each parameter's shape.
        output_shape: ``output.shape[1:]`` (set by the first forward pass).
    """

    every_product = True
    windowed = True
    reduces_squares = True

    def __init__(self, problem: Problem, samples: int, variance: list[Tensor]):
        super().__init__(problem, samples)
        self._variance = variance
        self._parts: list[Tensor] = []
        self._chunk: Tensor | None = None

    def factorize(self, output: Tensor, targets: Tensor, scale: float) -> SqrtHessianFactor:
        self.result = output.new_zeros(output.shape[0], output[0].numel())
        self._shape = output.shape
        self._parts = [self.result]
        return identity_factor(output)

    def begin(self, sqrt: SqrtHessianFactor, start: int, stop: int) -> None:
        super().begin(sqrt, start, stop)
        self._chunk = self.result.new_zeros(stop - start, self.samples)

    def _accumulate(self, index: int, value: Tensor) -> None:
        self._chunk += value

    def _square(self, index: int, products: Tensor) -> Tensor:
        weighted = products.square().mul_(self._variance[index])
        return weighted.flatten(2).sum(2)

    def layer(self, recording: Recording, call: Call, grads: Tensor) -> None:
        # a windowed block at a layer whose parameters are used nowhere else: the
        # weighted squares per column and sample on the boxes (no [V, N, *param])
        weights = {pname: self._variance[i] for i, pname in call.params}
        if not self._on_boxes(recording, call, grads, weights=weights):
            super().layer(recording, call, grads)

    def end(self, recording: Recording) -> None:
        super().end(recording)
        start, stop = self._range
        self.result[:, start:stop] += self._chunk.T  # the sweep's whole range, once
        self._chunk = None

    def abort(self) -> None:
        super().abort()
        self._partial.clear()  # nothing was added: a retry redoes every parameter
        self._chunk = None

    def _reduced(self) -> list[Tensor]:
        self._join()  # the sub-batches' parts joined first
        return [self.result]

    def absorb(self, later: Quantity) -> None:
        self._parts.append(later.result)

    def _join(self) -> None:
        if len(self._parts) > 1:
            self.result = torch.cat(self._parts)
            self._parts = [self.result]

    def final(self) -> Tensor:
        self._join()
        result = self.result.detach()
        return result.view(result.shape[0], *self._shape[1:])


class KroneckerFactors(Quantity):
    """Kronecker factors of the GGN blocks of Linear and Conv layers (KFLR).

    :attr:`result` is ``(output factors, input factors)`` keyed by layer name; the output
    factors sum over the columns, the input factors are made once per forward pass.
    """

    gram_only = True

    def __init__(self, problem: Problem, samples: int):
        super().__init__(problem, samples)
        self.result: tuple[dict[str, Tensor], dict[str, Tensor]] = ({}, {})
        self._chunk: dict[int, Tensor] = {}
        self._into: dict[str, Tensor] = {}  # an earlier sub-batch's input factors

    def continues(self, earlier: Quantity) -> None:
        """Add the input factors to an earlier sub-batch's, in place (no second copy).

        Args:
            earlier: The merged quantity of the earlier sub-batches.
        """
        self._into = dict(earlier.result[1])

    def check(self, recording: Recording) -> None:
        recording.check_kron(self.problem.names)

    def start(self, recording: Recording) -> None:
        outputs, inputs = self.result
        for call in recording.calls:
            if not call.params:
                continue
            module = call.ctx.module
            outputs[call.name] = module.weight.new_zeros(
                module.weight.shape[0], module.weight.shape[0]
            ).detach()
            if any(pname == "weight" for _, pname in call.params):
                into = self._into.pop(call.name, None)
                inputs[call.name] = call.rule.input_factor(call.ctx, into)

    def fixed_bytes(
        self, recording: Recording, element: int, cut: tuple[str, int] | None = None
    ) -> int:
        # no rule caches (patches dropped after the input factors); the totals are
        # allocated with the forward pass, each chunk's own on top
        return sum(f.numel() for f in self.result[0].values()) * element

    def begin(self, sqrt: SqrtHessianFactor, start: int, stop: int) -> None:
        self._chunk = {}

    def layer(self, recording: Recording, call: Call, grads: Tensor) -> None:
        if call.params:
            value = call.rule.output_factor(call.ctx, grads)
            old = self._chunk.get(call.index)
            self._chunk[call.index] = value if old is None else old + value

    def end(self, recording: Recording) -> None:
        for index, value in self._chunk.items():
            self.result[0][recording.calls[index].name].add_(value)
        self._chunk = {}

    def abort(self) -> None:
        self._chunk = {}

    def absorb(self, later: Quantity) -> None:
        for store, values in zip(self.result, later.result, strict=True):
            for name, value in values.items():  # in place: the factors are this call's
                if store.get(name) is value:  # an input factor added to in place
                    continue
                store[name] = store[name].add_(value) if name in store else value

    def _reduced(self) -> list[Tensor]:
        return list(self.result[0].values())  # every rank has the input factors already


class Gradient(Quantity):
    """The loss gradient: one vector ``dL/df`` backpropagated to the parameters."""

    batched = False

    def __init__(self, problem: Problem, samples: int = 0):
        super().__init__(problem, samples)
        self.result: list[Tensor | None] = [None] * len(problem.params)
        self._back: Tensor | None = None

    def _add(self, index: int, value: Tensor | None) -> None:
        if value is not None:
            old = self.result[index]
            self.result[index] = value if old is None else old + value

    def through(self, source: _Source, grads: Tensor) -> tuple[Tensor | None, ...]:
        return plain_grad([source.target], source.frontier, [grads])

    def layer(self, recording: Recording, call: Call, grads: Tensor) -> None:
        # the parameters and the input in one backward through the layer
        targets = [recording.params[i] for i, _ in call.params]
        if call.leaf is not None:
            targets.append(call.leaf)
        results = plain_grad([call.out_edge], targets, [grads])
        for (i, _), result in zip(call.params, results, strict=False):
            self._add(i, result)
        self._back = results[-1] if call.leaf is not None else None

    def backprop(self, recording: Recording, call: Call, grads: Tensor) -> Tensor | None:
        back, self._back = self._back, None
        return back

    def glue(self, recording: Recording, source: _Source, grads: Tensor) -> None:
        params = [recording.params[i] for i in source.params]
        with blocked(source.frontier):
            results = plain_grad([source.target], params, [grads])
        for i, result in zip(source.params, results, strict=True):
            self._add(i, result)
