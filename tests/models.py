"""Models beyond BackPACK's layers: normalizations, upsampling, skips, a small U-Net."""

from __future__ import annotations

import torch
from torch import nn


class Residual(nn.Module):
    """``x + f(x)``: a residual skip."""

    def __init__(self, channels: int):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.SiLU())

    def forward(self, x):
        return x + self.f(x)


class UNet(nn.Module):
    """Two levels down, two up, ``torch.cat`` skips, GroupNorm, Upsample, SiLU."""

    def __init__(self, channels: int = 2, width: int = 4):
        super().__init__()

        def block(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.SiLU()
            )

        self.enc0 = block(channels, width)
        self.enc1 = nn.Sequential(nn.AvgPool2d(2), block(width, 2 * width))
        self.bottom = nn.Sequential(nn.MaxPool2d(2), block(2 * width, 2 * width))
        self.up1 = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec1 = block(4 * width, width)
        self.up0 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.dec0 = block(2 * width, width)
        self.head = nn.Conv2d(width, channels, 1)

    def forward(self, x):
        e0 = self.enc0(x)
        e1 = self.enc1(e0)
        b = self.bottom(e1)
        d1 = self.dec1(torch.cat([self.up1(b), e1], dim=1))
        d0 = self.dec0(torch.cat([self.up0(d1), e0], dim=1))
        return self.head(d0)


class Chain(nn.Module):
    """A custom container whose forward only chains its children (BackPACK path)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 5), nn.Tanh())
        self.decoder = nn.Linear(5, 6)

    def forward(self, x):
        return self.decoder(self.encoder(x))


class Functional(nn.Module):
    """Functional calls between layers and a layer called twice: fallback unit."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.ones(6))

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = self.a(h).view(-1, 6) * self.scale
        return self.b(torch.tanh(h))


class PerSampleBlock(nn.Module):
    """A user-defined block with its own parameter and arbitrary per-sample math."""

    def __init__(self, features: int):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return torch.sin(x) * self.gain + x.pow(2).mean(dim=-1, keepdim=True)


class ScalarGated(nn.Module):
    """ReZero-style residual and a temperature: learned 0-d parameters in the glue."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.c = nn.Conv2d(4, 3, 3, padding=1)
        self.alpha = nn.Parameter(torch.tensor(0.7))
        self.temperature = nn.Parameter(torch.tensor(1.3))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = h + self.alpha * torch.relu(self.b(h))
        return self.c(h) / self.temperature
