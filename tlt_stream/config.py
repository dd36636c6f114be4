"""Typed configuration: frozen msgspec Structs loaded from TOML, environment and command-line overrides.

Precedence, lowest first: field defaults, the TOML file, environment variables, command-line flags. Every
value is validated on load; an unknown key (a typo) or a bad value raises `ConfigError` with one line that
names the key and what is allowed, which the CLI turns into exit code 2.

Environment: the short aliases in `ENV_ALIASES` (`TLT_REDIS_URL`, `TLT_MQTT_URL`, `TLT_RUN`) and the generic
form `TLT_<SECTION>__<FIELD>` (for example `TLT_BUS__BLOCK_MS=500`). Values are read as TOML literals when
they parse as one (`500`, `true`, `1.5`), else as strings.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta, Struct, field

__all__ = [
    "ENV_ALIASES",
    "BusConfig",
    "Config",
    "ConfigError",
    "describe",
    "load_config",
    "redact_config",
    "redact_text",
    "redact_url",
]


class ConfigError(Exception):
    """A configuration value, file or override is invalid. The message is one line meant for a human."""


def _doc(text: str, **constraints: Any) -> Meta:
    return Meta(description=text, **constraints)


REDIS_SCHEMES = ("redis", "rediss", "unix")
MQTT_SCHEMES = ("mqtt", "mqtts")


def _check_url(value: str | None, schemes: tuple[str, ...], name: str) -> None:
    if value is None:
        return
    scheme = urlsplit(value).scheme
    if scheme not in schemes:
        allowed = ", ".join(f"{s}://" for s in schemes)
        raise ValueError(f"{name} must start with one of {allowed} (got {redact_url(value)!r})")


class BusConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where the data plane (Redis streams) and control plane (MQTT) live and how they are used."""

    redis_url: Annotated[
        str | None,
        _doc("Redis URL (redis://, rediss:// for TLS, unix://). None starts an embedded Redis-protocol server."),
    ] = None
    mqtt_url: Annotated[
        str | None,
        _doc("MQTT broker URL (mqtt://user:pass@host:1883, mqtts:// for TLS). None starts an embedded broker."),
    ] = None
    block_ms: Annotated[int, _doc("How long one XREADGROUP blocks waiting for entries, in ms.", ge=1)] = 1000
    read_count: Annotated[int, _doc("Entries fetched per XREADGROUP call.", ge=1, le=10_000)] = 16
    reclaim_idle_ms: Annotated[
        int, _doc("An entry pending this long (its consumer presumed dead) is reclaimed with XAUTOCLAIM.", ge=1)
    ] = 60_000
    max_deliveries: Annotated[
        int, _doc("An entry delivered this many times without an ack is moved to the dead stream.", ge=1)
    ] = 5
    backlog_limit: Annotated[
        int,
        _doc("Un-acked entries a durable stream may hold before its producers wait (backpressure).", ge=1),
    ] = 4096
    hidden_maxlen: Annotated[
        int, _doc("Approximate bound on the `hidden` stream (a lossy drafter-training buffer).", ge=1)
    ] = 2000
    hidden_max_bytes: Annotated[
        int,
        _doc(
            "Approximate bound on the Redis memory the `hidden` stream holds, in bytes: its MAXLEN is lowered to "
            "this over the typical entry size the producer measures (a running mean, allocator overhead included).",
            ge=1024,
        ),
    ] = 256 * 2**20
    stats_maxlen: Annotated[int, _doc("Approximate bound on the `stats` stream.", ge=1)] = 100_000
    dead_maxlen: Annotated[int, _doc("Approximate bound on the `dead` stream.", ge=1)] = 100_000
    max_message_bytes: Annotated[
        int, _doc("Entries larger than this are refused before decoding and dead-lettered.", ge=1024)
    ] = 64 * 2**20
    heartbeat_s: Annotated[float, _doc("Seconds between worker heartbeats.", gt=0)] = 2.0
    heartbeat_ttl_s: Annotated[
        float, _doc("A worker whose heartbeat is older than this disappears from the registry.", gt=0)
    ] = 10.0
    mqtt_keepalive_s: Annotated[int, _doc("MQTT keepalive interval in seconds.", ge=5)] = 30
    reconnect_max_s: Annotated[float, _doc("Cap on the reconnect backoff for Redis and MQTT, seconds.", gt=0)] = 30.0
    redis_retries: Annotated[
        int,
        _doc(
            "Retries of one Redis command (capped backoff, 5 s) before a service gives up on an outage and exits "
            "with code 3 for its supervisor to restart it (40: about three minutes).",
            ge=0,
        ),
    ] = 40
    store_root: Annotated[
        str | None,
        _doc(
            "Checkpoint store: policy and drafter locations announced on the control plane are read only when "
            "they resolve inside this directory (`tlt-stream run` and compose set it). None: not confined."
        ),
    ] = None

    def __post_init__(self) -> None:
        _check_url(self.redis_url, REDIS_SCHEMES, "redis_url")
        _check_url(self.mqtt_url, MQTT_SCHEMES, "mqtt_url")
        if self.heartbeat_ttl_s <= self.heartbeat_s:
            raise ValueError("heartbeat_ttl_s must be greater than heartbeat_s")


RUN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class Config(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration of a tlt-stream run; one TOML file, one section per table."""

    run: Annotated[
        str,
        _doc("Run name: every Redis key is prefixed `tlt:{run}:`, every MQTT topic `tlt/{run}/`.", pattern=RUN_PATTERN),
    ] = "default"
    bus: Annotated[BusConfig, _doc("Redis streams and MQTT.")] = field(default_factory=BusConfig)

    @property
    def key_prefix(self) -> str:
        return f"tlt:{self.run}:"

    @property
    def topic_prefix(self) -> str:
        return f"tlt/{self.run}/"


ENV_ALIASES: dict[str, tuple[str, ...]] = {
    "TLT_RUN": ("run",),
    "TLT_REDIS_URL": ("bus", "redis_url"),
    "TLT_MQTT_URL": ("bus", "mqtt_url"),
}
ENV_PREFIX = "TLT_"
ENV_SEPARATOR = "__"


SECRET_KEY = r"[\w.-]*(?:pass(?:wd|word|phrase)?|pwd|token|secret|credentials?|auth|api[_-]?key|private[_-]?key)"
"""A setting or query parameter whose name ends in one of these holds a secret (`password`, `ssl_password`,
`passwd`, `pass`, `access_token`, `client_secret`, `auth`, `api_key`, ...; not `tokens` or `password_file`)."""

_SECRET_KEY_RE = re.compile(rf"^{SECRET_KEY}$", re.IGNORECASE)
_USERINFO_RE = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s:@/'\"]*):[^\s'\"]*@")
_ASSIGNMENT_RE = re.compile(rf"(?P<head>(?<![\w.-]){SECRET_KEY}=)[^\s&#;'\"]*", re.IGNORECASE)
REDACTED = "***"


def redact_text(text: str) -> str:
    """`text` with every secret it may carry replaced by `***`: URL passwords (`scheme://user:PASSWORD@host`,
    the password reaching to the last `@` of the URL, so an unescaped `@` or `/` in it hides nothing) and
    password-like assignments (`?password=...`, `&token=...`, `--set bus.x_secret=...`)."""
    text = _USERINFO_RE.sub(rf"\g<head>:{REDACTED}@", text)
    return _ASSIGNMENT_RE.sub(rf"\g<head>{REDACTED}", text)


def redact_url(url: str | None) -> str | None:
    """The URL with its password and any password-like query parameter replaced by `***`, for logs and
    error messages; never raises, whatever the URL."""
    return None if url is None else redact_text(url)


def redact_config(tree: Any) -> Any:
    """A copy of a configuration tree (builtins, as `msgspec.to_builtins(config)` gives) fit to print:
    password-like keys hold `***`, and every string value (URLs among them) has its secrets redacted."""
    if isinstance(tree, dict):
        return {
            key: REDACTED if _SECRET_KEY_RE.match(str(key)) and value not in (None, "") else redact_config(value)
            for key, value in tree.items()
        }
    if isinstance(tree, list | tuple):
        return [redact_config(value) for value in tree]
    return redact_text(tree) if isinstance(tree, str) else tree


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(tree: dict[str, Any], path: tuple[str, ...], value: Any, origin: str) -> None:
    node = tree
    for key in path[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: {'.'.join(path)} cannot be set because {key} is not a table")
        node = child
    node[path[-1]] = value


def env_overrides(environ: Mapping[str, str]) -> list[tuple[tuple[str, ...], Any, str]]:
    """(path, value, origin) for every configuration variable in `environ`."""
    found = []
    for name, raw in sorted(environ.items()):
        if name in ENV_ALIASES:
            found.append((ENV_ALIASES[name], _parse_scalar(raw), f"environment variable {name}"))
        elif name.startswith(ENV_PREFIX) and ENV_SEPARATOR in name:
            path = tuple(p.lower() for p in name[len(ENV_PREFIX) :].split(ENV_SEPARATOR))
            found.append((path, _parse_scalar(raw), f"environment variable {name}"))
    return found


def parse_assignment(text: str) -> tuple[tuple[str, ...], Any]:
    """`section.key=value` from a `--set` flag."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(redact_text(f"--set {text!r}: expected KEY=VALUE, for example bus.block_ms=500"))
    return tuple(key.strip().split(".")), _parse_scalar(value.strip())


_PATH_RE = re.compile(r"`\$((?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*)`")


def _struct_at(path: list[str]) -> type[Struct] | None:
    node: Any = Config
    for key in path:
        fields = {f.name: f for f in msgspec.structs.fields(node)}
        if key not in fields:
            return None
        node = _struct_type(fields[key].type)
        if node is None:
            return None
    return node


def _struct_type(tp: Any) -> type[Struct] | None:
    info = msgspec.inspect.type_info(tp)
    if isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    if isinstance(info, msgspec.inspect.StructType):
        return info.cls
    return None


def _friendly(error: msgspec.ValidationError, origin: str, tree: dict[str, Any]) -> str:
    message = str(error)
    match = _PATH_RE.search(message)
    path = [p for p in (match.group(1).split(".") if match else []) if p]
    body = _PATH_RE.sub("", message).removesuffix(" - at ").strip()
    unknown = re.match(r"Object contains unknown field `([^`]+)`", body)
    if unknown:
        key = ".".join([*path, unknown.group(1)])
        struct = _struct_at(path)
        allowed = ", ".join(f.name for f in msgspec.structs.fields(struct)) if struct else "?"
        return f"{origin}: unknown key {key!r}; allowed keys here: {allowed}"
    where = ".".join(path) or "(top level)"
    body = body[0].lower() + body[1:] if body else body
    value: Any = tree
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    got = f" (value: {value!r})" if path and not isinstance(value, dict | type(None)) else ""
    if path and _SECRET_KEY_RE.match(path[-1]):
        got = ""
    return redact_text(f"{origin}: {where}: {body}{got}")


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: list[str] | None = None,
    extra: Mapping[tuple[str, ...], Any] | None = None,
) -> Config:
    """Load and validate the configuration.

    `overrides` are `section.key=value` strings (the CLI's `--set`); `extra` maps paths to values for
    dedicated CLI flags (for example `--run`), applied last. Raises `ConfigError` with a one-line message.
    """
    tree: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        file = Path(path)
        origin = f"config file {file}"
        try:
            tree = tomllib.loads(file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {file} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {file} cannot be read: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file} is not valid TOML: {exc}") from None

        _validate(tree, origin)

    layers: list[tuple[tuple[str, ...], Any, str]] = []
    layers += env_overrides(os.environ if environ is None else environ)
    for text in overrides or []:
        key, value = parse_assignment(text)
        layers.append((key, value, f"--set {text}"))
    for key, value in (extra or {}).items():
        if value is not None:
            layers.append((key, value, f"--{key[-1].replace('_', '-')}"))

    for key, value, where in layers:
        _set_path(tree, key, value, where)
        _validate(tree, where)
    return _validate(tree, origin)


def _validate(tree: dict[str, Any], origin: str) -> Config:
    try:
        return msgspec.convert(tree, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_friendly(exc, origin, tree)) from None


def describe(struct: type[Struct] = Config, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(key, default, description) for every leaf field, for `tlt-stream config describe`."""
    rows: list[tuple[str, Any, str]] = []
    for f in msgspec.structs.fields(struct):
        key = f"{prefix}{f.name}"
        nested = _struct_type(f.type)
        if nested is not None:
            rows += describe(nested, f"{key}.")
            continue
        info = msgspec.inspect.type_info(f.type)
        text = (
            (info.extra_json_schema or {}).get("description", "") if isinstance(info, msgspec.inspect.Metadata) else ""
        )
        default = f.default if f.default is not msgspec.NODEFAULT else None
        rows.append((key, default, text))
    return rows
