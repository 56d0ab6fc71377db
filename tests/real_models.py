"""Real models for the exactness table: torchvision classifiers and hand-written models.

Each :class:`RealCase` builds a float64 :class:`Problem` (model, loss, inputs, targets),
small enough that the float64 brute force of ``tests/reference.py`` takes at most a few
seconds on 2 CPU cores. Models that draw randomness in ``forward`` do it in *replayable*
modules (see ``tests/reference.py``): they record the draw of each forward pass
(``draw``) and use a given one instead of drawing when ``replay`` is set, so the
reference can differentiate the function that the forward pass of the call under test
computed.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn

from tests.reference import Inputs

N = 3  # batch size of the hand-written cases (torchvision: 2)


def _convert(value, dtype: torch.dtype):
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_convert(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _convert(v, dtype) for k, v in value.items()}
    return value


def call(model: nn.Module, inputs: Inputs) -> Tensor:
    """``model(inputs)``, ``model(*inputs)`` or ``model(**inputs)``."""
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


@dataclass
class Problem:
    model: nn.Module
    loss_func: nn.Module
    inputs: Inputs
    targets: Tensor

    @property
    def batch(self) -> int:
        return self.targets.shape[0]

    def columns(self) -> int:
        """Columns of the loss Hessian's square root: the per-sample output size."""
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            return call(self.model, self.inputs)[0].numel()

    def to(self, dtype: torch.dtype) -> Problem:
        """A copy in ``dtype`` (model, loss, floating inputs and targets)."""
        return Problem(
            copy.deepcopy(self.model).to(dtype),
            copy.deepcopy(self.loss_func).to(dtype),
            _convert(self.inputs, dtype),
            _convert(self.targets, dtype),
        )


@dataclass(frozen=True)
class RealCase:
    """One row of the table.

    ``tags``: ``"small"`` (few columns: ``chunk_size=1`` is affordable), ``"random"``
    (draws in forward, in replayable modules), ``"torchvision"``.
    """

    id: str
    build: Callable[[], Problem]
    tags: frozenset[str] = field(default_factory=frozenset)

    def make(self, seed: int = 0) -> Problem:
        torch.manual_seed(seed)
        return self.build()


# --------------------------------------------------------------------------- helpers


def _randomize_norms(model: nn.Module) -> nn.Module:
    """Non-trivial affine parameters and running statistics of normalization layers."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.running_mean.normal_(0.0, 0.1)
                module.running_var.uniform_(0.5, 1.5)
            if isinstance(
                module, (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
            ):
                if getattr(module, "weight", None) is not None:
                    module.weight.uniform_(0.5, 1.5)
                if getattr(module, "bias", None) is not None:
                    module.bias.normal_(0.0, 0.1)
    return model


class Permute(nn.Module):
    def __init__(self, *dims: int):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return x.permute(*self.dims)


# --------------------------------------------------------------- replayable randomness


class VAE(nn.Module):
    """Reparameterization noise ``eps = torch.randn_like(mu)`` drawn in ``forward``.

    Replayable: ``draw`` is the last forward's ``eps``; with ``replay`` set, that tensor
    is used instead of drawing (and no random number is drawn). Returns reconstruction
    logits/means only; the GGN is that of the reconstruction loss.
    """

    def __init__(self, features: int = 8, hidden: int = 6, latent: int = 3):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(features, hidden), nn.Tanh())
        self.to_stats = nn.Linear(hidden, 2 * latent)
        self.decoder = nn.Sequential(
            nn.Linear(latent, hidden), nn.Softplus(), nn.Linear(hidden, features)
        )
        self.draw: Tensor | None = None
        self.replay: Tensor | None = None
        self.forward_calls = 0

    def forward(self, x):
        self.forward_calls += 1
        mu, logvar = self.to_stats(self.encoder(x)).chunk(2, dim=-1)
        eps = torch.randn_like(mu) if self.replay is None else self.replay
        self.draw = eps.detach()
        z = mu + torch.exp(0.5 * logvar) * eps
        return self.decoder(z)


class RecordedDropout(nn.Dropout):
    """``nn.Dropout`` (``F.dropout`` underneath) that records its mask; replayable.

    The mask is read off the output (``out != 0``): exact when the input has no exact
    zeros, as for a Linear layer's output here.
    """

    def __init__(self, p: float):
        super().__init__(p)
        self.draw: Tensor | None = None
        self.replay: Tensor | None = None
        self.forward_calls = 0

    def forward(self, x):
        self.forward_calls += 1
        if self.replay is not None:
            return x * self.replay.to(x.dtype) / (1 - self.p) if self.training else x
        out = super().forward(x)
        self.draw = (out != 0).detach()
        return out


class DropoutResidual(nn.Module):
    """``x + lin2(tanh(dropout(lin1(x))))`` with dropout active in training mode."""

    def __init__(self, features: int, p: float = 0.4):
        super().__init__()
        self.lin1 = nn.Linear(features, features)
        self.drop = RecordedDropout(p)
        self.lin2 = nn.Linear(features, features)

    def forward(self, x):
        return x + self.lin2(torch.tanh(self.drop(self.lin1(x))))


def _vae(loss: str) -> Problem:
    model = VAE().double()
    x = torch.rand(N, 8, dtype=torch.float64)
    if loss == "mse":
        return Problem(model, nn.MSELoss(), x, x.clone())
    return Problem(model, nn.BCEWithLogitsLoss(reduction="sum"), x, x.round())


def _dropout_residual() -> Problem:
    model = nn.Sequential(
        nn.Linear(5, 6), DropoutResidual(6), nn.GELU(), DropoutResidual(6), nn.Linear(6, 3)
    )
    model = model.double().train()
    x = torch.randn(N, 5, dtype=torch.float64)
    return Problem(model, nn.CrossEntropyLoss(), x, torch.randint(0, 3, (N,)))


# --------------------------------------------------------------------- dataflow models


class InplaceResBlock(nn.Module):
    """torchvision's BasicBlock pattern: BatchNorm (eval), ``out += identity``, in place."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def _inplace_resnet() -> Problem:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        InplaceResBlock(4),
        InplaceResBlock(4),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )
    model = _randomize_norms(model).double().eval()
    x = torch.randn(N, 3, 6, 6, dtype=torch.float64)
    return Problem(model, nn.CrossEntropyLoss(), x, torch.randint(0, 3, (N,)))


class TimeUNet(nn.Module):
    """Diffusion-style U-Net called as ``model(x, t)``.

    Sinusoidal embedding of the per-sample timesteps ``t`` [N] (integers), ``torch.cat``
    skips, GroupNorm, SiLU, ``F.interpolate`` (nearest and bilinear) upsampling.
    """

    def __init__(self, channels: int = 2, width: int = 4, tdim: int = 6):
        super().__init__()
        self.tdim = tdim
        self.time_mlp = nn.Sequential(
            nn.Linear(tdim, 2 * width), nn.SiLU(), nn.Linear(2 * width, 2 * width)
        )
        self.conv0 = nn.Conv2d(channels, width, 3, padding=1)
        self.norm0 = nn.GroupNorm(2, width)
        self.conv1 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.norm1 = nn.GroupNorm(2, 2 * width)
        self.conv2 = nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1)
        self.up1 = nn.Conv2d(4 * width, width, 3, padding=1)
        self.norm_up1 = nn.GroupNorm(2, width)
        self.up0 = nn.Conv2d(2 * width, width, 3, padding=1)
        self.head = nn.Conv2d(width, channels, 1)

    def embed(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        half = self.tdim // 2
        freqs = torch.exp(
            -math.log(100.0) * torch.arange(half, dtype=dtype, device=t.device) / half
        )
        args = t.to(dtype)[:, None] * freqs[None]
        return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)

    def forward(self, x, t):
        temb = self.time_mlp(self.embed(t, x.dtype))
        h0 = F.silu(self.norm0(self.conv0(x)))
        h1 = F.silu(self.norm1(self.conv1(h0) + temb[:, :, None, None]))
        h2 = F.silu(self.conv2(h1))
        u1 = F.interpolate(h2, scale_factor=2, mode="nearest")
        u1 = F.silu(self.norm_up1(self.up1(torch.cat([u1, h1], dim=1))))
        u0 = F.interpolate(u1, scale_factor=2, mode="bilinear", align_corners=False)
        u0 = F.silu(self.up0(torch.cat([u0, h0], dim=1)))
        return self.head(u0)


def _time_unet() -> Problem:
    model = _randomize_norms(TimeUNet()).double()
    x = torch.randn(N, 2, 8, 8, dtype=torch.float64)
    t = torch.randint(0, 100, (N,))
    return Problem(model, nn.MSELoss(), (x, t), torch.randn_like(x))


class MaskedPrototypes(nn.Module):
    """Called as ``model(**{"x", "mask", "prototypes", "temperature"})``.

    ``x`` [N, T, D] and ``mask`` [N, T] (bool) are per sample; ``prototypes`` [K, H]
    (K != N) and the float ``temperature`` are shared by all samples.
    """

    def __init__(self, features: int = 4, hidden: int = 6, classes: int = 3):
        super().__init__()
        self.proj = nn.Linear(features, hidden)
        self.head = nn.Linear(5, classes)

    def forward(self, x, mask, prototypes, temperature=1.0):
        h = torch.tanh(self.proj(x))
        m = mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp_min(1.0)
        return self.head(pooled @ prototypes.t() / temperature)


def _dict_inputs() -> Problem:
    model = MaskedPrototypes().double()
    mask = torch.rand(N, 5) > 0.4
    mask[:, 0] = True
    inputs = {
        "x": torch.randn(N, 5, 4, dtype=torch.float64),
        "mask": mask,
        "prototypes": torch.randn(5, 6, dtype=torch.float64),
        "temperature": 0.7,
    }
    return Problem(model, nn.CrossEntropyLoss(), inputs, torch.randint(0, 3, (N,)))


class LoopModel(nn.Module):
    """Layers in a ``ModuleList`` and a ``ModuleDict``, functional activations between."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 6)])
        self.blocks = nn.ModuleDict({"a": nn.Linear(6, 6), "b": nn.Linear(6, 6)})
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        for block in self.blocks.values():
            x = x + F.gelu(block(x))
        return self.head(x)


class TiedAutoencoder(nn.Module):
    """Decoder uses the encoder's weight functionally: ``F.linear(h, enc.weight.t())``."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(6, 4)
        self.dec_bias = nn.Parameter(torch.zeros(6))

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        return F.linear(h, self.enc.weight.t(), self.dec_bias)


def _shared_modules() -> Problem:
    enc, dec = nn.Linear(5, 5), nn.Linear(5, 5)
    dec.weight = enc.weight  # named_parameters(): 0.weight, 0.bias, 2.bias
    model = nn.Sequential(enc, nn.Tanh(), dec).double()
    x = torch.randn(N, 5, dtype=torch.float64)
    return Problem(model, nn.MSELoss(), x, torch.randn_like(x))


class TwiceCalled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


class TransformerTagger(nn.Module):
    """Encoder layer (eval) on [N, T, D], Linear head on [N, T, D], CE per token."""

    def __init__(self, d: int = 8, classes: int = 3):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            d_model=d, nhead=2, dim_feedforward=12, dropout=0.1, batch_first=True
        )
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.layer(x)).transpose(1, 2)  # [N, C, T] for CrossEntropyLoss


class AttentionClassifier(nn.Module):
    def __init__(self, features: int = 4, d: int = 6, classes: int = 3):
        super().__init__()
        self.embed = nn.Linear(features, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.embed(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        h = self.norm(h + a)
        return self.head(h.mean(dim=1))


def _conv_autoencoder_28() -> Problem:
    """28×28 autoencoder: 28→14→7 convolutions, 7→14→28 ``output_padding=1`` decoder."""
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1),
        nn.ReLU(),
        nn.ConvTranspose2d(2, 1, 3, stride=2, padding=1, output_padding=1),
    ).double()
    x = torch.rand(2, 1, 28, 28, dtype=torch.float64)
    return Problem(model, nn.BCEWithLogitsLoss(reduction="sum"), x, x.round())


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, channels // 2, 1)
        self.fc2 = nn.Conv2d(channels // 2, channels, 1)

    def forward(self, x):
        s = x.mean(dim=(2, 3), keepdim=True)
        return x * torch.sigmoid(self.fc2(F.relu(self.fc1(s))))


class TupleHead(nn.Module):
    """Takes an RNN's ``(output, h)`` or an LSTM's ``(output, (h, c))`` tuple."""

    def __init__(self, hidden: int, classes: int = 3):
        super().__init__()
        self.lin = nn.Linear(2 * hidden, classes)

    def forward(self, outputs):
        output, state = outputs
        h = state[0] if isinstance(state, tuple) else state  # [layers, N, H]
        return self.lin(torch.cat([output.mean(dim=1), h[-1]], dim=-1))


def _recurrent(cell: type[nn.RNNBase]) -> Problem:
    model = nn.Sequential(cell(3, 4, batch_first=True), TupleHead(4)).double()
    x = torch.randn(N, 5, 3, dtype=torch.float64)
    return Problem(model, nn.CrossEntropyLoss(), x, torch.randint(0, 3, (N,)))


class Segmenter(nn.Module):
    """Tiny segmentation net: per-pixel logits [N, 3, 8, 8], ``nn.Upsample`` decoder."""

    def __init__(self):
        super().__init__()
        self.down = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.mid = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.head = nn.Conv2d(4 + 3, 3, 1)

    def forward(self, x):
        h = self.mid(self.down(x))
        return self.head(torch.cat([self.up(h), x], dim=1))


def _embedding_layernorm() -> Problem:
    model = nn.Sequential(
        nn.Embedding(10, 6, padding_idx=0),
        nn.LayerNorm(6),
        nn.Linear(6, 6),
        nn.GELU(),
        Permute(0, 2, 1),
        nn.AdaptiveAvgPool1d(1),
        nn.Flatten(),
        nn.Linear(6, 3),
    )
    model = _randomize_norms(model).double()
    tokens = torch.randint(0, 10, (N, 5))
    return Problem(model, nn.CrossEntropyLoss(), tokens, torch.randint(0, 3, (N,)))


def _simple(model: nn.Module, shape: tuple[int, ...], loss: str = "ce") -> Problem:
    model = _randomize_norms(model).double().eval()
    x = torch.randn(N, *shape, dtype=torch.float64)
    with torch.no_grad():
        out = model(x)
    if loss == "mse":
        return Problem(model, nn.MSELoss(), x, torch.randn_like(out))
    reduction = "sum" if loss == "ce-sum" else "mean"
    targets = torch.randint(0, out.shape[1], (N, *out.shape[2:]))
    return Problem(model, nn.CrossEntropyLoss(reduction=reduction), x, targets)


# ------------------------------------------------------------------------- torchvision

TORCHVISION = [
    "resnet18",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "densenet121",
    "convnext_tiny",
    "squeezenet1_0",
    "shufflenet_v2_x0_5",
    "regnet_y_400mf",
]


def _torchvision(name: str, trainable: tuple[str, ...] | None = None) -> Callable:
    """Stock classifier, ``weights=None``, 3 classes, eval, 2 images 3×32×32, CE (mean).

    ``trainable``: name prefixes of the parameters left trainable (the others frozen);
    ``None``: all parameters trainable.
    """

    def build() -> Problem:
        model = getattr(torchvision.models, name)(weights=None, num_classes=3)
        model = _randomize_norms(model).double().eval()
        if name == "squeezenet1_0":  # its last layer is conv → ReLU: keep it alive
            with torch.no_grad():
                model.classifier[1].bias.uniform_(0.5, 1.0)
        if trainable is not None:
            for pname, param in model.named_parameters():
                param.requires_grad_(pname.startswith(trainable))
        x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
        return Problem(model, nn.CrossEntropyLoss(), x, torch.tensor([0, 2]))

    return build


def _tags(*tags: str) -> frozenset[str]:
    return frozenset(tags)


# convnext_tiny has 28M parameters: all trainable, its brute force needs ~2.8 GB and
# 1.5-20 s on 2 busy cores. Trainable: the stem, stage 1, the first block of stage 3 and
# the classifier (1.5M parameters); the frozen stages are still differentiated through.
CONVNEXT_TRAINABLE = ("features.0.", "features.1.", "features.5.0.", "classifier.")

CASES: list[RealCase] = [
    *[
        RealCase(
            f"tv-{name}",
            _torchvision(name, CONVNEXT_TRAINABLE if name == "convnext_tiny" else None),
            _tags("torchvision", "small"),
        )
        for name in TORCHVISION
    ],
    # frozen middle: only the stem conv, the first block of layer3 and the classifier train
    RealCase(
        "tv-resnet18-partly-frozen",
        _torchvision("resnet18", ("conv1.", "layer3.0.", "fc.")),
        _tags("torchvision", "small"),
    ),
    RealCase("vae-randn-mse", lambda: _vae("mse"), _tags("random", "small")),
    RealCase("vae-randn-bce-sum", lambda: _vae("bce"), _tags("random", "small")),
    RealCase("dropout-train-residual", _dropout_residual, _tags("random", "small")),
    RealCase("inplace-resblock-bn-eval", _inplace_resnet, _tags("small")),
    RealCase("time-unet-x-t", _time_unet),
    RealCase("dict-inputs-mask-prototypes", _dict_inputs, _tags("small")),
    RealCase("modulelist-loop", lambda: _simple(LoopModel(), (5,)), _tags("small")),
    RealCase(
        "tied-functional-weight-t",
        lambda: _simple(TiedAutoencoder(), (6,), "mse"),
        _tags("small"),
    ),
    RealCase("shared-dec-weight", _shared_modules, _tags("small")),
    RealCase("same-layer-twice", lambda: _simple(TwiceCalled(), (5,)), _tags("small")),
    RealCase(
        "transformer-encoder-layer",
        lambda: _simple(TransformerTagger(), (5, 8), "ce-sum"),
        _tags("small"),
    ),
    RealCase(
        "multihead-attention",
        lambda: _simple(AttentionClassifier(), (5, 4)),
        _tags("small"),
    ),
    RealCase(
        "linear-to-1-permute-flatten",
        lambda: _simple(
            nn.Sequential(nn.Linear(4, 1), Permute(0, 2, 1), nn.Flatten()), (5, 4), "mse"
        ),
        _tags("small"),
    ),
    RealCase("conv-autoencoder-28-output-padding", _conv_autoencoder_28),
    RealCase(
        "squeeze-excitation",
        lambda: _simple(
            nn.Sequential(
                nn.Conv2d(3, 4, 3, padding=1),
                nn.SiLU(),
                SqueezeExcite(4),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(4, 3),
            ),
            (3, 5, 5),
        ),
        _tags("small"),
    ),
    RealCase("lstm-tuple-into-block", lambda: _recurrent(nn.LSTM), _tags("small")),
    RealCase("rnn-tuple-into-block", lambda: _recurrent(nn.RNN), _tags("small")),
    RealCase("embedding-layernorm", _embedding_layernorm, _tags("small")),
    RealCase("segmenter-upsample-pixel-ce", lambda: _simple(Segmenter(), (3, 8, 8))),
]

BY_ID = {case.id: case for case in CASES}
assert len(BY_ID) == len(CASES)


# ------------------------------------------------------------------ refusal / precision


class BatchCenter(nn.Module):
    """Reduces over the batch axis: samples are coupled, no per-sample GGN exists."""

    def __init__(self, features: int):
        super().__init__()
        self.lin = nn.Linear(features, features)

    def forward(self, x):
        h = self.lin(x)
        return h + torch.tanh(h - h.mean(0, keepdim=True))


def coupled_models() -> dict[str, tuple[Callable[[], Problem], tuple[str, ...]]]:
    """Models whose samples are coupled, and the culprit's names.

    The refusal should contain one of them: the culprit's class, or its module name
    written as ``model.<name>``.
    """

    def bn_train() -> Problem:
        model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)).train()
        x, y = torch.randn(6, 4).double(), torch.randn(6, 3).double()
        return Problem(model.double(), nn.MSELoss(), x, y)

    def resnet_train() -> Problem:
        problem = _torchvision("resnet18")()
        problem.model.train()
        return problem

    def batch_center() -> Problem:
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), BatchCenter(5), nn.Linear(5, 3))
        x, y = torch.randn(6, 4).double(), torch.randn(6, 3).double()
        return Problem(model.double(), nn.MSELoss(), x, y)

    return {
        "batchnorm1d-train": (bn_train, ("BatchNorm1d", "model.1")),
        "tv-resnet18-train": (resnet_train, ("BatchNorm2d", "model.bn1")),
        "custom-batch-mean": (batch_center, ("BatchCenter", "model.2")),
    }
