"""Benchmark suite: ggnchunk against BackPACK's one pass, side by side in one run.

``python -m benchmarks [--quick] [--only NAME ...] [--threads 1 0] [--device cuda]``

For every problem of :data:`benchmarks.problems.DEFAULT_PROBLEMS` (issue 13's rows) it
measures BackPACK's ``DiagGGNExact`` in one pass, ggnchunk with a memory budget of 10%
of that pass's measured extra memory (where BackPACK cannot run the problem: a fixed
budget for the U-Net, 300 MiB as in issue 10, else 10% of ggnchunk's one pass),
ggnchunk's auto mode within the same budget, and ggnchunk in one pass. Every
configuration runs in fresh processes: one for the time (the process's first call, as a
script that calls once meets it: imports, model and data are ready before it, whatever
the method sets up at its first call is inside; then the median of ``--repeats`` warm
calls, more for short calls until 0.5 s of them; the floating-point operations are
counted with ``torch.utils.flop_counter`` on an extra, untimed call), one for the peak
memory (the first call, and a warm call after the freed heap went back to the OS; the
kernel's own peak RSS above the level before the call, the allocator as users have it:
no ``MALLOC_*`` variables), and in full runs one more for the same warm peak with
glibc's mmap threshold pinned (the repeatable figure). ``--quick`` measures memory (the
first call's time too) and then time in one process, 1 repeat (more for short calls),
and leaves out :data:`benchmarks.problems.QUICK_SKIPPED` unless ``--only`` names them.

A float32 matmul peak is measured in the same run with the same threads (before and after
the configurations; the higher counts). Writes, per device and thread count,
``<out>/<device>-<threads>t/``: one JSON per problem × method, ``environment.json``,
``table.md`` and PNGs (:mod:`benchmarks.plot`), and the tables of every folder to
``<out>/RESULTS.md`` (``python -m benchmarks.plot FOLDER ... --results-md PATH`` redraws
them from the JSON). ``<out>`` is a new ``results/benchmarks/run-<date>-<time>/`` at the
repository root (git-ignored) unless ``--out`` names one; a folder that holds an earlier
run's records is refused unless ``--overwrite`` or ``--resume`` says what to do with them.
The committed results change only when asked: ``--out benchmarks/results`` (a full run of
the default problems then also rewrites ``benchmarks/RESULTS.md``). A configuration
that fails is a row with its error (an exception, or a process past ``--timeout``
seconds), never a failed run; ``--resume`` measures again only what timed out or is
missing. ``--extra`` adds the older comparisons
(fixed chunk counts, budgets of 15/30/50%, the tutorial's slicing loop, ``DiagGGNMC``, a
``torch.func`` brute force).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks import plot
from benchmarks.problems import DEFAULT_PROBLEMS, GPU_PROBLEMS, PROBLEMS, QUICK_SKIPPED
from benchmarks.runner import run_isolated

HERE = Path(__file__).resolve().parent
MSE_PROBLEMS = {"tutorial_conv_ae", "mlp_ae", "conv_ae_28", "conv_ae_28_outpad"}
BUDGET_FRACTION = 0.10
FIXED_BUDGET_MIB = {
    "unet_32": 300.0,
    "unet": 300.0,
    "unet_64": 2048.0,
    "conv_ae_28_outpad": 30.0,
}
"""Fixed budgets where BackPACK cannot run the problem (the U-Net's 300 MiB is issue 10's
reference; the ``output_padding`` AE's 30 MiB is 10% of its dense one pass, 298-306 MiB:
windowed, the one pass peaks at about 45 MiB, and 10% of that holds no column); other
problems BackPACK cannot run get 10% of ggnchunk's one pass."""
BACKPACK_PARAMS = {
    "resnet18": {"use_converter": True},
    "resnet18_frozen": {"use_converter": True},
    "lraspp_frozen": {"use_converter": True},
    "tiny_gpt": {"use_converter": True},
}
"""BackPACK options per problem: ResNet-18 needs its torch.fx converter (residuals, in-place
ReLUs); the segmenter and the language model get it too (their best chance)."""
COMMITTED = HERE / "results"
"""The committed results: written only when ``--out`` names this folder."""
UNET_BASELINE_S = 26.0
"""Issue 10's U-Net time before the engine rewrite (4×3×32×32, width 16, 300 MiB)."""


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=HERE.parent,
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _engine_fingerprint() -> dict:
    """Where ggnchunk was imported from, its git state and a hash of its sources."""
    import ggnchunk

    folder = Path(ggnchunk.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*.py")):
        digest.update(path.relative_to(folder).as_posix().encode())
        digest.update(path.read_bytes())
    info = {"path": str(folder), "sources_sha256": digest.hexdigest()[:16]}
    if folder.parent == HERE.parent:
        info["commit"] = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--", "ggnchunk")
        info["uncommitted_changes"] = bool(dirty) if dirty is not None else None
    return info


def environment(device: str, threads: int) -> dict:
    """Versions, hardware and load of this run."""
    import backpack

    import ggnchunk

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backpack": getattr(backpack, "__version__", "1.7.1"),
        "ggnchunk": ggnchunk.__version__,
        "engine": _engine_fingerprint(),
        "device": device,
        "threads": threads or torch.get_num_threads(),
        "threads_setting": "default" if threads == 0 else str(threads),
        "cpu": _cpu_model(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
    }
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


def matmul_peak(device: str, threads: int, size: int | None = None) -> float:
    """FLOP/s of a float32 ``size²`` matmul (best of 5), in a fresh process.

    ``threads``: ``OMP_NUM_THREADS`` of that process (0: torch's default). ``size``:
    2048 on the CPU, 8192 on CUDA (a GPU needs the larger one to reach its peak). Full
    float32 (TF32 off), as ggnchunk computes.
    """
    size = size or (8192 if device == "cuda" else 2048)
    code = (
        "import torch,time\n"
        "from ggnchunk._engine import full_float32\n"
        "full_float32().__enter__()\n"
        f"d='{device}'; a=torch.randn({size}, {size}, device=d)\n"
        f"b=torch.randn({size}, {size}, device=d)\n"
        "s=lambda: torch.cuda.synchronize() if d=='cuda' else None\n"
        "a@b; s(); best=1e9\n"
        "for _ in range(5):\n"
        "    t=time.perf_counter(); a@b; s(); best=min(best,time.perf_counter()-t)\n"
        f"print(2*{size}**3/best)\n"
    )
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    else:
        env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def extra_configurations(problem: str, quick: bool) -> list[tuple[str, str, dict]]:
    """``(label, method, params)`` of the older comparisons (``--extra``)."""
    rows = []
    if problem in MSE_PROBLEMS:
        rows += [(f"slicing loop {k}", "slicing", {"num_chunks": k}) for k in (4, 16, 64)]
    chunks = (16, 64) if quick else (4, 16, 64, 256)
    rows += [(f"ggnchunk {k} chunks", "ggnchunk", {"num_chunks": k}) for k in chunks]
    rows += [("ggnchunk auto, no budget", "ggnchunk", {"chunk_size": "auto"})]
    rows += [(f"DiagGGNMC {m} sample(s)", "backpack", {"mc_samples": m}) for m in (1, 16)]
    if not quick or problem == "tutorial_conv_ae":
        rows += [("torch.func brute force", "torch_func", {})]
    return rows


class Bench:
    """One device × thread count: measures configurations and writes their records."""

    def __init__(self, args: argparse.Namespace, threads: int):
        self.args = args
        self.threads = threads
        self.quick = args.quick
        self.repeats = args.repeats or (1 if args.quick else 3)
        self.pinned = args.pinned if args.pinned is not None else not args.quick
        name = "default" if threads == 0 else f"{threads}t"
        self.out = args.out / f"{args.device}-{name}"
        self.out.mkdir(parents=True, exist_ok=True)
        self.resumed_at = time.strftime("%Y-%m-%d %H:%M:%S %Z") if args.resume else None
        if args.overwrite:  # asked for: the folder's earlier records go
            for stale in [*self.out.glob("*__*.json"), *self.out.glob("raw/*__*.pt")]:
                stale.unlink()
        self.common = {
            "device": args.device,
            "scale": 4 if args.device == "cuda" else 1,
            "threads": threads,
        }

    def measure(
        self,
        problem: str,
        label: str,
        role: str,
        method: str,
        params: dict,
        reference: list | None = None,
        budget: dict | None = None,
        interleave: dict | None = None,
    ) -> dict:
        """Time and peak memory of one configuration, each in a fresh process.

        ``interleave``: params of another configuration of the same method, timed
        alternately with this one in the timing process (:func:`~benchmarks.runner.
        time_interleaved`), for a ratio free of the drift between processes.

        With ``--resume``, a record this folder already holds is kept unless it timed
        out or had other parameters (a budget derived from a row measured again).
        """
        raw = self.out / "raw"
        name = f"{problem}__{label.replace(' ', '_').replace('%', 'pct')}"
        name = "".join(c if c.isalnum() or c in "-_.," else "_" for c in name)
        if self.resumed_at and (self.out / f"{name}.json").is_file():
            kept = json.loads((self.out / f"{name}.json").read_text())
            if not kept.get("timeout") and kept.get("params") == params:
                if (raw / f"{name}.pt").is_file():
                    kept["_diag"] = torch.load(raw / f"{name}.pt")
                print(_line(kept) + "  (kept)", flush=True)
                return kept
        kw = {**self.common, "timeout": self.args.timeout}
        memory_kw = {"peak": "hwm", "trim": True, "save_diag": True}
        if self.quick:  # one fresh process: memory first, then time
            memory = timing = run_isolated(
                problem,
                method,
                params,
                "both",
                raw,
                repeats=self.repeats,
                flops=True,
                pin_mmap=False,
                interleave=interleave,
                **memory_kw,
                **kw,
            )
        else:
            memory = run_isolated(
                problem, method, params, "memory", raw, pin_mmap=False, **memory_kw, **kw
            )
            timing = (
                memory
                if "error" in memory
                else run_isolated(
                    problem,
                    method,
                    params,
                    "time",
                    raw,
                    repeats=self.repeats,
                    flops=True,
                    pin_mmap=False,
                    interleave=interleave,
                    **kw,
                )
            )
        record = {
            "problem": problem,
            "label": label,
            "role": role,
            "method": method,
            "params": params,
            "budget": budget,
            **self.common,
        }
        for source in (memory, timing):
            if "error" in source:
                record.setdefault("error", source["error"])
                for key in ("error_type", "error_message", "traceback", "timeout"):
                    if key in source:
                        record.setdefault(key, source[key])
        for key in (
            "peak_mib",
            "cold_peak_mib",
            "memory_method",
            "parameters",
            "batch_size",
        ):
            record[key] = memory.get(key)
        for key in ("cold_error", "cold_call_s", "cold_setup_mib", "cold_setup_s"):
            if key in memory:
                record[key] = memory[key]
        for key in (
            "median_s",
            "times_s",
            "first_call_s",
            "first_call_error",
            "first_call_plain",
            "first_call_setup_s",
            "flops",
            "chunk_size",
            "passes",
            "columns",
            "threads",
            "load_average",
            "interleaved",
        ):
            if key in timing:
                record[key] = timing[key]
        record["load_average_memory_run"] = memory.get("load_average")
        record["threads_setting"] = self.threads
        if self.pinned and "error" not in record:
            pinned = run_isolated(
                problem,
                method,
                params,
                "memory",
                raw,
                pin_mmap=True,
                peak="hwm",
                trim=True,
                **kw,
            )
            record["pinned_peak_mib"] = pinned.get("peak_mib")
            record["pinned_cold_peak_mib"] = pinned.get("cold_peak_mib")
            if "error" in pinned:
                record["pinned_error"] = pinned["error"]
        diag_file = memory.get("diag_file")
        if diag_file and Path(diag_file).is_file():
            diag = torch.load(diag_file)
            if reference is not None and len(reference) == len(diag):
                record["rel_diff"] = max(
                    ((d.double() - r.double()).abs().max() / r.double().abs().max())
                    .nan_to_num(0.0)
                    .item()
                    for d, r in zip(diag, reference, strict=True)
                )
            record["_diag"] = diag
            if role in ("backpack", "one_pass"):  # a reference for --resume
                Path(diag_file).replace(raw / f"{name}.pt")
            else:
                Path(diag_file).unlink()
        if self.resumed_at:
            record["resumed_at"] = self.resumed_at
        saved = {k: v for k, v in record.items() if k != "_diag"}
        (self.out / f"{name}.json").write_text(json.dumps(saved, indent=2))
        print(_line(saved), flush=True)
        return record

    def problem(self, problem: str) -> None:
        """The rows of one problem: BackPACK one pass, ggnchunk one pass, budget, auto."""
        bp = self.measure(
            problem,
            "BackPACK one pass",
            "backpack",
            "backpack",
            BACKPACK_PARAMS.get(problem, {}),
        )
        reference = bp.get("_diag") if "error" not in bp else None
        one = self.measure(
            problem,
            "ggnchunk one pass",
            "one_pass",
            "ggnchunk",
            {"num_chunks": 1},
            reference,
        )
        if reference is None and "error" not in one:
            reference = one.get("_diag")
        if self.args.budget_mib:
            mib = self.args.budget_mib
            budget = {"mib": mib, "source": "fixed (--budget-mib)"}
        elif "error" not in bp and bp.get("peak_mib"):
            mib = max(1.0, BUDGET_FRACTION * bp["peak_mib"])
            budget = {"mib": round(mib, 1), "source": "10% of BackPACK one pass"}
        elif problem in FIXED_BUDGET_MIB or "error" in one or not one.get("peak_mib"):
            mib = FIXED_BUDGET_MIB.get(problem, 300.0)
            budget = {"mib": mib, "source": "fixed (BackPACK cannot run it)"}
        else:
            mib = max(1.0, BUDGET_FRACTION * one["peak_mib"])
            budget = {"mib": round(mib, 1), "source": "10% of ggnchunk one pass"}
        limit = f"{budget['mib']:.1f}MiB"
        self.measure(
            problem,
            "ggnchunk budget",
            "budget",
            "ggnchunk",
            {"max_memory": limit},
            reference,
            budget,
        )
        self.measure(
            problem,
            "ggnchunk auto",
            "auto",
            "ggnchunk",
            {"chunk_size": "auto", "max_memory": limit},
            reference,
            budget,
            interleave={"max_memory": limit},  # auto against budget mode, alternated
        )
        if self.args.extra:
            for label, method, params in extra_configurations(problem, self.quick):
                self.measure(problem, label, "extra", method, params, reference)
            if "error" not in bp and bp.get("peak_mib"):
                for fraction in (0.15, 0.3, 0.5):
                    mib = max(1.0, fraction * bp["peak_mib"])
                    self.measure(
                        problem,
                        f"ggnchunk budget {int(fraction * 100)}%",
                        "extra",
                        "ggnchunk",
                        {"max_memory": f"{mib:.1f}MiB"},
                        reference,
                        {
                            "mib": round(mib, 1),
                            "source": f"{int(fraction * 100)}% of BackPACK",
                        },
                    )

    def run(self, problems: list[str]) -> Path:
        """Measure every problem; write environment.json, table.md and the plots."""
        args = self.args
        env = environment(args.device, self.threads)
        env["matmul_flops_start"] = matmul_peak(args.device, self.threads)
        previous = self.out / "environment.json"
        if self.resumed_at and previous.is_file():  # keep the first run's record
            first = json.loads(previous.read_text())
            resumed = [*first.get("resumed", []), {
                "date": env["date"], "load_average_start": env["load_average_start"],
                "matmul_flops_start": env["matmul_flops_start"], "engine": env["engine"],
            }]  # fmt: skip
            env = {**first, "resumed": resumed}
            env["matmul_flops_start"] = max(
                first.get("matmul_flops", 0.0), resumed[-1]["matmul_flops_start"]
            )
        env["quick"] = self.quick
        env["repeats"] = self.repeats
        env["timeout_s"] = args.timeout
        env["problems"] = problems
        env["note"] = args.note
        env["unet_baseline_s"] = args.unet_baseline_s
        (self.out / "environment.json").write_text(json.dumps(env, indent=2))
        print(
            f"{self.out}: matmul peak {env['matmul_flops_start'] / 1e9:.1f} GFLOP/s "
            f"({env['threads']} thread(s)), load {env['load_average_start']}",
            flush=True,
        )
        start = time.perf_counter()
        for problem in problems:
            self.problem(problem)
        env["matmul_flops_end"] = matmul_peak(args.device, self.threads)
        env["matmul_flops"] = max(env["matmul_flops_start"], env["matmul_flops_end"])
        load = os.getloadavg() if hasattr(os, "getloadavg") else None
        wall = time.perf_counter() - start
        if self.resumed_at and env.get("resumed"):
            env["resumed"][-1].update(load_average_end=load, wall_s=wall)
        else:
            env["load_average_end"], env["wall_s"] = load, wall
        (self.out / "environment.json").write_text(json.dumps(env, indent=2))
        plot.main([str(self.out)])
        return self.out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments of ``python -m benchmarks``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.split("\n\n")[0],
        epilog="Each configuration runs in fresh processes; see benchmarks/__main__.py "
        "for what is measured and how. Problems: " + ", ".join(PROBLEMS),
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="memory and time in one process per configuration, 1 repeat, "
        "no pinned-allocator column",
    )
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        metavar="NAME",
        help=f"problems to run (default: {' '.join(DEFAULT_PROBLEMS)}; on CUDA also "
        f"{' '.join(GPU_PROBLEMS)})",
    )
    parser.add_argument(
        "--threads",
        nargs="+",
        type=int,
        default=[1],
        metavar="N",
        help="thread counts to measure at, one folder each; 0 = torch's "
        "default (default: 1)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed warm calls per configuration (default 3, quick 1)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds per process before a configuration is recorded "
        "as a timeout (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder, one subfolder per device and thread count (default: a new "
        "results/benchmarks/run-<date>-<time>/ at the repository root, git-ignored; "
        "the committed results change only with --out benchmarks/results)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the records an existing results folder holds (without it, a "
        "folder that holds records of an earlier run is refused)",
    )
    parser.add_argument(
        "--pinned",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also measure the warm peak with glibc's mmap threshold "
        "pinned (default: on, off with --quick)",
    )
    parser.add_argument(
        "--budget-mib",
        type=float,
        default=None,
        metavar="MIB",
        help="one fixed budget for every problem instead of 10%% of BackPACK's one pass",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the records the results folders already hold and measure only the "
        "missing ones and those that timed out (marked as measured later)",
    )
    parser.add_argument(
        "--extra",
        action="store_true",
        help="also the older comparisons (fixed chunk counts, 15/30/50%% "
        "budgets, slicing loop, DiagGGNMC, torch.func)",
    )
    parser.add_argument(
        "--results-md",
        type=Path,
        default=None,
        metavar="PATH",
        help="write the tables here (default: <out>/RESULTS.md; with --out "
        "benchmarks/results, benchmarks/RESULTS.md for a full run of the default "
        "problems and nowhere otherwise)",
    )
    parser.add_argument(
        "--note",
        default="",
        help="a line for the results, e.g. what else ran on the machine",
    )
    parser.add_argument(
        "--unet-baseline-s",
        type=float,
        default=UNET_BASELINE_S,
        help="U-Net time the <= 0.5x target is measured against (default: "
        "issue 10's %(default)s s, before the engine rewrite)",
    )
    return parser.parse_args(argv)


def default_out(now: float | None = None) -> Path:
    """A new run's folder: ``results/benchmarks/run-<date>-<time>/`` at the repository root.

    Args:
        now: Seconds since the epoch (default: now), for the folder's name (local time).

    Returns:
        The folder (not created); git ignores ``results/``.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return HERE.parent / "results" / "benchmarks" / f"run-{stamp}"


def thread_folders(out: Path, device: str, threads: list[int]) -> list[Path]:
    """The per-device, per-thread-count folders a run writes under ``out``."""
    return [out / f"{device}-{'default' if t == 0 else f'{t}t'}" for t in threads]


def check_out(args: argparse.Namespace) -> None:
    """Refuse to mix a new run into a folder holding an earlier run's records.

    Raises:
        SystemExit: A folder under ``args.out`` holds records and neither ``--resume``
            nor ``--overwrite`` was given; the message names the folder and the fix.
    """
    if args.resume and args.overwrite:
        raise SystemExit("--resume keeps a folder's records, --overwrite deletes them: "
                         "pass one of them")  # fmt: skip
    if args.resume or args.overwrite:
        return
    for folder in thread_folders(args.out, args.device, args.threads):
        if any(folder.glob("*__*.json")):
            committed = folder.resolve().parent == COMMITTED.resolve()
            raise SystemExit(
                f"{folder} holds the records of an earlier run"
                + (" (the committed results)" if committed else "")
                + ": leave out --out to write a new run to results/benchmarks/, or pass "
                "--overwrite to replace them, or --resume to measure only what is missing"
            )


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark suite (see the module docstring)."""
    args = parse_args(argv)
    default = DEFAULT_PROBLEMS + (GPU_PROBLEMS if args.device == "cuda" else ())
    problems = list(args.only or default)
    unknown = [p for p in problems if p not in PROBLEMS]
    if unknown:
        raise SystemExit(f"unknown problem(s) {unknown}; choose from {list(PROBLEMS)}")
    if args.quick and args.only is None:
        problems = [p for p in problems if p not in QUICK_SKIPPED]
        print(f"--quick leaves out {', '.join(sorted(QUICK_SKIPPED))} (run them with "
              "--only)", flush=True)  # fmt: skip
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available here")
    committed_out = args.out is not None and args.out.resolve() == COMMITTED.resolve()
    if args.out is None and args.resume:
        raise SystemExit("--resume completes an earlier run: pass its folder with --out")
    if args.out is None:
        args.out = default_out()
    check_out(args)
    print(f"writing to {args.out}", flush=True)
    folders = [Bench(args, threads).run(problems) for threads in args.threads]
    results_md = args.results_md
    if results_md is None:
        if not committed_out:
            results_md = args.out / "RESULTS.md"
        elif not args.quick and args.only is None:
            results_md = HERE / "RESULTS.md"
    if results_md is not None:
        if args.resume:  # the folders this run did not touch stay in the results
            others = sorted(args.out.glob(f"{args.device}-*/environment.json"))
            folders += [f.parent for f in others if f.parent not in folders]
        results_md.write_text(plot.results_markdown(folders))
        print(f"wrote {results_md}")


def _line(r: dict) -> str:
    head = f"{r['problem']:18s} {r['label']:20s}"
    if "error" in r:
        return f"{head} failed: {r['error'][:100]}"
    flops = f"{r['flops'] / r['median_s'] / 1e9:6.2f} GFLOP/s" if r.get("flops") else ""
    first = (
        f" first call {r['first_call_s']:.3f} s"
        if r.get("first_call_plain") and "first_call_error" not in r
        else ""
    )
    return (
        f"{head} {r['peak_mib']:9.1f} MiB {r['median_s']:8.3f} s {flops} "
        f"passes {r.get('passes') or 1} diff {r.get('rel_diff', float('nan')):.1e}{first}"
    )


if __name__ == "__main__":
    main()
