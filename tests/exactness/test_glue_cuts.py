"""Glue regions cut where another region starts: each crossed once per pass (issue 21).

A residual stream is glue from end to end: ``x + attn(norm(x))`` reaches the previous
block's output, which is itself an addition reaching the block before, and so on. Each
layer input on it starts a glue region; walked to the layer outputs, every later region
crossed the whole stream behind it again (torchvision's ViT with 8 layers: 114 s for
32 images, 12 s for 8). A region now stops at the sources of the regions behind it;
their vectors wait there and cross once, after every region cut at them. While a region
is crossed its cut nodes pass nothing on (their gradients are taken): a cut node on
another path to the region's layer outputs would otherwise be counted twice.

Every case is compared with the float64 brute force, in several chunkings, windowed and
dense, per sample, and with the cuts switched off (the same diagonal).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.models import VisionTransformer
from torchvision.models.convnext import CNBlockConfig, ConvNeXt

import ggnchunk
from ggnchunk import _windows
from ggnchunk._graph import recording
from tests.reference import assert_diag_close, reference_diag_ggn

D = 4


class Counted(torch.autograd.Function):
    """``2 * x`` whose backward calls are counted (vmap-able: the columns' batch)."""

    calls = 0

    @staticmethod
    def forward(x):
        return 2 * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        Counted.calls += 1
        return 2 * grad

    @staticmethod
    def vmap(info, in_dims, x):
        return 2 * x, in_dims[0]


class Stream(nn.Module):
    """A pre-norm residual stream of ``depth`` blocks, the glue counted in each block."""

    def __init__(self, depth: int = 4):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(depth))
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(depth))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        for norm, lin in zip(self.norms, self.lins, strict=True):
            x = x + Counted.apply(torch.tanh(lin(norm(x))))
        return self.head(x).flatten(1)


class RMSNorm(nn.Module):
    """Llama-style: a custom module, so glue (no rule), with a learned scale."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(D) + 0.5)

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class GlueNormStream(nn.Module):
    """A pre-norm stream whose norms are glue: no layer reads the stream itself.

    Each block's ``lin`` reads ``norm(x)``, so the stream ``x`` starts no region; the
    regions of the blocks' ``lin`` inputs all reach it. The tensor where they begin to
    overlap becomes a source of its own (timm's ``LayerNorm``, Llama's ``RMSNorm``).
    """

    def __init__(self, depth: int = 4):
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm() for _ in range(depth))
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(depth))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        for norm, lin in zip(self.norms, self.lins, strict=True):
            x = x + Counted.apply(torch.tanh(lin(norm(x))))
        return self.head(x).flatten(1)


class SharedBias(nn.Module):
    """T5-style: one position bias ``[1, H, T, T]`` from a table, added in every layer.

    Every layer's region reaches the bias, which has no batch axis (the samples share
    it): it must not become a source of its own (the samples' vectors would be summed
    there before the table's per-sample products). A CaiT-style ``qkv`` with the batch
    on axis 1 (``[3, N, H, T, d]``) is read in each layer too.
    """

    def __init__(self, layers: int = 3, heads: int = 2, length: int = 3):
        super().__init__()
        self.heads, self.length = heads, length
        self.table = nn.Parameter(torch.randn(2 * length - 1, heads))
        self.qkv = nn.ModuleList(nn.Linear(D, 3 * D) for _ in range(layers))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        n, t, d = x.shape
        where = torch.arange(t)
        bias = self.table[where[None, :] - where[:, None] + t - 1]  # [T, T, H]
        bias = bias.permute(2, 0, 1).unsqueeze(0)  # [1, H, T, T]
        for qkv in self.qkv:
            parts = qkv(x).reshape(n, t, 3, self.heads, d // self.heads)
            q, k, v = parts.permute(2, 0, 3, 1, 4)  # [3, N, H, T, d]
            scores = q @ k.transpose(-1, -2) + bias
            att = torch.softmax(scores, dim=-1) @ v
            x = x + att.transpose(1, 2).reshape(n, t, d)
        return self.head(x).flatten(1)


class CutOnAnotherPath(nn.Module):
    """The cut node lies on another path to the region's layer outputs.

    ``s = tanh(h)`` is ``inner``'s input (a region of its own) and is read again by the
    glue after ``inner``; ``tanh``'s node also leads to ``h``, which the later region
    reaches directly. Crossing that region must not pass ``s``'s vectors through
    ``tanh`` (its own region does).
    """

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(D, D)
        self.inner = nn.Linear(D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        h = self.first(x)
        s = torch.tanh(h)
        return self.head(self.inner(s) + s * h).flatten(1)


class LateConsumer(nn.Module):
    """The cut source's own layer is called after the layer of the region cut at it.

    ``s`` waits for ``a``'s region (``s * 2``), which the sweep crosses after ``b`` (the
    calls in reverse): ``s`` is due when ``a`` is done, not when ``b`` is.
    """

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(D, D)
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        s = torch.tanh(self.first(x))
        r = self.a(s * 2)
        q = self.b(s)
        return self.head(r + q).flatten(1)


class Chunked(nn.Module):
    """A GLU-style split: the cut would be one output of ``chunk``'s node (not cut)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(D, 2 * D)
        self.inner = nn.Linear(D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        a, b = torch.tanh(self.first(x)).chunk(2, dim=-1)
        return self.head(self.inner(a) * torch.sigmoid(b) + a).flatten(1)


class ImageStream(nn.Module):
    """Convolutional residual blocks with the stream in the glue, and a skip to the head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 3, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Conv2d(3, 3, 3, padding=1) for _ in range(3))
        self.head = nn.Conv2d(6, 2, 1)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        skip = h
        for block in self.blocks:
            h = h + torch.sin(block(h))
        return self.head(torch.cat([h, skip], dim=1))


def _vit():
    return VisionTransformer(
        image_size=8, patch_size=4, num_layers=3, num_heads=2, hidden_dim=8,
        mlp_dim=8, num_classes=3,
    )  # fmt: skip


def _convnext():
    stages = [CNBlockConfig(4, 8, 2), CNBlockConfig(8, None, 2)]
    return ConvNeXt(stages, num_classes=3)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, 2, 8, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


def _tokens(n):
    return torch.randn(n, 3, D, dtype=torch.float64)


def _images(n, side=8, channels=3):
    return torch.randn(n, channels, side, side, dtype=torch.float64)


MODELS = {
    # name: (model, inputs(n), classes or None for MSE on the output's shape)
    "stream": (Stream, lambda n: torch.randn(n, 2, D, dtype=torch.float64), 6),
    "glue-norm-stream": (
        GlueNormStream,
        lambda n: torch.randn(n, 2, D, dtype=torch.float64),
        6,
    ),
    "shared-bias": (SharedBias, lambda n: torch.randn(n, 3, D, dtype=torch.float64), 9),
    "cut-on-another-path": (CutOnAnotherPath, lambda n: torch.randn(n, D), 3),
    "chunked": (Chunked, lambda n: torch.randn(n, D), 3),
    "late-consumer": (LateConsumer, lambda n: torch.randn(n, D), 3),
    "image-stream": (ImageStream, lambda n: _images(n, 6, 2), None),
    "torchvision-vit": (_vit, _images, 3),
    "torchvision-convnext": (_convnext, _images, 3),
    "transformer-encoder": (Encoder, _tokens, 3),
}
CHUNKINGS = {
    "onepass": {},
    "chunks3": {"num_chunks": 3},
    "budget": {"max_memory": "64MiB"},
    "batch-chunks": {"num_chunks": 2, "batch_chunk_size": 2},
}


def _problem(name: str, n: int):
    make, inputs, classes = MODELS[name]
    torch.manual_seed(0)
    model = make().double().eval()
    x = inputs(n).double()
    if classes is None:
        return model, nn.MSELoss(), x, torch.randn_like(model(x))
    return model, nn.CrossEntropyLoss(), x, torch.randint(0, classes, (n,))


@pytest.mark.filterwarnings("ignore::ggnchunk.MemoryBudgetWarning")
@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", MODELS)
def test_cut_regions_match_the_brute_force(name, n, chunking):
    model, loss_func, x, y = _problem(name, n)
    got = ggnchunk.diag_ggn(model, loss_func, x, y, **CHUNKINGS[chunking])
    expected = reference_diag_ggn(model, loss_func, x, y)
    assert_diag_close(got, expected, rtol=1e-10, label=f"{name} n={n} {chunking}")


@pytest.mark.parametrize("name", MODELS)
def test_cut_regions_per_sample(name):
    n = 3
    model, loss_func, x, y = _problem(name, n)
    got = ggnchunk.diag_ggn(model, loss_func, x, y, per_sample=True, num_chunks=2)
    sum_loss = type(loss_func)(reduction="sum")
    # a sample's share of the batch's mean loss: CE averages over samples, MSE over
    # every output element
    scale = 1.0 / (n if isinstance(loss_func, nn.CrossEntropyLoss) else y.numel())
    for i in range(n):
        expected = reference_diag_ggn(model, sum_loss, x[i : i + 1], y[i : i + 1])
        assert_diag_close(
            {k: v[i] for k, v in got.items()},
            {k: scale * v for k, v in expected.items()},
            rtol=1e-10, label=f"{name} sample {i}",
        )  # fmt: skip


@pytest.mark.filterwarnings("ignore::ggnchunk.MemoryBudgetWarning")
@pytest.mark.parametrize("chunking", ["onepass", "budget"])
@pytest.mark.parametrize("windows", [False, True], ids=["dense", "windowed"])
def test_cut_regions_windowed(windows, chunking, monkeypatch):
    monkeypatch.setattr(_windows, "ENABLED", windows)
    monkeypatch.setattr(_windows, "MIN_POSITIONS", 0)
    monkeypatch.setattr(_windows, "TRIAL", False)
    model, loss_func, x, y = _problem("image-stream", 2)
    got = ggnchunk.diag_ggn(model, loss_func, x, y, **CHUNKINGS[chunking])
    expected = reference_diag_ggn(model, loss_func, x, y)
    assert_diag_close(got, expected, rtol=1e-10, label=f"{windows} {chunking}")


@pytest.mark.parametrize("name", MODELS)
def test_the_switch_gives_the_same_diagonal(name, monkeypatch):
    model, loss_func, x, y = _problem(name, 3)
    cut = ggnchunk.diag_ggn(model, loss_func, x, y, num_chunks=2)
    monkeypatch.setattr(recording, "CUT_AT_SOURCES", False)
    walked = ggnchunk.diag_ggn(model, loss_func, x, y, num_chunks=2)
    assert_diag_close(cut, walked, rtol=1e-12, label=name)


@pytest.mark.parametrize("stream", [Stream, GlueNormStream])
@pytest.mark.parametrize("depth", [2, 4, 6])
def test_each_block_is_crossed_once_per_pass(depth, stream, monkeypatch):
    """The counted glue runs once per block and pass cut, ``depth(depth+1)/2`` walked."""
    torch.manual_seed(0)
    model = stream(depth).double().eval()
    x = torch.randn(4, 2, D, dtype=torch.float64)
    y = torch.randint(0, 6, (4,))
    for cut, crossings in ((True, depth), (False, depth * (depth + 1) // 2)):
        monkeypatch.setattr(recording, "CUT_AT_SOURCES", cut)
        Counted.calls = 0
        ggnchunk.diag_ggn(model, nn.CrossEntropyLoss(), x, y, num_chunks=2)
        # two passes, and the check that samples stay independent (one more sweep);
        # the lins have rules, so no per-sample products cross the glue
        assert Counted.calls == 3 * crossings, (cut, Counted.calls)
