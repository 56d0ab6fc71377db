"""Glue parameters whose products are read per sample off one pass, and the proof of it.

A parameter whose every reader in the glue is a broadcast (a position table added, a
class token expanded, a layer scale, ``alpha`` of an addition, an ``addmm`` bias, a
functional layer or group norm's affine weight and bias; also through views such as
``gamma.reshape(1, -1, 1, 1)``), the right factor of a matrix product (``F.linear``'s
weight, ``nn.MultiheadAttention``'s projections) or an embedding lookup gets each
sample's products from one backward pass to its readers' outputs, grouped by sample,
instead of one pass per sample. The grouping is proven on the recorded graph once per
glue region, as a stride of the samples in the flattened output: a sequence-first model
whose token count equals the batch size (``T == N``: its shapes pass for batch-first)
gets the samples' axis 1, ``F.linear`` on ``[N, T, I]`` rows grouped by ``T``; a model
that reverses the batch around a bias has no such stride and must fail the proof (its
answer is wrong without it).

Every case is compared with the float64 brute force: the batch's diagonal in several
chunkings and each sample's diagonal (``per_sample=True``), at batch sizes 1, 2, 3 and 5.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import VisionTransformer
from torchvision.models.convnext import CNBlockConfig, ConvNeXt

import ggnchunk
import ggnchunk._graph.checks as checks
import ggnchunk._graph.readers as readers
import ggnchunk._quantities as quantities
from ggnchunk._autograd import grad_shape
from ggnchunk._quantities import _Products
from tests.reference import assert_diag_close, reference_diag_ggn
from tests.rules.test_batch_of_one import PositionsAndClassToken

D, T = 4, 3


class LayerScale(nn.Module):
    """CaiT/ConvNeXt-style layer scales, on either side of the product."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gamma = nn.Parameter(torch.randn(D))
        self.beta = nn.Parameter(torch.randn(1, 1, D))

    def forward(self, x):
        h = x + self.gamma * self.lin(x)
        h = h + torch.tanh(h) * self.beta
        return self.lin(h).flatten(1)


class Offsets(nn.Module):
    """Additions and subtractions with ``alpha``, the parameter on either side."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.a = nn.Parameter(torch.randn(T, D))
        self.b = nn.Parameter(torch.randn(1, T, 1))
        self.c = nn.Parameter(torch.randn(D))

    def forward(self, x):
        h = torch.add(x, self.a, alpha=-0.5)
        h = torch.sub(h, self.b, alpha=2.0)
        h = torch.sin(self.c - h)
        return self.lin(h).mean(1)


class LookupsAndPositions(nn.Module):
    """Token ids looked up in a table (``F.embedding`` in the glue) plus positions."""

    def __init__(self, vocab: int = 7):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, D))
        self.pos = nn.Parameter(torch.randn(1, T, D))
        self.lin = nn.Linear(D, 5)

    def forward(self, ids):
        h = F.embedding(ids, self.table, padding_idx=0) + self.pos
        return self.lin(torch.tanh(h)).sum(1)


class SequenceFirst(nn.Module):
    """Tokens first (``[T, N, D]``), a bias broadcast along axis 0 (not the samples').

    With ``T == N`` its shapes match a batch-first model's.
    """

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.bias = nn.Parameter(torch.randn(1, 1, D))
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        h = self.lin(x).transpose(0, 1) + self.bias  # [T, N, D]
        return self.head(torch.tanh(h).transpose(0, 1)).flatten(1)


class Reversed(nn.Module):
    """A bias added to the batch reversed (and reversed back).

    The samples' positions at the bias's output run backwards, which no stride of the
    flattened output describes.
    """

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.bias = nn.Parameter(torch.randn(D))
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        h = self.lin(x).flip(0) + self.bias
        return self.head(torch.tanh(h).flip(0)).flatten(1)


class FunctionalLinear(nn.Module):
    """A user's own weights through ``F.linear`` on 2-D and 3-D inputs, and ``x @ W``.

    2-D inputs take ``addmm`` (also called directly, with ``alpha`` and ``beta``); 3-D
    ones ``mm`` with the bias added after; ``W`` of ``x @ W`` is read as is (not
    transposed).
    """

    def __init__(self):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(5, D)), nn.Parameter(torch.randn(5))
        self.w2, self.b2 = nn.Parameter(torch.randn(D, 5)), nn.Parameter(torch.randn(D))
        self.w3 = nn.Parameter(torch.randn(D, 3))
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        h = torch.tanh(F.linear(self.lin(x), self.w1, self.b1))  # [N, T, 5]
        h = F.linear(h, self.w2, self.b2)  # [N, T, D]
        first = torch.sin(F.linear(h[:, 0], self.w1, self.b1))  # 2-D: addmm
        last = torch.addmm(self.b1, h[:, -1], self.w1.t(), beta=0.5, alpha=-2.0)
        return torch.cat([(h @ self.w3).flatten(1), first, last], 1)


class ConvNeXtLike(nn.Module):
    """Norms and layer scales in the glue, as timm's and transformers' ConvNeXts write them.

    timm's ``LayerNorm2d`` (permute, ``F.layer_norm``, permute back) and
    ``x.mul(gamma.reshape(1, -1, 1, 1))``; HF's channels-first norm
    (``weight[:, None, None] * x + bias[:, None, None]``); ``F.group_norm`` on a 1-D map
    and a weight-only layer norm: parameters read through views and by the norms' nodes.
    """

    def __init__(self, c: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(2, c, 3, padding=1)
        self.ln_weight, self.ln_bias = (
            nn.Parameter(torch.randn(c)),
            nn.Parameter(torch.randn(c)),
        )
        self.gamma = nn.Parameter(torch.randn(c))
        self.cf_weight, self.cf_bias = (
            nn.Parameter(torch.randn(c)),
            nn.Parameter(torch.randn(c)),
        )
        self.gn_weight, self.gn_bias = (
            nn.Parameter(torch.randn(c)),
            nn.Parameter(torch.randn(c)),
        )
        self.only_weight = nn.Parameter(torch.randn(c))
        self.conv2 = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        h = self.conv(x)
        ln = F.layer_norm(
            h.permute(0, 2, 3, 1), (h.shape[1],), self.ln_weight, self.ln_bias
        )
        h = h + ln.permute(0, 3, 1, 2).mul(self.gamma.reshape(1, -1, 1, 1))
        u = h.mean(1, keepdim=True)
        s = (h - u).pow(2).mean(1, keepdim=True)
        h = self.cf_weight[:, None, None] * ((h - u) / torch.sqrt(s + 1e-6))
        h = h + self.cf_bias[:, None, None]
        g = F.group_norm(h.flatten(2), 2, self.gn_weight, self.gn_bias).view_as(h)
        g = F.layer_norm(g.transpose(1, 3), (g.shape[1],), self.only_weight).transpose(1, 3)
        return self.conv2(torch.tanh(g)).flatten(1)


class StdConv2d(nn.Conv2d):
    """timm's ``StdConv2d`` (BiT's ResNetV2), its ``forward`` as timm writes it."""

    def __init__(self, *args, eps: float = 1e-6, **kwargs):
        super().__init__(*args, **kwargs)
        self.eps = eps

    def forward(self, x):
        weight = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1), None, None,
            training=True, momentum=0.0, eps=self.eps,
        ).reshape_as(self.weight)  # fmt: skip
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation,
                        self.groups)  # fmt: skip


class ScaledStdConv2d(nn.Conv2d):
    """timm's ``ScaledStdConv2d`` (NFNets): standardized, times a learned gain."""

    def __init__(self, *args, eps: float = 1e-6, **kwargs):
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.randn(self.out_channels, 1, 1, 1))
        self.scale = self.weight[0].numel() ** -0.5
        self.eps = eps

    def forward(self, x):
        weight = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1), None, None,
            weight=(self.gain * self.scale).view(-1), training=True, momentum=0.0,
            eps=self.eps,
        ).reshape_as(self.weight)  # fmt: skip
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation,
                        self.groups)  # fmt: skip


class ComputedConvWeights(nn.Module):
    """Convolutions whose weight is computed from parameters in ``forward``.

    timm's weight standardization (grouped, strided), NFNets' scaled form with a gain,
    torch's weight-norm parametrization (dilated, with a bias) and a functional
    convolution of a plain parameter: each parameter's products are one grouped weight
    gradient per convolution, carried back through the weight's computation.
    """

    def __init__(self):
        super().__init__()
        self.std = StdConv2d(4, 6, 3, padding=1, groups=2)
        self.scaled = ScaledStdConv2d(6, 6, 3, stride=2, padding=1, bias=False)
        self.normed = nn.utils.parametrizations.weight_norm(
            nn.Conv2d(6, 4, 3, padding=2, dilation=2)
        )
        self.w = nn.Parameter(torch.randn(4, 2, 1, 1))
        self.head = nn.Linear(4 * 9, 3)

    def forward(self, x):
        h = torch.tanh(self.std(x))
        h = torch.sigmoid(self.scaled(h))
        h = torch.tanh(self.normed(h))
        h = F.conv2d(h, self.w, groups=2)
        return self.head(h.flatten(1))


class Frames(nn.Module):
    """A video's frames folded into the batch (``[N·T, C, H, W]``): rows per sample."""

    def __init__(self):
        super().__init__()
        self.conv = StdConv2d(4, 3, 3, padding=1)
        self.spectral = nn.utils.parametrizations.spectral_norm(nn.Conv1d(3, 2, 3))

    def forward(self, x):
        n, t = x.shape[:2]
        h = torch.tanh(self.conv(x.flatten(0, 1)))  # [N·T, 3, H, W]
        h = h.reshape(n, t, 3, -1).mean(3).transpose(1, 2)  # [N, 3, T]
        return self.spectral(h).flatten(1)


class TransposedConvWeights(nn.Module):
    """Transposed convolutions whose weight is computed: HiFi-GAN's upsampling.

    A weight-normed ``ConvTranspose1d`` stack as HiFi-GAN's generator writes it (kernel
    ``2u``, stride ``u``, padding ``u / 2``, leaky ReLU, a weight-normed residual
    convolution), then a grouped, dilated ``ConvTranspose2d`` with ``output_padding``
    under spectral norm, and a functional transposed convolution of a plain parameter
    (no bias).
    """

    def __init__(self):
        super().__init__()
        weight_norm = nn.utils.parametrizations.weight_norm
        self.up1 = weight_norm(nn.ConvTranspose1d(4, 4, 4, 2, padding=1))
        self.res = weight_norm(nn.Conv1d(4, 4, 3, dilation=2, padding=2))
        self.up2 = nn.utils.parametrizations.spectral_norm(
            nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1, groups=2,
                               dilation=1)
        )  # fmt: skip
        self.w = nn.Parameter(torch.randn(4, 1, 2, 3) * 0.5)

    def forward(self, x):
        h = self.up1(F.leaky_relu(x, 0.1))  # [N, 4, 2L]
        h = h + self.res(F.leaky_relu(h, 0.1))
        h = torch.tanh(self.up2(h.unsqueeze(2)))  # [N, 4, 2, 4L]
        h = F.conv_transpose2d(h, self.w, stride=(1, 2), dilation=(2, 1))
        return h.flatten(1)


class ParameterParts(nn.Module):
    """Parts of parameters read in the glue: slices, a selection, splits.

    A position table longer than the sequence, sliced to it (``pos[:, :T]``, as
    Whisper's decoder), an offset slice of a table, a row selected from a table of gains,
    a negative slice, and a packed projection and its bias split in three and read by
    ``F.linear`` (``w.chunk(3)``: transposed parts of matrix products), attention
    between them; and a table's rows gathered by position ids per sample (transformers'
    Whisper decoder: ``weight[position_ids]``; here the first id is -1, the last row).
    Parts and whole parameters times constant numbers (``0.5 * pos``, ``gain / 3``,
    ``-tail``, a 0-d tensor times a scale: layer scales and ``alpha`` of timm's and
    OpenAI's models).
    """

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, T + 3, D))
        self.table = nn.Parameter(torch.randn(T + 2, D))
        self.gains = nn.Parameter(torch.randn(3, D))
        self.tail = nn.Parameter(torch.randn(2 * D))
        self.packed = nn.Parameter(torch.randn(3 * D, D) * 0.4)
        self.packed_bias = nn.Parameter(torch.randn(3 * D))
        self.rows = nn.Parameter(torch.randn(T + 1, D))
        self.scale = nn.Parameter(torch.randn(D))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        t = x.shape[1]
        ids = (torch.arange(t) - 1).expand(x.shape[0], t)
        h = x + 0.5 * self.pos[:, :t] + self.table[1 : t + 1] + self.rows[ids]
        h = h * (self.gains[1] / 3) - self.tail[-D:] * torch.tensor(2.0)
        h = h + torch.tanh(h) * (-self.scale * 0.25)
        wq, wk, wv = self.packed.chunk(3)
        bq, bk, bv = self.packed_bias.split([D, D, D])
        q, k, v = F.linear(h, wq, bq), F.linear(h, wk, bk), F.linear(h, wv, bv)
        scores = torch.softmax(q @ k.transpose(1, 2) / D**0.5, -1)
        return self.head((scores @ v + h)[:, 0])


def _torchvision_vit() -> nn.Module:
    """The ViT of torchvision, small: a class token expanded and a position table added."""
    return VisionTransformer(
        image_size=8, patch_size=4, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16,
        num_classes=3,
    )  # fmt: skip


def _torchvision_convnext() -> nn.Module:
    """The ConvNeXt of torchvision, small: ``LayerNorm2d`` and layer scales in the glue."""
    model = ConvNeXt([CNBlockConfig(4, 8, 1), CNBlockConfig(8, None, 1)], num_classes=3)
    with torch.no_grad():  # not the constant initialization
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.normal_()
                module.bias.normal_()
        for name, param in model.named_parameters():
            if name.endswith("layer_scale"):
                param.normal_()
    return model


def _torch_encoder(batch_first: bool) -> Callable[[], nn.Module]:
    """Torch's own ``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention`` inside)."""

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(
                D, 2, dim_feedforward=6, dropout=0.0, batch_first=batch_first
            )
            self.head = nn.Linear(D, 3)

        def forward(self, x):
            h = self.layer(x if batch_first else x.transpose(0, 1))
            return self.head(h if batch_first else h.transpose(0, 1)).mean(1)

    return Encoder


class EinsumsAndPermutes(nn.Module):
    """Parameters read through ``torch.einsum`` and views that reorder them.

    ``einsum("ntd,de->nte", h, w)`` (torch permutes and views the weight, then one
    ``bmm`` of a single matrix pair), ``einsum("ntd,ed->nte", h, v)`` (the weight read
    transposed), a table added transposed (``x + table.t()``) and a permuted row of a
    3-d gain; per-head weights (``einsum("nhtd,hde->nhte")``, and ``"nhtd,hed->nhte"``
    read permuted: ``bmm`` of one matrix pair per head) and a weight per position
    (``torch.bmm`` of the tokens' ``[T, N, D]`` with a ``[T, D, D]`` parameter: each
    pair's rows are the samples).
    """

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) * 0.4)
        self.v = nn.Parameter(torch.randn(D, D) * 0.4)
        self.table = nn.Parameter(torch.randn(D, T))
        self.gain = nn.Parameter(torch.randn(2, D, 1))
        self.heads = nn.Parameter(torch.randn(2, D // 2, 3) * 0.5)
        self.heads_out = nn.Parameter(torch.randn(2, D // 2, 3) * 0.5)
        self.positions = nn.Parameter(torch.randn(T, D, D) * 0.4)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        n, t, _ = x.shape
        h = torch.tanh(torch.einsum("ntd,de->nte", x, self.w)) + self.table.t()
        h = torch.einsum("ntd,ed->nte", h, self.v) * self.gain[1].permute(1, 0)
        split = h.view(n, t, 2, D // 2).transpose(1, 2)  # [N, heads, T, D/2]
        per_head = torch.einsum("nhtd,hde->nhte", torch.tanh(split), self.heads)
        back = torch.einsum("nhte,hde->nhtd", torch.tanh(per_head), self.heads_out)
        h = h + back.transpose(1, 2).reshape(n, t, D)
        h = h + torch.bmm(torch.tanh(h).transpose(0, 1), self.positions).transpose(0, 1)
        return self.head(torch.tanh(h)[:, 0])


class MatrixProducts(nn.Module):
    """Parameters as right factors of ``@`` and ``baddbmm`` in the glue (folded products).

    A projection of the first token (``x[:, 0] @ proj``, OpenAI CLIP's), of every token
    (``h @ w``, 3-d times 2-d), per-head weights broadcast over the samples
    (``[N, H, T, D] @ [H, D, E]``), the same read transposed (``.mT``) and square
    (not folded: torch expands it over the samples, read as a broadcast), vectors on
    the right (``h @ v``, and a part of one as a column), and ``baddbmm`` of a fixed
    bias with a weight per position.
    """

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, 2 * D) * 0.4)
        self.heads = nn.Parameter(torch.randn(2, D // 2, 3 * D) * 0.4)
        self.heads_t = nn.Parameter(torch.randn(2, D // 2, 3 * D) * 0.4)
        self.square = nn.Parameter(torch.randn(2, D // 2, D // 2) * 0.4)
        self.vec = nn.Parameter(torch.randn(D))
        self.vecs = nn.Parameter(torch.randn(2 * D))
        self.positions = nn.Parameter(torch.randn(T, D, 2 * D) * 0.4)
        self.proj = nn.Parameter(torch.randn(2 * D, 3) * 0.4)

    def forward(self, x):
        n, t, _ = x.shape
        h = torch.tanh(x @ self.w)[..., :D] + x  # [N, T, D]
        split = torch.tanh(h).view(n, t, 2, D // 2).transpose(1, 2)  # [N, 2, T, D/2]
        wide = split @ self.heads  # [N, 2, T, 3D]
        back = torch.tanh(wide) @ self.heads_t.mT  # [N, 2, T, D/2]
        back = back + torch.tanh(back) @ self.square  # square: torch expands it
        h = h + wide.sum(1)[..., :D] + back.transpose(1, 2).reshape(n, t, D)
        pooled = (torch.tanh(h) @ self.vec)[..., None] + torch.tanh(h) @ self.vecs[D:, None]
        h = h + pooled  # a vector on the right, and a part of one as a column
        bias = torch.ones(t, n, 2 * D, dtype=x.dtype)
        tokens = torch.baddbmm(bias, torch.tanh(h).transpose(0, 1), self.positions)
        return torch.tanh(tokens.transpose(0, 1))[:, 0] @ self.proj


class EndTokens(nn.Module):
    """OpenAI CLIP's text head: each sequence's end token times ``text_projection``.

    ``x[torch.arange(N), text.argmax(-1)] @ self.text_projection`` after a token and
    position embedding and a pre-norm residual MLP (the end token: the largest id).
    """

    def __init__(self):
        super().__init__()
        self.token_embedding = nn.Embedding(7, D)
        self.positional_embedding = nn.Parameter(torch.randn(T, D))
        self.ln = nn.LayerNorm(D)
        self.mlp = nn.Linear(D, D)
        self.text_projection = nn.Parameter(torch.randn(D, 3) * 0.5)

    def forward(self, text):
        x = self.token_embedding(text) + self.positional_embedding
        x = x + torch.tanh(self.mlp(self.ln(x)))
        return x[torch.arange(x.shape[0]), text.argmax(dim=-1)] @ self.text_projection


class TorchDecoderLayer(nn.Module):
    """Torch's ``nn.TransformerDecoderLayer``, causal, its memory a projection of the input.

    Its cross-attention reads the packed input projection in parts
    (``in_proj_weight.split([E, 2E])``). Its causal self-attention gives the first
    query rounding alone (a softmax over one key has a zero gradient), which the proof
    of the projection's samples must see through.
    """

    def __init__(self, width: int = 32):  # rounding shows from 4 heads of 8
        super().__init__()
        self.up, self.memory = nn.Linear(D, width), nn.Linear(D, width)
        self.layer = nn.TransformerDecoderLayer(
            width, 4, dim_feedforward=6, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        memory = torch.tanh(self.memory(x[:, :2]))
        h = self.layer(self.up(x), memory, tgt_mask=mask, tgt_is_causal=True)
        return self.head(h).mean(1)


def _inputs(name: str, n: int) -> torch.Tensor:
    if name == "end-tokens":
        return torch.randint(0, 7, (n, T))
    if name == "lookups":
        ids = torch.randint(0, 7, (n, T))
        ids[0, 0] = 0  # the padding row
        return ids
    if name == "sequence-first":
        return torch.randn(n, n, D, dtype=torch.float64)  # T == N
    if name == "convnext-norms":
        return torch.randn(n, 2, 3, 3, dtype=torch.float64)
    if name == "torchvision-vit":
        return torch.randn(n, 3, 8, 8, dtype=torch.float64)
    if name == "torchvision-convnext":
        return torch.randn(n, 3, 16, 16, dtype=torch.float64)
    if name == "computed-conv-weights":
        return torch.randn(n, 4, 6, 6, dtype=torch.float64)
    if name == "frames":
        return torch.randn(n, 5, 4, 3, 3, dtype=torch.float64)
    if name == "transposed-conv-weights":
        return torch.randn(n, 4, 3, dtype=torch.float64)
    return torch.randn(n, T, D, dtype=torch.float64)


MODELS = {
    "positions-class-token": (lambda: PositionsAndClassToken(T, D), "ce"),
    "layer-scale": (LayerScale, "mse"),
    "offsets-alpha": (Offsets, "mse"),
    "lookups": (LookupsAndPositions, "ce"),
    "sequence-first": (SequenceFirst, "mse"),
    "reversed": (Reversed, "mse"),
    "functional-linear": (FunctionalLinear, "mse"),
    "convnext-norms": (ConvNeXtLike, "mse"),
    "computed-conv-weights": (ComputedConvWeights, "ce"),
    "frames": (lambda: Frames().eval(), "mse"),
    "transposed-conv-weights": (lambda: TransposedConvWeights().eval(), "mse"),
    "parameter-parts": (ParameterParts, "ce"),
    "einsums-and-permutes": (EinsumsAndPermutes, "mse"),
    "matrix-products": (MatrixProducts, "ce"),
    "end-tokens": (EndTokens, "ce"),
    # models others wrote
    "torchvision-vit": (_torchvision_vit, "ce"),
    "torchvision-convnext": (_torchvision_convnext, "ce"),
    "torch-encoder-layer": (_torch_encoder(True), "ce"),
    "torch-decoder-layer": (TorchDecoderLayer, "ce"),
}
# whether every reader's samples are proven (for batches of two or more)
PROVEN = {name: name != "reversed" for name in MODELS}


def _problem(name: str, n: int, seed: int = 0):
    torch.manual_seed(seed)
    build, loss = MODELS[name]
    model = build().double()
    x = _inputs(name, n)
    with torch.no_grad():
        out = model(x)
    if loss == "ce":
        return model, nn.CrossEntropyLoss(), x, torch.randint(0, out.shape[1], (n,))
    return model, nn.MSELoss(reduction="sum"), x, torch.randn_like(out)


@pytest.fixture(autouse=True)
def always(monkeypatch):
    """Read per sample also where one pass per sample would cross the region less.

    The small batches of these tables would take the passes per sample: the readers are
    what is tested.
    """
    monkeypatch.setattr(checks, "READ_PER_SAMPLE_ALWAYS", True)


@pytest.fixture
def proofs(monkeypatch):
    """The proofs' answers in order, and ``"slow"`` for each pass per sample."""
    seen: list[bool | str] = []
    prove = checks.sample_strides
    slow = _Products._one_sample_at_a_time

    def watched(*args):
        strides = prove(*args)
        seen.append(all(stride is not None for stride in strides))
        return strides

    def one_at_a_time(*args):
        seen.append("slow")
        return slow(*args)

    monkeypatch.setattr(checks, "sample_strides", watched)
    monkeypatch.setattr(_Products, "_one_sample_at_a_time", staticmethod(one_at_a_time))
    return seen


CHUNKINGS = [{}, {"chunk_size": 1}, {"num_chunks": 2, "batch_chunk_size": 2}]


@pytest.mark.parametrize("kwargs", CHUNKINGS, ids=["onepass", "size1", "chunks2-sub2"])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("name", list(MODELS))
def test_glue_readers_match_the_brute_force(name, n, kwargs, proofs):
    model, loss_func, x, y = _problem(name, n)
    got = ggnchunk.diag_ggn(model, loss_func, x, y, **kwargs)
    expected = reference_diag_ggn(model, loss_func, x, y)
    assert_diag_close(got, expected, rtol=1e-10, label=f"{name} N={n} {kwargs}")
    assert proofs, "the glue's parameters were not read per sample"
    sub_batch = min(n, kwargs.get("batch_chunk_size", n))
    if sub_batch >= 2:
        assert proofs[0] is PROVEN[name]
    # every glue parameter of the proven models is read off one pass per region
    assert ("slow" in proofs) is not PROVEN[name] or sub_batch == 1


@pytest.mark.parametrize("n", [1, 3, 5])
@pytest.mark.parametrize("name", list(MODELS))
def test_glue_readers_per_sample(name, n):
    model, loss_func, x, y = _problem(name, n, seed=1)
    got = ggnchunk.diag_ggn(model, loss_func, x, y, per_sample=True, num_chunks=2)
    sum_loss = type(loss_func)(reduction="sum")
    scale = 1.0 / n if getattr(loss_func, "reduction", "sum") == "mean" else 1.0
    for i in range(n):
        expected = reference_diag_ggn(model, sum_loss, x[i : i + 1], y[i : i + 1])
        assert_diag_close(
            {k: v[i] for k, v in got.items()},
            {k: scale * v for k, v in expected.items()},
            rtol=1e-10, label=f"{name} sample {i} of {n}",
        )  # fmt: skip
    total = reference_diag_ggn(model, loss_func, x, y)
    assert_diag_close({k: v.sum(0) for k, v in got.items()}, total, rtol=1e-10)


def test_without_the_proof_the_reversed_answer_is_wrong(monkeypatch):
    """The proof is what keeps the grouping exact: a stride forced, the answer is off.

    Forced to read axis 0 as the samples, the bias's products go to the reversed
    samples: the batch's sum is the same, each sample's diagonal is not.
    """
    model, loss_func, x, y = _problem("reversed", 3)
    first = reference_diag_ggn(model, loss_func, x[:1], y[:1])["bias"]

    def axis0(target, frontier, readers, grads, room=None):  # as if axis 0 held them
        return [
            grad_shape(r.edge.node, r.edge.output_nr).numel() // grads.shape[1]
            for r in readers
        ]

    got = ggnchunk.diag_ggn(model, loss_func, x, y, per_sample=True)["bias"][0]
    torch.testing.assert_close(got, first, rtol=1e-10, atol=0)
    monkeypatch.setattr(checks, "sample_strides", axis0)
    got = ggnchunk.diag_ggn(model, loss_func, x, y, per_sample=True)["bias"][0]
    assert (got - first).abs().max() > 1e-3 * first.abs().max()


@pytest.mark.parametrize("name", list(MODELS))
def test_the_switch_gives_the_same_diagonal(name, monkeypatch):
    """One pass per sample (the switch off) and the readers agree, as the benchmark uses."""
    model, loss_func, x, y = _problem(name, 3, seed=2)
    fast = ggnchunk.diag_ggn(model, loss_func, x, y, num_chunks=2)
    monkeypatch.setattr(checks, "READ_PER_SAMPLE", False)
    slow = ggnchunk.diag_ggn(model, loss_func, x, y, num_chunks=2)
    assert_diag_close(fast, slow, rtol=1e-12, label=name)


@pytest.mark.parametrize("name", ["functional-linear", "convnext-norms", "torchvision-vit"])
def test_readers_products_hold_no_graph(name, monkeypatch):
    """Products made from saved tensors that require grad keep no autograd graph.

    The rows of a product and a norm's input require grad; a graph through them kept
    every pass's buffers alive (the level rose 1 MiB per pass on the time U-Net, and a
    64 MiB budget ran 2,340 passes instead of 120).
    """
    made = []
    read = quantities.read_per_sample

    def watched(*args):
        made.append(read(*args))
        return made[-1]

    monkeypatch.setattr(quantities, "read_per_sample", watched)
    model, loss_func, x, y = _problem(name, 3)
    ggnchunk.diag_ggn(model, loss_func, x, y, num_chunks=2)
    assert made and not any(value.requires_grad for value in made)


@pytest.mark.parametrize(("n", "read"), [(2, False), (16, True)])
def test_small_batches_take_one_pass_per_sample(n, read, monkeypatch, proofs):
    """One pass per sample where it crosses the region no more than the readers would.

    The proof and the products cross it about as often as four samples' passes here;
    both ways are exact.
    """
    monkeypatch.setattr(checks, "READ_PER_SAMPLE_ALWAYS", False)
    model, loss_func, x, y = _problem("positions-class-token", n)
    got = ggnchunk.diag_ggn(model, loss_func, x, y)
    assert_diag_close(got, reference_diag_ggn(model, loss_func, x, y), rtol=1e-10)
    assert ("slow" in proofs) is not read
    assert (True in proofs) is read


@pytest.mark.parametrize("read", [True, False])
@pytest.mark.parametrize(
    ("switch", "name"),
    [("READ_PARTS", "parameter-parts"), ("READ_FOLDED_PRODUCTS", "matrix-products")],
)
def test_the_readers_switches(switch, name, read, monkeypatch, proofs):
    """Parts of parameters and the glue's ``@`` weights: one pass, or one per sample.

    Read off one pass, or (the switch off) one pass per sample; the same diagonal.
    """
    monkeypatch.setattr(readers, switch, read)
    model, loss_func, x, y = _problem(name, 3)
    got = ggnchunk.diag_ggn(model, loss_func, x, y)
    assert_diag_close(got, reference_diag_ggn(model, loss_func, x, y), rtol=1e-10)
    assert ("slow" in proofs) is not read


def test_end_tokens_are_gathered_for_all_columns_at_once():
    """CLIP's ``x[arange(N), eot]`` is folded: no ``index_put`` once per column."""
    model, loss_func, x, y = _problem("end-tokens", 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ggnchunk.SlowBackwardWarning)
        got = ggnchunk.diag_ggn(model, loss_func, x, y, num_chunks=2)
    assert_diag_close(got, reference_diag_ggn(model, loss_func, x, y), rtol=1e-10)


class _ScaledTwice(nn.Module):
    """A parameter times a number, read by a product and by a call that reads nothing.

    ``s = 0.5 * w``; ``x @ s.T`` follows the product to ``w`` (a reader), and
    ``tanh(s)`` walks into the product with the number, whose gradient holds both
    paths: reading ``w`` there too counted the first path twice (a review found it).
    """

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, D))
        self.head = nn.Linear(3, 2)

    def forward(self, x):  # [N, D]
        s = 0.5 * self.w
        return self.head(torch.tanh(x @ s.T + torch.tanh(s).sum(1)))


@pytest.mark.parametrize("kwargs", [{}, {"batch_chunk_size": 1}, {"per_sample": True}])
@pytest.mark.parametrize("n", [1, 4])
def test_a_scaled_parameter_read_on_two_paths(n, kwargs):
    torch.manual_seed(0)
    model = _ScaledTwice().double()
    x, y = torch.randn(n, D, dtype=torch.float64), torch.randn(n, 2, dtype=torch.float64)
    loss_func = nn.MSELoss(reduction="sum")
    got = ggnchunk.diag_ggn(model, loss_func, x, y, **kwargs)
    if kwargs.get("per_sample"):
        got = {k: v.sum(0) for k, v in got.items()}
    assert_diag_close(got, reference_diag_ggn(model, loss_func, x, y), rtol=1e-10)
