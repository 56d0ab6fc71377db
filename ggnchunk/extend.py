"""Adding layers and losses to ggnchunk without editing it.

A **layer rule** (:class:`LayerRule`) gives a layer's parameter products from its
recorded input and the backpropagated columns, and maps the columns back to its input;
register it with :func:`register_rule`. A **loss handler** (:class:`LossSqrtHessian`)
gives the columns of a loss's Hessian square root (:class:`SqrtHessianFactor`); register
it with :func:`register_loss`. Layers and losses without either are still handled
exactly, through autograd on the recorded graph (slower for large column counts).

The interfaces are documented on the classes; ``ggnchunk/_rules/linear.py`` and
``ggnchunk/_sqrt_hessians.py`` hold the built-in examples. Test a new rule or loss
against a float64 brute force before relying on it.
"""

from ggnchunk._rules import LayerRule, RuleContext, RuleHandle, register_rule, rules
from ggnchunk._rules.base import Caches
from ggnchunk._rules.kernels import square_sum
from ggnchunk._sqrt_hessians import LossSqrtHessian, SqrtHessianFactor, register_loss

__all__ = [
    "Caches",
    "LayerRule",
    "LossSqrtHessian",
    "RuleContext",
    "RuleHandle",
    "SqrtHessianFactor",
    "register_loss",
    "register_rule",
    "rules",
    "square_sum",
]
