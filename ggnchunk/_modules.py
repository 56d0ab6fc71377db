"""Which model layers the engine can backpropagate through, and how.

``SUPPORTED`` maps a layer class (exact type, as BackPACK dispatches) to ``None`` when
BackPACK's own ``DiagGGNExact`` extension handles it, or to a BackPACK ``ModuleExtension``
that ggnchunk supplies. :func:`check_model` inspects a model before any work and names the
first module that cannot be handled.
"""

from __future__ import annotations

from dataclasses import dataclass

from backpack.custom_module.branching import SumModule
from backpack.custom_module.pad import Pad
from backpack.custom_module.permute import Permute
from backpack.custom_module.reduce_tuple import ReduceTuple
from backpack.custom_module.scale_module import ScaleModule
from backpack.custom_module.slicing import Slicing
from backpack.extensions.module_extension import ModuleExtension
from torch import nn

from ggnchunk._layers import AutogradJacobian, EmbeddingDiagGGN

__all__ = ["SUPPORTED", "HookedModules", "check_model", "supported_layers_table"]

_BACKPACK_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.ZeroPad2d,
    nn.Dropout,
    nn.Flatten,
    nn.Identity,
    nn.ReLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.LeakyReLU,
    nn.LogSigmoid,
    nn.ELU,
    nn.SELU,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.RNN,
    nn.LSTM,
    Pad,
    Permute,
    ScaleModule,
    SumModule,
    Slicing,
)

SUPPORTED: dict[type[nn.Module], ModuleExtension | None] = {
    **dict.fromkeys(_BACKPACK_LAYERS),
    # BackPACK 1.7.1 builds the one-hot matrix in float32 and fails in float64.
    nn.Embedding: EmbeddingDiagGGN(),
    # BackPACK 1.7.1's (adaptive) average pooling builds a float32 kernel and fails in
    # float64; its adaptive version also needs the input to be a multiple of the output.
    **{
        cls: AutogradJacobian()
        for cls in (
            nn.AvgPool1d,
            nn.AvgPool2d,
            nn.AvgPool3d,
            nn.AdaptiveAvgPool1d,
            nn.AdaptiveAvgPool2d,
            nn.AdaptiveAvgPool3d,
        )
    },
}
"""Registry: layer class → ``None`` (BackPACK's extension) or ggnchunk's extension."""

# Layers without children that only pass a tensor on; BackPACK never hooks them.
_PASS_THROUGH: tuple[type[nn.Module], ...] = (ReduceTuple,)

_SAMPLE_COUPLING = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@dataclass
class HookedModules:
    """The modules of a model that take part in the computation.

    Attributes:
        leaves: ``(qualified name, module)`` of every module without children, which the
            engine hooks for the duration of a call.
        already_extended: Names of modules the user had extended with BackPACK before the
            call; their own hooks are used and left in place.
    """

    leaves: list[tuple[str, nn.Module]]
    already_extended: list[str]


def _display(name: str) -> str:
    return f"model.{name}" if name else "model"


def check_model(model: nn.Module) -> HookedModules:
    """Check every module of ``model`` before any work is done.

    Args:
        model: The user's model.

    Returns:
        The modules to hook.

    Raises:
        TypeError: If ``model`` is not an ``nn.Module``.
        ValueError: If a module cannot be handled; the message names the module, its class
            and what to do.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module, got {type(model).__name__}. Wrap a function "
            "in an nn.Module whose forward calls registered layers."
        )
    leaves: list[tuple[str, nn.Module]] = []
    extended: list[str] = []
    owners: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            if param.requires_grad and id(param) in owners and owners[id(param)] != name:
                raise ValueError(
                    f"parameter {_display(name)}.{pname} is shared with "
                    f"{_display(owners[id(param)])}; the GGN diagonal of a tied parameter "
                    "is not the sum of per-layer diagonals. Untie the parameters or set "
                    "requires_grad=False on the shared one."
                )
            owners[id(param)] = name
    seen: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        has_children = next(module.children(), None) is not None
        if has_children:
            own = [p for _, p in module.named_parameters(recurse=False) if p.requires_grad]
            if own:
                raise ValueError(
                    f"{_display(name)} ({type(module).__name__}) has child modules and "
                    "trainable parameters of its own used in its forward; ggnchunk needs "
                    "every trainable parameter to belong to a layer without children. Move "
                    "the parameter into a layer of its own (e.g. nn.Linear)."
                )
            continue
        cls = type(module)
        if cls in _PASS_THROUGH:
            continue
        if cls not in SUPPORTED:
            raise ValueError(
                f"{_display(name)} is a {cls.__module__}.{cls.__qualname__}, which "
                "ggnchunk cannot backpropagate the GGN through. Supported layers: "
                f"{', '.join(sorted(c.__name__ for c in SUPPORTED))}. Replace it with a "
                "supported layer (freezing parameters does not help: the GGN is "
                "backpropagated through every layer of the model)."
            )
        if isinstance(module, _SAMPLE_COUPLING) and module.training:
            raise ValueError(
                f"{_display(name)} ({cls.__name__}) is in training mode, where it couples "
                "the samples of a batch and the GGN is not a sum over samples. Call "
                "model.eval() (or this module's .eval()) before computing the diagonal."
            )
        if getattr(module, "_is_full_backward_hook", None) is False:
            raise ValueError(
                f"{_display(name)} has a hook registered with the deprecated "
                "register_backward_hook, which cannot coexist with the full backward hooks "
                "ggnchunk uses. Use register_full_backward_hook instead."
            )
        if getattr(module, "_backpack_extend", False):
            extended.append(name)
        leaves.append((name, module))
    return HookedModules(leaves=leaves, already_extended=extended)


_NOTES: dict[type[nn.Module], str] = {
    nn.BatchNorm1d: "eval mode only (training mode couples samples)",
    nn.BatchNorm2d: "eval mode only (training mode couples samples)",
    nn.BatchNorm3d: "eval mode only (training mode couples samples)",
    nn.Dropout: "train mode uses the forward pass's mask",
    nn.RNN: "batch_first=True, then ReduceTuple(index=0)",
    nn.LSTM: "batch_first=True, then ReduceTuple(index=0)",
    nn.Embedding: "BackPACK's fails in float64; padding_idx row is 0",
}


def supported_layers_table() -> str:
    """A markdown table of the supported layers, generated from :data:`SUPPORTED`.

    Returns:
        Markdown text with one row per layer class: its import path, what computes its
        backpropagation (BackPACK, a ggnchunk extension, or the ``torch.func`` fallback)
        and notes.
    """
    rows = ["| layer | handled by | notes |", "|---|---|---|"]
    for cls, ext in sorted(SUPPORTED.items(), key=lambda item: item[0].__name__.lower()):
        path = (
            f"nn.{cls.__name__}"
            if cls.__module__.startswith("torch.nn")
            else f"{cls.__module__}.{cls.__name__}"
        )
        if ext is None:
            owner = "BackPACK"
        elif isinstance(ext, AutogradJacobian):
            owner = "ggnchunk: torch.func fallback"
        else:
            owner = f"ggnchunk: {type(ext).__name__}"
        rows.append(f"| `{path}` | {owner} | {_NOTES.get(cls, '')} |")
    for cls in _PASS_THROUGH:
        rows.append(f"| `{cls.__module__}.{cls.__name__}` | pass-through | |")
    rows.append(
        "| `nn.Sequential` and containers whose forward only chains layers | not hooked | |"
    )
    return "\n".join(rows)
