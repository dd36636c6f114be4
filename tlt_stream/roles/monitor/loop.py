"""The `tlt-stream monitor` command: one snapshot (`--once`), or a refresh every interval until SIGINT/SIGTERM,
shown as a live dashboard, JSON lines, log lines and/or Prometheus metrics.

Its options are validated here so that a bad flag exits 2 with a message before anything connects.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from rich.console import Console
from rich.live import Live

from tlt_stream.basics.aio import install_stop_signals, run, sleep_or_stop
from tlt_stream.basics.config import Config, ConfigError
from tlt_stream.bus.connect import connect_redis
from tlt_stream.roles.monitor.dashboard import render, summary_line
from tlt_stream.roles.monitor.prometheus import MetricsServer
from tlt_stream.roles.monitor.snapshot import check_redis_url, snapshot

__all__ = ["MonitorOptions", "monitor"]


@dataclass(frozen=True)
class MonitorOptions:
    """How `tlt-stream monitor` shows what it reads; validated here so a bad flag exits 2 with a message."""

    once: bool = False
    as_json: bool = False
    prometheus: int | None = None
    """Serve Prometheus metrics on this port (0: any free one)."""
    bind: str = "127.0.0.1"
    interval: float = 2.0
    window_s: float = 60.0
    timeout: float = 5.0

    def __post_init__(self) -> None:
        for name in ("interval", "window_s", "timeout"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ConfigError(f"monitor: {name} must be a finite number > 0, got {getattr(self, name)}")
        if self.prometheus is not None and not 0 <= self.prometheus <= 65535:
            raise ConfigError(f"monitor: --prometheus needs a port in 0..65535, got {self.prometheus}")
        if self.once and self.prometheus is not None:
            raise ConfigError("monitor: --once prints one snapshot; it cannot also serve --prometheus")


def monitor(config: Config, options: MonitorOptions) -> int:
    """`tlt-stream monitor` / `services/monitor.py`: exit 0, 1 (Redis unreachable with --once, port taken),
    2 (no Redis URL: the embedded servers of another process cannot be found)."""
    if config.bus.redis_url is None:
        print(
            "tlt-stream monitor: needs the run's Redis: --redis-url or TLT_REDIS_URL (and --run or TLT_RUN)",
            file=sys.stderr,
        )
        return 2
    try:
        check_redis_url(config.bus.redis_url)
    except ValueError as exc:
        print(f"tlt-stream monitor: {exc}", file=sys.stderr)
        return 2
    return run(_once(config, options) if options.once else _watch(config, options))


def _json(snap: Mapping[str, Any]) -> str:
    return msgspec.json.encode(snap).decode()


async def _once(config: Config, options: MonitorOptions) -> int:
    snap = await snapshot(config, window_s=options.window_s, timeout=options.timeout)
    if options.as_json:
        print(_json(snap), flush=True)
    elif snap["reachable"]:  # else the one line below says it all
        Console().print(render(snap))
    if not snap["reachable"]:
        print(f"tlt-stream monitor: {snap['error']}", file=sys.stderr)
        return 1
    return 0


async def _watch(config: Config, options: MonitorOptions) -> int:
    """Refresh every interval until SIGINT/SIGTERM: a live dashboard on a terminal, JSON lines with --json,
    else one summary line per refresh (none when serving Prometheus)."""
    stop = asyncio.Event()
    install_stop_signals(stop)
    console = Console()
    try:
        server = MetricsServer(options.bind, options.prometheus) if options.prometheus is not None else None
    except OSError as exc:
        print(f"tlt-stream monitor: cannot serve on {options.bind}:{options.prometheus}: {exc}", file=sys.stderr)
        return 1
    redis = connect_redis(config.bus.redis_url or "", name="tlt-monitor", retries=2)
    with contextlib.ExitStack() as stack:
        if server is not None:
            stack.enter_context(server)
            print(f"tlt-stream monitor: Prometheus metrics on {server.url}", file=sys.stderr, flush=True)
        live = None
        if console.is_terminal and not options.as_json:
            live = stack.enter_context(Live(console=console, auto_refresh=False))
        try:
            while True:
                snap = await snapshot(config, redis=redis, window_s=options.window_s, timeout=options.timeout)
                if server is not None:
                    server.publish(snap)
                if live is not None:
                    live.update(render(snap), refresh=True)
                elif options.as_json:
                    print(_json(snap), flush=True)
                elif server is None:
                    print(summary_line(snap), flush=True)
                if await sleep_or_stop(stop, options.interval):
                    break
        finally:
            await redis.aclose()
    return 0
