"""Typed configuration: one tree of frozen msgspec Structs (`tree.py`), loaded from defaults, a preset, TOML,
the environment, `--set` and flags (`load.py`), and printed without its secrets (`redact.py`).

`tlt-stream config describe` lists every setting with its default and docstring; `tlt-stream config show`
prints the effective values.
"""

from tlt_stream.basics.config.load import (
    ENV_ALIASES,
    NO_PRESET,
    ConfigError,
    describe,
    dump_toml,
    env_overrides,
    load_config,
    override,
    parse_assignment,
)
from tlt_stream.basics.config.redact import redact_config, redact_text, redact_url
from tlt_stream.basics.config.tree import (
    DEFAULTS,
    PRESETS,
    BusConfig,
    Config,
    DataConfig,
    DrafterConfig,
    LaunchConfig,
    LearnerConfig,
    PolicyConfig,
    RolloutConfig,
    SdConfig,
)

__all__ = [
    "DEFAULTS",
    "ENV_ALIASES",
    "NO_PRESET",
    "PRESETS",
    "BusConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DrafterConfig",
    "LaunchConfig",
    "LearnerConfig",
    "PolicyConfig",
    "RolloutConfig",
    "SdConfig",
    "describe",
    "dump_toml",
    "env_overrides",
    "load_config",
    "override",
    "parse_assignment",
    "redact_config",
    "redact_text",
    "redact_url",
]
