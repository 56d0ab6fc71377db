"""``nn.Linear`` on any leading axes."""

from __future__ import annotations

import ast
import functools
import inspect
import math
import sys
import textwrap

from torch import Tensor, nn

from ggnchunk._rules.base import LayerRule, RuleContext, gram_of_sums, trainable
from ggnchunk._rules.kernels import direct_bytes, products, square_sum, square_sum_bytes

__all__ = ["Conv1DRule", "LinearRule"]


class LinearRule(LayerRule):
    """``nn.Linear`` on ``[N, ..., D]``; Gram form over the extra axes where cheaper."""

    classes = (nn.Linear,)
    description = "any leading axes `[N, ..., D]`"
    weight_in_out = False  # the weight is [in, out] (transformers' Conv1D), not [out, in]

    def _laid_out(self, weight: Tensor) -> Tensor:
        """A weight-shaped result ``[..., out, in]`` in the weight's own layout."""
        return weight.transpose(-1, -2) if self.weight_in_out else weight

    @staticmethod
    def _sides(ctx: RuleContext, grads: Tensor) -> tuple[Tensor, Tensor]:
        x = ctx.x
        n, i = x.shape[0], x.shape[-1]
        v, o = grads.shape[0], grads.shape[-1]
        a = grads.reshape(v, n, -1, o).transpose(2, 3).unsqueeze(2)  # [V,N,1,O,P]
        b = x.reshape(n, -1, i).transpose(1, 2).unsqueeze(1)  # [N,1,I,P]
        return a, b

    def diag(self, ctx, grads):
        module, out = ctx.module, {}
        a, b = self._sides(ctx, grads)
        if trainable(module, "weight"):
            # (an accumulator has the weight's layout: [out, in] products only)
            into = None if self.weight_in_out else ctx.accumulator("weight", a.dtype)
            weight = square_sum(
                a, b, ctx.caches, columns=ctx.columns,
                into=None if into is None else into.unsqueeze(0),
            )  # fmt: skip
            if weight is not None:
                out["weight"] = self._laid_out(weight[0])
        if trainable(module, "bias"):
            out["bias"] = a.sum(4)[:, :, 0].square().sum((0, 1))
        return out

    def per_sample(self, ctx, grads):
        module, out = ctx.module, {}
        a, b = self._sides(ctx, grads)
        if trainable(module, "weight"):
            out["weight"] = self._laid_out(products(a, b)[:, :, 0])
        if trainable(module, "bias"):
            out["bias"] = a.sum(4)[:, :, 0]
        return out

    def diag_per_sample(self, ctx, grads):
        x = ctx.x
        if x[0].numel() != x.shape[-1]:  # positions per sample: their products mix
            return None
        module, out = ctx.module, {}
        squares = grads.reshape(grads.shape[0], x.shape[0], -1).square().sum(0)  # [N, O]
        if trainable(module, "weight"):
            out["weight"] = self._laid_out(
                squares[:, :, None] * x.reshape(x.shape[0], 1, -1).square()
            )
        if trainable(module, "bias"):
            out["bias"] = squares
        return out

    sample_free_backprop = True

    def backprop(self, ctx, grads):
        weight = ctx.module.weight.detach()
        return grads @ (weight.T if self.weight_in_out else weight)

    kron = True

    def output_factor(self, ctx, grads):
        return gram_of_sums(grads, grads.dim() - 1)

    def input_factor(self, ctx, into=None):
        x = ctx.x
        flat = x.reshape(-1, x.shape[-1])
        return flat.T @ flat if into is None else into.addmm_(flat.T, flat)

    def diag_onehot(self, ctx, mask):
        module, x = ctx.module, ctx.x
        o, i = mask.shape[-1], x.shape[-1]
        mask = mask.expand(x.shape[0], *mask.shape[1:]).reshape(-1, o)
        out = {}
        if trainable(module, "weight"):
            squares = x.reshape(-1, i).square()
            into = ctx.accumulator("weight", squares.dtype)
            if self.weight_in_out:
                out["weight"] = squares.T @ mask  # [in, out]
            elif into is not None:
                # into the result: no temporary of the weight's size (a language
                # model's head is its largest matrix)
                into.addmm_(mask.T, squares)
            else:
                out["weight"] = mask.T @ squares
        if trainable(module, "bias"):
            out["bias"] = mask.sum(0)
        return out

    @staticmethod
    def _sizes(ctx: RuleContext) -> tuple[int, int]:
        x = ctx.x
        fixed, per_column = square_sum_bytes(
            x.shape[0], 1, ctx.out_shape[-1], x.shape[-1], x[0].numel() // x.shape[-1],
            ctx.columns,
        )  # fmt: skip
        return fixed, per_column

    def column_bytes(self, ctx, element):
        return (2 * math.prod(ctx.out_shape) + self._sizes(ctx)[1]) * element

    def fixed_bytes(self, ctx, element):
        return self._sizes(ctx)[0] * element

    def transient_bytes(self, ctx, element):
        x = ctx.x
        if x[0].numel() == x.shape[-1]:  # one position: squares summed, nothing blocked
            return 0
        # samples batched in the direct form (also when lean), and the squares' weight-
        # sized total (or the Gram form's value; the direct form's steps are added in
        # place, :func:`~ggnchunk._rules.kernels.add_row_sums`)
        k = x.shape[-1]
        direct = direct_bytes(k, x[0].numel() // k)  # the direct form's slabs
        return (direct + ctx.module.weight.numel()) * element

    def totals_bytes(self, ctx, element):
        x = ctx.x
        if x[0].numel() == x.shape[-1]:
            return 0
        return ctx.module.weight.numel() * element

    def backprop_bytes(self, ctx, element):  # one product with the weight, no products
        return 2 * math.prod(ctx.out_shape) * element, 0, 0


_CONV1D_FORWARD = """def forward(self, x):
    size_out = x.size()[:-1] + (self.nf,)
    x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
    x = x.view(size_out)
    return x
"""
"""``Conv1D.forward`` of ``transformers.pytorch_utils`` as the rule knows it."""


@functools.cache
def _conv1d_class(cls: type) -> bool:
    """Whether ``cls`` is transformers' ``Conv1D`` with the ``forward`` the rule knows.

    Compared as syntax trees (comments and layout aside, every name and operation).
    """
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
        return ast.dump(ast.parse(source)) == ast.dump(ast.parse(_CONV1D_FORWARD))
    except (OSError, TypeError, SyntaxError):  # no source to read: not known
        return False


class Conv1DRule(LinearRule):
    """The ``Conv1D`` of transformers (GPT-2, OpenAI GPT): linear, weight ``[in, out]``.

    ``y = b + x W`` with ``W`` of shape ``[in, out]``: :class:`LinearRule` on ``W^T``,
    its results transposed back. The class is taken only from a loaded
    ``transformers.pytorch_utils`` whose ``Conv1D.forward`` is the one this rule knows
    (compared as syntax trees); any other version is left to the recorded graph (exact,
    slower).
    ggnchunk does not import transformers.
    """

    description = (
        "GPT-2's projections, `y = b + x W` with `W` `[in, out]` (when transformers is "
        "imported and its `forward` is the known one)"
    )
    listed = ("transformers.pytorch_utils.Conv1D",)  # whether transformers is loaded or not
    weight_in_out = True
    kron = False

    @property
    def classes(self) -> tuple[type[nn.Module], ...]:  # type: ignore[override]
        """The ``Conv1D`` of transformers where it is loaded and known, else none."""
        module = sys.modules.get("transformers.pytorch_utils")
        cls = getattr(module, "Conv1D", None) if module is not None else None
        if isinstance(cls, type) and issubclass(cls, nn.Module) and _conv1d_class(cls):
            return (cls,)
        return ()

    def accepts(self, module: nn.Module) -> bool:
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        return (
            isinstance(weight, Tensor) and weight.dim() == 2
            and getattr(module, "nf", None) == weight.shape[1]
            and isinstance(bias, Tensor) and tuple(bias.shape) == (weight.shape[1],)
        )  # fmt: skip
