r"""The recorded forward pass and the backward sweeps over it.

**Recording.** The user's forward runs once, with two hooks on every layer that has a rule
(see :mod:`ggnchunk._rules`): before the layer, its input is replaced by a detached copy
that requires grad (a *leaf*, sharing storage), which cuts the autograd graph at the
layer's input; after it, the layer's output is named by its gradient edge. The graph
falls apart into the layers' own small graphs (leaf → output) and the *glue* between them:
everything else the forward did (activations, residual additions, ``torch.cat``, attention
maths, in-place operations, dropout with the masks it drew, parameters used in functional
calls), which autograd differentiates as recorded. Nothing is ever run again.

**Plan.** For every place where glue begins (the model output, and the original tensor
behind every cut), a walk over ``next_functions`` finds the layer outputs it reaches
without passing another layer, and the other regions' sources it reaches (its
*frontier*), and the parameters it uses. A region cut at another's source leaves its
vectors there, and that region is crossed once, after every region cut at it (a
residual stream is crossed once per pass, not again by every later region); the cut
nodes pass nothing on while the region is crossed.

**Sweep.** For a chunk of square-root columns ``S`` (``[V, N, *output]``), the layers are
visited in reverse call order (a reverse topological order): the vectors at a layer's
output are complete once every later layer and the glue after it are done; the layer's
rule turns them into parameter diagonals; autograd (batched over the ``V`` columns) moves
them to the layer's input and, once every consumer of that input is done (the layers
and the regions cut at it), through the glue to the frontier, where they are added up.
A parameter used in the glue, or in more than one place, gets per-(column, sample)
products (read per sample off one pass, or one masked backward per sample through the
glue that uses it) that are added over its uses before squaring. Where the columns at a
layer's input span few directions (below a vocabulary's head), they are replaced by
fewer with the same Gram matrix (``compress``).

**Layout.** ``parts`` (calls, glue sources), ``recording`` (hooks and plan; the class the
engine holds), ``traverse`` (the one traversal), ``sweep`` (dense and windowed sweeps),
``bound`` (the memory bound, on sizes), ``checks`` (Kronecker factors, independent
samples), ``compress`` (fewer columns with the same Gram), ``readers`` (glue parameters'
products per sample), ``glue_windows`` (glue crossed on windowed boxes).
"""

from ggnchunk._autograd import SlowBackwardWarning
from ggnchunk._graph.parts import Call, SampleCouplingError, _Source
from ggnchunk._graph.recording import (
    GradientDisabledWarning,
    Recording,
    UnusedParameterWarning,
)

__all__ = [
    "Call",
    "GradientDisabledWarning",
    "UnusedParameterWarning",
    "Recording",
    "SampleCouplingError",
    "SlowBackwardWarning",
    "_Source",
]
