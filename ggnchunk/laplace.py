"""A laplace-torch curvature backend: exact GGN diagonals and KFLR factors, chunked.

Needs the optional dependency ``laplace-torch`` (``pip install 'ggnchunk[laplace]'``).

>>> from laplace import Laplace                                    # doctest: +SKIP
>>> from ggnchunk.laplace import ChunkedGGN                        # doctest: +SKIP
>>> la = Laplace(model, "regression", subset_of_weights="all",     # doctest: +SKIP
...              hessian_structure="diag", backend=ChunkedGGN,
...              backend_kwargs={"max_memory": "2GiB"})
>>> la.fit(train_loader)                                           # doctest: +SKIP

laplace-torch's conventions are kept exactly: ``diag(x, y)`` returns per-batch *sums*
(``0.5 x`` the loss and GGN of the summed MSE for regression, the summed cross-entropy's
for classification; no division by the dataset size), flattened over the trainable
parameters in order. Last-layer Laplace (``last_layer=True``) computes the features with
the feature extractor and the diagonal of the last layer only. No hooks stay on the
model, so laplace-torch's ``glm`` predictive (``torch.func``) works after ``fit``.

``ChunkedGGN(stochastic=True, num_samples=k)`` gives unbiased Monte-Carlo estimates from
``k`` sampled columns per batch (see ``mc_samples`` of :func:`ggnchunk.diag_ggn`).
:func:`output_variance` takes a fitted diagonal Laplace and returns the per-output
diagonal of its ``glm`` functional variance without Jacobians.

Inputs follow laplace-torch's backends too: a tensor is called as ``model(x)``; a dict
(a Hugging Face-style batch, any ``MutableMapping``) is passed whole, ``model(x)``, and
must hold the batched input tensor under ``dict_key_x`` (laplace-torch's
``Laplace(..., dict_key_x=..., dict_key_y=...)``; ``fit`` takes the targets from
``dict_key_y``); a tuple or list is unpacked, ``model(*x)``, as laplace-torch's
``torch.func`` Jacobians do. For classification, logits ``[B, ..., C]`` with class
indices ``[B, ...]`` (or ``[B, 1]`` for ``[B, C]``) are one prediction per position,
laplace-torch's ``f.view(-1, C)``, ``y.view(-1)``.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import Tensor, nn

from ggnchunk._api import ChunkOptions, evaluate
from ggnchunk._dataset import mapping_call
from ggnchunk._quantities import KroneckerFactors, Sampling

try:
    from laplace.curvature import GGNInterface
    from laplace.utils.matrix import Kron
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ggnchunk.laplace needs laplace-torch: pip install 'ggnchunk[laplace]' (or "
        "pip install laplace-torch)."
    ) from error

__all__ = ["ChunkedGGN", "output_variance"]


class ChunkedGGN(GGNInterface):
    """laplace-torch backend: exact diagonal GGN, chunked to fit a memory budget.

    Args:
        model: The model (or laplace-torch's feature extractor for last-layer Laplace).
        likelihood: ``"regression"`` or ``"classification"``.
        last_layer: Only the last layer's curvature (set by laplace-torch).
        subnetwork_indices: Indices of the flattened parameters to keep.
        dict_key_x: Key of the batched input tensor in dict inputs (laplace-torch's
            convention; the whole dict is passed to the model).
        dict_key_y: Key of the targets in dict batches (read by laplace-torch's
            ``fit``, which passes them as ``y``).
        stochastic: ``True``: Monte-Carlo estimates (diagonal and Kronecker output
            factors) from ``num_samples`` sampled columns of the loss Hessian's square
            root per batch (see ``mc_samples`` of :func:`ggnchunk.diag_ggn`; one draw
            from the global RNG per batch), unbiased; ``False`` (default): exact.
        num_samples: Sampled columns per batch with ``stochastic=True``.
        options: The chunking settings as one :class:`~ggnchunk.ChunkOptions`
            (``backend_kwargs={"options": ...}``), optional.
        **chunking: Or the same settings as keywords (``backend_kwargs``): the fields
            of :class:`~ggnchunk.ChunkOptions` (``max_memory``, ``num_chunks``,
            ``chunk_size``, ``batch_chunk_size``, ``recover_oom``, ...).

    ``hessian_structure="diag"`` (:meth:`diag`) and ``"kron"`` (:meth:`kron`, the factors
    of ``BackPackGGN(stochastic=False)``) are supported; :meth:`full` raises a
    ``NotImplementedError`` that names laplace-torch's backends for it.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        stochastic: bool = False,
        num_samples: int = 1,
        options: ChunkOptions | None = None,
        **chunking: Any,
    ):
        # checked here, before any fit
        self._options = ChunkOptions.resolve(options, chunking, "ChunkedGGN")
        if not isinstance(stochastic, bool):
            raise TypeError(f"stochastic must be True or False, got {stochastic!r}.")
        if stochastic:
            Sampling(num_samples, name="num_samples")  # checked here, before any fit
        super().__init__(model, likelihood, last_layer, subnetwork_indices, dict_key_x,
                         dict_key_y, stochastic, num_samples)  # fmt: skip
        self.chunking = chunking

    def diag(
        self, x: Tensor | MutableMapping[str, Any] | tuple | list, y: Tensor, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Loss and GGN diagonal of one batch, laplace-torch's convention.

        Args:
            x: Inputs: a tensor ``[B, ...]`` (``model(x)``), a dict holding the batched
                input under ``dict_key_x`` (passed whole, ``model(x)``), or a tuple/list
                (``model(*x)``).
            y: Targets: ``[B, M]`` (or ``[B]`` for one output) for regression; class
                indices ``[B]`` or ``[B, 1]`` for logits ``[B, C]``, ``[B, ...]`` for
                logits ``[B, ..., C]`` for classification.
            **kwargs: laplace-torch's extra arguments (``N``), unused: sums are returned.

        Returns:
            ``(factor * loss, factor * diagonal)``, the diagonal flattened over the
            trainable parameters (of the last layer for last-layer Laplace).

        Raises:
            KeyError: For a dict without ``dict_key_x``.
            TypeError: For inputs or targets of an unsupported type.
            ValueError: For inputs and targets with different batch sizes.
        """
        model, inputs, y = self._prepare(x, y)
        result = evaluate(model, self.lossfunc, inputs, y, self._options, scale=1.0,
                          sampling=self._sampling())  # fmt: skip
        flat = torch.cat([value.flatten() for value in result.diagonal])
        if self.subnetwork_indices is not None:
            flat = flat[self.subnetwork_indices]
        return self.factor * result.loss, self.factor * flat

    def _sampling(self) -> Sampling | None:
        """A new call's Monte-Carlo sampling (``None``: exact)."""
        return Sampling(self.num_samples) if self.stochastic else None

    def _prepare(
        self, x: Tensor | MutableMapping[str, Any] | tuple | list, y: Tensor
    ) -> tuple[nn.Module, Any, Tensor]:
        """The model to differentiate, its inputs and the targets, as ggnchunk needs them.

        Args:
            x: The batch's inputs (see :meth:`diag`).
            y: Its targets.

        Returns:
            ``(model, inputs, targets)``.

        Raises:
            KeyError: For a dict without ``dict_key_x``.
            TypeError: For targets that are not a tensor.
            ValueError: For inputs and targets with different batch sizes, and for
                regression targets with more than one axis per sample (laplace-torch
                would count only their last axis as outputs).
        """
        if not isinstance(y, Tensor):
            raise TypeError(f"y must be a torch.Tensor of targets, got {type(y).__name__}.")
        if isinstance(x, Mapping):
            self._check_dict(x, y)
        if self.last_layer:
            with torch.no_grad():
                _, features = self.model.forward_with_features(x)
            model, inputs = self.model.last_layer, features.detach()
        elif isinstance(x, Mapping):
            model, inputs = mapping_call(self.model, x)  # model(x): the dict whole
        else:
            model, inputs = self.model, x
        if self.likelihood == "regression":
            if y.dim() > 2:
                raise ValueError(
                    f"regression targets of shape {tuple(y.shape)}: laplace-torch counts "
                    f"only the last axis as outputs ({y.shape[-1]} instead of "
                    f"{y[0].numel()} per sample), so its marginal likelihood and its glm "
                    "predictive would be wrong for this model. Flatten the output and the "
                    "targets: Laplace(nn.Sequential(model, nn.Flatten()), ...) with "
                    "targets y.flatten(1) (ggnchunk.laplace.output_variance gives "
                    "per-pixel variances in the image's shape)."
                )
            if y.dim() == 1:
                y = y.unsqueeze(1)  # one output per sample: [B] → [B, 1]
        elif y.dim() == 2 and y.shape[1] == 1:
            y = y.reshape(-1)  # laplace-torch's y.view(-1) for logits [B, C]
        elif y.dim() >= 2:
            model = _ClassesLast(model)  # logits [B, ..., C], indices [B, ...]
        return model, inputs, y

    def _check_dict(self, x: Mapping[str, Any], y: Tensor) -> None:
        """Check a dict batch against laplace-torch's ``dict_key_x`` convention.

        Args:
            x: The dict inputs.
            y: The targets.

        Raises:
            KeyError: If ``dict_key_x`` is not a key of ``x``.
            ValueError: If ``x[dict_key_x]`` is not a tensor with ``y``'s batch size.
        """
        if self.dict_key_x not in x:
            raise KeyError(
                f"dict inputs have no key dict_key_x={self.dict_key_x!r} (keys: "
                f"{sorted(map(str, x))}); pass the key of the batched input tensor, e.g. "
                "Laplace(..., dict_key_x='input_ids', dict_key_y='labels')."
            )
        value = x[self.dict_key_x]
        if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != len(y):
            shape = (
                tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            )
            raise ValueError(
                f"x[{self.dict_key_x!r}] must be a tensor with the batch on axis 0 "
                f"({len(y)} samples, as y), got {shape}; set dict_key_x to the key of "
                "the batched input tensor."
            )

    def kron(
        self, x: Tensor | MutableMapping[str, Any] | tuple | list, y: Tensor, N: int,
        **kwargs: Any,
    ) -> tuple[Tensor, Kron]:  # fmt: skip
        """Loss and Kronecker-factored GGN of one batch, laplace-torch's convention.

        The factors of ``BackPackGGN(stochastic=False)`` (BackPACK's KFLR, see
        :func:`ggnchunk.kron_ggn`): ``[G, A * M / N]`` per weight and ``[G]`` per bias,
        with ``M`` the batch size, in the order of the trainable parameters; the output
        factors ``G`` are summed over chunks of the loss Hessian's square-root columns
        within ``max_memory``.

        Args:
            x: Inputs, as in :meth:`diag`.
            y: Targets, as in :meth:`diag`.
            N: Number of samples of the whole dataset (the input factors are divided by
                it, as laplace-torch's backends do).
            **kwargs: laplace-torch's extra arguments, unused.

        Returns:
            ``(factor * loss, factor * Kron(...))``.

        Raises:
            ValueError: For a trainable parameter outside ``nn.Linear``/``nn.Conv``
                layers (named; freeze it or use ``hessian_structure="diag"``), and
                everything :meth:`diag` refuses.
        """
        model, inputs, y = self._prepare(x, y)
        result = evaluate(model, self.lossfunc, inputs, y, self._options, scale=1.0,
                          spec=KroneckerFactors, sampling=self._sampling())  # fmt: skip
        samples = result.report.batch_chunks[-1][1]  # the input factors are / samples
        by_name: dict[str, list[Tensor]] = {}
        for layer in result.factors.values():
            if layer.weight is not None:
                by_name[layer.weight] = [layer.output, layer.input * (samples / N)]
            if layer.bias is not None:
                by_name[layer.bias] = [layer.output.clone()]
        kron = Kron([by_name[name] for name in result.names])
        return self.factor * result.loss, self.factor * kron

    def full(self, x: Any, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Not available: ChunkedGGN computes the diagonal and Kronecker factors only.

        Raises:
            NotImplementedError: Always, saying which backend to use for ``"full"``.
        """
        raise NotImplementedError(
            'ChunkedGGN computes hessian_structure="diag" and "kron" only; '
            'hessian_structure="full" is not available. Use laplace-torch\'s BackPackGGN '
            'or CurvlinopsGGN backend for it (e.g. Laplace(..., hessian_structure="full", '
            "backend=CurvlinopsGGN))."
        )


def output_variance(la: Any, x: Tensor | Any, **chunking: Any) -> Tensor:
    r"""Per-output functional variance of a fitted diagonal Laplace, without Jacobians.

    The diagonal of laplace-torch's ``glm`` functional variance,
    ``la._glm_predictive_distribution(x, diagonal_output=True)[1]`` (``J diag(s) J^T``
    with ``s = la.posterior_variance``; for regression without the observation noise
    ``la.sigma_noise**2``, which laplace-torch's predictive adds), computed by
    :func:`ggnchunk.output_variance` in chunks of output coordinates: laplace-torch forms
    the Jacobians ``[N, M, P]`` and the covariance ``[N, M, M]``; this needs neither, and
    keeps image-shaped outputs image-shaped.

    Args:
        la: A fitted laplace-torch ``DiagLaplace`` (``subset_of_weights="all"``) or
            ``DiagLLLaplace`` (``"last_layer"``: the features are computed with
            ``la.model.forward_with_features`` and the last layer's variance is used).
        x: Inputs as :meth:`ChunkedGGN.diag` takes them (a tensor, a dict holding
            ``la.dict_key_x``, or a tuple/list).
        **chunking: Options of :func:`ggnchunk.output_variance` (``max_memory``,
            ``num_chunks``, ``chunk_size``, ``batch_chunk_size``, ``recover_oom``,
            ``return_report``).

    Returns:
        ``[N, *output_shape]``: the model output's shape (``[N, M]`` for laplace-torch's
        ``[N, M]`` outputs).

    Raises:
        TypeError: If ``la`` is not a diagonal Laplace approximation.
        ValueError: If it is not fitted, or for everything
            :func:`ggnchunk.output_variance` refuses.
    """
    from laplace import DiagLaplace, DiagLLLaplace
    from laplace.baselaplace import ParametricLaplace

    from ggnchunk._variance import output_variance as variance_of

    if not isinstance(la, DiagLaplace) or not isinstance(la, ParametricLaplace):
        raise TypeError(
            f"la must be a fitted laplace-torch DiagLaplace (hessian_structure='diag'), "
            f"got {type(la).__name__}; other posteriors are not diagonal."
        )
    if type(la) not in (DiagLaplace, DiagLLLaplace):
        raise TypeError(
            f"{type(la).__name__} is not supported; use subset_of_weights='all' "
            "(DiagLaplace) or 'last_layer' (DiagLLLaplace)."
        )
    if getattr(la, "H", None) is None and getattr(la, "mean", None) is None:
        raise ValueError("la is not fitted; call la.fit(train_loader) first.")
    variance = la.posterior_variance.detach()
    if isinstance(la, DiagLLLaplace):
        if la.model.last_layer is None:
            raise ValueError("la is not fitted; call la.fit(train_loader) first.")
        with torch.no_grad():
            _, features = la.model.forward_with_features(x)
        model, inputs = la.model.last_layer, features.detach()
    elif isinstance(x, Mapping):
        model, inputs = mapping_call(la.model, x)
    else:
        model, inputs = la.model, x
    return variance_of(model, inputs, variance, **chunking)


class _ClassesLast(nn.Module):
    """The model with its last axis (classes) moved to axis 1, as cross-entropy needs.

    laplace-torch reads logits ``[B, ..., C]`` as ``f.view(-1, C)`` with targets
    ``y.view(-1)``; with the classes on axis 1 (``[B, C, ...]``) and targets ``[B, ...]``,
    the summed cross-entropy and its GGN are the same, and the batch stays on axis 0.

    Args:
        model: The model (or last layer).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        """Run the model; return its output with the last axis moved to axis 1.

        Args:
            *args: The model's positional arguments.
            **kwargs: The model's keyword arguments.

        Returns:
            The logits ``[B, C, ...]``.
        """
        return self.model(*args, **kwargs).movedim(-1, 1)
