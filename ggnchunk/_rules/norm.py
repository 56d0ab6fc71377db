"""Normalizations: BatchNorm (eval), LayerNorm, GroupNorm."""

from __future__ import annotations

import math

from torch import Tensor, nn

from ggnchunk._rules.base import LayerRule, RuleContext, trainable

__all__ = ["BatchNormRule", "GroupNormRule", "LayerNormRule"]


def _standardized(flat: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``x_hat`` and ``1/std`` over the last axis of ``flat`` ``[N, M, D]`` (biased var)."""
    rstd = (flat.var(-1, unbiased=False, keepdim=True) + eps).rsqrt()
    return (flat - flat.mean(-1, keepdim=True)) * rstd, rstd


class _NormRule(LayerRule):
    """Shared by the normalizations: ``y = x_hat * weight + bias`` per channel/feature."""

    def _x_hat(self, ctx: RuleContext) -> Tensor:
        """The normalized input, shaped like the input, kept for the forward pass.

        LayerNorm and GroupNorm keep it once, as the normalized sets that their
        backpropagation needs too (:meth:`_kept_normalized`); BatchNorm overrides it.
        """
        return self._kept_normalized(ctx)[0].reshape(ctx.x.shape)

    def _kept_normalized(self, ctx: RuleContext) -> tuple[Tensor, Tensor]:
        if ctx.caches.normalized is None:
            ctx.caches.normalized = self._normalized(ctx)
        return ctx.caches.normalized

    def _sum_axes(self, ctx: RuleContext, grads: Tensor) -> tuple[int, ...]:
        raise NotImplementedError

    def _reduce(self, ctx: RuleContext, t: Tensor) -> Tensor:
        """``[V, N, *out]`` → ``[V, N, *param.shape]`` (sum over the other axes)."""
        axes = self._sum_axes(ctx, t)
        return t.sum(axes) if axes else t

    def per_sample(self, ctx, grads):
        module, out = ctx.module, {}
        if trainable(module, "weight"):
            x_hat = self._x_hat(ctx)
            out["weight"] = self._reduce(ctx, grads * x_hat)
        if trainable(module, "bias"):
            out["bias"] = self._reduce(ctx, grads)
        return out

    def _sets(self, ctx: RuleContext) -> int:
        """Normalized sets (one ``1/std`` each) kept beside ``x_hat``."""
        raise NotImplementedError

    def fixed_bytes(self, ctx, element):
        return (math.prod(ctx.out_shape) + self._sets(ctx)) * element

    def _normalized(self, ctx: RuleContext) -> tuple[Tensor, Tensor]:
        """``x_hat`` ``[N, M, D]`` and ``1/std`` ``[N, M, 1]``: ``M`` normalized sets."""
        raise NotImplementedError

    def _backprop_normalized(
        self, ctx: RuleContext, grads: Tensor, weight_shape: tuple[int, ...]
    ) -> Tensor:
        """``dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))`` per normalized set.

        ``g`` is the vector times the affine weight; means over each set's elements.
        Broadcast over the columns: no per-column loop, no copy of ``x``.
        """
        module = ctx.module
        v = grads.shape[0]
        if module.weight is not None:
            grads = grads * module.weight.detach().view(weight_shape)
        if ctx.lean:  # kept only where the weight's products made it already
            x_hat, rstd = ctx.caches.normalized or self._normalized(ctx)
        else:
            x_hat, rstd = self._kept_normalized(ctx)
        g = grads.reshape(v, *x_hat.shape)
        mean_x = (g * x_hat).mean(-1, keepdim=True)
        dx = g - g.mean(-1, keepdim=True)
        return dx.addcmul_(x_hat, mean_x, value=-1).mul_(rstd).reshape(grads.shape)

    def column_bytes(self, ctx, element):
        return 4 * math.prod(ctx.out_shape) * element

    def backprop_bytes(self, ctx, element):  # the standardized input is kept
        return self.column_bytes(ctx, element), self.fixed_bytes(ctx, element), 0


class BatchNormRule(_NormRule):
    """``nn.BatchNorm1d/2d/3d`` in eval mode with running statistics."""

    classes = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    description = "eval mode only (training mode couples samples)"

    def record(self, ctx):
        module = ctx.module
        ctx.caches.running = (
            module.running_mean.detach().clone(),
            module.running_var.detach().clone(),
        )

    def _x_hat(self, ctx):
        if ctx.caches.x_hat is None:
            x = ctx.x
            shape = [1, -1] + [1] * (x.dim() - 2)
            mean, var = ctx.caches.running
            std = (var.to(x.dtype) + ctx.module.eps).sqrt().view(shape)
            ctx.caches.x_hat = (x - mean.to(x.dtype).view(shape)) / std
        return ctx.caches.x_hat

    def _sum_axes(self, ctx, grads):
        return tuple(range(3, grads.dim()))

    def _sets(self, ctx):
        return 0  # x_hat alone (running statistics)

    sample_free_backprop = True

    def column_bytes(self, ctx, element):
        return 2 * math.prod(ctx.out_shape) * element  # one product, one scaled copy

    def backprop_bytes(self, ctx, element):  # nothing kept: running statistics only
        return self.column_bytes(ctx, element), 0, 0

    def backprop(self, ctx, grads):
        module = ctx.module
        scale = (ctx.caches.running[1].to(grads.dtype) + module.eps).rsqrt()
        if module.weight is not None:
            scale = scale * module.weight.detach()
        return grads * scale.view(-1, *([1] * (grads.dim() - 3)))


class LayerNormRule(_NormRule):
    """``nn.LayerNorm`` (any ``normalized_shape``, with or without bias)."""

    classes = (nn.LayerNorm,)
    description = "any `normalized_shape`"

    def _sum_axes(self, ctx, grads):
        kept = len(ctx.module.normalized_shape)
        return tuple(range(2, grads.dim() - kept))

    def _sets(self, ctx):
        return ctx.x.numel() // math.prod(ctx.module.normalized_shape)

    def _normalized(self, ctx):
        module, x = ctx.module, ctx.x
        d = math.prod(module.normalized_shape)
        return _standardized(x.reshape(x.shape[0], -1, d), module.eps)

    def backprop(self, ctx, grads):
        return self._backprop_normalized(ctx, grads, tuple(ctx.module.normalized_shape))


class GroupNormRule(_NormRule):
    """``nn.GroupNorm``."""

    classes = (nn.GroupNorm,)
    description = "per-sample statistics"

    def _sum_axes(self, ctx, grads):
        return tuple(range(3, grads.dim()))

    def _sets(self, ctx):
        return ctx.x.shape[0] * ctx.module.num_groups

    def _normalized(self, ctx):
        module, x = ctx.module, ctx.x
        return _standardized(x.reshape(x.shape[0], module.num_groups, -1), module.eps)

    def backprop(self, ctx, grads):
        shape = (-1, *([1] * (grads.dim() - 3)))
        return self._backprop_normalized(ctx, grads, shape)
