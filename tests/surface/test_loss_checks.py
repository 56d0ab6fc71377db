"""Loss/target checks whose messages say the fix: cross-entropy with float class indices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ggnchunk
from ggnchunk._sqrt_hessians import lookup_loss

FLOAT_INDICES = r"look like class indices stored as floats.*targets\.long\(\)"


@pytest.mark.parametrize(
    ("output_shape", "target_shape"),
    [((3, 4), (3,)), ((2, 5, 7), (2, 7)), ((2, 3, 4, 4), (2, 4, 4))],
    ids=["[N,C]", "[N,C,L]", "[N,C,H,W]"],
)
def test_cross_entropy_float_class_indices_are_refused(output_shape, target_shape):
    loss_func = nn.CrossEntropyLoss()
    output = torch.randn(output_shape)
    indices = torch.randint(0, output_shape[1], target_shape)
    handler = lookup_loss(loss_func)
    handler.check_shapes(loss_func, output, indices)  # long indices: fine
    with pytest.raises(ValueError, match=FLOAT_INDICES):
        handler.check_shapes(loss_func, output, indices.float())


def test_cross_entropy_probabilities_still_accepted_and_checked():
    loss_func = nn.CrossEntropyLoss()
    handler = lookup_loss(loss_func)
    output = torch.randn(3, 4)
    handler.check_shapes(loss_func, output, torch.softmax(torch.randn(3, 4), dim=1))
    with pytest.raises(ValueError, match="class probabilities of shape"):
        handler.check_shapes(loss_func, output, torch.rand(3, 5))


def test_diag_ggn_names_float_class_indices():
    torch.manual_seed(0)
    X, y_float = torch.randn(3, 3), torch.tensor([0.0, 2.0, 1.0])
    loss_func = nn.CrossEntropyLoss(reduction="sum")
    with pytest.raises(ValueError, match=FLOAT_INDICES):
        ggnchunk.diag_ggn(nn.Linear(3, 4), loss_func, X, y_float)


@pytest.mark.parametrize(
    "kwargs", [{}, {"batch_chunk_size": 1}, {"batch_chunk_size": 2}, {"num_chunks": 2}]
)
def test_a_plain_function_that_averages_is_refused_for_any_sub_batch(kwargs):
    """A function taking the mean over the batch is not a sum of per-sample terms.

    Sub-batches of one sample could not tell it from a sum: ``batch_chunk_size=1``
    returned N times the diagonal without a word. The check now sees the sample twice.
    """
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Linear(4, 5).double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randint(0, 5, (3,))
    with pytest.raises(ValueError, match="not a sum of per-sample terms.*partial"):
        ggnchunk.diag_ggn(model, lambda o, t: F.cross_entropy(o, t), x, y, **kwargs)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_losses_of_one_sample_are_still_accepted(reduction):
    """A sum (or mean) of per-sample terms passes the check on one sample too."""
    torch.manual_seed(0)
    model = nn.Linear(4, 5).double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)

    class LogCosh(nn.Module):  # the generic path: no closed form
        def __init__(self):
            super().__init__()
            self.reduction = reduction

        def forward(self, out, target):
            terms = torch.log(torch.cosh(out - target))
            return terms.sum() if reduction == "sum" else terms.mean()

    whole = ggnchunk.diag_ggn(model, LogCosh(), x, y, batch_chunk_size=3)
    split = ggnchunk.diag_ggn(model, LogCosh(), x, y, batch_chunk_size=1)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-12, atol=0)


class _LogCoshSum(nn.Module):
    """A user's loss module without a ``reduction`` attribute (a sum)."""

    def forward(self, out, target):
        return torch.log(torch.cosh(out - target)).sum()


class _LogCoshMean(nn.Module):
    """The same as a mean over every element, without a ``reduction`` attribute."""

    def forward(self, out, target):
        return torch.log(torch.cosh(out - target)).mean()


def test_a_loss_module_without_reduction_is_taken_as_a_sum():
    """A loss module without ``reduction`` is a function of (output, target).

    It was refused with "reduction=None ... use L(reduction='mean')", an argument the
    class does not have.
    """
    from tests.reference import assert_diag_close, reference_diag_ggn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    actual = ggnchunk.diag_ggn(model, _LogCoshSum(), x, y, num_chunks=2)
    assert_diag_close(actual, reference_diag_ggn(model, _LogCoshSum(), x, y), rtol=1e-9)
    with pytest.raises(ValueError, match=r"_LogCoshMean\) is not a sum.*reduction"):
        ggnchunk.diag_ggn(model, _LogCoshMean(), x, y)


def test_the_fix_the_refusal_of_a_mean_without_reduction_names_works():
    """A module that averages itself is refused with a fix that works.

    timm's ``LabelSmoothingCrossEntropy`` has no ``reduction``; the fix named is
    ``loss_func.reduction = 'mean'``. Once set, its forward still takes the mean itself
    and the result is exact (the message used to ask for an attribute "its forward
    honours", which such a forward does not need to).
    """
    from tests.reference import assert_diag_close, reference_diag_ggn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    loss = _LogCoshMean()
    with pytest.raises(ValueError, match=r"loss_func\.reduction = 'mean'"):
        ggnchunk.diag_ggn(model, loss, x, y)
    loss.reduction = "mean"
    expected = reference_diag_ggn(model, loss, x, y)
    for options in ({}, {"num_chunks": 3}, {"batch_chunk_size": 1}):
        actual = ggnchunk.diag_ggn(model, loss, x, y, **options)
        assert_diag_close(actual, expected, rtol=1e-9)
