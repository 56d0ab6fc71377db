"""Layers on one position add their diagonal to the result in place (no weight-sized copy).

A Linear layer on feature vectors, the output layer's one-hot form (a language model's
head) and a convolution whose output is one pixel (ResNet's last stage on small images)
sum the squares over the columns first and need one product of the weight's size per
chunk. That product used to be a new tensor, then added to the
result: one weight-sized temporary per layer and chunk, which set ResNet-18's floor under
a tight budget (a one-column pass at 72-85 MiB against an 81 MiB budget, where the
result alone holds 43 MiB). Now it is written into the result (``baddbmm_``).

Each case checks that no value of the weight's size reached the result as a tensor of
its own, and the diagonal against the float64 brute force in several chunkings; a
retried chunk (out of memory in a later layer) must not add twice.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ggnchunk
from tests.reference import assert_diag_close, reference_diag_ggn


def _linear():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 37), nn.Tanh(), nn.Linear(37, 211), nn.Tanh(), nn.Linear(211, 6)
    ).double()
    x = torch.randn(3, 5, dtype=torch.float64)
    return model, nn.MSELoss(), x, torch.randn(3, 6, dtype=torch.float64), model[2]


def _head():
    """The model output's layer: its diagonal from the one-hot mask (MSE)."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(5, 37), nn.Tanh(), nn.Linear(37, 211)).double()
    x = torch.randn(3, 5, dtype=torch.float64)
    return model, nn.MSELoss(), x, torch.randn(3, 211, dtype=torch.float64), model[2]


def _conv_one_pixel():
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(2, 29, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(29, 41, 3, stride=2, padding=1),  # 2x2 -> one pixel
        nn.Flatten(),
        nn.Linear(41, 4),
    ).double()
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    return model, nn.CrossEntropyLoss(), x, torch.tensor([0, 3, 1]), model[2]


CASES = {"linear": _linear, "head": _head, "conv-one-pixel": _conv_one_pixel}
CHUNKINGS = [{}, {"num_chunks": 3}, {"chunk_size": 1}]


def _added_values(monkeypatch) -> list[tuple[int, tuple[int, ...]]]:
    """Spy: the (index, shape) of every value the quantity adds to its result."""
    from ggnchunk._quantities import DiagonalGGN

    added = []
    original = DiagonalGGN._add

    def add(self, index, value):
        added.append((index, tuple(value.shape)))
        return original(self, index, value)

    monkeypatch.setattr(DiagonalGGN, "_add", add)
    return added


@pytest.mark.parametrize("chunking", CHUNKINGS, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_one_position_adds_in_place_exactly(case, chunking, monkeypatch):
    model, loss, x, y, layer = CASES[case]()
    expected = reference_diag_ggn(model, loss, x, y)
    added = _added_values(monkeypatch)
    diag = ggnchunk.diag_ggn(model, loss, x, y, **chunking)
    assert_diag_close(diag, expected, 1e-10, f"{case} {chunking}")
    index = [p is layer.weight for p in model.parameters()].index(True)
    # the weight's value was never a tensor of its own: written into the result
    assert [shape for i, shape in added if i == index] == [], (case, chunking)
    assert any(i != index for i, _ in added)  # the other parameters still add values


def test_a_retried_chunk_adds_once(monkeypatch):
    """Out of memory after the in-place layer: the retried halves must not add again."""
    from ggnchunk._rules.linear import LinearRule

    model, loss, x, y, _ = _linear()
    expected = reference_diag_ggn(model, loss, x, y)
    original = LinearRule.diag
    failed = []

    def diag(self, ctx, grads):
        if ctx.module is model[0] and grads.shape[0] > 1 and not failed:
            failed.append(grads.shape[0])  # after the last layer added in place
            raise torch.OutOfMemoryError("simulated")
        return original(self, ctx, grads)

    monkeypatch.setattr(LinearRule, "diag", diag)
    with pytest.warns(ggnchunk.OutOfMemoryRecoveryWarning):
        diag_ = ggnchunk.diag_ggn(model, loss, x, y, num_chunks=1)
    assert failed, "the simulated out-of-memory error was never raised"
    assert_diag_close(diag_, expected, 1e-10, "retried")
