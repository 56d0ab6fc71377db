"""The backward sweeps: dense and windowed vectors over layers and glue.

A sweep visits the calls in reverse order (:mod:`.traverse`); at a layer the quantity
(:mod:`ggnchunk._quantities`) does its work and the rule maps the vectors to the layer's
input; glue is crossed by autograd (batched over the columns), or, for windowed blocks,
sliced where it is one ``torch.cat`` along channels. Operations that vmap loops over are
noted and warned about once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ggnchunk._autograd import (
    EdgeKey,
    GradientEdge,
    SlowBackwardWarning,
    batched_grad,
    blocked,
    edge_key,
    noting,
)
from ggnchunk._checks import warn
from ggnchunk._graph.compress import Cut, compressed, compressed_jointly
from ggnchunk._graph.glue_windows import cross
from ggnchunk._graph.parts import Call, _display, _Source, _Waiting
from ggnchunk._graph.traverse import Traversal
from ggnchunk._quantities import Quantity
from ggnchunk._windows import UNIONS, Windowed, attach, dense, joined_coeffs, mix, window
from ggnchunk._windows import add as add_vectors

# the internal switch (tests, benchmarks): False keeps every column of the chunk to the
# end of the sweep
COMPRESS = True


class Sweeps(Traversal):
    """Backward sweeps over the recording (mixed into the recording)."""

    def sweep(
        self,
        seed: Tensor,
        quantity: Quantity,
        visit: Callable[[str, Tensor], None] | None = None,
        cut: Cut | None = None,
        resume: _Waiting | None = None,
    ) -> None:
        """Backpropagate ``seed`` over the calls; the quantity works at the parameters.

        Args:
            seed: Vectors at the model output: ``[V, N, *output]`` columns, or
                ``[N, *output]`` for a quantity that is not batched (the gradient).
            quantity: What is computed at layers and glue parameters
                (:mod:`ggnchunk._quantities`); its :meth:`end` is called once the sweep
                is done.
            visit: Called with ``(where, vectors)`` at every layer output and input
                (used to check that samples stay independent).
            cut: Where a call's chunked sweeps stop (phase one, :class:`.compress.Cut`):
                the sweep ends there, its rows added to the factor, if the cut is
                decided there.
            resume: Phase two: the vectors at the cut's places (``seed`` is not used);
                the sweep goes on from there to the inputs.
        """

        def glue(source: _Source, grads: Tensor) -> list[tuple[GradientEdge, Any]]:
            if windows:
                self._see("source", source.key, grads, source.numel)
            if not source.cuts:
                return crossed(source, grads)
            # the other regions' sources it is cut at: their gradients are taken, and
            # their nodes pass nothing on (their own regions cross them, once)
            with blocked([self._sources[key].target for key in source.cuts]):
                return crossed(source, grads)

        def crossed(source: _Source, grads: Tensor) -> list[tuple[GradientEdge, Any]]:
            found: list[tuple[GradientEdge, Any]] = []
            block = grads if isinstance(grads, Windowed) else None
            split = None if block is None else self._split_channels(source, block)
            if split is not None:  # torch.cat along channels: the boxes stay
                return [(edge, split[edge_key(edge)]) for edge in source.frontier]
            glue_plan = None if block is None else self.glue_plan(source)
            if glue_plan is not None and source.frontier:
                # the region's nodes on the boxes (dense past a node without a windowed
                # form); its fields cross apart (once per forward pass)
                results, handed = cross(
                    glue_plan, block.windowed_part(), source.frontier, self._note(source)
                )
                results = self._glue_fields(source, block, results, quantity, False)
                self._window_ended(source, results, glue_plan.handed if handed else ())
                found = list(zip(source.frontier, results, strict=True))
            elif source.frontier:
                # a block crosses as its windowed part made dense, windowed again from
                # the values it reaches; its fields cross apart (once per forward pass)
                vectors = grads if block is None else block.windowed_part().dense()
                with noting(self._note(source)):
                    results = quantity.through(source, vectors)
                del vectors
                if block is not None:
                    self._by_values = True
                    results = self._glue_fields(source, block, results, quantity)
                    self._window_ended(source, results)
                found = list(zip(source.frontier, results, strict=True))
            if source.params:
                with noting(self._note(source)):
                    if isinstance(grads, Windowed) and grads.has_fields:
                        quantity.glue_block(self, source, grads)
                    else:
                        quantity.glue(self, source, dense(grads))
            return found

        windows = isinstance(seed, Windowed)
        if windows:
            self.windowed_sweeps += 1

        def layer(call: Call, grads: Tensor) -> Tensor | None:
            if windows:
                self._see("out", call.index, grads, call.out_numel)
                if call.params and quantity.squares_on_boxes(self, call, grads):
                    self._seen["boxed", call.index] = 1  # no products kept
                elif isinstance(grads, Windowed) and call.params:
                    self._seen["dense", call.index] = 1  # products of a dense copy
                elif call.params:
                    self._seen["kept", call.index] = 1  # dense vectors' products
            quantity.layer(self, call, grads)
            if call.leaf is None:
                return None
            back = quantity.backprop(self, call, grads)
            if windows:
                self._see("in", call.index, back, call.ctx.x[0].numel())
            return back

        # columns spanning few directions (below a vocabulary's head) replaced by fewer
        # with the same Gram, where the quantity depends on nothing else and no
        # parameter's per-column products are added over several uses (what the
        # quantity carries to a later layer is mapped with them)
        fewer = (
            (lambda vectors: compressed(vectors, quantity.carried))
            if COMPRESS and quantity.gram_only and not windows
            and not self.shared and visit is None else None
        )  # fmt: skip
        # the same over every place at once, where the columns span few directions of
        # all the vectors the sweep holds (below a segmenter's resize to the full image)
        together = None
        if COMPRESS and quantity.gram_only and not self.shared and visit is None:
            if cut is not None and resume is None:  # a chunk's sweep: stops at the cut
                columns = (seed.data if windows else seed).shape[0]

                def together(waiting: _Waiting, call: Call) -> Any:
                    return cut.step(waiting, call, columns, quantity.carried)

            elif resume is None:

                def together(waiting: _Waiting, call: Call) -> Any:
                    smaller = compressed_jointly(waiting.places(), quantity.carried)
                    if smaller is not None:
                        waiting.replace(smaller)

        unions = UNIONS.count
        start = None if resume is None else (cut.index, resume)
        try:
            self._traverse(
                seed, layer, glue, visit, compress=fewer, joint=together, resume=start
            )
        finally:
            if windows and UNIONS.count != unions:
                self._unions = True  # box sizes may depend on the columns' places
        if cut is not None and resume is None:
            cut.sweep_done()
        self._warn_fallbacks()
        quantity.end(self)

    def backprop(self, call: Call, grads: Tensor) -> Tensor:
        """Vectors ``[V, N, *out]`` at a call's output mapped to its input (the rule's map).

        Args:
            call: The layer call (its input needs the vectors).
            grads: The vectors at its output.

        Returns:
            ``[V, N, *input]``.
        """
        if isinstance(grads, Windowed):
            return self._backprop_windowed(call, grads)
        return self._backprop_dense(call, grads)

    def _backprop_windowed(self, call: Call, block: Windowed) -> Any:
        """A block through a call: the rule's windowed map (fields through its dense one).

        A rule without a windowed form maps the block's windowed part made dense, and the
        result is windowed again from its values. The fields at the call's input (the
        block's, mapped, then those the rule adds) are the same in every sweep: made in
        the first and kept in :attr:`images` under the call and the fields' origin.
        """
        part = block.windowed_part()
        back = call.rule.backprop_windowed(call.ctx, part)
        if back is None:
            self._seen["dense", call.index] = 1  # mapped as a dense copy
            self._by_values = True
            back = window(self._backprop_dense(call, part.dense()))
        own = back if isinstance(back, Windowed) and back.has_fields else None
        if block.has_fields or own is not None:
            key = self.images.key("call", call.index, block=block)

            def make() -> Tensor:
                parts = []
                if block.has_fields:
                    parts.append(self._backprop_dense(call, block.fields))
                if own is not None:
                    parts.append(own.fields)
                return parts[0] if len(parts) == 1 else torch.cat(parts)

            fields = self.images.get(key, make)
            coeffs = joined_coeffs(
                [b.coeffs for b in (block, own) if b is not None and b.has_fields]
            )
            if own is not None:
                back = own.windowed_part()
            back = attach(back, fields, coeffs, key)
        self._window_ended(call, [back])
        return back

    def _glue_fields(
        self, source: _Source, block: Windowed, results: tuple[Any, ...] | list[Any],
        quantity: Quantity, by_values: bool = True,
    ) -> list[Any]:  # fmt: skip
        """The windowed part's images through glue, with the fields' images.

        Dense results are windowed from their values where ``by_values``. The fields
        cross the glue once per forward pass (kept in :attr:`images`).
        """
        fields: tuple[Any, ...] = (None,) * len(results)
        key = None
        if block.has_fields:
            key = self.images.key("glue", source.key, block=block)

            def make() -> tuple[Any, ...]:
                with noting(self._note(source)):
                    return tuple(quantity.through(source, block.fields))

            fields = self.images.get(key, make)
        out = []
        for i, (r, f) in enumerate(zip(results, fields, strict=True)):
            if r is None and f is not None:  # reached by the fields only
                out.append(mix(block.coeffs, f))
                continue
            r = window(r) if by_values else r
            out.append(attach(r, f, block.coeffs, None if key is None else (key, i)))
        return out

    def _split_channels(
        self, source: _Source, block: Windowed
    ) -> dict[EdgeKey, Any] | None:
        """A block through glue that is one ``torch.cat`` of layer outputs along channels.

        The cat's backward slices the channel axis, so each layer output gets its slice
        of the block on the same boxes (fields sliced alike). ``None`` for any other glue
        (it is crossed by autograd).
        """
        if source.params:
            return None
        target = source.target
        node = target.grad_fn if isinstance(target, Tensor) else target.node
        if node is None or node.name() != "CatBackward0":
            return None
        if node._saved_dim % (2 + len(block.size)) != 1:
            return None
        parts: dict[EdgeKey, Any] = {}
        offset = 0
        for edge in node.next_functions:
            if edge[0] is None or edge_key(edge) not in self._out_keys:
                return None  # a slice's size is known for layer outputs only
            key = edge_key(edge)
            width = self.calls[self._out_keys[key]].ctx.out_shape[1]
            channels = slice(offset, offset + width)
            offset += width
            fields, origin = None, None
            if block.has_fields:  # a view: nothing to keep
                fields = block.fields[:, :, channels]
                if block.origin is not None:
                    origin = ("channels", offset - width, width, block.origin)
            part = Windowed(
                block.data[:, :, channels], block.start, block.size, fields, block.coeffs,
                origin,
            )  # fmt: skip
            if key in parts:
                part = add_vectors(parts[key], part, self.images)
            parts[key] = part
        if offset != block.data.shape[2]:
            return None
        return parts

    def _see(self, where: str, index: Any, value: Any, full: int) -> None:
        """Remember the largest size per column and sample a windowed sweep had."""
        if value is None:
            return
        if isinstance(value, Windowed):
            size = value.data.shape[2] * math.prod(value.box)
        else:
            size = full
        key = (where, index)
        self._seen[key] = max(self._seen.get(key, 0), size)

    @property
    def geometric_windows(self) -> bool:
        """Whether windowed sweeps keep every box by the layers' geometry alone.

        The sweep's own traversal on flags (whether a windowed block can arrive) finds
        the places a block reaches: there every layer that passes spatial vectors on has
        a windowed rule, and every glue region is one ``torch.cat`` of layer outputs
        along channels or has a :mod:`.glue_windows` plan (crossed on the boxes, and
        dense past a node without a windowed form). Elsewhere boxes are read from values
        (exact, but with copies the memory bound does not count). Places only dense
        vectors reach (after attention handed to autograd, say) do not matter.
        """
        if self._geometric is None:
            self._geometric = self._windows_by_geometry()
        return self._geometric

    def _windows_by_geometry(self) -> bool:
        by_values: list[str] = []

        class Flags(_Waiting):
            """Flags meeting at a place: a block can arrive if it can on either path."""

            def add(self, store, key, value, fresh=False):
                store[key] = int(bool(store.get(key, 0)) or bool(value))

        def layer(call: Call, windowed: int) -> int | None:
            if call.leaf is None:
                return None
            if not windowed:
                return 0
            if not call.rule.windowed:
                if len(call.ctx.out_shape) > 2:  # (no blocks without spatial axes)
                    by_values.append(call.name)
                return 0
            return 1

        def glue(source: _Source, windowed: int) -> list[tuple[GradientEdge, Any]]:
            if not source.frontier:
                return []
            if not windowed:
                return [(edge, 0) for edge in source.frontier]
            if not source.params and self._is_channel_cat(source):
                return [(edge, 1) for edge in source.frontier]
            glue_plan = self.glue_plan(source)
            if glue_plan is None:
                by_values.append(str(source.key))
                return [(edge, 1) for edge in source.frontier]
            ends = glue_plan.windowed_ends
            return [(edge, int(edge_key(edge) in ends)) for edge in source.frontier]

        self._traverse(1, layer, glue, waiting=Flags())
        return not by_values

    def _is_channel_cat(self, source: _Source) -> bool:
        target = source.target
        node = target.grad_fn if isinstance(target, Tensor) else target.node
        if node is None or node.name() != "CatBackward0":
            return False
        edges = node.next_functions
        if any(e[0] is None or edge_key(e) not in self._out_keys for e in edges):
            return False
        dims = len(self.calls[self._out_keys[edge_key(edges[0])]].ctx.out_shape)
        return node._saved_dim % dims == 1

    def windowed_share(self) -> float | None:
        """The windowed sweeps' vectors at the layers' outputs, as a share of full maps.

        The elements per column and sample the largest boxes had at every layer output
        a windowed sweep reached (full where the products took a dense copy), over the
        full maps' there: the share of the dense path's work the windows do, roughly.

        Returns:
            A number in ``(0, 1]``, or ``None`` before a windowed sweep.
        """
        if not self.windowed_sweeps:
            return None
        boxes = full = 0
        for call in self.calls:
            if ("out", call.index) not in self._seen:
                continue
            size = call.out_numel
            full += size
            if ("dense", call.index) in self._seen:
                boxes += size
            else:
                boxes += min(size, self._seen["out", call.index])
        return boxes / full if full else None

    @property
    def windowed_bound_ready(self) -> bool:
        """Whether :meth:`column_bytes` can count windowed sizes.

        After a windowed sweep whose boxes all came from the layers' geometry (box sizes
        the same for every column): boxes read from values after glue can be smaller for
        the first columns (at the map's border) than for later ones.
        """
        return self.windowed_sweeps > 0 and not self._by_values

    def _window_ended(
        self, where: Call | _Source, results: list[Any], handed: Any = ()
    ) -> None:
        """Remember where a block became dense maps (for the report).

        Vectors without spatial axes (a time embedding added to every position, a
        gate's per-channel scale) were never windowed: the maps beside them stay so.
        ``handed``: the glue nodes without a windowed form the block crossed dense.
        """
        if any(
            r is not None and not isinstance(r, Windowed) and r.dim() > 3 for r in results
        ):
            why = "the boxes fill the map"
            if handed:
                names = ", ".join(dict.fromkeys(handed))
                why = f"crossed dense by autograd at glue without a windowed form ({names})"
            self.window_ends.setdefault(self._place(where), why)

    def _backprop_dense(self, call: Call, grads: Tensor) -> Tensor:
        n = grads.shape[1]
        if call.rule.sample_free_backprop and grads.stride(1) == 0:
            # the same vectors for every sample (MSE's columns): map them once
            back = call.rule.backprop(call.ctx, grads[:, :1])
            if back is not None:
                return back.expand(back.shape[0], n, *back.shape[2:])
        back = call.rule.backprop(call.ctx, grads)
        if back is None:
            (back,) = batched_grad([call.out_edge], [call.leaf], [grads], self._note(call))
        return back

    def _end_name(self, edge: GradientEdge) -> str:
        """A frontier edge in words: a layer's output, or another region's source."""
        key = edge_key(edge)
        if key in self._out_keys:
            return _display(self.calls[self._out_keys[key]].name)
        return self.source_place(key)

    def _place(self, where: Call | _Source) -> str:
        """A layer call or glue region, in words."""
        if isinstance(where, Call):
            return f"{_display(where.name)} ({type(where.ctx.module).__name__})"
        ends = [self._end_name(e) for e in where.frontier]
        after = f" after {', '.join(ends[:3])}" if ends else ""
        before = self.source_place(where.key)
        return f"the operations before {before}{after}"

    def _note(self, where: Call | _Source) -> Callable[[str], None]:
        """Remember an operation that vmap ran once per column, and where."""

        def note(operation: str) -> None:
            if operation in self.fallbacks or _elementwise(operation):
                return
            self.fallbacks[operation] = self._place(where)

        return note

    def _warn_fallbacks(self) -> None:
        """Say once which operations the sweeps run once per column (slow, exact)."""
        if self._warned or not self.fallbacks:
            return
        self._warned = True
        found = "; ".join(f"{op} in {where}" for op, where in self.fallbacks.items())
        warn(
            f"torch has no batched backward for {found}: the backward sweeps run it once "
            "per square-root column, which is exact but can be many times slower. Layers "
            "with a rule (see ggnchunk.supported_layers_table()), frozen or not, "
            "F.scaled_dot_product_attention without dropout, F.interpolate, and pads, "
            "pooling, softmax, flips, masks and convolutions in the glue "
            "(docs/supported.md) are "
            "crossed by all columns at once: use those modules or calls instead of "
            "other functional calls or custom layers there, or call model.eval() if "
            "dropout inside attention is the cause.",
            SlowBackwardWarning,
        )


def _elementwise(operation: str) -> bool:
    """Whether vmap's per-column loop over ``operation`` costs only kernel launches.

    Elementwise backward kernels (activations, copies) do the same work looped as
    batched; the warning is for the kernels whose loop is the slow part (convolutions,
    normalizations, attention, pooling, resampling).
    """
    name = operation.removeprefix("aten::").split(".")[0].removesuffix("_out")  # overloads
    return name in _ELEMENTWISE or name.removesuffix("_backward") in _ACTIVATIONS


_ELEMENTWISE = frozenset({"copy_", "clone", "where", "masked_fill", "mul", "div"})
_ACTIVATIONS = frozenset({
    "tanh", "sigmoid", "threshold", "gelu", "silu", "hardsigmoid", "hardswish",
    "hardtanh", "leaky_relu", "elu", "softplus", "mish", "log_sigmoid", "rrelu_with_noise",
    "softshrink", "hardshrink", "prelu_kernel",
})  # fmt: skip
