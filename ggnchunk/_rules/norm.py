"""Normalizations: BatchNorm (eval), LayerNorm, GroupNorm, InstanceNorm."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ggnchunk._rules.base import LayerRule, RuleContext, squares, trainable
from ggnchunk._windows import Windowed, gather, mix

__all__ = ["BatchNormRule", "GroupNormRule", "InstanceNormRule", "LayerNormRule"]


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


class _ChannelNormRule(_NormRule):
    """Normalizations with one weight per channel (axis 1): BatchNorm, GroupNorm."""

    windowed = True

    windowed_squares = True

    def diag_windowed(self, ctx, block, per_sample=False, weights=None):
        module, out = ctx.module, {}
        data = block.data
        v, n, c = data.shape[:3]
        fields = self._field_products(ctx, block)
        sums = {}
        if trainable(module, "weight"):
            x_hat = gather(self._x_hat(ctx), block.start, block.box, block.size)
            sums["weight"] = (data * x_hat).reshape(v, n, c, -1).sum(3)
        if trainable(module, "bias"):
            sums["bias"] = data.reshape(v, n, c, -1).sum(3)
        for name, value in sums.items():
            if fields is not None:
                value = value + mix(block.coeffs, fields[name])
            out[name] = squares(value, per_sample, (weights or {}).get(name))
        return out


class BatchNormRule(_ChannelNormRule):
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

    def _scale(self, ctx: RuleContext, dtype: torch.dtype) -> Tensor:
        module = ctx.module
        scale = (ctx.caches.running[1].to(dtype) + module.eps).rsqrt()
        if module.weight is not None:
            scale = scale * module.weight.detach()
        return scale

    def backprop(self, ctx, grads):
        scale = self._scale(ctx, grads.dtype)
        return grads * scale.view(-1, *([1] * (grads.dim() - 3)))

    def backprop_windowed(self, ctx, block):
        data = block.data
        scale = self._scale(ctx, data.dtype)
        return block.with_data(data * scale.view(-1, *([1] * (data.dim() - 3))))


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


class GroupNormRule(_ChannelNormRule):
    """``nn.GroupNorm``."""

    classes = (nn.GroupNorm,)
    description = "per-sample statistics"

    def _sum_axes(self, ctx, grads):
        return tuple(range(3, grads.dim()))

    def _groups(self, ctx: RuleContext) -> int:
        """How many sets of channels share statistics (per sample)."""
        return ctx.module.num_groups

    def _sets(self, ctx):
        return ctx.x.shape[0] * self._groups(ctx)

    def _normalized(self, ctx):
        module, x = ctx.module, ctx.x
        groups = self._groups(ctx)
        return _standardized(x.reshape(x.shape[0], groups, -1), module.eps)

    def backprop(self, ctx, grads):
        shape = (-1, *([1] * (grads.dim() - 3)))
        return self._backprop_normalized(ctx, grads, shape)

    def backprop_windowed(self, ctx, block):
        """``rstd * (h - mean(h) - x_hat * mean(h * x_hat))`` per group, ``h = g * w``.

        ``rstd * h`` stays on the box; the two means are, per column and sample, two
        numbers per group times two maps that are the same for every column of a sample
        (``rstd`` on the group's channels, and ``rstd * x_hat`` there): they become the
        block's fields, with the means as coefficients. Exact, and the box does not grow.
        """
        module = ctx.module
        data = block.data
        v, n, c = data.shape[:3]
        g = self._groups(ctx)
        spatial = (1,) * (data.dim() - 3)
        if module.weight is not None:
            data = data * module.weight.detach().view(-1, *spatial)
        if ctx.lean:
            x_hat, rstd = ctx.caches.normalized or self._normalized(ctx)
        else:
            x_hat, rstd = self._kept_normalized(ctx)
        count = x_hat.shape[-1]  # elements per group
        maps = x_hat.reshape(ctx.x.shape)  # [N, C, *S]
        near = gather(maps, block.start, block.box, block.size)  # x_hat on the boxes
        per_group = (v, data.shape[1], g, -1)
        mean = data.reshape(per_group).sum(3) / count  # [V, N, G]
        mean_x = (data * near).reshape(v, n, g, -1).sum(3) / count
        rstd_c = rstd.view(n, g, 1).expand(n, g, c // g).reshape(n, c)
        local = data * rstd_c.view(1, n, c, *spatial)

        def fields() -> Tensor:  # made when read: a sweep may reuse the last one's
            # rstd on group j's channels, and rstd * x_hat there ([2G, N, C, *S])
            member = torch.eye(g, dtype=data.dtype, device=data.device)
            member = member.repeat_interleave(c // g, 1)  # [G, C]: channel c in group j
            ones = (member.view(g, 1, c) * rstd_c.view(1, n, c)).view(g, n, c, *spatial)
            ones = ones.expand(g, n, c, *block.size)
            return torch.cat([ones, ones * maps.unsqueeze(0)])

        coeffs = -torch.cat([mean.expand(v, n, g), mean_x], 2)
        return Windowed(local, block.start, block.size, fields, coeffs)

    def field_count(self, ctx):
        return 2 * self._groups(ctx)


class InstanceNormRule(GroupNormRule):
    """``nn.InstanceNorm1d/2d/3d`` with statistics of the input: one group per channel.

    Such a layer normalizes each channel of each sample over its positions, as
    ``nn.GroupNorm`` with as many groups as channels does: the same rule, windowed with
    two fields per channel. With running statistics (``track_running_stats=True`` in
    eval mode) the layer is an affine map per channel; it is then left to the glue.
    """

    classes = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
    description = "statistics of the input (not running ones): per sample and channel"

    def accepts(self, module: nn.Module) -> bool:
        return module.training or not module.track_running_stats

    def record(self, ctx):
        if ctx.x.dim() != ctx.module._get_no_batch_dim() + 1:
            raise ValueError(
                f"{type(ctx.module).__name__} got an input of shape {tuple(ctx.x.shape)} "
                "without a batch axis; inside a model whose first axis is the samples, "
                "call it on [N, C, ...] inputs."
            )

    def _groups(self, ctx: RuleContext) -> int:
        return ctx.x.shape[1]  # its channels (num_features need not match without affine)
