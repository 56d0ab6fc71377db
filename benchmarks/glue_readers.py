"""Glue parameters read per sample off one pass against one pass per sample (issue 21).

``python -m benchmarks.glue_readers [--out DIR] [--repeats K] [--quick]``: in one
process at 1 thread, alone on the machine. Models others wrote, whose parameters are
partly used in the glue: torchvision's ViT (a class token, a position table,
``nn.MultiheadAttention``'s projections), torchvision's ConvNeXt (``LayerNorm2d``, layer
scales) and torch's own ``nn.TransformerEncoder`` (``nn.MultiheadAttention``). Each
``diag_ggn`` call runs with the readers (:mod:`ggnchunk._graph.readers`) and without
them (the internal switch ``ggnchunk._graph.checks.READ_PER_SAMPLE``: one backward pass
through the glue region per sample), alternating: one untimed call each, then the best
of three (one with ``--quick``), at two batch sizes, in one pass and under a budget.

Writes ``glue_readers.json``, ``glue_readers.md`` and ``glue_readers.png`` into ``--out``
(default ``benchmarks/results/glue-readers``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks import ab

BATCHES = (8, 32)
CHUNKINGS = ({}, {"max_memory": "256MiB"})


def _models() -> dict:
    import torch
    from torch import nn
    from torchvision.models import VisionTransformer
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    class Encoder(nn.Module):
        """Token ids → ``nn.TransformerEncoder`` (2 layers, width 64) → mean → head."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(1000, 64)
            layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(64, 10)

        def forward(self, ids):
            return self.head(self.encoder(self.embed(ids)).mean(1))

    def images(n: int) -> torch.Tensor:
        return torch.randn(n, 3, 32, 32)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, 1000, (n, 32))

    def vit() -> nn.Module:
        return VisionTransformer(
            image_size=32, patch_size=4, num_layers=4, num_heads=2, hidden_dim=64,
            mlp_dim=128, num_classes=10,
        )  # fmt: skip

    def convnext() -> nn.Module:
        stages = [CNBlockConfig(16, 32, 2), CNBlockConfig(32, 64, 2)]
        return ConvNeXt([*stages, CNBlockConfig(64, None, 2)], num_classes=10)

    return {
        "torchvision ViT (32×32, patch 4, 4 layers, width 64)": (vit, images),
        "torchvision ConvNeXt (3 stages of 2 blocks, 16-64 channels)": (convnext, images),
        "nn.TransformerEncoder (2 layers, width 64, 32 tokens)": (Encoder, tokens),
    }


def _rows(repeats: int) -> list[dict]:
    import torch
    from torch import nn

    import ggnchunk
    from ggnchunk._graph import checks

    rows = []
    for name, (make, inputs) in _models().items():
        for n in BATCHES:
            torch.manual_seed(0)
            model = make().eval()
            x = inputs(n)
            y = torch.randint(0, 10, (n,))
            loss_func = nn.CrossEntropyLoss()
            for kwargs in CHUNKINGS:
                seconds = {"per sample": [], "readers": []}
                result = {}
                for round_ in range(repeats + 1):
                    for path in ("per sample", "readers"):
                        checks.READ_PER_SAMPLE = path == "readers"
                        start = time.perf_counter()
                        diag, report = ggnchunk.diag_ggn(
                            model, loss_func, x, y, return_report=True, **kwargs
                        )
                        if round_:  # the first round is untimed
                            seconds[path].append(time.perf_counter() - start)
                        peak = report.peak_extra_bytes
                        result[path] = {
                            "passes": report.num_passes,
                            "peak_mib": None if peak is None else peak / 2**20,
                            "diag": diag,
                        }
                checks.READ_PER_SAMPLE = True
                gap = max(
                    float(
                        (result["per sample"]["diag"][k] - result["readers"]["diag"][k])
                        .abs()
                        .max()
                        / result["per sample"]["diag"][k].abs().max().clamp_min(1e-30)
                    )
                    for k in result["readers"]["diag"]
                )
                row = {"problem": name, "batch": n, "chunking": kwargs,
                       "max_relative_gap_float32": gap}  # fmt: skip
                for path in ("per sample", "readers"):
                    result[path].pop("diag")
                    row[path] = {"seconds": min(seconds[path]),
                                 "all_seconds": seconds[path], **result[path]}  # fmt: skip
                row["speedup"] = row["per sample"]["seconds"] / row["readers"]["seconds"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def _table(rows: list[dict], environment: dict) -> str:
    lines = [
        "# Glue parameters read per sample off one pass (issue 21)",
        "",
        f"1 thread, {environment['machine']}, torch {environment['torch']}, commit "
        f"{environment['commit']}, alone on the machine; float32, cross-entropy, 10 "
        f"classes; best of {environment['repeats']} after an untimed call, the two paths "
        "alternating in one process. *per sample*: one backward pass through the glue "
        "region per sample (the internal switch off); *readers*: every sample's products "
        "off one pass to the parameters' readers. JSON beside this file.",
        "",
        "| problem | N | chunking | per sample | readers | speed-up | passes | peak "
        "(per sample / readers) | float32 relative gap |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        a, b = r["per sample"], r["readers"]
        peaks = "/".join(
            "–" if p["peak_mib"] is None else f"{p['peak_mib']:.0f}" for p in (a, b)
        )
        chunking = ", ".join(f"{k}={v}" for k, v in r["chunking"].items()) or "one pass"
        lines.append(
            f"| {r['problem']} | {r['batch']} | {chunking} | {a['seconds']:.2f} s "
            f"| {b['seconds']:.2f} s | {r['speedup']:.1f}× | {a['passes']} / "
            f"{b['passes']} | {peaks} MiB | {r['max_relative_gap_float32']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = list(dict.fromkeys(r["problem"] for r in rows))
    fig, axes = plt.subplots(1, len(problems), figsize=(5 * len(problems), 4))
    for ax, problem in zip(axes, problems, strict=True):
        mine = [r for r in rows if r["problem"] == problem]
        labels = [
            f"N={r['batch']}\n{'budget' if r['chunking'] else 'one pass'}" for r in mine
        ]
        xs = range(len(mine))
        ax.bar([x - 0.2 for x in xs], [r["per sample"]["seconds"] for r in mine], 0.4,
               label="one pass per sample")  # fmt: skip
        ax.bar([x + 0.2 for x in xs], [r["readers"]["seconds"] for r in mine], 0.4,
               label="readers")  # fmt: skip
        ax.set_xticks(list(xs), labels)
        ax.set_yscale("log")
        ax.set_ylabel("seconds (1 thread)")
        ax.set_title(problem.split(" (")[0])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and write the JSON, the table and the plot."""
    ab.main(argv, __doc__, "glue_readers", 3, _rows, _table, _plot)


if __name__ == "__main__":
    main()
