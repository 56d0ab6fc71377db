"""The one traversal of the recorded calls, shared by the sweeps and the memory bound.

The sweeps (:mod:`.sweep`) run it on tensors and the memory bound (:mod:`.bound`) on
sizes, so the bound follows the sweep's order and liveness by construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from ggnchunk._autograd import (
    EdgeKey,
    GradientEdge,
    edge_key,
)
from ggnchunk._graph.glue_windows import GluePlan, plan
from ggnchunk._graph.parts import Call, _display, _Source, _Waiting
from ggnchunk._windows import FieldCache

STOP = object()
"""A ``joint`` step's answer: the traversal ends before this call."""


class Traversal:
    """What a recording holds after its plan, and the traversal over it.

    The attributes are set by :class:`~ggnchunk._graph.recording.Recording`; the sweeps,
    the memory bound and the checks are mixed into it and read them.
    """

    calls: list[Call]
    shared: set[int]
    output_key: EdgeKey | None
    images: FieldCache
    fallbacks: dict[str, str]
    window_ends: dict[str, str]
    windowed_sweeps: int
    passes_ahead: int
    _batch: int
    _params: list[nn.Parameter]
    _sources: dict[EdgeKey, _Source]
    _out_keys: dict[EdgeKey, int]
    _crossings: dict[int, list[EdgeKey]]
    _seen: dict[tuple[str, Any], int]
    _by_values: bool
    _unions: bool
    _glue_plans: dict[EdgeKey, Any]
    _geometric: bool | None
    _warned: bool

    def glue_plan(self, source: _Source) -> GluePlan | None:
        """A glue region's plan for windowed blocks (:mod:`.glue_windows`), kept.

        Args:
            source: The region.

        Returns:
            The plan, or ``None`` where the region's first node has no windowed form.
        """
        if source.key not in self._glue_plans:
            self._glue_plans[source.key] = (
                plan(source.target, source.frontier) if source.frontier else None
            )
        return self._glue_plans[source.key]

    def source_place(self, key: EdgeKey) -> str:
        """A glue region's source in words: the input of the layer that reads it.

        Args:
            key: The source.

        Returns:
            The place (a source added where regions overlap is read by no layer).
        """
        consumer = self._sources[key].last_consumer
        if consumer < len(self.calls):
            return f"the input of {_display(self.calls[consumer].name)}"
        if key == self.output_key:
            return "the model output"
        return "glue that several regions reach"

    def _traverse(
        self,
        seed: Tensor,
        layer: Callable[[Call, Tensor], Tensor | None],
        glue: Callable[[_Source, Tensor], list[tuple[GradientEdge, Any]]],
        visit: Callable[[str, Tensor], None] | None = None,
        waiting: _Waiting | None = None,
        compress: Callable[[Tensor], Tensor | None] | None = None,
        joint: Callable[[_Waiting, Call], Any] | None = None,
        resume: tuple[int, _Waiting] | None = None,
    ) -> None:
        """The one traversal: vectors from the output back over the calls.

        The sweeps run it on tensors and the memory bound (:meth:`column_bytes`) on
        sizes, so the bound follows the sweep's order and liveness by construction.

        Vectors meeting at one place are added. ``layer(call, vectors)`` does the layer's
        work and returns the vectors at its input (``None``: nothing passes on); once
        every consumer of a glue region's source is done (the calls taking it and the
        regions cut at it), ``glue(source, vectors)`` returns ``(edge, vectors)`` for
        the layer outputs and the other regions' sources the region reaches, so each
        region is crossed once.

        Args:
            seed: The vectors at the model output.
            layer: The work at a layer call.
            glue: The work through a glue region.
            visit: Called with ``(where, vectors)`` at every layer output and input.
            waiting: Where the vectors wait between steps (sizes: read by the caller).
            compress: Fewer columns for a layer's input vectors with the same Gram
                matrix, or ``None`` (:mod:`.compress`); tried only where nothing else of
                the sweep is alive, so every later step sees the new columns alone.
            joint: ``joint(waiting, call)`` before each layer call that has vectors
                waiting at its output: may put fewer columns with the same Gram matrix
                of all of them together in place of the vectors at every place
                (:meth:`_Waiting.replace`), or return :data:`STOP` to end the traversal
                there (their rows added to a Gram factor for later, :mod:`.compress`).
            resume: ``(index, waiting)``: go on from before call ``index``, where a
                traversal stopped, with the vectors ``waiting`` there (``seed`` is not
                used).
        """
        if resume is not None:
            first, waiting = resume
        else:
            first = len(self.calls) - 1
            waiting = _Waiting(self.images) if waiting is None else waiting
        outs, srcs, add = waiting.outs, waiting.srcs, waiting.add

        def push(key: EdgeKey, value: Tensor, fresh: bool) -> None:
            source = self._sources[key]
            if source.direct:
                add(outs, key, value, fresh=fresh)  # taken from its place
                return
            results = glue(source, value)
            for (edge, result), once in zip(results, _unshared(results), strict=True):
                if result is not None:
                    end = edge_key(edge)  # a layer output, or another region's source
                    add(outs if end in self._out_keys else srcs, end, result, fresh=once)

        def cross_due(index: int) -> None:
            # the regions due now: every call taking their source and every region cut
            # at it are done; crossed also where this call got nothing (its output
            # unused, as a feature computed and dropped) and the vectors waiting there
            # came from the source's other consumers
            for key in self._crossings.get(index, ()):
                if key in srcs:
                    pending = srcs.pop(key)
                    if visit is not None:
                        visit(self.source_place(key), pending)
                    push(key, pending, fresh=waiting.is_fresh(pending))

        if resume is None:
            push(self.output_key, seed, fresh=False)  # the caller's
            cross_due(len(self.calls))  # glue that only the output's region reaches
        for call in reversed(self.calls[: first + 1]):
            key = edge_key(call.out_edge)
            held = joint is not None and key in outs and key != self.output_key
            if held and joint(waiting, call) is STOP:
                return
            value = outs.pop(key, None)
            back = None
            if value is not None:
                if visit is not None:
                    visit(f"the output of {_display(call.name)}", value)
                back = layer(call, value)
                del value
            if call.source is not None and back is not None:
                # a result of ggnchunk's own rules: nothing else holds it (a registered
                # rule may return a tensor it keeps)
                fresh = type(call.rule).__module__.startswith("ggnchunk.")
                if compress is not None and not outs and not srcs:
                    smaller = compress(back)
                    if smaller is not None:
                        back, fresh = smaller, True
                add(srcs, edge_key(call.source), back, fresh=fresh)
            del back
            cross_due(call.index)
        if srcs:  # vectors never crossed on: a wrong answer, refused
            raise RuntimeError(
                "ggnchunk's sweep left vectors at glue it never crossed (a bug in the "
                "order of its glue regions): please report it with the model."
            )


def _unshared(results: list[tuple[Any, Any]]) -> list[bool]:
    """Per glue result: whether no other result of the region shares its memory.

    Autograd hands one tensor, or views of it, to several edges (an addition's
    backward passes the vectors on unchanged, a reshape's gives a view): such a result
    must not be written into while another place is still to receive the memory.

    Args:
        results: ``(edge, vectors)`` pairs (vectors: a tensor, a block or ``None``).

    Returns:
        One flag per pair.
    """

    def memory(value: Any) -> int | None:
        tensor = getattr(value, "data", value) if not isinstance(value, Tensor) else value
        if not isinstance(tensor, Tensor):
            return None
        return tensor.untyped_storage().data_ptr()

    places = [memory(value) for _, value in results]
    return [p is not None and places.count(p) == 1 for p in places]
