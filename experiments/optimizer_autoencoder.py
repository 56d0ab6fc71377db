"""Training curves: the diagonal-GGN optimizer against Adam and SGD on a conv autoencoder.

Same model, initialization, data (scikit-learn's bundled 8×8 digits) and mini-batches for
every optimizer; the diagonal-GGN optimizer refreshes its curvature every
``--update-every`` steps with ggnchunk under ``--max-memory``. Writes the curves (loss
against step and against wall time) as PNG and JSON.

Run: ``python -m experiments.optimizer_autoencoder [--steps 200]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from torch import nn

from experiments._digits import autoencoder, digits
from ggnchunk.optim import DiagGGNOptimizer


def run(name: str, model: nn.Module, x: torch.Tensor, args) -> dict:
    loss_func = nn.MSELoss()
    if name == "diag-GGN":
        opt = DiagGGNOptimizer(
            model.named_parameters(), lr=args.lr_ggn, damping=args.damping, beta=0.9,
            update_every=args.update_every,
        )  # fmt: skip
    elif name == "Adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    losses, seconds, start = [], [], time.perf_counter()
    for _ in range(args.steps):
        batch = x[torch.randint(0, x.shape[0], (args.batch_size,), generator=generator)]
        target = batch.flatten(1)
        if isinstance(opt, DiagGGNOptimizer):
            loss = opt.step(opt.closure(model, loss_func, batch, target,
                                        max_memory=args.max_memory))  # fmt: skip
        else:
            opt.zero_grad()
            loss = loss_func(model(batch), target)
            loss.backward()
            opt.step()
        losses.append(float(loss.detach()))
        seconds.append(time.perf_counter() - start)
    with torch.no_grad():
        full = loss_func(model(x), x.flatten(1)).item()
    return {
        "optimizer": name,
        "losses": losses,
        "seconds": seconds,
        "final_full_loss": full,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--update-every", type=int, default=5)
    parser.add_argument("--lr-ggn", type=float, default=0.1)
    parser.add_argument("--damping", type=float, default=3e-2)
    parser.add_argument("--max-memory", default="256MiB")
    parser.add_argument("--out", type=Path, default=Path("results/optimizer_autoencoder"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x = digits()
    torch.manual_seed(0)
    initial = autoencoder()
    results = [run(name, copy.deepcopy(initial), x, args)
               for name in ("diag-GGN", "Adam", "SGD")]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "optimizer_autoencoder.json").write_text(json.dumps(results))
    for r in results:
        print(f"{r['optimizer']:9s} final loss (all digits) {r['final_full_loss']:.4f} "
              f"in {r['seconds'][-1]:.1f} s")  # fmt: skip
    _figure(results, args.out / "optimizer_autoencoder.png")
    print(f"saved {args.out / 'optimizer_autoencoder.png'}")
    return results


def _figure(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4))
    for r in results:
        by_step.plot(r["losses"], label=r["optimizer"], lw=1)
        by_time.plot(r["seconds"], r["losses"], label=r["optimizer"], lw=1)
    for ax, xlabel in ((by_step, "step"), (by_time, "seconds")):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mini-batch MSE")
        ax.grid(alpha=0.3)
    by_step.legend()
    fig.suptitle("Conv autoencoder on 8×8 digits")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
