"""The engine: one forward pass per batch, one backward sweep per chunk of columns.

:class:`Problem` is everything about a call that does not depend on the batch (model,
loss, parameters, the layers with rules), checked once at the entry point.
:class:`GGNComputation` owns what it adds to the user's model for the duration of a
``with`` block and removes it on exit, whatever happens in between (exceptions and
``KeyboardInterrupt`` included): the recording hooks of :mod:`ggnchunk._graph` and
``inplace=False`` on layers built with ``inplace=True`` (restored).

Each backward sweep seeds columns ``start:stop`` of the loss Hessian's square root (see
:mod:`ggnchunk._sqrt_hessians`) and adds each parameter's share in place through the
call's quantity (:mod:`ggnchunk._quantities`; no second parameter-sized accumulator per
chunk); a sweep that fails (out of memory) remembers which parameters it finished, so
its range can be retried in smaller pieces that leave those alone. The graph is kept
until :meth:`GGNComputation.close` frees it, after the last pass: the forward pass is
never run again.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn

from ggnchunk import _windows as windows
from ggnchunk._autograd import (
    BatchNormBase,
    module_backward_hooks_off,
    tensor_hooks_off_for_the_call,
)
from ggnchunk._checks import Batch, note_forward_error, warn
from ggnchunk._folding import folded_glue
from ggnchunk._graph import Recording, UnusedParameterWarning
from ggnchunk._graph.compress import Cut
from ggnchunk._memory import free_memory, synchronize
from ggnchunk._quantities import Gradient, Quantity, Sampling
from ggnchunk._rules import LayerRule, rule_for
from ggnchunk._scheduling import is_out_of_memory
from ggnchunk._sqrt_hessians import (
    LossSqrtHessian,
    SqrtHessianFactor,
    as_loss_module,
    lookup_loss,
)

__all__ = [
    "GGNComputation", "Problem", "check_kron_parameters", "full_float32", "model_lock",
]  # fmt: skip

PROBE_MARGIN = 4.0
"""The windows' trial stops timing dense columns where an eighth of its dense part took
this many times the windows' time per column (:meth:`GGNComputation._trial`)."""

_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model: nn.Module) -> threading.RLock:
    """The lock that serializes ggnchunk calls on one model (hooks are per model).

    Args:
        model: The user's model.

    Returns:
        A re-entrant lock, the same for every call on ``model``.
    """
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


# the reduced-precision float32 settings of torch >= 2.9 (one per backend and operator)
_FP32_PRECISION = (
    "cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn",
)  # fmt: skip


def _backend(path: str) -> object | None:
    node: object | None = torch.backends
    for part in path.split("."):
        node = getattr(node, part, None)
    return node if hasattr(node, "fp32_precision") else None


class _SharedSwitch:
    """A process-wide setting switched by the first of overlapping calls.

    The last call to leave restores it (calls in several threads share one switch).

    Args:
        switch: Sets the setting; returns what restores the one found.
        restore: Restores it from what ``switch`` returned.
    """

    def __init__(self, switch: Callable[[], Any], restore: Callable[[Any], None]):
        self._switch, self._restore = switch, restore
        self._lock = threading.Lock()
        self._users = 0
        self._saved: Any = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._saved = self._switch()
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    saved, self._saved = self._saved, None
                    self._restore(saved)


def _switch_to_full_float32() -> object:
    """Set full float32; return what restores the settings read before."""
    nodes = [node for node in map(_backend, _FP32_PRECISION) if node is not None]
    if nodes:  # torch >= 2.9: only the new API (torch refuses reads that mix the two)
        saved = [(node, node.fp32_precision) for node in nodes]
        for node in nodes:
            node.fp32_precision = "ieee"
        return saved
    saved = [torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32]
    torch.set_float32_matmul_precision("highest")  # also cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    return saved


def _restore(saved: object) -> None:
    if saved and isinstance(saved[0], tuple):
        for node, value in saved:
            node.fp32_precision = value
    else:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]


_FULL_FLOAT32 = _SharedSwitch(_switch_to_full_float32, _restore)


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """Float32 computed in full float32 (no TF32, no bf16) inside the block; restored.

    cuDNN's default runs float32 convolutions in TF32 (10-bit mantissa) on Ampere and
    later GPUs, and ``torch.set_float32_matmul_precision("high")`` does so for matmuls:
    results change at the 1e-3 level. ggnchunk's call (forward pass included, so the
    diagonal is that of the model computed in float32) runs with them switched off; the
    user's settings are restored on exit, also after an exception or
    ``KeyboardInterrupt``. Torch >= 2.9 keeps them per backend (``fp32_precision``),
    older torch in the legacy flags: only the API the build has is used. The settings
    are process-wide: concurrent calls (other models, other threads) share one switch,
    made by the first and undone by the last.
    """
    with _FULL_FLOAT32():
        yield


def _display(name: str) -> str:
    return f"model.{name}" if name else "model"


@dataclass
class Problem:
    """What a call computes the curvature of, checked once per call.

    Attributes:
        model: The user's model.
        loss_func: The user's loss module (``None``: no loss, for output variances).
        handler: The loss's Hessian square root (``None`` without a loss).
        names: Names of the trainable parameters, in ``named_parameters()`` order.
        params: The parameters themselves.
        units: ``{layer: (qualified name, rule)}`` for the layers that have a rule.
    """

    model: nn.Module
    loss_func: nn.Module | None
    handler: LossSqrtHessian | None
    names: list[str]
    params: list[nn.Parameter]
    units: dict[nn.Module, tuple[str, LayerRule]]

    @property
    def device(self) -> torch.device:
        """Device of the parameters."""
        return self.params[0].device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the parameters."""
        return self.params[0].dtype

    @classmethod
    def build(cls, model: nn.Module, loss_func: nn.Module | None) -> Problem:
        """Check model and loss before any work and find the layers with rules.

        Args:
            model: The user's model.
            loss_func: The user's loss (``None``: none, the columns are the outputs).

        Returns:
            The problem.

        Raises:
            TypeError: If ``model`` is not a module or the loss is not supported.
            ValueError: For layers that couple samples, half precision, no trainable
                parameters, or several devices/dtypes.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model must be a torch.nn.Module, got {type(model).__name__}. Wrap a "
                "function in an nn.Module."
            )
        handler = None
        if loss_func is not None:
            loss_func = as_loss_module(loss_func)
            handler = lookup_loss(loss_func)
            handler.check(loss_func)
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not params:
            raise ValueError(
                "model has no parameters with requires_grad=True, so its GGN diagonal is "
                "empty. Unfreeze the parameters whose diagonal you need."
            )
        made = [n for n, p in params if not nn.parameter.is_lazy(p) and p.is_inference()]
        if made and not torch.is_inference_mode_enabled():  # (else: the call's refusal)
            raise ValueError(
                f"the parameter {made[0]!r} is an inference tensor (made inside "
                "torch.inference_mode(), e.g. by loading or building the model there), "
                "which autograd cannot differentiate. Build the model and load its "
                "weights (load_state_dict) outside inference_mode."
            )
        lazy = [n for n, p in params if nn.parameter.is_lazy(p)]
        if lazy:
            raise ValueError(
                f"the parameter {lazy[0]!r} is not initialized yet (a lazy module such as "
                "nn.LazyLinear gets its shapes from its first input): run the model once "
                "on a batch, model(inputs), before calling ggnchunk."
            )
        devices = {p.device for _, p in params}
        if len(devices) > 1:
            raise ValueError(
                f"the model's parameters are on several devices "
                f"({sorted(map(str, devices))}); move the model to one device with "
                "model.to(device)."
            )
        complex_ = [(n, p.dtype) for n, p in params if p.is_complex()]
        if complex_:
            name, kind = complex_[0]
            raise ValueError(
                f"the parameter {name!r} is complex ({kind}); the GGN diagonal is "
                "defined here for real parameters. Store it as a real tensor with a last "
                "axis of 2 (real and imaginary part: nn.Parameter(torch.view_as_real(w))) "
                "and use torch.view_as_complex(...) in forward: the diagonal then has an "
                "entry for each part."
            )
        dtypes = {p.dtype for _, p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"the model's parameters have several dtypes ({sorted(map(str, dtypes))})"
                "; convert the model with model.float() or model.double()."
            )
        dtype = next(iter(dtypes))
        if dtype in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"the model's parameters are {dtype}: the exact GGN diagonal would lose "
                "precision silently in half precision (relative errors of 1e-3 and more). "
                "Compute it on a float32 copy: ggnchunk.diag_ggn(copy.deepcopy(model)"
                ".float(), ...), with float32 inputs."
            )
        if not dtype.is_floating_point:
            raise ValueError(
                f"the model's parameters have dtype {dtype}; use a float dtype."
            )
        units: dict[nn.Module, tuple[str, LayerRule]] = {}
        for name, module in model.named_modules():
            if isinstance(module, BatchNormBase) and (
                module.training or module.running_mean is None
            ):
                why = (
                    "is in training mode"
                    if module.training
                    else "has track_running_stats=False (it always uses batch statistics)"
                )
                raise ValueError(
                    f"{_display(name)} ({type(module).__name__}) {why}, where it couples "
                    "the samples of a batch and the GGN is not a sum over samples. Call "
                    "model.eval() (or this module's .eval(), with running statistics) "
                    "before computing the diagonal."
                )
            rule = rule_for(module)
            if rule is not None:
                rule.check(_display(name), module)
                units[module] = (name, rule)
        return cls(
            model, loss_func, handler, [n for n, _ in params], [p for _, p in params], units
        )


def check_kron_parameters(problem: Problem) -> None:
    """Refuse, before any work, trainable parameters that have no Kronecker factors.

    Every trainable parameter must be the ``weight`` or ``bias`` of a layer whose rule
    gives Kronecker factors (``nn.Linear``, ``nn.Conv1d/2d/3d`` with ``groups=1``).

    Args:
        problem: The checked problem.

    Raises:
        ValueError: Naming the first parameter without factors and the fix.
    """
    owners: dict[int, tuple[str, nn.Module]] = {}
    for name, module in problem.model.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), (name, module))
    for pname, param in zip(problem.names, problem.params, strict=True):
        name, module = owners[id(param)]
        unit = problem.units.get(module)
        reason = (
            unit[1].kron_check(module) if unit is not None
            else "Kronecker factors are available for nn.Linear and nn.Conv1d/2d/3d "
            "(groups=1) only"
        )  # fmt: skip
        if reason is None and pname.rsplit(".", 1)[-1] not in ("weight", "bias"):
            reason = "only a layer's weight and bias have Kronecker factors"
        if reason is not None:
            raise ValueError(
                f"parameter {pname!r} of {_display(name)} ({type(module).__name__}): "
                f"{reason}. Freeze it (requires_grad_(False)) to compute the factors of "
                "the other layers, or use ggnchunk.diag_ggn for its diagonal."
            )


class GGNComputation:
    """One forward pass's quantity, computed over any sequence of column ranges.

    Use as a context manager: hooks are installed on entry and everything is removed on
    exit. Call :meth:`forward` once, then :meth:`backward` once per column range, then
    read :attr:`quantity` (its ``result``).

    Args:
        problem: The checked problem.
        batch: The (sub-)batch's inputs.
        targets: Its targets (ignored without a loss).
        scale: Factor of the loss Hessian: ``1`` for ``reduction="sum"``,
            ``1 / normalizer`` of the whole batch for ``"mean"``.
        quantity: What the sweeps compute (:mod:`ggnchunk._quantities`), for this
            forward pass.
        sampling: Monte-Carlo columns instead of the exact square root (``None``: exact).
        key: The problem's key (model structure, loss, shapes, ...), under which the
            windowed/dense trial's outcome is remembered for later calls; ``None``:
            nothing remembered.
    """

    def __init__(
        self,
        problem: Problem,
        batch: Batch,
        targets: Tensor | None,
        scale: float,
        quantity: Quantity,
        sampling: Sampling | None = None,
        key: Hashable | None = None,
    ):
        self._problem = problem
        self._batch = batch
        self._targets = targets.detach() if targets is not None else None
        self._scale = scale
        self.quantity = quantity
        self._sampling = sampling
        self._recording = Recording(
            problem.units,
            problem.params,
            batch.size,
            quantity.every_product,
            quantity.sums_squares,
        )
        self._windows = windows.Choice(key)
        self._inplace: list[nn.Module] = []
        self._output: Tensor | None = None
        self._loss: Tensor | None = None
        self._sqrt: SqrtHessianFactor | None = None
        self._columns: int | None = None  # the chunk size the bounds are made for
        self.lean = False  # whether the sweeps keep no per-forward caches (set_lean)
        self.loss: Tensor | None = None

    # -- set-up and tear-down -------------------------------------------------------------
    def __enter__(self) -> GGNComputation:
        try:
            for module in self._problem.model.modules():
                if getattr(module, "inplace", None) is True:
                    module.inplace = False
                    self._inplace.append(module)
            self._recording.install()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._recording.remove()
        for module in self._inplace:
            module.inplace = True
        self._inplace.clear()

    def close(self) -> None:
        """Free the graph and everything recorded (the diagonal stays)."""
        self._recording.images.clear()
        self._recording.calls.clear()
        self._recording = None  # type: ignore[assignment]
        self._output = self._loss = self._sqrt = None

    # -- the passes -----------------------------------------------------------------------
    def forward(self) -> Tensor:
        """Run the forward pass once, plan the sweeps and check before any backward pass.

        Returns:
            The model output (attached to the graph), shape ``[N, ...]``.

        Raises:
            ValueError: If the output does not fit the targets, a layer's input was
                changed in place, or samples influence each other.
        """
        problem = self._problem
        batch = [t for t in self._batch.tensors() if self._batch.batched(t)]
        # compiled code (torch.compile) runs as written: the recording's hooks see its
        # layers, and dynamo would trace through them
        # the model's backward hooks are not set up: they would run in every sweep
        hooked: dict[int, dict] = {}
        try:
            with (
                torch.enable_grad(),
                folded_glue(batch, hooked),
                _eager(),
                module_backward_hooks_off(problem.model),
            ):
                output = problem.model(*self._batch.args, **self._batch.kwargs)
        except Exception as error:  # the module it came from, named
            note_forward_error(error, problem.model)
            raise
        self._recording.remove()  # hooks only for this forward
        # hooks the forward put on tensors: muted for the sweeps (run in it as written)
        tensor_hooks_off_for_the_call(list(hooked.values()))
        if not isinstance(output, Tensor):
            raise ValueError(
                f"the model returned a {type(output).__name__}; ggnchunk needs a single "
                "output tensor of shape [N, ...]. Wrap the model so that forward returns "
                "the tensor the loss is computed from."
            )
        if output.dim() == 0 or output.shape[0] != self._batch.size:
            hint = ""
            if self._batch.size == 1:  # squeeze() took the batch axis of one sample
                hint = (
                    " With one sample in the forward pass (a batch of one, or the last "
                    "sub-batch of batch_chunk_size), a forward that calls .squeeze() "
                    "drops the batch axis too: squeeze the axis by number instead "
                    "(.squeeze(-1))."
                )
            raise ValueError(
                f"the model output has shape {tuple(output.shape)} but the batch has "
                f"{self._batch.size} samples; ggnchunk needs axis 0 of the output to be "
                f"the batch axis.{hint}"
            )
        if not output.requires_grad:
            raise ValueError(
                "the model output does not depend on any trainable parameter; check "
                "requires_grad of the model's parameters."
                + self._recording.why_no_gradient()
            )
        if output.dtype != problem.dtype:
            raise ValueError(
                f"the model output has dtype {output.dtype} but the parameters are "
                f"{problem.dtype}; ggnchunk computes in the parameters' dtype. Remove "
                "the cast from forward."
            )
        _check_finite_output(output)
        if problem.loss_func is not None:
            with _eager():
                self._loss = self._loss_of(output)
        self._recording.plan(output)
        self._warn_unreached()
        self.quantity.check(self._recording)
        self._recording.check_independent(output)
        self.quantity.start(self._recording)
        self.loss = self._loss.detach() if self._loss is not None else None
        self._output = output
        sqrt = self.quantity.factorize(output.detach(), self._targets, self._scale)
        if self._sampling is not None:
            sqrt = self._sampling.draw(sqrt)
        self._sqrt = sqrt
        return output

    def _warn_unreached(self) -> None:
        """Warn about trainable parameters that no gradient of the output reaches."""
        names = [self._problem.names[i] for i in self._recording.unreached]
        if not names:
            return
        shown = ", ".join(names[:4]) + (
            f" and {len(names) - 4} more" if len(names) > 4 else ""
        )
        warn(
            f"ggnchunk: no gradient of the model output reaches the trainable "
            f"parameter(s) {shown}: their GGN diagonal is zero, as their gradients are. "
            "Either forward did not use them (an unused head, an auxiliary branch "
            "skipped in eval mode), or it used a value computed from them without "
            "gradients (a cache filled under torch.no_grad(): timm's LeViT keeps its "
            "attention biases so in eval mode; clear such a cache before the call). "
            "Set requires_grad=False on parameters that are meant to be unused.",
            UnusedParameterWarning,
        )

    def _loss_of(self, output: Tensor) -> Tensor:
        problem = self._problem
        problem.handler.check_shapes(problem.loss_func, output, self._targets)
        with torch.enable_grad():
            try:
                loss = problem.loss_func(output, self._targets)
            except (RuntimeError, ValueError, IndexError, TypeError) as error:
                hint = "Check the targets' shape and dtype for this loss."
                own = _mismatched_tensors(problem.loss_func, output)
                if own:  # a class weight in float32 beside a float64 model, say
                    hint = (
                        f"loss_func holds tensors unlike the model output ({output.dtype} "
                        f"on {output.device}): {', '.join(own)}. Move them with "
                        f"loss_func.to(dtype={output.dtype}, device='{output.device}')."
                    )
                batched = _batch_shaped(problem.loss_func, output)
                if batched is not None:  # the whole batch's per-sample weight
                    name, size = batched
                    hint = (
                        f"loss_func.{name} has a batch axis of {size} samples, but this "
                        f"forward pass has {output.shape[0]}: a per-sample weight cannot "
                        "follow batch_chunk_size's sub-batches. Drop batch_chunk_size, or "
                        "weight the samples in a loss function of (output, target)."
                    )
                raise ValueError(
                    f"loss_func ({type(problem.loss_func).__name__}) fails on the model "
                    f"output of shape {tuple(output.shape)} and targets of shape "
                    f"{tuple(self._targets.shape)} ({self._targets.dtype}): "
                    f"{str(error).rstrip('.')}. {hint}"
                ) from error
        if not isinstance(loss, Tensor):
            raise TypeError(
                f"loss_func returned {type(loss).__name__} {loss!r}, not a tensor: "
                "ggnchunk differentiates the loss, so compute it with torch operations on "
                "the output and return the tensor (no .item() or float())."
            )
        if loss.dim() != 0:
            raise ValueError(
                f"loss_func returned a tensor of shape {tuple(loss.shape)}; ggnchunk "
                "needs a scalar loss (reduction='mean' or 'sum')."
            )
        return loss

    @property
    def num_columns(self) -> int:
        """Number of columns ``V`` of the loss Hessian's square root (after forward)."""
        return self._require_sqrt().num_columns

    def column_bytes(self) -> int:
        """Upper bound on the bytes one column adds during a backward sweep.

        Returns:
            Bytes per column (square-root column and everything backpropagated).
        """
        element = self._output.element_size()
        sqrt = self._require_sqrt()
        # where the passes stop at a cut (known after the first): what they hold above
        cut = self._cut_place("above")
        dense = self._recording.column_bytes(element, cut=cut) + sqrt.column_bytes()
        self._dense_share = 1.0
        if (
            self._windowed(sqrt) and self._windows.choice is not False
            and not self._recording.geometric_windows
        ):  # fmt: skip
            # boxes read from values after glue or a layer without a windowed form:
            # no bound for windowed passes (their extra copies around the glue are not
            # in the dense bound), so a budgeted call runs dense passes, from the first
            self._windows.choice, self._by_values = False, True
        if (
            self._windowed(sqrt) and self._windows.choice is not False
            and self._recording.windowed_bound_ready
        ):  # fmt: skip
            # a windowed pass costs its boxes (the seed: one position per column);
            # dense passes then run the chunk in parts of the share that fits
            positions = math.prod(self._output.shape[2:])
            seed = 2 * -(-sqrt.column_bytes() // positions) + 64
            windowed = self._recording.column_bytes(element, True, cut) + seed
            self._dense_share = min(1.0, windowed / max(dense, 1))
            return min(dense, windowed)
        return dense

    def layer_bounds(self, fixed: int, per_column: int) -> list[tuple[int, int]] | None:
        """The dense bound split at the layers' steps, for a budget's chunk size.

        :meth:`fixed_bytes` counts the largest rule's transient bytes beside
        :meth:`column_bytes`' largest column anywhere; a layer's transient bytes are held
        only during its own steps (:meth:`~ggnchunk._graph.bound.MemoryBound.layer_steps`).

        Args:
            fixed: :meth:`fixed_bytes` of the plan.
            per_column: :meth:`column_bytes` of the plan.

        Returns:
            ``[(fixed, per column)]``: a chunk of ``V`` columns needs the largest
            ``fixed + V * per column`` of them (the first: one column of the unsplit
            bound, for every chunk), each within the pair of :meth:`fixed_bytes` and
            :meth:`column_bytes` at ``V >= 1``; or ``None`` where the bound is not
            split (windowed passes, a cut, a quantity whose fixed bytes are not the
            rules').
        """
        sqrt = self._require_sqrt()
        if (
            self._cut_place("above") is not None
            or type(self.quantity).fixed_bytes is not Quantity.fixed_bytes
            or (self._windowed(sqrt) and self._windows.choice is not False)
        ):  # fmt: skip
            return None
        element = self._output.element_size()
        largest, rest, steps = self._recording.layer_steps(element)
        if not steps or rest >= largest:
            return None
        seed = sqrt.column_bytes()
        # the working blocks' transient bytes stay beside every column; the weights'
        # totals only beside their layer's. One column keeps the unsplit line's count:
        # a fresh process's heap grows over its passes by about what the totals held
        # apart (ResNet-18: 9 MiB over ten one-column passes, whose peaks reached
        # 66-70 MiB where the split counted 63.5), so the split only lets more columns
        # in beside small transients, never a budget the line refuses
        bounds = [(fixed + per_column, 0), (fixed - largest + rest, per_column)]
        bounds += [
            (fixed - largest + transient, min(per_column, held + seed))
            for transient, held in steps
        ]
        return bounds

    assume_fields_kept = False
    """:meth:`fixed_bytes` as after a first pass that kept every field image (planning
    only: a budget's choice between lean and kept caches)."""

    _dense_share = 1.0
    """A dense pass runs a chunk in parts of this share (the chunk was planned with the
    windowed bound)."""

    def fixed_bytes(self, columns: int | None = None) -> int:
        """Upper bound on the bytes the sweeps keep whatever the chunk size.

        Args:
            columns: The chunk size to plan the contraction forms for (default: the
                last one given, at first all columns). A layer keeps the Gram form's
                matrices only where that form wins at this size; larger chunks then
                choose as this size would, so the bound holds for every chunk size.

        Returns:
            Bytes (rule caches and the chunk's diagonal accumulators).
        """
        element = self._output.element_size()
        if columns is not None or self._columns is None:
            self._columns = min(columns or self.num_columns, self.num_columns)
            for call in self._recording.calls:  # the Gram form's matrices depend on it
                call.ctx.columns = self._columns
        # the quantity's accumulators are allocated before the first sweep (measured
        # with the forward pass) and the sweeps add to them in place
        # where the passes stop at a cut (known after the first): the caches above it,
        # and the Gram's factor there
        fixed = self.quantity.fixed_bytes(
            self._recording, element, self._cut_place("above")
        )
        if self._cut is not None:
            fixed += self._cut.reserve_bytes()
        if self._windowed(self._require_sqrt()) and self._windows.choice is not False:
            # a windowed pass carries fields (GroupNorm's), dense maps per sample that
            # travel like extra columns; their images are kept for the later passes
            # (what the cache may still add: it never holds more than it is given)
            recording = self._recording
            fields = sum(
                call.rule.field_count(call.ctx) for call in recording.calls
                if call.leaf is not None
            )  # fmt: skip
            complete = recording.images.complete and recording.geometric_windows
            if fields and not (complete or self.assume_fields_kept):
                # fields still travel in some sweeps
                fixed += fields * recording.column_bytes(element)
            if fields:
                recording.images.plan(recording.field_image_bytes(element))
                fixed += recording.images.unbuilt_bytes()
        return fixed

    @property
    def may_window(self) -> bool:
        """Whether passes may still carry windows (before the budget's plan)."""
        return self._windowed(self._require_sqrt()) and self._windows.choice is not False

    def plan_dense(self, dense: bool, reason: str | None = None) -> None:
        """Plan dense passes only (``dense``), or undo that; call before any pass.

        Dense passes carry no fields, so their bounds leave out the fields' memory.

        Args:
            dense: Dense passes only; ``False`` restores the choice as it was.
            reason: Why (the report's ``window_ends``).
        """
        if dense and not self._planned_dense:
            self._planned_choice = self._windows.choice
        if dense:
            self._windows.choice, self._dense_reason = False, reason
            self._dense_limit = None  # dense chunks are planned with the dense bound
        elif self._planned_dense:
            self._windows.choice, self._dense_reason = self._planned_choice, None
        self._planned_dense = dense

    def limit_dense_parts(self, room: int) -> None:
        """Dense parts of chunks planned for windows hold what ``room`` bytes fit.

        Call after the plan's bounds are made (they count the fields' memory, which
        stays held during dense parts).

        Args:
            room: Bytes a pass may take above the memory in use.
        """
        element = self._output.element_size()
        dense = self._recording.column_bytes(element) + self._require_sqrt().column_bytes()
        self._dense_limit = max(1, int((room - self.fixed_bytes()) // max(dense, 1)))

    _dense_limit: int | None = None
    _planned_dense = False
    _planned_choice: bool | None = None
    _dense_reason: str | None = None
    _by_values = False  # dense passes because boxes would be read from values

    @property
    def has_fields(self) -> bool:
        """Whether windowed passes carry fields (norms over positions make them)."""
        return any(
            call.rule.field_count(call.ctx) for call in self._recording.calls
            if call.leaf is not None
        )  # fmt: skip

    @property
    def field_images_kept(self) -> bool:
        """Whether the windowed passes' fields need not travel (none, or all images kept).

        Known after the first windowed pass (before it: whether there are no fields).
        """
        recording = self._recording
        return not self.has_fields or (
            recording.images.complete and recording.geometric_windows
        )

    def limit_field_images(self, limit: int | None) -> None:
        """The most bytes the windowed fields' kept images may take (before any pass).

        Args:
            limit: Bytes (``None``: what they could need, as :meth:`fixed_bytes` counts).
        """
        self._recording.images.limit = limit

    def set_lean(self, lean: bool) -> None:
        """Keep no recomputable per-forward caches (for tight budgets), or keep them.

        Lean sweeps unfold a convolution's input one sample at a time in every chunk
        instead of once per forward pass, and map windowed fields again in every pass:
        less memory, more time. Call before the first backward pass;
        :meth:`fixed_bytes` follows.

        Args:
            lean: Whether to run lean.
        """
        self.lean = lean
        self._recording.images.set_enabled(not lean)
        for call in self._recording.calls:
            call.ctx.lean = lean
            if lean:
                call.ctx.caches.drop_for_lean()

    def _require_sqrt(self) -> SqrtHessianFactor:
        if self._sqrt is None:
            raise RuntimeError("call forward() first")
        return self._sqrt

    def backward(self, start: int, stop: int) -> None:
        """Add columns ``start:stop`` to the quantity.

        A pass that fails may have added some parameters' shares already; the quantity
        remembers them, so a failed range can be retried in parts (ranges inside it) and
        every column is still added exactly once.

        Args:
            start: First column (inclusive).
            stop: Last column (exclusive).
        """
        sqrt = self._require_sqrt()
        if self._expected is not None:  # the first pass: two phases if it is a chunk
            total, room = self._expected
            self._expected = None
            if stop - start < total and self.quantity.gram_only:
                if room is None:  # no budget: the factor within what the device has
                    room = free_memory(self._output.device) // 4
                self._cut = Cut(total, room, self._recording.column_macs)
        choice = self._windows
        if not self._windowed(sqrt) or choice.choice is False:
            self._dense(sqrt, start, stop)
            return
        recording = self._recording
        if choice.trial_next and stop - start >= 2 and recording.windowed_bound_ready:
            # boxes far smaller than the maps (by geometry): windows, no trial
            share = recording.windowed_share()
            if share is not None and share <= windows.CLEARLY_SMALLER:
                choice.settle(True)
        if not choice.trial_next or stop - start < 2:
            choice.passes += 1
            self._backward(sqrt, start, stop, True)
        else:  # the trial: each path timed at the size of part it will run
            self._trial(sqrt, start, stop)

    def _trial(self, sqrt: SqrtHessianFactor, start: int, stop: int) -> None:
        """Time both paths on parts of one chunk; keep the faster for later passes.

        Each path is timed at the size of part it will run (time per column depends on
        the size: a small part's vectors stay in cache and reuse the heap's pages, a
        large one's pay fresh pages). The dense part runs in up to three timed pieces
        and stops early where dense has lost, the rest of it then windowed: after a
        thirty-second of it, where that piece alone took longer than windows take for
        the whole part (more columns take no less time: dense cannot win); after an
        eighth (at least 8 columns, few enough for a pass's fixed costs to be spread),
        where its time per column is :data:`PROBE_MARGIN` times the windows'. A first
        call paid the whole dense part before: 5.4 s of a 5.5 s call whose later calls
        took 0.12 s (a skip added to a resized path, 8 images of 64x64,
        ``num_chunks=8``), 7 ms of the tutorial autoencoder's 25 ms first-call excess.
        """
        choice = self._windows
        run = self.dense_part(stop - start)  # dense passes' parts
        # the trial's dense part: half the chunk at most (a tenth timed dense parts
        # of 21 columns where dense passes ran 89, and kept dense on the kernel-4
        # 28x28 autoencoder at 64 MiB: 0.99x of dense where windows are 2.8x)
        part = max(1, min(run, (stop - start) // 2))
        first = max(1, -(-part // 32))
        dense = self._timed(self._part, sqrt, start, start + first, False)
        if part < run:  # dense would run larger parts than the trial affords:
            # time windows on a part of the same size (then the rest windowed)
            end = start + 2 * part
            windowed = self._timed(self._part, sqrt, start + part, end, True)
        else:  # dense runs parts of this size: windows at their own, the rest
            end = stop
            windowed = self._timed(self._part, sqrt, start + part, stop, True)
            windowed *= part / (stop - start - part)  # as many columns as the dense part
        done, lost = first, dense > windowed  # more columns take no less time
        second = max(first, -(-part // 8))
        if not lost and second >= 8 and second < part:
            dense += self._timed(self._part, sqrt, start + done, start + second, False)
            done = second
            lost = dense / done > PROBE_MARGIN * windowed / part
        if done < part:
            if lost:  # the rest of the dense part windowed
                self._part(sqrt, start + done, start + part, True)
            else:
                dense += self._timed(self._part, sqrt, start + done, start + part, False)
                done = part
        choice.decide(windowed / part, dense / done)
        if end < stop:
            self._part(sqrt, end, stop, True)

    def _dense(self, sqrt: SqrtHessianFactor, start: int, stop: int) -> None:
        """A dense pass, in parts where the chunk was planned with the windowed bound."""
        part = self.dense_part(stop - start)
        if part >= stop - start:
            self._backward(sqrt, start, stop, False)
            return
        for a in range(start, stop, part):
            self._part(sqrt, a, min(stop, a + part), False)

    def dense_part(self, columns: int) -> int:
        """Columns of a dense part of a chunk of ``columns``.

        Args:
            columns: The chunk's.

        Returns:
            At most ``columns``.
        """
        part = max(1, int(columns * self._dense_share))
        return part if self._dense_limit is None else min(part, self._dense_limit)

    def _timed(self, fn, *args) -> float:
        clock = time.perf_counter()
        fn(*args)
        synchronize(self._output.device)
        return time.perf_counter() - clock

    def _part(self, sqrt: SqrtHessianFactor, start: int, stop: int, windowed: bool) -> None:
        """One part of a chunk; out of memory, its halves (never the whole chunk).

        The scheduler retries a failed chunk in halves, which is exact only for ranges
        inside the one that failed: once parts of a chunk are added, a failure is
        recovered here, inside the part, and is not passed on as out of memory.
        """
        try:
            self._backward(sqrt, start, stop, windowed)
        except BaseException as error:
            if not is_out_of_memory(error):
                raise
            if stop - start == 1:
                raise RuntimeError(
                    "ggnchunk ran out of memory on a backward pass of one column "
                    f"({error}). Raise max_memory, or use smaller batches "
                    "(batch_chunk_size)."
                ) from error
            mid = (start + stop) // 2
            self._part(sqrt, start, mid, windowed)
            self._part(sqrt, mid, stop, windowed)

    def _backward(
        self, sqrt: SqrtHessianFactor, start: int, stop: int, windowed: bool
    ) -> None:
        self.quantity.begin(sqrt, start, stop)
        # the passes the glue readers' proof is paid back over (:mod:`._graph.readers`)
        self._recording.passes_ahead = -(-sqrt.num_columns // max(stop - start, 1))
        try:
            if windowed:  # one-hot columns on their output positions
                seed = sqrt.windowed_columns(start, stop)
                self.windowed_passes += 1
            else:
                seed = sqrt.columns(start, stop)
            self._recording.sweep(seed, self.quantity, cut=self._cut)
        except BaseException:
            self.quantity.abort()
            if self._cut is not None:  # its rows at the cut: added by the retried parts
                self._cut.discard()
            raise
        if self._cut is not None:
            self._cut.commit()
        if windowed:  # the fields' images the later passes reuse are all kept
            self._recording.images.freeze()

    windowed_passes = 0
    """Backward passes that carried their columns on boxes."""

    # -- two phases: chunks' sweeps stop at a cut, its Gram's factor swept below -------
    _expected: tuple[int, int | None] | None = None
    _cut: Cut | None = None

    def expect(self, total: int, room: int | None = None) -> None:
        """Before the first pass: the passes will cover ``total`` columns.

        Where the first pass is a chunk of them (fewer), every pass may stop where the
        columns span few directions of everything the sweep holds, and a factor of the
        Gram there, added over the passes, is swept below once
        (:class:`ggnchunk._graph.compress.Cut`): then :meth:`columns_below_cut` and
        :meth:`below_cut` finish the call.

        Args:
            total: Columns the call's passes cover.
            room: Bytes the Gram's factor may take with its folds (a budget's room;
                ``None``: a quarter of the memory the device has free).
        """
        self._expected = (total, room)

    def columns_below_cut(self) -> int:
        """After the passes: the factor columns still to sweep below the cut (or 0).

        The first call factors the Gram the passes added (and frees it).

        Returns:
            Columns ``R`` per sample (:meth:`below_cut` takes ranges of ``[0, R)``).
        """
        cut = self._cut
        if cut is None or not cut.on:
            return 0
        return cut.factor(self._output.dtype)

    def below_cut_bytes(self) -> tuple[int, int]:
        """The memory bound of the passes below the cut: fixed, and per column.

        Returns:
            ``(fixed bytes, bytes per column)`` (dense vectors, counted from the
            memory in use, which holds the factor's columns).
        """
        element = self._output.element_size()
        below = self._cut_place("below")
        # dense passes: no windowed fields travel (their kept images are in use)
        fixed = self.quantity.fixed_bytes(self._recording, element, below)
        return fixed, self._recording.column_bytes(element, cut=below)

    def plan_below_cut(self, columns: int | None = None, lean: bool | None = None) -> None:
        """Plan the layers below the cut for chunks of at most ``columns`` factor columns.

        They choose their contraction forms, and keep the Gram form's matrices, for
        chunks of that size (as :meth:`fixed_bytes` does above the cut); no chunk below
        holds more than the factor's columns (the default). The phase-one passes' chunk
        size, which they were planned for before, does not reach them: LRASPP's
        depthwise layers were counted 3.4 MiB of Gram matrices each for 408 columns
        where one-column passes kept 0.2 MiB of patches, and 48 factor columns ran one
        per pass within 44.8 MiB (2.9 s) where 29.1 MiB ran them six at a time (0.7 s).

        Nor does the passes' choice of lean caches: the layers below build theirs in
        the passes from the cut, so they may run lean where the passes above did not
        (:meth:`set_lean`, for them alone).

        Args:
            columns: Most factor columns per chunk (``None``: all of them).
            lean: Whether the layers below run lean (``None``: as they are).
        """
        most = self._cut.columns.shape[0]
        columns = most if columns is None else max(1, min(columns, most))
        for call in self._recording._calls_on(self._cut_place("below")):
            call.ctx.columns = columns
            if lean is not None:
                call.ctx.lean = lean
                if lean:
                    call.ctx.caches.drop_for_lean()

    def _cut_place(self, side: str) -> tuple[str, int] | None:
        cut = self._cut
        return None if cut is None or not cut.on else (side, cut.index)

    def below_cut(self, start: int, stop: int) -> None:
        """Sweep factor columns ``start:stop`` from the cut to the inputs (phase two).

        Args:
            start: First column.
            stop: One past the last.
        """
        cut = self._cut
        shift = self.num_columns  # ranges apart from the chunks' (failed-pass records)
        self.quantity.begin(None, shift + start, shift + stop)
        self._recording.passes_ahead = -(-cut.columns.shape[0] // max(stop - start, 1))
        try:
            waiting = cut.waiting(start, stop, self._recording.images)
            self._recording.sweep(None, self.quantity, cut=cut, resume=waiting)
        except BaseException:
            self.quantity.abort()
            raise

    @property
    def window_ends(self) -> dict[str, str]:
        """Where windowed columns became dense vectors, and why (for the report)."""
        ends = dict(self._recording.window_ends) if self._recording is not None else {}
        if self._dense_reason is not None:
            ends["every pass"] = self._dense_reason
        elif self._windows.choice is False and self._by_values:
            ends["every pass"] = (
                "boxes after glue without a windowed form are read from values, which "
                "the memory bound cannot count: a budgeted call runs dense passes"
            )
        elif self._windows.choice is False and self._windows.remembered:
            ends["every pass"] = (
                "an earlier call on this problem measured the dense path faster (its "
                "choice is remembered; ggnchunk.clear_autotune_cache() forgets it)"
            )
        elif self._windows.choice is False:
            ends["every later pass"] = (
                "the dense path was measured faster on this model's first passes"
            )
        return ends

    def _windowed(self, sqrt: SqrtHessianFactor) -> bool:
        """Whether this pass carries its columns on boxes (:mod:`ggnchunk._windows`)."""
        output = self._output
        return (
            windows.ENABLED and self.quantity.windowed and sqrt.local
            and output is not None and output.dim() >= 3
            and math.prod(output.shape[2:]) >= windows.MIN_POSITIONS
            and any(call.rule.windowed for call in self._recording.calls)
        )  # fmt: skip

    def gradient(self) -> list[Tensor | None]:
        """The gradient of the (scaled-as-computed) loss w.r.t. the parameters.

        Returns:
            One tensor per parameter (``None`` where the loss does not depend on it).
        """
        if self._loss is None or self._output is None:
            raise RuntimeError("call forward() first")
        (seed,) = torch.autograd.grad(self._loss, self._output, retain_graph=True)
        gradient = Gradient(self._problem)
        self._recording.sweep(seed, gradient)
        return gradient.result


def _check_finite_output(output: Tensor) -> None:
    """Refuse a model output with NaN or Inf (the inputs and parameters are finite).

    Args:
        output: The model output, ``[N, ...]``.

    Raises:
        ValueError: Naming the first sample with a non-finite output.
    """
    if not output.is_floating_point():
        return
    finite = torch.isfinite(output.detach()).reshape(output.shape[0], -1).all(1)
    if not bool(finite.all()):
        sample = int((~finite).nonzero()[0, 0])
        raise ValueError(
            f"the model output contains NaN or Inf values (sample {sample} first, "
            f"{int((~finite).sum())} of {output.shape[0]} samples), although the inputs "
            "and parameters are finite: an operation in forward produced them (a log or "
            "square root of a negative number, a division by zero, an overflow). The "
            "GGN is not defined there; fix the forward pass (e.g. clamp before a log) "
            "or leave those samples out."
        )


def _loss_tensors(loss_func: nn.Module) -> dict[str, Tensor]:
    """A loss module's tensors: its buffers and tensor attributes (a class weight, say).

    Args:
        loss_func: The loss module.

    Returns:
        ``{name: tensor}``.
    """
    tensors = dict(loss_func.named_buffers())
    tensors.update((k, v) for k, v in vars(loss_func).items() if isinstance(v, Tensor))
    return tensors


def _mismatched_tensors(loss_func: Any, output: Tensor) -> list[str]:
    """A loss module's floating tensors whose dtype or device differ from the output's.

    Args:
        loss_func: The loss (a module or a function: none then).
        output: The model output.

    Returns:
        ``"name (dtype, device)"`` for each.
    """
    if not isinstance(loss_func, nn.Module):
        return []
    return [
        f"{name} ({tensor.dtype}, {tensor.device})"
        for name, tensor in _loss_tensors(loss_func).items()
        if tensor.is_floating_point()
        and (tensor.dtype != output.dtype or tensor.device != output.device)
    ]


def _batch_shaped(loss_func: nn.Module, output: Tensor) -> tuple[str, int] | None:
    """A tensor of the loss shaped like a batch of outputs, but of another batch size.

    Args:
        loss_func: The loss module.
        output: This forward pass's output ``[N, ...]``.

    Returns:
        ``(attribute name, its batch size)``, or ``None``.
    """
    for name, value in _loss_tensors(loss_func).items():
        if value.dim() == output.dim() and value.shape[0] not in (1, output.shape[0]):
            return name, value.shape[0]
    return None


_EAGER_STANCE = _SharedSwitch(
    lambda: torch.compiler.set_stance("force_eager"),  # set now; its exit restores
    lambda stance: stance.__exit__(None, None, None),
)


def _eager() -> contextlib.AbstractContextManager:
    """A context where code compiled with ``torch.compile`` runs eagerly, as written.

    The recorded forward pass needs the model's layers to run as modules (their hooks
    record them; dynamo would trace through the hooks and fail in them). Eager code
    computes the same function; what dynamo would have fused is not run. Nothing to do
    where dynamo was never imported (no code can have been compiled). The stance is
    the process's: calls in several threads share one switch (:class:`_SharedSwitch`).
    """
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return _EAGER_STANCE()
