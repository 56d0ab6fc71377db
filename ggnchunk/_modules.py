"""Which model layers the engine can backpropagate through, and how.

``SUPPORTED`` maps a layer class (exact type, as BackPACK dispatches) to ``None`` when
BackPACK's own ``DiagGGNExact`` extension handles it, or to a BackPACK ``ModuleExtension``
that ggnchunk supplies. :func:`check_model` inspects a model before any work and names the
first module that cannot be handled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backpack.custom_module.branching import Parallel, SumModule
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
    # Layers BackPACK 1.7.1 lacks (its issues #254, #263, #328): torch.func fallback.
    **{
        cls: AutogradJacobian()
        for cls in (
            nn.LayerNorm,
            nn.GroupNorm,
            nn.Upsample,
            nn.UpsamplingNearest2d,
            nn.UpsamplingBilinear2d,
            nn.Unflatten,
            nn.SiLU,
            nn.GELU,
            nn.Softplus,
            nn.Softmax,
            nn.LogSoftmax,
            nn.Mish,
            nn.Hardtanh,
        )
    },
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
        leaves: ``(qualified name, module)`` of every module the engine hooks for the
            duration of a call: supported layers, and blocks handled by the
            ``torch.func`` fallback as one unit.
        already_extended: Names of modules the user had extended with BackPACK before the
            call; their own hooks are used and left in place.
        fallback: Names of the blocks handled by the fallback.
        fallback_classes: Their classes (BackPACK dispatches by class).
    """

    leaves: list[tuple[str, nn.Module]]
    already_extended: list[str]
    fallback: set[str] = field(default_factory=set)
    fallback_classes: set[type[nn.Module]] = field(default_factory=set)


def _display(name: str) -> str:
    return f"model.{name}" if name else "model"


CONTAINERS: tuple[type[nn.Module], ...] = (nn.Sequential, Parallel)
"""Containers whose forward only chains (or sums) their children: always descended."""


def _check_mode(name: str, module: nn.Module) -> None:
    for sub_name, sub in module.named_modules(prefix=name):
        if isinstance(sub, _SAMPLE_COUPLING) and sub.training:
            raise ValueError(
                f"{_display(sub_name)} ({type(sub).__name__}) is in training mode, where "
                "it couples the samples of a batch and the GGN is not a sum over samples. "
                "Call model.eval() (or this module's .eval()) before computing the "
                "diagonal."
            )


def check_model(model: nn.Module, atomic: frozenset[str] = frozenset()) -> HookedModules:
    """Check every module of ``model`` before any work is done, and decide how to hook it.

    Layers in :data:`SUPPORTED` are hooked one by one; ``nn.Sequential`` and other
    containers are descended into; a custom container is descended into too (its forward
    may only chain its children), unless it is named in ``atomic``, which the engine does
    when its forward turns out to do more (``torch.cat`` skips, functional calls): then it
    is handled as one unit by the ``torch.func`` fallback, as is any unsupported layer.

    Args:
        model: The user's model.
        atomic: Names of custom containers to handle as one fallback unit.

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
    result = HookedModules(leaves=[], already_extended=[])
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        cls = type(module)
        has_children = next(module.children(), None) is not None
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if cls in _PASS_THROUGH:
            return
        if cls in SUPPORTED:
            kind = "leaf"
        elif isinstance(module, CONTAINERS) or (
            has_children and not own and name not in atomic
        ):
            for child_name, child in module.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)
            return
        else:
            kind = "fallback"
        _check_mode(name, module)
        if getattr(module, "_is_full_backward_hook", None) is False:
            raise ValueError(
                f"{_display(name)} has a hook registered with the deprecated "
                "register_backward_hook, which cannot coexist with the full backward hooks "
                "ggnchunk uses. Use register_full_backward_hook instead."
            )
        if getattr(module, "_backpack_extend", False):
            result.already_extended.append(name)
        if kind == "fallback" or isinstance(SUPPORTED.get(cls), AutogradJacobian):
            result.fallback.add(name)
            if kind == "fallback":
                result.fallback_classes.add(cls)
        result.leaves.append((name, module))

    visit("", model)
    return result


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
    rows.append(
        "| any other per-sample module or block (e.g. a U-Net with `torch.cat` skips) | "
        "ggnchunk: torch.func fallback, as one unit | exact; slower than BackPACK |"
    )
    return "\n".join(rows)
