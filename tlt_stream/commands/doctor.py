"""`tlt-stream doctor`: check Redis and MQTT: versions, streams, pending entries, workers, retained versions."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import Any

from tlt_stream.commands.args import EXIT_CONFIG, add_config_args, load

__all__ = ["handle", "quiet_retries", "register"]


def register(commands: Any) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check Redis and MQTT: versions, streams, pending entries, workers, retained versions",
        description="Connect to the configured (or embedded) Redis and MQTT and report what is there. Exits 1 "
        "when something is unreachable; warns (exit 0) when a server admits clients without credentials, so "
        "that it may not have checked the URL's.",
    )
    add_config_args(doctor)
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.add_argument("--timeout", type=seconds, default=5.0, help="seconds to wait for each server")
    doctor.set_defaults(handler=handle)


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0 (at 0 or below every server would read as down)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def quiet_retries(verbose: int) -> None:
    """A check that answers at once says what failed in one line: the Redis client's "unreachable, retrying"
    warnings before it are logged only with -v."""
    if not verbose:
        logging.getLogger("tlt_stream.bus.connect").setLevel(logging.ERROR)


def handle(args: argparse.Namespace) -> int:
    from tlt_stream.basics.config import redact_text
    from tlt_stream.commands.doctor_checks import doctor

    config = load(args)
    quiet_retries(args.verbose)
    try:
        return doctor(config, as_json=args.json, timeout=args.timeout)
    except ValueError as exc:  # a URL the Redis or MQTT client refuses (an option it cannot read): one line
        print(f"tlt-stream doctor: {redact_text(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
