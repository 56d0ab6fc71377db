"""Whole-dataset diagonals, the streaming accumulator, and loss + gradient + diagonal."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ggnchunk
from tests.reference import assert_diag_close


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8, 5))


X = torch.randn(11, 1, 4, 4)  # 11 samples: batches of 4 leave an uneven last batch
CASES = {
    "mse-mean": (nn.MSELoss(), torch.randn(11, 5)),
    "mse-sum": (nn.MSELoss(reduction="sum"), torch.randn(11, 5)),
    "ce-mean-weighted-ignore": (
        nn.CrossEntropyLoss(weight=torch.rand(5) + 0.5, ignore_index=3),
        torch.randint(0, 5, (11,)),
    ),
    "bce-mean": (nn.BCEWithLogitsLoss(), torch.rand(11, 5).round()),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("options", [{}, {"num_chunks": 2}, {"max_memory": "1GiB"}])
def test_dataset_diagonal_equals_the_concatenated_batch(case, options):
    loss_func, y = CASES[case]
    model = _model().eval()
    expected = ggnchunk.diag_ggn(model, loss_func, X, y)
    loader = DataLoader(TensorDataset(X, y), batch_size=4)
    actual = ggnchunk.diag_ggn_dataset(model, loss_func, loader, progress=False, **options)
    assert_diag_close(actual, expected, rtol=1e-5, label=case)


def test_accumulator_streams_resets_and_round_trips():
    loss_func, y = CASES["mse-mean"]
    model = _model().eval()
    expected = ggnchunk.diag_ggn(model, loss_func, X, y)
    acc = ggnchunk.DiagGGNAccumulator(model, loss_func, chunk_size=3)
    acc.update(X[:6], y[:6])
    state = acc.state_dict()
    restored = ggnchunk.DiagGGNAccumulator(model, loss_func, chunk_size=3)
    restored.load_state_dict(state)
    for a in (acc, restored):
        a.update(X[6:], y[6:])
        assert a.num_samples == 11 and a.num_batches == 2
        assert_diag_close(a.compute(), expected, rtol=1e-5)
    acc.reset()
    with pytest.raises(RuntimeError, match="no batch was added"):
        acc.compute()


def test_accumulator_rejects_a_foreign_checkpoint():
    acc = ggnchunk.DiagGGNAccumulator(_model(), nn.MSELoss())
    acc.update(X[:2], torch.randn(2, 5))
    other = ggnchunk.DiagGGNAccumulator(nn.Sequential(nn.Linear(16, 5)), nn.MSELoss())
    with pytest.raises(ValueError, match="does not match"):
        other.load_state_dict(acc.state_dict())


def test_dataset_errors():
    model = _model()
    with pytest.raises(ValueError, match="no batch"):
        ggnchunk.diag_ggn_dataset(model, nn.MSELoss(), [], progress=False)
    with pytest.raises(TypeError, match=r"\(inputs, targets\) pairs"):
        ggnchunk.diag_ggn_dataset(model, nn.MSELoss(), [X], progress=False)
    with pytest.raises(RuntimeError, match="no torch.distributed process group"):
        ggnchunk.diag_ggn_dataset(model, nn.MSELoss(), [(X, X)], distributed=True)
    with pytest.raises(TypeError, match="unknown option"):
        ggnchunk.DiagGGNAccumulator(model, nn.MSELoss(), chunks=3)


def test_progress_bar_shows_the_chunking(capsys):
    loss_func, y = CASES["mse-sum"]
    loader = DataLoader(TensorDataset(X, y), batch_size=4)
    ggnchunk.diag_ggn_dataset(_model(), loss_func, loader, progress=True, num_chunks=2)
    err = capsys.readouterr().err
    assert "GGN diagonal" in err and "columns_per_pass=3" in err


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("options", [{}, {"num_chunks": 3, "batch_chunk_size": 4}])
def test_loss_gradient_and_diagonal_in_one_call(case, options):
    loss_func, y = CASES[case]
    model = _model().eval()
    loss, grad, diag = ggnchunk.loss_grad_and_diag_ggn(model, loss_func, X, y, **options)
    reference_loss = loss_func(model(X), y)
    reference_grad = torch.autograd.grad(reference_loss, list(model.parameters()))
    assert torch.allclose(loss, reference_loss.detach(), rtol=1e-5, atol=0)
    for (name, g), r in zip(grad.items(), reference_grad, strict=True):
        assert torch.allclose(g, r, rtol=1e-4, atol=1e-6 * r.abs().max().item()), name
    assert_diag_close(diag, ggnchunk.diag_ggn(model, loss_func, X, y), rtol=1e-5)
    assert all(p.grad is None for p in model.parameters())
