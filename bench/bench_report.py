"""Where the time of ``ddplab report`` goes: every case with default parameters, one batch per ``--jobs``.

A first batch pays one-time costs (numba compiling the emulated orders into
its on-disk cache, Python's bytecode caches) and is not counted; then one
batch per value of ``--jobs`` (default: 1, then 2 as ``make report`` runs),
back to back, so their ratio is measured at the same load. For each case of
a batch it prints the case's own time and splits it, from what the run
itself recorded:

* ``launch``: the case's launches (``launch_seconds`` records: forkserver,
  process groups, training and the measurements inside the ranks);
* ``cells``: every other notebook cell (imports, setup, tables, figures,
  verdict), from papermill's per-cell durations;
* ``kernel, papermill``: the rest of the case's time -- papermill's start,
  the kernel's start and shutdown, saving the notebook after each cell.

The HTML export and the other files of each case are written after its time
is taken: they are part of the batch's wall time only.

With ``--jobs 2`` two cases share the cores, so each case's own time grows
while the batch's wall time shrinks; read the split from the ``--jobs 1``
batch. Times on a shared machine move with its load, which is printed beside
them. No target is asserted here; the README quotes the printed figures.

    python bench/bench_report.py [--jobs 1 2] [--keep DIR] [case ...]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _common import machine_line  # noqa: E402


def _launch_seconds(case_dir: pathlib.Path) -> float:
    total = 0.0
    with open(case_dir / "results" / "records.jsonl") as fh:
        for line in fh:
            if '"launch_seconds"' in line:
                row = json.loads(line)
                if row["metric"] == "launch_seconds":
                    total += row["value"]
    return total


def _cell_seconds(case_dir: pathlib.Path) -> list[tuple[str, float]]:
    """``(first source line, seconds)`` of every code cell papermill ran."""
    nb = json.loads((case_dir / "notebook.ipynb").read_text())
    out = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        meta = cell.get("metadata", {}).get("papermill", {})
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        out.append((source.strip().splitlines()[0] if source.strip() else "", float(meta.get("duration") or 0)))
    return out


def breakdown(out_dir: pathlib.Path) -> list[dict]:
    """One row per case of a finished batch: total, launch, other cells, rest (seconds)."""
    index = json.loads((out_dir / "index.json").read_text())
    rows = []
    for case in index["cases"]:
        case_dir = out_dir / case["name"]
        launch = _launch_seconds(case_dir) if (case_dir / "results" / "records.jsonl").exists() else 0.0
        timed = _cell_seconds(case_dir) if (case_dir / "notebook.ipynb").exists() else []
        cells = sum(s for _, s in timed)
        run_cell = next((s for src, s in timed if ".run(" in src), 0.0)
        rows.append({"case": case["name"], "status": case["status"], "total": case["seconds"],
                     "launch": launch, "run_cell_rest": max(run_cell - launch, 0.0),
                     "cells": cells - run_cell, "other": case["seconds"] - cells})
    return rows


def _batch(out: pathlib.Path, cases: list[str], jobs: int) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ddplab", "report", *cases, "--output", str(out),
                           "--jobs", str(jobs)], capture_output=True, text=True)
    return time.perf_counter() - t0, proc


def _print_breakdown(rows: list[dict]) -> None:
    print(f"  {'case':<24} {'status':<11} {'total':>7} {'launch':>7} {'run cell, rest':>15} "
          f"{'other cells':>12} {'kernel, papermill':>18}")
    for r in rows:
        print(f"  {r['case']:<24} {r['status']:<11} {r['total']:7.1f} {r['launch']:7.1f} "
              f"{r['run_cell_rest']:15.1f} {r['cells']:12.1f} {r['other']:18.1f}")
    print(f"  {'sum':<24} {'':<11} {sum(r['total'] for r in rows):7.1f} "
          f"{sum(r['launch'] for r in rows):7.1f} {sum(r['run_cell_rest'] for r in rows):15.1f} "
          f"{sum(r['cells'] for r in rows):12.1f} {sum(r['other'] for r in rows):18.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2],
                        help="one measured batch per value, in this order (default: 1 2)")
    parser.add_argument("--keep", help="write the reports here instead of a temporary folder")
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(args.keep or tmp) / "reports"
        wall, proc = _batch(out, args.cases, max(args.jobs))
        print(f"\n== warm-up batch (not counted): {wall:.1f} s, exit {proc.returncode}")
        walls = {}
        for jobs in args.jobs:
            wall, proc = _batch(out, args.cases, jobs)
            walls[jobs] = wall
            print(f"\n== `ddplab report {' '.join(args.cases)} --jobs {jobs}`: {wall:.1f} s wall, "
                  f"exit {proc.returncode}; {machine_line()}")
            _print_breakdown(breakdown(out))
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n")
        if len(walls) > 1:
            first = args.jobs[0]
            print("\n" + "; ".join(f"--jobs {j}: {w:.1f} s ({w / walls[first]:.2f}x --jobs {first})"
                                    for j, w in walls.items()))


if __name__ == "__main__":
    main()
