"""Bad input gets a clear error that names the argument, before any backward pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ggnchunk
from ggnchunk._engine import GGNComputation


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


X = torch.randn(6, 4)
Y = torch.randn(6, 3)


@pytest.fixture(autouse=True)
def no_backward_pass(monkeypatch):
    """Fail any test here that reaches a backward pass: errors must come before."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a backward pass ran before the error was raised")

    monkeypatch.setattr(GGNComputation, "backward", forbidden)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"num_chunks": 2, "chunk_size": 2}, ValueError, ["num_chunks", "chunk_size"]),
        ({"num_chunks": 0}, ValueError, ["num_chunks"]),
        ({"num_chunks": -3}, ValueError, ["num_chunks"]),
        ({"num_chunks": 2.0}, TypeError, ["num_chunks"]),
        ({"num_chunks": True}, TypeError, ["num_chunks"]),
        ({"num_chunks": "4"}, TypeError, ["num_chunks"]),
        ({"chunk_size": 0}, ValueError, ["chunk_size"]),
        ({"chunk_size": 1.5}, TypeError, ["chunk_size"]),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else None,
)
def test_bad_chunk_arguments(kwargs, error, words):
    with pytest.raises(error) as info:
        ggnchunk.diag_ggn(_mlp(), nn.MSELoss(), X, Y, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_mse_targets_of_other_shape():
    with pytest.raises(ValueError, match=r"targets have shape \(6, 3, 1\).*\(6, 3\)"):
        ggnchunk.diag_ggn(_mlp(), nn.MSELoss(), X, Y[..., None])


def test_batch_sizes_differ():
    with pytest.raises(ValueError, match="targets has shape .* batch size 6"):
        ggnchunk.diag_ggn(_mlp(), nn.MSELoss(), X, Y[:5])


def test_cross_entropy_targets_of_wrong_shape():
    with pytest.raises(ValueError, match=r"class indices of shape \(6, 3\)"):
        ggnchunk.diag_ggn(_mlp(), nn.CrossEntropyLoss(), X, torch.zeros(6, 3).long())


def test_loss_that_is_not_a_loss():
    with pytest.raises(TypeError, match="loss_func must be a loss module"):
        ggnchunk.diag_ggn(_mlp(), "mse", X, Y)


def test_loss_failing_on_the_targets_names_them():
    with pytest.raises(ValueError, match=r"loss_func \(NLLLoss\) fails .* targets"):
        ggnchunk.diag_ggn(_mlp(), nn.NLLLoss(), X, Y)


def test_mean_loss_function_gets_a_hint():
    with pytest.raises(ValueError, match="taken as a sum over samples"):
        ggnchunk.diag_ggn(_mlp(), nn.functional.mse_loss, X, Y)


@pytest.mark.parametrize(
    "loss_func", [nn.MSELoss(reduction="none"), nn.CrossEntropyLoss(reduction="none")]
)
def test_reduction_none(loss_func):
    with pytest.raises(ValueError, match="reduction='none'.*reduction='mean'"):
        ggnchunk.diag_ggn(_mlp(), loss_func, X, Y)


def test_negative_class_weights():
    with pytest.raises(ValueError, match="loss_func.weight"):
        ggnchunk.diag_ggn(
            _mlp(), nn.CrossEntropyLoss(weight=torch.tensor([1.0, -1, 1])), X, Y
        )


def test_a_class_weight_in_another_dtype_is_named_with_the_fix():
    """A float32 class weight beside a float64 model is named, with the fix.

    Found by a helper's hunt: the message blamed the targets' shape and dtype, and ran
    into the next sentence.
    """
    model = nn.Linear(4, 3).double()
    x, y = torch.randn(2, 4, dtype=torch.float64), torch.tensor([0, 2])
    loss_func = nn.CrossEntropyLoss(weight=torch.rand(3))
    with pytest.raises(ValueError, match=r"Float\. loss_func holds tensors") as info:
        ggnchunk.diag_ggn(model, loss_func, x, y)
    assert "weight (torch.float32, cpu)" in str(info.value)
    assert "loss_func.to(dtype=torch.float64" in str(info.value)


class _BatchCenter(nn.Module):
    """Mixes samples: not a per-sample function."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


def test_layer_that_mixes_samples_is_refused():
    model = nn.Sequential(nn.Linear(4, 5), _BatchCenter(), nn.Linear(5, 3))
    with pytest.raises(
        ValueError, match=r"samples of the batch influence each other.*model\.0"
    ):
        ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y)


def test_batchnorm_in_training_mode():
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)).train()
    with pytest.raises(ValueError, match=r"model\.1 \(BatchNorm1d\) is in training mode"):
        ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y)
    assert model.training


def test_model_without_trainable_parameters():
    model = _mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        ggnchunk.diag_ggn(model, nn.MSELoss(), X, Y)


def test_empty_batch():
    with pytest.raises(ValueError, match="inputs has shape \\(0, 4\\): the batch is empty"):
        ggnchunk.diag_ggn(_mlp(), nn.MSELoss(), X[:0], Y[:0])


def test_inputs_on_another_device():
    with pytest.raises(ValueError, match="inputs is on meta but the model is on cpu"):
        ggnchunk.diag_ggn(_mlp(), nn.MSELoss(), X.to("meta"), Y)


def test_inputs_of_another_dtype():
    with pytest.raises(ValueError, match="inputs has dtype torch.float64"):
        ggnchunk.diag_ggn(_mlp(), nn.MSELoss(), X.double(), Y)


def test_inputs_not_a_tensor():
    with pytest.raises(TypeError, match="inputs must be a torch.Tensor"):
        ggnchunk.diag_ggn(_mlp(), nn.MSELoss(), X.tolist(), Y)


def test_model_not_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ggnchunk.diag_ggn(lambda x: x, nn.MSELoss(), X, Y)


def test_inference_mode():
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        ggnchunk.diag_ggn(_mlp(), nn.MSELoss(), X, Y)
