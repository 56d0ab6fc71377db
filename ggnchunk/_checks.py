"""Argument checks with messages that name the argument and say the fix.

Everything here runs before the forward pass; checks that need the model output
(output/target shapes, the number of columns) live next to the code that has it.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor, nn

__all__ = [
    "check_positive_int",
    "check_tensors",
    "trainable_parameters",
]


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


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The model's parameters with ``requires_grad``, in ``named_parameters()`` order.

    Args:
        model: The user's model.

    Returns:
        ``(name, parameter)`` pairs.

    Raises:
        ValueError: If there are none.
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            "model has no parameters with requires_grad=True, so its GGN diagonal is "
            "empty. Unfreeze the parameters whose diagonal you need."
        )
    return params


def check_tensors(
    params: list[tuple[str, nn.Parameter]], inputs: object, targets: object
) -> None:
    """Check types, batch sizes, dtypes and devices of inputs, targets and parameters.

    Args:
        params: The trainable parameters.
        inputs: The user's inputs.
        targets: The user's targets.

    Raises:
        TypeError: If inputs or targets are not tensors.
        ValueError: For an empty batch, mismatched batch sizes, mixed devices or dtypes.
        RuntimeError: Inside ``torch.inference_mode()``.
    """
    for name, value in (("inputs", inputs), ("targets", targets)):
        if not isinstance(value, Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor with the batch on axis 0, got "
                f"{type(value).__name__}."
            )
    if inputs.dim() == 0 or inputs.shape[0] == 0:
        raise ValueError(
            f"inputs has shape {tuple(inputs.shape)}: the batch is empty. Pass at least "
            "one sample, batch on axis 0."
        )
    if targets.dim() == 0 or targets.shape[0] != inputs.shape[0]:
        raise ValueError(
            f"targets has shape {tuple(targets.shape)} but inputs has batch size "
            f"{inputs.shape[0]}; pass one target per sample, batch on axis 0."
        )
    devices = {p.device for _, p in params}
    if len(devices) > 1:
        raise ValueError(
            f"the model's parameters are on several devices ({sorted(map(str, devices))}); "
            "move the model to one device with model.to(device)."
        )
    device = devices.pop()
    for name, value in (("inputs", inputs), ("targets", targets)):
        if value.device != device:
            raise ValueError(
                f"{name} is on {value.device} but the model is on {device}; move it with "
                f"{name}.to({str(device)!r})."
            )
    dtypes = {p.dtype for _, p in params}
    if len(dtypes) > 1:
        raise ValueError(
            f"the model's parameters have several dtypes ({sorted(map(str, dtypes))}); "
            "convert the model with model.float() or model.double()."
        )
    dtype = next(iter(dtypes))
    if not dtype.is_floating_point:
        raise ValueError(f"the model's parameters have dtype {dtype}; use a float dtype.")
    if inputs.is_floating_point() and inputs.dtype != dtype:
        raise ValueError(
            f"inputs has dtype {inputs.dtype} but the model has {dtype}; convert with "
            f"inputs.to({dtype})."
        )
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "ggnchunk cannot run inside torch.inference_mode(), which forbids the "
            "backward passes it needs; call it outside (torch.no_grad() is fine)."
        )
