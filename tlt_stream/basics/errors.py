"""Errors a user can fix, in a module that imports nothing heavy (service entry points catch them before
torch is loaded)."""

from __future__ import annotations

__all__ = ["CheckpointError", "ConfigError"]


class CheckpointError(Exception):
    """A checkpoint directory is missing, malformed, or uses features this runtime does not implement."""


class ConfigError(Exception):
    """A configuration value, file or override is invalid. The message is one line meant for a human."""
