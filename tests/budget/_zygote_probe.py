"""A module the zygote's tests run in its children: says what it sees, then acts."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

if __name__ == "__main__":
    action = sys.argv[1]
    print(json.dumps({
        "argv": sys.argv[1:], "pid": os.getpid(), "ppid": os.getppid(),
        "marked": getattr(torch, "_zygote_probe_mark", False),
        "threads_set": torch.get_num_threads(),
    }))  # fmt: skip
    torch._zygote_probe_mark = True  # must not reach the next child
    if action == "exit":
        sys.exit(int(sys.argv[2]))
    if action == "raise":
        raise ValueError("probe failed on purpose")
    if action == "sleep":
        time.sleep(float(sys.argv[2]))
