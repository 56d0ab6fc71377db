"""Benchmark problems: name → builder of ``(model, loss_func, inputs, targets)``.

Every builder makes its own data (no downloads) from a fixed seed, on the given device.
``scale`` > 1 grows the batch for GPUs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Problem = tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]


def tutorial_conv_ae(scale: int = 1) -> Problem:
    """BackPACK's retain_graph tutorial: conv autoencoder on ``[5, 3, 32, 32]``, MSE."""
    x = torch.rand(5 * scale, 3, 32, 32)
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 10, 3), nn.Sigmoid()),
        nn.Sequential(nn.ConvTranspose2d(10, 3, 3)),
    )
    return model, nn.MSELoss(), x, x


def mlp_ae(scale: int = 1) -> Problem:
    """MLP autoencoder 784-256-32-256-784, batch 32, MSE."""
    x = torch.rand(32 * scale, 784)
    model = nn.Sequential(
        nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 32), nn.ReLU(),
        nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 784),
    )  # fmt: skip
    return model, nn.MSELoss(), x, x


def conv_ae_28(scale: int = 1) -> Problem:
    """Deeper conv autoencoder on ``[16, 1, 28, 28]`` with an image-shaped output, MSE."""
    x = torch.rand(16 * scale, 1, 28, 28)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(8, 1, 4, stride=2, padding=1),
    )  # fmt: skip
    return model, nn.MSELoss(), x, x


def classifier_1000(scale: int = 1) -> Problem:
    """128-256-1000 classifier, batch 64, cross-entropy."""
    x = torch.randn(64 * scale, 128)
    y = torch.randint(0, 1000, (64 * scale,))
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 1000))
    return model, nn.CrossEntropyLoss(), x, y


def segmentation(scale: int = 1) -> Problem:
    """Per-pixel 5-class cross-entropy on ``[8, 3, 16, 16]`` (5·256 columns)."""
    x = torch.randn(8 * scale, 3, 16, 16)
    y = torch.randint(0, 5, (8 * scale, 16, 16))
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 5, 1),
    )  # fmt: skip
    return model, nn.CrossEntropyLoss(), x, y


class UNet(nn.Module):
    """Two levels down, two up, ``torch.cat`` skips, GroupNorm, Upsample, SiLU."""

    def __init__(self, channels: int = 3, width: int = 8):
        super().__init__()

        def block(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU()
            )

        self.enc0 = block(channels, width)
        self.enc1 = nn.Sequential(nn.AvgPool2d(2), block(width, 2 * width))
        self.bottom = nn.Sequential(nn.AvgPool2d(2), block(2 * width, 2 * width))
        self.up1 = nn.Upsample(scale_factor=2)
        self.dec1 = block(4 * width, width)
        self.up0 = nn.Upsample(scale_factor=2)
        self.dec0 = block(2 * width, width)
        self.head = nn.Conv2d(width, channels, 1)

    def forward(self, x):  # noqa: D102
        e0 = self.enc0(x)
        e1 = self.enc1(e0)
        b = self.bottom(e1)
        d1 = self.dec1(torch.cat([self.up1(b), e1], dim=1))
        return self.head(self.dec0(torch.cat([self.up0(d1), e0], dim=1)))


def unet(scale: int = 1) -> Problem:
    """Small U-Net autoencoder on ``[2, 3, 16, 16]`` (torch.func fallback), MSE."""
    x = torch.rand(2 * scale, 3, 16, 16)
    return UNet(), nn.MSELoss(), x, x


PROBLEMS: dict[str, Callable[[int], Problem]] = {
    "tutorial_conv_ae": tutorial_conv_ae,
    "mlp_ae": mlp_ae,
    "conv_ae_28": conv_ae_28,
    "classifier_1000": classifier_1000,
    "segmentation": segmentation,
    "unet": unet,
}


def build(name: str, device: str = "cpu", scale: int = 1, seed: int = 0) -> Problem:
    """Build problem ``name`` on ``device`` from ``seed``."""
    torch.manual_seed(seed)
    model, loss_func, x, y = PROBLEMS[name](scale)
    return model.to(device).eval(), loss_func.to(device), x.to(device), y.to(device)
