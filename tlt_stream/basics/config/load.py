"""Loading the configuration tree: defaults, a preset, the TOML file, the environment, `--set` and flags.

Precedence, lowest first: field defaults, the preset's values, the TOML file, environment variables, `--set`,
command-line flags. A preset sits under everything given explicitly, whichever layer names it. Every value is
validated on load; an unknown key (a typo) or a bad value raises `ConfigError` with one line that names the
key and what is allowed, which the CLI turns into exit code 2.

Environment: the short aliases in `ENV_ALIASES` (`TLT_REDIS_URL`, `TLT_MQTT_URL`, `TLT_RUN`, `TLT_PRESET`, `TLT_DEVICE`)
and the generic form `TLT_<SECTION>__<FIELD>` (`TLT_LEARNER__LR=1e-6`, `TLT_BUS__BLOCK_MS=500`). Values are
read as TOML literals when they parse as one (`500`, `true`, `1.5`, `[4, 1, 4]`), else as strings; a setting
that holds text only (`run`, a path, an id) takes the text as written (`TLT_RUN=2024` is the run "2024").
Whatever the layer, an empty string, an infinite or NaN number and an integer past 64 bits are refused.
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

from tlt_stream.basics.config.redact import REDACTED, is_secret_key, redact_config, redact_text, redact_url
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
    if not all(path):
        raise ConfigError(
            f"{origin}: {'.'.join(path)!r} is not a setting's name (an empty part): write section.key, "
            "for example learner.lr (`tlt-stream config describe` lists every key)"
        )
    node = tree
    for key in path[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: {'.'.join(path)} cannot be set because {key} is not a table")
        node = child
    node[path[-1]] = value


def _holds_text_only(path: tuple[str, ...]) -> bool:
    """Whether the setting at `path` takes text and nothing else a TOML literal could spell (`run`,
    `rollout.worker_id`, a path): its value is the text as written, even where it reads as a number."""
    struct = _struct_at(list(path[:-1]))
    fields = {f.name: f for f in msgspec.structs.fields(struct)} if struct is not None else {}
    if not path or path[-1] not in fields:
        return False
    info = msgspec.inspect.type_info(fields[path[-1]].type)
    info = info.type if isinstance(info, msgspec.inspect.Metadata) else info
    kinds = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    kinds = tuple(k.type if isinstance(k, msgspec.inspect.Metadata) else k for k in kinds)
    return all(
        isinstance(k, msgspec.inspect.StrType | msgspec.inspect.NoneType)
        or (isinstance(k, msgspec.inspect.LiteralType) and all(isinstance(v, str) for v in k.values))
        for k in kinds
    )


def _value_for(path: tuple[str, ...], raw: str) -> Any:
    """`raw` (an environment variable's or a `--set`'s text) as the setting at `path` reads it: a TOML
    literal, except that a text setting keeps the text a number or a boolean would spell (TLT_RUN=2024)."""
    value = parse_literal(raw)
    return raw if not isinstance(value, str) and _holds_text_only(path) else value


def env_overrides(environ: Mapping[str, str]) -> list[tuple[tuple[str, ...], Any, str]]:
    """(path, value, origin) for every configuration variable in `environ`."""
    found = []
    for name, raw in sorted(environ.items()):
        if name in ENV_ALIASES:
            found += [(path, _value_for(path, raw), f"environment variable {name}") for path in ENV_ALIASES[name]]
        elif name.startswith(ENV_PREFIX) and ENV_SEPARATOR in name:
            path = tuple(p.lower() for p in name[len(ENV_PREFIX) :].split(ENV_SEPARATOR))
            found.append((path, _value_for(path, raw), f"environment variable {name}"))
    return found


def parse_assignment(text: str) -> tuple[tuple[str, ...], Any]:
    """`section.key=value` from a `--set` flag."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {redact_url(text)!r}: expected KEY=VALUE, for example learner.lr=1e-6")
    path = tuple(key.strip().split("."))
    return path, _value_for(path, value.strip())


def shown_assignment(text: str) -> str:
    """A `--set KEY=VALUE` fit to quote in a message: the value of a secret-named key as `***`, any other
    value redacted as one value (a URL's password reaches to its last `@`, spaces and quotes included)."""
    key, sep, value = text.partition("=")
    if not sep:
        return redact_url(text) or ""
    secret = is_secret_key(key.strip().rpartition(".")[2])
    return f"{key}={REDACTED if secret else redact_url(value)}"


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
    got = f" (value: {redact_config(value)!r})" if path and not isinstance(value, dict | type(None)) else ""
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
    origins: Mapping[tuple[str, ...], str] | None = None,
) -> Config:
    """Load and validate the configuration.

    `overrides` are `section.key=value` strings (the CLI's `--set`); `extra` maps paths to values for
    dedicated CLI flags (for example `--run`), applied last (None: flag not given); `origins` names the flag
    that set a path of `extra` where it is not `--<last key>` (`--sd-arm` sets sd.arm). `default_preset` is the
    preset used when no layer names one (`tlt-stream run` on the tiny world). Raises `ConfigError`.
    """
    tree: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        if not str(path).strip():
            raise ConfigError(
                "the config file's name is empty (--config, or the environment variable TLT_CONFIG): name a "
                "TOML file, or leave both unset for the defaults"
            )
        file = Path(path)
        origin = f"config file {file}"
        try:
            tree = tomllib.loads(file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {file} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {file} is a directory: name the TOML file in it") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {file} cannot be read: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file} is not valid TOML: {exc}") from None
        _validate(tree, origin)

    layers: list[tuple[tuple[str, ...], Any, str]] = []
    layers += env_overrides(os.environ if environ is None else environ)
    for text in overrides or []:
        key, value = parse_assignment(text)
        layers.append((key, value, f"--set {shown_assignment(text)}"))
    for key, value in (extra or {}).items():
        if value is not None:
            flag = (origins or {}).get(key) or f"--{key[-1].replace('_', '-')}"
            layers.append((key, value, flag))

    preset_origin = origin  # the layer that names the preset, for its error
    for key, value, where in layers:
        _set_path(tree, key, value, where)
        _validate(tree, where)
        preset_origin = where if key == ("preset",) else preset_origin
    return _checked(_validate(_with_preset(tree, default_preset, preset_origin), origin))


INT_RANGE = (-(2**63), 2**63 - 1)
"""The integers a setting may hold: TOML's (64-bit signed), which Redis, msgpack and torch hold too."""


def _check_values(node: Any, origin: str, path: tuple[str, ...] = ()) -> None:
    """Refuse what no setting means, before any type is looked at: an infinite or NaN number (a TOML `inf`,
    or `1e400` rounded to it), an integer past 64 bits (Python's TOML reader takes any) and an empty string
    (a path or a name that is empty would mean the current directory, or nothing, not the default)."""
    if isinstance(node, dict):
        for key, value in node.items():
            _check_values(value, origin, (*path, str(key)))
    elif isinstance(node, list | tuple):
        for value in node:
            _check_values(value, origin, path)
    elif node == "":
        raise ConfigError(f"{origin}: {'.'.join(path)}: is empty: give a value, or leave the key out for its default")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{origin}: {'.'.join(path)}: must be a finite number (got {node!r})")
    elif isinstance(node, int) and not isinstance(node, bool) and not INT_RANGE[0] <= node <= INT_RANGE[1]:
        raise ConfigError(
            f"{origin}: {'.'.join(path)}: {node} does not fit in 64 bits: use a value from {INT_RANGE[0]} to "
            f"{INT_RANGE[1]}"
        )


def _validate(tree: dict[str, Any], origin: str) -> Config:
    _check_values(tree, origin)
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
