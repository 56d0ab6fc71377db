"""The engine's forward pass: glue operations routed to backwards that batch over columns.

The glue between layers is backpropagated by autograd, batched over a chunk's columns
(``torch.autograd.grad(..., is_grads_batched=True)``), and torch's batching runs the
backward kernels it has no rule for once per column. While the engine's forward pass
runs, :func:`folded_glue` (a torch function mode: thread-local) routes the calls whose
backward it can write with batched operations through their folded forms, the same
forward computation with such a backward:

- ``F.scaled_dot_product_attention`` (also inside ``nn.MultiheadAttention``):
  :mod:`ggnchunk._attention`;
- ``F.interpolate`` outside layers with a rule (functional resizes; ``nn.Upsample``
  keeps its rule): :mod:`ggnchunk._resample`;
- ``F.pad`` (every mode), max and average pooling (1-3d, also adaptive), pixel
  shuffles, ``flip``, ``roll``, ``masked_fill``, ``where``, ``softmax``, batch norm with
  running statistics and ``table[index]`` outside layers with a rule (the pooling
  layers keep theirs): :mod:`ggnchunk._glue_kernels`.

Calls they cannot reproduce exactly are left as they are.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ggnchunk._attention import SDPA, attention_workspace, fold_attention, unchecked
from ggnchunk._glue_kernels import FOLDERS, fold_glue_call, glue_kernel_workspace
from ggnchunk._resample import INTERPOLATE, fold_interpolate, resample_workspace

__all__ = ["folded_glue", "glue_workspace", "layer_entered", "layer_left"]

_DEPTH = threading.local()  # layers with a rule this thread's forward is inside


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


class _Folding(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
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
                with self:
                    return inner(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def folded_glue() -> Iterator[None]:
    """Route this thread's foldable glue calls through their folded forms (one forward).

    Yields:
        Nothing.
    """
    previous = getattr(_DEPTH, "value", 0)
    _DEPTH.value = 0  # a forward that raised inside a layer left its count behind
    try:
        with _Folding():
            yield
    finally:
        _DEPTH.value = previous
