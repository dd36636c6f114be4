"""`tlt-stream monitor`: the live dashboard of a run, its JSON and its Prometheus metrics."""

from __future__ import annotations

import argparse
from typing import Any

from tlt_stream.commands.args import add_config_args, load

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    mon = commands.add_parser(
        "monitor",
        help="live dashboard of a run from its Redis: streams, dead letters, workers, versions, throughput, SD, "
        "learner; --once --json for scripts; Prometheus metrics",
        description="Reads the run's Redis only (no broker): stream lengths, pending entries, consumer lag and the "
        "oldest pending entry, dead letters, workers and their states, policy/drafter/SD-config versions, rollout "
        "throughput, tokens per forward and SD on/off, the latest learner update and drafter-training slice.",
    )
    mode = mon.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="print one snapshot and exit (1: Redis unreachable)")
    mode.add_argument(
        "--prometheus", type=int, metavar="PORT", help="serve the figures at http://BIND:PORT/metrics (0: any port)"
    )
    mon.add_argument("--json", action="store_true", help="JSON: one object with --once, else one line per refresh")
    mon.add_argument("--bind", default="127.0.0.1", help="address the Prometheus endpoint listens on")
    mon.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    mon.add_argument("--window", type=float, default=60.0, help="seconds of rollout reports behind throughput")
    mon.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for Redis per snapshot")
    add_config_args(mon, bus=False)
    mon.add_argument("--redis-url", help="the run's Redis URL; env TLT_REDIS_URL")
    mon.set_defaults(handler=handle, mqtt_url=None)


def handle(args: argparse.Namespace) -> int:
    from tlt_stream.commands.doctor import quiet_retries
    from tlt_stream.roles.monitor import MonitorOptions, monitor

    if args.once:
        quiet_retries(args.verbose)

    options = MonitorOptions(
        once=args.once,
        as_json=args.json,
        prometheus=args.prometheus,
        bind=args.bind,
        interval=args.interval,
        window_s=args.window,
        timeout=args.timeout,
    )
    return monitor(load(args), options)
