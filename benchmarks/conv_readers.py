"""Glue convolutions' weights read per sample off one pass, against a pass per sample.

``python -m benchmarks.conv_readers [--out DIR] [--repeats K]``: in one process at 1
thread, alone on the machine. A convolution whose weight is computed in ``forward``
(timm's ``StdConv2d`` in BiT's ResNetV2, weight norm in audio vocoders) is glue: its
parameters' products were taken one backward pass per sample. Now one grouped weight
gradient per convolution gives every sample's, carried back through the weight's
computation (:mod:`ggnchunk._graph.readers`; the internal switch
``ggnchunk._graph.readers.READ_CONV_WEIGHTS``). HiFi-GAN's generator upsamples with
weight-normed transposed convolutions: those are read the same way, and their input's
backward runs on all columns at once (torch's batching looped over the columns); its
rows switch both (``ggnchunk._glue_kernels.TRANSPOSED_CONVS``). Each ``diag_ggn`` call
runs with and without, alternating (:func:`benchmarks.ab.alternate`): one untimed call
each, then the best of ``--repeats`` (default 1).

Writes ``conv_readers.json``, ``conv_readers.md`` and ``conv_readers.png`` into ``--out``
(default ``benchmarks/results/conv-readers``).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import ab

NAMES = ("one pass per sample", "read per sample")  # the switch off, then on


def _std_conv(c_in: int, c_out: int, k: int, stride: int = 1):
    import torch.nn.functional as F
    from torch import nn

    class StdConv2d(nn.Conv2d):  # timm's, as timm writes its forward
        def forward(self, x):
            weight = F.batch_norm(
                self.weight.reshape(1, self.out_channels, -1), None, None,
                training=True, momentum=0.0, eps=1e-6,
            ).reshape_as(self.weight)  # fmt: skip
            return F.conv2d(x, weight, self.bias, self.stride, self.padding)

    return StdConv2d(c_in, c_out, k, stride=stride, padding=k // 2, bias=False)


def _bit(n: int) -> tuple:
    """A BiT-style pre-activation ResNet: StdConv2d, GroupNorm, 3 stages, 10 classes."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, c_in: int, c_out: int):
            super().__init__()
            self.norm1, self.norm2 = nn.GroupNorm(8, c_in), nn.GroupNorm(8, c_out)
            self.conv1 = _std_conv(c_in, c_out, 3, 2)
            self.conv2 = _std_conv(c_out, c_out, 3)
            self.short = _std_conv(c_in, c_out, 1, 2)

        def forward(self, x):
            h = torch.relu(self.norm1(x))
            return self.short(h) + self.conv2(torch.relu(self.norm2(self.conv1(h))))

    model = nn.Sequential(
        _std_conv(3, 16, 3), Block(16, 32), Block(32, 64), Block(64, 64),
        nn.GroupNorm(8, 64), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, 10),
    ).eval()  # fmt: skip
    return (
        model,
        nn.CrossEntropyLoss(),
        torch.randn(n, 3, 32, 32),
        torch.randint(0, 10, (n,)),
    )


def _vocoder(n: int) -> tuple:
    """Weight-normed 1-d convolutions (HiFi-GAN-style), 256 steps, MSE."""
    import torch
    from torch import nn
    from torch.nn.utils.parametrizations import weight_norm

    model = nn.Sequential(
        weight_norm(nn.Conv1d(1, 16, 7, padding=3)), nn.LeakyReLU(0.1),
        weight_norm(nn.Conv1d(16, 16, 7, padding=3)), nn.LeakyReLU(0.1),
        weight_norm(nn.Conv1d(16, 1, 7, padding=3)),
    ).eval()  # fmt: skip
    return model, nn.MSELoss(), torch.randn(n, 1, 256), torch.randn(n, 1, 256)


def _hifigan(n: int) -> tuple:
    """HiFi-GAN's generator, small: weight-normed ``ConvTranspose1d`` upsampling ×4 ×4.

    As HiFi-GAN writes it: a weight-normed ``Conv1d`` in (kernel 7), per stage a
    weight-normed transposed convolution (kernel ``2u``, stride ``u``, padding ``u/2``)
    and a residual block of two dilated weight-normed convolutions with leaky ReLUs,
    a weight-normed ``Conv1d`` out and ``tanh``; 8 mel bins of 16 frames to 256 samples,
    MSE per sample.
    """
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.utils.parametrizations import weight_norm

    class ResBlock(nn.Module):
        def __init__(self, channels: int):
            super().__init__()
            self.convs = nn.ModuleList(
                weight_norm(nn.Conv1d(channels, channels, 3, dilation=d, padding=d))
                for d in (1, 3)
            )

        def forward(self, x):
            for conv in self.convs:
                x = x + conv(F.leaky_relu(x, 0.1))
            return x

    class Generator(nn.Module):
        def __init__(self, mels: int = 8, channels: int = 32, rates=(4, 4)):
            super().__init__()
            self.pre = weight_norm(nn.Conv1d(mels, channels, 7, padding=3))
            self.ups, self.blocks = nn.ModuleList(), nn.ModuleList()
            for i, u in enumerate(rates):
                c_in, c_out = channels // 2**i, channels // 2 ** (i + 1)
                self.ups.append(
                    weight_norm(nn.ConvTranspose1d(c_in, c_out, 2 * u, u, padding=u // 2))
                )
                self.blocks.append(ResBlock(c_out))
            self.post = weight_norm(nn.Conv1d(c_out, 1, 7, padding=3))

        def forward(self, x):
            x = self.pre(x)
            for up, block in zip(self.ups, self.blocks, strict=True):
                x = block(up(F.leaky_relu(x, 0.1)))
            return torch.tanh(self.post(F.leaky_relu(x)))

    model = Generator().eval()
    x = torch.randn(n, 8, 16)
    return model, nn.MSELoss(), x, torch.randn(n, 1, 256)


# HiFi-GAN's rows compare the transposed convolutions' switch (their weights read and
# their backward folded, or neither), the others the readers' switch
TRANSPOSED = "transposed"
CASES = [
    # (name, title, builder, batch, chunking[, switch])
    ("bit", "BiT-style ResNet (StdConv2d, GroupNorm), 32×32", _bit, 8, {}),
    ("bit", "BiT-style ResNet (StdConv2d, GroupNorm), 32×32", _bit, 32, {}),
    ("bit", "BiT-style ResNet (StdConv2d, GroupNorm), 32×32", _bit, 32,
     {"max_memory": "256MiB"}),
    ("vocoder", "weight-normed Conv1d stack, 256 steps", _vocoder, 4, {}),
    ("vocoder", "weight-normed Conv1d stack, 256 steps", _vocoder, 16, {}),
    ("hifigan", "HiFi-GAN generator (weight-normed ConvTranspose1d), 256 samples",
     _hifigan, 4, {}, TRANSPOSED),
    ("hifigan", "HiFi-GAN generator (weight-normed ConvTranspose1d), 256 samples",
     _hifigan, 16, {"max_memory": "128MiB"}, TRANSPOSED),
]  # fmt: skip


def _rows(repeats: int) -> list[dict]:
    from ggnchunk import _glue_kernels
    from ggnchunk._graph import readers

    return [
        ab.case_row(_glue_kernels, "TRANSPOSED_CONVS", NAMES, case, repeats)
        if case[5:] == (TRANSPOSED,)
        else ab.case_row(readers, "READ_CONV_WEIGHTS", NAMES, case, repeats)
        for case in CASES
    ]


def _table(rows: list[dict], environment: dict) -> str:
    return ab.table(
        "Convolutions' weights in the glue read per sample (issue 21)", "", environment,
        rows, NAMES, (*NAMES, "per sample / read"), batch=True,
    )  # fmt: skip


def _plot(rows: list[dict], path: Path) -> None:
    ab.batch_bars(rows, NAMES, path)


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and write the JSON, the table and the plot."""
    ab.main(argv, __doc__, "conv_readers", 1, _rows, _table, _plot)


if __name__ == "__main__":
    main()
