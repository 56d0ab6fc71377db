"""Per-output predictive variance under a diagonal posterior, exact against float64.

The reference is independent of ggnchunk: each sample's Jacobian w.r.t. all trainable
parameters (``torch.func.jacrev`` of a one-sample ``functional_call`` on a float64 copy),
then ``Var f_nm = sum_p J_nmp**2 s_p``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

import ggnchunk
from tests.cases import MODELS
from tests.models import Functional, PerSampleBlock

RTOL, ATOL = 1e-4, 1e-7  # float32 computation against the float64 reference


def reference_output_variance(model: nn.Module, x: torch.Tensor, s: torch.Tensor):
    """``[N, *output]`` float64 variances from full per-sample Jacobians."""
    model = copy.deepcopy(model).double()
    named = list(model.named_parameters())
    params = {n: p.detach() for n, p in named if p.requires_grad}
    state = {n: p.detach() for n, p in named if not p.requires_grad}
    state.update(dict(model.named_buffers()))
    x = x.double() if x.is_floating_point() else x

    def one(p, n):
        return functional_call(model, {**p, **state}, (x[n : n + 1],)).squeeze(0)

    rows = []
    for n in range(x.shape[0]):
        jac = jacrev(one)(params, n)
        out = one(params, n)
        flat = torch.cat([j.reshape(out.numel(), -1) for j in jac.values()], 1)
        rows.append((flat.square() * s.double()).sum(1).reshape(out.shape))
    return torch.stack(rows)


def _variance_for(model: nn.Module, seed: int = 3) -> torch.Tensor:
    torch.manual_seed(seed)
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return torch.rand(total) * 0.1


class _Skip(nn.Module):
    """``x + tanh(lin(x)) * gain``: a skip and a parameter used in the glue."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.gain = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return x + torch.tanh(self.lin(x)) * self.gain


def _glue_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 6), PerSampleBlock(6), _Skip(), nn.Linear(6, 4))


GLUE = [
    ("functional_shared_and_glue[N,6]", Functional, (6,)),
    ("per_sample_block[N,4]", _glue_model, (6,)),
]


def _cases():
    for case in MODELS:
        yield pytest.param(case.make, id=case.name)
    for name, build, shape in GLUE:

        def make(seed=0, build=build, shape=shape):
            torch.manual_seed(seed)
            return build().eval(), torch.randn(3, *shape)

        yield pytest.param(make, id=name)


@pytest.mark.parametrize("make", list(_cases()))
def test_exact_on_the_model_table(make):
    model, x = make()
    s = _variance_for(model)
    expected = reference_output_variance(model, x, s)
    result = ggnchunk.output_variance(model, x, s, num_chunks=2)
    assert result.shape == expected.shape
    assert result.dtype == torch.float32
    torch.testing.assert_close(result.double(), expected, rtol=RTOL, atol=ATOL)


CHUNKING = {
    "one_pass": {},
    "num_chunks": {"num_chunks": 5},
    "chunk_size_1": {"chunk_size": 1},
    "batch_chunks": {"batch_chunk_size": 2, "num_chunks": 3},
    "budget": {"max_memory": "64MiB"},
    "auto": {"chunk_size": "auto"},
}


@pytest.mark.parametrize("options", CHUNKING.values(), ids=CHUNKING.keys())
def test_every_chunking_option_gives_the_same_exact_result(options):
    model, x = MODELS[1].make()  # conv autoencoder, outputs [N, 2, 6, 6]
    s = _variance_for(model)
    expected = reference_output_variance(model, x, s)
    result, report = ggnchunk.output_variance(model, x, s, return_report=True, **options)
    torch.testing.assert_close(result.double(), expected, rtol=RTOL, atol=ATOL)
    assert report.num_columns == 2 * 6 * 6  # columns: the output coordinates


def test_dict_variance_and_frozen_parameters():
    model, x = MODELS[0].make()
    model[0].weight.requires_grad_(False)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    torch.manual_seed(4)
    variance = {
        n: torch.rand_like(p) for n, p in model.named_parameters() if p.requires_grad
    }
    flat = torch.cat([variance[n].flatten() for n in names])
    expected = reference_output_variance(model, x, flat)
    result = ggnchunk.output_variance(model, x, variance, chunk_size=2)
    torch.testing.assert_close(result.double(), expected, rtol=RTOL, atol=ATOL)


def test_bad_posterior_variance_is_refused_before_any_work():
    model, x = MODELS[0].make()
    total = sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match=rf"needs shape \[{total}\]"):
        ggnchunk.output_variance(model, x, torch.ones(total + 1))
    with pytest.raises(ValueError, match="non-negative"):
        ggnchunk.output_variance(model, x, -torch.ones(total))
    with pytest.raises(TypeError, match="posterior_variance must be"):
        ggnchunk.output_variance(model, x, [1.0] * total)
    with pytest.raises(ValueError, match="no entry for"):
        ggnchunk.output_variance(model, x, {"0.weight": torch.ones(8, 6)})
    with pytest.raises(ValueError, match="num_chunks"):
        ggnchunk.output_variance(model, x, torch.ones(total), num_chunks=0)


def test_model_is_left_unchanged():
    model, x = MODELS[0].make()
    before = copy.deepcopy(model.state_dict())
    variance = _variance_for(model)
    state = torch.get_rng_state()
    ggnchunk.output_variance(model, x, variance, num_chunks=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert torch.equal(state, torch.get_rng_state())


laplace = pytest.importorskip("laplace")


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_equals_laplace_torch_glm_functional_variance(likelihood, subset):
    from laplace import Laplace
    from torch.utils.data import DataLoader, TensorDataset

    from ggnchunk.laplace import ChunkedGGN
    from ggnchunk.laplace import output_variance as laplace_output_variance

    torch.manual_seed(0)
    outputs = 3 if likelihood == "regression" else 4
    x = torch.randn(20, 5)
    y = (
        torch.randn(20, outputs)
        if likelihood == "regression"
        else torch.randint(0, 4, (20,))
    )
    loader = DataLoader(TensorDataset(x, y), batch_size=6)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, outputs))
    la = Laplace(model, likelihood, subset_of_weights=subset, hessian_structure="diag",
                 backend=ChunkedGGN)  # fmt: skip
    la.fit(loader)
    la.prior_precision = 0.7  # any prior: the posterior variance follows
    _, f_var = la._glm_predictive_distribution(x[:8], diagonal_output=True)
    result = laplace_output_variance(la, x[:8], num_chunks=2)
    torch.testing.assert_close(result, f_var, rtol=1e-4, atol=1e-7)
    with pytest.raises(TypeError, match="DiagLaplace"):
        laplace_output_variance(
            Laplace(model, likelihood, hessian_structure="kron", backend=ChunkedGGN), x
        )


class _SharedScale(nn.Module):
    """``model(w, x)``: a shared ``[D]`` scale first, the per-sample ``[N, D]`` second."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, w, x):
        return torch.tanh(self.linear(x * w))


@pytest.mark.parametrize("batch_chunk_size", [None, 4])
def test_a_shared_argument_before_the_batch_needs_batch_size(batch_chunk_size):
    """The batch size came from the first tensor (the [4] scale): a false refusal."""
    torch.manual_seed(0)
    model = _SharedScale().double()
    w, x = torch.randn(4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    s = torch.rand(10, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"differ on axis 0 \(\[4, 6\]\).*batch_size=N"):
        ggnchunk.output_variance(model, (w, x), s)
    with pytest.raises(ValueError, match=r"batch_size=5, but no tensor of inputs has 5"):
        ggnchunk.output_variance(model, (w, x), s, batch_size=5)
    actual = ggnchunk.output_variance(
        model, (w, x), s, batch_size=6, batch_chunk_size=batch_chunk_size
    )
    params = dict(model.named_parameters())
    jac = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (w, x)))(params)
    expected = sum(
        (jac[n].reshape(6, 2, -1).square() * part.reshape(-1)).sum(-1)
        for n, part in zip(params, torch.split(s, [p.numel() for p in params.values()]),
                           strict=True)
    )  # fmt: skip
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=0)
