"""Helpers for autograd's graph API: gradient edges, node walks, batched backward.

The engine works on the autograd graph that the user's forward pass recorded: it names
tensors by their :class:`~torch.autograd.graph.GradientEdge` (so that an in-place
operation on a layer's output after the layer ran does not change which gradient is
meant), walks ``Node.next_functions`` to find where the glue between layers ends and
which parameters it uses, and backpropagates batches of vectors with
``torch.autograd.grad(..., is_grads_batched=True)``. Not the only module that reads the
graph: :mod:`ggnchunk._graph` walks ``next_functions`` itself, and the pooling and
upsampling rules in :mod:`ggnchunk._rules` read their nodes' private ``_saved_*``
attributes.
"""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase

__all__ = [
    "BatchNormBase",
    "active_modes",
    "as_hooks_leave_it",
    "Edge",
    "Gather",
    "GradientEdge",
    "Node",
    "SlowBackwardWarning",
    "accumulated_variable",
    "apply_node",
    "batched_grad",
    "blocked",
    "edge_key",
    "edge_numel",
    "edge_of",
    "first_global_forward_hook",
    "gather_of",
    "global_forward_hooks",
    "grad_shape",
    "in_checkpoint",
    "forward_tensor_hooks_off",
    "module_backward_hooks_off",
    "parameter_hooks_off",
    "tensor_hooks_off_for_the_call",
    "is_batched",
    "node_name",
    "noting",
    "on_columns",
    "will_run",
    "output_count",
    "plain_grad",
    "quiet_autograd",
    "saved_value",
    "scatter_rows",
]

Edge = GradientEdge
EdgeKey = tuple[int, int]
Target = Tensor | GradientEdge

_FALLBACK = (
    r"There is a performance drop because we have not yet implemented the batching rule"
)
_FALLBACK_OPERATION = re.compile(_FALLBACK + r" for (\S+?)\.(\s|$)")
# kernels torch's batching can neither batch nor loop over (cuDNN's RNN backward, whose
# weight gradients are a list): the columns then go backward one at a time
_NO_FALLBACK = re.compile(
    r"Batching rule not implemented for (\S+?)\. We could not generate a fallback"
)
_HARMLESS = (
    # vmap falls back to a loop for a few backward formulas; still exact.
    _FALLBACK,
    # torch's own notice when a module's inputs do not require grad.
    r"Full backward hook is firing when gradients are computed with respect to module",
)


def active_modes() -> tuple[str, ...]:
    """Names of the Python dispatch modes active now (``FlopCounterMode``, debug modes).

    Every operation under such a mode runs through Python and can allocate and take
    time differently: a budgeted ResNet-18 under ``FlopCounterMode`` cut its chunks to
    80 passes where plain calls ran 18, and the cut, remembered, held the next plain
    call to 100 passes. What is measured under a mode is not remembered.

    Returns:
        The modes' class names, innermost last (empty where none is active, or where
        this torch has no such stack).
    """
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    except ImportError:  # pragma: no cover - a torch without the private stack
        return ()
    return tuple(type(mode).__qualname__ for mode in _get_current_dispatch_mode_stack())


@contextlib.contextmanager
def quiet_autograd() -> Iterator[None]:
    """Silence, by message, the torch warnings a user cannot act on.

    Yields:
        Nothing; other warnings pass through unchanged.
    """
    with warnings.catch_warnings():
        for message in _HARMLESS:
            warnings.filterwarnings("ignore", message=message + ".*")
        yield


def edge_of(tensor: Tensor) -> GradientEdge:
    """The gradient edge of ``tensor`` now: it keeps naming this value after in-place ops.

    Args:
        tensor: A tensor that requires grad.

    Returns:
        Its ``(node, output_nr)`` edge.
    """
    return get_gradient_edge(tensor)


def edge_key(edge: GradientEdge | tuple[Node, int]) -> EdgeKey:
    """A hashable key for an edge: identity of its node and the output number.

    Args:
        edge: A gradient edge or a ``(node, output_nr)`` pair from ``next_functions``.

    Returns:
        ``(id(node), output_nr)``.
    """
    node, number = (edge.node, edge.output_nr) if isinstance(edge, GradientEdge) else edge
    return id(node), int(number)


def grad_shape(node: Node, number: int) -> torch.Size | None:
    """The shape of the gradient a node takes at output ``number`` (its forward output).

    Args:
        node: An autograd node.
        number: Its output number.

    Returns:
        The shape, or ``None`` where the node does not say.
    """
    metadata = getattr(node, "_input_metadata", None)
    if metadata is None or number >= len(metadata):
        return None
    return torch.Size(metadata[number].shape)


def edge_numel(edge: GradientEdge) -> int:
    """Elements of the gradient at a node's output (0 where the node does not say).

    Args:
        edge: The node's output.

    Returns:
        The count.
    """
    shape = grad_shape(edge.node, edge.output_nr)
    return 0 if shape is None else shape.numel()


def output_count(node: Node) -> int:
    """How many outputs a node's forward had (gradients its backward takes).

    Args:
        node: An autograd node.

    Returns:
        The count.
    """
    return len(getattr(node, "_input_metadata", ()))


def will_run(node: Node, position: int) -> bool:
    """Whether the running backward pass uses the gradient at input ``position`` of a node.

    A custom function's ``needs_input_grad`` is fixed at its forward; the gradients a
    pass asks for are not (the sweeps cross a folded convolution for its input's
    vectors, not its weight's). Only inside a node's backward; a leaf's gradient under
    ``torch.autograd.grad`` cannot be asked about, and counts as needed.

    Args:
        node: The node whose backward is running.
        position: One of its inputs (``next_functions``).

    Returns:
        ``False`` only where the pass will not use that gradient.
    """
    nxt = node.next_functions[position][0]
    if nxt is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(nxt))
    except (RuntimeError, AttributeError):
        return True


def saved_value(node: Node, name: str) -> object:
    """A value a node saved for its backward (``_saved_<name>``), or ``None``.

    Args:
        node: An autograd node.
        name: The saved argument's name (``"other"``, ``"alpha"``, ``"dim"``, ...).

    Returns:
        The value; a tensor detached (the sweeps use it as a constant: a factor that
        needs grad, ``x * sigmoid(gate(x))`` as LRASPP's head forms it, gave the
        windowed glue's products autograd history, kept in the diagonals returned and
        grown with every pass).
    """
    try:
        value = getattr(node, f"_saved_{name}", None)
    except RuntimeError:  # freed
        return None
    return value.detach() if isinstance(value, torch.Tensor) else value


def apply_node(node: Node, grad: Tensor) -> tuple[Tensor | None, ...]:
    """A node's backward on one gradient (the graph is kept).

    Args:
        node: An autograd node with one output.
        grad: A gradient of that output's shape.

    Returns:
        The gradients for the node's inputs.
    """
    with torch.no_grad():
        result = node(grad)
    return result if isinstance(result, tuple) else (result,)


def accumulated_variable(node: Node) -> Tensor | None:
    """The leaf tensor behind an ``AccumulateGrad`` node, else ``None``.

    Args:
        node: A node of the autograd graph.

    Returns:
        The leaf tensor (a parameter, or a leaf the engine created).
    """
    if type(node).__name__ == "AccumulateGrad":
        return node.variable
    return None


@dataclass(frozen=True)
class Gather:
    """An ``embedding`` node of the graph that reads its weight directly: rows by index.

    The gradient of the weight is the gradient at the node's output added into the rows
    of ``indices`` (``padding_idx``'s row gets none); done by hand, it is batched over
    columns, where torch's vmap runs ``embedding_backward`` once per column.
    """

    edge: GradientEdge  # the node's output: where the gradient is taken
    indices: Tensor
    rows: int
    padding_idx: int | None


def gather_of(node: Node) -> Gather | None:
    """The :class:`Gather` of an ``EmbeddingBackward0`` node, else ``None``.

    Only dense embeddings without ``scale_grad_by_freq`` (which scales by counts over the
    whole batch) qualify.

    Args:
        node: A node of the autograd graph.

    Returns:
        The gather, or ``None`` for any other node.
    """
    if node.name() != "EmbeddingBackward0":
        return None
    try:
        if node._saved_scale_grad_by_freq or node._saved_sparse:
            return None
        padding = int(node._saved_padding_idx)
        rows = int(node._saved_weight_sym_argsize_0)
        indices = node._saved_indices
    except (AttributeError, RuntimeError, TypeError):  # another torch's names
        return None
    # torch saves "no padding row" (-1) as an unsigned 2**64 - 1
    row = padding if 0 <= padding < rows else None
    return Gather(GradientEdge(node, 0), indices, rows, row)


def scatter_rows(gather: Gather, grads: Tensor) -> Tensor:
    """The weight gradients of a :class:`Gather` from the gradients at its output.

    Args:
        gather: The embedding node.
        grads: ``[V, *indices.shape, D]``, the gradients at the node's output.

    Returns:
        ``[V, rows, D]``.
    """
    v, dim = grads.shape[0], grads.shape[-1]
    rows = grads.new_zeros(v, gather.rows, dim)
    rows.index_add_(1, gather.indices.reshape(-1), grads.reshape(v, -1, dim))
    if gather.padding_idx is not None:
        rows[:, gather.padding_idx] = 0.0
    return rows


class SlowBackwardWarning(UserWarning):
    """The backward sweeps run an operation once per column (torch has no batched form).

    Exact, but it can make a call many times slower; the message names the operation
    and where in the model it is.
    """


_NOTING = threading.local()


@contextlib.contextmanager
def noting(note: Callable[[str], None]) -> Iterator[None]:
    """Give ``note`` to every :func:`batched_grad` of this thread inside the block.

    Args:
        note: Called with the operations vmap ran once per vector.

    Yields:
        Nothing.
    """
    previous = getattr(_NOTING, "note", None)
    _NOTING.note = note
    try:
        yield
    finally:
        _NOTING.note = previous


def batched_grad(
    outputs: Sequence[Target],
    inputs: Sequence[Target],
    grad_outputs: Sequence[Tensor],
    note: Callable[[str], None] | None = None,
) -> tuple[Tensor | None, ...]:
    """Backpropagate a batch of vectors (leading axis) from ``outputs`` to ``inputs``.

    Args:
        outputs: Tensors or gradient edges where the vectors start.
        inputs: Tensors or gradient edges where they are wanted.
        grad_outputs: One ``[V, *output_shape]`` tensor per output.
        note: Called with the name of every operation (``"aten::..."``) that torch's
            batching ran once per vector (its fallback for kernels without a batching
            rule; torch reports it only when asked, which this does for the call).

    Returns:
        One ``[V, *input_shape]`` tensor per input (``None`` where unreachable).
    """
    note = note or getattr(_NOTING, "note", None)
    try:
        return _batched_noting(outputs, inputs, grad_outputs, note)
    except RuntimeError as error:
        match = _NO_FALLBACK.search(str(error))
        if match is None:
            raise
    # torch cannot batch a kernel on the way (nor loop over it): one column at a time,
    # exact, and said like vmap's own per-column loops
    if note is not None:
        operation = match.group(1)
        if operation == "aten::item" and torch.is_anomaly_enabled():
            # no layer of the user's: anomaly mode checks every gradient with ``item``
            operation += (
                " (torch.autograd.detect_anomaly() checks every gradient with it: "
                "turn anomaly detection off for this call)"
            )
        note(operation)
    return _one_by_one(outputs, inputs, grad_outputs)


def _one_by_one(
    outputs: Sequence[Target],
    inputs: Sequence[Target],
    grad_outputs: Sequence[Tensor],
) -> tuple[Tensor | None, ...]:
    """:func:`batched_grad` as a loop over the vectors (plain backward passes)."""
    count = int(grad_outputs[0].shape[0]) if grad_outputs else 0
    columns = [
        plain_grad(outputs, inputs, [g[v] for g in grad_outputs]) for v in range(count)
    ]
    # reachability is the graph's, the same for every vector
    return tuple(
        None if not columns or columns[0][i] is None
        else torch.stack([column[i] for column in columns])
        for i in range(len(inputs))
    )  # fmt: skip


def _batched_noting(
    outputs: Sequence[Target],
    inputs: Sequence[Target],
    grad_outputs: Sequence[Tensor],
    note: Callable[[str], None] | None,
) -> tuple[Tensor | None, ...]:
    if note is None:
        with quiet_autograd():
            return _batched(outputs, inputs, grad_outputs)
    enabled = torch._C._debug_only_are_vmap_fallback_warnings_enabled()
    torch._C._debug_only_display_vmap_fallback_warnings(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", message=_FALLBACK + ".*")
            warnings.filterwarnings("ignore", message=_HARMLESS[1] + ".*")
            result = _batched(outputs, inputs, grad_outputs)
    finally:
        torch._C._debug_only_display_vmap_fallback_warnings(enabled)
    for item in caught:
        match = _FALLBACK_OPERATION.search(str(item.message))
        if match is not None:
            note(match.group(1))
        else:  # not ours: shown as it would have been
            warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)
    return result


def _batched(
    outputs: Sequence[Target],
    inputs: Sequence[Target],
    grad_outputs: Sequence[Tensor],
) -> tuple[Tensor | None, ...]:
    previous = getattr(_COLUMNS, "count", None)
    count = int(grad_outputs[0].shape[0]) if grad_outputs else None
    _COLUMNS.count = count
    # autograd runs a CUDA graph's backward on a device thread, which sees no
    # thread-local of this one: the count is also kept under the batching's level
    level = _vmap_level() + 1 if _UNWRAPPABLE and count is not None else None
    if level is not None:
        with _LOCK:
            _BY_LEVEL.setdefault(level, []).append(count)
    try:
        return _grad(outputs, inputs, grad_outputs, batched=True)
    finally:
        _COLUMNS.count = previous
        if level is not None:
            with _LOCK:
                _BY_LEVEL[level].remove(count)
                if not _BY_LEVEL[level]:
                    del _BY_LEVEL[level]


_COLUMNS = threading.local()  # how many vectors this thread's batched backward carries
# the counts of the batched backward passes open in any thread, by batching level
_BY_LEVEL: dict[int, list[int]] = {}
_LOCK = threading.Lock()
# torch's legacy batching (what is_grads_batched runs) and the calls that unwrap it
_UNWRAPPABLE = all(
    hasattr(owner, name)
    for owner, name in (
        (torch._C, "_vmapmode_increment_nesting"),
        (torch._C, "_vmapmode_decrement_nesting"),
        (torch, "_remove_batch_dim"),
        (torch, "_add_batch_dim"),
        (getattr(torch._C, "_functorch", None), "is_legacy_batchedtensor"),
    )
)


def _legacy_batched(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a column's view in the batching ``is_grads_batched`` runs."""
    return _UNWRAPPABLE and torch._C._functorch.is_legacy_batchedtensor(tensor)


def is_batched(tensor: Tensor) -> bool:
    """Whether ``tensor`` is one column's view of a batch (torch runs it batched).

    Such a view takes no in-place update of a plain tensor: code that runs on it uses
    out-of-place forms.

    Args:
        tensor: A tensor a backward received.

    Returns:
        True for a view of torch's batching (``is_grads_batched`` or ``torch.func``'s
        ``vmap``); False for a plain tensor.
    """
    functorch = getattr(torch._C, "_functorch", None)
    return _legacy_batched(tensor) or bool(
        functorch is not None
        and hasattr(functorch, "is_batchedtensor")
        and functorch.is_batchedtensor(tensor)
    )


def _vmap_level() -> int:
    """The level of the batching autograd runs now (torch's legacy vmap nesting)."""
    level = torch._C._vmapmode_increment_nesting()
    torch._C._vmapmode_decrement_nesting()
    return level - 1


def on_columns(
    grads: Sequence[Tensor], backward: Callable[..., Sequence[Tensor | None]]
) -> tuple[Tensor | None, ...]:
    """Run a folded node's backward on all columns of a batched backward at once.

    Inside ``torch.autograd.grad(..., is_grads_batched=True)`` a node's backward sees
    one column's gradient (a batched view); torch runs the kernels it has no batching
    rule for once per column. ``backward`` instead takes the columns as a leading axis
    and uses plain kernels (the columns folded into the batch axis). Outside a batched
    backward of :func:`batched_grad` (one gradient) it runs on a leading axis of one.

    The column count comes from :func:`batched_grad`: this thread's own, or, where
    autograd runs the backward on another thread (a CUDA graph's, on the device's
    thread, where the batching's nesting level is not seen either), the (level, count)
    pair open in any thread whose unwrapping gives plain columns of that count (else
    the leading axis of one: slower, never wrong).

    Args:
        grads: The node's output gradients (one column's view of them).
        backward: Maps ``[V, *output_shape]`` tensors to ``[V, *input_shape]`` ones
            (``None`` for inputs without a gradient), with out-of-place operations.

    Returns:
        The node's input gradients, as autograd expects them.
    """
    count = getattr(_COLUMNS, "count", None)
    here = count is not None  # this thread's own batched backward (the CPU's)
    if grads and all(_legacy_batched(g) for g in grads):
        if here:
            candidates = [(_vmap_level(), count)]
        else:
            # another thread's (a CUDA device thread runs the backward of the caller's
            # call). The batching's nesting is a thread-local too (0 on that thread):
            # each (level, count) pair open in any thread is tried, and the one whose
            # unwrapping gives plain columns of its count is this backward's
            with _LOCK:
                candidates = sorted(
                    {(lvl, c) for lvl, counts in _BY_LEVEL.items() for c in counts}
                )
        for level, count in candidates:
            columns = [torch._remove_batch_dim(g, level, count, 0) for g in grads]
            if all(
                c.shape == (count, *g.shape) and (here or not _legacy_batched(c))
                for c, g in zip(columns, grads, strict=True)
            ):  # (another thread's: the columns came out plain, so the level was ours)
                results = backward(*columns)
                return tuple(
                    None if r is None else torch._add_batch_dim(r, 0, level)
                    for r in results
                )
    # one gradient (or a batching that is not ours): a leading axis of one; torch
    # batches (or loops over) the plain kernels as it would any backward
    results = backward(*(g.unsqueeze(0) for g in grads))
    return tuple(None if r is None else r.squeeze(0) for r in results)


def node_name(node: Node) -> str:
    """The name of the autograd node a folded glue node stands for, else its own.

    Folded glue (:mod:`ggnchunk._glue_kernels`) records the arguments of the torch node
    it replaces under the same ``_saved_*`` names, so code that reads nodes by kind
    (the windowed glue) reads both alike.

    Args:
        node: An autograd node.

    Returns:
        A name such as ``"ConstantPadNdBackward0"``.
    """
    return getattr(node, "stands_for", None) or node.name()


def _grad(
    outputs: Sequence[Target],
    inputs: Sequence[Target],
    grad_outputs: Sequence[Tensor],
    batched: bool,
) -> tuple[Tensor | None, ...]:
    try:
        return torch.autograd.grad(
            list(outputs),
            list(inputs),
            grad_outputs=list(grad_outputs),
            retain_graph=True,
            allow_unused=True,
            is_grads_batched=batched,
        )
    except RuntimeError as error:
        if _CHANGED_IN_PLACE in str(error):
            raise ValueError(
                "the model's forward changed a tensor in place after an operation had "
                "saved it for the backward pass, so no gradient of the output can be "
                f"taken (torch: {str(error).split('. Hint')[0]}); loss.backward() fails "
                "on it as well. Change a copy instead (t = t.clone() before the in-place "
                "operation), or use the operation that returns a new tensor (t = t + 1 "
                "instead of t += 1)."
            ) from error
        if _CUDNN_RNN_EVAL not in str(error):
            raise
        raise ValueError(
            "an LSTM, GRU or RNN of the model ran on cuDNN in eval mode, and cuDNN's "
            "recurrent layers cannot backpropagate in eval mode (torch's own limit: "
            "no gradient of it can be taken). Call model.train() for the call where the "
            "recurrent layers have no dropout (the same function), or run the call "
            "inside `with torch.backends.cudnn.flags(enabled=False):`."
        ) from error


# torch's check in cuDNN's recurrent backward (aten/src/ATen/native/cudnn/RNN.cpp)
_CUDNN_RNN_EVAL = "cudnn RNN backward can only be called in training mode"
# torch's check of a saved tensor's version (torch/csrc/autograd/saved_variable.cpp)
_CHANGED_IN_PLACE = "modified by an inplace operation"


def plain_grad(
    outputs: Sequence[Target],
    inputs: Sequence[Target],
    grad_outputs: Sequence[Tensor],
) -> tuple[Tensor | None, ...]:
    """Backpropagate one vector from ``outputs`` to ``inputs`` (graph kept).

    Args:
        outputs: Tensors or gradient edges where the vector starts.
        inputs: Tensors or gradient edges where it is wanted.
        grad_outputs: One tensor per output, of its shape.

    Returns:
        One tensor per input (``None`` where unreachable).
    """
    with quiet_autograd():
        return _grad(outputs, inputs, grad_outputs, batched=False)


@contextlib.contextmanager
def blocked(edges: Sequence[GradientEdge]) -> Iterator[None]:
    """Let no gradient through the nodes of ``edges`` (they backpropagate zeros).

    Used when the gradient w.r.t. a parameter must count only the glue's paths, not the
    paths through layers whose rules account for themselves.

    Args:
        edges: Edges whose nodes are blocked while the context is open.

    Yields:
        Nothing.
    """

    def zero(grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        return tuple(None if g is None else g.new_zeros(g.shape) for g in grads)

    nodes = {id(edge.node): edge.node for edge in edges}
    handles = [node.register_prehook(zero) for node in nodes.values()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def sole_storage_owner(tensor: Tensor) -> bool:
    """Whether no other tensor shares ``tensor``'s memory (the root of a view aside).

    Counts the references to the storage (``torch._C._storage_Use_Count``): one per
    tensor sharing it, one for the storage object asked for here, one more where
    ``tensor`` is a view (its root). Another view, an autograd graph's saved copy or a
    user's alias of the memory makes it more. The same tensor object held twice is not
    seen: callers check their own containers. False where torch lacks the count.

    Args:
        tensor: A dense tensor.

    Returns:
        Whether writing into ``tensor`` in place can change no other tensor.
    """
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return False
    try:
        uses = count(tensor.untyped_storage()._cdata)
    except (AttributeError, RuntimeError, TypeError):
        return False
    return uses == (2 if tensor._base is None else 3)


def warm_up() -> None:
    """Pay the one-time set-up of batched backward passes now (about 40 MiB, 0.3 s).

    ``torch.autograd.grad(..., is_grads_batched=True)`` initializes ``torch.func``'s
    machinery on first use. ggnchunk does this when it is imported, so that the memory
    a call adds, which ``max_memory`` bounds, is the call's own and not a one-time cost
    of the process.
    """
    x = torch.ones(2, 2, requires_grad=True)
    with quiet_autograd():
        torch.autograd.grad(
            torch.tanh(x * 2), x, torch.ones(2, 2, 2), is_grads_batched=True
        )


def global_forward_hooks() -> bool:
    """Whether forward hooks for every module are registered (``torch.nn.modules``).

    Returns:
        True if ``register_module_forward_hook`` has hooks now.
    """
    from torch.nn.modules import module as torch_module

    return bool(getattr(torch_module, "_global_forward_hooks", None))


def first_global_forward_hook(hook: Callable) -> Any:
    """Register ``hook`` for every module's forward, ahead of the hooks already there.

    torch runs the global forward hooks before a module's own, in registration order;
    a hook that must see a layer's own output (before a user's global hook replaces it)
    has to run first.

    Args:
        hook: ``hook(module, args, output)``; its result is ignored.

    Returns:
        The handle (``.remove()``).
    """
    from torch.nn.modules import module as torch_module

    handle = torch_module.register_module_forward_hook(hook)
    hooks = getattr(torch_module, "_global_forward_hooks", None)
    if hooks is not None and hasattr(hooks, "move_to_end") and handle.id in hooks:
        hooks.move_to_end(handle.id, last=False)
    return handle


@contextlib.contextmanager
def _muted(dicts: Sequence[dict | None]) -> Iterator[None]:
    """Empty each hook dictionary in place for the block; then restore it, in order.

    The dictionaries stay the same objects, so the handles the user holds still remove
    their hooks; hooks added during the block are kept, after the restored ones.
    """
    saved: list[tuple[dict, list]] = []
    try:
        for hooks in dicts:
            if hooks:
                saved.append((hooks, list(hooks.items())))
                hooks.clear()
        yield
    finally:
        for hooks, items in reversed(saved):
            added = list(hooks.items())
            hooks.clear()
            hooks.update(items)
            hooks.update(added)


def parameter_hooks_off(params: Sequence[Tensor]) -> contextlib.AbstractContextManager:
    """The parameters' gradient hooks (``Tensor.register_hook``) do not run in the block.

    They run wherever autograd computes a gradient of the parameter, also in
    ``torch.autograd.grad`` with ``is_grads_batched=True``: a clipping or scaling hook
    would change the products of parameters that the glue's backward reaches (an LSTM's
    weights, a position table), and not those of layers with rules. The GGN is the
    model function's, whatever its training loop does to gradients.

    Args:
        params: The trainable parameters.

    Returns:
        A context manager.
    """
    return _muted([getattr(p, "_backward_hooks", None) for p in params])


_CALL = threading.local()  # .stack: the running call's muted tensor hooks


@contextlib.contextmanager
def forward_tensor_hooks_off() -> Iterator[None]:
    """The block of one call: tensor hooks its forward passes registered are muted.

    A model's ``forward`` may hook a tensor (``h.register_hook``: scaling, clipping,
    a gradient kept for Grad-CAM). Autograd would run such a hook wherever the columns
    cross that tensor through autograd (glue between layers), on batched columns, and
    not where a layer's rule takes them: a scaling hook made a diagonal 9x off. The GGN
    is the model function's, as for the parameters' hooks
    (:func:`parameter_hooks_off`). Each forward pass runs them as written (a forward
    that differentiates inside itself needs them), then
    :func:`tensor_hooks_off_for_the_call` mutes them until the block ends, also on an
    exception.

    Yields:
        Nothing.
    """
    previous = getattr(_CALL, "stack", None)
    try:
        with contextlib.ExitStack() as stack:
            _CALL.stack = stack
            yield
    finally:
        _CALL.stack = previous


def tensor_hooks_off_for_the_call(dicts: Sequence[dict]) -> None:
    """Mute these hook dictionaries (``Tensor._backward_hooks``) until the call ends.

    Args:
        dicts: The dictionaries of the tensors a forward pass hooked.

    Raises:
        RuntimeError: Outside :func:`forward_tensor_hooks_off` (a caller's mistake).
    """
    if not dicts:
        return
    stack = getattr(_CALL, "stack", None)
    if stack is None:
        raise RuntimeError("tensor hooks are muted only inside forward_tensor_hooks_off")
    stack.enter_context(_muted(dicts))


def as_hooks_leave_it(param: Tensor, grad: Tensor) -> Tensor:
    """``grad`` after the parameter's gradient hooks, in order, as ``backward`` runs them.

    For code that sets ``.grad`` itself in place of a ``loss.backward()`` (the optimizer's
    closure): a user's clipping hook then acts on its steps as on the others.

    Args:
        param: The parameter.
        grad: Its gradient, shaped as the parameter.

    Returns:
        What the last hook returned (``grad`` where none returned anything).
    """
    for hook in list((getattr(param, "_backward_hooks", None) or {}).values()):
        result = hook(grad)
        if result is not None:
            grad = result
    return grad


def module_backward_hooks_off(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """No module backward hook is set up by a forward pass run in the block.

    A module with (full) backward hooks, or with global ones
    (``register_module_full_backward_hook``), wraps its inputs and outputs in nodes
    whose backward calls the hooks: they would run in every backward sweep, with
    batches of columns (a hook that returns a changed ``grad_input`` would change the
    result; one that reads a missing gradient raised). The forward pass's values are
    the same without them.

    Args:
        model: The model; its modules' hooks and the global ones are muted.

    Returns:
        A context manager.
    """
    from torch.nn.modules import module as torch_module

    dicts: list[dict | None] = [
        getattr(torch_module, "_global_backward_hooks", None),
        getattr(torch_module, "_global_backward_pre_hooks", None),
    ]
    for module in model.modules():
        dicts.append(getattr(module, "_backward_hooks", None))
        dicts.append(getattr(module, "_backward_pre_hooks", None))
    return _muted(dicts)


def in_checkpoint() -> bool:
    """Whether the forward running now is inside a ``torch.utils.checkpoint`` region.

    A non-reentrant checkpoint saves nothing in the forward pass and runs the function
    again when the backward needs its tensors, matching them to the nodes of the first
    run by their order and shapes: the first run must save what the second one does,
    so nothing in it may be replaced by a folded form. Its saved-tensor hooks are then
    the innermost ones (their functions are ``torch.utils.checkpoint``'s).

    Returns:
        True inside such a region's forward.
    """
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # (a torch without it: no region is found)
        return False
    hooks = top(False)
    if not hooks:
        return False
    pack = hooks[0]
    return bool(getattr(pack, "_checkpoint_internal", False)) or (
        getattr(pack, "__module__", "") == "torch.utils.checkpoint"
    )
