"""Float32 means full float32: TF32 (and bf16) switched off for the call, then restored.

cuDNN's default runs float32 convolutions in TF32 on Ampere and later GPUs (results change
at the 1e-3 level). ggnchunk computes its call, forward pass included, in full float32 and
restores the user's settings afterwards. The switching is checked on the CPU (the settings
exist on CPU builds too); the numbers on a GPU (skipped without one).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ggnchunk
from ggnchunk._engine import _FP32_PRECISION, _backend, full_float32
from tests.reference import assert_diag_close, reference_diag_ggn

NEW_API = any(_backend(path) is not None for path in _FP32_PRECISION)


def precision_settings() -> dict[str, object]:
    """The settings the call switches, read with the API this torch build uses."""
    if NEW_API:
        return {path: _backend(path).fp32_precision for path in _FP32_PRECISION
                if _backend(path) is not None}  # fmt: skip
    return {
        "matmul": torch.get_float32_matmul_precision(),
        "cudnn": torch.backends.cudnn.allow_tf32,
    }


def reduced_precision() -> None:
    """What a user who wants speed sets: TF32 matmuls and convolutions (bf16 on CPU)."""
    if NEW_API:
        for path in _FP32_PRECISION:
            node = _backend(path)
            if node is not None:
                node.fp32_precision = "bf16" if path.startswith("mkldnn") else "tf32"
    else:
        torch.set_float32_matmul_precision("medium")
        torch.backends.cudnn.allow_tf32 = True


def full_precision_values() -> dict[str, object]:
    if NEW_API:
        return dict.fromkeys(precision_settings(), "ieee")
    return {"matmul": "highest", "cudnn": False}


@pytest.fixture
def user_settings():
    """The user's reduced-precision settings for the test; the originals restored."""
    before = precision_settings()
    reduced_precision()
    try:
        yield precision_settings()
    finally:
        if NEW_API:
            for path, value in before.items():
                _backend(path).fp32_precision = value
        else:
            torch.set_float32_matmul_precision(before["matmul"])
            torch.backends.cudnn.allow_tf32 = before["cudnn"]


class Recorder(nn.Module):
    """A conv model that records the precision settings its forward pass runs with."""

    def __init__(self, fail: type[BaseException] | None = None):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.seen: list[dict[str, object]] = []
        self.fail = fail

    def forward(self, x):
        self.seen.append(precision_settings())
        if self.fail is not None:
            raise self.fail("stop")
        return self.conv(x)


def test_call_runs_in_full_float32_and_restores_the_users_settings(user_settings):
    assert user_settings != full_precision_values(), "the fixture set nothing to switch"
    model = Recorder()
    x = torch.randn(3, 2, 5, 5)
    ggnchunk.diag_ggn(model, nn.MSELoss(), x, torch.randn(3, 3, 5, 5), num_chunks=2)
    assert model.seen == [full_precision_values()]
    assert precision_settings() == user_settings


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_settings_restored_after_an_exception(user_settings, error):
    model = Recorder(fail=error)
    x = torch.randn(3, 2, 5, 5)
    with pytest.raises(error):
        ggnchunk.diag_ggn(model, nn.MSELoss(), x, torch.randn(3, 3, 5, 5))
    assert model.seen == [full_precision_values()]
    assert precision_settings() == user_settings


def test_nested_and_overlapping_uses_restore_once_at_the_end(user_settings):
    outer, inner = full_float32(), full_float32()
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # another thread's call ending first
    assert precision_settings() == full_precision_values(), "switched back too early"
    inner.__exit__(None, None, None)
    assert precision_settings() == user_settings


def test_kron_and_gradient_entry_points_run_in_full_float32(user_settings):
    """Every entry point goes through the one wrapped evaluation."""
    model = Recorder()
    x, y = torch.randn(4, 2, 5, 5), torch.randn(4, 3, 5, 5)
    ggnchunk.kron_ggn(model, nn.MSELoss(), x, y)
    ggnchunk.loss_grad_and_diag_ggn(model, nn.MSELoss(), x, y)
    assert model.seen == [full_precision_values()] * 2
    assert precision_settings() == user_settings


# -- on a GPU -------------------------------------------------------------------------


def _conv_problem():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.Tanh(), nn.Conv2d(16, 16, 3, padding=1),
        nn.Sigmoid(), nn.ConvTranspose2d(16, 3, 3, padding=1),
    ).eval()  # fmt: skip
    x = torch.rand(6, 3, 16, 16)
    return model, x


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_float32_matches_float64_at_float32_precision(user_settings):
    """With TF32 allowed by the user, float32 on CUDA still matches float64 to ~1e-5."""
    model, x = _conv_problem()
    expected = reference_diag_ggn(model, nn.MSELoss(), x, x)  # float64 on a copy
    cuda = copy.deepcopy(model).float().cuda()
    xc = x.float().cuda()
    for kwargs in ({}, {"num_chunks": 7}, {"max_memory": "64MiB"}):
        actual = ggnchunk.diag_ggn(cuda, nn.MSELoss(), xc, xc, **kwargs)
        actual = {k: v.double().cpu() for k, v in actual.items()}
        # TF32 (10-bit mantissa) would be off by ~1e-3; full float32 by ~1e-6
        assert_diag_close(actual, expected, rtol=1e-4, label=f"float32 cuda {kwargs}")
    assert precision_settings() == user_settings


def test_legacy_flags_where_torch_has_no_per_backend_settings():
    """Torch < 2.9: the legacy flags (run in a fresh process: torch refuses mixed reads)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import torch, ggnchunk._engine as engine\n"
        "engine._backend = lambda path: None\n"
        "torch.set_float32_matmul_precision('medium')\n"
        "torch.backends.cudnn.allow_tf32 = True\n"
        "state = lambda: (torch.get_float32_matmul_precision(),\n"
        "                 torch.backends.cuda.matmul.allow_tf32,\n"
        "                 torch.backends.cudnn.allow_tf32)\n"
        "inside = []\n"
        "try:\n"
        "    with engine.full_float32():\n"
        "        inside.append(state())\n"
        "        raise KeyboardInterrupt\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"
        "print(repr([inside[0], state()]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    import ast

    inside, after = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert inside == ("highest", False, False)
    assert after == ("medium", True, True)
