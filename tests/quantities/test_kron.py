"""Kronecker factors (KFLR): float64 brute force, BackPACK's KFLR, laplace-torch's backend.

Every case is checked against :func:`tests.reference.reference_kron` (``torch.func``
Jacobians w.r.t. a virtual bias and loss Hessians; ``F.unfold`` patches), in every
chunking mode; the factorization itself is checked against the exact GGN block where it
is exact (one sample, one output position).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev

import ggnchunk
from tests.reference import reference_kron


def _mlp():
    return nn.Sequential(nn.Linear(5, 7), nn.Sigmoid(), nn.Linear(7, 3))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(4, 5, 3, padding="same", padding_mode="circular", dilation=1),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(5 * 2 * 2, 3),
    )  # fmt: skip


def _conv1d():
    return nn.Sequential(
        nn.Conv1d(2, 3, 3, dilation=2, padding=2, padding_mode="reflect"), nn.Tanh(),
        nn.Conv1d(3, 2, 2, stride=2, bias=False), nn.Flatten(), nn.Linear(2 * 5, 3),
    )  # fmt: skip


def _tokens():  # Linear on [N, T, D]: a 1x1 convolution over T
    return nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 3))


def _segmenter():  # per-pixel classes: many columns
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 1))


def _autoencoder():
    return nn.Sequential(nn.Linear(16, 4), nn.ReLU(), nn.Linear(4, 16))


def _partly_frozen():
    model = _mlp()
    model[0].bias.requires_grad_(False)
    model[2].weight.requires_grad_(False)
    return model


def _laplace_cnn():  # the shape of laplace-torch's test CNNs
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 2),
    )


_N = 4
# name: (model, input shape, output kind)
CASES = {
    "mlp": (_mlp, (_N, 5), "vector"),
    "cnn": (_cnn, (_N, 3, 8, 8), "vector"),
    "conv1d": (_conv1d, (_N, 2, 10), "vector"),
    "tokens": (_tokens, (_N, 5, 4), "vector"),
    "segmenter": (_segmenter, (_N, 2, 4, 4), "pixels"),
    "autoencoder": (_autoencoder, (_N, 16), "vector"),
    "partly_frozen": (_partly_frozen, (_N, 5), "vector"),
    "laplace_cnn": (_laplace_cnn, (_N, 3, 8, 8), "vector"),
}
LOSSES = {
    "mse_sum": lambda: nn.MSELoss(reduction="sum"),
    "mse_mean": lambda: nn.MSELoss(),
    "ce_mean": lambda: nn.CrossEntropyLoss(),
    "bce_sum": lambda: nn.BCEWithLogitsLoss(reduction="sum"),
}


def _problem(case: str, loss: str, dtype=torch.float64):
    build, shape, _ = CASES[case]
    torch.manual_seed(0)
    model = build().to(dtype)
    x = torch.randn(*shape, dtype=dtype)
    with torch.no_grad():
        out = model(x)
    if loss.startswith("ce"):
        targets = torch.randint(0, out.shape[1], (out.shape[0], *out.shape[2:]))
    elif loss.startswith("bce"):
        targets = torch.rand(out.shape, dtype=dtype)
    else:
        targets = torch.randn(out.shape, dtype=dtype)
    return model, LOSSES[loss](), x, targets


def _assert_factors(actual, expected, rtol, label):
    """Assert ``max|a - e| <= rtol * scale`` per factor.

    ``scale`` is floored at 1e-3 of the largest factor entry of the model: an output
    factor that is exactly zero (the last layer's when cross-entropy's softmax cannot see
    a per-channel shift) is held to the rounding noise of the problem.
    """
    assert list(actual) == list(expected), f"{label}: layers {list(actual)}"
    overall = max(
        t.abs().max().item() for f in expected.values() for t in f if t is not None
    )
    for name, (g, a) in expected.items():
        got = actual[name]
        for what, value, exp in (("output", got.output, g), ("input", got.input, a)):
            if exp is None:
                assert value is None, f"{label} {name}.{what}: expected None"
                continue
            scale = exp.abs().max().item()
            err = (value.double() - exp).abs().max().item()
            assert err <= rtol * max(scale, 1e-3 * overall), (
                f"{label} {name}.{what}: max error {err:.3e}, scale {scale:.3e}"
            )


MODES = {
    "one_pass": {},
    "num_chunks_3": {"num_chunks": 3},
    "chunk_size_2": {"chunk_size": 2},
    "budget": {"max_memory": "64MiB"},
    "batch_chunks": {"batch_chunk_size": 3, "num_chunks": 2},
}


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("case", list(CASES))
def test_factors_equal_the_float64_brute_force(case, loss):
    if loss.startswith("ce") and CASES[case][0] is _autoencoder:
        pytest.skip("covered by the other classifiers")
    model, loss_func, x, y = _problem(case, loss)
    expected = reference_kron(model, loss_func, x, y)
    for mode, options in MODES.items():
        got = ggnchunk.kron_ggn(model, loss_func, x, y, **options)
        _assert_factors(got, expected, 1e-9, f"{case}/{loss}/{mode}")


@pytest.mark.parametrize("case", ["cnn", "segmenter"])
def test_float32_chunked_matches_the_brute_force(case):
    model, loss_func, x, y = _problem(case, "mse_mean", torch.float32)
    expected = reference_kron(model, loss_func, x, y)
    got = ggnchunk.kron_ggn(model, loss_func, x, y, num_chunks=5)
    _assert_factors(got, expected, 1e-5, case)
    assert all(f.output.dtype == torch.float32 for f in got.values())


def _exact_block(model, loss_func, x, y, name):
    """The exact float64 GGN block of one parameter, J^T H J with torch.func."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    out = model(x).detach()
    h = hessian(lambda o: loss_func(o, y))(out).reshape(out.numel(), out.numel())

    def f(p):
        return functional_call(model, {**params, name: p}, (x,))

    j = jacrev(f)(params[name]).reshape(out.numel(), -1)
    return j.T @ h @ j


@pytest.mark.parametrize(
    "build, shape",
    [
        (_mlp, (1, 5)),
        # the kernel covers the whole input: one output position
        (
            lambda: nn.Sequential(
                nn.Conv2d(2, 3, 4), nn.Flatten(), nn.Tanh(), nn.Linear(3, 2)
            ),
            (1, 2, 4, 4),
        ),
    ],
)
def test_one_sample_one_position_kron_is_the_exact_block(build, shape):
    torch.manual_seed(3)
    model = build().double()
    x = torch.randn(*shape, dtype=torch.float64)
    y = torch.randn(1, 2 if len(shape) == 4 else 3, dtype=torch.float64)
    loss_func = nn.MSELoss(reduction="sum")
    factors = ggnchunk.kron_ggn(model, loss_func, x, y, num_chunks=2)
    for layer, f in factors.items():
        exact = _exact_block(model, loss_func, x, y, f.weight)
        assert torch.allclose(f.weight_block(), exact, rtol=1e-10, atol=1e-12), layer
        exact_bias = _exact_block(model, loss_func, x, y, f.bias)
        assert torch.allclose(f.output, exact_bias, rtol=1e-10, atol=1e-12), layer


# -- BackPACK's KFLR ----------------------------------------------------------------------
backpack = pytest.importorskip("backpack")


def _conv3d():
    return nn.Sequential(nn.Conv3d(2, 3, 2, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(3 * 4 * 4 * 4, 3))  # fmt: skip


@pytest.mark.parametrize("loss", ["mse_sum", "mse_mean", "ce_mean"])
# laplace_cnn is left out: BackPACK 1.7.1 fails on AvgPool2d in float64 (dtype error)
@pytest.mark.parametrize("case", ["mlp", "cnn", "conv1d", "conv3d", "segmenter"])
def test_factors_equal_backpacks_kflr(case, loss):
    from backpack import backpack as bp_context
    from backpack import extend
    from backpack.extensions import KFLR

    if case == "segmenter" and loss.startswith("mse"):
        pytest.skip("BackPACK 1.7.1's MSELoss takes [N, D] outputs only")
    if case == "conv3d":
        torch.manual_seed(0)
        model = _conv3d().double()
        x = torch.randn(_N, 2, 3, 3, 3, dtype=torch.float64)
        y = (torch.randint(0, 3, (_N,)) if loss.startswith("ce")
             else torch.randn(_N, 3, dtype=torch.float64))  # fmt: skip
        loss_func = LOSSES[loss]()
    else:
        model, loss_func, x, y = _problem(case, loss)
        # BackPACK unfolds with explicit zero padding only (its factors for "same" fail
        # and for reflect/circular padding differ from the brute force, ours do not)
        if case == "cnn":
            model[2].padding, model[2].padding_mode = (1, 1), "zeros"
        if case == "conv1d":
            model[0].padding_mode = "zeros"
    ours = ggnchunk.kron_ggn(model, loss_func, x, y, num_chunks=2)
    theirs_model = extend(copy.deepcopy(model))
    with warnings.catch_warnings(), bp_context(KFLR()):
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        extend(copy.deepcopy(loss_func))(theirs_model(x), y).backward()
    for name, module in theirs_model.named_modules():
        if name not in ours:
            continue
        f = ours[name]
        g, a = module.weight.kflr
        assert torch.allclose(f.output, g, rtol=1e-10, atol=1e-14), name
        assert torch.allclose(f.input, a, rtol=1e-10, atol=1e-14), name
        if module.bias is not None:
            assert torch.allclose(f.output, module.bias.kflr[0], rtol=1e-10, atol=1e-14)


# -- refusals -----------------------------------------------------------------------------
class _FLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 3)

    def forward(self, x):
        return nn.functional.linear(torch.tanh(self.enc(x)), self.enc.weight.t())


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        return self.layer(torch.tanh(self.layer(x)))


@pytest.mark.parametrize(
    "model, shape, match",
    [
        (
            nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)),
            (3, 4),
            r"'1\.weight' of model\.1 \(LayerNorm\)",
        ),
        (nn.Sequential(nn.Conv1d(4, 4, 1, groups=2), nn.Flatten()), (3, 4, 2), "groups=2"),
        (nn.Sequential(nn.ConvTranspose1d(4, 4, 1), nn.Flatten()), (3, 4, 2), "Transpose"),
        (_FLinear(), (3, 4), r"'enc\.weight' is used outside"),
        (_Twice(), (3, 4), r"model\.layer \(Linear\) is called more than once"),
    ],
    ids=["layernorm", "grouped", "transpose", "f_linear", "twice"],
)
def test_layers_without_factors_are_refused_by_name(model, shape, match):
    x = torch.randn(*shape)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    with pytest.raises(ValueError, match=match) as raised:
        ggnchunk.kron_ggn(model, nn.MSELoss(), x, y)
    assert "requires_grad_(False)" in str(raised.value)
    assert "diag_ggn" in str(raised.value)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_freezing_the_refused_parameters_gives_the_other_layers_factors():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 2)).double()
    model[1].requires_grad_(False)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    got = ggnchunk.kron_ggn(model, nn.MSELoss(), x, y, chunk_size=1)
    _assert_factors(got, reference_kron(model, nn.MSELoss(), x, y), 1e-9, "layernorm")


def test_report_and_budget_error():
    model, loss_func, x, y = _problem("autoencoder", "mse_sum")
    factors, report = ggnchunk.kron_ggn(model, loss_func, x, y, num_chunks=4,
                                        return_report=True)  # fmt: skip
    assert len(report.schedules[0].chunks) == 4 and report.num_columns == 16
    # the passes stop at the 4-wide bottleneck, and its Gram's factor goes on below
    assert [s.total for s in report.schedules[1:]] == [4]
    assert report.num_passes == 4 + len(report.schedules[1].chunks)
    assert set(factors) == {"0", "2"}
    with pytest.raises(ggnchunk.MemoryBudgetError):
        ggnchunk.kron_ggn(model, loss_func, x, y, max_memory=16)


def test_torchvision_resnet18_with_frozen_batchnorm():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).double().eval()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.requires_grad_(False)
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    y = torch.randint(0, 3, (2,))
    loss_func = nn.CrossEntropyLoss()
    expected = reference_kron(model, loss_func, x, y)
    got = ggnchunk.kron_ggn(model, loss_func, x, y, num_chunks=2)
    assert len(got) == 21  # 20 convolutions and the classifier
    _assert_factors(got, expected, 1e-9, "resnet18")
