"""``ddplab`` / ``python -m ddplab``: the command line.

    ddplab report [CASE ...] [-p NAME VALUE ...] [--params FILE] [--quick]
                  [--output DIR] [--no-input] [--timeout SECONDS]
    ddplab run CASE|MODULE:FUNC --out DIR [-p NAME VALUE ...]   (under torchrun)
    ddplab cases                      list the cases and their parameters
"""
from __future__ import annotations

import argparse
import math
import sys

__all__ = ["main", "build_parser"]


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0 (``nan`` would mean no timeout at all)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def _cmd_report(opts) -> int:
    from ddplab.report import run_report
    return run_report(opts)


def _cmd_run(opts) -> int:
    from ddplab.torchrun import run_rank
    try:
        return run_rank(opts.target, opts.out, dict(opts.param or ()), backend=opts.backend,
                        timeout=opts.timeout)
    except ValueError as exc:
        print(f"ddplab run: {exc}", file=sys.stderr)
        return 2


def _cmd_cases(opts) -> int:
    from ddplab.cases import CASES, get_case
    for name in CASES:
        module = get_case(name)
        print(f"{name}  ({CASES[name][1]}, seed {module.SEED})\n  {module.TITLE}")
        for line in module.PARAMETERS.help().splitlines():
            print(f"    {line}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ddplab.report import DEFAULT_TIMEOUT, NOTEBOOK_DIR

    parser = argparse.ArgumentParser(prog="ddplab", description="Reproduce data-parallel training "
                                     "reports, measure them exactly, publish reports.")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="run the case notebooks and publish reports/",
                            description="Run case notebooks with papermill; write HTML reports, "
                            "Markdown summaries and reports/index.html.")
    report.add_argument("cases", nargs="*", help="cases to run (default: all); see 'ddplab cases'")
    report.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"),
                        help="set a parameter for every selected case that has it "
                             "(lists as [2, 4] or 2,4)")
    report.add_argument("--params", metavar="FILE",
                        help="YAML parameters: {case: {name: value}} or {name: value}")
    report.add_argument("--quick", action="store_true", help="small parameters: seconds per case")
    report.add_argument("--output", default="reports", help="output folder (default: reports)")
    report.add_argument("--no-input", action="store_true",
                        help="hide code cells in the HTML (outputs and tracebacks stay)")
    report.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT,
                        help=f"seconds per notebook before it is stopped (default {DEFAULT_TIMEOUT:g})")
    report.add_argument("--notebooks", default=str(NOTEBOOK_DIR), help=argparse.SUPPRESS)
    report.set_defaults(func=_cmd_report)
    run = sub.add_parser("run", help="run a case on this rank (start it with torchrun)",
                         description="Run a case's worker (or MODULE:FUNC) on every torchrun rank; "
                         "rank 0 writes the merged results folder that notebooks read as run_dir.")
    run.add_argument("target", help="a case name (see 'ddplab cases') or MODULE:FUNCTION")
    run.add_argument("--out", required=True, help="the run folder (rank files, merged results)")
    run.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"),
                     help="set a case parameter")
    run.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    run.add_argument("--timeout", type=_seconds, default=1800.0,
                     help="seconds any collective may wait for a peer (default 1800)")
    run.set_defaults(func=_cmd_run)
    cases = sub.add_parser("cases", help="list the cases and their parameters")
    cases.set_defaults(func=_cmd_cases)
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    return opts.func(opts)


if __name__ == "__main__":
    sys.exit(main())
