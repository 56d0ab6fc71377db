"""Brute-force float64 GGN diagonal with ``torch.func``; shares no code with ggnchunk.

``diag(sum_n J_n^T H_n J_n)`` with ``J_n`` the Jacobian of sample ``n``'s output w.r.t. all
trainable parameters (``torch.func.jacrev`` of a one-sample ``functional_call``: reverse
mode, so conventions of torch's backward formulas hold, e.g. an embedding's padding row
gets no gradient, which forward mode would give one) and ``H_n`` the Hessian of the
whole batch's loss w.r.t. sample ``n``'s output (``torch.func.hessian``; where the
parameters are fewer than the outputs, ``H_n J_n`` by forward-over-reverse
Hessian-vector products along ``J_n``'s columns), so the loss's reduction enters exactly
as torch defines it.

Inputs are a Tensor (``model(x)``), a tuple/list (``model(*inputs)``) or a dict
(``model(**inputs)``). A tensor entry whose axis 0 is the batch (as long as ``targets``'s
axis 0) is per-sample: sample ``n`` gets its slice ``[n:n+1]``; any other entry is passed
unchanged to every sample.

Randomness in forward. The reference never draws: a model that draws (noise, train-mode
dropout) must do so in *replayable* modules, which have two attributes,

- ``draw``: the last forward's draw, batch on axis 0 (recorded by the module itself), and
- ``replay``: ``None`` (draw as usual) or a tensor to use instead of drawing,

and the caller passes ``draws=recorded_draws(model)`` read right after the call under test.
Each sample's Jacobian is then that of the function with the sample's slice of the draws,
which is what the forward pass of the call computed. A model that would draw from torch's
RNG outside such modules (``nn.Dropout`` in training mode) is refused.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev, jvp, vmap

Inputs = Tensor | tuple | list | dict


def _double(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().double() if value.is_floating_point() else value.detach()
    return value


def _is_per_sample(value: Any, batch: int) -> bool:
    return isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == batch


def split_inputs(inputs: Inputs, batch: int) -> Callable[[slice], tuple[tuple, dict]]:
    """``select(rows) -> (args, kwargs)`` for ``model(*args, **kwargs)`` on those rows.

    Per-sample tensors (batch on axis 0) are sliced, everything else is passed unchanged.
    """

    def pick(value: Any, rows: slice) -> Any:
        return value[rows] if _is_per_sample(value, batch) else value

    if isinstance(inputs, Tensor):
        return lambda rows: ((inputs[rows],), {})
    if isinstance(inputs, (tuple, list)):
        return lambda rows: (tuple(pick(v, rows) for v in inputs), {})
    if isinstance(inputs, dict):
        return lambda rows: ((), {k: pick(v, rows) for k, v in inputs.items()})
    raise TypeError(f"inputs must be a Tensor, tuple, list or dict, got {type(inputs)}")


def _to_double(inputs: Inputs) -> Inputs:
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_double(v) for v in inputs)
    if isinstance(inputs, dict):
        return {k: _double(v) for k, v in inputs.items()}
    return _double(inputs)


def is_replayable(module: nn.Module) -> bool:
    """Whether ``module`` follows the replay protocol (``draw`` and ``replay``)."""
    return hasattr(module, "replay") and hasattr(module, "draw")


def recorded_draws(model: nn.Module) -> dict[str, Tensor]:
    """Every replayable module's draw of the last forward pass, keyed by module name."""
    draws = {}
    for name, module in model.named_modules():
        if is_replayable(module):
            if module.draw is None:
                raise ValueError(f"module {name!r} has not drawn yet: run a forward first")
            draws[name] = module.draw.detach().clone()
    return draws


def _check_randomness(model: nn.Module, draws: Mapping[str, Tensor] | None) -> None:
    names = {name for name, module in model.named_modules() if is_replayable(module)}
    if names and draws is None:
        raise ValueError(
            f"the model draws randomness in {sorted(names)}; pass "
            "draws=recorded_draws(model) read right after the forward under test"
        )
    if draws is not None and set(draws) != names:
        raise ValueError(
            f"draws for {sorted(draws)} but replayable modules {sorted(names)}"
        )
    for name, module in model.named_modules():
        dropout = isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0
        if dropout and module.training and not is_replayable(module):
            raise ValueError(
                f"module {name!r} ({type(module).__name__}) draws in training mode but is "
                "not replayable: the reference cannot reproduce its draws"
            )


class _Sampled:
    """The float64 copy of a model as functions of (parameters, rows of the batch)."""

    def __init__(
        self,
        model: nn.Module,
        inputs: Inputs,
        batch: int,
        draws: Mapping[str, Tensor] | None,
    ):
        _check_randomness(model, draws)
        self.model = copy.deepcopy(model).double()
        self.select = split_inputs(_to_double(inputs), batch)
        self.draws = {k: _double(v) for k, v in (draws or {}).items()}
        for name, draw in self.draws.items():
            if draw.shape[0] != batch:
                raise ValueError(
                    f"draw of {name!r} has shape {tuple(draw.shape)}, batch {batch}"
                )
        named = list(self.model.named_parameters())
        self.params = {n: p.detach() for n, p in named if p.requires_grad}
        frozen = {n: p.detach() for n, p in named if not p.requires_grad}
        self.state = {**frozen, **dict(self.model.named_buffers())}

    def __call__(self, params: dict[str, Tensor], rows: slice) -> Tensor:
        for name, draw in self.draws.items():
            self.model.get_submodule(name).replay = draw[rows]
        args, kwargs = self.select(rows)
        return functional_call(self.model, {**params, **self.state}, args, kwargs)


def reference_diag_ggn(
    model: nn.Module,
    loss_func: nn.Module,
    inputs: Inputs,
    targets: Tensor,
    draws: Mapping[str, Tensor] | None = None,
    per_sample: bool = False,
) -> dict[str, Tensor]:
    """Float64 GGN diagonal, keyed by parameter name (trainable parameters only).

    Args:
        model: The model (left unchanged: the reference works on a float64 copy).
        loss_func: The loss module.
        inputs: Tensor, tuple/list or dict of model inputs (see the module docstring).
        targets: Targets, batch on axis 0 (which defines the batch size).
        draws: For models with replayable random modules, their draws in the forward pass
            under test (:func:`recorded_draws`); each sample replays its slice.
        per_sample: Each sample's term apart, ``[N, *param.shape]`` (its own Jacobian
            and its block of the batch loss's Hessian).
    """
    loss_func = copy.deepcopy(loss_func).double()
    targets = _double(targets)
    batch = targets.shape[0]
    sampled = _Sampled(model, inputs, batch, draws)
    params = sampled.params

    def one_sample(p: dict[str, Tensor], n: int) -> Tensor:
        return sampled(p, slice(n, n + 1)).squeeze(0)

    outputs = torch.stack([one_sample(params, n).detach() for n in range(batch)])
    result = {
        n: torch.zeros(batch, p.numel(), dtype=torch.float64) for n, p in params.items()
    }
    total = sum(p.numel() for p in params.values())
    for n in range(batch):

        def loss_of_sample(out_n: Tensor, n: int = n) -> Tensor:
            full = torch.cat([outputs[:n], out_n.unsqueeze(0), outputs[n + 1 :]])
            return loss_func(full, targets)

        size = outputs[n].numel()
        with warnings.catch_warnings():  # vmap over attention's backward: slow, not wrong
            warnings.filterwarnings("ignore", "There is a performance drop")
            jac = jacrev(one_sample)(params, n)
        jac = {name: j.reshape(size, -1) for name, j in jac.items()}
        if total < size:  # fewer parameters than outputs: H J by Hessian-vector products
            columns = torch.cat(list(jac.values()), dim=1).T.reshape(
                total, *outputs[n].shape
            )

            def hvp(v: Tensor, n: int = n) -> Tensor:
                return jvp(jacrev(loss_of_sample), (outputs[n],), (v,))[1]

            hess_jac = (
                vmap(hvp)(columns)
                .reshape(total, size)
                .T.split([j.shape[1] for j in jac.values()], dim=1)
            )
        else:  # the loss Hessian of this sample's output, [size, size]
            hess = hessian(loss_of_sample)(outputs[n]).reshape(size, size)
            hess_jac = [hess @ j for j in jac.values()]
        for (name, j), hj in zip(jac.items(), hess_jac, strict=True):
            result[name][n] = (hj * j).sum(0)
    if per_sample:
        return {n: result[n].reshape(batch, *p.shape) for n, p in params.items()}
    return {n: result[n].sum(0).reshape(p.shape) for n, p in params.items()}


def reference_sanity(
    model: nn.Module,
    inputs: Inputs,
    batch: int,
    draws: Mapping[str, Tensor] | None = None,
    output: Tensor | None = None,
    rtol: float = 1e-10,
) -> Tensor:
    """Check what the reference relies on; return its float64 batch output.

    - Samples are independent: the one-sample outputs, stacked, equal the output of one
      call on the whole batch (with the same draws replayed).
    - ``output`` (a forward of the model under test, e.g. the one that recorded
      ``draws``) equals the reference's function, so the replayed draws are those used.
    """
    sampled = _Sampled(model, inputs, batch, draws)
    with torch.no_grad():
        whole = sampled(sampled.params, slice(None))
        stacked = torch.cat(
            [sampled(sampled.params, slice(n, n + 1)) for n in range(batch)]
        )
    scale = whole.abs().max().item()
    gap = (stacked - whole).abs().max().item()
    assert gap <= rtol * scale, (
        f"samples are not independent: one-sample outputs differ from the batch output by "
        f"{gap:.3e} (scale {scale:.3e})"
    )
    if output is not None:
        gap = (output.detach().double() - whole).abs().max().item()
        tol = rtol if output.dtype == torch.float64 else 1e-5
        assert gap <= tol * scale, (
            f"the reference's function differs from the given output by {gap:.3e} "
            f"(scale {scale:.3e}): the replayed draws are not those of that forward"
        )
    return whole


def assert_diag_close(
    actual: dict[str, Tensor], expected: dict[str, Tensor], rtol: float, label: str = ""
) -> None:
    """Assert ``max|a - e| <= rtol * scale`` per parameter; report the worst entry.

    ``scale`` is the parameter's largest expected entry, floored at 1e-3 of the largest
    entry of the whole diagonal: a parameter whose exact diagonal is zero (a bias that
    softmax cannot see) is held to rounding noise of the whole problem, not to zero.
    """
    assert list(actual) == list(expected), (
        f"{label}: keys {list(actual)} != {list(expected)}"
    )
    overall = max(e.abs().max().item() for e in expected.values())
    for name, exp in expected.items():
        act = actual[name]
        assert act.shape == exp.shape, f"{label} {name}: shape {act.shape} != {exp.shape}"
        diff = (act.detach().cpu().double() - exp.cpu().double()).abs()
        scale = max(exp.abs().max().item(), 1e-3 * overall)
        worst = int(diff.argmax())
        assert diff.max().item() <= rtol * scale, (
            f"{label} {name}: max abs error {diff.max().item():.3e} at flat index {worst} "
            f"(got {act.flatten()[worst].item():.6e}, expected "
            f"{exp.flatten()[worst].item():.6e}); allowed {rtol:.0e} x {scale:.3e}; "
            f"{int((diff > rtol * scale).sum())} of {diff.numel()} entries off"
        )


def _unfold_reference(module: nn.Module, x: Tensor) -> Tensor:
    """A Conv1d/Conv2d's input patches ``[N, C_in * prod(kernel), P]`` with F.unfold."""
    import torch.nn.functional as F

    conv1d = isinstance(module, nn.Conv1d)
    if conv1d:  # a Conv1d is a Conv2d over a height of 1
        x = x.unsqueeze(2)
    two = (lambda v: (1, v[0])) if conv1d else (lambda v: tuple(v))
    kernel, stride, dilation = (two(module.kernel_size), two(module.stride),
                                two(module.dilation))  # fmt: skip
    if module.padding == "same":
        pads = []
        for k, d in zip(reversed(kernel), reversed(dilation), strict=True):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
    else:
        padding = (0, 0) if module.padding == "valid" else tuple(module.padding)
        if conv1d:
            padding = (0, *padding)
        pads = [padding[1], padding[1], padding[0], padding[0]]
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    x = F.pad(x, pads, mode=mode)
    return F.unfold(x, kernel, dilation=dilation, stride=stride)


def reference_kron(
    model: nn.Module, loss_func: nn.Module, inputs: Tensor, targets: Tensor
) -> dict[str, tuple[Tensor, Tensor | None]]:
    """Float64 KFLR factors ``(G, A)`` of every trainable Linear/Conv1d/Conv2d, brute force.

    ``G = sum_n J_n^T H_n J_n`` with ``J_n`` the Jacobian (``torch.func.jacrev``) of sample
    ``n``'s output w.r.t. a shift ``delta [C_out]`` added to the layer's output on every
    position (a virtual bias) and ``H_n`` the loss Hessian w.r.t. that output;
    ``A = (1/N) sum_n sum_p u u^T`` over the layer's inputs (``F.unfold`` patches for
    convolutions), ``None`` for a frozen weight.
    """
    model = copy.deepcopy(model).double()
    loss_func = copy.deepcopy(loss_func).double()
    x, targets = _double(inputs), _double(targets)
    batch = targets.shape[0]
    with torch.no_grad():
        outputs = model(x)
    size = outputs[0].numel()
    hessians = []
    for n in range(batch):

        def loss_of_sample(out_n: Tensor, n: int = n) -> Tensor:
            full = torch.cat([outputs[:n], out_n.unsqueeze(0), outputs[n + 1 :]])
            return loss_func(full, targets)

        hessians.append(hessian(loss_of_sample)(outputs[n]).reshape(size, size))
    result = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            continue
        trainable = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not trainable:
            continue
        axis = -1 if isinstance(module, nn.Linear) else 1
        channels = module.weight.shape[0]
        state: dict[str, Any] = {}

        def shift(mod, args, out, state=state, axis=axis):
            state["input"] = args[0].detach()
            shape = [1] * out.dim()
            shape[axis] = -1
            return out + state["delta"].reshape(shape)

        handle = module.register_forward_hook(shift)
        try:

            def sample_output(delta: Tensor, n: int, state=state) -> Tensor:
                state["delta"] = delta
                return model(x[n : n + 1]).squeeze(0)

            zero = torch.zeros(channels, dtype=torch.float64)
            g = torch.zeros(channels, channels, dtype=torch.float64)
            for n in range(batch):
                jac = jacrev(sample_output)(zero, n).reshape(size, channels)
                g += jac.T @ hessians[n] @ jac
            state["delta"] = zero
            with torch.no_grad():
                model(x)
        finally:
            handle.remove()
        a = None
        if module.weight.requires_grad:
            u = state["input"]
            if isinstance(module, nn.Linear):
                flat = u.reshape(-1, u.shape[-1])
                a = flat.T @ flat / batch
            else:
                patches = _unfold_reference(module, u)
                a = torch.einsum("nkp,nlp->kl", patches, patches) / batch
        result[name] = (g, a)
    return result
