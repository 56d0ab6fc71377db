"""Per-sample diagonals and output variances on windowed columns, against dense columns.

``python -m benchmarks.per_sample_windows [--out DIR] [--repeats K] [--quick]``: in one
process at 1 thread, alone on the machine. ``per_sample=True`` swept dense columns only,
each layer making its ``[V, N, *param]`` products of the whole map; the convolutions,
transposed convolutions and channel norms now square each sample's products on the
columns' boxes (:mod:`ggnchunk._windows`; the internal switch
``ggnchunk._windows.ENABLED``, which also lets the engine's trial pick the dense path
where it measures it faster). Each ``diag_ggn(..., per_sample=True)`` call runs with and
without, alternating (:func:`benchmarks.ab.alternate`): one untimed call each, then the
best of ``--repeats`` (default 2); so does each ``ggnchunk.output_variance`` call (the
per-output variance under a diagonal posterior: the same products, weighted by the
posterior variance and summed per column and sample).

Writes ``per_sample_windows.json``, ``per_sample_windows.md`` and
``per_sample_windows.png`` into ``--out`` (default
``benchmarks/results/per-sample-windows``).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import ab, problems

NAMES = ("dense", "windowed")  # the switch off, then on
PER_SAMPLE = {"per_sample": True}


def _problem(name: str, batch: int):
    def build(n: int) -> tuple:
        """A benchmark problem with ``n`` samples (its own batch cut to ``n``)."""
        model, loss_func, x, y = problems.PROBLEMS[name]()
        return model, loss_func, x[:n], y[:n]

    build.__doc__ = problems.PROBLEMS[name].__doc__
    return build


CASES = [
    # (name, title, builder, batch, options)
    ("tutorial-ae", "tutorial conv AE, 3×32×32", _problem("tutorial_conv_ae", 5), 5,
     PER_SAMPLE),
    ("outpad-ae", "conv AE 1×28×28, `output_padding` decoder",
     _problem("conv_ae_28_outpad", 16), 16, PER_SAMPLE),
    ("outpad-ae", "conv AE 1×28×28, `output_padding` decoder",
     _problem("conv_ae_28_outpad", 16), 16, {**PER_SAMPLE, "max_memory": "64MiB"}),
    ("unet-32", "U-Net 3×32×32, width 16", _problem("unet_32", 4), 2,
     {**PER_SAMPLE, "num_chunks": 8}),
]  # fmt: skip


VARIANCE_CASES = [
    # (name, title, builder, batch, options): ggnchunk.output_variance, posterior
    # variances uniform in [0, 0.1)
    ("tutorial-ae", "tutorial conv AE, 3×32×32", _problem("tutorial_conv_ae", 5), 5, {}),
    ("outpad-ae", "conv AE 1×28×28, `output_padding` decoder",
     _problem("conv_ae_28_outpad", 16), 16, {}),
    ("unet-32", "U-Net 3×32×32, width 16", _problem("unet_32", 4), 2, {"num_chunks": 8}),
]  # fmt: skip


def _variance_row(case: tuple, repeats: int) -> dict:
    """:func:`benchmarks.ab.compare` of ``ggnchunk.output_variance`` for one case."""
    import torch

    import ggnchunk
    from ggnchunk import _windows

    name, title, builder, n, chunking = case
    torch.manual_seed(0)
    model, loss_func, x, y = builder(n)
    variance = {
        k: torch.rand_like(p) * 0.1 for k, p in model.named_parameters() if p.requires_grad
    }
    return ab.compare(
        _windows, "ENABLED", NAMES, (model, loss_func, x, y), chunking, repeats,
        call=lambda: ggnchunk.output_variance(
            model, x, variance, return_report=True, **chunking
        ),
        problem=f"{title}: output variance", name=f"{name} variance N={n}", batch=n,
    )  # fmt: skip


def _rows(repeats: int) -> list[dict]:
    from ggnchunk import _windows

    rows = [ab.case_row(_windows, "ENABLED", NAMES, case, repeats) for case in CASES]
    return rows + [_variance_row(case, repeats) for case in VARIANCE_CASES]


def _table(rows: list[dict], environment: dict) -> str:
    return ab.table(
        "Per-sample diagonals and output variances on windowed columns (issue 21)", "",
        environment, rows, NAMES, (*NAMES, "dense / windowed"), batch=True,
    )  # fmt: skip


def _plot(rows: list[dict], path: Path) -> None:
    ab.batch_bars(rows, NAMES, path)


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and write the JSON, the table and the plot."""
    ab.main(argv, __doc__, "per_sample_windows", 2, _rows, _table, _plot)


if __name__ == "__main__":
    main()
