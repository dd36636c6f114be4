"""Entry point: `python services/rollout_worker.py [...]`, the same as `tlt-stream rollout-worker`; see `--help`."""

from __future__ import annotations

import sys

from tlt_stream.commands.cli import console

if __name__ == "__main__":
    sys.exit(console(["rollout-worker", *sys.argv[1:]]))
