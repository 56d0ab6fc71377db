"""Diagonal Laplace for a conv autoencoder on 8×8 digits: uncertainty, cost of the fit.

Trains a small conv autoencoder on scikit-learn's bundled digits (no download), fits a
diagonal Laplace approximation with ggnchunk's laplace-torch backend under a memory budget,
and draws the per-pixel predictive standard deviation (GLM predictive) on in-distribution
digits next to uniform-noise images. Each backend's fit (ggnchunk, laplace-torch's
default ``CurvlinopsGGN``, its ``BackPackGGN``) is timed and its peak extra memory
measured in a fresh process.

Run: ``python -m experiments.laplace_autoencoder [--out results/laplace_autoencoder]``.
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
from torch.utils.data import DataLoader, TensorDataset

from experiments._digits import autoencoder, digits, train

BACKENDS = ("ggnchunk", "curvlinops", "backpack")


def _laplace(model, backend: str, max_memory: str):
    from laplace import Laplace
    from laplace.curvature import BackPackGGN, CurvlinopsGGN

    from ggnchunk.laplace import ChunkedGGN

    cls = {"ggnchunk": ChunkedGGN, "curvlinops": CurvlinopsGGN, "backpack": BackPackGGN}
    kwargs = {"max_memory": max_memory} if backend == "ggnchunk" else {}
    return Laplace(model, "regression", subset_of_weights="all", hessian_structure="diag",
                   backend=cls[backend], backend_kwargs=kwargs)  # fmt: skip


def _trained(args) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = digits()
    model = autoencoder()
    path = args.out / "model.pt"
    if path.exists():
        model.load_state_dict(torch.load(path))
    else:
        losses = train(model, x, steps=args.steps)
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), path)
        print(f"trained {args.steps} Adam steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return model, x


def fit_only(args) -> None:
    """Child process: fit one backend, report time and peak extra memory as JSON."""
    from ggnchunk import measure_peak_memory

    model, x = _trained(args)
    loader = DataLoader(TensorDataset(x, x.flatten(1)), batch_size=args.batch_size)
    la = _laplace(model, args.fit_only, args.max_memory)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        measured = measure_peak_memory(la.fit, loader)
    print(json.dumps({"backend": args.fit_only, "peak_mib": measured.peak_extra_mib,
                      "seconds": time.perf_counter() - start}))  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/laplace_autoencoder"))
    parser.add_argument("--steps", type=int, default=300, help="Adam training steps")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-memory", default="64MiB", help="ggnchunk's budget")
    parser.add_argument("--fit-only", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fit_only:
        fit_only(args)
        return {}
    model, x = _trained(args)

    costs = []
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    for backend in BACKENDS:
        cmd = [sys.executable, "-m", "experiments.laplace_autoencoder", "--out",
               str(args.out), "--fit-only", backend, "--max-memory", args.max_memory,
               "--batch-size", str(args.batch_size)]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode == 0:
            costs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        else:
            costs.append(
                {"backend": backend, "error": proc.stderr.strip().splitlines()[-1]}
            )
        print(costs[-1], flush=True)

    la = _laplace(model, "ggnchunk", args.max_memory)
    la.fit(DataLoader(TensorDataset(x, x.flatten(1)), batch_size=args.batch_size))
    la.optimize_prior_precision(method="marglik", n_steps=50)
    torch.manual_seed(1)
    images = {"digits": x[:6], "noise": torch.rand(6, 1, 8, 8)}
    stds = {}
    for name, batch in images.items():
        _, var = la(batch, pred_type="glm")
        stds[name] = torch.diagonal(var, dim1=-2, dim2=-1).sqrt().view(-1, 8, 8)
    summary = {
        "fit": costs,
        "prior_precision": la.prior_precision.tolist(),
        "mean_pixel_std": {name: s.mean().item() for name, s in stds.items()},
    }
    (args.out / "laplace_autoencoder.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary["mean_pixel_std"]))
    _figure(images, stds, args.out / "laplace_autoencoder.png")
    print(f"saved {args.out / 'laplace_autoencoder.png'} and laplace_autoencoder.json")
    return summary


def _figure(images, stds, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vmax = max(s.max().item() for s in stds.values())
    fig, axes = plt.subplots(4, 6, figsize=(9, 6.5))
    for row, (name, batch) in enumerate(images.items()):
        for col in range(6):
            axes[2 * row, col].imshow(batch[col, 0], cmap="gray")
            axes[2 * row + 1, col].imshow(stds[name][col], cmap="magma", vmin=0, vmax=vmax)
        axes[2 * row, 0].set_ylabel(f"{name}\ninput")
        axes[2 * row + 1, 0].set_ylabel("predictive\nstd per pixel")
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("Diagonal Laplace (ggnchunk backend): per-pixel uncertainty")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
