"""Inputs that used to reach users as raw errors (issue 21 §3): each a clear error.

Every case names the argument and says the fix, and is raised before any backward pass.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ggnchunk
from ggnchunk._engine import GGNComputation


@pytest.fixture
def problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return model, torch.randn(5, 3), torch.randn(5, 2)


@pytest.fixture(autouse=True)
def no_backward(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a backward pass ran before the error")

    monkeypatch.setattr(GGNComputation, "backward", forbidden)


def test_an_astronomical_budget(problem):
    with pytest.raises(ValueError, match="max_memory='1e400 B' is larger than any"):
        ggnchunk.diag_ggn(*problem[:1], nn.MSELoss(), *problem[1:], max_memory="1e400 B")


def test_a_loss_that_returns_a_python_float(problem):
    model, x, y = problem
    with pytest.raises(TypeError, match=r"loss_func returned float .*no \.item\(\)"):
        ggnchunk.diag_ggn(model, lambda out, target: 1.0, x, y)


def test_data_that_is_not_an_iterable_of_batches(problem):
    model, x, _ = problem
    for data in (None, x):
        with pytest.raises(TypeError, match=r"data must be a DataLoader.*TensorDataset"):
            ggnchunk.diag_ggn_dataset(model, nn.MSELoss(), data)


def test_dict_inputs_with_keys_that_are_not_strings(problem):
    class Keyed(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 2)

        def forward(self, a):
            return self.linear(a)

    _, x, y = problem
    with pytest.raises(TypeError, match=r"key 1 \(int\).*string keys"):
        ggnchunk.diag_ggn(Keyed(), nn.MSELoss(), {1: x}, y)


@pytest.mark.parametrize("where", ["inputs", "targets", "parameter"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_values_are_named_not_called_coupling(problem, where, value):
    model, x, y = problem
    if where == "inputs":
        x = x.clone()
        x[0, 0] = value
    elif where == "targets":
        y = y.clone()
        y[1, 1] = value
    else:
        with torch.no_grad():
            model[2].bias[0] = value
    match = "parameter '2.bias'" if where == "parameter" else where
    with pytest.raises(ValueError, match=f"{match}.*NaN or Inf"):
        ggnchunk.diag_ggn(model, nn.MSELoss(), x, y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32,
                                   torch.float64])  # fmt: skip
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), None])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "expanded"])
@pytest.mark.parametrize("size", [1, 31, 4097, 100_003])
def test_the_finite_check_agrees_with_isfinite(dtype, value, layout, size):
    """The checks' fast test (by the extremes) against ``isfinite(...).all()``."""
    from ggnchunk._checks import all_finite

    generator = torch.Generator().manual_seed(size)
    x = torch.randn(2 * size, generator=generator).to(dtype)
    if value is not None:  # anywhere, also the last element a vectorized loop sees
        for index in (0, size - 1, 2 * size - 1, int(torch.randint(size, (1,)))):
            y = x.clone()
            y[index] = value
            for z in _layouts(y, layout, size):
                assert all_finite(z) == bool(torch.isfinite(z).all()), (index, z.shape)
    else:
        for z in _layouts(x, layout, size):
            assert all_finite(z)
    assert all_finite(x[:0])


def _layouts(x: torch.Tensor, layout: str, size: int) -> list[torch.Tensor]:
    if layout == "contiguous":
        return [x]
    if layout == "strided":
        return [x[::2], x[1::2], x.reshape(2, size).t()]
    return [x[:size].unsqueeze(0).expand(3, -1)]


class _LogOf(nn.Module):
    """A log (or a masked square root) of a linear layer's output: NaN where negative."""

    def __init__(self, masked: bool):
        super().__init__()
        self.linear, self.masked = nn.Linear(3, 2), masked

    def forward(self, a):
        h = self.linear(a)
        if self.masked:  # NaN in the branch torch.where drops: finite output, NaN grads
            return torch.where(h > 0, torch.sqrt(h), h)
        return torch.log(h)


@pytest.mark.parametrize(
    ("masked", "kwargs"),
    [(False, {}), (False, {"batch_chunk_size": 1}), (False, {"max_memory": "64MiB"}),
     (True, {}), (True, {"max_memory": "64MiB"})],  # one sample: checks nothing backward
)  # fmt: skip
def test_non_finite_values_made_by_the_forward_pass_are_named(masked, kwargs):
    """NaN made by the model's own operations is named, not called a coupling.

    It was reported as samples influencing each other, or (batches of one) returned
    as a NaN diagonal without a word.
    """
    torch.manual_seed(0)
    model, x = _LogOf(masked), torch.randn(6, 3)
    with torch.no_grad():
        h = model.linear(x)
    if not bool((h < 0).any()):  # the seed's draw gives negative values
        pytest.skip("no negative pre-activation")
    y = torch.zeros(6, 2)
    match = "backpropagating.*NaN or Inf.*torch.where" if masked else "model output.*NaN"
    with pytest.raises(ValueError, match=match):
        ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **kwargs)


def test_a_model_on_the_meta_device():
    model = nn.Linear(3, 2, device="meta")
    x, y = torch.randn(4, 3, device="meta"), torch.randn(4, 2, device="meta")
    with pytest.raises(ValueError, match="'meta' device.*to_empty"):
        ggnchunk.diag_ggn(model, nn.MSELoss(), x, y)


def test_cross_entropy_mean_with_every_target_ignored(problem):
    model, x, _ = problem
    targets = torch.full((5,), 1)
    with pytest.raises(ValueError, match="every target is ignore_index.*reduction='sum'"):
        ggnchunk.diag_ggn(model, nn.CrossEntropyLoss(ignore_index=1), x, targets)


def test_budget_errors_show_small_sizes_readably(problem):
    model, x, y = problem
    with pytest.raises(ggnchunk.MemoryBudgetError) as info:
        ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, max_memory=10)
    message = str(info.value)
    assert "max_memory is 10 B" in message and "0.0 MiB" not in message


def test_a_per_sample_loss_weight_with_sub_batches_names_the_weight(problem):
    """A loss weight with the batch's axis cannot follow sub-batches: say so.

    The message said to check the targets, which were fine.
    """
    model, x, _ = problem
    loss = nn.BCEWithLogitsLoss(weight=torch.rand(5, 2))
    targets = torch.rand(5, 2)
    with pytest.raises(ValueError, match=r"loss_func.weight has a batch axis of 5.*Drop"):
        ggnchunk.diag_ggn(model, loss, x, targets, batch_chunk_size=2)


def test_a_lazy_module_not_initialized_yet():
    model = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.LazyLinear(2))
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    with pytest.raises(
        ValueError, match=r"'0.weight' is not initialized yet.*model\(inputs\)"
    ):
        ggnchunk.diag_ggn(model, nn.MSELoss(), x, y)


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))

    def forward(self, x):
        return self.body(x)


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="notes: Python 3.11")
@pytest.mark.parametrize("call", ["diag_ggn", "kron_ggn", "output_variance"])
def test_an_error_in_the_forward_pass_names_the_module(call):
    model, x, y = _Nested(), torch.randn(5, 7), torch.randn(5, 2)  # 7 features, not 3
    if call == "diag_ggn":
        run = lambda: ggnchunk.diag_ggn(model, nn.MSELoss(), x, y)  # noqa: E731
    elif call == "kron_ggn":
        run = lambda: ggnchunk.kron_ggn(model, nn.MSELoss(), x, y)  # noqa: E731
    else:
        variance = {n: torch.ones_like(p) for n, p in model.named_parameters()}
        run = lambda: ggnchunk.output_variance(model, x, variance)  # noqa: E731
    with pytest.raises(RuntimeError, match="cannot be multiplied") as raised:
        run()
    notes = getattr(raised.value, "__notes__", [])
    assert notes == [
        "ggnchunk: raised in the model's forward pass, in module 'body.0' (Linear), "
        "which ggnchunk runs as model(inputs); check that model(inputs) runs on these "
        "inputs."
    ]
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_parameters_made_in_inference_mode_are_named():
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"'0.weight' is an inference tensor .*outside"):
        ggnchunk.diag_ggn(model, nn.MSELoss(), torch.randn(5, 3), torch.randn(5, 2))


class _NoGradInside(nn.Module):
    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.reentrant = reentrant
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        def body(t):
            return self.b(torch.tanh(self.a(t)))

        if self.reentrant is None:
            with torch.no_grad():
                return body(x)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(body, x, use_reentrant=self.reentrant)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize(
    "reentrant, words",
    [
        (None, r"depend on any .* model.a \(Linear\), model.b \(Linear\) ran with "
               r"gradients disabled in the forward pass \(inside torch.no_grad\(\)"),
        (True, r"checkpoint with use_reentrant=True \(around model.a\).*"
               r"use_reentrant=False"),
    ],
)  # fmt: skip
def test_an_output_without_gradient_says_which_layers_ran_without(reentrant, words):
    """The checkpoint's inputs (the data) need no grad: its output has none at all."""
    model = _NoGradInside(reentrant)
    with pytest.raises(ValueError, match=words):
        ggnchunk.diag_ggn(model, nn.MSELoss(), torch.randn(5, 3), torch.randn(5, 2))
