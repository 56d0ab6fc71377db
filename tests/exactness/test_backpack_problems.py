"""BackPACK's own DiagGGNExact test problems against the float64 brute force.

A representative subset of the 99 problems in ``tests/backpack_problems.py``: every layer
kind (Linear on [N, ..., D], activations, max/avg/adaptive pooling 1d-3d with dilation
and ceil mode, Conv/ConvTranspose 1d-3d with stride/padding/dilation/groups/no bias,
BatchNorm 1d-3d in eval mode, Embedding, RNN, LSTM, BackPACK's Pad/Slicing/Permute/
ReduceTuple/Parallel modules, residual models) and every loss (MSE, cross-entropy on
[N, C] and [N, C, d1, ...], BCEWithLogits [N, 1], mean and sum). The five problems whose
exact diagonal is all zero (dead ReLUs at BackPACK's seed) are left out. All 99 run with
``python -m tools.backpack_problems`` (which also runs BackPACK itself).
"""

from __future__ import annotations

import functools

import pytest
import torch

import ggnchunk
from tests.backpack_problems import BY_ID
from tests.reference import assert_diag_close, reference_diag_ggn

SUBSET = [
    "00-example-linear-ce",
    "02-linear-relu-linear-ce-sum",
    "16-act-SELU-bias",
    "20-pool-Conv1d-MaxPool1d(2,1,0,2,False,True)",
    "26-pool-Conv3d-MaxPool3d(2,1,0,2,False,True)",
    "28-pool-Conv1d-AvgPool1d(2,1,0,True)",
    "32-pool-Conv2d-AvgPool2d(2,1,0,False)",
    "34-pool-Conv3d-AvgPool3d(2,1,0,True)",
    "39-cnn-Conv1d(3,6,2,4,2,3)-in3,8",
    "44-cnn-Conv2d(3,6,2,4,2,3)-in3,8,8",
    "49-cnn-Conv3d(3,6,2,4,2,3)-in3,4,8,8",
    "57-cnn-ConvTranspose2d(2,4,2,1,0,0,1,True,2)-in2,9,9",
    "59-cnn-ConvTranspose2d(3,2,2,4,2,0,1,False)-in3,7,7",
    "61-cnn-ConvTranspose3d(2,3,2,2,2,0,1,True,2)-in2,3,5,5",
    "63-cnn-Conv1d(6,4,2,1,0,1,2)-in6,7",
    "64-cnn-Conv2d(6,3,2,1,0,1,3)-in6,7,5",
    "65-cnn-Conv3d(4,2,2,1,0,2,2)-in4,7,5,6",
    "66-cnn-ConvTranspose1d(6,3,2,4,2,0,3,True,3)-in6,8",
    "67-cnn-ConvTranspose2d(4,2,2,1,0,0,2,True,2)-in4,9,9",
    "68-cnn-ConvTranspose3d(4,2,(2,2,1),2,2,0,2,True,2)-in4,3,5,5",
    "71-three-additional-mse-sum",
    "73-two-additional-ce-mean",
    "75-multi-d-CrossEntropyLoss",
    "77-pad-channels-conv-ce",
    "79-slicing-twice-conv-mse",
    "80-bce-non-binary-labels-mean",
    "81-bce-binary-labels-sum",
    "82-rnn-permute-mse",
    "83-lstm-ce",
    "84-rnn-linear-permute-ce-2d",
    "85-adaptive-avg-pool-1d",
    "87-adaptive-avg-pool-3d",
    "88-batchnorm1d-eval",
    "91-batchnorm3d-linear-stack-eval",
    "92-embedding-linear-ce",
    "93-embedding-flatten-ce",
    "94-branching-linear",
    "96-nested-branching-convolution",
    "97-ResNet1",
    "98-ResNet2",
]


@functools.cache
def _reference(problem_id: str, converted: bool = False) -> dict[str, torch.Tensor]:
    expected = reference_diag_ggn(*BY_ID[problem_id].set_up(converted=converted))
    assert max(e.abs().max().item() for e in expected.values()) > 0, "trivial problem"
    return expected


@pytest.mark.parametrize("num_chunks", [1, 3])
@pytest.mark.parametrize("problem_id", SUBSET)
def test_backpack_problem(problem_id, num_chunks):
    model, loss_func, inputs, targets = BY_ID[problem_id].set_up()
    actual = ggnchunk.diag_ggn(model, loss_func, inputs, targets, num_chunks=num_chunks)
    assert_diag_close(
        actual, _reference(problem_id), rtol=1e-9, label=f"{num_chunks} chunks"
    )


@pytest.mark.parametrize("problem_id", ["97-ResNet1", "98-ResNet2"])
def test_backpack_converted_model(problem_id):
    # the torch.fx model of BackPACK's converter (SumModule, ScaleModule, ...) as it is
    model, loss_func, inputs, targets = BY_ID[problem_id].set_up(converted=True)
    actual = ggnchunk.diag_ggn(model, loss_func, inputs, targets, num_chunks=2)
    assert_diag_close(actual, _reference(problem_id, converted=True), rtol=1e-9)


@pytest.mark.parametrize(
    ("problem_id", "module"),
    [("91-batchnorm3d-linear-stack-eval", "0"), ("98-ResNet2", "bn1")],
)
def test_batchnorm_in_training_mode_is_refused(problem_id, module):
    model, loss_func, inputs, targets = BY_ID[problem_id].set_up()
    model.train()
    with pytest.raises(ValueError, match=rf"{module} \(BatchNorm\dd\) is in training mode"):
        ggnchunk.diag_ggn(model, loss_func, inputs, targets)
