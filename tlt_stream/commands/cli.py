"""The `tlt-stream` command: the parser (each subcommand registers its own arguments, `tlt_stream/commands/`),
logging that never prints a secret, and the process entry. Nothing heavy is imported to parse arguments, so
`--help` answers at once; each subcommand imports what it needs only when it runs."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from tlt_stream.commands import COMMANDS
from tlt_stream.commands.args import EXIT_CONFIG

__all__ = ["Parser", "RedactingFormatter", "build_parser", "console", "main", "setup_logging"]


class Parser(argparse.ArgumentParser):
    """argparse with a usage error in one line (which command, what is wrong, where the help is) instead of
    the command's whole usage block above it, in which the one line that matters was easy to miss. Its
    subcommands' parsers are of the same class (`add_subparsers` takes the parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_CONFIG, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="tlt-stream",
        description="Reasoning-RL training that tames the long tail: adaptive speculative decoding with an "
        "online drafter, streamed through Redis and MQTT.",
    )
    from tlt_stream import __version__

    parser.add_argument("--version", action="version", version=f"tlt-stream {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"tlt_stream.commands.{name}").register(commands)
    return parser


class RedactingFormatter(logging.Formatter):
    """Log lines (tracebacks included) with every URL password and password-like value replaced by `***`:
    whatever a library or a service logs, no secret reaches a terminal or a run's logs."""

    def format(self, record: logging.LogRecord) -> str:
        from tlt_stream.basics.config import redact_text

        return redact_text(super().format(record))


def setup_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"))
    logging.basicConfig(level=level, handlers=[handler])


def _exit_on_sigterm() -> None:
    """Until a service's event loop installs its own handler (which drains and exits 0), SIGTERM raises
    SystemExit(143): a service stopped while still importing torch or loading a checkpoint exits at once,
    with the conventional code and its `finally` blocks run, rather than being killed mid-write."""
    import signal

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (main() called from a test's worker thread): leave it be
        pass


def console(argv: Sequence[str] | None = None) -> int:
    """The process entry (`tlt-stream`, `python -m services.X`): `main` with the process-wide SIGTERM
    handling of a command-line program around it, which in-process callers of `main` (tests) do not want."""
    _exit_on_sigterm()
    try:
        return main(argv)
    finally:
        _ignore_sigterm()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(getattr(args, "verbose", 0))
    handler: Callable[[argparse.Namespace], int] = args.handler
    from tlt_stream.basics.config import ConfigError, redact_text

    try:
        return handler(args)
    except ConfigError as exc:  # its text may quote a --set or a value with a password in it
        print(f"tlt-stream: configuration error: {redact_text(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print("tlt-stream: interrupted", file=sys.stderr)
        return 130


def _ignore_sigterm() -> None:
    """The command is done and the process is exiting with its own code: a SIGTERM now (a supervisor
    stopping everything as this service finishes) must not turn a clean exit into death by signal."""
    import signal

    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass


if __name__ == "__main__":
    sys.exit(console())
