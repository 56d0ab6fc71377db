"""Columns of the symmetric square root of a loss Hessian, by loss class.

For a loss ``L(f) = sum_n l_n(f_n)`` over model outputs ``f_n`` the GGN diagonal is
``diag(G) = sum_n sum_v (J_n^T S_n[:, v])**2`` where ``S_n S_n^T = d^2 l_n / d f_n^2``.
Any partition of the column index ``v`` therefore splits the computation exactly. This
module knows, for each supported loss class, how many columns ``S`` has and how to build
any contiguous range of them, in the layout the sweep backpropagates (BackPACK's):
``[num_columns_in_range, N, *output_shape]``.

A new loss is one new :class:`LossSqrtHessian` subclass registered in ``LOSSES``.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ggnchunk._autograd import quiet_autograd
from ggnchunk._checks import warn
from ggnchunk._windows import Windowed, window
from ggnchunk.losses import GaussianNLL

__all__ = [
    "LOSSES",
    "LossSqrtHessian",
    "SqrtHessianFactor",
    "averages",
    "identity_factor",
    "lookup_loss",
    "sampled_factor",
]


class SqrtHessianFactor(ABC):
    """The square root of one batch's loss Hessian, built column range by range."""

    def squared_mask(self, start: int, stop: int) -> Tensor | None:
        """``sum_v S[v]**2`` over columns ``start:stop`` if each column is one-hot.

        For losses whose Hessian is diagonal in the output coordinates (MSE, BCE) column
        ``v`` is ``s_n e_v``; a layer producing the model output can then form its
        diagonal from this mask alone (see :meth:`ggnchunk._rules.LayerRule.diag_onehot`).

        Args:
            start: First column (inclusive).
            stop: Last column (exclusive).

        Returns:
            ``[N or 1, *output_shape[1:]]``, or ``None`` if columns are not one-hot.
        """
        return None

    num_columns: int
    """Number of columns ``V`` of the square root (per sample)."""

    local = False
    """Each column is non-zero at one output position only (all its channels): the
    sweeps may carry it on the box that position reaches (:mod:`ggnchunk._windows`)."""

    def windowed_columns(self, start: int, stop: int) -> Any:
        """Columns ``start:stop`` on their boxes (:class:`~ggnchunk._windows.Windowed`).

        Args:
            start: First column (inclusive).
            stop: Last column (exclusive).

        Returns:
            A block (or the dense columns where windows do not pay).
        """
        return window(self.columns(start, stop))

    @abstractmethod
    def columns(self, start: int, stop: int) -> Tensor:
        """Columns ``start:stop`` of the square root.

        Args:
            start: First column (inclusive).
            stop: Last column (exclusive).

        Returns:
            Tensor of shape ``[stop - start, N, *output_shape]``.
        """

    def column_bytes(self) -> int:
        """Bytes of one column of the square root (``N * prod(output_shape)`` entries).

        Returns:
            Size in bytes of the tensor :meth:`columns` returns per column.
        """
        return self._column_numel * self._element_size

    _column_numel: int
    _element_size: int

    def combine(self, noise: Tensor) -> Tensor:
        """``S_n noise[k, n]`` for every sample: random combinations of the columns.

        The default builds the columns in ranges of at most ``k`` (memory of ``k``
        columns); factors with structure override it.

        Args:
            noise: ``[K, N, V]`` weights, one per (draw, sample, column).

        Returns:
            ``[K, N, *output_shape]``.
        """
        count, n, total = noise.shape
        result: Tensor | None = None
        step = max(count, 1)
        for a in range(0, total, step):
            b = min(total, a + step)
            columns = self.columns(a, b)  # [c, N, *output]
            term = torch.einsum(
                "knc,cnf->knf", noise[:, :, a:b], columns.reshape(b - a, n, -1)
            )
            result = term if result is None else result.add_(term)
            shape = columns.shape[1:]
        return result.view(count, *shape)


class _SampledFactor(SqrtHessianFactor):
    """``K`` Monte-Carlo columns ``S_n eps_k / sqrt(K)``, drawn once per forward pass."""

    def __init__(self, columns: Tensor):
        self._columns = columns
        self.num_columns = columns.shape[0]
        self._column_numel = columns[0].numel()
        self._element_size = columns.element_size()

    def columns(self, start: int, stop: int) -> Tensor:
        return self._columns[start:stop]


def sampled_factor(
    exact: SqrtHessianFactor, samples: int, generator: torch.Generator
) -> SqrtHessianFactor:
    r"""Monte-Carlo square root: ``K`` columns ``S_n \epsilon_k / \sqrt{K}``.

    With ``eps_k ~ N(0, I_V)`` independent, ``E[S eps eps^T S^T] = S S^T = H``, so
    ``sum_k (J^T S eps_k)**2 / K`` is an unbiased estimate of ``diag(J^T H J)`` (and the
    Kronecker output factors' estimate is unbiased likewise), for every loss.

    Args:
        exact: The exact square root of the forward pass.
        samples: ``K``.
        generator: A CPU generator the noise is drawn from (``[K, N, V]``).

    Returns:
        A factor with ``K`` columns.
    """
    probe = exact.columns(0, 1)
    n = probe.shape[1]
    noise = torch.randn(
        samples, n, exact.num_columns, generator=generator, dtype=probe.dtype
    ).to(probe.device)
    del probe
    columns = exact.combine(noise)
    columns.mul_(samples**-0.5)
    return _SampledFactor(columns)


def identity_factor(output: Tensor) -> SqrtHessianFactor:
    """The identity over the output coordinates, the same for every sample.

    Args:
        output: The model output ``[N, ...]``.

    Returns:
        A factor with ``prod(output.shape[1:])`` one-hot columns.
    """
    return _ScaledIdentityFactor(output, 1.0)


class LossSqrtHessian(ABC):
    """How to factorize the Hessian of one loss class."""

    loss_class: type[nn.Module]

    @abstractmethod
    def check(self, loss_func: nn.Module) -> None:
        """Raise a ``ValueError`` for loss options that ggnchunk cannot handle exactly.

        Args:
            loss_func: The user's loss module.
        """

    @abstractmethod
    def check_shapes(self, loss_func: nn.Module, output: Tensor, target: Tensor) -> None:
        """Raise a ``ValueError`` if output and target do not fit this loss.

        Args:
            loss_func: The user's loss module.
            output: Model output, shape ``[N, ...]``.
            target: Targets.
        """

    @abstractmethod
    def normalizer(self, loss_func: nn.Module, target: Tensor) -> Tensor:
        """The divisor of ``reduction="mean"``, from the targets alone.

        It is additive over sub-batches, so a batch split into parts is normalized
        exactly by the sum of the parts' normalizers.

        Args:
            loss_func: The user's loss module.
            target: Targets of the whole batch.

        Returns:
            Scalar tensor.
        """

    @abstractmethod
    def factorize(
        self, loss_func: nn.Module, output: Tensor, target: Tensor, scale: float | Tensor
    ) -> SqrtHessianFactor:
        """Build the square-root factor for one batch.

        Args:
            loss_func: The user's loss module.
            output: Detached model output, shape ``[N, ...]``.
            target: Detached targets.
            scale: Factor of the loss: ``1`` for ``reduction="sum"``, ``1 / normalizer``
                of the whole batch for ``"mean"``.

        Returns:
            The factor, whose columns can be requested range by range.
        """


def averages(loss_func: nn.Module) -> bool:
    """Whether the loss divides its sum by a normalizer (``"mean"``, KL's ``"batchmean"``).

    Args:
        loss_func: The loss module.

    Returns:
        True for ``reduction="mean"`` and ``"batchmean"``.
    """
    return getattr(loss_func, "reduction", None) in ("mean", "batchmean")


def _reduction_checked(loss_func: nn.Module) -> str:
    reduction = getattr(loss_func, "reduction", None)
    if reduction == "batchmean" and isinstance(loss_func, nn.KLDivLoss):
        return reduction  # the sum over the batch size
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"loss_func has reduction={reduction!r}; ggnchunk needs a scalar loss. "
            f"Use {type(loss_func).__name__}(reduction='mean') or (reduction='sum')."
        )
    return reduction


def _same_shape(output: Tensor, target: Tensor, loss_name: str) -> None:
    if output.shape != target.shape:
        raise ValueError(
            f"targets have shape {tuple(target.shape)} but the model output has shape "
            f"{tuple(output.shape)}; {loss_name} needs them equal. Reshape the targets "
            "(ggnchunk needs no Flatten in the model: targets may be image- or "
            "sequence-shaped like the output)."
        )


class _DiagonalFactor(SqrtHessianFactor):
    """Square root of a Hessian that is diagonal in the output coordinates."""

    local = True

    def __init__(self, sqrt_diag: Tensor):
        # sqrt_diag: [N, *output_shape], the square roots of the Hessian's diagonal
        # (an output of one number per sample, [N], has one column)
        self._sqrt = sqrt_diag.reshape(sqrt_diag.shape[0], -1)
        self._shape = sqrt_diag.shape
        self.num_columns = self._sqrt.shape[1]
        self._column_numel = self._sqrt.numel()
        self._element_size = self._sqrt.element_size()

    def columns(self, start: int, stop: int) -> Tensor:
        count = stop - start
        n, d = self._sqrt.shape
        result = self._sqrt.new_zeros(count, n, d)
        local = torch.arange(count, device=self._sqrt.device)
        result[local, :, local + start] = self._sqrt[:, start:stop].T
        return result.view(count, *self._shape)

    def combine(self, noise: Tensor) -> Tensor:
        return (noise * self._sqrt).view(noise.shape[0], *self._shape)

    def windowed_columns(self, start: int, stop: int) -> Any:
        if len(self._shape) < 3:
            return self.columns(start, stop)
        return _one_hot_block(self._shape, start, stop, self._sqrt[:, start:stop].T)

    def squared_mask(self, start: int, stop: int) -> Tensor:
        mask = torch.zeros_like(self._sqrt)
        mask[:, start:stop] = self._sqrt[:, start:stop].square()
        return mask.view(self._shape)


def _one_hot_block(shape: torch.Size, start: int, stop: int, values: Tensor) -> Windowed:
    """Columns ``s e_j`` of outputs ``[N, C, *S]`` on one-position boxes.

    Args:
        shape: The output's shape.
        start: First column (flat output index).
        stop: Last column (exclusive).
        values: ``[V, N or 1]``: each column's entry per sample.

    Returns:
        The block ``[V, N or 1, C, 1, ...]``.
    """
    v, c, spatial = stop - start, shape[1], tuple(shape[2:])
    positions = math.prod(spatial)
    index = torch.arange(start, stop, device=values.device)
    channel, flat = index // positions, index % positions
    starts = _coordinates(flat, spatial)
    data = values.new_zeros(v, values.shape[1], c, *([1] * len(spatial)))
    data.view(v, values.shape[1], c)[torch.arange(v, device=values.device), :, channel] = (
        values
    )
    return Windowed(data, starts, spatial)


def _coordinates(flat: Tensor, spatial: tuple[int, ...]) -> Tensor:
    """``[V, d]`` coordinates of flat positions ``[V]`` in a map of size ``spatial``."""
    coords = []
    for size in reversed(spatial):
        coords.append(flat % size)
        flat = flat // size
    return torch.stack(coords[::-1], 1)


class _ScaledIdentityFactor(SqrtHessianFactor):
    """Square root ``c * I``, the same for every sample: stored once, expanded over N.

    Like BackPACK's own MSE square root, the batch axis is a stride-0 expansion, so a
    chunk of ``L`` columns costs ``L * D`` entries instead of ``L * N * D`` and the
    layers' einsums read less memory.
    """

    local = True

    def __init__(self, output: Tensor, value: float):
        self._shape = output.shape
        self._batch = output.shape[0]
        self._features = output[0].numel()
        self._value = value
        self._dtype, self._device = output.dtype, output.device
        self.num_columns = self._features
        self._column_numel = self._features
        self._element_size = output.element_size()

    def columns(self, start: int, stop: int) -> Tensor:
        count = stop - start
        rows = torch.zeros(count, self._features, dtype=self._dtype, device=self._device)
        local = torch.arange(count, device=self._device)
        rows[local, local + start] = self._value
        return (
            rows.unsqueeze(1)
            .expand(count, self._batch, self._features)
            .view(count, *self._shape)
        )

    def combine(self, noise: Tensor) -> Tensor:
        return (noise * self._value).view(noise.shape[0], *self._shape)

    def windowed_columns(self, start: int, stop: int) -> Any:
        if len(self._shape) < 3:
            return self.columns(start, stop)
        values = torch.full((stop - start,), self._value, dtype=self._dtype,
                            device=self._device)  # fmt: skip
        block = _one_hot_block(self._shape, start, stop, values.view(-1, 1))
        return block.expanded(self._batch)

    def squared_mask(self, start: int, stop: int) -> Tensor:
        mask = torch.zeros(1, self._features, dtype=self._dtype, device=self._device)
        mask[:, start:stop] = self._value**2
        return mask.view(1, *self._shape[1:])


class MSELossSqrtHessian(LossSqrtHessian):
    """``nn.MSELoss``: Hessian ``2 / norm * I`` per sample (``norm = N * D`` for mean)."""

    loss_class = nn.MSELoss

    def check(self, loss_func: nn.Module) -> None:
        _reduction_checked(loss_func)

    def check_shapes(self, loss_func, output, target) -> None:
        _same_shape(output, target, "MSELoss")

    def normalizer(self, loss_func, target) -> Tensor:
        return torch.tensor(float(target.numel()))

    def factorize(self, loss_func, output, target, scale) -> SqrtHessianFactor:
        return _ScaledIdentityFactor(output, math.sqrt(2.0 * float(scale)))


class BCEWithLogitsLossSqrtHessian(LossSqrtHessian):
    """``nn.BCEWithLogitsLoss`` with any output shape, ``weight`` and ``pos_weight``.

    Per element the Hessian w.r.t. the logit ``z`` is
    ``w * sigma(z) * (1 - sigma(z)) * (pos_weight * y + 1 - y)``, diagonal across elements.
    """

    loss_class = nn.BCEWithLogitsLoss

    def check(self, loss_func: nn.Module) -> None:
        _reduction_checked(loss_func)
        for name in ("weight", "pos_weight"):
            value = getattr(loss_func, name, None)
            if value is not None and bool((value < 0).any()):
                raise ValueError(
                    f"loss_func.{name} has negative entries; the GGN is only defined for "
                    f"a convex loss. Use a non-negative {name}."
                )

    def check_shapes(self, loss_func, output, target) -> None:
        _same_shape(output, target, "BCEWithLogitsLoss")

    def normalizer(self, loss_func, target) -> Tensor:
        return torch.tensor(float(target.numel()))

    def factorize(self, loss_func, output, target, scale) -> SqrtHessianFactor:
        prob = torch.sigmoid(output)
        hess = prob * (1.0 - prob)
        if loss_func.pos_weight is not None:
            pos_weight = loss_func.pos_weight.to(output)
            hess = hess * (pos_weight * target + 1.0 - target)
        if loss_func.weight is not None:
            hess = hess * loss_func.weight.to(output)
        hess = torch.broadcast_to(hess * float(scale), output.shape)
        # Soft targets outside [0, 1] with pos_weight could make entries negative.
        return _DiagonalFactor(hess.clamp_min(0.0).sqrt())


class _SoftmaxFactor(SqrtHessianFactor):
    """Square root of ``c * (diag(p) - p p^T)`` per sample and position.

    Column ``j`` is class ``j % C`` at flattened position ``j // C`` (a position's classes
    side by side, so that a chunk holds whole positions: below a vocabulary's head their
    columns span the head's input width only, :mod:`ggnchunk._graph.compress`):
    ``S[j][n, c, s] = delta(s, s_j) * sqrt(c[n, s_j]) * (tau_c delta(c, c_j) - p_c tau_cj)``
    with ``tau = sqrt(p)``.
    """

    local = True

    def __init__(self, prob: Tensor, weight: Tensor):
        # prob: [N, C, *spatial]; weight: [N, *spatial] (non-negative per-position factor)
        self._shape = prob.shape
        n, c = prob.shape[:2]
        self._prob = prob.reshape(n, c, -1)
        self._tau = self._prob.sqrt()
        self._sqrt_weight = weight.reshape(n, -1).clamp_min(0.0).sqrt()
        self._positions = self._prob.shape[2]
        self.num_columns = c * self._positions
        self._column_numel = self._prob.numel()
        self._element_size = self._prob.element_size()

    def columns(self, start: int, stop: int) -> Tensor:
        count = stop - start
        n, c, p = self._prob.shape
        device = self._prob.device
        if p == 1:  # no positions: one outer product and a diagonal, no scatter
            prob, tau = self._prob[:, :, 0], self._tau[:, :, 0]  # [N, C]
            tau_j = tau[:, start:stop].T  # [count, N]
            result = tau_j.unsqueeze(2) * prob.unsqueeze(0)  # [count, N, C]
            result.neg_()
            local = torch.arange(count, device=device)
            result[local, :, local + start] += tau_j
            result *= self._sqrt_weight[:, 0].view(1, n, 1)
            return result.view(count, *self._shape)
        values, pos = self._at_positions(start, stop)
        result = self._prob.new_zeros(count, n, c, p)
        result[torch.arange(count, device=device), :, :, pos] = values
        return result.view(count, *self._shape)

    def _at_positions(self, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Columns ``start:stop`` at their positions: ``[V, N, C]`` and positions ``[V]``.

        Column ``j`` there is ``sqrt(w) (tau_c delta(c, c_j) - p_c tau_cj)`` over the
        classes ``c``; zero at every other position.
        """
        c = self._prob.shape[1]
        device = self._prob.device
        index = torch.arange(start, stop, device=device)
        pos, cls = index // c, index % c
        tau_j = self._tau[:, cls, pos].T  # [V, N]
        values = -self._prob[:, :, pos].permute(2, 0, 1) * tau_j[..., None]
        values[torch.arange(stop - start, device=device), :, cls] += tau_j
        values *= self._sqrt_weight[:, pos].T[:, :, None]
        return values, pos

    def windowed_columns(self, start: int, stop: int) -> Any:
        # each column on its position's one-position box, every class there: the
        # columns made dense first took [V, N, C, *S] (40 KB a column for 5 classes
        # of 16x16 maps, 8 images: twice the windowed bound's count per column)
        if len(self._shape) < 3:
            return self.columns(start, stop)
        values, pos = self._at_positions(start, stop)
        spatial = tuple(self._shape[2:])
        data = values.view(*values.shape, *([1] * len(spatial)))
        return Windowed(data, _coordinates(pos, spatial), spatial)

    def combine(self, noise: Tensor) -> Tensor:
        # S eps at (c, s) = sqrt(w_s) (tau_c eps_{c,s} - p_c sum_c' tau_c' eps_{c',s})
        count = noise.shape[0]
        n, c, p = self._prob.shape
        eps = noise.view(count, n, p, c).transpose(2, 3)  # the columns' order
        inner = (self._tau * eps).sum(2, keepdim=True)  # [K, N, 1, P]
        result = self._tau * eps - self._prob * inner
        result *= self._sqrt_weight.view(1, n, 1, p)
        return result.view(count, *self._shape)


class CrossEntropyLossSqrtHessian(LossSqrtHessian):
    """``nn.CrossEntropyLoss``: index or probability targets, extra axes, all options.

    Supports ``weight``, ``ignore_index`` and ``label_smoothing``.
    Per sample and position the loss is ``sum_c a_c (-log p_c)`` with target weights
    ``a`` that do not depend on the logits, so its Hessian is
    ``(sum_c a_c) * (diag(p) - p p^T)``; only the scalar factor depends on the options.
    """

    loss_class = nn.CrossEntropyLoss

    def check(self, loss_func: nn.Module) -> None:
        _reduction_checked(loss_func)
        if loss_func.weight is not None and bool((loss_func.weight < 0).any()):
            raise ValueError(
                "loss_func.weight has negative entries; the GGN is only defined for a "
                "convex loss. Use non-negative class weights."
            )

    def check_shapes(self, loss_func, output, target) -> None:
        if output.dim() < 2:
            raise ValueError(
                f"CrossEntropyLoss needs model outputs of shape [N, C, ...]; got "
                f"{tuple(output.shape)}. Add a batch axis."
            )
        index_shape = (output.shape[0], *output.shape[2:])
        if target.is_floating_point():
            if tuple(target.shape) == index_shape:
                raise ValueError(
                    f"targets have dtype {target.dtype} and shape {tuple(target.shape)}, "
                    f"the shape of class indices for model outputs of shape "
                    f"{tuple(output.shape)}: they look like class indices stored as "
                    "floats. Convert them with targets.long() (floating-point targets "
                    "must be class probabilities of the output's shape)."
                )
            if target.shape != output.shape:
                raise ValueError(
                    f"targets are class probabilities of shape {tuple(target.shape)} but "
                    f"the model output has shape {tuple(output.shape)}; they must be equal."
                )
        elif tuple(target.shape) != index_shape:
            raise ValueError(
                f"targets are class indices of shape {tuple(target.shape)}; for model "
                f"outputs of shape {tuple(output.shape)} CrossEntropyLoss needs "
                f"{index_shape} (the class axis is axis 1 of the output)."
            )

    def normalizer(self, loss_func, target) -> Tensor:
        if target.is_floating_point():  # probabilities [N, C, ...]: one per position
            if target.dim() < 2:
                raise ValueError(
                    f"targets have dtype {target.dtype} and shape {tuple(target.shape)}: "
                    "they look like class indices stored as floats. Convert them with "
                    "targets.long() (floating-point targets must be class probabilities "
                    "of the output's shape [N, C, ...])."
                )
            return torch.tensor(float(target.numel() // target.shape[1]))
        valid = target != loss_func.ignore_index
        if loss_func.weight is None:
            return valid.sum().double().cpu()
        safe = torch.where(valid, target, torch.zeros_like(target))
        return (loss_func.weight[safe] * valid).sum().double().cpu()

    def factorize(self, loss_func, output, target, scale) -> SqrtHessianFactor:
        num_classes = output.shape[1]
        eps = loss_func.label_smoothing
        class_weight = loss_func.weight
        if class_weight is not None:
            class_weight = class_weight.to(output)
        shape = [1, num_classes] + [1] * (output.dim() - 2)
        if target.is_floating_point():
            soft = target.to(output) * (1.0 - eps) + eps / num_classes
            if class_weight is not None:
                soft = soft * class_weight.view(shape)
            factor = soft.sum(dim=1)
        else:
            valid = target != loss_func.ignore_index
            safe_target = torch.where(valid, target, torch.zeros_like(target))
            if class_weight is None:
                target_weight = valid.to(output.dtype)
                smooth = torch.ones_like(target_weight)
            else:
                target_weight = class_weight[safe_target] * valid
                smooth = valid * class_weight.sum() / num_classes
                smooth = smooth.to(output.dtype)
            factor = (1.0 - eps) * target_weight
            if eps > 0:
                factor = factor + eps * (smooth * valid if class_weight is None else smooth)
        factor = factor * float(scale)
        return _SoftmaxFactor(torch.softmax(output, dim=1), factor)


class GaussianNLLSqrtHessian(LossSqrtHessian):
    """:class:`ggnchunk.losses.GaussianNLL`: the likelihood's Fisher, diagonal.

    Per coordinate, ``1 / var`` for the mean and ``1 / 2`` for the log-variance (see
    :mod:`ggnchunk.losses` for why the Fisher and not the NLL's Hessian).
    """

    loss_class = GaussianNLL

    def check(self, loss_func: nn.Module) -> None:
        _reduction_checked(loss_func)

    def check_shapes(self, loss_func, output, target) -> None:
        if output.dim() < 2 or output.shape[1] != 2:
            raise ValueError(
                f"GaussianNLL needs model outputs of shape [N, 2, ...] (mean and "
                f"log-variance on axis 1); got {tuple(output.shape)}."
            )
        expected = (output.shape[0], *output.shape[2:])
        if tuple(target.shape) != expected:
            raise ValueError(
                f"targets have shape {tuple(target.shape)}; for model outputs of shape "
                f"{tuple(output.shape)} GaussianNLL needs {expected} (axis 1 of the output "
                "holds mean and log-variance)."
            )

    def normalizer(self, loss_func, target) -> Tensor:
        return torch.tensor(float(target.numel()))

    def factorize(self, loss_func, output, target, scale) -> SqrtHessianFactor:
        var = output[:, 1].exp().clamp(min=loss_func.eps)
        fisher = torch.stack([1.0 / var, torch.full_like(var, 0.5)], dim=1)
        return _DiagonalFactor((fisher * float(scale)).sqrt())


LOSSES: dict[type[nn.Module], LossSqrtHessian] = {
    handler.loss_class: handler
    for handler in (
        MSELossSqrtHessian(),
        BCEWithLogitsLossSqrtHessian(),
        CrossEntropyLossSqrtHessian(),
        GaussianNLLSqrtHessian(),
    )
}
"""Registry: loss class (exact type) → its Hessian square root."""


class NotConvexWarning(UserWarning):
    """A loss Hessian had negative eigenvalues; the GGN used its positive part."""


class ZeroHessianWarning(UserWarning):
    """The loss Hessian w.r.t. the model output is zero: so is the GGN diagonal."""


def _loss_name(loss_func: nn.Module) -> str:
    """The user's name for the loss (a function's, or its module's class)."""
    if isinstance(loss_func, FunctionLoss):
        fn = loss_func.fn
        return getattr(fn, "__name__", None) or type(fn).__name__
    return type(loss_func).__name__


class FunctionLoss(nn.Module):
    """A loss function ``fn(output, target)`` that sums per-sample terms, as a module.

    Args:
        fn: The function; checked after the forward pass to be a sum over samples.
    """

    reduction = "sum"

    def __init__(self, fn: Callable[[Tensor, Tensor], Tensor]):
        super().__init__()
        self.fn = fn

    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        """``fn(output, target)``.

        Args:
            output: Model output ``[N, ...]``.
            target: Targets ``[N, ...]``.

        Returns:
            Scalar loss.
        """
        return self.fn(output, target)


class _DenseFactor(SqrtHessianFactor):
    """Per-sample square roots ``S_n`` (``[N, D, D]``, column ``v`` is ``S_n[:, v]``)."""

    def __init__(self, sqrt: Tensor, shape: torch.Size):
        self._sqrt = sqrt
        self._shape = shape
        self.num_columns = sqrt.shape[2]
        self._column_numel = sqrt.shape[0] * sqrt.shape[1]
        self._element_size = sqrt.element_size()

    def columns(self, start: int, stop: int) -> Tensor:
        part = self._sqrt[:, :, start:stop].permute(2, 0, 1)
        return part.reshape(stop - start, *self._shape)


def _piecewise_linear(loss_func: nn.Module) -> bool:
    """Whether the loss is piecewise linear in the output (a zero Hessian a.e.)."""
    if isinstance(loss_func, nn.MultiMarginLoss):
        return loss_func.p == 1
    return isinstance(
        loss_func, (nn.L1Loss, nn.HingeEmbeddingLoss, nn.MultiLabelMarginLoss)
    )


def _composite_margin(loss_func: nn.Module) -> Callable[[Tensor, Tensor], Tensor] | None:
    """Torch's margin losses written with differentiable operations (summed), or None.

    ``multi_margin_loss`` and ``multilabel_margin_loss`` have no second derivative in
    torch. These forms follow torch's documented formulas; the batch check in
    :meth:`AutogradLossSqrtHessian._factorize` compares their sum with the loss module's
    own value at the forward pass's outputs, so a mismatch is refused, not used.
    """
    if type(loss_func) is nn.MultiMarginLoss:
        p, margin, weight = loss_func.p, loss_func.margin, loss_func.weight

        def multi_margin(f: Tensor, t: Tensor) -> Tensor:  # f [B, C], t [B]
            hinge = (margin - f.gather(1, t[:, None]) + f).clamp_min(0.0) ** p
            classes = torch.arange(f.shape[1], device=f.device)
            hinge = hinge.masked_fill(t[:, None] == classes, 0.0)
            if weight is not None:
                hinge = hinge * weight[t][:, None]
            return hinge.sum() / f.shape[1]

        return multi_margin
    if type(loss_func) is nn.MultiLabelMarginLoss:

        def multilabel_margin(f: Tensor, t: Tensor) -> Tensor:  # f, t [B, C]
            # the targets are the indices before the first -1 of each row
            listed = (t < 0).long().cumsum(1) == 0
            classes = torch.arange(f.shape[1], device=f.device)
            is_target = ((t[:, :, None] == classes) & listed[:, :, None]).any(1)
            pairs = (1.0 - f[:, :, None] + f[:, None, :]).clamp_min(0.0)  # [B, j, i]
            keep = is_target[:, :, None] & ~is_target[:, None, :]
            return (pairs * keep).sum() / f.shape[1]

        return multilabel_margin
    return None


def _scaled(term: Callable[[Tensor, Tensor], Tensor], factor: float):
    return lambda f, t: factor * term(f, t)


_DENSE_LIMIT = 2048  # outputs per sample up to which a non-diagonal Hessian is factorized


class AutogradLossSqrtHessian(LossSqrtHessian):
    """Any twice-differentiable loss that is a sum or mean of per-sample terms.

    Each sample's term ``l_n(f_n)`` is the loss (with ``reduction="sum"``) of that sample
    alone; the whole batch's loss is checked to equal their sum (or, for
    ``reduction="mean"``, their sum over the number of target elements) at the forward
    pass's outputs, so a loss that couples samples is refused. Its Hessian comes from
    ``torch.func``: when it is diagonal (elementwise losses such as ``HuberLoss``,
    ``SmoothL1Loss``, ``PoissonNLLLoss``; tested with a random vector) only the diagonal
    is formed, one Hessian-vector product per sample, so pixel outputs stay cheap;
    otherwise the per-sample ``D x D`` Hessian (``D`` outputs per sample, at most 2,048)
    is factorized by a symmetric eigendecomposition. Negative eigenvalues (the loss is
    not convex in the output there) are set to zero — the GGN with the positive part of
    the loss Hessian, positive semi-definite as a curvature must be — and a
    :class:`NotConvexWarning` says so.
    """

    loss_class = nn.Module

    def check(self, loss_func: nn.Module) -> None:
        _reduction_checked(loss_func)

    def check_shapes(self, loss_func, output, target) -> None:
        if target.shape[0] != output.shape[0]:
            raise ValueError(
                f"targets have batch size {target.shape[0]} but the model output has "
                f"{output.shape[0]}; pass one target per sample."
            )

    def normalizer(self, loss_func, target) -> Tensor:
        if getattr(loss_func, "reduction", None) == "batchmean":
            return torch.tensor(float(target.shape[0]))
        if isinstance(loss_func, nn.NLLLoss) and not target.is_floating_point():
            # torch's weighted mean: over the weights of the targets not ignored
            valid = target != loss_func.ignore_index
            if loss_func.weight is None:
                return valid.sum().double().cpu()
            safe = torch.where(valid, target, torch.zeros_like(target))
            return (loss_func.weight[safe] * valid).sum().double().cpu()
        return torch.tensor(float(target.numel()))

    @staticmethod
    def _per_sample(loss_func: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
        composite = _composite_margin(loss_func)
        if composite is not None:  # torch's kernel has no second derivative
            return lambda f, t: composite(f.unsqueeze(0), t.unsqueeze(0))
        summed = loss_func
        if getattr(loss_func, "reduction", "sum") != "sum":
            summed = copy.copy(loss_func)  # shares parameters and buffers
            summed.reduction = "sum"
        return lambda f, t: summed(f.unsqueeze(0), t.unsqueeze(0))

    def factorize(self, loss_func, output, target, scale) -> SqrtHessianFactor:
        with quiet_autograd():
            return self._factorize(loss_func, output, target, scale)

    def _factorize(self, loss_func, output, target, scale) -> SqrtHessianFactor:
        term = self._per_sample(loss_func)
        func = torch.func
        terms = func.vmap(term)(output, target)
        checked, targets = output, target
        if output.shape[0] == 1:
            # one sample (a batch of one, or batch_chunk_size's sub-batches) cannot tell
            # a sum from a mean over the batch: check on the sample twice (the loss only,
            # the model does not run again)
            checked, targets = torch.cat([output, output]), torch.cat([target, target])
            terms = torch.cat([terms, terms])
        total = loss_func(checked.detach(), targets).detach()
        divisor = 1
        if averages(loss_func):
            divisor = float(self.normalizer(loss_func, targets))
        tolerance = (
            1e-4 if output.dtype in (torch.float16, torch.bfloat16, torch.float32) else 1e-9
        )
        if divisor == 0:  # a mean over no target (every one ignored in this sub-batch):
            # 0/0, but the terms must be zero, as the whole batch's mean counts them
            expected = terms.sum()
            total = torch.zeros_like(expected)
        else:
            expected = terms.sum() / divisor
        close = torch.allclose(total, expected, rtol=tolerance, atol=tolerance * 1e-3)
        if not close and divisor > 1:
            # a forward that takes the mean itself (reduction="mean" not passed on): the
            # loss is the mean of per-sample means, sum_n (m * l_n) / numel with m the
            # target elements per sample (the same for every batch size)
            m = target[0].numel()
            close = torch.allclose(
                total, terms.sum() / targets.shape[0], rtol=tolerance,
                atol=tolerance * 1e-3,
            )  # fmt: skip
            if close:
                term = _scaled(term, float(m))
        if not close:
            raise ValueError(
                f"loss_func ({_loss_name(loss_func)}) is not a "
                f"{'mean' if averages(loss_func) else 'sum'} of per-sample "
                "terms: the batch's loss "
                f"is {float(total):.6g}, the per-sample losses give {float(expected):.6g}. "
                "ggnchunk needs loss(output, target) = sum over samples of "
                "loss(output[n:n+1], target[n:n+1]) (or that sum over the number of "
                "target elements for reduction='mean'); losses that couple samples have "
                "no per-sample GGN."
                + (
                    " A plain function (or a loss module without a reduction attribute) "
                    "is taken as a sum over samples: for a mean, pass "
                    "functools.partial(fn, reduction='sum') and rescale; a loss module "
                    "that averages over the samples itself (timm's "
                    "LabelSmoothingCrossEntropy) is taken as such once you set "
                    "loss_func.reduction = 'mean'."
                    if isinstance(loss_func, FunctionLoss)
                    else ""
                )
            )

        def hvp(f: Tensor, t: Tensor, v: Tensor) -> Tensor:  # reverse over reverse
            return func.vjp(lambda g: func.grad(term)(g, t), f)[1](v)[0]

        batched = func.vmap(hvp)
        diag = batched(output, target, torch.ones_like(output))
        # a private generator: the user's random state is left as it was
        generator = torch.Generator(device=output.device).manual_seed(0)
        probe = torch.rand(
            output.shape, generator=generator, dtype=output.dtype, device=output.device
        ) + 0.5  # fmt: skip
        atol = tolerance * float(diag.abs().max().clamp_min(1e-30))
        if torch.allclose(batched(output, target, probe), diag * probe, tolerance, atol):
            hess = diag * float(scale)
            if bool((hess < 0).any()):
                self._warn_not_convex(loss_func)
            if isinstance(loss_func, nn.KLDivLoss):
                warn(
                    "ggnchunk: nn.KLDivLoss is linear in its input (the model's "
                    "log-probabilities), so its Hessian w.r.t. the model output and "
                    "the GGN diagonal are all zeros. For the Fisher of a categorical "
                    "model, output logits and use nn.CrossEntropyLoss with the target "
                    "probabilities (or a function applying log_softmax inside the "
                    "loss).",
                    ZeroHessianWarning,
                )
            if _piecewise_linear(loss_func):  # (a sub-batch's zero is no reason)
                warn(
                    f"ggnchunk: the Hessian of loss_func ({type(loss_func).__name__}) "
                    "w.r.t. the model output is zero almost everywhere (the loss is "
                    "piecewise linear), so the GGN diagonal is all zeros. Use a loss "
                    "with curvature (e.g. nn.SmoothL1Loss or nn.HuberLoss for "
                    "regression, nn.CrossEntropyLoss or MultiMarginLoss(p=2) for "
                    "classes) for a useful GGN.",
                    ZeroHessianWarning,
                )
            return _DiagonalFactor(hess.clamp_min(0.0).sqrt())
        size = output[0].numel()
        if size > _DENSE_LIMIT:
            raise ValueError(
                f"the Hessian of loss_func ({type(loss_func).__name__}) w.r.t. each "
                f"sample's {size} outputs is not diagonal, and factorizing {size} x "
                f"{size} per sample exceeds ggnchunk's limit of {_DENSE_LIMIT} outputs. "
                "Use a loss that acts elementwise, or fewer outputs per sample."
            )
        # reverse over reverse: forward-mode AD would load torch's jvp decompositions,
        # whose first use warns about torch.jit.script
        hessian = func.jacrev(func.jacrev(term))
        hess = func.vmap(hessian)(output, target).reshape(-1, size, size)
        hess = 0.5 * (hess + hess.transpose(1, 2)) * float(scale)
        values, vectors = torch.linalg.eigh(hess)
        if bool((values < -tolerance * values.abs().amax().clamp_min(1e-30)).any()):
            self._warn_not_convex(loss_func)
        sqrt = vectors * values.clamp_min(0.0).sqrt().unsqueeze(1)
        return _DenseFactor(sqrt, output.shape)

    @staticmethod
    def _warn_not_convex(loss_func: nn.Module) -> None:
        warn(
            f"ggnchunk: the Hessian of loss_func ({type(loss_func).__name__}) w.r.t. the "
            "model output has negative eigenvalues at some samples (the loss is not "
            "convex there); the GGN uses its positive part (negative eigenvalues set to "
            "0), which keeps the curvature positive semi-definite.",
            NotConvexWarning,
        )


_AUTOGRAD = AutogradLossSqrtHessian()


def as_loss_module(loss_func: object) -> nn.Module:
    """The user's loss as a module: a plain function becomes a :class:`FunctionLoss`.

    Args:
        loss_func: A loss module or a function ``fn(output, target) -> scalar``.

    Returns:
        A module with a ``reduction`` attribute.

    Raises:
        TypeError: If ``loss_func`` is neither.
    """
    if isinstance(loss_func, type) and issubclass(loss_func, nn.Module):
        raise TypeError(
            f"loss_func is the class {loss_func.__name__}, not a loss: instantiate it: "
            f"loss_func={loss_func.__name__}()."
        )
    if isinstance(loss_func, nn.GaussianNLLLoss):
        raise TypeError(
            "loss_func is nn.GaussianNLLLoss, which takes the variance as a third "
            "argument; ggnchunk calls loss(output, target). Use "
            "ggnchunk.losses.GaussianNLL() with a model that outputs mean and "
            "log-variance on axis 1 ([N, 2, ...])."
        )
    if isinstance(loss_func, nn.Module):
        if not hasattr(loss_func, "reduction"):  # a user's module computing a scalar:
            return FunctionLoss(loss_func)  # as a function, checked to be a sum
        return loss_func
    if callable(loss_func):
        return FunctionLoss(loss_func)
    raise TypeError(
        f"loss_func must be a loss module (e.g. nn.MSELoss()) or a function "
        f"loss(output, target) -> scalar, got {type(loss_func).__name__}."
    )


def lookup_loss(loss_func: object) -> LossSqrtHessian:
    """Return the handler for ``loss_func``: a closed form if registered, else autograd.

    Args:
        loss_func: The user's loss module (see :func:`as_loss_module`).

    Returns:
        The registered handler for the loss's exact class, or the autograd handler.

    Raises:
        TypeError: If ``loss_func`` is not a module.
    """
    if not isinstance(loss_func, nn.Module):
        raise TypeError(f"loss_func must be a loss module, got {type(loss_func).__name__}.")
    return LOSSES.get(type(loss_func), _AUTOGRAD)


def register_loss(handler: LossSqrtHessian, *, overwrite: bool = False) -> None:
    """Give a loss class a closed-form Hessian square root, without editing ggnchunk.

    Losses without one are handled exactly by autograd (their Hessian per sample,
    factorized); a closed form is faster and exact for any output size.

    Args:
        handler: An instance of a :class:`LossSqrtHessian` subclass whose ``loss_class``
            is the (exact) loss class it handles.
        overwrite: Replace the handler registered for that class.

    Raises:
        TypeError: If ``handler`` is a class or not a :class:`LossSqrtHessian`, or its
            ``loss_class`` is not an ``nn.Module`` subclass.
        ValueError: If the class has a handler and ``overwrite`` is false.
    """
    if isinstance(handler, type):
        raise TypeError(
            f"register_loss takes a handler instance, got the class {handler.__name__}; "
            f"instantiate it: register_loss({handler.__name__}())."
        )
    if not isinstance(handler, LossSqrtHessian):
        raise TypeError(
            f"handler must be a ggnchunk LossSqrtHessian, got {type(handler).__name__}."
        )
    cls = getattr(handler, "loss_class", None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(
            f"{type(handler).__name__}.loss_class must be an nn.Module subclass, got "
            f"{cls!r}."
        )
    if cls in LOSSES and not overwrite:
        raise ValueError(
            f"{cls.__name__} already has the handler {type(LOSSES[cls]).__name__}; pass "
            "overwrite=True to replace it."
        )
    LOSSES[cls] = handler
