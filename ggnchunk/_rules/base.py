"""What every rule is: its context (one call of its layer) and its interface."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

__all__ = ["Caches", "LayerRule", "RuleContext", "gram_of_sums", "squares", "trainable"]


@dataclass
class Caches:
    """What a rule keeps between the chunks of one forward pass, named and typed.

    Each built-in cache says here whether a lean pass drops it (it is then made again
    per sample, see :attr:`RuleContext.lean`) and whether the rules' memory bounds count
    it as kept (``fixed_bytes``): views of the layer's input and small statistics are
    not counted. A rule registered from outside keeps what it needs in :attr:`custom`.

    Attributes:
        patches: A convolution's unfolded input patches, ``[N, G, K, P]``.
        gram: The Gram matrix of the fixed side of
            :func:`~ggnchunk._rules.kernels.square_sum`, ``[N, G, K, P, P]``.
        squares: The input's squares, for the output layer's one-hot form.
        grouped: A transposed convolution's input viewed as ``[N, G, C_in/G, P]``.
        x_hat: BatchNorm's input normalized by its running statistics.
        normalized: LayerNorm/GroupNorm's ``(x_hat [N, M, D], 1/std [N, M, 1])``.
        running: BatchNorm's running ``(mean, var)``, cloned at forward time.
        matrices: A bilinear or bicubic upsampling's per-axis ``[out, in]``
            matrices (``False`` where they did not reproduce its call).
        custom: Anything a registered rule keeps (not counted, never dropped).
    """

    patches: Tensor | None = None
    matrices: Any = None
    gram: Tensor | None = None
    squares: Tensor | None = None
    grouped: Tensor | None = None
    x_hat: Tensor | None = None
    normalized: tuple[Tensor, Tensor] | None = None
    running: tuple[Tensor, Tensor] | None = None
    custom: dict[str, Any] = field(default_factory=dict)

    LEAN_DROPS: ClassVar[tuple[str, ...]] = ("patches", "squares")
    """Recomputed per sample in lean passes instead of kept."""
    COUNTED: ClassVar[tuple[str, ...]] = ("patches", "gram", "x_hat", "normalized")
    """What the rules' ``fixed_bytes`` count as kept."""

    def drop_for_lean(self) -> None:
        """Free the caches a lean pass makes again per sample."""
        for name in self.LEAN_DROPS:
            setattr(self, name, None)

    def held_bytes(self, inputs: tuple[Tensor, ...]) -> int:
        """Bytes of the counted caches held now (views of ``inputs`` excluded).

        Args:
            inputs: The layer's inputs: caches that share their storage cost nothing.

        Returns:
            Bytes, each storage counted once.
        """
        own = {t.untyped_storage().data_ptr() for t in inputs}
        seen, total = set(), 0
        stack: list[Any] = [getattr(self, name) for name in self.COUNTED]
        while stack:
            value = stack.pop()
            if isinstance(value, (tuple, list)):
                stack.extend(value)
            elif isinstance(value, torch.Tensor):
                ptr = value.untyped_storage().data_ptr()
                if ptr not in own and ptr not in seen:
                    seen.add(ptr)
                    total += value.untyped_storage().nbytes()
        return total

    def names(self) -> list[str]:
        """The names of the caches held now (for tests and reports).

        Returns:
            Field names whose value is set.
        """
        held = [f.name for f in fields(self) if f.name != "custom"]
        return [n for n in held if getattr(self, n) is not None] + list(self.custom)


@dataclass
class RuleContext:
    """What a rule keeps from one call of its layer (set at forward time).

    Attributes:
        module: The layer.
        inputs: The layer's tensor inputs as it received them (detached leaves).
        versions: Their version counters then (an in-place change is detected).
        out_shape: Shape of the layer's output.
        caches: What the rule keeps between chunks (see :class:`Caches`).
        columns: Most columns a chunk can have (set once they are known; for bounds).
        lean: Keep no per-forward caches that can be recomputed per sample (a tight
            memory budget: unfolded patches are made one sample at a time per chunk).
        shared: The layer's parameters take the per-sample products' path.
        output: The layer produces the model output.
        node: The autograd node that produced the layer's output.
        index: The call's place in the recorded order.
        images: The forward pass's cache of windowed fields' images
            (:class:`~ggnchunk._windows.FieldCache`; ``None``: none).
        into: While :meth:`Rule.diag` (or ``diag_onehot``) runs, accumulators of the
            call's diagonal by parameter name (the result, viewed as the parameter),
            which a built-in rule may add its value to in place instead of returning
            it; a rule that does leaves the name out of its returned dict. It adds in
            one step, after every allocation of the computation (an out-of-memory
            error mid-way must leave the accumulator as it was: the chunk is retried).
            ``None``: return values.
        in_place: The sweeps hand :attr:`into` to this call's ``diag`` (the diagonal's
            quantity, parameters not shared): a bound may count a value added there
            in one step as no memory.
    """

    module: nn.Module
    inputs: tuple[Tensor, ...]
    versions: tuple[int, ...]
    out_shape: tuple[int, ...]
    caches: Caches = field(default_factory=Caches)
    columns: int = 2**20
    lean: bool = False
    shared: bool = False
    output: bool = False
    node: Any = None
    index: int = -1
    images: Any = None
    into: dict[str, Tensor] | None = None
    in_place: bool = False

    @property
    def x(self) -> Tensor:
        """The layer's first input, detached."""
        return self.inputs[0].detach()

    def accumulator(self, name: str, dtype: torch.dtype) -> Tensor | None:
        """The accumulator of parameter ``name`` to add to in place (:attr:`into`).

        Args:
            name: The parameter's name in the layer.
            dtype: The dtype of the value the rule would add.

        Returns:
            The contiguous accumulator of that dtype, shaped as the parameter, or
            ``None`` (none handed in: return the value instead).
        """
        into = None if self.into is None else self.into.get(name)
        if into is None or into.dtype != dtype or not into.is_contiguous():
            return None
        return into

    @property
    def extra(self) -> dict[str, Any]:
        """A registered rule's own caches (:attr:`Caches.custom`)."""
        return self.caches.custom


class LayerRule(ABC):
    """Parameter diagonals of one kind of layer from its input and backpropagated vectors.

    Subclasses set ``classes`` (layers whose ``forward`` is the one the rule knows) and
    ``param_names``, and implement :meth:`per_sample`; :meth:`diag` may be overridden
    by a faster form that never materializes the per-sample products.
    """

    classes: tuple[type[nn.Module], ...] = ()
    param_names: tuple[str, ...] = ("weight", "bias")
    description: str = ""
    param_free = False
    """Layers without parameters, ruled only to map vectors back faster than autograd."""

    def record(self, ctx: RuleContext) -> None:  # noqa: B027 - optional hook
        """Store what the rule needs beyond the input (called at forward time).

        Args:
            ctx: The call's context.
        """

    def accepts(self, module: nn.Module) -> bool:
        """Whether this layer, in its present configuration, computes what the rule knows.

        A layer the rule does not accept is handled from the recorded graph, as any
        layer without a rule (``nn.InstanceNorm2d`` with running statistics, say).

        Args:
            module: A layer of one of :attr:`classes`.

        Returns:
            True by default.
        """
        return True

    def check(self, name: str, module: nn.Module) -> None:  # noqa: B027 - optional
        """Raise a ``ValueError`` if this layer cannot be handled exactly.

        Args:
            name: The layer's qualified name, for the message.
            module: The layer.
        """

    @abstractmethod
    def per_sample(self, ctx: RuleContext, grads: Tensor) -> dict[str, Tensor]:
        """Per-(column, sample) parameter products ``J_theta(x_n)^T G[v, n]``.

        Args:
            ctx: The call's context.
            grads: ``[V, N, *out_shape[1:]]``.

        Returns:
            ``{param_name: [V, N, *param.shape]}`` for the layer's trainable parameters.
        """

    def diag(self, ctx: RuleContext, grads: Tensor) -> dict[str, Tensor]:
        """``sum_{v, n}`` of the squared per-sample products.

        Args:
            ctx: The call's context.
            grads: ``[V, N, *out_shape[1:]]``.

        Returns:
            ``{param_name: [*param.shape]}``.
        """
        return {k: t.square().sum((0, 1)) for k, t in self.per_sample(ctx, grads).items()}

    def diag_per_sample(self, ctx: RuleContext, grads: Tensor) -> dict[str, Tensor] | None:
        """``sum_v`` of the squared per-sample products, where a shortcut has it.

        Optional: ``None`` (the default) squares :meth:`per_sample`'s products. A
        parameter's per-sample diagonal without its ``[V, N, *param]`` products (a
        linear layer with one position per sample: ``sum_v (g ⊗ x)² = (sum_v g²) ⊗ x²``).

        Args:
            ctx: The call's context.
            grads: ``[V, N, *out_shape[1:]]``.

        Returns:
            ``{param_name: [N, *param.shape]}`` for the layer's trainable parameters,
            or ``None``.
        """
        return None

    sample_free_backprop = False
    """Whether :meth:`backprop` is the same linear map for every sample (no ``x``)."""

    def diag_onehot(self, ctx: RuleContext, mask: Tensor) -> dict[str, Tensor] | None:
        """The diagonal when the layer's output is the model output and columns are one-hot.

        Column ``v`` of the square root is ``s_{n,v} e_v``, so ``J_theta(x_n)^T`` of it is
        one row of the layer's per-sample Jacobian and its square needs ``x**2`` only:
        the chunk's diagonal is the layer's weight gradient for input ``x**2`` and output
        gradient ``mask = sum_v s_{n,v}**2 e_v`` — one kernel call, whatever the chunk
        size.

        Args:
            ctx: The call's context.
            mask: ``[N or 1, *out_shape[1:]]``.

        Returns:
            ``{param_name: [*param.shape]}``, or ``None`` where the rule has no such form.
        """
        return None

    def backprop(self, ctx: RuleContext, grads: Tensor) -> Tensor | None:
        """The vectors at the layer's input, ``[V, N, *input.shape[1:]]``, or ``None``.

        ``None`` lets autograd do it on the recorded graph (batched over ``V``); a rule
        that knows the transposed Jacobian folds ``V`` into the batch instead.

        Args:
            ctx: The call's context.
            grads: ``[V, N, *out_shape[1:]]``.

        Returns:
            The backpropagated vectors, or ``None``.
        """
        return None

    windowed = False
    """Whether the rule maps windowed blocks (:mod:`ggnchunk._windows`): a rule that
    sets it implements :meth:`backprop_windowed` and, if it has parameters,
    :meth:`diag_windowed` (each may still return ``None`` for a call it cannot do)."""

    @classmethod
    def has_diag_windowed(cls) -> bool:
        """Whether the rule overrides :meth:`diag_windowed`."""
        return cls.diag_windowed is not LayerRule.diag_windowed

    windowed_squares = False
    """Whether :meth:`diag_windowed` takes ``per_sample`` and ``weights`` (each sample's
    squares, and weighted sums per column: the output variance)."""

    def diag_windowed(
        self,
        ctx: RuleContext,
        block: Any,
        per_sample: bool = False,
        weights: dict[str, Tensor] | None = None,
    ) -> dict[str, Tensor] | None:
        """:meth:`diag` for a :class:`~ggnchunk._windows.Windowed` block, or ``None``.

        The squared per-(column, sample) products, reduced as :func:`squares` reduces
        them (asked with ``per_sample`` or ``weights`` only of a rule that sets
        :attr:`windowed_squares`).

        Args:
            ctx: The call's context.
            block: The vectors at the layer's output, each column on its box.
            per_sample: Sum the squares over the columns only.
            weights: ``{param_name: [*param.shape]}``: weight the squares and sum them
                over the parameter's entries instead.

        Returns:
            ``{param_name: [*param.shape]}`` (``[N, *param.shape]`` per sample, ``[V,
            N]`` with weights), or ``None`` (the block is made dense).
        """
        return None

    def _field_products(self, ctx: RuleContext, block: Any) -> dict[str, Tensor] | None:
        """The per-sample products of a block's fields (``[K, N, *param]``), or ``None``.

        A windowed diagonal adds ``sum_k coeffs[v, n, k]`` times these to each column's
        own products before squaring. They are the same in every sweep of the forward
        pass: kept in :attr:`RuleContext.images` where there is one.
        """
        if not block.has_fields:
            return None
        if ctx.images is None:
            return self.per_sample(ctx, block.fields)
        key = ctx.images.key("products", ctx.index, block=block)
        return ctx.images.get(key, lambda: self.per_sample(ctx, block.fields))

    def field_count(self, ctx: RuleContext) -> int:
        """Fields (dense maps per sample) :meth:`backprop_windowed` adds to a block.

        Args:
            ctx: The call's context.

        Returns:
            ``K`` of the fields the rule makes (0: none).
        """
        return 0

    def backprop_windowed(self, ctx: RuleContext, block: Any) -> Any:
        """:meth:`backprop` for a :class:`~ggnchunk._windows.Windowed` block, or ``None``.

        Args:
            ctx: The call's context.
            block: The vectors at the layer's output, each column on its box.

        Returns:
            The vectors at the layer's input (a block, or dense ``[V, N, *input]`` where
            the boxes cover most of the map), or ``None`` (the block is made dense).
        """
        return None

    kron = False
    """Whether the rule gives Kronecker factors (``output_factor``, ``input_factor``)."""

    def kron_check(self, module: nn.Module) -> str | None:
        """Why this layer has no Kronecker factors, or ``None`` if it has.

        Args:
            module: The layer.

        Returns:
            A reason for the error message, or ``None``.
        """
        if not self.kron:
            return (
                "Kronecker factors are available for nn.Linear and nn.Conv1d/2d/3d "
                "(groups=1) only"
            )
        return None

    def output_factor(self, ctx: RuleContext, grads: Tensor) -> Tensor:
        """``sum_{v, n} s_{vn} s_{vn}^T`` with ``s_{vn}`` the vector summed over positions.

        The exact GGN block of the layer's bias (BackPACK's KFLR output factor).

        Args:
            ctx: The call's context.
            grads: ``[V, N, *out_shape[1:]]``.

        Returns:
            ``[C_out, C_out]``.
        """
        raise NotImplementedError  # pragma: no cover - guarded by ``kron``

    def input_factor(self, ctx: RuleContext, into: Tensor | None = None) -> Tensor:
        """``sum_n sum_p u_{np} u_{np}^T`` over the (unfolded) inputs, not normalized.

        Args:
            ctx: The call's context.
            into: An earlier sub-batch's factor to add to, in place (``None``: a new one).

        Returns:
            ``[K, K]`` with ``K`` the weight's fan-in (``weight[0].numel()``): ``into``
            itself where given.
        """
        raise NotImplementedError  # pragma: no cover - guarded by ``kron``

    def column_bytes(self, ctx: RuleContext, element: int) -> int:
        """Bytes the rule allocates per column of a chunk, at most (for memory plans).

        Args:
            ctx: The call's context.
            element: Bytes per element.

        Returns:
            An upper bound per column.
        """
        return 2 * math.prod(ctx.out_shape) * element

    def fixed_bytes(self, ctx: RuleContext, element: int) -> int:
        """Bytes the rule keeps for the whole forward pass (caches), at most.

        Args:
            ctx: The call's context.
            element: Bytes per element.

        Returns:
            An upper bound.
        """
        return 0

    def backprop_bytes(self, ctx: RuleContext, element: int) -> tuple[int, int, int]:
        """Bytes of :meth:`backprop` alone (a frozen layer): per column, fixed, transient.

        Args:
            ctx: The call's context.
            element: Bytes per element.

        Returns:
            Upper bounds like :meth:`column_bytes`, :meth:`fixed_bytes` and
            :meth:`transient_bytes` for a call that has no trainable parameter.
        """
        return self.column_bytes(ctx, element), 0, self.transient_bytes(ctx, element)

    def transient_bytes(self, ctx: RuleContext, element: int) -> int:
        """Bytes the rule allocates and frees within its step, whatever the chunk size.

        Only one layer's step runs at a time, so a plan adds the largest of these.

        Args:
            ctx: The call's context.
            element: Bytes per element.

        Returns:
            An upper bound.
        """
        return 0

    def totals_bytes(self, ctx: RuleContext, element: int) -> int:
        """The part of :meth:`transient_bytes` that is parameter-sized totals.

        A weight's squares summed over the chunk's columns (a 512-channel layer's: 9 MiB
        in float32) are held during the layer's own step only, beside the columns alive
        there, where the rest of the transient bytes (working blocks) stand for any
        step's slack: a budget's plan counts the totals at their step only
        (:meth:`~ggnchunk._graph.bound.MemoryBound.layer_steps`).

        Args:
            ctx: The call's context (trainable parameters).
            element: Bytes per element.

        Returns:
            Bytes, at most :meth:`transient_bytes`.
        """
        return 0


def squares(
    values: Tensor, per_sample: bool = False, weights: Tensor | None = None
) -> Tensor:
    """Squared per-(column, sample) products, reduced (``values`` squared in place).

    Args:
        values: ``[V, N, *param.shape]``, a tensor of the caller's own.
        per_sample: Sum over the columns only: ``[N, *param.shape]``.
        weights: ``[*param.shape]``: the squares weighted and summed over the
            parameter's entries instead, ``[V, N]``.

    Returns:
        ``sum_{v,n}`` of the squares, ``[*param.shape]``, unless asked otherwise.
    """
    values = values.square_()
    if weights is not None:
        return values.mul_(weights).flatten(2).sum(2)
    return values.sum(0 if per_sample else (0, 1))


def gram_of_sums(grads: Tensor, channel_axis: int) -> Tensor:
    """``sum_{v, n} s s^T`` with ``s = grads[v, n]`` summed over all but the channel axis.

    Args:
        grads: ``[V, N, ...]``.
        channel_axis: Axis of ``grads`` holding the channels.

    Returns:
        ``[C, C]``.
    """
    v, n = grads.shape[:2]
    if n > 1 and grads.stride(1) == 0:  # the same vectors for every sample
        return n * gram_of_sums(grads[:, :1], channel_axis)
    moved = grads.movedim(channel_axis, 2)
    sums = moved.reshape(v * n, moved.shape[2], -1).sum(2)
    return sums.T @ sums


def trainable(module: nn.Module, name: str) -> bool:
    param = getattr(module, name, None)
    return isinstance(param, nn.Parameter) and param.requires_grad
