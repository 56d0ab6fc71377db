"""Windowed columns against the dense path of the same commit (issue 19).

``python -m benchmarks.windows [--only NAME ...] [--chunking budget fixed] [--out DIR]``:
for each problem and chunking (the same budget, or the same fixed number of chunks), in
one process at 1 thread, the same ``diag_ggn`` call with the windowed path on and off
(``ggnchunk._windows.ENABLED``), alternating, one untimed call of each, then one timed
(the 64×64 U-Nets: one timed call each, first calls), then one untimed call of each
under torch's ``FlopCounterMode`` (grouped convolutions' backward counted right,
:mod:`benchmarks.flops`): the floating-point operations each
path really runs (the windowed path's on its boxes, zero-padded entries included), as
GFLOP/s and % of the float32 matmul peak measured at the start of the run (the 64×64
U-Net's dense path is not counted: minutes more). Writes ``windows.json``,
``windows.md`` and, with matplotlib, ``windows.png`` into ``--out``
(default ``benchmarks/results/windows``). Run it alone on the machine: other work beside
it moves the ratios several-fold.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

PROBLEMS = {
    # name: (budget, fixed chunks, title, issue 19's target for the speed-up or None)
    "tutorial_conv_ae": ("160MiB", 1, "tutorial conv AE 5×3×32×32", 8.0),
    "conv_ae_28_outpad": ("64MiB", 1, "conv AE 16×1×28×28, `output_padding` decoder", 4.0),
    "conv_ae_28": ("64MiB", 1, "conv AE 16×1×28×28, kernel-4 decoder", None),
    "unet_32": ("300MiB", 16, "U-Net 4×3×32×32, width 16", 2.0),
    "unet_64": ("1GiB", 128, "U-Net 2×3×64×64, width 16", 5.0),
    "time_unet_64": ("2GiB", 128, "time-conditioned U-Net 2×3×64×64 with attention", 5.0),
    "sr_espcn": ("256MiB", 16, "ESPCN ×2 super-resolution 4×3×32×32 → 64×64", None),
    "unet_classic_64": ("512MiB", 64, "classic U-Net 2×3×64×64 (max pool, bilinear)", None),
    "cyclegan_generator": (
        "512MiB",
        16,
        "CycleGAN ResnetGenerator 2×3×64×64 (instance norms)",
        None,
    ),
}
ROUNDS = {
    "cyclegan_generator": 1,
    "unet_64": 1,
    "time_unet_64": 1,
    "unet_classic_64": 1,
}  # timed calls per path (the others: one untimed, then one)
UNCOUNTED = {
    ("unet_64", "dense"),
    ("time_unet_64", "dense"),
    ("unet_classic_64", "dense"),
    ("cyclegan_generator", "dense"),
}  # FLOPs not counted (an extra call takes minutes)


def _measure(name: str, chunking: str) -> dict:
    """Time the windowed and the dense path on one problem (in this process)."""
    import torch

    import ggnchunk
    from benchmarks.flops import flop_counter
    from benchmarks.problems import build
    from ggnchunk import _windows

    torch.set_num_threads(1)
    budget, chunks = PROBLEMS[name][:2]
    params = {"max_memory": budget} if chunking == "budget" else {"num_chunks": chunks}
    model, loss_func, x, targets = build(name)
    times: dict[str, list[float]] = {"windowed": [], "dense": []}
    info: dict[str, dict] = {}
    diags = {}
    rounds = ROUNDS.get(name, 2)
    for repeat in range(rounds):  # with two rounds the first is untimed (warm-up)
        for method in ("windowed", "dense"):
            _windows.ENABLED = method == "windowed"
            start = time.perf_counter()
            diag, report = ggnchunk.diag_ggn(
                model, loss_func, x, targets, return_report=True, **params
            )
            elapsed = time.perf_counter() - start
            if repeat or rounds == 1:
                times[method].append(elapsed)
            diags[method] = diag
            info[method] = {
                "passes": report.num_passes, "chunk_size": report.chunk_size,
                "peak_MiB": (report.peak_extra_bytes or 0) / 2**20,
                "windowed": report.windowed, "window_ends": report.window_ends,
            }  # fmt: skip
    flops: dict[str, int | None] = {}
    for method in ("windowed", "dense"):
        flops[method] = None
        if (name, method) in UNCOUNTED:
            continue
        _windows.ENABLED = method == "windowed"
        with flop_counter() as counter:
            ggnchunk.diag_ggn(model, loss_func, x, targets, **params)
        flops[method] = counter.get_total_flops()
    _windows.ENABLED = True
    # relative to the diagonal's largest entry: a parameter whose diagonal is exactly
    # zero (a bias before a normalization without affine) has only rounding in both
    scale = max(float(v.abs().max()) for v in diags["dense"].values())
    gap = max(
        float((diags["windowed"][k] - diags["dense"][k]).abs().max())
        for k in diags["dense"]
    ) / max(scale, 1e-30)
    return {
        "problem": name, "chunking": chunking, "params": params,
        "warm": rounds > 1,
        "windowed_s": min(times["windowed"]), "dense_s": min(times["dense"]),
        "speedup": min(times["dense"]) / min(times["windowed"]),
        "relative_gap": gap, "info": info, "flops": flops,
    }  # fmt: skip


def _table(rows: list[dict], environment: dict) -> str:
    lines = [
        "# Windowed columns against the dense path (issue 19)",
        "",
        f"`python -m benchmarks.windows`, {environment['when']}, 1 thread, "
        f"{environment['machine']}, torch {environment['torch']}, commit "
        f"{environment['commit']}. Warm calls, same budget, both paths of the same commit "
        "in one process, alternating; float32 results of the two paths agree to the "
        "gap shown (relative to the diagonal's largest entry). GFLOP/s: the operations "
        "each path really runs, counted by torch's `FlopCounterMode` (grouped "
        "convolutions' backward counted right, "
        "`benchmarks/flops.py`) in one more call (the windowed path's on its boxes), "
        "per second of the timed call; % of the float32 matmul peak "
        f"({environment.get('matmul_peak', 0) / 1e9:.1f} GFLOP/s, 1 thread).",
        "",
        "| problem | chunking | dense | windowed | speed-up | target "
        "| passes (windowed/dense) | GFLOP (windowed/dense) "
        "| GFLOP/s, % of peak (windowed / dense) | windows ended at | gap |",
        "|---|---|---:|---:|---:|---:|---|---|---|---|---:|",
    ]
    peak = environment.get("matmul_peak") or 0.0
    for row in rows:
        _, _, title, target = PROBLEMS[row["problem"]]
        chunking = ", ".join(f"{k}={v}" for k, v in row["params"].items())
        if not row["warm"]:
            chunking += " (first calls)"
        info = row["info"]
        ends = "; ".join(info["windowed"]["window_ends"]) or "(stayed windowed)"
        met = "" if target is None else (
            f"≥ {target:g}× {'met' if row['speedup'] >= target else 'NOT met'}"
        )  # fmt: skip
        counted, rates = [], []
        for method in ("windowed", "dense"):
            count = (row.get("flops") or {}).get(method)
            if count is None:
                counted.append("not counted")
                rates.append("–")
                continue
            rate = count / row[f"{method}_s"]
            counted.append(f"{count / 1e9:.2f}")
            share = f", {100 * rate / peak:.0f}%" if peak else ""
            rates.append(f"{rate / 1e9:.1f}{share}")
        lines.append(
            f"| {title} | {chunking} | {row['dense_s']:.2f} s | "
            f"{row['windowed_s']:.2f} s | {row['speedup']:.2f}× | {met} | "
            f"{info['windowed']['passes']}/{info['dense']['passes']} | "
            f"{' / '.join(counted)} | {' / '.join(rates)} | {ends} | "
            f"{row['relative_gap']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - optional
        return
    names = list(dict.fromkeys(r["problem"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.38
    for shift, chunking, color in ((-width / 2, "budget", "tab:blue"),
                                   (width / 2, "fixed", "tab:green")):  # fmt: skip
        values = {r["problem"]: r["speedup"] for r in rows if r["chunking"] == chunking}
        ax.bar(
            [i + shift for i, n in enumerate(names) if n in values],
            [values[n] for n in names if n in values], width, color=color,
            label=f"same {'budget' if chunking == 'budget' else 'fixed chunks'}",
        )  # fmt: skip
    targets = [PROBLEMS[n][3] for n in names]
    ax.scatter(
        [i for i, t in enumerate(targets) if t], [t for t in targets if t],
        color="tab:red", marker="_", s=900, label="target", zorder=3,
    )  # fmt: skip
    ax.set_xticks(range(len(names)), names)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("dense time / windowed time")
    ax.set_title("Windowed columns: speed-up over the dense path (1 thread, warm)")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Run the comparison; each problem in its own process (``--child``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=list(PROBLEMS))
    parser.add_argument("--out", default="benchmarks/results/windows")
    parser.add_argument("--chunking", nargs="*", default=["budget", "fixed"])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_measure(*args.child)))
        return
    from benchmarks.__main__ import matmul_peak

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    peak = matmul_peak("cpu", 1)
    print(f"float32 matmul peak, 1 thread: {peak / 1e9:.1f} GFLOP/s", flush=True)
    rows = []
    for name in args.only:
        for chunking in args.chunking:
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.windows", "--child", name, chunking],
                capture_output=True, text=True, env=env, check=True,
            )  # fmt: skip
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{name} {chunking}: {rows[-1]['speedup']:.2f}x", flush=True)
    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        check=False,
    ).stdout.strip()  # fmt: skip
    environment = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__, "commit": commit or "unknown", "matmul_peak": peak,
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "windows.json").write_text(
        json.dumps({"environment": environment, "rows": rows}, indent=1)
    )
    (out / "windows.md").write_text(_table(rows, environment))
    _plot(rows, out / "windows.png")
    print((out / "windows.md").read_text())


if __name__ == "__main__":
    main()
