"""The folded attention's backward on the query rows a column reaches.

A column's gradient at an attention output is often zero on most query rows (an output
pixel's column at a bottleneck's attention, a token's column at the last block's). The
backward then runs on those rows only (``_attention._columns_backward``). Checked
against ``torch.func.vjp`` of ``F.scaled_dot_product_attention`` per column in float64,
on row patterns with sparse, full, empty and mixed columns, masks and causal attention,
and end to end against the brute force, with the rows' form shown to run.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ggnchunk
from ggnchunk import _attention
from ggnchunk._autograd import batched_grad
from tests.reference import assert_diag_close, reference_diag_ggn

PATTERNS = {
    "sparse": lambda v, length, g: torch.rand(v, length, generator=g) < 0.2,
    "one-row": lambda v, length, g: torch.eye(length, dtype=torch.bool)[
        torch.randint(0, length, (v,), generator=g)
    ],
    "mixed": lambda v, length, g: torch.cat(
        [
            torch.rand(v - 3, length, generator=g) < 0.25,
            torch.ones(2, length, dtype=torch.bool),
            torch.zeros(1, length, dtype=torch.bool),
        ]
    ),
    "full": lambda v, length, g: torch.ones(v, length, dtype=torch.bool),
}
MASKS = ("none", "causal", "bool", "float")


def _inputs(mask_kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, heads, length, keys, dim, dim_v = 2, 3, 12, 12, 5, 4
    q = torch.randn(n, heads, length, dim, generator=g, dtype=torch.float64)
    k = torch.randn(n, heads, keys, dim, generator=g, dtype=torch.float64)
    v = torch.randn(n, heads, keys, dim_v, generator=g, dtype=torch.float64)
    kwargs = {}
    if mask_kind == "causal":
        kwargs["is_causal"] = True
    elif mask_kind == "bool":
        mask = torch.rand(n, 1, length, keys, generator=g) < 0.7
        mask[..., 0] = True  # every row attends to a key
        kwargs["attn_mask"] = mask
    elif mask_kind == "float":
        kwargs["attn_mask"] = torch.randn(length, keys, generator=g, dtype=torch.float64)
    return q, k, v, kwargs, g


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mask_kind", MASKS)
def test_rows_form_matches_the_vjp_per_column(pattern, mask_kind):
    q, k, v, kwargs, g = _inputs(mask_kind)
    columns = 9
    live = PATTERNS[pattern](columns, q.shape[2], g)  # [V, L]
    out_shape = (*q.shape[:-1], v.shape[-1])
    grads = torch.randn(columns, *out_shape, generator=g, dtype=torch.float64)
    grads = grads * live[:, None, None, :, None]
    calls = []
    original = _attention._on_rows

    def spy(gr, rows, *args):
        calls.append(None if rows is None else rows.shape[1])
        return original(gr, rows, *args)

    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = _attention.fold_attention((qg, kg, vg), kwargs)
    assert out is not None
    try:
        _attention._on_rows = spy
        got = batched_grad([out], [qg, kg, vg], [grads])
    finally:
        _attention._on_rows = original
    _, vjp = torch.func.vjp(lambda a, b, c: F.scaled_dot_product_attention(
        a, b, c, **kwargs), q, k, v)  # fmt: skip
    for column in range(columns):
        expected = vjp(grads[column])
        for name, a, e in zip("qkv", got, expected, strict=True):
            torch.testing.assert_close(
                a[column], e, rtol=1e-12, atol=1e-12, msg=f"d{name}, column {column}"
            )
    widths = [c for c in calls if c is not None]
    if pattern == "full":
        assert widths == []  # no column is sparse: the full form only
    else:  # the sparse columns took the rows' form, on their live rows only
        most = int(live[live.sum(1) <= q.shape[2] // 2].sum(1).max())
        assert widths == [max(most, 1)]


def test_nan_rows_count_as_live():
    """A NaN in a column's gradient is not skipped: it reaches the results as NaN."""
    q, k, v, kwargs, _ = _inputs("none")
    grads = torch.zeros(3, *q.shape[:-1], v.shape[-1], dtype=torch.float64)
    grads[0, 0, 0, 1, 0] = float("nan")
    grads[1, 1, 2, 4, 3] = 1.0
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = _attention.fold_attention((qg, kg, vg), kwargs)
    dq, _, dv = batched_grad([out], [qg, kg, vg], [grads])
    assert bool(dv[0, 0, 0].isnan().any()) and bool(dq[0, 0, 0, 1].isnan().any())
    assert not bool(dv[1].isnan().any()) and not bool(dv[2].isnan().any())


class LastTokens(nn.Module):
    """Two attention blocks and per-token logits: the last block's columns reach one row."""

    def __init__(self, dim: int = 8, vocab: int = 7):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        h = self.embed(idx)
        n, t, d = h.shape
        for layer in self.qkv:
            q, k, v = layer(h).split(d, dim=2)
            q, k, v = (z.view(n, t, 2, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + y.transpose(1, 2).reshape(n, t, d)
        return self.head(self.norm(h)).transpose(1, 2)


@pytest.mark.parametrize(
    "options", [{}, {"num_chunks": 3}, {"chunk_size": 1}, {"max_memory": "64MiB"}],
    ids=["onepass", "chunks3", "chunk_size1", "max_memory"],
)  # fmt: skip
def test_per_token_columns_take_the_rows_form_and_stay_exact(options, monkeypatch):
    torch.manual_seed(0)
    model = LastTokens().double()
    idx, targets = torch.randint(0, 7, (3, 10)), torch.randint(0, 7, (3, 10))
    widths = []
    original = _attention._on_rows

    def spy(g, rows, *args):
        widths.append(None if rows is None else rows.shape[1])
        return original(g, rows, *args)

    monkeypatch.setattr(_attention, "_on_rows", spy)
    got = ggnchunk.diag_ggn(model, nn.CrossEntropyLoss(), idx, targets, **options)
    monkeypatch.undo()
    expected = reference_diag_ggn(model, nn.CrossEntropyLoss(), idx, targets)
    assert_diag_close(got, expected, rtol=1e-10)
    assert 1 in widths  # the last attention: each token's columns on its own row


@pytest.mark.parametrize("mask_kind", ["none", "causal", "float"])
@pytest.mark.parametrize("pattern", ["sparse", "full"])
def test_grouped_query_attention_is_folded(mask_kind, pattern):
    """``enable_gqa=True`` (fewer key heads): folded, exact against the vjp per column."""
    q, k, v, kwargs, g = _inputs(mask_kind, seed=1)
    q = torch.cat([q, q.flip(2)], 1)  # 6 query heads on 3 key heads
    columns = 7
    live = PATTERNS[pattern](columns, q.shape[2], g)
    grads = torch.randn(columns, *q.shape[:-1], v.shape[-1], generator=g,
                        dtype=torch.float64) * live[:, None, None, :, None]  # fmt: skip
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = _attention.fold_attention((qg, kg, vg), {**kwargs, "enable_gqa": True})
    assert out is not None
    got = batched_grad([out], [qg, kg, vg], [grads])
    _, vjp = torch.func.vjp(lambda a, b, c: F.scaled_dot_product_attention(
        a, b, c, enable_gqa=True, **kwargs), q, k, v)  # fmt: skip
    for column in range(columns):
        for name, a, e in zip("qkv", got, vjp(grads[column]), strict=True):
            torch.testing.assert_close(
                a[column], e, rtol=1e-12, atol=1e-12, msg=f"d{name}, column {column}"
            )


def test_grouped_query_attention_without_enable_gqa_is_left_alone():
    q, k, v, _, _ = _inputs("none")
    q = torch.cat([q, q], 1).requires_grad_(True)
    assert _attention.fold_attention((q, k, v), {}) is None  # torch itself refuses it


class GroupedQuery(nn.Module):
    """A Mistral-style block: 4 query heads on 2 key heads, ``enable_gqa=True``."""

    def __init__(self, dim: int = 8, vocab: int = 7):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.q, self.kv = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        h = self.embed(idx)
        n, t, d = h.shape
        q = self.q(h).view(n, t, 4, 2).transpose(1, 2)
        k, v = (z.reshape(n, t, 2, 2).transpose(1, 2) for z in self.kv(h).split(d // 2, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.head(h + y.transpose(1, 2).reshape(n, t, d)).transpose(1, 2)


@pytest.mark.parametrize(
    "options", [{}, {"num_chunks": 3}, {"max_memory": "64MiB"}],
    ids=["onepass", "chunks3", "max_memory"],
)  # fmt: skip
def test_grouped_query_model_is_exact_without_a_per_column_loop(options):
    torch.manual_seed(0)
    model = GroupedQuery().double()
    idx, targets = torch.randint(0, 7, (3, 6)), torch.randint(0, 7, (3, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ggnchunk.SlowBackwardWarning)
        got = ggnchunk.diag_ggn(model, nn.CrossEntropyLoss(), idx, targets, **options)
    expected = reference_diag_ggn(model, nn.CrossEntropyLoss(), idx, targets)
    assert_diag_close(got, expected, rtol=1e-10)


@pytest.mark.parametrize("mask_kind", ["none", "causal"])
def test_keys_broadcast_over_heads_are_folded(mask_kind):
    """One key head broadcast over the query heads (Falcon's multi-query attention)."""
    q, k, v, kwargs, g = _inputs(mask_kind, seed=2)
    k, v = k[:, :1], v[:, :1]
    columns = 5
    live = PATTERNS["mixed"](columns + 3, q.shape[2], g)[-columns:]
    grads = torch.randn(columns, *q.shape[:-1], v.shape[-1], generator=g,
                        dtype=torch.float64) * live[:, None, None, :, None]  # fmt: skip
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = _attention.fold_attention((qg, kg, vg), kwargs)
    assert out is not None
    got = batched_grad([out], [qg, kg, vg], [grads])
    _, vjp = torch.func.vjp(lambda a, b, c: F.scaled_dot_product_attention(
        a, b, c, **kwargs), q, k, v)  # fmt: skip
    for column in range(columns):
        for name, a, e in zip("qkv", got, vjp(grads[column]), strict=True):
            torch.testing.assert_close(
                a[column], e, rtol=1e-12, atol=1e-12, msg=f"d{name}, column {column}"
            )
    # two axes broadcast (or a key axis larger than one): left to torch
    q2 = q[:1].expand(2, *q.shape[1:]).contiguous().requires_grad_(True)
    assert _attention.fold_attention((q2, k[:1], v[:1]), {}) is None


class WeightedMHA(nn.Module):
    """``nn.MultiheadAttention`` as most code calls it (``need_weights=True``).

    Per-token logits after one attention over token embeddings, optionally with a key
    padding mask (the ``baddbmm`` form), its weights used in the loss or dropped.
    """

    def __init__(self, dim=8, vocab=7, use_weights=False, padding=False, dropout=0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True, dropout=dropout)
        self.head = nn.Linear(dim, vocab)
        self.use_weights, self.padding = use_weights, padding

    def forward(self, idx):
        h = self.embed(idx)
        pad = None
        if self.padding:  # token 0 is padding (never a whole sequence here)
            pad = idx == 0
        a, weights = self.attn(h, h, h, key_padding_mask=pad)
        out = self.head(h + a)
        if self.use_weights:  # [N, T, T] added to the logits of the first T classes
            out = out + F.pad(weights, (0, out.shape[-1] - weights.shape[-1]))
        return out.transpose(1, 2)


@pytest.mark.parametrize("padding", [False, True], ids=["no-mask", "padding-mask"])
@pytest.mark.parametrize("use_weights", [False, True], ids=["output", "output-and-weights"])
def test_multihead_attention_with_weights_is_folded_and_exact(
    use_weights, padding, monkeypatch
):
    """The ``need_weights=True`` tail: the same output, the folded backward, exact."""
    torch.manual_seed(0)
    model = WeightedMHA(use_weights=use_weights, padding=padding).double()
    idx, targets = torch.randint(1, 7, (3, 6)), torch.randint(0, 7, (3, 6))
    idx[0, -2:] = idx[2, 1] = 0  # padding in two of the sequences
    from ggnchunk._folding import folded_glue

    with folded_glue():
        folded = model(idx)
    assert torch.equal(folded, model(idx)), "the folded tail computed something else"
    assert "_EagerAttentionBackward" in _node_names(folded)
    rows = []
    original = _attention._on_rows
    monkeypatch.setattr(
        _attention, "_on_rows",
        lambda g, r, *args: rows.append(r is not None) or original(g, r, *args),
    )  # fmt: skip
    for options in ({}, {"num_chunks": 3}, {"max_memory": "64MiB"}):
        with warnings.catch_warnings():
            warnings.simplefilter("error", ggnchunk.SlowBackwardWarning)
            got = ggnchunk.diag_ggn(model, nn.CrossEntropyLoss(), idx, targets, **options)
        expected = reference_diag_ggn(model, nn.CrossEntropyLoss(), idx, targets)
        assert_diag_close(got, expected, rtol=1e-10, label=str(options))
    assert any(rows), "a token's columns reach its own row: the rows' form"


def test_multihead_attention_with_dropout_keeps_torchs_tail():
    """Dropout draws between the softmax and the product: nothing is folded."""
    torch.manual_seed(0)
    model = WeightedMHA(dropout=0.5).double().train()
    from ggnchunk._folding import folded_glue

    with folded_glue():
        out = model(torch.randint(0, 7, (2, 5)))
    assert "_EagerAttentionBackward" not in _node_names(out)


def _node_names(output):
    """The names of every node behind ``output``.

    Every node visited is kept alive: before torch 2.13 ``next_functions`` makes a new
    Python object per access, and a dropped one's id is reused.
    """
    names, seen, stack, alive = set(), set(), [output.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        alive.append(node)
        names.add(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names
