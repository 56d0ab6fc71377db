"""Worker of tests/integrations/test_distributed.py: one rank of a 2-process gloo group."""

from __future__ import annotations

import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ggnchunk


def model_for(rank: int, mismatch: bool) -> nn.Module:
    torch.manual_seed(0)
    width = 6 + rank if mismatch else 6
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 5)).eval()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(10, 4), torch.randn(10, 5)


def _variance(model: nn.Module) -> torch.Tensor:
    total = sum(p.numel() for p in model.parameters())
    return torch.linspace(0.01, 0.1, total)


def worker(rank: int, world: int, modes: list[str], out: str) -> None:
    """Run every mode in turn, each in its own process group (a file store in ``out``).

    A mode's result goes to ``out/MODE/rank{rank}.pt`` (and ``.passes``), its traceback
    to ``out/MODE/rank{rank}.err``; a group's timeout keeps a mode whose ranks fell out
    of step from holding the next ones.
    """
    for mode in modes:
        folder = Path(out) / mode
        folder.mkdir(exist_ok=True)
        dist.init_process_group(
            "gloo", init_method=f"file://{Path(out) / (mode + '.store')}", rank=rank,
            world_size=world, timeout=timedelta(seconds=120),
        )  # fmt: skip
        try:
            _run_mode(rank, world, mode, str(folder))
        finally:
            dist.destroy_process_group()


def _run_mode(rank: int, world: int, mode: str, out: str) -> None:
    try:
        x, y = data()
        model = model_for(rank, mode == "mismatch")
        loss_func = nn.MSELoss()
        if mode in ("dataset", "mismatch", "empty-rank"):
            if mode == "empty-rank":  # rank 1 has no data at all
                shard = range(0, 10) if rank == 0 else range(0)
            else:
                shard = range(rank, 10, world)  # each rank its share, uneven batches
            batches = [(x[list(shard)][i : i + 3], y[list(shard)][i : i + 3])
                       for i in range(0, len(shard), 3)]  # fmt: skip
            result = ggnchunk.diag_ggn_dataset(model, loss_func, batches, progress=False,
                                               num_chunks=2)  # fmt: skip
        elif mode == "global-chunks":  # num_chunks counts the passes of all ranks
            result, report = ggnchunk.diag_ggn(
                model,
                loss_func,
                x,
                y,
                column_parallel=True,
                num_chunks=4,
                return_report=True,
            )
            torch.save(report.num_passes, Path(out) / f"rank{rank}.passes")
        elif mode == "three-columns":  # fewer columns than chunks, and a budget
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).eval()
            result = ggnchunk.diag_ggn(model, loss_func, x, y[:, :3], column_parallel=True,
                                       max_memory="256MiB")  # fmt: skip
        elif mode == "kron":  # output factors summed over the ranks, input factors not
            factors = ggnchunk.kron_ggn(model, loss_func, x, y, column_parallel=True,
                                        num_chunks=3)  # fmt: skip
            result = {name: (f.output, f.input) for name, f in factors.items()}
        elif mode == "sub-batches":  # per-sample parts and output variances joined
            per_sample = ggnchunk.diag_ggn(model, loss_func, x, y, column_parallel=True,
                                           num_chunks=2, batch_chunk_size=4,
                                           per_sample=True)  # fmt: skip
            variance = ggnchunk.output_variance(
                model, x, _variance(model), column_parallel=True, num_chunks=2,
                batch_chunk_size=4,
            )  # fmt: skip
            result = {"per_sample": per_sample, "variance": variance}
        elif mode == "dataset-column-parallel":  # refused: each rank has its own batches
            result = ggnchunk.diag_ggn_dataset(
                model, loss_func, [(x, y)], progress=False, column_parallel=True
            )
        elif mode in ("different-weights", "different-inputs", "different-draws"):
            if mode == "different-weights" and rank == 1:
                with torch.no_grad():
                    model[0].weight[0, 0] += 1e-6  # one value, far below any tolerance
            if mode == "different-inputs" and rank == 1:
                x = x.clone()
                x[3, 2] += 1e-6
            if mode == "different-draws":  # dropout in training mode, seeds not alike
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Tanh(),
                                      nn.Linear(6, 5)).train()  # fmt: skip
                torch.manual_seed(10 + rank)
            result = ggnchunk.diag_ggn(model, loss_func, x, y, column_parallel=True,
                                       num_chunks=2)  # fmt: skip
        elif mode == "accumulator-empty-rank":  # rank 1 saw no batch, joins with zeros
            accumulator = ggnchunk.DiagGGNAccumulator(model, loss_func, num_chunks=2)
            if rank == 0:
                accumulator.update(x[:6], y[:6])
                accumulator.update(x[6:], y[6:])
            accumulator.all_reduce()
            result = accumulator.compute()
        else:  # chunk-parallel: same batch everywhere, columns split over the ranks
            result = ggnchunk.diag_ggn(model, loss_func, x, y, column_parallel=True,
                                       num_chunks=2)  # fmt: skip
        torch.save(result, Path(out) / f"rank{rank}.pt")
    except Exception:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
