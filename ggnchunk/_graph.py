r"""The recorded forward pass and the backward sweeps over it.

**Recording.** The user's forward runs once, with two hooks on every layer that has a rule
(see :mod:`ggnchunk._rules`): before the layer, its input is replaced by a detached copy
that requires grad (a *leaf*, sharing storage), which cuts the autograd graph at the
layer's input; after it, the layer's output is named by its gradient edge. The graph
falls apart into the layers' own small graphs (leaf → output) and the *glue* between them:
everything else the forward did (activations, residual additions, ``torch.cat``, attention
maths, in-place operations, dropout with the masks it drew, parameters used in functional
calls), which autograd differentiates as recorded. Nothing is ever run again.

**Plan.** For every place where glue begins (the model output, and the original tensor
behind every cut), a walk over ``next_functions`` finds the layer outputs it reaches
without passing another layer (its *frontier*) and the parameters it uses.

**Sweep.** For a chunk of square-root columns ``S`` (``[V, N, *output]``), the layers are
visited in reverse call order (a reverse topological order): the vectors at a layer's
output are complete once every later layer and the glue after it are done; the layer's
rule turns them into parameter diagonals; autograd (batched over the ``V`` columns) moves
them to the layer's input and, once every consumer of that input is done, through the
glue to the frontier, where they are added up. A parameter used in the glue, or in more
than one place, gets per-(column, sample) products (one masked backward per sample
through the glue that uses it) that are added over its uses before squaring.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ggnchunk._attention import attention_workspace
from ggnchunk._autograd import (
    EdgeKey,
    GradientEdge,
    SlowBackwardWarning,
    accumulated_variable,
    batched_grad,
    edge_key,
    edge_of,
    noting,
)
from ggnchunk._checks import user_stacklevel
from ggnchunk._quantities import Quantity
from ggnchunk._rules import LayerRule, RuleContext
from ggnchunk._windows import FieldCache, Windowed, attach, dense, joined_coeffs, window
from ggnchunk._windows import add as add_vectors

__all__ = ["Call", "Recording", "SampleCouplingError", "SlowBackwardWarning"]


class SampleCouplingError(ValueError):
    """The model mixes the samples of a batch: its GGN is not a sum over samples."""


def _display(name: str) -> str:
    return f"model.{name}" if name else "model"


@dataclass
class Call:
    """One call of a layer with a rule during the recorded forward pass."""

    index: int
    name: str
    rule: LayerRule
    ctx: RuleContext
    params: list[tuple[int, str]]  # (index in the parameter list, name in the layer)
    leaf: Tensor | None  # the detached input that requires grad (None: input needs none)
    source: GradientEdge | None  # where the glue before the layer ends
    out_edge: GradientEdge
    out_numel: int  # per sample


@dataclass
class _Source:
    """Where glue begins: the model output, or the original tensor behind a cut."""

    key: EdgeKey
    target: Any  # tensor or gradient edge, for autograd
    numel: int  # per sample
    last_consumer: int  # the glue is pushed after this call index is done
    direct: bool = False  # the source is a layer output itself (no glue in between)
    frontier: list[GradientEdge] = field(default_factory=list)
    params: list[int] = field(default_factory=list)  # parameter indices used in the glue
    workspace: int = 0  # elements per column its nodes allocate (folded attention)


class _Waiting:
    """The vectors a traversal holds between steps: at layer outputs and glue sources.

    Vectors (or sizes) meeting at one place are added; sizes of one place are equal, so
    their "sum" is one of them. Blocks' joined fields are kept in ``images``.
    """

    def __init__(self, images: FieldCache | None = None) -> None:
        self.outs: dict[EdgeKey, Any] = {}
        self.srcs: dict[EdgeKey, Any] = {}
        self.images = images

    def add(self, store: dict[EdgeKey, Any], key: EdgeKey, value: Any) -> None:
        old = store.get(key)
        if old is None:
            store[key] = value
        elif not isinstance(value, int):
            store[key] = add_vectors(old, value, self.images)

    def total(self) -> int:
        """Elements waiting (size traversals)."""
        return sum(self.outs.values()) + sum(self.srcs.values())


class Recording:
    """Hooks on the layers with rules for one forward pass, then plan and sweeps.

    Args:
        units: ``{module: (qualified name, rule)}``.
        params: The trainable parameters, in ``named_parameters()`` order.
        batch: Number of samples ``N`` in the forward pass.
        every_product: Every parameter takes the per-sample products' path (the
            quantity keeps them: each sample's diagonal, output variances), and the
            memory bound counts them.
    """

    def __init__(
        self,
        units: dict[nn.Module, tuple[str, LayerRule]],
        params: list[nn.Parameter],
        batch: int,
        every_product: bool = False,
    ):
        self.every_product = every_product
        self._units = units
        self._params = params
        self._param_index = {id(p): i for i, p in enumerate(params)}
        self._batch = batch
        self._thread = threading.get_ident()
        self._pending: dict[int, list[Any]] = {}
        self.calls: list[Call] = []
        self._handles: list[Any] = []
        self._sources: dict[EdgeKey, _Source] = {}
        self._order: list[EdgeKey] = []  # model output source first
        self._out_keys: dict[EdgeKey, int] = {}
        self.shared: set[int] = set()
        self.output_key: EdgeKey | None = None
        self.fallbacks: dict[str, str] = {}  # operation vmap loops over -> where
        self._warned = False
        self.window_ends: dict[str, str] = {}  # where windowed columns became dense
        # sizes (elements per column and sample) windowed sweeps had at each call's
        # output and input, for the windowed memory bound; ("dense", i): a full map
        self._seen: dict[tuple[str, int], int] = {}
        self._by_values = False  # a block crossed glue and was windowed from values
        self.windowed_sweeps = 0
        self.images = FieldCache()  # the windowed fields' images, reused by every sweep

    # -- hooks -----------------------------------------------------------------------
    def install(self) -> None:
        """Register the hooks (removed by :meth:`remove`)."""
        for module in self._units:
            self._handles.append(
                module.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
            )
            self._handles.append(
                module.register_forward_hook(self._post_hook, prepend=True)
            )

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
            stack.append(None)
            return None
        if args:
            x, rest, key = args[0], args[1:], None
        elif "input" in kwargs:
            x, rest, key = kwargs["input"], (), "input"
        else:
            stack.append(None)
            return None
        if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[0] != self._batch:
            stack.append(None)  # not a per-sample call: the glue handles it
            return None
        if x.requires_grad:
            leaf = x.detach().requires_grad_()
            stack.append((leaf, edge_of(x), leaf._version))
            if key is None:
                return (leaf, *rest), kwargs
            return args, {**kwargs, key: leaf}
        stack.append((None, None, x._version, x))
        return None

    def _post_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        stack = self._pending.get(id(module))
        entry = stack.pop() if stack else None
        if entry is None:
            return
        if not (isinstance(output, Tensor) and output.requires_grad):
            return
        if output.dim() == 0 or output.shape[0] != self._batch:
            return
        name, rule = self._units[module]
        leaf, source, version = entry[:3]
        x = leaf if leaf is not None else entry[3]
        ctx = RuleContext(module, (x,), (version,), tuple(output.shape))
        ctx.node = output.grad_fn
        ctx.index, ctx.images = len(self.calls), self.images
        rule.record(ctx)
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
        for source in self._sources.values():
            self._walk(source)
            for i in source.params:
                uses[i] = uses.get(i, 0) + 1
        self._stop_without_parameters()
        self.shared = {i for i, count in uses.items() if count > 1 or self.every_product}
        for call in self.calls:
            call.ctx.shared = any(i in self.shared for i, _ in call.params)
            call.ctx.output = edge_key(call.out_edge) == self.output_key
        self._order = sorted(self._sources, key=lambda k: -self._sources[k].last_consumer)

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
                        reach[self._out_keys[edge_key(e)]] for e in source.frontier
                    )
            return behind[key]

        for call in self.calls:  # forward order: every call upstream is settled
            back = call.source is not None and upstream(edge_key(call.source))
            reach[call.index] = bool(call.params) or back
            if call.source is not None and not back:
                call.leaf = call.source = None  # nothing to pass back to
        for source in self._sources.values():
            source.frontier = [
                e for e in source.frontier if reach[self._out_keys[edge_key(e)]]
            ]
        self._sources = {
            key: source for key, source in self._sources.items()
            if key == self.output_key or behind.get(key, False)
        }  # fmt: skip

    def _add_source(self, key: EdgeKey, target: Any, numel: int, consumer: int) -> None:
        source = self._sources.get(key)
        if source is None:
            self._sources[key] = _Source(key, target, numel, consumer)
        else:
            source.last_consumer = min(source.last_consumer, consumer)

    def _walk(self, source: _Source) -> None:
        if source.key in self._out_keys:
            source.direct = True
            return
        node = source.target.grad_fn if isinstance(source.target, Tensor) else None
        if node is None and isinstance(source.target, GradientEdge):
            node = source.target.node
        frontier: dict[EdgeKey, GradientEdge] = {}
        params: set[int] = set()
        stack, seen = [node], set()
        while stack:
            current = stack.pop()
            if current is None or id(current) in seen:
                continue
            seen.add(id(current))
            source.workspace += attention_workspace(current)
            variable = accumulated_variable(current)
            if variable is not None:
                if id(variable) in self._param_index:
                    params.add(self._param_index[id(variable)])
                continue
            for nxt, number in current.next_functions:
                if nxt is None:
                    continue
                key = edge_key((nxt, number))
                if key in self._out_keys:
                    frontier[key] = self.calls[self._out_keys[key]].out_edge
                else:
                    stack.append(nxt)
        source.frontier = list(frontier.values())
        source.params = sorted(params)

    # -- memory model ----------------------------------------------------------------
    def column_bytes(self, element: int, windowed: bool = False) -> int:
        """An upper bound on the bytes one square-root column costs during a sweep.

        Runs the sweep's own traversal (:meth:`_traverse`) on sizes instead of tensors:
        which backpropagated vectors are alive at each step (waiting at layer outputs and
        glue sources, the current layer's and its rule's), plus autograd's buffers
        inside the glue (bounded by twice the vectors at the glue's ends) and per-sample
        products of shared parameters. The largest total, per column.

        With ``windowed`` (after a windowed sweep, :attr:`windowed_bound_ready`), the
        sizes at layer outputs and inputs are twice those the windowed sweeps had there
        (the boxes' sizes; a margin for how boxes align), never more than the full
        map's, and each rule's own bytes shrink with its output's share of the map.

        Args:
            element: Bytes per element of the computation's dtype.
            windowed: Count the windowed sweeps' sizes.

        Returns:
            Bytes per column (a chunk of ``V`` columns needs ``V`` times this).
        """
        n = self._batch
        waiting = _Waiting()
        worst = 0
        seen = self._seen if windowed else {}

        def sized(where: str, call: Call, full: int) -> int:
            if not windowed or ("dense", call.index) in seen:
                return full
            return min(full, 2 * seen.get((where, call.index), full))

        def settle(extra: int) -> None:
            nonlocal worst
            worst = max(worst, waiting.total() + extra)

        def glue(source: _Source, size: int) -> list[tuple[GradientEdge, Any]]:
            ends = [self.calls[self._out_keys[edge_key(e)]] for e in source.frontier]
            if windowed and size < source.numel:  # a cat sliced on the boxes (a
                # block meeting other glue leaves no windowed bound)
                return [(c.out_edge, sized("out", c, c.out_numel)) for c in ends]
            added = sum(call.out_numel for call in ends)
            buffers = 2 * (size + added) + -(-source.workspace // n)
            if source.params:
                buffers += size + sum(self._params[i].numel() for i in source.params)
            settle(size + added + buffers)
            return [(call.out_edge, call.out_numel) for call in ends]

        def layer(call: Call, size: int) -> int | None:
            rule = _rule_bytes(call, element)[0] // (element * n)
            if windowed:
                size = sized("out", call, call.out_numel)
                rule = -(-rule * size // max(call.out_numel, 1))
            shared = sum(
                self._params[i].numel() for i, _ in call.params if i in self.shared
            )
            settle(size + rule + shared)
            if call.leaf is None:
                return None
            inputs = sized("in", call, call.ctx.x[0].numel())
            settle(size + inputs)
            return inputs

        # the sweep's own traversal, on sizes (elements per column and sample)
        self._traverse(self._sources[self.output_key].numel, layer, glue, waiting=waiting)
        shared_total = sum(self._params[i].numel() for i in self.shared)
        # 1.5: what the sizes leave out (kernels' workspaces, the allocator's partly
        # reused blocks) measured up to ~1.5x on CPU convolutions
        return int(1.5 * (worst + shared_total) * n * element)

    def fixed_bytes(self, element: int) -> int:
        """Bytes the rules will keep for the whole forward pass, beyond what they hold now.

        Caches already built (by the forward pass or an earlier sweep) are in the memory
        in use; only what is still to be built, and the largest step's transient memory,
        is counted.

        Args:
            element: Bytes per element.

        Returns:
            An upper bound.
        """
        kept = sum(
            max(
                0,
                _rule_bytes(call, element)[1] - call.ctx.caches.held_bytes(call.ctx.inputs),
            )
            for call in self.calls
        )
        transient = max((_rule_bytes(call, element)[2] for call in self.calls), default=0)
        return kept + transient

    def field_image_bytes(self, element: int) -> int:
        """What a windowed sweep can keep of its fields' images (:attr:`images`).

        Fields made by the calls after a place can reach it (``K`` of them, each a map
        per sample): their images at every call's input and output (after glue and
        where blocks meet), at glue sources, and their per-sample parameter products.
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
                total += reaching.get(source.last_consumer, 0) * source.numel
        return total * self._batch * element

    # -- sweeps ----------------------------------------------------------------------
    @property
    def params(self) -> list[nn.Parameter]:
        """The trainable parameters, in ``named_parameters()`` order."""
        return self._params

    def sweep(
        self,
        seed: Tensor,
        quantity: Quantity,
        visit: Callable[[str, Tensor], None] | None = None,
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
        """

        def glue(source: _Source, grads: Tensor) -> list[tuple[GradientEdge, Any]]:
            found: list[tuple[GradientEdge, Any]] = []
            block = grads if isinstance(grads, Windowed) else None
            split = None if block is None else self._split_channels(source, block)
            if split is not None:  # torch.cat along channels: the boxes stay
                return [(edge, split[edge_key(edge)]) for edge in source.frontier]
            if source.frontier:
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
                    quantity.glue(self, source, dense(grads))
            return found

        windows = isinstance(seed, Windowed)
        if windows:
            self.windowed_sweeps += 1

        def layer(call: Call, grads: Tensor) -> Tensor | None:
            if windows:
                self._see("out", call.index, grads, call.out_numel)
                if (
                    isinstance(grads, Windowed)
                    and call.params
                    and (call.ctx.shared or not type(call.rule).has_diag_windowed())
                ):
                    self._seen["dense", call.index] = 1  # products of a dense copy
            quantity.layer(self, call, grads)
            if call.leaf is None:
                return None
            back = quantity.backprop(self, call, grads)
            if windows:
                self._see("in", call.index, back, call.ctx.x[0].numel())
            return back

        self._traverse(seed, layer, glue, visit)
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
        self, source: _Source, block: Windowed, results: tuple[Any, ...],
        quantity: Quantity,
    ) -> list[Any]:  # fmt: skip
        """The windowed part's images through glue, windowed, with the fields' images.

        The fields cross the glue once per forward pass (kept in :attr:`images`).
        """
        fields: tuple[Any, ...] = (None,) * len(results)
        key = None
        if block.has_fields:
            key = self.images.key("glue", source.key, block=block)

            def make() -> tuple[Any, ...]:
                with noting(self._note(source)):
                    return tuple(quantity.through(source, block.fields))

            fields = self.images.get(key, make)
        return [
            attach(window(r), f, block.coeffs, None if key is None else (key, i))
            for i, (r, f) in enumerate(zip(results, fields, strict=True))
        ]

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

    def _see(self, where: str, index: int, value: Any, full: int) -> None:
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

        True when every layer that passes vectors on has a windowed rule and every glue
        region is one ``torch.cat`` of layer outputs along channels; elsewhere boxes are
        read from values (exact, but with copies the memory bound does not count).
        """
        for call in self.calls:
            if call.leaf is not None and not call.rule.windowed:
                return False
        for source in self._sources.values():
            if source.direct or not (source.frontier or source.params):
                continue
            if source.params or not self._is_channel_cat(source):
                return False
        return True

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

    @property
    def windowed_bound_ready(self) -> bool:
        """Whether :meth:`column_bytes` can count windowed sizes.

        After a windowed sweep whose boxes all came from the layers' geometry (box sizes
        the same for every column): boxes read from values after glue can be smaller for
        the first columns (at the map's border) than for later ones.
        """
        return self.windowed_sweeps > 0 and not self._by_values

    def _window_ended(self, where: Call | _Source, results: list[Any]) -> None:
        """Remember where a block became dense vectors (for the report)."""
        if any(r is not None and not isinstance(r, Windowed) for r in results):
            self.window_ends.setdefault(self._place(where), "the boxes fill the map")

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

    def _call_at(self, edge: GradientEdge) -> Call:
        return self.calls[self._out_keys[edge_key(edge)]]

    def _place(self, where: Call | _Source) -> str:
        """A layer call or glue region, in words."""
        if isinstance(where, Call):
            return f"{_display(where.name)} ({type(where.ctx.module).__name__})"
        ends = [_display(self._call_at(e).name) for e in where.frontier]
        after = f" after {', '.join(ends[:3])}" if ends else ""
        before = (
            "the model output" if where.last_consumer >= len(self.calls)
            else f"the input of {_display(self.calls[where.last_consumer].name)}"
        )  # fmt: skip
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
        warnings.warn(
            f"torch has no batched backward for {found}: the backward sweeps run it once "
            "per square-root column, which is exact but can be many times slower. Layers "
            "with a rule (see ggnchunk.supported_layers_table()), frozen or not, and "
            "F.scaled_dot_product_attention without dropout are crossed by all columns "
            "at once: use those modules instead of functional calls or custom layers "
            "there, or call model.eval() if dropout inside attention is the cause.",
            SlowBackwardWarning,
            stacklevel=user_stacklevel(),
        )

    def _traverse(
        self,
        seed: Tensor,
        layer: Callable[[Call, Tensor], Tensor | None],
        glue: Callable[[_Source, Tensor], list[tuple[GradientEdge, Any]]],
        visit: Callable[[str, Tensor], None] | None = None,
        waiting: _Waiting | None = None,
    ) -> None:
        """The one traversal: vectors from the output back over the calls.

        The sweeps run it on tensors and the memory bound (:meth:`column_bytes`) on
        sizes, so the bound follows the sweep's order and liveness by construction.

        Vectors meeting at one place are added. ``layer(call, vectors)`` does the layer's
        work and returns the vectors at its input (``None``: nothing passes on); once
        every consumer of a glue region's source is done, ``glue(source, vectors)``
        returns ``(edge, vectors)`` for the layer outputs the region reaches, so each
        region is crossed once.

        Args:
            seed: The vectors at the model output.
            layer: The work at a layer call.
            glue: The work through a glue region.
            visit: Called with ``(where, vectors)`` at every layer output and input.
            waiting: Where the vectors wait between steps (sizes: read by the caller).
        """
        waiting = _Waiting(self.images) if waiting is None else waiting
        outs, srcs, add = waiting.outs, waiting.srcs, waiting.add

        def push(key: EdgeKey, value: Tensor) -> None:
            source = self._sources[key]
            if source.direct:
                add(outs, key, value)
                return
            for edge, result in glue(source, value):
                if result is not None:
                    add(outs, edge_key(edge), result)

        push(self.output_key, seed)
        for call in reversed(self.calls):
            value = outs.pop(edge_key(call.out_edge), None)
            if value is None:
                continue
            if visit is not None:
                visit(f"the output of {_display(call.name)}", value)
            back = layer(call, value)
            del value
            if back is None:
                continue
            key = edge_key(call.source)
            add(srcs, key, back)
            del back
            if self._sources[key].last_consumer == call.index:
                pending = srcs.pop(key)
                if visit is not None:
                    visit(f"the input of {_display(call.name)}", pending)
                push(key, pending)

    def check_kron(self, names: list[str]) -> None:
        """Refuse what has no Kronecker factors: parameters outside ruled layers, shared.

        Args:
            names: The parameters' qualified names, for the message.

        Raises:
            ValueError: Naming the parameter or layer.
        """
        for source in self._sources.values():
            if source.params:
                name = names[source.params[0]]
                raise ValueError(
                    f"parameter {name!r} is used outside a per-sample call of an "
                    "nn.Linear or nn.Conv layer (by F.linear, a custom layer or a tied "
                    "weight, or by a layer whose input does not have the batch on axis "
                    "0, e.g. after samples were reshaped into the batch axis), so it "
                    "has no Kronecker factors. Freeze it (requires_grad_(False)) or use "
                    "ggnchunk.diag_ggn."
                )
        for call in self.calls:
            if any(i in self.shared for i, _ in call.params):
                raise ValueError(
                    f"{_display(call.name)} ({type(call.ctx.module).__name__}) is called "
                    "more than once or shares its parameters, so its GGN block has no "
                    "single Kronecker factorization. Freeze it (requires_grad_(False)) "
                    "or use ggnchunk.diag_ggn."
                )
            reason = call.rule.kron_check(call.ctx.module) if call.params else None
            if reason is not None:
                raise ValueError(
                    f"{_display(call.name)} ({type(call.ctx.module).__name__}): {reason}. "
                    "Freeze its parameters (requires_grad_(False)) or use "
                    "ggnchunk.diag_ggn."
                )

    def check_independent(self, output: Tensor) -> None:
        """Refuse models whose samples influence each other (before any real pass).

        Backpropagates one random vector from the first and one from the last sample's
        output and checks that they stay on their sample at every layer's output and
        input: an exact test of the recorded graph, for couplings in layers and glue.

        Args:
            output: The model output, ``[N, ...]``.

        Raises:
            SampleCouplingError: Naming the first place where samples mix.
        """
        n = output.shape[0]
        if n < 2:
            return
        seed = torch.zeros(2, *output.shape, dtype=output.dtype, device=output.device)
        generator = torch.Generator(device=output.device).manual_seed(0)
        for column, sample in enumerate((0, n - 1)):
            seed[column, sample] = torch.rand(
                output.shape[1:], generator=generator, dtype=output.dtype,
                device=output.device,
            ) + 0.5  # fmt: skip

        def visit(where: str, vectors: Tensor) -> None:
            others = torch.ones(2, n, dtype=torch.bool, device=vectors.device)
            others[0, 0] = others[1, n - 1] = False
            flat = vectors.reshape(2, n, -1)
            if bool((flat[others] != 0).any()):
                raise SampleCouplingError(
                    f"samples of the batch influence each other: backpropagating from one "
                    f"sample's output reaches other samples at {where}. An operation in "
                    "the model mixes samples (batch statistics such as BatchNorm in "
                    "training mode or x - x.mean(0), or attention across the batch axis), "
                    "so the GGN is not a sum over samples. Call model.eval(), or remove "
                    "the operation that mixes samples."
                )

        visit("the model output", seed)
        self.sweep(seed, Quantity(), visit)


def _elementwise(operation: str) -> bool:
    """Whether vmap's per-column loop over ``operation`` costs only kernel launches.

    Elementwise backward kernels (activations, copies) do the same work looped as
    batched; the warning is for the kernels whose loop is the slow part (convolutions,
    normalizations, attention, pooling, resampling).
    """
    name = operation.removeprefix("aten::").removesuffix("_out")
    return name in _ELEMENTWISE or name.removesuffix("_backward") in _ACTIVATIONS


_ELEMENTWISE = frozenset({"copy_", "clone", "where", "masked_fill", "mul", "div"})
_ACTIVATIONS = frozenset({
    "tanh", "sigmoid", "threshold", "gelu", "silu", "hardsigmoid", "hardswish",
    "hardtanh", "leaky_relu", "elu", "softplus", "mish", "log_sigmoid", "rrelu_with_noise",
    "softshrink", "hardshrink", "prelu_kernel",
})  # fmt: skip


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
