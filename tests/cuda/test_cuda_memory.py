"""Budgets, growth, out-of-memory recovery and clean-up, measured by the CUDA allocator.

Skipped without a CUDA device; ``python -m tools.gpu_check`` runs them.

The peak of a call is ``max_memory_allocated`` above ``memory_allocated`` before the call.
ggnchunk's scheduler resets the allocator's peak statistics around each chunk it
measures, so :func:`call_peak` records the peak just before every reset and takes the
largest: the peak of the whole call, forward pass included. First calls run in a fresh
process (``python -c`` calling :func:`first_call_worker`), warm calls in this one.
"""

from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ggnchunk
from ggnchunk import MemoryBudgetError, OutOfMemoryRecoveryWarning

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20
# benchmark problems at GPU batch sizes: (name, scale, budget as a share of one pass)
BUDGETED = [
    ("tutorial_conv_ae", 4, 0.2), ("conv_ae_28", 4, 0.2), ("conv_ae_28_outpad", 4, 0.2),
    ("unet_32", 1, 0.3), ("resnet18", 4, 0.6),
]  # fmt: skip
FEW_COLUMNS = {"resnet18"}  # 10 columns: one column may not fit a small share


@contextlib.contextmanager
def call_peak(device: str = "cuda"):
    """Yield a dict that holds ``peak`` (bytes above the level before) after the block.

    Wraps ``torch.cuda.reset_peak_memory_stats`` for the block so that the peak reached
    before each reset (the scheduler resets around every measured chunk) is kept.
    """
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    peaks: list[int] = []
    original = torch.cuda.reset_peak_memory_stats

    def reset(*args, **kwargs):
        peaks.append(torch.cuda.max_memory_allocated(device))
        original(*args, **kwargs)

    original(device)
    torch.cuda.reset_peak_memory_stats = reset
    record: dict[str, int] = {"before": before}
    try:
        yield record
    finally:
        torch.cuda.reset_peak_memory_stats = original
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device))
        record["peak"] = max(peaks) - before


def _problem(name: str, scale: int, dtype=torch.float32):
    from benchmarks.problems import build

    model, loss_func, x, y = build(name, "cuda", scale=scale)
    model = model.to(dtype)
    x = x.to(dtype) if x.is_floating_point() else x
    y = y.to(dtype) if y.is_floating_point() else y
    return model, loss_func, x, y


def one_pass_peak(name: str, scale: int) -> int:
    """Bytes the one-pass call adds (a warm call: kernels and workspaces set up)."""
    model, loss_func, x, y = _problem(name, scale)
    ggnchunk.diag_ggn(model, loss_func, x, y)
    gc.collect()
    with call_peak() as record:
        result = ggnchunk.diag_ggn(model, loss_func, x, y)
    del result
    return record["peak"]


def budgeted_call(name: str, scale: int, budget: int, warm: bool) -> dict:
    """One budgeted call: its peak, passes, chunk sizes and error against 7 chunks."""
    model, loss_func, x, y = _problem(name, scale)
    if warm:
        ggnchunk.diag_ggn(model, loss_func, x[:2], y[:2], num_chunks=2)
    gc.collect()
    try:
        with call_peak() as record, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            diag, report = ggnchunk.diag_ggn(
                model, loss_func, x, y, max_memory=budget, return_report=True
            )
    except MemoryBudgetError as error:
        return {"refused": str(error)}
    reference = ggnchunk.diag_ggn(model, loss_func, x, y, num_chunks=7)
    error = max(
        float((diag[k] - reference[k]).abs().max() / reference[k].abs().max().clamp_min(
            1e-30))
        for k in diag
    )  # fmt: skip
    schedule = report.schedules[0]
    return {
        "peak": record["peak"], "setup": report.setup_bytes,
        "passes": report.num_passes, "error": error,
        "sizes": [c.stop - c.start for c in schedule.chunks],
        "chunk_peaks": [c.peak_extra_bytes for c in schedule.chunks],
        "warnings": [str(w.message) for w in caught],
    }  # fmt: skip


def first_call_worker(name: str, scale: int, budget: int) -> None:
    """In a fresh process: the first budgeted call, printed as JSON (last line)."""
    print(json.dumps(budgeted_call(name, scale, budget, warm=False)))


def _first_call(name: str, scale: int, budget: int) -> dict:
    code = (
        "from tests.cuda.test_cuda_memory import first_call_worker; "
        f"first_call_worker({name!r}, {scale}, {budget})"
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("call", ["first", "warm"])
@pytest.mark.parametrize(("name", "scale", "share"), BUDGETED)
def test_the_allocator_peak_stays_within_the_budget(name, scale, share, call):
    budget = int(share * one_pass_peak(name, scale))
    if call == "first":
        record = _first_call(name, scale, budget)
    else:
        record = budgeted_call(name, scale, budget, warm=True)
    if "refused" in record:
        assert name in FEW_COLUMNS, record["refused"]  # one column did not fit: refused
        return
    label = f"{name} {call}: budget {budget / MiB:.1f} MiB, {record}"
    # the one-time set-up is paid before the call's baseline (cuBLAS's workspaces: 32 MiB
    # per handle on a Hopper GPU), and the report says how much it kept
    assert record["peak"] - record["setup"] <= budget, label
    assert record["passes"] > 1 or name in FEW_COLUMNS, label
    assert record["error"] < 1e-5, label
    assert not any("above the" in w for w in record["warnings"]), label


@pytest.mark.parametrize("name", ["tutorial_conv_ae", "conv_ae_28"])
def test_chunks_grow_from_measurements_but_never_past_the_budget(name):
    """Sizes grow from measured peaks (no bound sees cuDNN's workspaces), within budget."""
    budget = int(0.2 * one_pass_peak(name, 4))
    record = budgeted_call(name, 4, budget, warm=True)
    sizes, peaks = record["sizes"], record["chunk_peaks"]
    planned = sizes[1]  # the first index runs alone; measured growth follows
    assert max(sizes) > planned, f"no growth: {record}"
    assert all(p <= budget for p in peaks), record
    assert record["peak"] <= budget, record


def test_recovers_from_a_real_out_of_memory_error_exactly():
    from tests.reference import assert_diag_close, reference_diag_ggn

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.ConvTranspose2d(8, 1, 4, stride=2, padding=1),
    ).double()  # fmt: skip
    x = torch.rand(4, 1, 28, 28, dtype=torch.float64)
    loss_func = torch.nn.MSELoss()
    expected = reference_diag_ggn(model, loss_func, x, x)
    cuda, xc = model.cuda(), x.cuda()
    ggnchunk.diag_ggn(cuda, loss_func, xc, xc, num_chunks=4)  # kernels, workspaces
    with call_peak() as record:
        ggnchunk.diag_ggn(cuda, loss_func, xc, xc)
    one_pass = record["peak"]
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    cap = torch.cuda.memory_allocated() + 0.3 * one_pass + 8 * MiB
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):  # the one pass cannot fit
            ggnchunk.diag_ggn(cuda, loss_func, xc, xc, recover_oom=False)
        gc.collect()
        torch.cuda.empty_cache()
        with pytest.warns(OutOfMemoryRecoveryWarning) as caught:
            actual, report = ggnchunk.diag_ggn(
                cuda, loss_func, xc, xc, num_chunks=1, return_report=True
            )
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert report.schedules[0].out_of_memory_splits > 0
    assert report.num_passes > 1
    assert f"chunk_size={report.chunk_size}" in str(caught[0].message)
    assert_diag_close(actual, expected, rtol=1e-10, label="after out-of-memory splits")


def _small_problem():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Sigmoid(),
        torch.nn.ConvTranspose2d(8, 3, 3, padding=1),
    ).cuda()  # fmt: skip
    x = torch.rand(8, 3, 16, 16, device="cuda")
    return model, x


@pytest.mark.parametrize(
    "options",
    [{}, {"num_chunks": 5}, {"max_memory": "64MiB"}, {"chunk_size": "auto"},
     {"batch_chunk_size": 3, "num_chunks": 2}, {"per_sample": True}],
    ids=lambda o: ",".join(o) or "one_pass",
)  # fmt: skip
def test_nothing_is_left_on_the_device_after_a_call(options):
    model, x = _small_problem()
    loss_func = torch.nn.MSELoss()
    ggnchunk.diag_ggn(model, loss_func, x, x, **options)  # one-time set-up
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    result = ggnchunk.diag_ggn(model, loss_func, x, x, **options)
    held = torch.cuda.memory_allocated() - before
    assert held >= sum(v.numel() * v.element_size() for v in result.values())
    del result
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before, options


def test_nothing_is_left_on_the_device_after_a_failed_call():
    model, x = _small_problem()
    loss_func = torch.nn.MSELoss()
    ggnchunk.diag_ggn(model, loss_func, x, x, num_chunks=2)
    gc.collect()
    before = torch.cuda.memory_allocated()

    def fail(*_):
        raise KeyboardInterrupt

    handle = model[2].register_forward_hook(fail)
    try:
        with pytest.raises(KeyboardInterrupt):
            ggnchunk.diag_ggn(model, loss_func, x, x, num_chunks=2)
    finally:
        handle.remove()
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
