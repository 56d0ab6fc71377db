"""Whole-dataset diagonals, the streaming accumulator, and loss + gradient + diagonal."""

from __future__ import annotations

from collections import UserDict

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ggnchunk
from tests.reference import assert_diag_close, reference_diag_ggn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8, 5))


X = torch.randn(11, 1, 4, 4)  # 11 samples: batches of 4 leave an uneven last batch
CASES = {
    "mse-mean": (nn.MSELoss(), torch.randn(11, 5)),
    "mse-sum": (nn.MSELoss(reduction="sum"), torch.randn(11, 5)),
    "ce-mean-weighted-ignore": (
        nn.CrossEntropyLoss(weight=torch.rand(5) + 0.5, ignore_index=3),
        torch.randint(0, 5, (11,)),
    ),
    "bce-mean": (nn.BCEWithLogitsLoss(), torch.rand(11, 5).round()),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("options", [{}, {"num_chunks": 2}, {"max_memory": "1GiB"}])
def test_dataset_diagonal_equals_the_concatenated_batch(case, options):
    loss_func, y = CASES[case]
    model = _model().eval()
    expected = ggnchunk.diag_ggn(model, loss_func, X, y)
    loader = DataLoader(TensorDataset(X, y), batch_size=4)
    actual = ggnchunk.diag_ggn_dataset(model, loss_func, loader, progress=False, **options)
    assert_diag_close(actual, expected, rtol=1e-5, label=case)


def test_accumulator_streams_resets_and_round_trips():
    loss_func, y = CASES["mse-mean"]
    model = _model().eval()
    expected = ggnchunk.diag_ggn(model, loss_func, X, y)
    acc = ggnchunk.DiagGGNAccumulator(model, loss_func, chunk_size=3)
    acc.update(X[:6], y[:6])
    state = acc.state_dict()
    restored = ggnchunk.DiagGGNAccumulator(model, loss_func, chunk_size=3)
    restored.load_state_dict(state)
    for a in (acc, restored):
        a.update(X[6:], y[6:])
        assert a.num_samples == 11 and a.num_batches == 2
        assert_diag_close(a.compute(), expected, rtol=1e-5)
    acc.reset()
    with pytest.raises(RuntimeError, match="no batch was added"):
        acc.compute()


def test_accumulator_rejects_a_foreign_checkpoint():
    acc = ggnchunk.DiagGGNAccumulator(_model(), nn.MSELoss())
    acc.update(X[:2], torch.randn(2, 5))
    other = ggnchunk.DiagGGNAccumulator(nn.Sequential(nn.Linear(16, 5)), nn.MSELoss())
    with pytest.raises(ValueError, match="does not match"):
        other.load_state_dict(acc.state_dict())


def test_accumulator_rejects_another_loss_or_a_malformed_checkpoint():
    model = _model()
    acc = ggnchunk.DiagGGNAccumulator(model, nn.MSELoss())
    acc.update(X[:2], torch.randn(2, 5))
    state = acc.state_dict()
    for loss_func in (nn.CrossEntropyLoss(), nn.MSELoss(reduction="sum")):
        other = ggnchunk.DiagGGNAccumulator(model, loss_func)
        with pytest.raises(ValueError, match=r"loss MSELoss\(reduction='mean'\), but"):
            other.load_state_dict(state)
        assert other.num_batches == 0  # nothing loaded
    fresh = ggnchunk.DiagGGNAccumulator(model, nn.MSELoss())
    with pytest.raises(ValueError, match=r"state lacks \['sum', 'normalizer'"):
        fresh.load_state_dict({"num_samples": 2})
    with pytest.raises(TypeError, match="state must be a dict"):
        fresh.load_state_dict([state])
    # a checkpoint from before the loss was recorded still loads
    older = {k: v for k, v in state.items() if k != "loss"}
    fresh.load_state_dict(older)
    assert fresh.num_batches == 1


def test_dataset_errors():
    model = _model()
    with pytest.raises(ValueError, match="no batch"):
        ggnchunk.diag_ggn_dataset(model, nn.MSELoss(), [], progress=False)
    with pytest.raises(
        TypeError, match=r"each batch of data must be an \(inputs, targets\) pair"
    ):
        ggnchunk.diag_ggn_dataset(model, nn.MSELoss(), [X], progress=False)
    with pytest.raises(RuntimeError, match="no torch.distributed process group"):
        ggnchunk.diag_ggn_dataset(model, nn.MSELoss(), [(X, X)], distributed=True)
    with pytest.raises(TypeError, match="unknown keyword"):
        ggnchunk.DiagGGNAccumulator(model, nn.MSELoss(), chunks=3)


def test_progress_bar_shows_the_chunking(capsys):
    loss_func, y = CASES["mse-sum"]
    loader = DataLoader(TensorDataset(X, y), batch_size=4)
    ggnchunk.diag_ggn_dataset(_model(), loss_func, loader, progress=True, num_chunks=2)
    err = capsys.readouterr().err
    assert "GGN diagonal" in err and "columns_per_pass=3" in err


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("options", [{}, {"num_chunks": 3, "batch_chunk_size": 4}])
def test_loss_gradient_and_diagonal_in_one_call(case, options):
    loss_func, y = CASES[case]
    model = _model().eval()
    loss, grad, diag = ggnchunk.loss_grad_and_diag_ggn(model, loss_func, X, y, **options)
    reference_loss = loss_func(model(X), y)
    reference_grad = torch.autograd.grad(reference_loss, list(model.parameters()))
    assert torch.allclose(loss, reference_loss.detach(), rtol=1e-5, atol=0)
    for (name, g), r in zip(grad.items(), reference_grad, strict=True):
        assert torch.allclose(g, r, rtol=1e-4, atol=1e-6 * r.abs().max().item()), name
    assert_diag_close(diag, ggnchunk.diag_ggn(model, loss_func, X, y), rtol=1e-5)
    assert all(p.grad is None for p in model.parameters())


class _DictModel(nn.Module):
    """laplace-torch's convention: the whole dict batch is the model's one argument."""

    def __init__(self, kind: type = dict):
        super().__init__()
        torch.manual_seed(3)
        self.kind = kind
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        self.scale = nn.Linear(1, 3)

    def forward(self, batch):
        assert type(batch) is self.kind, type(batch)  # the batch's own mapping type
        return self.net(batch["features"]) * self.scale(batch["t"])


class _Keywords(nn.Module):
    """For the reference: ``model(**entries)`` → ``model(dict)`` (test code only)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **entries):
        return self.model(self.model.kind(entries))


def _dict_data(n: int = 11):
    torch.manual_seed(4)
    features, t = torch.randn(n, 4), torch.rand(n, 1)
    y = torch.randint(0, 3, (n,))
    return features, t, y


def _collate(kind):
    def collate(rows):
        return kind(
            features=torch.stack([r[0] for r in rows]),
            t=torch.stack([r[1] for r in rows]),
            target=torch.stack([r[2] for r in rows]),
            note="kept",  # non-tensor entries reach the model unchanged
        )

    return collate


@pytest.mark.parametrize("kind", [dict, UserDict])
@pytest.mark.parametrize("options", [{}, {"num_chunks": 2, "batch_chunk_size": 2}])
def test_dict_batches_follow_laplace_torchs_convention(kind, options):
    features, t, y = _dict_data()
    model, loss_func = _DictModel(kind), nn.CrossEntropyLoss()
    rows = list(zip(features, t, y, strict=True))
    loader = DataLoader(rows, batch_size=4, collate_fn=_collate(kind))
    actual = ggnchunk.diag_ggn_dataset(model, loss_func, loader, progress=False,
                                       dict_key_x="features", dict_key_y="target",
                                       **options)  # fmt: skip
    inputs = {"features": features, "t": t, "target": y, "note": "kept"}
    expected = reference_diag_ggn(_Keywords(model), loss_func, inputs, y)
    expected = {k.removeprefix("model."): v for k, v in expected.items()}
    assert_diag_close(actual, expected, rtol=1e-5, label=kind.__name__)

    acc = ggnchunk.DiagGGNAccumulator(model, loss_func, dict_key_x="features",
                                      dict_key_y="target", **options)  # fmt: skip
    for batch in loader:
        acc.update(batch)
    assert acc.num_samples == 11 and acc.num_batches == 3
    assert_diag_close(acc.compute(), expected, rtol=1e-5, label=f"{kind.__name__} acc")


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.a, self.b = nn.Linear(4, 2), nn.Linear(1, 2)

    def forward(self, x, t, *, shift=None):
        out = torch.tanh(self.a(x)) + self.b(t)
        return out if shift is None else out + shift


@pytest.mark.parametrize("outputs", ["tuple", "dict"])
def test_pairs_with_tuple_or_dict_inputs_and_one_output_columns(outputs):
    features, t, _ = _dict_data()
    y = torch.randn(11, 2)
    model, loss_func = _TwoInputs(), nn.MSELoss(reduction="sum")
    if outputs == "tuple":  # model(*inputs)
        batches = [((features[i : i + 4], t[i : i + 4]), y[i : i + 4]) for i in (0, 4, 8)]
        inputs = (features, t)
    else:  # a dict in a pair is ggnchunk's own convention: model(**inputs)
        batches = [({"x": features[i : i + 4], "t": t[i : i + 4]}, y[i : i + 4])
                   for i in (0, 4, 8)]  # fmt: skip
        inputs = {"x": features, "t": t}
    expected = reference_diag_ggn(model, loss_func, inputs, y)
    # num_chunks above the 2 columns is clamped (one column per pass)
    actual = ggnchunk.diag_ggn_dataset(model, loss_func, batches, progress=False,
                                       num_chunks=5)  # fmt: skip
    assert_diag_close(actual, expected, rtol=1e-5, label=outputs)
    acc = ggnchunk.DiagGGNAccumulator(model, loss_func, max_memory="256MiB")
    for batch in batches:
        acc.update(*batch) if outputs == "tuple" else acc.update(batch)
    assert acc.num_samples == 11
    assert_diag_close(acc.compute(), expected, rtol=1e-5, label=f"{outputs} acc")


def test_batches_of_the_wrong_shape_are_refused_with_the_fix():
    model, loss_func = _DictModel(), nn.CrossEntropyLoss()
    features, t, y = _dict_data(4)
    good = {"features": features, "t": t, "labels": y}
    run = lambda batch, **kw: ggnchunk.diag_ggn_dataset(  # noqa: E731
        model, loss_func, [batch], progress=False, dict_key_x="features", **kw
    )
    with pytest.raises(KeyError, match=r"dict_key_y='target'.*pass dict_key_y="):
        run(good, dict_key_y="target")
    with pytest.raises(KeyError, match=r"dict_key_x='input_ids'"):
        ggnchunk.diag_ggn_dataset(model, loss_func, [good], progress=False)
    with pytest.raises(ValueError, match=r"'features' entry \(dict_key_x\) has shape"):
        run({**good, "features": features[:3]})
    with pytest.raises(TypeError, match=r"'labels' entry \(dict_key_y\) is a list"):
        run({**good, "labels": y.tolist()})
    with pytest.raises(TypeError, match=r"a tuple of 3 items.*\(\(x1, x2\), targets\)"):
        run((features, t, y))
    with pytest.raises(TypeError, match=r"second item \(the targets\) is a list"):
        run((features, y.tolist()))
    acc = ggnchunk.DiagGGNAccumulator(model, loss_func)
    with pytest.raises(
        TypeError, match=r"update\(\)'s batch must be an \(inputs, targets\) pair"
    ):
        acc.update(features)


def test_a_plain_function_loss_is_a_sum_over_batches():
    """``loss(output, target)`` functions work in the dataset API too (a sum)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                torch.nn.Linear(4, 2)).double()  # fmt: skip
    x, y = torch.randn(10, 3, dtype=torch.float64), torch.randn(10, 2, dtype=torch.float64)

    def loss(output, target):
        return ((output - target) ** 2).sum() + (output**4).sum()

    class Loss(nn.Module):  # the same function, as the reference needs a module
        def forward(self, output, target):
            return loss(output, target)

    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    actual = ggnchunk.diag_ggn_dataset(model, loss, loader, num_chunks=2, progress=False)
    expected = reference_diag_ggn(model, Loss(), x, y)
    assert_diag_close(actual, expected, rtol=1e-10)


def test_a_checkpoint_of_another_shape_names_the_parameter_and_shapes():
    """Same names, other shapes: the message listed two equal name lists."""
    from torch import nn

    import ggnchunk

    small = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    large = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3)).double()
    saved = ggnchunk.DiagGGNAccumulator(small, nn.MSELoss())
    saved.update(
        torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    )
    other = ggnchunk.DiagGGNAccumulator(large, nn.MSELoss())
    with pytest.raises(ValueError, match=r"\['0.weight'\] has shape \(8, 5\).*\(9, 5\)"):
        other.load_state_dict(saved.state_dict())


def test_a_distributed_sampler_that_repeats_samples_is_refused():
    """Its default padding repeats samples: 10 on 3 ranks made a diagonal 17% off."""
    from torch.utils.data import DistributedSampler

    data = TensorDataset(X[:10], torch.randn(10, 5))
    padded = DistributedSampler(data, num_replicas=3, rank=0, shuffle=False)
    with pytest.raises(ValueError, match=r"repeats 2 sample\(s\) .* over 3 ranks"):
        ggnchunk.diag_ggn_dataset(
            _model(), nn.MSELoss(), DataLoader(data, batch_size=4, sampler=padded)
        )
    # no padding (10 on 2 ranks), or padding dropped: the samples it gives, once each
    model = _model().eval()
    for sampler in (
        DistributedSampler(data, num_replicas=2, rank=1, shuffle=False),
        DistributedSampler(data, num_replicas=3, rank=2, shuffle=False, drop_last=True),
    ):
        share = list(sampler)
        actual = ggnchunk.diag_ggn_dataset(
            model, nn.MSELoss(reduction="sum"),
            DataLoader(data, batch_size=2, sampler=sampler), progress=False,
        )  # fmt: skip
        expected = reference_diag_ggn(
            model, nn.MSELoss(reduction="sum"), X[share], data.tensors[1][share]
        )
        assert_diag_close(actual, expected, rtol=1e-5)


def test_a_dataset_loop_that_raises_leaves_the_random_state_as_it_was():
    """The first batch's forward pass draws dropout masks; the second batch is bad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Dropout(0.5), nn.Linear(6, 2)).train()
    batches = [
        (torch.randn(4, 3), torch.randn(4, 2)),
        (torch.randn(4, 3), torch.randn(4, 1)),
    ]
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="targets have shape"):
        ggnchunk.diag_ggn_dataset(model, nn.MSELoss(), batches, progress=False)
    assert torch.equal(torch.get_rng_state(), state)
    ggnchunk.diag_ggn_dataset(model, nn.MSELoss(), batches[:1], progress=False)
    assert not torch.equal(torch.get_rng_state(), state)  # a call that returns: advanced


def test_all_reduce_of_a_column_parallel_accumulator_is_refused():
    accumulator = ggnchunk.DiagGGNAccumulator(_model(), nn.MSELoss(), column_parallel=True)
    with pytest.raises(ValueError, match="all_reduce sums the ranks' own batches, but"):
        accumulator.all_reduce()
