"""The BackPACK tutorial's autoencoder at many chunkings, and agreement with BackPACK."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from backpack import backpack, extend
from backpack.extensions import DiagGGNExact
from torch import nn

import ggnchunk
from tests.reference import assert_diag_close, reference_diag_ggn


def tutorial_problem():
    """The conv autoencoder of BackPACK's retain_graph tutorial, without its Flatten."""
    torch.manual_seed(0)
    X = torch.rand(5, 3, 32, 32)
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 10, 3), nn.Sigmoid()),
        nn.Sequential(nn.ConvTranspose2d(10, 3, 3)),
    )
    return model, nn.MSELoss(), X, X


@functools.cache
def _tutorial_reference():
    return reference_diag_ggn(*tutorial_problem())


@pytest.mark.slow
@pytest.mark.parametrize("num_chunks", [1, 3, 4, 7, 16, 64])
def test_tutorial_autoencoder(num_chunks):
    model, loss_func, X, Y = tutorial_problem()
    actual = ggnchunk.diag_ggn(model, loss_func, X, Y, num_chunks=num_chunks)
    assert_diag_close(
        actual, _tutorial_reference(), rtol=1e-5, label=f"{num_chunks} chunks"
    )


def _backpack_one_pass(model, loss_func, X, Y):
    model, loss_func = extend(model), extend(loss_func)
    with backpack(DiagGGNExact()), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        loss_func(model(X), Y).backward()
    return {n: p.diag_ggn_exact.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", ["mse", "ce", "bce[N,1]", "ce[N,C,H,W]"])
def test_equals_backpack_where_its_one_pass_works(loss, reduction):
    torch.manual_seed(0)
    if loss == "ce[N,C,H,W]":
        model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 4, 1))
        X, Y = torch.randn(3, 2, 5, 5), torch.randint(0, 4, (3, 5, 5))
    else:
        outputs = 1 if loss == "bce[N,1]" else 5
        model = nn.Sequential(nn.Linear(6, 7), nn.Sigmoid(), nn.Linear(7, outputs))
        X = torch.randn(8, 6)
        Y = {
            "mse": torch.randn(8, 5),
            "ce": torch.randint(0, 5, (8,)),
            "bce[N,1]": torch.rand(8, 1).round(),
        }[loss]
    loss_func = {
        "mse": nn.MSELoss,
        "ce": nn.CrossEntropyLoss,
        "bce[N,1]": nn.BCEWithLogitsLoss,
        "ce[N,C,H,W]": nn.CrossEntropyLoss,
    }[loss](reduction=reduction)
    ours = {
        k: ggnchunk.diag_ggn(model, loss_func, X, Y, num_chunks=k)
        for k in ((1,) if loss == "bce[N,1]" else (1, 2))  # [N, 1]: one column only
    }
    expected = _backpack_one_pass(model, loss_func, X, Y)
    for k, actual in ours.items():
        assert_diag_close(actual, expected, rtol=1e-6, label=f"{k} chunks vs BackPACK")
