"""Benchmark suite: ``python -m benchmarks [--device cpu|cuda] [--quick] [--only NAME]``.

For every problem in :mod:`benchmarks.problems` and every method (BackPACK's one pass,
the tutorial's Slicing loop at 4/16/64 chunks, ggnchunk at fixed chunkings, at three
memory budgets (15%, 30%, 50% of BackPACK's one-pass extra memory) and in auto mode,
BackPACK's Monte-Carlo ``DiagGGNMC``, and a ``torch.func`` brute force), each in fresh
processes (one for peak memory, one for time; with ``--quick`` one process that
measures memory first and then time, with no memory poller running): peak extra memory,
median time, achieved FLOP/s next to a matmul peak measured in the same run, and the
relative error against a float64 reference. Writes one JSON per problem × method ×
device, ``environment.json``, ``table.md``, and (with matplotlib) one PNG per problem via
:mod:`benchmarks.plot`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.problems import PROBLEMS
from benchmarks.runner import run_isolated

MSE_PROBLEMS = {"tutorial_conv_ae", "mlp_ae", "conv_ae_28"}


def environment(device: str, threads: int) -> dict:
    """Versions and hardware of this run."""
    import backpack

    import ggnchunk

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backpack": getattr(backpack, "__version__", "1.7.1"),
        "ggnchunk": ggnchunk.__version__,
        "device": device,
        "threads": threads,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


def matmul_peak(device: str, threads: int) -> float:
    """FLOP/s of a 2048² float32 matmul, in a fresh process with the benchmark's threads."""
    code = (
        "import torch,time\n"
        f"d='{device}'; a=torch.randn(2048, 2048, device=d)\n"
        "b=torch.randn(2048, 2048, device=d)\n"
        "s=lambda: torch.cuda.synchronize() if d=='cuda' else None\n"
        "a@b; s(); best=1e9\n"
        "for _ in range(5):\n"
        "    t=time.perf_counter(); a@b; s(); best=min(best,time.perf_counter()-t)\n"
        "print(2*2048**3/best)\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def configurations(problem: str, quick: bool) -> list[tuple[str, str, dict]]:
    """``(label, method, params)`` of every method measured on ``problem``."""
    rows = [("backpack one pass", "backpack", {})]
    if problem in MSE_PROBLEMS:
        rows += [(f"slicing loop {k}", "slicing", {"num_chunks": k}) for k in (4, 16, 64)]
    chunks = (1, 16, 64) if quick else (1, 4, 16, 64, 256)
    rows += [(f"ggnchunk {k} chunks", "ggnchunk", {"num_chunks": k}) for k in chunks]
    rows += [("ggnchunk auto", "ggnchunk", {"chunk_size": "auto"})]
    rows += [(f"DiagGGNMC {m} sample(s)", "backpack", {"mc_samples": m}) for m in (1, 16)]
    if not quick or problem == "tutorial_conv_ae":
        rows += [("torch.func brute force", "torch_func", {})]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="fewer methods, 1 repeat")
    parser.add_argument("--only", nargs="*", default=None, help="problem names")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("results/benchmarks"))
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    scale = 4 if args.device == "cuda" else 1
    out = args.out / args.device
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args.device, args.threads)
    env["matmul_flops"] = matmul_peak(args.device, args.threads)
    (out / "environment.json").write_text(json.dumps(env, indent=2))
    print(
        f"matmul peak: {env['matmul_flops'] / 1e9:.1f} GFLOP/s ({args.threads} thread(s))"
    )
    common = {"device": args.device, "scale": scale, "threads": args.threads,
              "quick": args.quick}  # fmt: skip
    for problem in args.only or list(PROBLEMS):
        if problem not in PROBLEMS:
            raise SystemExit(f"unknown problem {problem!r}; choose from {list(PROBLEMS)}")
        reference = run_isolated(
            problem,
            "ggnchunk",
            {"num_chunks": 16, "float64": True},
            "time",
            out / "raw",
            repeats=0,
            save_diag=True,
            **_run_args(common),
        )
        one_pass = None
        for label, method, params in configurations(problem, args.quick):
            record = _measure(
                problem, label, method, params, out, reference, repeats, common
            )
            if method == "backpack" and not params:
                one_pass = record
        if one_pass is None or "error" in one_pass:
            continue
        for fraction in (0.15, 0.3, 0.5):  # budgets relative to BackPACK's one pass
            budget = {"max_memory": f"{max(1.0, fraction * one_pass['peak_mib']):.1f}MiB"}
            label = f"ggnchunk budget {int(fraction * 100)}%"
            _measure(problem, label, "ggnchunk", budget, out, reference, repeats, common)
    subprocess.run([sys.executable, "-m", "benchmarks.plot", str(out)], check=False)


def _run_args(common: dict) -> dict:
    return {k: v for k, v in common.items() if k != "quick"}


def _measure(problem, label, method, params, out, reference, repeats, common) -> dict:
    if common.get("quick"):  # one fresh process: memory first, then time
        memory = timing = run_isolated(
            problem, method, params, "both", out / "raw", save_diag=True, cold=False,
            repeats=repeats, flops=True, **_run_args(common),
        )  # fmt: skip
    else:  # separate fresh processes, cold and warm memory
        memory = run_isolated(problem, method, params, "memory", out / "raw",
                              save_diag=True, **_run_args(common))  # fmt: skip
        timing = run_isolated(problem, method, params, "time", out / "raw",
                              repeats=repeats, flops=True, **_run_args(common))  # fmt: skip
    record = {"problem": problem, "label": label, "method": method, "params": params,
              **common}  # fmt: skip
    for source in (memory, timing):
        if "error" in source:
            record["error"] = source["error"]
    for key in ("peak_mib", "cold_peak_mib"):
        record[key] = memory.get(key)
    for key in ("median_s", "times_s", "flops", "chunk_size", "passes", "columns"):
        record[key] = timing.get(key)
    if "diag_file" in memory and "diag_file" in reference:
        diag = torch.load(memory["diag_file"])
        ref = torch.load(reference["diag_file"])
        record["rel_error"] = max(
            ((d.double() - r).abs().max() / r.abs().max()).item()
            for d, r in zip(diag, ref, strict=True)
        )
    name = f"{problem}__{label.replace(' ', '_').replace('%', 'pct')}.json"
    (out / name).write_text(json.dumps(record, indent=2))
    print(_line(record), flush=True)
    return record


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['problem']:18s} {r['label']:26s} failed: {r['error'][:80]}"
    return (
        f"{r['problem']:18s} {r['label']:26s} {r['peak_mib']:10.1f} MiB "
        f"{r['median_s']:8.3f} s  err {r.get('rel_error', float('nan')):.1e}"
    )


if __name__ == "__main__":
    main()
