"""Columns replaced below a wide head by fewer with the same Gram matrix (issue 21).

A language model's head maps each token's ``C`` columns (one per word) to its ``D``-wide
input: below it they span ``D`` directions per token. The diagonal and the Kronecker
factors depend on the columns only through each sample's Gram matrix, so the sweep
replaces them there by each token's QR factor (``min(C, D)`` columns per token;
:mod:`ggnchunk._graph.compress`). Every case against the float64 brute force in several
chunkings, with the switch off (the same numbers), and with the replacement shown to
happen; per-sample quantities and shared parameters keep every column, except a table
tied between the embedding and the head, whose carried rows are mapped with the columns.

Segmenters resize small maps to the full image at the end: a column per output pixel
and class, but below the resize they span only the small maps' directions. There the
sweep replaces the vectors at every place it holds together (both classifiers of an
LRASPP head), with the Gram matrix of all of them kept
(:func:`~ggnchunk._graph.compress.compressed_jointly`).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ggnchunk
from ggnchunk._graph import compress, sweep
from tests.reference import assert_diag_close, reference_diag_ggn, reference_kron

VOCAB, WIDTH, T = 40, 4, 5
FOLD_COST = compress.FOLD_COST  # the library's: the cost guard's own tests use it


@pytest.fixture(autouse=True)
def _every_cut(monkeypatch):
    """The cut wherever it is exact, whatever it costs.

    The tables' small models cost little below their cuts, so the cost guard would
    keep their chunked passes whole; what is tested here is that the cut is exact
    (the guard's decisions have tests of their own, with the library's constant).
    """
    monkeypatch.setattr(compress, "FOLD_COST", 0.0)


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


class Segmenter(nn.Module):
    """LRASPP's shape: classifiers at 1/4 and 1/8 added, then resized to the image.

    A gate from the pooled deep features multiplies them (LRASPP's scale branch); at
    32×32 the 3·1,024 columns per image span 3·(64 + 16) directions below the resize.
    """

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 5, stride=4, padding=2)
        self.body = nn.Conv2d(4, 6, 3, stride=2, padding=1)
        self.gate = nn.Conv2d(6, 6, 1)
        self.low = nn.Conv2d(4, 3, 1)
        self.high = nn.Conv2d(6, 3, 1)

    def forward(self, x):
        low = torch.relu(self.stem(x))
        high = torch.tanh(self.body(low))
        high = high * torch.sigmoid(self.gate(high.mean((2, 3), keepdim=True)))
        up = F.interpolate(self.high(high), size=low.shape[-2:], mode="bilinear")
        return F.interpolate(self.low(low) + up, size=x.shape[-2:], mode="bilinear")


class DeepLabLike(nn.Module):
    """One classifier at 1/4 of the image, resized to it: 3·64 directions per image."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 5, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(5, 5, 3, stride=2, padding=2, dilation=2), nn.ReLU(),
        )  # fmt: skip
        self.head = nn.Conv2d(5, 3, 1)

    def forward(self, x):
        return F.interpolate(self.head(self.body(x)), scale_factor=4, mode="bilinear")


def _segmenter(n: int, cls: type[nn.Module] = Segmenter, loss: str = "ce"):
    torch.manual_seed(0)
    model = cls().double().eval()
    x = torch.randn(n, 3, 32, 32, dtype=torch.float64)
    if loss == "mse":
        return model, nn.MSELoss(), x, torch.randn(n, 3, 32, 32, dtype=torch.float64)
    return model, nn.CrossEntropyLoss(), x, torch.randint(0, 3, (n, 32, 32))


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
    "segmenter": _segmenter,
    "segmenter-mse": lambda n: _segmenter(n, loss="mse"),
    "deeplab-like": lambda n: _segmenter(n, DeepLabLike),
}  # fmt: skip
SEGMENTERS = ("segmenter", "segmenter-mse", "deeplab-like")
CHUNKINGS = {
    "onepass": {},
    "chunks3": {"num_chunks": 3},
    "budget": {"max_memory": "64MiB"},
    "batch-chunks": {"num_chunks": 2, "batch_chunk_size": 2},
}


@functools.cache
def _expected(name: str, n: int) -> dict[str, torch.Tensor]:
    return reference_diag_ggn(*PROBLEMS[name](n))  # the problems are seeded


@pytest.fixture
def replaced(monkeypatch):
    """How many times the sweeps replaced columns, and by how many."""
    seen: list[tuple[int, int]] = []

    def spy(vectors, carried=None):
        out = compress.compressed(vectors, carried)
        if out is not None:
            seen.append((vectors.shape[0], out.shape[0]))
        return out

    def jointly(values, carried=None):
        out = compress.compressed_jointly(values, carried)
        if out is not None:
            seen.append((compress._shape(values[0])[0], out[0].shape[0]))
        return out

    factor = compress.Cut.factor

    def cut(self, dtype):  # chunked passes: their Gram's factor, swept below the cut
        columns = factor(self, dtype)
        if columns and (self.total, columns) not in seen:
            seen.append((self.total, columns))
        return columns

    monkeypatch.setattr(sweep, "compressed", spy)
    monkeypatch.setattr(sweep, "compressed_jointly", jointly)
    monkeypatch.setattr(compress.Cut, "factor", cut)
    return seen


@pytest.mark.filterwarnings("ignore::ggnchunk.MemoryBudgetWarning")
@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", PROBLEMS)
def test_fewer_columns_match_the_brute_force(name, n, chunking, replaced):
    model, loss_func, x, y = PROBLEMS[name](n)
    got = ggnchunk.diag_ggn(model, loss_func, x, y, **CHUNKINGS[chunking])
    expected = _expected(name, n)
    assert_diag_close(got, expected, rtol=1e-10, label=f"{name} n={n} {chunking}")
    if name == "two-heads":  # not at a head (the other's columns wait at h): below
        assert chunking != "onepass" or [b for b, _ in replaced] == [VOCAB]
    elif name in SEGMENTERS:  # below the resize: the small maps' directions
        # in one pass at once (QR: as many as the directions); in chunks, the passes
        # stop there and the Gram's factor goes on below (without the directions no
        # column reaches: cross-entropy's per pixel, the high branch's beside the low)
        kept = 3 * (64 + 16) if name.startswith("segmenter") else 3 * 64
        assert replaced and all(after <= kept for _, after in replaced), replaced
        assert chunking == "onepass" or any(before == 3 * 1024 for before, _ in replaced)
    elif chunking in ("onepass", "batch-chunks"):
        # whole tokens (or samples) per pass: min(40, 4) columns for each
        assert replaced and all(after * 2 <= before for before, after in replaced)


@pytest.mark.parametrize("name", ["lm", "classifier", "segmenter"])
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


@pytest.mark.parametrize("chunks", [1, 3], ids=["onepass", "chunks3"])
@pytest.mark.parametrize("windows", [True, False], ids=["windowed", "dense"])
def test_segmenter_kronecker_factors_with_fewer_columns(
    windows, chunks, monkeypatch, replaced
):
    """Both classifiers' factors against the brute force, with and without windows.

    In chunks, the passes stop below the resize and their Gram's factor goes on.
    """
    from ggnchunk import _windows

    monkeypatch.setattr(_windows, "ENABLED", windows)
    model, loss_func, x, y = _segmenter(2)
    fewer = ggnchunk.kron_ggn(model, loss_func, x, y, num_chunks=chunks)
    assert replaced and all(after <= 3 * 80 for _, after in replaced), replaced
    assert chunks == 1 or replaced == [(3 * 1024, 2 * 64)]  # CE: 2 per low pixel
    expected = reference_kron(model, loss_func, x, y)
    assert set(fewer) == set(expected)
    for name, (output, inputs) in expected.items():
        assert torch.allclose(fewer[name].output, output, rtol=1e-10, atol=1e-14), name
        assert torch.allclose(fewer[name].input, inputs, rtol=1e-10, atol=1e-14), name


class _Logits(nn.Module):
    """Torchvision's segmenters return ``{"out": logits}``: the logits."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)["out"]


@pytest.mark.parametrize(
    "chunking", [{}, {"num_chunks": 5}, {"max_memory": "200MiB"}],
    ids=["onepass", "chunks5", "budget"],
)  # fmt: skip
def test_torchvision_lraspp_replaces_its_columns_below_the_resize(
    chunking, replaced, monkeypatch
):
    """Torchvision's LRASPP, float64: the classifiers and the first convolution train.

    The columns cross the whole frozen backbone to reach the first layer (in chunks:
    the Gram's factor of every pass's vectors below the resize, once; its cost guard as
    the library has it).
    """
    torchvision = pytest.importorskip("torchvision")
    monkeypatch.setattr(compress, "FOLD_COST", FOLD_COST)

    torch.manual_seed(0)
    net = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3
    )
    net.requires_grad_(False)
    net.classifier.low_classifier.requires_grad_(True)
    net.classifier.high_classifier.requires_grad_(True)
    net.backbone["0"][0].requires_grad_(True)
    model = _Logits(net).double().eval()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    y = torch.randint(0, 3, (2, 16, 16))
    got, report = ggnchunk.diag_ggn(
        model, nn.CrossEntropyLoss(), x, y, return_report=True, **chunking
    )
    # both 1x1 classifiers run at 1/8 of the image (the high branch is resized first)
    assert replaced and all(after <= 3 * (4 + 4) for _, after in replaced), replaced
    if chunking:  # one schedule for the passes, one for the factor's columns below
        assert len(report.schedules) == 2 and report.schedules[1].total <= 3 * 8
        assert report.schedules[1].factor and not report.schedules[0].factor
        # the report's chunk size counts the square root's columns only
        assert report.chunk_size == max(
            c.stop - c.start for c in report.schedules[0].chunks
        )
    expected = _lraspp_expected(model, x, y)
    assert_diag_close(got, expected, rtol=1e-9, label="lraspp")


_LRASPP: dict[str, dict[str, torch.Tensor]] = {}


def _lraspp_expected(model, x, y):
    if "out" not in _LRASPP:  # (the model and data are seeded: the same each time)
        _LRASPP["out"] = reference_diag_ggn(model, nn.CrossEntropyLoss(), x, y)
    return _LRASPP["out"]


@pytest.mark.parametrize("name", ["lm", "segmenter"])
def test_per_sample_keeps_every_column(name, replaced):
    model, loss_func, x, y = PROBLEMS[name](3)
    got = ggnchunk.diag_ggn(model, loss_func, x, y, per_sample=True)
    assert not replaced  # each sample's products are kept: no Gram to share
    assert_diag_close({k: v.sum(0) for k, v in got.items()}, _expected(name, 3), 1e-10)


def test_output_variance_keeps_every_column(replaced):
    """Each output's variance is a sum over parameters per column: no Gram to share."""
    model, _, x, _ = _segmenter(2, DeepLabLike)
    torch.manual_seed(1)
    variance = {
        n: torch.rand_like(p) for n, p in model.named_parameters() if p.requires_grad
    }
    got = ggnchunk.output_variance(model, x, variance)
    assert not replaced
    params = dict(model.named_parameters())
    for i in range(2):  # sum_p J_mp^2 s_p per output m, by torch.func
        jac = torch.func.jacrev(
            lambda p, i=i: torch.func.functional_call(model, p, (x[i : i + 1],))
        )(params)
        expected = sum(
            (jac[n].reshape(3 * 32 * 32, -1) ** 2 * variance[n].reshape(1, -1)).sum(1)
            for n in variance
        )
        assert torch.allclose(got[i].reshape(-1), expected, rtol=1e-10, atol=1e-14)


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


def test_the_joint_gram_is_kept_without_directions_no_column_reaches():
    """Two places' vectors together: the same Gram, rank-deficient in one sample."""
    torch.manual_seed(0)
    v, n = 200, 3
    first = torch.randn(v, n, 3, 4, dtype=torch.float64)
    second = torch.randn(v, n, 2, dtype=torch.float64)
    basis = torch.randn(5, 14, dtype=torch.float64)  # every column in 5 directions
    both = torch.randn(v, n, 5, dtype=torch.float64) @ basis
    first, second = both[..., :12].reshape(v, n, 3, 4), both[..., 12:]
    second[:, 1] = 0  # sample 1: its second place is never reached
    out = compress.compressed_jointly([first, second])
    assert out is not None and out[0].shape[0] == 5 and out[1].shape[1:] == (n, 2)
    for i in range(n):
        a = torch.cat([first[:, i].reshape(v, -1), second[:, i]], dim=1)
        b = torch.cat([out[0][:, i].reshape(5, -1), out[1][:, i]], dim=1)
        assert torch.allclose(b.T @ b, a.T @ a, rtol=1e-12, atol=1e-10)
    assert compress.compressed_jointly([first[:40], second[:40]]) is None  # 14 > 40/4


@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_a_cut_adds_up_every_chunks_gram(chunks):
    """The cut's factor after chunks of columns: the Gram of all of them, per sample."""
    from ggnchunk._graph.parts import _Waiting
    from ggnchunk._graph.traverse import STOP

    torch.manual_seed(0)
    v, n = 60, 2
    # (vectors a rule made from a trainable weight carry a graph: none is kept, or
    # each pass's R would keep every earlier one alive, 216 KiB a pass on a U-Net)
    outs = torch.randn(v, n, 3, dtype=torch.float64, requires_grad=True)
    srcs = torch.randn(v, n, 2, 2, dtype=torch.float64)
    cut = compress.Cut(v, room=None)

    class Call:
        index = 4

    for part in torch.arange(v).chunk(chunks):
        waiting = _Waiting()
        waiting.outs["out"], waiting.srcs["src"] = outs[part], srcs[part]
        assert cut.step(waiting, Call, len(part), {}) is STOP
        cut.commit()  # (its sweep finished)
        kept = cut.r if cut.r is not None else cut.pending[-1]
        assert kept.grad_fn is None
        cut.sweep_done()
    outs = outs.detach()
    assert cut.on and cut.index == 4 and cut.factor(torch.float64) == 7
    below = cut.waiting(0, 7, None)
    assert below.outs["out"].shape == (7, n, 3) and below.srcs["src"].shape == (7, n, 2, 2)
    for i in range(n):
        a = torch.cat([outs[:, i], srcs[:, i].reshape(v, -1)], dim=1)
        b = torch.cat([below.outs["out"][:, i], below.srcs["src"][:, i].reshape(7, -1)], 1)
        assert torch.allclose(b.T @ b, a.T @ a, rtol=1e-12, atol=1e-10)


def test_a_cut_is_not_taken_where_rows_are_carried_or_the_gram_is_too_large():
    from ggnchunk._graph.parts import _Waiting

    class Call:
        index = 2

    waiting = _Waiting()
    waiting.outs["out"] = torch.randn(40, 2, 3, dtype=torch.float64)
    carried = compress.Cut(400, room=None)  # a tied table's rows travel past it
    assert carried.step(waiting, Call, 40, {0: torch.zeros(40, 2)}) is None
    assert carried.decided and not carried.on
    small = compress.Cut(400, room=100)  # 3 * 8 * 2 * 3 * 3 bytes do not fit
    assert small.step(waiting, Call, 40, {}) is None and not small.decided
    few = compress.Cut(40, room=None)  # 3 directions against 40 columns: 3 > 40 / 4 no
    waiting.outs["out"] = torch.randn(40, 2, 11, dtype=torch.float64)
    assert few.step(waiting, Call, 40, {}) is None and not few.decided


@pytest.mark.parametrize("per_sample", [True, False], ids=["per-sample", "variance"])
def test_chunked_per_sample_quantities_keep_every_column(per_sample, replaced):
    model, loss_func, x, y = _segmenter(3, DeepLabLike)
    if per_sample:  # (the table's brute force, summed)
        got = ggnchunk.diag_ggn(model, loss_func, x, y, per_sample=True, num_chunks=3)
        summed = {k: v.sum(0) for k, v in got.items()}
        assert_diag_close(summed, _expected("deeplab-like", 3), 1e-10)
    else:
        variance = {
            n: torch.rand_like(p) for n, p in model.named_parameters() if p.requires_grad
        }
        chunked = ggnchunk.output_variance(model, x, variance, num_chunks=3)
        whole = ggnchunk.output_variance(model, x, variance)
        assert torch.allclose(chunked, whole, rtol=1e-12, atol=1e-14)
    assert not replaced


class TwoUnits(nn.Module):
    """Two one-unit branches whose outputs differ in scale by ``scale`` (found by a helper).

    Below the frozen decoder the columns' directions differ by ``scale``: a Gram
    matrix's eigendecomposition lost the small one past ``1e8`` (``b``'s diagonal came
    out 0), the QR factor keeps it.
    """

    def __init__(self, scale: float):
        super().__init__()
        self.a, self.b, self.dec = nn.Linear(4, 1), nn.Linear(4, 1), nn.Linear(2, 20)
        with torch.no_grad():
            w = torch.randn(20, 2)
            w[:10, 1], w[10:, 0] = 0, 0
            w[:, 0] *= scale
            self.dec.weight.copy_(w)
        self.dec.requires_grad_(False)

    def forward(self, x):
        return self.dec(torch.cat([self.a(x), self.b(x)], 1))


@pytest.mark.parametrize("chunking", [{}, {"num_chunks": 3}, {"chunk_size": 1}])
@pytest.mark.parametrize("scale", [1.0, 1e8, 1e12, 1e17, 1e20])
def test_directions_of_very_different_scales_are_kept(scale, chunking, replaced):
    torch.manual_seed(0)
    model = TwoUnits(scale).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    y = torch.randn(3, 20, dtype=torch.float64)
    got = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **chunking)
    assert replaced  # (at the cut, or by the one pass)
    expected = reference_diag_ggn(model, nn.MSELoss(), x, y)
    for name in expected:  # each parameter on its own scale
        assert_diag_close({name: got[name]}, {name: expected[name]}, 1e-10, label=name)


def test_the_joint_factor_keeps_a_direction_1e10_times_smaller():
    torch.manual_seed(0)
    v, n = 64, 2
    big = torch.randn(v, n, 3, dtype=torch.float64)
    small = 1e-10 * torch.randn(v, n, 2, dtype=torch.float64)
    out = compress.compressed_jointly([big, small])
    assert out is not None and out[0].shape[0] == 5
    for i in range(n):
        a = torch.cat([big[:, i], small[:, i]], dim=1)
        b = torch.cat([out[0][:, i], out[1][:, i]], dim=1)
        gram, kept = a.T @ a, b.T @ b
        assert torch.allclose(kept[3:, 3:], gram[3:, 3:], rtol=1e-10, atol=0)
        assert torch.allclose(kept, gram, rtol=1e-12, atol=1e-14)


def test_passes_below_a_cut_are_never_refused_after_the_passes_above(monkeypatch):
    """The call's first plan vouched for one column to the inputs: run one at a time.

    A budget a helper found refused below the cut (after 768 passes above it) where
    every column to the inputs fits: the plan's level had grown by what the heap kept.
    """
    from ggnchunk import _engine

    def too_large(self):  # as if the level had grown past the budget
        return 2**40, 1

    monkeypatch.setattr(_engine.GGNComputation, "below_cut_bytes", too_large)
    model, loss_func, x, y = _segmenter(1, DeepLabLike)
    got, report = ggnchunk.diag_ggn(
        model, loss_func, x, y, max_memory="256MiB", return_report=True
    )
    assert len(report.schedules) == 2 and report.schedules[1].mode == "fixed"
    assert report.schedules[1].chunk_size == 1
    assert_diag_close(got, _expected("deeplab-like", 1), rtol=1e-10)


def test_passes_above_a_cut_plan_without_the_caches_below_it(monkeypatch):
    """The caches of the layers below the cut are built by the passes from there.

    Torchvision's partly frozen LRASPP at 512 MiB counted 127.5 MiB of caches below its
    cut in every pass above it, where none is built: 22 passes where 16 fit.
    """
    from ggnchunk._graph import bound

    asked: list[tuple[tuple[str, int] | None, int]] = []
    fixed = bound.MemoryBound.fixed_bytes

    def spy(self, element, cut=None):
        value = fixed(self, element, cut)
        asked.append((cut, value))
        return value

    monkeypatch.setattr(bound.MemoryBound, "fixed_bytes", spy)
    model, loss_func, x, y = _segmenter(2, DeepLabLike)
    model.head.requires_grad_(False)  # the cut's place: caches below it only
    got, report = ggnchunk.diag_ggn(
        model, loss_func, x, y, max_memory="64MiB", return_report=True
    )
    assert len(report.schedules) == 2, report.schedules  # the passes stopped at a cut
    sides = {cut[0] for cut, _ in asked if cut is not None}
    assert sides == {"above", "below"}, asked
    whole = max(value for cut, value in asked if cut is None)
    above = [value for cut, value in asked if cut is not None and cut[0] == "above"]
    assert whole > 0 and max(above) < whole, asked  # the body's caches: below only
    expected = reference_diag_ggn(model, loss_func, x, y)
    assert_diag_close(got, expected, rtol=1e-10)


@pytest.mark.parametrize(
    ("name", "side"), [("lraspp_mobilenet_v3_large", 32), ("fcn_resnet50", 16)]
)
def test_larger_budgets_never_take_more_passes_below_the_cut(name, side):
    """The layers below a cut plan their forms for the factor's chunks, not the passes'.

    Torchvision's segmenters, all trainable (float64, one image). LRASPP's layers below
    its cut were planned for the passes' chunks of hundreds of columns, so their bound
    reserved the Gram form's matrices (3.4 MiB for a depthwise layer that kept 0.2 MiB
    of patches in one-column chunks): 2.5x its smallest budget ran the factor's 32
    columns 3 at a time, 20 passes where 2x took 15. FCN's passes above its cut ran
    with caches at 2x (lean at 1.6x), and so did the layers below, whose 2048-channel
    head then counted a weight per factor column: 11 passes where 1.6x took 6.
    """
    import re

    torchvision = pytest.importorskip("torchvision")

    torch.manual_seed(0)
    net = getattr(torchvision.models.segmentation, name)(
        weights=None, weights_backbone=None, num_classes=3, aux_loss=False
    )
    model = _Logits(net).double().eval()
    x = torch.randn(1, 3, side, side, dtype=torch.float64)
    y = torch.randint(0, 3, (1, side, side))
    loss_func = nn.CrossEntropyLoss()
    with pytest.raises(ggnchunk.MemoryBudgetError) as refused:
        ggnchunk.diag_ggn(model, loss_func, x, y, max_memory="1MiB")
    smallest = float(re.search(r"needs up to ([\d.]+) MiB", str(refused.value))[1])
    expected = ggnchunk.diag_ggn(model, loss_func, x, y)
    passes = []
    for factor in (1.6, 2.0, 2.5, 3.0):
        got, report = ggnchunk.diag_ggn(
            model, loss_func, x, y, max_memory=f"{smallest * factor:.1f}MiB",
            return_report=True,
        )  # fmt: skip
        assert len(report.schedules) == 2 and report.schedules[1].factor, report
        assert_diag_close(got, expected, rtol=1e-10, label=f"{factor}x")
        passes.append(report.num_passes)
    assert all(b <= a + 1 for a, b in itertools.pairwise(passes)), passes


def test_a_pass_retried_after_running_out_of_memory_adds_its_rows_once(monkeypatch):
    """A pass's rows count once, even where it fails after reaching the cut.

    Found by a helper's review: a pass stopped at the cut, added its rows to the
    factor, then ran out of memory squaring a glue parameter's products; its halves
    added them again (parameters below the cut 1.26-1.42x too large, no warning).
    """
    from ggnchunk import _quantities

    class Scaled(Segmenter):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.3))

        def forward(self, x):
            return super().forward(x) * self.scale  # a glue parameter above the cut

    torch.manual_seed(0)
    model = Scaled().double().eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    y = torch.randint(0, 3, (2, 32, 32))
    gathered, failed = [], []
    gather, square = compress.Cut._gather, _quantities._Products._square

    def counted(self, *args):
        gathered.append(1)
        return gather(self, *args)

    def fails_once(self, index, products):  # after the first pass's rows were taken
        if len(gathered) == 1 and not failed:
            failed.append(1)
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return square(self, index, products)

    monkeypatch.setattr(compress.Cut, "_gather", counted)
    monkeypatch.setattr(_quantities._Products, "_square", fails_once)
    with pytest.warns(UserWarning, match="ran out of memory"):
        got, report = ggnchunk.diag_ggn(
            model, nn.CrossEntropyLoss(), x, y, num_chunks=3, return_report=True
        )
    assert failed and len(report.schedules) == 2  # retried, then below the cut
    assert report.schedules[0].out_of_memory_splits == 1
    expected = reference_diag_ggn(model, nn.CrossEntropyLoss(), x, y)
    assert_diag_close(got, expected, rtol=1e-10)


def test_the_factor_is_folded_once_per_its_width_of_rows(monkeypatch):
    """Passes of fewer columns than the factor is wide wait: one QR per ``D`` rows.

    A QR of ``[N, D + V, D]`` in every pass of ``V << D`` columns took 29 s of a 33 s
    call (a helper's review: 64x64 images, ``chunk_size=64``, ``D = 768``).
    """
    folds: list[int] = []
    fold = compress.Cut._fold

    def counted(self, rows):
        folds.append(sum(r.shape[1] for r in rows))
        return fold(self, rows)

    monkeypatch.setattr(compress.Cut, "_fold", counted)
    model, loss_func, x, y = _segmenter(2)
    got, report = ggnchunk.diag_ggn(
        model, loss_func, x, y, chunk_size=16, return_report=True
    )
    passes = len(report.schedules[0].chunks)  # 192 passes, D = 3 * (64 + 16) = 240
    assert len(report.schedules) == 2 and passes == 3 * 32 * 32 // 16
    assert len(folds) <= passes // 4, folds  # not one per pass
    assert all(rows >= 240 for rows in folds[:-1]), folds  # the last: what is left
    assert_diag_close(got, _expected("segmenter", 2), rtol=1e-10)


@pytest.mark.parametrize(
    ("make", "side", "chunking", "cut"),
    [
        ("segmenter", 32, {"num_chunks": 3}, False),  # 0.82 D^2 below: not worth it
        ("deeplab-like", 32, {"num_chunks": 3}, True),  # 2.75 D^2 below
        ("deeplab-like", 32, {"max_memory": "64MiB"}, True),
    ],
)
def test_a_cut_is_taken_where_the_sweep_below_costs_more_than_its_factor(
    monkeypatch, make, side, chunking, cut
):
    """The library's cost guard: a cut only where the layers below cost ``D^2``.

    Below a 64x64 segmenter-like model's cut two small convolutions cost 0.69 ``D^2``
    per column and sample: the cut took 5.8 s against 1.6 s without it (a helper's
    review); at 32x32 one of them costs 2.75 ``D^2`` and the cut gained 1.9x.
    """
    monkeypatch.setattr(compress, "FOLD_COST", FOLD_COST)
    model, loss_func, x, y = PROBLEMS[make](2)
    got, report = ggnchunk.diag_ggn(model, loss_func, x, y, return_report=True, **chunking)
    assert (len(report.schedules) == 2) == cut, report.schedules
    assert_diag_close(got, _expected(make, 2), rtol=1e-10)
