"""The real-model table and every entry point on CUDA, in float64, against the CPU.

The real-model table is compared with the float64 brute force of ``tests/reference.py``
run on CUDA (a model's float64 arithmetic differs between devices); the rest with the
brute force on the CPU (or, for the Laplace backend and the optimizer, whose CPU
results the CPU suite holds to the brute force, with the same computation on the CPU).
Skipped without a CUDA device; ``python -m tools.gpu_check`` runs them.
"""

from __future__ import annotations

import copy
import functools
import socket

import pytest
import torch
from torch import nn

import ggnchunk
from tests.real_models import BY_ID
from tests.reference import assert_diag_close, recorded_draws, reference_diag_ggn

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")

# the table: torchvision, VAE noise, (x, t) U-Net, dict inputs, tied weights,
# transformers, and the conv autoencoder with output padding
TABLE = [
    "tv-resnet18-partly-frozen", "tv-squeezenet1_0", "tv-mobilenet_v3_small",
    "vae-randn-mse", "vae-randn-bce-sum", "dropout-train-residual", "time-unet-x-t",
    "dict-inputs-mask-prototypes", "tied-functional-weight-t", "shared-dec-weight",
    "transformer-encoder-layer", "multihead-attention", "embedding-layernorm",
    "lstm-tuple-into-block", "conv-autoencoder-28-output-padding",
    "segmenter-upsample-pixel-ce",
]  # fmt: skip
CHUNKINGS = {
    "onepass": {},
    "chunks3": {"num_chunks": 3},
    "budget": {"max_memory": "256MiB"},
}


def to(value, device):
    """Tensors (nested in tuples, lists, dicts) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to(v, device) for k, v in value.items()}
    return value


def _brute_force_on_cuda(*args) -> dict[str, torch.Tensor]:
    """The float64 brute force on CUDA, without cuDNN.

    torch.func cannot batch cuDNN's LSTM backward ("Cannot access data pointer of
    Tensor that doesn't have storage", H200, torch 2.11); mobilenet_v3_small's brute
    force is the same with cuDNN and without.
    """
    with torch.backends.cudnn.flags(enabled=False):
        return reference_diag_ggn(*args)


@functools.cache
def _expected(case_id: str) -> dict[str, torch.Tensor]:
    problem = BY_ID[case_id].make()
    return _brute_force_on_cuda(
        copy.deepcopy(problem.model).to(CUDA), copy.deepcopy(problem.loss_func).to(CUDA),
        to(problem.inputs, CUDA), problem.targets.to(CUDA),
    )  # fmt: skip


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("case_id", TABLE)
def test_real_models_on_cuda_match_a_brute_force_on_cuda(case_id, chunking):
    """Against the float64 brute force on the same device.

    Not the CPU's: a model's float64 arithmetic on CUDA differs from the CPU's, and
    the GGN with it (the H200 run of 2026-11-30: on mobilenet_v3_small the brute force
    on CUDA differs from the one on the CPU by 3e-7 of a parameter's largest entry on
    1,134 entries, with cuDNN and without; ggnchunk on CUDA differs from the CPU's brute
    force by exactly that, and from the one on CUDA by 5e-15).
    """
    if case_id not in BY_ID:
        pytest.fail(f"{case_id} is no longer in tests/real_models.py: update TABLE")
    cpu = BY_ID[case_id].make()
    model = copy.deepcopy(cpu.model).to(CUDA)
    loss_func = copy.deepcopy(cpu.loss_func).to(CUDA)
    inputs, targets = to(cpu.inputs, CUDA), cpu.targets.to(CUDA)
    torch.manual_seed(1234)
    actual = ggnchunk.diag_ggn(model, loss_func, inputs, targets, **CHUNKINGS[chunking])
    assert all(v.device.type == CUDA.type and v.dtype == torch.float64
               for v in actual.values())  # fmt: skip
    if "random" in BY_ID[case_id].tags:  # the draws of the call, replayed
        expected = _brute_force_on_cuda(model, loss_func, inputs, targets,
                                        recorded_draws(model))  # fmt: skip
    else:
        expected = _expected(case_id)
    assert_diag_close(actual, expected, rtol=1e-9, label=f"cuda {case_id} {chunking}")


def _conv_problem(dtype=torch.float64, n: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.Tanh(), nn.Conv2d(6, 4, 3, stride=2),
        nn.Flatten(), nn.Linear(4 * 3 * 3, 5),
    ).to(dtype).eval()  # fmt: skip
    x = torch.randn(n, 3, 8, 8, dtype=dtype)
    y = torch.randn(n, 5, dtype=dtype)
    return model, x, y


def test_kron_ggn_on_cuda_matches_the_cpu_brute_force():
    from tests.reference import reference_kron

    model, x, y = _conv_problem()
    loss_func = nn.MSELoss()
    expected = reference_kron(model, loss_func, x, y)
    cuda = copy.deepcopy(model).to(CUDA)
    for options in ({}, {"num_chunks": 3}, {"max_memory": "64MiB"},
                    {"batch_chunk_size": 3, "num_chunks": 2}):  # fmt: skip
        got = ggnchunk.kron_ggn(cuda, loss_func, x.to(CUDA), y.to(CUDA), **options)
        assert list(got) == list(expected)
        overall = max(t.abs().max().item() for f in expected.values() for t in f
                      if t is not None)  # fmt: skip
        for name, (g, a) in expected.items():
            for what, value, exp in (("output", got[name].output, g),
                                     ("input", got[name].input, a)):  # fmt: skip
                assert value.device.type == CUDA.type
                err = (value.cpu().double() - exp).abs().max().item()
                scale = max(exp.abs().max().item(), 1e-3 * overall)
                assert err <= 1e-9 * scale, f"{options} {name}.{what}: {err:.3e}"


def test_per_sample_on_cuda_matches_the_brute_force_of_each_sample():
    model, x, y = _conv_problem()
    loss_func = nn.MSELoss(reduction="sum")  # each sample's GGN is its own loss's
    cuda = copy.deepcopy(model).to(CUDA)
    actual = ggnchunk.diag_ggn(cuda, loss_func, x.to(CUDA), y.to(CUDA), per_sample=True,
                               num_chunks=2)  # fmt: skip
    for n in range(x.shape[0]):
        expected = reference_diag_ggn(model, loss_func, x[n : n + 1], y[n : n + 1])
        assert_diag_close({k: v[n] for k, v in actual.items()}, expected, rtol=1e-9,
                          label=f"sample {n}")  # fmt: skip


def test_loss_gradient_and_diagonal_on_cuda():
    model, x, y = _conv_problem()
    loss_func = nn.MSELoss()
    cuda = copy.deepcopy(model).to(CUDA)
    loss, grad, diag = ggnchunk.loss_grad_and_diag_ggn(
        cuda, loss_func, x.to(CUDA), y.to(CUDA), num_chunks=3
    )
    assert_diag_close(diag, reference_diag_ggn(model, loss_func, x, y), rtol=1e-9)
    reference_loss = loss_func(model(x), y)
    expected = dict(zip([n for n, _ in model.named_parameters()],
                        torch.autograd.grad(reference_loss, list(model.parameters())),
                        strict=True))  # fmt: skip
    assert_diag_close(grad, expected, rtol=1e-10, label="gradient")
    assert abs(loss.item() - reference_loss.item()) <= 1e-12 * abs(reference_loss.item())


def test_laplace_backend_on_cuda_equals_the_cpu_backend():
    laplace = pytest.importorskip("laplace")
    from torch.utils.data import DataLoader, TensorDataset

    from ggnchunk.laplace import ChunkedGGN

    def fit(device):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
        torch.manual_seed(0)
        x, y = torch.randn(20, 5, dtype=torch.float64), torch.randn(20, 3).double()
        loader = DataLoader(TensorDataset(x.to(device), y.to(device)), batch_size=6)
        la = laplace.Laplace(model.to(device), "regression", subset_of_weights="all",
                             hessian_structure="diag", backend=ChunkedGGN,
                             backend_kwargs={"num_chunks": 2})  # fmt: skip
        la.fit(loader)
        return la

    cpu, cuda = fit("cpu"), fit(CUDA)
    assert cuda.H.device.type == CUDA.type
    scale = cpu.H.abs().max()
    assert (cuda.H.cpu() - cpu.H).abs().max() <= 1e-10 * scale
    assert torch.allclose(cuda.loss.cpu(), cpu.loss, rtol=1e-10)


def test_optimizer_on_cuda_follows_the_cpu_steps():
    from ggnchunk.optim import DiagGGNOptimizer

    def train(device):
        model, x, y = _conv_problem()
        model = model.to(device)
        opt = DiagGGNOptimizer(model.named_parameters(), lr=0.3, damping=1e-3)
        closure = opt.closure(model, nn.MSELoss(), x.to(device), y.to(device),
                              num_chunks=2)  # fmt: skip
        losses = [opt.step(closure).item() for _ in range(5)]
        return losses, [p.detach().cpu() for p in model.parameters()]

    cpu_losses, cpu_params = train("cpu")
    cuda_losses, cuda_params = train(CUDA)
    assert cuda_losses == pytest.approx(cpu_losses, rel=1e-9)
    for a, b in zip(cuda_params, cpu_params, strict=True):
        assert (a - b).abs().max() <= 1e-9 * b.abs().max()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
    reason="needs torch.distributed with nccl",
)
def test_distributed_and_the_dataset_loop_on_a_one_rank_nccl_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    model, x, y = _conv_problem(n=9)
    loss_func = nn.MSELoss(reduction="sum")
    expected = reference_diag_ggn(model, loss_func, x, y)
    cuda = copy.deepcopy(model).to(CUDA)
    xc, yc = x.to(CUDA), y.to(CUDA)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)  # fmt: skip
    try:
        for options in ({"num_chunks": 3}, {"max_memory": "64MiB"}):
            actual = ggnchunk.diag_ggn(
                cuda, loss_func, xc, yc, column_parallel=True, **options
            )
            assert_diag_close(actual, expected, rtol=1e-9, label=f"distributed {options}")
        batches = [(xc[i : i + 4], yc[i : i + 4]) for i in range(0, 9, 4)]
        actual = ggnchunk.diag_ggn_dataset(cuda, loss_func, batches, progress=False,
                                           num_chunks=2)  # fmt: skip
        assert_diag_close(actual, expected, rtol=1e-9, label="dataset loop")
        cpu_batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 9, 4)]
        actual = ggnchunk.diag_ggn_dataset(cuda, loss_func, cpu_batches, progress=False)
        assert_diag_close(actual, expected, rtol=1e-9, label="dataset loop, CPU batches")
    finally:
        dist.destroy_process_group()


WINDOWED = [
    "tutorial-ae", "outpad-ae", "dilation-groups-same", "convT-dilation-stride3",
    "reflect", "conv1d", "conv3d", "skips-groupnorm-avg-nearest",
    "skips-maxpool-bilinear", "layernorm-instancenorm", "attention-bottleneck",
    "groupnorm-after-convT",
]  # fmt: skip


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # the model's
@pytest.mark.parametrize("patches", [True, False], ids=["patches", "grouped"])
@pytest.mark.parametrize("name", WINDOWED)
def test_windowed_columns_on_cuda(name, patches, monkeypatch):
    """The windows table's models with every column on its box, on the GPU.

    Box starts live on the device of the vectors: index arithmetic with per-axis
    tensors made on the CPU fails there (the CPU suite cannot see it).
    """
    from ggnchunk import _windows
    from ggnchunk._rules import conv
    from tests.rules import test_windows as table

    monkeypatch.setattr(_windows, "ENABLED", True)
    monkeypatch.setattr(_windows, "MIN_POSITIONS", 0)
    monkeypatch.setattr(_windows, "TRIAL", False)
    monkeypatch.setattr(conv, "PATCHES", patches)
    model, loss_func, x, targets = table._problem(name, "mse")
    expected = table._expected(name, "mse")
    diag, report = ggnchunk.diag_ggn(
        model.to(CUDA), loss_func, x.to(CUDA), targets.to(CUDA), num_chunks=3,
        return_report=True,
    )  # fmt: skip
    assert report.windowed
    actual = {k: v.cpu() for k, v in diag.items()}
    assert_diag_close(actual, expected, rtol=1e-9, label=f"{name} on CUDA")


@pytest.mark.parametrize(
    "case",
    ["tiny-gpt", "relative-position-bias", "encoder-batch-first-frozen-attention",
     "frozen-norms-conv", "resnet18-frozen-backbone"],
)  # fmt: skip
def test_folded_glue_and_attention_take_all_columns_at_once_on_cuda(case, monkeypatch):
    """No per-column loop on the GPU either, and exact against the CPU brute force.

    Autograd runs a CUDA graph's backward on a device thread, not the calling one: what
    the engine's batched backward tells the folded nodes must reach that thread (the
    CPU suite, whose backward runs in the calling thread, cannot see it).
    """
    import warnings

    from ggnchunk._graph import readers
    from tests.rules import test_frozen_attention as table
    from tools.gpu_budgets import folded_paths

    # the relative bias table's gather crossed by its folded node (read as a lookup by
    # default, it is not run: nothing is folded there, on the CPU too)
    monkeypatch.setattr(readers, "READ_PARTS", False)
    cpu = table._make(case)
    model = copy.deepcopy(cpu.model).to(CUDA)
    loss_func = copy.deepcopy(cpu.loss_func).to(CUDA)
    with folded_paths() as folded, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = ggnchunk.diag_ggn(
            model, loss_func, to(cpu.inputs, CUDA), cpu.targets.to(CUDA), num_chunks=2
        )
    slow = [str(w.message) for w in caught if w.category is ggnchunk.SlowBackwardWarning]
    assert slow == [], slow
    assert all(folded), "folded glue ran column by column (on the device thread?)"
    assert folded or case not in {"relative-position-bias", "resnet18-frozen-backbone"}
    actual = {k: v.cpu() for k, v in actual.items()}
    assert_diag_close(actual, table._expected(case), rtol=1e-9, label=f"{case} on CUDA")
