"""Extending ggnchunk: registered layer rules and losses, the activation table, caches.

A registered rule and a registered loss are compared with the float64 brute force in
every chunking mode, and shown to be used (a spy); bad registrations are refused with
the fix. The activation table's derivatives are compared with autograd's; the typed
caches keep one copy of what the bounds count.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ggnchunk
from ggnchunk._rules import rule_for
from ggnchunk._rules.activation import DERIVATIVES, derivative
from ggnchunk._rules.base import RuleContext
from ggnchunk._rules.norm import GroupNormRule, LayerNormRule
from ggnchunk._sqrt_hessians import LOSSES, MSELossSqrtHessian
from ggnchunk.extend import LayerRule, LossSqrtHessian
from tests.reference import assert_diag_close, reference_diag_ggn

CHUNKINGS = [{}, {"num_chunks": 3}, {"chunk_size": 1}, {"max_memory": "64MiB"}]


class Scale(nn.Module):
    """``y = x * weight + bias`` per feature: a layer ggnchunk has no rule for."""

    def __init__(self, features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features))
        self.bias = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return x * self.weight + self.bias


class ScaleRule(LayerRule):
    classes = (Scale,)
    description = "test rule"
    calls = 0

    def per_sample(self, ctx, grads):
        type(self).calls += 1
        out = {}
        if ctx.module.weight.requires_grad:
            out["weight"] = (grads * ctx.x).reshape(*grads.shape[:2], -1, grads.shape[-1])
            out["weight"] = out["weight"].sum(2)
        if ctx.module.bias.requires_grad:
            out["bias"] = grads.reshape(*grads.shape[:2], -1, grads.shape[-1]).sum(2)
        return out

    sample_free_backprop = True

    def backprop(self, ctx, grads):
        return grads * ctx.module.weight.detach()


def _scale_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), Scale(6), nn.Linear(6, 3)).double()


@pytest.mark.parametrize("kwargs", CHUNKINGS, ids=str)
def test_registered_rule_is_used_and_exact(kwargs):
    model = _scale_model()
    x, y = torch.randn(7, 5).double(), torch.randn(7, 3).double()
    expected = reference_diag_ggn(model, nn.MSELoss(), x, y)
    handle = ggnchunk.register_rule(ScaleRule())
    try:
        assert isinstance(rule_for(model[2]), ScaleRule)
        ScaleRule.calls = 0
        actual = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **kwargs)
        assert ScaleRule.calls > 0, "the registered rule was not used"
    finally:
        handle.remove()
    assert rule_for(model[2]) is None
    assert_diag_close(actual, expected, rtol=1e-10, label=f"registered rule {kwargs}")
    # unregistered: the recorded graph handles the layer, with the same result
    again = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **kwargs)
    assert_diag_close(again, expected, rtol=1e-10, label=f"no rule {kwargs}")


def test_register_rule_refuses_with_the_fix():
    with pytest.raises(TypeError, match=r"instantiate it: register_rule\(ScaleRule\(\)\)"):
        ggnchunk.register_rule(ScaleRule)
    with pytest.raises(TypeError, match="LayerRule"):
        ggnchunk.register_rule(object())

    class Empty(ScaleRule):
        classes = ()

    with pytest.raises(TypeError, match="classes"):
        ggnchunk.register_rule(Empty())

    class Linear2(ScaleRule):
        classes = (nn.Linear,)

    with pytest.raises(ValueError, match="overwrite=True"):
        ggnchunk.register_rule(Linear2())
    handle = ggnchunk.register_rule(Linear2(), overwrite=True)
    try:
        assert isinstance(rule_for(nn.Linear(2, 2)), Linear2)
    finally:
        handle.remove()
        handle.remove()  # twice is fine
    assert type(rule_for(nn.Linear(2, 2))).__name__ == "LinearRule"


class MyMSE(nn.MSELoss):
    """A loss class of the user's: found by exact type, so it needs registering."""


class MyMSEHandler(MSELossSqrtHessian):
    loss_class = MyMSE
    calls = 0

    def factorize(self, loss_func, output, target, scale):
        type(self).calls += 1
        return super().factorize(loss_func, output, target, scale)


@pytest.mark.parametrize("kwargs", CHUNKINGS[:3], ids=str)
def test_registered_loss_is_used_and_exact(kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4).double(), torch.randn(6, 3).double()
    expected = reference_diag_ggn(model, MyMSE(), x, y)
    ggnchunk.register_loss(MyMSEHandler())
    try:
        MyMSEHandler.calls = 0
        actual = ggnchunk.diag_ggn(model, MyMSE(), x, y, **kwargs)
        assert MyMSEHandler.calls > 0, "the registered handler was not used"
    finally:
        LOSSES.pop(MyMSE)
    assert_diag_close(actual, expected, rtol=1e-10, label=f"registered loss {kwargs}")


def test_register_loss_refuses_with_the_fix():
    with pytest.raises(TypeError, match="instantiate it"):
        ggnchunk.register_loss(MyMSEHandler)
    with pytest.raises(TypeError, match="LossSqrtHessian"):
        ggnchunk.register_loss(object())
    with pytest.raises(ValueError, match="overwrite=True"):
        ggnchunk.register_loss(MSELossSqrtHessian())
    assert issubclass(MyMSEHandler, LossSqrtHessian)


ACTIVATIONS = [
    nn.ReLU(), nn.SiLU(), nn.GELU(), nn.GELU(approximate="tanh"), nn.Tanh(),
    nn.Sigmoid(), nn.Hardswish(), nn.LeakyReLU(0.3), nn.ELU(0.7),
    nn.Softplus(beta=2.0, threshold=1.5), nn.Hardsigmoid(), nn.Hardtanh(-0.5, 2.0),
    nn.ReLU6(), nn.Mish(),
]  # fmt: skip


@pytest.mark.parametrize("module", ACTIVATIONS, ids=repr)
def test_activation_table_matches_autograd(module):
    assert any(cls in DERIVATIVES for cls in type(module).__mro__)
    x = torch.linspace(-3, 3, 97, dtype=torch.float64).reshape(1, -1)
    x = x[:, (x.abs() > 1e-3)[0]]  # away from kinks
    leaf = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(module(leaf).sum(), leaf)
    torch.testing.assert_close(derivative(module, x), expected, rtol=1e-12, atol=1e-12)


def test_activation_without_a_derivative_is_refused_not_guessed():
    class Mish(nn.Module):
        def forward(self, x):
            return x * torch.tanh(nn.functional.softplus(x))

    with pytest.raises(TypeError, match="DERIVATIVES"):
        derivative(Mish(), torch.randn(2, 3))
    assert rule_for(Mish()) is None

    class MyTanh(nn.Tanh):  # the same forward: Tanh's derivative
        pass

    x = torch.randn(2, 3, dtype=torch.float64)
    torch.testing.assert_close(derivative(MyTanh(), x), 1 - torch.tanh(x) ** 2)

    class Shifted(nn.Tanh):  # another forward: no rule
        def forward(self, x):
            return torch.tanh(x - 1)

    assert rule_for(Shifted()) is None


@pytest.mark.parametrize(
    ("module", "shape"),
    [(nn.LayerNorm(6), (4, 3, 6)), (nn.GroupNorm(2, 4), (4, 4, 3, 3))],
    ids=["layernorm", "groupnorm"],
)
def test_norms_keep_one_counted_copy(module, shape):
    module = module.double()
    x = torch.randn(*shape, dtype=torch.float64)
    rule = LayerNormRule() if isinstance(module, nn.LayerNorm) else GroupNormRule()
    ctx = RuleContext(module, (x,), (x._version,), tuple(module(x).shape))
    grads = torch.randn(2, *ctx.out_shape, dtype=torch.float64)
    products = rule.per_sample(ctx, grads)
    back = rule.backprop(ctx, grads)
    assert ctx.caches.names() == ["normalized"], ctx.caches.names()
    assert ctx.caches.held_bytes(ctx.inputs) <= rule.fixed_bytes(ctx, x.element_size())
    # and the values: autograd on the layer itself
    leaf = x.clone().requires_grad_()
    out = module(leaf)
    for v in range(2):
        got = torch.autograd.grad(out, [leaf, module.weight], grads[v], retain_graph=True)
        torch.testing.assert_close(back[v], got[0])
        torch.testing.assert_close(products["weight"][v].sum(0), got[1])


def test_lean_drops_what_it_recomputes():
    from ggnchunk._rules.base import Caches

    caches = Caches(patches=torch.ones(3), squares=torch.ones(3), gram=torch.ones(3))
    caches.drop_for_lean()
    assert caches.names() == ["gram"]
