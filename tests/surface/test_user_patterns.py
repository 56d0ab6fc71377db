"""Models written around their layers: checkpoints, torch.compile, weight norms, no_grad.

Gradient checkpointing, ``torch.compile``, weight and spectral norm, and
``torch.no_grad()`` inside ``forward``, as users' models have them.

Every value is compared with the float64 brute force (of the same function written
plainly where the brute force cannot run the model as it is: ``torch.func`` refuses
saved-tensor hooks and compiled code); every refusal says the fix and comes before any
backward pass.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import checkpoint

import ggnchunk
from ggnchunk._engine import GGNComputation
from tests.reference import assert_diag_close, reference_diag_ggn

CHUNKINGS = {
    "one_pass": {},
    "chunks3": {"num_chunks": 3},
    "budget": {"max_memory": "64MiB"},
    "batch_chunks": {"batch_chunk_size": 1, "num_chunks": 2},
}


def _data():
    torch.manual_seed(1)
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    return x, torch.randn(3, 2, 6, 6, dtype=torch.float64)


class _Checkpointed(nn.Module):
    """A block behind a trainable 1×1 conv (``first=False``) or at the input."""

    def __init__(self, reentrant: bool | None, first: bool = False):
        super().__init__()
        self.pre = nn.Identity() if first else nn.Conv2d(2, 2, 1)
        self.block = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.SiLU(), nn.Conv2d(4, 2, 3, padding=1)
        )
        self.post = nn.Conv2d(2, 2, 1)
        self.reentrant = reentrant  # None: no checkpoint (the brute force's function)

    def forward(self, x):
        h = self.pre(x)
        if self.reentrant is None:
            g = self.block(h)
        else:
            g = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.post(F.silu(g + h))


@pytest.mark.parametrize("first", [False, True], ids=["middle", "at_input"])
@pytest.mark.parametrize("options", CHUNKINGS.values(), ids=CHUNKINGS.keys())
def test_checkpoint_without_reentrance_is_exact(first, options):
    x, y = _data()
    torch.manual_seed(0)
    plain = _Checkpointed(None, first).double().eval()
    model = copy.deepcopy(plain)
    model.reentrant = False
    expected = reference_diag_ggn(plain, nn.MSELoss(), x, y)
    diag = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **options)
    assert_diag_close(diag, expected, 1e-9, "checkpoint(use_reentrant=False)")


class _GlueBlock(nn.Module):
    """Glue the engine folds elsewhere: reflect pad, max pool, attention, resize."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.qkv = nn.Linear(4, 12)
        self.out = nn.Linear(4, 4)

    def forward(self, h):
        h = F.max_pool2d(F.pad(self.conv(h), (1, 1, 1, 1), mode="reflect"), 3, stride=1)
        n, c, height, width = h.shape
        q, k, v = self.qkv(h.flatten(2).transpose(1, 2)).chunk(3, -1)
        a = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
        a = torch.softmax(a, -1) * F.silu(a)
        h = h + self.out(a).transpose(1, 2).reshape(n, c, height, width)
        return F.interpolate(h, scale_factor=2, mode="bilinear")


class _CheckpointedGlue(nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        self.pre, self.block, self.post = (
            nn.Conv2d(2, 4, 1),
            _GlueBlock(),
            nn.Conv2d(4, 2, 1),
        )
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.pre(x)
        if self.checkpointed:
            h = checkpoint(self.block, h, use_reentrant=False)
        else:
            h = self.block(h)
        return self.post(h)


@pytest.mark.filterwarnings("ignore::ggnchunk.SlowBackwardWarning")
def test_checkpoint_around_glue_the_engine_would_fold_is_exact():
    """The calls inside a checkpoint run as written, not folded.

    The backward runs them again and matches what they saved (folded forms there saved
    other tensors: a raw CheckpointError).
    """
    torch.manual_seed(1)
    x, y = torch.randn(3, 2, 4, 4).double(), torch.randn(3, 2, 8, 8).double()
    torch.manual_seed(0)
    plain = _CheckpointedGlue(False).double().eval()
    model = copy.deepcopy(plain)
    model.checkpointed = True
    expected = reference_diag_ggn(plain, nn.MSELoss(), x, y)
    for name, options in CHUNKINGS.items():
        diag = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **options)
        assert_diag_close(diag, expected, 1e-9, name)


@pytest.mark.parametrize("first", [False, True], ids=["middle", "at_input"])
def test_reentrant_checkpoint_is_refused_before_any_backward(first, monkeypatch):
    """At the input torch itself only warns and gave these layers a zero diagonal."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a backward pass ran before the error")

    monkeypatch.setattr(GGNComputation, "backward", forbidden)
    x, y = _data()
    model = _Checkpointed(True, first).double().eval()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "None of the inputs have requires_grad")
        with pytest.raises(ValueError, match=r"use_reentrant=True \(around model\.block"):
            ggnchunk.diag_ggn(model, nn.MSELoss(), x, y)
    assert all(
        not m._forward_hooks and not m._forward_pre_hooks for m in model.modules()
    )  # fmt: skip


class _NoGradInside(nn.Module):
    def __init__(self, context):
        super().__init__()
        self.a = nn.Conv2d(2, 2, 3, padding=1)
        self.b = nn.Conv2d(2, 2, 3, padding=1)
        self.context = context

    def forward(self, x):
        with self.context():
            h = self.a(x)
        return self.b(torch.tanh(h) + x)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_a_trainable_layer_run_without_gradients_is_named(context):
    """Its diagonal is zero, as its gradient is: exact, and said once."""
    x, y = _data()
    torch.manual_seed(0)
    model = _NoGradInside(context).double()
    with pytest.warns(ggnchunk.GradientDisabledWarning, match=r"model\.a \(Conv2d\)"):
        diag = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, num_chunks=2)
    assert_diag_close(diag, reference_diag_ggn(model, nn.MSELoss(), x, y), 1e-9)
    assert not diag["a.weight"].any() and diag["b.weight"].any()
    model.a.requires_grad_(False)  # frozen on purpose: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error", ggnchunk.GradientDisabledWarning)
        ggnchunk.diag_ggn(model, nn.MSELoss(), x, y)


class _Cached(nn.Module):
    """A table used through a cache, as timm's LeViT keeps its attention biases in eval."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 2, 3, padding=1)
        self.table = nn.Parameter(torch.randn(2, 1, 1))
        self.unused = nn.Linear(2, 2)  # an auxiliary head skipped in eval mode
        self.cache = None

    def forward(self, x):
        if self.training or self.cache is None:
            self.cache = self.table * 2.0  # filled under no_grad: no graph to the table
        return self.a(x) + self.cache


def test_parameters_no_gradient_reaches_are_named():
    """A helper's hunt: LeViT's cached biases got an all-zero diagonal without a word.

    Exact (zero, as their gradients are), and said once, naming them; parameters set
    not to train are not named.
    """
    x, y = _data()
    torch.manual_seed(0)
    model = _Cached().double().eval()
    with torch.no_grad():
        model(x)  # an evaluation pass fills the cache without a graph
    with pytest.warns(ggnchunk.UnusedParameterWarning, match=r"table, unused\.weight"):
        diag = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, num_chunks=2)
    assert_diag_close(diag, reference_diag_ggn(model, nn.MSELoss(), x, y), 1e-9)
    assert not diag["table"].any() and not diag["unused.weight"].any()
    assert diag["a.weight"].any()
    model.table.requires_grad_(False)
    model.unused.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ggnchunk.UnusedParameterWarning)
        ggnchunk.diag_ggn(model, nn.MSELoss(), x, y)


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 2, 3, padding=1)
    ).double()


@pytest.mark.parametrize("what", ["model", "submodule"])
def test_a_compiled_model_runs_eagerly_and_is_exact(what):
    """Dynamo traced through the recording's hooks (a raw AttributeError)."""
    from torch._dynamo import eval_frame

    x, y = _data()
    plain = _conv_net()
    expected = reference_diag_ggn(plain, nn.MSELoss(), x, y)
    model = copy.deepcopy(plain)
    if what == "model":
        model = torch.compile(model, backend="eager")
        prefix = "_orig_mod."
    else:
        model[2] = torch.compile(model[2], backend="eager")
        prefix = ""
    for options in CHUNKINGS.values():
        diag = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **options)
        assert list(diag) == [name for name, _ in model.named_parameters()]
        plain_names = {
            n: n[len(prefix) :].replace("2._orig_mod.", "2.") for n in diag
        }  # fmt: skip
        assert_diag_close(
            {plain_names[n]: v for n, v in diag.items()}, expected, 1e-9, str(options)
        )
    assert eval_frame._stance.stance == "default"  # the process's setting restored


def test_concurrent_calls_restore_the_compiler_stance():
    """Calls in two threads overlap; the one that started first leaves first.

    The other call is still inside its forward then: it still runs eagerly, and the
    setting is restored once both left (each call setting and restoring the stance on
    its own left the second call's compiled code to dynamo, and the stance forced on).
    """
    import threading

    from torch._dynamo import eval_frame

    x, y = _data()
    first_in, second_in, first_done = (threading.Event() for _ in range(3))
    seen = []

    class Held(nn.Module):
        def __init__(self, signal, wait):
            super().__init__()
            self.net = torch.compile(_conv_net(), backend="eager")
            self.signal, self.wait = signal, wait

        def forward(self, x):
            self.signal.set()
            self.wait.wait(30)
            seen.append(eval_frame._stance.stance)
            return self.net(x)

    errors = []
    # every model built before the thread starts: _conv_net seeds torch's global RNG,
    # and two threads drawing from it at once get each other's numbers
    expected = reference_diag_ggn(_conv_net(), nn.MSELoss(), x, y)
    models = Held(first_in, second_in), Held(second_in, first_done)

    def first():  # enters first, leaves once the second call is inside its forward
        try:
            ggnchunk.diag_ggn(models[0], nn.MSELoss(), x, y)
        except Exception as error:  # reported below
            errors.append(error)
        finally:
            first_done.set()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert first_in.wait(30)
        diag = ggnchunk.diag_ggn(models[1], nn.MSELoss(), x, y)
    finally:
        second_in.set()
        first_done.set()
        thread.join(30)
    assert not errors
    assert seen == ["force_eager", "force_eager"]
    names = {n: n.replace("net._orig_mod.", "") for n in diag}
    assert_diag_close({names[n]: v for n, v in diag.items()}, expected, 1e-9)
    assert eval_frame._stance.stance == "default"


def _weight_normed(kind: str) -> nn.Module:
    model = _conv_net()
    if kind == "weight_norm":
        model[0] = parametrizations.weight_norm(model[0])
        model[2] = parametrizations.weight_norm(model[2], dim=None)
    elif kind == "spectral_norm":
        model[0] = parametrizations.spectral_norm(model[0])
    return model.eval()  # spectral norm's power iteration runs in training mode only


@pytest.mark.filterwarnings("ignore::ggnchunk.SlowBackwardWarning")
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
def test_parametrized_weights_are_exact(kind):
    x, y = _data()
    model = _weight_normed(kind)
    expected = reference_diag_ggn(model, nn.MSELoss(), x, y)
    for name, options in CHUNKINGS.items():
        diag = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **options)
        assert_diag_close(diag, expected, 1e-9, f"{kind} {name}")


def test_hook_style_weight_norm_matches_the_parametrization():
    """``torch.nn.utils.weight_norm`` (a pre-hook; the brute force cannot copy it)."""
    x, y = _data()
    model = _conv_net()
    reference = copy.deepcopy(model)
    reference[0] = parametrizations.weight_norm(reference[0])
    expected = reference_diag_ggn(reference.eval(), nn.MSELoss(), x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still used
        model[0] = torch.nn.utils.weight_norm(model[0])
    names = {
        "0.weight_g": "0.parametrizations.weight.original0",
        "0.weight_v": "0.parametrizations.weight.original1",
    }
    for options in CHUNKINGS.values():
        diag = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **options)
        renamed = {names.get(n, n): v for n, v in diag.items()}
        assert_diag_close({n: renamed[n] for n in expected}, expected, 1e-9, str(options))


class _PackedLSTM(nn.Module):
    """Variable-length sequences: ``pack_padded_sequence`` into an LSTM, its last state."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(
            x, lengths, batch_first=True, enforce_sorted=False
        )
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1])


@pytest.mark.filterwarnings("ignore::ggnchunk.SlowBackwardWarning")
def test_packed_sequences_are_exact():
    """Samples interleaved in the packed data; the brute force runs each one unpadded.

    (``torch.func`` cannot run ``pack_padded_sequence``: each sample's Jacobian is that
    of the LSTM on its own first ``length`` steps, which is what packing computes.)
    """
    torch.manual_seed(0)
    model = _PackedLSTM().double().eval()
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    lengths = torch.tensor([5, 3, 4, 2])
    y = torch.randn(4, 2, dtype=torch.float64)
    params = {n: p.detach() for n, p in model.named_parameters()}
    expected = {n: torch.zeros_like(p) for n, p in params.items()}
    for n in range(4):

        def one(p, n=n):
            steps = x[n : n + 1, : int(lengths[n])]
            lstm = {k[5:]: v for k, v in p.items() if k.startswith("lstm.")}
            head = {k[5:]: v for k, v in p.items() if k.startswith("head.")}
            _, (h, _) = torch.func.functional_call(model.lstm, lstm, (steps,))
            return torch.func.functional_call(model.head, head, (h[-1],))[0]

        jac = torch.func.jacrev(one)(params)
        for name in expected:  # MSE's mean over 4 x 2 outputs: Hessian 2/8 I
            expected[name] += 0.25 * (jac[name] ** 2).sum(0)
    for options in CHUNKINGS.values():
        diag = ggnchunk.diag_ggn(model, nn.MSELoss(), (x, lengths), y, **options)
        assert_diag_close(diag, expected, 1e-9, f"packed {options}")


def test_inputs_and_targets_made_in_inference_mode():
    """Tensors made in ``torch.inference_mode()`` (a frozen extractor's features).

    Torch refused to save them for backward (a raw RuntimeError); a copy is used.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    with torch.inference_mode():
        x_inf, y_inf = x.clone(), y.clone()
    expected = reference_diag_ggn(model, nn.MSELoss(), x, y)
    for options in CHUNKINGS.values():
        diag = ggnchunk.diag_ggn(model, nn.MSELoss(), x_inf, y_inf, **options)
        assert_diag_close(diag, expected, 1e-9, str(options))
    for inputs in ((x_inf,), {"input": x_inf}):
        diag = ggnchunk.diag_ggn(model, nn.MSELoss(), inputs, y_inf)
        assert_diag_close(diag, expected, 1e-9, type(inputs).__name__)
    labels = torch.tensor([0, 3, 1, 2])
    with torch.inference_mode():
        labels_inf = labels.clone()
    diag = ggnchunk.diag_ggn(model, nn.CrossEntropyLoss(), x_inf, labels_inf)
    assert_diag_close(
        diag, reference_diag_ggn(model, nn.CrossEntropyLoss(), x, labels), 1e-9, "ce"
    )
    assert x_inf.is_inference() and y_inf.is_inference()  # the caller's stay as they are


class _Squeezed(nn.Module):
    """A regression head written ``.squeeze()``: ``[N]``, but ``[]`` for one sample."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        return self.head(x).squeeze()


@pytest.mark.parametrize("options", [{}, {"batch_chunk_size": 2}])
def test_squeeze_dropping_the_batch_axis_of_one_sample_is_explained(options):
    x, y = torch.randn(5, 3), torch.randn(5)
    count = 1 if not options else 5  # a batch of one, or a last sub-batch of one
    with pytest.raises(
        ValueError, match=r"\.squeeze\(\) drops the batch axis.*squeeze\(-1\)"
    ):
        ggnchunk.diag_ggn(_Squeezed(), nn.MSELoss(), x[:count], y[:count], **options)


class _InnerAutocast(nn.Module):
    """Part of ``forward`` in bfloat16 under the model's own ``torch.autocast``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.tanh(self.a(x))
        return self.b(h.float())


def test_autocast_inside_forward_is_refused_before_any_backward(monkeypatch):
    """Its layer computed in bfloat16 and the rule failed on the dtypes (raw error)."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a backward pass ran before the error")

    monkeypatch.setattr(GGNComputation, "backward", forbidden)
    model, x = _InnerAutocast(), torch.randn(3, 2, 6, 6)
    with pytest.raises(ValueError, match=r"model\.a ran inside torch\.autocast.*bfloat16"):
        ggnchunk.diag_ggn(model, nn.MSELoss(), x, x)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not torch.is_autocast_enabled("cpu")


class _LongitudeConv2d(nn.Conv2d):
    """Circular padding along the width only, zeros along the height (climate models)."""

    def _conv_forward(self, x, weight, bias):
        rows, cols = self.padding
        x = F.pad(x, (cols, cols, 0, 0), mode="circular")
        return F.conv2d(x, weight, bias, self.stride, (rows, 0), self.dilation, self.groups)


class _ShiftedOutputPadding(nn.ConvTranspose2d):
    def _output_padding(self, *args, **kwargs):
        return [1, 0]


def _patched_instance() -> nn.Module:
    conv = nn.Conv2d(2, 3, 3, padding=1)

    def flipped(self, x, weight, bias):  # a replaced helper on one instance
        return F.conv2d(x, weight.flip(-1), bias, self.stride, self.padding)

    conv._conv_forward = flipped.__get__(conv)
    return conv


def _padding_changed_after_init() -> nn.Module:
    conv = nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect")
    conv.padding = (2, 2)  # forward still reflects by the 1 it was built with
    return conv


HELPERS = {
    "padding_changed_after_init": _padding_changed_after_init,
    "subclass_conv_forward": lambda: _LongitudeConv2d(2, 3, 3, padding=1),
    "instance_conv_forward": _patched_instance,
    "subclass_output_padding": lambda: _ShiftedOutputPadding(2, 3, 3, stride=2),
}


@pytest.mark.parametrize("make", HELPERS.values(), ids=HELPERS.keys())
def test_a_layer_computing_other_than_its_rule_knows_is_exact(make):
    """A replaced helper or a stale pad: ``forward`` is the layer's own, not what it does.

    The rule for the plain layer gave a diagonal 50% off without a word.
    """
    from ggnchunk._rules import rule_for

    torch.manual_seed(0)
    layer = make()
    assert rule_for(layer) is None  # left to the recorded graph
    model = nn.Sequential(layer, nn.Tanh(), nn.Conv2d(3, 2, 1)).double()
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    expected = reference_diag_ggn(model, nn.MSELoss(), x, y)
    for name, options in CHUNKINGS.items():
        diag = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **options)
        assert_diag_close(diag, expected, 1e-9, name)


def test_a_subclass_that_only_configures_the_layer_keeps_its_rule():
    from ggnchunk._rules import rule_for

    class Configured(nn.Conv2d):  # __init__ and extra_repr only
        def __init__(self):
            super().__init__(2, 3, 3, padding=1, bias=False)

        def extra_repr(self):
            return "configured"

    assert rule_for(Configured()) is not None
    assert rule_for(nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect")) is not None
    assert rule_for(nn.Conv1d(2, 3, 4, padding="same", padding_mode="circular")) is not None
    assert rule_for(nn.MultiheadAttention(4, 2).out_proj) is not None


class _Hypernetwork(nn.Module):
    """A layer's weight computed in ``forward`` from parameters and set on the layer."""

    def __init__(self):
        super().__init__()
        self.base = nn.Parameter(torch.randn(4, 3))
        self.scale = nn.Parameter(torch.randn(4, 1))
        self.lin = nn.Linear(3, 4)
        del self.lin.weight  # set in every forward
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        self.lin.weight = self.base * self.scale
        return self.out(torch.tanh(self.lin(x)))


class _FastWeights(nn.Module):
    """Meta-learning's inner step: ``functional_call`` with weights made from parameters."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(48, 2)
        )
        self.delta = nn.Parameter(0.1 * torch.randn(3, 2, 3, 3))

    def forward(self, x):
        weights = {"0.weight": self.net[0].weight - 0.5 * self.delta}
        return torch.func.functional_call(self.net, weights, (x,))


class _DetachedFastWeights(_FastWeights):
    """The swapped-in weight needs no grad: the rule would read the parameter back."""

    def forward(self, x):
        weights = {"0.weight": (self.net[0].weight - 0.5 * self.delta).detach()}
        return torch.func.functional_call(self.net, weights, (x,))


SWAPPED = {"hypernetwork": _Hypernetwork, "fast_weights": _FastWeights,
           "detached_fast_weights": _DetachedFastWeights}  # fmt: skip


@pytest.mark.parametrize("make", SWAPPED.values(), ids=SWAPPED.keys())
def test_a_layer_run_on_other_weights_than_its_parameters_is_exact(make):
    """The layer's weight is not its parameter during the call.

    The rule read the parameter: weights made from other parameters got a zero
    diagonal (relative error 1.0), without a word.
    """
    torch.manual_seed(0)
    model = make().double()
    shape = (5, 3) if make is _Hypernetwork else (5, 2, 4, 4)
    x, y = torch.randn(*shape).double(), torch.randn(5, 2).double()
    expected = reference_diag_ggn(model, nn.MSELoss(), x, y)
    for name, options in CHUNKINGS.items():
        if make is _DetachedFastWeights:  # no gradient reaches the weights it detached
            with pytest.warns(ggnchunk.UnusedParameterWarning, match=r"net\.0\.weight"):
                diag = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **options)
        else:
            diag = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **options)
        assert_diag_close(diag, expected, 1e-9, name)


class _ReconfiguredBetweenCalls(nn.Module):
    """One layer called twice, its settings changed in between (shared weights)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.act = nn.LeakyReLU(0.1)
        self.out = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        self.conv.dilation, self.conv.padding, self.act.negative_slope = (1, 1), (1, 1), 0.1
        a = self.act(self.conv(x))
        self.conv.dilation, self.conv.padding, self.act.negative_slope = (2, 2), (2, 2), 0.3
        b = self.act(self.conv(x))
        return self.out(torch.cat([a, b], 1))


def test_a_layer_reconfigured_between_its_calls_is_exact():
    """The rule read the settings after the forward (the last call's) for every call."""
    torch.manual_seed(0)
    model = _ReconfiguredBetweenCalls().double()
    x, y = torch.randn(3, 2, 6, 6).double(), torch.randn(3, 2, 6, 6).double()
    expected = reference_diag_ggn(model, nn.MSELoss(), x, y)
    for name, options in CHUNKINGS.items():
        diag = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **options)
        assert_diag_close(diag, expected, 1e-9, name)
    assert model.conv.dilation == (2, 2) and model.act.negative_slope == 0.3


class _SequenceFirst(nn.Module):
    """Layers applied to ``[T, N, D]`` (``batch_first=False``), output ``[N, ...]``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x.transpose(0, 1)))
        return self.b(h).transpose(0, 1).flatten(1)


@pytest.mark.parametrize("steps", [3, 4])
def test_layers_on_a_sequence_first_axis(steps):
    """Exact where axis 0 is not the batch size; refused where it is by coincidence.

    With T == N the layers would take time steps for samples: refused with the reason,
    never answered.
    """
    torch.manual_seed(0)
    model = _SequenceFirst().double()
    x, y = torch.randn(4, steps, 5).double(), torch.randn(4, 2 * steps).double()
    if steps == 4:
        with pytest.raises(ggnchunk.SampleCouplingError, match=r"T == N\).*batch_first"):
            ggnchunk.diag_ggn(model, nn.MSELoss(), x, y)
        return
    expected = reference_diag_ggn(model, nn.MSELoss(), x, y)
    for name, options in CHUNKINGS.items():
        diag = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **options)
        assert_diag_close(diag, expected, 1e-9, name)


class _SpectralConv(nn.Module):
    """A Fourier neural operator's layer: a product of the lowest modes (neuraloperator).

    Its complex weights stored as real pairs (``torch.view_as_real``); ``complex_=True``
    keeps them complex, which is refused.
    """

    def __init__(self, channels: int = 3, modes: int = 3, complex_: bool = False):
        super().__init__()
        torch.manual_seed(4)
        w = torch.randn(channels, channels, modes, modes, dtype=torch.complex128) * 0.3
        self.w = nn.Parameter(w if complex_ else torch.view_as_real(w))
        self.modes, self.lift, self.mix = (
            modes,
            nn.Conv2d(2, channels, 1),
            nn.Conv2d(3, 3, 1),
        )
        self.proj = nn.Conv2d(channels, 2, 1)

    def forward(self, x):
        h = self.lift(x)
        spectrum, m = torch.fft.rfft2(h), self.modes
        w = self.w if self.w.is_complex() else torch.view_as_complex(self.w)
        low = torch.einsum("bixy,ioxy->boxy", spectrum[:, :, :m, :m], w)
        mixed = torch.zeros_like(spectrum)
        mixed[:, :, :m, :m] = low
        return self.proj(F.gelu(torch.fft.irfft2(mixed, s=h.shape[-2:]) + self.mix(h)))


@pytest.mark.parametrize("options", list(CHUNKINGS.values()), ids=list(CHUNKINGS))
def test_a_fourier_layer_with_real_stored_complex_weights_is_exact(options):
    model = _SpectralConv().double()
    x, y = _data()
    expected = reference_diag_ggn(model, nn.MSELoss(), x, y)
    actual = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **options)
    assert actual["w"].shape == model.w.shape  # one entry per real and imaginary part
    assert_diag_close(actual, expected, rtol=1e-9, label=str(options))


def test_complex_parameters_are_refused_with_the_real_storage_fix():
    """Before: "several dtypes … convert with model.double()", which leaves them complex."""
    model = _SpectralConv(complex_=True).double()
    x, y = _data()
    with pytest.raises(ValueError, match=r"'w' is complex .*view_as_real"):
        ggnchunk.diag_ggn(model, nn.MSELoss(), x, y)


class _HookedNet(nn.Module):
    """Parameters behind layers with rules and in the glue (an LSTM, a position vector)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True)
        self.pos = nn.Parameter(0.3 * torch.randn(4))
        self.mid = nn.Linear(4, 4)
        self.act = nn.Tanh()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.act(self.mid(self.rnn(x)[0][:, -1] + self.pos)))


@pytest.mark.parametrize("options", list(CHUNKINGS.values()), ids=list(CHUNKINGS))
@pytest.mark.parametrize("kind", ["parameter", "module", "global"])
def test_users_backward_hooks_neither_run_nor_change_the_result(kind, options):
    """Gradient hooks are the training loop's business, not the model function's.

    A parameter's clipping hook ran wherever the glue's backward reached the parameter
    (100x on the LSTM's weights for a x10 hook, none on the Linear layers'); a module's
    full backward hook ran in every sweep with batched columns (and raised where it read
    a gradient the sweep did not compute). After the call, the hooks are all there and run
    in the user's own backward.
    """
    torch.manual_seed(0)
    net = _HookedNet().double()
    x = torch.randn(3, 5, 3, dtype=torch.float64)
    y = torch.tensor([0, 2, 1])
    loss_func = nn.CrossEntropyLoss()
    expected = reference_diag_ggn(net, loss_func, x, y)
    ran = []

    def tensor_hook(grad):
        ran.append("tensor")
        return grad * 10

    def module_hook(module, grad_input, grad_output):
        ran.append("module")
        # (grad_input[0] * 10 raised a TypeError in the sweeps: no input gradient there)
        return tuple(None if g is None else g * 10 for g in grad_input)

    def pre_hook(module, grad_output):
        ran.append("pre")
        return tuple(None if g is None else g * 10 for g in grad_output)

    handles = []
    if kind == "parameter":
        handles = [p.register_hook(tensor_hook) for p in net.parameters()]
    elif kind == "module":
        handles = [
            net.mid.register_full_backward_hook(module_hook),
            net.head.register_full_backward_pre_hook(pre_hook),
        ]
        with warnings.catch_warnings():  # torch's own deprecation of the old style
            warnings.simplefilter("ignore")
            handles.append(
                net.act.register_backward_hook(lambda m, gi, go: ran.append("old"))
            )
    else:
        handles = [
            nn.modules.module.register_module_full_backward_hook(module_hook),
            nn.modules.module.register_module_full_backward_pre_hook(pre_hook),
        ]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ggnchunk.SlowBackwardWarning)
            diag = ggnchunk.diag_ggn(net, loss_func, x, y, **options)
        assert ran == []
        assert_diag_close(diag, expected, 1e-9, kind)
        # still registered, in their order, and they run in the user's own backward
        with warnings.catch_warnings():  # torch's own, for modules returning tuples
            warnings.simplefilter("ignore")
            loss_func(net(x), y).backward()
        assert ran
    finally:
        for handle in handles:
            handle.remove()


class _HooksInForward(nn.Module):
    """A forward that hooks tensors: a layer's output, the glue, the input, a parameter.

    The layer's output feeds the glue (``tanh(h) * 1.5 + sin(h)``), which the columns
    cross with autograd; a conv then takes them with its rule. A forward that
    differentiates inside itself (``inner``) needs its hooks there.
    """

    def __init__(self, where: str):
        super().__init__()
        self.where, self.ran = where, []
        self.a = nn.Conv2d(2, 3, 3, padding=1)
        self.b = nn.Conv2d(3, 3, 1)
        self.c = nn.Conv2d(3, 2, 3, padding=1)

    def _hook(self, grad):
        self.ran.append(self.where)
        return grad * 3

    def forward(self, x):
        if self.where == "input":
            x = x.clone().requires_grad_(True) if not x.requires_grad else x
            x.register_hook(self._hook)
        h = self.a(x)
        if self.where == "layer_output":
            h.register_hook(self._hook)
        g = torch.tanh(h) * 1.5 + h.sin()
        if self.where == "glue":
            g.register_hook(self._hook)
        if self.where == "parameter":
            self.c.weight.register_hook(self._hook)
        if self.where == "inner":  # a derivative inside the forward, through a hook
            probe = h.detach().requires_grad_(True)
            probe.register_hook(self._hook)
            (inner,) = torch.autograd.grad(probe.pow(2).sum(), probe, create_graph=False)
            g = g + 0.0 * inner  # 3 * 2 * probe: the hook ran in the forward
            self.inner = inner
        return self.c(torch.relu(self.b(g)))


@pytest.mark.parametrize("options", list(CHUNKINGS.values()), ids=list(CHUNKINGS))
@pytest.mark.parametrize("where", ["layer_output", "glue", "input", "parameter", "inner"])
def test_hooks_the_forward_puts_on_tensors_do_not_change_the_result(where, options):
    """``h.register_hook(...)`` inside ``forward``: the GGN is the model function's.

    Autograd ran such a hook wherever the columns crossed the tensor through autograd
    (the glue after a layer's output), on batched columns: a ``x3`` hook made the
    diagonal 9x off, silently. The forward's own differentiation still runs them.
    """
    torch.manual_seed(0)
    model = _HooksInForward(where).double()
    x, y = _data()
    plain = _HooksInForward("none").double()
    plain.load_state_dict(model.state_dict())
    expected = reference_diag_ggn(plain, nn.MSELoss(), x, y)
    hooks_before = dict(model.c.weight._backward_hooks or {})
    diag = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, **options)
    assert_diag_close(diag, expected, 1e-9, where)
    if where == "inner":  # run in the forward, as written: 3 * d(probe²)/d(probe)
        assert model.ran and set(model.ran) == {"inner"}
        last = model.inner.shape[0]  # the last forward's (sub-)batch
        assert torch.allclose(model.inner, 6 * model.a(x[-last:]).detach())
    else:
        assert model.ran == []
    if where == "parameter":  # what the forward registered stays, after the user's own
        hooks = model.c.weight._backward_hooks
        assert list(hooks.items())[: len(hooks_before)] == list(hooks_before.items())
        assert len(hooks) > len(hooks_before)
        model.c.weight._backward_hooks.clear()


def test_hooks_the_forward_put_on_a_parameter_are_back_after_a_refused_call():
    """Muted from the forward's end: a call refused after it gives them back."""
    torch.manual_seed(0)
    model = _HooksInForward("parameter").double()
    x, y = _data()
    with pytest.raises(ggnchunk.MemoryBudgetError):
        ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, max_memory="1KiB")
    hooks = model.c.weight._backward_hooks
    assert hooks is not None and len(hooks) == 1  # the forward's hook, registered
    model.c.weight._backward_hooks.clear()
