"""What the side-by-side (A/B) benchmarks share: the setting, alternating timings, output.

An A/B benchmark runs the same ``diag_ggn`` call with an internal switch on and off in
one process at 1 thread, alternating: one untimed call of each, then the best of
``repeats`` timed calls. :func:`alternate` does that; :func:`environment` and
:func:`write` record the setting and write ``NAME.json`` and ``NAME.md`` (and the plot)
into the run's folder.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def environment(repeats: int) -> dict:
    """The run's setting: machine, torch, Python, commit, threads and repeats."""
    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__, "python": sys.version.split()[0], "commit": commit,
        "threads": torch.get_num_threads(), "repeats": repeats,
    }  # fmt: skip


def alternate(
    paths: dict[str, Callable[[], Any]], call: Callable[[], Any], repeats: int
) -> dict[str, dict]:
    """Time ``call`` under each path's setting, alternating; one untimed round first.

    Args:
        paths: ``{name: set}``: ``set()`` switches the path on before its call.
        call: The call; returns ``(diag, report)`` (``diag_ggn(..., return_report=True)``).
        repeats: Timed calls per path.

    Returns:
        ``{name: {"seconds", "all_seconds", "passes", "peak_mib", "diag"}}``: the best
        time, every time, and the last call's passes, peak and diagonal.
    """
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    result: dict[str, dict] = {}
    for round_ in range(repeats + 1):
        for name, switch in paths.items():
            switch()
            start = time.perf_counter()
            diag, report = call()
            if round_:  # the first round is untimed
                seconds[name].append(time.perf_counter() - start)
            peak = report.peak_extra_bytes
            result[name] = {
                "passes": report.num_passes,
                "peak_mib": None if peak is None else peak / 2**20,
                "diag": diag,
            }
    for name in paths:
        result[name].update(seconds=min(seconds[name]), all_seconds=seconds[name])
    return result


def compare(
    module: Any, switch: str, names: tuple[str, str], built: tuple, chunking: dict,
    repeats: int, call: Callable[[], Any] | None = None, **fields: Any,
) -> dict:  # fmt: skip
    """One row: ``diag_ggn`` with ``module.switch`` off (``names[0]``) and on, alternating.

    Args:
        module: The module holding the internal switch (left on afterwards).
        switch: The switch's name.
        names: The two paths' names, off first.
        built: ``(model, loss_func, inputs, targets)``.
        chunking: ``diag_ggn``'s chunking arguments.
        repeats: Timed calls per path.
        call: Another call to time instead of ``diag_ggn`` (returning ``(result,
            report)``; a tensor result is compared as one diagonal).
        fields: Put into the row first (the problem's title, its batch).

    Returns:
        The row: the fields, the chunking, each path's :func:`alternate` record (without
        the diagonal), the float32 gap between the paths and the speed-up.
    """
    import ggnchunk

    model, loss_func, x, y = built

    def setting(on: bool) -> Callable[[], None]:
        return lambda: setattr(module, switch, on)

    try:
        result = alternate(
            {names[0]: setting(False), names[1]: setting(True)},
            call
            or (
                lambda: ggnchunk.diag_ggn(
                    model, loss_func, x, y, return_report=True, **chunking
                )
            ),
            repeats,
        )
    finally:
        setattr(module, switch, True)
    row = {
        **fields, "chunking": chunking,
        "max_relative_gap_float32": relative_gap(
            result[names[0]]["diag"], result[names[1]]["diag"]
        ),
    }  # fmt: skip
    for name in names:
        result[name].pop("diag")
        row[name] = result[name]
    row["speedup"] = row[names[0]]["seconds"] / row[names[1]]["seconds"]
    print(json.dumps(row), flush=True)
    return row


def cells(row: dict, names: tuple[str, str]) -> str:
    """A row's shared table cells: chunking, both times, speed-up, passes, peaks, gap."""
    a, b = row[names[0]], row[names[1]]
    peaks = "/".join(
        "–" if p["peak_mib"] is None else f"{p['peak_mib']:.0f}" for p in (a, b)
    )
    chunking = ", ".join(f"{k}={v}" for k, v in row["chunking"].items()) or "one pass"
    return (
        f"{chunking} | {a['seconds']:.2f} s | {b['seconds']:.2f} s | {row['speedup']:.1f}× "
        f"| {a['passes']} / {b['passes']} | {peaks} MiB "
        f"| {row['max_relative_gap_float32']:.1e} |"
    )


def relative_gap(a: dict, b: dict) -> float:
    """The largest difference of two diagonals, relative to each parameter's largest."""
    if not isinstance(a, dict):  # one tensor (output variances)
        a, b = {"": a}, {"": b}
    return max(
        float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-30)) for k in a
    )


def write(
    out: Path, name: str, record: dict, table: str, plot: Callable[[Path], None]
) -> None:
    """Write ``NAME.json``, ``NAME.md`` and ``NAME.png`` into ``out`` (made if missing).

    Args:
        out: The run's folder.
        name: The files' stem.
        record: The JSON's content (the environment and the rows).
        table: The markdown table.
        plot: Draws the plot into the path it is given (needs matplotlib).
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(record, indent=1))
    (out / f"{name}.md").write_text(table)
    plot(out / f"{name}.png")
    print(table)


def table(
    title: str, note: str, environment: dict, rows: list[dict], names: tuple[str, str],
    columns: tuple[str, str, str], batch: bool = False,
) -> str:  # fmt: skip
    """The markdown table of an A/B run: a heading, the run's line, one row per problem.

    Args:
        title: The heading.
        note: Sentences after the run's line (what the two paths are), or ``""``.
        environment: :func:`environment`'s record.
        rows: :func:`compare`'s rows.
        names: The two paths' names, off first.
        columns: The two paths' column headers and the peaks' ``"a / b"``.
        batch: Whether a batch column (the rows' ``"batch"``) follows the problem.
    """
    lines = [
        f"# {title}",
        "",
        f"1 thread, {environment['machine']}, torch {environment['torch']}, commit "
        f"{environment['commit']}, alone on the machine; float32; best of "
        f"{environment['repeats']} after an untimed call, the two paths alternating in "
        "one process. " + (f"{note} " if note else "") + "JSON beside this file.",
        "",
        f"| problem | {'N | ' if batch else ''}chunking | {columns[0]} | {columns[1]} | "
        f"speed-up | passes | peak ({columns[2]}) | float32 relative gap |",
        f"|---|{'---:|' if batch else ''}---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        size = f" {r['batch']} |" if batch else ""
        lines.append(f"| {r['problem']} |{size} {cells(r, names)}")
    return "\n".join(lines) + "\n"


def bars(
    rows: list[dict], names: tuple[str, str], legend: tuple[str, str], labels: list[str],
    path: Path, size: tuple[float, float] = (8, 4), log: bool = False, fontsize=None,
) -> None:  # fmt: skip
    """A bar plot of an A/B run's seconds, the two paths side by side per row.

    Args:
        rows: :func:`compare`'s rows.
        names: The two paths' names in the rows, off first.
        legend: Their labels in the plot.
        labels: One tick label per row.
        path: Where the PNG goes.
        size: The figure's size in inches.
        log: A logarithmic time axis.
        fontsize: The tick labels' size (matplotlib's default where ``None``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    xs = range(len(rows))
    for shift, name, label in ((-0.2, names[0], legend[0]), (0.2, names[1], legend[1])):
        ax.bar([x + shift for x in xs], [r[name]["seconds"] for r in rows], 0.4,
               label=label)  # fmt: skip
    ax.set_xticks(list(xs), labels, fontsize=fontsize)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel("seconds (1 thread)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def case_row(
    module: Any, switch: str, names: tuple[str, str], case: tuple, repeats: int
) -> dict:
    """:func:`compare` for one case ``(name, title, builder, batch, chunking)``, seeded.

    Args:
        module: The module holding the internal switch.
        switch: The switch's name.
        names: The two paths' names, off first.
        case: The case: its short name, its title, ``builder(batch) -> (model,
            loss_func, inputs, targets)``, the batch size and the chunking arguments.
        repeats: Timed calls per path.

    Returns:
        The row, named ``"NAME N=BATCH"``.
    """
    import torch

    name, title, builder, n, chunking = case[:5]
    torch.manual_seed(0)
    return compare(
        module, switch, names, builder(n), chunking, repeats, problem=title,
        name=f"{name} N={n}", batch=n,
    )  # fmt: skip


def batch_bars(rows: list[dict], names: tuple[str, str], path: Path) -> None:
    """:func:`bars` with each row's name and chunking under its bars."""
    labels = [f"{r['name']}\n{cells(r, names).split(' | ')[0]}" for r in rows]
    bars(rows, names, names, labels, path, fontsize=7)


def main(
    argv: list[str] | None, doc: str, name: str, repeats: int,
    rows: Callable[[int], list[dict]], make_table: Callable[[list[dict], dict], str],
    plot: Callable[[list[dict], Path], None],
) -> None:  # fmt: skip
    """An A/B benchmark's command line: ``[--out DIR] [--repeats K] [--quick]``, 1 thread.

    Runs the rows, then writes ``NAME.json``, ``NAME.md`` and ``NAME.png`` into
    ``--out`` (default ``benchmarks/results/NAME`` with ``-`` for ``_``).

    Args:
        argv: The arguments (``sys.argv[1:]`` where ``None``).
        doc: The benchmark's docstring (its first line describes the command).
        name: The files' stem.
        repeats: The default of ``--repeats``.
        rows: Makes the rows for a number of repeats.
        make_table: The markdown table of the rows and the environment.
        plot: Draws the rows into a path.
    """
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=f"benchmarks/results/{name.replace('_', '-')}")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--quick", action="store_true", help="one timed call per path")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    repeats = 1 if args.quick else args.repeats
    setting = environment(repeats)
    found = rows(repeats)
    record = {"environment": setting, "rows": found}
    table_ = make_table(found, setting)
    write(Path(args.out), name, record, table_, lambda path: plot(found, path))


def switch_main(
    argv: list[str] | None, doc: str, name: str, repeats: int, module: str,
    switch: str, names: tuple[str, str], cases: list[tuple], title: str, ratio: str,
) -> None:  # fmt: skip
    """:func:`main` for the common shape: one switch, a row per case, bars per row.

    Args:
        argv: The arguments (``sys.argv[1:]`` where ``None``).
        doc: The benchmark's docstring.
        name: The files' stem.
        repeats: The default of ``--repeats``.
        module: The dotted name of the module holding the switch (imported when run).
        switch: The switch's name.
        names: The two paths' names, off first.
        cases: The cases (:func:`case_row`).
        title: The table's title.
        ratio: The ratio column's header.
    """
    import importlib

    def rows(k: int) -> list[dict]:
        holder = importlib.import_module(module)
        return [case_row(holder, switch, names, case, k) for case in cases]

    def make_table(found: list[dict], setting: dict) -> str:
        return table(title, "", setting, found, names, (*names, ratio), batch=True)

    main(argv, doc, name, repeats, rows, make_table,
         lambda found, path: batch_bars(found, names, path))  # fmt: skip
