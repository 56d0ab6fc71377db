"""Columns replaced by fewer with the same Gram, against all kept (#21).

``python -m benchmarks.compress [--out DIR] [--repeats K]``: in one process at 1 thread,
alone on the machine. Below a language model's head a token's ``C`` columns (one per
word) span the head's ``D``-wide input; the sweep replaces them by each token's QR factor.
Below a segmenter's final resize the columns (one per pixel and class) span the small
maps' directions; the sweep replaces the vectors at every place it holds together
(:mod:`ggnchunk._graph.compress`; the internal switch
``ggnchunk._graph.sweep.COMPRESS``); in chunks, the passes stop there and their
Gram's factor goes on below (``Cut``, the same switch). Each ``diag_ggn`` call runs with
and without, alternating (:func:`benchmarks.ab.alternate`): one untimed call each, then
the best of ``--repeats`` (default 1).

Writes ``compress.json``, ``compress.md`` and ``compress.png`` into ``--out`` (default
``benchmarks/results/compress``).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import ab

NAMES = ("every column", "fewer columns")  # the switch off, then on

CASES = [
    # (problem, title, chunking)
    (
        "tiny_gpt",
        "GPT-2-style LM, vocabulary 1,000, width 64, 2×32 tokens",
        {"num_chunks": 16},
    ),
    (
        "gpt_eager",
        "GPT-2-style LM, eager attention, vocabulary 200, 16 tokens",
        {"max_memory": "48MiB"},
    ),
    ("classifier_1000", "classifier 128-256-1000, N=64", {}),
    # segmenters: a column per pixel and class, the small maps' directions below the
    # final resize (every place the sweep holds replaced together)
    ("lraspp_frozen", "torchvision LRASPP, partly frozen, 2×3×64×64", {}),
    # in chunks (a budget's passes, num_chunks): the passes stop below the resize and
    # their Gram's factor is swept below once (:class:`ggnchunk._graph.compress.Cut`)
    ("lraspp_frozen", "the same, max_memory=512MiB", {"max_memory": "512MiB"}),
    ("lraspp_frozen", "the same, num_chunks=8", {"num_chunks": 8}),
    ("deeplab_frozen", "torchvision DeepLabV3-MobileNetV3, partly frozen, 2×3×32×32", {}),
    ("deeplab_frozen", "the same, max_memory=256MiB", {"max_memory": "256MiB"}),
]


def _rows(repeats: int) -> list[dict]:
    import torch

    from benchmarks import problems
    from ggnchunk._graph import sweep

    rows = []
    for name, title, chunking in CASES:
        torch.manual_seed(0)
        rows.append(
            ab.compare(
                sweep,
                "COMPRESS",
                NAMES,
                problems.build(name),
                chunking,
                repeats,
                problem=title,
                name=name,
            )
        )
    return rows


def _table(rows: list[dict], environment: dict) -> str:
    return ab.table(
        "Columns replaced by fewer with the same Gram (issue 21)", "",
        environment, rows, NAMES, ("every column", "fewer columns", "every / fewer"),
    )  # fmt: skip


def _plot(rows: list[dict], path: Path) -> None:
    def label(row: dict) -> str:
        chunking = row["chunking"]
        if "max_memory" in chunking:
            return f"{row['name']} (budget)"
        if "num_chunks" in chunking and row["name"].startswith(("lraspp", "deeplab")):
            return f"{row['name']} ({chunking['num_chunks']} chunks)"
        return row["name"]

    labels = [label(r) for r in rows]
    ab.bars(rows, NAMES, ("every column", "fewer columns, same Gram"), labels, path)


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and write the JSON, the table and the plot."""
    ab.main(argv, __doc__, "compress", 1, _rows, _table, _plot)


if __name__ == "__main__":
    main()
