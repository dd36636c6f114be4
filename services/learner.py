"""Entry point of the learner service: `python services/learner.py --run-dir RUN --policy DIR [...]`.

The same as `tlt-stream learner`; see `--help`. One learner per run: it owns the policy version.
"""

from __future__ import annotations

import sys

from tlt_stream.commands.cli import console

if __name__ == "__main__":
    sys.exit(console(["learner", *sys.argv[1:]]))
