"""Reproduce BackPACK's retain_graph tutorial table with ggnchunk: chunks → memory, time.

For the tutorial's conv autoencoder (``[5, 3, 32, 32]``, MSE) this prints and saves, for
BackPACK's one pass and ggnchunk at several chunk counts: the peak extra memory (peak
minus the level before the call: RSS on CPU, allocator on CUDA), the median time, and the
largest relative error against BackPACK's one pass. Every measurement runs in a fresh
process; time and memory in separate ones.

Run: ``python -m experiments.tutorial_table [--chunks 1 4 16 64] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.runner import run_isolated

PROBLEM = "tutorial_conv_ae"


def _max_rel_error(diag: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(
        ((d.double() - r.double()).abs().max() / r.double().abs().max()).item()
        for d, r in zip(diag, reference, strict=True)
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per row")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--scale", type=int, default=1, help="multiply the batch size")
    parser.add_argument(
        "--out", type=Path, default=Path("results/tutorial_table"), help="output folder"
    )
    args = parser.parse_args(argv)

    rows = [("BackPACK DiagGGNExact, one pass", "backpack", {})]
    rows += [
        (f"ggnchunk, {k} chunk(s)", "ggnchunk", {"num_chunks": k}) for k in args.chunks
    ]
    common = {"device": args.device, "scale": args.scale, "threads": args.threads}
    records, reference = [], None
    for label, method, params in rows:
        memory = run_isolated(PROBLEM, method, params, "memory", args.out, save_diag=True,
                              **common)  # fmt: skip
        timing = run_isolated(PROBLEM, method, params, "time", args.out,
                              repeats=args.repeats, **common)  # fmt: skip
        record = {"label": label, "method": method, "params": params, **common}
        for source in (memory, timing):
            if "error" in source:
                record["error"] = source["error"]
        record["peak_mib"] = memory.get("peak_mib")
        record["median_s"] = timing.get("median_s")
        if "diag_file" in memory:
            diag = torch.load(memory["diag_file"])
            reference = diag if reference is None else reference
            record["max_rel_error"] = _max_rel_error(diag, reference)
        records.append(record)
        print(_row(record), flush=True) if len(records) > 1 else print(
            _header(), _row(record), sep="\n", flush=True
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tutorial_table.json").write_text(json.dumps(records, indent=2))
    (args.out / "tutorial_table.md").write_text(
        "\n".join([_header()] + [_row(r) for r in records])
    )
    print(
        f"\nsaved {args.out / 'tutorial_table.json'} and tutorial_table.md "
        f"({args.device}, {args.threads} thread(s), errors relative to BackPACK's one pass)"
    )
    return records


def _header() -> str:
    return (
        "| method | peak extra memory [MiB] | time [s] | max rel. error |\n"
        "|---|---:|---:|---:|"
    )


def _row(r: dict) -> str:
    if "error" in r:
        return f"| {r['label']} | failed: {r['error'][:60]} | | |"
    return (
        f"| {r['label']} | {r['peak_mib']:,.1f} | {r['median_s']:.2f} | "
        f"{r['max_rel_error']:.1e} |"
    )


if __name__ == "__main__":
    main()
