"""The BackPACK engine: hooks on, one forward pass, one backward pass per column range.

:class:`GGNComputation` owns everything it adds to the user's model for the duration of a
``with`` block and removes it on exit, whatever happens in between:

* a forward hook that stores each layer's input and output (BackPACK's ``hook_store_io``)
  and a full backward hook that runs BackPACK's extension, on every layer not already
  extended by the user (handles kept locally, so BackPACK's global ``CTX`` never grows);
* a recording forward hook on every layer, used to check after the forward pass that the
  layers form a chain BackPACK can follow (no functional operations between layers);
* ``inplace=False`` on layers built with ``inplace=True`` (an in-place activation would
  overwrite the input BackPACK needs), restored on exit;
* the ``diag_ggn_exact`` attribute BackPACK writes on parameters (restored to its value
  before the call, if the user had one).

Each backward pass seeds BackPACK with columns ``start:stop`` of the loss Hessian's square
root (see :mod:`ggnchunk._sqrt_hessians`) and adds the resulting diagonals to
accumulators. The passes use ``torch.autograd.grad``, so ``.grad`` is never touched.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from types import TracebackType

import torch
from backpack import backpack, hook_run_extensions, hook_store_io, memory_cleanup
from backpack.extensions import DiagGGNExact
from backpack.extensions.module_extension import ModuleExtension
from torch import Tensor, nn

from ggnchunk._layers.fallback import AutogradJacobian, check_per_sample
from ggnchunk._modules import SUPPORTED, HookedModules
from ggnchunk._sqrt_hessians import LOSSES, LossSqrtHessian, SqrtHessianFactor

__all__ = ["GGNComputation", "quiet_backpack_warnings"]

_SAVEFIELD = "diag_ggn_exact"

_HARMLESS_WARNINGS = (
    # The first layer's input does not require grad; its parameters still get diagonals.
    "Full backward hook is firing when gradients are computed with respect to module "
    "outputs since no inputs require gradients",
)


@contextlib.contextmanager
def quiet_backpack_warnings() -> Iterator[None]:
    """Silence, by exact message, the BackPACK/torch warnings a user cannot act on.

    Yields:
        Nothing; warnings with other messages pass through unchanged.
    """
    with warnings.catch_warnings():
        for message in _HARMLESS_WARNINGS:
            warnings.filterwarnings("ignore", message=re.escape(message))
        yield


class _Skip(ModuleExtension):
    """Do nothing: the engine seeds the loss Hessian's square root itself.

    Registered for the loss classes, so that a loss module the user extended with BackPACK
    does not add BackPACK's own (full, unchunked) square root to the seeded columns.
    """

    def __call__(self, extension, module, g_inp, g_out) -> None:
        return None


_SKIP = _Skip()
_FALLBACK = AutogradJacobian()


class BrokenChainError(ValueError):
    """BackPACK cannot follow the layers: an operation outside them sits in between.

    Attributes:
        module_name: The layer whose input is computed outside the layers, or, when the
            model output is, the last layer that ran (``None`` if none ran).
        previous: The layer that ran just before ``module_name`` (``None`` if none).
    """

    def __init__(self, message: str, module_name: str | None, previous: str | None = None):
        super().__init__(message)
        self.module_name = module_name
        self.previous = previous


def _signature(tensor: Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride())


def _previous(order: list[str], name: str) -> str | None:
    index = order.index(name) if name in order else 0
    return order[index - 1] if index > 0 else None


def _display(name: str) -> str:
    return f"model.{name}" if name else "model"


class GGNComputation:
    """One batch's GGN diagonal, computed over any sequence of column ranges.

    Use as a context manager: hooks are installed on entry and everything is removed on
    exit. Call :meth:`forward` once, then :meth:`backward` once per column range, then
    read :attr:`diagonal`.

    Args:
        model: The user's model, already checked by :func:`ggnchunk._modules.check_model`.
        modules: Its layers, as returned by ``check_model``.
        loss_func: The user's loss module.
        handler: The loss's Hessian square root.
        inputs: Model inputs, shape ``[N, ...]``.
        targets: Targets, shape as the loss requires.
        params: ``(name, parameter)`` of the trainable parameters, in
            ``named_parameters()`` order.
        scale: Factor of the loss Hessian: ``1`` for ``reduction="sum"``,
            ``1 / normalizer`` of the whole batch for ``"mean"`` (see
            :meth:`~ggnchunk._sqrt_hessians.LossSqrtHessian.normalizer`).
    """

    def __init__(
        self,
        model: nn.Module,
        modules: HookedModules,
        loss_func: nn.Module,
        handler: LossSqrtHessian,
        inputs: Tensor,
        targets: Tensor,
        params: list[tuple[str, nn.Parameter]],
        scale: float,
    ):
        self._model = model
        self._modules = modules
        self._loss_func = loss_func
        self._handler = handler
        self._scale = scale
        self._inputs = inputs.detach()
        self._targets = targets.detach()
        self._names = [name for name, _ in params]
        self._params = [param for _, param in params]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._full_hook_flags: list[tuple[nn.Module, bool | None]] = []
        self._inplace: list[nn.Module] = []
        self._saved_attrs: list[tuple[Tensor, object]] = []
        self._records: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {}
        self._output: Tensor | None = None
        self._loss: Tensor | None = None
        self._factor: SqrtHessianFactor | None = None
        self._rng: Tensor | None = None
        self._loss_value: Tensor | None = None
        self._cuda_rng: Tensor | None = None
        self.gradient: list[Tensor | None] | None = None
        self.diagonal: list[Tensor] = [torch.zeros_like(p) for p in self._params]
        self.passes = 0

    # -- set-up and tear-down -------------------------------------------------------------
    def __enter__(self) -> GGNComputation:
        already = set(self._modules.already_extended)
        try:
            for name, module in self._modules.leaves:
                if getattr(module, "inplace", None) is True:
                    module.inplace = False
                    self._inplace.append(module)
                self._handles.append(module.register_forward_hook(self._recorder(name)))
                if name in already:
                    continue
                self._full_hook_flags.append((module, module._is_full_backward_hook))
                self._handles.append(module.register_forward_hook(hook_store_io))
                self._handles.append(
                    module.register_full_backward_hook(hook_run_extensions)
                )
            for param in self._params:
                if hasattr(param, _SAVEFIELD):
                    self._saved_attrs.append((param, getattr(param, _SAVEFIELD)))
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
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module, flag in self._full_hook_flags:
            module._is_full_backward_hook = flag
        self._full_hook_flags.clear()
        for module in self._inplace:
            module.inplace = True
        self._inplace.clear()
        for _, module in self._modules.leaves:
            memory_cleanup(module)
        if getattr(self._loss_func, "_backpack_extend", False):
            memory_cleanup(self._loss_func)  # the user's BackPACK hooks stored our tensors
        for param in self._params:
            if hasattr(param, _SAVEFIELD):
                delattr(param, _SAVEFIELD)
        for param, value in self._saved_attrs:
            setattr(param, _SAVEFIELD, value)
        self._saved_attrs.clear()
        self._output = self._loss = self._factor = None

    def _recorder(self, name: str):
        records = self._records

        def record(module: nn.Module, inputs: tuple, output: object) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, Tensor) and torch.is_grad_enabled():
                records.setdefault(name, []).append(_signature(out))

        return record

    # -- the passes -----------------------------------------------------------------------
    def forward(self) -> Tensor:
        """Run the forward pass and check the result before any backward pass.

        Returns:
            The model output (attached to the graph), shape ``[N, ...]``.

        Raises:
            ValueError: If the model output does not fit the targets, or the layers are not
                connected the way BackPACK needs.
        """
        if self._rng is None:  # remember the random state: a re-run draws the same masks
            self._rng = torch.get_rng_state()
            if self._inputs.device.type == "cuda":
                self._cuda_rng = torch.cuda.get_rng_state(self._inputs.device)
        self._records.clear()
        devices = [self._inputs.device] if self._inputs.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self._rng)
            if devices:
                torch.cuda.set_rng_state(self._cuda_rng, self._inputs.device)
            with torch.enable_grad(), quiet_backpack_warnings():
                output = self._model(self._inputs)
        if not isinstance(output, Tensor):
            raise ValueError(
                f"the model returned a {type(output).__name__}; ggnchunk needs a single "
                "output tensor of shape [N, ...]."
            )
        self._check_chain(output)
        self._handler.check_shapes(self._loss_func, output, self._targets)
        with torch.enable_grad():
            self._loss = self._loss_func(output, self._targets)
        self._loss_value = self._loss.detach()
        self._output = output
        self._factor = self._handler.factorize(
            self._loss_func, output.detach(), self._targets, self._scale
        )
        return output

    def _check_chain(self, output: Tensor) -> None:
        if output.shape[0] != self._inputs.shape[0]:
            raise ValueError(
                f"the model output has batch size {output.shape[0]} but inputs has "
                f"{self._inputs.shape[0]}; ggnchunk needs axis 0 of the output to be the "
                "batch axis."
            )
        if not output.requires_grad:
            raise ValueError(
                "the model output does not depend on any trainable parameter; check "
                "requires_grad of the model's parameters."
            )
        produced: dict[tuple, set[str]] = {}
        for name, signatures in self._records.items():
            if len(signatures) > 1:
                raise BrokenChainError(
                    f"{_display(name)} was called {len(signatures)} times in one forward "
                    "pass; ggnchunk (through BackPACK) needs each layer to be called once. "
                    "Use a separate layer instance for each call.",
                    name,
                )
            produced.setdefault(signatures[0], set()).add(name)
        for name, module in self._modules.leaves:
            if name not in self._records:
                continue
            index = 0
            while hasattr(module, f"input{index}"):
                value = getattr(module, f"input{index}")
                index += 1
                if not (isinstance(value, Tensor) and value.requires_grad):
                    continue
                if not produced.get(_signature(value), set()) - {name}:
                    raise BrokenChainError(
                        f"the input of {_display(name)} ({type(module).__name__}) is "
                        "computed by an operation outside the model's layers (a functional "
                        "call such as torch.relu, x.view, x + y or torch.cat in forward). "
                        "BackPACK can only follow layers: replace the operation with a "
                        "layer (nn.ReLU, nn.Flatten, ...).",
                        name,
                        _previous(list(self._records), name),
                    )
        if _signature(output) not in produced:
            raise BrokenChainError(
                "the model output is computed by an operation outside the model's layers "
                "(for example a reshape or activation function at the end of forward). "
                "Replace it with a layer (nn.Flatten, nn.Sigmoid, ...), or leave it out: "
                "ggnchunk accepts image- and sequence-shaped outputs.",
                next(reversed(self._records), None),
            )
        for name, module in self._modules.leaves:
            if name in self._modules.fallback and name in self._records:
                check_per_sample(name, module, module.input0, module.output)

    @property
    def num_columns(self) -> int:
        """Number of columns ``V`` of the loss Hessian's square root (after forward)."""
        return self._require_factor().num_columns

    @property
    def column_bytes(self) -> int:
        """Bytes of one column of the square root, ``N * prod(output_shape)`` entries."""
        return self._require_factor().column_bytes()

    @property
    def loss(self) -> Tensor:
        """The loss value of the forward pass, detached."""
        if self._loss_value is None:
            raise RuntimeError("call forward() first")
        return self._loss_value

    def _require_factor(self) -> SqrtHessianFactor:
        if self._factor is None:
            raise RuntimeError("call forward() first")
        return self._factor

    def _extension(self) -> DiagGGNExact:
        extension = DiagGGNExact()
        for cls, module_extension in SUPPORTED.items():
            if module_extension is not None:
                extension.set_module_extension(cls, module_extension, overwrite=True)
        for cls in self._modules.fallback_classes:
            extension.set_module_extension(cls, _FALLBACK, overwrite=True)
        for cls in LOSSES:
            extension.set_module_extension(cls, _SKIP, overwrite=True)
        return extension

    def backward(self, start: int, stop: int, retain_graph: bool = True) -> None:
        """Add the GGN diagonal of columns ``start:stop`` to :attr:`diagonal`.

        Nothing is added if the pass fails, so a failed range can be retried (split into
        smaller ranges). If the graph is gone (a pass with ``retain_graph=False`` ran or
        failed), the forward pass is run again first, with the same random state (the
        same dropout masks), so any range can still be computed.

        Args:
            start: First column (inclusive).
            stop: Last column (exclusive).
            retain_graph: Keep the forward graph for further passes. ``False`` frees it
                during this pass (lower peak memory and time on the last pass).
        """
        if self._output is None and self._factor is not None:
            self.forward()
        factor = self._require_factor()
        extension = self._extension()
        output, loss = self._output, self._loss
        extension.saved_quantities.save_quantity(
            output.data_ptr(),
            factor.columns(start, stop),
            extension.accumulate_backpropagated_quantities,
        )
        try:
            with backpack(extension, retain_graph=retain_graph), quiet_backpack_warnings():
                gradient = torch.autograd.grad(
                    loss, self._params, retain_graph=retain_graph, allow_unused=True
                )
            chunk = [getattr(param, _SAVEFIELD, None) for param in self._params]
        except BaseException:
            if not retain_graph:  # the graph may be partly freed: forward again if retried
                self._drop_graph()
            raise
        finally:
            for param in self._params:
                if hasattr(param, _SAVEFIELD):
                    delattr(param, _SAVEFIELD)
        for accumulator, value in zip(self.diagonal, chunk, strict=True):
            if value is not None:
                accumulator.add_(value)
        if self.gradient is None:
            self.gradient = list(gradient)
        self.passes += 1
        if not retain_graph:
            self._drop_graph()

    def forward_bytes(self) -> int:
        """Bytes of the tensors the forward pass keeps: layer inputs and outputs, loss.

        An estimate of the memory the forward pass adds (autograd saves these or
        tensors of their size), counted once per storage.

        Returns:
            Bytes.
        """
        seen: dict[int, int] = {}
        tensors = [self._output] if self._output is not None else []
        for _, module in self._modules.leaves:
            index = 0
            while hasattr(module, f"input{index}"):
                tensors.append(getattr(module, f"input{index}"))
                index += 1
            if hasattr(module, "output"):
                tensors.append(module.output)
        for tensor in tensors:
            if isinstance(tensor, Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def plain_gradient(self) -> list[Tensor | None]:
        """The loss gradient by a plain backward pass (no BackPACK work), freeing the graph.

        Returns:
            One gradient per parameter (``None`` for unused parameters).
        """
        if self._loss is None:
            self.forward()
        gradient = torch.autograd.grad(self._loss, self._params, allow_unused=True)
        self._drop_graph()
        return list(gradient)

    def _drop_graph(self) -> None:
        self._output = self._loss = None
        for _, module in self._modules.leaves:
            memory_cleanup(module)
