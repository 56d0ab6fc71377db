"""The same exactness checks on a CUDA device; skipped without one."""

from __future__ import annotations

import pytest
import torch

import ggnchunk
from tests.cases import LOSSES, MODELS
from tests.reference import assert_diag_close, reference_diag_ggn

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("loss_case", LOSSES[::2], ids=lambda c: c.name)
@pytest.mark.parametrize("model_case", MODELS[:6], ids=lambda c: c.name)
def test_cuda_results_match_brute_force_and_stay_on_device(model_case, loss_case):
    model, x = model_case.make()
    with torch.no_grad():
        out = model(x)
    if loss_case.needs_classes and out.dim() < 2:
        pytest.skip("cross-entropy needs [N, C, ...] outputs")
    loss_func, targets = loss_case.build(out)
    expected = reference_diag_ggn(model, loss_func, x, targets)
    # float64: TF32 convolutions (cuDNN's default) would blur a float32 comparison
    device = torch.device("cuda")
    model, loss_func = model.to(device, torch.float64), loss_func.to(device, torch.float64)
    x = x.to(device, torch.float64) if x.is_floating_point() else x.to(device)
    targets = targets.to(device)
    if targets.is_floating_point():
        targets = targets.double()
    for kwargs in ({}, {"num_chunks": 3}):
        actual = ggnchunk.diag_ggn(model, loss_func, x, targets, **kwargs)
        assert all(v.device.type == "cuda" for v in actual.values())
        assert_diag_close(actual, expected, rtol=1e-10, label=str(kwargs))
