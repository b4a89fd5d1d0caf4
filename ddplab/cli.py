"""``ddplab`` / ``python -m ddplab``: the command line.

    ddplab report [CASE ...] [-p NAME VALUE ...] [--params FILE] [--quick]
                  [--output DIR] [--no-input] [--timeout SECONDS] [--jobs N]
    ddplab run CASE|MODULE:FUNC --out DIR [-p NAME VALUE ...]   (under torchrun)
    ddplab new-notebook CASE [-o FILE]  write a case's notebook from the template
    ddplab cases                      list the cases and their parameters
"""
from __future__ import annotations

import argparse
import math
import os
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


def _jobs(text: str) -> int:
    """An argparse type: how many notebooks run at once, an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _cmd_report(opts) -> int:
    from ddplab.report import run_report
    return run_report(cases=opts.cases, overrides=opts.param or (), params_file=opts.params,
                      quick=opts.quick, output=opts.output, no_input=opts.no_input,
                      timeout=opts.timeout, jobs=opts.jobs)


def _cmd_run(opts) -> int:
    from ddplab.torchrun import run_rank
    try:
        code = run_rank(opts.target, opts.out, dict(opts.param or ()), backend=opts.backend,
                        timeout=opts.timeout)
    except ValueError as exc:
        print(f"ddplab run: {exc}", file=sys.stderr)
        return 2
    # The rank joined the job, saved what it owes and left with every peer. End here, without
    # the interpreter's finalization: a process group that C++ still holds (a DDP reducer kept
    # alive by torch.compile's caches) outlives destroy_process_group, and its gloo threads,
    # taking the GIL while the interpreter shuts down, abort the process (SIGABRT, "terminate
    # called without an active exception") after the work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cmd_cases(opts) -> int:
    from ddplab.cases import builtin_cases
    for case in builtin_cases():
        print(f"{case.name}  (notebook {case.notebook})\n  {case.title}")
        for line in case.parameters.help().splitlines():
            print(f"    {line}")
    return 0


def _cmd_new_notebook(opts) -> int:
    import pathlib

    import nbformat

    from ddplab.notebook import template_notebook
    try:
        nb = template_notebook(opts.case, case_path=opts.case)
        from ddplab.cases import get_case
        out = pathlib.Path(opts.output) if opts.output else get_case(opts.case).notebook_path()
    except ValueError as exc:
        print(f"ddplab new-notebook: {exc}", file=sys.stderr)
        return 2
    if out.exists() and not opts.force:
        print(f"ddplab new-notebook: {out} exists (--force replaces it)", file=sys.stderr)
        return 2
    nbformat.write(nb, out)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ddplab.report import DEFAULT_TIMEOUT

    parser = argparse.ArgumentParser(prog="ddplab", description="Reproduce data-parallel training "
                                     "reports, measure them exactly, publish reports.")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="run the case notebooks and publish reports/",
                            description="Run case notebooks with papermill; write HTML reports, "
                            "Markdown summaries and reports/index.html.")
    report.add_argument("cases", nargs="*", help="cases to run (default: all built-in ones; see "
                        "'ddplab cases'), or a case module's path such as mypackage.mycase")
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
                        help=f"seconds per notebook before it is stopped, and per case for checking its "
                             f"parameters (which may import and call your setup) (default {DEFAULT_TIMEOUT:g})")
    report.add_argument("--jobs", type=_jobs, default=1, metavar="N",
                        help="notebooks run at once (default 1; 2 on 2 cores: the batch in about "
                             "three quarters of the time, each case slower)")
    report.set_defaults(func=_cmd_report)
    run = sub.add_parser("run", help="run a case on this rank (start it with torchrun)",
                         description="Run a case's worker (or MODULE:FUNC) on every torchrun rank; "
                         "rank 0 writes the merged results folder that notebooks read as run_dir.")
    run.add_argument("target", help="a case name (see 'ddplab cases'), a case module's path "
                     "(mypackage.mycase) or MODULE:FUNCTION")
    run.add_argument("--out", required=True, help="the run folder (rank files, merged results)")
    run.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"),
                     help="set a case parameter")
    run.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    run.add_argument("--timeout", type=_seconds, default=1800.0,
                     help="seconds any collective may wait for a peer (default 1800)")
    run.set_defaults(func=_cmd_run)
    new = sub.add_parser("new-notebook", help="write the notebook of a case (its parameters cell "
                         "mirrors the case's parameters)",
                         description="Write a case's notebook from ddplab's template: the parameters "
                         "cell from the case's declared parameters, then run, figures and verdict.")
    new.add_argument("case", help="the case: its module path, e.g. mypackage.mycase")
    new.add_argument("-o", "--output", help="where to write it (default: the case's notebook path)")
    new.add_argument("--force", action="store_true", help="replace an existing file")
    new.set_defaults(func=_cmd_new_notebook)
    cases = sub.add_parser("cases", help="list the cases and their parameters")
    cases.set_defaults(func=_cmd_cases)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ddplab.notebook_run import skip_iri_checker
    skip_iri_checker()  # before any nbformat import: 2 s off every command
    opts = build_parser().parse_args(argv)
    return opts.func(opts)


if __name__ == "__main__":
    sys.exit(main())
