"""`tlt-stream report`: plots and an HTML page for a run directory."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    rep = commands.add_parser("report", help="plots and an HTML page for a run directory")
    rep.add_argument("run_dir", help="a run directory written by `tlt-stream run` or the learner")
    rep.add_argument("-v", "--verbose", action="count", default=0)
    rep.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from tlt_stream.report import write_report

    try:
        page = write_report(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"tlt-stream report: {exc}", file=sys.stderr)
        return 1
    print(page)
    return 0
