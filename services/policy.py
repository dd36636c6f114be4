"""Entry point: `python services/policy.py [...]`, the same as `tlt-stream policy`; see `--help`."""

from __future__ import annotations

import sys

from tlt_stream.cli import main

if __name__ == "__main__":
    sys.exit(main(["policy", *sys.argv[1:]]))
