"""The laplace-torch backend: same posterior as the built-in BackPACK backend, and more."""

from __future__ import annotations

import copy
import warnings
from collections import UserDict

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

laplace = pytest.importorskip("laplace")
from laplace import Laplace  # noqa: E402
from laplace.curvature import BackPackGGN  # noqa: E402

import ggnchunk  # noqa: E402
from ggnchunk.laplace import ChunkedGGN  # noqa: E402
from tests.reference import reference_diag_ggn  # noqa: E402


def _data(likelihood: str, outputs: int = 3, n: int = 20):
    torch.manual_seed(0)
    x = torch.randn(n, 5)
    y = torch.randn(n, outputs) if likelihood == "regression" else torch.randint(0, 4, (n,))
    return DataLoader(TensorDataset(x, y), batch_size=6)


def _model(outputs: int) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, outputs))


def _fit(model, likelihood, loader, backend, subset="all", structure="diag", **kwargs):
    la = Laplace(model, likelihood, subset_of_weights=subset, hessian_structure=structure,
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


def _autoencoder(hidden: int) -> tuple[nn.Module, DataLoader]:
    """A 784-``hidden``-784 MLP autoencoder and 64 random images in batches of 32."""
    torch.manual_seed(0)
    x = torch.rand(64, 784)
    loader = DataLoader(TensorDataset(x, x), batch_size=32)
    return nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 784)), loader


def test_autoencoder_with_784_outputs_under_a_300mib_budget():
    model, loader = _autoencoder(64)
    la = _fit(model, "regression", loader, ChunkedGGN, max_memory="300MiB")
    expected = ggnchunk.diag_ggn_dataset(model, nn.MSELoss(reduction="sum"), loader,
                                         progress=False)  # fmt: skip
    flat = torch.cat([v.flatten() for v in expected.values()])
    assert torch.allclose(la.H, 0.5 * flat, rtol=1e-5, atol=1e-8)
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    mean, _ = la(loader.dataset.tensors[0][:4], pred_type="glm")
    assert mean.shape == (4, 784)


def test_backend_arguments_are_checked():
    with pytest.raises(TypeError, match="unknown keyword"):
        ChunkedGGN(_model(3), "regression", chunks=3)
    with pytest.raises(TypeError, match="num_samples must be a positive int"):
        ChunkedGGN(_model(3), "regression", stochastic=True, num_samples=0)


def test_full_says_which_structures_are_computed():
    loader = _data("regression", 3)
    la = Laplace(_model(3), "regression", subset_of_weights="all",
                 hessian_structure="full", backend=ChunkedGGN)  # fmt: skip
    with pytest.raises(NotImplementedError) as raised:
        la.fit(loader)
    message = str(raised.value)
    assert 'hessian_structure="diag" and "kron"' in message
    assert 'hessian_structure="full" is not available' in message
    assert "BackPackGGN" in message and "CurvlinopsGGN" in message


class _DictInput(nn.Module):
    """laplace-torch's custom-model convention: one dict argument (its test_dict_data)."""

    def __init__(self, outputs: int):
        super().__init__()
        self.net = _model(outputs)

    def forward(self, data):
        assert isinstance(data, UserDict)  # the collator's own mapping type
        return self.net(data["test_input_key"])


def _dict_collator(rows):
    return UserDict(
        test_input_key=torch.stack([r[0] for r in rows]),
        test_label_key=torch.stack([r[1] for r in rows]),
    )


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_dict_batches_follow_laplace_torchs_dict_keys(likelihood, subset):
    outputs = 3 if likelihood == "regression" else 4
    torch.manual_seed(0)
    x = torch.randn(10, 5)  # laplace-torch's collator gives class labels [B, 1]
    y = (
        torch.randn(10, outputs)
        if likelihood == "regression"
        else torch.randint(4, (10, 1))
    )
    rows = list(zip(x, y, strict=True))
    dict_loader = DataLoader(rows, batch_size=3, collate_fn=_dict_collator)
    model = _DictInput(outputs)
    keys = {"dict_key_x": "test_input_key", "dict_key_y": "test_label_key"}
    la = Laplace(model, likelihood, subset_of_weights=subset, hessian_structure="diag",
                 backend=ChunkedGGN, backend_kwargs={"num_chunks": 2}, **keys)  # fmt: skip
    la.fit(dict_loader)
    tensor_loader = DataLoader(TensorDataset(x, y), batch_size=3)
    theirs = _fit(copy.deepcopy(model.net), likelihood, tensor_loader, BackPackGGN, subset)
    assert torch.allclose(la.H, theirs.H, rtol=1e-5, atol=1e-7)
    assert torch.allclose(la.loss, theirs.loss, rtol=1e-5)
    batch = next(iter(dict_loader))
    if likelihood == "regression":
        mean, _ = la(batch, pred_type="glm")
        assert torch.allclose(mean, model.net(batch["test_input_key"]), atol=1e-6)
    else:
        probs = la(batch, pred_type="glm", link_approx="probit")
        assert torch.allclose(probs.sum(-1), torch.ones(3), atol=1e-5)
    # laplace-torch's default keys do not name this batch's input: say which key to pass
    backend = ChunkedGGN(model, likelihood)
    with pytest.raises(KeyError, match=r"dict_key_x='input_ids'.*test_input_key"):
        backend.diag(batch, batch["test_label_key"])


def test_tuple_inputs_are_unpacked_like_laplace_torchs_jacobians():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 2), nn.Linear(1, 2)

        def forward(self, x, t):
            return torch.tanh(self.a(x)) * self.b(t)

    torch.manual_seed(0)
    model, x, t, y = TwoInputs(), torch.randn(7, 5), torch.rand(7, 1), torch.randn(7, 2)
    expected = reference_diag_ggn(model, nn.MSELoss(reduction="sum"), (x, t), y)
    flat = torch.cat([v.flatten() for v in expected.values()])
    for options in ({}, {"num_chunks": 2}, {"max_memory": "256MiB"}):
        loss, diag = ChunkedGGN(model, "regression", **options).diag((x, t), y, N=7)
        assert torch.allclose(diag.double(), 0.5 * flat, rtol=1e-5, atol=1e-8), options
        assert torch.allclose(loss, 0.5 * ((model(x, t) - y) ** 2).sum().detach())


def test_logits_per_position_are_laplace_torchs_view_minus_one():
    """Logits [B, T, C] with labels [B, T]: laplace-torch's f.view(-1, C), y.view(-1)."""
    torch.manual_seed(0)
    model = _model(4)  # acts on the last axis: per position
    x, y = torch.randn(6, 3, 5), torch.randint(4, (6, 3))
    loss, diag = ChunkedGGN(model, "classification", num_chunks=5).diag(x, y)
    # the same positions as 18 samples of a [B, C] classifier, through BackPACK
    with warnings.catch_warnings():  # BackPACK's hook warning
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        loss_bp, diag_bp = BackPackGGN(copy.deepcopy(model), "classification").diag(
            x.reshape(18, 5), y.reshape(18)
        )
    assert torch.allclose(diag, diag_bp, rtol=1e-5, atol=1e-8)
    assert torch.allclose(loss, loss_bp, rtol=1e-6)


def _fit_kron(model, likelihood, loader, backend, subset="all", **kwargs):
    return _fit(model, likelihood, loader, backend, subset, "kron", **kwargs)


@pytest.mark.parametrize("options", [{}, {"num_chunks": 2}, {"max_memory": "64MiB"}])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_kron_equals_the_builtin_backpack_backend(likelihood, subset, options):
    outputs = 3 if likelihood == "regression" else 4
    loader = _data(likelihood, outputs)
    model = _model(outputs).double()
    loader = DataLoader(
        TensorDataset(*[t.double() if t.is_floating_point() else t
                        for t in loader.dataset.tensors]), batch_size=6,
    )  # fmt: skip
    ours = _fit_kron(model, likelihood, loader, ChunkedGGN, subset, **options)
    theirs = _fit_kron(copy.deepcopy(model), likelihood, loader, BackPackGGN, subset)
    assert len(ours.H_facs.kfacs) == len(theirs.H_facs.kfacs)
    for mine, other in zip(ours.H_facs.kfacs, theirs.H_facs.kfacs, strict=True):
        assert len(mine) == len(other)
        for a, b in zip(mine, other, strict=True):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    assert torch.allclose(ours.loss, theirs.loss, rtol=1e-10)
    assert torch.allclose(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood(),
                          rtol=1e-8)  # fmt: skip


def test_kron_cnn_equals_the_builtin_backpack_backend():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(4 * 3 * 3, 2)).double()  # fmt: skip
    x, y = torch.randn(10, 3, 8, 8, dtype=torch.float64), torch.randint(0, 2, (10,))
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    ours = _fit_kron(model, "classification", loader, ChunkedGGN, chunk_size=1)
    theirs = _fit_kron(copy.deepcopy(model), "classification", loader, BackPackGGN)
    for mine, other in zip(ours.H_facs.kfacs, theirs.H_facs.kfacs, strict=True):
        for a, b in zip(mine, other, strict=True):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_kron_autoencoder_784_outputs_under_a_budget():
    model, loader = _autoencoder(32)
    la = _fit_kron(model, "regression", loader, ChunkedGGN, max_memory="64MiB")
    theirs = _fit_kron(copy.deepcopy(model), "regression", loader, BackPackGGN)
    for mine, other in zip(la.H_facs.kfacs, theirs.H_facs.kfacs, strict=True):
        for a, b in zip(mine, other, strict=True):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6 * b.abs().max().item())
    mean, _ = la(loader.dataset.tensors[0][:4], pred_type="glm")
    assert mean.shape == (4, 784)


def test_kron_refuses_layers_without_factors_by_name():
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="kron",
                 backend=ChunkedGGN)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"model\.1 \(LayerNorm\).*requires_grad_\(False\)"
    ):
        la.fit(_data("regression", 3))


def _image_autoencoder() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 3, 1))


def test_image_shaped_regression_outputs_are_refused_with_the_fix():
    """laplace-torch would count 4 outputs instead of 48 per sample: silently wrong."""
    model = _image_autoencoder()
    x = torch.randn(6, 3, 4, 4)
    loader = DataLoader(TensorDataset(x, x), batch_size=3)
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="diag",
                 backend=ChunkedGGN)  # fmt: skip
    with pytest.raises(ValueError, match=r"nn\.Flatten\(\)") as info:
        la.fit(loader)
    assert "4 instead of 48" in str(info.value)
    backend = ChunkedGGN(model, "regression")
    with pytest.raises(ValueError, match="flatten"):
        backend.diag(x, x)
    with pytest.raises(ValueError, match="flatten"):
        backend.kron(x, x, N=6)


def test_flattened_image_outputs_equal_the_builtin_backpack_backend():
    model = nn.Sequential(_image_autoencoder(), nn.Flatten())
    x = torch.randn(6, 3, 4, 4)
    loader = DataLoader(TensorDataset(x, x.flatten(1)), batch_size=3)
    ours = _fit(copy.deepcopy(model), "regression", loader, ChunkedGGN)
    theirs = _fit(copy.deepcopy(model), "regression", loader, BackPackGGN)
    assert ours.n_outputs == theirs.n_outputs == 48
    assert torch.allclose(ours.H, theirs.H, rtol=1e-4, atol=1e-7)
    assert torch.allclose(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood(),
                          rtol=1e-5)  # fmt: skip
