"""GGN-diagonal methods: ggnchunk and the alternatives it is measured against.

Each method is ``fn(model, loss_func, inputs, targets, **params) -> list[Tensor]`` (one
tensor per trainable parameter, in ``named_parameters()`` order). Methods that set
things up once (BackPACK's ``extend``) do it on the first call, so that a warm-up call
pays for it and timed calls do not.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from backpack import backpack, extend, memory_cleanup
from backpack.custom_module.slicing import Slicing
from backpack.extensions import DiagGGNExact, DiagGGNMC
from torch import Tensor, nn

import ggnchunk

_HOOK_WARNING = "Full backward hook is firing"


_FLAT: dict[int, nn.Module] = {}


def _flat_model(model: nn.Module, output_dims: int) -> nn.Module:
    """BackPACK's MSE needs ``[N, D]`` outputs: append a Flatten where needed (once)."""
    if id(model) not in _FLAT:
        flat = nn.Sequential(model, nn.Flatten()) if output_dims > 2 else model
        _FLAT[id(model)] = extend(flat)
    return _FLAT[id(model)]


def _backpack_targets(loss_func: nn.Module, targets: Tensor) -> Tensor:
    return targets if isinstance(loss_func, nn.CrossEntropyLoss) else targets.flatten(1)


_CONVERTED: dict[int, nn.Module] = {}


def _converted(model: nn.Module, flatten: bool) -> nn.Module:
    """``extend(model, use_converter=True)``: BackPACK's torch.fx rewrite (once)."""
    if id(model) not in _CONVERTED:
        net = nn.Sequential(model, nn.Flatten()) if flatten else model
        _CONVERTED[id(model)] = extend(net, use_converter=True)
    return _CONVERTED[id(model)]


def backpack_one_pass(
    model, loss_func, inputs, targets, mc_samples: int = 0, use_converter: bool = False
) -> list[Tensor]:
    """BackPACK ``DiagGGNExact`` (or ``DiagGGNMC`` with ``mc_samples``) in one pass.

    ``use_converter``: extend through BackPACK's torch.fx converter, which rewrites
    residual additions and in-place operations (ResNets) into BackPACK modules; results
    are read from the converted module's parameters, in the same order.
    """
    is_ce = isinstance(loss_func, nn.CrossEntropyLoss)
    with torch.no_grad():
        dims = model(inputs[:1]).dim()
    if use_converter:
        net = _converted(model, flatten=not is_ce and dims > 2)
    else:
        net = extend(model if is_ce else _flat_model(model, dims))
    loss_module = extend(loss_func)
    extension = DiagGGNMC(mc_samples=mc_samples) if mc_samples else DiagGGNExact()
    params = [p for p in (net if use_converter else model).parameters() if p.requires_grad]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_HOOK_WARNING)
        loss = loss_module(net(inputs), _backpack_targets(loss_func, targets))
        with backpack(extension):
            torch.autograd.grad(loss, params)
    return [getattr(p, extension.savefield) for p in params]


def slicing_loop(model, loss_func, inputs, targets, num_chunks: int = 4) -> list[Tensor]:
    """The BackPACK tutorial's hand-written loop: ``Slicing`` of the flattened output.

    Re-implemented as in the tutorial (a new extended ``Slicing`` module per chunk),
    with two repairs so it can run as a baseline: uneven chunks are weighted by their
    share of the outputs (the tutorial divides by ``num_chunks`` and requires it to divide
    the output size), and each ``Slicing`` module is cleaned up (the tutorial's leaks).
    MSE only, like the tutorial.
    """
    if not isinstance(loss_func, nn.MSELoss):
        raise NotImplementedError("the tutorial's slicing loop is for MSELoss only")
    with torch.no_grad():
        dims = model(inputs[:1]).dim()
    net = _flat_model(model, dims)
    extend(loss_func)
    params = [p for p in model.parameters() if p.requires_grad]
    result = [torch.zeros_like(p) for p in params]
    flat_targets = targets.flatten(1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_HOOK_WARNING)
        output = net(inputs)
        total = output.shape[1]
        bounds = torch.linspace(0, total, num_chunks + 1).round().long().tolist()
        for index in range(num_chunks):
            last = index == num_chunks - 1
            sl = (slice(None), slice(bounds[index], bounds[index + 1]))
            chunk_module = extend(Slicing(sl))
            loss = loss_func(chunk_module(output), flat_targets[sl])
            with backpack(DiagGGNExact(), retain_graph=not last):
                torch.autograd.grad(loss, params, retain_graph=not last)
            weight = (bounds[index + 1] - bounds[index]) / total
            if loss_func.reduction == "sum":
                weight = 1.0
            for acc, p in zip(result, params, strict=True):
                acc.add_(p.diag_ggn_exact, alpha=weight)
            memory_cleanup(chunk_module)
    for module in net.modules():
        memory_cleanup(module)
    return result


def ggnchunk_method(
    model, loss_func, inputs, targets, **params
) -> tuple[list[Tensor], dict]:
    """``ggnchunk.diag_ggn`` with the given chunking arguments; also its chunking."""
    diag, report = ggnchunk.diag_ggn(
        model, loss_func, inputs, targets, return_report=True, **params
    )
    info = {"chunk_size": report.chunk_size, "passes": report.num_passes,
            "columns": report.num_columns, "setup_s": report.setup_seconds,
            "setup_mib": report.setup_bytes / 2**20}  # fmt: skip
    return list(diag.values()), info


def torch_func_brute_force(model, loss_func, inputs, targets) -> list[Tensor]:
    """Per-sample Jacobians (``vmap(jacrev)``) and per-sample loss Hessians."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def one(p, x):
        return torch.func.functional_call(model, p, (x.unsqueeze(0),)).squeeze(0)

    jac = torch.func.vmap(torch.func.jacrev(one), in_dims=(None, 0))(params, inputs)
    with torch.no_grad():
        out = model(inputs)
    n, size = out.shape[0], out[0].numel()
    hessians = []
    for i in range(n):

        def loss_i(o, i=i):
            return loss_func(torch.cat([out[:i], o.unsqueeze(0), out[i + 1 :]]), targets)

        hessians.append(torch.func.hessian(loss_i)(out[i]).reshape(size, size))
    hess = torch.stack(hessians)
    result = []
    for name, p in params.items():
        j = jac[name].reshape(n, size, -1)
        result.append(torch.einsum("nop,noq,nqp->p", j, hess, j).reshape(p.shape))
    return result


METHODS: dict[str, Callable[..., list[Tensor]]] = {
    "backpack": backpack_one_pass,
    "slicing": slicing_loop,
    "ggnchunk": ggnchunk_method,
    "torch_func": torch_func_brute_force,
}
