"""A ``torch.optim.Optimizer`` preconditioned with the exact GGN diagonal.

The update of each parameter ``p`` with gradient ``g`` is::

    c_t  = beta * c_{t-1} + (1 - beta) * diag_ggn      (when curvature is handed over)
    c^   = c_t / (1 - beta ** k)                        (bias correction, k updates so far)
    p   <- p - lr * (g + weight_decay * p) / (c^ + damping)

Curvature comes from :func:`ggnchunk.diag_ggn` (or :func:`ggnchunk.loss_grad_and_diag_ggn`,
which gives loss, gradient and diagonal from one forward pass) through
:meth:`DiagGGNOptimizer.update_curvature`; :meth:`DiagGGNOptimizer.closure` builds a
closure that refreshes it every ``update_every`` steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ggnchunk._api import ChunkOptions, loss_grad_and_diag_ggn
from ggnchunk._autograd import as_hooks_leave_it

__all__ = ["DiagGGNOptimizer"]


class DiagGGNOptimizer(torch.optim.Optimizer):
    """Gradient descent preconditioned by a damped moving average of the GGN diagonal.

    Follows torch's conventions: hyperparameters live in ``param_groups`` (validated),
    per-parameter state holds tensors only (``step``, ``curvature``,
    ``curvature_updates``), ``state_dict()``/``load_state_dict()`` resume bit-identically,
    and ``step(closure)`` re-enables grad around the closure.

    Args:
        params: Parameters, parameter groups, or ``model.named_parameters()``. The
            :meth:`closure` matches curvature to parameters by identity; a diagonal
            handed to :meth:`update_curvature` without its model is matched by name
            (``named_parameters()``) or else by order. Frozen parameters
            (``requires_grad=False``) may be among them: they are skipped.
        lr: Step size, ``> 0``.
        damping: Added to the curvature before dividing, ``> 0``.
        beta: Moving-average factor of the curvature, ``0 <= beta < 1`` (0: use the
            latest diagonal only).
        weight_decay: L2 penalty added to the gradient, ``>= 0``.
        update_every: Refresh the curvature every this many steps (used by
            :meth:`closure` and :attr:`curvature_due`), ``>= 1``.

    Examples:
        >>> import torch, ggnchunk
        >>> from ggnchunk.optim import DiagGGNOptimizer
        >>> model = torch.nn.Linear(3, 2)
        >>> X, y = torch.randn(16, 3), torch.randn(16, 2)
        >>> opt = DiagGGNOptimizer(model.named_parameters(), lr=0.5, damping=1e-2)
        >>> closure = opt.closure(model, torch.nn.MSELoss(), X, y)
        >>> first = opt.step(closure)
        >>> bool(opt.step(closure) < first)
        True
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        damping: float = 1e-3,
        beta: float = 0.95,
        weight_decay: float = 0.0,
        update_every: int = 1,
    ):
        defaults = {
            "lr": lr,
            "damping": damping,
            "beta": beta,
            "weight_decay": weight_decay,
            "update_every": update_every,
        }
        self._validate(defaults)
        super().__init__(params, defaults)

    @staticmethod
    def _validate(group: dict[str, Any]) -> None:
        def number(value: Any) -> bool:
            return (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            )

        checks = {
            "lr": (lambda v: number(v) and v > 0, "a finite positive step size"),
            "damping": (lambda v: number(v) and v > 0, "finite and positive"),
            "beta": (lambda v: number(v) and 0 <= v < 1, "a number in [0, 1)"),
            "weight_decay": (lambda v: number(v) and v >= 0, "finite and non-negative"),
            "update_every": (
                lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                "an int >= 1",
            ),
        }
        for name, (ok, what) in checks.items():
            if not ok(group[name]):
                raise ValueError(f"Invalid {name}: {group[name]!r}; it must be {what}.")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (its hyperparameters are validated like the defaults, first).

        Args:
            param_group: As for any ``torch.optim.Optimizer``.

        Raises:
            ValueError: If a hyperparameter is invalid (the group is not added).
        """
        if isinstance(param_group, dict):  # (torch's own error for anything else)
            self._validate({**self.defaults, **param_group})
        super().add_param_group(param_group)

    # -- curvature ----------------------------------------------------------------------
    def _named(self) -> list[tuple[str | None, nn.Parameter, dict[str, Any]]]:
        named = []
        for group in self.param_groups:
            names = group.get("param_names", [None] * len(group["params"]))
            named += [(n, p, group) for n, p in zip(names, group["params"], strict=True)]
        return named

    @torch.no_grad()
    def update_curvature(
        self, diag: dict[str, Tensor], model: nn.Module | None = None
    ) -> None:
        """Fold a GGN diagonal into the moving average.

        Args:
            diag: What :func:`ggnchunk.diag_ggn` returns (its trainable parameters).
            model: The model ``diag`` is of: then matched by parameter identity (any
                order, any way the optimizer was built). Without it, matched by name
                when the optimizer was built from ``named_parameters()``, else by order.
                Parameters with ``requires_grad=False`` (which ``diag`` leaves out) are
                skipped either way.

        Raises:
            KeyError: If a trainable parameter's name is missing from ``diag``.
            ValueError: If the number of entries or a shape does not match.
        """
        named = [(n, p, g) for n, p, g in self._named() if p.requires_grad]
        if model is not None:
            ids = {id(p): name for name, p in model.named_parameters()}
            missing = [n or "a parameter" for n, p, _ in named
                       if ids.get(id(p)) not in diag]  # fmt: skip
            if missing:
                raise KeyError(
                    f"diag has no entry for the optimizer's parameter(s) {missing[:3]}: "
                    "they are not trainable parameters of model; build the optimizer "
                    "from that model's parameters."
                )
            values = [diag[ids[id(p)]] for _, p, _ in named]
        elif all(name is not None for name, _, _ in named):
            missing = [name for name, _, _ in named if name not in diag]
            if missing:
                raise KeyError(
                    f"diag has no entry for parameter(s) {missing[:3]}; pass the dict "
                    "diag_ggn returns for the model these parameters belong to."
                )
            values = [diag[name] for name, _, _ in named]
        else:
            values = list(diag.values())
            if len(values) != len(named):
                raise ValueError(
                    f"diag has {len(values)} entries but the optimizer has {len(named)} "
                    "trainable parameters; pass model=... (or build the optimizer from "
                    "model.named_parameters()) to match them by identity or name."
                )
        for (name, param, group), value in zip(named, values, strict=True):
            if value.shape != param.shape:
                raise ValueError(
                    f"diag entry for {name or 'a parameter'} has shape "
                    f"{tuple(value.shape)}, the parameter {tuple(param.shape)}."
                )
            state = self.state[param]
            if "curvature" not in state:
                state["curvature"] = torch.zeros_like(param)
                state["curvature_updates"] = torch.zeros((), dtype=torch.float32)
            beta = group["beta"]
            state["curvature"].mul_(beta).add_(value.to(param), alpha=1 - beta)
            state["curvature_updates"] += 1

    @property
    def curvature_due(self) -> bool:
        """Whether the next step should refresh the curvature (every ``update_every``).

        Counted in the optimizer's steps: the most steps any parameter took (a parameter
        that some steps leave without a gradient does not hold the count back), with the
        first group's ``update_every``.
        """
        states = [self.state.get(p, {}) for _, p, _ in self._named()]
        steps = [int(s["step"].item()) for s in states if "step" in s]
        if not steps or not any("curvature" in s for s in states):  # (a closure alone)
            return True
        return max(steps) % self.param_groups[0]["update_every"] == 0

    def closure(
        self,
        model: nn.Module,
        loss_func: nn.Module,
        inputs: Tensor | tuple | list | Mapping[str, Any],
        targets: Tensor,
        options: ChunkOptions | None = None,
        **chunking: Any,
    ) -> Callable[[], Tensor]:
        """A closure for :meth:`step`: loss and gradient, plus curvature when it is due.

        When due, one call of :func:`ggnchunk.loss_grad_and_diag_ggn` (one forward pass)
        gives loss, gradient and diagonal; otherwise a plain forward and backward pass.

        Args:
            model: The model whose parameters this optimizer holds.
            loss_func: Its loss.
            inputs: The batch's inputs, as in :func:`ggnchunk.diag_ggn`: a tensor
                (``model(inputs)``), a tuple/list (``model(*inputs)``) or a dict
                (``model(**inputs)``).
            targets: The batch's targets.
            options: The chunking settings as one :class:`~ggnchunk.ChunkOptions`
                (optional); checked now, not when the closure runs.
            **chunking: Or the same settings as keywords, as in
                :func:`ggnchunk.diag_ggn`; not both.

        Returns:
            The closure; it sets ``.grad`` and returns the loss.
        """
        resolved = ChunkOptions.resolve(options, chunking, "closure")

        def closure() -> Tensor:
            self.zero_grad()
            if not self.curvature_due:  # the model called as ggnchunk calls it
                if isinstance(inputs, Mapping):
                    output = model(**inputs)
                elif isinstance(inputs, (tuple, list)):
                    output = model(*inputs)
                else:
                    output = model(inputs)
                loss = loss_func(output, targets)
                loss.backward()
                return loss.detach()
            loss, grad, diag = loss_grad_and_diag_ggn(
                model, loss_func, inputs, targets, options=resolved
            )
            params = dict(model.named_parameters())
            for name, value in grad.items():
                # the gradient hooks loss.backward() would have run (clipping, say)
                params[name].grad = as_hooks_leave_it(params[name], value)
            self.update_curvature(diag, model)
            return loss

        return closure

    # -- the update ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """One preconditioned gradient step.

        Args:
            closure: Re-evaluates the model and returns the loss (e.g. :meth:`closure`).

        Returns:
            The closure's loss, if any.

        Raises:
            RuntimeError: If a parameter with a gradient has no curvature yet.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for name, param, group in self._named():
            if param.grad is None:
                continue
            state = self.state[param]
            if "curvature" not in state:
                raise RuntimeError(
                    f"step() ran before any curvature for {name or 'a parameter'}: call "
                    "optimizer.update_curvature(ggnchunk.diag_ggn(...)) first, or step "
                    "with optimizer.closure(model, loss_func, X, y)."
                )
            state.setdefault("step", torch.zeros((), dtype=torch.float32))
            state["step"] += 1
            grad = param.grad
            if group["weight_decay"]:
                grad = grad.add(param, alpha=group["weight_decay"])
            correction = 1 - group["beta"] ** state["curvature_updates"].item()
            denominator = state["curvature"] / correction + group["damping"]
            param.addcdiv_(grad, denominator, value=-group["lr"])
        return loss
