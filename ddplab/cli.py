"""``python -m ddplab`` / ``ddplab``: the command line."""
from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _cmd_report(opts) -> int:
    from ddplab.report import run_report
    return run_report(opts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddplab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="run the case notebooks and publish reports/")
    report.set_defaults(func=_cmd_report)
    opts = parser.parse_args(argv)
    return opts.func(opts)


if __name__ == "__main__":
    sys.exit(main())
