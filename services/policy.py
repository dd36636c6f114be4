"""Entry point: `python services/policy.py [...]`, the same as `tlt-stream policy`; see `--help`."""

from __future__ import annotations

import sys

from tlt_stream.commands.cli import console

if __name__ == "__main__":
    sys.exit(console(["policy", *sys.argv[1:]]))
