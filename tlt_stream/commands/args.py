"""What every subcommand shares: the configuration and device arguments, argument types, loading the config."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["EXIT_CONFIG", "add_config_args", "add_device_arg", "load", "positive", "sd_arm", "share"]

EXIT_CONFIG = 2
"""The exit code of a configuration the user can fix (one line on stderr, never a traceback)."""


def add_config_args(parser: argparse.ArgumentParser, *, bus: bool = True) -> None:
    group = parser.add_argument_group("configuration")
    group.add_argument("--config", metavar="FILE", help="TOML configuration file")
    group.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="overrides",
        help="override one setting, e.g. --set bus.block_ms=500 (repeatable)",
    )
    group.add_argument("--run", help="run name (key and topic prefix); env TLT_RUN")
    if bus:
        group.add_argument("--redis-url", help="Redis URL; env TLT_REDIS_URL; default: embedded server")
        group.add_argument("--mqtt-url", help="MQTT URL; env TLT_MQTT_URL; default: embedded broker")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")


def add_device_arg(parser: argparse.ArgumentParser) -> None:
    import os

    parser.add_argument(
        "--device",
        default=os.environ.get("TLT_DEVICE", "auto"),
        help="auto (CUDA when torch sees a device, else CPU), cpu, cuda or cuda:N; env TLT_DEVICE (default auto)",
    )


def share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def sd_arm(text: str) -> tuple[int, int, int]:
    try:
        depth, topk, verify = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected DEPTH,TOPK,VERIFY (three integers), got {text!r}") from None
    if min(depth, topk, verify) < 1 or verify > depth * topk * topk:
        raise argparse.ArgumentTypeError(f"need DEPTH, TOPK, VERIFY >= 1 and VERIFY <= DEPTH*TOPK^2, got {text!r}")
    return depth, topk, verify


def load(args: argparse.Namespace) -> Any:
    """The validated configuration from --config, the environment, --set and dedicated flags."""
    from tlt_stream.config import load_config

    extra: dict[tuple[str, ...], Any] = {("run",): getattr(args, "run", None)}
    if hasattr(args, "redis_url"):
        extra[("bus", "redis_url")] = args.redis_url
        extra[("bus", "mqtt_url")] = args.mqtt_url
    return load_config(args.config, overrides=args.overrides, extra=extra)
