"""Windowed blocks through glue: the glue's own nodes, mapped box by box.

A glue region between layers (an activation called as a function, a time embedding
added to every position, a residual sum, ``torch.cat``, a resize) would otherwise be
crossed by autograd on the block made dense (a full map per column) and the results
windowed again from their values, whose boxes the memory bound cannot know in advance.
Here the region's nodes are read once (:func:`plan`) and the block crosses the ones of
known geometry on its boxes (:func:`cross`):

- pointwise maps (``F.silu``, ``torch.sigmoid``, ``x * 2``, ...): the block times the
  node's derivative map (the node applied to ones, once per sweep), gathered on the
  boxes;
- additions and subtractions: the block to each side; a side broadcast over the
  positions (``h + emb[:, :, None, None]``) gets the block summed over its box, a
  vector without spatial axes;
- products with a recorded tensor (a map, or a per-channel or per-sample factor): the
  block times the factor on its boxes (summed where the side is broadcast); quotients
  alike (``(x + h) / scale``: the block over the divisor; a recorded divisor that
  needs grad gets the block times ``-x / scale**2``);
- ``torch.cat`` along channels: channel slices, same boxes;
- ``F.pad`` with zeros and slices of positions (``h[..., :H, :W]``, a classic U-Net's
  crops): the boxes shifted to the input's positions; slices, ``chunk`` and ``split``
  of channels: zeros for the channels a part left out (the parts' blocks summed);
- reflection and replication padding (CycleGAN's generators): each box folded onto the
  input positions its entries read;
- ``F.max_pool2d`` and ``F.avg_pool2d`` (tiling windows): the pooling layers' own
  windowed maps (:mod:`ggnchunk._rules.folded`);
- ``pixel_shuffle`` / ``pixel_unshuffle`` (super-resolution heads): boxes widened to
  whole cells and moved to the other grid;
- views and ``expand`` to the same shape: the block as it is;
- resizes folded by :mod:`ggnchunk._resample`: each spatial axis's matrix restricted to
  the box's rows and the input rows they reach (one box size for all columns).

Every other node (attention, reshapes that flatten positions, ...) and every vector
without spatial axes is handed to autograd at that node, batched over the columns, on
dense vectors; its results at the frontier stay dense (where the region's first node is
such a node, the whole region is). So every box size comes from the region's structure
alone, never from values, and the memory bound can count them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ggnchunk._autograd import (
    EdgeKey,
    GradientEdge,
    Node,
    apply_node,
    batched_grad,
    edge_key,
    grad_shape,
    node_name,
    output_count,
    saved_value,
)
from ggnchunk._rules.folded import WINDOWED, pool_tiles
from ggnchunk._windows import (
    MAX_FILL,
    Windowed,
    end_of,
    gather,
    resampled,
    valid,
    whole_cells,
)
from ggnchunk._windows import add as add_vectors

__all__ = ["GluePlan", "cross", "plan"]

POINTWISE = frozenset({
    "SiluBackward0", "SigmoidBackward0", "TanhBackward0", "ReluBackward0",
    "GeluBackward0", "EluBackward0", "LeakyReluBackward0", "HardswishBackward0",
    "HardsigmoidBackward0", "SoftplusBackward0", "MishBackward0", "ExpBackward0",
    "NegBackward0", "MulBackward1", "DivBackward1", "HardtanhBackward0",
    "ThresholdBackward0", "CloneBackward0", "AliasBackward0", "AbsBackward0",
    "SinBackward0", "CosBackward0", "LogBackward0", "SqrtBackward0", "PowBackward0",
    "RsqrtBackward0", "ReciprocalBackward0", "ClampBackward1", "ClampMinBackward0",
    "ClampMaxBackward0", "AddBackward1", "SubBackward1", "RsubBackward1",
    "LogSigmoidBackward0", "Relu6Backward0", "SeluBackward0", "CeluBackward0",
    "SoftshrinkBackward0", "HardshrinkBackward0", "ErfBackward0", "LogitBackward0",
    "SgnBackward0", "SignBackward0", "RoundBackward0", "FloorBackward0", "CeilBackward0",
})  # fmt: skip
"""Nodes whose backward multiplies by a map of the same shape (a diagonal Jacobian)."""

RESAMPLE = "_FoldedResampleBackward"
_VIEWS = frozenset({"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0",
                    "ExpandBackward0"})  # fmt: skip
_FOLDING_PADS = frozenset(
    f"{kind}Pad{d}DBackward0" for kind in ("Reflection", "Replication") for d in (1, 2, 3)
)
"""Reflection and replication padding (``nn.ReflectionPad2d``, ``F.pad(mode=...)``)."""


@dataclass
class GluePlan:
    """A glue region's nodes in the order the block crosses them.

    Attributes:
        start: The region's first node and output number.
        order: The nodes (by id) in a reverse topological order.
        nodes: ``id -> node``.
        action: ``id -> "pointwise" | "same" | "add" | "sub" | "mul" | "div" | "cat" |
            "pad" | "slice" | "split" | "fold-pad" | "pool" | "shuffle" | "flip" |
            "resample" | "hand"`` (``"hand"``: handed to autograd, dense; ``"same"``: a
            view to the same shape).
        frontier: The region's frontier edge keys, in the source's order.
        handoffs: Whether a spatial block is handed to autograd somewhere (dense
            results, counted as full maps).
        handed: The names of the nodes a spatial block is handed to autograd at.
        windowed_ends: The frontier edges a windowed block can reach (the others get
            dense vectors, or vectors without spatial axes, whatever the values).
        index_bytes: Bytes per column and sample of the index maps the region's max
            poolings make (two int64 maps of the pooled map's size, at most).
    """

    start: tuple[Node, int]
    order: list[int]
    nodes: dict[int, Node]
    action: dict[int, str]
    frontier: list[EdgeKey]
    handoffs: bool = False
    handed: list[str] = field(default_factory=list)
    index_bytes: int = 0
    windowed_ends: set[EdgeKey] = field(default_factory=set)


def plan(target: Any, frontier: list[GradientEdge]) -> GluePlan | None:
    """Read a region's nodes and what each does with a spatial block.

    Args:
        target: The region's start (a tensor or a gradient edge).
        frontier: The layer outputs it reaches.

    Returns:
        The plan, or ``None`` where the region cannot be ordered from its start (it
        is crossed on dense vectors, windowed again from their values).
    """
    if isinstance(target, Tensor):
        node, number = target.grad_fn, target.output_nr
    else:
        node, number = target.node, target.output_nr
    if node is None:
        return None
    ends = [edge_key(e) for e in frontier]
    end_set = set(ends)
    end_nodes = {k[0] for k in ends}
    if (id(node), number) in end_set:
        return None  # direct: nothing to cross
    reach: dict[int, bool] = {}
    nodes: dict[int, Node] = {}

    def reaches(n: Node) -> bool:  # iterative: regions can be long chains
        stack = [(n, False)]
        while stack:
            cur, expanded = stack.pop()
            key = id(cur)
            if key in reach and not expanded:
                continue
            if id(cur) in end_nodes:
                reach[key] = False  # a layer output: only its edges count
                continue
            nexts = [(m, k) for m, k in cur.next_functions if m is not None]
            if not expanded:
                stack.append((cur, True))
                stack.extend((m, False) for m, _ in nexts if id(m) not in reach)
                continue
            nodes[key] = cur
            reach[key] = any(
                (id(m), int(k)) in end_set or reach.get(id(m), False) for m, k in nexts
            )
        return reach.get(id(n), False)

    if not reaches(node):
        return None
    region = {k for k, r in reach.items() if r}
    consumers = dict.fromkeys(region, 0)
    for k in region:
        for m, _ in nodes[k].next_functions:
            if m is not None and id(m) in region:
                consumers[id(m)] += 1
    for k in region:  # a node that is also a frontier node's other output: no plan
        if k in end_nodes:
            return None
    # the order: Kahn's, from the start
    order, ready, left = [], [id(node)], dict(consumers)
    if left[id(node)] != 0:
        return None  # the start is reached again inside its own region
    while ready:
        k = ready.pop()
        order.append(k)
        for m, _ in nodes[k].next_functions:
            if m is not None and id(m) in region:
                left[id(m)] -= 1
                if left[id(m)] == 0:
                    ready.append(id(m))
    if len(order) != len(region):
        return None
    out = GluePlan((node, number), order, nodes, {}, ends)
    # what each node does with a spatial block (from shapes only); a region whose
    # first node has no windowed form is handed to autograd whole, at that node
    spatial: dict[int, bool] = {id(node): True}
    for k in order:
        n = nodes[k]
        act = _action(n) if spatial.get(k, False) else "hand"
        if act is None:
            act = "hand"
        out.action[k] = act
        if act == "hand":
            if spatial.get(k, False):
                out.handoffs = True
                out.handed.append(node_name(n))
            continue
        shape = grad_shape(n, 0)
        if act == "pool" and node_name(n).startswith("MaxPool"):
            out.index_bytes += 2 * 8 * math.prod(shape[1:])
        for m, nr in n.next_functions:
            if m is None or (id(m) not in region and (id(m), int(nr)) not in end_set):
                continue
            there = grad_shape(m, nr)
            keeps = (
                there is not None and shape is not None and len(there) == len(shape)
                and math.prod(there[2:]) > 1
            )  # fmt: skip
            if (id(m), int(nr)) in end_set:
                if keeps:
                    out.windowed_ends.add((id(m), int(nr)))
                continue
            spatial[id(m)] = spatial.get(id(m), False) or keeps
    return out


def _action(n: Node) -> str | None:
    """What a node does with a spatial block, or ``None`` (handed to autograd)."""
    name = node_name(n)
    shape = grad_shape(n, 0)
    nexts = n.next_functions
    if name in ("SplitBackward0", "SplitWithSizesBackward0"):  # torch.chunk, split
        sizes = saved_value(n, "self_sym_sizes")
        ok = (
            shape is not None and len(shape) >= 3 and sizes is not None
            and saved_value(n, "dim") % len(sizes) == 1
            and len(nexts) == 1 and nexts[0][0] is not None
        )  # fmt: skip
        return "split" if ok else None
    if shape is None or len(shape) < 3 or output_count(n) != 1:
        return None
    if name in POINTWISE:
        if len(nexts) != 1 or nexts[0][0] is None:
            return None
        there = grad_shape(*nexts[0])
        return "pointwise" if there == shape else None
    if name in _VIEWS:  # a view or expand to the same shape: the block as it is
        same = (
            len(nexts) == 1 and nexts[0][0] is not None and grad_shape(*nexts[0]) == shape
        )
        return "same" if same else None
    if name in ("AddBackward0", "SubBackward0"):
        return "add" if name == "AddBackward0" else "sub"
    if name == "MulBackward0":
        return "mul"
    if name == "DivBackward0":
        return "div"
    if name == "CatBackward0":
        dim = saved_value(n, "dim")
        if dim is None or dim % len(shape) != 1:
            return None
        # a part that needs no grad has no node to say its width: one such part's is
        # what the others leave
        return "cat" if sum(m is None for m, _ in nexts) <= 1 else None
    if name == "ConstantPadNdBackward0":
        pads = saved_value(n, "pad")
        if pads is None or len(pads) % 2 or len(pads) // 2 > len(shape) - 2:
            return None  # a padded channel or batch axis
        return "pad"
    if name == "SliceBackward0":
        dim, step = saved_value(n, "dim"), saved_value(n, "step")
        if dim is None or step != 1 or len(nexts) != 1 or nexts[0][0] is None:
            return None
        return "slice" if dim % len(shape) >= 1 else None
    if name in _FOLDING_PADS:
        pads = saved_value(n, "padding")
        ok = pads is not None and len(pads) == 2 * (len(shape) - 2) and len(nexts) == 1
        return "fold-pad" if ok else None
    if name in ("MaxPool2DWithIndicesBackward0", "AvgPool2DBackward0"):
        # functional pooling: the pooling layers' windowed maps (2d; average pooling
        # whose windows tile the input)
        if len(shape) != 4 or len(nexts) != 1:
            return None
        if name == "AvgPool2DBackward0" and pool_tiles(n) is None:
            return None
        return "pool"
    if name in ("PixelShuffleBackward0", "PixelUnshuffleBackward0"):
        return "shuffle" if len(shape) == 4 and len(nexts) == 1 else None
    if name == "FlipBackward0":  # a flip of positions (test-time flips, mirrored maps)
        dims = saved_value(n, "dims")
        ok = (
            dims is not None and len(nexts) == 1 and nexts[0][0] is not None
            and all(_signed(int(d)) % len(shape) >= 2 for d in dims)
        )  # fmt: skip
        return "flip" if ok else None
    if name == RESAMPLE:
        matrices = getattr(n, "matrices", None)  # the folded resize's own attribute
        if matrices is None or len(matrices) != len(shape) - 2:
            return None
        return "resample"
    return None


def cross(
    glue_plan: GluePlan, block: Windowed, frontier: list[GradientEdge], note: Any = None
) -> tuple[list[Any], bool]:
    """A block's windowed part across a region, to its frontier.

    Args:
        glue_plan: The region's :func:`plan`.
        block: The windowed vectors at the region's start (no fields).
        frontier: The region's frontier edges (the plan's, in its order).
        note: Passed to :func:`~ggnchunk._autograd.batched_grad` for handed-off nodes.

    Returns:
        ``(results, handed)``: one value per frontier edge (a block, dense vectors or
        ``None``), and whether a spatial block was handed to autograd (dense results).
    """
    p = glue_plan
    node, number = p.start
    values: dict[EdgeKey, Any] = {(id(node), number): block}
    ends = set(p.frontier)
    results: dict[EdgeKey, Any] = {}
    hand_edges: list[GradientEdge] = []
    hand_values: list[Tensor] = []
    handed = False
    derivative: dict[int, Tensor] = {}

    def send(m: Node, nr: int, value: Any) -> None:
        key = (id(m), int(nr))
        store = results if key in ends else values
        if key not in ends and id(m) not in p.action:
            return  # reaches no frontier edge
        old = store.get(key)
        store[key] = value if old is None else add_vectors(old, value)

    for k in p.order:
        n = p.nodes[k]
        mine = [(nr, values.pop((k, nr))) for nr in range(output_count(n))
                if (k, nr) in values]  # fmt: skip
        if not mine:
            continue
        act = p.action[k]
        value = mine[0][1]
        if act == "split":  # every output's block, each on its channels
            if all(isinstance(v, Windowed) for _, v in mine):
                m, nr = n.next_functions[0]
                send(m, nr, _split(n, mine))
                continue
            act = "hand"
        if act != "hand" and (len(mine) != 1 or mine[0][0] != 0 or
                              not isinstance(value, Windowed)):  # fmt: skip
            act = "hand"
        if act == "hand":
            for nr, v in mine:
                if isinstance(v, Windowed):
                    handed, v = True, v.dense()
                elif v.dim() > 3 and math.prod(v.shape[3:]) > 1:
                    handed = True
                hand_edges.append(GradientEdge(n, nr))
                hand_values.append(v)
            continue
        for m, nr, v in _step(n, act, value, derivative):
            send(m, nr, v)
    if hand_edges:
        dense = batched_grad(hand_edges, frontier, hand_values, note)
        for key, v in zip(p.frontier, dense, strict=True):
            if v is not None:
                old = results.get(key)
                results[key] = v if old is None else add_vectors(old, v)
    return [results.get(key) for key in p.frontier], handed


def _step(
    n: Node, act: str, block: Windowed, derivative: dict[int, Tensor]
) -> list[tuple[Node, int, Any]]:
    """One node on a block: ``(next node, output number, vectors)`` per next edge."""
    nexts = [(m, nr) for m, nr in n.next_functions]
    out: list[tuple[Node, int, Any]] = []
    if act == "pointwise":
        d = derivative.get(id(n))
        if d is None:
            d = getattr(n, "slope", None)  # a folded activation's (made once, forward)
        if d is None:
            shape = grad_shape(n, 0)
            ones = torch.ones(shape, dtype=block.data.dtype, device=block.data.device)
            d = derivative[id(n)] = apply_node(n, ones)[0]
        m, nr = nexts[0]
        out.append((m, nr, _times(block, d)))
    elif act in ("add", "sub"):
        alpha = saved_value(n, "alpha")
        alpha = 1 if alpha is None else alpha
        for i, (m, nr) in enumerate(nexts):
            if m is None:
                continue
            v = block
            if i == 1:
                scale = -alpha if act == "sub" else alpha
                if scale != 1:
                    v = block.with_data(block.data * scale)
            out.append((m, nr, _reduced(v, grad_shape(m, nr))))
    elif act == "mul":
        factors = (saved_value(n, "other"), saved_value(n, "self"))
        for i, (m, nr) in enumerate(nexts):
            if m is None:
                continue
            out.append((m, nr, _reduced(_times(block, factors[i]), grad_shape(m, nr))))
    elif act == "same":
        m, nr = nexts[0]
        out.append((m, nr, block))
    elif act == "div":
        other = saved_value(n, "other")  # a tensor (a number is a 0-d tensor)
        for i, (m, nr) in enumerate(nexts):
            if m is None:
                continue
            if i == 0:
                v = _times(block, other, divide=True)
            else:  # d(x / y)/dy = -(x / y) / y, as autograd forms it
                v = _times(block, -(saved_value(n, "self") / other) / other)
            out.append((m, nr, _reduced(v, grad_shape(m, nr))))
    elif act == "cat":
        known = [None if m is None else grad_shape(m, nr)[1] for m, nr in nexts]
        rest = block.data.shape[2] - sum(w for w in known if w is not None)
        offset = 0
        for (m, nr), width in zip(nexts, known, strict=True):
            width = rest if width is None else width
            if m is not None:
                data = block.data[:, :, offset : offset + width]
                out.append((m, nr, block.with_data(data)))
            offset += width
        if offset != block.data.shape[2] or rest < 0:
            raise RuntimeError("ggnchunk: a cat's sizes do not add up (internal error)")
    elif act == "pad":
        m, nr = nexts[0]
        pads = [_signed(p) for p in saved_value(n, "pad")]
        dims = len(block.size)
        lows = [pads[2 * (dims - 1 - i)] if 2 * (dims - 1 - i) < len(pads) else 0
                for i in range(dims)]  # fmt: skip
        start = block.start - torch.tensor(lows, device=block.start.device)
        out.append((m, nr, _moved(block, start, tuple(grad_shape(m, nr)[2:]))))
    elif act == "slice":
        m, nr = nexts[0]
        sizes = tuple(saved_value(n, "self_sym_sizes"))
        dim = saved_value(n, "dim") % len(sizes)
        first = _signed(saved_value(n, "start"))
        first = min(max(first + sizes[dim] if first < 0 else first, 0), sizes[dim])
        if dim == 1:  # channels: zeros for those the slice left out
            out.append((m, nr, block.with_data(_channels_at(block.data, first, sizes[1]))))
        else:
            start = block.start.clone()
            start[:, dim - 2] += first
            out.append((m, nr, _moved(block, start, sizes[2:])))
    elif act == "fold-pad":
        m, nr = nexts[0]
        out.append((m, nr, _folded_pad(n, block, tuple(grad_shape(m, nr)[2:]))))
    elif act == "pool":
        m, nr = nexts[0]
        out.append((m, nr, WINDOWED[node_name(n)](n, block, tuple(grad_shape(m, nr)[2:]))))
    elif act == "shuffle":
        m, nr = nexts[0]
        out.append((m, nr, _shuffled(n, block, tuple(grad_shape(m, nr)[2:]))))
    elif act == "flip":  # position p of an axis comes from size - 1 - p
        m, nr = nexts[0]
        rank = len(block.size) + 2
        axes = sorted({_signed(int(d)) % rank for d in saved_value(n, "dims")})
        start = block.start.clone()
        for axis in axes:
            k = axis - 2
            start[:, k] = block.size[k] - block.start[:, k] - block.box[k]
        data = block.data.flip([axis + 1 for axis in axes])  # the columns lead
        out.append((m, nr, end_of(Windowed(data, start, block.size), MAX_FILL)))
    elif act == "resample":
        m, nr = nexts[0]
        out.append((m, nr, resampled(block, n.matrices, grad_shape(m, nr))))
    return out


def _split(n: Node, blocks: list[tuple[int, Windowed]]) -> Any:
    """Blocks at a channel split's outputs as one block of its input (channels placed)."""
    channels = saved_value(n, "self_sym_sizes")[1]
    sizes = saved_value(n, "split_sizes")
    if sizes is None:  # torch.chunk: equal parts, the last one shorter
        each = saved_value(n, "split_size")
        sizes = [min(each, channels - i) for i in range(0, channels, each)]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    total = None
    for nr, block in blocks:
        placed = block.with_data(_channels_at(block.data, offsets[nr], channels))
        total = placed if total is None else add_vectors(total, placed)
    return total


def _channels_at(data: Tensor, first: int, channels: int) -> Tensor:
    """``[V, N, c, *box]`` placed at channels ``first : first + c`` of ``channels``."""
    after = channels - first - data.shape[2]
    if first == 0 and after == 0:
        return data
    shape = data.shape
    return torch.cat([data.new_zeros(*shape[:2], first, *shape[3:]), data,
                      data.new_zeros(*shape[:2], after, *shape[3:])], 2)  # fmt: skip


def _folded_pad(n: Node, block: Windowed, size: tuple[int, ...]) -> Any:
    """A block through reflection or replication padding's backward.

    Per axis, padded position ``q`` reads input position ``f(q)`` (reflected, or clamped
    into the map): a box of ``b`` positions reads an interval of at most ``b`` input
    positions, starting at the smallest ``f(q)``. The block is summed onto it along the
    axis (positions reflected onto one another add up).
    """
    reflect = node_name(n).startswith("Reflection")
    pads = saved_value(n, "padding")  # last axis first, (left, right) per axis
    dims = len(size)
    data, starts = block.data, []
    for axis in range(dims):
        left, length, b = pads[2 * (dims - 1 - axis)], size[axis], block.box[axis]
        right = pads[2 * (dims - 1 - axis) + 1]
        s = block.start[:, axis]
        q = s[:, None] + torch.arange(b, device=s.device) - left  # [V, b], input coords
        # a box's entries outside the padded map are zero: read as its edge's
        q = q.clamp(-left, length - 1 + right)
        if reflect:
            period = max(2 * (length - 1), 1)
            q = torch.remainder(q, period)
            source = torch.where(q >= length, period - q, q)
        else:
            source = q.clamp(0, length - 1)
        first = source.min(1).values  # [V]
        index = source - first[:, None]  # [V, b], in [0, b)
        moved = data.movedim(3 + axis, -1)  # [V, N, C, ..., b]
        shape = [moved.shape[0]] + [1] * (moved.dim() - 2) + [b]
        folded = torch.zeros_like(moved).scatter_add_(
            -1, index.view(shape).expand(moved.shape).contiguous(), moved.contiguous()
        )
        data = folded.movedim(-1, 3 + axis)
        starts.append(first)
    return end_of(Windowed(data, torch.stack(starts, 1), size), MAX_FILL)


def _shuffled(n: Node, block: Windowed, size: tuple[int, ...]) -> Any:
    """A block through ``F.pixel_shuffle``'s backward (or ``pixel_unshuffle``'s).

    ``pixel_shuffle`` by ``r``: each box is widened to whole ``r × r`` cells (the widest
    any alignment needs, ``(b + r - 2) // r + 1`` cells for ``b`` positions), then
    unshuffled onto the input's grid. ``pixel_unshuffle``: the box's cells shuffled back.
    """
    if node_name(n) == "PixelUnshuffleBackward0":
        r = saved_value(n, "downscale_factor")
        data = F.pixel_shuffle(block.data, r)
        return end_of(Windowed(data, block.start * r, size), MAX_FILL)
    r = saved_value(n, "upscale_factor")
    wide, cells = whole_cells(block, (r,) * len(block.box))
    data = F.pixel_unshuffle(wide.data, r)
    return end_of(Windowed(data, cells, size), MAX_FILL)


def _signed(value: int) -> int:
    """A saved integer as autograd stores it (negatives wrap around 2**64)."""
    return value - 2**64 if value >= 2**63 else value


def _moved(block: Windowed, start: Tensor, size: tuple[int, ...]) -> Any:
    """The block's boxes at new starts in a map of a new size (a pad's or slice's input).

    Entries outside the old map are zero already; those outside the new one are set so.
    """
    inside = valid(start, block.box, size)
    data = block.data if bool(inside.all()) else torch.where(inside, block.data, 0)
    return end_of(Windowed(data, start, tuple(size)), MAX_FILL)


def _times(block: Windowed, factor: Any, divide: bool = False) -> Any:
    """The block times (or over) a map, a per-channel/per-sample factor or a number.

    A divisor is gathered on the boxes like a factor; the positions outside the map
    are gathered as zeros, so their quotients (``0 / 0``) are set back to zero.
    """
    op = torch.div if divide else torch.mul
    if not isinstance(factor, Tensor):
        return block.with_data(op(block.data, factor))
    dims = 2 + len(block.size)
    if factor.dim() > dims:
        return op(block.dense(), factor)
    shape = (1,) * (dims - factor.dim()) + tuple(factor.shape)
    factor = factor.reshape(shape)
    spatial = shape[2:]
    if all(s == 1 for s in spatial):
        return block.with_data(op(block.data, factor.unsqueeze(0)))
    if tuple(spatial) != tuple(block.size):
        return op(block.dense(), factor)
    boxes = gather(factor, block.start, block.box, block.size)  # [V, N', C', *box]
    if not divide:
        return block.with_data(block.data * boxes)
    inside = valid(block.start, block.box, block.size)  # [V, 1, 1, *box]
    return block.with_data(torch.where(inside, block.data / boxes, 0))


def _reduced(value: Any, shape: torch.Size | None) -> Any:
    """Vectors summed to the shape a broadcast side had (none: as they are)."""
    if shape is None:
        return value
    full = tuple(value.shape[1:])
    if tuple(shape) == full:
        return value
    dims = len(full)
    padded = (1,) * (dims - len(shape)) + tuple(shape)
    if (
        len(shape) > dims
        or not isinstance(value, Windowed)
        or any(s != 1 for s in padded[2:])
    ):
        dense = value.dense() if isinstance(value, Windowed) else value
        return dense.sum_to_size(dense.shape[0], *padded).reshape(dense.shape[0], *shape)
    data = value.data.sum(tuple(range(3, 3 + len(value.size))), keepdim=True)
    v = data.shape[0]
    if data.shape[1] != padded[0] or data.shape[2] != padded[1]:
        data = data.sum_to_size(v, *padded[:2], *data.shape[3:])
    return data.reshape(v, *shape)
