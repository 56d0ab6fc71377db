"""Shared by the experiments: scikit-learn's bundled 8×8 digits, a conv autoencoder."""

from __future__ import annotations

import torch
from torch import nn


def digits(n: int | None = None) -> torch.Tensor:
    """The 1,797 bundled 8×8 digits (no download), scaled to [0, 1]: ``[N, 1, 8, 8]``."""
    from sklearn.datasets import load_digits

    images = torch.tensor(load_digits().images, dtype=torch.float32) / 16.0
    return images[:n].unsqueeze(1)


def autoencoder() -> nn.Module:
    """Conv encoder 8×8 → 4×4 → 2×2, transposed-conv decoder back; flat 64-pixel output."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(8, 8, 2, stride=2), nn.ReLU(),
        nn.ConvTranspose2d(8, 1, 2, stride=2), nn.Flatten(),
    )  # fmt: skip


def train(
    model: nn.Module, x: torch.Tensor, steps: int = 300, seed: int = 0
) -> list[float]:
    """Adam on the mean squared reconstruction error; returns the losses."""
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        batch = x[torch.randint(0, x.shape[0], (64,))]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(batch), batch.flatten(1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
