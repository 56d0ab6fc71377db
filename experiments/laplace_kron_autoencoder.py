"""Kronecker-factored Laplace (laplace-torch's default) for a 784-output MLP autoencoder.

The bundled 8×8 digits (no download), upsampled to 28×28, reconstructed by a
784-256-32-256-784 MLP autoencoder. ``Laplace(..., hessian_structure="kron")`` is fitted
with ggnchunk's ``ChunkedGGN`` under a memory budget and with laplace-torch's
``BackPackGGN(stochastic=False)`` (BackPACK's KFLR, the same factors) and
``CurvlinopsGGN`` (its default backend); each fit runs in a fresh process, timed, its peak
extra memory read from the kernel's high-water mark (``VmHWM``). ggnchunk's factors are
compared with BackPACK's.

Run: ``python -m experiments.laplace_kron_autoencoder [--out results/laplace_kron]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.peak import high_water_mark_mib
from experiments._digits import digits

BACKENDS = ("ggnchunk", "backpack", "curvlinops")


def _data(n: int) -> torch.Tensor:
    x = digits(n)
    return nn.functional.interpolate(x, size=(28, 28), mode="bilinear").flatten(1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 32), nn.ReLU(),
        nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 784),
    )  # fmt: skip


def fit_only(args) -> None:
    """Child process: one backend's kron fit; prints time, peak and the factors' file."""
    from laplace import Laplace
    from laplace.curvature import BackPackGGN, CurvlinopsGGN

    from ggnchunk.laplace import ChunkedGGN

    torch.set_num_threads(args.threads)
    x = _data(args.samples)
    loader = DataLoader(TensorDataset(x, x), batch_size=args.batch_size)
    cls = {"ggnchunk": ChunkedGGN, "backpack": BackPackGGN, "curvlinops": CurvlinopsGGN}
    kwargs = {"max_memory": args.max_memory} if args.fit_only == "ggnchunk" else {}
    la = Laplace(_model(), "regression", subset_of_weights="all", hessian_structure="kron",
                 backend=cls[args.fit_only], backend_kwargs=kwargs)  # fmt: skip

    def fit() -> float:
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            la.fit(loader)
        return time.perf_counter() - start

    measured = high_water_mark_mib(fit)
    if measured is None:
        raise RuntimeError("this experiment measures Linux's VmHWM (/proc/self/clear_refs)")
    peak, seconds = measured
    path = args.out / f"kfacs_{args.fit_only}.pt"
    torch.save([[f.detach() for f in group] for group in la.H_facs.kfacs], path)
    print(json.dumps({"backend": args.fit_only, "seconds": seconds, "peak_mib": peak,
                      "factors": str(path)}))  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/laplace_kron"))
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-memory", default="64MiB", help="ggnchunk's budget")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fit-only", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.fit_only:
        fit_only(args)
        return {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    results = []
    for backend in BACKENDS:
        cmd = [sys.executable, "-m", "experiments.laplace_kron_autoencoder", "--out",
               str(args.out), "--fit-only", backend, "--max-memory", args.max_memory,
               "--batch-size", str(args.batch_size), "--samples", str(args.samples),
               "--threads", str(args.threads)]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode == 0:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        else:
            results.append({"backend": backend, "error": proc.stderr.strip()[-300:]})
        print(results[-1], flush=True)
    ours, theirs = (
        torch.load(args.out / f"kfacs_{name}.pt") for name in ("ggnchunk", "backpack")
    )
    diff = max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        for ga, gb in zip(ours, theirs, strict=True)
        for a, b in zip(ga, gb, strict=True)
    )
    summary = {"fits": results, "max_rel_diff_vs_backpack": diff,
               "samples": args.samples, "batch_size": args.batch_size,
               "max_memory": args.max_memory, "threads": args.threads}  # fmt: skip
    (args.out / "laplace_kron.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
