r"""Per-output predictive variance under a diagonal posterior, on the GGN engine.

For a posterior ``N(theta*, diag(s))`` over the trainable parameters, the linearized
(GLM) predictive variance of output coordinate ``m`` of sample ``n`` is
``Var f_nm = sum_p J_nmp**2 s_p``: the columns are the output coordinates (the identity,
no loss), swept like the GGN diagonal's, and each column's squared per-sample products
are reduced over the parameters (weighted by ``s``) instead of summed over columns.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ggnchunk._api import ChunkOptions, GGNReport, _compute, _legacy_distributed
from ggnchunk._checks import check_batch, check_positive_int
from ggnchunk._distributed import check_same_work, resolve_group
from ggnchunk._engine import Problem, full_float32, model_lock
from ggnchunk._quantities import OutputVariance

__all__ = ["output_variance"]


def _batch_size(inputs: Any, given: int | None) -> int:
    """``N``: axis 0 of the input tensors (all of them must agree), or ``given``."""
    sizes, stack, found = [], [inputs], False
    while stack:
        value = stack.pop(0)
        if isinstance(value, Tensor):
            found = True
            if value.dim() > 0:
                sizes.append(int(value.shape[0]))
        elif isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, Mapping):
            stack.extend(value.values())
    if not found:
        raise TypeError(
            "inputs must be a torch.Tensor with the batch on axis 0, a tuple/list of "
            "model arguments (model(*inputs)) or a dict (model(**inputs)); got "
            f"{type(inputs).__name__} without tensors."
        )
    if given is not None:
        size = check_positive_int(given, "batch_size")
        if size not in sizes:
            raise ValueError(
                f"batch_size={size}, but no tensor of inputs has {size} entries on axis "
                f"0 (they have {sorted(set(sizes))}); pass the number of samples."
            )
        return size
    if not sizes or 0 in sizes:
        raise ValueError(
            "inputs has no batch axis or an empty batch (axis 0 of its tensors: "
            f"{sizes}). Pass at least one sample, batch on axis 0."
        )
    if len(set(sizes)) > 1:
        raise ValueError(
            f"inputs' tensors differ on axis 0 ({sorted(set(sizes))}), so the batch size "
            "is not clear (without targets, output_variance takes it from the inputs); "
            "pass batch_size=N. Tensors with N entries on axis 0 are per-sample, the "
            "others are passed whole to every sub-batch."
        )
    return sizes[0]


def _check_variance(problem: Problem, variance: object) -> list[Tensor]:
    """The posterior variance as one tensor per trainable parameter, checked."""
    names, params = problem.names, problem.params
    total = sum(p.numel() for p in params)
    if isinstance(variance, Mapping):
        missing = [n for n in names if n not in variance]
        extra = [k for k in variance if k not in set(names)]
        if missing or extra:
            raise ValueError(
                f"posterior_variance has no entry for {missing[:3]} and entries for "
                f"{extra[:3]} that are not trainable parameters; pass one tensor per "
                "trainable parameter, keyed as model.named_parameters() (as diag_ggn "
                "returns them), or a flat tensor."
            )
        values = [variance[n] for n in names]
    elif isinstance(variance, Tensor):
        if variance.dim() != 1 or variance.numel() != total:
            raise ValueError(
                f"posterior_variance has shape {tuple(variance.shape)}; a flat tensor "
                f"needs shape [{total}] (the trainable parameters, flattened in "
                "named_parameters() order), or pass a dict of per-parameter tensors."
            )
        values = list(torch.split(variance, [p.numel() for p in params]))
    else:
        raise TypeError(
            "posterior_variance must be a flat tensor or a dict {parameter name: tensor}, "
            f"got {type(variance).__name__}."
        )
    checked = []
    for name, param, value in zip(names, params, values, strict=True):
        if not isinstance(value, Tensor) or value.numel() != param.numel():
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value)
            raise ValueError(
                f"posterior_variance[{name!r}] has shape {shape}, but the parameter has "
                f"shape {tuple(param.shape)}."
            )
        if value.device != param.device:
            raise ValueError(
                f"posterior_variance is on {value.device} but the model is on "
                f"{param.device}; move it with .to({str(param.device)!r})."
            )
        if not value.dtype.is_floating_point:
            raise ValueError(
                f"posterior_variance has dtype {value.dtype}; pass floating-point "
                "variances."
            )
        if bool((value < 0).any()) or not bool(torch.isfinite(value).all()):
            raise ValueError(
                f"posterior_variance[{name!r}] has negative or non-finite entries; "
                "variances must be finite and non-negative."
            )
        checked.append(value.detach().reshape(param.shape).to(param.dtype))
    return checked


def output_variance(
    model: nn.Module,
    inputs: Tensor,
    posterior_variance: Tensor | Mapping[str, Tensor],
    *,
    batch_size: int | None = None,
    return_report: bool = False,
    options: ChunkOptions | None = None,
    **chunking: Any,
) -> Tensor | tuple[Tensor, GGNReport]:
    r"""Predictive variance of every output under a diagonal posterior (linearized).

    For a Gaussian posterior with diagonal covariance ``diag(s)`` over the trainable
    parameters (a diagonal Laplace approximation), the variance of the linearized model's
    output coordinate ``m`` for sample ``n`` is ``Var f_nm = sum_p J_nmp**2 s_p``, with
    ``J_n`` the Jacobian of sample ``n``'s output w.r.t. the parameters — the diagonal of
    laplace-torch's ``glm`` functional variance ``J diag(s) J^T`` without forming it
    (``[N, M, M]``) or the Jacobians (``[N, M, P]``). Exact.

    The output coordinates are the columns, chunked exactly as :func:`diag_ggn`'s columns
    (the same options and memory budget): one forward pass, then one backward pass per
    chunk of output coordinates. No loss is needed.

    Args:
        model: As in :func:`diag_ggn`.
        inputs: Model inputs, batch on axis 0 (a tensor, or a tuple/list or dict of
            model arguments as in :func:`diag_ggn`).
        posterior_variance: ``s``: a flat tensor ``[P]`` over the trainable parameters in
            ``named_parameters()`` order (laplace-torch's ``posterior_variance``), or a
            dict ``{name: tensor of the parameter's shape}``; finite, non-negative.
        batch_size: The number of samples ``N``, needed only where the tensors among
            ``inputs`` differ on axis 0 (as in :func:`diag_ggn`, where the targets give
            it, tensors with ``N`` entries on axis 0 are per-sample).
        return_report: Also return a :class:`GGNReport`.
        options: The chunking settings as one :class:`ChunkOptions` (optional), over
            output coordinates instead of loss-Hessian columns
            (``column_parallel=True``: ranks share the output coordinates).
        **chunking: Or the same settings as keywords, as in :func:`diag_ggn`
            (``num_chunks``, ``chunk_size``, ``max_memory``, ``batch_chunk_size``,
            ``recover_oom``, ``column_parallel``, ``progress``); not both.

    Returns:
        ``[N, *output_shape]`` variances (the model output's shape, dtype and device);
        with ``return_report=True``, the pair ``(variance, report)``.

    Raises:
        TypeError: For arguments of the wrong type (the message names the argument).
        ValueError: For a posterior variance that does not fit the parameters, and
            everything :func:`diag_ggn` refuses about the model and chunk options.

    Examples:
        >>> import torch, ggnchunk
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 3))
        >>> s = torch.full((sum(p.numel() for p in model.parameters()),), 1e-2)
        >>> var = ggnchunk.output_variance(model, torch.randn(5, 4), s, num_chunks=2)
        >>> tuple(var.shape)
        (5, 3)
    """
    _legacy_distributed(chunking, "output_variance")
    options = ChunkOptions.resolve(options, chunking, "output_variance")
    problem = Problem.build(model, None)
    variance = _check_variance(problem, posterior_variance)
    size = _batch_size(inputs, batch_size)
    placeholder = problem.params[0].new_zeros(size)
    batch = check_batch(
        list(zip(problem.names, problem.params, strict=True)), inputs, placeholder
    )
    group = resolve_group(True, model) if options.column_parallel else None
    if group is not None:
        check_same_work(group, {"posterior_variance": list(variance)})
    spec = partial(OutputVariance, variance=variance)
    with (
        model_lock(model),
        torch.autocast(problem.device.type, enabled=False),
        full_float32(),
    ):
        quantity, _, _, report = _compute(problem, batch, None, options, 1.0, spec, group)
    result = quantity.final()
    return (result, report) if return_report else result
