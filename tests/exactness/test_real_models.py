"""Real models against the float64 brute force; refusals; half precision.

Torchvision classifiers and hand-written models with any dataflow, several inputs and
randomness in forward.

The table is ``tests/real_models.py``; the brute force is ``tests/reference.py``.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

import ggnchunk
from tests.real_models import BY_ID, CASES, Problem, call, coupled_models
from tests.reference import (
    assert_diag_close,
    recorded_draws,
    reference_diag_ggn,
    reference_sanity,
    split_inputs,
)

# (id, kwargs from the number of columns); which cases get which: see _chunkings
CHUNKINGS = {
    "onepass": lambda columns: {"num_chunks": 1},
    "chunks3": lambda columns: {"num_chunks": 3},
    "chunk_size1": lambda columns: {"chunk_size": 1},
    "max_memory": lambda columns: {"max_memory": "256MiB"},
}
MAX_MEMORY_CASES = {"time-unet-x-t", "conv-autoencoder-28-output-padding", "vae-randn-mse"}
# more than ~2 s per test on 2 busy cores (the float64 brute force over 11M parameters)
SLOW = {"tv-resnet18"}


def _chunkings(case) -> list[str]:
    names = ["onepass", "chunks3"]
    if "small" in case.tags and "torchvision" not in case.tags:  # tv: chunks3 == size 1
        names.append("chunk_size1")
    if case.id in MAX_MEMORY_CASES:
        names.append("max_memory")
    return names


def _param(case, *rest, slow: bool | None = None):
    slow = case.id in SLOW if slow is None else slow
    return pytest.param(
        case.id, *rest, id="-".join([case.id, *rest]),
        marks=[pytest.mark.slow] if slow else [],
    )  # fmt: skip


FLOAT64 = [_param(case, chunking) for case in CASES for chunking in _chunkings(case)]
RANDOM = [case.id for case in CASES if "random" in case.tags]


@functools.cache
def _expected(case_id: str) -> dict[str, torch.Tensor]:
    """Reference of a deterministic case (its model is rebuilt identically per test)."""
    problem = BY_ID[case_id].make()
    return reference_diag_ggn(problem.model, problem.loss_func, problem.inputs,
                              problem.targets)  # fmt: skip


def _draws_after_call(model: nn.Module) -> dict[str, torch.Tensor]:
    """The draws of the last forward pass, with a clear failure if it ran in a transform."""
    try:
        return recorded_draws(model)
    except (NotImplementedError, RuntimeError) as error:
        pytest.fail(
            "the model's last forward pass ran inside a torch.func transform (its recorded "
            f"draw is a functorch wrapper: {error}); ggnchunk re-ran the user's forward "
            "instead of differentiating the draws of the forward pass of the call"
        )


def _display(name: str) -> str:
    return repr(name) if name else "the model"


def _forward_calls(model: nn.Module) -> int:
    return sum(getattr(m, "forward_calls", 0) for m in model.modules())


def _expected_for(case_id: str, problem: Problem) -> dict[str, torch.Tensor]:
    if "random" not in BY_ID[case_id].tags:
        return _expected(case_id)
    draws = _draws_after_call(problem.model)
    for name, draw in draws.items():
        assert draw.shape[0] == problem.batch, (
            f"the last forward pass drew {_display(name)} with shape "
            f"{tuple(draw.shape)}, not for the batch of {problem.batch}: ggnchunk re-ran "
            "(part of) the forward per sample"
        )
    return reference_diag_ggn(problem.model, problem.loss_func, problem.inputs,
                              problem.targets, draws)  # fmt: skip


@pytest.mark.parametrize(("case_id", "chunking"), FLOAT64)
def test_float64_matches_brute_force(case_id, chunking):
    problem = BY_ID[case_id].make()
    kwargs = CHUNKINGS[chunking](problem.columns())
    state = {k: v.clone() for k, v in problem.model.state_dict().items()}
    torch.manual_seed(1234)
    actual = ggnchunk.diag_ggn(
        problem.model, problem.loss_func, problem.inputs, problem.targets, **kwargs
    )
    expected = _expected_for(case_id, problem)
    for name, value in actual.items():
        assert value.dtype == torch.float64, f"{name}: dtype {value.dtype}"
    assert_diag_close(actual, expected, rtol=1e-9, label=f"{case_id} {kwargs}")
    for key, value in problem.model.state_dict().items():
        assert torch.equal(value, state[key]), f"the call changed the model's {key}"


# float32: chunked vs one pass (same draws for random models: same seed before each call)
FLOAT32 = [
    _param(BY_ID[case_id], slow=False)
    for case_id in ["tv-squeezenet1_0", "time-unet-x-t", "dict-inputs-mask-prototypes",
                    "segmenter-upsample-pixel-ce", "vae-randn-bce-sum",
                    "dropout-train-residual", "transformer-encoder-layer"]
]  # fmt: skip


@pytest.mark.parametrize("case_id", FLOAT32)
def test_float32_chunked_agrees_with_one_pass(case_id):
    problem = BY_ID[case_id].make().to(torch.float32)
    columns = problem.columns()
    args = (problem.model, problem.loss_func, problem.inputs, problem.targets)
    torch.manual_seed(99)
    one_pass = ggnchunk.diag_ggn(*args, num_chunks=1)
    random = "random" in BY_ID[case_id].tags
    first_draws = _draws_after_call(problem.model) if random else {}
    for value in one_pass.values():
        assert value.dtype == torch.float32
    for kwargs in ({"num_chunks": 3}, {"chunk_size": max(1, columns // 4)}):
        torch.manual_seed(99)
        chunked = ggnchunk.diag_ggn(*args, **kwargs)
        if random:
            draws = _draws_after_call(problem.model)
            for name, draw in draws.items():
                assert torch.equal(draw, first_draws[name]), (
                    f"{_display(name)}: same seed, other draws: ggnchunk's forward is "
                    "not the first use of the random generator"
                )
        assert_diag_close(chunked, one_pass, rtol=1e-5, label=f"float32 {kwargs}")


# ------------------------------------------------------------- randomness in forward


def _plain_forward(problem: Problem, seed: int):
    """From ``seed``: the RNG state before and after one plain forward, draws, output."""
    torch.manual_seed(seed)
    before = torch.get_rng_state()
    with torch.no_grad():
        output = call(problem.model, problem.inputs)
    return before, torch.get_rng_state(), recorded_draws(problem.model), output


@pytest.mark.parametrize("chunking", ["onepass", "chunks3", "chunk_size1"])
@pytest.mark.parametrize("case_id", RANDOM)
def test_random_forward_result_is_for_the_draws_of_the_call(case_id, chunking):
    problem = BY_ID[case_id].make()
    before, _, draws, output = _plain_forward(problem, seed=5)
    # the reference replays those draws: its function is the forward that drew them
    reference_sanity(problem.model, problem.inputs, problem.batch, draws, output)
    _, _, other_draws, _ = _plain_forward(problem, seed=6)
    torch.set_rng_state(before)
    kwargs = CHUNKINGS[chunking](problem.columns())
    calls = _forward_calls(problem.model)
    actual = ggnchunk.diag_ggn(
        problem.model, problem.loss_func, problem.inputs, problem.targets, **kwargs
    )
    calls = _forward_calls(problem.model) - calls
    call_draws = _draws_after_call(problem.model)
    args = (problem.model, problem.loss_func, problem.inputs, problem.targets)
    expected = reference_diag_ggn(*args, call_draws)
    # the test has power: other draws give another diagonal
    other = reference_diag_ggn(*args, other_draws)
    gap = max((other[k] - expected[k]).abs().max().item() for k in expected)
    assert gap > 1e-3 * max(v.abs().max().item() for v in expected.values())
    assert_diag_close(
        actual, expected, rtol=1e-9,
        label=f"{case_id} {kwargs} ({calls} forward call(s) of the random modules)",
    )  # fmt: skip
    for name, draw in call_draws.items():
        assert torch.equal(draw, draws[name]), (
            f"{_display(name)}: the call's forward drew other numbers than a plain "
            "forward from the same random state"
        )


@pytest.mark.parametrize("case_id", RANDOM)
def test_random_forward_draws_exactly_once(case_id):
    """The user's RNG state after the call is that after one plain forward pass."""
    problem = BY_ID[case_id].make()
    before, after_one_forward, _, _ = _plain_forward(problem, seed=11)
    torch.set_rng_state(before)
    calls = _forward_calls(problem.model)
    ggnchunk.diag_ggn(
        problem.model, problem.loss_func, problem.inputs, problem.targets, num_chunks=3
    )
    calls = _forward_calls(problem.model) - calls
    assert torch.equal(torch.get_rng_state(), after_one_forward), (
        "the RNG state after the call differs from that after one forward pass: ggnchunk "
        f"drew random numbers other than those of one forward ({calls} forward call(s) of "
        "the model's random modules during the call)"
    )


# ------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", list(coupled_models()))
def test_coupled_samples_are_refused_before_any_backward_pass(name):
    build, culprits = coupled_models()[name]
    torch.manual_seed(0)
    problem = build()
    model = problem.model
    reached = []
    handles = [
        p.register_hook(lambda grad: reached.append(1))
        for p in model.parameters()
        if p.requires_grad
    ]
    modes = [m.training for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with pytest.raises(ValueError) as info:
            ggnchunk.diag_ggn(
                model, problem.loss_func, problem.inputs, problem.targets, num_chunks=2
            )
    finally:
        for handle in handles:
            handle.remove()
    assert any(c in str(info.value) for c in culprits), (
        f"the message names none of {culprits}: {info.value}"
    )
    assert not reached, "a backward pass reached the parameters before the refusal"
    assert [m.training for m in model.modules()] == modes, "modes changed"
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), f"the refused call changed the model's {key}"


# ------------------------------------------------------------------------ precision


def _linear_problem(dtype: torch.dtype) -> Problem:
    """Linear model, MSE: exact in float32 whatever the forward's precision.

    Its GGN diagonal (2/(N·M)·Σ x²) does not depend on the forward's values, so a float32
    computation of it is exact up to the final rounding.
    """
    torch.manual_seed(0)
    model = nn.Linear(16, 4).to(dtype)
    x = torch.randn(64, 16).to(dtype)
    return Problem(model, nn.MSELoss(), x, torch.randn(64, 4).to(dtype))


def _mlp_problem(dtype: torch.dtype) -> Problem:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    ).to(dtype)
    x = torch.randn(32, 8).to(dtype)
    return Problem(model, nn.CrossEntropyLoss(), x, torch.randint(0, 4, (32,)))


@pytest.mark.parametrize("model", ["linear-mse", "mlp-ce"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model_is_refused(dtype, model):
    """The documented outcome: half precision is refused with the fix (a float32 copy)."""
    problem = _linear_problem(dtype) if model == "linear-mse" else _mlp_problem(dtype)
    args = (problem.model, problem.loss_func, problem.inputs, problem.targets)
    with pytest.raises(ValueError, match=str(dtype)) as info:
        ggnchunk.diag_ggn(*args, num_chunks=2)
    assert ".float()" in str(info.value), "the message must say the fix"
    for _, param in problem.model.named_parameters():
        assert param.grad is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_is_switched_off_for_the_call(dtype):
    """The documented outcome: computed in the parameters' dtype, autocast on afterwards."""
    problem = _linear_problem(torch.float32)
    args = (problem.model, problem.loss_func, problem.inputs, problem.targets)
    expected = reference_diag_ggn(*args)
    with torch.autocast("cpu", dtype=dtype):
        actual = ggnchunk.diag_ggn(*args, num_chunks=2)
        assert torch.is_autocast_enabled("cpu"), "the call left autocast switched off"
    for name, value in actual.items():
        assert value.dtype == torch.float32, f"{name}: dtype {value.dtype}"
    assert_diag_close(actual, expected, rtol=1e-5, label=f"autocast {dtype}")


# ------------------------------------------------------ the reference, checked itself


def _full_batch_ggn(problem: Problem, draws=None) -> dict[str, torch.Tensor]:
    """``diag(J^T H J)`` from the Jacobian of the whole batch's output.

    J from one call on the whole batch (with the whole draws replayed), H the loss
    Hessian w.r.t. the whole output: no per-sample slicing, so it checks the reference's
    slicing of inputs and draws.
    """
    model = problem.model.double()
    for name, draw in (draws or {}).items():
        model.get_submodule(name).replay = draw
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    rest = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    rest.update(dict(model.named_buffers()))
    args, kwargs = split_inputs(problem.inputs, problem.batch)(slice(None))

    def output(p):
        return torch.func.functional_call(model, {**p, **rest}, args, kwargs)

    out = output(params).detach()
    hess = torch.func.hessian(lambda o: problem.loss_func(o, problem.targets))(out)
    hess = hess.reshape(out.numel(), out.numel())
    with warnings.catch_warnings():  # vmap over attention's backward: slow, not wrong
        warnings.filterwarnings("ignore", "There is a performance drop")
        jac = torch.func.jacrev(output)(params)
    result = {}
    for name, j in jac.items():
        j = j.reshape(out.numel(), -1)
        result[name] = ((hess @ j) * j).sum(0).reshape(params[name].shape)
    for name in draws or {}:
        model.get_submodule(name).replay = None
    return result


FULL_BATCH = [c.id for c in CASES if "torchvision" not in c.tags and c.id not in SLOW]


@pytest.mark.parametrize("case_id", FULL_BATCH)
def test_reference_equals_full_batch_jacobian(case_id):
    problem = BY_ID[case_id].make()
    draws = None
    if "random" in BY_ID[case_id].tags:
        _, _, draws, output = _plain_forward(problem, seed=3)
        reference_sanity(problem.model, problem.inputs, problem.batch, draws, output)
    else:
        reference_sanity(problem.model, problem.inputs, problem.batch)
    expected = reference_diag_ggn(
        problem.model, problem.loss_func, problem.inputs, problem.targets, draws
    )
    assert_diag_close(_full_batch_ggn(problem, draws), expected, 1e-11, case_id)


class _TwoInputLinear(nn.Module):
    """Linear in its parameters, called as ``model(x, shift, scale=...)``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(2, 3, bias=False)

    def forward(self, x, side, shift, scale=1.0):
        return scale * (self.a(x) + self.b(side)) + shift


@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_reference_equals_hessian_for_several_inputs_linear_in_parameters(form):
    """For a model linear in its parameters the GGN is the loss's Hessian."""
    torch.manual_seed(0)
    model = _TwoInputLinear().double()
    x, side = torch.randn(5, 4).double(), torch.randn(5, 2).double()
    shift = torch.randn(3).double()  # not per-sample: passed unchanged
    y = torch.randint(0, 3, (5,))
    loss_func = nn.CrossEntropyLoss()
    if form == "tuple":
        inputs = (x, side, shift, 0.5)
    else:
        inputs = {"x": x, "side": side, "shift": shift, "scale": 0.5}
    expected = reference_diag_ggn(model, loss_func, inputs, y)
    params = dict(model.named_parameters())

    def loss_of(*values):
        p = dict(zip(params, values, strict=True))
        out = torch.func.functional_call(model, p, (x, side, shift, 0.5))
        return loss_func(out, y)

    hess = torch.func.hessian(loss_of, argnums=(0, 1, 2))(*params.values())
    for i, name in enumerate(params):
        size = params[name].numel()
        diag = torch.diagonal(hess[i][i].reshape(size, size)).reshape(params[name].shape)
        torch.testing.assert_close(expected[name], diag, rtol=1e-12, atol=1e-15)


class _NoisyLinear(nn.Module):
    """Linear in its parameters with replayable multiplicative noise."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.draw = self.replay = None

    def forward(self, x):
        eps = torch.randn_like(x) if self.replay is None else self.replay
        self.draw = eps.detach()
        return self.lin(x * eps)


def test_reference_replays_each_samples_draw():
    torch.manual_seed(0)
    model = _NoisyLinear().double()
    x, y = torch.randn(5, 4).double(), torch.randn(5, 3).double()
    loss_func = nn.MSELoss(reduction="sum")
    with torch.no_grad():
        model(x)
    draws = recorded_draws(model)
    expected = reference_diag_ggn(model, loss_func, x, y, draws)
    model.replay = draws[""]
    params = dict(model.named_parameters())

    def loss_of(w, b):
        out = torch.func.functional_call(model, {"lin.weight": w, "lin.bias": b}, (x,))
        return loss_func(out, y)

    hess = torch.func.hessian(loss_of, argnums=(0, 1))(*params.values())
    diag_w = torch.diagonal(hess[0][0].reshape(12, 12)).reshape(3, 4)
    torch.testing.assert_close(expected["lin.weight"], diag_w, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="draws randomness"):
        reference_diag_ggn(model, loss_func, x, y)


LEAN = [
    _param(case, slow=False)
    for case in CASES
    if "random" not in case.tags and case.id != "tv-convnext_tiny"
]


@pytest.mark.parametrize("case_id", LEAN)
@pytest.mark.parametrize("chunking", [{"chunk_size": 1}, {"num_chunks": 2}])
def test_lean_passes_match_brute_force(case_id, chunking, monkeypatch):
    """Lean passes (a tight budget: patches unfolded per sample in every pass) are exact."""
    from tests.lean import force_lean

    force_lean(monkeypatch)
    problem = BY_ID[case_id].make()
    actual = ggnchunk.diag_ggn(
        problem.model, problem.loss_func, problem.inputs, problem.targets, **chunking
    )
    assert_diag_close(actual, _expected(case_id), rtol=1e-9, label=f"lean {case_id}")
