"""Nothing the user owns is changed by a call, and repeated calls do not leak."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from backpack import backpack, extend
from backpack.context import CTX
from backpack.extensions import DiagGGNExact
from torch import nn

import ggnchunk
from tests.reference import assert_diag_close, reference_diag_ggn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3),
        nn.ReLU(inplace=True),
        nn.Dropout(0.2),
        nn.Flatten(),
        nn.Linear(12, 5),
    )


X = torch.randn(4, 2, 4, 4)
Y = torch.randn(4, 5)


def _snapshot(model: nn.Module) -> list:
    state = []
    for module in model.modules():
        state.append(
            (
                type(module).__name__,
                module.training,
                sorted(module.__dict__),
                list(module._forward_hooks),
                list(module._forward_pre_hooks),
                list(module._backward_hooks),
                list(module._backward_pre_hooks),
                module._is_full_backward_hook,
                getattr(module, "inplace", None),
            )
        )
    for param in model.parameters():
        state.append((sorted(param.__dict__), param.requires_grad))
    return state


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("kwargs", [{}, {"num_chunks": 3}])
def test_model_is_left_as_it_was(mode, kwargs):
    model = _model().train(mode == "train")
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)
    grad = model[0].weight.grad
    model[4].bias.diag_ggn_exact = "the user's own value"
    before = _snapshot(model)
    handles = len(CTX.hook_handles)
    ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y, **kwargs)
    assert _snapshot(model) == before
    assert model[0].weight.grad is grad and bool((grad == 7.0).all())
    assert model[0].bias.grad is None and model[4].weight.grad is None
    assert model[4].bias.diag_ggn_exact == "the user's own value"
    assert len(CTX.hook_handles) == handles


def test_torch_func_and_legacy_hooks_work_afterwards():
    model = _model().eval()
    ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y, num_chunks=2)
    params = {n: p.detach() for n, p in model.named_parameters()}
    jac = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (X,)))(params)
    assert jac["4.weight"].shape == (4, 5, 5, 12)
    model[4].register_backward_hook(lambda *args: None)  # fails if the flag was left on


def test_error_inside_backward_leaves_nothing_behind(monkeypatch):
    model = _model().eval()
    before = _snapshot(model)

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure inside a backward pass")

    monkeypatch.setattr(torch.autograd, "grad", broken)
    with pytest.raises(RuntimeError, match="simulated failure"):
        ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y, num_chunks=2)
    assert _snapshot(model) == before


def _live_tensors() -> int:
    gc.collect()
    with (
        warnings.catch_warnings()
    ):  # inspecting torch.distributed's deprecated objects warns
        warnings.simplefilter("ignore")
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


def test_hundred_calls_do_not_grow_memory():
    model = _model().eval()
    for _ in range(3):
        ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y, num_chunks=3)
    tensors_before = _live_tensors()
    for _ in range(100):
        ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y, num_chunks=3)
    tensors_after = _live_tensors()
    assert tensors_after <= tensors_before


def test_call_inside_no_grad():
    model = _model().eval()
    expected = ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y, num_chunks=2)
    with torch.no_grad():
        actual = ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y, num_chunks=2)
    assert_diag_close(actual, expected, rtol=0.0)


def test_dropout_in_training_mode_chunked_equals_one_pass():
    model = _model().train()
    torch.manual_seed(3)
    one = ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y)
    torch.manual_seed(3)
    chunked = ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y, num_chunks=4)
    assert_diag_close(chunked, one, rtol=1e-5)
    assert model.training


def test_model_already_extended_by_the_user_keeps_its_extension():
    model, loss_func = _model().eval(), nn.MSELoss()
    model[1].inplace = False  # BackPACK's own hooks cannot handle in-place layers
    expected = reference_diag_ggn(model, loss_func, X, Y)  # torch.func needs no hooks
    model, loss_func = extend(model), extend(loss_func)
    handles = len(CTX.hook_handles)
    hooks = [list(m._forward_hooks) for m in model.modules()]
    actual = ggnchunk.diag_ggn(model, loss_func, X, Y, num_chunks=3)
    assert_diag_close(actual, expected, rtol=1e-5)
    assert [list(m._forward_hooks) for m in model.modules()] == hooks
    assert len(CTX.hook_handles) == handles
    # the user's own BackPACK code still works on the model
    with backpack(DiagGGNExact()), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        loss_func(model(X), Y).backward()
    assert_diag_close(
        {n: p.diag_ggn_exact for n, p in model.named_parameters()}, expected, rtol=1e-5
    )


def test_results_have_parameter_names_shapes_dtypes_in_order():
    model = _model().eval()
    model[4].bias.requires_grad_(False)
    diag = ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y)
    expected = [
        (n, p.shape, p.dtype) for n, p in model.named_parameters() if p.requires_grad
    ]
    assert [(n, v.shape, v.dtype) for n, v in diag.items()] == expected


def test_user_warnings_are_not_silenced():
    class Warns(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x):
            warnings.warn("a warning of the user's own", UserWarning, stacklevel=1)
            return self.linear(x)

    with pytest.warns(UserWarning, match="a warning of the user's own"):
        ggnchunk.diag_ggn(Warns(), nn.MSELoss(), torch.randn(2, 4), torch.randn(2, 3))


def test_training_step_after_a_call_has_no_hooks_to_run():
    model = _model().eval()
    ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y, num_chunks=2)
    called = []
    # no hooks left: a plain backward runs no BackPACK code
    import backpack as bp

    original = bp.hook_run_extensions
    try:
        bp.hook_run_extensions = lambda *a: called.append(a)
        nn.MSELoss()(model(X), Y).backward()
    finally:
        bp.hook_run_extensions = original
    assert not called
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())


def _interrupt_the_sweeps(monkeypatch) -> None:
    """Ctrl-C at the first batched backward (a sweep), as a user's would come."""
    real = torch.autograd.grad

    def interrupted(*args, **kwargs):
        if kwargs.get("is_grads_batched"):
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", interrupted)


@pytest.mark.parametrize("where", ["forward", "sweep"])
def test_keyboard_interrupt_leaves_nothing_behind(monkeypatch, where):
    """Ctrl-C inside the user's forward or inside a backward sweep: all restored."""
    model = _model().eval()
    before = _snapshot(model)
    if where == "forward":
        handle = model[3].register_forward_hook(
            lambda *args: (_ for _ in ()).throw(KeyboardInterrupt)
        )
        before = _snapshot(model)
    else:
        _interrupt_the_sweeps(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y, num_chunks=2)
    assert _snapshot(model) == before
    assert model[1].inplace is True
    if where == "forward":
        handle.remove()
    monkeypatch.undo()
    expected = reference_diag_ggn(model, nn.MSELoss(), X, Y)
    assert_diag_close(ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y), expected, rtol=1e-5)


def test_two_threads_on_one_model_get_exact_results():
    import threading

    model = _model().eval()
    expected = reference_diag_ggn(model, nn.MSELoss(), X, Y)
    results, errors = [], []

    def work() -> None:
        try:
            for _ in range(3):
                results.append(ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y, num_chunks=2))
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(results) == 6
    for result in results:
        assert_diag_close(result, expected, rtol=1e-5)


class _Noisy(nn.Module):
    """Dropout in forward; ``couple``: each sample's output also reads the batch's mean."""

    def __init__(self, couple: bool = False):
        super().__init__()
        self.lin, self.out, self.couple = nn.Linear(6, 8), nn.Linear(8, 6), couple

    def forward(self, x):
        h = torch.nn.functional.dropout(torch.tanh(self.lin(x)), 0.5, training=True)
        return self.out(h - h.mean(0) if self.couple else h)


@pytest.mark.parametrize("failure", ["budget", "coupled", "interrupt"])
def test_a_call_that_raises_leaves_the_random_state_as_it_was(failure, monkeypatch):
    """A call refused after its forward pass had drawn its dropout masks for nothing.

    A call that returns advances the random state as its forward pass did (the README's
    promise); one that raises (a budget too small, samples that influence each other,
    Ctrl-C in a sweep) leaves it as before the call.
    """
    torch.manual_seed(0)
    model = _Noisy(couple=failure == "coupled")
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    kwargs = {"max_memory": 1024} if failure == "budget" else {}
    if failure == "interrupt":
        _interrupt_the_sweeps(monkeypatch)
    state = torch.get_rng_state()
    expected = {"budget": ggnchunk.MemoryBudgetError, "coupled": ValueError,
                "interrupt": KeyboardInterrupt}[failure]  # fmt: skip
    with pytest.raises(expected):
        ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **kwargs)
    assert torch.equal(torch.get_rng_state(), state)
    monkeypatch.undo()
    if failure != "coupled":  # and a call that returns draws as one forward pass
        ggnchunk.diag_ggn(model, nn.MSELoss(), x, y)
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        model(x)
        assert torch.equal(torch.get_rng_state(), after)
