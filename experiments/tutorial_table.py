"""Reproduce BackPACK's retain_graph tutorial table with ggnchunk: chunks → memory, time.

For the tutorial's conv autoencoder (``[5, 3, 32, 32]``, MSE) this prints and saves, for
BackPACK's one pass, ggnchunk at several chunk counts, at several memory budgets and in
auto mode: the columns per backward pass, the number of passes, the peak extra memory
(peak minus the level before the call: RSS on CPU, allocator on CUDA; warm call), the
median time, and the largest relative error against BackPACK's one pass. Every
measurement runs in a fresh process; time and memory in separate ones.

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


def _rows(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    rows = [("BackPACK DiagGGNExact, one pass", "backpack", {})]
    for k in args.chunks:
        rows.append((f"ggnchunk, num_chunks={k}", "ggnchunk", {"num_chunks": k}))
    for budget in args.budgets:
        rows.append((f"ggnchunk, max_memory={budget}", "ggnchunk", {"max_memory": budget}))
    if args.budgets:
        auto = {"chunk_size": "auto", "max_memory": args.budgets[-1]}
        rows.append((f"ggnchunk, auto within {args.budgets[-1]}", "ggnchunk", auto))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, nargs="*", default=[1, 4, 16, 64])
    parser.add_argument(
        "--budgets", nargs="*", default=["100MiB", "250MiB", "600MiB"],
        help="max_memory of ggnchunk's budget rows; the last is also the auto row's budget",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per row")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--scale", type=int, default=1, help="multiply the batch size")
    parser.add_argument(
        "--out", type=Path, default=Path("results/tutorial_table"), help="output folder"
    )
    args = parser.parse_args(argv)

    common = {"device": args.device, "scale": args.scale, "threads": args.threads}
    records, reference = [], None
    print(_header(), flush=True)
    for label, method, params in _rows(args):
        memory = run_isolated(
            PROBLEM, method, params, "memory", args.out, save_diag=True, **common
        )
        timing = run_isolated(
            PROBLEM, method, params, "time", args.out, repeats=args.repeats, **common
        )
        record = {"label": label, "method": method, "params": params, **common}
        for source in (memory, timing):
            if "error" in source:
                record["error"] = source["error"]
        record["peak_mib"] = memory.get("peak_mib")
        record["cold_peak_mib"] = memory.get("cold_peak_mib")
        record["median_s"] = timing.get("median_s")
        record["chunk_size"] = timing.get("chunk_size", 3072)
        record["passes"] = timing.get("passes", 1)
        if "diag_file" in memory:
            diag = torch.load(memory["diag_file"])
            reference = diag if reference is None else reference
            record["max_rel_error"] = _max_rel_error(diag, reference)
        records.append(record)
        print(_row(record), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tutorial_table.json").write_text(json.dumps(records, indent=2))
    table = "\n".join([_header()] + [_row(r) for r in records]) + "\n"
    (args.out / "tutorial_table.md").write_text(table)
    print(
        f"\nsaved {args.out / 'tutorial_table.json'} and tutorial_table.md ({args.device}, "
        f"{args.threads} thread(s); errors relative to BackPACK's one pass)"
    )
    return records


def _header() -> str:
    return (
        "| method | columns per pass | passes | peak extra memory [MiB] | time [s] "
        "| max rel. error |\n|---|---:|---:|---:|---:|---:|"
    )


def _row(r: dict) -> str:
    if "error" in r:
        return f"| {r['label']} | failed: {r['error'][:80]} | | | | |"
    return (
        f"| {r['label']} | {r['chunk_size']} | {r['passes']} | {r['peak_mib']:,.1f} | "
        f"{r['median_s']:.2f} | {r['max_rel_error']:.1e} |"
    )


if __name__ == "__main__":
    main()
