"""Per-sample diagonals of linear layers by their shortcut, against squared products.

``python -m benchmarks.per_sample [--out DIR] [--repeats K]``: in one process at 1
thread, alone on the machine. ``per_sample=True`` made every layer's ``[V, N, *param]``
products and squared them; a linear layer on one position per sample whose parameters
are used nowhere else now gives each sample's diagonal as ``(sum_v g²) ⊗ x²``
(:meth:`ggnchunk.extend.Rule.diag_per_sample`; the internal switch
``ggnchunk._quantities.PER_SAMPLE_SHORTCUTS``). Wide classifier heads are where it
shows: torchvision's AlexNet and VGG-11 (found by a sweep of torchvision's models) and
a wide MLP. Each ``diag_ggn(..., per_sample=True)`` call runs with and without,
alternating (:func:`benchmarks.ab.alternate`): one untimed call each, then the best of
``--repeats`` (default 2).

Writes ``per_sample.json``, ``per_sample.md`` and ``per_sample.png`` into ``--out``
(default ``benchmarks/results/per-sample``).
"""

from __future__ import annotations

from benchmarks import ab

NAMES = ("products squared", "shortcut")  # the switch off, then on
PER_SAMPLE = {"per_sample": True}


def _mlp(n: int) -> tuple:
    """``Linear(16384, 4096)``, ReLU, ``Linear(4096, 3)``; cross-entropy."""
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(16384, 4096), nn.ReLU(), nn.Linear(4096, 3))
    return model, nn.CrossEntropyLoss(), torch.randn(n, 16384), torch.randint(0, 3, (n,))


def _torchvision(name: str, side: int):
    def build(n: int) -> tuple:
        """A torchvision classifier, ``weights=None``, 3 classes, eval."""
        import torch
        import torchvision
        from torch import nn

        model = getattr(torchvision.models, name)(weights=None, num_classes=3).eval()
        x = torch.randn(n, 3, side, side)
        return model, nn.CrossEntropyLoss(), x, torch.randint(0, 3, (n,))

    return build


CASES = [
    # (name, title, builder, batch, options)
    ("mlp", "MLP 16384-4096-3", _mlp, 2, PER_SAMPLE),
    ("alexnet", "torchvision AlexNet, 64×64, 3 classes", _torchvision("alexnet", 64), 2,
     PER_SAMPLE),
    ("vgg11", "torchvision VGG-11, 32×32, 3 classes", _torchvision("vgg11", 32), 2,
     PER_SAMPLE),
]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and write the JSON, the table and the plot."""
    ab.switch_main(
        argv,
        __doc__,
        "per_sample",
        2,
        module="ggnchunk._quantities",
        switch="PER_SAMPLE_SHORTCUTS",
        names=NAMES,
        cases=CASES,
        title="Per-sample diagonals of linear layers by their shortcut (issue 21)",
        ratio="squared / shortcut",
    )


if __name__ == "__main__":
    main()
