"""Benchmark problems: name → builder of ``(model, loss_func, inputs, targets)``.

Every builder makes its own data (no downloads) from a fixed seed, on the given device.
``scale`` > 1 grows the batch for GPUs. :data:`PROBLEMS` holds every problem;
:data:`DEFAULT_PROBLEMS` are the rows of the benchmark table (issue 13's list), the others
run with ``--only``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Problem = tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]


def tutorial_conv_ae(scale: int = 1) -> Problem:
    """BackPACK's retain_graph tutorial: conv autoencoder on ``[5, 3, 32, 32]``, MSE."""
    x = torch.rand(5 * scale, 3, 32, 32)
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 10, 3), nn.Sigmoid()),
        nn.Sequential(nn.ConvTranspose2d(10, 3, 3)),
    )
    return model, nn.MSELoss(), x, x


def mlp_ae(scale: int = 1) -> Problem:
    """MLP autoencoder 784-256-32-256-784, batch 32, MSE."""
    x = torch.rand(32 * scale, 784)
    model = nn.Sequential(
        nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 32), nn.ReLU(),
        nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 784),
    )  # fmt: skip
    return model, nn.MSELoss(), x, x


def conv_ae_28(scale: int = 1) -> Problem:
    """Deeper conv autoencoder on ``[16, 1, 28, 28]`` with an image-shaped output, MSE."""
    x = torch.rand(16 * scale, 1, 28, 28)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(8, 1, 4, stride=2, padding=1),
    )  # fmt: skip
    return model, nn.MSELoss(), x, x


def conv_ae_28_outpad(scale: int = 1) -> Problem:
    """28×28 conv autoencoder on ``[16, 1, 28, 28]``, ``output_padding`` decoder, MSE.

    28→14→7 convolutions and the standard 7→14→28 decoder, ``ConvTranspose2d(..., 3,
    stride=2, padding=1, output_padding=1)``; BackPACK 1.7.1 fails on it.
    """
    x = torch.rand(16 * scale, 1, 28, 28)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(16, 8, 3, stride=2, padding=1, output_padding=1), nn.ReLU(),
        nn.ConvTranspose2d(8, 1, 3, stride=2, padding=1, output_padding=1),
    )  # fmt: skip
    return model, nn.MSELoss(), x, x


def classifier_1000(scale: int = 1) -> Problem:
    """128-256-1000 classifier, batch 64, cross-entropy."""
    x = torch.randn(64 * scale, 128)
    y = torch.randint(0, 1000, (64 * scale,))
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 1000))
    return model, nn.CrossEntropyLoss(), x, y


def segmentation(scale: int = 1) -> Problem:
    """Per-pixel 5-class cross-entropy on ``[8, 3, 16, 16]`` (5·256 columns)."""
    x = torch.randn(8 * scale, 3, 16, 16)
    y = torch.randint(0, 5, (8 * scale, 16, 16))
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 5, 1),
    )  # fmt: skip
    return model, nn.CrossEntropyLoss(), x, y


class UNet(nn.Module):
    """Two levels down, two up, ``torch.cat`` skips, GroupNorm, Upsample, SiLU."""

    def __init__(self, channels: int = 3, width: int = 8):
        super().__init__()

        def block(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU()
            )

        self.enc0 = block(channels, width)
        self.enc1 = nn.Sequential(nn.AvgPool2d(2), block(width, 2 * width))
        self.bottom = nn.Sequential(nn.AvgPool2d(2), block(2 * width, 2 * width))
        self.up1 = nn.Upsample(scale_factor=2)
        self.dec1 = block(4 * width, width)
        self.up0 = nn.Upsample(scale_factor=2)
        self.dec0 = block(2 * width, width)
        self.head = nn.Conv2d(width, channels, 1)

    def forward(self, x):  # noqa: D102
        e0 = self.enc0(x)
        e1 = self.enc1(e0)
        b = self.bottom(e1)
        d1 = self.dec1(torch.cat([self.up1(b), e1], dim=1))
        return self.head(self.dec0(torch.cat([self.up0(d1), e0], dim=1)))


def unet(scale: int = 1) -> Problem:
    """Small U-Net autoencoder on ``[2, 3, 16, 16]`` (torch.func fallback), MSE."""
    x = torch.rand(2 * scale, 3, 16, 16)
    return UNet(), nn.MSELoss(), x, x


def unet_32(scale: int = 1) -> Problem:
    """Issue 13's U-Net: :class:`UNet` of width 16 on ``[4, 3, 32, 32]``, MSE.

    GroupNorm, SiLU, ``Upsample`` and ``torch.cat`` skips: BackPACK cannot run it (no
    GroupNorm, Upsample or ``cat``; its converter does not rewrite ``cat`` skips).
    """
    x = torch.rand(4 * scale, 3, 32, 32)
    return UNet(width=16), nn.MSELoss(), x, x


def resnet18(scale: int = 1) -> Problem:
    """Torchvision's ResNet-18 (``weights=None``, eval mode), 10 classes, cross-entropy.

    8 images ``3×32×32``; in-place ReLUs and ``out += identity`` residuals. BackPACK
    runs it through ``extend(model, use_converter=True)`` (torch.fx).
    """
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=10)
    x = torch.randn(8 * scale, 3, 32, 32)
    y = torch.randint(0, 10, (8 * scale,))
    return model, nn.CrossEntropyLoss(), x, y


def tiny_mlp_ae(scale: int = 1) -> Problem:
    """A 32-16-32 MLP autoencoder on 8 samples, MSE: seconds, for the smoke test."""
    x = torch.rand(8 * scale, 32)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 32))
    return model, nn.MSELoss(), x, x


PROBLEMS: dict[str, Callable[[int], Problem]] = {
    "tutorial_conv_ae": tutorial_conv_ae,
    "mlp_ae": mlp_ae,
    "classifier_1000": classifier_1000,
    "segmentation": segmentation,
    "conv_ae_28_outpad": conv_ae_28_outpad,
    "unet_32": unet_32,
    "resnet18": resnet18,
    "conv_ae_28": conv_ae_28,
    "unet": unet,
    "tiny_mlp_ae": tiny_mlp_ae,
}

DEFAULT_PROBLEMS = (
    "tutorial_conv_ae", "mlp_ae", "classifier_1000", "segmentation",
    "conv_ae_28_outpad", "unet_32", "resnet18",
)  # fmt: skip
"""The benchmark table's rows, in order."""

CONV_AUTOENCODERS = frozenset({"tutorial_conv_ae", "conv_ae_28_outpad", "conv_ae_28"})
"""Problems held to issue 13's conv-autoencoder targets (≤ 0.6× time, ≥ 35% of peak)."""


# -- issue 21's rows: frozen layers and attention ------------------------------------------
# A partly frozen segmenter, a frozen-backbone ResNet with a trainable early block and a
# small GPT-2-style language model. Registered here (after the default rows), so that other
# blocks can append their own rows at the end of the file.


class _OutOnly(nn.Module):
    """Torchvision's segmentation models return ``{"out": logits}``: return the logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)["out"]


def lraspp_frozen(scale: int = 1, side: int = 64) -> Problem:
    """Torchvision's LRASPP MobileNetV3-Large, partly frozen, 3 classes, per-pixel CE.

    ``lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3)`` on
    ``[2, 3, 64, 64]`` (3·4,096 columns per image). The backbone's blocks 0–13 and every
    BatchNorm's affine parameters are frozen (eval mode: running statistics): the last
    three blocks and the head train, with frozen BatchNorms between their layers.
    ``side``: the images' side (the A/B benchmarks' smaller rows).
    """
    import torchvision

    net = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3
    )
    for name, block in net.backbone.named_children():
        if int(name) <= 13:
            block.requires_grad_(False)
    for module in net.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.requires_grad_(False)
    x = torch.randn(2 * scale, 3, side, side)
    y = torch.randint(0, 3, (2 * scale, side, side))
    return _OutOnly(net), nn.CrossEntropyLoss(), x, y


def deeplab_frozen(scale: int = 1) -> Problem:
    """Torchvision's DeepLabV3 MobileNetV3-Large, partly frozen, 3 classes, per-pixel CE.

    ``deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3)``
    on ``[2, 3, 32, 32]`` (3·1,024 columns per image): its first convolution, one
    squeeze-excitation block, the ASPP projection and the classifier train; every
    other parameter is frozen (eval mode).
    """
    import torchvision

    net = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3, aux_loss=False
    )
    keep = ("backbone.0.", "backbone.4.block.2", "classifier.0.project", "classifier.4")
    for name, parameter in net.named_parameters():
        parameter.requires_grad_(name.startswith(keep))
    x = torch.randn(2 * scale, 3, 32, 32)
    y = torch.randint(0, 3, (2 * scale, 32, 32))
    return _OutOnly(net), nn.CrossEntropyLoss(), x, y


def deeplab(scale: int = 1) -> Problem:
    """Torchvision's DeepLabV3 MobileNetV3-Large, all trainable, 3 classes, per-pixel CE.

    ``[1, 3, 32, 32]`` in float64: the ASPP's atrous convolutions (dilation 12, 24, 36)
    on 4x4 maps read a few taps of maps padded to 28x28-76x76 (a budget test).
    """
    import torchvision

    net = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3, aux_loss=False
    )
    x = torch.randn(scale, 3, 32, 32, dtype=torch.float64)
    y = torch.randint(0, 3, (scale, 32, 32))
    return _OutOnly(net.double()), nn.CrossEntropyLoss(), x, y


def resnet18_frozen(scale: int = 1) -> Problem:
    """ResNet-18 with a frozen backbone: only ``layer1`` and the 100-class head train.

    Torchvision's ResNet-18 (``weights=None``, eval mode) on 8 images ``3×32×32``,
    cross-entropy (800 columns: with 10 classes, 10% of BackPACK's one pass is less than
    one column needs); ``conv1``/``bn1`` and ``layer2``–``layer4`` are frozen, so the
    columns cross three frozen stages between the head and ``layer1``.
    """
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=100)
    model.requires_grad_(False)
    model.layer1.requires_grad_(True)
    model.fc.requires_grad_(True)
    x = torch.randn(8 * scale, 3, 32, 32)
    y = torch.randint(0, 100, (8 * scale,))
    return model, nn.CrossEntropyLoss(), x, y


class _CausalBlock(nn.Module):
    """Pre-LayerNorm block: causal ``scaled_dot_product_attention``, GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        )

    def forward(self, h):
        n, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).split(d, dim=-1)
        q, k, v = (a.reshape(n, t, self.heads, -1).transpose(1, 2) for a in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(att.transpose(1, 2).reshape(n, t, d))
        return h + self.mlp(self.ln2(h))


class TinyGPT(nn.Module):
    """GPT-2-style language model: token and learned position embeddings, causal blocks.

    Returns logits ``[N, vocab, T]`` (classes on dimension 1, as ``nn.CrossEntropyLoss``
    takes per-token targets ``[N, T]``).
    """

    def __init__(self, vocab: int = 1000, length: int = 32, dim: int = 64,
                 layers: int = 2, heads: int = 4):  # fmt: skip
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(length, dim)
        self.blocks = nn.Sequential(*(_CausalBlock(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):  # noqa: D102
        where = torch.arange(ids.shape[1], device=ids.device)
        h = self.blocks(self.tokens(ids) + self.positions(where))
        return self.head(self.ln(h)).transpose(1, 2)


def tiny_gpt(scale: int = 1) -> Problem:
    """:class:`TinyGPT` (vocabulary 1,000, 32 tokens, width 64, 2 blocks), per-token CE.

    2 sequences of 32 token ids: 1,000 columns per token (64,000 in all).
    """
    ids = torch.randint(0, 1000, (2 * scale, 33))
    return TinyGPT(), nn.CrossEntropyLoss(), ids[:, :-1], ids[:, 1:]


class _EagerBlock(_CausalBlock):
    """:class:`_CausalBlock` with attention written out, as GPT-2's eager attention.

    Scores, ``torch.where`` of the causal mask, ``softmax``, then the values.
    """

    def forward(self, h):
        n, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).split(d, dim=-1)
        q, k, v = (a.reshape(n, t, self.heads, -1).transpose(1, 2) for a in (q, k, v))
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        scores = torch.where(causal, scores, torch.finfo(scores.dtype).min)
        att = nn.functional.softmax(scores, dim=-1) @ v
        h = h + self.proj(att.transpose(1, 2).reshape(n, t, d))
        return h + self.mlp(self.ln2(h))


def gpt_eager(scale: int = 1) -> Problem:
    """:class:`TinyGPT` with eager attention (vocabulary 200, 16 tokens), per-token CE.

    2 sequences of 16 token ids: 200 columns per token (6,400 in all). Its glue
    (``torch.where``, ``softmax``) is what transformers' eager attention runs.
    """
    model = TinyGPT(vocab=200, length=16)
    model.blocks = nn.Sequential(*(_EagerBlock(64, 4) for _ in range(2)))
    ids = torch.randint(0, 200, (2 * scale, 17))
    return model, nn.CrossEntropyLoss(), ids[:, :-1], ids[:, 1:]


class _ReflectResidual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.ReflectionPad2d(1), nn.Conv2d(width, width, 3), nn.ReLU(),
            nn.ReflectionPad2d(1), nn.Conv2d(width, width, 3),
        )  # fmt: skip

    def forward(self, h):
        return h + self.body(h)


def reflect_generator(scale: int = 1) -> Problem:
    """CycleGAN-style generator (reflection pads, residual blocks) on ``[2, 3, 32, 32]``.

    Without its instance norms: the glue is reflection padding, sums and activations.
    """
    model = nn.Sequential(
        nn.ReflectionPad2d(3), nn.Conv2d(3, 8, 7), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        _ReflectResidual(16), _ReflectResidual(16),
        nn.ConvTranspose2d(16, 8, 3, stride=2, padding=1, output_padding=1), nn.ReLU(),
        nn.ReflectionPad2d(3), nn.Conv2d(8, 3, 7), nn.Tanh(),
    )  # fmt: skip
    x = torch.randn(2 * scale, 3, 24, 24)
    return model, nn.MSELoss(), x, torch.randn_like(x)


def _in_block(width: int) -> nn.Module:
    return nn.Sequential(
        nn.ReflectionPad2d(1), nn.Conv2d(width, width, 3), nn.InstanceNorm2d(width),
        nn.ReLU(), nn.ReflectionPad2d(1), nn.Conv2d(width, width, 3),
        nn.InstanceNorm2d(width),
    )  # fmt: skip


class _InResidual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.block = _in_block(width)

    def forward(self, h):
        return h + self.block(h)


def cyclegan_generator(scale: int = 1) -> Problem:
    """CycleGAN's ``ResnetGenerator`` (instance norms, reflection pads), ``[2, 3, 64, 64]``.

    As in the CycleGAN code: a 7×7 stem, two stride-2 convolutions down, residual
    blocks, two transposed convolutions up, a 7×7 head and ``tanh``; ``ngf=8``, two
    residual blocks (the original has 64 and 9). MSE to a target image.
    """
    w = 8
    model = nn.Sequential(
        nn.ReflectionPad2d(3), nn.Conv2d(3, w, 7), nn.InstanceNorm2d(w), nn.ReLU(),
        nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), nn.InstanceNorm2d(2 * w), nn.ReLU(),
        nn.Conv2d(2 * w, 4 * w, 3, stride=2, padding=1), nn.InstanceNorm2d(4 * w),
        nn.ReLU(), _InResidual(4 * w), _InResidual(4 * w),
        nn.ConvTranspose2d(4 * w, 2 * w, 3, stride=2, padding=1, output_padding=1),
        nn.InstanceNorm2d(2 * w), nn.ReLU(),
        nn.ConvTranspose2d(2 * w, w, 3, stride=2, padding=1, output_padding=1),
        nn.InstanceNorm2d(w), nn.ReLU(),
        nn.ReflectionPad2d(3), nn.Conv2d(w, 3, 7), nn.Tanh(),
    )  # fmt: skip
    x = torch.randn(2 * scale, 3, 64, 64)
    return model, nn.MSELoss(), x, torch.randn_like(x)


class _AttentionSR(nn.Module):
    """×2 super-resolution with attention over the pixels.

    Conv, GroupNorm, attention, a residual, conv, ``PixelShuffle``. The attention is
    written out, ``softmax(q kᵀ / √d) v``, as many hand-written models have it (not
    ``scaled_dot_product_attention``: its ``[heads, L, L]`` scores live in the glue);
    with ``module=True`` it is ``nn.MultiheadAttention`` with its default
    ``need_weights=True``.
    """

    def __init__(self, width: int = 8, heads: int = 2, module: bool = False):
        super().__init__()
        self.head = nn.Conv2d(3, width, 3, padding=1)
        self.norm = nn.GroupNorm(2, width)
        self.heads = heads
        if module:
            self.attn = nn.MultiheadAttention(width, heads)
        else:
            self.qkv = nn.Conv2d(width, 3 * width, 1)
        self.body = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.LeakyReLU(0.1))
        self.tail = nn.Conv2d(width, 12, 3, padding=1)
        self.shuffle = nn.PixelShuffle(2)

    def _attention(self, h):
        n, c = h.shape[:2]
        if hasattr(self, "attn"):
            tokens = self.norm(h).flatten(2).permute(2, 0, 1)  # [L, N, C]
            return self.attn(tokens, tokens, tokens)[0].permute(1, 2, 0)
        qkv = self.qkv(self.norm(h)).reshape(n, 3, self.heads, c // self.heads, -1)
        q, k, v = qkv.unbind(1)  # [N, heads, C / heads, L]
        scores = q.transpose(-1, -2) @ k / (c // self.heads) ** 0.5  # [N, heads, L, L]
        return v @ torch.softmax(scores, dim=-1).transpose(-1, -2)

    def forward(self, x):
        h = self.head(x)
        h = h + self._attention(h).reshape(h.shape)
        return self.shuffle(self.tail(self.body(h)))


def attention_sr(scale: int = 1) -> Problem:
    """:class:`_AttentionSR` from ``[2, 3, 12, 12]`` to ``[2, 3, 24, 24]``, MSE.

    Its ``[N·heads, 144, 144]`` scores per column live inside the glue, 40× the vectors
    at the glue's ends: a memory bound that counted the ends alone planned 2× its
    budget.
    """
    x = torch.randn(2 * scale, 3, 12, 12)
    return _AttentionSR(), nn.MSELoss(), x, torch.randn(2 * scale, 3, 24, 24)


class _DepthHead(nn.Module):
    """GLPN's depth head in float64: 3×3 convolutions to one channel, squeezed."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 1, 3, padding=1),
        )  # fmt: skip

    def forward(self, x):
        depth = torch.sigmoid(self.body(x)).squeeze(1) * 10  # in [0, 10], as GLPN's
        return depth.unsqueeze(1)  # [N, 1, H, W], as a depth wrapper returns it


def depth_head_f64(scale: int = 1) -> Problem:
    """:class:`_DepthHead` on ``[2, 3, 32, 32]`` in float64, MSE to a depth map.

    Without oneDNN (float64 on the CPU) torch's native kernels unfold every kernel
    offset of all ``V·N`` maps in the backprop (``slow_conv_transpose2d``): 72 times
    the last layer's output map. The squeeze (glue without a windowed form) keeps the
    columns dense, as in transformers' GLPN, which peaked at 384 MiB at 256 MiB.
    """
    x = torch.randn(2 * scale, 3, 32, 32, dtype=torch.float64)
    target = torch.rand(2 * scale, 1, 32, 32, dtype=torch.float64) * 10
    return _DepthHead().double(), nn.MSELoss(), x, target


class _FrozenWide(nn.Module):
    """A trainable stem, two frozen 512-channel 3×3 convolutions, a trainable head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 512, 3, padding=1)
        self.frozen = nn.Sequential(*[nn.Conv2d(512, 512, 3, padding=1) for _ in range(2)])
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(512, 256)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        for conv in self.frozen:
            h = torch.relu(conv(h))
        return self.head(h.mean((2, 3)))


def frozen_wide_convs(scale: int = 1) -> Problem:
    """:class:`_FrozenWide` on ``[8, 3, 2, 2]``, MSE to 256 outputs (a budget test).

    The frozen convolutions' backprop of few columns runs as one product with the
    weight into the patches' gradients (``n · P · Cin · 9`` elements per column), which
    a frozen layer's bound must count: a warm call at 24 MiB peaked at 28.9 MiB while
    the bound counted products a frozen layer never makes in their place.
    """
    x = torch.randn(8 * scale, 3, 2, 2)
    return _FrozenWide().eval(), nn.MSELoss(), x, torch.randn(8 * scale, 256)


PROBLEMS.update(
    frozen_wide_convs=frozen_wide_convs,
    attention_sr=attention_sr,
    depth_head_f64=depth_head_f64,
    lraspp_frozen=lraspp_frozen, resnet18_frozen=resnet18_frozen, tiny_gpt=tiny_gpt,
    deeplab_frozen=deeplab_frozen, deeplab=deeplab,
    gpt_eager=gpt_eager, reflect_generator=reflect_generator,
    cyclegan_generator=cyclegan_generator,
)  # fmt: skip
DEFAULT_PROBLEMS += ("lraspp_frozen", "resnet18_frozen", "tiny_gpt")
QUICK_SKIPPED = frozenset({"lraspp_frozen", "tiny_gpt"})
"""Default rows ``--quick`` leaves out (minutes each on a CPU); ``--only`` runs them."""


def build(name: str, device: str = "cpu", scale: int = 1, seed: int = 0) -> Problem:
    """Build problem ``name`` on ``device`` from ``seed``."""
    torch.manual_seed(seed)
    model, loss_func, x, y = PROBLEMS[name](scale)
    x = tuple(a.to(device) for a in x) if isinstance(x, tuple) else x.to(device)
    return model.to(device).eval(), loss_func.to(device), x, y.to(device)


# -- GPU rows (issue 20) ------------------------------------------------------------------
# Larger batches for `python -m benchmarks --device cuda`: added to the default rows there
# (GPU_PROBLEMS), runnable anywhere with --only. Their batch is fixed (``scale`` ignored):
# they are the GPU sizes already.


def tutorial_conv_ae_n64(scale: int = 1) -> Problem:
    """BackPACK's tutorial conv autoencoder at a GPU batch: ``[64, 3, 32, 32]``, MSE."""
    del scale
    model, loss_func, _, _ = tutorial_conv_ae()
    x = torch.rand(64, 3, 32, 32)
    return model, loss_func, x, x


def unet_64(scale: int = 1) -> Problem:
    """Issue 13's U-Net (width 16) on ``[2, 3, 64, 64]`` (12,288 columns), MSE."""
    del scale
    x = torch.rand(2, 3, 64, 64)
    return UNet(width=16), nn.MSELoss(), x, x


class TimeAttentionUNet(nn.Module):
    """Issue 19's user model: a time-conditioned U-Net with attention at the bottleneck.

    Called as ``model(x, t)``: a sinusoidal embedding of the per-sample timesteps ``t``
    (an MLP) added to every block's maps; GroupNorm, SiLU, stride-2 convolutions down,
    nearest upsampling (``F.interpolate``, as diffusers' ``Upsample2D``) up,
    ``torch.cat`` skips, and one self-attention block (``nn.MultiheadAttention`` over
    the positions, GroupNorm first) at the quarter-resolution bottleneck.
    """

    def __init__(self, channels: int = 3, width: int = 16, tdim: int = 32):
        super().__init__()
        self.tdim = tdim
        self.time = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        w = width
        self.enc0, self.emb0 = nn.Conv2d(channels, w, 3, padding=1), nn.Linear(tdim, w)
        self.norm0 = nn.GroupNorm(4, w)
        self.down0 = nn.Conv2d(w, 2 * w, 3, stride=2, padding=1)
        self.enc1, self.emb1 = nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.Linear(tdim, 2 * w)
        self.norm1 = nn.GroupNorm(4, 2 * w)
        self.down1 = nn.Conv2d(2 * w, 2 * w, 3, stride=2, padding=1)
        self.norm_attn = nn.GroupNorm(4, 2 * w)
        self.attn = nn.MultiheadAttention(2 * w, 2, batch_first=True)
        self.mid = nn.Conv2d(2 * w, 2 * w, 3, padding=1)
        self.norm_mid = nn.GroupNorm(4, 2 * w)
        self.dec1, self.emb_dec1 = (
            nn.Conv2d(4 * w, 2 * w, 3, padding=1),
            nn.Linear(tdim, 2 * w),
        )
        self.norm_dec1 = nn.GroupNorm(4, 2 * w)
        self.dec0 = nn.Conv2d(3 * w, w, 3, padding=1)
        self.norm_dec0 = nn.GroupNorm(4, w)
        self.head = nn.Conv2d(w, channels, 1)

    def _embed(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        half = self.tdim // 2
        freqs = torch.exp(
            -math.log(1000.0) * torch.arange(half, dtype=dtype, device=t.device) / half
        )
        args = t.to(dtype)[:, None] * freqs[None]
        return self.time(torch.cat([torch.sin(args), torch.cos(args)], dim=-1))

    def forward(self, x, t):  # noqa: D102
        silu, up = F.silu, lambda h: F.interpolate(h, scale_factor=2, mode="nearest")
        temb = self._embed(t, x.dtype)
        h0 = silu(self.norm0(self.enc0(x) + self.emb0(temb)[:, :, None, None]))
        h1 = silu(self.norm1(self.enc1(self.down0(h0)) + self.emb1(temb)[:, :, None, None]))
        b = self.down1(h1)
        n, c, hh, ww = b.shape
        tokens = self.norm_attn(b).flatten(2).transpose(1, 2)
        b = b + self.attn(tokens, tokens, tokens, need_weights=False)[0].transpose(
            1, 2
        ).reshape(n, c, hh, ww)
        b = silu(self.norm_mid(self.mid(b)))
        d1 = (
            self.dec1(torch.cat([up(b), h1], dim=1)) + self.emb_dec1(temb)[:, :, None, None]
        )
        d1 = silu(self.norm_dec1(d1))
        d0 = silu(self.norm_dec0(self.dec0(torch.cat([up(d1), h0], dim=1))))
        return self.head(d0)


def time_unet_64(scale: int = 1) -> Problem:
    """:class:`TimeAttentionUNet` (width 16) on ``[2, 3, 64, 64]`` and timesteps, MSE."""
    del scale
    x = torch.rand(2, 3, 64, 64)
    t = torch.tensor([10, 500])
    return TimeAttentionUNet(width=16), nn.MSELoss(), (x, t), x


def time_unet_32(scale: int = 1) -> Problem:
    """:class:`TimeAttentionUNet` (width 8) on ``[2, 3, 32, 32]`` and timesteps, MSE.

    Small enough for the fresh-process budget tests: its functional glue (the time
    embedding added to the maps, ``F.silu``, ``F.interpolate``) crossed on the boxes.
    """
    x = torch.rand(2 * scale, 3, 32, 32)
    t = torch.tensor([10, 500] * scale)
    return TimeAttentionUNet(width=8, tdim=16), nn.MSELoss(), (x, t), x


class _DoubleConv(nn.Sequential):
    """Two 3×3 convolutions, each with BatchNorm (eval) and an in-place ReLU."""

    def __init__(self, cin: int, cout: int):
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        )  # fmt: skip


class _Up(nn.Module):
    """Bilinear upsampling, ``F.pad`` to the skip's size, ``cat``, two convolutions."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.conv = _DoubleConv(cin, cout)

    def forward(self, x1, x2):
        x1 = self.up(x1)
        dy, dx = x2.size(2) - x1.size(2), x2.size(3) - x1.size(3)
        x1 = F.pad(x1, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        return self.conv(torch.cat([x2, x1], dim=1))


class ClassicUNet(nn.Module):
    """The classic U-Net layout (as in the popular PyTorch ports of Ronneberger et al.).

    Max pooling down, bilinear upsampling up, ``F.pad`` to match the skips, BatchNorm
    (eval) and in-place ReLUs; two levels, width ``w``.
    """

    def __init__(self, w: int = 8):
        super().__init__()
        self.inc = _DoubleConv(3, w)
        self.down1 = nn.Sequential(nn.MaxPool2d(2), _DoubleConv(w, 2 * w))
        self.down2 = nn.Sequential(nn.MaxPool2d(2), _DoubleConv(2 * w, 2 * w))
        self.up1, self.up2 = _Up(4 * w, w), _Up(2 * w, w)
        self.outc = nn.Conv2d(w, 3, 1)

    def forward(self, x):  # noqa: D102
        x1 = self.inc(x)
        x2 = self.down1(x1)
        return self.outc(self.up2(self.up1(self.down2(x2), x2), x1))


def unet_classic_64(scale: int = 1) -> Problem:
    """:class:`ClassicUNet` (width 8, eval) on ``[2, 3, 64, 64]``, MSE to the input."""
    x = torch.rand(2 * scale, 3, 64, 64)
    return ClassicUNet(8).eval(), nn.MSELoss(), x, x


def sr_espcn(scale: int = 1) -> Problem:
    """ESPCN super-resolution (Shi et al., 2016), ×2: 4 images 3×32×32 to 3×64×64, MSE.

    Convolutions 5×5 (64 channels), 3×3 (32), 3×3 (12), tanh between, then
    ``nn.PixelShuffle(2)``: the glue that starts at the model output (issue 19's
    windows cross it on the boxes).
    """
    model = nn.Sequential(
        nn.Conv2d(3, 64, 5, padding=2), nn.Tanh(), nn.Conv2d(64, 32, 3, padding=1),
        nn.Tanh(), nn.Conv2d(32, 12, 3, padding=1), nn.PixelShuffle(2),
    )  # fmt: skip
    x = torch.rand(4 * scale, 3, 32, 32)
    return model, nn.MSELoss(), x, torch.rand(4 * scale, 3, 64, 64)


def conv3d_stack(scale: int = 1) -> Problem:
    """Two float64 3-d convolutions (64 channels on 4x16x16 clips), pooled, 3 BCE outputs.

    In float64 torch runs its native ``slow_conv3d``, whose input gradient unfolds every
    kernel offset of all ``V * N`` maps at once, twice (a budget test's problem: a video
    network's one-column passes went above budgets its bound had accepted).
    """
    model = nn.Sequential(
        nn.Conv3d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv3d(64, 64, 3, padding=1),
        nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(64, 3),
    ).double()  # fmt: skip
    x = torch.randn(2 * scale, 3, 4, 16, 16, dtype=torch.float64)
    return model, nn.BCEWithLogitsLoss(), x, torch.rand(2 * scale, 3, dtype=torch.float64)


def wide_conv_head(scale: int = 1) -> Problem:
    """A float64 512-channel 3x3 convolution on 2x2 maps, pooled, 3 MSE outputs.

    Its weight (2.4M elements, 18 MiB) outweighs its maps: the products' squares are
    summed into a weight-sized total, with each step's sum beside it (a budget test's
    problem: those two weights were not in the bound).
    """
    model = nn.Sequential(
        nn.Conv2d(3, 512, 1), nn.ReLU(), nn.Conv2d(512, 512, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 3),
    ).double()  # fmt: skip
    x = torch.randn(2 * scale, 3, 2, 2, dtype=torch.float64)
    return model, nn.MSELoss(), x, torch.randn(2 * scale, 3, dtype=torch.float64)


def resnet18_layer4(scale: int = 1) -> Problem:
    """ResNet-18 frozen but ``layer4`` and the head: 4 images ``3x64x64``, 10 classes.

    Torchvision's ResNet-18 (``weights=None``, eval mode) in float64 (the budget test
    compares it with an unbudgeted call to 1e-10); ``layer4``'s 512-channel 3x3
    weights (18 MiB each) on 2x2 maps, the rest frozen (a budget test's problem: each
    layer's weight-sized Gram-form value, freed into a hole the next vectors split,
    kept 2.4x the bytes in use resident, 20-27% above budgets the bound met).
    """
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=10)
    model.requires_grad_(False)
    model.layer4.requires_grad_(True)
    model.fc.requires_grad_(True)
    x = torch.randn(4 * scale, 3, 64, 64, dtype=torch.float64)
    return model.double(), nn.CrossEntropyLoss(), x, torch.randint(0, 10, (4 * scale,))


PROBLEMS.update(
    resnet18_layer4=resnet18_layer4,
    wide_conv_head=wide_conv_head,
    conv3d_stack=conv3d_stack,
    tutorial_conv_ae_n64=tutorial_conv_ae_n64,
    unet_64=unet_64,
    time_unet_64=time_unet_64,
    time_unet_32=time_unet_32,
    sr_espcn=sr_espcn,
    unet_classic_64=unet_classic_64,
)
GPU_PROBLEMS = ("tutorial_conv_ae_n64", "unet_64")
"""Rows added to :data:`DEFAULT_PROBLEMS` on CUDA."""
CONV_AUTOENCODERS = CONV_AUTOENCODERS | {"tutorial_conv_ae_n64"}
