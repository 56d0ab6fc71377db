"""Two CPU processes with the gloo backend give the single-process result on every rank."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import ggnchunk
from tests.integrations._distributed_worker import _variance, data, model_for, worker
from tests.reference import assert_diag_close

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


MODES = [
    "dataset", "chunk-parallel", "empty-rank", "global-chunks", "three-columns", "kron",
    "sub-batches", "accumulator-empty-rank",
    # both ranks refuse, in step
    "mismatch", "dataset-column-parallel", "different-weights", "different-inputs",
    "different-draws",
]  # fmt: skip
_OUTCOMES: dict[str, tuple[list, list[str], list]] = {}


def _run(mode: str) -> tuple[list, list[str]]:
    """Both ranks' results (or tracebacks) of ``mode``.

    The first call spawns the two ranks once for every mode (each in its own process
    group): a spawn is most of a mode's time.
    """
    if not _OUTCOMES:
        with tempfile.TemporaryDirectory() as folder:
            mp.spawn(worker, args=(2, MODES, folder), nprocs=2, join=True)
            for name in MODES:
                results, errors, passes = [], [], []
                for rank in range(2):
                    stem = Path(folder) / name / f"rank{rank}"
                    if stem.with_suffix(".err").exists():
                        errors.append(stem.with_suffix(".err").read_text())
                    else:
                        results.append(torch.load(stem.with_suffix(".pt")))
                    if stem.with_suffix(".passes").exists():
                        passes.append(torch.load(stem.with_suffix(".passes")))
                _OUTCOMES[name] = (results, errors, passes)
    results, errors, _ = _OUTCOMES[mode]
    return results, errors


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode", ["dataset", "chunk-parallel", "empty-rank", "accumulator-empty-rank"]
)
def test_two_ranks_equal_one_process(mode):
    x, y = data()
    expected = ggnchunk.diag_ggn(model_for(0, False), nn.MSELoss(), x, y)
    results, errors = _run(mode)
    assert not errors, errors[0]
    for rank, result in enumerate(results):
        assert_diag_close(result, expected, rtol=1e-5, label=f"rank {rank}")


@pytest.mark.slow
def test_num_chunks_counts_the_passes_of_all_ranks():
    x, y = data()
    expected = ggnchunk.diag_ggn(model_for(0, False), nn.MSELoss(), x, y)
    results, errors = _run("global-chunks")
    assert not errors, errors[0]
    assert len(results) == 2
    for rank, result in enumerate(results):
        assert_diag_close(result, expected, rtol=1e-5, label=f"rank {rank}")
    assert _OUTCOMES["global-chunks"][2] == [2, 2]  # 4 passes in all


@pytest.mark.slow
def test_three_columns_under_a_budget_on_two_ranks():
    x, y = data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).eval()
    expected = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y[:, :3])
    results, errors = _run("three-columns")
    assert not errors, errors[0]
    for rank, result in enumerate(results):
        assert_diag_close(result, expected, rtol=1e-5, label=f"rank {rank}")


@pytest.mark.slow
def test_ranks_with_different_models_are_refused():
    _, errors = _run("mismatch")
    assert len(errors) == 2
    assert all("disagree on the model's trainable parameters" in e for e in errors)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, words",
    [
        ("dataset-column-parallel", "diag_ggn_dataset: column_parallel=True splits one"),
        ("different-weights", "the ranks' model parameters and buffers differ"),
        ("different-inputs", "the ranks' inputs differ"),
        ("different-draws", "forward passes gave different outputs .* Seed every rank"),
    ],
)
def test_ranks_that_would_split_different_work_are_refused(mode, words):
    """Column-parallel sums are of one batch's columns: every rank holds the same work.

    They silently summed shares of different models, inputs or random draws (relative
    errors 0.34-2.3); now every rank refuses in step (no rank left waiting).
    """
    results, errors = _run(mode)
    assert not results and len(errors) == 2
    assert all(re.search(words, e.replace("\n", " ")) for e in errors), errors[0]


def test_chunk_parallel_without_a_process_group():
    x, y = data()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ggnchunk.diag_ggn(model_for(0, False), nn.MSELoss(), x, y, column_parallel=True)


@pytest.mark.slow
def test_kron_factors_on_two_ranks_equal_one_process():
    x, y = data()
    expected = ggnchunk.kron_ggn(model_for(0, False), nn.MSELoss(), x, y)
    results, errors = _run("kron")
    assert not errors, errors[0]
    for result in results:
        assert list(result) == list(expected)
        for name, (output, inputs) in result.items():
            assert torch.allclose(output, expected[name].output, rtol=1e-5, atol=1e-8)
            assert torch.allclose(inputs, expected[name].input, rtol=1e-5, atol=1e-8)


@pytest.mark.slow
def test_sub_batches_on_two_ranks_equal_one_process():
    """Per-sample diagonals and output variances: sub-batches joined before the sum."""
    x, y = data()
    model = model_for(0, False)
    per_sample = ggnchunk.diag_ggn(model, nn.MSELoss(), x, y, per_sample=True)
    variance = ggnchunk.output_variance(model, x, _variance(model))
    results, errors = _run("sub-batches")
    assert not errors, errors[0]
    for rank, result in enumerate(results):
        assert_diag_close(result["per_sample"], per_sample, rtol=1e-5, label=f"rank {rank}")
        torch.testing.assert_close(result["variance"], variance, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool,
              torch.uint8, torch.complex64],
)  # fmt: skip
def test_the_work_fingerprint_sees_every_bit_and_shape(dtype):
    from ggnchunk._distributed import _fingerprint

    torch.manual_seed(0)
    base = (torch.randn(3, 5, dtype=torch.float64) * 3).to(dtype)  # 15 elements: odd
    same = _fingerprint([base.T.contiguous().T])  # the same values, copied
    assert _fingerprint([base]) == same == _fingerprint([base.clone()])
    assert _fingerprint([base.reshape(5, 3)]) != same  # the same bits, another shape
    assert _fingerprint([base[:, :4]]) != same
    assert _fingerprint([base, base]) != same
    odd = torch.cat([base.reshape(-1)[:1], base.reshape(-1)])[1:]  # a view at offset 1
    assert _fingerprint([odd.reshape(3, 5)]) == same
    bits = base.clone().view(torch.uint8) if dtype != torch.bool else base.clone()
    flat = bits.reshape(-1)
    flat[7] = ~flat[7] if dtype == torch.bool else flat[7] ^ 1  # one bit of one value
    assert _fingerprint([bits.view(dtype) if dtype != torch.bool else bits]) != same
    swapped = base.clone().reshape(-1)
    swapped[[2, 9]] = swapped[[9, 2]]  # two values trade places
    if not torch.equal(swapped, base.reshape(-1)):
        assert _fingerprint([swapped.reshape(3, 5)]) != same
