"""Argument checks with messages that name the argument and say the fix.

Everything here runs before the forward pass; checks that need the model output
(output/target shapes, the number of columns) live next to the code that has it.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Batch", "check_batch", "check_positive_int"]


def check_positive_int(value: object, name: str, hint: str = "") -> int:
    """Return ``value`` as an ``int`` if it is a positive integer, else raise.

    Args:
        value: The user's value.
        name: The argument's name, for the message.
        hint: Extra advice appended to the message.

    Returns:
        The value as a Python ``int``.

    Raises:
        TypeError: If the value is not an integer (``bool`` and ``float`` included).
        ValueError: If the value is not positive.
    """
    if isinstance(value, (bool, float)):
        raise TypeError(f"{name} must be a positive int, got {value!r}.{hint}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a positive int, got {type(value).__name__} {value!r}.{hint}"
        ) from None
    if number < 1:
        raise ValueError(f"{name} must be a positive int, got {number}.{hint}")
    return number


def all_finite(value: Tensor) -> bool:
    """Whether every element of a tensor is finite (no NaN or Inf).

    By the extremes (``torch.aminmax``, which propagates NaN): one reduction, with no
    boolean copy of the tensor as ``isfinite(value).all()`` makes; 9x faster on a 2.4M
    element weight (0.6 ms against 5.7 ms, 1 thread), which made the checks of
    ResNet-18's parameters 9% of a call.

    Args:
        value: Any shape.

    Returns:
        ``True`` for an empty tensor.
    """
    if value.numel() == 0:
        return True
    if not value.is_floating_point():  # complex: no order; integers: always finite
        return bool(torch.isfinite(value).all())
    low, high = torch.aminmax(value.detach())
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _map_tensors(value: Any, fn: Any) -> Any:
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def usable(tensor: Tensor) -> Tensor:
    """``tensor`` detached; a copy where it was made in ``torch.inference_mode()``.

    Autograd cannot save inference tensors for a backward pass (a layer's input, a
    loss's targets): a normal copy takes their place (the caller's tensor stays).

    Args:
        tensor: An input or target.

    Returns:
        A tensor outside any graph, usable by autograd.
    """
    return tensor.clone() if tensor.is_inference() else tensor.detach()


class Batch:
    """The model's inputs for one forward pass: ``model(*args, **kwargs)``.

    ``inputs`` is a tensor (``model(inputs)``), a tuple or list (``model(*inputs)``) or a
    dict (``model(**inputs)``). Tensors whose axis 0 has the batch size are per-sample
    (sliced by :meth:`slice`); anything else is passed unchanged to every sub-batch.
    Tensors are detached, so the caller's inputs never collect gradients (inference
    tensors are copied, :func:`usable`).

    Args:
        inputs: The user's inputs.
        size: The batch size ``N`` (from the targets).
    """

    def __init__(self, inputs: Any, size: int):
        self.size = size
        if isinstance(inputs, Tensor):
            self.args: tuple = (usable(inputs),)
            self.kwargs: dict = {}
        elif isinstance(inputs, (tuple, list)):
            self.args = tuple(_map_tensors(list(inputs), usable))
            self.kwargs = {}
        elif isinstance(inputs, dict):
            keys = [k for k in inputs if not isinstance(k, str)]
            if keys:
                raise TypeError(
                    f"inputs is a dict with the key {keys[0]!r} ({type(keys[0]).__name__}"
                    "): a dict is passed as model(**inputs), whose keys must be the "
                    "names of forward's arguments (strings). Use string keys, or pass a "
                    "tuple for positional arguments."
                )
            self.args = ()
            self.kwargs = _map_tensors(dict(inputs), usable)
        else:
            raise TypeError(
                "inputs must be a torch.Tensor with the batch on axis 0, a tuple/list "
                "(called as model(*inputs)) or a dict (called as model(**inputs)); got "
                f"{type(inputs).__name__}."
            )

    def tensors(self) -> list[Tensor]:
        """Every tensor among the inputs (nested in tuples, lists and dicts too)."""
        found: list[Tensor] = []
        _map_tensors((self.args, self.kwargs), found.append)
        return found

    def batched(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is per-sample (axis 0 has the batch size)."""
        return tensor.dim() > 0 and tensor.shape[0] == self.size

    def slice(self, start: int, stop: int) -> Batch:
        """Samples ``start:stop`` (per-sample tensors sliced, the rest unchanged).

        Args:
            start: First sample.
            stop: One past the last sample.

        Returns:
            The sub-batch.
        """
        part = Batch.__new__(Batch)
        part.size = stop - start
        cut = lambda t: t[start:stop] if self.batched(t) else t  # noqa: E731
        part.args = _map_tensors(self.args, cut)
        part.kwargs = _map_tensors(self.kwargs, cut)
        return part


def check_batch(
    params: list[tuple[str, nn.Parameter]], inputs: object, targets: object
) -> Batch:
    """Check inputs and targets against each other and the parameters.

    Args:
        params: The trainable parameters.
        inputs: The user's inputs (tensor, tuple/list or dict of them).
        targets: The user's targets, batch on axis 0.

    Returns:
        The batch, with detached tensors.

    Raises:
        TypeError: If targets are not a tensor or inputs of an unsupported type.
        ValueError: For an empty batch, no per-sample input, mixed devices or dtypes.
        RuntimeError: Inside ``torch.inference_mode()``.
    """
    if not isinstance(targets, Tensor):
        raise TypeError(
            f"targets must be a torch.Tensor with the batch on axis 0, got "
            f"{type(targets).__name__}."
        )
    if isinstance(inputs, Tensor) and (inputs.dim() == 0 or inputs.shape[0] == 0):
        raise ValueError(
            f"inputs has shape {tuple(inputs.shape)}: the batch is empty. Pass at least "
            "one sample, batch on axis 0."
        )
    if targets.dim() == 0 or targets.shape[0] == 0:
        raise ValueError(
            f"targets has shape {tuple(targets.shape)}: the batch is empty or has no "
            "batch axis. Pass at least one sample, batch on axis 0."
        )
    batch = Batch(inputs, targets.shape[0])
    tensors = batch.tensors()
    if not tensors:
        raise TypeError(
            "inputs must be a torch.Tensor with the batch on axis 0, a tuple/list of "
            "model arguments (model(*inputs)) or a dict (model(**inputs)) holding at "
            f"least one tensor; got {type(inputs).__name__} without tensors."
        )
    if isinstance(inputs, Tensor) and inputs.shape[0] != targets.shape[0]:
        raise ValueError(
            f"targets has shape {tuple(targets.shape)} but inputs has batch size "
            f"{inputs.shape[0]}; pass one target per sample, batch on axis 0."
        )
    if not any(batch.batched(t) for t in tensors):
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(
            f"targets has batch size {batch.size} but no input tensor has it on axis 0 "
            f"(input shapes {shapes}); pass one target per sample, batch on axis 0."
        )
    device = params[0][1].device
    dtype = params[0][1].dtype
    for name, value in [("inputs", t) for t in tensors] + [("targets", targets)]:
        if value.device != device:
            raise ValueError(
                f"{name} is on {value.device} but the model is on {device}; move it with "
                f"{name}.to({str(device)!r})."
            )
    for value in tensors:
        if value.is_floating_point() and value.dtype != dtype:
            raise ValueError(
                f"inputs has dtype {value.dtype} but the model has {dtype}; convert with "
                f"inputs.to({dtype})."
            )
    if device.type == "meta":
        raise ValueError(
            "the model's parameters are on the 'meta' device (shapes without values), "
            "so there is no curvature to compute; load or initialize the weights first, "
            "e.g. model.to_empty(device='cpu') and then load_state_dict(...)."
        )
    for name, value in [("inputs", t) for t in tensors] + [("targets", targets)]:
        if value.is_floating_point() and not all_finite(value):
            raise ValueError(
                f"{name} contain NaN or Inf values; the GGN of a non-finite forward pass "
                f"is not defined. Remove or replace them (e.g. torch.nan_to_num)."
            )
    bad = [n for n, p in params if not all_finite(p)]
    if bad:
        raise ValueError(
            f"parameter {bad[0]!r} contains NaN or Inf values ({len(bad)} parameter(s) "
            "in all); the GGN is not defined there. Re-initialize or restore them first."
        )
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "ggnchunk cannot run inside torch.inference_mode(), which forbids the "
            "backward passes it needs; call it outside (torch.no_grad() is fine)."
        )
    return batch


@contextlib.contextmanager
def random_state_kept_on_error(device: torch.device) -> Iterator[None]:
    """Torch's random state on the CPU (and ``device``) is put back if the block raises.

    A call refused after its forward pass (a budget too small, samples that influence
    each other), or interrupted, would otherwise have drawn the forward pass's random
    numbers (dropout, a VAE's noise) for nothing; a call that returns advances the state
    as its forward pass did.

    Args:
        device: The device the model is on.
    """
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    except BaseException:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        raise


# frames a warning passes through between ggnchunk and its caller: torch's decorators
# (``no_grad``) and ``torch.optim``'s step hooks around ``DiagGGNOptimizer.step``
_WRAPPERS = frozenset({"torch.utils._contextlib", "torch.optim.optimizer", "contextlib"})


# the warnings given so far in the running call (None: outside a call)
_SAID: contextvars.ContextVar[set[tuple[type, str]] | None] = contextvars.ContextVar(
    "ggnchunk_warnings_said", default=None
)


@contextlib.contextmanager
def warnings_once() -> Iterator[None]:
    """Within the block (a call, a dataset loop), each distinct warning is given once.

    A call runs one forward pass and sweep per sub-batch (``batch_chunk_size``, a
    dataset's batches): the same finding would otherwise be repeated for each, and
    Python's own once-per-place registry is reset whenever ``warnings.catch_warnings``
    exits anywhere in the process. Nested blocks share the outermost block's record.
    """
    if _SAID.get() is not None:
        yield
        return
    token = _SAID.set(set())
    try:
        yield
    finally:
        _SAID.reset(token)


def note_forward_error(error: BaseException, model: nn.Module) -> None:
    """Name the module in whose forward ``error`` was raised, as a note on the error.

    The error keeps its type and traceback (code catching it still works); on Python
    3.10, which has no notes, it is left as it is.

    Args:
        error: An exception raised by ``model``'s forward pass inside a call.
        model: The user's model.
    """
    if not hasattr(error, "add_note"):
        return
    names = {id(m): n for n, m in model.named_modules()}
    where, tb = None, error.__traceback__
    while tb is not None:  # the innermost forward of one of the model's modules
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            where = owner
        tb = tb.tb_next
    if where is None:
        return
    name = names[id(where)] or "the model itself"
    label = repr(name) if names[id(where)] else name
    error.add_note(
        f"ggnchunk: raised in the model's forward pass, in module {label} "
        f"({type(where).__name__}), which ggnchunk runs as model(inputs); check that "
        "model(inputs) runs on these inputs."
    )


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` at the user's frame, once per :func:`warnings_once` block.

    Args:
        message: The warning's text.
        category: Its class.
    """
    said = _SAID.get()
    if said is not None:
        if (category, message) in said:
            return
        said.add((category, message))
    warnings.warn(message, category, stacklevel=user_stacklevel())


def user_stacklevel() -> int:
    """``stacklevel`` for ``warnings.warn`` that points at the first frame outside ggnchunk.

    Walks out of ggnchunk's modules (and the torch wrappers directly around them).

    Returns:
        The level, counted from the caller of this function's caller (``warnings.warn``'s
        own convention: 1 is the function that calls ``warn``).
    """
    frame, level = sys._getframe(1), 1
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] != "ggnchunk" and module not in _WRAPPERS:
            break
        frame, level = frame.f_back, level + 1
    return level
