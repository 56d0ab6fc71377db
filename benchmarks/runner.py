"""Run one configuration (problem × method × params × device) in this process.

Used as a child process: ``python -m benchmarks.runner --problem P --method M --params
JSON --mode time|memory|both --out FILE``. ``time`` does a warm-up call and then
``repeats`` timed calls (median, ``cuda.synchronize`` on GPU). ``memory`` measures a cold
first call (unless ``--warm-only``) and a warm call with
:func:`ggnchunk.measure_peak_memory`. ``both`` measures memory first, in the fresh
process, and then times calls once the poller has stopped (the CPU memory poller slows
the computation it watches, so no timed call runs beside it).
:func:`run_isolated` starts such a child with a pinned glibc mmap threshold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.methods import METHODS
from benchmarks.problems import build

MMAP_THRESHOLD = "131072"  # without it, freed memory returns to the OS unpredictably


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _unpack(result, record: dict) -> list:
    """Methods return a diagonal, or ``(diagonal, info)``: keep the info in the record."""
    if isinstance(result, tuple):
        result, info = result
        record.update(info)
    return result


def run_here(
    problem: str,
    method: str,
    params: dict,
    mode: str,
    device: str = "cpu",
    repeats: int = 3,
    scale: int = 1,
    save_diag: str | None = None,
    flops: bool = False,
    cold: bool = True,
) -> dict:
    """Measure one configuration in this process; return a JSON-ready record.

    ``params`` go to the method, except ``float64`` (run the problem in float64).
    """
    from ggnchunk import measure_peak_memory

    params = dict(params)
    model, loss_func, x, y = build(problem, device, scale)
    if params.pop("float64", False):
        model, loss_func = model.double(), loss_func.double()
        x = x.double() if x.is_floating_point() else x
        y = y.double() if y.is_floating_point() else y
    fn = METHODS[method]
    record = {
        "problem": problem,
        "method": method,
        "params": params,
        "mode": mode,
        "device": device,
        "threads": torch.get_num_threads(),
        "batch_size": x.shape[0],
    }
    import contextlib

    from torch.utils.flop_counter import FlopCounterMode

    def call():
        out = fn(model, loss_func, x, y, **params)
        _sync(device)
        return out

    # The warm-up call counts floating-point operations (untimed), except in auto mode,
    # whose warm-up call times candidate chunk sizes: there an extra call counts them.
    tuning = params.get("chunk_size") == "auto"
    count_now = flops and not tuning
    counter = FlopCounterMode(display=False) if count_now else contextlib.nullcontext()
    if mode in ("memory", "both"):
        if cold:
            first = measure_peak_memory(call, device=device)
            record["cold_peak_mib"] = first.peak_extra_mib
        else:  # warm up without the poller (faster), measure the warm call only
            with counter:
                call()
            if count_now:
                record["flops"] = counter.get_total_flops()
        warm = measure_peak_memory(call, device=device)
        diag = _unpack(warm.result, record)
        record["peak_mib"] = warm.peak_extra_mib
        record["memory_method"] = warm.method
    if mode in ("time", "both"):
        if mode == "time":  # a fresh process: warm up first
            start = time.perf_counter()
            with counter:
                diag = call()
            record["first_call_s"] = time.perf_counter() - start
            if count_now:
                record["flops"] = counter.get_total_flops()
        times = []
        for _ in range(repeats):  # no memory poller runs now
            start = time.perf_counter()
            diag = call()
            times.append(time.perf_counter() - start)
        record["times_s"] = times
        record["median_s"] = statistics.median(times) if times else record["first_call_s"]
        diag = _unpack(diag, record)
    if flops and "flops" not in record:
        with FlopCounterMode(display=False) as late_counter:
            call()
        record["flops"] = late_counter.get_total_flops()
    if save_diag:
        torch.save([d.detach().cpu() for d in diag], save_diag)
    return record


def run_isolated(
    problem: str,
    method: str,
    params: dict,
    mode: str,
    out_dir: Path,
    device: str = "cpu",
    repeats: int = 3,
    scale: int = 1,
    threads: int | None = None,
    save_diag: bool = False,
    timeout: float = 1800,
    flops: bool = False,
    cold: bool = True,
) -> dict:
    """Run :func:`run_here` in a fresh Python process and return its record.

    A failed child (out of memory, an error) gives a record with ``"error"``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"{problem}-{method}-{mode}-" + "-".join(f"{k}{v}" for k, v in params.items())
    tag = "".join(c if c.isalnum() or c in "-_." else "_" for c in tag)
    out = out_dir / f"{tag}.json"
    diag_file = out_dir / f"{tag}.pt" if save_diag else None
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [
        sys.executable, "-m", "benchmarks.runner", "--problem", problem, "--method", method,
        "--params", json.dumps(params), "--mode", mode, "--device", device,
        "--repeats", str(repeats), "--scale", str(scale), "--out", str(out),
    ]  # fmt: skip
    if diag_file:
        cmd += ["--save-diag", str(diag_file)]
    if flops:
        cmd.append("--flops")
    if not cold:
        cmd.append("--warm-only")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {
            "problem": problem, "method": method, "params": params, "mode": mode,
            "device": device, "error": " | ".join(tail) or f"exit {proc.returncode}",
        }  # fmt: skip
    record = json.loads(out.read_text())
    if diag_file:
        record["diag_file"] = str(diag_file)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", required=True)
    parser.add_argument("--method", required=True)
    parser.add_argument("--params", default="{}")
    parser.add_argument("--mode", choices=["time", "memory", "both"], required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-diag", default=None)
    parser.add_argument("--flops", action="store_true")
    parser.add_argument("--warm-only", action="store_true")
    args = parser.parse_args()
    record = run_here(
        args.problem, args.method, json.loads(args.params), args.mode, args.device,
        args.repeats, args.scale, args.save_diag, args.flops, not args.warm_only,
    )  # fmt: skip
    Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
