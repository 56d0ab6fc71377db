"""Per-pixel uncertainty map of a digits autoencoder from ggnchunk.output_variance.

Trains the small conv autoencoder of :mod:`experiments._digits` on scikit-learn's bundled
8×8 digits (no download), fits a diagonal Laplace approximation with ggnchunk's
laplace-torch backend (exact, and Monte-Carlo with ``stochastic=True``), tunes the prior
precision by marginal likelihood, and computes the per-pixel predictive standard deviation
``sqrt(sum_p J_mp**2 s_p)`` with :func:`ggnchunk.laplace.output_variance`: chunked over
the output pixels, no Jacobians ``[N, 64, P]`` and no ``[N, 64, 64]`` covariance as
laplace-torch's ``glm`` predictive forms. Checks it against that predictive's diagonal,
and draws digits, inverted digits and uniform noise with their uncertainty maps.

Run: ``python -m experiments.uncertainty_map [--out experiments/output]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from experiments._digits import autoencoder, digits, train


def _fit(model, loader, stochastic: bool):
    from laplace import Laplace

    from ggnchunk.laplace import ChunkedGGN

    kwargs = {"max_memory": "64MiB"}
    if stochastic:
        kwargs.update(stochastic=True, num_samples=4)
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="diag",
                 backend=ChunkedGGN, backend_kwargs=kwargs)  # fmt: skip
    la.fit(loader)
    la.optimize_prior_precision(method="marglik", n_steps=50)
    return la


def main(argv: list[str] | None = None) -> dict:
    """Train, fit, compute the maps, save the PNG and a JSON summary.

    Args:
        argv: Command-line arguments (``None``: ``sys.argv``).

    Returns:
        The summary.
    """
    from ggnchunk.laplace import output_variance

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/output"))
    parser.add_argument("--steps", type=int, default=300, help="Adam training steps")
    parser.add_argument("--train", type=int, default=1500, help="training digits")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    x = digits()
    train_x, test_x = x[: args.train], x[args.train :]
    model = autoencoder()
    losses = train(model, train_x, steps=args.steps)
    loader = DataLoader(TensorDataset(train_x, train_x.flatten(1)), batch_size=128)
    torch.manual_seed(1)
    exact = _fit(model, loader, stochastic=False)
    torch.manual_seed(2)
    sampled = _fit(model, loader, stochastic=True)

    torch.manual_seed(3)
    images = {
        "test digits": test_x[:6],
        "inverted digits": 1 - test_x[6:12],
        "uniform noise": torch.rand(6, 1, 8, 8),
    }
    stds, recon = {}, {}
    worst = 0.0
    for name, batch in images.items():
        var = output_variance(exact, batch, chunk_size=16)  # [6, 64], 4 passes
        _, glm = exact._glm_predictive_distribution(batch, diagonal_output=True)
        worst = max(worst, ((var - glm).abs() / glm.abs().clamp_min(1e-12)).max().item())
        stds[name] = var.sqrt().view(-1, 8, 8)
        with torch.no_grad():
            recon[name] = model(batch).view(-1, 8, 8)
    mc_std = output_variance(sampled, images["test digits"]).sqrt().view(-1, 8, 8)

    summary = {
        "train_loss": [losses[0], losses[-1]],
        "prior_precision": exact.prior_precision.item(),
        "prior_precision_mc": sampled.prior_precision.item(),
        "sigma_noise": exact.sigma_noise.item(),
        "max_rel_diff_vs_laplace_glm": worst,
        "mean_pixel_std": {name: s.mean().item() for name, s in stds.items()},
        "mean_pixel_std_mc_test_digits": mc_std.mean().item(),
    }
    (args.out / "uncertainty_map.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    _figure(images, recon, stds, mc_std, args.out / "uncertainty_map.png")
    print(f"saved {args.out / 'uncertainty_map.png'}")
    return summary


def _figure(images, recon, stds, mc_std, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for name in images:
        rows.append((f"{name}\ninput", images[name][:, 0], "gray", None))
        rows.append(("reconstruction", recon[name], "gray", None))
        rows.append(("predictive std\n(exact diag)", stds[name], "magma", "std"))
        if name == "test digits":
            rows.append(("predictive std\n(MC diag, k=4)", mc_std, "magma", "std"))
    vmax = max(max(s.max().item() for s in stds.values()), mc_std.max().item())
    fig, axes = plt.subplots(len(rows), 6, figsize=(8, 1.35 * len(rows)))
    for r, (label, values, cmap, kind) in enumerate(rows):
        for c in range(6):
            ax = axes[r, c]
            if kind == "std":
                im = ax.imshow(values[c], cmap=cmap, vmin=0, vmax=vmax)
            else:
                ax.imshow(values[c].clamp(0, 1), cmap=cmap, vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[r, 0].set_ylabel(label, fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.4, label="per-pixel predictive std")
    fig.suptitle(
        "Diagonal Laplace of a digits autoencoder: ggnchunk.output_variance", fontsize=10
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
