"""compose.yaml is valid against the compose specification and keeps the servers off the host network."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tlt_stream.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_validates_against_the_spec() -> None:
    checker = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    result = subprocess.run(
        [checker, "--builtin-schema", "vendor.compose-spec", str(ROOT / "compose.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_servers_publish_no_ports_and_redis_persists() -> None:
    services = compose()["services"]
    for name in ("redis", "mosquitto"):
        assert "ports" not in services[name], f"{name} must not be published to the host"
        assert "healthcheck" in services[name]
    assert "--appendonly" in services["redis"]["command"]


@pytest.mark.parametrize("name", ["doctor"])
def test_service_commands_are_real_subcommands(name: str) -> None:
    service = compose()["services"][name]
    args = build_parser().parse_args(service["command"])
    assert args.command == service["command"][0]
    env = service["environment"]
    assert env["TLT_REDIS_URL"].startswith("redis://redis:") and env["TLT_MQTT_URL"].startswith("mqtt://mosquitto:")
    assert all(dep["condition"] == "service_healthy" for dep in service["depends_on"].values())
