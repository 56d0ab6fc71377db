"""Glue regions cut at other regions' sources against regions walked to the layers (#21).

``python -m benchmarks.glue_cuts [--out DIR] [--repeats K] [--quick]``: in one process
at 1 thread, alone on the machine. A residual stream is glue that reaches every earlier
block: walked to the layer outputs, each later region crossed it again, and the
attention and norms on it, once per region (work growing with depth²). Cut at the
regions' sources (:data:`ggnchunk._graph.recording.CUT_AT_SOURCES`), vectors wait where
another region starts and cross it once. Each ``diag_ggn`` call runs with the cuts and
without them, alternating (:func:`benchmarks.ab.alternate`): one untimed call each, then
the best of three (one with ``--quick``).

Writes ``glue_cuts.json``, ``glue_cuts.md`` and ``glue_cuts.png`` into ``--out``
(default ``benchmarks/results/glue-cuts``).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import ab

NAMES = ("walked", "cut")  # the switch off, then on


def _cases() -> list[tuple[str, int, dict, object]]:
    """``(title, N, diag_ggn's chunking, build)``; ``build()`` gives the problem."""
    import torch
    from torch import nn
    from torchvision.models import VisionTransformer
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    from benchmarks import problems

    class Encoder(nn.Module):
        """Token ids → ``nn.TransformerEncoder`` (width 64) → mean → head."""

        def __init__(self, layers: int):
            super().__init__()
            self.embed = nn.Embedding(1000, 64)
            layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(64, 10)

        def forward(self, ids):
            return self.head(self.encoder(self.embed(ids)).mean(1))

    class RMSNorm(nn.Module):
        """Llama-style: a custom module (glue, no rule) with a learned scale."""

        def __init__(self, width: int):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(width))

        def forward(self, x):
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def vit(layers: int, n: int, rms: bool = False):
        def build():
            model = VisionTransformer(
                image_size=32,
                patch_size=4,
                num_layers=layers,
                num_heads=2,
                hidden_dim=64,
                mlp_dim=128,
                num_classes=10,
            )
            if rms:  # the stream read only through glue norms
                for block in model.encoder.layers:
                    block.ln_1, block.ln_2 = RMSNorm(64), RMSNorm(64)
            x = torch.randn(n, 3, 32, 32)
            return model, nn.CrossEntropyLoss(), x, torch.randint(0, 10, (n,))

        return build

    def encoder(layers: int, n: int):
        def build():
            ids = torch.randint(0, 1000, (n, 32))
            return Encoder(layers), nn.CrossEntropyLoss(), ids, torch.randint(0, 10, (n,))

        return build

    def convnext(n: int):
        def build():
            stages = [CNBlockConfig(16, 32, 2), CNBlockConfig(32, 64, 2)]
            model = ConvNeXt([*stages, CNBlockConfig(64, None, 2)], num_classes=10)
            x = torch.randn(n, 3, 32, 32)
            return model, nn.CrossEntropyLoss(), x, torch.randint(0, 10, (n,))

        return build

    def problem(name: str):
        return lambda: problems.build(name)

    budget = {"max_memory": "256MiB"}
    return [
        ("torchvision ViT, 4 layers", 8, {}, vit(4, 8)),
        ("torchvision ViT, 8 layers", 8, {}, vit(8, 8)),
        ("torchvision ViT, 12 layers", 8, {}, vit(12, 8)),
        ("torchvision ViT, 8 layers", 8, budget, vit(8, 8)),
        ("torchvision ViT, 4 layers", 32, {}, vit(4, 32)),
        ("torchvision ViT with RMSNorm modules, 8 layers", 8, {}, vit(8, 8, rms=True)),
        ("nn.TransformerEncoder, 6 layers, 32 tokens", 8, {}, encoder(6, 8)),
        ("torchvision ConvNeXt, 3 stages of 2 blocks", 16, {}, convnext(16)),
        (
            "GPT-2-style LM (tiny_gpt), per-token CE",
            4,
            {"num_chunks": 16},
            problem("tiny_gpt"),
        ),
        (
            "time-conditioned U-Net 2×3×32×32 (windowed)",
            2,
            {"max_memory": "64MiB"},
            problem("time_unet_32"),
        ),
    ]


def _rows(repeats: int) -> list[dict]:
    import torch

    from ggnchunk._graph import recording

    rows = []
    for title, n, chunking, build in _cases():
        torch.manual_seed(0)
        problem = build()
        problem[0].eval()
        rows.append(
            ab.compare(
                recording,
                "CUT_AT_SOURCES",
                NAMES,
                problem,
                chunking,
                repeats,
                problem=title,
                batch=n,
            )
        )
    return rows


def _table(rows: list[dict], environment: dict) -> str:
    return ab.table(
        "Glue regions cut at other regions' sources (issue 21)",
        "*walked*: each glue region walked to the layer outputs, through the regions "
        "behind it (the internal switch off); *cut*: a region stops where another region "
        "starts, whose vectors then cross it once.",
        environment, rows, NAMES, ("walked", "cut", "walked / cut"), batch=True,
    )  # fmt: skip


def _plot(rows: list[dict], path: Path) -> None:
    labels = [
        "\n".join(r["problem"].split(", ")[:2])
        + f"\nN={r['batch']}{', budget' if 'max_memory' in r['chunking'] else ''}"
        for r in rows
    ]
    ab.bars(rows, NAMES, ("walked to the layers", "cut at the sources"), labels, path,
            size=(12, 4.5), log=True, fontsize=7)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and write the JSON, the table and the plot."""
    ab.main(argv, __doc__, "glue_cuts", 3, _rows, _table, _plot)


if __name__ == "__main__":
    main()
