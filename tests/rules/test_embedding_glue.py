"""Embedding lookups in the glue (learned positions, functional lookups) vs. brute force.

A lookup whose input has no batch axis (``positions(arange(T))``, GPT-2's learned
positions) or a functional ``F.embedding`` is glue: its weight gets per-sample products
from the glue sweep. Torch's vmap runs ``embedding_backward`` once per column there; the
sweep instead takes the gradients at the lookup's output (batched) and adds them into
rows. Each case is compared with the float64 brute force in several chunkings, with
batches of one, and the fast path is checked to warn about no per-column kernel.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ggnchunk
from tests.reference import assert_diag_close, reference_diag_ggn

VOCAB, LENGTH, DIM = 7, 4, 5


class Positions(nn.Module):
    """Token lookup (a rule) plus learned positions looked up without a batch axis."""

    def __init__(self, padding_idx: int | None = None, twice: bool = False,
                 scale_grad_by_freq: bool = False):  # fmt: skip
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Embedding(
            LENGTH, DIM, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq
        )
        self.twice = twice
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        where = torch.arange(ids.shape[1], device=ids.device)
        h = self.tokens(ids) + self.positions(where)
        if self.twice:  # the same table read a second time (two lookups, one weight)
            h = h * torch.tanh(self.positions(where.flip(0)))
        return self.head(self.ln(h)).transpose(1, 2)


class Functional(nn.Module):
    """``F.embedding`` on batched ids with a weight of the model's own (glue)."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, DIM))
        self.tied = tied
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        h = self.head(self.ln(F.embedding(ids, self.table)))
        if self.tied:  # the table read by a matrix product too: the generic path
            h = h + F.linear(self.ln(h[..., :DIM]), self.table)
        return h.transpose(1, 2)


class _ScaledLookup(nn.Embedding):
    """Gemma's token table: an ``nn.Embedding`` whose ``forward`` scales (glue)."""

    def forward(self, ids):
        return super().forward(ids) * DIM**0.5


class Scaled(nn.Module):
    """The scaled lookup of tokens with a padding row, a per-token head."""

    def __init__(self):
        super().__init__()
        self.tokens = _ScaledLookup(VOCAB, DIM, padding_idx=0)
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        return self.head(self.ln(self.tokens(ids))).transpose(1, 2)


CASES = {
    "positions": lambda: Positions(),
    "positions_padding_idx": lambda: Positions(padding_idx=1),
    "positions_read_twice": lambda: Positions(twice=True),
    "positions_scale_grad_by_freq": lambda: Positions(scale_grad_by_freq=True),
    "functional": lambda: Functional(),
    "functional_tied": lambda: Functional(tied=True),
    "scaled": lambda: Scaled(),
}
# lookups whose weight is read only by embedding nodes take the batched path
FAST = {
    "positions",
    "positions_padding_idx",
    "positions_read_twice",
    "functional",
    "scaled",
}


def _problem(name: str, n: int):
    torch.manual_seed(0)
    model = CASES[name]().double()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.normal_()
                module.bias.normal_()
    ids = torch.randint(0, VOCAB, (n, LENGTH))
    targets = torch.randint(0, VOCAB, (n, LENGTH))
    return model, nn.CrossEntropyLoss(), ids, targets


@pytest.mark.parametrize(
    "kwargs", [{}, {"chunk_size": 5}, {"batch_chunk_size": 2}],
    ids=["onepass", "size5", "subbatch2"],
)  # fmt: skip
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_embedding_in_glue_exact(name, n, kwargs):
    model, loss_func, ids, targets = _problem(name, n)
    expected = reference_diag_ggn(model, loss_func, ids, targets)
    actual = ggnchunk.diag_ggn(model, loss_func, ids, targets, **kwargs)
    assert_diag_close(actual, expected, rtol=1e-10, label=f"{name} N={n} {kwargs}")


# tables used once, by one lookup: squared from the lookup's vectors, no
# [V, N, rows, D] (a table read twice keeps its products; a lookup with
# scale_grad_by_freq is no plain gather)
SQUARED = {"positions": 1, "positions_padding_idx": 1, "positions_read_twice": 0,
           "positions_scale_grad_by_freq": 0, "functional": 1, "functional_tied": 0,
           "scaled": 1}  # fmt: skip


@pytest.mark.parametrize("kwargs", [{}, {"batch_chunk_size": 1}], ids=["whole", "ones"])
@pytest.mark.parametrize("name", list(CASES))
def test_tables_read_by_one_lookup_are_squared_there(name, kwargs, monkeypatch):
    """Which tables take the lookup's squares, and the diagonal against the brute force.

    Per pass, and per sample where the lookup is crossed one sample at a time.
    """
    from ggnchunk import _quantities

    seen = []
    real = _quantities.lookup_squares

    def spy(gather, grads, samples, stride):
        seen.append(gather.rows)
        return real(gather, grads, samples, stride)

    monkeypatch.setattr(_quantities, "lookup_squares", spy)
    model, loss_func, ids, targets = _problem(name, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ggnchunk.SlowBackwardWarning)
        got = ggnchunk.diag_ggn(model, loss_func, ids, targets, **kwargs)
    assert len(set(seen)) == SQUARED[name], seen
    assert_diag_close(got, reference_diag_ggn(model, loss_func, ids, targets), 1e-10)


@pytest.mark.parametrize("name", sorted(FAST))
def test_embedding_in_glue_batched(name):
    """No per-column ``embedding_backward``: no SlowBackwardWarning for these lookups."""
    model, loss_func, ids, targets = _problem(name, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ggnchunk.SlowBackwardWarning)
        ggnchunk.diag_ggn(model, loss_func, ids, targets, num_chunks=2)


@pytest.mark.parametrize("name", ["positions", "functional"])
def test_embedding_in_glue_per_sample(name):
    model, loss_func, ids, targets = _problem(name, 3)
    actual = ggnchunk.diag_ggn(model, loss_func, ids, targets, per_sample=True)
    for sample in range(3):
        expected = reference_diag_ggn(
            model, loss_func, ids[sample : sample + 1], targets[sample : sample + 1]
        )
        # the mean over 3 samples scales each sample's share by 1/3 (the mean over
        # its 4 tokens is the same in both)
        scaled = {k: v / 3 for k, v in expected.items()}
        got = {k: v[sample] for k, v in actual.items()}
        assert_diag_close(got, scaled, rtol=1e-10, label=f"{name} sample {sample}")


class _ScaledTokens(nn.Module):
    """Token ids looked up with ``scale_grad_by_freq=True``, in four layouts."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout
        self.tokens = nn.Embedding(VOCAB, DIM, scale_grad_by_freq=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        n, t = ids.shape
        if self.layout == "functional":
            h = F.embedding(ids, self.tokens.weight, scale_grad_by_freq=True)
        elif self.layout == "flat":  # [N * T] ids
            h = self.tokens(ids.reshape(-1)).reshape(n, t, DIM)
        elif self.layout == "sequence-first":  # [T, N] ids
            h = self.tokens(ids.t()).transpose(0, 1)
        else:
            h = self.tokens(ids)
        return self.head(torch.tanh(h)).transpose(1, 2)


@pytest.mark.parametrize("layout", ["module", "functional", "flat", "sequence-first"])
def test_scale_grad_by_freq_of_tokens_is_refused(layout):
    """Counts over the whole batch couple the samples: refused, with the fix.

    Followed, sub-batches of one sample gave another diagonal than the whole batch
    (the counts differ); the rule ignored the counts (0.99 off the brute force);
    flattened ids were 0.75 off. Refused wherever the indices are made from the batch,
    whatever their shape.
    """
    model, loss_func, ids, targets = _problem("positions", 3)
    model = _ScaledTokens(layout).double()
    with pytest.raises(ValueError, match="scale_grad_by_freq=False"):
        ggnchunk.diag_ggn(model, loss_func, ids, targets)
    assert not model.tokens._forward_hooks and not model.tokens._forward_pre_hooks
    model.tokens.weight.requires_grad_(False)  # frozen: nothing to scale
    frozen = ggnchunk.diag_ggn(model, loss_func, ids, targets)
    assert_diag_close(frozen, reference_diag_ggn(model, loss_func, ids, targets), 1e-10)


class _ScaledPositions(nn.Module):
    """Positions ``[1, T]`` (GPT-2's ``position_ids``) looked up with the counts."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Embedding(LENGTH, DIM, scale_grad_by_freq=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        where = torch.tensor([[0, 1, 1, 2]], device=ids.device)[:, : ids.shape[1]]
        return self.head(torch.tanh(self.tokens(ids) + self.positions(where))).transpose(
            1, 2
        )


@pytest.mark.parametrize("n", [1, LENGTH])
@pytest.mark.parametrize("kwargs", [{}, {"batch_chunk_size": 1}], ids=["whole", "ones"])
def test_scale_grad_by_freq_of_positions_is_followed(n, kwargs):
    """Indices not made from the batch: a fixed count per row, exact, at any ``N``.

    Also where their axis 0 has the batch's size (``[1, T]`` with ``N = 1``,
    ``arange(T)`` with ``N = T``), which a test of shapes refused.
    """
    torch.manual_seed(0)
    model = _ScaledPositions().double()
    ids = torch.randint(0, VOCAB, (n, LENGTH))
    targets = torch.randint(0, VOCAB, (n, LENGTH))
    loss_func = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ggnchunk.SlowBackwardWarning)
        got = ggnchunk.diag_ggn(model, loss_func, ids, targets, **kwargs)
    assert_diag_close(got, reference_diag_ggn(model, loss_func, ids, targets), 1e-10)
