"""GGN diagonal with torch.distributed: per-rank time and the all-reduced result's error.

Launch with torchrun (``gloo`` on CPU, ``nccl`` on GPUs)::

    .venv/bin/torchrun --nproc_per_node=2 experiments/distributed_diag.py

``--mode dataset`` (default): each rank takes its share of the data (every
``world_size``-th sample, no repeats: a ``DistributedSampler`` would pad with copies) and
``diag_ggn_dataset`` sums the partial diagonals with one all-reduce. ``--mode chunks``:
every rank runs the forward pass on the same batch and its share of the output chunks
(``diag_ggn(..., column_parallel=True)``). Rank 0 also computes the single-process result
and prints the largest relative error. Without torchrun it runs as one process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for torchrun's path

import ggnchunk


def problem() -> tuple[nn.Module, torch.Tensor]:
    """MLP autoencoder 784-256-32-256-784 and 256 random images (fixed seed)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 32), nn.ReLU(),
        nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 784),
    )  # fmt: skip
    return model, torch.rand(256, 784)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["dataset", "chunks"], default="dataset")
    parser.add_argument("--max-memory", default="256MiB")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    launched = "RANK" in os.environ
    device = torch.device("cpu")
    if launched:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        if backend == "nccl":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
    rank = dist.get_rank() if launched else 0
    world = dist.get_world_size() if launched else 1
    model, x = problem()
    model, x = model.to(device), x.to(device)
    loss_func = nn.MSELoss()
    start = time.perf_counter()
    if args.mode == "dataset":
        data = TensorDataset(x, x)
        share = Subset(data, range(rank, len(data), world)) if launched else data
        loader = DataLoader(share, batch_size=args.batch_size)
        diag = ggnchunk.diag_ggn_dataset(model, loss_func, loader, progress=False,
                                         max_memory=args.max_memory)  # fmt: skip
    else:
        batch = x[: args.batch_size]
        diag = ggnchunk.diag_ggn(model, loss_func, batch, batch, max_memory=args.max_memory,
                                 column_parallel=launched)  # fmt: skip
    seconds = time.perf_counter() - start
    times = [torch.zeros(world, device=device)]
    if launched:
        mine = torch.zeros(world, device=device)
        mine[rank] = seconds
        dist.all_reduce(mine)
        times = [mine]
    if rank == 0:
        if args.mode == "dataset":
            reference = ggnchunk.diag_ggn(
                model, loss_func, x, x, max_memory=args.max_memory
            )
        else:
            b = args.batch_size
            reference = ggnchunk.diag_ggn(model, loss_func, x[:b], x[:b])
        error = max(((diag[n] - r).abs().max() / r.abs().max()).item()
                    for n, r in reference.items())  # fmt: skip
        per_rank = times[0].tolist() if launched else [seconds]
        print(f"mode={args.mode} ranks={world} per-rank seconds="
              f"{[round(t, 2) for t in per_rank]} max relative error vs one process="
              f"{error:.1e}")  # fmt: skip
    if launched:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
