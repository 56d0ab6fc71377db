"""Columns below a wide head replaced by fewer with the same Gram, against all kept (#21).

``python -m benchmarks.compress [--out DIR] [--repeats K]``: in one process at 1 thread,
alone on the machine. Below a language model's head a token's ``C`` columns (one per
word) span the head's ``D``-wide input; the sweep replaces them by each token's QR factor
(:mod:`ggnchunk._graph.compress`; the internal switch
``ggnchunk._graph.sweep.COMPRESS``). Each ``diag_ggn`` call runs with and without,
alternating (:func:`benchmarks.ab.alternate`): one untimed call each, then the best of
``--repeats`` (default 1).

Writes ``compress.json``, ``compress.md`` and ``compress.png`` into ``--out`` (default
``benchmarks/results/compress``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import ab

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
]


def _rows(repeats: int) -> list[dict]:
    import json

    import torch

    import ggnchunk
    from benchmarks import problems
    from ggnchunk._graph import sweep

    def switch(on: bool):
        def set_() -> None:
            sweep.COMPRESS = on

        return set_

    rows = []
    for name, title, chunking in CASES:
        torch.manual_seed(0)
        model, loss_func, x, y = problems.build(name)
        paths = {"every column": switch(False), "fewer columns": switch(True)}
        try:
            result = ab.alternate(
                paths,
                lambda m=model, f=loss_func, x=x, y=y, c=chunking: ggnchunk.diag_ggn(
                    m, f, x, y, return_report=True, **c
                ),
                repeats,
            )
        finally:
            sweep.COMPRESS = True
        row = {
            "problem": title, "name": name, "chunking": chunking,
            "max_relative_gap_float32": ab.relative_gap(
                result["every column"]["diag"], result["fewer columns"]["diag"]
            ),
        }  # fmt: skip
        for path in paths:
            result[path].pop("diag")
            row[path] = result[path]
        row["speedup"] = row["every column"]["seconds"] / row["fewer columns"]["seconds"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _table(rows: list[dict], environment: dict) -> str:
    lines = [
        "# Columns below a wide head replaced by fewer with the same Gram (issue 21)",
        "",
        f"1 thread, {environment['machine']}, torch {environment['torch']}, commit "
        f"{environment['commit']}, alone on the machine; float32; best of "
        f"{environment['repeats']} after an untimed call, the two paths alternating in "
        "one process. JSON beside this file.",
        "",
        "| problem | chunking | every column | fewer columns | speed-up | passes | peak "
        "(every / fewer) | float32 relative gap |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        a, b = r["every column"], r["fewer columns"]
        peaks = "/".join(
            "–" if p["peak_mib"] is None else f"{p['peak_mib']:.0f}" for p in (a, b)
        )
        chunking = ", ".join(f"{k}={v}" for k, v in r["chunking"].items()) or "one pass"
        lines.append(
            f"| {r['problem']} | {chunking} | {a['seconds']:.2f} s | {b['seconds']:.2f} s "
            f"| {r['speedup']:.1f}× | {a['passes']} / {b['passes']} | {peaks} MiB "
            f"| {r['max_relative_gap_float32']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["every column"]["seconds"] for r in rows], 0.4,
           label="every column")  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [r["fewer columns"]["seconds"] for r in rows], 0.4,
           label="fewer columns, same Gram")  # fmt: skip
    ax.set_xticks(list(xs), [r["name"] for r in rows])
    ax.set_ylabel("seconds (1 thread)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and write the JSON, the table and the plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/compress")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    environment = ab.environment(args.repeats)
    rows = _rows(args.repeats)
    record = {"environment": environment, "rows": rows}
    table = _table(rows, environment)
    ab.write(Path(args.out), "compress", record, table, lambda p: _plot(rows, p))


if __name__ == "__main__":
    main()
