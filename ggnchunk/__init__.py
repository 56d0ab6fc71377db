"""ggnchunk: the exact GGN diagonal of a PyTorch model's loss, in bounded memory.

The public API is exactly what this module exports.
"""

from ggnchunk._api import diag_ggn
from ggnchunk._memory import PeakMemory, measure_peak_memory
from ggnchunk._modules import supported_layers_table
from ggnchunk._scheduler import plan_chunks

__version__ = "0.1.0"

__all__ = [
    # computing diagonals
    "diag_ggn",
    # planning chunks (generic: any sum over an index range)
    "plan_chunks",
    # measuring
    "PeakMemory",
    "measure_peak_memory",
    # introspection
    "supported_layers_table",
]
