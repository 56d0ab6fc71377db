"""The engine's forward pass: glue operations routed to backwards that batch over columns.

The glue between layers is backpropagated by autograd, batched over a chunk's columns
(``torch.autograd.grad(..., is_grads_batched=True)``), and torch's batching runs the
backward kernels it has no rule for once per column. While the engine's forward pass
runs, :func:`folded_glue` (a torch function mode: thread-local) routes the calls whose
backward it can write with batched operations through their folded forms, the same
forward computation with such a backward:

- ``F.scaled_dot_product_attention`` (also inside ``nn.MultiheadAttention``, and its
  ``need_weights=True`` tail: :class:`_EagerTail`): :mod:`ggnchunk._attention`;
- ``F.interpolate`` outside layers with a rule (functional resizes; ``nn.Upsample``
  keeps its rule): :mod:`ggnchunk._resample`;
- ``F.pad`` (every mode), max and average pooling (1-3d, also adaptive), pixel
  shuffles, ``flip``, ``roll``, ``masked_fill``, ``where``, ``softmax``, batch norm with
  running statistics, ``table[index]`` and functional activations (``F.silu``,
  ``F.gelu``, ``torch.tanh``, ...) outside layers with a rule (the pooling and
  activation layers keep theirs): :mod:`ggnchunk._glue_kernels`.

Calls they cannot reproduce exactly are left as they are, and so is every call inside
a ``torch.utils.checkpoint`` region (its backward runs the calls again as written and
needs the tensors they save to match those of the first run).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from ggnchunk._attention import (
    SDPA,
    attention_workspace,
    fold_attention,
    fold_eager_tail,
    unchecked,
)
from ggnchunk._autograd import in_checkpoint
from ggnchunk._glue_kernels import FOLDERS, fold_glue_call, glue_kernel_workspace
from ggnchunk._resample import INTERPOLATE, fold_interpolate, resample_workspace

__all__ = ["folded_glue", "from_batch", "glue_workspace", "layer_entered", "layer_left"]

_DEPTH = threading.local()  # layers with a rule this thread's forward is inside
# ``store``: the tensors this thread's forward made from the batch (tracked)
_TAGS = threading.local()


def from_batch(x: torch.Tensor) -> bool | None:
    """Whether this thread's forward made ``x`` from the batch's tensors.

    A layer called on a tensor whose axis 0 has the batch size by chance (T5's relative
    position bias looked up for ``[q, k]`` positions where ``q == N``, a position
    embedding of ``arange(L)`` with ``L == N``, a Perceiver's learned latents) is no
    per-sample call; only a tensor made from the inputs can be one. Every call the
    forward makes passes its tag on (in-place ones to the tensor they change); a call
    the tags miss leaves the layer to the glue, which is exact either way.

    Args:
        x: A tensor of the forward pass.

    Returns:
        Whether it was made from the batch, or ``None`` where no forward is tracked.
    """
    store = getattr(_TAGS, "store", None)
    return None if store is None else x in store


def _tagged(store: WeakIdKeyDictionary, values: Any) -> bool:
    for value in values:
        if isinstance(value, torch.Tensor):
            if value in store:
                return True
        elif isinstance(value, (list, tuple)) and any(
            isinstance(v, torch.Tensor) and v in store for v in value
        ):
            return True
    return False


def _tag(store: WeakIdKeyDictionary, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        store[value] = True
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                store[item] = True


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (
        name.endswith("_") and not name.endswith("__")
    ) or (name.startswith("__i") and name.endswith("__"))  # fmt: skip


def layer_entered() -> None:
    """Note that a layer with a rule starts its forward (the recording's pre-hook)."""
    _DEPTH.value = getattr(_DEPTH, "value", 0) + 1


def layer_left() -> None:
    """Note that a layer with a rule finished its forward (the recording's hook)."""
    _DEPTH.value = max(0, getattr(_DEPTH, "value", 0) - 1)


def glue_workspace(node: Any) -> int:
    """Elements per column a node of the recorded glue allocates beyond its vectors.

    Args:
        node: An autograd node of the glue.

    Returns:
        A folded node's workspace (all samples together), else 0.
    """
    return (
        attention_workspace(node) + resample_workspace(node)
        + glue_kernel_workspace(node)
    )  # fmt: skip


_LOOKUP_ARGS = {
    F.embedding: ("input", "weight", "padding_idx", "max_norm", "norm_type",
                  "scale_grad_by_freq", "sparse"),
    torch.embedding: ("weight", "input", "padding_idx", "scale_grad_by_freq", "sparse"),
}  # fmt: skip


def _refuse_counted_lookup(
    store: WeakIdKeyDictionary, func: Any, args: tuple, kwargs: dict
) -> None:
    """Refuse a lookup of the batch's indices with ``scale_grad_by_freq=True``.

    Its backward divides each row's gradient by the index's count over the whole index
    tensor: over the batch where the indices are made from it (token ids, also
    flattened or sequence-first), which couples the samples (a sub-batch gets other
    counts); a fixed factor where they are not (positions ``arange(T)``), followed.
    """
    bound = dict(zip(_LOOKUP_ARGS[func], args, strict=False)) | kwargs
    weight, indices = bound.get("weight"), bound.get("input")
    if not (
        bound.get("scale_grad_by_freq") and torch.is_grad_enabled()
        and isinstance(weight, torch.Tensor) and weight.requires_grad
        and isinstance(indices, torch.Tensor) and indices in store
    ):  # fmt: skip
        return
    raise ValueError(
        "an embedding lookup (nn.Embedding or F.embedding) with scale_grad_by_freq=True "
        "reads indices made from the batch: its backward divides each row's gradient by "
        "the index's count over the whole batch, which is not the derivative of the "
        "forward pass and couples the samples, so the model has no exact GGN diagonal "
        "that is a sum over samples. Pass scale_grad_by_freq=False there (for "
        "nn.Embedding: set module.scale_grad_by_freq = False) while computing the "
        "curvature; the forward pass does not change."
    )


_REGISTER_HOOK = torch.Tensor.register_hook


class _Folding(TorchFunctionMode):
    def __init__(
        self,
        store: WeakIdKeyDictionary | None = None,
        hooked: dict[int, dict] | None = None,
    ) -> None:
        super().__init__()
        self.store = store  # the batch's tensors and those made from them (tracked)
        self.hooked = hooked  # the hook dictionaries of tensors hooked in the block

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _REGISTER_HOOK and self.hooked is not None and args:
            handle = func(*args, **kwargs)
            hooks = getattr(args[0], "_backward_hooks", None)
            if hooks is not None:  # kept by id: the tensor itself is not held
                self.hooked[id(hooks)] = hooks
            return handle
        store = self.store
        if store is not None and (func is F.embedding or func is torch.embedding):
            _refuse_counted_lookup(store, func, args, kwargs)
        result = self._call(func, args, kwargs)
        if store is not None and (_tagged(store, args) or _tagged(store, kwargs.values())):
            _tag(store, result)
            if _in_place(func) and args:
                _tag(store, args[0])
            if "out" in kwargs:
                _tag(store, kwargs["out"])
        return result

    def _call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if (
            func is SDPA or func is INTERPOLATE or func in FOLDERS
            or func is F.multi_head_attention_forward
        ) and in_checkpoint():  # fmt: skip
            # run again in the backward as written: the saved tensors must match
            return func(*args, **kwargs)
        if func is SDPA:
            folded = fold_attention(args, kwargs)
            if folded is not None:
                return folded
        elif func is INTERPOLATE and not getattr(_DEPTH, "value", 0):
            folded = fold_interpolate(args, kwargs)
            if folded is not None:
                return folded
        elif func in FOLDERS and not getattr(_DEPTH, "value", 0):
            folded = fold_glue_call(func, args, kwargs)
            if folded is not None:
                return folded
        elif func is F.multi_head_attention_forward:
            inner = unchecked(func)
            if inner is not None:
                with self, _EagerTail():
                    return inner(*args, **kwargs)
        return func(*args, **kwargs)


class _EagerTail(TorchFunctionMode):
    """Inside ``F.multi_head_attention_forward``: its ``need_weights=True`` tail folded.

    It computes ``P = softmax(bmm(q, kᵀ))`` (``baddbmm`` with the mask) for the weights
    it returns, then ``bmm(P, v)``. That last product, where its first operand is this
    very ``P``, is the same product in :func:`~ggnchunk._attention.fold_eager_tail`, with
    the folded attention's backward (the rows' form); the weights keep their own graph.
    With dropout (a draw between the two) the operand is not ``P`` and nothing is
    changed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.scores: Any = None  # (the scores, q, kᵀ, mask) of the last product
        self.probs: Any = None  # (P, q, kᵀ, mask)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.bmm and self.probs is not None and len(args) == 2 and not kwargs:
            probs, q, keys, mask = self.probs
            self.probs = None
            if args[0] is probs:
                folded = fold_eager_tail(q, keys, args[1], mask, probs)
                if folded is not None:
                    return folded
        result = func(*args, **kwargs)
        if func is torch.bmm and len(args) == 2 and not kwargs:
            self.scores = (result, args[0], args[1], None)
        elif func is torch.baddbmm and len(args) == 3 and not kwargs:
            self.scores = (result, args[1], args[2], args[0])
        elif func is F.softmax and self.scores is not None and args and (
            args[0] is self.scores[0]
        ) and _last_axis(args, kwargs):  # fmt: skip
            self.probs = (result, *self.scores[1:])
            self.scores = None
        return result


def _last_axis(args: tuple, kwargs: dict) -> bool:
    """A ``softmax`` call along the last axis, in the input's dtype."""
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    dtype = kwargs.get("dtype", args[3] if len(args) > 3 else None)
    return dtype is None and isinstance(dim, int) and dim in (-1, args[0].dim() - 1)


@contextlib.contextmanager
def folded_glue(
    batch: Iterable[torch.Tensor] | None = None, hooked: dict[int, dict] | None = None
) -> Iterator[None]:
    """Route this thread's foldable glue calls through their folded forms (one forward).

    Args:
        batch: The batch's per-sample tensors: the tensors made from them are tracked
            (:func:`from_batch`); ``None`` tracks nothing.
        hooked: Where the hook dictionaries of the tensors that the block hooks
            (``Tensor.register_hook``, in the model's forward) are collected, by id;
            ``None`` collects nothing.

    Yields:
        Nothing.
    """
    previous = getattr(_DEPTH, "value", 0)
    previous_store = getattr(_TAGS, "store", None)
    store = None
    if batch is not None:
        store = WeakIdKeyDictionary()
        _tag(store, list(batch))
    _DEPTH.value = 0  # a forward that raised inside a layer left its count behind
    _TAGS.store = store
    try:
        with _Folding(store, hooked):
            yield
    finally:
        _DEPTH.value = previous
        _TAGS.store = previous_store
