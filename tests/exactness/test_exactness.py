"""Every case of the table against the float64 brute force, and chunked vs one pass."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import ggnchunk
from tests.cases import CHUNKINGS, LOSSES, MODELS, LossCase, ModelCase
from tests.reference import assert_diag_close, reference_diag_ggn


def _fits(model_case: ModelCase, loss_case: LossCase) -> bool:
    model, x = model_case.make()
    with torch.no_grad():
        out = model(x)
    return out.dim() >= 2 or not loss_case.needs_classes


CASES = [
    pytest.param(m, lo, id=f"{m.name}-{lo.name}")
    for m in MODELS
    for lo in LOSSES
    if _fits(m, lo)
]


@functools.cache
def _problem(model_case: ModelCase, loss_case: LossCase):
    model, x = model_case.make()
    with torch.no_grad():
        out = model(x)
    torch.manual_seed(1)
    loss_func, targets = loss_case.build(out)
    expected = reference_diag_ggn(model, loss_func, x, targets)
    columns = out[0].numel()
    return model, loss_func, x, targets, expected, columns


@pytest.mark.parametrize("chunking", [c[0] for c in CHUNKINGS])
@pytest.mark.parametrize(("model_case", "loss_case"), CASES)
def test_float64_matches_brute_force(model_case, loss_case, chunking):
    model, loss_func, x, targets, expected, columns = _problem(model_case, loss_case)
    kwargs = dict(CHUNKINGS)[chunking](columns)
    model64, loss64 = model.double(), loss_func.double()
    x64 = x.double() if x.is_floating_point() else x
    t64 = targets.double() if targets.is_floating_point() else targets
    try:
        actual = ggnchunk.diag_ggn(model64, loss64, x64, t64, **kwargs)
    finally:
        model.float()
        loss_func.float()
    for value in actual.values():
        assert value.dtype == torch.float64
    assert_diag_close(actual, expected, rtol=1e-10, label=f"{chunking}")


@pytest.mark.parametrize(("model_case", "loss_case"), CASES)
def test_float32_chunkings_agree_with_one_pass(model_case, loss_case):
    model, loss_func, x, targets, expected, columns = _problem(model_case, loss_case)
    one_pass = ggnchunk.diag_ggn(model, loss_func, x, targets)
    for value in one_pass.values():
        assert value.dtype == torch.float32
    assert_diag_close(one_pass, expected, rtol=1e-5, label="float32 one pass")
    for name, make in CHUNKINGS[1:]:
        chunked = ggnchunk.diag_ggn(model, loss_func, x, targets, **make(columns))
        assert_diag_close(chunked, one_pass, rtol=1e-5, label=f"float32 {name}")


def test_reference_equals_hessian_for_a_model_linear_in_its_parameters():
    """Check the reference itself: for a linear model the GGN is the Hessian."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    loss_func = nn.CrossEntropyLoss()
    expected = reference_diag_ggn(model, loss_func, x, y)
    params = dict(model.named_parameters())

    def loss_of(w, b):
        return loss_func(torch.func.functional_call(model, {"weight": w, "bias": b}, x), y)

    hess = torch.func.hessian(loss_of, argnums=(0, 1))(params["weight"], params["bias"])
    diag_w = torch.diagonal(hess[0][0].reshape(12, 12)).reshape(3, 4)
    diag_b = torch.diagonal(hess[1][1])
    assert torch.allclose(expected["weight"], diag_w, rtol=1e-12, atol=0)
    assert torch.allclose(expected["bias"], diag_b, rtol=1e-12, atol=0)
