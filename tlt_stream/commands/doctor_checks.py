"""`tlt-stream doctor`: can this run reach its servers, and what state is it in?

The Redis half is the monitor's scan (`tlt_stream.roles.monitor.snapshot.inspect_redis`: streams, groups, dead
letters, workers, the versions mirror), so the two commands never disagree on what a run holds; the MQTT
half reads the retained versions, which the monitor never looks at.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import aiomqtt
import msgspec

from tlt_stream.basics.common import as_text
from tlt_stream.basics.config import Config, redact_url
from tlt_stream.basics.messages import CONTROL_CODEC
from tlt_stream.bus.connect import endpoints, mqtt_params
from tlt_stream.bus.streams import check_run
from tlt_stream.roles.monitor.snapshot import check_redis_url, empty_run_note, inspect_redis, reason

__all__ = ["doctor", "inspect_mqtt", "inspect_redis"]


async def inspect_mqtt(config: Config, timeout: float) -> dict[str, Any]:
    check_run(config.run)  # its topics are a filter's level: a name with a wildcard would read other runs'
    params = mqtt_params(config.bus.mqtt_url or "")
    report: dict[str, Any] = {"url": redact_url(config.bus.mqtt_url), "reachable": False, "retained": {}}
    try:
        async with asyncio.timeout(timeout):
            async with params.client(timeout=timeout) as client:
                report["reachable"] = True
                await client.subscribe(f"{config.topic_prefix}+", qos=1)
                await client.subscribe("$SYS/broker/version", qos=0)
                deadline = time.monotonic() + min(1.0, timeout / 2)
                while time.monotonic() < deadline:
                    try:
                        async with asyncio.timeout(deadline - time.monotonic()):
                            message = await anext(aiter(client.messages))
                    except TimeoutError:
                        break
                    topic = str(message.topic)
                    if topic == "$SYS/broker/version":
                        report["server"] = as_text(message.payload)
                        continue
                    try:
                        decoded = CONTROL_CODEC.decode(message.payload)  # type: ignore[arg-type]
                        report["retained"][topic] = msgspec.to_builtins(decoded)
                    except msgspec.DecodeError as exc:
                        report["retained"][topic] = {"error": f"undecodable: {exc}"}
    except (aiomqtt.MqttError, TimeoutError, OSError) as exc:
        report["error"] = f"cannot reach MQTT at {redact_url(config.bus.mqtt_url)}: {reason(exc)}"
    return report


def _print_human(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]tlt-stream doctor[/bold]  run [cyan]{report['run']}[/cyan]"
        + ("  (embedded servers)" if report["embedded"] else "")
    )
    for name in ("redis", "mqtt"):
        part = report[name]
        status = "[green]ok[/green]" if part["reachable"] else "[red]unreachable[/red]"
        console.print(f"{name:5s} {status}  {escape(part['url'])}  {escape(part.get('server', ''))}")
    redis = report["redis"]
    if redis.get("streams"):
        table = Table("stream", "length", "group", "pending", "lag", "consumers", title="streams")
        for name, entry in redis["streams"].items():
            groups = entry["groups"] or {"-": {"pending": "-", "lag": "-", "consumers": "-"}}
            for group, g in groups.items():
                table.add_row(name, str(entry["length"]), group, str(g["pending"]), str(g["lag"]), str(g["consumers"]))
        console.print(table)
        console.print(f"dead letters per stream: {redis.get('dead_counts') or 'none'}")
        console.print(f"live workers: {len(redis.get('workers', []))}")
        for worker in redis.get("workers", []):
            console.print(
                f"  {worker['worker_id']}: {worker.get('state')} ({worker.get('role')}, pid {worker.get('pid')})"
            )
        versions = redis.get("versions") or {}
        console.print(
            "versions (Redis mirror): " + (", ".join(f"{k} v{v['version']}" for k, v in versions.items()) or "none")
        )
        if redis.get("run_found") is False:
            console.print(f"[yellow]{escape(empty_run_note(report['run'], redis.get('other_runs')))}[/yellow]")
    retained = report["mqtt"].get("retained") or {}
    if report["mqtt"]["reachable"]:
        console.print(
            "retained (MQTT): " + (", ".join(f"{k} v{v.get('version')}" for k, v in retained.items()) or "none")
        )


def doctor(config: Config, *, as_json: bool, timeout: float) -> int:
    embedded = config.bus.redis_url is None or config.bus.mqtt_url is None
    check_run(config.run)  # one line before any server starts or a client connects
    if config.bus.redis_url is not None:
        check_redis_url(config.bus.redis_url)  # before an embedded server starts or a client connects
    with endpoints(config) as resolved:

        async def gather() -> list[Any]:  # both end before an error is raised: no client is left half-open
            return await asyncio.gather(
                inspect_redis(resolved, timeout), inspect_mqtt(resolved, timeout), return_exceptions=True
            )

        redis_report, mqtt_report = asyncio.run(gather())
    for part in (redis_report, mqtt_report):
        if isinstance(part, BaseException):
            raise part
    report = {"run": config.run, "embedded": embedded, "redis": redis_report, "mqtt": mqtt_report}
    ok = redis_report["reachable"] and mqtt_report["reachable"]
    report["ok"] = ok
    if as_json:
        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        _print_human(report)
    if not ok:  # the reason, once, on stderr (the human view above says which server)
        for part in (redis_report, mqtt_report):
            if "error" in part:
                print(f"tlt-stream doctor: {part['error']}", file=sys.stderr)
    return 0 if ok else 1
