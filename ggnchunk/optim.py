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

from collections.abc import Callable, Iterable
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
        params: Parameters, parameter groups, or ``model.named_parameters()`` (then
            curvature is matched by name; otherwise by order).
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
        checks = {
            "lr": (group["lr"] > 0, "a positive step size"),
            "damping": (group["damping"] > 0, "positive"),
            "beta": (0 <= group["beta"] < 1, "in [0, 1)"),
            "weight_decay": (group["weight_decay"] >= 0, "non-negative"),
            "update_every": (
                isinstance(group["update_every"], int)
                and not isinstance(group["update_every"], bool)
                and group["update_every"] >= 1,
                "an int >= 1",
            ),
        }
        for name, (ok, what) in checks.items():
            if not ok:
                raise ValueError(f"Invalid {name}: {group[name]!r}; it must be {what}.")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (its hyperparameters are validated like the defaults).

        Args:
            param_group: As for any ``torch.optim.Optimizer``.
        """
        super().add_param_group(param_group)
        self._validate(self.param_groups[-1])

    # -- curvature ----------------------------------------------------------------------
    def _named(self) -> list[tuple[str | None, nn.Parameter, dict[str, Any]]]:
        named = []
        for group in self.param_groups:
            names = group.get("param_names", [None] * len(group["params"]))
            named += [(n, p, group) for n, p in zip(names, group["params"], strict=True)]
        return named

    @torch.no_grad()
    def update_curvature(self, diag: dict[str, Tensor]) -> None:
        """Fold a GGN diagonal into the moving average.

        Args:
            diag: What :func:`ggnchunk.diag_ggn` returns. Matched by parameter name when
                the optimizer was built from ``named_parameters()``, else by order.

        Raises:
            KeyError: If a parameter's name is missing from ``diag``.
            ValueError: If the number of entries or a shape does not match.
        """
        named = self._named()
        by_name = all(name is not None for name, _, _ in named)
        if by_name:
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
                    "parameters; build the optimizer from model.named_parameters() to "
                    "match by name."
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
        """Whether the next step should refresh the curvature (every ``update_every``)."""
        _, param, group = self._named()[0]
        state = self.state.get(param, {})
        if "curvature" not in state or "step" not in state:  # (a closure run alone)
            return True
        return int(state["step"].item()) % group["update_every"] == 0

    def closure(
        self,
        model: nn.Module,
        loss_func: nn.Module,
        inputs: Tensor,
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
            inputs: The batch's inputs.
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
            if not self.curvature_due:
                loss = loss_func(model(inputs), targets)
                loss.backward()
                return loss.detach()
            loss, grad, diag = loss_grad_and_diag_ggn(
                model, loss_func, inputs, targets, options=resolved
            )
            params = dict(model.named_parameters())
            for name, value in grad.items():
                # the gradient hooks loss.backward() would have run (clipping, say)
                params[name].grad = as_hooks_leave_it(params[name], value)
            self.update_curvature(diag)
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
