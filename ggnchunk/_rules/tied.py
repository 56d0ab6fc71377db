r"""A vocabulary's table shared by its embedding and its output head (tied weights).

Language models (GPT-2, BERT's masked-language head, T5 with tied embeddings) use one
``[C, D]`` table twice: ``nn.Embedding`` looks rows up for the input tokens and an
``nn.Linear`` head maps the last features to the ``C`` logits. The table's per-column
products are the sum of the two uses' products, ``P = P_head + P_emb``, so its diagonal
is

.. math:: \sum_{v,n} P^2 = \sum_{v,n} P_{head}^2 + \sum_{v,n} P_{emb}^2
    + 2 \sum_{v,n} P_{head} \odot P_{emb}.

The first two terms are each layer's own diagonal, from its rule's fast form. The cross
term needs ``P_head`` only on the rows the sample's tokens look up (``P_emb`` is zero on
the others): with the head's input ``x`` (``[N, T, D]``) and its output vectors ``g``
(``[V, N, T, C]``), sample ``n``'s product on row ``r = tok[n, s]`` is
``sum_t g[v, n, t, r] x[n, t]`` (:func:`head_rows`, ``[V, N, S, D]``), kept from the
head's visit to the embedding's, where it meets the vectors ``e`` at the embedding's
output (:func:`embedding_cross`): ``2 sum_{v, n, s: tok[n, s] = r} head_rows[v, n, s]
* e[v, n, s]``.

The cross term is a sum over columns of products of two linear images of each column,
so it depends on the columns only through their Gram matrix: where the sweep replaces
the columns by fewer with the same Gram (:mod:`ggnchunk._graph.compress`), the kept rows
are mapped by the same orthonormal factor and stay exact.
"""

from __future__ import annotations

from torch import Tensor

from ggnchunk._rules.base import RuleContext
from ggnchunk._rules.embedding import EmbeddingRule
from ggnchunk._rules.linear import LinearRule

__all__ = ["embedding_cross", "head_rows", "is_tied_pair"]


def is_tied_pair(head_rule: object, embedding_rule: object) -> bool:
    """Whether two layers' rules are a head and an embedding sharing their ``weight``.

    Args:
        head_rule: The rule of the call visited first in the sweep (the later call).
        embedding_rule: The rule of the earlier call.

    Returns:
        ``True`` for ggnchunk's own ``nn.Linear`` rule (weight ``[C, D]``, not
        transformers' ``[D, C]`` ``Conv1D``) and its ``nn.Embedding`` rule.
    """
    return type(head_rule) is LinearRule and type(embedding_rule) is EmbeddingRule


def head_rows(head: RuleContext, grads: Tensor, embedding: RuleContext) -> Tensor:
    """The head weight's per-(column, sample) products on the rows the tokens look up.

    Args:
        head: The head's call (its input ``x``: ``[N, *T, D]``).
        grads: ``[V, N, *T, C]`` vectors at the head's output.
        embedding: The embedding's call (its indices ``[N, *S]``).

    Returns:
        ``[V, N, S, D]``: sample ``n``'s product ``sum_t grads[v, n, t, r] x[n, t]`` on
        row ``r = indices[n, s]`` (``S`` positions flattened).
    """
    n = grads.shape[1]
    x = head.x.reshape(n, -1, head.x.shape[-1])  # [N, T, D]
    g = grads.reshape(grads.shape[0], n, x.shape[1], grads.shape[-1])  # [V, N, T, C]
    rows = embedding.inputs[0].reshape(n, -1)  # [N, S]
    picked = g.gather(3, rows[None, :, None, :].expand(g.shape[0], n, g.shape[2], -1))
    return picked.transpose(2, 3) @ x.to(g.dtype)  # [V, N, S, T] @ [N, T, D]


def embedding_cross(embedding: RuleContext, grads: Tensor, rows: Tensor) -> Tensor:
    """Twice the cross term of the table's two uses, ``[C, D]``.

    Args:
        embedding: The embedding's call (its indices ``[N, *S]``).
        grads: ``[V, N, *S, D]`` vectors at the embedding's output.
        rows: :func:`head_rows` of the same columns, ``[V, N, S, D]``.

    Returns:
        ``2 sum_{v, n, s: indices[n, s] = r} rows[v, n, s] * grads[v, n, s]`` on row
        ``r`` (``padding_idx``'s row is 0: the lookup gives it no gradient).
    """
    module = embedding.module
    indices = embedding.inputs[0].reshape(-1)
    products = (rows * grads.reshape(rows.shape)).sum(0)  # [N, S, D]
    dim = products.shape[-1]
    result = products.new_zeros(module.num_embeddings, dim)
    result.index_add_(0, indices, products.reshape(-1, dim))
    if module.padding_idx is not None:
        result[module.padding_idx] = 0.0
    return result.mul_(2.0)
