"""The pieces of a recorded forward pass: layer calls, glue sources, waiting vectors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ggnchunk._autograd import (
    EdgeKey,
    Gather,
    GradientEdge,
    sole_storage_owner,
)
from ggnchunk._graph.readers import Reader
from ggnchunk._rules import LayerRule, RuleContext
from ggnchunk._windows import FieldCache
from ggnchunk._windows import add as add_vectors


class SampleCouplingError(ValueError):
    """The model mixes the samples of a batch: its GGN is not a sum over samples."""


def _display(name: str) -> str:
    return f"model.{name}" if name else "model"


@dataclass
class Call:
    """One call of a layer with a rule during the recorded forward pass."""

    index: int
    name: str
    rule: LayerRule
    ctx: RuleContext
    params: list[tuple[int, str]]  # (index in the parameter list, name in the layer)
    leaf: Tensor | None  # the detached input that requires grad (None: input needs none)
    source: GradientEdge | None  # where the glue before the layer ends
    out_edge: GradientEdge
    out_numel: int  # per sample


@dataclass
class _Source:
    """Where glue begins: the model output, or the original tensor behind a cut."""

    key: EdgeKey
    target: Any  # tensor or gradient edge, for autograd
    numel: int  # per sample
    last_consumer: int  # the glue is pushed after this call index is done
    direct: bool = False  # the source is a layer output itself (no glue in between)
    frontier: list[GradientEdge] = field(default_factory=list)
    # the frontier's other regions' sources (not layer outputs): the region's vectors
    # wait there, and the sweep blocks them while crossing (:mod:`.traverse`)
    cuts: list[EdgeKey] = field(default_factory=list)
    # the walk's steps ``(parent's id, node)``, while the plan looks for overlaps
    steps: list[Any] = field(default_factory=list)
    params: list[int] = field(default_factory=list)  # parameter indices used in the glue
    workspace: int = 0  # elements per column its nodes allocate (folded attention)
    # elements per column and sample of the largest node's gradients in and out (an
    # eager attention's [L, S] scores inside the glue, far above its ends' vectors)
    inner: int = 0
    # parameters read in the glue only by embedding lookups: their products are the
    # gradients at the lookups' outputs added into rows (batched over columns)
    gathers: dict[int, list[Gather]] = field(default_factory=dict)
    # parameters whose every reader in the glue is a broadcast, a matrix product or a
    # lookup (:mod:`.readers`): their products off one pass to the readers' outputs
    readers: dict[int, list[Reader]] = field(default_factory=dict)
    # the samples' stride at each reader's output (in ``readers``' order, flattened),
    # proven once per recording (None: not yet; a None entry: not proven)
    strides: list[int | None] | None = None
    # elements per column and sample of the largest reader's output: the gradients
    # taken there, in groups of at most the region's size
    reader_numel: int = 0


class _Waiting:
    """The vectors a traversal holds between steps: at layer outputs and glue sources.

    Vectors (or sizes) meeting at one place are added; sizes of one place are equal, so
    their "sum" is one of them. Blocks' joined fields are kept in ``images``.
    """

    def __init__(self, images: FieldCache | None = None) -> None:
        self.outs: dict[EdgeKey, Any] = {}
        self.srcs: dict[EdgeKey, Any] = {}
        self.images = images
        self._fresh: set[int] = set()  # ids of stored objects nothing else holds

    def add(
        self, store: dict[EdgeKey, Any], key: EdgeKey, value: Any, fresh: bool = False
    ) -> None:
        """Store ``value`` at ``key``, added to what waits there.

        Args:
            store: :attr:`outs` or :attr:`srcs`.
            key: The place.
            value: Vectors (or a size).
            fresh: Nothing but the caller holds the ``value`` object (a rule's or a
                glue region's result, vectors taken from a place): it may then be
                written into, where no other tensor shares its memory either.
        """
        old = store.get(key)
        if old is None:
            store[key] = value
            self._note(value, fresh)
        elif not isinstance(value, int):

            def owned(tensor: Tensor) -> bool:
                # a dense side added into in place, not copied first (a full map per
                # column: 0.5 s of the U-Net 32² at 300 MiB): only where no other
                # tensor shares its memory and no other place holds it
                if not (fresh if tensor is value else id(tensor) in self._fresh):
                    return False
                if not isinstance(tensor, Tensor) or not sole_storage_owner(tensor):
                    return False
                root = tensor._base
                held = [
                    v for d in (self.outs, self.srcs) for v in d.values()
                    if v is tensor or (root is not None and v is root)
                ]  # fmt: skip
                return len(held) == (1 if tensor is old else 0)

            store[key] = add_vectors(old, value, self.images, owned)
            self._note(store[key], True)  # a new tensor, or one of the two owned

    def replace(self, values: list[Any]) -> None:
        """Put new vectors in place of every stored ones (in :meth:`places` order).

        Args:
            values: New tensors nothing else holds, one per place.
        """
        keys = [(store, key) for store in (self.outs, self.srcs) for key in store]
        for (store, key), value in zip(keys, values, strict=True):
            self._note(store[key], False)
            store[key] = value
            self._note(value, True)

    def places(self) -> list[Any]:
        """The vectors stored at every place: layer outputs, then glue sources."""
        return [*self.outs.values(), *self.srcs.values()]

    def is_fresh(self, value: Any) -> bool:
        """Whether ``value``, stored here until now, was handed over fresh.

        Args:
            value: Vectors just taken from a place (a registered rule's result is not).

        Returns:
            Whether nothing but the sweep holds the object.
        """
        return isinstance(value, Tensor) and id(value) in self._fresh

    def _note(self, value: Any, fresh: bool) -> None:
        """Remember whether the stored ``value`` object is held by nothing else."""
        if fresh and isinstance(value, Tensor):
            self._fresh.add(id(value))
        else:
            self._fresh.discard(id(value))

    def total(self) -> int:
        """Elements waiting (size traversals)."""
        return sum(self.outs.values()) + sum(self.srcs.values())
