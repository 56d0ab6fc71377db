"""The laplace-torch backend: same posterior as the built-in BackPACK backend, and more."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

laplace = pytest.importorskip("laplace")
from laplace import Laplace  # noqa: E402
from laplace.curvature import BackPackGGN  # noqa: E402

import ggnchunk  # noqa: E402
from ggnchunk.laplace import ChunkedGGN  # noqa: E402


def _data(likelihood: str, outputs: int = 3, n: int = 20):
    torch.manual_seed(0)
    x = torch.randn(n, 5)
    y = torch.randn(n, outputs) if likelihood == "regression" else torch.randint(0, 4, (n,))
    return DataLoader(TensorDataset(x, y), batch_size=6)


def _model(outputs: int) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, outputs))


def _fit(model, likelihood, loader, backend, subset="all", **kwargs):
    la = Laplace(model, likelihood, subset_of_weights=subset, hessian_structure="diag",
                 backend=backend, backend_kwargs=kwargs)  # fmt: skip
    with warnings.catch_warnings():  # the built-in BackPACK backend's hook warning
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        la.fit(loader)
    return la


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_equals_the_builtin_backpack_backend(likelihood, subset):
    outputs = 3 if likelihood == "regression" else 4
    loader = _data(likelihood, outputs)
    model = _model(outputs)
    ours = _fit(model, likelihood, loader, ChunkedGGN, subset, num_chunks=2)
    theirs = _fit(copy.deepcopy(model), likelihood, loader, BackPackGGN, subset)
    assert torch.allclose(ours.H, theirs.H, rtol=1e-5, atol=1e-7)
    assert torch.allclose(ours.loss, theirs.loss, rtol=1e-5)
    assert torch.allclose(ours.posterior_precision, theirs.posterior_precision, rtol=1e-5)
    # no hooks left: the glm predictive (torch.func) runs after fit
    x = next(iter(loader))[0]
    if likelihood == "regression":
        mean, var = ours(x, pred_type="glm")
        assert mean.shape == (x.shape[0], outputs)
        assert bool((torch.diagonal(var, dim1=-2, dim2=-1) >= 0).all())
    else:
        probs = ours(x, pred_type="glm", link_approx="probit")
        assert torch.allclose(probs.sum(-1), torch.ones(x.shape[0]), atol=1e-5)


def test_autoencoder_with_784_outputs_under_a_300mib_budget():
    torch.manual_seed(0)
    x = torch.rand(64, 784)
    loader = DataLoader(TensorDataset(x, x), batch_size=32)
    model = nn.Sequential(nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 784))
    la = _fit(model, "regression", loader, ChunkedGGN, max_memory="300MiB")
    expected = ggnchunk.diag_ggn_dataset(model, nn.MSELoss(reduction="sum"), loader,
                                         progress=False)  # fmt: skip
    flat = torch.cat([v.flatten() for v in expected.values()])
    assert torch.allclose(la.H, 0.5 * flat, rtol=1e-5, atol=1e-8)
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    mean, _ = la(x[:4], pred_type="glm")
    assert mean.shape == (4, 784)


def test_backend_arguments_are_checked():
    with pytest.raises(TypeError, match="unknown backend_kwargs"):
        ChunkedGGN(_model(3), "regression", chunks=3)
    with pytest.raises(ValueError, match="stochastic=True"):
        ChunkedGGN(_model(3), "regression", stochastic=True)


@pytest.mark.parametrize("structure", ["kron", "full"])
def test_kron_and_full_say_that_only_diag_is_computed(structure):
    loader = _data("regression", 3)
    la = Laplace(_model(3), "regression", subset_of_weights="all",
                 hessian_structure=structure, backend=ChunkedGGN)  # fmt: skip
    with pytest.raises(NotImplementedError) as raised:
        la.fit(loader)
    message = str(raised.value)
    assert 'hessian_structure="diag"' in message
    assert f'hessian_structure="{structure}" is not available' in message
    assert "BackPackGGN" in message and "CurvlinopsGGN" in message
