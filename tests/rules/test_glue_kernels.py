"""Pads, pooling, flips, rolls and softmax in the glue: all columns at once, exact.

torch's batching has no rule for these calls' backward kernels, so in the glue between
layers they ran once per column (and held every column's result beside the stacked
output). The engine's forward routes them through :mod:`ggnchunk._glue_kernels`.
Checked here: a folded call's output is the user's call's (bit for bit), its batched
backward equals autograd's per-column backward on every mode and option and takes no
per-column loop, one unbatched gradient is right too, calls inside layers with a rule
are not folded, and models written with such glue (also torchvision's and timm-style
code) match the float64 brute force in every chunking mode and with a batch of one.
"""

from __future__ import annotations

import gc
import math
import re
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ggnchunk
from ggnchunk._autograd import batched_grad
from ggnchunk._folding import folded_glue, glue_workspace
from tests.models import ScalarGated
from tests.reference import assert_diag_close, reference_diag_ggn

# name: (input shape, the call)
CALLS = {
    "pad-constant": ((2, 3, 5, 6), lambda x: F.pad(x, [1, 0, 2, 1])),
    "pad-crop": ((2, 3, 5, 6), lambda x: F.pad(x, [-1, 1, 1, -2])),
    "pad-value-channels": ((2, 3, 5, 6), lambda x: F.pad(x, (1, 1, 0, 0, 2, 1), value=0.7)),
    "pad-constant-1d-unbatched": ((3, 7), lambda x: F.pad(x, (2, 3))),
    "pad-reflect-1d": ((2, 3, 7), lambda x: F.pad(x, (2, 3), mode="reflect")),
    "pad-reflect-2d": ((2, 3, 5, 6), lambda x: F.pad(x, (1, 2, 3, 1), mode="reflect")),
    "pad-reflect-2d-unbatched": (
        (3, 5, 6),
        lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"),
    ),
    "pad-reflect-3d": (
        (2, 2, 3, 4, 5),
        lambda x: F.pad(x, (1, 2, 1, 1, 2, 0), mode="reflect"),
    ),
    "pad-replicate-2d": ((2, 3, 5, 6), lambda x: F.pad(x, (2, 0, 1, 3), mode="replicate")),
    "pad-replicate-1d": ((2, 3, 6), lambda x: F.pad(x, (3, 1), mode="replicate")),
    "pad-replicate-3d": (
        (1, 2, 3, 4, 5),
        lambda x: F.pad(x, (1, 1, 2, 0, 1, 2), mode="replicate"),
    ),
    "pad-circular-2d": ((2, 3, 5, 6), lambda x: F.pad(x, (2, 1, 1, 3), mode="circular")),
    "pad-circular-1d": ((2, 3, 6), lambda x: F.pad(x, (3, 2), mode="circular")),
    "zero-pad-module": ((2, 3, 5, 6), nn.ZeroPad2d((1, 2, 0, 1))),
    "reflection-pad-module": ((2, 3, 5, 6), nn.ReflectionPad2d(2)),
    "max-pool-2d-overlap": ((2, 3, 9, 8), lambda x: F.max_pool2d(x, 3, 2, 1)),
    "max-pool-2d-ceil-dilated": (
        (2, 3, 9, 10),
        lambda x: F.max_pool2d(x, (2, 3), (2, 1), (1, 1), dilation=(2, 1), ceil_mode=True),
    ),
    "max-pool-2d-indices": (
        (2, 3, 8, 8),
        lambda x: F.max_pool2d(x, 2, return_indices=True)[0],
    ),
    "max-pool-2d-unbatched": ((3, 8, 6), lambda x: F.max_pool2d(x, 2)),
    "max-pool-1d": ((2, 3, 11), lambda x: F.max_pool1d(x, 3, stride=2, padding=1)),
    "max-pool-3d": ((2, 2, 4, 6, 5), lambda x: F.max_pool3d(x, 2, ceil_mode=True)),
    "max-pool-ties": ((2, 3, 8, 8), lambda x: F.max_pool2d(x, 3, 1)),  # ties in x
    "max-pool-module-3d": ((2, 2, 4, 6, 6), nn.MaxPool3d((2, 3, 3), stride=2, padding=1)),
    "adaptive-max-2d": ((2, 3, 9, 7), lambda x: F.adaptive_max_pool2d(x, (4, 3))),
    "adaptive-max-1d": ((2, 3, 10), lambda x: F.adaptive_max_pool1d(x, 4)),
    "avg-pool-2d-padded": ((2, 3, 9, 8), lambda x: F.avg_pool2d(x, 3, 2, 1)),
    "avg-pool-2d-exclude-ceil": (
        (2, 3, 9, 8),
        lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
    ),
    "avg-pool-2d-divisor": ((2, 3, 8, 8), lambda x: F.avg_pool2d(x, 2, divisor_override=3)),
    "avg-pool-2d-tiles": ((2, 3, 8, 8), lambda x: F.avg_pool2d(x, 2)),
    "avg-pool-1d": ((2, 3, 11), lambda x: F.avg_pool1d(x, 3, 2, 1)),
    "avg-pool-3d": ((2, 2, 4, 6, 5), lambda x: F.avg_pool3d(x, 2, padding=1)),
    "adaptive-avg-2d": ((2, 3, 9, 7), lambda x: F.adaptive_avg_pool2d(x, (4, 3))),
    "adaptive-avg-global": ((2, 3, 9, 7), lambda x: F.adaptive_avg_pool2d(x, 1)),
    "adaptive-avg-1d": ((2, 3, 10), lambda x: F.adaptive_avg_pool1d(x, 3)),
    "adaptive-avg-3d": ((2, 2, 4, 6, 5), lambda x: F.adaptive_avg_pool3d(x, (2, 3, 2))),
    "adaptive-avg-module": ((2, 3, 9, 7), nn.AdaptiveAvgPool2d((3, None))),
    "flip": ((2, 3, 5, 6), lambda x: x.flip(-1)),
    "flip-two": ((2, 3, 5, 6), lambda x: torch.flip(x, [1, 3])),
    "flip-varargs": ((2, 3, 5, 6), lambda x: x.flip(-1, -2)),
    "roll": ((2, 3, 5, 6), lambda x: x.roll(2, -1)),
    "roll-two": ((2, 3, 5, 6), lambda x: torch.roll(x, shifts=(-1, 3), dims=(2, 3))),
    "softmax": ((2, 3, 5, 6), lambda x: F.softmax(x, dim=-1)),
    "softmax-channels": ((2, 3, 5, 6), lambda x: x.softmax(1)),
    # float32 inputs, the softmax taken in float64 (its backward too, then cast)
    "softmax-dtype": ((2, 3, 5), lambda x: torch.softmax(x, 1, dtype=torch.float64)),
    "softmax-module": ((2, 4, 6), nn.Softmax(dim=-2)),
    "log-softmax": ((2, 3, 5, 6), lambda x: F.log_softmax(x, dim=2)),
    "log-softmax-method": ((2, 7), lambda x: x.log_softmax(-1)),
    "pixel-shuffle": ((2, 8, 3, 4), lambda x: F.pixel_shuffle(x, 2)),
    "pixel-unshuffle-module": ((2, 2, 6, 4), nn.PixelUnshuffle(2)),
    "pixel-shuffle-unbatched": ((9, 2, 3), nn.PixelShuffle(3)),
    "rows-of-a-table": ((10, 3), lambda x: x[torch.tensor([[1, 0], [9, -1], [1, 1]])]),
    "rows-int32": ((6, 2, 2), lambda x: x[torch.tensor([5, 0, 5], dtype=torch.int32)]),
    # timm's LeViT and EfficientFormer: a relative-position bias read as biases[:, idxs]
    "rows-of-axis-1": ((3, 7), lambda x: x[:, torch.tensor([[1, 0, 6], [6, -1, 1]])]),
    "rows-of-axis-2": ((2, 3, 5, 2), lambda x: x[:, :, torch.tensor([4, 0, 4, 2])]),
    # Falcon's fused heads: a list index between an ellipsis and a whole slice
    "rows-list-after-ellipsis": ((2, 3, 6, 2), lambda x: x[..., [-2], :]),
    "rows-before-ellipsis": ((2, 5, 3, 2), lambda x: x[:, [4, 1, 1], ...]),
    "rows-0d-index": ((2, 5, 3), lambda x: x[:, torch.tensor(3)]),
    # OpenAI CLIP's end tokens: x[arange(N), text.argmax(-1)]
    "points-end-tokens": ((3, 5, 4), lambda x: x[torch.arange(3), torch.tensor([4, 0, 4])]),
    # broadcast index tensors, a negative one, a repeated point, a trailing ellipsis
    "points-broadcast": (
        (3, 4, 2, 2),
        lambda x: x[torch.tensor([[0], [2]]), torch.tensor([1, -1, 1]), ...],
    ),
    "points-three-axes": (
        (2, 3, 4),
        lambda x: x[torch.tensor([1, 0]), torch.tensor([2, 2]), torch.tensor([3, 0])],
    ),
    # DeBERTa's relative attention: scores gathered along the keys by an expanded index
    "gather-relative-positions": (
        (2, 2, 4, 8),
        lambda x: torch.gather(
            x,
            -1,
            torch.tensor([[3, 4, 5, 7], [2, 3, 4, 5], [0, 2, 3, 4], [0, 0, 2, 3]]).expand(
                2, 2, 4, 4
            ),
        ),
    ),
    "gather-method-smaller-index": (
        (3, 5, 4),
        lambda x: x.gather(1, torch.tensor([[[4, 0], [4, 4]]]).expand(2, 2, 2)),
    ),
    "masked-fill": (
        (2, 3, 4, 4),
        lambda x: x.masked_fill(~torch.ones(4, 4).bool().tril(), -1e4),
    ),
    "masked-fill-tensor-value": (
        (2, 3, 4),
        lambda x: torch.masked_fill(
            x, torch.tensor([True, False, True, False]), torch.tensor(2.0)
        ),
    ),
    "where-input": (
        (2, 3, 4, 4),
        lambda x: torch.where(torch.ones(4, 4).bool().tril(), x, -1e4),
    ),
    "where-other": (
        (2, 3, 4),
        lambda x: torch.where(
            torch.tensor([True, False, True, False]), torch.zeros(4).double(), x
        ),
    ),
    # functional activations: torch's batching loops over the columns for their backward
    "silu": ((2, 3, 4, 4), F.silu),
    "gelu": ((2, 3, 4), F.gelu),
    "gelu-tanh": ((2, 3, 4), lambda x: F.gelu(x, approximate="tanh")),
    "mish": ((2, 3, 4), F.mish),
    "hardswish": ((2, 3, 4), lambda x: F.hardswish(x * 4)),
    "hardsigmoid": ((2, 3, 4), lambda x: F.hardsigmoid(x * 4)),
    "leaky-relu": ((2, 3, 4), lambda x: F.leaky_relu(x, negative_slope=0.2)),
    "elu": ((2, 3, 4), lambda x: F.elu(x, 0.7)),
    "softplus": ((2, 3, 4), lambda x: F.softplus(x, beta=2.0, threshold=1.0)),
    "hardtanh": ((2, 3, 4), lambda x: F.hardtanh(x, -0.5, 0.8)),
    "relu6": ((2, 3, 4), lambda x: F.relu6(x * 5)),
    "tanh": ((2, 3, 4), torch.tanh),
    "tensor-tanh": ((2, 3, 4), lambda x: x.tanh()),
    "functional-tanh": ((2, 3, 4), F.tanh),
}


def _per_column(y, x, grads):
    """Autograd's backward, one column at a time (no batching)."""
    rows = [torch.autograd.grad(y, x, g, retain_graph=True)[0] for g in grads]
    return torch.stack(rows)


@pytest.mark.parametrize("name", CALLS)
def test_folded_glue_call_is_the_users_call_with_the_same_backward(name):
    shape, call = CALLS[name]
    torch.manual_seed(0)
    dtype = torch.float32 if "dtype" in name else torch.float64
    tol = 1e-12 if dtype == torch.float64 else 1e-6  # the input's precision
    x = torch.randn(shape, dtype=dtype)
    if "ties" in name:  # equal values inside windows: the recorded argmax decides
        x = x.mul(2).round().div(2)
    x.requires_grad_(True)
    expected = call(x)
    with folded_glue():
        got = call(x)
    assert type(got.grad_fn).__name__ == "_FoldedGlueBackward", "the call was not folded"
    assert torch.equal(got, expected), "the folded call computed something else"
    assert glue_workspace(got.grad_fn) >= 0
    grads = torch.randn(5, *got.shape, dtype=got.dtype)
    seen: list[str] = []
    (batched,) = batched_grad([got], [x], [grads], note=seen.append)
    assert not seen, f"columns looped over: {seen}"
    reference = _per_column(expected, x, grads)
    torch.testing.assert_close(batched, reference, rtol=tol, atol=tol)
    # one gradient, not batched (the engine's single-column paths)
    (single,) = torch.autograd.grad(got, x, grads[1], retain_graph=True)
    torch.testing.assert_close(single, reference[1], rtol=tol, atol=tol)
    # the same columns through torch's own (unfolded) batched backward
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (unfolded,) = torch.autograd.grad(
            expected, x, grads, retain_graph=True, is_grads_batched=True
        )
    torch.testing.assert_close(batched, unfolded, rtol=tol, atol=tol)


def _affine(*shape):
    return (
        torch.randn(shape, dtype=torch.float64, requires_grad=True),
        torch.randn(shape, dtype=torch.float64, requires_grad=True),
    )


# name: (input shape, weight and bias shape or None, the call on (x, weight, bias)).
# Layer, group and instance norms are left to torch: folded, their backward measured
# 2.5× slower than torch's per-column loop and took 2-3× its memory (benchmarks/results/
# glue-kernels-*), so only batch norm with running statistics (an affine map) is here.
NORMS = {
    "batch-norm-eval": (
        (2, 3, 4, 5),
        (3,),
        lambda x, w, b: F.batch_norm(x, RUNNING[0], RUNNING[1], w, b, training=False),
    ),
    "batch-norm-eval-1d-no-affine": (
        (4, 3),
        None,
        lambda x, w, b: F.batch_norm(x, RUNNING[0], RUNNING[1], eps=1e-3),
    ),
}
RUNNING = (torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.5)


def _assert_folded_like_autograd(got, expected, wanted, columns):
    """A call of several tensors folded, with autograd's output and gradients.

    Its output bit for bit, and its batched backward (no per-column loop) and one
    unbatched gradient equal to autograd's.
    """
    folded = "_FoldedTensorsBackward"
    assert folded in str(got.grad_fn) or folded in str(got.grad_fn.next_functions), (
        "the call was not folded"
    )
    assert torch.equal(got, expected), "the folded call computed something else"
    grads = torch.randn(columns, *got.shape, dtype=got.dtype)
    seen: list[str] = []
    batched = batched_grad([got], wanted, [grads], note=seen.append)
    assert not seen, f"columns looped over: {seen}"
    for value, tensor in zip(batched, wanted, strict=True):
        reference = torch.stack(
            [torch.autograd.grad(expected, tensor, g, retain_graph=True)[0] for g in grads]
        )
        torch.testing.assert_close(value, reference, rtol=1e-11, atol=1e-12)
    singles = torch.autograd.grad(got, wanted, grads[1], retain_graph=True)
    for value, tensor in zip(singles, wanted, strict=True):
        reference = torch.autograd.grad(expected, tensor, grads[1], retain_graph=True)[0]
        torch.testing.assert_close(value, reference, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("name", NORMS)
@pytest.mark.parametrize("frozen_input", [False, True], ids=["input-grad", "frozen-input"])
def test_folded_norms_match_autograd_at_input_weight_and_bias(name, frozen_input):
    shape, affine, call = NORMS[name]
    if frozen_input and affine is None:
        pytest.skip("nothing needs grad")
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=not frozen_input)
    w, b = _affine(*affine) if affine is not None else (None, None)
    if "weight-only" in name:
        b = None
    expected = call(x, w, b)
    with folded_glue():
        got = call(x, w, b)
    wanted = [t for t in (x, w, b) if t is not None and t.requires_grad]
    _assert_folded_like_autograd(got, expected, wanted, columns=4)


@pytest.mark.parametrize(
    "call",
    [
        lambda h: F.pad(h, (1, 1)),
        lambda h: torch.where(torch.ones(4, dtype=torch.bool), h, h.detach() * 3),
        lambda h: F.avg_pool2d(h, 2),
        lambda h: F.batch_norm(h, torch.zeros(3), torch.ones(3), training=False),
    ],
)
def test_a_folded_node_does_not_keep_the_calls_inputs_alive(call):
    """As torch's own nodes: a linear call's input is not saved for its backward."""
    a = torch.randn(2, 3, 4, 4, requires_grad=True)
    with folded_glue():
        h = a * 2
        alive = weakref.ref(h)
        y = call(h)
        del h
    gc.collect()
    assert "Folded" in type(y.grad_fn).__name__
    if type(y.grad_fn.spec).__name__ != "_BatchNormEval":  # it saves its input, as torch's
        assert alive() is None, "the folded node holds its input"


@pytest.mark.parametrize("name", ["max-pool-2d-overlap", "softmax", "log-softmax", "flip"])
def test_torch_func_vmap_over_a_folded_backward(name):
    """Batched by ``torch.func.vmap`` (not the engine's batching): out-of-place forms."""
    shape, call = CALLS[name]
    torch.manual_seed(3)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    expected = call(x)
    with folded_glue():
        got = call(x)
    grads = torch.randn(3, *got.shape, dtype=got.dtype)

    def backward(y):
        return torch.func.vmap(lambda g: torch.autograd.grad(y, x, g, retain_graph=True)[0])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on its own batching
        torch.testing.assert_close(
            backward(got)(grads), backward(expected)(grads), rtol=1e-12, atol=1e-12
        )


def test_indices_asked_for_are_returned_and_not_differentiable():
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    out, idx = F.max_pool2d(x, 2, return_indices=True)
    with folded_glue():
        got, got_idx = F.max_pool2d(x, 2, return_indices=True)
    assert torch.equal(got, out) and torch.equal(got_idx, idx)
    assert not got_idx.requires_grad and got_idx.dtype == torch.int64


@pytest.mark.parametrize(
    "call",
    [
        lambda x: F.pad(x, (1, 1)).detach(),  # no grad: not folded
        lambda x: x.flip(0),  # the samples' axis
        lambda x: x.roll(1),  # the flattened tensor
        lambda x: x.softmax(None) if False else F.softmax(x, dim=None, _stacklevel=3),
    ],
)
def test_calls_that_mix_samples_or_need_no_grad_are_left_to_torch(call):
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # F.softmax's implicit dim
        expected = call(x)
        with folded_glue():
            got = call(x)
    assert got.grad_fn is None or "Folded" not in type(got.grad_fn).__name__
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda x: F.pad(x, (1, 2, 3)), RuntimeError),  # an odd number of pads
        (lambda x: F.pad(x, (1, 1), mode="reflect", value=2.0), (RuntimeError, ValueError)),
        (lambda x: F.max_pool2d(x, 0), RuntimeError),
        (lambda x: x.softmax(7), IndexError),
        (lambda x: x[torch.tensor([9])], IndexError),
        (lambda x: x[torch.tensor([0, 1]), torch.tensor([5, 0])], IndexError),
        (lambda x: x[torch.tensor([0, 1]), torch.tensor([1, 0, 2])], IndexError),
    ],
)
def test_a_call_torch_refuses_raises_torchs_own_error(call, error):
    """Folding never turns the user's bad call into an internal error."""
    x = torch.randn(2, 3, 4, 5, requires_grad=True)
    with pytest.raises(error) as plain:
        call(x)
    with folded_glue(), pytest.raises(error) as folded:
        call(x)
    assert str(folded.value) == str(plain.value)


def test_pooling_layers_with_a_rule_keep_their_own_nodes():
    pool = nn.MaxPool2d(2)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), pool, nn.Flatten(), nn.LazyLinear(2))
    x = torch.randn(2, 2, 8, 8)
    model(x)
    with folded_glue():
        from ggnchunk._folding import layer_entered, layer_left

        layer_entered()  # as the recording's pre-hook does for a layer with a rule
        try:
            out = pool(torch.randn(2, 3, 6, 6, requires_grad=True))
        finally:
            layer_left()
    assert type(out.grad_fn).__name__ == "MaxPool2DWithIndicesBackward0"


class GlueNet(nn.Module):
    """Convolutions and a Linear head, joined by the folded glue calls."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.conv3 = nn.Conv2d(4, 3, 2)
        self.head = nn.Linear(3 * 2 * 2 + 4, 3)

    def forward(self, x):
        h = F.pad(x, (1, 1, 1, 1), mode="circular")
        h = torch.tanh(self.conv1(h))  # 12 -> 12
        h = F.max_pool2d(h, 3, 2, 1)  # 6
        h = F.pad(h, (1, 0, 0, 1), mode="reflect").flip(-1)  # 7
        h = self.conv2(h).roll(1, -2)
        h = F.avg_pool2d(h, 3, 2, 1, count_include_pad=False)  # 4
        h = h * F.softmax(h, dim=1)
        pooled = F.adaptive_avg_pool2d(h, 1).flatten(1)
        h = F.adaptive_max_pool2d(self.conv3(F.pad(h, (0, 1, 1, 0), mode="replicate")), 2)
        return self.head(torch.cat([h.flatten(1), pooled], 1))


class EagerAttention(nn.Module):
    """GPT-2's eager attention written out: softmax of masked scores, then values."""

    def __init__(self, dim=8, heads=2, vocab=11):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)
        self.heads = heads

    def forward(self, tokens):
        h = self.embed(tokens)
        n, t, d = h.shape
        q, k, v = self.qkv(h).split(d, dim=2)
        q, k, v = (z.view(n, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        mixed = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(n, t, d)
        h = h + self.proj(mixed)
        return self.out(h).log_softmax(-1)


class MHAttention(nn.Module):
    """``nn.MultiheadAttention`` with its default ``need_weights=True``, over pixels.

    Eager ``bmm``, softmax, ``bmm`` (its projections are parameters used in the glue),
    then a glue parameter used as ``tokens @ mix``.
    """

    def __init__(self, dim=8, classes=3):
        super().__init__()
        self.stem = nn.Conv2d(2, dim, 3, padding=1)
        self.attn = nn.MultiheadAttention(dim, 2)
        self.mix = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        tokens = self.stem(x).flatten(2).permute(2, 0, 1)  # [L, N, C]
        h, weights = self.attn(tokens, tokens, tokens)
        h = torch.tanh(h @ self.mix) + weights.mean(-1).t()[..., None]
        return self.head(h.mean(0))


class BaddbmmAttention(nn.Module):
    """diffusers' ``Attention.get_attention_scores``, then a pixel-wise output.

    ``baddbmm`` of an empty tensor with ``beta=0`` and ``alpha=scale``, softmax, ``bmm``.
    """

    def __init__(self, dim=6, heads=2):
        super().__init__()
        self.qkv = nn.Conv2d(3, 3 * dim, 1)
        self.out = nn.Conv2d(dim, 3, 3, padding=1)
        self.heads = heads

    def forward(self, x):
        n, _, height, width = x.shape
        q, k, v = self.qkv(x).flatten(2).chunk(3, dim=1)  # [N, C, L]
        q, k, v = (z.reshape(n * self.heads, -1, height * width).mT for z in (q, k, v))
        empty = torch.empty(q.shape[0], q.shape[1], k.shape[1], dtype=q.dtype)
        scale = q.shape[-1] ** -0.5
        scores = torch.baddbmm(empty, q, k.transpose(-1, -2), beta=0, alpha=scale)
        mixed = torch.bmm(scores.softmax(-1), v)  # [N * heads, L, C / heads]
        mixed = mixed.mT.reshape(n, -1, height, width)
        return self.out(torch.relu(mixed))


class LayerNorm2d(nn.LayerNorm):
    """timm's ``LayerNorm2d``: ``nn.LayerNorm`` over channels of ``[N, C, H, W]``."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtStyle(nn.Module):
    """timm's ConvNeXt stem and block as written, and a head.

    ``LayerNorm2d``, depthwise 7×7, channels-last MLP, layer scale (a parameter in the
    glue), residual; the head after global average pooling and a ``LayerNorm2d``.
    """

    def __init__(self, width=8, classes=3):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 2, stride=2)
        self.stem_norm = LayerNorm2d(width)
        self.dw = nn.Conv2d(width, width, 7, padding=3, groups=width)
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.gamma = nn.Parameter(torch.full((width,), 0.5))
        self.head_norm = LayerNorm2d(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.stem_norm(self.stem(x))
        y = self.dw(h).permute(0, 2, 3, 1)
        y = self.fc2(F.gelu(self.fc1(self.norm(y)))) * self.gamma
        h = h + y.permute(0, 3, 1, 2)
        return self.head(F.adaptive_avg_pool2d(self.head_norm(h), 1).flatten(1))


class CycleGANStyle(nn.Module):
    """A CycleGAN ResNet generator in small.

    Reflection pads, instance norms (affine and not), a residual block, a transposed
    convolution up, ``tanh``.
    """

    def __init__(self, width=4):
        super().__init__()
        self.inp = nn.Sequential(
            nn.ReflectionPad2d(2), nn.Conv2d(2, width, 5),
            nn.InstanceNorm2d(width, affine=True), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.InstanceNorm2d(2 * width), nn.ReLU(),
        )  # fmt: skip
        self.block = nn.Sequential(
            nn.ReflectionPad2d(1), nn.Conv2d(2 * width, 2 * width, 3),
            nn.InstanceNorm2d(2 * width, affine=True), nn.ReLU(),
        )  # fmt: skip
        self.out = nn.Sequential(
            nn.ConvTranspose2d(2 * width, width, 3, 2, padding=1, output_padding=1),
            nn.GroupNorm(2, width), nn.ReLU(), nn.ReflectionPad2d(1),
            nn.Conv2d(width, 2, 3), nn.Tanh(),
        )  # fmt: skip

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.block(h))


def _convnext_style():
    x = torch.randn(3, 3, 12, 12, dtype=torch.float64)
    return ConvNeXtStyle().double(), x, nn.CrossEntropyLoss(), torch.tensor([0, 2, 1])


def _cyclegan_style():
    x = torch.randn(2, 2, 10, 10, dtype=torch.float64)
    return CycleGANStyle().double(), x, nn.MSELoss(), torch.randn(2, 2, 10, 10).double()


def _glue_net():
    x = torch.randn(3, 2, 12, 12, dtype=torch.float64)
    return GlueNet().double(), x, nn.CrossEntropyLoss(), torch.tensor([0, 2, 1])


def _eager_attention():
    tokens = torch.randint(0, 11, (2, 5))
    return EagerAttention().double(), tokens, _TokenNLL(), torch.randint(0, 11, (2, 5))


def _scalar_gates():
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64)
    return ScalarGated().double(), x, nn.MSELoss(), torch.randn(2, 3, 6, 5).double()


def _mh_attention():
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    return MHAttention().double(), x, nn.CrossEntropyLoss(), torch.tensor([0, 2, 1])


def _baddbmm_attention():
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    return BaddbmmAttention().double(), x, nn.MSELoss(), torch.randn(2, 3, 5, 4).double()


class VectorHead(nn.Module):
    """Scores as ``h @ v`` with a vector parameter (a value head, an attention pool)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.v = nn.Parameter(torch.randn(6))

    def forward(self, x):  # [N, T, 4] -> [N, T]
        return torch.tanh(self.lin(x)) @ self.v


def _vector_head():
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    return VectorHead().double(), x, nn.MSELoss(), torch.randn(3, 5).double()


class RelativeAttention(nn.Module):
    """DeBERTa's content-to-position scores: ``q @ pos.T`` gathered at each offset."""

    def __init__(self, dim: int = 4, span: int = 3):
        super().__init__()
        self.span = span
        self.q, self.k, self.out = (
            nn.Linear(dim, dim),
            nn.Linear(dim, dim),
            nn.Linear(dim, 3),
        )
        self.pos = nn.Parameter(torch.randn(2 * span, dim))

    def forward(self, x):  # [N, T, D] -> [N, T, 3]
        q, k = self.q(x), self.k(x)
        n, t = x.shape[:2]
        offsets = torch.arange(t)[:, None] - torch.arange(t)[None, :]
        rel = offsets.clamp(-self.span, self.span - 1) + self.span  # [T, T]
        c2p = torch.gather(q @ self.pos.T, -1, rel.expand(n, t, t))
        return self.out((q @ k.transpose(-1, -2) + c2p).softmax(-1) @ k)


def _relative_attention():
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    return RelativeAttention().double(), x, nn.MSELoss(), torch.randn(3, 5, 3).double()


class _TokenNLL(nn.Module):
    """Per-token negative log-likelihood of log-probabilities ``[N, T, V]``."""

    reduction = "mean"

    def forward(self, logp, target):
        return F.nll_loss(logp.flatten(0, 1), target.flatten())


# the norms' backward kernels, which torch's per-column loop runs as fast (see NORMS)
LEFT_TO_TORCH = {"native_layer_norm_backward", "native_batch_norm_backward"}
MODELS = {
    "glue-net": _glue_net,
    "eager-attention": _eager_attention,
    "multihead-attention-weights": _mh_attention,
    "baddbmm-attention": _baddbmm_attention,
    "scalar-gates": _scalar_gates,
    "vector-head": _vector_head,
    "relative-attention": _relative_attention,
    "convnext-style": _convnext_style,
    "cyclegan-style": _cyclegan_style,
}
CHUNKINGS = ({"num_chunks": 1}, {"num_chunks": 4}, {"max_memory": "128MiB"})


@pytest.mark.filterwarnings("ignore::ggnchunk.MemoryBudgetWarning")
@pytest.mark.parametrize("kwargs", CHUNKINGS, ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_models_with_folded_glue_match_the_brute_force(name, kwargs):
    torch.manual_seed(1)
    model, x, loss_func, y = MODELS[name]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ggnchunk.SlowBackwardWarning)
        got = ggnchunk.diag_ggn(model, loss_func, x, y, **kwargs)
    looped = {
        op
        for w in caught
        if issubclass(w.category, ggnchunk.SlowBackwardWarning)
        for op in re.findall(r"aten::(\w+)", str(w.message))
    }
    assert looped <= LEFT_TO_TORCH, f"columns looped over: {looped - LEFT_TO_TORCH}"
    expected = reference_diag_ggn(model, loss_func, x, y)
    assert_diag_close(got, expected, rtol=1e-9, label=f"{name} {kwargs}")


@pytest.mark.parametrize("name", MODELS)
def test_models_with_folded_glue_on_a_batch_of_one(name):
    torch.manual_seed(2)
    model, x, loss_func, y = MODELS[name]()
    x, y = x[:1], y[:1]
    got = ggnchunk.diag_ggn(model, loss_func, x, y, num_chunks=2)
    expected = reference_diag_ggn(model, loss_func, x, y)
    assert_diag_close(got, expected, rtol=1e-9, label=f"{name} batch of one")
    per_sample = ggnchunk.diag_ggn(model, loss_func, x, y, per_sample=True)
    for name_, value in per_sample.items():
        torch.testing.assert_close(value[0], got[name_], rtol=1e-9, atol=1e-12)


# name: (a's shape, b's shape, the call on (a, b)): matrix products in the glue whose
# output (the columns' maps) is the large side, as attention's scores q kᵀ: torch's
# batching copied those maps whole in the backward
FIXED = torch.randn(3, 4, 6, dtype=torch.float64)
PRODUCTS = {
    "bmm": ((3, 4, 2), (3, 2, 6), torch.bmm),
    "bmm-method-wide": ((2, 7, 2), (2, 2, 7), Tensor.bmm),
    "bmm-scores": ((2, 9, 3), (2, 3, 8), torch.bmm),
    "matmul-4d": ((2, 3, 4, 2), (2, 3, 2, 6), lambda a, b: a @ b),
    "matmul-broadcast": ((2, 1, 4, 1), (1, 3, 1, 6), torch.matmul),
    "matmul-matrix-right": ((2, 3, 4, 2), (2, 6), lambda a, b: a @ b),
    "matmul-matrix-left": ((4, 2), (2, 3, 2, 6), Tensor.matmul),
    "matmul-matrices": ((4, 2), (2, 6), lambda a, b: a @ b),
    "matmul-3d-4d": ((3, 8, 2), (2, 3, 2, 9), lambda a, b: a @ b),
    # a vector on the right (torch's batching looped ``ger`` per column)
    "matmul-vector-right": ((2, 3, 4, 5), (5,), lambda a, b: a @ b),
    "matmul-matrix-vector": ((4, 3), (3,), torch.matmul),
    "baddbmm-scaled": ((3, 4, 2), (3, 2, 6),
                       lambda a, b: torch.baddbmm(FIXED, a, b, alpha=0.3, beta=2)),
    "baddbmm-broadcast-input": ((3, 4, 2), (3, 2, 6),
                                lambda a, b: torch.baddbmm(FIXED[0, :1], a, b)),
    "baddbmm-nan-input-beta-0": ((3, 4, 2), (3, 2, 6),
                                 lambda a, b: FIXED.mul(math.nan).baddbmm(a, b, beta=0)),
}  # fmt: skip


@pytest.mark.parametrize("needs", ["both", "a-only", "b-only"])
@pytest.mark.parametrize("name", PRODUCTS)
def test_folded_matrix_products_match_autograd_at_both_operands(name, needs):
    """All columns at once (no loop), equal to autograd's per column, at ``a`` and ``b``."""
    a_shape, b_shape, call = PRODUCTS[name]
    torch.manual_seed(0)
    a = torch.randn(a_shape, dtype=torch.float64, requires_grad=needs != "b-only")
    b = torch.randn(b_shape, dtype=torch.float64, requires_grad=needs != "a-only")
    expected = call(a, b)
    with folded_glue():
        got = call(a, b)
    wanted = [t for t in (a, b) if t.requires_grad]
    _assert_folded_like_autograd(got, expected, wanted, columns=5)


# name: (a's shape, b's shape, the call on (a, b)): a 0-d tensor that needs grad times
# (or dividing) a map; torch's batching ran the full sum to the scalar per column
SCALARS = {
    "map-times-scalar": ((2, 3, 4), (), lambda a, b: a * b),
    "scalar-times-map": ((), (2, 3, 4), lambda a, b: a * b),
    "torch-mul": ((3, 5), (), torch.mul),
    "mul-method": ((), (2, 2, 3, 3), Tensor.mul),
    "map-over-scalar": ((2, 3, 4), (), lambda a, b: a / b),
    "torch-div": ((4, 3), (), torch.div),
}


@pytest.mark.parametrize("needs", ["both", "a-only", "b-only"])
@pytest.mark.parametrize("name", SCALARS)
def test_folded_products_with_a_scalar_match_autograd(name, needs):
    """``a * s`` and ``a / s`` with a 0-d ``s``: batched, equal to autograd per column."""
    a_shape, b_shape, call = SCALARS[name]
    if needs == ("b-only" if a_shape == () else "a-only"):
        pytest.skip("torch's own node where the scalar needs no grad")
    torch.manual_seed(0)
    a = torch.randn(a_shape, dtype=torch.float64, requires_grad=needs != "b-only")
    b = torch.randn(b_shape, dtype=torch.float64, requires_grad=needs != "a-only")
    expected = call(a, b)
    with folded_glue():
        got = call(a, b)
    wanted = [t for t in (a, b) if t.requires_grad]
    _assert_folded_like_autograd(got, expected, wanted, columns=5)
    # read as the torch node it stands for, with the same saved values
    divide = "div" in name or "over" in name
    assert got.grad_fn.stands_for == ("DivBackward0" if divide else "MulBackward0")
    assert got.grad_fn._saved_self is a and got.grad_fn._saved_other is b


@pytest.mark.parametrize(
    "call",
    [
        lambda a, b: b[0, :, 0] @ b[0],  # a vector on the left
        lambda a, b: b[..., :2] @ b[..., :2].mT,  # square: no map beside a thin side
        lambda a, b: torch.baddbmm(a[..., :1], a, b),  # a bias that needs grad
        lambda a, b: torch.matmul(a, b.detach()).detach(),  # nothing needs grad
        lambda a, b: a.sum() / b,  # a scalar divided by a map
        lambda a, b: a * b.detach().sum(),  # a scalar that needs no grad
        lambda a, b: torch.div(a, a.sum(), rounding_mode="floor"),  # rounding
    ],
)
def test_products_torch_keeps(call):
    """A vector on the left, a ``baddbmm`` bias or a divisor map needing grad: torch's."""
    a = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 2, 6, dtype=torch.float64, requires_grad=True)
    with folded_glue():
        got = call(a, b)
    assert "Folded" not in type(got.grad_fn).__name__


# name: (input shape, weight shape, with a bias, the call's options). A convolution in
# the glue: a weight computed in forward (weight standardization, weight or spectral
# norm) or fixed; torch's batching ran its backward once per column.
CONVS = {
    "conv2d": ((2, 3, 6, 5), (4, 3, 3, 3), True, {"padding": 1}),
    "conv2d-stride-dilation": ((2, 3, 9, 8), (4, 3, 3, 2), True,
                               {"stride": (2, 1), "padding": (2, 0), "dilation": 2}),
    "conv2d-groups": ((2, 4, 6, 6), (6, 2, 3, 3), True, {"groups": 2, "padding": 1}),
    "conv2d-depthwise-no-bias": ((2, 4, 5, 5), (4, 1, 3, 3), False, {"groups": 4}),
    "conv1d": ((2, 3, 9), (5, 3, 4), True, {"stride": 2}),
    "conv3d": ((1, 2, 4, 5, 4), (3, 2, 2, 3, 2), True, {"padding": (1, 0, 1)}),
    # transposed (weight [Cin, Cout / G, *K]): HiFi-GAN's weight-normed upsampling
    "conv-transpose1d": ((2, 3, 7), (3, 4, 8), True, {"stride": 4, "padding": 2}),
    "conv-transpose2d-output-padding-groups": ((2, 4, 4, 3), (4, 3, 3, 3), True,
        {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2}),
    "conv-transpose2d-dilation-no-bias": ((2, 3, 5, 4), (3, 2, 3, 2), False,
        {"stride": (1, 2), "padding": (2, 0), "dilation": 2, "output_padding": (0, 1)}),
    "conv-transpose3d": ((1, 2, 3, 4, 3), (2, 3, 2, 3, 2), True,
        {"stride": 2, "padding": (1, 0, 1)}),
}  # fmt: skip
CONV_FUNCTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
TRANSPOSED_FUNCTIONS = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@pytest.mark.parametrize("needs", ["all", "weight-only", "input-only"])
@pytest.mark.parametrize("name", CONVS)
def test_folded_convolutions_match_autograd_at_input_weight_and_bias(name, needs):
    """Batched backward equals autograd's per column at the input, weight and bias."""
    shape, wshape, with_bias, options = CONVS[name]
    transposed = name.startswith("conv-transpose")
    conv = (TRANSPOSED_FUNCTIONS if transposed else CONV_FUNCTIONS)[len(shape) - 2]
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=needs != "weight-only")
    w = torch.randn(wshape, dtype=torch.float64, requires_grad=needs != "input-only")
    b = None
    if with_bias:
        channels = wshape[1] * options.get("groups", 1) if transposed else wshape[0]
        b = torch.randn(channels, dtype=torch.float64, requires_grad=needs != "input-only")
    expected = conv(x, w, b, **options)
    with folded_glue():
        got = conv(x, w, b, **options)
    wanted = [t for t in (x, w, b) if t is not None and t.requires_grad]
    _assert_folded_like_autograd(got, expected, wanted, columns=5)


class _StdConv2d(nn.Conv2d):
    """timm's ``StdConv2d``: the weight standardized per output channel in forward."""

    def forward(self, x):
        w = self.weight
        mean = w.mean((1, 2, 3), keepdim=True)
        var = w.var((1, 2, 3), keepdim=True, unbiased=False)
        w = (w - mean) / torch.sqrt(var + 1e-6)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation,
                        self.groups)  # fmt: skip


class _ComputedWeights(nn.Module):
    """Convolutions without a rule: standardized, weight-normed, spectral, a fixed blur."""

    def __init__(self):
        super().__init__()
        self.std = _StdConv2d(2, 4, 3, padding=1)
        self.norm = nn.utils.parametrizations.weight_norm(
            nn.Conv2d(4, 4, 3, padding=1, groups=2)
        )
        self.spectral = nn.utils.parametrizations.spectral_norm(nn.Conv1d(4, 3, 2))
        blur = torch.tensor([1.0, 2.0, 1.0])
        self.register_buffer(
            "blur", (blur[:, None] * blur[None, :] / 16).expand(4, 1, 3, 3)
        )
        self.head = nn.Linear(3 * 35, 5)

    def forward(self, x):
        h = torch.tanh(self.std(x))
        h = F.conv2d(h, self.blur.to(h.dtype), padding=1, groups=4)  # fixed weight
        h = torch.relu(self.norm(h))
        return self.head(self.spectral(h.flatten(2)).flatten(1))


@pytest.mark.filterwarnings("ignore::ggnchunk.MemoryBudgetWarning")
@pytest.mark.parametrize("kwargs", [*CHUNKINGS, {"batch_chunk_size": 1}], ids=str)
def test_convolutions_with_computed_weights_match_the_brute_force(kwargs):
    torch.manual_seed(0)
    model = _ComputedWeights().double().eval()
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    targets = torch.randint(0, 5, (3,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = ggnchunk.diag_ggn(model, nn.CrossEntropyLoss(), x, targets, **kwargs)
    folded = ("convolution_backward", "_weight_norm_interface_backward")
    loops = [str(w.message) for w in caught if any(f in str(w.message) for f in folded)]
    assert not loops, loops
    expected = reference_diag_ggn(model, nn.CrossEntropyLoss(), x, targets)
    assert_diag_close(actual, expected, rtol=1e-9)


# dim: (direction shape, magnitude shape); -1: one norm over the whole tensor
WEIGHT_NORMS = {0: ((4, 3, 3, 3), (4, 1, 1, 1)), 1: ((5, 6), (1, 6)), -1: ((3, 4), ()),
                2: ((2, 3, 4), (1, 1, 4))}  # fmt: skip


@pytest.mark.parametrize("needs", ["both", "direction", "magnitude"])
@pytest.mark.parametrize("dim", WEIGHT_NORMS)
def test_folded_weight_norm_matches_autograd(dim, needs):
    """``torch._weight_norm`` (weight-normed layers) batched, without a per-column loop."""
    vshape, gshape = WEIGHT_NORMS[dim]
    torch.manual_seed(0)
    v = torch.randn(vshape, dtype=torch.float64, requires_grad=needs != "magnitude")
    g = torch.randn(gshape, dtype=torch.float64, requires_grad=needs != "direction")
    expected = torch._weight_norm(v, g, dim)
    with folded_glue():
        got = torch._weight_norm(v, g, dim)
    wanted = [t for t in (v, g) if t.requires_grad]
    _assert_folded_like_autograd(got, expected, wanted, columns=5)


class _LinearNorm(nn.Module):
    """timm's LeViT ``LinearNorm``: a BatchNorm1d on tokens flattened into the batch."""

    def __init__(self, features_in: int, features_out: int):
        super().__init__()
        self.linear = nn.Linear(features_in, features_out, bias=False)
        self.bn = nn.BatchNorm1d(features_out)

    def forward(self, x):
        x = self.linear(x)
        return self.bn(x.flatten(0, 1)).reshape_as(x)


class _LeViTStyle(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.act, self.b = _LinearNorm(4, 6), nn.Hardswish(), _LinearNorm(6, 3)

    def forward(self, x):
        return self.b(self.act(self.a(x))).mean(1)


@pytest.mark.parametrize("kwargs", CHUNKINGS, ids=str)
def test_a_layer_called_on_more_rows_than_samples_is_glue_with_folded_calls(kwargs):
    """A norm on ``[N * T, C]`` is no per-sample layer: its ``F.batch_norm`` is folded.

    It used to count as inside a layer, so its call stayed torch's and its backward ran
    once per column (``native_batch_norm_backward``).
    """
    torch.manual_seed(0)
    model = _LeViTStyle().double().eval()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm1d):
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
            with torch.no_grad():
                module.weight.normal_()
                module.bias.normal_()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    y = torch.tensor([0, 2, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ggnchunk.SlowBackwardWarning)
        got = ggnchunk.diag_ggn(model, nn.CrossEntropyLoss(), x, y, **kwargs)
    expected = reference_diag_ggn(model, nn.CrossEntropyLoss(), x, y)
    assert_diag_close(got, expected, rtol=1e-10)


class _IndexChangedInPlace(nn.Module):
    """Gathers whose index tensors the forward changes in place after them.

    ``h[:, pos]`` (rows of one axis) and ``h[arange(N), ids]`` (points), then
    ``pos += 1`` and ``ids += 1`` before the next step's gathers: torch's own nodes
    refuse to backpropagate (their saved indices changed); the folded ones keep the
    indices as the calls read them. With ``clone`` the model reads copies instead:
    the same function, for the brute force.
    """

    def __init__(self, clone: bool):
        super().__init__()
        self.clone = clone
        self.lin, self.head = nn.Linear(3, 6), nn.Linear(6, 2)

    def forward(self, x, ids):
        h = torch.tanh(self.lin(x))  # [N, T, 6]
        rows, points = torch.tensor([0, 2, 1]), ids.clone()
        first = h[:, rows.clone() if self.clone else rows].sum(1)
        first = (
            first + h[torch.arange(h.shape[0]), points.clone() if self.clone else points]
        )
        rows += 1
        points += 1
        return self.head(first + h[:, rows].sum(1) + h[torch.arange(h.shape[0]), points])


@pytest.mark.parametrize("kwargs", [{}, {"num_chunks": 2}, {"batch_chunk_size": 2}])
def test_gathers_keep_their_indices_as_the_calls_read_them(kwargs):
    torch.manual_seed(0)
    changed, copied = _IndexChangedInPlace(False).double(), _IndexChangedInPlace(True)
    copied = copied.double()
    copied.load_state_dict(changed.state_dict())
    x, ids = torch.randn(4, 5, 3, dtype=torch.float64), torch.tensor([3, 0, 2, 1])
    y, loss_func = torch.randn(4, 2, dtype=torch.float64), nn.MSELoss()
    got = ggnchunk.diag_ggn(changed, loss_func, (x, ids), y, **kwargs)
    expected = reference_diag_ggn(copied, loss_func, (x, ids), y)
    assert_diag_close(got, expected, rtol=1e-9)
