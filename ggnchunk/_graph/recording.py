"""The recording of one forward pass: hooks on the layers with rules, then the plan.

:class:`Recording` is the object the engine holds: the hooks and the plan are here, the
sweeps (:mod:`.sweep`), the memory bound (:mod:`.bound`) and the checks
(:mod:`.checks`) are mixed in; all share the one traversal (:mod:`.traverse`).
"""

from __future__ import annotations

import copy
import os
import sys
import threading
from typing import Any

import torch
from torch import Tensor, nn

from ggnchunk._autograd import (
    EdgeKey,
    Gather,
    GradientEdge,
    Node,
    accumulated_variable,
    edge_key,
    edge_numel,
    edge_of,
    first_global_forward_hook,
    global_forward_hooks,
    grad_shape,
    output_count,
)
from ggnchunk._checks import warn
from ggnchunk._folding import from_batch, glue_workspace, layer_entered, layer_left
from ggnchunk._graph.bound import MemoryBound
from ggnchunk._graph.checks import Checks
from ggnchunk._graph.parts import Call, _display, _Source
from ggnchunk._graph.readers import (
    Broadcast,
    ConvWeight,
    Placed,
    Product,
    Reader,
    computed_weight,
    read_behind,
)
from ggnchunk._graph.sweep import Sweeps
from ggnchunk._rules import LayerRule, RuleContext
from ggnchunk._rules.tied import is_tied_pair
from ggnchunk._windows import FieldCache


class Recording(Sweeps, MemoryBound, Checks):
    """Hooks on the layers with rules for one forward pass, then plan and sweeps.

    Args:
        units: ``{module: (qualified name, rule)}``.
        params: The trainable parameters, in ``named_parameters()`` order.
        batch: Number of samples ``N`` in the forward pass.
        every_product: Every parameter takes the per-sample products' path (the
            quantity keeps them: each sample's diagonal, output variances), and the
            memory bound counts them.
        sums_squares: The quantity adds squares summed over columns and samples: a
            table shared by an embedding and an output head is added as the two
            layers' diagonals plus their cross term (:mod:`ggnchunk._rules.tied`), a
            table used once by one glue lookup from the lookup's vectors, neither from
            products kept per column.
    """

    def __init__(
        self,
        units: dict[nn.Module, tuple[str, LayerRule]],
        params: list[nn.Parameter],
        batch: int,
        every_product: bool = False,
        sums_squares: bool = False,
    ):
        self.every_product = every_product
        self.sums_squares = sums_squares and not every_product
        self._units = units
        # each layer's tensors as the rule was chosen for them (see _as_chosen)
        self._tensors = {
            module: _tensors_of(module, rule) for module, (_, rule) in units.items()
        }
        self._params = params
        self._param_index = {id(p): i for i, p in enumerate(params)}
        self._batch = batch
        self._thread = threading.get_ident()
        self._pending: dict[int, list[Any]] = {}
        self.calls: list[Call] = []
        self._settings: list[dict[str, Any]] = []  # each call's layer settings then
        self._handles: list[Any] = []
        self._sources: dict[EdgeKey, _Source] = {}
        # call index -> the glue sources crossed once it is done (downstream first)
        self._crossings: dict[int, list[EdgeKey]] = {}
        self._out_keys: dict[EdgeKey, int] = {}
        self.shared: set[int] = set()
        self.reused: set[int] = set()  # parameters used in several places
        # a table used by an output head and an embedding (parameter index -> the
        # head's and the embedding's call index): their diagonals plus a cross term
        self.tied: dict[int, tuple[int, int]] = {}
        self.output_key: EdgeKey | None = None
        self.fallbacks: dict[str, str] = {}  # operation vmap loops over -> where
        self._warned = False
        self.window_ends: dict[str, str] = {}  # where windowed columns became dense
        # sizes (elements per column and sample) windowed sweeps had at each call's
        # output and input, for the windowed memory bound; ("dense", i): a full map;
        # ("boxed", i) / ("kept", i): call i's products squared on the boxes / kept
        self._seen: dict[tuple[str, Any], int] = {}
        self._by_values = False  # a block crossed glue and was windowed from values
        self._unions = False  # blocks were added on the union of their boxes
        self._glue_plans: dict[EdgeKey, Any] = {}  # glue regions' windowed plans
        self.passes_ahead = 1  # passes of the forward pass's columns, at this pass's size
        self._geometric: bool | None = None  # whether boxes follow the geometry alone
        self.windowed_sweeps = 0
        self.images = FieldCache()  # the windowed fields' images, reused by every sweep
        # every node of the recorded graph, by id: see _pin_graph
        self._pins: dict[int, Node] = {}
        # layers with trainable parameters that ran with gradients disabled (inside
        # ``torch.no_grad()``, or a reentrant checkpoint's forward): name -> class
        self.without_grad: dict[str, str] = {}
        # the first of them that ran inside a reentrant checkpoint's forward
        self.in_checkpoint: str | None = None
        # the first layer with a rule that ran under the forward's own torch.autocast
        self.in_autocast: tuple[str, torch.dtype] | None = None

    # -- hooks -----------------------------------------------------------------------
    def install(self) -> None:
        """Register the hooks (removed by :meth:`remove`).

        A layer's output is recorded before any user hook can replace it (what such a
        hook computes from it is glue). A module's own hooks run after the global ones
        (``register_module_forward_hook``), so where a global forward hook exists the
        output is read by a global hook placed first.
        """
        ahead = global_forward_hooks()
        for module in self._units:
            self._handles.append(
                module.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
            )
            if not ahead:
                self._handles.append(
                    module.register_forward_hook(self._post_hook, prepend=True)
                )
        if ahead:
            self._handles.append(first_global_forward_hook(self._global_post_hook))

    def _global_post_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if module in self._units:
            return self._post_hook(module, args, output)
        return None

    def remove(self) -> None:
        """Remove the hooks; safe to call more than once."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending.clear()

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if threading.get_ident() != self._thread:
            return None  # another thread's forward: neither recorded nor popped
        stack = self._pending.setdefault(id(module), [])
        if not torch.is_grad_enabled():
            if any(id(p) in self._param_index for p in module.parameters(recurse=False)):
                name = self._units[module][0]
                self.without_grad.setdefault(name, type(module).__name__)
                if self.in_checkpoint is None and _in_reentrant_checkpoint():
                    self.in_checkpoint = name
            stack.append(None)
            return None
        if args:
            x, rest, key = args[0], args[1:], None
        elif "input" in kwargs:
            x, rest, key = kwargs["input"], (), "input"
        else:
            stack.append(None)
            return None
        if (
            not isinstance(x, Tensor) or x.dim() == 0 or x.shape[0] != self._batch
            or from_batch(x) is False or not self._as_chosen(module)
        ):  # fmt: skip
            # not a per-sample call (a BatchNorm1d on tokens flattened into the batch
            # axis, as timm's LeViT; a tensor not made from the batch whose axis 0 has
            # its size by chance, as T5's position bias with N queries): the glue
            # handles it, its inner calls folded. Also a layer whose weight is not the
            # one its rule was chosen for (:meth:`_as_chosen`)
            stack.append(None)
            return None
        if self.in_autocast is None and torch.is_autocast_enabled(x.device.type):
            # the engine turned autocast off around the forward: the model's own
            self.in_autocast = (
                self._units[module][0],
                torch.get_autocast_dtype(x.device.type),
            )
        layer_entered()  # its inner calls are the rule's, not glue to fold
        if x.requires_grad:
            leaf = x.detach().requires_grad_()
            stack.append((leaf, edge_of(x), leaf._version))
            if key is None:
                return (leaf, *rest), kwargs
            return args, {**kwargs, key: leaf}
        stack.append((None, None, x._version, x))
        return None

    def _as_chosen(self, module: nn.Module) -> bool:
        """Whether the layer runs on the tensors its rule was chosen for.

        A weight computed in ``forward`` and set on the layer (a hypernetwork), or
        swapped in by ``torch.func.functional_call`` (fast weights in meta-learning),
        is not the parameter the rule would read (during the call, or afterwards when
        ``functional_call`` has put the parameter back): such a call is glue, and the
        recorded graph takes the weight's own graph back to the parameters it comes
        from (the rule gave those a zero diagonal).
        """
        return all(
            getattr(module, name, None) is tensor
            for name, tensor in self._tensors[module].items()
        )

    def _post_hook(self, module: nn.Module, args: tuple, output: Any) -> Tensor | None:
        if threading.get_ident() != self._thread:
            return None
        stack = self._pending.get(id(module))
        entry = stack.pop() if stack else None
        if entry is None:
            return None
        layer_left()
        if not (isinstance(output, Tensor) and output.requires_grad):
            return None
        if output.dim() == 0 or output.shape[0] != self._batch:
            return None
        name, rule = self._units[module]
        leaf, source, version = entry[:3]
        x = leaf if leaf is not None else entry[3]
        node, replaced = output.grad_fn, None
        if output._is_view() and output._base is not x and output._base is not x._base:
            # a view of the layer's own result (nn.Linear on [N, T, D]): an in-place
            # operation on it (``q /= scale``) would rewrite the graph through its base
            # and leave the recorded node off the path (relative error 1.0 measured);
            # a copy is the layer's output instead, with its own node
            output = replaced = output.clone()
        ctx = RuleContext(module, (x,), (version,), tuple(output.shape))
        ctx.node = node
        ctx.index, ctx.images = len(self.calls), self.images
        rule.record(ctx)
        self._settings.append(_settings_of(module))
        params = [
            (self._param_index[id(p)], pname)
            for pname, p in module.named_parameters(recurse=False)
            if id(p) in self._param_index
        ]
        self.calls.append(
            Call(
                len(self.calls), name, rule, ctx, params, leaf, source, edge_of(output),
                output[0].numel(),
            )
        )  # fmt: skip
        return replaced

    # -- plan ------------------------------------------------------------------------
    def plan(self, output: Tensor) -> None:
        """Find each glue region's frontier and parameters (after the forward pass).

        Args:
            output: The model output, ``[N, ...]``.

        Raises:
            ValueError: If a layer's input was changed in place after the layer used it.
        """
        for call in self.calls:
            x = call.ctx.inputs[0]
            if x._version != call.ctx.versions[0]:
                kind = type(call.ctx.module).__name__
                raise ValueError(
                    f"the input of {_display(call.name)} ({kind}) was modified in place "
                    "after the layer used it (for example by an in-place activation or "
                    "`x += ...` on the same tensor). ggnchunk needs the value the layer "
                    "saw: use an out-of-place operation there."
                )
        if self.in_checkpoint is not None:
            _refuse_reentrant(f"around {_display(self.in_checkpoint)}")
        if self.in_autocast is not None:
            name, dtype = self.in_autocast
            raise ValueError(
                f"{_display(name)} ran inside torch.autocast (computing in {dtype}) that "
                "the model's forward enables. ggnchunk computes in the parameters' dtype "
                "and its rules cannot follow a layer that computes in another one. "
                "Turn the autocast in forward off for this call (a flag on the model, "
                "or torch.autocast(..., enabled=False) around that part); autocast "
                "around the call itself is turned off for you."
            )
        for call, settings in zip(self.calls, self._settings, strict=True):
            if _settings_of(call.ctx.module) != settings:
                # changed after the call (a layer called again with another dilation
                # or stride): the rule reads the settings of this call
                call.ctx.module = _as_called(call.ctx.module, settings)
        self._settings = []
        self._pin_graph(output)
        self._out_keys = {edge_key(c.out_edge): c.index for c in self.calls}
        uses: dict[int, int] = {}
        for call in self.calls:
            for i, _ in call.params:
                uses[i] = uses.get(i, 0) + 1
        out_edge = edge_of(output)
        self.output_key = edge_key(out_edge)
        self._sources = {}
        self._add_source(self.output_key, output, output[0].numel(), len(self.calls))
        for call in self.calls:
            if call.source is not None:
                self._add_source(
                    edge_key(call.source), call.source, call.ctx.x[0].numel(), call.index
                )
        self._walk_all()
        for source in self._sources.values():
            for i in source.params:
                uses[i] = uses.get(i, 0) + 1
        self._stop_without_parameters()
        silent = self._warn_without_grad(uses)
        # trainable parameters no gradient reaches (and not already warned about)
        self.unreached = [
            i for i in range(len(self._params)) if i not in uses and i not in silent
        ]
        self.reused = {i for i, count in uses.items() if count > 1}  # several places
        self.tied = self._tied_pairs(uses) if self.sums_squares else {}
        self.shared = {
            i for i, count in uses.items()
            if (count > 1 or self.every_product) and i not in self.tied
        }  # fmt: skip
        for call in self.calls:
            call.ctx.shared = any(i in self.shared for i, _ in call.params)
            call.ctx.output = edge_key(call.out_edge) == self.output_key
            # the diagonal's accumulators are handed to unshared calls' rules
            call.ctx.in_place = self.sums_squares and not call.ctx.shared
        self._schedule_crossings()

    def lone_lookups(self, source: _Source) -> set[int]:
        """The glue region's tables used once, by one lookup, squared there.

        Where the quantity adds the squares summed over samples (:attr:`sums_squares`),
        their diagonal is made from the lookup's vectors grouped by (sample, row),
        without per-sample products of the whole table
        (:func:`~ggnchunk._graph.readers.lookup_squares`).

        Args:
            source: The glue region.

        Returns:
            Parameter indices.
        """
        if not self.sums_squares:
            return set()
        return {
            i for i, found in source.gathers.items()
            if len(found) == 1 and len(source.readers.get(i, ())) == 1
            and i not in self.shared
        }  # fmt: skip

    def _tied_pairs(self, uses: dict[int, int]) -> dict[int, tuple[int, int]]:
        """Tables used exactly twice: by an ``nn.Embedding``, then an ``nn.Linear`` head.

        See :func:`~ggnchunk._rules.tied.is_tied_pair`.

        Args:
            uses: Places each parameter is used in (calls and glue regions).

        Returns:
            ``{parameter index: (head call index, embedding call index)}``.
        """
        found: dict[int, list[Call]] = {}
        for call in self.calls:
            for i, pname in call.params:
                if uses.get(i) == 2 and pname == "weight":
                    found.setdefault(i, []).append(call)
        tied = {}
        for i, pair in found.items():
            if len(pair) == 2:
                embedding, head = pair  # in the order of the forward pass
                if is_tied_pair(head.rule, embedding.rule):
                    tied[i] = (head.index, embedding.index)
        return tied

    def why_no_gradient(self) -> str:
        """Why an output without gradient has none, as far as the recording saw.

        Returns:
            A sentence for the error (empty where no layer with trainable parameters
            ran with gradients disabled).

        Raises:
            ValueError: If one ran inside a reentrant ``torch.utils.checkpoint``.
        """
        if self.in_checkpoint is not None:
            _refuse_reentrant(f"around {_display(self.in_checkpoint)}")
        if not self.without_grad:
            return ""
        names = [f"{_display(n)} ({k})" for n, k in list(self.without_grad.items())[:3]]
        return (
            f" {', '.join(names)} ran with gradients disabled in the forward pass "
            "(inside torch.no_grad() or torch.inference_mode() in forward): run them "
            "with gradients enabled."
        )

    def _warn_without_grad(self, uses: dict[int, int]) -> set[int]:
        """Warn about layers whose trainable parameters ran only with gradients off.

        Their diagonal is zero, as their gradients are (autograd never sees them): a
        part of ``forward`` inside ``torch.no_grad()`` or ``torch.inference_mode()``
        (a reentrant ``torch.utils.checkpoint``, which does the same, is refused
        before this).

        Returns:
            The indices of those layers' parameters.
        """
        silent = []
        indices: set[int] = set()
        for module, (name, _) in self._units.items():
            if name not in self.without_grad:
                continue
            mine = [
                self._param_index[id(p)] for p in module.parameters(recurse=False)
                if id(p) in self._param_index
            ]  # fmt: skip
            if mine and not any(i in uses for i in mine):
                silent.append(f"{_display(name)} ({self.without_grad[name]})")
                indices.update(mine)
        if silent:
            shown = ", ".join(silent[:3]) + (
                f" and {len(silent) - 3} more" if len(silent) > 3 else ""
            )
            warn(
                f"ggnchunk: {shown} ran with gradients disabled in the forward pass "
                "(inside torch.no_grad() or torch.inference_mode()), so no gradient "
                "reaches their trainable parameters: their GGN diagonal is zero, as "
                "their gradients are. Run them with gradients enabled for their "
                "curvature, or set requires_grad=False on their parameters.",
                GradientDisabledWarning,
            )
        return indices

    def _schedule_crossings(self) -> None:
        """When each glue region is crossed: once every place its vectors come from is done.

        A region's vectors come from the calls that take its source as input and from
        the regions cut at it (:meth:`_walk`). It is crossed after the last of them in
        the sweep's (reverse) order, and after every region that feeds it where they
        are due at the same call.
        """
        feeding: dict[EdgeKey, int] = {key: 0 for key in self._sources}
        for source in self._sources.values():
            for key in source.cuts:
                feeding[key] += 1
        order, ready = [], [k for k, count in feeding.items() if count == 0]
        while ready:  # downstream first (Kahn's order over the cuts)
            key = ready.pop()
            order.append(key)
            for cut in self._sources[key].cuts:
                feeding[cut] -= 1
                if feeding[cut] == 0:
                    ready.append(cut)
        due = {key: self._sources[key].last_consumer for key in order}
        for key in order:
            for cut in self._sources[key].cuts:
                due[cut] = min(due[cut], due[key])
        self._crossings = {}
        for key in order:
            if key != self.output_key:
                self._crossings.setdefault(due[key], []).append(key)

    def _stop_without_parameters(self) -> None:
        """Cut the sweeps where no trainable parameter is upstream.

        A call whose input depends on no trainable parameter (only on inputs that
        require grad, or frozen parts) passes nothing back, and a glue region leaves out
        the layer outputs behind which nothing is trained: no backward work there.
        """
        reach: dict[int, bool] = {}  # call index -> a trainable parameter at or before it
        behind: dict[EdgeKey, bool] = {}  # source -> a trainable parameter behind it

        def upstream(key: EdgeKey) -> bool:
            if key not in behind:
                source = self._sources[key]
                if source.direct:
                    behind[key] = reach[self._out_keys[key]]
                else:
                    behind[key] = bool(source.params) or any(
                        ended(edge_key(e)) for e in source.frontier
                    )
            return behind[key]

        def ended(key: EdgeKey) -> bool:  # a frontier edge: a layer output or a cut
            return reach[self._out_keys[key]] if key in self._out_keys else upstream(key)

        for call in self.calls:  # forward order: every call upstream is settled
            back = call.source is not None and upstream(edge_key(call.source))
            reach[call.index] = bool(call.params) or back
            if call.source is not None and not back:
                call.leaf = call.source = None  # nothing to pass back to
        for source in self._sources.values():
            source.frontier = [e for e in source.frontier if ended(edge_key(e))]
            source.cuts = [k for k in source.cuts if upstream(k)]
        self._sources = {
            key: source for key, source in self._sources.items()
            if key == self.output_key or behind.get(key, False)
        }  # fmt: skip

    def _pin_graph(self, output: Tensor) -> None:
        """Keep the Python object of every node behind ``output`` alive with the recording.

        The sweeps and glue plans know nodes by ``id``. Before torch 2.13 a C++ node's
        Python object lives only while something refers to it (``next_functions`` makes
        a new one on each access after the last was dropped), so the id of a dropped
        one is reused by the next object made: a walk then took an unseen node for a
        seen one and missed whole glue regions (diagonals of 0, relative error 1.0,
        measured on torch 2.11). While one object of a node lives, every access returns
        it, so ids are stable and unique for as long as the recording holds them.
        """
        pins = self._pins
        stack = [output.grad_fn] + [
            edge.node for call in self.calls for edge in (call.out_edge, call.source)
            if edge is not None
        ]  # fmt: skip
        while stack:
            node = stack.pop()
            if node is None or id(node) in pins:
                continue
            pins[id(node)] = node
            stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)

    def _add_source(self, key: EdgeKey, target: Any, numel: int, consumer: int) -> None:
        source = self._sources.get(key)
        if source is None:
            self._sources[key] = _Source(key, target, numel, consumer)
        else:
            source.last_consumer = min(source.last_consumer, consumer)

    def _walk_all(self) -> None:
        """Walk every region; where regions still overlap, cut them at shared glue.

        A region stops at another region's source (:meth:`_walk`). Where no layer reads
        the glue that several regions reach (a residual stream whose norms are custom
        modules: timm's ``LayerNorm``, Llama's ``RMSNorm``), the tensor where they
        begin to overlap becomes a source of its own, read by those regions only, and
        the regions are walked again (a few rounds at most).
        """
        pending = list(self._sources.values())
        for round_ in range(SHARED_ROUNDS + 1):
            for source in pending:
                self._walk(source)
            if not CUT_AT_SOURCES or round_ == SHARED_ROUNDS:
                break
            entries = self._overlaps()
            if not entries:
                break
            for key, (node, numel) in entries.items():
                self._add_source(key, GradientEdge(node, 0), numel, SHARED)
            # walked again: the new sources, and the regions that reach one of them
            # (the others' walks cannot change)
            new_nodes = {id(node) for node, _ in entries.values()}
            pending = [
                source for source in self._sources.values()
                if source.key in entries
                or any(id(node) in new_nodes for _, node in source.steps)
            ]  # fmt: skip
        for source in self._sources.values():
            source.steps = []  # the walks' record, no longer needed

    def _overlaps(self) -> dict[EdgeKey, tuple[Node, int]]:
        """Where regions begin to overlap: nodes more regions reach than reach a parent.

        Only a node with one output and a backward of its own (not a leaf's), whose
        tensor is no layer output or source already, and is shaped as a layer's input
        or output (the batch on axis 0, as the sweeps and the check that samples stay
        independent read every source).

        Returns:
            ``{edge key: (node, elements per sample)}`` of the new sources.
        """
        # the samples' own tensors: batch on axis 0, shaped as a layer's input or
        # output (a table shared by the samples, T5's position bias ``[1, H, T, T]``,
        # or CaiT's ``qkv`` with the batch on axis 1 summed or mixed the samples)
        shapes = {
            tuple(shape) for call in self.calls
            for shape in (call.ctx.out_shape, getattr(call.ctx.x, "shape", None))
            if shape is not None
        }  # fmt: skip
        count: dict[int, int] = {}
        for source in self._sources.values():
            for node_id in {id(node) for _, node in source.steps}:
                count[node_id] = count.get(node_id, 0) + 1
        entries: dict[EdgeKey, tuple[Node, int]] = {}
        for source in self._sources.values():
            for parent, node in source.steps:
                here = count[id(node)]
                if here < 2 or count.get(parent, 1) >= here:
                    continue
                key = edge_key((node, 0))
                if (
                    key in entries or key in self._sources or key in self._out_keys
                    or output_count(node) != 1 or not node.next_functions
                    or accumulated_variable(node) is not None
                ):  # fmt: skip
                    continue
                shape = grad_shape(node, 0)
                if shape is None or tuple(shape) not in shapes:
                    continue
                entries[key] = (node, -(-shape.numel() // self._batch))
        return entries

    def _walk(self, source: _Source) -> None:
        if source.key in self._out_keys:
            source.direct = True
            return
        node = source.target.grad_fn if isinstance(source.target, Tensor) else None
        if node is None and isinstance(source.target, GradientEdge):
            node = source.target.node
        frontier: dict[EdgeKey, GradientEdge] = {}
        params: set[int] = set()
        # every reader of a parameter (:mod:`.readers`), None for any other node
        readers: dict[int, list[Reader | None]] = {}
        stack, seen = [node], set()
        # a convolution's weight computed from these alone (:func:`computed_weight`)
        known = lambda v: id(v) in self._param_index  # noqa: E731
        stops = lambda k: k in self._out_keys or k in self._sources  # noqa: E731
        source.workspace = 0  # a region walked again (after an overlap cut) starts over
        steps: list[tuple[int, Node]] = []  # (parent's id, node) for every step walked
        cuts: list[EdgeKey] = []
        inner = 0
        root = accumulated_variable(node) if node is not None else None
        if root is not None and id(root) in self._param_index:  # the glue is a parameter
            index = self._param_index[id(root)]
            params.add(index)
            readers[index] = [None]
        while stack:
            current = stack.pop()
            if current is None or id(current) in seen:
                continue
            seen.add(id(current))
            if current.name() == _REENTRANT_CHECKPOINT:
                _refuse_reentrant(f"in the operations before {self._consumer(source)}")
            source.workspace += glue_workspace(current)
            inner = max(inner, _gradients_numel(current))
            for position, (nxt, number) in enumerate(current.next_functions):
                if nxt is None:
                    continue
                key = edge_key((nxt, number))
                if key in self._out_keys:
                    frontier[key] = self.calls[self._out_keys[key]].out_edge
                    continue
                cut = self._sources.get(key)
                if cut is not None and CUT_AT_SOURCES and _cuttable(nxt, key, self):
                    # another region's source: its vectors wait there and cross it
                    # once, with that region's own (a residual stream is crossed once
                    # per pass, not once per later region)
                    frontier[key] = cut.target
                    cuts.append(key)
                    continue
                # a parameter behind views, ``.T`` or as a part (``pos[:, :T]``): read
                # there, not walked (the views would count as another reader)
                found = read_behind(current, position, known)
                if found is not None:
                    index = self._param_index[id(found[0])]
                    params.add(index)
                    readers.setdefault(index, []).append(found[1])
                    continue
                computed = computed_weight(current, position, known, stops)
                if computed is not None:
                    # a convolution's weight computed from parameters alone (weight
                    # standardization, weight norm): read at the convolution, not walked
                    for variable, reader in computed:
                        index = self._param_index[id(variable)]
                        params.add(index)
                        readers.setdefault(index, []).append(reader)
                    continue
                stack.append(nxt)
                steps.append((id(current), nxt))
        source.frontier = list(frontier.values())
        source.cuts = cuts
        source.steps = steps
        source.inner = -(-inner // self._batch)
        source.params = sorted(params)
        source.gathers = _only(readers, Gather)
        source.readers = _only(readers, (Broadcast, Product, ConvWeight, Gather, Placed))
        sizes = [
            edge_numel(reader.edge) for found in source.readers.values() for reader in found
        ]
        # a convolution's weight products per column and sample, and the same again
        # carried back through a computed weight
        sizes += [
            2 * reader.weight.numel() * self._batch
            for found in source.readers.values() for reader in found
            if isinstance(reader, ConvWeight)
        ]  # fmt: skip
        source.reader_numel = -(-max(sizes, default=0) // self._batch)

    def _consumer(self, source: _Source) -> str:
        """Where a glue region's vectors come from, for messages."""
        if source.key == self.output_key:
            return "the model output"
        if 0 <= source.last_consumer < len(self.calls):
            return f"the input of {_display(self.calls[source.last_consumer].name)}"
        return "a tensor several parts of the model read"

    @property
    def params(self) -> list[nn.Parameter]:
        """The trainable parameters, in ``named_parameters()`` order."""
        return self._params


# the node of ``torch.utils.checkpoint(..., use_reentrant=True)``: its backward calls
# ``torch.autograd.backward``, which torch refuses inside ``torch.autograd.grad``
_REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"


_PLAIN = (bool, int, float, str, type(None))


def _settings_of(module: nn.Module) -> dict[str, Any]:
    """A layer's settings: its attributes that are plain values (stride, padding, eps)."""
    return {
        name: value for name, value in vars(module).items()
        if isinstance(value, _PLAIN) or (
            isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value)
        )
    }  # fmt: skip


def _as_called(module: nn.Module, settings: dict[str, Any]) -> nn.Module:
    """The layer with the settings of one call: a copy sharing its tensors."""
    twin = copy.copy(module)  # the same parameter and buffer dicts
    twin.__dict__.update(copy.deepcopy(settings))
    return twin


def _tensors_of(module: nn.Module, rule: LayerRule) -> dict[str, Any]:
    """The layer's own parameters and buffers, and its rule's tensors (``None``: none)."""
    found = {name: getattr(module, name, None) for name in rule.param_names}
    found.update(module.named_parameters(recurse=False))
    found.update(module.named_buffers(recurse=False))
    return found


def _in_reentrant_checkpoint() -> bool:
    """Whether the running code is inside a reentrant checkpoint's forward."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        frame = frame.f_back
    return False


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


def _refuse_reentrant(where: str) -> None:
    raise ValueError(
        f"the model calls torch.utils.checkpoint with use_reentrant=True ({where}). "
        "Its layers run with gradients disabled and its backward runs the forward "
        "again, which cannot happen inside torch.autograd.grad (every pass of ggnchunk "
        "uses it), so their curvature cannot be computed. Pass use_reentrant=False to "
        "checkpoint (same values; torch recommends it), or turn gradient checkpointing "
        "off for this call (transformers: model.gradient_checkpointing_disable(); "
        "diffusers: model.disable_gradient_checkpointing())."
    )


class GradientDisabledWarning(UserWarning):
    """Layers with trainable parameters ran with gradients disabled: zero diagonal."""


class UnusedParameterWarning(UserWarning):
    """Trainable parameters that no gradient of the output reaches: zero diagonal."""


# the internal switch (tests, benchmarks): False walks every region to the layer outputs,
# through the regions behind it, as before the cuts (each region crossed per later one)
CUT_AT_SOURCES = True
# rounds of sources added where regions overlap (:meth:`Recording._walk_all`)
SHARED_ROUNDS = 3
# the "consumer" of a source added where regions overlap: no layer reads it
SHARED = 1 << 62


def _cuttable(node: Node, key: EdgeKey, recording: Recording) -> bool:
    """Whether a region's walk may stop at another region's source ``key`` (at ``node``).

    Not at the model output (its vectors are the seed, pushed first), and only at a node
    with one output: the sweep blocks the cut nodes while crossing (their gradients are
    taken, not passed on), which would block the other outputs' paths too.
    """
    return key != recording.output_key and output_count(node) == 1


def _only(
    readers: dict[int, list[Any]], kind: type | tuple[type, ...]
) -> dict[int, list[Any]]:
    """The parameters whose every reader is of ``kind``, with their readers."""
    return {
        i: found for i, found in readers.items() if all(isinstance(r, kind) for r in found)
    }


def _gradients_numel(node: Node) -> int:
    """Elements a node's backward holds: the gradients it takes and makes, and a copy.

    Batched over columns, a product with a transposed operand copies the largest of
    them (measured on ``nn.MultiheadAttention``'s eager scores: about three ``[L, S]``
    maps per column alive at its softmax and products). 0 where the node does not say.
    """
    taken = (grad_shape(node, i) for i in range(output_count(node)))
    made = (
        grad_shape(nxt, number) for nxt, number in node.next_functions if nxt is not None
    )
    sizes = [shape.numel() for shape in (*taken, *made) if shape is not None]
    return sum(sizes) + max(sizes, default=0)
