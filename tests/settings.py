"""Configurations for tests: the tree with a few dotted keys replaced.

`override` validates every value and the rules between sections, as a user's configuration is; `replaced`
does not, for what only tests ask of a role (greedy rollouts at temperature 0, which the tree refuses for RL).
"""

from __future__ import annotations

from typing import Any

import msgspec

from tlt_stream.basics.config import Config

__all__ = ["replaced"]


def replaced(config: Config, values: dict[str, Any]) -> Config:
    """`config` with `values` (`{"rollout.max_batch": 4, "sd.drafter": "ngram"}`) set as given, unvalidated."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, _, field = key.partition(".")
        sections.setdefault(section, {})[field] = value
    changes = {name: msgspec.structs.replace(getattr(config, name), **fields) for name, fields in sections.items()}
    return msgspec.structs.replace(config, **changes)
