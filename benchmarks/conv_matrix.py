"""Convolutions' backprop as matrix products where the kernels waste work, against them.

``python -m benchmarks.conv_matrix [--out DIR] [--repeats K]``: in one process at 1
thread, alone on the machine. The columns' backprop through a 1x1 convolution (pointwise
layers, ResNets' strided shortcuts) is a channel mix, and through a wider kernel between
one-position maps (a deep stage of a small image) the one tap that reads the input:
both as matrix products, where oneDNN's convolution kernels ran every tap over the
padding or ran the mix 2-5x slower. The internal switch is
``ggnchunk._rules.conv.MATRIX_BACKPROP``. Each ``diag_ggn`` call runs with and without,
alternating (:func:`benchmarks.ab.alternate`): one untimed call each, then the best of
``--repeats`` (default 2).

Writes ``conv_matrix.json``, ``conv_matrix.md`` and ``conv_matrix.png`` into ``--out``
(default ``benchmarks/results/conv-matrix``).
"""

from __future__ import annotations

from benchmarks import ab

NAMES = ("convolution kernels", "matrix products")  # the switch off, then on


def _resnet18_frozen(n: int) -> tuple:
    from benchmarks.problems import resnet18_frozen

    model, loss_func, x, y = resnet18_frozen()
    return model.eval(), loss_func, x[:n], y[:n]


def _resnet18(n: int) -> tuple:
    import torch
    import torchvision
    from torch import nn

    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    return (
        model,
        nn.CrossEntropyLoss(),
        torch.randn(n, 3, 32, 32),
        torch.randint(0, 10, (n,)),
    )


def _resnet50_late(n: int) -> tuple:
    """Torchvision's ResNet-50 (bottlenecks of 1x1 convolutions), ``layer3`` on trained."""
    import torch
    import torchvision
    from torch import nn

    model = torchvision.models.resnet50(weights=None, num_classes=10).eval()
    model.requires_grad_(False)
    for part in (model.layer3, model.layer4, model.fc):
        part.requires_grad_(True)
    return (
        model,
        nn.CrossEntropyLoss(),
        torch.randn(n, 3, 32, 32),
        torch.randint(0, 10, (n,)),
    )


def _lraspp_frozen(n: int) -> tuple:
    """The benchmark's partly frozen LRASPP on 32x32 images (its 64x64 one takes ~100 s)."""
    from benchmarks.problems import lraspp_frozen

    model, loss_func, x, y = lraspp_frozen(side=32)
    return model.eval(), loss_func, x[:n], y[:n]


CASES = [
    # (name, title, builder, batch, chunking)
    ("resnet18_frozen", "ResNet-18 frozen but layer1 and head, 32×32, 100 classes",
     _resnet18_frozen, 8, {}),
    ("resnet18_frozen", "ResNet-18 frozen but layer1 and head, 32×32, 100 classes",
     _resnet18_frozen, 8, {"max_memory": "22.9MiB"}),
    ("resnet18", "ResNet-18, 32×32, 10 classes", _resnet18, 8, {}),
    ("resnet50_late", "ResNet-50, layer3 on trained, 32×32, 10 classes",
     _resnet50_late, 8, {}),
    ("lraspp_frozen", "LRASPP MobileNetV3-Large partly frozen, 32×32, 3 classes",
     _lraspp_frozen, 2, {}),
]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and write the JSON, the table and the plot."""
    ab.switch_main(
        argv,
        __doc__,
        "conv_matrix",
        2,
        module="ggnchunk._rules.conv",
        switch="MATRIX_BACKPROP",
        names=NAMES,
        cases=CASES,
        title="Convolutions' backprop as matrix products (issue 21)",
        ratio="kernels / products",
    )


if __name__ == "__main__":
    main()
