"""ggnchunk: the exact GGN diagonal of a PyTorch model's loss, in bounded memory.

The public API is exactly what this module exports.
"""

from ggnchunk._api import (
    ChunkOptions,
    GGNReport,
    clear_autotune_cache,
    diag_ggn,
    kron_ggn,
    loss_grad_and_diag_ggn,
)
from ggnchunk._autograd import SlowBackwardWarning
from ggnchunk._dataset import DiagGGNAccumulator, diag_ggn_dataset
from ggnchunk._graph import (
    GradientDisabledWarning,
    SampleCouplingError,
    UnusedParameterWarning,
)
from ggnchunk._kron import KronFactors
from ggnchunk._memory import PeakMemory, measure_peak_memory, parse_memory
from ggnchunk._rules import register_rule, supported_layers_table
from ggnchunk._scheduling import (
    ChunkRecord,
    ChunkScheduler,
    MemoryBudgetError,
    MemoryBudgetWarning,
    OutOfMemoryRecoveryWarning,
    ScheduleReport,
    plan_chunks,
)
from ggnchunk._sqrt_hessians import NotConvexWarning, ZeroHessianWarning, register_loss
from ggnchunk._variance import output_variance

# Nothing runs at import: the one-time set-up of a process (kernels paged in, torch.func)
# is paid lazily by its first budgeted call, before that call's baseline (_warmup.py).

__version__ = "0.1.0"

__all__ = [
    # computing diagonals
    "diag_ggn",
    "diag_ggn_dataset",
    "loss_grad_and_diag_ggn",
    "DiagGGNAccumulator",
    "GGNReport",
    "ChunkOptions",
    # Kronecker factors (KFLR)
    "kron_ggn",
    "KronFactors",
    # predictive variance under a diagonal posterior
    "output_variance",
    # scheduling chunks (generic: any sum over an index range)
    "ChunkScheduler",
    "ScheduleReport",
    "ChunkRecord",
    "plan_chunks",
    "clear_autotune_cache",
    "MemoryBudgetError",
    "MemoryBudgetWarning",
    "OutOfMemoryRecoveryWarning",
    # errors and warnings users meet
    "SampleCouplingError",
    "GradientDisabledWarning",
    "UnusedParameterWarning",
    "NotConvexWarning",
    "SlowBackwardWarning",
    "ZeroHessianWarning",
    # measuring memory
    "measure_peak_memory",
    "PeakMemory",
    "parse_memory",
    # extending (ggnchunk.extend has the interfaces)
    "register_rule",
    "register_loss",
    # introspection
    "supported_layers_table",
]
