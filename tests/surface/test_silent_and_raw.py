"""Issue 21 section 3: silently wrong results, the user's state, raw or misleading errors.

Every value is compared with the float64 brute force; every refusal names the argument
and the fix.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

import ggnchunk
from tests.quantities.test_losses_and_per_sample import LOSSES
from tests.reference import assert_diag_close, reference_diag_ggn


def _model(outputs: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, outputs)).double()


X = torch.randn(5, 3, dtype=torch.float64)


# -- random state -----------------------------------------------------------------------
def _every_loss(out: torch.Tensor):
    yield "mse", nn.MSELoss(), torch.randn_like(out)
    yield "bce", nn.BCEWithLogitsLoss(), torch.rand_like(out).round()
    yield "ce", nn.CrossEntropyLoss(), torch.randint(0, out.shape[1], (out.shape[0],))
    yield "gaussian-nll", ggnchunk.losses.GaussianNLL(), torch.randn(out.shape[0])
    for name, (make_loss, make_target) in LOSSES.items():
        if name != "poisson-rate":  # needs positive outputs; same path as poisson-log
            yield name, make_loss(), make_target(out)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_no_loss_path_changes_the_global_random_state():
    """Generic losses probed their Hessian's diagonality with the global RNG."""
    model = _model()
    with torch.no_grad():
        out = model(X)
    torch.manual_seed(3)
    for name, loss_func, targets in _every_loss(out):
        model_out = model
        if name == "gaussian-nll":
            model_out = nn.Sequential(model, nn.Linear(4, 2)).double()
        state = torch.get_rng_state()
        # (a CUDA generator is never touched on CPU inputs; on CUDA the probe uses a
        # private generator of the output's device as well)
        ggnchunk.diag_ggn(model_out, loss_func, X, targets)
        assert torch.equal(torch.get_rng_state(), state), f"{name} changed the RNG state"


# -- a loss module whose forward takes the mean itself ----------------------------------
class LogCosh(nn.Module):
    reduction = "mean"

    def forward(self, x, y):
        return torch.log(torch.cosh(x - y)).mean()


class LogCoshPerSampleMean(nn.Module):
    reduction = "mean"

    def forward(self, x, y):
        return torch.log(torch.cosh(x - y)).flatten(1).mean(1).mean()


@pytest.mark.parametrize("loss_class", [LogCosh, LogCoshPerSampleMean])
def test_loss_taking_the_mean_itself_is_exact(loss_class):
    model = _model()
    with torch.no_grad():
        targets = torch.randn_like(model(X))
    loss_func = loss_class()
    expected = reference_diag_ggn(model, loss_func, X, targets)
    for kwargs in ({}, {"num_chunks": 3}, {"batch_chunk_size": 2}):
        actual = ggnchunk.diag_ggn(model, loss_func, X, targets, **kwargs)
        assert_diag_close(actual, expected, rtol=1e-9, label=f"{kwargs}")


# -- an interrupt right after the memory poller started ---------------------------------
def test_interrupt_after_the_poller_starts_leaves_no_thread(monkeypatch):
    import threading

    from ggnchunk._memory import HostMemory

    started: list[threading.Thread] = []
    original = threading.Thread.start

    def start_then_interrupt(self):
        original(self)
        started.append(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        HostMemory(torch.device("cpu")).measure(lambda: None)
    monkeypatch.undo()
    assert len(started) == 1
    started[0].join(timeout=2.0)
    assert not started[0].is_alive(), "the RSS polling thread is still running"


# -- losses: a class instead of an instance, GaussianNLLLoss, L1 -------------------------
def test_loss_class_instead_of_an_instance_says_instantiate():
    model = _model()
    with pytest.raises(TypeError, match=r"instantiate it: loss_func=MSELoss\(\)"):
        ggnchunk.diag_ggn(model, nn.MSELoss, X, torch.randn(5, 4, dtype=torch.float64))


def test_torch_gaussian_nll_points_to_ours():
    model = _model()
    with pytest.raises(TypeError, match=r"ggnchunk\.losses\.GaussianNLL\(\)"):
        ggnchunk.diag_ggn(
            model, nn.GaussianNLLLoss(), X, torch.randn(5, 4, dtype=torch.float64)
        )


def test_l1_loss_warns_that_its_diagonal_is_zero():
    model = _model()
    targets = torch.randn(5, 4, dtype=torch.float64)
    expected = reference_diag_ggn(model, nn.L1Loss(), X, targets)
    with pytest.warns(ggnchunk.ZeroHessianWarning, match="L1Loss.*zero almost everywhere"):
        actual = ggnchunk.diag_ggn(model, nn.L1Loss(), X, targets)
    assert_diag_close(actual, expected, rtol=1e-12, label="L1")


def _margin_reference(model, x, targets, p, margin, weight, mean):
    """diag(J^T H J) with multi-margin's Hessian written out by hand.

    Per sample with class ``y`` and active set ``A = {i != y: margin - f_y + f_i > 0}``,
    ``l = w_y / C * sum_A (margin - f_y + f_i)^p``: for ``p = 2`` the Hessian is
    ``2 w_y / C * sum_A (e_i - e_y)(e_i - e_y)^T``; for ``p = 1`` it is zero.
    """
    with torch.no_grad():
        out = model(x)
    num, classes = out.shape
    expected = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    jacobians = [
        jacrev(lambda q, n=n: functional_call(model, q, (x[n : n + 1],))[0])(
            {k: v.detach() for k, v in model.named_parameters()}
        )
        for n in range(num)
    ]
    for n, jac in enumerate(jacobians):
        y = int(targets[n])
        hess = torch.zeros(classes, classes, dtype=out.dtype)
        for i in range(classes):
            if i != y and p == 2 and margin - out[n, y] + out[n, i] > 0:
                e = torch.zeros(classes, dtype=out.dtype)
                e[i], e[y] = 1.0, -1.0
                hess += 2.0 * (1.0 if weight is None else weight[y]) / classes * e.outer(e)
        hess = hess / (num if mean else 1)
        for k, j in jac.items():
            j = j.reshape(classes, -1)
            expected[k] += torch.einsum("ap,ab,bp->p", j, hess, j).reshape(
                expected[k].shape
            )
    return expected


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_multi_margin_loss_squared_is_exact(weighted, reduction):
    """No second derivative of multi_margin_loss in torch: a raw RuntimeError before."""
    model = _model()
    torch.manual_seed(3)
    targets = torch.randint(0, 4, (5,))
    weight = torch.rand(4, dtype=torch.float64) + 0.5 if weighted else None
    loss = nn.MultiMarginLoss(p=2, margin=2.0, weight=weight, reduction=reduction)
    expected = _margin_reference(model, X, targets, 2, 2.0, weight, reduction == "mean")
    assert max(float(v.abs().max()) for v in expected.values()) > 0
    for kwargs in ({}, {"num_chunks": 3}, {"batch_chunk_size": 1}):
        actual = ggnchunk.diag_ggn(model, loss, X, targets, **kwargs)
        assert_diag_close(actual, expected, rtol=1e-9, label=f"{reduction} {kwargs}")


@pytest.mark.parametrize(
    "make_loss, make_targets",
    [
        (lambda: nn.MultiMarginLoss(), lambda: torch.randint(0, 4, (5,))),
        (lambda: nn.HingeEmbeddingLoss(), lambda: torch.randn(5, 4).sign().double()),
        (lambda: nn.MultiLabelMarginLoss(),
         lambda: torch.tensor([[2, 0, -1, 1]] * 3 + [[3, -1, 0, 0]] * 2)),
    ],
    ids=["multi-margin", "hinge-embedding", "multilabel-margin"],
)  # fmt: skip
def test_piecewise_linear_losses_warn_that_the_diagonal_is_zero(make_loss, make_targets):
    """A silent zero (HingeEmbeddingLoss) or a raw RuntimeError (the margin losses)."""
    model = _model()
    loss, targets = make_loss(), make_targets()
    with torch.no_grad():  # torch's own value: the sample sum the library checks
        loss(model(X), targets)
    if isinstance(loss, nn.HingeEmbeddingLoss):
        expected = reference_diag_ggn(model, loss, X, targets)
    else:  # no second derivative in torch: the Hessian is zero a.e. by hand
        expected = _margin_reference(
            model, X, targets.reshape(5, -1)[:, 0], 1, 1.0, None, True
        )
    with pytest.warns(ggnchunk.ZeroHessianWarning, match="zero almost everywhere"):
        actual = ggnchunk.diag_ggn(model, loss, X, targets)
    assert_diag_close(actual, expected, rtol=1e-12, label=type(loss).__name__)


def test_a_finding_is_said_once_per_call_not_per_sub_batch():
    """Each sub-batch (batch_chunk_size, a dataset's batches) repeated its warnings."""
    model, targets = _model(), torch.randn(5, 4, dtype=torch.float64)
    bag = nn.Sequential(nn.EmbeddingBag(9, 3), nn.Linear(3, 2)).double()
    tokens = torch.randint(0, 9, (5, 4))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ggnchunk.diag_ggn(model, nn.L1Loss(), X, targets, batch_chunk_size=2)
        ggnchunk.diag_ggn(bag, nn.CrossEntropyLoss(), tokens, targets[:, 0].sign().long()
                          .clamp_min(0), batch_chunk_size=1)  # fmt: skip
        ggnchunk.diag_ggn_dataset(
            model, nn.L1Loss(), [(X[:2], targets[:2]), (X[2:], targets[2:])]
        )
    said = [(type(w.message).__name__, w.filename) for w in record]
    assert said == [
        ("ZeroHessianWarning", __file__),
        ("SlowBackwardWarning", __file__),
        ("ZeroHessianWarning", __file__),
    ], said


# -- user backward hooks: not fired during a call, still registered after ---------------
def test_user_backward_hooks_do_not_fire_and_stay_registered():
    model = _model()
    fired: list[str] = []
    model[2].register_full_backward_hook(lambda *a: fired.append("module"))
    model[0].weight.register_hook(lambda g: fired.append("tensor"))
    model[0].bias.register_post_accumulate_grad_hook(lambda p: fired.append("post"))
    targets = torch.randn(5, 4, dtype=torch.float64)
    ggnchunk.diag_ggn(model, nn.MSELoss(), X, targets, num_chunks=2)
    assert fired == []
    nn.MSELoss()(model(X), targets).backward()
    assert sorted(set(fired)) == ["module", "post", "tensor"]


# -- another thread running the same model during a call --------------------------------
class _AtLinear(torch.overrides.TorchFunctionMode):
    """Runs ``action`` in this thread's ``F.linear`` with ``weight`` (between hooks)."""

    def __init__(self, weight, action):
        super().__init__()
        self.weight, self.action = weight, action

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is nn.functional.linear and args[1] is self.weight:
            self.action()
        return func(*args, **(kwargs or {}))


def test_another_thread_calling_the_model_during_a_call_changes_nothing():
    """A forced race: another thread is inside the last layer when the call enters it.

    It leaves while the calling thread is inside (between the layer's pre- and post-hook).
    """
    import threading

    model = _model()
    layer = model[2]
    inside, release = threading.Event(), threading.Event()
    raced: list[threading.Thread] = []

    def other_thread():
        def wait():
            inside.set()
            release.wait(5.0)

        h = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
        with _AtLinear(layer.weight, wait):
            layer(h)

    def start_other(module, args):
        if torch.is_grad_enabled() and not raced:
            raced.append(threading.Thread(target=other_thread))
            raced[0].start()
            inside.wait(5.0)

    def let_other_leave():
        if raced and not release.is_set():
            release.set()
            raced[0].join(5.0)

    model.register_forward_pre_hook(start_other)
    targets = torch.randn(5, 4, dtype=torch.float64)
    try:
        with _AtLinear(layer.weight, let_other_leave):
            actual = ggnchunk.diag_ggn(model, nn.MSELoss(), X, targets)
    finally:
        release.set()
        for thread in raced:
            thread.join(5.0)
    assert raced, "the race did not happen"
    expected = reference_diag_ggn(model, nn.MSELoss(), X, targets)
    assert_diag_close(actual, expected, rtol=1e-10, label="racing thread")


class _ChangedAfterSaved(nn.Module):
    """A 0-d scale that the forward changes in place after a product saved it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        scale = torch.tensor(2.0, dtype=x.dtype)
        h = x + self.w * scale
        scale += 1  # autograd's saved value of ``scale`` is now stale
        return self.lin(h)


def test_a_tensor_changed_in_place_after_it_was_saved_is_named():
    """The version check of torch (``loss.backward()`` raises it too) says the fix."""
    model = _ChangedAfterSaved().double()
    with pytest.raises(ValueError, match=r"changed a tensor in place .*t = t.clone\(\)"):
        ggnchunk.diag_ggn(model, nn.MSELoss(), X, torch.randn(5, 2, dtype=torch.float64))


def test_anomaly_detection_is_named_as_the_slow_kernel_and_the_result_is_exact():
    """Anomaly mode's check of every gradient is named as the slow kernel.

    It checks with ``item``, which vmap cannot batch: the columns then go one at a time,
    and the warning named a layer's glue as the cause.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8, 3))
    model = model.double()
    x = torch.randn(4, 1, 4, 4, dtype=torch.float64)
    y = torch.randn(4, 3, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autograd.detect_anomaly():
            actual = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y)
    slow = [str(w.message) for w in caught if w.category is ggnchunk.SlowBackwardWarning]
    assert len(slow) == 1 and "aten::item (torch.autograd.detect_anomaly()" in slow[0]
    assert_diag_close(actual, reference_diag_ggn(model, nn.MSELoss(), x, y), rtol=1e-10)
