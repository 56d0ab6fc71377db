"""``nn.Embedding``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ggnchunk._rules.base import LayerRule, RuleContext

__all__ = ["EmbeddingRule"]


class EmbeddingRule(LayerRule):
    """``nn.Embedding``: rows gathered by index; ``padding_idx``'s row gets 0.

    Sample ``n``'s product for row ``r`` is the sum of the output vectors at the positions
    whose index is ``r``.
    """

    classes = (nn.Embedding,)
    param_names = ("weight",)
    description = (
        "any index shape; `padding_idx` row is 0 (BackPACK's fails in float64); a table "
        "tied to an `nn.Linear` head: both rules plus a cross term; "
        "`scale_grad_by_freq=True` refused on indices made from the batch"
    )

    def accepts(self, module: nn.Module) -> bool:
        """Not with ``scale_grad_by_freq=True``: left to the recorded graph.

        Its gradient is divided by each index's count over the whole index tensor; the
        engine's forward refuses it where the indices are made from the batch (the
        counts couple the samples: :mod:`ggnchunk._folding`), and the glue follows
        torch's backward where they are not (positions).
        """
        return not module.scale_grad_by_freq

    def _grouped(self, ctx: RuleContext, grads: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        module, indices = ctx.module, ctx.inputs[0]
        count, dim = module.num_embeddings, module.embedding_dim
        n = indices.shape[0]
        sample = torch.arange(n, device=indices.device).repeat_interleave(
            indices[0].numel()
        )
        keys = sample * count + indices.reshape(-1)
        unique, inverse = torch.unique(keys, return_inverse=True)
        v = grads.shape[0]
        summed = grads.new_zeros(v, unique.numel(), dim)
        summed.index_add_(1, inverse, grads.reshape(v, -1, dim))
        return unique, summed, grads.new_zeros(count, dim)

    def diag(self, ctx, grads):
        module = ctx.module
        unique, summed, result = self._grouped(ctx, grads)
        result.index_add_(0, unique % module.num_embeddings, summed.square().sum(0))
        if module.padding_idx is not None:
            result[module.padding_idx] = 0.0
        return {"weight": result}

    def per_sample(self, ctx, grads):
        module = ctx.module
        count = module.num_embeddings
        unique, summed, _ = self._grouped(ctx, grads)
        v, n = grads.shape[:2]
        result = grads.new_zeros(v, n * count, module.embedding_dim)
        result.index_add_(1, unique, summed)
        result = result.view(v, n, count, -1)
        if module.padding_idx is not None:
            result[:, :, module.padding_idx] = 0.0
        return {"weight": result}
