"""Columns replaced below a wide head by fewer with the same Gram matrix (issue 21).

A language model's head maps each token's ``C`` columns (one per word) to its ``D``-wide
input: below it they span ``D`` directions per token. The diagonal and the Kronecker
factors depend on the columns only through each sample's Gram matrix, so the sweep
replaces them there by each token's QR factor (``min(C, D)`` columns per token;
:mod:`ggnchunk._graph.compress`). Every case against the float64 brute force in several
chunkings, with the switch off (the same numbers), and with the replacement shown to
happen; per-sample quantities and shared parameters keep every column, except a table
tied between the embedding and the head, whose carried rows are mapped with the columns.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ggnchunk
from ggnchunk._graph import compress, sweep
from tests.reference import assert_diag_close, reference_diag_ggn

VOCAB, WIDTH, T = 40, 4, 5


class TinyLM(nn.Module):
    """Embeddings, a pre-norm residual block with causal attention, a wide head."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 8), nn.GELU(), nn.Linear(8, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        a = self.norm(h)
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        h = h + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        h = h + self.mlp(h)
        return self.head(h).transpose(1, 2)  # [N, vocab, T]: per-token CE


class WideClassifier(nn.Module):
    """A 40-class head on a 4-wide feature: one block of columns per sample."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, WIDTH), nn.Tanh())
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        return self.head(self.body(x))


class TwoHeads(nn.Module):
    """Two wide heads on one feature: one head's columns meet the other's below them."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, WIDTH), nn.Tanh())
        self.first = nn.Linear(WIDTH, VOCAB // 2)
        self.second = nn.Linear(WIDTH, VOCAB // 2)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return torch.cat([self.first(h), self.second(h)], dim=1)


def _two_heads(n: int):
    torch.manual_seed(0)
    model = TwoHeads().double().eval()
    x = torch.randn(n, 6, dtype=torch.float64)
    return model, nn.CrossEntropyLoss(), x, torch.randint(0, VOCAB, (n,))


def _lm(n: int, tied: bool = False):
    torch.manual_seed(0)
    model = TinyLM(tied).double().eval()
    ids = torch.randint(0, VOCAB, (n, T + 1))
    return model, nn.CrossEntropyLoss(), ids[:, :-1], ids[:, 1:]


def _classifier(n: int):
    torch.manual_seed(0)
    model = WideClassifier().double().eval()
    x = torch.randn(n, 6, dtype=torch.float64)
    return model, nn.CrossEntropyLoss(), x, torch.randint(0, VOCAB, (n,))


PROBLEMS = {
    "lm": _lm, "classifier": _classifier, "lm-tied": lambda n: _lm(n, True),
    "two-heads": _two_heads,
}  # fmt: skip
CHUNKINGS = {
    "onepass": {},
    "chunks3": {"num_chunks": 3},
    "budget": {"max_memory": "64MiB"},
    "batch-chunks": {"num_chunks": 2, "batch_chunk_size": 2},
}


@pytest.fixture
def replaced(monkeypatch):
    """How many times the sweeps replaced columns, and by how many."""
    seen: list[tuple[int, int]] = []

    def spy(vectors, carried=None):
        out = compress.compressed(vectors, carried)
        if out is not None:
            seen.append((vectors.shape[0], out.shape[0]))
        return out

    monkeypatch.setattr(sweep, "compressed", spy)
    return seen


@pytest.mark.filterwarnings("ignore::ggnchunk.MemoryBudgetWarning")
@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", PROBLEMS)
def test_fewer_columns_match_the_brute_force(name, n, chunking, replaced):
    model, loss_func, x, y = PROBLEMS[name](n)
    got = ggnchunk.diag_ggn(model, loss_func, x, y, **CHUNKINGS[chunking])
    expected = reference_diag_ggn(model, loss_func, x, y)
    assert_diag_close(got, expected, rtol=1e-10, label=f"{name} n={n} {chunking}")
    if name == "two-heads":  # not at a head (the other's columns wait at h): below
        assert chunking != "onepass" or [b for b, _ in replaced] == [VOCAB]
    elif chunking in ("onepass", "batch-chunks"):
        # whole tokens (or samples) per pass: min(40, 4) columns for each
        assert replaced and all(after * 2 <= before for before, after in replaced)


@pytest.mark.parametrize("name", ["lm", "classifier"])
def test_the_switch_gives_the_same_diagonal(name, monkeypatch, replaced):
    model, loss_func, x, y = PROBLEMS[name](3)
    fewer = ggnchunk.diag_ggn(model, loss_func, x, y)
    assert replaced
    monkeypatch.setattr(sweep, "COMPRESS", False)
    every = ggnchunk.diag_ggn(model, loss_func, x, y)
    assert_diag_close(fewer, every, rtol=1e-12, label=name)


def test_kronecker_factors_with_fewer_columns(monkeypatch, replaced):
    """The hidden layer's output factor ``sum_n J_n^T H_n J_n`` against ``torch.func``."""
    model, loss_func, x, y = _classifier(3)
    fewer = ggnchunk.kron_ggn(model, loss_func, x, y)
    assert replaced
    z = model.body[0](x).detach()  # the hidden layer's output

    def logits(z_n):
        return model.head(torch.tanh(z_n))

    expected = torch.zeros(WIDTH, WIDTH, dtype=torch.float64)
    for i in range(3):
        out = logits(z[i]).detach()
        hess = torch.func.hessian(lambda o, i=i: loss_func(o[None], y[i : i + 1]) / 3)(out)
        jac = torch.func.jacrev(logits)(z[i])
        expected += jac.T @ hess @ jac
    factors = fewer["body.0"]
    assert torch.allclose(factors.output, expected, rtol=1e-10, atol=1e-14)
    monkeypatch.setattr(sweep, "COMPRESS", False)
    every = ggnchunk.kron_ggn(model, loss_func, x, y)
    for name, factor in fewer.items():
        assert torch.allclose(factor.output, every[name].output, rtol=1e-10, atol=1e-14)


def test_per_sample_keeps_every_column(replaced):
    model, loss_func, x, y = _lm(3)
    got = ggnchunk.diag_ggn(model, loss_func, x, y, per_sample=True)
    assert not replaced  # each sample's products are kept: no Gram to share
    total = reference_diag_ggn(model, loss_func, x, y)
    assert_diag_close({k: v.sum(0) for k, v in got.items()}, total, rtol=1e-10)


def test_the_gram_matrix_is_kept():
    """Each sample's Gram matrix, token by token, and columns on several tokens left."""
    torch.manual_seed(0)
    v, n = 120, 2
    vectors = torch.zeros(v, n, T, WIDTH, dtype=torch.float64)
    tokens = torch.randint(0, T, (v,))
    vectors[torch.arange(v), :, tokens] = torch.randn(v, n, WIDTH, dtype=torch.float64)
    vectors[7] = 0  # a zero column: dropped
    out = compress.compressed(vectors)
    assert out is not None and out.shape[0] <= T * WIDTH
    for i in range(n):
        a, b = vectors[:, i].reshape(v, -1), out[:, i].reshape(out.shape[0], -1)
        assert torch.allclose(b.T @ b, a.T @ a, rtol=1e-12, atol=1e-12)
    assert (out.ne(0).any(dim=(1, 3)).sum(dim=1) <= 1).all()  # one token per column
    zero = compress.compressed(torch.zeros_like(vectors))  # nothing to carry: one zero
    assert zero is not None and zero.shape[0] == 1 and not zero.any()
    vectors[0, :, (tokens[0] + 1) % T] = 1.0  # a column on two tokens
    assert compress.compressed(vectors) is None
