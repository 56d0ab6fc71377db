"""A laplace-torch curvature backend with exact, chunked GGN diagonals.

Needs the optional dependency ``laplace-torch`` (``pip install 'ggnchunk[laplace]'``).

>>> from laplace import Laplace                                    # doctest: +SKIP
>>> from ggnchunk.laplace import ChunkedGGN                        # doctest: +SKIP
>>> la = Laplace(model, "regression", subset_of_weights="all",     # doctest: +SKIP
...              hessian_structure="diag", backend=ChunkedGGN,
...              backend_kwargs={"max_memory": "2GiB"})
>>> la.fit(train_loader)                                           # doctest: +SKIP

laplace-torch's conventions are kept exactly: ``diag(x, y)`` returns per-batch *sums*
(``0.5 x`` the loss and GGN of the summed MSE for regression, the summed cross-entropy's
for classification; no division by the dataset size), flattened over the trainable
parameters in order. Last-layer Laplace (``last_layer=True``) computes the features with
the feature extractor and the diagonal of the last layer only. No hooks stay on the
model, so laplace-torch's ``glm`` predictive (``torch.func``) works after ``fit``.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from torch import Tensor, nn

from ggnchunk._api import loss_grad_and_diag_ggn

try:
    from laplace.curvature import GGNInterface
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ggnchunk.laplace needs laplace-torch: pip install 'ggnchunk[laplace]' (or "
        "pip install laplace-torch)."
    ) from error

__all__ = ["ChunkedGGN"]


class ChunkedGGN(GGNInterface):
    """laplace-torch backend: exact diagonal GGN, chunked to fit a memory budget.

    Args:
        model: The model (or laplace-torch's feature extractor for last-layer Laplace).
        likelihood: ``"regression"`` or ``"classification"``.
        last_layer: Only the last layer's curvature (set by laplace-torch).
        subnetwork_indices: Indices of the flattened parameters to keep.
        dict_key_x: laplace-torch's key for dict inputs (not supported here).
        dict_key_y: laplace-torch's key for dict targets (not supported here).
        stochastic: Must be ``False``: this backend is exact.
        num_samples: Ignored (Monte-Carlo samples of stochastic backends).
        **chunking: Options of :func:`ggnchunk.diag_ggn`: ``max_memory``,
            ``num_chunks``, ``chunk_size``, ``batch_chunk_size``, ``recover_oom``.

    Only ``hessian_structure="diag"`` is supported: :meth:`kron` and :meth:`full` raise a
    ``NotImplementedError`` that names laplace-torch's backends for those structures.
    """

    _OPTIONS = ("max_memory", "num_chunks", "chunk_size", "batch_chunk_size", "recover_oom")

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        stochastic: bool = False,
        num_samples: int = 1,
        **chunking: Any,
    ):
        unknown = set(chunking) - set(self._OPTIONS)
        if unknown:
            raise TypeError(
                f"unknown backend_kwargs {sorted(unknown)}; ChunkedGGN takes "
                f"{', '.join(self._OPTIONS)} (and laplace-torch's own arguments)."
            )
        if stochastic:
            raise ValueError(
                "ChunkedGGN computes the exact GGN diagonal; stochastic=True is not "
                "available. Use laplace-torch's BackPackGGN for Monte-Carlo estimates."
            )
        super().__init__(model, likelihood, last_layer, subnetwork_indices, dict_key_x,
                         dict_key_y, stochastic=False, num_samples=num_samples)  # fmt: skip
        self.chunking = chunking

    def diag(
        self, x: Tensor | MutableMapping[str, Any], y: Tensor, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Loss and GGN diagonal of one batch, laplace-torch's convention.

        Args:
            x: Inputs ``[B, ...]``.
            y: Targets: ``[B, M]`` (or ``[B]`` for one output) for regression, class
                indices ``[B]`` for classification.
            **kwargs: laplace-torch's extra arguments (``N``), unused: sums are returned.

        Returns:
            ``(factor * loss, factor * diagonal)``, the diagonal flattened over the
            trainable parameters (of the last layer for last-layer Laplace).

        Raises:
            TypeError: For dict inputs.
            ValueError: For classification outputs other than ``[B, C]``.
        """
        if isinstance(x, MutableMapping):
            raise TypeError(
                "ChunkedGGN takes tensor inputs; dict inputs (Hugging Face models) are not "
                "supported. Use laplace-torch's CurvlinopsGGN for those."
            )
        model, inputs = self.model, x
        if self.last_layer:
            with torch.no_grad():
                _, features = self.model.forward_with_features(x)
            model, inputs = self.model.last_layer, features.detach()
        if self.likelihood == "regression" and y.dim() == 1:
            y = y.unsqueeze(1)  # one output per sample: [B] → [B, 1]
        loss, _, diag = loss_grad_and_diag_ggn(
            model, self.lossfunc, inputs, y, **self.chunking
        )
        flat = torch.cat([value.flatten() for value in diag.values()])
        if self.subnetwork_indices is not None:
            flat = flat[self.subnetwork_indices]
        return self.factor * loss, self.factor * flat

    def kron(self, x: Any, y: Tensor, N: int, **kwargs: Any) -> tuple[Tensor, Any]:
        """Not available: ChunkedGGN computes the GGN diagonal only.

        Raises:
            NotImplementedError: Always, saying which backend to use for ``"kron"``.
        """
        raise NotImplementedError(_only_diag("kron"))

    def full(self, x: Any, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Not available: ChunkedGGN computes the GGN diagonal only.

        Raises:
            NotImplementedError: Always, saying which backend to use for ``"full"``.
        """
        raise NotImplementedError(_only_diag("full"))


def _only_diag(structure: str) -> str:
    """The message for a Hessian structure other than ``"diag"``.

    Args:
        structure: laplace-torch's ``hessian_structure`` (``"kron"`` or ``"full"``).

    Returns:
        What ChunkedGGN computes and what to use instead.
    """
    return (
        'ChunkedGGN computes the exact GGN diagonal (hessian_structure="diag") only; '
        f'hessian_structure="{structure}" is not available. Use hessian_structure="diag" '
        "with ChunkedGGN, or laplace-torch's BackPackGGN or CurvlinopsGGN backend for "
        f'"{structure}" (e.g. Laplace(..., hessian_structure="{structure}", '
        "backend=CurvlinopsGGN))."
    )
