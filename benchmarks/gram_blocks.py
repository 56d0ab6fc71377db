"""The Gram form's column Gram matrices from cache-sized blocks, against one product.

``python -m benchmarks.gram_blocks [--out DIR] [--repeats K]``: in one process at 1
thread, alone on the machine. A layer's diagonal in the Gram form needs, per sample and
output channel, the columns' ``P x P`` Gram matrix; over few positions (a deep stage's
2x2 or 3x3 maps) one batched product over the chunk's strided columns ran at about
1 GFLOP/s. From blocks of columns copied to cache-sized ``[M, P, s]`` slabs it is 3-6x
faster (:func:`ggnchunk._rules.kernels._blocked_gram`; the internal switch
``ggnchunk._rules.kernels.BLOCKED_GRAM``). Each ``diag_ggn`` call runs with and
without, alternating (:func:`benchmarks.ab.alternate`): one untimed call each, then the
best of ``--repeats`` (default 2).

Writes ``gram_blocks.json``, ``gram_blocks.md`` and ``gram_blocks.png`` into ``--out``
(default ``benchmarks/results/gram-blocks``).
"""

from __future__ import annotations

from benchmarks import ab

NAMES = ("one product", "blocks of columns")  # the switch off, then on


def _lraspp_frozen(side: int):
    def build(n: int) -> tuple:
        from benchmarks.problems import lraspp_frozen

        model, loss_func, x, y = lraspp_frozen(side=side)
        return model.eval(), loss_func, x[:n], y[:n]

    return build


def _problem(name: str):
    def build(n: int) -> tuple:
        from benchmarks.problems import PROBLEMS

        model, loss_func, x, y = PROBLEMS[name]()
        return model.eval(), loss_func, x[:n], y[:n]

    return build


CASES = [
    # (name, title, builder, batch, chunking)
    ("lraspp_frozen", "LRASPP MobileNetV3-Large partly frozen, 32×32, 3 classes",
     _lraspp_frozen(32), 2, {}),
    ("lraspp_frozen", "LRASPP MobileNetV3-Large partly frozen, 48×48, 3 classes",
     _lraspp_frozen(48), 2, {}),
    ("segmentation", "segmentation 8×3×16×16, 5 classes", _problem("segmentation"), 8,
     {}),
    ("resnet18", "ResNet-18, 8×3×32×32, 10 classes", _problem("resnet18"), 8,
     {"max_memory": "81.2MiB"}),
    ("unet_32", "U-Net 4×3×32×32, width 16", _problem("unet_32"), 4,
     {"max_memory": "300MiB"}),
]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and write the JSON, the table and the plot."""
    ab.switch_main(
        argv,
        __doc__,
        "gram_blocks",
        2,
        module="ggnchunk._rules.kernels",
        switch="BLOCKED_GRAM",
        names=NAMES,
        cases=CASES,
        title="Gram matrices of few positions from blocks of columns (issue 21)",
        ratio="one / blocks",
    )


if __name__ == "__main__":
    main()
