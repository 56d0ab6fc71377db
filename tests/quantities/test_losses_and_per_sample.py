"""Beyond the three closed-form losses: any loss, GaussianNLL, per-sample diagonals.

Every result is compared with the float64 brute force of ``tests/reference.py`` (the
batch loss's Hessian w.r.t. each sample's output from ``torch.func.hessian``), or, for
the Gaussian likelihood's Fisher and the positive part of a non-convex loss's Hessian,
with a brute force written out here from per-sample Jacobians.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

import ggnchunk
from ggnchunk._sqrt_hessians import FunctionLoss, NotConvexWarning
from ggnchunk.losses import GaussianNLL
from tests.reference import assert_diag_close, reference_diag_ggn


def _model(outputs: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, outputs)).double()


X = torch.randn(5, 3, dtype=torch.float64)


def _coupled_outputs(output, target):  # a non-diagonal Hessian: coordinates interact
    return ((output.sum(1) - target.sum(1)) ** 2).sum() + (output**2).sum()


def _squared_sum(output, target):
    return ((output - target) ** 2).sum()


LOSSES = {
    "huber-mean": (lambda: nn.HuberLoss(delta=0.5), lambda o: torch.randn_like(o)),
    "smoothl1-sum": (lambda: nn.SmoothL1Loss(reduction="sum", beta=0.3),
                     lambda o: torch.randn_like(o)),
    "poisson-log-input": (lambda: nn.PoissonNLLLoss(), lambda o: torch.rand_like(o) * 3),
    "poisson-rate": (lambda: nn.PoissonNLLLoss(log_input=False),
                     lambda o: torch.rand_like(o) * 3),
    "function-sum": (lambda: _squared_sum, lambda o: torch.randn_like(o)),
    "function-non-diagonal": (lambda: _coupled_outputs, lambda o: torch.randn_like(o)),
}  # fmt: skip


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # the brute force's vmap
@pytest.mark.parametrize("name", list(LOSSES))
def test_any_convex_loss_is_exact(name):
    make_loss, make_target = LOSSES[name]
    model = _model()
    if name == "poisson-rate":  # positive rates
        model = nn.Sequential(model, nn.Softplus())
    with torch.no_grad():
        out = model(X)
    torch.manual_seed(1)
    targets = make_target(out)
    loss = make_loss()
    module = loss if isinstance(loss, nn.Module) else FunctionLoss(loss)
    expected = reference_diag_ggn(model, module, X, targets)
    for kwargs in ({}, {"num_chunks": 3}, {"max_memory": "64MiB", "batch_chunk_size": 2}):
        actual = ggnchunk.diag_ggn(model, loss, X, targets, **kwargs)
        assert_diag_close(actual, expected, rtol=1e-9, label=f"{name} {kwargs}")


def _jacobians(model, x):
    params = {k: v.detach() for k, v in model.named_parameters()}
    return [jacrev(lambda p, n=n: functional_call(model, p, (x[n : n + 1],))[0])(params)
            for n in range(x.shape[0])]  # fmt: skip


def test_non_convex_loss_uses_the_positive_part_and_warns():
    model = _model(2)

    def cosine(output, target):  # Hessian -cos(o) per coordinate: negative where cos > 0
        return torch.cos(output - target).sum()

    targets = torch.zeros(5, 2, dtype=torch.float64)
    with pytest.warns(NotConvexWarning, match="positive part") as record:
        actual = ggnchunk.diag_ggn(model, cosine, X, targets, num_chunks=2)
    assert record[0].filename == __file__  # points at the user's call
    with torch.no_grad():
        hess = (-torch.cos(model(X))).clamp_min(0)  # [N, 2], diagonal per sample
    expected = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    for n, jac in enumerate(_jacobians(model, X)):
        for k, j in jac.items():
            j = j.reshape(2, -1)
            expected[k] += (hess[n][:, None] * j * j).sum(0).reshape(expected[k].shape)
    assert_diag_close(actual, expected, rtol=1e-9)


def test_loss_coupling_samples_is_refused():
    def coupled(output, target):
        return ((output - output.mean(0)) ** 2).sum()

    with pytest.raises(ValueError, match="not a sum of per-sample terms"):
        ggnchunk.diag_ggn(_model(), coupled, X, torch.zeros(5, 4, dtype=torch.float64))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gaussian_nll_uses_the_fisher(reduction):
    torch.manual_seed(2)
    model = nn.Sequential(_model(2 * 3), nn.Unflatten(1, (2, 3)))
    targets = torch.randn(5, 3, dtype=torch.float64)
    loss = GaussianNLL(reduction=reduction)
    with torch.no_grad():
        out = model(X)
        reference_loss = nn.GaussianNLLLoss(reduction=reduction)(
            out[:, 0], targets, out[:, 1].exp()
        )
    torch.testing.assert_close(loss(out, targets), reference_loss)
    norm = targets.numel() if reduction == "mean" else 1
    fisher = torch.stack([1 / out[:, 1].exp(), torch.full_like(out[:, 1], 0.5)], 1) / norm
    expected = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    for n, jac in enumerate(_jacobians(model, X)):
        for k, j in jac.items():
            j = j.reshape(6, -1)
            f = fisher[n].reshape(6, 1)
            expected[k] += (f * j * j).sum(0).reshape(expected[k].shape)
    for kwargs in ({}, {"chunk_size": 1}, {"max_memory": "64MiB"}):
        actual = ggnchunk.diag_ggn(model, loss, X, targets, **kwargs)
        assert_diag_close(actual, expected, rtol=1e-9, label=str(kwargs))


def test_gaussian_nll_shapes_are_checked():
    model = _model(3)
    with pytest.raises(ValueError, match=r"\[N, 2, \.\.\.\]"):
        ggnchunk.diag_ggn(model, GaussianNLL(), X, torch.zeros(5, 3, dtype=torch.float64))


PER_SAMPLE_MODELS = {
    "mlp-mse": (lambda: _model(), nn.MSELoss(), lambda o: torch.randn_like(o)),
    "conv-tied-ce": (None, nn.CrossEntropyLoss(reduction="sum"), None),
}


class _TiedConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Linear(3, 4)

    def forward(self, x):
        h = torch.relu(self.conv(x)).mean((2, 3))
        return self.head(h) + torch.nn.functional.linear(h, self.head.weight) * 0.5


@pytest.mark.parametrize("kwargs", [{}, {"num_chunks": 3, "batch_chunk_size": 2},
                                    {"max_memory": "64MiB"}])  # fmt: skip
@pytest.mark.parametrize("case", ["mlp-mse", "conv-tied-ce"])
def test_per_sample_diagonals(case, kwargs):
    torch.manual_seed(3)
    if case == "mlp-mse":
        model, loss, x = _model(), nn.MSELoss(), X
        with torch.no_grad():
            targets = torch.randn_like(model(x))
    else:
        model, loss = _TiedConv().double(), nn.CrossEntropyLoss(reduction="sum")
        x = torch.randn(4, 2, 4, 4, dtype=torch.float64)
        targets = torch.randint(0, 4, (4,))
    actual = ggnchunk.diag_ggn(model, loss, x, targets, per_sample=True, **kwargs)
    n = x.shape[0]
    sum_loss = type(loss)(reduction="sum")
    scale = 1.0 / targets.numel() if loss.reduction == "mean" else 1.0
    for i in range(n):
        expected = reference_diag_ggn(model, sum_loss, x[i : i + 1], targets[i : i + 1])
        got = {k: v[i] for k, v in actual.items()}
        assert_diag_close(got, {k: scale * v for k, v in expected.items()}, rtol=1e-9)
    total = ggnchunk.diag_ggn(model, loss, x, targets)
    assert_diag_close({k: v.sum(0) for k, v in actual.items()}, total, rtol=1e-9)
    for name, param in model.named_parameters():
        assert actual[name].shape == (n, *param.shape)


def _products_made(rule: type, monkeypatch) -> list[tuple]:
    """The weight shapes whose per-sample products ``rule.per_sample`` makes (a spy)."""
    made: list[tuple] = []
    products = rule.per_sample

    def watched(self, ctx, grads):
        made.append(tuple(ctx.module.weight.shape))
        return products(self, ctx, grads)

    monkeypatch.setattr(rule, "per_sample", watched)
    return made


@pytest.mark.parametrize("case", ["mlp-mse", "conv-tied-ce"])
def test_per_sample_linear_layers_skip_their_products(case, monkeypatch):
    """A linear layer on one position per sample: ``(sum_v g²) ⊗ x²``, no products.

    Its ``[V, N, O, I]`` products are made only where the weight is used again (the
    tied head: its products are added over the uses before squaring).
    """
    from ggnchunk._rules.linear import LinearRule

    made = _products_made(LinearRule, monkeypatch)
    torch.manual_seed(3)
    if case == "mlp-mse":
        model, loss, x = _model(), nn.MSELoss(), X
        targets = torch.randn(x.shape[0], 4, dtype=torch.float64)
    else:
        model, loss = _TiedConv().double(), nn.CrossEntropyLoss(reduction="sum")
        x = torch.randn(4, 2, 4, 4, dtype=torch.float64)
        targets = torch.randint(0, 4, (4,))
    ggnchunk.diag_ggn(model, loss, x, targets, per_sample=True)
    assert made == ([] if case == "mlp-mse" else [(4, 3)])


class _OnePosition(nn.Module):
    """Convolutions with one output position.

    A pooled gate (squeeze-excitation, LRASPP's scale) on a segmenter's maps, and a
    classifier's last layers on a 1x1 map.
    """

    def __init__(self, segmenter: bool):
        super().__init__()
        self.segmenter = segmenter
        self.body = nn.Conv2d(2, 4, 3, padding=1)
        self.gate = nn.Conv2d(4, 4, 1, groups=2)  # on the pooled map
        self.whole = nn.Conv2d(4, 6, 5)  # its kernel covers the 5x5 map: one position
        self.padded = nn.Conv2d(6, 3, 3, padding=1)  # a 1x1 map, zero-padded
        self.head = nn.Conv2d(4, 3, 1)
        unused = (self.whole, self.padded) if segmenter else (self.head,)
        for module in unused:
            module.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        h = h * torch.sigmoid(self.gate(h.mean((2, 3), keepdim=True)))
        if self.segmenter:
            return self.head(h)
        return self.padded(torch.tanh(self.whole(h))).flatten(1)


@pytest.mark.parametrize("segmenter", [True, False], ids=["segmenter", "classifier"])
def test_per_sample_one_position_convolutions_skip_their_products(segmenter, monkeypatch):
    """A convolution with one output position: ``(sum_v g²) ⊗ patch²``, no products.

    LRASPP's pooled 960 -> 128 scale made ``[V, N, 128, 960]`` products per sample
    (6 GB in float64 for 3,072 columns): 35 s where the summed diagonal took 0.15 s.
    Grouped, zero-padded and whole-map kernels, exact per sample.
    """
    from ggnchunk._rules.conv import ConvRule

    made = _products_made(ConvRule, monkeypatch)
    torch.manual_seed(5)
    model = _OnePosition(segmenter).double()
    x = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    with torch.no_grad():
        out = model(x)
    if segmenter:
        loss, targets = nn.CrossEntropyLoss(), torch.randint(0, 3, (3, 5, 5))
    else:
        loss, targets = nn.MSELoss(reduction="sum"), torch.randn_like(out)
    actual = ggnchunk.diag_ggn(model, loss, x, targets, per_sample=True, num_chunks=2)
    for i in range(x.shape[0]):
        expected = reference_diag_ggn(model, loss, x[i : i + 1], targets[i : i + 1])
        scale = 1 / x.shape[0] if segmenter else 1.0  # the mean's share of one sample
        got = {k: v[i] for k, v in actual.items()}
        assert_diag_close(got, {k: scale * v for k, v in expected.items()}, rtol=1e-9)
    one_position = {(4, 2, 1, 1)} | (set() if segmenter else {(6, 4, 5, 5), (3, 6, 3, 3)})
    assert not one_position & set(made), made


class _OneNumber(nn.Module):
    """One output number per sample, ``[N]`` (a regression or binary head squeezed)."""

    def __init__(self, sigmoid: bool = False):
        super().__init__()
        self.hidden, self.head = nn.Linear(4, 3), nn.Linear(3, 1)
        self.sigmoid = sigmoid

    def forward(self, x):
        out = self.head(torch.tanh(self.hidden(x))).squeeze(-1)
        return torch.sigmoid(out) if self.sigmoid else out


ONE_NUMBER_LOSSES = {
    "bce-logits": lambda: nn.BCEWithLogitsLoss(),
    "bce-logits-pos-weight-sum": lambda: nn.BCEWithLogitsLoss(
        reduction="sum", pos_weight=torch.tensor(2.0, dtype=torch.float64)
    ),
    "bce": lambda: nn.BCELoss(),
    "mse": lambda: nn.MSELoss(),
    "huber": lambda: nn.HuberLoss(),
}


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"num_chunks": 2}, {"max_memory": "64MiB"}, {"batch_chunk_size": 2},
     {"per_sample": True}],
)  # fmt: skip
@pytest.mark.parametrize("name", list(ONE_NUMBER_LOSSES))
def test_outputs_of_one_number_per_sample(name, kwargs):
    """Outputs ``[N]``: BCE raised a raw ``IndexError`` (flattening a missing axis)."""
    torch.manual_seed(0)
    loss = ONE_NUMBER_LOSSES[name]()
    model = _OneNumber(sigmoid=name == "bce").double()
    x = torch.randn(5, 4, dtype=torch.float64)
    targets = torch.rand(5, dtype=torch.float64)
    actual = ggnchunk.diag_ggn(model, loss, x, targets, **kwargs)
    if kwargs.get("per_sample"):
        actual = {k: v.sum(0) for k, v in actual.items()}
    assert_diag_close(actual, reference_diag_ggn(model, loss, x, targets), rtol=1e-9)


@pytest.mark.parametrize(
    "kwargs", [{}, {"num_chunks": 2}, {"max_memory": "64MiB"}, {"batch_chunk_size": 2}]
)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("options", ["weight", "ignore_index", "both"])
def test_nll_loss_with_class_weights_and_ignored_targets(options, reduction, kwargs):
    """``NLLLoss``'s weighted mean divides by the targets' weights, as cross-entropy's.

    It was refused as "not a mean of per-sample terms".
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 4), nn.LogSoftmax(1))
    model = model.double()
    x = torch.randn(5, 5, dtype=torch.float64)
    targets = torch.tensor([0, 2, 2, 3, 1])
    weight = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)
    loss = nn.NLLLoss(
        weight=weight if options != "ignore_index" else None,
        ignore_index=2 if options != "weight" else -100,
        reduction=reduction,
    )
    actual = ggnchunk.diag_ggn(model, loss, x, targets, **kwargs)
    assert_diag_close(actual, reference_diag_ggn(model, loss, x, targets), rtol=1e-9)


@pytest.mark.parametrize("kwargs", [{}, {"batch_chunk_size": 2}, {"max_memory": "64MiB"}])
@pytest.mark.parametrize("reduction", ["batchmean", "sum"])
def test_kl_divergence_is_linear_in_its_input_and_says_so(reduction, kwargs):
    """``KLDivLoss`` has no curvature in the model's log-probabilities: zeros, warned.

    ``reduction="batchmean"``, torch's recommended one, was refused.
    """
    from ggnchunk._sqrt_hessians import ZeroHessianWarning

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3), nn.LogSoftmax(1))
    model = model.double()
    x = torch.randn(5, 5, dtype=torch.float64)
    targets = torch.softmax(torch.randn(5, 3, dtype=torch.float64), 1)
    loss = nn.KLDivLoss(reduction=reduction)
    with pytest.warns(ZeroHessianWarning, match="linear in its input.*CrossEntropyLoss"):
        actual = ggnchunk.diag_ggn(model, loss, x, targets, **kwargs)
    expected = reference_diag_ggn(model, loss, x, targets)
    for name, value in actual.items():
        assert torch.equal(value, torch.zeros_like(value)), name
        assert float(expected[name].abs().max()) < 1e-12, name


@pytest.mark.parametrize("kind", ["cross_entropy", "nll", "nll_weighted"])
@pytest.mark.parametrize("where", ["batch_chunks", "dataset"])
def test_a_sub_batch_whose_targets_are_all_ignored_adds_nothing(kind, where):
    """A mean over a batch whose sub-batch (or loader batch) has only ignored targets.

    The batch's loss is finite; the sub-batch's own mean is 0/0. ``NLLLoss`` (the
    generic path) was refused as "not a mean of per-sample terms" (NaN against NaN),
    and ``loss_grad_and_diag_ggn`` returned a NaN loss and gradient for cross-entropy.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    weight = torch.tensor([0.2, 1.0, 3.0], dtype=torch.float64)
    if kind == "cross_entropy":
        loss_func = nn.CrossEntropyLoss(ignore_index=1)
    else:  # NLL is linear in the log-probabilities: a zero GGN, the loss and gradient
        model.append(nn.LogSoftmax(-1))
        loss_func = nn.NLLLoss(weight=weight if kind == "nll_weighted" else None,
                               ignore_index=1)  # fmt: skip
    x = torch.randn(5, 4, dtype=torch.float64)
    targets = torch.tensor([0, 2, 1, 1, 0])  # samples 2 and 3: ignored
    expected = reference_diag_ggn(model, loss_func, x, targets)
    true_loss = loss_func(model(x), targets)
    true_grad = torch.autograd.grad(true_loss, list(model.parameters()))
    if where == "dataset":
        from torch.utils.data import DataLoader, TensorDataset

        loader = DataLoader(TensorDataset(x, targets), batch_size=2)
        actual = ggnchunk.diag_ggn_dataset(model, loss_func, loader, progress=False)
        assert_diag_close(actual, expected, 1e-9, where)
        return
    loss, grad, actual = ggnchunk.loss_grad_and_diag_ggn(
        model, loss_func, x, targets, batch_chunk_size=2
    )
    assert_diag_close(actual, expected, 1e-9, where)
    assert torch.allclose(loss, true_loss, rtol=1e-12)
    for g, t in zip(grad.values(), true_grad, strict=True):
        assert torch.allclose(g, t, rtol=1e-10, atol=1e-14)
