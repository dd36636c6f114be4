"""`tlt-stream doctor`: can this run reach its servers, and what state is it in?

The Redis half is the monitor's scan (`tlt_stream.roles.monitor.snapshot.inspect_redis`: streams, groups, dead
letters, workers, the versions mirror), so the two commands never disagree on what a run holds; the MQTT
half reads the retained versions, which the monitor never looks at.

A server reached with credentials is also asked whether it needed them: a Redis whose default user has no
password accepts any password for it, and a broker that admits anonymous clients may ignore a URL's username
and password. Either says "ok" to credentials that a server with authentication on would refuse, so doctor
says so (a warning: the server is reachable and the run would work against it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiomqtt
import msgspec
from redis.exceptions import NoPermissionError, RedisError

from tlt_stream.basics.common import as_text
from tlt_stream.basics.config import Config, redact_url
from tlt_stream.basics.messages import CONTROL_CODEC
from tlt_stream.bus.connect import connect_redis, endpoints, mqtt_params
from tlt_stream.bus.streams import check_run
from tlt_stream.roles.monitor.snapshot import check_redis_url, empty_run_note, inspect_redis, reason

__all__ = ["doctor", "inspect_mqtt", "inspect_redis", "mqtt_credentials_warning", "redis_credentials_warning"]

REDIS_PASSWORD_UNCHECKED = (
    "this Redis requires no password ({who} has none), so the URL's password was not checked: a server with "
    "authentication on may refuse it"
)
MQTT_CREDENTIALS_UNNEEDED = (
    "the MQTT broker here admits clients without credentials, so the URL's username and password were not "
    "needed and may not have been checked: a broker with authentication on may refuse them"
)


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


async def redis_credentials_warning(url: str, timeout: float) -> str | None:
    """What to tell a user whose Redis URL carries a password that this server does not check, else None.

    A connection without credentials that the server admits (PONG, or NOPERM: the default user, logged in
    without a password but not allowed PING) means the default user has no password, and Redis then accepts
    any password for it: the URL's, when it names no user or `default`. (redis-py logs in with `HELLO 3 AUTH
    default <password>`, which such a server answers OK; only the RESP2 `AUTH <password>` gets an error.) For
    another user, its ACL flags say whether it has a password, when the user may read them (`ACL GETUSER`);
    otherwise nothing is said. A server that refuses the anonymous connection (NOAUTH) checks passwords: no
    warning, and no failed AUTH in its log, as no wrong password is ever sent."""
    anonymous = connect_redis(url, name="tlt-doctor", retries=0)
    kwargs = anonymous.connection_pool.connection_kwargs
    username, password = kwargs.get("username"), kwargs.get("password")
    if not password:
        await anonymous.aclose()
        return None
    kwargs.update(username=None, password=None, credential_provider=None)
    try:
        async with asyncio.timeout(timeout):
            await anonymous.ping()
    except NoPermissionError:
        pass  # logged in as the default user, without a password, which may not PING
    except (RedisError, TimeoutError, OSError):
        return None  # NOAUTH: passwords are checked (or no answer: nothing can be told)
    finally:
        await anonymous.aclose()
    if username in (None, "", "default"):
        return REDIS_PASSWORD_UNCHECKED.format(who="its default user")
    client = connect_redis(url, name="tlt-doctor", retries=0)
    try:
        async with asyncio.timeout(timeout):
            user = await client.acl_getuser(username)
    except (RedisError, TimeoutError, OSError):
        return None  # the user may not read its ACL: whether its password was checked is unknown
    finally:
        await client.aclose()
    flags = {as_text(flag) for flag in (user or {}).get("flags") or ()}
    return REDIS_PASSWORD_UNCHECKED.format(who="the URL's user") if "nopass" in flags else None


async def mqtt_credentials_warning(url: str, timeout: float) -> str | None:
    """What to tell a user whose MQTT URL carries credentials that this broker does not need, else None: one
    more connection, without them, that the broker accepts. (Whether it checked the URL's credentials cannot
    be told without sending wrong ones: Mosquitto with a password file and `allow_anonymous true` checks them,
    without the file it ignores them.) A broker that requires authentication refuses that connection, which
    it may log as a client not authorised."""
    params = mqtt_params(url)
    if not (params.username or params.password):
        return None
    anonymous = dataclasses.replace(params, username=None, password=None)
    try:
        async with asyncio.timeout(timeout):
            async with anonymous.client(timeout=timeout):
                pass
    except (aiomqtt.MqttError, TimeoutError, OSError):
        return None
    return MQTT_CREDENTIALS_UNNEEDED


async def _with_warning(
    report: dict[str, Any], check: Callable[[str, float], Awaitable[str | None]], url: str | None, timeout: float
) -> dict[str, Any]:
    """`report` with the credentials warning of `check` (`warning`), asked only of a server that answered."""
    if report["reachable"] and url is not None and (warning := await check(url, timeout)) is not None:
        report["warning"] = warning
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
        if "warning" in part:  # one line, unwrapped, whatever the terminal's width
            console.print(f"[yellow]{name:5s} warning: {escape(part['warning'])}[/yellow]", soft_wrap=True)
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

        async def redis_part() -> dict[str, Any]:
            report = await inspect_redis(resolved, timeout)
            return await _with_warning(report, redis_credentials_warning, resolved.bus.redis_url, timeout)

        async def mqtt_part() -> dict[str, Any]:
            report = await inspect_mqtt(resolved, timeout)
            return await _with_warning(report, mqtt_credentials_warning, resolved.bus.mqtt_url, timeout)

        async def gather() -> list[Any]:  # both end before an error is raised: no client is left half-open
            return await asyncio.gather(redis_part(), mqtt_part(), return_exceptions=True)

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
