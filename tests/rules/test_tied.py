"""A table tied between an embedding and an output head (GPT-2, BERT, T5).

Its diagonal is the two layers' own diagonals plus twice their cross term
(:mod:`ggnchunk._rules.tied`), with the columns compressed below the head and the kept
rows mapped with them. Every case against the float64 brute force in several
chunkings, with and without the compression, on batches of one and three; the pair's
path is shown to be taken where it applies, and left where it does not (a third use, a
head before the lookup). A spy that drops the cross term shows the test can fail.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ggnchunk
from ggnchunk import _quantities
from ggnchunk._graph import compress, sweep
from tests.reference import assert_diag_close, reference_diag_ggn

# a vocabulary 6 times the width (the columns compress below the head); tokens are
# made to repeat within a sample
VOCAB, WIDTH, T = 24, 4, 5


class TiedLM(nn.Module):
    """Lookup (with a padding row), a pre-norm residual MLP, the tied head per token."""

    def __init__(self, padding_idx: int | None = 0):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=padding_idx)
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 8), nn.GELU(), nn.Linear(8, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.mlp(self.norm(h))
        return self.head(h).transpose(1, 2)  # [N, vocab, T]: per-token CE


class Pooled(nn.Module):
    """Tokens looked up and averaged; one tied head (with a bias) per sample."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.body(self.embed(ids).mean(1)))


class Grid(nn.Module):
    """Index maps ``[N, 2, 3]``: two axes of positions at the lookup and the head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids) * 1.5)).permute(0, 3, 1, 2)


class ThreeUses(nn.Module):
    """T5's shared table: encoder and decoder lookups and the head (no pair)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        source = self.embed(ids).mean(1, keepdim=True).expand(-1, ids.shape[1], -1)
        h = torch.tanh(self.mix(torch.cat([source, self.embed(ids.flip(1))], -1)))
        return self.head(h).transpose(1, 2)


class HeadFirst(nn.Module):
    """The head runs before the lookup in the forward pass (no pair: kept products)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.proj = nn.Linear(WIDTH, VOCAB)

    def forward(self, x, ids):
        logits = self.head(torch.tanh(x))
        return logits + self.proj(self.embed(ids).sum(1))


def _ids(n: int, shape: tuple[int, ...] = (T + 1,)) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (n, *shape))
    ids.view(n, -1)[:, 1] = 0  # the padding row is looked up
    ids.view(n, -1)[:, 2] = ids.view(n, -1)[:, 3]  # a row looked up twice
    return ids


def _lm(n, loss="ce", padding_idx=0):
    torch.manual_seed(0)
    model = TiedLM(padding_idx).double().eval()
    ids = _ids(n)
    if loss == "mse":
        target = torch.randn(n, VOCAB, T, dtype=torch.float64)
        return model, nn.MSELoss(), ids[:, :-1], target, True
    return model, nn.CrossEntropyLoss(), ids[:, :-1], ids[:, 1:], True


def _pooled(n):
    torch.manual_seed(0)
    model = Pooled().double().eval()
    return model, nn.CrossEntropyLoss(), _ids(n), torch.randint(0, VOCAB, (n,)), True


def _grid(n):
    torch.manual_seed(0)
    model = Grid().double().eval()
    target = torch.randint(0, VOCAB, (n, 2, 3))
    return model, nn.CrossEntropyLoss(reduction="sum"), _ids(n, (2, 3)), target, True


def _three_uses(n):
    torch.manual_seed(0)
    model = ThreeUses().double().eval()
    ids = _ids(n)
    return model, nn.CrossEntropyLoss(), ids[:, :-1], ids[:, 1:], False


def _head_first(n):
    torch.manual_seed(0)
    model = HeadFirst().double().eval()
    x = torch.randn(n, WIDTH, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (n,))
    return model, nn.CrossEntropyLoss(), (x, _ids(n)), target, False


CASES = {
    "lm-ce": _lm,
    "lm-mse": lambda n: _lm(n, "mse"),
    "lm-no-padding": lambda n: _lm(n, padding_idx=None),
    "pooled": _pooled,
    "grid": _grid,
    "three-uses": _three_uses,
    "head-first": _head_first,
}
CHUNKINGS = {
    "onepass": {},
    "chunks3": {"num_chunks": 3},
    "budget": {"max_memory": "64MiB"},
    "batch-chunks": {"num_chunks": 2, "batch_chunk_size": 1},
}


@pytest.fixture
def crossed(monkeypatch):
    """How many cross terms the sweeps added."""
    calls = []
    real = _quantities.tied_cross

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(_quantities, "tied_cross", spy)
    return calls


def _run(model, loss_func, x, y, **options):
    args = x if isinstance(x, tuple) else (x,)
    return ggnchunk.diag_ggn(model, loss_func, args if len(args) > 1 else x, y, **options)


# every chunking with the compression, and the passes that compress without it
MODES = [(True, c) for c in CHUNKINGS] + [(False, "onepass"), (False, "batch-chunks")]


@pytest.mark.filterwarnings("ignore::ggnchunk.MemoryBudgetWarning")
@pytest.mark.parametrize(
    ("squeeze", "chunking"), MODES,
    ids=[f"{c}-{'compressed' if s else 'every-column'}" for s, c in MODES],
)  # fmt: skip
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", CASES)
def test_tied_table_matches_the_brute_force(name, n, squeeze, chunking, crossed,
                                            monkeypatch):  # fmt: skip
    model, loss_func, x, y, paired = CASES[name](n)
    monkeypatch.setattr(sweep, "COMPRESS", squeeze)
    got = _run(model, loss_func, x, y, **CHUNKINGS[chunking])
    expected = reference_diag_ggn(model, loss_func, x, y)
    assert_diag_close(got, expected, rtol=1e-10, label=f"{name} n={n} {chunking}")
    assert bool(crossed) == paired


def test_the_cross_term_is_needed(monkeypatch):
    """Without the cross term the table's diagonal is wrong (the test can fail)."""
    model, loss_func, x, y, _ = _lm(3)
    expected = reference_diag_ggn(model, loss_func, x, y)
    monkeypatch.setattr(_quantities, "tied_cross", lambda ctx, g, rows: rows.new_zeros(
        ctx.module.weight.shape))  # fmt: skip
    got = ggnchunk.diag_ggn(model, loss_func, x, y)
    with pytest.raises(AssertionError, match="embed.weight"):
        assert_diag_close(got, expected, rtol=1e-3)


def test_kept_rows_follow_the_compressed_columns(monkeypatch):
    """The columns are compressed between the head and the lookup, rows carried."""
    seen = []
    real = compress.compressed

    def spy(vectors, carried=None):
        out = real(vectors, carried)
        if out is not None:
            seen.append(sorted(carried or {}))
        return out

    monkeypatch.setattr(sweep, "compressed", spy)
    model, loss_func, x, y, _ = _lm(3)
    got = ggnchunk.diag_ggn(model, loss_func, x, y)
    assert seen and seen[0]  # compressed with the head's rows carried
    assert_diag_close(got, reference_diag_ggn(model, loss_func, x, y), rtol=1e-10)


@pytest.mark.parametrize("quantity", ["per-sample", "variance"])
def test_per_sample_quantities_keep_the_products(quantity, crossed):
    """Each sample's diagonal and output variances add the uses' products (no pair)."""
    model, loss_func, x, y, _ = _lm(3)
    if quantity == "per-sample":
        got = ggnchunk.diag_ggn(model, loss_func, x, y, per_sample=True)
        expected = reference_diag_ggn(model, loss_func, x, y, per_sample=True)
        assert_diag_close(got, expected, rtol=1e-10)
    else:
        params = dict(model.named_parameters())
        variance = {name: torch.rand_like(p) for name, p in params.items()}
        got = ggnchunk.output_variance(model, x, variance)
        jac = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (x,)))(
            params
        )
        expected = sum(
            (j.flatten(3) ** 2 * s.flatten()).sum(-1)
            for j, s in zip(jac.values(), variance.values(), strict=True)
        )
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, rtol=1e-10, atol=1e-14)
    assert not crossed


def test_float32_memory_budget_holds():
    """A budget over a tied LM: the bound counts the carried rows (no warning)."""
    import warnings

    torch.manual_seed(0)
    model = TiedLM().eval()
    ids = _ids(2, (17,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ggnchunk.MemoryBudgetWarning)
        got, report = ggnchunk.diag_ggn(
            model, nn.CrossEntropyLoss(), ids[:, :-1], ids[:, 1:],
            max_memory="40MiB", return_report=True,
        )  # fmt: skip
    expected = reference_diag_ggn(model, nn.CrossEntropyLoss(), ids[:, :-1], ids[:, 1:])
    assert_diag_close(got, expected, rtol=1e-5)
    assert report.num_columns == 16 * VOCAB  # per sample: 16 tokens
