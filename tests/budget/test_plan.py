"""Chunk plans partition the index range for every chunking; the bound's margin."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ggnchunk import plan_chunks


@pytest.mark.parametrize("total", [1, 2, 7, 64, 3072])
def test_every_num_chunks_partitions(total):
    for k in sorted(k for k in {1, 2, 3, total // 2, total - 1, total} if 1 <= k <= total):
        plan = plan_chunks(total, num_chunks=k)
        assert len(plan) == k
        sizes = [b - a for a, b in plan]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
        assert plan[0][0] == 0 and plan[-1][1] == total
        assert all(plan[i][1] == plan[i + 1][0] for i in range(k - 1))


@pytest.mark.parametrize("total", [1, 7, 100])
def test_every_chunk_size_partitions(total):
    for size in range(1, total + 1):
        plan = plan_chunks(total, chunk_size=size)
        sizes = [b - a for a, b in plan]
        assert all(s == size for s in sizes[:-1]) and 1 <= sizes[-1] <= size
        assert plan[0][0] == 0 and plan[-1][1] == total
        assert all(plan[i][1] == plan[i + 1][0] for i in range(len(plan) - 1))


def test_default_is_one_chunk():
    assert plan_chunks(5) == [(0, 5)]


# -- every small total, every option up to total + 3 (clamped) ---------------------------

SMALL_TOTALS = range(1, 41)


def _assert_partition(plan, total, label):
    """Contiguous, in order, no empty chunk, every index of [0, total) exactly once."""
    assert plan, f"{label}: empty plan"
    assert all(isinstance(a, int) and isinstance(b, int) for a, b in plan), label
    assert all(a < b for a, b in plan), f"{label}: empty chunk in {plan}"
    assert plan[0][0] == 0 and plan[-1][1] == total, f"{label}: {plan}"
    assert all(plan[i][1] == plan[i + 1][0] for i in range(len(plan) - 1)), label
    counts = [0] * total
    for a, b in plan:
        for index in range(a, b):
            counts[index] += 1
    assert counts == [1] * total, f"{label}: {plan}"


@pytest.mark.parametrize("total", SMALL_TOTALS, ids=lambda t: f"total={t}")
def test_num_chunks_up_to_total_plus_3(total):
    for k in range(1, total + 4):
        label = f"plan_chunks({total}, num_chunks={k})"
        plan = plan_chunks(total, num_chunks=k)
        _assert_partition(plan, total, label)
        expected_count = k if k <= total else total  # clamped: one index per chunk
        assert len(plan) == expected_count, label
        sizes = [b - a for a, b in plan]
        assert sorted(sizes, reverse=True) == sizes, label  # larger chunks first
        assert set(sizes) <= {total // expected_count, -(-total // expected_count)}, label


@pytest.mark.parametrize("total", SMALL_TOTALS, ids=lambda t: f"total={t}")
def test_chunk_size_up_to_total_plus_3(total):
    for k in range(1, total + 4):
        label = f"plan_chunks({total}, chunk_size={k})"
        plan = plan_chunks(total, chunk_size=k)
        _assert_partition(plan, total, label)
        if k >= total:  # clamped: one chunk
            assert plan == [(0, total)], label
            continue
        full, rest = divmod(total, k)
        expected = [(i * k, (i + 1) * k) for i in range(full)]
        if rest:
            expected.append((full * k, total))
        assert plan == expected, label


def test_clamping_examples():
    assert plan_chunks(1, num_chunks=2) == [(0, 1)]
    assert plan_chunks(3, num_chunks=8) == [(0, 1), (1, 2), (2, 3)]
    assert plan_chunks(2, chunk_size=5) == [(0, 2)]
    assert plan_chunks(3, chunk_size=3) == [(0, 3)]


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [({"num_chunks": 0}, ValueError, "num_chunks must be a positive int, got 0"),
     ({"num_chunks": -2}, ValueError, "num_chunks must be a positive int"),
     ({"num_chunks": 2.0}, TypeError, "num_chunks must be a positive int"),
     ({"num_chunks": True}, TypeError, "num_chunks must be a positive int"),
     ({"chunk_size": 0}, ValueError, "chunk_size must be a positive int, got 0"),
     ({"chunk_size": "3"}, TypeError, "chunk_size must be a positive int"),
     ({"num_chunks": 2, "chunk_size": 2}, ValueError, "only one of")],
    ids=["num_chunks=0", "num_chunks=-2", "num_chunks=2.0", "num_chunks=True",
         "chunk_size=0", "chunk_size='3'", "both"],
)  # fmt: skip
def test_bad_options_still_raise(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        plan_chunks(5, **kwargs)


@pytest.mark.parametrize("total", [0, -1, 2.5])
def test_bad_total_raises(total):
    with pytest.raises((ValueError, TypeError), match="total"):
        plan_chunks(total, num_chunks=2)


class _Tokens(nn.Module):
    """Attention over tokens: linear layers, a norm, glue; no maps."""

    def __init__(self):
        super().__init__()
        self.qkv, self.norm, self.out = nn.Linear(8, 24), nn.LayerNorm(8), nn.Linear(8, 5)

    def forward(self, h):
        q, k, v = self.qkv(self.norm(h)).chunk(3, dim=-1)
        return self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v) + h)


@pytest.mark.parametrize(
    ("name", "margin"),
    [
        ("mlp", 1.0),
        ("tokens", 1.0),
        ("conv1d", 1.5),
        ("conv2d", 1.5),
        ("pooled_maps", 1.5),  # a rule on maps (batch norm), pooling in the glue
    ],
)
def test_the_bound_keeps_its_margin_for_maps_only(name, margin):
    """Convolutions' workspaces need the 1.5x margin; vectors of features do not.

    Without maps the margin made budgets hold a third fewer columns than fit (the MLP
    autoencoder used 49% of 14 MiB in 37 passes; 65% in 25 without it).
    """
    from ggnchunk._checks import Batch
    from ggnchunk._engine import GGNComputation, Problem
    from ggnchunk._quantities import DiagonalGGN

    torch.manual_seed(0)
    models = {
        "mlp": (nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5)), (3, 6)),
        "tokens": (_Tokens(), (3, 4, 8)),
        "conv1d": (nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(12, 5)),
                   (3, 2, 6)),
        "conv2d": (nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 5)),
                   (3, 2, 4, 4)),
        "pooled_maps": (nn.Sequential(nn.BatchNorm2d(2).eval(), nn.MaxPool2d(2),
                                      nn.Flatten(), nn.Linear(8, 5)), (3, 2, 4, 4)),
    }  # fmt: skip
    model, shape = models[name]
    x = torch.randn(shape)
    out = model(x)
    problem = Problem.build(model, nn.MSELoss())
    with GGNComputation(
        problem, Batch(x, 3), torch.randn_like(out), 1.0, DiagonalGGN(problem, 3)
    ) as run:
        run.forward()
        assert run._recording.size_margin() == margin


@pytest.mark.parametrize("quantity", ["diagonal", "kron"])
def test_the_bound_holds_weight_totals_apart_at_their_layers(quantity):
    """The weights' squares' totals are counted beside their own layer's columns only.

    Torchvision's ResNet-18: its 512-channel layers' totals (9 MiB in float32) are held
    where the columns are 2x2 maps; counted beside the first layers' columns too, a
    budget of 80.2 MiB fitted one column of 32x32 images where three did.
    Every step of the split lies within the unsplit line (fixed, per column), and the
    split gives room; Kronecker factors are not split (their fixed bytes are not the
    rules').
    """
    torchvision = pytest.importorskip("torchvision")
    from ggnchunk._checks import Batch
    from ggnchunk._engine import GGNComputation, Problem
    from ggnchunk._quantities import DiagonalGGN, KroneckerFactors

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    if quantity == "kron":  # factors of the convolutions and the head only
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.requires_grad_(False)
    x = torch.randn(2, 3, 64, 64)  # layer4's maps 2x2
    problem = Problem.build(model, nn.CrossEntropyLoss())
    kind = DiagonalGGN if quantity == "diagonal" else KroneckerFactors
    with GGNComputation(
        problem, Batch(x, 2), torch.tensor([1, 7]), 1.0, kind(problem, 2)
    ) as run:
        run.forward()
        run.set_lean(True)  # as a tight budget plans it (products in the Gram form)
        # the diagonal's lean Gram form is added into the accumulator: no totals at all
        # (kernels.square_sum's ``into``); where it is not handed in (a layer called
        # twice), each layer's total is held at its step
        in_place = run.fixed_bytes()
        calls = [c for c in run._recording.calls if c.ctx.in_place]
        assert calls or quantity == "kron"
        for call in calls:
            call.ctx.in_place = False
        fixed, per_column = run.fixed_bytes(), run.column_bytes()
        assert quantity == "kron" or fixed - in_place >= 512 * 512 * 9 * 4 // 2
        bounds = run.layer_bounds(fixed, per_column)
        if quantity == "kron":
            assert bounds is None
            return
        assert bounds, "no split"
        # one column as the unsplit line counts it, for every chunk
        assert bounds[0] == (fixed + per_column, 0)
        steps = bounds[1:]
        assert all(f <= fixed and p <= per_column for f, p in steps), steps
        # the next stands for every step: the working blocks' transient bytes kept,
        # the weights' totals taken out (layer4's 512x512x3x3: 9 MiB)
        assert steps[0][1] == per_column
        assert fixed - steps[0][0] >= 512 * 512 * 9 * 4 // 2
        # where a 512-channel layer's total is held, its columns are small
        heavy = [p for f, p in steps[1:] if f > steps[0][0] + 2**22]
        assert heavy and max(heavy) < per_column / 4, (heavy, per_column)
