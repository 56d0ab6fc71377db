r"""Per-layer rules: a layer's parameter diagonals from its input and a batch of vectors.

For a layer ``y_n = f(theta, x_n)`` that treats samples independently, the engine hands
its rule the layer's recorded input ``x`` (``[N, ...]``) and the vectors ``G`` that the
chunk's square-root columns became at the layer's output (``[V, N, *y.shape[1:]]``). The
rule returns ``sum_{v, n} (J_theta(x_n)^T G[v, n])**2`` per parameter, or the
per-(column, sample) products when a parameter is shared, and maps ``G`` back to the
layer's input. Rules never run the user's code: they use the recorded input and torch's
own functions.

The package, one family a file:

- :mod:`.base`: :class:`RuleContext` (one call of a layer), :class:`Caches` (what a rule
  keeps between chunks, typed, with what lean passes drop and what bounds count),
  :class:`LayerRule` (the interface, byte bounds included);
- :mod:`.kernels`: the shared contraction :func:`square_sum` beside its byte count;
- :mod:`.geometry`: convolution geometry (padding, unfolded patches);
- :mod:`.linear`, :mod:`.conv`, :mod:`.norm`, :mod:`.embedding`: layers with parameters;
- :mod:`.activation` (a table of derivatives), :mod:`.folded` (pooling, upsampling):
  layers without parameters, ruled to map the columns back faster than autograd;
- :mod:`.tied`: a table tied between an embedding and an output head (the cross term
  of the two rules' products);
- here: the registry (:func:`register_rule`, :func:`rule_for`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn.utils import parametrize

from ggnchunk._rules.activation import ActivationRule
from ggnchunk._rules.base import Caches, LayerRule, RuleContext
from ggnchunk._rules.conv import ConvRule, ConvTransposeRule
from ggnchunk._rules.embedding import EmbeddingRule
from ggnchunk._rules.folded import FoldedRule
from ggnchunk._rules.kernels import square_sum
from ggnchunk._rules.linear import Conv1DRule, LinearRule
from ggnchunk._rules.norm import (
    BatchNormRule,
    GroupNormRule,
    InstanceNormRule,
    LayerNormRule,
)

__all__ = [
    "RULES",
    "Caches",
    "InstanceNormRule",
    "LayerRule",
    "RuleContext",
    "RuleHandle",
    "register_rule",
    "rules",
    "rule_for",
    "square_sum",
    "supported_layers_table",
]

RULES: list[LayerRule] = [
    LinearRule(),
    Conv1DRule(),
    ConvRule(),
    ConvTransposeRule(),
    BatchNormRule(),
    LayerNormRule(),
    GroupNormRule(),
    InstanceNormRule(),
    EmbeddingRule(),
    ActivationRule(),
    FoldedRule(),
]
"""Registry: one rule per kind of layer, searched in order (registered rules first)."""


def rules() -> tuple[LayerRule, ...]:
    """The registered rules, in the order :func:`rule_for` searches them.

    Returns:
        A snapshot of the registry.
    """
    return tuple(RULES)


class RuleHandle:
    """Returned by :func:`register_rule`; ``remove()`` unregisters the rule."""

    def __init__(self, rule: LayerRule):
        self.rule = rule

    def remove(self) -> None:
        """Unregister the rule (safe to call more than once)."""
        if self.rule in RULES:
            RULES.remove(self.rule)


def register_rule(rule: LayerRule, *, overwrite: bool = False) -> RuleHandle:
    """Add a rule for layers ggnchunk does not know, without editing ggnchunk.

    The rule is searched before the built-in ones. A rule implements
    :meth:`LayerRule.per_sample` (``{param: [V, N, *param.shape]}``) and, to keep the
    columns on the fast path, :meth:`LayerRule.backprop`; its byte methods bound its
    memory for budgets. Its results are checked by nobody but you: compare them with a
    brute force (``tests/reference.py`` shows one) before you rely on them.

    Args:
        rule: An instance of a :class:`LayerRule` subclass whose ``classes`` names the
            layer classes it handles (their ``forward`` must be the one it knows).
        overwrite: Take over classes another rule handles already.

    Returns:
        A handle whose ``remove()`` unregisters the rule.

    Raises:
        TypeError: If ``rule`` is a class or not a :class:`LayerRule`, or its
            ``classes`` are not module classes.
        ValueError: If a class is handled already and ``overwrite`` is false.
    """
    if isinstance(rule, type):
        raise TypeError(
            f"register_rule takes a rule instance, got the class {rule.__name__}; "
            f"instantiate it: register_rule({rule.__name__}())."
        )
    if not isinstance(rule, LayerRule):
        raise TypeError(
            f"rule must be a ggnchunk LayerRule, got {type(rule).__name__}; subclass "
            "ggnchunk.LayerRule and implement per_sample (and backprop)."
        )
    classes = rule.classes
    if not classes or not all(
        isinstance(c, type) and issubclass(c, nn.Module) for c in classes
    ):
        raise TypeError(
            f"{type(rule).__name__}.classes must be a non-empty tuple of nn.Module "
            f"subclasses, got {classes!r}."
        )
    if not overwrite:
        for other in RULES:
            taken = set(classes) & set(other.classes)
            if taken:
                names = ", ".join(sorted(c.__name__ for c in taken))
                raise ValueError(
                    f"{names} already has the rule {type(other).__name__}; pass "
                    "overwrite=True to replace it."
                )
    RULES.insert(0, rule)
    return RuleHandle(rule)


def rule_for(module: nn.Module) -> LayerRule | None:
    """The rule for ``module`` if its computation is exactly the one the rule knows.

    A module qualifies when its class (or a subclass that does not override ``forward``,
    such as ``nn.MultiheadAttention``'s output projection) runs the known layer's
    ``forward`` with the known layer's own helpers (a subclass or an instance that
    replaces ``nn.Conv2d._conv_forward``, as circular padding along one axis does,
    computes something else), it is not parametrized
    (``torch.nn.utils.parametrize``), and its own trainable parameters are among the
    rule's (``weight``, ``bias``; none for a frozen layer, whose rule then only maps the
    vectors back). Anything else is handled from
    the recorded graph.

    Args:
        module: A module.

    Returns:
        The rule, or ``None``.
    """
    if "forward" in vars(module) or parametrize.is_parametrized(module):
        return None
    if isinstance(module, torch.jit.ScriptModule):  # traced or scripted: TorchScript
        return None  # runs its graph without Python hooks; autograd's graph is exact
    forward = type(module).forward
    own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
    for rule in RULES:
        for cls in rule.classes:
            if (
                isinstance(module, cls) and forward is cls.forward
                and _same_helpers(module, cls) and rule.accepts(module)
            ):  # fmt: skip
                # a frozen layer keeps its rule's backprop (no parameter products)
                if set(own) <= set(rule.param_names):
                    return rule
                return None
    return None


@functools.cache
def _helpers(cls: type) -> tuple[str, ...]:
    """The private methods ``cls`` and its bases below ``nn.Module`` define.

    Its ``forward`` may call them (``nn.Conv2d._conv_forward``,
    ``nn.ConvTranspose2d._output_padding``); the state-dict hooks compute nothing.
    """
    names: set[str] = set()
    for base in cls.__mro__:
        if base is nn.Module or base is object:
            break
        names.update(
            name for name, value in vars(base).items()
            if name.startswith("_") and not name.startswith("__") and callable(value)
            and "state_dict" not in name
        )  # fmt: skip
    return tuple(sorted(names))


def _same_helpers(module: nn.Module, cls: type) -> bool:
    """Whether ``module`` runs ``cls``'s own helpers (none replaced on it or its class)."""
    own = vars(module)
    kind = type(module)
    return all(
        name not in own and getattr(kind, name, None) is getattr(cls, name, None)
        for name in _helpers(cls)
    )


def supported_layers_table() -> str:
    """A markdown table of the layers with a dedicated rule, generated from :data:`RULES`.

    Returns:
        Markdown text: one row per layer class, then how everything else is handled.
    """
    rows = ["| layer | how | notes |", "|---|---|---|"]
    for rule in RULES:
        names = getattr(rule, "listed", None) or [
            f"nn.{cls.__name__}" if cls.__module__.startswith("torch.nn")
            else f"{cls.__module__}.{cls.__qualname__}"
            for cls in rule.classes
        ]  # fmt: skip
        for name in names:
            rows.append(f"| `{name}` | rule `{type(rule).__name__}` | "
                        f"{rule.description} |")  # fmt: skip
    rows.append(
        "| any other layer without parameters (dropout, max pooling, reshapes, `cat`,"
        " additions, attention maths, functional calls such as `F.silu`) | autograd on "
        "the recorded graph, batched over columns | no rule needed; in-place operations "
        "are fine |"
    )
    rows.append(
        "| any other parameter (RNN/LSTM/GRU, `nn.MultiheadAttention` projections, "
        "parameters used functionally, custom layers) | per-sample products from the "
        "recorded graph | exact; one batched backward per sample through the part of "
        "the graph that uses the parameter |"
    )
    return "\n".join(rows)
