"""laplace-torch's own diag and kron checks, rewritten for ``ChunkedGGN`` (fast, offline).

``tools/laplace_suite.py`` runs laplace-torch's whole test suite with ``ChunkedGGN`` from a
clone of its repository; CI has neither network nor the clone, so the checks that matter
most are rewritten here: every ``hessian_structure="diag"`` fit must give what
laplace-torch's ``BackPackGGN(stochastic=False)`` gives (curvature, loss, marginal
likelihood, posterior), for all weights, the last layer and a subnetwork, for 1-, 2- and
3-output regression and binary and 3-class classification (2 and 3 columns used to
crash the budget mode), with no options, a memory budget and ``num_chunks=2`` (more
chunks than the 1-output regression's one column: clamped). Every
``hessian_structure="kron"`` fit must give BackPACK's KFLR factors (``H_facs.kfacs``),
loss and marginal likelihood for the same problems (all weights and the last layer,
refits with ``override=False`` for all weights), and the backend's ``kron`` must pass
laplace-torch's backend-level kron checks (one sample: the exact diagonal; split
batches; the ``N`` normalization).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

laplace = pytest.importorskip("laplace")
from laplace import DiagSubnetLaplace, KronLaplace, KronLLLaplace, Laplace  # noqa: E402
from laplace.curvature import BackPackGGN, CurvlinopsGGN, GGNInterface  # noqa: E402
from laplace.utils import LargestMagnitudeSubnetMask  # noqa: E402

import ggnchunk  # noqa: E402
from ggnchunk.laplace import ChunkedGGN  # noqa: E402

DTYPE = torch.float64  # exact comparisons: BackPACK and ggnchunk agree to rounding
OPTIONS = [{}, {"max_memory": "256MiB"}, {"num_chunks": 2}]
PROBLEMS = [
    ("regression", 1),
    ("regression", 2),
    ("regression", 3),
    ("classification", 2),
    ("classification", 3),
]


def _problem(likelihood: str, outputs: int, n: int = 10):
    """laplace-torch's test problem: 3 inputs, batches of 3 (an uneven last batch)."""
    torch.manual_seed(240)
    x = torch.randn(n, 3, dtype=DTYPE)
    if likelihood == "regression":
        y = torch.randn(n, outputs, dtype=DTYPE)
    else:
        y = torch.randint(outputs, (n,))
    model = nn.Sequential(nn.Linear(3, 20), nn.Tanh(), nn.Linear(20, outputs)).to(DTYPE)
    return model, DataLoader(TensorDataset(x, y), batch_size=3)


def _fit(model, likelihood, loader, backend, subset="all", **kwargs):
    la = Laplace(copy.deepcopy(model), likelihood, subset_of_weights=subset,
                 hessian_structure="diag", backend=backend, backend_kwargs=kwargs,
                 prior_precision=0.7)  # fmt: skip
    with warnings.catch_warnings():  # the built-in BackPACK backend's hook warning
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        la.fit(loader)
    return la


def _assert_same_posterior(ours, theirs, label: str) -> None:
    for name in ("H", "loss", "posterior_precision", "log_likelihood"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-10,
                              atol=1e-12), f"{label}: {name} differs"  # fmt: skip
    assert torch.allclose(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood(),
                          rtol=1e-10), f"{label}: marginal likelihood differs"  # fmt: skip


def _assert_predictive(la, loader, likelihood: str, outputs: int) -> None:
    """The glm predictive (torch.func Jacobians) runs after fit: no hooks left."""
    x = next(iter(loader))[0]
    if likelihood == "regression":
        mean, var = la(x, pred_type="glm")
        assert mean.shape == (3, outputs) and var.shape == (3, outputs, outputs)
    else:
        probs = la(x, pred_type="glm", link_approx="probit")
        assert torch.allclose(probs.sum(-1), torch.ones(3, dtype=DTYPE))


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize(("likelihood", "outputs"), PROBLEMS)
def test_diag_fit_equals_backpack(likelihood, outputs, subset):
    model, loader = _problem(likelihood, outputs)
    theirs = _fit(model, likelihood, loader, BackPackGGN, subset)
    assert bool((theirs.H > 0).any())
    for options in OPTIONS:
        ours = _fit(model, likelihood, loader, ChunkedGGN, subset, **options)
        _assert_same_posterior(ours, theirs, f"{likelihood}/{outputs}/{subset} {options}")
    _assert_predictive(ours, loader, likelihood, outputs)


@pytest.mark.parametrize(
    ("likelihood", "outputs"), [("regression", 2), ("classification", 3)]
)
def test_diag_equals_the_diagonal_of_laplaces_full_ggn(likelihood, outputs):
    """laplace-torch's test_diag_ggn_{cls,reg}_backpack: diag vs its torch.func full GGN."""
    model, loader = _problem(likelihood, outputs)
    x, y = loader.dataset.tensors
    reference = GGNInterface(model, likelihood)
    loss_full, full = reference.full(x, y)
    for options in OPTIONS:
        loss, diag = ChunkedGGN(model, likelihood, **options).diag(x, y, N=len(x))
        assert diag.shape == (sum(p.numel() for p in model.parameters()),)
        assert torch.allclose(diag, full.diagonal(), rtol=1e-10, atol=1e-12), options
        assert torch.allclose(loss, loss_full, rtol=1e-12), options
    # the options reach the engine: a 16-byte budget cannot hold one column
    with pytest.raises(ggnchunk.MemoryBudgetError, match="max_memory"):
        ChunkedGGN(model, likelihood, max_memory=16).diag(x, y)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_diag_subnetwork_equals_backpack(likelihood):
    model, loader = _problem(likelihood, 3)
    indices = LargestMagnitudeSubnetMask(model, n_params_subnet=20).select()
    fits = {}
    runs = [("backpack", BackPackGGN, {}), ("ours", ChunkedGGN, {"max_memory": "256MiB"})]
    for name, backend, options in runs:
        la = DiagSubnetLaplace(copy.deepcopy(model), likelihood, subnetwork_indices=indices,
                               backend=backend, backend_kwargs=options)  # fmt: skip
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            la.fit(loader)
        fits[name] = la
    assert fits["ours"].H.shape == (20,)
    _assert_same_posterior(fits["ours"], fits["backpack"], f"subnet {likelihood}")


def test_reward_modeling_pairs_equal_laplaces_default_backend():
    """laplace-torch's test_reward_modeling: pair inputs [B, 2, 3], logits [B, 2].

    BackPACK cannot run this model (a reshape outside its layers); laplace-torch's default
    backend computes the diagonal from ``torch.func`` Jacobians.
    """
    torch.manual_seed(0)

    class RewardModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))

        def forward(self, x):
            return self.net(x.reshape(-1, x.shape[-1])).reshape(x.shape[0], -1)

    model = RewardModel().to(DTYPE)
    x, y = torch.randn(10, 2, 3, dtype=DTYPE), torch.randint(2, (10,))
    loader = DataLoader(TensorDataset(x, y), batch_size=3)
    ours = _fit(model, "reward_modeling", loader, ChunkedGGN, num_chunks=2)
    theirs = _fit(model, "reward_modeling", loader, CurvlinopsGGN)
    _assert_same_posterior(ours, theirs, "reward modeling")


def _fit_kron(model, likelihood, loader, backend, subset="all", **kwargs):
    la = Laplace(copy.deepcopy(model), likelihood, subset_of_weights=subset,
                 hessian_structure="kron", backend=backend, backend_kwargs=kwargs,
                 prior_precision=0.7)  # fmt: skip
    assert isinstance(la, KronLLLaplace if subset == "last_layer" else KronLaplace)
    with warnings.catch_warnings():  # the built-in BackPACK backend's hook warning
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        la.fit(loader)
        if subset == "all":  # last-layer Laplace refuses override=False
            la.fit(loader, override=False)  # laplace-torch rescales the input factors
    return la


def _assert_same_kron(ours, theirs, label: str) -> None:
    assert len(ours.H_facs.kfacs) == len(theirs.H_facs.kfacs), label
    for i, (mine, other) in enumerate(
        zip(ours.H_facs.kfacs, theirs.H_facs.kfacs, strict=True)
    ):
        assert len(mine) == len(other), f"{label}: factor {i}"
        for a, b in zip(mine, other, strict=True):
            assert a.shape == b.shape, f"{label}: factor {i}"
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), f"{label}: factor {i}"
    assert torch.allclose(ours.loss, theirs.loss, rtol=1e-10), f"{label}: loss"
    assert torch.allclose(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood(),
                          rtol=1e-10), f"{label}: marginal likelihood"  # fmt: skip


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize(("likelihood", "outputs"), PROBLEMS)
def test_kron_fit_equals_backpack(likelihood, outputs, subset):
    """Kron(LL)Laplace fits (test_baselaplace, test_lllaplace): BackPACK's factors."""
    model, loader = _problem(likelihood, outputs)
    theirs = _fit_kron(model, likelihood, loader, BackPackGGN, subset)
    for options in OPTIONS:
        ours = _fit_kron(model, likelihood, loader, ChunkedGGN, subset, **options)
        _assert_same_kron(ours, theirs, f"{likelihood}/{outputs}/{subset} {options}")
    _assert_predictive(ours, loader, likelihood, outputs)


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize(
    ("likelihood", "outputs"), [("regression", 2), ("classification", 2)]
)
def test_kron_backend_checks(likelihood, outputs, options):
    """test_curv_backends_backpack's kron checks with ChunkedGGN as the backend."""
    model, loader = _problem(likelihood, outputs)
    x, y = loader.dataset.tensors
    backend = ChunkedGGN(model, likelihood, **options)
    n = len(x)
    # one sample: Kron is exact, its diagonal is the GGN diagonal
    _, diag = backend.diag(x[:1], y[:1], N=1)
    _, kron = backend.kron(x[:1], y[:1], N=1)
    assert torch.allclose(kron.diag(), diag, rtol=1e-10, atol=1e-12)
    # batching correction: two halves with the whole N add up to the whole batch
    loss, kron = backend.kron(x, y, N=n)
    assert len(kron.diag()) == sum(p.numel() for p in model.parameters())
    loss1, kron1 = backend.kron(x[: n // 2], y[: n // 2], N=n)
    loss2, kron2 = backend.kron(x[n // 2 :], y[n // 2 :], N=n)
    assert torch.allclose(kron.diag(), (kron1 + kron2).diag(), rtol=1e-10)
    assert torch.allclose(loss, loss1 + loss2, rtol=1e-12)
    # normalization: one sample seven times with N=7 is seven times the sample with N=1
    loss1, kron1 = backend.kron(x[:1], y[:1], N=1)
    loss7, kron7 = backend.kron(x[:1].repeat(7, 1), y[:1].repeat_interleave(7, 0), N=7)
    assert torch.allclose((7 * kron1).diag(), kron7.diag(), rtol=1e-10)
    assert torch.allclose(7 * loss1, loss7, rtol=1e-12)
    # and BackPACK's factors for the whole batch
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        loss_bp, kron_bp = BackPackGGN(copy.deepcopy(model), likelihood).kron(x, y, N=n)
    for mine, other in zip(kron.kfacs, kron_bp.kfacs, strict=True):
        for a, b in zip(mine, other, strict=True):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    assert torch.allclose(loss, loss_bp, rtol=1e-12)
