"""Losses that ggnchunk adds to torch's: a Gaussian likelihood with a predicted variance.

``GaussianNLL`` is the negative log-likelihood of a heteroscedastic Gaussian whose model
predicts mean and log-variance on axis 1 of its output. Its curvature in ggnchunk is the
likelihood's **Fisher** with respect to (mean, log-variance) — ``1 / var`` for the mean
and ``1 / 2`` for the log-variance, per coordinate, scaled by the reduction — which is
positive semi-definite everywhere, whereas the Hessian of the NLL in these coordinates is
not (its log-variance entry ``(t - mean)**2 / (2 var)`` and mixed entries make it
indefinite away from the optimum). For a Gaussian, the GGN with the Fisher is the
standard generalized Gauss-Newton / Fisher-scoring curvature.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["GaussianNLL"]


class GaussianNLL(nn.Module):
    """Gaussian negative log-likelihood of an output holding mean and log-variance.

    ``loss(output, target)`` equals
    ``nn.GaussianNLLLoss(full=False, eps=eps, reduction=reduction)(mean, target, var)``
    with ``mean = output[:, 0]`` and ``var = output[:, 1].exp()``.

    Args:
        reduction: ``"mean"`` (over every target element) or ``"sum"``.
        eps: Lower clamp of the variance, as in ``nn.GaussianNLLLoss``.

    Examples:
        >>> import torch
        >>> out, t = torch.randn(4, 2, 3), torch.randn(4, 3)
        >>> torch_loss = torch.nn.GaussianNLLLoss()(out[:, 0], t, out[:, 1].exp())
        >>> bool(torch.allclose(GaussianNLL()(out, t), torch_loss))
        True
    """

    def __init__(self, reduction: str = "mean", eps: float = 1e-6):
        super().__init__()
        if reduction not in ("mean", "sum"):
            raise ValueError(
                f"reduction={reduction!r}: GaussianNLL needs a scalar loss; use 'mean' or "
                "'sum'."
            )
        self.reduction = reduction
        self.eps = float(eps)

    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        """The loss.

        Args:
            output: ``[N, 2, ...]``: mean on ``output[:, 0]``, log-variance on
                ``output[:, 1]``.
            target: ``[N, ...]``.

        Returns:
            Scalar loss.
        """
        mean, var = output[:, 0], output[:, 1].exp().clamp(min=self.eps)
        terms = 0.5 * (torch.log(var) + (target - mean) ** 2 / var)
        return terms.mean() if self.reduction == "mean" else terms.sum()
