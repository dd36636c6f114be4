"""Two small helpers every layer shares, written once: Redis replies as text, and stable hashes.

Python's `hash()` of a string is salted per process; ids, seeds and splits that must agree across processes,
restarts and machines come from `stable_hex`/`stable_int` (SHA-1 of the UTF-8 text, truncated) instead.
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["as_text", "stable_hex", "stable_int"]


def as_text(value: Any) -> Any:
    """A Redis reply as `str` when it is `bytes` (redis-py answers bytes unless told otherwise); anything
    else as it is."""
    return value.decode() if isinstance(value, bytes) else value


def stable_hex(value: str, digits: int) -> str:
    """The first `digits` hex digits of the SHA-1 of `value`: the same in every process and on every run."""
    return hashlib.sha1(value.encode()).hexdigest()[:digits]


def stable_int(value: str, digits: int) -> int:
    """`stable_hex(value, digits)` as an integer (a seed, a bucket)."""
    return int(stable_hex(value, digits), 16)
