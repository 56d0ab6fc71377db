"""Checks of a recorded forward pass: Kronecker factors exist, samples stay independent."""

from __future__ import annotations

import torch
from torch import Tensor

from ggnchunk._autograd import edge_numel
from ggnchunk._graph.parts import SampleCouplingError, _display, _Source
from ggnchunk._graph.readers import (
    Reader,
    reader_groups,
    reader_room,
    sample_strides,
    shared_edges,
)
from ggnchunk._graph.traverse import Traversal
from ggnchunk._quantities import Quantity

# the internal switches (benchmarks, tests): False takes one pass per sample for every
# glue parameter, as before the readers were read per sample; ALWAYS reads per sample
# also where one pass per sample costs fewer passes through the region (small batches)
READ_PER_SAMPLE = True
READ_PER_SAMPLE_ALWAYS = False


class Checks(Traversal):
    """Refusals read off the recorded graph (mixed into the recording)."""

    def check_kron(self, names: list[str]) -> None:
        """Refuse what has no Kronecker factors: parameters outside ruled layers, shared.

        Args:
            names: The parameters' qualified names, for the message.

        Raises:
            ValueError: Naming the parameter or layer.
        """
        for source in self._sources.values():
            if source.params:
                name = names[source.params[0]]
                raise ValueError(
                    f"parameter {name!r} is used outside a per-sample call of an "
                    "nn.Linear or nn.Conv layer (by F.linear, a custom layer or a tied "
                    "weight, or by a layer whose input does not have the batch on axis "
                    "0, e.g. after samples were reshaped into the batch axis), so it "
                    "has no Kronecker factors. Freeze it (requires_grad_(False)) or use "
                    "ggnchunk.diag_ggn."
                )
        for call in self.calls:
            if any(i in self.shared for i, _ in call.params):
                raise ValueError(
                    f"{_display(call.name)} ({type(call.ctx.module).__name__}) is called "
                    "more than once or shares its parameters, so its GGN block has no "
                    "single Kronecker factorization. Freeze it (requires_grad_(False)) "
                    "or use ggnchunk.diag_ggn."
                )
            reason = call.rule.kron_check(call.ctx.module) if call.params else None
            if reason is not None:
                raise ValueError(
                    f"{_display(call.name)} ({type(call.ctx.module).__name__}): {reason}. "
                    "Freeze its parameters (requires_grad_(False)) or use "
                    "ggnchunk.diag_ggn."
                )

    def check_independent(self, output: Tensor) -> None:
        """Refuse models whose samples influence each other (before any real pass).

        Backpropagates one random vector from the first and one from the last sample's
        output and checks that they stay on their sample at every layer's output and
        input: an exact test of the recorded graph, for couplings in layers and glue.

        Args:
            output: The model output, ``[N, ...]``.

        Raises:
            SampleCouplingError: Naming the first place where samples mix.
        """
        n = output.shape[0]
        if n < 2:
            return
        seed = torch.zeros(2, *output.shape, dtype=output.dtype, device=output.device)
        generator = torch.Generator(device=output.device).manual_seed(0)
        for column, sample in enumerate((0, n - 1)):
            seed[column, sample] = torch.rand(
                output.shape[1:], generator=generator, dtype=output.dtype,
                device=output.device,
            ) + 0.5  # fmt: skip

        def visit(where: str, vectors: Tensor) -> None:
            others = torch.ones(2, n, dtype=torch.bool, device=vectors.device)
            others[0, 0] = others[1, n - 1] = False
            flat = vectors.reshape(2, n, -1)
            if not bool(torch.isfinite(flat).all()):
                raise ValueError(
                    f"backpropagating from the model output gives NaN or Inf values at "
                    f"{where} (as loss.backward() would there): the forward pass "
                    "computed non-finite intermediate values (a log or square root of a "
                    "negative number, a division by zero, an overflow), maybe in a "
                    "branch that torch.where masks (whose gradient is then 0 x NaN), "
                    "although the output is finite. Fix the forward pass (e.g. clamp "
                    "before a log, or mask the operation's input instead of its output)."
                )
            if bool((flat[others] != 0).any()):
                raise SampleCouplingError(
                    f"samples of the batch influence each other: backpropagating from one "
                    f"sample's output reaches other samples at {where}. An operation in "
                    "the model mixes samples (batch statistics such as BatchNorm in "
                    "training mode or x - x.mean(0), or attention across the batch axis), "
                    "so the GGN is not a sum over samples. Call model.eval(), or remove "
                    "the operation that mixes samples. If no operation mixes them, a layer "
                    "there may get its samples on another axis than 0 while axis 0 has "
                    "the batch size by coincidence (a sequence-first [T, N, D] tensor "
                    "with T == N): move the batch axis first (batch_first=True), or use "
                    "another batch size."
                )

        visit("the model output", seed)
        self.sweep(seed, Quantity(), visit)

    def per_sample_readers(
        self, source: _Source, grads: Tensor
    ) -> dict[int, list[tuple[Reader, int]]]:
        """The glue's parameters whose products are read per sample off one pass.

        A parameter whose every reader (:mod:`.readers`) has its samples' stride proven
        on the recorded graph (once per region, :func:`~.readers.sample_strides`).

        Args:
            source: The glue region.
            grads: ``[V, N, ...]`` vectors at its start (their shape, dtype, device).

        Returns:
            The parameters with their readers and strides; empty where none qualifies.
        """
        if not READ_PER_SAMPLE or not source.readers:
            return {}
        found = [reader for readers in source.readers.values() for reader in readers]
        if source.strides is None:
            room = reader_room(source, grads)
            if READ_PER_SAMPLE_ALWAYS or _worth_it(found, grads, room, self.passes_ahead):
                # half the products' room: the probes' sightings take 6 bytes a position
                source.strides = sample_strides(
                    source.target, source.frontier, found, grads, max(1, room // 2)
                )
            else:
                source.strides = [None] * len(found)
        strides = iter(source.strides)
        result = {}
        for i, readers in source.readers.items():
            pairs = [(reader, next(strides)) for reader in readers]
            if all(stride is not None for _, stride in pairs):
                result[i] = pairs
        return result


def _worth_it(readers: list[Reader], grads: Tensor, room: int, passes: int) -> bool:
    """Whether the readers cross the region fewer times than one pass per sample.

    The proof's probes (``2⌈log₂ N⌉`` vectors, as many per pass as the sweep's columns,
    per group of readers) once, and a pass per group for the products in each of the
    ``passes``, against ``N`` passes in each; with one more pass's worth of margin for
    the proof's own work (measured: timm's ConvNeXt-atto with 5 images in one pass took
    0.20 s read per sample, 0.15 s one sample at a time).
    """
    v, n = grads.shape[:2]
    sizes = [edge_numel(edge) // n for edge, _ in shared_edges(readers)]
    probes = 2 * (n - 1).bit_length()
    proof = len(reader_groups(sizes, max(1, room // 2))) * -(-probes // v)
    return proof + len(reader_groups(sizes, room)) * passes + 1 < n * passes
