"""``nn.Embedding``: BackPACK 1.7.1 builds its one-hot matrix in float32 (fails in float64).

The output row ``(n, t)`` is row ``idx[n, t]`` of the weight, so sample ``n``'s
transposed Jacobian applied to a column ``M[v, n]`` of shape ``[T, D]`` adds the rows of
``M[v, n]`` with equal index. The GGN diagonal of row ``r`` is
``sum_{v, n} (sum_{t: idx[n, t] = r} M[v, n, t])**2``.
"""

from __future__ import annotations

import torch
from backpack.extensions.module_extension import ModuleExtension
from torch import Tensor, nn

__all__ = ["EmbeddingDiagGGN"]


class EmbeddingDiagGGN(ModuleExtension):
    """Exact GGN diagonal of an embedding table, in the parameters' dtype."""

    def __init__(self) -> None:
        super().__init__(params=["weight"])

    def weight(
        self,
        extension: object,
        module: nn.Embedding,
        g_inp: tuple[Tensor, ...],
        g_out: tuple[Tensor, ...],
        backproped: Tensor,
    ) -> Tensor:
        """Diagonal for ``module.weight``.

        Args:
            extension: The running BackPACK extension (unused).
            module: The embedding, with ``input0`` (indices ``[N, *]``) stored.
            g_inp: Gradients w.r.t. the inputs (unused).
            g_out: Gradients w.r.t. the output (unused).
            backproped: ``[V, N, *, D]``, the matrix backpropagated to the output.

        Returns:
            ``[num_embeddings, D]``.
        """
        indices = module.input0
        count, dim = module.num_embeddings, module.embedding_dim
        batch = indices.shape[0]
        sample = torch.arange(batch, device=indices.device).repeat_interleave(
            indices[0].numel()
        )
        keys = sample * count + indices.reshape(-1)
        unique, inverse = torch.unique(keys, return_inverse=True)
        columns = backproped.shape[0]
        summed = backproped.new_zeros(columns, unique.numel(), dim)
        summed.index_add_(1, inverse, backproped.reshape(columns, -1, dim))
        result = backproped.new_zeros(count, dim)
        result.index_add_(0, unique % count, (summed**2).sum(0))
        if module.padding_idx is not None:
            result[module.padding_idx] = 0.0
        return result
