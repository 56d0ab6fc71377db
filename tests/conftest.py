"""Test-session set-up: CPU threads shared fairly between pytest-xdist workers.

With pytest-xdist (``pytest -n 2``; not in the ``test`` extra, and the README's command
runs serially) each worker would otherwise start torch's default thread pool (one thread
per core) and the workers would oversubscribe the cores; each gets its share instead. A
plain ``pytest`` run is left as is.
"""

from __future__ import annotations

import os

import torch

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if os.environ.get("PYTEST_XDIST_WORKER") and _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))
