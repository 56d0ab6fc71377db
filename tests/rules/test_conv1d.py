"""transformers' ``Conv1D`` (GPT-2's projections) through its rule, against the brute force.

ggnchunk does not import transformers. The rule takes the class from a loaded
``transformers.pytorch_utils`` whose ``Conv1D.forward`` is, line for line, the one it
knows. Here a stand-in module of that name holds a class with that ``forward`` (so the
suite runs without transformers), and one whose ``forward`` differs, which must be left
to the recorded graph; where transformers is installed, its GPT-2 is checked too.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

import ggnchunk
from ggnchunk._rules import rule_for
from ggnchunk._rules.linear import Conv1DRule
from tests.quantities.test_output_variance import reference_output_variance
from tests.reference import assert_diag_close, reference_diag_ggn

MODES = ({}, {"num_chunks": 3}, {"max_memory": "64MiB"}, {"batch_chunk_size": 1})


class Conv1D(nn.Module):
    """transformers' ``Conv1D`` as of 4.x-5.x (``pytorch_utils.py``)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.nx = nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.5)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)  # noqa: RUF005 (transformers' line)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        x = x.view(size_out)
        return x


class OtherConv1D(Conv1D):
    """A ``Conv1D`` whose ``forward`` is not the known one (it scales its output)."""

    def forward(self, x):
        return 2.0 * torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(
            *x.shape[:-1], self.nf
        )


@pytest.fixture
def transformers_module(monkeypatch):
    """A ``transformers.pytorch_utils`` holding the stand-in class."""
    module = types.ModuleType("transformers.pytorch_utils")
    module.Conv1D = Conv1D
    monkeypatch.setitem(sys.modules, "transformers.pytorch_utils", module)
    return module


def _net(cls=Conv1D) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(cls(8, 5), nn.Tanh(), cls(6, 8), nn.GELU(), cls(3, 6)).double()


@pytest.mark.parametrize("shape", [(4, 5), (3, 4, 5)], ids=["flat", "tokens"])
def test_the_known_conv1d_has_the_rule_and_is_exact(transformers_module, shape):
    model = _net()
    assert all(isinstance(rule_for(m), Conv1DRule) for m in model if isinstance(m, Conv1D))
    torch.manual_seed(1)
    x = torch.randn(*shape, dtype=torch.float64)
    with torch.no_grad():
        targets = torch.randn_like(model(x))
    expected = reference_diag_ggn(model, nn.MSELoss(), x, targets)
    for kwargs in MODES:
        actual = ggnchunk.diag_ggn(model, nn.MSELoss(), x, targets, **kwargs)
        assert_diag_close(actual, expected, rtol=1e-9, label=str(kwargs))
    per_sample = ggnchunk.diag_ggn(model, nn.MSELoss(), x, targets, per_sample=True)
    for name, value in per_sample.items():  # [N, in, out]: the weight's own layout
        assert value.shape[1:] == dict(model.named_parameters())[name].shape
    assert_diag_close({k: v.sum(0) for k, v in per_sample.items()}, expected, rtol=1e-9)


def test_a_shared_and_a_frozen_conv1d_are_exact(transformers_module):
    model = _net()
    model[2].requires_grad_(False)  # frozen: the rule only maps the vectors back
    tied = nn.Sequential(model, Conv1D(3, 3)).double()
    tied[1].weight = nn.Parameter(model[4].weight[:3].detach().clone())
    tied[1].bias = model[4].bias  # a bias shared by two layers: per-sample products
    torch.manual_seed(2)
    x = torch.randn(5, 5, dtype=torch.float64)
    targets = torch.randint(0, 3, (5,))
    expected = reference_diag_ggn(tied, nn.CrossEntropyLoss(), x, targets)
    for kwargs in MODES:
        actual = ggnchunk.diag_ggn(tied, nn.CrossEntropyLoss(), x, targets, **kwargs)
        assert_diag_close(actual, expected, rtol=1e-9, label=str(kwargs))


def test_output_variance_through_conv1d(transformers_module):
    model = _net()
    torch.manual_seed(3)
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    total = sum(p.numel() for p in model.parameters())
    flat = torch.rand(total, dtype=torch.float64)
    variance, start = {}, 0
    for name, p in model.named_parameters():
        variance[name] = flat[start : start + p.numel()].view_as(p)
        start += p.numel()
    actual = ggnchunk.output_variance(model, x, variance, num_chunks=2)
    expected = reference_output_variance(model, x, flat)
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12)


def test_another_forward_is_left_to_the_recorded_graph(transformers_module):
    transformers_module.Conv1D = OtherConv1D
    model = _net(OtherConv1D)
    assert all(rule_for(m) is None for m in model if isinstance(m, OtherConv1D))
    torch.manual_seed(4)
    x = torch.randn(4, 5, dtype=torch.float64)
    targets = torch.randn(4, 3, dtype=torch.float64)
    expected = reference_diag_ggn(model, nn.MSELoss(), x, targets)
    actual = ggnchunk.diag_ggn(model, nn.MSELoss(), x, targets, num_chunks=2)
    assert_diag_close(actual, expected, rtol=1e-9)


def test_without_transformers_loaded_there_is_no_rule(monkeypatch):
    monkeypatch.delitem(sys.modules, "transformers.pytorch_utils", raising=False)
    assert Conv1DRule().classes == ()
    assert rule_for(Conv1D(3, 2)) is None


def test_transformers_gpt2_is_exact():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=40, n_positions=6, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(5)
    lm = transformers.GPT2LMHeadModel(config).eval().double()

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(ids).logits.transpose(1, 2)

    model = Logits()
    ruled = [m for m in model.modules() if type(m).__name__ == "Conv1D"]
    assert ruled and all(isinstance(rule_for(m), Conv1DRule) for m in ruled)
    ids, targets = torch.randint(0, 40, (2, 6)), torch.randint(0, 40, (2, 6))
    expected = reference_diag_ggn(model, nn.CrossEntropyLoss(), ids, targets)
    for kwargs in MODES[:2]:
        actual = ggnchunk.diag_ggn(model, nn.CrossEntropyLoss(), ids, targets, **kwargs)
        assert_diag_close(actual, expected, rtol=1e-9, label=str(kwargs))
