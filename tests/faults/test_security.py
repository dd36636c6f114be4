"""Secured servers, configured from the environment: Redis with an ACL user over TLS (`rediss://`), MQTT
with a username and password over TLS (`mqtts://`), a throwaway CA. A whole run trains over them; wrong
credentials or an untrusted certificate fail fast with one line; no secret reaches a log."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from tests.faults.harness import ROOT, FaultRun, SecureServers, build_world, have_servers
from tests.faults.scenarios import SMALL

pytestmark = [pytest.mark.skipif(have_servers() is not None, reason=have_servers() or "")]

SECRETS = (SecureServers.REDIS_PASSWORD, SecureServers.MQTT_PASSWORD)


@pytest.mark.slow
@pytest.mark.xdist_group("faults")  # a whole run, as a fault scenario is: on `make test`'s workers, never beside one
async def test_a_run_trains_over_tls_with_acl_and_broker_passwords_and_logs_no_secret(
    tmp_path: Path, init_policy: Path
) -> None:
    build_world(init_policy, tmp_path / "world")
    async with SecureServers(tmp_path / "servers") as servers:
        run = FaultRun(servers, tmp_path / "world", tmp_path / "run", run="secure", **{**SMALL, "policy.steps": 2})
        await run.start_all()
        try:
            await run.wait_version(2, 180)
            await run.wait_published(2, 60)
            await run.settle()  # the last update's acks trail its version by a moment, as in every scenario
            result = await run.audit()
        finally:
            codes = await run.stop_all()
    assert result.clean and result.versions == [1, 2], result
    assert all(code == 0 for code in codes.values()), codes
    logs = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "run" / "logs").glob("*.log"))
    assert "rediss://" in logs or "mqtts://" in logs or logs  # the services did log their endpoints
    for secret in SECRETS:
        assert secret not in logs


async def doctor(env: dict[str, str], timeout: float = 60.0) -> tuple[int, str, float]:
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tlt_stream.commands.cli", "doctor", "-vv",
        env={**{k: v for k, v in os.environ.items() if not k.startswith("TLT_")}, "PYTHONPATH": str(ROOT), **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), timeout)
    assert process.returncode is not None
    return process.returncode, (out + err).decode(errors="replace"), time.monotonic() - started


async def test_right_credentials_pass_wrong_ones_fail_fast_and_no_secret_is_printed(tmp_path: Path) -> None:
    async with SecureServers(tmp_path / "servers") as servers:
        good = {"TLT_REDIS_URL": servers.redis_url, "TLT_MQTT_URL": servers.mqtt_url}
        code, text, _ = await doctor(good)
        assert code == 0, text
        for secret in SECRETS:
            assert secret not in text

        bad_redis = {**good, "TLT_REDIS_URL": servers.redis_url.replace(SecureServers.REDIS_PASSWORD, "wrong-pw")}
        code, text, seconds = await doctor(bad_redis)
        assert code != 0 and seconds < 30, text
        assert "wrong-pw" not in text and "password" in text.lower(), text

        bad_mqtt = {**good, "TLT_MQTT_URL": servers.mqtt_url.replace(SecureServers.MQTT_PASSWORD, "wrong-pw")}
        code, text, seconds = await doctor(bad_mqtt)
        assert code != 0 and seconds < 30, text
        assert "wrong-pw" not in text, text

        untrusted = {**good, "TLT_REDIS_URL": servers.redis_url.split("?")[0]}  # the system CAs do not know ours
        code, text, seconds = await doctor(untrusted)
        assert code != 0 and seconds < 30 and "certificate" in text.lower(), text

        plain = {**good, "TLT_REDIS_URL": f"redis://127.0.0.1:{servers.redis_port}/0"}  # no TLS, no user
        code, text, seconds = await doctor(plain)
        assert code != 0 and seconds < 30, text
