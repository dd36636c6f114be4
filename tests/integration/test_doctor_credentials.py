"""`tlt-stream doctor` with credentials that the server never checks: a Redis without authentication accepts any
password for its default user, a broker that admits anonymous clients any username and password. Doctor says
the server is reachable and warns, once, that the URL's credentials were not checked (exit 0, as for its other
warnings), never printing them; a server with authentication on, or a URL without credentials, gets no warning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.compose_file import deployed_server, make_env, missing_binaries, private_redis

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]

REAL_REDIS = os.environ.get("TLT_TEST_REDIS_URL")
REAL_MQTT = os.environ.get("TLT_TEST_MQTT_URL")
REDIS_WARNING = "redis warning: this Redis requires no password (its default user has none), so the URL's password"
REDIS_USER_WARNING = "redis warning: this Redis requires no password (the URL's user has none), so the URL's password"
MQTT_WARNING = "mqtt  warning: the MQTT broker here admits clients without credentials"


def with_credentials(url: str, userinfo: str) -> str:
    """`url` with `userinfo` (`user:password`, `:password`) in front of its host."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{host}"))


def doctor(redis_url: str, mqtt_url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLT_")}
    run = f"t{uuid.uuid4().hex[:10]}"  # reads nothing but its own (absent) keys; doctor writes none
    urls = ["--redis-url", redis_url, "--mqtt-url", mqtt_url]
    return subprocess.run(
        [sys.executable, "-m", "tlt_stream.commands.cli", "doctor", "--run", run, *urls, "--timeout", "10", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def warning_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if "warning:" in line]


@pytest.fixture
def real() -> tuple[str, str]:
    """The real servers' URLs, which must take no credentials (the servers CI runs have no authentication)."""
    if not (REAL_REDIS and REAL_MQTT):
        pytest.skip("real servers not configured (set TLT_TEST_REDIS_URL and TLT_TEST_MQTT_URL)")
    if "@" in urlsplit(REAL_REDIS).netloc or "@" in urlsplit(REAL_MQTT).netloc:
        pytest.skip("the real servers take credentials: these tests need servers without authentication")
    return REAL_REDIS, REAL_MQTT


@pytest.mark.parametrize("userinfo", [":{secret}", "default:{secret}"])
def test_a_password_redis_never_checks_is_reported_and_never_printed(real: tuple[str, str], userinfo: str) -> None:
    secret = f"pw{uuid.uuid4().hex}"
    redis_url, mqtt_url = with_credentials(real[0], userinfo.format(secret=secret)), real[1]
    result = doctor(redis_url, mqtt_url)
    assert result.returncode == 0, result.stdout + result.stderr  # a warning, not a failure
    assert secret not in result.stdout + result.stderr
    assert "redis ok" in result.stdout
    assert warning_lines(result.stdout) == [
        f"{REDIS_WARNING} was not checked: a server with authentication on may refuse it"
    ], result.stdout
    assert "Traceback" not in result.stderr

    result = doctor(redis_url, mqtt_url, "--json")
    assert result.returncode == 0, result.stderr
    assert secret not in result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["redis"]["reachable"]
    assert report["redis"]["warning"].startswith("this Redis requires no password (its default user has none)")
    assert "warning" not in report["mqtt"]


def test_urls_without_credentials_get_no_warning(real: tuple[str, str]) -> None:
    result = doctor(*real)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "redis ok" in result.stdout and "mqtt  ok" in result.stdout
    assert warning_lines(result.stdout) == []
    report = json.loads(doctor(*real, "--json").stdout)
    assert report["ok"] and "warning" not in report["redis"] and "warning" not in report["mqtt"]


def test_credentials_a_broker_admitting_anonymous_clients_never_needed_are_reported(real: tuple[str, str]) -> None:
    secret = f"pw{uuid.uuid4().hex}"
    mqtt_url = with_credentials(real[1], f"someone:{secret}")
    result = doctor(real[0], mqtt_url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert secret not in result.stdout + result.stderr
    assert "mqtt  ok  mqtt://someone:***@" in result.stdout
    (line,) = warning_lines(result.stdout)
    assert line.startswith(MQTT_WARNING) and "may not have been checked" in line, result.stdout
    report = json.loads(doctor(real[0], mqtt_url, "--json").stdout)
    assert report["ok"] and "warning" in report["mqtt"] and "warning" not in report["redis"]


# ------------------------------------------------------------- servers of the test's own: with and without auth


def test_servers_with_authentication_on_get_no_warning(tmp_path: Path) -> None:
    """compose.yaml's Redis and Mosquitto, as deployed: the default user off, anonymous clients refused."""
    if why := missing_binaries("redis-server", "redis-cli", "sha256sum", "mosquitto", "mosquitto_passwd"):
        pytest.skip(why)
    env = make_env(tmp_path / ".env")
    with (
        deployed_server("redis", tmp_path / "redis", env) as redis_port,
        deployed_server("mosquitto", tmp_path / "mosquitto", env) as mqtt_port,
    ):
        redis_password, mqtt_password = env["TLT_REDIS_PASSWORD_MONITOR"], env["TLT_MQTT_PASSWORD_MONITOR"]
        redis_url = f"redis://monitor:{redis_password}@127.0.0.1:{redis_port}/0"
        mqtt_url = f"mqtt://monitor:{mqtt_password}@127.0.0.1:{mqtt_port}"
        result = doctor(redis_url, mqtt_url)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "redis ok" in result.stdout and "mqtt  ok" in result.stdout
        assert warning_lines(result.stdout) == []
        assert redis_password not in result.stdout + result.stderr
        assert mqtt_password not in result.stdout + result.stderr
        wrong = doctor(f"redis://monitor:wrong@127.0.0.1:{redis_port}/0", mqtt_url)
        assert wrong.returncode == 1 and "cannot reach Redis" in wrong.stderr  # still a failure, as before


def test_a_named_user_without_a_password_is_reported_one_with_a_password_is_not(
    tmp_path: Path, real: tuple[str, str]
) -> None:
    if why := missing_binaries("redis-server", "redis-cli"):
        pytest.skip(why)
    secret = f"pw{uuid.uuid4().hex}"
    with private_redis(tmp_path / "redis") as port:
        for acl in (["alice", "on", "nopass", "~*", "&*", "+@all"], ["bob", "on", f">{secret}", "~*", "&*", "+@all"]):
            subprocess.run(["redis-cli", "-p", str(port), "ACL", "SETUSER", *acl], check=True, capture_output=True)
        unchecked = doctor(f"redis://alice:{secret}@127.0.0.1:{port}/0", real[1])
        assert unchecked.returncode == 0, unchecked.stdout + unchecked.stderr
        assert secret not in unchecked.stdout + unchecked.stderr
        assert [line[: len(REDIS_USER_WARNING)] for line in warning_lines(unchecked.stdout)] == [REDIS_USER_WARNING]
        checked = doctor(f"redis://bob:{secret}@127.0.0.1:{port}/0", real[1])
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert secret not in checked.stdout + checked.stderr
        assert warning_lines(checked.stdout) == [], checked.stdout
