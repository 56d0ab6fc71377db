"""Monte-Carlo columns (``mc_samples``): unbiased estimates on the same engine.

Unbiasedness is checked statistically with fixed seeds: the mean of ``R`` independent
estimates must lie within 5 standard errors (the sample standard deviation over
``sqrt(R)``) of the exact value from the float64 brute force, for every entry. An estimate
off by any constant factor (a missing ``1 / sqrt(k)``) or that drops a part of the
Hessian fails by tens of standard errors with these ``R``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ggnchunk
from tests.reference import reference_diag_ggn, reference_kron

SIGMAS = 5.0


def _assert_unbiased(draws: torch.Tensor, exact: torch.Tensor) -> None:
    """``draws``: ``[R, ...]`` estimates; ``exact``: the expected value."""
    r = draws.shape[0]
    mean = draws.mean(0)
    error = draws.std(0) / r**0.5
    bad = (mean - exact).abs() > SIGMAS * error + 1e-12 * (1 + exact.abs())
    assert not bool(bad.any()), (
        f"{int(bad.sum())} of {bad.numel()} entries off by more than {SIGMAS} standard "
        f"errors; worst z = {float(((mean - exact).abs() / error).max()):.2f}"
    )
    assert bool((error > 0).any())  # the estimates do vary: the test can fail


def _flat(values) -> torch.Tensor:
    return torch.cat([v.flatten() for v in values])


def _mlp(outputs: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, outputs)).double()


def _ce_image():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 4, 1))
    x = torch.randn(3, 2, 3, 3)
    return model.double(), x.double(), nn.CrossEntropyLoss(), torch.randint(0, 4, (3, 3, 3))


class _Coupled(nn.Module):
    """A convex loss whose per-sample Hessian couples the outputs (``2 I + 1 1^T``)."""

    reduction = "sum"

    def forward(self, out, t):
        return ((out - t) ** 2).sum() + 0.5 * (out.sum(1) ** 2).sum()


_coupled = _Coupled()


def _case(kind: str):
    torch.manual_seed(1)
    x = torch.randn(5, 4, dtype=torch.float64)
    if kind == "mse_mean":
        return _mlp(3), x, nn.MSELoss(), torch.randn(5, 3, dtype=torch.float64)
    if kind == "ce_sum":
        return _mlp(4), x, nn.CrossEntropyLoss(reduction="sum"), torch.randint(0, 4, (5,))
    if kind == "bce":
        return _mlp(3), x, nn.BCEWithLogitsLoss(), torch.rand(5, 3, dtype=torch.float64)
    if kind == "dense_function":  # a non-diagonal Hessian: autograd's dense root
        return _mlp(3), x, _coupled, torch.randn(5, 3, dtype=torch.float64)
    if kind == "ce_image":
        return _ce_image()
    raise KeyError(kind)


KINDS = ["mse_mean", "ce_sum", "bce", "dense_function", "ce_image"]


@pytest.mark.parametrize("kind", KINDS)
def test_diagonal_is_unbiased(kind):
    model, x, loss_func, y = _case(kind)
    exact = _flat(reference_diag_ggn(model, loss_func, x, y).values())
    generator = torch.Generator().manual_seed(11)
    draws = torch.stack([
        _flat(ggnchunk.diag_ggn(model, loss_func, x, y, mc_samples=2, num_chunks=2,
                                generator=generator).values())
        for _ in range(200)
    ])  # fmt: skip
    _assert_unbiased(draws, exact)


def test_per_sample_and_sub_batches_are_unbiased():
    model, x, loss_func, y = _case("ce_sum")
    exact = torch.stack([
        _flat(reference_diag_ggn(model, loss_func, x[n:n + 1], y[n:n + 1]).values())
        for n in range(5)
    ])  # fmt: skip
    generator = torch.Generator().manual_seed(12)
    draws = torch.stack([
        torch.cat([v.flatten(1) for v in ggnchunk.diag_ggn(
            model, loss_func, x, y, mc_samples=3, batch_chunk_size=2, per_sample=True,
            generator=generator).values()], 1)
        for _ in range(200)
    ])  # fmt: skip
    _assert_unbiased(draws, exact)


def test_kronecker_output_factors_are_unbiased():
    model, x, loss_func, y = _case("ce_sum")
    exact = reference_kron(model, loss_func, x, y)
    generator = torch.Generator().manual_seed(13)
    runs = [
        ggnchunk.kron_ggn(model, loss_func, x, y, mc_samples=2, generator=generator)
        for _ in range(200)
    ]
    for name, (output, inputs) in exact.items():
        draws = torch.stack([run[name].output for run in runs])
        _assert_unbiased(draws, output)
        # the input factors need no columns: exact in every draw
        torch.testing.assert_close(runs[0][name].input, inputs)


def test_k_columns_are_swept_and_the_budget_and_chunks_apply():
    model, x, loss_func, y = _case("ce_image")  # 36 exact columns
    _, report = ggnchunk.diag_ggn(model, loss_func, x, y, return_report=True)
    assert report.num_columns == 36
    _, report = ggnchunk.diag_ggn(model, loss_func, x, y, mc_samples=5, num_chunks=5,
                                  return_report=True)  # fmt: skip
    assert (report.num_columns, report.num_passes, report.chunk_size) == (5, 5, 1)
    _, report = ggnchunk.diag_ggn(model, loss_func, x, y, mc_samples=4,
                                  max_memory="64MiB", return_report=True)  # fmt: skip
    assert report.num_columns == 4
    assert sum(c.stop - c.start for s in report.schedules for c in s.chunks) >= 4


def test_random_draws_one_seed_per_call():
    model, x, loss_func, y = _case("ce_sum")
    first = ggnchunk.diag_ggn(model, loss_func, x, y, mc_samples=3,
                              generator=torch.Generator().manual_seed(5))  # fmt: skip
    again = ggnchunk.diag_ggn(model, loss_func, x, y, mc_samples=3, num_chunks=3,
                              generator=torch.Generator().manual_seed(5))  # fmt: skip
    for name in first:  # the same draws whatever the chunking
        torch.testing.assert_close(first[name], again[name], rtol=1e-12, atol=1e-15)
    # with a generator, the global RNG is untouched
    state = torch.get_rng_state()
    seeded = torch.Generator().manual_seed(5)
    ggnchunk.diag_ggn(model, loss_func, x, y, mc_samples=3, generator=seeded,
                      batch_chunk_size=2)  # fmt: skip
    assert torch.equal(state, torch.get_rng_state())
    # without one, the global RNG advances by exactly one draw per call
    ggnchunk.diag_ggn(model, loss_func, x, y, mc_samples=3, batch_chunk_size=2)
    after = torch.get_rng_state()
    torch.set_rng_state(state)
    torch.randint(0, 2**62, ())
    assert torch.equal(after, torch.get_rng_state())


def test_sampling_arguments_are_checked():
    model, x, loss_func, y = _case("mse_mean")
    for bad in (0, -1, 2.0, True):
        with pytest.raises(TypeError, match="mc_samples must be a positive int"):
            ggnchunk.diag_ggn(model, loss_func, x, y, mc_samples=bad)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        ggnchunk.diag_ggn(model, loss_func, x, y, mc_samples=2, generator=3)
    with pytest.raises(ValueError, match="generator is only used with mc_samples"):
        ggnchunk.diag_ggn(model, loss_func, x, y, generator=torch.Generator())


def test_dataset_path_is_unbiased():
    model, x, loss_func, y = _case("mse_mean")
    data = [(x[:3], y[:3]), (x[3:], y[3:])]
    exact = _flat(ggnchunk.diag_ggn_dataset(model, loss_func, data).values())
    generator = torch.Generator().manual_seed(14)
    draws = torch.stack([
        _flat(ggnchunk.diag_ggn_dataset(model, loss_func, data, mc_samples=2,
                                        generator=generator).values())
        for _ in range(200)
    ])  # fmt: skip
    _assert_unbiased(draws, exact)


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_laplace_backend_stochastic_is_unbiased(structure):
    pytest.importorskip("laplace")
    from ggnchunk.laplace import ChunkedGGN

    model = _mlp(4).float()
    torch.manual_seed(2)
    x, y = torch.randn(6, 4), torch.randint(0, 4, (6,))
    exact_backend = ChunkedGGN(model, "classification")
    backend = ChunkedGGN(model, "classification", stochastic=True, num_samples=2)
    assert backend.stochastic and backend.num_samples == 2
    if structure == "diag":
        _, exact = exact_backend.diag(x, y)
        torch.manual_seed(15)
        draws = torch.stack([backend.diag(x, y)[1] for _ in range(200)])
        _assert_unbiased(draws.double(), exact.double())
    else:
        _, exact = exact_backend.kron(x, y, N=6)
        torch.manual_seed(16)
        runs = [backend.kron(x, y, N=6)[1] for _ in range(200)]
        for i, block in enumerate(exact.kfacs):
            draws = torch.stack([run.kfacs[i][0] for run in runs])
            _assert_unbiased(draws.double(), block[0].double())
