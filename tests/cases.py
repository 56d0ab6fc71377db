"""The case table: models × losses × reductions × output shapes × chunkings.

Each model case builds a small model and inputs; each loss case builds a loss module and
targets that fit a given output. Tests turn their product into parametrized ids such as
``conv_ae[N,2,6,6]-mse-mean-chunks3``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from backpack.custom_module.reduce_tuple import ReduceTuple
from torch import Tensor, nn

N = 3  # batch size of every case


@dataclass(frozen=True)
class ModelCase:
    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]  # without the batch axis
    integer_inputs: int = 0  # > 0: inputs are indices below this value

    def make(self, seed: int = 0) -> tuple[nn.Module, Tensor]:
        torch.manual_seed(seed)
        model = self.build()
        model.eval()
        if self.integer_inputs:
            x = torch.randint(0, self.integer_inputs, (N, *self.input_shape))
        else:
            x = torch.randn(N, *self.input_shape)
        return model, x


def _bn_mlp() -> nn.Module:
    model = nn.Sequential(
        nn.Linear(5, 6),
        nn.BatchNorm1d(6),
        nn.Dropout(0.3),
        nn.LeakyReLU(0.1),
        nn.Linear(6, 4),
    )
    bn = model[1]
    bn.running_mean.normal_()
    bn.running_var.uniform_(0.5, 2.0)
    bn.weight.data.normal_()
    bn.bias.data.normal_()
    return model


MODELS: list[ModelCase] = [
    ModelCase(
        "mlp[N,5]",
        lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5)),
        (6,),
    ),
    ModelCase(
        "conv_ae[N,2,6,6]",
        lambda: nn.Sequential(
            nn.Sequential(nn.Conv2d(2, 3, 3), nn.Sigmoid()),
            nn.Sequential(nn.ConvTranspose2d(3, 2, 3)),
        ),
        (2, 6, 6),
    ),
    ModelCase(
        "conv_ae_flat[N,32]",
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3, stride=1, padding=1),
            nn.ReLU(),
            nn.AvgPool2d(2),
            nn.ConvTranspose2d(3, 2, 2, stride=2),
            nn.Flatten(),
        ),
        (2, 4, 4),
    ),
    ModelCase(
        "seq[N,4,3]",
        lambda: nn.Sequential(nn.Linear(4, 6), nn.ELU(), nn.Linear(6, 3)),
        (4, 4),
    ),
    ModelCase(
        "cnn_classifier[N,4]",
        lambda: nn.Sequential(
            nn.Conv2d(1, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(12, 4)
        ),
        (1, 6, 6),
    ),
    ModelCase(
        "segmenter[N,3,4,4]",
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.SELU(), nn.Conv2d(4, 3, 1)),
        (2, 4, 4),
    ),
    ModelCase("bn_dropout_mlp[N,4]", _bn_mlp, (5,)),
    ModelCase(
        "conv1d[N,2,7]",
        lambda: nn.Sequential(
            nn.Conv1d(2, 3, 3, padding=1),
            nn.LogSigmoid(),
            nn.ConvTranspose1d(3, 2, 3, padding=1, dilation=1),
            nn.AdaptiveAvgPool1d(7),
        ),
        (2, 7),
    ),
    ModelCase(
        "conv3d[N,2,2,3,3]",
        lambda: nn.Sequential(nn.Conv3d(1, 2, 2, padding=1), nn.Sigmoid(), nn.MaxPool3d(2)),
        (1, 2, 4, 4),
    ),
    ModelCase(
        "embedding[N,3]",
        lambda: nn.Sequential(
            nn.Embedding(6, 4, padding_idx=0), nn.Flatten(), nn.Tanh(), nn.Linear(12, 3)
        ),
        (3,),
        integer_inputs=6,
    ),
    ModelCase(
        "lstm[N,5,2]",
        lambda: nn.Sequential(
            nn.LSTM(3, 4, batch_first=True), ReduceTuple(index=0), nn.Linear(4, 2)
        ),
        (5, 3),
    ),
    ModelCase(
        "rnn[N,5,2]",
        lambda: nn.Sequential(
            nn.RNN(3, 4, batch_first=True), ReduceTuple(index=0), nn.Linear(4, 2)
        ),
        (5, 3),
    ),
]


@dataclass(frozen=True)
class LossCase:
    name: str
    build: Callable[[Tensor], tuple[nn.Module, Tensor]]  # output → (loss, targets)
    needs_classes: bool = False  # cross-entropy: output [N, C, ...]


def _mse(reduction: str) -> Callable[[Tensor], tuple[nn.Module, Tensor]]:
    return lambda out: (nn.MSELoss(reduction=reduction), torch.randn_like(out))


def _bce(reduction: str, weighted: bool = False):
    def build(out: Tensor) -> tuple[nn.Module, Tensor]:
        targets = torch.rand_like(out).round()
        if not weighted:
            return nn.BCEWithLogitsLoss(reduction=reduction), targets
        weight = torch.rand(out.shape[-1]) + 0.5
        pos_weight = torch.rand(out.shape[-1]) * 3
        return nn.BCEWithLogitsLoss(weight, reduction=reduction, pos_weight=pos_weight), (
            targets
        )

    return build


def _ce(reduction: str, **options):
    soft = options.pop("soft", False)

    def build(out: Tensor) -> tuple[nn.Module, Tensor]:
        classes = out.shape[1]
        kwargs = dict(options)
        if "weight" in kwargs:
            kwargs["weight"] = torch.rand(classes) + 0.2
        if soft:
            targets = torch.softmax(torch.randn_like(out), dim=1)
        else:
            targets = torch.randint(0, classes, (out.shape[0], *out.shape[2:]))
            if "ignore_index" in kwargs:
                targets.view(-1)[::3] = kwargs["ignore_index"]
        return nn.CrossEntropyLoss(reduction=reduction, **kwargs), targets

    return build


LOSSES: list[LossCase] = [
    LossCase("mse-mean", _mse("mean")),
    LossCase("mse-sum", _mse("sum")),
    LossCase("bce-mean", _bce("mean")),
    LossCase("bce-sum", _bce("sum")),
    LossCase("bce-weighted-sum", _bce("sum", weighted=True)),
    LossCase("ce-mean", _ce("mean"), needs_classes=True),
    LossCase("ce-sum", _ce("sum"), needs_classes=True),
    LossCase(
        "ce-weight-ignore-smooth-mean",
        _ce("mean", weight=None, ignore_index=99, label_smoothing=0.2),
        needs_classes=True,
    ),
    LossCase("ce-soft-smooth-sum", _ce("sum", soft=True, label_smoothing=0.1), True),
]

# (id, kwargs from the number of columns V)
CHUNKINGS: list[tuple[str, Callable[[int], dict]]] = [
    ("onepass", lambda v: {}),
    ("chunks3", lambda v: {"num_chunks": 3}),
    ("chunks_all", lambda v: {"num_chunks": v}),
    ("size5", lambda v: {"chunk_size": min(5, v)}),
]
