"""Layers BackPACK lacks and models that are not chains: exact through the glue."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ggnchunk
from tests.models import Chain, Functional, PerSampleBlock, Residual, UNet
from tests.reference import assert_diag_close, reference_diag_ggn

N = 3

MODELS = {
    "upsample-nearest-2d": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Upsample(scale_factor=2),
                              nn.Conv2d(3, 2, 3)),
        (2, 4, 4),
    ),
    "upsample-bilinear-2d": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.UpsamplingBilinear2d(scale_factor=2),
                              nn.Tanh(), nn.Conv2d(3, 2, 3)),
        (2, 3, 3),
    ),
    "upsample-linear-1d": (
        lambda: nn.Sequential(
            nn.Conv1d(2, 3, 3),
            nn.Upsample(scale_factor=3, mode="linear"),
            nn.Conv1d(3, 2, 1),
        ),
        (2, 5),
    ),
    "unflatten-mlp-to-conv": (
        lambda: nn.Sequential(nn.Linear(5, 18), nn.Unflatten(1, (2, 3, 3)), nn.GELU(),
                              nn.ConvTranspose2d(2, 2, 2)),
        (5,),
    ),
    "layernorm-affine": (
        lambda: nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.SiLU(), nn.Linear(6, 4)),
        (5,),
    ),
    "layernorm-plain-seq": (
        lambda: nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6, elementwise_affine=False),
                              nn.Linear(6, 3)),
        (5, 4),
    ),
    "groupnorm-affine": (
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.SiLU(),
                              nn.Conv2d(4, 2, 1)),
        (2, 5, 5),
    ),
    "groupnorm-plain": (
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(4, 4, affine=False),
                              nn.Conv2d(4, 2, 1)),
        (2, 4, 4),
    ),
    "residual-skip": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 1), Residual(3), nn.Conv2d(3, 2, 1)),
        (2, 4, 4),
    ),
    "unet-cat-skips": (lambda: UNet(), (2, 8, 8)),
    "custom-chain": (Chain, (6,)),
    "functional-ops": (Functional, (6,)),
    "per-sample-block": (
        lambda: nn.Sequential(nn.Linear(4, 5), PerSampleBlock(5), nn.Linear(5, 3)), (4,)
    ),
}  # fmt: skip


def _build(name: str, seed: int = 0):
    torch.manual_seed(seed)
    build, shape = MODELS[name]
    model = build().double().eval()
    for module in model.modules():  # non-trivial norm parameters
        if isinstance(module, (nn.LayerNorm, nn.GroupNorm)) and module.weight is not None:
            module.weight.data.normal_()
            module.bias.data.normal_()
    x = torch.randn(N, *shape, dtype=torch.float64)
    return model, x


@pytest.mark.parametrize("loss", ["mse-mean", "bce-sum", "ce-mean"])
@pytest.mark.parametrize("name", list(MODELS))
def test_dataflow_is_exact(name, loss):
    model, x = _build(name)
    with torch.no_grad():
        out = model(x)
    torch.manual_seed(1)
    if loss == "mse-mean":
        loss_func, y = nn.MSELoss(), torch.randn_like(out)
    elif loss == "bce-sum":
        loss_func, y = nn.BCEWithLogitsLoss(reduction="sum"), torch.rand_like(out).round()
    else:
        loss_func = nn.CrossEntropyLoss()
        y = torch.randint(0, out.shape[1], (out.shape[0], *out.shape[2:]))
    expected = reference_diag_ggn(model, loss_func, x, y)
    columns = out[0].numel()
    for kwargs in ({}, {"num_chunks": 3}, {"chunk_size": max(1, columns // 2 - 1)}):
        actual = ggnchunk.diag_ggn(model, loss_func, x, y, **kwargs)
        assert_diag_close(actual, expected, rtol=1e-10, label=f"{name} {kwargs}")


def test_unet_hooks_only_the_whole_model_and_leaves_nothing_behind():
    model, x = _build("unet-cat-skips")
    before = [(list(m._forward_hooks), list(m._backward_hooks)) for m in model.modules()]
    ggnchunk.diag_ggn(model, nn.MSELoss(), x, x, num_chunks=4)
    after = [(list(m._forward_hooks), list(m._backward_hooks)) for m in model.modules()]
    assert before == after
    params = {n: p.detach() for n, p in model.named_parameters()}
    torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (x,)))(params)


@pytest.mark.parametrize("name", ["custom-chain", "unet-cat-skips", "residual-skip"])
def test_layers_with_rules_need_no_per_sample_backward(monkeypatch, name):
    """Every parameter of these models sits in a layer with a rule: no masked passes."""
    from ggnchunk._graph import Recording

    recordings, plan = [], Recording.plan

    def spy(self, output):
        plan(self, output)
        recordings.append((self.shared, list(self._sources.values()), list(self.calls)))

    monkeypatch.setattr(Recording, "plan", spy)
    model, x = _build(name)
    ggnchunk.diag_ggn(model, nn.MSELoss(), x, torch.zeros_like(model(x)), num_chunks=2)
    ((shared, sources, calls),) = recordings
    assert not shared
    assert all(not source.params for source in sources)
    assert {call.name for call in calls if call.params} == {
        name for name, m in model.named_modules() if any(True for _ in m.parameters(False))
    }


@pytest.mark.parametrize("kwargs", [{}, {"num_chunks": 3}, {"max_memory": "64MiB"}])
@pytest.mark.parametrize("conv", [False, True])
def test_global_forward_hooks_that_change_outputs(conv, kwargs):
    """Global forward hooks that change layers' outputs are glue, as a layer's own hooks.

    A hook for every module (``register_module_forward_hook``) runs before a layer's
    own hooks: it replaced the output the engine recorded (relative error 0.8). The
    user's global hooks keep their order and nothing of ggnchunk's stays behind.
    """
    from torch.nn.modules import module as torch_module

    torch.manual_seed(0)
    if conv:
        model = nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 2, 3, padding=1)
        ).double()
        x = torch.randn(3, 2, 5, 5, dtype=torch.float64)
        layer = nn.Conv2d
    else:
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 4)).double()
        x = torch.randn(3, 6, dtype=torch.float64)
        layer = nn.Linear

    def scale(module, args, output):
        return output * 1.5 + 0.25 if isinstance(module, layer) else None

    def observe(module, args, output):
        return None

    handles = [
        torch_module.register_module_forward_hook(scale),
        torch_module.register_module_forward_hook(observe),
    ]
    try:
        before = list(torch_module._global_forward_hooks)
        with torch.no_grad():
            targets = torch.randn_like(model(x))
        expected = reference_diag_ggn(model, nn.MSELoss(), x, targets)
        actual = ggnchunk.diag_ggn(model, nn.MSELoss(), x, targets, **kwargs)
        assert list(torch_module._global_forward_hooks) == before
    finally:
        for handle in handles:
            handle.remove()
    assert_diag_close(actual, expected, rtol=1e-9)


class _InPlaceOnOutputs(nn.Module):
    """In-place operations on layers' outputs, as attention code writes them.

    ``nn.Linear`` on ``[N, T, D]`` returns a view of its 2-d result: an in-place
    operation on it rewrote the graph through the view's base, off the recorded layer
    (relative error 1.0, any batch). Longformer's ``query_global(...)`` on
    ``[1, N, D]`` (a batch of one looks per-sample there) then ``/= sqrt(d)``.
    """

    def __init__(self, case: str):
        super().__init__()
        self.case = case
        self.embed, self.q, self.k = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):  # [N, T, 3]
        h = torch.tanh(self.embed(x))
        if self.case == "scale":
            q = self.q(h)
            q /= 2.0  # the query's scale, in place
            k = self.k(h)
            k.mul_(torch.sigmoid(h))
            scores = torch.softmax((q @ k.transpose(1, 2)), -1)
            return self.out((scores @ h).sum(1) + q[:, 0])
        if self.case == "residual":
            y = self.q(h)
            y += h  # a residual added in place
            torch.relu_(y)
            return self.out(self.k(y).sum(1))
        # "positions first": [T, N, D], a layer on one position [1, N, D]
        t = h.transpose(0, 1)
        g = self.q(t[:1].contiguous())
        g /= 2.0
        return self.out(g[0] + self.k(t).sum(0))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"num_chunks": 3}, {"max_memory": "64MiB"}, {"batch_chunk_size": 1},
     {"per_sample": True}],
)  # fmt: skip
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("case", ["scale", "residual", "positions_first"])
def test_in_place_operations_on_layer_outputs(case, n, kwargs):
    torch.manual_seed(0)
    model = _InPlaceOnOutputs(case).double()
    x = torch.randn(n, 5, 3, dtype=torch.float64)
    targets = torch.randint(0, 2, (n,))
    loss = nn.CrossEntropyLoss()
    actual = ggnchunk.diag_ggn(model, loss, x, targets, **kwargs)
    if kwargs.get("per_sample"):
        actual = {k: v.sum(0) for k, v in actual.items()}
    assert_diag_close(actual, reference_diag_ggn(model, loss, x, targets), rtol=1e-9)


@pytest.mark.filterwarnings("ignore:`torch.jit.[a-z_]+` is deprecated")  # (2.11: a
# DeprecationWarning, 2.14: a FutureWarning)
@pytest.mark.parametrize("kwargs", [{}, {"num_chunks": 2}, {"max_memory": "64MiB"}])
@pytest.mark.parametrize("how", ["trace", "script"])
@pytest.mark.parametrize("conv", [False, True])
def test_torchscript_models(conv, how, kwargs):
    """TorchScript runs its graph without Python hooks: the glue's exact path.

    A traced model raised a raw ``AttributeError`` while its layers were matched to
    rules.
    """
    torch.manual_seed(0)
    if conv:
        model = nn.Sequential(
            nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 4)
        ).double()
        x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    else:
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4)).double()
        x = torch.randn(3, 6, dtype=torch.float64)
    targets = torch.randint(0, 4, (3,))
    compiled = torch.jit.trace(model, x) if how == "trace" else torch.jit.script(model)
    actual = ggnchunk.diag_ggn(compiled, nn.CrossEntropyLoss(), x, targets, **kwargs)
    expected = reference_diag_ggn(model, nn.CrossEntropyLoss(), x, targets)
    assert_diag_close(actual, expected, rtol=1e-9)


class _SummedCopies(nn.Module):
    """Glue of views and a reduction between two layers (``expand``, ``sum``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h.unsqueeze(1).expand(-1, 2, -1).sum(1))


def test_every_node_of_the_recorded_graph_is_kept_alive():
    """The sweeps know autograd nodes by id: every node's Python object must live on.

    Before torch 2.14 a node's Python object dies with its last reference and the next
    object made takes its id: the walk over the glue above then took an unseen node for
    a seen one and gave ``a`` a diagonal of zeros (relative error 1.0 on torch 2.11, in
    this model and in the real-model table's dict inputs, tied weights, attention and
    LSTM; the GPU machine's image has torch 2.11). Exact on any version only while the
    recording holds every node of its graph.
    """
    from ggnchunk._autograd import node_name
    from ggnchunk._checks import Batch
    from ggnchunk._engine import GGNComputation, Problem
    from ggnchunk._quantities import DiagonalGGN

    torch.manual_seed(0)
    model = _SummedCopies().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    problem = Problem.build(model, nn.MSELoss())
    with GGNComputation(problem, Batch(x, 5), y, 1.0, DiagonalGGN(problem, 5)) as run:
        output = run.forward()
        pins = run._recording._pins
        # the layers' inputs are cut from the graph: the glue hangs behind them
        stack = [output.grad_fn] + [
            call.source.node for call in run._recording.calls if call.source is not None
        ]
        names = set()
        while stack:
            node = stack.pop()
            assert pins.get(id(node)) is node, node.name()
            names.add(node_name(node))  # a folded tanh's: the node it stands for
            stack.extend(n for n, _ in node.next_functions if n is not None)
        glue = {"SumBackward1", "ExpandBackward0", "UnsqueezeBackward0", "TanhBackward0"}
        assert glue <= names, names
    expected = reference_diag_ggn(model, nn.MSELoss(), x, y)
    assert_diag_close(ggnchunk.diag_ggn(model, nn.MSELoss(), x, y), expected, rtol=1e-9)


class _PositionEmbedding(nn.Module):
    """An ``nn.Embedding`` of ``arange(L)`` added to every sample (no batch axis)."""

    def __init__(self, length: int):
        super().__init__()
        self.length = length
        self.pos = nn.Embedding(length, 4)
        self.lin = nn.Linear(4, 2)

    def forward(self, x):  # [N, L, 4]
        return self.lin(torch.tanh(x + self.pos(torch.arange(self.length)))).flatten(1)


class _Latents(nn.Module):
    """A Perceiver's learned latents ``[M, D]`` projected by a layer, then attended."""

    def __init__(self, length: int):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(length, 4))
        self.to_q, self.to_k, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):  # [N, 5, 4]
        q = self.to_q(self.latents)
        att = torch.einsum("md,ntd->nmt", q, self.to_k(x)).softmax(-1)
        return self.out(att @ x).flatten(1)


class _RelativeBias(nn.Module):
    """T5's relative position bias: an embedding of ``[q, k]`` buckets, per head."""

    def __init__(self, length: int):
        super().__init__()
        self.length = length
        self.bias = nn.Embedding(2 * length - 1, 2)
        self.v, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):  # [N, L, 4]
        position = torch.arange(self.length)
        buckets = position[None, :] - position[:, None] + self.length - 1
        scores = self.bias(buckets).permute(2, 0, 1)  # [2, q, k]: no batch axis
        mixed = (scores.softmax(-1)[None] @ self.v(x)[:, None]).sum(1)
        return self.out(mixed).flatten(1)


BATCH_FREE = {
    "position-embedding": (_PositionEmbedding, lambda n, m: torch.randn(n, m, 4)),
    "perceiver-latents": (_Latents, lambda n, m: torch.randn(n, 5, 4)),
    "t5-relative-bias": (_RelativeBias, lambda n, m: torch.randn(n, m, 4)),
}


@pytest.mark.parametrize("kwargs", [{}, {"num_chunks": 2}, {"batch_chunk_size": 2}])
@pytest.mark.parametrize(("n", "length"), [(3, 3), (2, 2), (3, 2), (1, 1)])
@pytest.mark.parametrize("name", BATCH_FREE)
def test_layers_on_tensors_without_the_batch(name, n, length, kwargs):
    """A layer whose input is not made from the batch is no per-sample call.

    Also where its axis 0 has the batch size by chance (``L == N``, or the sub-batch's
    size): it was recorded as one, and its output, the same for every sample, was
    refused as samples influencing each other (T5's position bias with as many
    queries as samples; found by a sweep of transformers' models).
    """
    torch.manual_seed(0)
    build, inputs = BATCH_FREE[name]
    model = build(length).double().eval()
    x = inputs(n, length).double()
    y = torch.randn_like(model(x))
    loss_func = nn.MSELoss()
    got = ggnchunk.diag_ggn(model, loss_func, x, y, **kwargs)
    assert_diag_close(got, reference_diag_ggn(model, loss_func, x, y), rtol=1e-9)
