"""Draw the benchmark results: ``python -m benchmarks.plot results/benchmarks/cpu``.

Reads the per-configuration JSON files and ``environment.json`` of one device folder,
writes ``table.md`` (every problem × method: peak memory, time, ratios to BackPACK's one
pass, achieved FLOP/s, error) and, with matplotlib, ``<problem>.png``: peak extra memory
and time against the number of backward passes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def load(folder: Path) -> tuple[dict, dict[str, list[dict]]]:
    """Environment and records grouped by problem."""
    env = json.loads((folder / "environment.json").read_text())
    groups: dict[str, list[dict]] = defaultdict(list)
    for path in sorted(folder.glob("*__*.json")):
        record = json.loads(path.read_text())
        groups[record["problem"]].append(record)
    return env, groups


def table(env: dict, groups: dict[str, list[dict]]) -> str:
    """Markdown table with ratios against BackPACK's one pass of the same problem."""
    peak_flops = env.get("matmul_flops", float("nan"))
    lines = [
        f"Device: {env.get('gpu', env.get('cpu'))} ({env['device']}), "
        f"{env['threads']} thread(s), torch {env['torch']}, BackPACK {env['backpack']}; "
        f"matmul peak {peak_flops / 1e9:.1f} GFLOP/s. Peak = extra memory above the level "
        "before the call (warm call, fresh process); time = median; error = max relative "
        "error against a float64 reference (ggnchunk in float64, itself checked against "
        "a torch.func brute force in the tests).",
        "",
        "| problem | method | passes | peak [MiB] | peak / one pass | time [s] | "
        "time / one pass | GFLOP/s (% of matmul) | rel. error |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for problem, records in groups.items():
        base = next((r for r in records if r["label"] == "backpack one pass"), None)
        order = sorted(records, key=lambda r: (r["method"] != "backpack", r["label"]))
        for r in order:
            if "error" in r:
                lines.append(f"| {problem} | {r['label']} | | failed: {r['error'][:60]} |"
                             " | | | | |")  # fmt: skip
                continue
            mem_ratio = time_ratio = ""
            if base and "error" not in base and base["peak_mib"]:
                mem_ratio = f"{r['peak_mib'] / base['peak_mib']:.2f}"
                time_ratio = f"{r['median_s'] / base['median_s']:.2f}"
            rate = ""
            if r.get("flops"):
                achieved = r["flops"] / r["median_s"]
                rate = f"{achieved / 1e9:.2f} ({100 * achieved / peak_flops:.0f}%)"
            err = f"{r['rel_error']:.1e}" if r.get("rel_error") is not None else ""
            lines.append(
                f"| {problem} | {r['label']} | {r.get('passes') or 1} | "
                f"{r['peak_mib']:,.1f} | "
                f"{mem_ratio} | {r['median_s']:.3f} | {time_ratio} | {rate} | {err} |"
            )
    return "\n".join(lines) + "\n"


def plot(folder: Path, groups: dict[str, list[dict]]) -> list[Path]:
    """One PNG per problem; returns the paths (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install -e '.[bench]' to draw the plots")
        return []
    paths = []
    for problem, records in groups.items():
        fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(10, 4))
        series = {"ggnchunk": [], "slicing": []}
        for r in records:
            if "error" in r or "num_chunks" not in r["params"]:
                continue
            series.get(r["method"], []).append((r["params"]["num_chunks"], r))
        for name, points in series.items():
            points.sort(key=lambda p: p[0])
            if points:
                xs = [p[0] for p in points]
                ax_mem.plot(xs, [p[1]["peak_mib"] for p in points], "o-", label=name)
                ax_time.plot(xs, [p[1]["median_s"] for p in points], "o-", label=name)
        for r in records:
            if "error" in r:
                continue
            if r["label"] == "backpack one pass":
                ax_mem.axhline(r["peak_mib"], color="k", ls="--", label="BackPACK one pass")
                ax_time.axhline(
                    r["median_s"], color="k", ls="--", label="BackPACK one pass"
                )
            elif r["method"] == "ggnchunk" and "num_chunks" not in r["params"]:
                passes = r.get("passes") or 1
                ax_mem.plot(passes, r["peak_mib"], "s", label=r["label"])
                ax_time.plot(passes, r["median_s"], "s", label=r["label"])
        for ax, ylabel in ((ax_mem, "peak extra memory [MiB]"), (ax_time, "time [s]")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("backward passes")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        ax_mem.set_yscale("log")
        ax_time.legend(fontsize=7)
        fig.suptitle(problem)
        fig.tight_layout()
        path = folder / f"{problem}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments of ``python -m benchmarks.plot``.

    Args:
        argv: The arguments without the program name; ``sys.argv[1:]`` by default.

    Returns:
        The parsed arguments (``folder``).
    """
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plot",
        description="Draw the benchmark results of one device folder: write table.md "
        "(every problem x method: peak memory, time, ratios to BackPACK's one pass, "
        "FLOP/s, error) and, with matplotlib, one <problem>.png per problem.",
    )
    parser.add_argument(
        "folder",
        nargs="?",
        type=Path,
        default=Path("results/benchmarks/cpu"),
        help="folder with environment.json and the per-configuration JSON files "
        "written by `python -m benchmarks` (default: %(default)s)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Write ``table.md`` (and the plots) for the folder named on the command line.

    Args:
        argv: The arguments without the program name; ``sys.argv[1:]`` by default.
    """
    folder = parse_args(argv).folder
    if not (folder / "environment.json").is_file():
        sys.exit(
            f"error: {folder} has no environment.json; pass the folder that "
            "`python -m benchmarks` wrote (e.g. results/benchmarks/cpu)."
        )
    env, groups = load(folder)
    text = table(env, groups)
    (folder / "table.md").write_text(text)
    print(text)
    for path in plot(folder, groups):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
