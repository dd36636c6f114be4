"""`tlt-stream config`: show the effective configuration or describe every setting."""

from __future__ import annotations

import argparse
from typing import Any

from tlt_stream.commands.args import add_config_args, load

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    config = commands.add_parser("config", help="show the effective configuration or describe every setting")
    config.add_argument("action", choices=["show", "describe"], help="show: effective values as JSON")
    add_config_args(config)
    config.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    import msgspec

    from tlt_stream.basics.config import PRESETS, describe, redact_config

    if args.action == "describe":
        for key, default, text in describe():
            print(f"{key} = {default!r}\n    {text}")
        for name, values in PRESETS.items():
            flat = [f"{section}.{k} = {v!r}" for section, table in values.items() for k, v in table.items()]
            print(f"\npreset {name!r} (preset = {name!r}): " + ", ".join(flat))
        return 0
    config = load(args)
    print(msgspec.json.format(msgspec.json.encode(redact_config(msgspec.to_builtins(config)))).decode())
    return 0
