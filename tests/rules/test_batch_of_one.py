"""(Sub-)batches of one sample, for parameters used in the glue, against the brute force.

With one sample no batch reduction makes a new tensor: autograd may hand back the very
buffer of backpropagated vectors (or a view of it) as a glue parameter's gradient, which
must be read before that buffer is reused. Every glue-parameter case of the test tables
runs with a batch of one, with ``batch_chunk_size`` leaving a last sub-batch of one, and
through the dataset loop with a last batch of one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ggnchunk
from tests.exactness.test_dataflow import _build as _build_dataflow
from tests.real_models import BY_ID, CASES
from tests.reference import assert_diag_close, reference_diag_ggn, split_inputs
from tests.rules.test_rules import LAYERS, rule_problem


class PositionsAndClassToken(nn.Module):
    """The issue's minimal case: learned positions, a class token, LayerNorm, residual."""

    def __init__(self, tokens: int = 3, d: int = 5):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, tokens + 1, d))
        self.cls_token = nn.Parameter(torch.randn(1, 1, d))
        self.ln = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        h0 = torch.cat([cls, x], dim=1) + self.pos
        h = self.lin(self.ln(h0)) + h0
        return h[:, 0]


def _issue_problem(n: int):
    torch.manual_seed(0)
    model = PositionsAndClassToken().double()
    with torch.no_grad():
        model.ln.weight.normal_()
        model.ln.bias.normal_()
    x = torch.randn(n, 3, 5, dtype=torch.float64)
    y = torch.randint(0, 5, (n,))
    return model, nn.CrossEntropyLoss(), x, y


def _check(model, loss_func, x, y, label, **kwargs):
    expected = reference_diag_ggn(model, loss_func, x, y)
    actual = ggnchunk.diag_ggn(model, loss_func, x, y, **kwargs)
    assert_diag_close(actual, expected, rtol=1e-10, label=label)


@pytest.mark.parametrize("kwargs", [{}, {"chunk_size": 1}], ids=["onepass", "size1"])
def test_issue_case_batch_of_one(kwargs):
    _check(*_issue_problem(1), "batch of one", **kwargs)


def test_issue_case_last_sub_batch_of_one():
    _check(*_issue_problem(3), "batch_chunk_size=2", batch_chunk_size=2)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_issue_case_dataset_with_a_last_batch_of_one(reduction):
    model, _, x, y = _issue_problem(3)
    loss_func = nn.CrossEntropyLoss(reduction=reduction)
    expected = reference_diag_ggn(model, loss_func, x, y)
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    actual = ggnchunk.diag_ggn_dataset(model, loss_func, loader, progress=False)
    assert_diag_close(actual, expected, rtol=1e-10, label="dataset [2, 1]")


@pytest.mark.parametrize("shared", [False, True], ids=["single", "shared"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_rule_table_glue_parameter_batch_of_one(name, shared):
    """``_Front``'s ``scale`` is a glue parameter; ``shared`` adds per-sample products."""
    model, x, y = rule_problem(name, shared)
    loss_func = nn.MSELoss(reduction="sum")
    _check(model, loss_func, x[:1], y[:1], f"{name} N=1")
    _check(model, loss_func, x, y, f"{name} batch_chunk_size=2", batch_chunk_size=2)


@pytest.mark.parametrize("name", ["functional-ops", "per-sample-block"])
def test_dataflow_glue_parameters_batch_of_one(name):
    model, x = _build_dataflow(name)
    with torch.no_grad():
        out = model(x)
    torch.manual_seed(1)
    loss_func = nn.CrossEntropyLoss()
    y = torch.randint(0, out.shape[1], (out.shape[0],))
    _check(model, loss_func, x[:1], y[:1], f"{name} N=1")
    _check(model, loss_func, x, y, f"{name} batch_chunk_size=2", batch_chunk_size=2)


# the hand-written real models (glue parameters: tied and functional weights, layers
# called twice, attention, prototypes, ...); random ones draw per batch, torchvision is
# covered by the rule table's layers
REAL = [
    case.id
    for case in CASES
    if "small" in case.tags and not {"random", "torchvision"} & case.tags
]


@pytest.mark.parametrize("case_id", REAL)
def test_real_models_batch_of_one(case_id):
    problem = BY_ID[case_id].make()
    n = problem.batch
    args, kwargs = split_inputs(problem.inputs, n)(slice(0, 1))
    inputs = kwargs if kwargs else (args[0] if len(args) == 1 else args)
    if isinstance(problem.inputs, list):
        inputs = list(args)
    loss_func = problem.loss_func
    _check(problem.model, loss_func, inputs, problem.targets[:1], f"{case_id} N=1")
    _check(
        problem.model, loss_func, problem.inputs, problem.targets,
        f"{case_id} batch_chunk_size={n - 1}", batch_chunk_size=n - 1,
    )  # fmt: skip
