"""Every layer rule, over its options, against the float64 brute force.

Each rule's diagonal (fast form), its per-sample products (used for shared parameters)
and its backpropagation (folded over columns) are exercised: the per-sample form by
sharing the layer's parameters with a twin, the backpropagation by a layer in front of it.
Both contraction forms of :func:`ggnchunk._rules.square_sum` (direct and Gram) are
compared with a plain einsum.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ggnchunk
from ggnchunk._rules.base import Caches
from ggnchunk._rules.kernels import square_sum, use_gram
from tests.reference import assert_diag_close, reference_diag_ggn

LAYERS = {
    "linear": (lambda: nn.Linear(4, 3), (4,)),
    "linear-tokens": (lambda: nn.Linear(4, 3), (5, 4)),
    "linear-no-bias-2-extra-axes": (lambda: nn.Linear(4, 3, bias=False), (2, 3, 4)),
    "conv1d-stride-dilation": (lambda: nn.Conv1d(2, 4, 3, stride=2, dilation=2), (2, 11)),
    "conv1d-drops-a-row": (lambda: nn.Conv1d(2, 4, 3, stride=2, dilation=2), (2, 12)),
    "conv2d-stride3-drops-rows": (
        lambda: nn.Conv2d(2, 3, (3, 2), stride=(3, 2), padding=(1, 0)), (2, 8, 7)
    ),
    "conv2d-groups-padding": (lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), (4, 5, 5)),
    "conv2d-same-reflect": (
        lambda: nn.Conv2d(2, 3, (3, 2), padding="same", padding_mode="reflect"),
        (2, 5, 6),
    ),
    "conv2d-circular": (lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular"),
                        (2, 4, 4)),
    "conv2d-depthwise": (lambda: nn.Conv2d(3, 3, 3, groups=3), (3, 5, 5)),
    "conv3d": (lambda: nn.Conv3d(2, 2, 2, stride=(1, 2, 1)), (2, 3, 4, 3)),
    # grouped at stride 1: backpropagated by a convolution with the flipped kernel
    "conv1d-groups-dilated-padded": (
        lambda: nn.Conv1d(4, 6, 3, padding=3, dilation=2, groups=2), (4, 7)
    ),
    "conv2d-depthwise-dilated-5x5": (
        lambda: nn.Conv2d(3, 3, 5, padding=4, dilation=2, groups=3), (3, 6, 5)
    ),
    "conv2d-depthwise-multiplier": (
        lambda: nn.Conv2d(2, 6, (3, 2), padding=(1, 0), groups=2), (2, 5, 4)
    ),
    "conv2d-groups-padding-past-the-kernel": (
        lambda: nn.Conv2d(4, 4, 3, padding=3, groups=2), (4, 3, 3)
    ),
    # dilated and padded far past small maps (an ASPP's atrous branches): the patches
    # are gathered tap by tap, no padded map
    "conv2d-atrous-on-a-small-map": (
        lambda: nn.Conv2d(3, 4, 3, padding=6, dilation=6), (3, 4, 4)
    ),
    "conv1d-atrous-strided": (
        lambda: nn.Conv1d(2, 3, 3, stride=2, padding=5, dilation=5), (2, 4)
    ),
    "conv3d-atrous-groups": (
        lambda: nn.Conv3d(4, 2, (3, 1, 3), padding=(4, 0, 3), dilation=(4, 1, 3), groups=2),
        (4, 2, 3, 2),
    ),
    "conv3d-groups": (lambda: nn.Conv3d(4, 2, (3, 2, 3), padding=(1, 0, 1), groups=2),
                      (4, 3, 3, 4)),
    "convT1d-output-padding": (
        lambda: nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1, output_padding=1), (2, 4)
    ),
    "convT2d-output-padding": (
        lambda: nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1),
        (3, 4, 4),
    ),
    "convT2d-groups-dilation": (
        lambda: nn.ConvTranspose2d(4, 2, 2, groups=2, dilation=2, stride=(2, 1)),
        (4, 3, 3),
    ),
    "convT3d": (lambda: nn.ConvTranspose3d(2, 2, 2, stride=2, output_padding=(1, 0, 1)),
                (2, 2, 2, 2)),
    # output padding at or past the stride (allowed below the dilation): the output grid
    # has more patches than the input has positions
    "convT2d-output-padding-past-the-stride": (
        lambda: nn.ConvTranspose2d(3, 2, 2, stride=(1, 2), padding=1, dilation=3,
                                   output_padding=(1, 2)),
        (3, 4, 5),
    ),
    "convT1d-output-padding-past-the-stride": (
        lambda: nn.ConvTranspose1d(2, 3, 3, dilation=2, output_padding=1), (2, 5)
    ),
    "batchnorm2d-eval": (lambda: nn.BatchNorm2d(3), (3, 4, 4)),
    "batchnorm1d-tokens-eval": (lambda: nn.BatchNorm1d(3), (3, 5)),
    "layernorm-2d-shape": (lambda: nn.LayerNorm((3, 4)), (2, 3, 4)),
    "layernorm-no-bias": (lambda: nn.LayerNorm(4, bias=False), (3, 4)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), (4, 3, 3)),
    "groupnorm-no-affine": (lambda: nn.GroupNorm(2, 4, affine=False), (4, 3, 3)),
    "layernorm-no-affine": (lambda: nn.LayerNorm(4, elementwise_affine=False), (3, 4)),
    "instancenorm2d": (lambda: nn.InstanceNorm2d(3), (3, 4, 4)),
    "instancenorm2d-affine": (lambda: nn.InstanceNorm2d(3, affine=True), (3, 4, 5)),
    "instancenorm1d-affine": (lambda: nn.InstanceNorm1d(2, affine=True), (2, 6)),
    "instancenorm3d-affine": (lambda: nn.InstanceNorm3d(2, affine=True), (2, 3, 3, 2)),
    # running statistics in eval mode: an affine map per channel, left to the glue
    "instancenorm2d-running-eval": (
        lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), (3, 4, 4)
    ),
    # layers without parameters: only their backpropagation (to the glue in front)
    "relu": (nn.ReLU, (3, 4)),
    "silu": (nn.SiLU, (2, 3, 3)),
    "gelu": (nn.GELU, (5,)),
    "gelu-tanh": (lambda: nn.GELU(approximate="tanh"), (5,)),
    "tanh": (nn.Tanh, (5,)),
    "sigmoid": (nn.Sigmoid, (5,)),
    "hardswish": (nn.Hardswish, (2, 5)),
    "leaky-relu": (lambda: nn.LeakyReLU(0.2), (5,)),
    "elu": (lambda: nn.ELU(alpha=0.7), (5,)),
    "softplus": (lambda: nn.Softplus(beta=2.0, threshold=1.0), (5,)),
    "avgpool2d": (lambda: nn.AvgPool2d(2), (2, 4, 4)),
    "avgpool2d-ceil-no-pad-count": (
        lambda: nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True,
                             count_include_pad=False),
        (2, 5, 5),
    ),
    "avgpool2d-divisor": (lambda: nn.AvgPool2d(2, divisor_override=3), (2, 4, 4)),
    # windows that tile the input, with rows and columns no window reads
    "avgpool2d-tiles-remainder": (lambda: nn.AvgPool2d((3, 2)), (2, 7, 5)),
    "maxpool2d": (lambda: nn.MaxPool2d(2), (2, 4, 4)),
    "maxpool2d-overlap-pad-dilation": (
        lambda: nn.MaxPool2d(3, stride=2, padding=1, dilation=1, ceil_mode=True),
        (2, 5, 5),
    ),
    "maxpool2d-dilated": (lambda: nn.MaxPool2d(2, stride=1, dilation=2), (2, 5, 5)),
    "upsample-nearest": (lambda: nn.Upsample(scale_factor=2), (2, 3, 3)),
    "upsample-nearest-size": (lambda: nn.Upsample(size=(5, 4)), (2, 3, 3)),
    "upsample-bilinear": (lambda: nn.Upsample(scale_factor=1.5, mode="bilinear"),
                          (2, 4, 4)),
    "upsample-bilinear-corners": (
        lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), (2, 3, 3)
    ),
    "upsampling-nearest2d": (lambda: nn.UpsamplingNearest2d(scale_factor=2), (2, 3, 3)),
    "upsample-bicubic-autograd": (lambda: nn.Upsample(scale_factor=2, mode="bicubic"),
                                  (2, 3, 3)),
}  # fmt: skip


class _Front(nn.Module):
    """A layer in front (exercises the rule's backpropagation), the layer, a twin."""

    def __init__(self, layer: nn.Module, shape: tuple[int, ...], shared: bool):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(shape) + 0.5)  # glue parameter in front
        self.layer = layer
        self.twin = None
        if shared:  # same parameters, second call: per-sample products are added
            self.twin = layer

    def forward(self, x):
        y = self.layer(torch.tanh(x * self.scale))
        if self.twin is not None:
            y = y + torch.sin(self.twin(x))
        return y


def _randomize(layer: nn.Module) -> None:
    for buffer_name in ("running_mean", "running_var"):
        buffer = getattr(layer, buffer_name, None)
        if buffer is not None:
            buffer.copy_(
                torch.rand_like(buffer) + (0.5 if buffer_name == "running_var" else 0)
            )
    for param in layer.parameters():
        param.data.normal_()


def rule_problem(name: str, shared: bool) -> tuple[nn.Module, Tensor, Tensor]:
    """The table's layer ``name`` behind :class:`_Front` (float64), its inputs, targets.

    Args:
        name: A key of :data:`LAYERS`.
        shared: Whether the front's parameter is also used by the layer's input path.

    Returns:
        ``(model, x [3, *shape], y)``, built from a fixed seed.
    """
    torch.manual_seed(0)
    build, shape = LAYERS[name]
    layer = build().double().eval()
    with torch.no_grad():
        _randomize(layer)
    model = _Front(layer, shape, shared).double().eval()
    x = torch.randn(3, *shape, dtype=torch.float64)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    return model, x, y


@pytest.mark.parametrize("lean", [False, True], ids=["cached", "lean"])
@pytest.mark.parametrize("shared", [False, True], ids=["single", "shared"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_rule_is_exact(name, shared, lean, monkeypatch):
    if lean:  # a tight budget's passes: no per-forward caches
        from tests.lean import force_lean

        force_lean(monkeypatch)
    model, x, y = rule_problem(name, shared)
    loss_func = nn.MSELoss(reduction="sum")
    expected = reference_diag_ggn(model, loss_func, x, y)
    for kwargs in ({}, {"num_chunks": 3}, {"chunk_size": 1}):
        actual = ggnchunk.diag_ggn(model, loss_func, x, y, **kwargs)
        assert_diag_close(actual, expected, rtol=1e-10, label=f"{name} {kwargs}")


def test_instance_norm_takes_the_group_norm_rule_only_with_input_statistics():
    from ggnchunk._rules import InstanceNormRule, rule_for

    assert isinstance(rule_for(nn.InstanceNorm2d(3, affine=True)), InstanceNormRule)
    tracked = nn.InstanceNorm2d(3, track_running_stats=True)
    assert isinstance(rule_for(tracked), InstanceNormRule)  # training: input statistics
    assert rule_for(tracked.eval()) is None  # running statistics: the glue's


CONVOLUTIONS = [name for name in LAYERS if name.startswith("conv")]


@pytest.mark.parametrize("name", CONVOLUTIONS)
def test_convolution_backprop_by_the_input_gradient_kernel_is_exact(name, monkeypatch):
    # large weights are backpropagated by convolution_backward instead of the transposed
    # convolution: force that path on the small test layers
    monkeypatch.setattr(ggnchunk._rules.conv, "SMALL_WEIGHT", -1)
    test_rule_is_exact(name, False, False, monkeypatch)


SHAPES = [(3, 2, 1, 4, 5, 1), (3, 2, 1, 4, 5, 6), (2, 3, 2, 3, 4, 2), (50, 2, 1, 8, 9, 3),
          (1, 2, 1, 8, 9, 40), (4, 2, 3, 2, 2, 7), (2, 3, 1, 6, 40, 12),
          (5, 3, 1, 2, 3, 30), (1000, 2, 1, 30, 3, 40)]  # fmt: skip


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "dilation", "size"),
    [((3, 3), (1, 1), (36, 36), (36, 36), (4, 4)),  # DeepLab's widest ASPP branch
     ((3, 3), (1, 1), (12, 12), (12, 12), (2, 2)),  # its narrowest on 16x16 images
     ((3, 2), (2, 1), (5, 1), (5, 3), (3, 4)),
     ((1, 3), (1, 3), (0, 4), (1, 4), (5, 2)),
     ((2, 2), (2, 2), (3, 3), (1, 1), (1, 1)),
     ((3, 3), (1, 1), (1, 1), (1, 1), (5, 5))],  # dense: padded first, as before
)  # fmt: skip
def test_convolution_patches_without_a_padded_map_match_torch_unfold(
    kernel, stride, padding, dilation, size
):
    """Where the zero-padded map is larger than the patches, they are gathered tap by tap.

    Against ``F.unfold`` (im2col), for the patches' layout ``[B, C*K, P]``.
    """
    from ggnchunk._rules.geometry import _sparse_taps, unfold

    x = torch.randn(2, 3, *size, dtype=torch.float64)
    got = unfold(x, kernel, stride, padding, dilation)
    expected = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert _sparse_taps(x, kernel, stride, padding, dilation) is (size != (5, 5))


@pytest.mark.parametrize(("v", "n", "g", "o", "k", "p"), SHAPES)
def test_square_sum_forms_agree_with_a_plain_einsum(v, n, g, o, k, p):
    torch.manual_seed(1)
    a = torch.randn(v, n, g, o, p, dtype=torch.float64)
    b = torch.randn(n, g, k, p, dtype=torch.float64)
    expected = torch.einsum("vngop,ngkp->vngok", a, b).square().sum((0, 1))
    torch.testing.assert_close(square_sum(a, b), expected, rtol=1e-12, atol=0)
    cache = Caches()
    torch.testing.assert_close(square_sum(a, b, cache), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(square_sum(a, b, cache), expected, rtol=1e-12, atol=0)


# the Gram form's shapes on few positions (where the blocks of columns are used)
FEW_POSITIONS = [(50, 2, 1, 8, 9, 3), (100, 2, 2, 4, 20, 9), (37, 3, 1, 5, 30, 4),
                 (64, 1, 3, 2, 12, 2)]  # fmt: skip


@pytest.mark.parametrize(("v", "n", "g", "o", "k", "p"), FEW_POSITIONS)
@pytest.mark.parametrize("layout", ["contiguous", "positions-not-last"])
def test_gram_matrices_from_blocks_of_columns_agree_with_a_plain_einsum(
    v, n, g, o, k, p, layout, monkeypatch
):
    """The Gram form's column blocks (uneven last block, any strides) are exact."""
    from ggnchunk._rules import kernels

    monkeypatch.setattr(kernels, "_BLOCKED_GRAM_ELEMENTS", 0)
    monkeypatch.setattr(kernels, "BLOCK", 7 * n * g * o * p)  # 7 columns a block
    blocks = []
    original = kernels._blocked_gram
    monkeypatch.setattr(
        kernels, "_blocked_gram", lambda a: blocks.append(a.shape) or original(a)
    )
    torch.manual_seed(1)
    a = torch.randn(v, n, g, o, p, dtype=torch.float64)
    if layout == "positions-not-last":  # a Linear's columns on a sequence
        a = torch.randn(v, n, g, p, o, dtype=torch.float64).transpose(3, 4)
    b = torch.randn(n, g, k, p, dtype=torch.float64)
    expected = torch.einsum("vngop,ngkp->vngok", a, b).square().sum((0, 1))
    got = square_sum(a, b)
    assert blocks == [(v, n, g, o, p)]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "chunking", [{}, {"num_chunks": 3}, {"chunk_size": 12}, {"max_memory": "64MiB"}]
)
def test_convolutions_with_gram_matrices_from_blocks_of_columns_are_exact(
    chunking, monkeypatch
):
    """Per-pixel cross-entropy on 3x3 maps: the Gram form, from blocks of columns."""
    from ggnchunk._rules import kernels

    monkeypatch.setattr(kernels, "_BLOCKED_GRAM_ELEMENTS", 0)
    monkeypatch.setattr(kernels, "BLOCK", 64)
    blocks = []
    original = kernels._blocked_gram
    monkeypatch.setattr(
        kernels, "_blocked_gram", lambda a: blocks.append(a.shape) or original(a)
    )
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 8, 3, padding=1, groups=2),
        nn.Tanh(), nn.Conv2d(8, 4, 1),
    ).double()  # fmt: skip
    x = torch.randn(2, 3, 3, 3, dtype=torch.float64)
    y = torch.randint(0, 4, (2, 3, 3))
    loss_func = nn.CrossEntropyLoss()
    got = ggnchunk.diag_ggn(model, loss_func, x, y, **chunking)
    assert blocks, "the Gram form from blocks of columns did not run"
    assert_diag_close(got, reference_diag_ggn(model, loss_func, x, y), rtol=1e-9)


def test_both_contraction_forms_are_chosen_somewhere():
    assert use_gram(100, 2, 1, 8, 9, 3) and not use_gram(1, 2, 1, 8, 9, 40)


@pytest.mark.parametrize(
    "name",
    ["avgpool2d", "avgpool2d-ceil-no-pad-count", "upsample-nearest", "upsample-bilinear",
     "maxpool2d", "maxpool2d-overlap-pad-dilation",
     "upsample-nearest-size", "upsampling-nearest2d", "upsample-bicubic-autograd"],
)  # fmt: skip
def test_pooling_and_upsampling_use_their_kernel_or_say_autograd(monkeypatch, name):
    """The folded kernel runs where it exists (no per-column loop); bicubic: autograd."""
    from ggnchunk._rules import FoldedRule

    results, backprop = [], FoldedRule.backprop

    def spy(self, ctx, grads):
        out = backprop(self, ctx, grads)
        results.append(out is not None)
        return out

    monkeypatch.setattr(FoldedRule, "backprop", spy)
    build, shape = LAYERS[name]
    model = _Front(build().double(), shape, shared=False).double()
    x = torch.randn(3, *shape, dtype=torch.float64)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, num_chunks=2)
    assert results and all(results) == ("bicubic" not in name)


def test_square_sum_keeps_no_gram_factor_beyond_the_planned_chunk_size():
    # a bound made for chunks of one column reserves no Gram factor where the direct
    # form wins for one column: a larger chunk must then not build one either
    v, n, g, o, k, p = 50, 2, 1, 8, 9, 3
    assert use_gram(v, n, g, o, k, p) and not use_gram(1, n, g, o, k, p)
    torch.manual_seed(2)
    a = torch.randn(v, n, g, o, p, dtype=torch.float64)
    b = torch.randn(n, g, k, p, dtype=torch.float64)
    expected = torch.einsum("vngop,ngkp->vngok", a, b).square().sum((0, 1))
    for columns, kept in ((1, False), (2, False), (5, True), (v, True), (None, True)):
        cache = Caches()
        torch.testing.assert_close(square_sum(a, b, cache, columns=columns), expected,
                                   rtol=1e-12, atol=0)  # fmt: skip
        assert (cache.gram is not None) is kept, columns


class _OutputSize(nn.Module):
    """A decoder that resolves the stride's ambiguity with ``output_size=`` (U-Nets)."""

    def __init__(self, image: bool):
        super().__init__()
        self.image = image  # image-shaped output: windowed columns
        self.down = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1)
        self.up1d = nn.ConvTranspose1d(2, 2, 2, stride=3)
        self.up1d.requires_grad_(not image)  # unused with image outputs

    def forward(self, x):
        h = self.up(torch.relu(self.down(x)), output_size=x.shape[-2:])  # 8 from 4
        if self.image:
            return h
        flat = self.up1d(h.flatten(2)[..., :5], output_size=[15])  # output_padding 2
        return torch.cat([h.flatten(1), flat.flatten(1)], 1)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"num_chunks": 5}, {"max_memory": "64MiB"}, {"batch_chunk_size": 2},
     {"per_sample": True}],
)  # fmt: skip
@pytest.mark.parametrize("image", [False, True])
def test_transposed_convolutions_called_with_output_size(kwargs, image):
    """``output_size=`` sets an output padding the module's attribute does not hold.

    It raised a raw size error from the weight products of the one-hot columns.
    """
    torch.manual_seed(0)
    model = _OutputSize(image).double()
    x = torch.randn(3, 2, 8, 8, dtype=torch.float64)
    targets = torch.randn_like(model(x))
    actual = ggnchunk.diag_ggn(model, nn.MSELoss(), x, targets, **kwargs)
    if kwargs.get("per_sample"):
        actual = {k: v.sum(0) for k, v in actual.items()}
    expected = reference_diag_ggn(model, nn.MSELoss(), x, targets)
    assert_diag_close(actual, expected, rtol=1e-9)


class _Unpooled(nn.Module):
    """SegNet's decoder: the pooling's indices place the values back (``MaxUnpool2d``)."""

    def __init__(self, functional: bool, conv_after: bool):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.pool, self.unpool = nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)
        self.after = nn.Conv2d(4, 2, 3, padding=1) if conv_after else nn.Identity()
        self.functional = functional

    def forward(self, x):
        h = self.conv(x)
        if self.functional:
            p, idx = F.max_pool2d(h, 2, return_indices=True)
        else:
            p, idx = self.pool(h)
        return self.after(self.unpool(p, idx))


@pytest.mark.parametrize("kwargs", [{}, {"num_chunks": 3}, {"batch_chunk_size": 1}])
@pytest.mark.parametrize("conv_after", [False, True])
@pytest.mark.parametrize("functional", [False, True])
def test_max_pooling_whose_indices_unpool(functional, conv_after, kwargs):
    """Max pooling whose indices feed an unpooling (SegNet) is exact.

    ``nn.MaxPool2d(return_indices=True)`` took the pooling rule, which does not map a
    tuple output: a diagonal of 0 where the brute force gives 0.125 (relative error 1).
    """
    torch.manual_seed(1)
    model = _Unpooled(functional, conv_after).double()
    x = torch.randn(3, 2, 8, 8, dtype=torch.float64)
    targets = torch.randn_like(model(x))
    actual = ggnchunk.diag_ggn(model, nn.MSELoss(), x, targets, **kwargs)
    expected = reference_diag_ggn(model, nn.MSELoss(), x, targets)
    assert_diag_close(actual, expected, rtol=1e-9)


class _DeepStage(nn.Module):
    """A deep, narrow-map stage (ResNet's last): wide convolutions on 1x1 to 4x4 maps."""

    def __init__(self, frozen: bool):
        super().__init__()
        self.stem = nn.Conv2d(2, 16, 3, stride=2, padding=1)  # 8x8 -> 4x4
        self.deep = nn.Sequential(
            nn.Conv2d(16, 32, 3, padding=2, dilation=2), nn.ReLU(),  # 4x4
            nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.Tanh(),  # 2x2
            nn.Conv2d(32, 24, 2, stride=1, padding=0),  # 1x1
        )  # fmt: skip
        self.head = nn.Linear(24, 10)
        if frozen:
            self.deep.requires_grad_(False)

    def forward(self, x):
        return self.head(self.deep(torch.relu(self.stem(x))).flatten(1))


@pytest.mark.parametrize("kwargs", [{}, {"num_chunks": 10}, {"num_chunks": 4},
                                    {"max_memory": "64MiB"}])  # fmt: skip
@pytest.mark.parametrize("frozen", [False, True])
def test_convolutions_backpropagated_as_one_product_on_small_maps(
    frozen, kwargs, monkeypatch
):
    """Few vectors on few positions: a convolution crossed as one product, then folded.

    No weight reorder; stride, padding, dilation, frozen or not, exact; the path is
    taken where the columns' patches are smaller than the weight.
    """
    from ggnchunk._rules import conv

    folds = []
    original = conv.F.fold
    monkeypatch.setattr(
        conv.F, "fold", lambda *a, **k: folds.append(1) or original(*a, **k)
    )
    torch.manual_seed(0)
    model = _DeepStage(frozen).double()
    x = torch.randn(2, 2, 8, 8, dtype=torch.float64)
    targets = torch.randint(0, 10, (2,))
    actual = ggnchunk.diag_ggn(model, nn.CrossEntropyLoss(), x, targets, **kwargs)
    expected = reference_diag_ggn(model, nn.CrossEntropyLoss(), x, targets)
    assert_diag_close(actual, expected, rtol=1e-9)
    if kwargs.get("num_chunks") == 10:  # one column per pass: the deep layers fold
        assert folds


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
@pytest.mark.parametrize("kwargs", [{"num_chunks": 3}, {"max_memory": "64MiB"}])
@pytest.mark.parametrize("padding", [1, "same", (2, 1), "same-dilated", "valid"])
@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular", "zeros"])
def test_convolutions_padded_with_values_cross_all_columns_at_once(mode, padding, kwargs):
    """A layer padded with values or ``"same"``/``"valid"`` backpropagates on all columns.

    Its input gradient was left to autograd, whose convolution and pad backward torch's
    batching ran once per column (a ``SlowBackwardWarning``, about 4x slower). With
    zeros and a kernel of even length, ``"same"`` pads one more on the right.
    """
    import warnings

    torch.manual_seed(0)
    kernel = (3, 2) if str(padding).startswith("same") else 3
    dilation = 2 if padding == "same-dilated" else 1
    padding = "same" if padding == "same-dilated" else padding
    model = nn.Sequential(  # the layer under test between two (its input gradient)
        nn.Conv2d(2, 3, 3, padding=1, padding_mode=mode), nn.Tanh(),
        nn.Conv2d(3, 3, kernel, padding=padding, padding_mode=mode, dilation=dilation),
        nn.Tanh(), nn.Conv2d(3, 2, 3, padding=1, padding_mode=mode, stride=2),
    ).double()  # fmt: skip
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    targets = torch.randn_like(model(x))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = ggnchunk.diag_ggn(model, nn.MSELoss(), x, targets, **kwargs)
    slow = [str(w.message) for w in caught if "SlowBackward" in type(w.message).__name__]
    assert not slow, slow
    expected = reference_diag_ggn(model, nn.MSELoss(), x, targets)
    assert_diag_close(actual, expected, rtol=1e-9)
