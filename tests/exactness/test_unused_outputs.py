"""Layers whose output is computed and dropped (unused features, a discarded branch).

Such a layer is the last consumer (in call order) of its input, but no vectors reach
it: the vectors the input's other consumers left there must still cross on. Before,
they waited for it and were dropped, and every earlier layer's diagonal came out zero,
silently (timm's ``features_only`` encoders compute every stage, a U-Net may use a few).
Each case against the float64 brute force, in every chunking, windowed and dense.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ggnchunk
from ggnchunk import _windows
from tests.reference import assert_diag_close, reference_diag_ggn


class Dropped(nn.Module):
    """``later`` reads ``h`` and is thrown away; ``head`` reads ``h`` and is the output.

    ``order``: whether the dropped layer runs before or after the used one, and
    ``frozen``: whether its parameters train.
    """

    def __init__(self, order: str, frozen: bool, glue: bool):
        super().__init__()
        self.order, self.glue = order, glue
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.later = nn.Conv2d(3, 3, 3, padding=1)
        self.deeper = nn.Conv2d(3, 3, 1)
        self.head = nn.Conv2d(3, 2, 1)
        if frozen:
            self.later.requires_grad_(False)
            self.deeper.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        if self.glue:  # the region between conv and its consumers is glue
            h = h * 2 + 1
        if self.order == "dropped-first":
            _ = self.deeper(torch.relu(self.later(h)))
            return self.head(h)
        out = self.head(h)
        _ = self.deeper(torch.relu(self.later(h)))
        return out


class Features(nn.Module):
    """A ``features_only``-style encoder: every stage runs, the decoder uses the first."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU()
        )
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.SiLU())
            for _ in range(2)
        )
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        feats = [self.stem(x)]
        for stage in self.stages:
            feats.append(stage(feats[-1]))
        return self.head(feats[0])


CASES = {
    f"{order}-{'frozen' if frozen else 'trained'}-{'glue' if glue else 'direct'}": (
        lambda order=order, frozen=frozen, glue=glue: Dropped(order, frozen, glue)
    )
    for order in ("dropped-first", "dropped-last")
    for frozen in (False, True)
    for glue in (False, True)
}
CASES["features-only"] = Features
OPTIONS = {
    "onepass": {},
    "chunks3": {"num_chunks": 3},
    "budget": {"max_memory": "64MiB"},
    "batch_chunks": {"batch_chunk_size": 1, "num_chunks": 2},
}


@pytest.mark.filterwarnings("ignore::ggnchunk.MemoryBudgetWarning")
@pytest.mark.parametrize("windows", [False, True], ids=["dense", "windowed"])
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("case", CASES)
def test_dropped_outputs_leave_earlier_layers_exact(case, options, windows, monkeypatch):
    monkeypatch.setattr(_windows, "ENABLED", windows)
    monkeypatch.setattr(_windows, "MIN_POSITIONS", 0)
    monkeypatch.setattr(_windows, "TRIAL", False)
    torch.manual_seed(0)
    model = CASES[case]().double().eval()
    x = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    targets = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    got = ggnchunk.diag_ggn(model, nn.MSELoss(), x, targets, **OPTIONS[options])
    expected = reference_diag_ggn(model, nn.MSELoss(), x, targets)
    assert_diag_close(got, expected, rtol=1e-10, label=f"{case} {options} {windows}")
    assert (
        float(got["conv.weight" if "conv.weight" in got else "stem.0.weight"].abs().max())
        > 0
    )
