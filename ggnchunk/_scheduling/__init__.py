"""Chunk scheduling: split an index range ``[0, total)`` into chunks and run them.

Generic: nothing here knows about GGNs.

* :mod:`~ggnchunk._scheduling.plan`: fixed plans and the chunking options' checks.
* :mod:`~ggnchunk._scheduling.execute`: running chunks, adding up their results,
  splitting a chunk that runs out of memory; the report and its records.
* :mod:`~ggnchunk._scheduling.budget`: the budget model (how large a chunk fits, checked
  against every measured chunk).
* :mod:`~ggnchunk._scheduling.autotune`: auto mode's timing trials and its bounded cache.
* :mod:`~ggnchunk._scheduling.scheduler`: :class:`ChunkScheduler`, which ties them
  together.
"""

from ggnchunk._scheduling.autotune import clear_autotune_cache
from ggnchunk._scheduling.budget import (
    MemoryBudgetError,
    MemoryBudgetWarning,
    passes_within,
    planning_share,
)
from ggnchunk._scheduling.execute import (
    ChunkRecord,
    OutOfMemoryRecoveryWarning,
    ScheduleReport,
    is_out_of_memory,
)
from ggnchunk._scheduling.plan import Plan, check_chunking, plan_chunks
from ggnchunk._scheduling.scheduler import ChunkScheduler, Mode

__all__ = [
    "ChunkRecord",
    "ChunkScheduler",
    "MemoryBudgetError",
    "MemoryBudgetWarning",
    "Mode",
    "OutOfMemoryRecoveryWarning",
    "Plan",
    "ScheduleReport",
    "check_chunking",
    "clear_autotune_cache",
    "is_out_of_memory",
    "passes_within",
    "plan_chunks",
    "planning_share",
]
