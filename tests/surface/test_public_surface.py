"""The public surface: one ChunkOptions for every entry point, names, reprs, exports."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

import ggnchunk
from ggnchunk._api import ChunkOptions
from tests.reference import assert_diag_close, reference_diag_ggn

FIELDS = [f.name for f in dataclasses.fields(ChunkOptions)]


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4))
    x, y = torch.randn(7, 3), torch.randn(7, 4)
    return model, nn.MSELoss(), x, y


def _entry_points():
    from ggnchunk.laplace import ChunkedGGN

    return {
        "diag_ggn": ggnchunk.diag_ggn,
        "kron_ggn": ggnchunk.kron_ggn,
        "loss_grad_and_diag_ggn": ggnchunk.loss_grad_and_diag_ggn,
        "diag_ggn_dataset": ggnchunk.diag_ggn_dataset,
        "DiagGGNAccumulator": ggnchunk.DiagGGNAccumulator,
        "ChunkedGGN": ChunkedGGN,
        "output_variance": ggnchunk.output_variance,
    }


@pytest.mark.parametrize("name", list(_entry_points()))
def test_every_entry_point_takes_options_and_the_fields_as_keywords(name):
    entry = _entry_points()[name]
    params = inspect.signature(entry).parameters
    assert params["options"].default is None
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    # the keywords are defined once, in ChunkOptions (the dataset's own progress is its
    # bar over batches; ChunkOptions(progress=True) there is the bar within a batch)
    own = {"progress"} if name == "diag_ggn_dataset" else set()
    assert set(FIELDS) & set(params) == own
    doc = inspect.getdoc(entry)
    assert "ChunkOptions" in doc and "options" in doc


@pytest.mark.parametrize(
    "chunking",
    [{"num_chunks": 3}, {"chunk_size": 2, "batch_chunk_size": 4}, {"max_memory": "512MiB"}],
)
def test_options_object_equals_keywords_and_the_reference(chunking):
    model, loss_func, x, y = _problem()
    expected = reference_diag_ggn(model, loss_func, x, y)
    by_keywords = ggnchunk.diag_ggn(model, loss_func, x, y, **chunking)
    by_options = ggnchunk.diag_ggn(model, loss_func, x, y, options=ChunkOptions(**chunking))
    assert_diag_close(by_options, expected, rtol=1e-5)
    for name in expected:
        assert torch.equal(by_options[name], by_keywords[name]), name
    *_, diag = ggnchunk.loss_grad_and_diag_ggn(
        model, loss_func, x, y, options=ChunkOptions(**chunking)
    )
    assert_diag_close(diag, expected, rtol=1e-5)
    data = [(x[:4], y[:4]), (x[4:], y[4:])]
    whole = ggnchunk.diag_ggn_dataset(
        model, nn.MSELoss(reduction="sum"), data, progress=False,
        options=ChunkOptions(**chunking),
    )  # fmt: skip
    assert_diag_close(
        whole, reference_diag_ggn(model, nn.MSELoss(reduction="sum"), x, y), rtol=1e-5
    )


def test_kron_and_accumulator_take_options():
    model, loss_func, x, y = _problem()
    a = ggnchunk.kron_ggn(model, loss_func, x, y, options=ChunkOptions(num_chunks=2))
    b = ggnchunk.kron_ggn(model, loss_func, x, y, num_chunks=2)
    for name in a:
        assert torch.equal(a[name].output, b[name].output)
        assert torch.equal(a[name].input, b[name].input)
    acc = ggnchunk.DiagGGNAccumulator(model, loss_func, options=ChunkOptions(num_chunks=2))
    acc.update(x, y)
    assert_diag_close(acc.compute(), reference_diag_ggn(model, loss_func, x, y), rtol=1e-5)


@pytest.mark.parametrize("name", list(_entry_points()))
def test_conflicts_and_unknown_keywords_are_refused(name):
    model, loss_func, x, y = _problem()
    entry = _entry_points()[name]
    if name == "ChunkedGGN":
        call = lambda **kw: entry(model, "regression", **kw)  # noqa: E731
    elif name == "DiagGGNAccumulator":
        call = lambda **kw: entry(model, loss_func, **kw)  # noqa: E731
    elif name == "diag_ggn_dataset":
        call = lambda **kw: entry(model, loss_func, [(x, y)], progress=False, **kw)  # noqa: E731
    elif name == "output_variance":
        s = torch.full((sum(p.numel() for p in model.parameters()),), 0.1)
        call = lambda **kw: entry(model, x, s, **kw)  # noqa: E731
    else:
        call = lambda **kw: entry(model, loss_func, x, y, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="num_chunks=3 vs 2"):
        call(options=ChunkOptions(num_chunks=2), num_chunks=3)
    with pytest.raises(TypeError, match="unknown keyword.*chunks"):
        call(chunks=3)
    with pytest.raises(TypeError, match="options must be a ggnchunk.ChunkOptions"):
        call(options={"num_chunks": 2})
    call(options=ChunkOptions(num_chunks=2), num_chunks=2)  # agreeing is fine


def test_distributed_is_a_deprecated_name_of_column_parallel():
    model, loss_func, x, y = _problem()
    with (
        pytest.warns(FutureWarning, match="column_parallel"),
        pytest.raises(RuntimeError, match="init_process_group"),
    ):
        ggnchunk.diag_ggn(model, loss_func, x, y, distributed=True)
    with pytest.warns(FutureWarning):
        ggnchunk.kron_ggn(model, loss_func, x, y, distributed=False)
    s = torch.full((sum(p.numel() for p in model.parameters()),), 0.1)
    with pytest.warns(FutureWarning, match="column_parallel"):
        old = ggnchunk.output_variance(model, x, s, distributed=False, num_chunks=2)
    assert torch.equal(old, ggnchunk.output_variance(model, x, s, num_chunks=2))


@pytest.mark.parametrize("chunking", [{"num_chunks": 3}, {"chunk_size": 2}])
def test_output_variance_options_equal_keywords(chunking):
    model, _, x, _ = _problem()
    s = torch.rand(sum(p.numel() for p in model.parameters()), generator=None)
    by_keywords = ggnchunk.output_variance(model, x, s, **chunking)
    by_options = ggnchunk.output_variance(model, x, s, options=ChunkOptions(**chunking))
    assert torch.equal(by_keywords, by_options)


def test_loss_grad_and_diag_ggn_returns_a_report():
    model, loss_func, x, y = _problem()
    *_, report = ggnchunk.loss_grad_and_diag_ggn(
        model, loss_func, x, y, num_chunks=2, return_report=True
    )
    assert isinstance(report, ggnchunk.GGNReport)
    assert report.num_passes == 2 and report.num_columns == 4
    assert len(ggnchunk.loss_grad_and_diag_ggn(model, loss_func, x, y)) == 3
    with pytest.raises(TypeError, match="return_report must be True or False"):
        ggnchunk.loss_grad_and_diag_ggn(model, loss_func, x, y, return_report="no")
    with pytest.raises(TypeError, match="return_report must be True or False"):
        ggnchunk.diag_ggn(model, loss_func, x, y, return_report="no")


def test_reprs_are_short_summaries():
    torch.manual_seed(0)
    # (hidden wider than a quarter of the columns: the passes go on to the inputs)
    model = nn.Sequential(nn.Linear(8, 100), nn.Tanh(), nn.Linear(100, 300))
    x, y = torch.randn(4, 8), torch.randn(4, 300)
    _, report = ggnchunk.diag_ggn(
        model, nn.MSELoss(), x, y, chunk_size=1, return_report=True
    )
    assert report.num_passes == 300
    text = repr(report)
    assert len(text) < 200 and "passes=300" in text and "columns=300" in text
    assert len(repr(report.schedules[0])) < 200 and "passes=300" in repr(
        report.schedules[0]
    )
    measured = ggnchunk.measure_peak_memory(
        ggnchunk.diag_ggn, model, nn.MSELoss(), x, y, num_chunks=2
    )
    text = repr(measured)
    assert len(text) < 250 and "peak_extra=" in text and "reused memory" in text
    assert "reuses" in inspect.getdoc(ggnchunk.PeakMemory)


def test_progress_shows_a_bar_over_the_passes(capsys):
    pytest.importorskip("tqdm")
    model, loss_func, x, y = _problem()
    ggnchunk.diag_ggn(model, loss_func, x, y, num_chunks=3, progress=True)
    err = capsys.readouterr().err
    assert "GGN backward passes" in err and "3" in err
    ggnchunk.diag_ggn(model, loss_func, x, y, num_chunks=3)
    assert capsys.readouterr().err == ""


def test_errors_and_options_are_exported():
    for name in (
        "ChunkOptions",
        "SampleCouplingError",
        "NotConvexWarning",
        "MemoryBudgetError",
        "MemoryBudgetWarning",
        "OutOfMemoryRecoveryWarning",
    ):
        assert name in ggnchunk.__all__ and hasattr(ggnchunk, name)  # fmt: skip
    assert ggnchunk.ChunkOptions is ChunkOptions


def test_docstrings_match_what_is_supported():
    doc = inspect.getdoc(ggnchunk.diag_ggn)
    assert "must not exceed" not in doc
    assert "tuple/list" in doc and "dict" in doc
    assert "any twice-differentiable loss" in doc


def test_laplace_uses_no_private_api():
    import ggnchunk.laplace as laplace

    source = inspect.getsource(laplace)
    assert "_evaluate" not in source


def test_optimizer_closure_takes_options_and_checks_them_at_once():
    from ggnchunk.optim import DiagGGNOptimizer

    model, loss_func, x, y = _problem()
    opt = DiagGGNOptimizer(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="unknown keyword.*chunks"):
        opt.closure(model, loss_func, x, y, chunks=3)
    with pytest.raises(ValueError, match="num_chunks=3 vs 2"):
        opt.closure(
            model, loss_func, x, y, options=ChunkOptions(num_chunks=2), num_chunks=3
        )
    loss = opt.step(opt.closure(model, loss_func, x, y, options=ChunkOptions(num_chunks=2)))
    assert torch.isfinite(loss)
