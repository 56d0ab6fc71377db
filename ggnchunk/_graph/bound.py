"""The memory bound of a sweep: bytes per column, fixed bytes, the fields' images.

Computed by the sweep's own traversal (:mod:`.traverse`) on sizes instead of tensors,
with the rules' byte counts (:mod:`ggnchunk._rules`).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn

from ggnchunk._autograd import (
    GradientEdge,
    edge_key,
)
from ggnchunk._graph.parts import Call, _Source, _Waiting
from ggnchunk._graph.traverse import STOP, Traversal
from ggnchunk._rules.conv import ConvRule, ConvTransposeRule
from ggnchunk._rules.folded import FoldedRule
from ggnchunk._rules.kernels import MAPS_MARGIN

_MAP_RULES = (ConvRule, ConvTransposeRule, FoldedRule)


class MemoryBound(Traversal):
    """The bytes a sweep over the recording needs (mixed into the recording)."""

    def column_bytes(
        self, element: int, windowed: bool = False, cut: tuple[str, int] | None = None
    ) -> int:
        """An upper bound on the bytes one square-root column costs during a sweep.

        Runs the sweep's own traversal (:meth:`_traverse`) on sizes instead of tensors:
        which backpropagated vectors are alive at each step (waiting at layer outputs and
        glue sources, the current layer's and its rule's), plus autograd's buffers
        inside the glue (twice the vectors at the glue's ends, or the largest node's
        gradients in and out where more: an eager attention's scores) and per-sample
        products of shared parameters. The largest total, per column.

        With ``windowed`` (after a windowed sweep, :attr:`windowed_bound_ready`), the
        sizes at layer outputs and inputs are those the windowed sweeps had there (the
        boxes' sizes, from the layers' geometry: the same for every column), twice them
        where blocks were added on the union of their boxes (a union's size can depend
        on where a column lies, :data:`ggnchunk._windows.UNIONS`), never more than the
        full map's, and each rule's own bytes shrink with its output's share of the map.

        Args:
            element: Bytes per element of the computation's dtype.
            windowed: Count the windowed sweeps' sizes.
            cut: ``("above", index)``: the sweeps stop before call ``index``, where they
                add their vectors to a Gram factor (:class:`.compress.Cut`);
                ``("below", index)``: the sweeps start there, with a factor's columns.

        Returns:
            Bytes per column (a chunk of ``V`` columns needs ``V`` times this).
        """
        n = self._batch
        worst = 0
        # the largest total at each layer's own steps (its products and backprop, where
        # its rule's transient memory is held): :meth:`layer_steps`
        steps: dict[int, int] = {}
        current: list[int | None] = [None]  # the layer whose steps are settled
        seen = self._seen if windowed else {}
        margin = self.alignment_margin()

        class Meeting(_Waiting):
            """Windowed blocks meeting at a place: added on the union of their boxes.

            Both are reboxed, then summed: three blocks beside the two.
            """

            def add(self, store, key, value, fresh=False):
                if windowed and store.get(key) is not None:
                    settle(value + 3 * max(value, store[key]))
                super().add(store, key, value, fresh)

        waiting = Meeting()
        # layers whose products the windowed sweeps squared on the boxes, never on a
        # dense copy: nothing kept per column (each sample's diagonal, say)
        boxed = {
            call.index
            for call in self.calls
            if ("boxed", call.index) in seen
            and ("dense", call.index) not in seen
            and ("kept", call.index) not in seen
        }

        def sized(where: str, call: Call, full: int) -> int:  # at a layer
            if not windowed or ("dense", call.index) in seen:
                return full
            return min(full, margin * seen.get((where, call.index), full))

        def settle(extra: int) -> None:
            nonlocal worst
            held = waiting.total() + extra
            worst = max(worst, held)
            if current[0] is not None:
                steps[current[0]] = max(steps.get(current[0], 0), held)

        def glue(source: _Source, size: int) -> list[tuple[GradientEdge, Any]]:
            full = [(e, self._end_numel(e)) for e in source.frontier]
            if windowed and size < source.numel:  # a cat sliced on the boxes, or
                # a region crossed on them (:mod:`.glue_windows`)
                outs = [(e, self._end_numel(e, seen)) for e in source.frontier]
                glue_plan = self.glue_plan(source)
                if glue_plan is not None or source.params:
                    added = sum(v for _, v in outs)
                    buffers = 2 * (size + added)  # the nodes' results on the boxes
                    if glue_plan is not None:  # max poolings' index maps
                        buffers += -(-glue_plan.index_bytes // element)
                    if glue_plan is None or glue_plan.handoffs:  # dense from a node on
                        buffers += 2 * (source.numel + sum(v for _, v in full))
                        buffers += -(-source.workspace // n)
                    if source.params:  # the parameters' products: dense vectors
                        buffers += (
                            source.numel + 2 * source.reader_numel
                            + sum(self._params[i].numel() for i in source.params)
                        )  # fmt: skip
                    inner = source.inner  # autograd's buffers of the region's nodes
                    if glue_plan is not None and not glue_plan.handoffs:
                        # crossed on the boxes alone: the nodes' buffers shrink with
                        # the largest share of a map the boxes cover at the region's
                        # ends (dense, they planned a column per pass for a skip added
                        # to a resized path: 12,288 passes, 73 s, where one took 0.13 s)
                        shares = [size / source.numel] + [
                            v / f for (_, v), (_, f) in zip(outs, full, strict=True) if f
                        ]
                        inner = math.ceil(inner * min(1.0, max(shares)))
                    settle(size + added + max(buffers, inner))
                return outs
            added = sum(v for _, v in full)
            buffers = max(2 * (size + added), source.inner) + -(-source.workspace // n)
            if source.params:
                # the samples' vectors one at a time, or the readers' gradients (a
                # group at most the region's size, and one scaled copy of a reader's)
                buffers += size + 2 * source.reader_numel
                # (a table used once by one lookup: its grouped sums, no bigger than
                # the lookup's vectors, counted with the readers')
                lone = self.lone_lookups(source)
                buffers += sum(
                    self._params[i].numel() for i in source.params if i not in lone
                )
            settle(size + added + buffers)
            return full

        def layer(call: Call, size: int) -> int | None:
            rule = _rule_bytes(call, element)[0] // (element * n)
            if windowed:
                size = sized("out", call, call.out_numel)
                rule = -(-rule * size // max(call.out_numel, 1))
            shared = sum(
                self._params[i].numel()
                for i, _ in call.params
                if i in self.shared and call.index not in boxed
            )
            current[0] = call.index
            try:
                settle(size + rule + shared + tied.get(call.index, 0))
                if call.leaf is None:
                    return None
                inputs = sized("in", call, call.ctx.x[0].numel())
                settle(size + inputs)
                return inputs
            finally:
                current[0] = None

        # a tied table's rows kept from the head to the embedding (counted throughout)
        # and, at the head, the gathered logits they are made from
        tied: dict[int, int] = {}
        carried = 0
        for head, embedding in self.tied.values():
            rows = self.calls[embedding].out_numel
            positions = rows // max(self.calls[embedding].ctx.module.embedding_dim, 1)
            inner = self.calls[head].ctx.x[0].numel() // max(
                self.calls[head].ctx.x.shape[-1], 1
            )
            tied[head] = tied.get(head, 0) + inner * positions + rows
            carried += rows

        # the sweep's own traversal, on sizes (elements per column and sample)
        def at_cut(held: _Waiting, call: Call) -> Any:
            nonlocal worst
            if cut is None or call.index != cut[1]:
                return None
            if cut[0] == "above":  # the rows of the factor: dense, joined, in float64
                # (the dense copies and their join, then the float64 rows, their
                # concatenation with the waiting ones and the QR's copy: 6 elements of
                # float32 per element; the factor's own tensors are fixed bytes)
                dense = sum(
                    self.calls[self._out_keys[key]].out_numel for key in held.outs
                ) + sum(self._sources[key].numel for key in held.srcs)
                settle(6 * dense)
                return STOP
            worst = 0  # below: what the sweeps from here hold
            steps.clear()
            settle(0)
            return None

        self._traverse(
            self._sources[self.output_key].numel, layer, glue, waiting=waiting,
            joint=None if cut is None else at_cut,
        )  # fmt: skip
        squared = {i for c in self.calls if c.index in boxed for i, _ in c.params}
        shared_total = sum(self._params[i].numel() for i in self.shared if i not in squared)
        scale = self.size_margin() * n * element
        self._layer_steps = {
            index: int(scale * (held + shared_total + carried))
            for index, held in steps.items()
        }
        return int(scale * (worst + shared_total + carried))

    _layer_steps: dict[int, int] | None = None

    def _calls_on(self, cut: tuple[str, int] | None) -> list[Call]:
        """The calls on a cut's side (:meth:`column_bytes`' ``cut``), or all of them."""
        if cut is None:
            return self.calls
        side, index = cut
        return [c for c in self.calls if (c.index > index) == (side == "above")]

    def layer_steps(
        self, element: int, cut: tuple[str, int] | None = None
    ) -> tuple[int, int, list[tuple[int, int]]]:
        """The dense bound split at the layers: where each rule's transient memory is held.

        :meth:`fixed_bytes` counts the largest rule's transient bytes beside the largest
        column of the whole sweep (:meth:`column_bytes`), but a layer's transient bytes
        are held only during its own steps, beside the columns alive there: a ResNet's
        512-channel layers hold a weight-sized total (9 MiB) where the columns are 4x4
        maps, its first layers 32x32 maps with a small weight. Counted together, the
        bound left a budget room for one column where three fitted.

        Args:
            element: Bytes per element.
            cut: As in :meth:`column_bytes`.

        Only the parameter-sized totals (:meth:`~ggnchunk.extend.LayerRule.totals_bytes`)
        are held apart: the rest of the rules' transient bytes (working blocks) stays
        counted beside every column, as the slack it has been (measured peaks of dense
        passes ran up to ~10% above the columns' count at glue steps: a residual
        GroupNorm model, 0.34-0.37 MiB per column against 0.336 counted, 63.9 MiB
        under a 64 MiB budget where a split of all transient bytes let that go).

        Returns:
            ``(largest transient, largest transient but totals, [(transient, column
            bytes) per layer step])``: a chunk of ``V`` columns needs ``fixed_bytes -
            largest + max(t + V * c)`` over the steps and ``(rest, column_bytes)``,
            instead of ``fixed_bytes + V * column_bytes``.
        """
        self.column_bytes(element, cut=cut)
        calls = self._calls_on(cut)
        layer_steps = self._layer_steps or {}
        pairs, rest = [], 0
        for call in calls:
            transient = _rule_bytes(call, element)[2]
            totals = call.rule.totals_bytes(call.ctx, element) if call.params else 0
            rest = max(rest, transient - min(totals, transient))
            if totals > 0 and call.index in layer_steps:
                pairs.append((transient, layer_steps[call.index]))
        return self.transient_bytes(element, cut), rest, pairs

    def transient_bytes(self, element: int, cut: tuple[str, int] | None = None) -> int:
        """The largest transient bytes of one rule's step (:meth:`fixed_bytes`'s share).

        Args:
            element: Bytes per element.
            cut: As in :meth:`fixed_bytes`.

        Returns:
            Bytes.
        """
        calls = self._calls_on(cut)
        return max((_rule_bytes(call, element)[2] for call in calls), default=0)

    def column_macs(self, index: int) -> int:
        """Multiply-adds per dense column and sample from before call ``index`` down.

        Counted from the layers' shapes (a convolution's or a linear layer's vectors'
        backprop: each output element times its inputs; one per output element for
        any other layer; twice where the layer has trainable parameters, for their
        products); the glue between them is left out (the count is a lower bound).
        :class:`.compress.Cut` weighs its factor's cost against it.

        Args:
            index: The call before which a sweep would stop.

        Returns:
            Multiply-adds.
        """
        prefix = getattr(self, "_macs_prefix", None)
        if prefix is None:  # once per recording (asked at every place a cut is tried)
            prefix = self._macs_prefix = self._layer_macs()
        return prefix[index]

    def _layer_macs(self) -> list[int]:
        """Multiply-adds from the first call up to each call, inclusive (see above)."""
        prefix, total = [], 0
        for call in self.calls:
            module, work = call.ctx.module, call.out_numel
            if isinstance(module, nn.Linear):
                work *= module.in_features
            elif isinstance(module, nn.modules.conv._ConvNd):
                kernel = math.prod(module.kernel_size)
                if module.transposed:  # each input element reaches C_out / g * k
                    x = call.ctx.x
                    inputs = x[0].numel() if isinstance(x, Tensor) else call.out_numel
                    work = inputs * (module.out_channels // module.groups) * kernel
                else:
                    work *= module.in_channels // module.groups * kernel
            total += 2 * work if call.params else work
            prefix.append(total)
        return prefix

    def alignment_margin(self) -> int:
        """The factor on the windowed sweeps' sizes for columns placed elsewhere.

        Every windowed map sizes its box from the layers' geometry alone, the same for
        every column (tested for one column per sweep at every output position of the
        windows' test table), except a union of two blocks' boxes where paths meet: its
        size can depend on the column's place modulo the paths' strides, and the first
        sweeps may not have met the widest. ``y + up(down(y))`` grows from one position
        per axis to two (four times in two dimensions), more than this margin: there
        the budget's measured peaks shrink the chunks (:mod:`ggnchunk._scheduling`).

        Returns:
            2 where windowed sweeps added blocks on their union, else 1.
        """
        return 2 if self._unions else 1

    def _end_numel(self, edge: GradientEdge, seen: dict[Any, int] | None = None) -> int:
        """A frontier edge's elements per column and sample (a windowed sweep's).

        Args:
            edge: A layer output, or another region's source (a cut).
            seen: The windowed sweeps' sizes (:attr:`_seen`); ``None``: the full size.

        Returns:
            The full size, or the largest the windowed sweeps had there times
            :meth:`alignment_margin`, never more than the full size.
        """
        key = edge_key(edge)
        if key in self._out_keys:
            call = self.calls[self._out_keys[key]]
            full, place = call.out_numel, ("out", call.index)
            if seen is not None and ("dense", call.index) in seen:
                return full
        else:
            full, place = self._sources[key].numel, ("source", key)
        if seen is None:
            return full
        return min(full, self.alignment_margin() * seen.get(place, full))

    def size_margin(self) -> float:
        """The factor on the sizes for what they leave out: 1.5 with maps, else 1.

        Convolutions' kernels allocate workspaces beyond their vectors and the allocator
        reuses blocks of maps partly (measured up to ~1.5x the sizes on the CPU).
        Vectors of features alone (linear layers, embeddings, norms and attention over
        tokens) were measured within the sizes, in fresh processes, after other work
        and after a one-pass call (the MLP autoencoder at 14 MiB, the 1,000-class
        classifier at 73.4 MiB, an eager GPT-2-style model at 64 MiB): with the maps'
        margin they planned 37, 24 and 24 passes that used 49%, 67% and 63% of the
        budget; without it 25, 21 and 18 passes, 65%, 94% and 88%.

        Returns:
            :data:`MAPS_MARGIN` where a layer with a rule works on maps (spatial axes,
            or a convolution, pooling or resampling rule) or no layer has a rule, else 1.
        """
        if not self.calls:
            return MAPS_MARGIN
        for call in self.calls:
            x = call.ctx.x
            if isinstance(call.rule, _MAP_RULES) or (isinstance(x, Tensor) and x.dim() > 3):
                return MAPS_MARGIN
        return 1.0

    def fixed_bytes(self, element: int, cut: tuple[str, int] | None = None) -> int:
        """Bytes the rules will keep for the whole forward pass, beyond what they hold now.

        Caches already built (by the forward pass or an earlier sweep) are in the memory
        in use; only what is still to be built, and the largest step's transient memory,
        is counted.

        Args:
            element: Bytes per element.
            cut: As in :meth:`column_bytes`: ``("above", index)`` counts only the calls
                the sweeps reach before they stop (after call ``index``; the caches
                below are built by the sweeps from the cut, planned then),
                ``("below", index)`` only the calls from there to the inputs.

        Returns:
            An upper bound.
        """
        calls = self._calls_on(cut)
        kept = sum(
            max(
                0,
                _rule_bytes(call, element)[1] - call.ctx.caches.held_bytes(call.ctx.inputs),
            )
            for call in calls
        )
        return kept + self.transient_bytes(element, cut)

    def field_image_bytes(self, element: int) -> int:
        """What a windowed sweep can keep of its fields' images (:attr:`images`).

        Fields made by the calls after a place can reach it (``K`` of them, each a map
        per sample): their images at every call's input and output (after glue and
        where blocks meet), at glue sources (with their products with the glue's
        parameters), and their per-sample parameter products.
        An estimate to reserve: the cache never holds more than it was given.

        Args:
            element: Bytes per element.

        Returns:
            Bytes.
        """
        after, total = 0, 0  # fields made by the calls after the current one
        reaching: dict[int, int] = {}  # call index -> fields reaching its input
        for call in reversed(self.calls):
            params = sum(self._params[i].numel() for i, _ in call.params)
            total += after * (call.out_numel + params)
            if call.leaf is not None:
                after += call.rule.field_count(call.ctx)
                total += after * call.ctx.x[0].numel()
            reaching[call.index] = after
        for source in self._sources.values():
            if not source.direct and source.key != self.output_key:
                # the fields' images there, and their products with the glue's
                # parameters (:meth:`~ggnchunk._quantities.Quantity.glue_block`)
                params = sum(self._params[i].numel() for i in source.params)
                total += reaching.get(source.last_consumer, 0) * (source.numel + params)
        return total * self._batch * element


def _rule_bytes(call: Call, element: int) -> tuple[int, int, int]:
    """A call's rule bytes: per column, fixed and transient (backprop only if frozen)."""
    rule, ctx = call.rule, call.ctx
    if call.params:
        return (
            rule.column_bytes(ctx, element), rule.fixed_bytes(ctx, element),
            rule.transient_bytes(ctx, element),
        )  # fmt: skip
    if call.leaf is None:  # nothing to do at all
        return 0, 0, 0
    return rule.backprop_bytes(ctx, element)
