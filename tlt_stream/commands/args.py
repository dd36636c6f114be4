"""What every subcommand shares: the configuration arguments, flags that set a configuration key, loading.

A flag that sets a setting is declared with `setting(parser, "--lr", "learner.lr")`: its help and default are
read from the configuration tree (written there once), its value goes into the tree above the file, the
environment and `--set`, and an unset flag changes nothing.
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

__all__ = ["EXIT_CONFIG", "add_config_args", "flag_values", "load", "positive", "setting"]

EXIT_CONFIG = 2
"""The exit code of a configuration the user can fix (one line on stderr, never a traceback)."""

SETTING = "setting:"
"""Prefix of the argparse destinations of setting flags: `setting:KEY[,KEY...]`."""

FLAGS = "setting_flags"
"""The parser default holding {destination: the flag's name} of its setting flags, for error messages."""


def add_config_args(parser: argparse.ArgumentParser, *, bus: bool = True) -> None:
    group = parser.add_argument_group("configuration")
    group.add_argument(
        "--config",
        metavar="FILE",
        default=os.environ.get("TLT_CONFIG"),
        help="TOML configuration file (`tlt-stream config describe` lists every key); env TLT_CONFIG",
    )
    group.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="overrides",
        help="override one setting, e.g. --set learner.lr=1e-6 (repeatable); env TLT_SECTION__KEY",
    )
    group.add_argument("--run", help="run name (key and topic prefix); env TLT_RUN")
    if bus:
        group.add_argument("--redis-url", help="Redis URL; env TLT_REDIS_URL; default: embedded server")
        group.add_argument("--mqtt-url", help="MQTT URL; env TLT_MQTT_URL; default: embedded broker")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")


def positive(text: str) -> int:
    """An argparse type: an integer >= 1 (offline tools' own options; role settings use `setting`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


@functools.cache
def _rows() -> dict[str, tuple[Any, str]]:
    from tlt_stream.basics.config import describe

    return {key: (default, text) for key, default, text in describe()}


def _field(key: str) -> tuple[Any, str, bool]:
    """(default, docstring, holds text) of a dotted configuration key."""
    import msgspec

    from tlt_stream.basics.config import DEFAULTS

    rows = _rows()
    if key not in rows:
        raise KeyError(f"no configuration key {key!r}")
    section, _, name = key.rpartition(".")
    struct = type(getattr(DEFAULTS, section)) if section else type(DEFAULTS)
    kind = {f.name: f.type for f in msgspec.structs.fields(struct)}[name]
    info = msgspec.inspect.type_info(kind)
    info = info.type if isinstance(info, msgspec.inspect.Metadata) else info
    types = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    text = any(isinstance(t, msgspec.inspect.StrType | msgspec.inspect.LiteralType) for t in types)
    return rows[key][0], rows[key][1], text


def setting(
    parser: Any, *flags: str, keys: str | tuple[str, ...], const: Any = None, help: str | None = None, **kwargs: Any
) -> None:
    """A flag that sets configuration key(s) `keys`. With `const`, a switch that sets that value. The help
    text is `help` or the key's docstring, followed by the default and the key."""
    names = (keys,) if isinstance(keys, str) else keys
    default, doc, text = _field(names[0])
    shown = "none" if default is None else str(default).lower() if isinstance(default, bool) else default
    where = ", ".join(names)
    dest = SETTING + ",".join(names)
    named = parser.get_default(FLAGS)
    if named is None:
        named = {}
        parser.set_defaults(**{FLAGS: named})
    named[dest] = flags[0]
    if const is not None:
        parser.add_argument(
            *flags, dest=dest, action="store_const", const=const, default=None, help=f"{help or doc} ({where})"
        )
        return
    from tlt_stream.basics.config.load import parse_literal

    kind = kwargs.pop("type", None) or (str if text else parse_literal)
    if "choices" not in kwargs:
        kwargs.setdefault("metavar", flags[0].lstrip("-").upper().replace("-", "_"))
    body = (help or doc).replace("%", "%%")
    parser.add_argument(*flags, dest=dest, type=kind, default=None, help=f"{body} (default {shown}; {where})", **kwargs)


def flag_values(args: argparse.Namespace) -> dict[tuple[str, ...], Any]:
    """(key path, value) of every setting flag given on the command line."""
    found: dict[tuple[str, ...], Any] = {}
    for dest, value in vars(args).items():
        if dest.startswith(SETTING) and value is not None:
            for key in dest.removeprefix(SETTING).split(","):
                found[tuple(key.split("."))] = value
    return found


def load(args: argparse.Namespace, *, default_preset: str | None = None) -> Any:
    """The validated configuration from --config, the environment, --set and the flags."""
    from tlt_stream.basics.config import load_config

    extra: dict[tuple[str, ...], Any] = {("run",): getattr(args, "run", None)}
    if hasattr(args, "redis_url"):
        extra[("bus", "redis_url")] = args.redis_url
        extra[("bus", "mqtt_url")] = args.mqtt_url
    extra.update(flag_values(args))
    origins = {
        tuple(key.split(".")): flag
        for dest, flag in (getattr(args, FLAGS, None) or {}).items()
        for key in dest.removeprefix(SETTING).split(",")
    }
    return load_config(
        args.config, overrides=args.overrides, extra=extra, default_preset=default_preset, origins=origins
    )
