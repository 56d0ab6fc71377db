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
     ({"update_every": 0}, "update_every"), ({"update_every": 1.5}, "update_every"),
     ({"lr": "0.1"}, "lr"), ({"lr": float("inf")}, "lr"), ({"lr": True}, "lr"),
     ({"damping": float("inf")}, "damping"), ({"beta": float("nan")}, "beta"),
     ({"weight_decay": float("inf")}, "weight_decay")],
)  # fmt: skip
def test_hyperparameters_are_validated(kwargs, name):
    model = _problem()[0]
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        DiagGGNOptimizer(model.parameters(), **kwargs)
    opt = DiagGGNOptimizer(model[0].parameters())
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        opt.add_param_group({"params": model[2].parameters(), **kwargs})
    assert len(opt.param_groups) == 1  # a refused group is not kept (it was, with lr -1)


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
    monkeypatch.setattr(
        opt, "update_curvature", lambda d, m=None: (calls.append(1), original(d, m))
    )
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


def _float64_problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5)).double()
    x = torch.randn(16, 5, dtype=torch.float64)
    return model, nn.MSELoss(), x, torch.sin(x)


def test_the_closure_matches_curvature_to_parameters_by_identity():
    """Each parameter gets its own diagonal, whatever order the optimizer holds.

    Built from parameters in another order than the model's (same shapes), a parameter
    got another's diagonal, matched by order.
    """
    model, loss_func, x, y = _float64_problem()
    diag = ggnchunk.diag_ggn(model, loss_func, x, y)
    names = {id(p): n for n, p in model.named_parameters()}
    params = list(model.parameters())[::-1]
    opt = DiagGGNOptimizer(params, beta=0.5)
    opt.step(opt.closure(model, loss_func, x, y))
    for param in params:
        expected = 0.5 * diag[names[id(param)]]
        assert torch.allclose(opt.state[param]["curvature"], expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("named", [True, False])
def test_frozen_parameters_are_skipped(named):
    model, loss_func, x, y = _float64_problem()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    diag = ggnchunk.diag_ggn(model, loss_func, x, y)
    opt = DiagGGNOptimizer(model.named_parameters() if named else model.parameters(),
                           beta=0.5)  # fmt: skip
    for _ in range(2):
        opt.step(opt.closure(model, loss_func, x, y))
    assert torch.equal(model[0].weight, frozen) and model[0].weight not in opt.state
    by_hand = DiagGGNOptimizer(model.named_parameters() if named else model.parameters())
    by_hand.update_curvature(diag)  # without the model: by name or order, frozen skipped
    for name, param in model.named_parameters():
        if param.requires_grad:
            curvature = by_hand.state[param]["curvature"]
            assert torch.allclose(curvature, 0.05 * diag[name], rtol=1e-12, atol=0)


def test_curvature_is_refreshed_on_schedule_when_a_parameter_gets_no_gradient():
    """The schedule counts the optimizer's steps, not the first parameter's.

    A parameter unused in forward gets no .grad from the plain steps: the schedule
    counted that parameter's steps and never refreshed the curvature again.
    """

    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.aux = nn.Linear(5, 5)  # first, never used
            self.body = nn.Linear(5, 5)

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(0)
    model = WithUnused().double()
    x = torch.randn(8, 5, dtype=torch.float64)
    opt = DiagGGNOptimizer(model.named_parameters(), update_every=3)
    closure = opt.closure(model, nn.MSELoss(), x, torch.sin(x))
    with pytest.warns(ggnchunk.UnusedParameterWarning):
        for _ in range(12):
            opt.step(closure)
    assert opt.state[model.body.weight]["curvature_updates"].item() == 4  # steps 1,4,7,10


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_the_closure_calls_the_model_as_ggnchunk_does_on_every_step(kind):
    """Tuple and dict inputs: the plain steps called model(inputs) (a raw TypeError)."""

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 5), nn.Linear(3, 5)

        def forward(self, u, v):
            return self.a(u) + self.b(v)

    torch.manual_seed(0)
    model = TwoInputs().double()
    u, v = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    inputs = (u, v) if kind == "tuple" else {"u": u, "v": v}
    y = torch.sin(u)
    opt = DiagGGNOptimizer(model.named_parameters(), update_every=2)
    closure = opt.closure(model, nn.MSELoss(), inputs, y)
    for _ in range(3):
        before = nn.MSELoss()(model(u, v), y)
        assert torch.allclose(opt.step(closure), before, rtol=1e-12, atol=0)
