"""Glue calls folded over columns against torch's per-column loop (issue 21, section 2).

``python -m benchmarks.glue_kernels [--out DIR]``: in one process at 1 thread, alone on
the machine:

1. **One call's batched backward** (``torch.autograd.grad(..., is_grads_batched=True)``
   over ``V`` vectors) for pads, pooling, softmax, ``where`` and ``flip``: torch's own
   backward (its batching loops over the columns) against the folded call of
   :mod:`ggnchunk._glue_kernels`, alternating, the best of three each, and the peak RSS
   each takes above the RSS before it (the kernel's high-water mark).
2. **Whole calls** of ``diag_ggn`` on problems whose glue is such calls
   (:func:`benchmarks.problems.gpt_eager`, :func:`benchmarks.problems.reflect_generator`),
   with the folding on and off (``ggnchunk._glue_kernels.FOLDERS`` emptied: the internal
   switch), alternating, one untimed call each, then one timed; fixed chunks and a
   budget.

Writes ``glue_kernels.json`` and ``glue_kernels.md`` into ``--out`` (default
``benchmarks/results/glue-kernels``).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

CALLS = {
    # name: (input shape, vectors, the call as source text): maps as small as glue
    # meets them deep in a network, columns as many as a chunk carries
    "reflection pad 2d": ((2, 8, 16, 16), 2048, "F.pad(x, (1, 1, 1, 1), mode='reflect')"),
    "constant pad (crop)": ((2, 8, 16, 16), 2048, "F.pad(x, (-1, -1, -1, -1))"),
    "max pool 3/2/1": ((2, 8, 16, 16), 2048, "F.max_pool2d(x, 3, 2, 1)"),
    "avg pool 3/2/1": ((2, 8, 16, 16), 2048, "F.avg_pool2d(x, 3, 2, 1)"),
    "adaptive avg pool to 1": ((2, 64, 8, 8), 2048, "F.adaptive_avg_pool2d(x, 1)"),
    "softmax of scores": ((2, 4, 16, 16), 6400, "F.softmax(x, dim=-1)"),
    "causal where": ((2, 4, 16, 16), 6400, "torch.where(MASK, x, -1e4)"),
    "batch norm, running statistics": (
        (2, 8, 16, 16),
        2048,
        "F.batch_norm(x, MEAN, VAR, training=False)",
    ),
    "flip": ((2, 8, 16, 16), 2048, "x.flip(-1)"),
    "reflection pad 2d, large maps": (
        (2, 16, 64, 64),
        64,
        "F.pad(x, (3, 3, 3, 3), mode='reflect')",
    ),
}
PROBLEMS = {
    # name: (fixed chunks, budget)
    "gpt_eager": (8, "256MiB"),
    "reflect_generator": (8, "256MiB"),
}


def _call_rows() -> list[dict]:
    import torch
    import torch.nn.functional as F

    from benchmarks.peak import high_water_mark_mib
    from ggnchunk._autograd import batched_grad
    from ggnchunk._folding import folded_glue

    rows = []
    for name, (shape, vectors, source) in CALLS.items():
        torch.manual_seed(0)
        x = torch.randn(shape, requires_grad=True)
        scope = {"F": F, "torch": torch, "x": x,
                 "MASK": torch.ones(shape[-2:], dtype=torch.bool).tril(),
                 "MEAN": torch.zeros(shape[1]), "VAR": torch.ones(shape[1])}  # fmt: skip
        plain = eval(source, scope)
        with folded_glue():
            folded = eval(source, scope)
        grads = torch.randn(vectors, *plain.shape)

        def backward(y, grads=grads, x=x):  # as the engine's sweeps batch the columns
            return batched_grad([y], [x], [grads])[0]

        times = {"torch": [], "folded": []}
        peaks = {}
        for _ in range(3):
            for path, y in (("torch", plain), ("folded", folded)):
                start = time.perf_counter()
                backward(y)
                times[path].append(time.perf_counter() - start)
        for path, y in (("torch", plain), ("folded", folded)):
            measured = high_water_mark_mib(lambda y=y: backward(y))
            peaks[path] = None if measured is None else round(measured[0], 1)
        gap = float((backward(plain) - backward(folded)).abs().max())
        rows.append({
            "call": name, "input": list(shape), "vectors": vectors,
            "torch_s": min(times["torch"]), "folded_s": min(times["folded"]),
            "speedup": min(times["torch"]) / min(times["folded"]),
            "torch_peak_mib": peaks["torch"], "folded_peak_mib": peaks["folded"],
            "max_abs_gap_float32": gap,
        })  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def _problem_rows() -> list[dict]:
    import torch

    import ggnchunk
    from benchmarks.problems import build
    from ggnchunk import _glue_kernels

    folders = dict(_glue_kernels.FOLDERS)
    rows = []
    for name, (chunks, budget) in PROBLEMS.items():
        model, loss_func, x, y = build(name)
        for kwargs in ({"num_chunks": chunks}, {"max_memory": budget}):
            result = {}
            for timed in (False, True):
                for path in ("torch", "folded"):
                    _glue_kernels.FOLDERS.clear()
                    if path == "folded":
                        _glue_kernels.FOLDERS.update(folders)
                    start = time.perf_counter()
                    diag, report = ggnchunk.diag_ggn(
                        model, loss_func, x, y, return_report=True, **kwargs
                    )
                    seconds = time.perf_counter() - start
                    if timed:
                        peak = report.peak_extra_bytes
                        result[path] = {
                            "seconds": seconds, "passes": report.num_passes,
                            "peak_mib": None if peak is None else peak / 2**20,
                            "windowed": report.windowed,
                            "diag": {k: v.clone() for k, v in diag.items()},
                        }  # fmt: skip
            _glue_kernels.FOLDERS.clear()
            _glue_kernels.FOLDERS.update(folders)
            gap = max(
                float(
                    (result["torch"]["diag"][k] - result["folded"]["diag"][k]).abs().max()
                )
                for k in result["torch"]["diag"]
            )
            row = {"problem": name, "chunking": kwargs, "max_abs_gap_float32": gap}
            for path in ("torch", "folded"):
                result[path].pop("diag")
                row[path] = result[path]
            row["speedup"] = row["torch"]["seconds"] / row["folded"]["seconds"]
            rows.append(row)
            print(row, flush=True)
    del torch
    return rows


def _table(calls: list[dict], problems: list[dict], environment: dict) -> str:
    lines = [
        "# Glue calls folded over columns (issue 21, section 2)",
        "",
        f"1 thread, {environment['machine']}, torch {environment['torch']}, "
        f"commit {environment['commit']}, alone on the machine. JSON beside this file.",
        "",
        "## One call's batched backward",
        "",
        "| call | input | vectors | torch (per column) | folded | speed-up "
        "| peak torch | peak folded |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in calls:
        lines.append(
            f"| {r['call']} | {'×'.join(map(str, r['input']))} | {r['vectors']} "
            f"| {r['torch_s']:.3f} s | {r['folded_s']:.3f} s | {r['speedup']:.1f}× "
            f"| {r['torch_peak_mib']} MiB | {r['folded_peak_mib']} MiB |"
        )
    lines += [
        "",
        "## Whole calls (`diag_ggn`, float32, second call of each path)",
        "",
        "| problem | chunking | torch's loop | folded | speed-up | passes | peak "
        "(torch / folded) | float32 gap |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in problems:
        t, f = r["torch"], r["folded"]
        peaks = "/".join(
            "–" if p["peak_mib"] is None else f"{p['peak_mib']:.0f}" for p in (t, f)
        )
        lines.append(
            f"| {r['problem']} | {r['chunking']} | {t['seconds']:.2f} s "
            f"| {f['seconds']:.2f} s "
            f"| {r['speedup']:.1f}× | {t['passes']} / {f['passes']} | {peaks} MiB "
            f"| {r['max_abs_gap_float32']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run both parts and write the JSON and the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/glue-kernels")
    parser.add_argument("--skip-problems", action="store_true")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    environment = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__, "python": sys.version.split()[0], "commit": commit,
        "threads": 1,
    }  # fmt: skip
    calls = _call_rows()
    problems = [] if args.skip_problems else _problem_rows()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"environment": environment, "calls": calls, "problems": problems}
    (out / "glue_kernels.json").write_text(json.dumps(record, indent=1))
    (out / "glue_kernels.md").write_text(_table(calls, problems, environment))
    print(_table(calls, problems, environment))


if __name__ == "__main__":
    main()
