"""Every public chunking mode on problems with 1, 2 and 3 columns (issue: IndexError).

Regression with 1–3 outputs, binary classification (BCE, one column) and 2- and 3-class
cross-entropy: ``num_chunks`` and ``chunk_size`` from 1 to beyond the column count
(clamped), ``max_memory``, ``"auto"``, ``batch_chunk_size``, through ``diag_ggn`` and
``diag_ggn_dataset``; each against the float64 brute force.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ggnchunk
from tests.reference import assert_diag_close, reference_diag_ggn

MODES = [
    {"num_chunks": 1}, {"num_chunks": 2}, {"num_chunks": 3}, {"num_chunks": 8},
    {"chunk_size": 1}, {"chunk_size": 2}, {"chunk_size": 5},
    {"max_memory": "64MiB"}, {"chunk_size": "auto"},
    {"chunk_size": "auto", "max_memory": "64MiB"},
    {"max_memory": "64MiB", "batch_chunk_size": 3},
    {"num_chunks": 2, "batch_chunk_size": 1},
]  # fmt: skip


def _problem(kind: str, outputs: int):
    torch.manual_seed(outputs)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, outputs)).double()
    x = torch.randn(7, 3, dtype=torch.float64)
    if kind == "mse":
        return model, nn.MSELoss(), x, torch.randn(7, outputs, dtype=torch.float64)
    if kind == "bce":
        return model, nn.BCEWithLogitsLoss(), x, torch.rand(7, outputs).round().double()
    return model, nn.CrossEntropyLoss(), x, torch.randint(0, outputs, (7,))


PROBLEMS = [("mse", 1), ("mse", 2), ("mse", 3), ("bce", 1), ("ce", 2), ("ce", 3)]


@pytest.mark.parametrize(
    "kwargs", MODES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items())
)
@pytest.mark.parametrize(
    ("kind", "outputs"), PROBLEMS, ids=[f"{k}{o}" for k, o in PROBLEMS]
)
def test_every_mode_on_few_columns(kind, outputs, kwargs):
    model, loss_func, x, y = _problem(kind, outputs)
    expected = reference_diag_ggn(model, loss_func, x, y)
    ggnchunk.clear_autotune_cache()
    actual, report = ggnchunk.diag_ggn(model, loss_func, x, y, return_report=True, **kwargs)
    assert_diag_close(actual, expected, rtol=1e-10, label=str(kwargs))
    assert report.chunk_size <= report.num_columns
    if "num_chunks" in kwargs and "batch_chunk_size" not in kwargs:
        assert report.num_passes == min(kwargs["num_chunks"], report.num_columns)


@pytest.mark.parametrize("kwargs", [{"num_chunks": 4}, {"max_memory": "64MiB"},
                                    {"chunk_size": "auto"}])  # fmt: skip
@pytest.mark.parametrize(("kind", "outputs"), [("mse", 1), ("ce", 2), ("ce", 3)])
def test_dataset_on_few_columns(kind, outputs, kwargs):
    model, loss_func, x, y = _problem(kind, outputs)
    loss_func = type(loss_func)(reduction="sum")
    expected = reference_diag_ggn(model, loss_func, x, y)
    batches = [(x[i : i + 3], y[i : i + 3]) for i in range(0, 7, 3)]
    actual = ggnchunk.diag_ggn_dataset(model, loss_func, batches, progress=False, **kwargs)
    assert_diag_close(actual, expected, rtol=1e-10, label=str(kwargs))
