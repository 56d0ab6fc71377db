"""Run one configuration (problem × method × params × device) in this process.

Used as a child process: ``python -m benchmarks.runner --problem P --method M --params
JSON --mode time|memory|both --out FILE``. ``time`` times the process's first call
(``first_call_s``: imports, model and data are ready before it; whatever the method sets
up at its first call is inside) and then ``repeats`` warm calls (median, more for short
calls until :data:`MIN_TIMED_S` of them; ``cuda.synchronize`` on GPU). ``memory``
measures a cold first call (unless ``--warm-only``) and a warm call. ``both`` measures
memory first, in the fresh process, and then times calls (no timed call runs beside a
memory poller).

CPU peak memory is the resident set size above the level just before the call, either
polled every millisecond by memory_profiler (``--peak poll``, through
:func:`ggnchunk.measure_peak_memory`) or read from the kernel's own high-water mark
(``--peak hwm``: ``VmHWM``, reset through ``/proc/self/clear_refs`` just before the call;
exact, no poller). ``--trim`` returns the memory freed by earlier calls to the operating
system (glibc ``malloc_trim(0)``) before the warm call, so that a warm call that reuses
freed heap does not look free. A failed configuration writes a record with ``"error"``
(exception type and message) and exits with status 1.

:func:`run_isolated` starts such a child, by default with a pinned glibc mmap threshold
(repeatable peaks); ``pin_mmap=False`` leaves the allocator as users have it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.methods import METHODS
from benchmarks.peak import high_water_mark_mib
from benchmarks.problems import build

MMAP_THRESHOLD = "131072"  # without it, freed memory returns to the OS unpredictably
MiB = 2**20


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _unpack(result, record: dict) -> list:
    """Methods return a diagonal, or ``(diagonal, info)``: keep the info in the record."""
    if isinstance(result, tuple):
        result, info = result
        record.update(info)
    return result


def malloc_trim() -> bool:
    """Give the heap's free pages back to the OS (glibc); False where unavailable."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def peak_extra_mib(call: Callable, device: str, peak: str) -> tuple[float, str, object]:
    """Run ``call`` once: peak memory above the level before it [MiB], method, result."""
    if device.startswith("cpu") and peak == "hwm":
        measured = high_water_mark_mib(call)
        if measured is not None:
            return measured[0], "vmhwm", measured[1]
    from ggnchunk import measure_peak_memory

    measured = measure_peak_memory(call, device=device)
    return measured.peak_extra_mib, measured.method, measured.result


MIN_TIMED_S = 0.5
"""Warm calls are repeated (beyond ``repeats``) until they took this long in all."""
MAX_REPEATS = 15
"""At most this many warm calls where :data:`MIN_TIMED_S` asks for more."""
MIN_INTERLEAVED_S = 2.0
"""An interleaved comparison runs rounds until each configuration took this long."""
MAX_ROUNDS = 16
"""At most this many rounds of an interleaved comparison (:func:`time_interleaved`)."""


def time_interleaved(call: Callable, other: Callable, rounds: int = 1) -> dict:
    """Time two warm calls alternately in this process; the ratio of their medians.

    Ratios between separate processes carry the machine's drift between them (on this
    shared 2-core machine the same plan, 22 passes of 39 columns, read 0.18 s in one
    process and 0.24 s in the next); calls alternated in one process share it. ``other``
    is warmed up first (its own first call, untimed), then one untimed round of both
    (the first calls after the other configuration's first call ran on the heap it left:
    the segmentation model's auto calls read 0.13-0.14 s there, 0.09 s later), then
    rounds run until each took :data:`MIN_INTERLEAVED_S` in all (at least ``rounds``, at
    most :data:`MAX_ROUNDS`), ``call`` first in even rounds and ``other`` first in odd
    ones, so that neither always runs on the heap the other left. Three rounds of
    0.5 s in all read auto 1.11x and 1.24x of budget mode on the MLP and 28x28
    autoencoders, whose plans were the same chunk for chunk; 30 rounds in that order
    read 1.014x and 1.004x.

    Args:
        call: The configuration measured (already warm).
        other: The one it is compared with.
        rounds: The fewest rounds.

    Returns:
        ``{"times_s", "other_times_s", "ratio"}``: each call's times, and the median of
        ``call``'s over the median of ``other``'s.
    """
    other()  # its first call in this process: set-up and planning, untimed
    call()  # a round that settles the heap both now share, untimed
    other()
    own: list[float] = []
    theirs: list[float] = []
    while len(own) < rounds or (
        min(sum(own), sum(theirs)) < MIN_INTERLEAVED_S and len(own) < MAX_ROUNDS
    ):
        pair = ((call, own), (other, theirs))
        for fn, times in pair if len(own) % 2 == 0 else pair[::-1]:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    ratio = statistics.median(own) / statistics.median(theirs)
    return {"times_s": own, "other_times_s": theirs, "ratio": ratio}


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
    peak: str = "poll",
    trim: bool = False,
    interleave: dict | None = None,
) -> dict:
    """Measure one configuration in this process; return a JSON-ready record.

    ``params`` go to the method, except ``float64`` (run the problem in float64). With
    ``interleave`` (the same method's params of another configuration), the timed calls
    are followed by both configurations timed alternately (:func:`time_interleaved`),
    recorded under ``"interleaved"``.
    """
    from benchmarks.flops import flop_counter

    params = dict(params)
    record = {
        "problem": problem,
        "method": method,
        "params": dict(params),
        "mode": mode,
        "device": device,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
    }
    float64 = params.pop("float64", False)
    model, loss_func, x, y = build(problem, device, scale)
    if float64:
        model, loss_func = model.double(), loss_func.double()
        x = x.double() if x.is_floating_point() else x
        y = y.double() if y.is_floating_point() else y
    record["batch_size"] = x.shape[0]
    record["parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fn = METHODS[method]

    def call():
        out = fn(model, loss_func, x, y, **params)
        _sync(device)
        return out

    # The first call of the process is measured as users meet it: everything before it
    # (imports, building the model and data) is done, everything the call itself does
    # (BackPACK's extend, ggnchunk's one-time set-up and planning) is inside. A memory run
    # without ``cold`` warms up untimed and counts floating-point operations there;
    # otherwise an extra, untimed call at the end counts them.
    count_now = flops and mode == "memory" and not cold
    counter = flop_counter() if count_now else contextlib.nullcontext()
    diag = None
    if mode in ("memory", "both"):
        if cold:
            start = time.perf_counter()
            try:
                record["cold_peak_mib"], _, first = peak_extra_mib(call, device, peak)
                diag = _unpack(first, record)
                # the one-time set-up the call paid before its budget's baseline
                record["cold_setup_mib"] = record.get("setup_mib")
                record["cold_setup_s"] = record.get("setup_s")
            except MemoryError as error:  # MemoryBudgetError: the process's one-time
                # set-up counts in a first call; the warm call is still measured
                record["cold_error"] = f"{type(error).__name__}: {error}"
            record["cold_call_s"] = time.perf_counter() - start
            if mode == "both":  # the process's first call: its time is the first call's
                record["first_call_s"] = record["cold_call_s"]
                record["first_call_setup_s"] = record.get("cold_setup_s")
                record["first_call_plain"] = True
                if "cold_error" in record:
                    record["first_call_error"] = record["cold_error"]
        else:  # warm up without measuring, measure the warm call only
            with counter:
                diag = _unpack(call(), record)
            if count_now:
                record["flops"] = counter.get_total_flops()
        gc.collect()
        if trim:
            record["trimmed"] = malloc_trim()
        record["peak_mib"], record["memory_method"], warm = peak_extra_mib(
            call, device, peak
        )
        diag = _unpack(warm, record)
    if mode in ("time", "both"):
        if mode == "time":  # a fresh process: its first call, timed as is
            start = time.perf_counter()
            try:
                diag = _unpack(call(), record)
                record["first_call_setup_s"] = record.get("setup_s")
            except MemoryError as error:  # as in memory mode: the first call pays the
                # process's one-time set-up; the warm calls are still timed
                record["first_call_error"] = f"{type(error).__name__}: {error}"
            record["first_call_s"] = time.perf_counter() - start
            record["first_call_plain"] = True  # no FLOP counter around it
        times: list[float] = []
        # at least ``repeats`` calls, and more for short calls until MIN_TIMED_S of them
        # (a median of one 60 ms call on this shared machine swung ratios by 30%)
        while len(times) < repeats or (
            sum(times) < MIN_TIMED_S and len(times) < MAX_REPEATS
        ):  # no memory poller runs now
            start = time.perf_counter()
            result = call()
            times.append(time.perf_counter() - start)
            diag = _unpack(result, record)
        record["times_s"] = times
        record["median_s"] = statistics.median(times) if times else record["first_call_s"]
        if interleave is not None:
            other_params = dict(interleave)
            other_params.pop("float64", None)

            def other():
                out = fn(model, loss_func, x, y, **other_params)
                _sync(device)
                return out

            record["interleaved"] = {  # at least 3 rounds: one pair is one sample
                "params": interleave,
                **time_interleaved(call, other, max(3, repeats)),
            }
    if flops and "flops" not in record:
        counted: dict = {}
        with flop_counter() as late_counter:
            diag = _unpack(call(), counted)
        record["flops"] = late_counter.get_total_flops()
        # the record's passes and chunk size stay the timed calls': under the counter
        # every operation runs through Python and a budgeted call can plan otherwise
        # (the partly frozen ResNet-18 at 23.6 MiB: 80 passes there, 18 when timed)
        if "passes" in counted:
            record["flops_passes"] = counted["passes"]
    if save_diag and diag is not None:
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
    pin_mmap: bool = True,
    peak: str = "poll",
    trim: bool = False,
    interleave: dict | None = None,
) -> dict:
    """Run :func:`run_here` in a fresh Python process and return its record.

    ``threads``: ``OMP_NUM_THREADS`` of the child; ``0`` removes it (torch's default);
    ``None`` keeps this process's environment. ``pin_mmap`` sets glibc's
    ``MALLOC_MMAP_THRESHOLD_`` (repeatable peaks); ``False`` removes every ``MALLOC_*``
    variable, as users run. A failed child (an error, out of memory, past ``timeout``
    seconds) gives a record with ``"error"``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"{problem}-{method}-{mode}-" + "-".join(f"{k}{v}" for k, v in params.items())
    tag += "-pinned" if pin_mmap else ""
    tag = "".join(c if c.isalnum() or c in "-_." else "_" for c in tag)
    out = out_dir / f"{tag}.json"
    out.unlink(missing_ok=True)
    diag_file = out_dir / f"{tag}.pt" if save_diag else None
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if pin_mmap:
        env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    if threads == 0:
        env.pop("OMP_NUM_THREADS", None)
        env.pop("MKL_NUM_THREADS", None)
    elif threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [
        sys.executable, "-m", "benchmarks.runner", "--problem", problem, "--method", method,
        "--params", json.dumps(params), "--mode", mode, "--device", device,
        "--repeats", str(repeats), "--scale", str(scale), "--out", str(out),
        "--peak", peak,
    ]  # fmt: skip
    if diag_file:
        cmd += ["--save-diag", str(diag_file)]
    if flops:
        cmd.append("--flops")
    if not cold:
        cmd.append("--warm-only")
    if trim:
        cmd.append("--trim")
    if interleave is not None:
        cmd += ["--interleave", json.dumps(interleave)]
    root = Path(__file__).resolve().parent.parent
    failed = {"problem": problem, "method": method, "params": params, "mode": mode,
              "device": device}  # fmt: skip
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout,
            check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {**failed, "error": f"timeout after {timeout:.0f} s", "timeout": True}
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        if out.is_file():  # the child caught the error and said what it was
            return {**failed, **json.loads(out.read_text()), "process_s": seconds}
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        reason = f"exit {proc.returncode}"
        if proc.returncode < 0:
            reason += " (killed: out of memory?)" if proc.returncode == -9 else " (signal)"
        return {**failed, "error": " | ".join(tail) or reason, "process_s": seconds}
    record = json.loads(out.read_text())
    record["process_s"] = seconds
    record["pinned_mmap"] = pin_mmap
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
    parser.add_argument("--peak", choices=["poll", "hwm"], default="poll")
    parser.add_argument("--trim", action="store_true")
    parser.add_argument("--interleave", default=None)
    args = parser.parse_args()
    # on CUDA every method runs in full float32 (TF32 off), as ggnchunk computes and as
    # the matmul peak is measured: BackPACK would otherwise get cuDNN's TF32 convolutions
    from ggnchunk._engine import full_float32

    cuda = args.device.startswith("cuda")
    try:
        with full_float32() if cuda else contextlib.nullcontext():
            record = run_here(
                args.problem, args.method, json.loads(args.params), args.mode,
                args.device, args.repeats, args.scale, args.save_diag, args.flops,
                not args.warm_only, args.peak, args.trim,
                None if args.interleave is None else json.loads(args.interleave),
            )  # fmt: skip
        if cuda:
            record["float32"] = "full (TF32 off)"
    except Exception as error:  # recorded as the configuration's result, not raised
        message = str(error).strip().splitlines()
        record = {
            "error": f"{type(error).__name__}: {message[0] if message else ''}",
            "error_type": type(error).__name__,
            "error_message": str(error),
            "traceback": traceback.format_exc().splitlines()[-12:],
        }
        Path(args.out).write_text(json.dumps(record, indent=2))
        traceback.print_exc()
        sys.exit(1)
    Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
