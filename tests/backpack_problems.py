"""BackPACK's 99 ``DiagGGNExact`` test problems, rebuilt without BackPACK's test package.

Copied and adapted from BackPACK (https://github.com/f-dangel/backpack, commit 366bcd60,
November 2025): the settings in ``test/extensions/secondorder/secondorder_settings.py``
(82 shared second-order problems) and ``test/extensions/secondorder/diag_ggn/
diag_ggn_settings.py`` (17 local ones: RNN/LSTM, adaptive pooling, BatchNorm in eval mode,
Embedding, branched models, converted ResNets), in that order (``DiagGGN_SETTINGS``), with
the helpers they use from ``test/extensions/automated_settings.py``,
``test/extensions/problem.py``, ``test/core/derivatives/utils.py``,
``test/utils/evaluation_mode.py`` and ``test/converter/resnet_cases.py``.

BackPACK is Copyright (c) 2019 Felix Dangel, Frederik Künstner & Philipp Hennig, released
under the MIT License (``LICENSE.txt`` in its repository): permission is granted to copy,
modify and distribute it provided the copyright notice and permission notice are kept;
the software is provided "as is", without warranty of any kind.

Adaptations: no ``device`` entries (CPU); each problem has a short readable id (its
position in ``DiagGGN_SETTINGS``, then what it is) instead of BackPACK's long repr id;
output sizes of the automated CNN settings are computed on the ``meta`` device (the
random number generator is not touched at import); the class-level input/target tensors
and loss of the converter ResNets are built fresh per call. :meth:`Problem.set_up` seeds
and builds exactly as BackPACK's ``ExtensionsTestProblem.set_up`` (model, input, target,
loss), so the numbers are BackPACK's own. Problems whose BackPACK model is
``convert_module_to_backpack(...)`` also keep the plain model (``plain_module_fn``):
ggnchunk takes models as they are.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from backpack import convert_module_to_backpack
from backpack.custom_module.branching import Parallel
from backpack.custom_module.pad import Pad
from backpack.custom_module.permute import Permute
from backpack.custom_module.reduce_tuple import ReduceTuple
from backpack.custom_module.slicing import Slicing
from torch import Tensor, nn, rand, randint
from torch.nn import (
    ELU,
    LSTM,
    RNN,
    SELU,
    AdaptiveAvgPool1d,
    AdaptiveAvgPool2d,
    AdaptiveAvgPool3d,
    AvgPool1d,
    AvgPool2d,
    AvgPool3d,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    BCEWithLogitsLoss,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    CrossEntropyLoss,
    Embedding,
    Flatten,
    Identity,
    LeakyReLU,
    Linear,
    LogSigmoid,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
    MSELoss,
    ReLU,
    Sequential,
    Sigmoid,
    Tanh,
)


@dataclass(frozen=True)
class Problem:
    id: str
    module_fn: Callable[[], nn.Module]
    input_fn: Callable[[], Tensor]
    loss_function_fn: Callable[[], nn.Module]
    target_fn: Callable[[], Tensor]
    seed: int = 0
    plain_module_fn: Callable[[], nn.Module] | None = None

    def set_up(
        self, converted: bool = False, dtype: torch.dtype = torch.float64
    ) -> tuple[nn.Module, nn.Module, Tensor, Tensor]:
        """``(model, loss_func, inputs, targets)`` as BackPACK builds them, in ``dtype``.

        ``converted``: for converter problems, BackPACK's converted model instead of the
        plain one (same parameter values).
        """
        torch.manual_seed(self.seed)
        make = self.module_fn
        if self.plain_module_fn is not None and not converted:
            make = self.plain_module_fn
        with contextlib.redirect_stdout(io.StringIO()):  # the converter's report
            model = make()
        inputs = self.input_fn()
        targets = self.target_fn()
        loss_func = self.loss_function_fn()
        model = model.to(dtype)
        if inputs.is_floating_point():
            inputs = inputs.to(dtype)
        if targets.is_floating_point():
            targets = targets.to(dtype)
        return model, loss_func, inputs, targets


# test/core/derivatives/utils.py
def classification_targets(size: tuple[int, ...], num_classes: int) -> Tensor:
    return torch.randint(size=size, low=0, high=num_classes)


def regression_targets(size: tuple[int, ...]) -> Tensor:
    return torch.rand(size=size)


# test/utils/evaluation_mode.py
def initialize_training_false_recursive(module: nn.Module) -> nn.Module:
    if isinstance(module, (BatchNorm1d, BatchNorm2d, BatchNorm3d)):
        module.running_mean = torch.rand_like(module.running_mean)
        module.running_var = torch.rand_like(module.running_var)
        module.weight.data = torch.rand_like(module.weight)
        module.bias.data = torch.rand_like(module.bias)
    else:
        for child in module.children():
            initialize_training_false_recursive(child)
    return module.train(False)


# test/extensions/automated_settings.py
def _frozen_linear(in_features: int, out_features: int) -> Linear:
    linear = Linear(in_features, out_features)
    for p in linear.parameters():
        p.requires_grad = False
    return linear


def _output_dim(module_fn: Callable[[], nn.Module], input_size: tuple[int, ...]) -> int:
    output = module_fn().to("meta")(torch.empty(input_size, device="meta"))
    return output.numel() // output.shape[0]


def _args(params: tuple[Any, ...]) -> str:
    return ",".join(str(p).replace(" ", "") for p in params)


def make_simple_act_setting(act_cls: type[nn.Module], bias: bool) -> dict:
    return {
        "input_fn": lambda: rand(3, 3, 7, 7),
        "module_fn": lambda: Sequential(
            Conv2d(3, 2, 2, bias=bias), act_cls(), Flatten(), _frozen_linear(72, 5)
        ),
        "loss_function_fn": lambda: CrossEntropyLoss(),
        "target_fn": lambda: classification_targets((3,), 5),
        "id": f"act-{act_cls.__name__}-{'bias' if bias else 'nobias'}",
    }


def make_simple_cnn_setting(
    input_size: tuple[int, ...], conv_cls: type[nn.Module], conv_params: tuple[Any, ...]
) -> dict:
    with torch.device("meta"):
        out = _output_dim(lambda: conv_cls(*conv_params), input_size)
    return {
        "input_fn": lambda: rand(input_size),
        "module_fn": lambda: Sequential(
            conv_cls(*conv_params), ReLU(), Flatten(), _frozen_linear(out, 5)
        ),
        "loss_function_fn": lambda: CrossEntropyLoss(reduction="sum"),
        "target_fn": lambda: classification_targets((3,), 5),
        "id": f"cnn-{conv_cls.__name__}({_args(conv_params)})-in{_args(input_size[1:])}",
    }


def make_simple_pooling_setting(
    input_size: tuple[int, ...],
    conv_cls: type[nn.Module],
    pool_cls: type[nn.Module],
    pool_params: tuple[Any, ...],
) -> dict:
    conv_params = (3, 2, 2)
    with torch.device("meta"):
        out = _output_dim(
            lambda: Sequential(conv_cls(*conv_params), pool_cls(*pool_params)), input_size
        )
    return {
        "input_fn": lambda: rand(input_size),
        "module_fn": lambda: Sequential(
            conv_cls(*conv_params),
            ReLU(),
            pool_cls(*pool_params),
            Flatten(),
            _frozen_linear(out, 5),
        ),
        "loss_function_fn": lambda: CrossEntropyLoss(reduction="sum"),
        "target_fn": lambda: classification_targets((3,), 5),
        "id": f"pool-{conv_cls.__name__}-{pool_cls.__name__}({_args(pool_params)})",
    }


# test/converter/resnet_cases.py
class ResNet1(nn.Module):
    """Small ResNet: one Euler step."""

    def __init__(self, in_dim: int = 2, out_dim: int = 10):
        super().__init__()
        self.net = Sequential(
            Linear(in_dim, out_dim),
            Tanh(),
            Linear(out_dim, out_dim),
            Tanh(),
            Linear(out_dim, in_dim),
        )

    def forward(self, input: Tensor) -> Tensor:
        x = self.net(input)
        return input + x * 0.1


class ResNet2(nn.Module):
    """Replicates resnet18 but a lot smaller."""

    num_classes: int = 3
    batch_size: int = 2
    picture_width: int = 7
    inplanes = 2
    input_test = (batch_size, 3, picture_width, picture_width)
    target_test = (batch_size, num_classes)

    def __init__(self):
        from torchvision.models.resnet import BasicBlock

        super().__init__()
        self.inplanes = ResNet2.inplanes
        self.conv1 = Conv2d(
            3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False
        )
        self.bn1 = BatchNorm2d(self.inplanes)
        self.relu = ReLU(inplace=True)
        self.maxpool = MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(BasicBlock, ResNet2.inplanes, 2)
        self.layer2 = self._make_layer(BasicBlock, 2 * ResNet2.inplanes, 2, stride=2)
        self.layer3 = self._make_layer(BasicBlock, 4 * ResNet2.inplanes, 2, stride=2)
        self.avgpool = AdaptiveAvgPool2d((1, 1))
        self.fc = Linear(4 * ResNet2.inplanes, self.num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)

    def _make_layer(
        self, block: type[nn.Module], planes: int, blocks: int, stride: int = 1
    ) -> Sequential:
        from torchvision.models.resnet import conv1x1

        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample, 1, 64, 1, BatchNorm2d)]
        self.inplanes = planes * block.expansion
        layers += [
            block(
                self.inplanes,
                planes,
                groups=1,
                base_width=64,
                dilation=1,
                norm_layer=BatchNorm2d,
            )
            for _ in range(1, blocks)
        ]
        return Sequential(*layers)


###############################################################################
#        test/extensions/secondorder/secondorder_settings.py (82 problems)     #
###############################################################################
SECONDORDER_SETTINGS: list[dict] = [
    {
        "input_fn": lambda: rand(3, 10),
        "module_fn": lambda: Sequential(Linear(10, 5)),
        "loss_function_fn": lambda: CrossEntropyLoss(),
        "target_fn": lambda: classification_targets((3,), 5),
        "seed": 0,
        "id": "example-linear-ce",
    },
    # classification
    {
        "input_fn": lambda: rand(3, 10),
        "module_fn": lambda: Sequential(Linear(10, 7), Linear(7, 5)),
        "loss_function_fn": lambda: CrossEntropyLoss(reduction="mean"),
        "target_fn": lambda: classification_targets((3,), 5),
        "id": "linear-linear-ce-mean",
    },
    {
        "input_fn": lambda: rand(3, 10),
        "module_fn": lambda: Sequential(Linear(10, 7), ReLU(), Linear(7, 5)),
        "loss_function_fn": lambda: CrossEntropyLoss(reduction="sum"),
        "target_fn": lambda: classification_targets((3,), 5),
        "id": "linear-relu-linear-ce-sum",
    },
    # regression
    {
        "input_fn": lambda: rand(3, 10),
        "module_fn": lambda: Sequential(Linear(10, 7), Sigmoid(), Linear(7, 5)),
        "loss_function_fn": lambda: MSELoss(reduction="mean"),
        "target_fn": lambda: regression_targets((3, 5)),
        "id": "linear-sigmoid-linear-mse-mean",
    },
]

# activation layers
for _act in [ReLU, Sigmoid, Tanh, LeakyReLU, LogSigmoid, ELU, SELU]:
    for _bias in [True, False]:
        SECONDORDER_SETTINGS.append(make_simple_act_setting(_act, bias=_bias))

# max pooling: MaxPoolNd(kernel_size, stride, padding, dilation, return_indices, ceil_mode)
SECONDORDER_SETTINGS += [
    make_simple_pooling_setting((3, 3, 7), Conv1d, MaxPool1d, (2, 1)),
    make_simple_pooling_setting((3, 3, 7), Conv1d, MaxPool1d, (2, 1, 0, 2)),
    make_simple_pooling_setting((3, 3, 7), Conv1d, MaxPool1d, (2, 1, 0, 2, False, True)),
    make_simple_pooling_setting((3, 3, 11, 11), Conv2d, MaxPool2d, (2, 1)),
    make_simple_pooling_setting((3, 3, 7, 7), Conv2d, MaxPool2d, (2, 1, 0, 2)),
    make_simple_pooling_setting((3, 3, 7, 7), Conv2d, MaxPool2d, (2, 1, 0, 2, False, True)),
    make_simple_pooling_setting((3, 3, 7, 7, 7), Conv3d, MaxPool3d, (2, 1)),
    make_simple_pooling_setting((3, 3, 7, 7, 7), Conv3d, MaxPool3d, (2, 1, 0, 2)),
    make_simple_pooling_setting(
        (3, 3, 7, 7, 7), Conv3d, MaxPool3d, (2, 1, 0, 2, False, True)
    ),
]

# average pooling: AvgPoolNd(kernel_size, stride, padding, ceil_mode)
SECONDORDER_SETTINGS += [
    make_simple_pooling_setting((3, 3, 7), Conv1d, AvgPool1d, (2, 1)),
    make_simple_pooling_setting((3, 3, 7), Conv1d, AvgPool1d, (2, 1, 0, True)),
    make_simple_pooling_setting((3, 3, 7), Conv1d, AvgPool1d, (2, 1, 0, False)),
    make_simple_pooling_setting((3, 3, 11, 11), Conv2d, AvgPool2d, (2, 1)),
    make_simple_pooling_setting((3, 3, 7, 7), Conv2d, AvgPool2d, (2, 1, 0, True)),
    make_simple_pooling_setting((3, 3, 7, 7), Conv2d, AvgPool2d, (2, 1, 0, False)),
    make_simple_pooling_setting((3, 3, 7, 7, 7), Conv3d, AvgPool3d, (2, 1)),
    make_simple_pooling_setting((3, 3, 7, 7, 7), Conv3d, AvgPool3d, (2, 1, 0, True)),
    make_simple_pooling_setting((3, 3, 7, 7, 7), Conv3d, AvgPool3d, (2, 1, 0, False)),
]

# convolutions:
# ConvNd(in, out, kernel_size, stride, padding, dilation, groups, bias)
# ConvTransposeNd(in, out, kernel_size, stride, padding, output_padding, groups, bias,
#                 dilation)
SECONDORDER_SETTINGS += [
    # Conv1d
    make_simple_cnn_setting((3, 3, 7), Conv1d, (3, 2, 2)),
    make_simple_cnn_setting((3, 2, 7), Conv1d, (2, 3, 2, 2, 0, 2)),
    make_simple_cnn_setting((3, 3, 7), Conv1d, (3, 2, 2, 2, 1)),
    make_simple_cnn_setting((3, 3, 8), Conv1d, (3, 6, 2, 4, 2, 3)),
    make_simple_cnn_setting((3, 3, 7), Conv1d, (3, 2, 2, 4, 2, 1, 1, False)),
    # Conv2d
    make_simple_cnn_setting((3, 3, 7, 7), Conv2d, (3, 2, 2)),
    make_simple_cnn_setting((3, 2, 7, 7), Conv2d, (2, 3, 2, 2, 0, 2)),
    make_simple_cnn_setting((3, 3, 7, 7), Conv2d, (3, 2, 2, 2, 1)),
    make_simple_cnn_setting((3, 3, 8, 8), Conv2d, (3, 6, 2, 4, 2, 3)),
    make_simple_cnn_setting((3, 3, 7, 7), Conv2d, (3, 2, 2, 4, 2, 1, 1, False)),
    # Conv3d
    make_simple_cnn_setting((3, 3, 2, 7, 7), Conv3d, (3, 2, 2)),
    make_simple_cnn_setting((3, 2, 3, 7, 7), Conv3d, (2, 3, 2, 2, 0, 2)),
    make_simple_cnn_setting((3, 3, 2, 7, 7), Conv3d, (3, 2, 2, 3, 2)),
    make_simple_cnn_setting((3, 3, 4, 8, 8), Conv3d, (3, 6, 2, 4, 2, 3)),
    make_simple_cnn_setting((3, 3, 2, 7, 7), Conv3d, (3, 2, 2, 4, 2, 1, 1, False)),
    # ConvTranspose1d
    make_simple_cnn_setting((3, 3, 7), ConvTranspose1d, (3, 2, 2)),
    make_simple_cnn_setting((3, 2, 7), ConvTranspose1d, (2, 3, 2, 2, 0, 0, 1, True, 2)),
    make_simple_cnn_setting((3, 3, 7), ConvTranspose1d, (3, 2, 2, 2, 1)),
    make_simple_cnn_setting((3, 3, 8), ConvTranspose1d, (3, 6, 2, 4, 2, 0, 1, True, 3)),
    make_simple_cnn_setting((3, 3, 7), ConvTranspose1d, (3, 2, 2, 4, 2, 0, 1, False)),
    # ConvTranspose2d
    make_simple_cnn_setting((3, 3, 7, 7), ConvTranspose2d, (3, 2, 2)),
    make_simple_cnn_setting((3, 2, 9, 9), ConvTranspose2d, (2, 4, 2, 1, 0, 0, 1, True, 2)),
    make_simple_cnn_setting((3, 3, 7, 7), ConvTranspose2d, (3, 2, 2, 2, 1)),
    make_simple_cnn_setting((3, 3, 7, 7), ConvTranspose2d, (3, 2, 2, 4, 2, 0, 1, False)),
    # ConvTranspose3d
    make_simple_cnn_setting((3, 3, 2, 7, 7), ConvTranspose3d, (3, 2, 2)),
    make_simple_cnn_setting(
        (3, 2, 3, 5, 5), ConvTranspose3d, (2, 3, 2, 2, 2, 0, 1, True, 2)
    ),
    make_simple_cnn_setting((3, 3, 2, 7, 7), ConvTranspose3d, (3, 2, 2, 4, 2, 0, 1, False)),
]

# group convolutions
SECONDORDER_SETTINGS += [
    make_simple_cnn_setting((3, 6, 7), Conv1d, (6, 4, 2, 1, 0, 1, 2)),
    make_simple_cnn_setting((3, 6, 7, 5), Conv2d, (6, 3, 2, 1, 0, 1, 3)),
    make_simple_cnn_setting((3, 4, 7, 5, 6), Conv3d, (4, 2, 2, 1, 0, 2, 2)),
    make_simple_cnn_setting((3, 6, 8), ConvTranspose1d, (6, 3, 2, 4, 2, 0, 3, True, 3)),
    make_simple_cnn_setting((3, 4, 9, 9), ConvTranspose2d, (4, 2, 2, 1, 0, 0, 2, True, 2)),
    make_simple_cnn_setting(
        (3, 4, 3, 5, 5), ConvTranspose3d, (4, 2, (2, 2, 1), 2, 2, 0, 2, True, 2)
    ),
]

# linear with additional dimensions
SECONDORDER_SETTINGS += [
    # regression
    {
        "input_fn": lambda: rand(3, 4, 5),
        "module_fn": lambda: Sequential(Linear(5, 3), Linear(3, 2), Flatten()),
        "loss_function_fn": lambda: MSELoss(reduction="mean"),
        "target_fn": lambda: regression_targets((3, 8)),
        "id": "one-additional-mse-mean",
    },
    {
        "input_fn": lambda: rand(3, 4, 2, 5),
        "module_fn": lambda: Sequential(Linear(5, 3), Sigmoid(), Linear(3, 2), Flatten()),
        "loss_function_fn": lambda: MSELoss(reduction="mean"),
        "target_fn": lambda: regression_targets((3, 16)),
        "id": "two-additional-mse-mean",
    },
    {
        "input_fn": lambda: rand(3, 4, 2, 3, 5),
        "module_fn": lambda: Sequential(Linear(5, 3), Linear(3, 2), Flatten()),
        "loss_function_fn": lambda: MSELoss(reduction="sum"),
        "target_fn": lambda: regression_targets((3, 48)),
        "id": "three-additional-mse-sum",
    },
    # classification
    {
        "input_fn": lambda: rand(3, 4, 5),
        "module_fn": lambda: Sequential(Linear(5, 3), Linear(3, 2), Flatten()),
        "loss_function_fn": lambda: CrossEntropyLoss(reduction="mean"),
        "target_fn": lambda: classification_targets((3,), 8),
        "id": "one-additional-ce-mean",
    },
    {
        "input_fn": lambda: rand(3, 4, 2, 5),
        "module_fn": lambda: Sequential(Linear(5, 3), Sigmoid(), Linear(3, 2), Flatten()),
        "loss_function_fn": lambda: CrossEntropyLoss(reduction="mean"),
        "target_fn": lambda: classification_targets((3,), 16),
        "id": "two-additional-ce-mean",
    },
    {
        "input_fn": lambda: rand(3, 4, 2, 3, 5),
        "module_fn": lambda: Sequential(Linear(5, 3), ReLU(), Linear(3, 2), Flatten()),
        "loss_function_fn": lambda: CrossEntropyLoss(reduction="sum"),
        "target_fn": lambda: classification_targets((3,), 48),
        "id": "three-additional-ce-sum",
    },
]

# CrossEntropyLoss on [N, C, d1, d2, d3]
SECONDORDER_SETTINGS += [
    {
        "input_fn": lambda: rand(3, 4, 2, 3, 5),
        "module_fn": lambda: Sequential(Linear(5, 3), ReLU(), Linear(3, 2)),
        "loss_function_fn": lambda: CrossEntropyLoss(reduction="sum"),
        "target_fn": lambda: classification_targets((3, 2, 3, 2), 4),
        "id": "multi-d-CrossEntropyLoss",
    },
]

# custom Pad module
SECONDORDER_SETTINGS += [
    {
        "input_fn": lambda: rand(5, 3, 4, 4),
        "module_fn": lambda: Sequential(
            Conv2d(in_channels=3, out_channels=2, kernel_size=2),
            Pad((1, 1, 0, 2), mode="constant", value=0.0),
            Conv2d(in_channels=2, out_channels=2, kernel_size=3, stride=2),
            Flatten(),
            Linear(8, 2),
        ),
        "loss_function_fn": lambda: MSELoss(reduction="mean"),
        "target_fn": lambda: regression_targets((5, 2)),
        "id": "pad-conv-mse",
    },
    {
        "input_fn": lambda: rand(5, 3, 4, 4),
        "module_fn": lambda: Sequential(
            Conv2d(in_channels=3, out_channels=2, kernel_size=3, padding=1),
            ReLU(),
            Pad((1, 1, 2, 0, 1, 2), mode="constant", value=1.0),
            Conv2d(in_channels=5, out_channels=2, kernel_size=3, stride=2),
            ReLU(),
            Flatten(),
            Linear(8, 3),
        ),
        "loss_function_fn": lambda: CrossEntropyLoss(reduction="mean"),
        "target_fn": lambda: classification_targets((5,), 3),
        "id": "pad-channels-conv-ce",
    },
]

# custom Slicing module
SECONDORDER_SETTINGS += [
    {
        "input_fn": lambda: rand(3, 3, 4, 5),
        "module_fn": lambda: Sequential(
            Conv2d(in_channels=3, out_channels=2, kernel_size=2, padding=1),
            Slicing((slice(None), 0, slice(None, None, 2), slice(0, 2))),
            ReLU(),
            Flatten(),
            Linear(6, 4),
        ),
        "loss_function_fn": lambda: CrossEntropyLoss(reduction="mean"),
        "target_fn": lambda: classification_targets((3,), 4),
        "id": "slicing-conv-ce",
    },
    {
        "input_fn": lambda: rand(3, 3, 4, 5),
        "module_fn": lambda: Sequential(
            Conv2d(in_channels=3, out_channels=2, kernel_size=2, padding=1),
            Slicing((slice(None), slice(None), 2)),
            ReLU(),
            Slicing((slice(None), 1)),
            Linear(6, 4),
        ),
        "loss_function_fn": lambda: MSELoss(reduction="mean"),
        "target_fn": lambda: regression_targets((3, 4)),
        "id": "slicing-twice-conv-mse",
    },
]

# BCEWithLogitsLoss
SECONDORDER_SETTINGS += [
    {
        "input_fn": lambda: rand(3, 6),
        "module_fn": lambda: Sequential(Linear(6, 4), ReLU(), Linear(4, 1)),
        "loss_function_fn": lambda: BCEWithLogitsLoss(reduction="mean"),
        "target_fn": lambda: rand(3, 1),
        "id": "bce-non-binary-labels-mean",
    },
    {
        "input_fn": lambda: rand(3, 6),
        "module_fn": lambda: Sequential(Linear(6, 4), ReLU(), Linear(4, 1)),
        "loss_function_fn": lambda: BCEWithLogitsLoss(reduction="sum"),
        "target_fn": lambda: classification_targets(size=(3, 1), num_classes=2).float(),
        "id": "bce-binary-labels-sum",
    },
]

###############################################################################
#   test/extensions/secondorder/diag_ggn/diag_ggn_settings.py (17 problems)    #
###############################################################################
LOCAL_SETTINGS: list[dict] = [
    # RNN
    {
        "input_fn": lambda: rand(8, 5, 6),
        "module_fn": lambda: Sequential(
            RNN(input_size=6, hidden_size=3, batch_first=True),
            ReduceTuple(index=0),
            Permute(0, 2, 1),
            Flatten(),
        ),
        "loss_function_fn": lambda: MSELoss(),
        "target_fn": lambda: regression_targets((8, 3 * 5)),
        "id": "rnn-permute-mse",
    },
    {
        "input_fn": lambda: rand(4, 3, 5),
        "module_fn": lambda: Sequential(
            LSTM(input_size=5, hidden_size=4, batch_first=True),
            ReduceTuple(index=0),
            Flatten(),
        ),
        "loss_function_fn": lambda: CrossEntropyLoss(),
        "target_fn": lambda: classification_targets((4,), 4 * 3),
        "id": "lstm-ce",
    },
    {
        "input_fn": lambda: rand(8, 5, 6),
        "module_fn": lambda: Sequential(
            RNN(input_size=6, hidden_size=3, batch_first=True),
            ReduceTuple(index=0),
            Linear(3, 3),
            Permute(0, 2, 1),
        ),
        "loss_function_fn": lambda: CrossEntropyLoss(),
        "target_fn": lambda: classification_targets((8, 5), 3),
        "id": "rnn-linear-permute-ce-2d",
    },
    # AdaptiveAvgPool
    {
        "input_fn": lambda: rand(2, 2, 9),
        "module_fn": lambda: Sequential(Linear(9, 9), AdaptiveAvgPool1d((3,)), Flatten()),
        "loss_function_fn": lambda: MSELoss(),
        "target_fn": lambda: regression_targets((2, 2 * 3)),
        "id": "adaptive-avg-pool-1d",
    },
    {
        "input_fn": lambda: rand(2, 2, 6, 8),
        "module_fn": lambda: Sequential(Linear(8, 8), AdaptiveAvgPool2d((3, 4)), Flatten()),
        "loss_function_fn": lambda: MSELoss(),
        "target_fn": lambda: regression_targets((2, 2 * 3 * 4)),
        "id": "adaptive-avg-pool-2d",
    },
    {
        "input_fn": lambda: rand(2, 2, 9, 5, 4),
        "module_fn": lambda: Sequential(
            Linear(4, 4), AdaptiveAvgPool3d((3, 5, 2)), Flatten()
        ),
        "loss_function_fn": lambda: MSELoss(),
        "target_fn": lambda: regression_targets((2, 2 * 3 * 5 * 2)),
        "id": "adaptive-avg-pool-3d",
    },
    # BatchNorm (evaluation mode)
    {
        "input_fn": lambda: rand(2, 3, 4),
        "module_fn": lambda: initialize_training_false_recursive(
            Sequential(BatchNorm1d(num_features=3), Flatten())
        ),
        "loss_function_fn": lambda: MSELoss(),
        "target_fn": lambda: regression_targets((2, 4 * 3)),
        "id": "batchnorm1d-eval",
    },
    {
        "input_fn": lambda: rand(3, 2, 4, 3),
        "module_fn": lambda: initialize_training_false_recursive(
            Sequential(BatchNorm2d(num_features=2), Flatten())
        ),
        "loss_function_fn": lambda: MSELoss(),
        "target_fn": lambda: regression_targets((3, 2 * 4 * 3)),
        "id": "batchnorm2d-eval",
    },
    {
        "input_fn": lambda: rand(3, 3, 4, 1, 2),
        "module_fn": lambda: initialize_training_false_recursive(
            Sequential(BatchNorm3d(num_features=3), Flatten())
        ),
        "loss_function_fn": lambda: MSELoss(),
        "target_fn": lambda: regression_targets((3, 3 * 4 * 1 * 2)),
        "id": "batchnorm3d-eval",
    },
    {
        "input_fn": lambda: rand(3, 3, 4, 1, 2),
        "module_fn": lambda: initialize_training_false_recursive(
            Sequential(
                BatchNorm3d(num_features=3),
                Linear(2, 3),
                BatchNorm3d(num_features=3),
                ReLU(),
                BatchNorm3d(num_features=3),
                Flatten(),
            )
        ),
        "loss_function_fn": lambda: MSELoss(),
        "target_fn": lambda: regression_targets((3, 4 * 1 * 3 * 3)),
        "id": "batchnorm3d-linear-stack-eval",
    },
    # Embedding
    {
        "input_fn": lambda: randint(0, 5, (6,)),
        "module_fn": lambda: Sequential(Embedding(5, 3), Linear(3, 4)),
        "loss_function_fn": lambda: CrossEntropyLoss(reduction="mean"),
        "target_fn": lambda: classification_targets((6,), 4),
        "id": "embedding-linear-ce",
    },
    {
        "input_fn": lambda: randint(0, 3, (3, 2, 2)),
        "module_fn": lambda: Sequential(Embedding(3, 2), Flatten()),
        "loss_function_fn": lambda: CrossEntropyLoss(reduction="mean"),
        "target_fn": lambda: classification_targets((3,), 2 * 2),
        "seed": 2,
        "id": "embedding-flatten-ce",
    },
    # branched models
    {
        "input_fn": lambda: rand(3, 10),
        "module_fn": lambda: Sequential(
            Linear(10, 5),
            ReLU(),
            Parallel(Identity(), Linear(5, 5)),  # skip connection
            Sigmoid(),
            Linear(5, 4),
        ),
        "loss_function_fn": lambda: CrossEntropyLoss(),
        "target_fn": lambda: classification_targets((3,), 4),
        "id": "branching-linear",
    },
    {
        "input_fn": lambda: rand(4, 2, 6, 6),
        "module_fn": lambda: Sequential(
            Conv2d(2, 3, kernel_size=3, stride=1, padding=1),
            ReLU(),
            Parallel(  # skip connection
                Identity(),
                Sequential(
                    Conv2d(3, 5, kernel_size=3, stride=1, padding=1),
                    ReLU(),
                    Conv2d(5, 3, kernel_size=3, stride=1, padding=1),
                ),
            ),
            MaxPool2d(kernel_size=3, stride=2),
            Flatten(),
            Linear(12, 5),
        ),
        "loss_function_fn": lambda: CrossEntropyLoss(),
        "target_fn": lambda: classification_targets((4,), 5),
        "id": "branching-convolution",
    },
    {
        "input_fn": lambda: rand(4, 3, 6, 6),
        "module_fn": lambda: Sequential(
            Conv2d(3, 2, kernel_size=3, stride=1, padding=1),
            ReLU(),
            Parallel(  # skip connection
                Identity(),
                Sequential(
                    Conv2d(2, 4, kernel_size=3, stride=1, padding=1),
                    Sigmoid(),
                    Conv2d(4, 2, kernel_size=3, stride=1, padding=1),
                    Parallel(
                        Identity(),
                        Sequential(
                            Conv2d(2, 4, kernel_size=3, stride=1, padding=1),
                            ReLU(),
                            Conv2d(4, 2, kernel_size=3, stride=1, padding=1),
                        ),
                    ),
                ),
            ),
            MaxPool2d(kernel_size=3, stride=2),
            Flatten(),
            Linear(8, 5),
        ),
        "loss_function_fn": lambda: CrossEntropyLoss(),
        "target_fn": lambda: classification_targets((4,), 5),
        "id": "nested-branching-convolution",
    },
    # branched models, converter (BackPACK: convert_module_to_backpack(model, True))
    {
        "input_fn": lambda: torch.tensor([[1.0, 2.0]]),
        "module_fn": lambda: convert_module_to_backpack(ResNet1(), True),
        "plain_module_fn": ResNet1,
        "loss_function_fn": lambda: MSELoss(),
        "target_fn": lambda: torch.tensor([[1.0, 1.0]]),
        "id": "ResNet1",
    },
    {
        "input_fn": lambda: rand(ResNet2.input_test),
        "module_fn": lambda: convert_module_to_backpack(ResNet2().eval(), True),
        "plain_module_fn": lambda: ResNet2().eval(),
        "loss_function_fn": lambda: MSELoss(),
        "target_fn": lambda: rand(ResNet2.target_test),
        "id": "ResNet2",
    },
]


def _problem(index: int, setting: dict) -> Problem:
    setting = dict(setting)
    name = setting.pop("id")
    return Problem(id=f"{index:02d}-{name}", **setting)


PROBLEMS: list[Problem] = [
    _problem(i, s) for i, s in enumerate(SECONDORDER_SETTINGS + LOCAL_SETTINGS)
]
BY_ID: dict[str, Problem] = {p.id: p for p in PROBLEMS}
assert len(PROBLEMS) == 99 and len(BY_ID) == 99
