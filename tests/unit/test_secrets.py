"""No command prints a secret: URL passwords (`scheme://user:PASSWORD@host`) and password-like query values
(`?password=`, `&token=`, ...) are `***` in every output line, log line and error message.

The commands run for real (in this process, or as `tlt-stream` subprocesses where their logging matters)
against embedded servers; the checks read what they print."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ports import free_port
from tlt_stream.bus.embedded import EmbeddedServers
from tlt_stream.commands.cli import RedactingFormatter, main

SECRET = "hunter2-Zq9"
"""Every password in this file: the one string that must never come out."""


def with_password(url: str, *, query: str = "password") -> str:
    """`url` carrying SECRET twice: as its userinfo password and as a query parameter named `query`."""
    scheme, rest = url.split("://", 1)
    return f"{scheme}://app:{SECRET}@{rest}?{query}={SECRET}"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tlt_stream.commands.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("TLT_")}, **(env or {})},
    )


def printed(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    return out + err


@pytest.fixture
def no_bus_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TLT_RUN", "TLT_REDIS_URL", "TLT_MQTT_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A Redis-protocol server of this test's own (fakeredis accepts any password, so a URL with one works)."""
    servers = EmbeddedServers()
    try:
        yield servers.start_redis()
    finally:
        servers.close()


def closed_port() -> int:
    return free_port()  # nothing listens there once the probe socket is closed


# ----------------------------------------------------------------------------------------- config show


@pytest.mark.parametrize(
    ("env", "flags"),
    [
        ({"TLT_REDIS_URL": with_password("rediss://db.example:6380/0")}, []),
        ({"TLT_MQTT_URL": with_password("mqtts://broker.example:8883", query="token")}, []),
        ({}, ["--set", f"bus.redis_url={with_password('redis://db.example/1', query='passwd')}"]),
        ({}, ["--redis-url", with_password("unix:///run/redis.sock"), "--mqtt-url", with_password("mqtt://b")]),
    ],
    ids=["TLT_REDIS_URL", "TLT_MQTT_URL", "--set", "--redis-url/--mqtt-url"],
)
def test_config_show_redacts_every_url(env: dict[str, str], flags: list[str]) -> None:
    result = cli("config", "show", *flags, env=env)
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout + result.stderr
    bus = json.loads(result.stdout)["bus"]
    urls = [url for url in (bus["redis_url"], bus["mqtt_url"]) if url is not None]
    assert urls and all("app:***@" in url and url.endswith("=***") for url in urls), urls


def test_config_show_keeps_urls_without_secrets_as_they_are(
    capsys: pytest.CaptureFixture[str], no_bus_environment: None
) -> None:
    assert main(["config", "show", "--redis-url", "redis://db.example:6379/0?db=2"]) == 0
    assert json.loads(capsys.readouterr().out)["bus"]["redis_url"] == "redis://db.example:6379/0?db=2"


def test_config_show_hides_a_user_part_without_a_colon(
    capsys: pytest.CaptureFixture[str], no_bus_environment: None
) -> None:
    """redis-cli reads `redis://SECRET@host` as the password, so a user part without a colon is hidden whole."""
    assert main(["config", "show", "--redis-url", f"redis://{SECRET}@db.example:6379/0"]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out
    assert json.loads(out)["bus"]["redis_url"] == "redis://***@db.example:6379/0"


@pytest.mark.parametrize(
    "args",
    [
        ["--set", f"bus.redis_url=http://app:{SECRET}@db.example"],  # a bad scheme: the error quotes the --set
        ["--set", f"bus.mqtt_url=http://broker.example/?password={SECRET}"],
        ["--set", f"redis://app:{SECRET}@db.example"],  # no KEY=: the error quotes the whole flag
        ["--set", f"bus.redis_password={SECRET}"],  # an unknown key whose value is a secret
        ["--redis-url", f"http://db.example/0?token={SECRET}"],
    ],
)
def test_configuration_errors_never_quote_a_secret(
    args: list[str], capsys: pytest.CaptureFixture[str], no_bus_environment: None
) -> None:
    assert main(["config", "show", *args]) == 2
    text = printed(capsys)
    assert "configuration error" in text and "***" in text and SECRET not in text, text


# ----------------------------------------------------------------------------------------- run


def test_run_in_a_used_run_name_names_the_server_without_its_password(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_bus_environment: None
) -> None:
    from redis import Redis

    client = Redis.from_url(redis_url)
    client.set("tlt:used:versions", b"1")  # the run name already holds state
    client.close()
    url = with_password(redis_url)
    code = main(["run", "--run", "used", "--redis-url", url, "--world", str(tmp_path / "world")])
    text = printed(capsys)
    assert code == 1, text
    assert "run 'used' already has state in Redis (redis://app:***@127.0.0.1:" in text
    assert SECRET not in text
    assert not (tmp_path / "world").exists()  # refused before anything was built


# ----------------------------------------------------------------------------------------- doctor, monitor


def test_doctor_reports_servers_without_their_passwords(
    redis_url: str, capsys: pytest.CaptureFixture[str], no_bus_environment: None
) -> None:
    mqtt = with_password(f"mqtt://127.0.0.1:{closed_port()}", query="token")  # unreachable: an error names it
    for json_flag in ([], ["--json"]):
        args = ["doctor", "--redis-url", with_password(redis_url), "--mqtt-url", mqtt, "--timeout", "2"]
        assert main([*args, *json_flag]) == 1
        text = printed(capsys)
        assert "app:***@127.0.0.1" in text and "cannot reach MQTT at mqtt://app:***@" in text, text
        assert SECRET not in text


def test_monitor_snapshot_and_errors_redact_the_redis_url(
    redis_url: str, capsys: pytest.CaptureFixture[str], no_bus_environment: None
) -> None:
    assert main(["monitor", "--once", "--json", "--redis-url", with_password(redis_url)]) == 0
    text = printed(capsys)
    assert json.loads(text)["redis"].startswith("redis://app:***@127.0.0.1:") and SECRET not in text

    gone = with_password(f"redis://127.0.0.1:{closed_port()}/0")
    assert main(["monitor", "--once", "--redis-url", gone, "--timeout", "2"]) == 1
    text = printed(capsys)
    assert "cannot reach Redis at redis://app:***@" in text and SECRET not in text, text


def test_log_lines_of_a_failing_connection_redact_the_url() -> None:
    gone = with_password(f"redis://127.0.0.1:{closed_port()}/0")
    result = cli("monitor", "--once", "-vv", "--redis-url", gone, "--timeout", "2")
    assert result.returncode == 1
    assert "unreachable (attempt" in result.stderr, result.stderr  # the retry helper's warning was logged
    assert "app:***@" in result.stderr and SECRET not in result.stdout + result.stderr


def test_the_log_formatter_redacts_messages_arguments_and_tracebacks() -> None:
    formatter = RedactingFormatter("%(levelname)s %(message)s")
    try:
        raise ConnectionError(f"lost redis://:{SECRET}@db:6379")
    except ConnectionError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "url %s", (f"mqtt://u:{SECRET}@b",), sys.exc_info())
    line = formatter.format(record)
    assert "url mqtt://u:***@b" in line and "lost redis://:***@db:6379" in line and SECRET not in line


def test_ensure_new_run_error_alone(redis_url: str) -> None:
    """The message of the launcher's check itself, for callers other than the command line."""
    from tlt_stream.basics.config import BusConfig, Config
    from tlt_stream.commands.run.launch import ensure_new_run

    config = Config(run="used2", bus=BusConfig(redis_url=with_password(redis_url)))

    async def used_then_check() -> None:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url)
        await client.set("tlt:used2:dispatch", b"0")
        await client.aclose()
        await ensure_new_run(config)

    with pytest.raises(RuntimeError) as info:
        asyncio.run(used_then_check())
    assert "redis://app:***@127.0.0.1:" in str(info.value) and SECRET not in str(info.value)
