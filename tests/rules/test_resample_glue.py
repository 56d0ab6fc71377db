"""Functional resizes in the glue (``F.interpolate``): all columns at once, exact.

torch's batching has no rule for any of ``F.interpolate``'s backward kernels, so a
functional resize between layers (torchvision's segmentation heads) ran once per column.
The engine's forward routes such calls through :mod:`ggnchunk._resample`, whose backward
is one matrix product per spatial axis. Checked here: the folded call's output is the
user's call's, its batched backward equals autograd's on every mode and option (and
takes no per-column loop), and models with such resizes match the float64 brute force
in every chunking mode; ``nn.Upsample`` keeps its rule.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ggnchunk
from ggnchunk import _resample
from ggnchunk._resample import fold_interpolate
from tests.reference import assert_diag_close, reference_diag_ggn, reference_kron

# (spatial input shape, F.interpolate options)
CALLS = {
    "nearest-1d-scale": ((7,), {"scale_factor": 2, "mode": "nearest"}),
    "nearest-2d-size-down": ((7, 6), {"size": (3, 4), "mode": "nearest"}),
    "nearest-3d": ((3, 4, 5), {"size": (5, 3, 7), "mode": "nearest"}),
    "nearest-exact-2d": ((5, 7), {"scale_factor": 1.7, "mode": "nearest-exact"}),
    "linear-1d-corners": ((6,), {"size": 11, "mode": "linear", "align_corners": True}),
    "bilinear-2d-size": ((5, 7), {"size": (12, 9), "mode": "bilinear"}),
    "bilinear-2d-scale-kept": (
        (5, 7),
        {"scale_factor": (1.5, 2.3), "mode": "bilinear", "recompute_scale_factor": False},
    ),
    "bilinear-2d-scale-recomputed": (
        (5, 7),
        {"scale_factor": 1.5, "mode": "bilinear", "recompute_scale_factor": True},
    ),
    "bilinear-2d-corners-down": (
        (9, 8),
        {"size": (4, 5), "mode": "bilinear", "align_corners": True},
    ),
    "bilinear-2d-antialias": (
        (12, 10),
        {"size": (5, 4), "mode": "bilinear", "antialias": True},
    ),
    "bicubic-2d": ((5, 6), {"size": (11, 7), "mode": "bicubic"}),
    "bicubic-2d-antialias": (
        (11, 9),
        {"size": (4, 6), "mode": "bicubic", "antialias": True},
    ),
    "trilinear-3d": ((3, 4, 5), {"scale_factor": 2, "mode": "trilinear"}),
    "area-2d": ((7, 9), {"size": (3, 4), "mode": "area"}),
    "area-1d-up": ((4,), {"size": 7, "mode": "area"}),
}


def _fallbacks(run) -> list[str]:
    """The operations torch's batching ran once per vector while ``run()`` ran."""
    enabled = torch._C._debug_only_are_vmap_fallback_warnings_enabled()
    torch._C._debug_only_display_vmap_fallback_warnings(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run()
    finally:
        torch._C._debug_only_display_vmap_fallback_warnings(enabled)
    return result, [str(w.message) for w in caught if "batching rule" in str(w.message)]


@pytest.mark.parametrize("name", CALLS)
def test_folded_call_is_the_users_call_with_the_same_backward(name):
    spatial, options = CALLS[name]
    torch.manual_seed(0)
    x = torch.randn(2, 3, *spatial, dtype=torch.float64, requires_grad=True)
    folded = fold_interpolate((x,), dict(options))
    expected = F.interpolate(x, **options)
    assert folded is not None, name
    assert torch.equal(folded, expected)  # the same kernel on the same input
    vectors = torch.randn(5, *expected.shape, dtype=torch.float64)
    (want,) = torch.autograd.grad(expected, x, vectors, is_grads_batched=True)
    (got,), slow = _fallbacks(
        lambda: torch.autograd.grad(folded, x, vectors, is_grads_batched=True)
    )
    assert slow == [], slow
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-13), (got - want).abs().max()


def test_positional_arguments_and_float32():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 6, requires_grad=True)
    folded = fold_interpolate((x, (8, 9), None, "bilinear", True), {})
    expected = F.interpolate(x, (8, 9), None, "bilinear", True)
    assert torch.equal(folded, expected)
    g = torch.randn(expected.shape)
    (want,) = torch.autograd.grad(expected, x, g)
    (got,) = torch.autograd.grad(folded, x, g)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_calls_that_are_left_as_they_are():
    x = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    assert fold_interpolate((x,), {"size": (8, 9), "mode": "bilinear"}) is None  # no grad
    y = x.clone().requires_grad_()
    with torch.no_grad():
        assert fold_interpolate((y,), {"size": (8, 9)}) is None
    # an invalid call: left to raise the user's own error
    assert fold_interpolate((y,), {"size": (8, 9), "scale_factor": 2}) is None
    assert fold_interpolate((y,), {"size": (8, 9), "unknown": 1}) is None
    z = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)  # no spatial axis
    assert fold_interpolate((z,), {"size": 3}) is None


class Segmenter(nn.Module):
    """Convolutions at low resolution, logits resized to the input size (LRASPP-like)."""

    def __init__(self, mode: str, classes: int = 3, **options):
        super().__init__()
        self.options = {"mode": mode, **options}
        self.down = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Conv2d(4, classes, 1)
        self.skip = nn.Conv2d(2, classes, 1)

    def forward(self, x):
        h = torch.tanh(self.down(x))
        h = F.interpolate(h, scale_factor=0.5, mode="area")  # a functional downsampling
        h = torch.tanh(self.mid(h))
        h = F.interpolate(h, size=(h.shape[2] * 2, h.shape[3] * 2), **self.options)
        out = self.head(h)
        out = F.interpolate(out, size=x.shape[-2:], **self.options)
        return out + self.skip(x)


MODELS = {
    "bilinear": lambda: Segmenter("bilinear", align_corners=False),
    "bicubic-corners": lambda: Segmenter("bicubic", align_corners=True),
    "nearest": lambda: Segmenter("nearest"),
}
CHUNKINGS = {
    "onepass": {"num_chunks": 1},
    "chunks5": {"num_chunks": 5},
    "chunk_size1": {"chunk_size": 1},
    "budget": {"max_memory": "64MiB"},
    "batch_chunks": {"batch_chunk_size": 1, "num_chunks": 2},
}
LOSSES = {
    "ce": lambda: (nn.CrossEntropyLoss(), lambda n: torch.randint(0, 3, (n, 8, 8))),
    "mse": lambda: (nn.MSELoss(), lambda n: torch.randn(n, 3, 8, 8, dtype=torch.float64)),
}


def _problem(model_name: str, loss_name: str, n: int = 2):
    torch.manual_seed(0)
    model = MODELS[model_name]().double()
    loss_func, targets = LOSSES[loss_name]()
    x = torch.randn(n, 2, 8, 8, dtype=torch.float64)
    return model, loss_func, x, targets(n)


@pytest.mark.filterwarnings("ignore::ggnchunk.MemoryBudgetWarning")
@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("model_name", MODELS)
def test_models_with_functional_resizes_match_the_brute_force(
    model_name, loss_name, chunking
):
    model, loss_func, x, y = _problem(model_name, loss_name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ggnchunk.SlowBackwardWarning)  # no per-column loop
        got = ggnchunk.diag_ggn(model, loss_func, x, y, **CHUNKINGS[chunking])
    expected = reference_diag_ggn(model, loss_func, x, y)
    assert_diag_close(got, expected, rtol=1e-9, label=f"{model_name} {loss_name}")


def test_batch_of_one_and_per_sample():
    model, loss_func, x, y = _problem("bilinear", "ce", n=3)
    got = ggnchunk.diag_ggn(model, loss_func, x[:1], y[:1], num_chunks=2)
    assert_diag_close(got, reference_diag_ggn(model, loss_func, x[:1], y[:1]), rtol=1e-9)
    per_sample = ggnchunk.diag_ggn(model, loss_func, x, y, per_sample=True, num_chunks=3)
    total = {k: v.sum(0) for k, v in per_sample.items()}
    assert_diag_close(total, reference_diag_ggn(model, loss_func, x, y), rtol=1e-9)


def test_kron_through_functional_resizes():
    model, loss_func, x, y = _problem("bilinear", "mse")
    expected = reference_kron(model, loss_func, x, y)
    got = ggnchunk.kron_ggn(model, loss_func, x, y, num_chunks=3)
    for name, (g, a) in expected.items():
        assert torch.allclose(got[name].output, g, rtol=1e-9, atol=1e-12), name
        if a is not None:
            assert torch.allclose(got[name].input, a, rtol=1e-9, atol=1e-12), name


def test_only_glue_resizes_are_folded(monkeypatch):
    """``nn.Upsample`` keeps its rule (its windowed nearest path); functional calls fold."""
    calls = []
    original = _resample.fold_interpolate

    def counted(args, kwargs):
        result = original(args, kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr("ggnchunk._folding.fold_interpolate", counted)
    torch.manual_seed(0)
    module_form = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Upsample(scale_factor=2), nn.Conv2d(3, 2, 1)
    ).double()  # fmt: skip
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    y = torch.randn(2, 2, 8, 8, dtype=torch.float64)
    got = ggnchunk.diag_ggn(module_form, nn.MSELoss(), x, y, num_chunks=2)
    assert_diag_close(got, reference_diag_ggn(module_form, nn.MSELoss(), x, y), rtol=1e-9)
    assert calls == []
    model, loss_func, x, y = _problem("bilinear", "ce")
    ggnchunk.diag_ggn(model, loss_func, x, y, num_chunks=2)
    assert calls == [True, True, True]


def test_a_resize_of_the_input_needs_no_fold():
    """A resize before any parameter: nothing to backpropagate there, still exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Upsample(size=(6, 6), mode="bilinear"),
                          nn.Conv2d(2, 3, 3)).double()  # fmt: skip

    class Resized(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x):
            return self.body(F.interpolate(x, size=(6, 6), mode="bicubic"))

    wrapped = Resized()
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    y = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    got = ggnchunk.diag_ggn(wrapped, nn.MSELoss(), x, y, num_chunks=2)
    assert_diag_close(got, reference_diag_ggn(wrapped, nn.MSELoss(), x, y), rtol=1e-9)


class Stretched(nn.Module):
    """A convolution's small output stretched 8x: the backward's steps outgrow it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)

    def forward(self, x):
        return F.interpolate(self.conv(x), size=(32, 32), mode="bilinear").sum((2, 3))


def test_resample_workspace_is_in_the_bound(monkeypatch):
    """The folded backward's intermediate products are counted per column."""
    from ggnchunk._checks import Batch
    from ggnchunk._engine import GGNComputation, Problem
    from ggnchunk._quantities import DiagonalGGN

    torch.manual_seed(0)
    model = Stretched().double()
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    targets = torch.randn(2, 2, dtype=torch.float64)

    def per_column() -> int:
        problem = Problem.build(model, nn.MSELoss())
        quantity = DiagonalGGN(problem, 2)
        with GGNComputation(problem, Batch(x, 2), targets, 1.0, quantity) as c:
            c.forward()
            return c.column_bytes()

    folded = per_column()
    monkeypatch.setattr("ggnchunk._folding.fold_interpolate", lambda args, kwargs: None)
    plain = per_column()
    # the matrix [4, 32] expanded over the N * C slices, the first step's [N, C, 4, 32]
    assert folded - plain >= (2 * 2 * 4 * 32 + 2 * 2 * 4 * 32) * 8


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::ggnchunk.MemoryBudgetWarning")
@pytest.mark.parametrize("chunking", ["onepass", "chunks5", "budget"])
def test_torchvision_deeplabv3(chunking):
    """DeepLabV3 resizes with ``F.interpolate`` twice, both crossed by all columns.

    Its ASPP pooling branch resizes 1x1 features to the map, its head the logits to
    the input (bilinear).
    """
    import torchvision

    from tests.real_models import _randomize_norms
    from tests.rules.test_frozen_attention import Out

    torch.manual_seed(0)
    net = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3, aux_loss=False
    )
    model = Out(_randomize_norms(net).double().eval())
    for name, param in model.named_parameters():  # the pooling branch's norm, the head
        param.requires_grad_(name.startswith(("model.classifier.0.convs.4.2.",
                                              "model.classifier.4.")))  # fmt: skip
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    y = torch.randint(0, 3, (2, 16, 16))
    loss_func = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ggnchunk.SlowBackwardWarning)
        got = ggnchunk.diag_ggn(model, loss_func, x, y, **CHUNKINGS[chunking])
    expected = reference_diag_ggn(model, loss_func, x, y)
    assert set(got) == {"model.classifier.0.convs.4.2.weight",
                        "model.classifier.0.convs.4.2.bias",
                        "model.classifier.4.weight", "model.classifier.4.bias"}  # fmt: skip
    assert_diag_close(got, expected, rtol=1e-9, label=f"deeplabv3 {chunking}")
