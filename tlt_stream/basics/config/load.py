"""Loading the configuration tree: defaults, a preset, the TOML file, the environment, `--set` and flags.

Precedence, lowest first: field defaults, the preset's values, the TOML file, environment variables, `--set`,
command-line flags. A preset sits under everything given explicitly, whichever layer names it. Every value is
validated on load; an unknown key (a typo) or a bad value raises `ConfigError` with one line that names the
key and what is allowed, which the CLI turns into exit code 2.

Environment: the short aliases in `ENV_ALIASES` (`TLT_REDIS_URL`, `TLT_MQTT_URL`, `TLT_RUN`, `TLT_PRESET`, `TLT_DEVICE`)
and the generic form `TLT_<SECTION>__<FIELD>` (`TLT_LEARNER__LR=1e-6`, `TLT_BUS__BLOCK_MS=500`). Values are
read as TOML literals when they parse as one (`500`, `true`, `1.5`, `[4, 1, 4]`), else as strings.
"""

from __future__ import annotations

import copy
import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
from msgspec import Struct

from tlt_stream.basics.config.redact import is_secret_key, redact_text
from tlt_stream.basics.config.rules import check_rules
from tlt_stream.basics.config.tree import PRESETS, Config
from tlt_stream.basics.errors import ConfigError

__all__ = [
    "ENV_ALIASES",
    "NO_PRESET",
    "ConfigError",
    "describe",
    "dump_toml",
    "env_overrides",
    "load_config",
    "override",
    "parse_assignment",
    "parse_literal",
]


ENV_ALIASES: dict[str, tuple[tuple[str, ...], ...]] = {
    "TLT_RUN": (("run",),),
    "TLT_PRESET": (("preset",),),
    "TLT_REDIS_URL": (("bus", "redis_url"),),
    "TLT_MQTT_URL": (("bus", "mqtt_url"),),
    "TLT_DEVICE": (("rollout", "device"), ("learner", "device")),
}
ENV_PREFIX = "TLT_"
ENV_SEPARATOR = "__"
NO_PRESET = "none"
"""`preset = "none"`: no preset, not even the one a command would pick by default."""


def parse_literal(text: str) -> Any:
    """`text` as the TOML literal it spells (`500`, `true`, `1.5`, `[4, 1, 4]`), else the string itself."""
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
            found += [(path, parse_literal(raw), f"environment variable {name}") for path in ENV_ALIASES[name]]
        elif name.startswith(ENV_PREFIX) and ENV_SEPARATOR in name:
            path = tuple(p.lower() for p in name[len(ENV_PREFIX) :].split(ENV_SEPARATOR))
            found.append((path, parse_literal(raw), f"environment variable {name}"))
    return found


def parse_assignment(text: str) -> tuple[tuple[str, ...], Any]:
    """`section.key=value` from a `--set` flag."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(redact_text(f"--set {text!r}: expected KEY=VALUE, for example learner.lr=1e-6"))
    return tuple(key.strip().split(".")), parse_literal(value.strip())


_PATH_RE = re.compile(r"`\$((?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*)`")


def _struct_type(tp: Any) -> type[Struct] | None:
    info = msgspec.inspect.type_info(tp)
    if isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    if isinstance(info, msgspec.inspect.StructType):
        return info.cls
    return None


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
    if path and is_secret_key(path[-1]):
        got = ""
    return redact_text(f"{origin}: {where}: {body}{got}")


def _merge(low: dict[str, Any], high: dict[str, Any]) -> dict[str, Any]:
    """`high` over `low`, table by table."""
    merged = copy.deepcopy(low)
    for key, value in high.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _with_preset(tree: dict[str, Any], default_preset: str | None, origin: str) -> dict[str, Any]:
    name = tree.get("preset", default_preset)
    if name in (None, NO_PRESET):
        return {**tree, "preset": None}
    if name not in PRESETS:
        raise ConfigError(f"{origin}: preset: unknown preset {name!r}; choose {', '.join(PRESETS)} or {NO_PRESET}")
    return {**_merge(PRESETS[name], tree), "preset": name}


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: list[str] | None = None,
    extra: Mapping[tuple[str, ...], Any] | None = None,
    default_preset: str | None = None,
) -> Config:
    """Load and validate the configuration.

    `overrides` are `section.key=value` strings (the CLI's `--set`); `extra` maps paths to values for
    dedicated CLI flags (for example `--run`), applied last (None: flag not given). `default_preset` is the
    preset used when no layer names one (`tlt-stream run` on the tiny world). Raises `ConfigError`.
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
    return _checked(_validate(_with_preset(tree, default_preset, origin), origin))


def _validate(tree: dict[str, Any], origin: str) -> Config:
    checked = {**tree, "preset": None} if tree.get("preset") == NO_PRESET else tree
    try:
        return msgspec.convert(checked, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_friendly(exc, origin, tree)) from None


def _checked(config: Config) -> Config:
    """`config` once every layer is applied, held to the rules between its sections (`rules.py`: the error
    names the keys, whichever layers set them)."""
    return check_rules(config)


def override(config: Config, values: Mapping[str, Any]) -> Config:
    """`config` with dotted keys replaced (`{"policy.steps": 5}`), validated like any other layer; for code
    that builds a configuration (benchmarks, tests) rather than reading one. A `preset` among them sets its
    values first, under the others given."""
    tree = msgspec.to_builtins(config)
    name = values.get("preset")
    if name not in (None, NO_PRESET):
        tree = _merge(tree, _with_preset({"preset": name}, None, "override"))
    for key, value in values.items():
        _set_path(tree, tuple(key.split(".")), value, key)
    return _checked(_validate(tree, "override"))


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


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value} has no TOML form here")
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()  # a JSON string is a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def dump_toml(config: Config, *, leave_out: tuple[str, ...] = ()) -> str:
    """The configuration as TOML that `load_config` reads back to the same values; None values (every one
    of them a default) and the dotted keys in `leave_out` (secrets travel another way) are not written."""
    tree = msgspec.to_builtins(config)
    top = [f"{k} = {_toml_value(v)}" for k, v in tree.items() if not isinstance(v, dict) and v is not None]
    lines = [line for line in top if line.split(" = ")[0] not in leave_out]
    for section, values in tree.items():
        if not isinstance(values, dict):
            continue
        lines.append(f"\n[{section}]")
        for key, value in values.items():
            if value is not None and f"{section}.{key}" not in leave_out:
                lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"
