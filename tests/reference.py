"""Brute-force float64 GGN diagonal with ``torch.func``; shares no code with ggnchunk.

``diag(sum_n J_n^T H_n J_n)`` with ``J_n`` the Jacobian of sample ``n``'s output w.r.t. all
trainable parameters (``torch.func.jacrev`` of a one-sample ``functional_call``) and
``H_n`` the Hessian of the whole batch's loss w.r.t. sample ``n``'s output
(``torch.func.hessian``), so the loss's reduction enters exactly as torch defines it.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev


def _double(tensor: Tensor) -> Tensor:
    return tensor.double() if tensor.is_floating_point() else tensor


def reference_diag_ggn(
    model: nn.Module, loss_func: nn.Module, inputs: Tensor, targets: Tensor
) -> dict[str, Tensor]:
    """Float64 GGN diagonal, keyed by parameter name (trainable parameters only)."""
    model = copy.deepcopy(model).double()
    loss_func = copy.deepcopy(loss_func).double()
    inputs, targets = _double(inputs.detach()), _double(targets.detach())
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())
    state = {**frozen, **buffers}

    def one_sample(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return functional_call(model, {**p, **state}, (x.unsqueeze(0),)).squeeze(0)

    with torch.no_grad():
        outputs = functional_call(model, {**params, **state}, (inputs,))
    result = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in params.items()}
    for n in range(inputs.shape[0]):

        def loss_of_sample(out_n: Tensor, n: int = n) -> Tensor:
            full = torch.cat([outputs[:n], out_n.unsqueeze(0), outputs[n + 1 :]])
            return loss_func(full, targets)

        hess = hessian(loss_of_sample)(outputs[n])
        size = outputs[n].numel()
        hess = hess.reshape(size, size)
        jac = jacrev(one_sample)(params, inputs[n])
        for name, j in jac.items():
            j = j.reshape(size, -1)
            result[name] += ((hess @ j) * j).sum(0)
    return {n: result[n].reshape(p.shape) for n, p in params.items()}


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
