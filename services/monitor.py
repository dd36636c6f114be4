"""Entry point of the monitor: `python -m services.monitor [--prometheus PORT] [--bind ADDRESS] [...]`.

The same as `tlt-stream monitor`; see `--help`. Reads the run's Redis only (TLT_REDIS_URL, TLT_RUN) and
stops cleanly on SIGTERM. Without a terminal it shows no dashboard: serve `--prometheus` or use `--json`.
"""

from __future__ import annotations

import sys

from tlt_stream.commands.cli import console

if __name__ == "__main__":
    sys.exit(console(["monitor", *sys.argv[1:]]))
