"""DiagGGNOptimizer follows torch.optim's conventions and trains."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ggnchunk
from ggnchunk.optim import DiagGGNOptimizer


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
    x = torch.randn(32, 6)
    return model, nn.MSELoss(), x, torch.sin(x)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"lr": 0}, "lr"), ({"lr": -1.0}, "lr"), ({"damping": 0}, "damping"),
     ({"beta": 1.0}, "beta"), ({"beta": -0.1}, "beta"),
     ({"weight_decay": -1}, "weight_decay"),
     ({"update_every": 0}, "update_every"), ({"update_every": 1.5}, "update_every")],
)  # fmt: skip
def test_hyperparameters_are_validated(kwargs, name):
    model = _problem()[0]
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        DiagGGNOptimizer(model.parameters(), **kwargs)
    opt = DiagGGNOptimizer(model[0].parameters())
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        opt.add_param_group({"params": model[2].parameters(), **kwargs})


def test_step_before_curvature_is_a_clear_error():
    model, loss_func, x, y = _problem()
    opt = DiagGGNOptimizer(model.parameters())
    loss_func(model(x), y).backward()
    with pytest.raises(RuntimeError, match="before any curvature"):
        opt.step()


def test_loss_decreases_and_beats_sgd_at_equal_steps():
    model, loss_func, x, y = _problem()
    sgd_model = copy.deepcopy(model)
    opt = DiagGGNOptimizer(model.named_parameters(), lr=0.5, damping=1e-3, beta=0.9)
    closure = opt.closure(model, loss_func, x, y, num_chunks=2)
    losses = [opt.step(closure).item() for _ in range(30)]
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.5)
    for _ in range(30):
        sgd.zero_grad()
        sgd_loss = loss_func(sgd_model(x), y)
        sgd_loss.backward()
        sgd.step()
    assert losses[-1] < 0.5 * losses[0]
    assert losses[-1] < sgd_loss.item()


def test_curvature_refreshed_every_k_steps(monkeypatch):
    model, loss_func, x, y = _problem()
    opt = DiagGGNOptimizer(model.named_parameters(), update_every=3)
    calls = []
    original = opt.update_curvature
    monkeypatch.setattr(opt, "update_curvature", lambda d: (calls.append(1), original(d)))
    closure = opt.closure(model, loss_func, x, y)
    for _ in range(7):
        opt.step(closure)
    assert len(calls) == 3  # steps 1, 4, 7


def test_state_dict_round_trip_resumes_bit_identically():
    model, loss_func, x, y = _problem()
    opt = DiagGGNOptimizer(model.named_parameters(), lr=0.1, update_every=2)
    closure = opt.closure(model, loss_func, x, y)
    for _ in range(3):
        opt.step(closure)
    model2 = copy.deepcopy(model)
    opt2 = DiagGGNOptimizer(model2.named_parameters(), lr=0.1, update_every=2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(isinstance(v, torch.Tensor) for s in opt.state.values() for v in s.values())
    closure2 = opt2.closure(model2, loss_func, x, y)
    for _ in range(4):
        opt.step(closure)
        opt2.step(closure2)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_curvature_by_order_and_shape_checks():
    model, loss_func, x, y = _problem()
    diag = ggnchunk.diag_ggn(model, loss_func, x, y)
    by_order = DiagGGNOptimizer(model.parameters())
    by_order.update_curvature(diag)  # matched by order
    by_name = DiagGGNOptimizer(model.named_parameters())
    with pytest.raises(KeyError, match="no entry"):
        by_name.update_curvature({"0.weight": diag["0.weight"]})
    with pytest.raises(ValueError, match="entries but the optimizer has"):
        by_order.update_curvature({"a": diag["0.weight"]})
    bad = dict(diag)
    bad["0.bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        by_name.update_curvature(bad)


def test_the_closure_runs_the_parameters_gradient_hooks_on_every_step():
    """A clipping hook acts on the steps that compute curvature as on the others.

    The closure sets ``.grad`` from ``loss_grad_and_diag_ggn`` (whose gradient is the
    loss's, hooks muted) where a plain step runs ``loss.backward()`` (hooks run).
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)).double()
    x = torch.randn(32, 6, dtype=torch.float64)
    y, loss_func = torch.sin(x), nn.MSELoss()
    handles = [p.register_hook(lambda g: g.clamp(-1e-3, 1e-3)) for p in model.parameters()]
    handles.append(model[0].weight.register_hook(lambda g: g * 2))  # after the clip
    try:
        expected = torch.autograd.grad(loss_func(model(x), y), list(model.parameters()))
        opt = DiagGGNOptimizer(model.parameters(), update_every=2)
        closure = opt.closure(model, loss_func, x, y)
        assert opt.curvature_due
        closure()  # curvature due: loss_grad_and_diag_ggn
        for param, grad in zip(model.parameters(), expected, strict=True):
            assert torch.allclose(param.grad, grad, rtol=1e-12, atol=0)
        assert opt.curvature_due  # (a closure run outside step() counts no step)
    finally:
        for handle in handles:
            handle.remove()
    assert float(expected[0].abs().max()) == 2e-3  # the hooks did act
