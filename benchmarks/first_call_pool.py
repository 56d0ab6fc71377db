"""A budgeted first call with and without the products' buffer pool grown before it.

``python -m benchmarks.first_call_pool [--out DIR] [--rounds K]``: fresh processes at 1
thread, alone on the machine, in the default environment. MKL keeps a pool of packing
buffers per thread that grows with the largest products a process ran and is never
given back; a first call grew it inside its budget, counted it as in use after its
forward pass and planned more passes than later calls
(:func:`ggnchunk._warmup.ensure_matmul_pool` now grows it before the baseline). Each
round runs, for every problem, one process with the set-up (``on``) and one without it
(``off``: the model-size threshold raised out of reach), alternating; each process makes
three budgeted calls (the first, then two after ``malloc_trim``, as the benchmark's warm
call) and records their times, passes and set-up times.

Writes ``first_call_pool.json`` and ``first_call_pool.md`` into ``--out`` (default
``benchmarks/results/first-call-pool``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the benchmark's budgets (10% of BackPACK's one pass in today's runs)
CASES = [("resnet18", "81.2MiB"), ("resnet18_frozen", "22.9MiB")]

_CHILD = """
import ctypes, gc, json, sys, time, torch, ggnchunk
from benchmarks import problems
from ggnchunk import _warmup
torch.set_num_threads(1)
name, budget, variant = sys.argv[1:4]
if variant == "off":
    _warmup._POOL_PARAMETERS = 2**62
model, loss, x, y = problems.build(name)
calls = []
for _ in range(3):
    start = time.perf_counter()
    _, report = ggnchunk.diag_ggn(model, loss, x, y, max_memory=budget,
                                  return_report=True)
    calls.append([time.perf_counter() - start, report.num_passes, report.setup_seconds])
    del report
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
print(json.dumps(calls))
"""


def _run(name: str, budget: str, variant: str) -> list:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _CHILD, name, budget, variant],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(runs: list[dict]) -> str:
    lines = [
        "| problem | budget | pool set up first | first call [s] | passes | "
        "third call [s] | passes | first ÷ third |",
        "|---|---|---|---|---|---|---|---:|",
    ]
    for name, budget in CASES:
        for variant in ("on", "off"):
            mine = [
                r["calls"] for r in runs if r["problem"] == name and r["variant"] == variant
            ]
            first = [c[0][0] for c in mine]
            third = [c[2][0] for c in mine]
            ratio = statistics.median(f / t for f, t in zip(first, third, strict=True))
            lines.append(
                f"| {name} | {budget} | {'yes' if variant == 'on' else 'no'} | "
                f"{', '.join(f'{t:.2f}' for t in first)} | "
                f"{', '.join(str(c[0][1]) for c in mine)} | "
                f"{', '.join(f'{t:.2f}' for t in third)} | "
                f"{', '.join(str(c[2][1]) for c in mine)} | {ratio:.2f}× |"
            )
    return "\n".join(lines)


def main() -> None:
    """Run the rounds, write JSON and a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/first-call-pool"))
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    runs = []
    for _ in range(args.rounds):
        for variant in ("on", "off"):
            for name, budget in CASES:
                calls = _run(name, budget, variant)
                runs.append({"problem": name, "variant": variant, "calls": calls})
                print(json.dumps(runs[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "first_call_pool.json").write_text(json.dumps(runs, indent=1))
    (out / "first_call_pool.md").write_text(
        "# A budgeted first call with and without the products' pool grown first\n\n"
        "`python -m benchmarks.first_call_pool`: fresh processes, 1 thread, alone, "
        "alternating. Per process: the first call, then two after `malloc_trim` "
        "(times in seconds, one value per round).\n\n" + _table(runs) + "\n"
    )
    print(_table(runs))


if __name__ == "__main__":
    main()
