"""The `tlt-stream` subcommands, one module each: `register(commands)` adds its parser (arguments and
help), `handle(args)` runs it and imports what it needs (torch, redis, ...) only then, so `--help` answers
at once."""

from __future__ import annotations

COMMANDS = (
    "doctor",
    "generate",
    "bootstrap",
    "evaluate",
    "export_drafter",
    "drafter",
    "run",
    "report",
    "purge",
    "plan",
    "learner",
    "rollout_worker",
    "policy",
    "monitor",
    "config",
    "compose",
)
"""The subcommand modules, in the order `tlt-stream --help` lists them."""
